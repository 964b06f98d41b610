"""Execute a plan: read this rank's chunks wave by wave, cast on CPU, and move each wave's payloads along the
job's exchange path (transport.py): peers on the same node through shared memory, others packed into one flat
byte buffer per wave (staging buffers allocated once per job) and one ``all_to_all_single``."""
from __future__ import annotations

import dataclasses
import os
import secrets
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import torch
import torch.distributed as dist

from . import faults
from .datamodel import SourceChunk, TargetFile, TargetTensor, numel
from .errors import ConvertError
from .layout.boxes import Box, logical_view, write_logical
from .nonfinite import count_nonfinite
from .phases import phase
from .plan import (
    Plan,
    Transfer,
    aligned,
    block_count,
    block_shape,
    block_spans,
    row_blocks,
    staging_bytes,
    tensor_boxes,
    transfer_rows,
)
from .runtime import Runtime, stop_on_error
from .transport import (
    COLLECTIVES,
    ExchangePath,
    Segment,
    decide,
    launch_env,
    map_part,
    node_map,
    pair_bytes,
    remove_stale,
    segment_offsets,
    segment_path,
    segment_sizes,
    shm_need,
    shm_room,
)

ReadFn = Callable[[list[SourceChunk]], dict[int, torch.Tensor]]


Done = Callable[[int, int, "int | None", torch.Tensor], None]  # (file, tensor, first row or None: whole, data)


class Merge(Protocol):
    """What the assembly asks of a merge epilogue (``lora.merge.Merger``)."""

    stored: dict[tuple[int, int], torch.dtype]  # (file, tensor) it changes -> the dtype they are written in

    def apply(self, fid: int, j: int, t: TargetTensor, block: Box, tensor: torch.Tensor) -> torch.Tensor: ...


Block = tuple[int, int, int]  # (file id, tensor index, row block)


