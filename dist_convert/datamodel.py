"""The data model every part shares, importing no format: a source is described as *chunks* (each
one readable unit: a tensor in a rank file, a DCP chunk), a target as *files* of stored tensors. Both
carry ``Piece`` lists that say which box of which logical tensor sits where, so resharding is box
intersection (plan.py). The planner, the executor and integrity work on these alone.
"""
from __future__ import annotations

import argparse
from collections.abc import Collection
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .config import ModelConfig
from .errors import ConvertError
from .layout.boxes import Piece
from .layout.topology import Layout

if TYPE_CHECKING:
    from .optim.state import OptimizerState


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def row_axis(shape: tuple[int, ...]) -> int | None:
    """The axis a tensor is cut into row blocks along: the first longer than 1 (torch_dist stacks a layer's
    tensor as [1, rows, ...]); None when there is none."""
    return next((d for d, n in enumerate(shape) if n > 1), None)


@dataclass
class SourceChunk:
    id: int
    file: str  # path relative to the iteration directory
    key: str  # name in the file / DCP key
    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: list[Piece]
    offsets: tuple[int, ...] | None = None  # DCP: chunk offset in the stored global tensor
    sliceable: bool = False  # boxes of it can be read on their own: plan.split_chunks cuts it
    contiguous_cuts: bool = False  # only boxes that are one contiguous byte run (DCP items read by offset)
    origin: tuple[int, ...] | None = None  # DCP: offsets of the stored item this chunk is (a part of)
    origin_shape: tuple[int, ...] | None = None  # DCP: that stored item's shape
    # block-scaled FP8 (hf): (file, key, block size) of the stored weight's scale grid; ``dtype`` is then
    # what the reader dequantizes to
    scale: tuple[str, str, tuple[int, int]] | None = None
    twins: tuple[tuple[str, str], ...] = ()  # (file, key) of stored copies the reader checks equal (hf: MTP's)
    flat: int | None = None  # bucket space (optimizer state): where in a stored 1-D tensor this chunk starts

    @property
    def nbytes(self) -> int:
        return numel(self.shape) * self.dtype.itemsize


@dataclass
class SourceIndex:
    format: str
    iter_dir: Path
    iteration: int | str  # "release" for release/ checkpoints
    args: argparse.Namespace
    cfg: ModelConfig
    layout: Layout
    chunks: list[SourceChunk]
    notes: list[str] = field(default_factory=list)
    absent: frozenset[str] = frozenset()  # logical tensors the source lacks, left out (--allow-missing)
    style: str | None = None  # on-disk style where a format has several (torch_dist: "0.16" | "0.19")
    optimizer: OptimizerState | None = None  # of a source read with --optimizer (None: the model only)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.chunks)


@dataclass
class TargetTensor:
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: list[Piece]
    offsets: tuple[int, ...] | None = None  # DCP: chunk offset in the global tensor
    global_shape: tuple[int, ...] | None = None

    @property
    def nbytes(self) -> int:
        return numel(self.shape) * self.dtype.itemsize


@dataclass
class TargetFile:
    id: int
    name: str  # a rank file (legacy) or a group of DCP chunks written by one rank
    tensors: list[TargetTensor]
    objects: dict[str, Any] = field(default_factory=dict)  # non-tensor entries (e.g. _extra_state)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def omit_absent(files: list[TargetFile], absent: Collection[str]) -> list[TargetFile]:
    """Pure: the target files without the tensors that hold only logical tensors the source lacks
    (``SourceIndex.absent``, from ``--allow-missing``). File ids, names and objects stay; a tensor
    without pieces (vocabulary padding only) stays. A tensor mixing absent and present logical
    tensors is refused: its absent part could only be written as zeros."""
    if not absent:
        return files
    out = []
    for f in files:
        tensors = []
        for t in f.tensors:
            gone = {p.logical for p in t.pieces if p.logical in absent}
            if gone and len(gone) < len({p.logical for p in t.pieces}):
                raise ConvertError(f"target tensor {t.key} of {f.name} holds {sorted(gone)[0]}, which the source "
                                   "lacks, together with tensors it has",
                                   "drop the --allow-missing pattern that matches it, or choose another --dst-format")
            if not gone:
                tensors.append(t)
        out.append(replace(f, tensors=tensors))
    return out


@dataclass(frozen=True)
class Target:
    cfg: ModelConfig
    layout: Layout
    dtype: torch.dtype | None  # None: keep each tensor's source dtype
    args: argparse.Namespace
    iteration: int | str
    style: str | None = None  # the source's on-disk style, kept when the format stays (torch_dist: "0.16" | "0.19")
    optimizer: OptimizerState | None = None  # to write with the model (--optimizer; None: the model only)


# Tensors megatron-core keeps in their own dtype whatever the params dtype (MoE router.expert_bias: fp32)
KEEP_DTYPE = (".mlp.router.expert_bias",)


def target_dtype(target: Target, dtypes: dict[str, torch.dtype], logical: str) -> torch.dtype:
    """The dtype a target tensor holding ``logical`` is written in: ``--dtype``'s, else the source's;
    tensors megatron-core keeps in their own dtype (and optimizer state) are never cast."""
    keep = target.dtype is None or logical.endswith(KEEP_DTYPE) or logical.startswith("optimizer.state.")
    return dtypes[logical] if keep else target.dtype


@dataclass
class WrittenFile:
    """A target file on disk, fsynced: what a writer reports when it finished one."""

    file: int  # TargetFile id
    name: str  # its path relative to the writer's directory
    record: dict[str, Any] = field(default_factory=dict)  # what ``finalize`` needs of it (JSON; journaled)
    sha256: str | None = None  # its checksum when the writer hashed it while writing (else it is read back)
