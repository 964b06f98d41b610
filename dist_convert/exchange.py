"""Execute a plan: read this rank's chunks wave by wave, cast on CPU, pack the pieces for each
destination into one flat byte buffer, and move them with one ``all_to_all_single`` per wave."""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist

from . import faults
from .datamodel import SourceChunk, TargetFile, numel
from .errors import ConvertError
from .layout.boxes import logical_view, write_logical
from .plan import (
    Plan,
    Transfer,
    aligned,
    block_count,
    block_shape,
    block_spans,
    row_blocks,
    tensor_boxes,
    transfer_rows,
)
from .runtime import Runtime

ReadFn = Callable[[list[SourceChunk]], dict[int, torch.Tensor]]


Done = Callable[[int, int, "int | None", torch.Tensor], None]  # (file, tensor, first row or None: whole, data)
Block = tuple[int, int, int]  # (file id, tensor index, row block)


class Assembly:
    """This rank's target tensors. Each is allocated when first touched, zero-filled unless the plan fills all
    of it (zeros stay where nothing maps: vocabulary padding), and, when ``done`` is given, handed to it as soon
    as every byte the plan sends it has arrived, then dropped: memory holds only tensors still being assembled.

    ``block_bytes`` (with ``done``, for a writer that writes what it gets at once): a larger tensor is
    assembled in row blocks (plan.row_blocks), each handed over on its own with its first row, so memory
    holds only the blocks being filled however large a tensor is; and a block that one transfer fills whole,
    in its dtype, is handed over as the transfer's own bytes (the read or receive buffer), never copied.
    Without ``done`` every tensor is kept whole in ``tensors``; ``into`` gives preallocated ones to fill."""

    def __init__(self, files: list[TargetFile], plan: Plan, rank: int, done: Done | None = None,
                 into: dict[tuple[int, int], torch.Tensor] | None = None, block_bytes: int | None = None) -> None:
        self.specs = {(f.id, j): t for f in files for j, t in enumerate(f.tensors)}
        self.passthrough = block_bytes is not None and done is not None
        limit = block_bytes if self.passthrough else None
        boxes = tensor_boxes(plan, rank)
        self.row_blocks = {k: row_blocks(t.shape, t.dtype.itemsize, limit, boxes.get(k, ()))
                           for k, t in self.specs.items()}
        self.missing: dict[Block, int] = defaultdict(int)
        for w in plan.waves:
            for t in w.transfers:
                if t.writer == rank:
                    for b, _, _, nbytes in block_spans(t, self.row_blocks[(t.file, t.tensor)]):
                        self.missing[(t.file, t.tensor, b)] += nbytes
        self.done = done
        self.blocks: dict[Block, torch.Tensor] = {(*k, 0): v for k, v in (into or {}).items()}
        self.handed: set[Block] = set()
        self.error: ConvertError | None = None  # the first error of ``done``: the run stops at the next wave

    @property
    def tensors(self) -> dict[tuple[int, int], torch.Tensor]:
        """The whole tensors held (without ``done``: all of them once ``finish`` ran)."""
        return {(f, j): t for (f, j, _), t in self.blocks.items()}

    def _shape(self, key: Block) -> tuple[int, ...]:
        return block_shape(self.specs[key[:2]].shape, self.row_blocks[key[:2]], key[2])

    def _block(self, key: Block) -> torch.Tensor:
        """Allocated at first touch: uninitialised when the plan fills every byte of it, else zero-filled."""
        if key not in self.blocks:
            spec, shape = self.specs[key[:2]], self._shape(key)
            full = self.missing.get(key, 0) == numel(shape) * spec.dtype.itemsize
            self.blocks[key] = (torch.empty if full else torch.zeros)(shape, dtype=spec.dtype)
        return self.blocks[key]

    def _hand(self, key: Block) -> None:
        tensor = self.blocks.pop(key)
        self.handed.add(key)
        if self.error is None and self.done is not None:
            blocks = self.row_blocks[key[:2]]
            try:
                self.done(key[0], key[1], None if blocks is None else blocks.starts[key[2]], tensor)
            except ConvertError as e:
                self.error = e

    def put(self, t: Transfer, src: torch.Tensor) -> None:
        """Transfer ``t`` arrived as ``src`` (shaped ``t.shape``: its destination box, or the logical block when
        the target stores it with a view): copied (and cast) into place, through the target's view if any, or
        handed over as it is when it is a whole block."""
        blocks, box = self.row_blocks[(t.file, t.tensor)], t.dst_box
        for b, lo, hi, nbytes in block_spans(t, blocks):
            key = (t.file, t.tensor, b)
            where = box.slices()
            part = src
            if blocks is not None:  # the transfer's rows in this block, and where they go in it
                d, first = blocks.axis, blocks.starts[b]
                rows = transfer_rows(t, d)
                if rows.axis is not None:
                    part = src.narrow(rows.axis, (lo - rows.start) // rows.step, (hi - lo - 1) // rows.step + 1)
                where = (*where[:d], slice(lo - first, hi - first), *where[d + 1:])
            if (self.passthrough and t.dst_view is None and key not in self.blocks and nbytes == self.missing[key]
                    and part.dtype == self.specs[key[:2]].dtype and tuple(part.shape) == self._shape(key)
                    and part.is_contiguous()):
                self.blocks[key] = part  # the one transfer that fills this block
            elif t.dst_view is None:
                self._block(key)[where].copy_(part)
            else:
                write_logical(self._block(key)[where], t.dst_view, part)
            self.missing[key] -= nbytes
            if self.missing[key] == 0 and self.done is not None:
                self._hand(key)

    def finish(self) -> dict[tuple[int, int], torch.Tensor]:
        """Every block not handed over yet (zeros where nothing touched it): handed over, or returned."""
        for k in self.specs:
            for b in range(block_count(self.row_blocks[k])):
                if (*k, b) not in self.handed:
                    self._block((*k, b))
        if self.done is not None:
            for key in sorted(self.blocks):
                self._hand(key)
        return self.tensors


def _order(t: Transfer) -> tuple:
    return (t.file, t.tensor, t.dst_box.offsets, t.chunk)


def execute(plan: Plan, rt: Runtime, chunks: dict[int, SourceChunk], read: ReadFn, out: Assembly,
            what: str = "converting", read_ahead: bool = False) -> dict[str, int]:
    """Collective. Fills this rank's target tensors in ``out``. Returns byte counters. ``read_ahead``: the
    next wave's chunks are read in a thread while this wave is exchanged and written."""
    stats = {"read": 0, "sent": 0, "received": 0, "copied": 0}

    def mine(i: int) -> list[SourceChunk]:
        return [chunks[c] for c in plan.waves[i].reads.get(rt.rank, [])] if i < len(plan.waves) else []

    with rt.progress(plan.moved_bytes, what) as bar, ThreadPoolExecutor(1, thread_name_prefix="read") as pool:
        ahead: Future | None = pool.submit(read, mine(0)) if read_ahead and plan.waves else None
        for i, wave in enumerate(plan.waves):
            faults.reached("wave", rt.rank)
            error = out.error
            data = {}
            if error is None:
                try:
                    data = ahead.result() if ahead is not None else read(mine(i))
                except ConvertError as e:
                    error = e
            ahead = pool.submit(read, mine(i + 1)) if read_ahead and error is None and i + 1 < len(plan.waves) \
                else None
            stop_on_error(rt, error)
            stats["read"] += sum(c.nbytes for c in mine(i))
            _run_wave(wave.transfers, data, rt, out, stats)
            del data
            bar.advance(sum(t.nbytes for t in wave.transfers))
    stop_on_error(rt, out.error)
    return stats


def stop_on_error(rt: Runtime, error: ConvertError | None) -> None:
    """Collective: every rank stops when any rank has an error (that rank raises its own)."""
    if rt.all_ok(error is None):
        return
    if error is not None:
        error.local = True
        raise error
    raise ConvertError("another rank failed (see its error above)", "fix that cause and rerun")


def payload(src: torch.Tensor, t: Transfer) -> torch.Tensor:
    """View of the transfer's box in a source chunk, shaped as its payload (``t.shape``): through the
    source's view (strided, permuted) when it has one; otherwise only size-1 axes differ. Either way it
    stays a view; ``copy_`` then casts and copies in one pass."""
    block = src[t.src_box.slices()]
    return (block if t.src_view is None else logical_view(block, t.src_view)).reshape(t.shape)


def pack(send: dict[int, list[Transfer]], data: dict[int, torch.Tensor], world: int,
         pin: bool = False) -> tuple[torch.Tensor, list[int]]:
    """The flat byte buffer this rank sends in a wave, and its bytes per destination rank: per rank in
    order, each transfer's payload (``payload``: contiguous, cast to the target dtype) at an aligned offset."""
    sizes = [sum(aligned(t.nbytes) for t in send.get(r, ())) for r in range(world)]
    buf = torch.empty(sum(sizes), dtype=torch.uint8, pin_memory=pin)
    pos = 0
    for r in range(world):
        for t in sorted(send.get(r, ()), key=_order):
            buf[pos:pos + t.nbytes].view(t.dtype).view(t.shape).copy_(payload(data[t.chunk], t))
            pos += aligned(t.nbytes)
    return buf, sizes


def unpack(recv: dict[int, list[Transfer]], buf: torch.Tensor, world: int, out: Assembly) -> None:
    """Put each transfer of the received flat buffer (per source rank in order, as ``pack`` laid it out)."""
    pos = 0
    for r in range(world):
        for t in sorted(recv.get(r, ()), key=_order):
            out.put(t, buf[pos:pos + t.nbytes].view(t.dtype).view(t.shape))
            pos += aligned(t.nbytes)


def _run_wave(transfers: list[Transfer], data: dict[int, torch.Tensor], rt: Runtime, out: Assembly,
              stats: dict[str, int]) -> None:
    send: dict[int, list[Transfer]] = defaultdict(list)
    recv: dict[int, list[Transfer]] = defaultdict(list)
    for t in transfers:
        if t.reader == rt.rank and t.writer == rt.rank:
            out.put(t, payload(data[t.chunk], t))
            stats["copied"] += t.nbytes
        elif t.reader == rt.rank:
            send[t.writer].append(t)
        elif t.writer == rt.rank:
            recv[t.reader].append(t)
    if not rt.distributed:
        return
    sendbuf, in_sizes = pack(send, data, rt.world, pin=rt.device.type == "cuda")
    out_sizes = [sum(aligned(t.nbytes) for t in recv[r]) for r in range(rt.world)]
    recvbuf = torch.empty(sum(out_sizes), dtype=torch.uint8, device=rt.device)
    dist.all_to_all_single(recvbuf, sendbuf.to(rt.device, non_blocking=True), out_sizes, in_sizes, group=rt.group)
    stats["sent"] += sum(in_sizes)
    stats["received"] += sum(out_sizes)
    unpack(recv, recvbuf.cpu(), rt.world, out)
