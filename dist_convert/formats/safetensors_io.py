"""The safetensors file format, read and written without building whole-file buffers.

Headers are parsed and checked here (so a corrupt or truncated shard gets a clear error before any
rank reads it); tensor data is read with ``safe_open(...).get_slice`` (only the requested rows or
columns). A file's layout (header, each tensor's byte span) follows from its tensors' names, dtypes and
shapes alone (``file_layout``), so a writer knows it before any tensor exists: ``StreamedFile`` writes the
header first and each tensor's bytes, or a block of its rows, at their place as they arrive, in any order;
``write_file`` writes tensors it holds, front to back. Both lay a file out byte for byte alike.
"""
from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from ..datamodel import numel, row_axis
from ..durable import DurableFile
from ..errors import ConvertError
from ..layout.boxes import Box
from .distcp import PositionedFile

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
NAMES = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 << 20


def read_header(path: Path) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """name -> (dtype, shape) of every tensor in a safetensors file, after checking that the header
    parses and that every tensor's bytes lie inside the file."""
    fix = "the shard is corrupt or truncated; re-download or re-copy it"
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise ConvertError(f"{path} is not a safetensors file ({size} bytes)", fix)
        (n,) = struct.unpack("<Q", head)
        if n > min(_MAX_HEADER, size - 8):
            raise ConvertError(f"{path} has a corrupt safetensors header (declared length {n}, file {size} bytes)",
                               fix)
        try:
            header = json.loads(fh.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConvertError(f"{path} has a corrupt safetensors header ({e})", fix) from None
    if not isinstance(header, dict):
        raise ConvertError(f"{path} has a corrupt safetensors header (not a JSON object)", fix)
    data_size = size - 8 - n
    out: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = DTYPES[entry["dtype"]]
            shape = tuple(int(s) for s in entry["shape"])
            begin, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise ConvertError(f"{path}: header entry {name!r} is malformed ({e!r})", fix) from None
        if end - begin != numel(shape) * dtype.itemsize or end > data_size or begin < 0:
            raise ConvertError(f"{path}: tensor {name} claims bytes {begin}..{end} but the data section holds "
                               f"{data_size} bytes", fix)
        out[name] = (dtype, shape)
    return out


def read_boxes(path: Path, wanted: list[tuple[str, Box]]) -> list[torch.Tensor]:
    """The given boxes of tensors in one file, each read as a slice (not the whole tensor)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return [f.get_slice(key)[box.slices()] for key, box in wanted]
    except (SafetensorError, OSError, RuntimeError) as e:
        raise ConvertError(f"cannot read {path}: {e}", "the shard is corrupt; re-download or re-copy it") from None


@dataclass(frozen=True, kw_only=True)
class FileLayout:
    """Where everything lies in a safetensors file: ``header`` (its length, 8 bytes, then the JSON header padded
    with spaces so that the data starts 8-byte aligned) and each tensor's ``spans`` (name -> (dtype, shape, first
    byte in the file)) in the order the data section holds them."""

    header: bytes
    spans: dict[str, tuple[torch.dtype, tuple[int, ...], int]]
    size: int  # bytes of the whole file


def file_layout(entries: Iterable[tuple[str, torch.dtype, tuple[int, ...]]],
                metadata: dict[str, str] | None = None) -> FileLayout:
    """Pure: the layout of a file holding tensors (name, dtype, shape) in this order, their bytes back to back."""
    header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
    pos, rel = 0, {}
    for name, dtype, shape in entries:
        nbytes = numel(shape) * dtype.itemsize
        header[name] = {"dtype": NAMES[dtype], "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        rel[name] = (dtype, tuple(shape), pos)
        pos += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
    head = struct.pack("<Q", len(raw)) + raw
    return FileLayout(header=head, spans={k: (d, s, len(head) + at) for k, (d, s, at) in rel.items()},
                      size=len(head) + pos)


def _raw(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def write_file(path: Path, tensors: list[tuple[str, torch.Tensor]], metadata: dict[str, str] | None = None) -> str:
    """Write a safetensors file: header, then each tensor's bytes straight from memory; fsynced. Its SHA-256."""
    layout = file_layout(((name, t.dtype, tuple(t.shape)) for name, t in tensors), metadata)
    with DurableFile(path) as fh:
        fh.write(layout.header)
        for _, t in tensors:
            if t.numel():
                fh.write_kept(_raw(t))
        return fh.close()


class StreamedFile:
    """A safetensors file of a known layout, written as its tensors arrive: the header at once, then each tensor's
    bytes, or a block of its rows (along ``datamodel.row_axis``), at their place, in any order. It holds no tensor:
    what it gets is written (and handed to the hashing thread, durable.Digest) and let go. ``close`` fsyncs it once
    every byte was written and returns its SHA-256 (distcp.PositionedFile hashes it front to back)."""

    def __init__(self, path: Path, layout: FileLayout) -> None:
        self.path, self.layout = path, layout
        self.fh = PositionedFile(path)
        self.fh.append(layout.header)
        self.fh.reserve(layout.size - len(layout.header))

    def write(self, name: str, t: torch.Tensor, first_row: int = 0) -> None:
        """Tensor ``name`` whole, or rows ``first_row ...`` of it (a block shaped as the tensor but along its row
        axis), at their place; refused (an assertion: a planning bug) when it does not match the layout."""
        dtype, shape, at = self.layout.spans[name]
        d = row_axis(shape)
        rows = t.shape[d] if d is not None and t.dim() == len(shape) else None
        block = shape if d is None else (*shape[:d], rows, *shape[d + 1:])
        assert t.dtype == dtype and tuple(t.shape) == tuple(block) and first_row + (rows or 0) <= (
            shape[d] if d is not None else 0), f"{self.path.name}: {name} {t.dtype} {tuple(t.shape)} at row " \
            f"{first_row} does not fit {dtype} {shape}"
        if t.numel():
            self.fh.pwrite(_raw(t), at + first_row * (numel(shape[d + 1:]) if d is not None else 0) * dtype.itemsize)

    def close(self) -> str:
        return self.fh.close()