class Assembly:
    """This rank's target tensors. Each is allocated when first touched, zero-filled unless the plan fills all
    of it (zeros stay where nothing maps: vocabulary padding), and, when ``done`` is given, handed to it as soon
    as every byte the plan sends it has arrived, then dropped: memory holds only tensors still being assembled.

    ``block_bytes`` (with ``done``, for a writer that writes what it gets at once): a larger tensor is
    assembled in row blocks (plan.row_blocks), each handed over on its own with its first row, so memory
    holds only the blocks being filled however large a tensor is; and a block that one transfer fills whole,
    in its dtype, is handed over as the transfer's own bytes (the read or receive buffer), never copied.
    Without ``done`` every tensor is kept whole in ``tensors``; ``into`` gives preallocated ones to fill.

    ``merge`` (``lora.merge.Merger``; ``files`` are then its ``work_files``): the tensors it names in ``stored`` are
    assembled uncast in buffers of their own (never a passed-through read buffer), and each complete block goes
    through ``merge.apply`` (the adapter's product added in float32, the stored dtype cast) before it is handed
    over."""

    def __init__(self, files: list[TargetFile], plan: Plan, rank: int, done: Done | None = None,
                 into: dict[tuple[int, int], torch.Tensor] | None = None, block_bytes: int | None = None,
                 merge: Merge | None = None) -> None:
        self.specs = {(f.id, j): t for f in files for j, t in enumerate(f.tensors)}
        self.merge = merge
        self.merged = set(merge.stored) if merge is not None else set()
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
        self.done_ns = 0  # time spent in ``done`` (writing), kept out of the exchange's time

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
            t0 = time.perf_counter_ns()
            try:
                if key[:2] in self.merged:
                    shape = self._shape(key)
                    first = [0] * len(shape)
                    if blocks is not None:
                        first[blocks.axis] = blocks.starts[key[2]]
                    tensor = self.merge.apply(key[0], key[1], self.specs[key[:2]], Box(tuple(first), shape), tensor)
                self.done(key[0], key[1], None if blocks is None else blocks.starts[key[2]], tensor)
            except ConvertError as e:
                self.error = e
            finally:
                self.done_ns += time.perf_counter_ns() - t0

    def put(self, t: Transfer, src: torch.Tensor, borrowed: bool = False) -> None:
        """Transfer ``t`` arrived as ``src`` (shaped ``t.shape``: its destination box, or the logical block when
        the target stores it with a view): copied (and cast) into place, through the target's view if any, or
        handed over as it is when it is a whole block (unless ``borrowed``: ``src`` lies in a buffer the next
        wave reuses, a staging buffer)."""
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
            if (self.passthrough and not borrowed and t.dst_view is None and key not in self.blocks
                    and key[:2] not in self.merged
                    and nbytes == self.missing[key]
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
            what: str = "converting", read_ahead: bool = False, *, exchange: str = "auto",
            nonfinite: dict[str, tuple[int, int]] | None = None) -> dict[str, int]:
    """Collective. Fills this rank's target tensors in ``out``. Returns byte counters and ``exchange_ns``, the
    time spent moving bytes between ranks (packing, transport, unpacking). ``read_ahead``: the next wave's
    chunks are read in a thread while this wave is exchanged and written. ``exchange``: the ``--exchange``
    path (auto, shm, gloo, nccl; transport.decide). ``nonfinite``: NaN and infinite values of the chunks this rank
    reads are counted into it as they are read (``count_nonfinite``)."""
    stats = {"read": 0, "sent": 0, "received": 0, "copied": 0, "exchange_ns": 0}

    def mine(i: int) -> list[SourceChunk]:
        return [chunks[c] for c in plan.waves[i].reads.get(rt.rank, [])] if i < len(plan.waves) else []

    mover = Mover(plan, rt, choose_path(plan, rt, exchange)) if rt.distributed else None

    def timed_read(cs: list[SourceChunk]) -> dict[int, torch.Tensor]:
        with phase("read"):
            data = read(cs)
            if nonfinite is not None:
                count_nonfinite(cs, data, nonfinite)
            return data

    with rt.progress(plan.moved_bytes, what) as bar, ThreadPoolExecutor(1, thread_name_prefix="read") as pool:
        ahead: Future | None = pool.submit(timed_read, mine(0)) if read_ahead and plan.waves else None
        for i, wave in enumerate(plan.waves):
            faults.reached("wave", rt.rank)
            error = out.error
            data = {}
            if error is None:
                try:
                    data = ahead.result() if ahead is not None else timed_read(mine(i))
                except ConvertError as e:
                    error = e
            ahead = pool.submit(timed_read, mine(i + 1)) if read_ahead and error is None and i + 1 < len(plan.waves) \
                else None
            stop_on_error(rt, error)
            stats["read"] += sum(c.nbytes for c in mine(i))
            _run_wave(wave.transfers, data, rt, out, stats, mover, i)
            del data
            bar.advance(sum(t.nbytes for t in wave.transfers))
    stop_on_error(rt, out.error)
    return stats


def choose_path(plan: Plan, rt: Runtime, requested: str) -> ExchangePath:
    """Collective: the job's exchange path (transport.decide) from the plan, the nodes of the ranks (torchrun's
    GROUP_RANK, gathered) and, where same-node peers would use it, whether every node's /dev/shm can hold the
    largest wave. Said once on rank 0."""
    env = launch_env()
    nodes = node_map(rt.world, env.local_world_size or rt.world, rt.all_gather_object(env.group_rank))
    pairs = pair_bytes(plan)
    cuda = rt.device.type == "cuda"
    path = decide(pairs, nodes, requested, cuda)
    why = None
    if path.within == "shm":
        whys = rt.all_gather_object(shm_room(shm_need(plan, nodes), env.shm_dir))
        why = next((w for w in whys if w is not None), None)
        if why is not None:
            path = decide(pairs, nodes, requested, cuda, shm_ok=False, shm_why=why)
    rt.log(path.describe())
    return path


def payload(src: torch.Tensor, t: Transfer) -> torch.Tensor:
    """View of the transfer's box in a source chunk, shaped as its payload (``t.shape``): through the
    source's view (strided, permuted) when it has one; otherwise only size-1 axes differ. Either way it
    stays a view (but for a shifted or scaled piece's transfer, ``mul`` and ``add``); ``copy_`` then casts and
    copies in one pass."""
    block = src[t.src_box.slices()]
    out = (block if t.src_view is None else logical_view(block, t.src_view)).reshape(t.shape)
    out = out * t.mul if t.mul != 1 else out  # a scaled piece (a power of two: exact)
    return out + t.add if t.add else out  # a shifted piece (in the source dtype, before any cast)


