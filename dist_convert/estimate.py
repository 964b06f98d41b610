"""``dist_convert plan``: what a conversion would do at a world size, without doing it (one process, no
tensors read): per rank the bytes read, written, sent and received, the waves, the predicted peak memory,
and a time estimate from storage and network speeds.

The memory model: in a wave a rank holds the chunks it reads (and the next wave's, read meanwhile when it has
cores to spare: runtime.overlap_io), the send buffers it packs from them, the receive buffers of what other
ranks send it, and the target tensors it assembles (kept until each is complete, then written; a DCP target's
in row blocks, and a block one transfer fills is that transfer's buffer); on top, what the process itself takes
(the interpreter, torch, dist_convert and the index: measured in this process before planning). Between the
ranks of one CPU node (``shm``, the path such a job takes) the send and receive buffers are shared-memory
segments mapped for the whole job (transport.segment_sizes): the rank's own, as large as the most it sends in a
wave, and its part of each sender's, as large as the most that sender sends it in a wave, held in every wave.
"""
from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .convert import ReshardOptions, logical_numel, prepare, sliced
from .datamodel import SourceChunk, TargetTensor, numel
from .plan import (
    Plan,
    aligned,
    block_bytes,
    block_shape,
    block_spans,
    make_plan,
    row_blocks,
    staging_bytes,
    tensor_boxes,
)
from .runtime import Runtime, human_bytes, overlap_io, peak_rss_bytes
from .transport import page_aligned, segment_sizes


@dataclass(frozen=True, kw_only=True)
class RankEstimate:
    rank: int
    read_bytes: int
    written_bytes: int
    sent_bytes: int
    received_bytes: int
    peak_wave_bytes: int  # the most a wave holds at once on this rank (reads + send + receive + assembly)
    predicted_peak_rss: int  # peak_wave_bytes + the process's own footprint
    seconds: float  # read + write at the given speeds, exchange at the network speed
    staging_bytes: int = 0  # pinned host buffers an NCCL exchange holds for the whole job (plan.staging_bytes)


def rank_estimates(plan: Plan, chunks: dict[int, SourceChunk], tensors: dict[tuple[int, int], TargetTensor],
                   base_rss: int, read_gbps: float, write_gbps: float, net_gbps: float,
                   read_ahead: bool = False, block_limit: int | None = None, shm: bool = False) -> list[RankEstimate]:
    """Pure: per-rank figures of ``plan`` (``chunks``: the source chunks by id; ``tensors``: each target tensor
    by (file id, index); ``read_ahead``: ranks read the next wave while exchanging this one; ``block_limit``:
    larger target tensors are assembled in row blocks of this size, and a block one transfer fills in its dtype
    is that transfer's own buffer, as exchange.Assembly does; ``shm``: the ranks are on one node and exchange
    through shared memory, transport.Segment)."""
    world = plan.world
    sent, received = [0] * world, [0] * world
    peak = [0] * world
    segments = shm_segments(plan) if shm else [0] * world
    boxes = tensor_boxes(plan)
    blocks = {k: row_blocks(t.shape, t.dtype.itemsize, block_limit, boxes.get(k, ())) for k, t in tensors.items()}

    def block_nbytes(f: int, j: int, b: int) -> int:
        return numel(block_shape(tensors[(f, j)].shape, blocks[(f, j)], b)) * tensors[(f, j)].dtype.itemsize

    missing: dict[tuple[int, int, int], int] = defaultdict(int)  # bytes a block still waits for
    for wave in plan.waves:
        for t in wave.transfers:
            for b, _, _, nbytes in block_spans(t, blocks[(t.file, t.tensor)]):
                missing[(t.file, t.tensor, b)] += nbytes
    open_: list[set[tuple[int, int, int]]] = [set() for _ in range(world)]  # blocks being assembled, per writer
    for i, wave in enumerate(plan.waves):
        held = [0] * world
        # this wave's chunks, and with read_ahead the next wave's, which a thread reads meanwhile
        for w in plan.waves[i:i + 1 + read_ahead]:
            for rank, ids in w.reads.items():
                held[rank] += sum(chunks[c].nbytes for c in ids)
        for t in wave.transfers:
            if t.reader != t.writer:
                sent[t.reader] += t.nbytes
                received[t.writer] += t.nbytes
                if not shm:
                    held[t.reader] += t.nbytes  # the packed send buffer
                    held[t.writer] += t.nbytes  # the receive buffer
            for b, _, _, nbytes in block_spans(t, blocks[(t.file, t.tensor)]):
                key = (t.file, t.tensor, b)
                whole = block_limit is not None and key not in open_[t.writer] and nbytes == missing[key] \
                    == block_nbytes(*key) and chunks[t.chunk].dtype == t.dtype
                if not whole:  # else the transfer's own bytes are the block: nothing is allocated
                    open_[t.writer].add(key)
                missing[key] -= nbytes
        for rank in range(world):
            # blocks still waiting at the wave's end, and the largest completed in it (each is written and
            # freed the moment it completes)
            done = [block_nbytes(*k) for k in open_[rank] if missing[k] == 0]
            held[rank] += sum(block_nbytes(*k) for k in open_[rank] if missing[k] > 0) + max(done, default=0)
            peak[rank] = max(peak[rank], held[rank] + segments[rank])
            open_[rank] = {k for k in open_[rank] if missing[k] > 0}
    gb = 2**30
    return [RankEstimate(rank=r, read_bytes=plan.read_bytes[r], written_bytes=plan.write_bytes[r], sent_bytes=sent[r],
                         received_bytes=received[r], peak_wave_bytes=peak[r], predicted_peak_rss=base_rss + peak[r],
                         seconds=plan.read_bytes[r] / (read_gbps * gb) + plan.write_bytes[r] / (write_gbps * gb)
                         + max(sent[r], received[r]) / (net_gbps * gb), staging_bytes=staging_bytes(plan, r).total)
            for r in range(world)]


