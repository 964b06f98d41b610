"""The safetensors file format, read and written without building whole-file buffers.

Headers are parsed and checked here (so a corrupt or truncated shard gets a clear error before any
rank reads it); tensor data is read with ``safe_open(...).get_slice`` (only the requested rows or
columns) and written straight from each tensor's memory, one ``write`` per tensor.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from ..datamodel import numel
from ..durable import DurableFile
from ..errors import ConvertError
from ..layout.boxes import Box

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


def write_file(path: Path, tensors: list[tuple[str, torch.Tensor]], metadata: dict[str, str] | None = None) -> str:
    """Write a safetensors file: header, then each tensor's bytes straight from memory; fsynced. Its SHA-256."""
    header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
    pos = 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
    with DurableFile(path) as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        for _, t in tensors:
            if t.numel():
                fh.write_kept(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))
        return fh.close()
