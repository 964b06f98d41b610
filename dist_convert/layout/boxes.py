"""Pure slice algebra: boxes (offset + size per dim) of logical tensors and how TP shards cut them."""
from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import torch


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


def union_numel(boxes: Iterable[Box]) -> int:
    """Pure: how many elements the union of ``boxes`` holds (replicas counted once; boxes that overlap in part cut
    into slabs along the first axis, recursively; a 0-d box holds one element)."""
    unique = list(dict.fromkeys(boxes))
    if not unique:
        return 0
    if all(a.intersect(b) is None for i, a in enumerate(unique) for b in unique[i + 1:]):
        return sum(b.numel for b in unique)
    cuts = sorted({x for b in unique for x in (b.offsets[0], b.offsets[0] + b.sizes[0])})
    total = 0
    for lo, hi in zip(cuts, cuts[1:], strict=False):
        inner = [Box(b.offsets[1:], b.sizes[1:]) for b in unique
                 if b.offsets[0] <= lo and hi <= b.offsets[0] + b.sizes[0]]
        total += (hi - lo) * union_numel(inner)
    return total


class Kind(str, Enum):
    """How a logical tensor is partitioned over tensor-parallel ranks."""

    REP = "replicated"
    COL = "column"  # split dim 0
    ROW = "row"  # split dim 1
    VOCAB = "vocab"  # split dim 0 of the padded vocabulary
    GLU = "glu"  # SwiGLU fc1: [gate; up], each half split on dim 0
    PARTS = "parts"  # dim 0 is named sections (Mamba2 / Gated DeltaNet in_proj, conv1d), each split on its own


@dataclass(frozen=True, kw_only=True)
class View:
    """How a piece's logical box lies in its stored tensor when it is not a plain box of the same shape:
    logical axis ``i`` runs along stored axis ``axes[i]`` (a permutation: transposed storage), and consecutive
    elements along stored axis ``a`` lie ``steps[a]`` apart (interleaved storage: every k-th column). Stored
    axes no logical axis runs along have size 1 in the piece (a stacked layer or expert axis).

    A piece with a view holds a *strided region* of its stored tensor: its ``sbox`` is the smallest box
    covering the region (it starts at the first element; along stored axis ``a`` it spans
    ``(n - 1) * steps[a] + 1`` elements for ``n`` logical ones), and the region is ``sbox`` sliced with
    ``steps``. The covering box is what a reader reads (once); ``logical_view`` turns it into the logical
    orientation, for reading and (``write_logical``) for writing. gpt-oss ``mlp.experts.gate_up_proj``
    [E, H, 2F] (gate on the even columns, up on the odd ones, transposed) against megatron-core's fc1 [2F, H]
    of expert ``e`` (logical [gate; up])::

        v = View(axes=(2, 1), steps=(1, 1, 2))  # logical rows along stored axis 2 (step 2), columns along axis 1
        gate = Piece(fc1_e, Box((0, 0), (F, H)), Box((e, 0, 0), (1, H, 2 * F - 1)), view=v)
        up = Piece(fc1_e, Box((F, 0), (F, H)), Box((e, 0, 1), (1, H, 2 * F - 1)), view=v)
    """

    axes: tuple[int, ...]  # per logical axis: the stored axis it runs along
    steps: tuple[int, ...]  # per stored axis: the distance between consecutive elements (1: adjacent)

    def __post_init__(self) -> None:
        if len(set(self.axes)) != len(self.axes) or any(not 0 <= a < len(self.steps) for a in self.axes) \
                or any(k < 1 for k in self.steps):
            raise ValueError(f"{self}: axes must be distinct stored axes and steps at least 1")

    @staticmethod
    def plain(stored_rank: int, logical_rank: int) -> View:
        """The view of a piece without one: the logical axes are the trailing stored axes, adjacent."""
        lead = stored_rank - logical_rank
        return View(axes=tuple(range(lead, stored_rank)), steps=(1,) * stored_rank)

    def count(self, axis: int, span: int) -> int:
        """Elements of the region along stored ``axis`` in a covering box ``span`` long."""
        return (span - 1) // self.steps[axis] + 1 if span > 0 else 0