def shm_segments(plan: Plan) -> list[int]:
    """Pure: per rank, the shared memory it maps for the job when every rank is on one node: its own segment
    (transport.segment_sizes) and, of each peer that sends to it, the part it reads (the most that peer sends
    it in one wave, page-aligned)."""
    world = plan.world
    own = segment_sizes(plan, [0] * world)
    most: dict[tuple[int, int], int] = defaultdict(int)
    for wave in plan.waves:
        per: dict[tuple[int, int], int] = defaultdict(int)
        for t in wave.transfers:
            if t.reader != t.writer:
                per[(t.reader, t.writer)] += aligned(t.nbytes)
        for pair, n in per.items():
            most[pair] = max(most[pair], page_aligned(n))
    return [own[r] + sum(n for (_, b), n in most.items() if b == r) for r in range(world)]


def estimate(opts: ReshardOptions, rt: Runtime, world: int, read_gbps: float, write_gbps: float,
             net_gbps: float) -> dict[str, Any]:
    p = prepare(opts, rt, world)
    index = sliced(p.index, p.files, opts.memory_budget)
    base = peak_rss_bytes()  # what a rank holds before its first wave: the imports and the index
    plan = make_plan(index.chunks, p.files, world, opts.memory_budget, logical_numel(index), absent=index.absent)
    tensors = {(f.id, j): t for f in p.files for j, t in enumerate(f.tensors)}
    # the run is assumed on this machine, all ranks on it (the bench's case): it reads ahead with cores to spare
    ranks = rank_estimates(plan, {c.id: c for c in index.chunks}, tensors, base, read_gbps, write_gbps, net_gbps,
                           overlap_io(world), block_bytes(opts.memory_budget) if p.dst_fmt.row_blocks else None,
                           shm=rt.device.type != "cuda")
    return {"source": {"format": index.format, "layout": str(index.layout), "bytes": index.nbytes,
                       "stored_bytes": sum(c.stored_nbytes for c in index.chunks), "chunks": len(index.chunks)},
            "target": {"format": p.dst_fmt.name, "layout": str(p.target.layout), "files": len(p.files),
                       "bytes": sum(f.nbytes for f in p.files), "stored_bytes": sum(f.stored_nbytes for f in p.files)},
            "world": world, "waves": len(plan.waves), "memory_budget": opts.memory_budget,
            "speeds_gbps": {"read": read_gbps, "write": write_gbps, "network": net_gbps},
            "seconds": max(r.seconds for r in ranks), "ranks": [asdict(r) for r in ranks], "notes": index.notes}


def print_estimate(est: dict[str, Any], json_path: Path | None) -> None:
    from rich.console import Console
    from rich.table import Table

    s, t = est["source"], est["target"]

    def size(side: dict[str, Any]) -> str:  # a quantized side: what its files hold, then what it dequantizes to
        return human_bytes(side["bytes"]) if side["stored_bytes"] == side["bytes"] else \
            f"{human_bytes(side['stored_bytes'])} stored, {human_bytes(side['bytes'])} logical"

    table = Table(title=f"plan: {s['format']} {s['layout']} ({size(s)}) -> {t['format']} "
                        f"{t['layout']} ({t['files']} files, {size(t)}) on {est['world']} ranks, {est['waves']} waves; "
                        f"about {est['seconds']:.1f} s at {est['speeds_gbps']['read']:g} GB/s read")
    for col in ("rank", "read", "written", "sent", "received", "peak wave", "peak RSS", "pinned (nccl)", "s"):
        table.add_column(col, justify="right")
    for r in est["ranks"]:
        table.add_row(str(r["rank"]), *(human_bytes(r[k]) for k in ("read_bytes", "written_bytes", "sent_bytes",
                                                                     "received_bytes", "peak_wave_bytes",
                                                                     "predicted_peak_rss", "staging_bytes")),
                      f"{r['seconds']:.1f}")
    console = Console(stderr=True)
    console.print(table)
    for note in est["notes"]:  # what the conversion would say of the source (a model class change, ...)
        console.print(f"note: {note}", highlight=False, markup=False)
    if json_path is not None:
        json_path.write_text(json.dumps(est, indent=1, default=str))