def _fill(buf: torch.Tensor, transfers: list[Transfer], data: dict[int, torch.Tensor]) -> int:
    """Pack ``transfers`` (in order) into ``buf`` from its start, each at an aligned offset; returns the end."""
    pos = 0
    for t in sorted(transfers, key=_order):
        buf[pos:pos + t.nbytes].view(t.dtype).view(t.shape).copy_(payload(data[t.chunk], t))
        pos += aligned(t.nbytes)
    return pos


def _drain(buf: torch.Tensor, transfers: list[Transfer], out: Assembly, borrowed: bool = False) -> None:
    """Put each transfer of ``buf`` laid out by ``_fill``."""
    pos = 0
    for t in sorted(transfers, key=_order):
        out.put(t, buf[pos:pos + t.nbytes].view(t.dtype).view(t.shape), borrowed)
        pos += aligned(t.nbytes)


def pack(send: dict[int, list[Transfer]], data: dict[int, torch.Tensor], world: int,
         pin: bool = False, into: torch.Tensor | None = None) -> tuple[torch.Tensor, list[int]]:
    """The flat byte buffer this rank sends in a wave, and its bytes per destination rank: per rank in
    order, each transfer's payload (``payload``: contiguous, cast to the target dtype) at an aligned offset.
    ``into``: a staging buffer to pack into (its first bytes are returned), else a fresh one."""
    sizes = [sum(aligned(t.nbytes) for t in send.get(r, ())) for r in range(world)]
    buf = into[:sum(sizes)] if into is not None else torch.empty(sum(sizes), dtype=torch.uint8, pin_memory=pin)
    pos = 0
    for r in range(world):
        pos += _fill(buf[pos:pos + sizes[r]], send.get(r, []), data)
    return buf, sizes


def unpack(recv: dict[int, list[Transfer]], buf: torch.Tensor, world: int, out: Assembly,
           borrowed: bool = False) -> None:
    """Put each transfer of the received flat buffer (per source rank in order, as ``pack`` laid it out)."""
    pos = 0
    for r in range(world):
        _drain(buf[pos:], recv.get(r, []), out, borrowed)
        pos += sum(aligned(t.nbytes) for t in recv.get(r, ()))


def _grow(buf: torch.Tensor | None, n: int, device: torch.device, pin: bool = False) -> torch.Tensor:
    """``buf`` when it holds ``n`` bytes, else a new one of ``n`` (a staging buffer outgrown: see Mover.fall_back)."""
    if buf is not None and buf.numel() >= n:
        return buf
    return torch.empty(n, dtype=torch.uint8, device=device, pin_memory=pin and device.type == "cpu")


