"""The merge of an adapter into the base as it is written: ``W' = W + scale * B @ A`` on each target tensor's own
boxes, by the rank that writes it, before any cast.

A target tensor holding adapted weights is assembled in its source dtype (the plan casts nothing on the way), and
when a row block of it is complete the merge, in float32 (exact from bf16 / fp16), adds for each of its pieces
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
from .adapter import AdapterSpec, stored_at

WORK_DTYPE = torch.float32


class AdapterReader:
    """Rank-local reads of boxes of an adapter's tensors (float32): of each stored chunk holding a part of the box,
    exactly that part (chunks of peft's safetensors and of torch_dist items are sliceable), nothing cached."""

    def __init__(self, index: SourceIndex, read: Callable[[list[SourceChunk]], dict[int, torch.Tensor]]) -> None:
        self.read = read
        self.pieces: dict[str, list[tuple[SourceChunk, Piece]]] = {}
        for c in index.chunks:
            for p in c.pieces:
                self.pieces.setdefault(p.logical, []).append((c, p))
        self.read_bytes = 0

    def box(self, logical: str, box: Box) -> torch.Tensor:
        out = torch.zeros(box.sizes, dtype=WORK_DTYPE)
        parts = []
        for c, p in self.pieces.get(logical, ()):
            o = p.lbox.intersect(box)
            if o is None:
                continue
            lead = len(p.sbox.sizes) - len(p.lbox.sizes)
            at = Box(p.sbox.offsets[:lead] + tuple(a + b - d for a, b, d in zip(
                p.sbox.offsets[lead:], o.offsets, p.lbox.offsets, strict=True)), p.sbox.sizes[:lead] + o.sizes)
            start = c.offsets or (0,) * len(c.shape)
            parts.append((o, replace(c, id=len(parts), shape=at.sizes,
                                     offsets=tuple(a + b for a, b in zip(start, at.offsets, strict=True)))))
        got = self.read([c for _, c in parts]) if parts else {}
        for o, c in parts:
            out[o.relative_to(box).slices()] = got[c.id].reshape(o.sizes)
            self.read_bytes += c.nbytes
        return out


class Merger:
    """Which target tensors an adapter changes, what the plan moves them as, and the merge epilogue."""

    def __init__(self, spec: AdapterSpec, reader: AdapterReader) -> None:
        self.modules = spec.by_logical()
        self.reader = reader
        self.stored: dict[tuple[int, int], torch.dtype] = {}

    def touches(self, t: TargetTensor) -> bool:
        return any(p.logical in self.modules for p in t.pieces)

    def work_files(self, files: list[TargetFile], dtypes: dict[str, torch.dtype]) -> list[TargetFile]:
        """The files as the plan and the assembly see them: adapted tensors in their source dtype (``dtypes``), so
        nothing is cast before the merge (what they are written as is kept in ``stored``). Refuses adapted weights
        stored through a view (transposed, strided)."""
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
                    t = replace(t, dtype=dtypes[t.pieces[0].logical])
                tensors.append(t)
            out.append(replace(f, tensors=tensors))
        return out

    def apply(self, fid: int, j: int, t: TargetTensor, block: Box, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (the source dtype) is ``block`` of target tensor ``t``: in float32 (exact), the adapter's
        product added on each of its pieces, then cast to the stored dtype."""
        if (fid, j) not in self.stored:
            return tensor
        work = tensor.to(WORK_DTYPE)  # the assembly's own buffer: changed in place when it is float32 already
        for p in t.pieces:
            sb = p.sbox.intersect(block) if p.logical in self.modules else None
            if sb is None:
                continue
            lead = len(p.sbox.sizes) - len(p.lbox.sizes)
            lb = Box(tuple(a + b - c for a, b, c in zip(p.lbox.offsets, sb.offsets[lead:], p.sbox.offsets[lead:],
                                                        strict=True)), sb.sizes[lead:])
            self.add(p.logical, lb, work[sb.relative_to(block).slices()][(0,) * lead])
        return work.to(self.stored[(fid, j)])

    def delta(self, logical: str, box: Box) -> torch.Tensor:
        """The adapter's product on ``box`` of logical tensor ``logical`` (float32)."""
        out = torch.zeros(box.sizes, dtype=WORK_DTYPE)
        if logical in self.modules:
            self.add(logical, box, out)
        return out

    def add(self, logical: str, box: Box, out: torch.Tensor) -> None:
        """``out`` (float32, ``box.sizes``) += for each module adapting ``box`` of logical tensor ``logical``:
        scale * B[rows] @ A[:, cols] (the columns of A read once per module, the rows of B each piece needs)."""
        for m in self.modules[logical]:
            hits = [(stored_at(q, o), o) for q in m.base if q.logical == logical
                    for o in [box.intersect(q.lbox)] if o is not None]
            if not hits:
                continue
            first = min(col for (_, col), _ in hits)
            last = max(col + o.sizes[1] for (_, col), o in hits)
            a = self.reader.box(m.a, Box((0, first), (m.r, last - first)))
            for (row, col), o in hits:
                b = self.reader.box(m.b, Box((row, 0), (o.sizes[0], m.r)))
                part = a[:, col - first:col - first + o.sizes[1]]
                out[o.relative_to(box).slices()] += (b @ part).mul_(m.scale)  # peft's order: (B @ A) * scaling


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