@dataclass(frozen=True)
class Piece:
    """``lbox`` of logical tensor ``logical`` is stored at ``sbox`` of a stored tensor.

    ``sbox`` may carry extra leading axes of size 1 (the layer axis of stacked torch_dist keys). With a
    ``view`` (keyword only) the logical box is stored transposed and/or strided: ``sbox`` is then the box
    covering that strided region (see ``View``); without one the boxes have the same sizes.
    """

    logical: str
    lbox: Box
    sbox: Box
    view: View | None = field(default=None, kw_only=True)
    # the stored values are the logical ones plus ``shift`` (computed in the stored dtype): a norm weight HF keeps as
    # w where megatron-core keeps w - 1 (zero-centred gamma)
    shift: float = field(default=0.0, kw_only=True)
    # the stored values are the logical ones times ``scale`` (a power of two: exact): a LoRA B whose module's scale
    # the stored adapter's one alpha states otherwise (lora/structure.py)
    scale: float = field(default=1.0, kw_only=True)

    def __post_init__(self) -> None:
        v = self.view
        if v is None:
            return
        if len(v.steps) != len(self.sbox.sizes) or len(v.axes) != len(self.lbox.sizes) \
                or logical_sizes(self.sbox, v) != self.lbox.sizes \
                or any(self.sbox.sizes[a] != 1 for a in range(len(v.steps)) if a not in v.axes):
            raise ValueError(f"{self.logical}: stored box {self.sbox} does not cover logical box {self.lbox} "
                             f"under {v} (along each stored axis (n - 1) * step + 1 elements, 1 off the view's axes)")


def mcore_global_shape(kind: Kind, logical_shape: tuple[int, ...], padded_rows: int | None) -> tuple[int, ...]:
    """Shape of megatron-core's global (unsharded) tensor: the logical one, vocab padded."""
    if kind is Kind.VOCAB:
        assert padded_rows is not None
        return (padded_rows,) + tuple(logical_shape[1:])
    return tuple(logical_shape)


def tp_chunks(kind: Kind, global_shape: tuple[int, ...], tp_rank: int, tp: int,
              sections: tuple[int, ...] = ()) -> list[Box]:
    """Boxes of the mcore-global tensor held by ``tp_rank``, in the order they are stacked on dim 0
    of that rank's local tensor (SwiGLU: the gate part, then the up part; ``Kind.PARTS``: the rank's run of
    each of ``sections``, the row counts of the tensor's sections in order)."""
    if kind is Kind.REP:
        return [Box.full(global_shape)]
    if kind is Kind.ROW:
        n = global_shape[1] // tp
        return [Box((0, tp_rank * n) + (0,) * (len(global_shape) - 2), (global_shape[0], n) + global_shape[2:])]
    rest0 = (0,) * (len(global_shape) - 1)
    if kind in (Kind.GLU, Kind.PARTS):  # fused.GLU's parts: [gate; up]; or the named sections
        if kind is Kind.GLU:
            sections = (global_shape[0] // 2,) * 2
        assert sum(sections) == global_shape[0], (sections, global_shape)
        starts = [sum(sections[:i]) for i in range(len(sections))]
        return [Box((lo,) + rest0, (n,) + global_shape[1:])
                for lo, n in part_tp_rows([[(a, n)] for a, n in zip(starts, sections, strict=True)], tp_rank, tp)]
    n = global_shape[0] // tp  # COL, VOCAB
    return [Box((tp_rank * n,) + rest0, (n,) + global_shape[1:])]


def part_tp_rows(parts: list[list[tuple[int, int]]], tp_rank: int, tp: int) -> list[tuple[int, int]]:
    """Rows (start, count) that TP rank ``tp_rank`` of ``tp`` holds of a fused tensor whose parts are split
    over TP separately (``parts``: each part's row extents, in the part's own row order): the rank's
    contiguous 1/tp of every part's own rows, in part order (SwiGLU: ``[gate_r; up_r]``). Pure; the
    ``tp_rows`` of ``layout/fused.py``'s fused tensors."""
    out = []
    for extents in parts:
        share = sum(n for _, n in extents) // tp
        lo, hi, pos = tp_rank * share, (tp_rank + 1) * share, 0
        for start, n in extents:
            a, b = max(lo, pos), min(hi, pos + n)
            if a < b:
                out.append((start + a - pos, b - a))
            pos += n
    return out


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
                 tp_rank: int, tp: int, lead: tuple[int, ...] = (),
                 sections: tuple[int, ...] = ()) -> tuple[tuple[int, ...], list[Piece]]:
    """Local shape and pieces of the tensor a TP rank holds (legacy per-rank files)."""
    chunks = tp_chunks(kind, global_shape, tp_rank, tp, sections)
    pieces: list[Piece] = []
    row = 0
    for c in chunks:
        off = (row,) + (0,) * (len(global_shape) - 1)
        pieces += chunk_pieces(logical, kind, c, logical_rows, off, lead)
        row += c.sizes[0]
    return local_shape(chunks), pieces