class Mover:
    """Moves one job's waves along its ExchangePath. Not frozen: it holds the job's buffers, each allocated once
    at the largest wave's size and reused by every wave:

    - shm: each rank's segment under /dev/shm (reserved in full: a /dev/shm too small is found here, before
      any wave, and the job falls back to the collective). Every peer that reads from it maps it once, then its
      name is removed: no file outlives the start of the first wave, whatever happens to the job later.
    - the collective's staging buffers (plan.staging_bytes): what this rank packs (pinned with NCCL) and, with
      NCCL, the device buffers and a pinned host buffer received into with a non-blocking copy. On CPU a wave
      receives into a fresh buffer: a block that one transfer fills is then handed to the writer as those
      bytes, never copied, which a reused buffer does not allow (``Assembly.put``'s ``borrowed``)."""

    def __init__(self, plan: Plan, rt: Runtime, path: ExchangePath) -> None:
        self.plan, self.rt, self.path = plan, rt, path
        self.group, self.device = None, torch.device("cpu")
        self.send = self.recv = self.dev_send = self.dev_recv = None
        self.segment: torch.Tensor | None = None  # this rank's shm segment, mapped
        self.peers: dict[int, torch.Tensor] = {}  # the segments of the peers that send to this rank, mapped
        if path.uses_shm:
            self._map_segments()
        if self.path.collective is not None:
            self._join()

    def _map_segments(self) -> None:
        """Collective: every rank reserves and maps its segment, maps its senders' ones, and the names go."""
        rt, path = self.rt, self.path
        env = launch_env()
        remove_stale(env.shm_dir)
        ids = rt.all_gather_object((secrets.token_hex(4), os.getpid()))
        token, pids, run = ids[0][0], [pid for _, pid in ids], env.run_id
        sizes = segment_sizes(self.plan, path.nodes)  # the same-node peers are the shm ones
        seg, why = None, None
        if sizes[rt.rank]:
            try:
                seg = Segment(segment_path(run, token, rt.rank, env.shm_dir), sizes[rt.rank])
            except OSError as e:
                why = f"/dev/shm could not take {sizes[rt.rank]} bytes ({e.strerror or e})"
        try:
            whys = rt.all_gather_object(why)  # every segment exists, or none is used
            why = next((w for w in whys if w is not None), None)
            if why is None:
                senders = {t.reader for w in self.plan.waves for t in w.transfers
                           if t.writer == rt.rank and path.via(t.reader, t.writer) == "shm"}
                self.peers = {r: map_part(segment_path(run, token, r, env.shm_dir, pids[r]), 0, sizes[r])
                              for r in sorted(senders)}
                rt.barrier()  # every reader holds its mapping: the names can go
                self.segment = seg.buf if seg is not None else None
        finally:
            if seg is not None:
                seg.unlink()
        if why is not None:
            coll = "nccl" if rt.device.type == "cuda" else "gloo"
            self.path = dataclasses.replace(path, within=coll, note=f"{why}: same-node peers use {coll}")
            rt.log(f"exchange: falling back: {self.path.note}")

    def _join(self) -> None:
        """The collective's group and staging buffers (collective: every rank joins)."""
        kind = self.path.collective
        if kind == "nccl" or self.rt.backend == "gloo":
            self.group = self.rt.group
        else:  # gloo asked for on an NCCL runtime
            self.group = dist.new_group(backend="gloo")
        self.device = self.rt.device if kind == "nccl" else torch.device("cpu")
        size = staging_bytes(self.plan, self.rt.rank, lambda a, b: self.path.via(a, b) in COLLECTIVES)
        cuda = self.device.type == "cuda"
        self.send = _grow(self.send, size.send, torch.device("cpu"), pin=cuda)
        if cuda:
            self.dev_send = _grow(self.dev_send, size.send, self.device)
            self.dev_recv = _grow(self.dev_recv, size.receive, self.device)
            self.recv = _grow(self.recv, size.receive, torch.device("cpu"), pin=True)

    def wave(self, i: int, transfers: list[Transfer], send: dict[int, list[Transfer]],
             recv: dict[int, list[Transfer]], data: dict[int, torch.Tensor], out: Assembly,
             stats: dict[str, int]) -> None:
        rank, path = self.rt.rank, self.path
        if any(path.via(t.reader, t.writer) in COLLECTIVES for t in transfers):
            self._collective({r: ts for r, ts in send.items() if path.via(rank, r) in COLLECTIVES},
                             {r: ts for r, ts in recv.items() if path.via(r, rank) in COLLECTIVES}, data, out, stats)
        if not any(path.via(t.reader, t.writer) == "shm" for t in transfers):
            return
        now = time.perf_counter_ns()
        offsets, _ = segment_offsets(_shm_sizes(transfers, rank, path))
        for peer, at in offsets.items():
            _fill(self.segment[at:], send[peer], data)
            stats["sent"] += sum(aligned(t.nbytes) for t in send[peer])
        now = _lap(stats, "pack_ns", now)
        self.rt.barrier()  # every segment holds this wave
        now = _lap(stats, "move_ns", now)
        for r, ts in sorted(recv.items()):
            if path.via(r, rank) == "shm":
                at = segment_offsets(_shm_sizes(transfers, r, path))[0][rank]
                _drain(self.peers[r][at:], ts, out, borrowed=True)  # the next wave packs over it
                stats["received"] += sum(aligned(t.nbytes) for t in ts)
        now = _lap(stats, "unpack_ns", now)
        self.rt.barrier()  # every peer has read this wave: the segments can take the next
        _lap(stats, "settle_ns", now)  # waiting for the peers' unpacking (and writing): not this rank's exchange

    def _collective(self, send: dict[int, list[Transfer]], recv: dict[int, list[Transfer]],
                    data: dict[int, torch.Tensor], out: Assembly, stats: dict[str, int]) -> None:
        world = self.rt.world
        in_sizes = [sum(aligned(t.nbytes) for t in send.get(r, ())) for r in range(world)]
        out_sizes = [sum(aligned(t.nbytes) for t in recv.get(r, ())) for r in range(world)]
        self.send = _grow(self.send, sum(in_sizes), torch.device("cpu"), pin=self.device.type == "cuda")
        now = time.perf_counter_ns()
        sendbuf, _ = pack(send, data, world, into=self.send)
        now = _lap(stats, "pack_ns", now)
        if self.device.type == "cuda":
            n, m = sum(in_sizes), sum(out_sizes)
            self.dev_send = _grow(self.dev_send, n, self.device)
            self.dev_recv = _grow(self.dev_recv, m, self.device)
            self.recv = _grow(self.recv, m, torch.device("cpu"), pin=True)
            self.dev_send[:n].copy_(sendbuf, non_blocking=True)
            dist.all_to_all_single(self.dev_recv[:m], self.dev_send[:n], out_sizes, in_sizes, group=self.group)
            self.recv[:m].copy_(self.dev_recv[:m], non_blocking=True)
            torch.cuda.current_stream(self.device).synchronize()
            now = _lap(stats, "move_ns", now)
            unpack(recv, self.recv[:m], world, out, borrowed=True)
        else:
            recvbuf = torch.empty(sum(out_sizes), dtype=torch.uint8)
            dist.all_to_all_single(recvbuf, sendbuf, out_sizes, in_sizes, group=self.group)
            now = _lap(stats, "move_ns", now)
            unpack(recv, recvbuf, world, out)
        _lap(stats, "unpack_ns", now)
        stats["sent"] += sum(in_sizes)
        stats["received"] += sum(out_sizes)


