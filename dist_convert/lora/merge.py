"""The merge of an adapter into the base as it is written: ``W' = W + scale * B @ A`` on each target tensor's own
boxes, by the rank that writes it, before any cast.

A target tensor holding adapted weights is assembled in float32 (the plan moves its bytes as float32: the cast
from the source dtype is exact), and when a row block of it is complete the merge adds, for each of its pieces,
the adapter's product on that piece's logical box: the rows of B and the columns of A the box needs, read by this
rank from the adapter's own files (a column-parallel shard reads its rows of B and all of A, a row-parallel one
all of B and its columns of A, an HF ``q_proj`` the q rows of a fused Bridge B). Then it is cast to its stored dtype.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from ..datamodel import SourceChunk, SourceIndex, TargetFile, TargetTensor
from ..errors import ConvertError
from ..formats.base import FormatOptions, on_rank0
from ..layout.boxes import Box, Piece
from ..layout.rules import logical_tensors
from ..runtime import Runtime
from .adapter import AdapterModule, AdapterSpec

WORK_DTYPE = torch.float32


class AdapterReader:
    """Rank-local reads of boxes of an adapter's tensors (float32), each chunk read from disk at most once."""

    def __init__(self, index: SourceIndex, read: Callable[[list[SourceChunk]], dict[int, torch.Tensor]]) -> None:
        self.read = read
        self.pieces: dict[str, list[tuple[SourceChunk, Piece]]] = {}
        for c in index.chunks:
            for p in c.pieces:
                self.pieces.setdefault(p.logical, []).append((c, p))
        self.cache: dict[int, torch.Tensor] = {}
        self.read_bytes = 0

    def box(self, logical: str, box: Box) -> torch.Tensor:
        hits = [(c, p, o) for c, p in self.pieces.get(logical, ()) for o in [p.lbox.intersect(box)] if o is not None]
        todo = [c for c in {c.id: c for c, _, _ in hits}.values() if c.id not in self.cache]
        if todo:
            self.cache.update(self.read(todo))
            self.read_bytes += sum(c.nbytes for c in todo)
        out = torch.zeros(box.sizes, dtype=WORK_DTYPE)
        for c, p, o in hits:
            lead = len(p.sbox.sizes) - len(p.lbox.sizes)
            at = o.relative_to(p.lbox)
            src = self.cache[c.id][p.sbox.slices()[:lead] + Box(tuple(a + b for a, b in zip(
                p.sbox.offsets[lead:], at.offsets, strict=True)), o.sizes).slices()]
            out[o.relative_to(box).slices()] = src.reshape(o.sizes)
        return out


class Merger:
    """Which target tensors an adapter changes, their float32 working copies, and the merge epilogue."""

    def __init__(self, spec: AdapterSpec, reader: AdapterReader) -> None:
        self.modules = spec.by_logical()
        self.reader = reader
        self.stored: dict[tuple[int, int], torch.dtype] = {}

    def touches(self, t: TargetTensor) -> bool:
        return any(p.logical in self.modules for p in t.pieces)

    def work_files(self, files: list[TargetFile]) -> list[TargetFile]:
        """The files as the plan and the assembly see them: adapted tensors in float32 (what they are written
        as is kept in ``stored``). Refuses adapted weights stored through a view (transposed, strided)."""
        out = []
        for f in files:
            tensors = []
            for j, t in enumerate(f.tensors):
                if self.touches(t):
                    bad = next((p for p in t.pieces if p.logical in self.modules and (p.view or p.shift)), None)
                    if bad is not None:
                        raise ConvertError(f"{f.name}: {t.key} stores {bad.logical} transposed or interleaved, which "
                                           "the LoRA merge does not write yet", "merge into another --dst-format "
                                           "(torch_dist, hf of a family storing plain weights), then convert that")
                    self.stored[(f.id, j)] = t.dtype
                    t = replace(t, dtype=WORK_DTYPE)
                tensors.append(t)
            out.append(replace(f, tensors=tensors))
        return out

    def apply(self, fid: int, j: int, t: TargetTensor, block: Box, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (float32) is ``block`` of target tensor ``t``: add the adapter's product on each of its pieces,
        then cast to the stored dtype."""
        if (fid, j) not in self.stored:
            return tensor
        for p in t.pieces:
            if p.logical not in self.modules:
                continue
            sb = p.sbox.intersect(block)
            if sb is None:
                continue
            lead = len(p.sbox.sizes) - len(p.lbox.sizes)
            lb = Box(tuple(a + b - c for a, b, c in zip(p.lbox.offsets, sb.offsets[lead:], p.sbox.offsets[lead:],
                                                        strict=True)), sb.sizes[lead:])
            region = tensor[sb.relative_to(block).slices()]
            region += self.delta(p.logical, lb).view(region.shape)
        return tensor.to(self.stored[(fid, j)])

    def delta(self, logical: str, box: Box) -> torch.Tensor:
        """sum over the modules adapting ``box`` of logical tensor ``logical``: scale * B[rows] @ A[:, cols]."""
        out = torch.zeros(box.sizes, dtype=WORK_DTYPE)
        for m in self.modules[logical]:
            for q in m.base:
                o = box.intersect(q.lbox) if q.logical == logical else None
                if o is not None:
                    out[o.relative_to(box).slices()] += self._product(m, q, o)
        return out

    def _product(self, m: AdapterModule, q: Piece, o: Box) -> torch.Tensor:
        row = q.sbox.offsets[0] + o.offsets[0] - q.lbox.offsets[0]
        col = q.sbox.offsets[1] + o.offsets[1] - q.lbox.offsets[1]
        b = self.reader.box(m.b, Box((row, 0), (o.sizes[0], m.r)))
        a = self.reader.box(m.a, Box((0, col), (m.r, o.sizes[1])))
        return (b @ a).mul_(m.scale)  # peft's order: (B @ A) * scaling


def open_adapter(path: Path, base: SourceIndex, rt: Runtime, options: FormatOptions) -> Merger:
    """Collective: the merger of the adapter at ``path`` (an HF peft directory, named by the base's HF names, or
    a Megatron-Bridge LoRA checkpoint) into the model ``base`` indexes; refused when it adapts another model."""
    from ..formats import detect_format
    from ..formats.peft import PeftFormat

    if not path.exists():
        raise ConvertError(f"--lora {path} does not exist", "pass the adapter directory to --lora")
    fmt = detect_format(path, options)
    if isinstance(fmt, PeftFormat):
        index = on_rank0(rt, lambda: fmt.index_on(path, base))
    elif fmt.name == "bridge_lora":
        index = fmt.index(path, rt, None)
    else:
        raise ConvertError(f"--lora {path} is a {fmt.name} checkpoint, not a LoRA adapter",
                           "pass an HF peft directory (adapter_config.json) or a Megatron-Bridge LoRA PEFT checkpoint")
    logical = logical_tensors(base.cfg)
    for m in index.adapter.modules:
        for p in m.base:
            t = logical.get(p.logical)
            if t is None or any(o + n > s for o, n, s in zip(p.lbox.offsets, p.lbox.sizes, t.shape, strict=True)):
                raise ConvertError(f"--lora {path} adapts {m.name} ({p.logical} {p.lbox.sizes}), which the source "
                                   f"model {base.iter_dir} " + ("lacks" if t is None else f"has as {t.shape}"),
                                   "pass the adapter trained on this base model")
    base.notes.append(f"merging the LoRA adapter {path} ({index.adapter.kind}, {len(index.adapter.modules)} modules) "
                      "into the weights, in float32 before any cast")
    return Merger(index.adapter, AdapterReader(index, lambda cs: fmt.read(index, cs)))
