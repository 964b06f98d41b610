"""Plan before execute: a pure function from a source index and target files to per-rank reads,
transfers and writes, in waves that respect a memory budget. No processes, no I/O."""
from __future__ import annotations

import bisect
from collections import defaultdict, deque
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from .datamodel import SourceChunk, TargetFile, numel, row_axis
from .defaults import DEFAULT_BUDGET  # noqa: F401 - the engine's name for it
from .errors import ConvertError
from .layout.boxes import Box, Piece, View, by_logical, logical_sizes, piece_box, union_numel

ALIGN = 16  # bytes: every segment of an exchange buffer starts aligned for any dtype


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True, kw_only=True)
class Transfer:
    """One box of one logical tensor, from a source chunk to a target tensor. The payload it travels as is
    contiguous, shaped ``shape``: the destination box, or, where the target stores it with a view, the logical
    block (``src_view``: the sender applies the source's view when it packs it, so a receiver never sees it)."""

    chunk: int  # source chunk id
    src_box: Box  # box within the stored source chunk (with src_view: the box covering its strided region)
    reader: int
    file: int  # target file id
    tensor: int  # index of the tensor in the target file
    dst_box: Box  # box within the stored target tensor (with dst_view: the box covering its strided region)
    writer: int
    nbytes: int  # payload bytes in the target dtype
    dtype: torch.dtype  # target dtype
    src_view: View | None = None  # how the source chunk stores the logical block (layout.boxes.View)
    dst_view: View | None = None  # how the target tensor stores it
    add: float = 0.0  # added to the values on the way (the target piece's shift less the source piece's)
    mul: float = 1.0  # the values are multiplied by it first (the target piece's scale over the source piece's)

    @property
    def shape(self) -> tuple[int, ...]:
        """The payload's shape (C order): the destination box, or the logical block for a target view."""
        return self.dst_box.sizes if self.dst_view is None else logical_sizes(self.dst_box, self.dst_view)


@dataclass(kw_only=True)
class Wave:
    reads: dict[int, list[int]] = field(default_factory=dict)  # rank -> chunk ids
    transfers: list[Transfer] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class Plan:
    world: int
    reader_of: dict[int, int]  # chunk id -> rank
    writer_of: dict[int, int]  # target file id -> rank
    waves: list[Wave]
    read_bytes: list[int]  # per rank
    write_bytes: list[int]  # per rank
    skipped_chunks: int  # replicas not read

    def files_of(self, rank: int) -> list[int]:
        return sorted(f for f, r in self.writer_of.items() if r == rank)

    @property
    def moved_bytes(self) -> int:
        return sum(t.nbytes for w in self.waves for t in w.transfers)


BLOCK_MIN = 1 << 16  # bytes: the smallest row block (only a tensor larger than this is assembled in blocks)


