"""Cutting the work before it is planned (pure, no processes, no I/O): target files spread over the ranks that
write them (``split_files``), and source chunks cut at the boxes the targets need and into row blocks that fit a
wave (``split_chunks``), so that ``plan.make_plan`` assigns reads no larger than what one target takes."""
from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import replace

from .datamodel import SourceChunk, TargetFile
from .layout.boxes import Box, BoxIndex, View, by_logical, piece_box, piece_within
from .plan import balance


def split_files(files: list[TargetFile], world: int) -> list[TargetFile]:
    """Spread target files over ``world`` writers where the format lets any rank write any part (DCP: a file is
    just a group of chunks): with fewer files than ranks each file's tensors are split largest-first into
    ``ceil(world / len(files))`` parts of near-equal bytes; where a part would still hold well over a rank's share
    (the first expert rank's files hold every tensor but the routed experts), every file is cut into parts of about
    half a share, so that the writers balance. Objects stay with a file's first part. Otherwise the files are returned
    as they are."""
    if not files:
        return files
    share = sum(f.nbytes for f in files) / world
    even = -(-world // len(files)) if len(files) < world else 1
    lopsided = share > 0 and max(f.nbytes for f in files) / even > 1.5 * share
    if len(files) >= world and not lopsided:
        return files
    out: list[TargetFile] = []
    for f in files:
        parts = max(even, math.ceil(2 * f.nbytes / share)) if lopsided else even
        owner = balance({j: t.nbytes for j, t in enumerate(f.tensors)}, parts)
        for p in range(parts):
            tensors = [t for j, t in enumerate(f.tensors) if owner[j] == p]
            if tensors or p == 0:
                out.append(TargetFile(id=len(out), name=f"{f.name}.{p}", tensors=tensors,
                                      objects=f.objects if p == 0 else {}))
    return out


def split_chunks(chunks: list[SourceChunk], files: list[TargetFile], max_bytes: int) -> list[SourceChunk]:
    """Cut each sliceable chunk at the boundaries of the target pieces it feeds, then into row blocks
    of at most ``max_bytes``, so that a rank reads just the rows or columns one target needs and no
    read exceeds the wave budget. Chunks read by byte range (``contiguous_cuts``) are cut only where
    every part stays one contiguous run. Other chunks pass through; ids are renumbered."""
    wanted = by_logical((p.logical, p.lbox, None) for f in files for t in f.tensors for p in t.pieces)
    out: list[SourceChunk] = []
    for c in chunks:
        if not c.sliceable:
            out.append(replace(c, id=len(out)))
            continue
        cuts = [{0, n} for n in c.shape]
        for sp in c.pieces:
            index = wanted.get(sp.logical)
            for _, inter, _ in index.overlapping(sp.lbox) if index is not None else ():
                for d, (o, e) in enumerate(_extent(piece_box(sp, inter), sp.view, c.shape)):
                    cuts[d] |= {o, e}
        if c.contiguous_cuts:
            cuts = contiguous_cuts(cuts, c.shape)
        spans = [list(itertools.pairwise(sorted(s))) for s in cuts]
        # the pieces by the box covering each in the chunk: a cell of a chunk of many pieces (an HF tensor of
        # every expert) looks only at those it can hold
        every = range(len(c.pieces))
        stored = BoxIndex([(piece_box(sp, sp.lbox), i) for i, sp in enumerate(c.pieces)]) if len(every) > 8 else None
        for cell in itertools.product(*spans):
            for box in _row_blocks(Box(tuple(a for a, _ in cell), tuple(b - a for a, b in cell)),
                                   c.dtype.itemsize, max_bytes):
                near = every if stored is None else sorted(o.value for o in stored.overlapping(box))
                out.append(_sub_chunk(c, box, len(out), near))
    return out


def _extent(box: Box, view: View | None, shape: tuple[int, ...]) -> list[tuple[int, int]]:
    """Per axis, where to cut a chunk around ``box`` (a piece's covering box in it): at its ends, or, along
    an axis ``view`` strides, at the whole periods of the step it touches, so that interleaved pieces (gate
    on the even columns, up on the odd ones) share their cuts and a cell holds whole periods."""
    out = []
    for d, (o, n) in enumerate(zip(box.offsets, box.sizes, strict=True)):
        k = 1 if view is None else view.steps[d]
        lo = o - o % k
        out.append((lo, min(shape[d], lo + view.count(d, n) * k)) if k > 1 else (o, o + n))
    return out


def contiguous_cuts(cuts: list[set[int]], shape: tuple[int, ...]) -> list[set[int]]:
    """Keep the cuts of a C-ordered tensor under which every cell is one contiguous run: a dim may
    be cut only while every dim before it is cut into single rows."""
    out, single = [], True
    for s, n in zip(cuts, shape, strict=True):
        out.append(set(s) if single else {0, n})
        single = single and len(s) == n + 1
    return out


def _row_blocks(box: Box, itemsize: int, max_bytes: int) -> list[Box]:
    """Blocks of at most ``max_bytes`` along the first axis longer than 1 (contiguous parts stay contiguous)."""
    d = next((i for i, n in enumerate(box.sizes) if n > 1), None)
    if d is None:
        return [box]
    row = itemsize * (box.numel // box.sizes[d])
    if not row or row * box.sizes[d] <= max_bytes:
        return [box]
    per = max(1, max_bytes // row)
    lo, n = box.offsets[d], box.sizes[d]
    return [Box(box.offsets[:d] + (o,) + box.offsets[d + 1:],
                box.sizes[:d] + (min(per, lo + n - o),) + box.sizes[d + 1:])
            for o in range(lo, lo + n, per)]


def _sub_chunk(c: SourceChunk, box: Box, cid: int, near: Iterable[int]) -> SourceChunk:
    """The part ``box`` (chunk coordinates) of chunk ``c``, with its pieces (of ``c.pieces[i]`` for i in
    ``near``, in order: those whose covering box meets ``box``)."""
    pieces = []
    for i in near:
        part = piece_within(c.pieces[i], box)
        if part is not None:
            pieces.append(replace(part, sbox=part.sbox.relative_to(box)))
    base = c.offsets or (0,) * len(c.shape)
    return replace(c, id=cid, shape=box.sizes, pieces=pieces,
                   offsets=tuple(a + b for a, b in zip(base, box.offsets, strict=True)))
