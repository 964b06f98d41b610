"""Pure slice algebra: boxes (offset + size per dim) of logical tensors and how TP shards cut them."""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from enum import Enum


@dataclass(frozen=True)
class Box:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @staticmethod
    def full(shape: tuple[int, ...]) -> Box:
        return Box((0,) * len(shape), tuple(shape))

    @property
    def numel(self) -> int:
        n = 1
        for s in self.sizes:
            n *= s
        return n

    def intersect(self, other: Box) -> Box | None:
        offs, sizes = [], []
        for a, na, b, nb in zip(self.offsets, self.sizes, other.offsets, other.sizes, strict=True):
            lo, hi = max(a, b), min(a + na, b + nb)
            if hi <= lo:
                return None
            offs.append(lo)
            sizes.append(hi - lo)
        return Box(tuple(offs), tuple(sizes))

    def relative_to(self, outer: Box) -> Box:
        """This box in the coordinates of ``outer`` (which contains it)."""
        return Box(tuple(a - b for a, b in zip(self.offsets, outer.offsets, strict=True)), self.sizes)

    def shifted(self, delta: tuple[int, ...]) -> Box:
        return Box(tuple(a + d for a, d in zip(self.offsets, delta, strict=True)), self.sizes)

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + n) for o, n in zip(self.offsets, self.sizes, strict=True))


class Kind(str, Enum):
    """How a logical tensor is partitioned over tensor-parallel ranks."""

    REP = "replicated"
    COL = "column"  # split dim 0
    ROW = "row"  # split dim 1
    VOCAB = "vocab"  # split dim 0 of the padded vocabulary
    GLU = "glu"  # SwiGLU fc1: [gate; up], each half split on dim 0


@dataclass(frozen=True)
class Piece:
    """``lbox`` of logical tensor ``logical`` is stored at ``sbox`` of a stored tensor.

    ``sbox`` may carry extra leading axes of size 1 (the layer axis of stacked torch_dist keys).
    """

    logical: str
    lbox: Box
    sbox: Box


def mcore_global_shape(kind: Kind, logical_shape: tuple[int, ...], padded_rows: int | None) -> tuple[int, ...]:
    """Shape of megatron-core's global (unsharded) tensor: the logical one, vocab padded."""
    if kind is Kind.VOCAB:
        assert padded_rows is not None
        return (padded_rows,) + tuple(logical_shape[1:])
    return tuple(logical_shape)


def tp_chunks(kind: Kind, global_shape: tuple[int, ...], tp_rank: int, tp: int) -> list[Box]:
    """Boxes of the mcore-global tensor held by ``tp_rank``, in the order they are stacked on dim 0
    of that rank's local tensor (SwiGLU: the gate part, then the up part)."""
    if kind is Kind.REP:
        return [Box.full(global_shape)]
    if kind is Kind.ROW:
        n = global_shape[1] // tp
        return [Box((0, tp_rank * n) + (0,) * (len(global_shape) - 2), (global_shape[0], n) + global_shape[2:])]
    rest0 = (0,) * (len(global_shape) - 1)
    if kind is Kind.GLU:
        half = global_shape[0] // 2
        n = half // tp
        return [Box((tp_rank * n,) + rest0, (n,) + global_shape[1:]),
                Box((half + tp_rank * n,) + rest0, (n,) + global_shape[1:])]
    n = global_shape[0] // tp  # COL, VOCAB
    return [Box((tp_rank * n,) + rest0, (n,) + global_shape[1:])]


def local_shape(chunks: list[Box]) -> tuple[int, ...]:
    rows = sum(c.sizes[0] for c in chunks)
    return (rows,) + chunks[0].sizes[1:]


def chunk_pieces(logical: str, kind: Kind, chunk: Box, logical_rows: int, local_offset: tuple[int, ...],
                 lead: tuple[int, ...] = ()) -> list[Piece]:
    """Pieces of a stored block that holds ``chunk`` (a box of the mcore-global tensor) at
    ``local_offset``. Vocab rows at or past the true vocabulary (padding) map to nothing.
    ``lead`` are offsets of extra leading axes (size 1) in the stored tensor."""
    box = chunk
    if kind is Kind.VOCAB:
        clipped = chunk.intersect(Box((0,) * len(chunk.offsets), (logical_rows,) + chunk.sizes[1:]))
        if clipped is None:
            return []
        box = clipped
    local = box.relative_to(chunk).shifted(local_offset)
    sbox = Box(lead + local.offsets, (1,) * len(lead) + local.sizes)
    return [Piece(logical, box, sbox)]


def local_pieces(logical: str, kind: Kind, global_shape: tuple[int, ...], logical_rows: int,
                 tp_rank: int, tp: int, lead: tuple[int, ...] = ()) -> tuple[tuple[int, ...], list[Piece]]:
    """Local shape and pieces of the tensor a TP rank holds (legacy per-rank files)."""
    chunks = tp_chunks(kind, global_shape, tp_rank, tp)
    pieces: list[Piece] = []
    row = 0
    for c in chunks:
        off = (row,) + (0,) * (len(global_shape) - 1)
        pieces += chunk_pieces(logical, kind, c, logical_rows, off, lead)
        row += c.sizes[0]
    return local_shape(chunks), pieces


def piece_box(piece: Piece, inner: Box) -> Box:
    """Where ``inner`` (a sub-box of ``piece.lbox``) sits in the stored tensor of ``piece``."""
    lead = len(piece.sbox.offsets) - len(inner.offsets)
    offs = piece.sbox.offsets[:lead] + tuple(
        s + (i - lo) for s, i, lo in zip(piece.sbox.offsets[lead:], inner.offsets, piece.lbox.offsets, strict=True))
    return Box(offs, (1,) * lead + inner.sizes)


class BoxIndex:
    """Boxes of one tensor, indexed for overlap queries: sorted by their offset on the axis where the
    offsets vary most (the one they are cut along), so a query scans only the boxes that can reach it."""

    def __init__(self, items: list[tuple[Box, object]]) -> None:
        self.axis = 0
        if items:
            rank = len(items[0][0].offsets)
            self.axis = max(range(rank), key=lambda d: len({b.offsets[d] for b, _ in items})) if rank else 0
        d = self.axis
        self.items = sorted(items, key=lambda it: it[0].offsets[d] if it[0].offsets else 0)
        self.starts = [b.offsets[d] if b.offsets else 0 for b, _ in self.items]
        self.longest = max((b.sizes[d] if b.sizes else 0 for b, _ in self.items), default=0)

    def overlapping(self, box: Box) -> list[tuple[Box, Box, object]]:
        """(stored box, intersection, value) of every indexed box ``box`` intersects, in axis order."""
        if not box.offsets:
            return [(b, b, v) for b, v in self.items]
        lo, hi = box.offsets[self.axis], box.offsets[self.axis] + box.sizes[self.axis]
        out = []
        for i in range(bisect.bisect_right(self.starts, lo - self.longest), bisect.bisect_left(self.starts, hi)):
            b, v = self.items[i]
            inter = b.intersect(box)
            if inter is not None:
                out.append((b, inter, v))
        return out