def block_bytes(budget: int) -> int:
    """The row blocks a large target tensor is assembled in: an eighth of the wave budget (reads are cut to a
    quarter), at least BLOCK_MIN."""
    return max(BLOCK_MIN, budget // 8)


@dataclass(frozen=True)
class RowBlocks:
    """How a target tensor is assembled in row blocks: along ``axis`` (datamodel.row_axis), block ``b`` holding
    rows ``starts[b]`` up to the next start (the last up to ``rows``)."""

    axis: int
    starts: tuple[int, ...]
    rows: int

    def end(self, b: int) -> int:
        return self.starts[b + 1] if b + 1 < len(self.starts) else self.rows


def row_blocks(shape: tuple[int, ...], itemsize: int, limit: int | None,
               boxes: Iterable[Box] = ()) -> RowBlocks | None:
    """The row blocks a target tensor of ``shape`` is assembled in: cut where the transfers into it (their
    ``boxes``) start and end, so that a transfer of whole rows can be a block of its own, and into blocks of at
    most ``limit`` bytes (at least one row); None: it is assembled whole (no limit, no axis longer than 1, under
    BLOCK_MIN bytes, or one block would hold it)."""
    d = row_axis(shape)
    if limit is None or d is None or numel(shape) * itemsize < BLOCK_MIN:
        return None
    rows = shape[d]
    per = max(1, limit // max(1, itemsize * numel(shape[d + 1:])))
    cuts = sorted({0, *(x for b in boxes for x in (b.offsets[d], b.offsets[d] + b.sizes[d]) if 0 < x < rows)})
    starts = tuple(r for a, e in zip(cuts, [*cuts[1:], rows], strict=True) for r in range(a, e, per))
    return RowBlocks(d, starts, rows) if len(starts) > 1 else None


def tensor_boxes(plan: Plan, rank: int | None = None) -> dict[tuple[int, int], list[Box]]:
    """The box each transfer fills in its target tensor, per (file, tensor) (``rank``: only the tensors that
    rank writes)."""
    out: dict[tuple[int, int], list[Box]] = defaultdict(list)
    for w in plan.waves:
        for t in w.transfers:
            if rank is None or t.writer == rank:
                out[(t.file, t.tensor)].append(t.dst_box)
    return out


class Span(NamedTuple):
    """The part of a transfer that falls in one row block of its target tensor."""

    block: int
    lo: int  # its first row (target tensor coordinates)
    hi: int  # one past its last row
    nbytes: int


class Rows(NamedTuple):
    """How a transfer runs along one axis of its target tensor: ``count`` rows from ``start``, ``step`` apart,
    that are rows of its payload along ``axis`` (None: an axis the payload lacks; then ``count`` is 1)."""

    start: int
    step: int
    count: int
    axis: int | None


def transfer_rows(t: Transfer, d: int) -> Rows:
    """How transfer ``t`` runs along axis ``d`` of its target tensor (plain: adjacent rows, payload axis ``d``)."""
    v, box = t.dst_view, t.dst_box
    if v is None:
        return Rows(box.offsets[d], 1, box.sizes[d], d)
    if d not in v.axes:
        return Rows(box.offsets[d], 1, 1, None)
    return Rows(box.offsets[d], v.steps[d], v.count(d, box.sizes[d]), v.axes.index(d))


def block_spans(t: Transfer, blocks: RowBlocks | None) -> list[Span]:
    """Each row block that transfer ``t`` fills in its target tensor, with the rows it fills there (the first
    and one past the last, strided ones included) and their bytes (blocks None: the one block, the whole
    tensor; rows then mean nothing). A block that a strided transfer steps over is not listed."""
    if blocks is None:
        return [Span(0, 0, 0, t.nbytes)]
    r = transfer_rows(t, blocks.axis)
    hi = r.start + (r.count - 1) * r.step + 1
    out = []
    for b in range(bisect.bisect_right(blocks.starts, r.start) - 1, bisect.bisect_left(blocks.starts, hi)):
        j0 = max(0, -((r.start - blocks.starts[b]) // r.step))  # the first of its rows in the block
        j1 = min(r.count, -((r.start - blocks.end(b)) // r.step))
        if j1 > j0:
            out.append(Span(b, r.start + j0 * r.step, r.start + (j1 - 1) * r.step + 1,
                            t.nbytes * (j1 - j0) // r.count))
    return out


def block_shape(shape: tuple[int, ...], blocks: RowBlocks | None, b: int) -> tuple[int, ...]:
    """Shape of row block ``b`` of a target tensor of ``shape`` (blocks None: the whole tensor)."""
    if blocks is None:
        return shape
    d = blocks.axis
    return (*shape[:d], blocks.end(b) - blocks.starts[b], *shape[d + 1:])


def block_count(blocks: RowBlocks | None) -> int:
    return 1 if blocks is None else len(blocks.starts)


def select_source(chunks: list[SourceChunk], logical_numel: dict[str, int],
                  absent: Collection[str] = frozenset()) -> dict[int, list[Piece]]:
    """Keep one copy of every logical box (replicas are read once) and check that the kept pieces
    cover every logical tensor exactly, except the ``absent`` ones (``SourceIndex.absent``: never
    read). Returns chunk id -> kept pieces (only chunks with any)."""
    seen: set[tuple[str, Box]] = set()
    kept: dict[int, list[Piece]] = {}
    covered: dict[str, list[Box]] = defaultdict(list)
    for c in chunks:
        for p in c.pieces:
            if (p.logical, p.lbox) in seen or p.logical in absent:
                continue
            seen.add((p.logical, p.lbox))
            kept.setdefault(c.id, []).append(p)
            covered[p.logical].append(p.lbox)
    for name, count in logical_numel.items():
        if name in absent:
            continue
        boxes = covered.get(name, [])
        total = sum(b.numel for b in boxes)
        overlap = any(a.intersect(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
        if total != count or overlap:
            raise ConvertError(f"source shards of {name} {'overlap' if overlap else 'do not cover it'} "
                               f"({total} of {count} elements)",
                               "the checkpoint is incomplete or its rank files disagree; re-copy it")
    unknown = set(covered) - set(logical_numel)
    if unknown:
        raise ConvertError(f"source holds tensors the target does not: {sorted(unknown)[:3]}",
                           "the model config differs between source and target")
    return kept


def check_coverage(files: list[TargetFile], logical_numel: dict[str, int], absent: Collection[str] = frozenset(),
                   dropped: Collection[str] = frozenset()) -> None:
    """Refuse, before anything is read or written, a target that does not hold every element of every logical tensor
    of the source: a tensor a target leaves out only because its format declared it dropped (``dropped``, with a
    note) or because the source lacks it (``absent``, --allow-missing). A name-table row a format forgot is caught
    here, never written as a model without it."""
    boxes: dict[str, list[Box]] = defaultdict(list)
    for f in files:
        for t in f.tensors:
            for p in t.pieces:
                boxes[p.logical].append(p.lbox)
    short = [(name, union_numel(boxes.get(name, ())), n) for name, n in logical_numel.items()
             if name not in absent and name not in dropped]
    short = [s for s in short if s[1] < s[2]]
    if short:
        name, have, want = short[0]
        raise ConvertError(f"the target would not hold all of {len(short)} logical tensor(s) of the source, e.g. "
                           f"{name} ({have} of {want} elements): its format's name table has no place for them",
                           "a dist_convert bug in that format's tables: please report it; meanwhile convert to "
                           "--dst-format torch_dist, which holds every tensor")


def balance(sizes: dict[int, int], world: int, load: list[int] | None = None,
            prefer: dict[int, int] | None = None, home: set[int] = frozenset(), cap: float = 0.0) -> dict[int, int]:
    """Largest-first greedy balance of items over ranks; ties go to the preferred rank. Items in
    ``home`` go to their preferred rank as long as its load stays within ``cap``."""
    load = load if load is not None else [0] * world
    owner = {}
    for item in sorted(sizes, key=lambda i: (-sizes[i], i)):
        pref = (prefer or {}).get(item)
        if item in home and pref is not None and load[pref] + sizes[item] <= cap:
            best = pref
        else:
            best = min(range(world), key=lambda r: (load[r], r != pref, r))
        owner[item] = best
        load[best] += sizes[item]
    return owner


class Spot(NamedTuple):
    """Where a target piece is: target file ``file``, its tensor ``tensor``, that tensor's piece ``index``."""

    file: int
    tensor: int
    index: int
    piece: Piece


@dataclass(frozen=True, kw_only=True)
class Route:
    """A transfer before its reader is chosen: from a box of a source chunk to a box of a target tensor."""

    file: int  # target file id
    tensor: int  # index of the tensor in the file
    src_box: Box
    dst_box: Box
    src_view: View | None
    dst_view: View | None
    nbytes: int  # in the target dtype
    dtype: torch.dtype  # the target's
    add: float = 0.0
    mul: float = 1.0


def make_plan(chunks: list[SourceChunk], files: list[TargetFile], world: int, budget: int,
              logical_numel: dict[str, int], writer_of: dict[int, int] | None = None,
              absent: Collection[str] = frozenset()) -> Plan:
    """Who reads which chunk, who writes which file, and the transfers between them, in waves
    (``absent``: logical tensors the source lacks; nothing is read for them)."""
    kept = select_source(chunks, logical_numel, absent)
    by_id = {c.id: c for c in chunks}
    by_file = {f.id: f for f in files}
    writer_of = writer_of or balance({f.id: f.nbytes for f in files}, world)
    targets = by_logical((p.logical, p.lbox, Spot(f.id, j, k, p)) for f in files for j, t in enumerate(f.tensors)
                          for k, p in enumerate(t.pieces))
    # transfers per chunk (reader not yet known)
    raw: dict[int, list[Route]] = defaultdict(list)
    consumer_bytes: dict[int, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    for cid, pieces in kept.items():
        for sp in pieces:
            index = targets.get(sp.logical)
            found = index.overlapping(sp.lbox) if index is not None else []
            for o in sorted(found, key=lambda o: (o.value.file, o.value.tensor, o.value.index)):  # target order
                spot: Spot = o.value
                dtype = by_file[spot.file].tensors[spot.tensor].dtype
                nbytes = o.inter.numel * dtype.itemsize
                raw[cid].append(Route(file=spot.file, tensor=spot.tensor, src_box=piece_box(sp, o.inter),
                                      dst_box=piece_box(spot.piece, o.inter), src_view=sp.view,
                                      dst_view=spot.piece.view, nbytes=nbytes, dtype=dtype,
                                      add=spot.piece.shift - sp.shift * spot.piece.scale / sp.scale,
                                      mul=spot.piece.scale / sp.scale))
                consumer_bytes[cid][writer_of[spot.file]] += nbytes
    prefer = {cid: max(cb, key=cb.get) for cid, cb in consumer_bytes.items()}
    sizes = {cid: by_id[cid].nbytes for cid in kept if cid in raw}  # chunks no target file needs are not read
    # read each chunk where most of it is written (sliceable chunks were cut per consumer), as long as
    # no rank reads more than 15% over a fair share; the rest is balanced by size
    reader_of = balance(sizes, world, prefer=prefer, home=set(kept), cap=1.15 * sum(sizes.values()) / world)
    read_bytes = [0] * world
    for cid, r in reader_of.items():
        read_bytes[r] += by_id[cid].stored_nbytes  # what the files hold (a quantized source: its packed parts)
    write_bytes = [0] * world
    for f in files:
        write_bytes[writer_of[f.id]] += f.stored_nbytes
    waves = _waves(raw, reader_of, writer_of, by_id, world, budget)
    return Plan(world=world, reader_of=reader_of, writer_of=writer_of, waves=waves, read_bytes=read_bytes,
                write_bytes=write_bytes, skipped_chunks=len(chunks) - len(kept))


def _chunk_cost(cid: int, raw: dict[int, list[Route]], reader: int, writer_of: dict[int, int],
                by_id: dict[int, SourceChunk]) -> dict[int, int]:
    """Bytes a chunk puts in memory per rank: the reader holds it (cast) and its send buffer; each
    writer the target tensor bytes it fills and, when it is not the reader, its receive buffer."""
    cost = {reader: max(by_id[cid].nbytes, sum(x.nbytes for x in raw[cid]))}
    for x in raw[cid]:
        w = writer_of[x.file]
        cost[w] = cost.get(w, 0) + x.nbytes
        if w != reader:
            cost[reader] += aligned(x.nbytes)
            cost[w] += aligned(x.nbytes)
    return cost


def _waves(raw: dict[int, list[Route]], reader_of: dict[int, int], writer_of: dict[int, int],
           by_id: dict[int, SourceChunk], world: int, budget: int) -> list[Wave]:
    """Pack chunks into waves, first fit: per rank, bytes read + sent + received stay within the
    budget (a chunk larger than the budget alone gets a wave of its own). Chunks are taken
    round-robin over readers so that every wave keeps all ranks reading."""
    queues: dict[int, deque[int]] = defaultdict(deque)
    # in target order, so that target tensors (and files) complete early and can be written and freed
    for cid in sorted(reader_of, key=lambda c: (min(((x.file, x.tensor) for x in raw[c]), default=(-1, -1)), c)):
        queues[reader_of[cid]].append(cid)
    pending: list[int] = []
    while any(queues.values()):
        for r in range(world):
            if queues[r]:
                pending.append(queues[r].popleft())
    costs = {cid: _chunk_cost(cid, raw, reader_of[cid], writer_of, by_id) for cid in pending}
    waves: list[Wave] = []
    while pending:
        wave, used, later = Wave(), [0] * world, []
        for cid in pending:
            cost = costs[cid]
            if wave.reads and any(used[r] + c > budget for r, c in cost.items()):
                later.append(cid)
                continue
            r = reader_of[cid]
            wave.reads.setdefault(r, []).append(cid)
            for x in raw[cid]:
                wave.transfers.append(Transfer(chunk=cid, src_box=x.src_box, reader=r, file=x.file, tensor=x.tensor,
                                               dst_box=x.dst_box, writer=writer_of[x.file], nbytes=x.nbytes,
                                               dtype=x.dtype, src_view=x.src_view, dst_view=x.dst_view,
                                               add=x.add, mul=x.mul))
            for rank, c in cost.items():
                used[rank] += c
        waves.append(wave)
        pending = later
    return waves



@dataclass(frozen=True, kw_only=True)
class StagingBytes:
    """A rank's exchange staging buffers, allocated once per job at the largest wave's size and reused by
    every wave (exchange.Staging): what it packs for the collective, and (CUDA: pinned) what it receives."""

    send: int
    receive: int

    @property
    def total(self) -> int:
        return self.send + self.receive


def staging_bytes(plan: Plan, rank: int, collective: Callable[[int, int], bool] | None = None) -> StagingBytes:
    """Pure: the staging buffers of ``rank``: the most bytes (each payload aligned, as packed) it sends and
    receives over the collective in any one wave. ``collective(reader, writer)``: whether that pair's bytes go
    over it (default: every pair of different ranks; shared-memory peers do not use the staging buffers; a rank's
    own bytes only where ``collective`` says so: a one-rank transport check, transport.ExchangePath.own).

    The waves are packed with each wave's own send and receive bytes in the budget (``_chunk_cost``); buffers
    kept at the largest wave's size add at most ``total - that wave's share`` on top in other waves, reported
    beside the budget (``dist_convert plan``, docs/exchange.md) rather than repacked into it."""
    over = collective or (lambda a, b: a != b)
    send = receive = 0
    for w in plan.waves:
        s = r = 0
        for t in w.transfers:
            if (t.reader != t.writer or collective is not None) and over(t.reader, t.writer):
                s += aligned(t.nbytes) if t.reader == rank else 0
                r += aligned(t.nbytes) if t.writer == rank else 0
        send, receive = max(send, s), max(receive, r)
    return StagingBytes(send=send, receive=receive)
