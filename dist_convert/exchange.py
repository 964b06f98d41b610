"""Execute a plan: read this rank's chunks wave by wave, cast on CPU, pack the pieces for each
destination into one flat byte buffer, and move them with one ``all_to_all_single`` per wave."""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist

from . import faults
from .datamodel import SourceChunk, TargetFile
from .errors import ConvertError
from .plan import Plan, Transfer, aligned
from .runtime import Runtime

ReadFn = Callable[[list[SourceChunk]], dict[int, torch.Tensor]]


Done = Callable[[int, int, torch.Tensor], None]


class Assembly:
    """This rank's target tensors. Each is allocated zero-filled when first touched (zeros stay where
    nothing maps: vocabulary padding) and, when ``done`` is given, handed to it as soon as every byte
    the plan sends it has arrived, then dropped: memory holds only tensors still being assembled.
    Without ``done`` every tensor is kept in ``tensors``; ``into`` gives preallocated ones to fill."""

    def __init__(self, files: list[TargetFile], plan: Plan, rank: int, done: Done | None = None,
                 into: dict[tuple[int, int], torch.Tensor] | None = None) -> None:
        self.specs = {(f.id, j): t for f in files for j, t in enumerate(f.tensors)}
        self.missing: dict[tuple[int, int], int] = defaultdict(int)
        for w in plan.waves:
            for t in w.transfers:
                if t.writer == rank:
                    self.missing[(t.file, t.tensor)] += t.nbytes
        self.done = done
        self.tensors: dict[tuple[int, int], torch.Tensor] = dict(into or {})
        self.handed: set[tuple[int, int]] = set()
        self.error: ConvertError | None = None  # the first error of ``done``: the run stops at the next wave

    def _hand(self, key: tuple[int, int]) -> None:
        tensor = self.tensors.pop(key)
        self.handed.add(key)
        if self.error is None and self.done is not None:
            try:
                self.done(key[0], key[1], tensor)
            except ConvertError as e:
                self.error = e

    def view(self, t: Transfer) -> torch.Tensor:
        """Where transfer ``t`` lands."""
        key = (t.file, t.tensor)
        if key not in self.tensors:
            spec = self.specs[key]
            self.tensors[key] = torch.zeros(spec.shape, dtype=spec.dtype)
        return self.tensors[key][t.dst_box.slices()]

    def filled(self, t: Transfer) -> None:
        key = (t.file, t.tensor)
        self.missing[key] -= t.nbytes
        if self.missing[key] == 0 and self.done is not None:
            self._hand(key)

    def finish(self) -> dict[tuple[int, int], torch.Tensor]:
        """Every tensor not handed over yet (zeros where nothing touched it): handed over, or returned."""
        for key, spec in self.specs.items():
            if key not in self.handed and key not in self.tensors:
                self.tensors[key] = torch.zeros(spec.shape, dtype=spec.dtype)
        if self.done is not None:
            for key in sorted(self.tensors):
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


def _piece(src: torch.Tensor, t: Transfer, shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
    """View of the transfer's box in a source chunk, shaped as its destination (only size-1 axes
    differ, so this stays a view); ``copy_`` then casts and copies in one pass."""
    return src[t.src_box.slices()].reshape(shape)


def _run_wave(transfers: list[Transfer], data: dict[int, torch.Tensor], rt: Runtime, out: Assembly,
              stats: dict[str, int]) -> None:
    send: dict[int, list[Transfer]] = defaultdict(list)
    recv: dict[int, list[Transfer]] = defaultdict(list)
    for t in transfers:
        if t.reader == rt.rank and t.writer == rt.rank:
            dst = out.view(t)
            dst.copy_(_piece(data[t.chunk], t, dst.shape))
            out.filled(t)
            stats["copied"] += t.nbytes
        elif t.reader == rt.rank:
            send[t.writer].append(t)
        elif t.writer == rt.rank:
            recv[t.reader].append(t)
    if not rt.distributed:
        return
    in_sizes = [sum(aligned(t.nbytes) for t in send[r]) for r in range(rt.world)]
    out_sizes = [sum(aligned(t.nbytes) for t in recv[r]) for r in range(rt.world)]
    sendbuf = torch.empty(sum(in_sizes), dtype=torch.uint8, pin_memory=rt.device.type == "cuda")
    pos = 0
    for r in range(rt.world):
        for t in sorted(send[r], key=_order):
            seg = sendbuf[pos:pos + t.nbytes].view(t.dtype).view(t.src_box.sizes)
            seg.copy_(data[t.chunk][t.src_box.slices()])
            pos += aligned(t.nbytes)
    recvbuf = torch.empty(sum(out_sizes), dtype=torch.uint8, device=rt.device)
    dist.all_to_all_single(recvbuf, sendbuf.to(rt.device, non_blocking=True), out_sizes, in_sizes, group=rt.group)
    recvbuf = recvbuf.cpu()
    stats["sent"] += sum(in_sizes)
    stats["received"] += sum(out_sizes)
    pos = 0
    for r in range(rt.world):
        for t in sorted(recv[r], key=_order):
            dst = out.view(t)
            dst.copy_(recvbuf[pos:pos + t.nbytes].view(t.dtype).reshape(dst.shape))
            out.filled(t)
            pos += aligned(t.nbytes)