def piece_box(piece: Piece, inner: Box) -> Box:
    """Where ``inner`` (a sub-box of ``piece.lbox``) sits in the stored tensor of ``piece``: with a view, the
    smallest box covering its strided region (the view itself stays the piece's)."""
    v = piece.view
    if v is None:
        lead = len(piece.sbox.offsets) - len(inner.offsets)
        offs = piece.sbox.offsets[:lead] + tuple(
            s + (i - lo) for s, i, lo in zip(piece.sbox.offsets[lead:], inner.offsets, piece.lbox.offsets,
                                             strict=True))
        return Box(offs, (1,) * lead + inner.sizes)
    offs, sizes = list(piece.sbox.offsets), [1] * len(v.steps)
    for i, a in enumerate(v.axes):
        offs[a] += (inner.offsets[i] - piece.lbox.offsets[i]) * v.steps[a]
        sizes[a] = (inner.sizes[i] - 1) * v.steps[a] + 1
    return Box(tuple(offs), tuple(sizes))


def sub_piece(piece: Piece, inner: Box) -> Piece:
    """The part of ``piece`` that holds ``inner`` (a sub-box of its logical box), with the same view."""
    return Piece(piece.logical, inner, piece_box(piece, inner), view=piece.view, shift=piece.shift)


def piece_within(piece: Piece, box: Box) -> Piece | None:
    """The part of ``piece`` whose stored elements lie in ``box`` (stored coordinates): its logical box and
    the box covering those elements; None when none do. A box that cuts through a strided region keeps the
    elements on its side (the covering box of the part starts and ends on one of them)."""
    v = piece.view or View.plain(len(piece.sbox.sizes), len(piece.lbox.sizes))
    s, lo, hi = piece.sbox.offsets, box.offsets, tuple(o + n for o, n in zip(box.offsets, box.sizes, strict=True))
    if any(not lo[a] <= s[a] < hi[a] for a in range(len(s)) if a not in v.axes):
        return None
    loffs, lsizes = [], []
    for i, a in enumerate(v.axes):
        k, n = v.steps[a], piece.lbox.sizes[i]
        j0, j1 = max(0, -((s[a] - lo[a]) // k)), min(n, -((s[a] - hi[a]) // k))  # ceil((lo - s) / k), ...
        if j1 <= j0:
            return None
        loffs.append(piece.lbox.offsets[i] + j0)
        lsizes.append(j1 - j0)
    return sub_piece(piece, Box(tuple(loffs), tuple(lsizes)))


def logical_sizes(box: Box, view: View | None) -> tuple[int, ...]:
    """Sizes of the logical block a view's strided region covered by ``box`` holds, in logical axis order
    (``view`` None: the box's sizes)."""
    if view is None:
        return box.sizes
    return tuple(view.count(a, box.sizes[a]) for a in view.axes)


def strided_slices(box: Box, view: View | None) -> tuple[slice, ...]:
    """The exact elements of the strided region covered by ``box``, as slices of the stored tensor."""
    if view is None:
        return box.slices()
    return tuple(slice(o, o + n, k) for o, n, k in zip(box.offsets, box.sizes, view.steps, strict=True))


def logical_view(block: torch.Tensor, view: View) -> torch.Tensor:
    """The stored ``block`` (the data of a piece's covering box) as its logical block: the strided elements,
    permuted into logical axis order. A view of ``block`` (no copy), so it reads and, with ``copy_``, writes
    (``write_logical``)."""
    x = block[tuple(slice(None, None, k) if a in view.axes else 0 for a, k in enumerate(view.steps))]
    kept = sorted(view.axes)  # x's axes, in stored order
    return x.permute([kept.index(a) for a in view.axes])


def write_logical(block: torch.Tensor, view: View, data: torch.Tensor) -> None:
    """The inverse of ``logical_view``: ``data`` (logical orientation) written (and cast) into its strided
    places in the stored ``block``; the elements between them are left as they are."""
    logical_view(block, view).copy_(data)


class Overlap(NamedTuple):
    """An indexed box a query box intersects."""

    box: Box  # the indexed box
    inter: Box  # its intersection with the query
    value: object  # what was indexed with it


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

    def overlapping(self, box: Box) -> list[Overlap]:
        """(stored box, intersection, value) of every indexed box ``box`` intersects, in axis order."""
        if not box.offsets:
            return [Overlap(b, b, v) for b, v in self.items]
        lo, hi = box.offsets[self.axis], box.offsets[self.axis] + box.sizes[self.axis]
        out = []
        for i in range(bisect.bisect_right(self.starts, lo - self.longest), bisect.bisect_left(self.starts, hi)):
            b, v = self.items[i]
            inter = b.intersect(box)
            if inter is not None:
                out.append(Overlap(b, inter, v))
        return out


def by_logical(items: Iterable[tuple[str, Box, object]]) -> dict[str, BoxIndex]:
    """Boxes per logical tensor, indexed for overlap queries (``items``: (logical name, box, value))."""
    groups: dict[str, list[tuple[Box, object]]] = defaultdict(list)
    for name, box, value in items:
        groups[name].append((box, value))
    return {name: BoxIndex(group) for name, group in groups.items()}