def _lap(stats: dict[str, int], key: str, since: int) -> int:
    """Add the nanoseconds since ``since`` to ``stats[key]`` (the exchange's phases: pack, move, unpack)."""
    now = time.perf_counter_ns()
    stats[key] = stats.get(key, 0) + now - since
    return now


def _shm_sizes(transfers: list[Transfer], sender: int, path: ExchangePath) -> dict[int, int]:
    """Bytes ``sender`` packs for each same-node peer in a wave (its segment's parts)."""
    sizes: dict[int, int] = defaultdict(int)
    for t in transfers:
        if t.reader == sender and path.via(t.reader, t.writer) == "shm":
            sizes[t.writer] += aligned(t.nbytes)
    return sizes


def _run_wave(transfers: list[Transfer], data: dict[int, torch.Tensor], rt: Runtime, out: Assembly,
              stats: dict[str, int], mover: Mover | None = None, i: int = 0) -> None:
    """One wave: the bytes that cross ranks first (every rank has just met in stop_on_error, so ``exchange_ns``
    holds the exchange, not a peer still reading or copying; nor the writes of tensors it completes), then this
    rank's own copies."""
    send: dict[int, list[Transfer]] = defaultdict(list)
    recv: dict[int, list[Transfer]] = defaultdict(list)
    own = []
    through = mover is not None and mover.path.own != "local"  # one rank checking its collective (transport.py)
    for t in transfers:
        if t.reader == rt.rank and t.writer == rt.rank and through:
            send[t.writer].append(t)
            recv[t.reader].append(t)
        elif t.reader == rt.rank and t.writer == rt.rank:
            own.append(t)
        elif t.reader == rt.rank:
            send[t.writer].append(t)
        elif t.writer == rt.rank:
            recv[t.reader].append(t)
    if mover is not None:
        t0, written, settled = time.perf_counter_ns(), out.done_ns, stats.get("settle_ns", 0)
        with phase("exchange"):
            mover.wave(i, transfers, send, recv, data, out, stats)
        stats["exchange_ns"] += (time.perf_counter_ns() - t0 - (out.done_ns - written)
                                 - (stats.get("settle_ns", 0) - settled))
    with phase("assemble"):
        for t in own:
            out.put(t, payload(data[t.chunk], t))
            stats["copied"] += t.nbytes
