"""Hugging Face shards written as their tensors arrive (``ShardWriter``, the hf format's ``TargetWriter``).

A shard's layout follows from the plan alone: its tensors' names, dtypes and shapes, or, with ``--quantize``, what
the scheme stores for them (``shard_entries``). So a shard's header is written when its first tensor arrives and
every tensor's bytes, or each block of its rows, at their place as they come (``safetensors_io.StreamedFile``): a
rank holds what its waves hold, never a whole shard. Tensors quantized together (a scheme's ``shares`` unit) are
gathered until the unit is complete, quantized, and written; their bytes are the unit's, not the shard's. The
files are byte for byte those ``safetensors_io.write_file`` writes from the same tensors in the same order.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..datamodel import TargetFile, TargetTensor, WrittenFile, row_axis
from .base import StreamedFiles
from .quant import Writer
from .safetensors_io import FileLayout, StreamedFile, file_layout

Entry = tuple[str, torch.dtype, tuple[int, ...]]  # a stored tensor: name, dtype, shape


def unit_key(scheme: Writer | None, t: TargetTensor) -> str:
    """The key of the tensors ``t`` is quantized together with ("\\0" + the scheme's ``shares`` key), or ``t``'s
    own name when it is stored as it is."""
    return "\0" + scheme.shares(t.key) if scheme is not None and scheme.quantizable(t.key, t.shape) else t.key


def units(tensors: list[TargetTensor], scheme: Writer | None) -> dict[str, list[int]]:
    """Pure: the tensors' indexes by unit, units in the order of their first tensor (the order a file holds them)."""
    out: dict[str, list[int]] = {}
    for j, t in enumerate(tensors):
        out.setdefault(unit_key(scheme, t), []).append(j)
    return out


def quantized_entries(scheme: Writer, tensors: list[TargetTensor]) -> list[Entry]:
    """What ``scheme.quantize_together`` stores for ``tensors`` (one unit): names, dtypes and shapes, found by
    quantizing tensors without data (the meta device: no memory, no time); a scheme whose code needs values to run
    (a finiteness check) quantizes zeros of the unit's shapes instead, once per unit."""
    try:
        with torch.device("meta"):
            out = scheme.quantize_together([(t.key, torch.empty(t.shape, dtype=t.dtype)) for t in tensors])
    except (RuntimeError, NotImplementedError):  # the scheme read a value (MXFP4's isfinite check: .item() on meta)
        out = scheme.quantize_together([(t.key, torch.zeros(t.shape, dtype=t.dtype)) for t in tensors])
    return [(name, x.dtype, tuple(x.shape)) for name, x in out]


def shard_entries(tensors: list[TargetTensor], scheme: Writer | None) -> list[Entry]:
    """Pure: what a shard of these tensors stores, in its order: each tensor as it is, or (``--quantize``) each
    unit's quantized parts where its first tensor is."""
    out: list[Entry] = []
    for key, js in units(tensors, scheme).items():
        if key.startswith("\0"):
            out += quantized_entries(scheme, [tensors[j] for j in js])
        else:
            out += [(tensors[j].key, tensors[j].dtype, tuple(tensors[j].shape)) for j in js]
    return out


@dataclass(kw_only=True)
class _Shard:
    """A shard being written: its file, the tensors still due, and the quantized units' tensors gathered so far."""

    file: StreamedFile
    left: int
    unit_of: dict[int, str]  # tensor index -> its unit (quantized tensors only)
    members: dict[str, list[int]]  # unit -> its tensors' indexes (quantized units only)
    gathered: dict[int, torch.Tensor] = field(default_factory=dict)  # complete tensors of incomplete units
    filling: dict[int, torch.Tensor] = field(default_factory=dict)  # quantized tensors arriving in row blocks


class ShardWriter(StreamedFiles[_Shard]):
    """The hf ``TargetWriter``: ``put`` (a whole tensor) and ``put_rows`` (a block of its rows, in any order) write
    at once; a shard is closed (fsynced, hashed as written) with its last tensor. ``record(file)``: what
    ``finalize`` needs of it (``WrittenFile.record``)."""

    def __init__(self, out_dir: Path, files: list[TargetFile], scheme: Writer | None,
                 record: Callable[[TargetFile], dict[str, Any]]) -> None:
        super().__init__(files)
        self.out_dir, self.scheme, self.record = out_dir, scheme, record
        self.rows_due: dict[tuple[int, int], int] = {}

    def layout(self, f: TargetFile) -> FileLayout:
        return file_layout(shard_entries(f.tensors, self.scheme))

    def _start(self, f: TargetFile) -> _Shard:
        quantized = {k: js for k, js in units(f.tensors, self.scheme).items() if k.startswith("\0")}
        return _Shard(file=StreamedFile(self.out_dir / f.name, self.layout(f)), left=len(f.tensors),
                      unit_of={j: k for k, js in quantized.items() for j in js}, members=quantized)

    def put(self, file: TargetFile, j: int, tensor: torch.Tensor) -> list[WrittenFile]:
        return self.put_rows(file, j, 0, tensor)

    def put_rows(self, file: TargetFile, j: int, first_row: int, block: torch.Tensor) -> list[WrittenFile]:
        """Rows ``first_row ...`` of tensor ``j`` along its row axis (datamodel.row_axis), or the whole tensor; the
        tensor is complete with its last row."""
        t, s = file.tensors[j], self._file(file)
        d = row_axis(t.shape)
        rows, due = (1, 1) if d is None else (block.shape[d], t.shape[d])
        if j not in s.unit_of:
            s.file.write(t.key, block, first_row)
        elif rows == due:
            s.filling[j] = block  # whole at once: kept as it is
        else:
            if j not in s.filling:
                s.filling[j] = torch.empty(t.shape, dtype=t.dtype)
            s.filling[j].narrow(d, first_row, rows).copy_(block)
        left = self.rows_due.pop((file.id, j), due) - rows
        if left:
            self.rows_due[(file.id, j)] = left
            return []
        if j in s.unit_of:
            s.gathered[j] = s.filling.pop(j)
            self._quantize(file, s, s.unit_of[j])
        s.left -= 1
        return [] if s.left else [self._close(file)]

    def _quantize(self, f: TargetFile, s: _Shard, unit: str) -> None:
        """Once every tensor of ``unit`` is complete: its quantized parts written, its tensors let go."""
        js = s.members[unit]
        if any(j not in s.gathered for j in js):
            return
        for name, x in self.scheme.quantize_together([(f.tensors[j].key, s.gathered.pop(j)) for j in js]):
            s.file.write(name, x)

    def _finish(self, f: TargetFile, s: _Shard) -> WrittenFile:
        return WrittenFile(file=f.id, name=f.name, record=self.record(f), sha256=s.file.close())
