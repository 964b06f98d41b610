"""``dist_convert plan``: what a conversion would do at a world size, without doing it (one process, no
tensors read): per rank the bytes read, written, sent and received, the waves, the predicted peak memory,
and a time estimate from storage and network speeds.

The memory model: in a wave a rank holds the chunks it reads (and the next wave's, read meanwhile when it has
a core to spare: runtime.overlap_io), the send
buffers it packs from them, the receive buffers of what other ranks send it, and the target tensors it
assembles (kept until each is complete, then written); on top, what the process itself takes (the
interpreter, torch, dist_convert and the index: measured in this process before planning).
"""
from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .convert import ReshardOptions, logical_numel, prepare, sliced
from .plan import Plan, make_plan
from .runtime import Runtime, human_bytes, overlap_io, peak_rss_bytes


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


def rank_estimates(plan: Plan, chunk_bytes: dict[int, int], tensor_bytes: dict[tuple[int, int], int],
                   base_rss: int, read_gbps: float, write_gbps: float, net_gbps: float,
                   read_ahead: bool = False) -> list[RankEstimate]:
    """Pure: per-rank figures of ``plan`` (``chunk_bytes``: stored size of each source chunk read;
    ``tensor_bytes``: size of each target tensor (file id, index); ``read_ahead``: ranks read the next
    wave while exchanging this one)."""
    world = plan.world
    sent, received = [0] * world, [0] * world
    peak = [0] * world
    missing: dict[tuple[int, int], int] = defaultdict(int)  # bytes a target tensor still waits for
    for wave in plan.waves:
        for t in wave.transfers:
            missing[(t.file, t.tensor)] += t.nbytes
    open_: list[set[tuple[int, int]]] = [set() for _ in range(world)]  # tensors being assembled, per writer
    for i, wave in enumerate(plan.waves):
        held = [0] * world
        # this wave's chunks, and with read_ahead the next wave's, which a thread reads meanwhile
        for w in plan.waves[i:i + 1 + read_ahead]:
            for rank, chunks in w.reads.items():
                held[rank] += sum(chunk_bytes[c] for c in chunks)
        for t in wave.transfers:
            if t.reader != t.writer:
                sent[t.reader] += t.nbytes
                received[t.writer] += t.nbytes
                held[t.reader] += t.nbytes  # the packed send buffer
                held[t.writer] += t.nbytes  # the receive buffer
            open_[t.writer].add((t.file, t.tensor))
            missing[(t.file, t.tensor)] -= t.nbytes
        for rank in range(world):
            held[rank] += sum(tensor_bytes[k] for k in open_[rank])
            peak[rank] = max(peak[rank], held[rank])
            open_[rank] = {k for k in open_[rank] if missing[k] > 0}  # complete ones are written and freed
    gb = 2**30
    return [RankEstimate(rank=r, read_bytes=plan.read_bytes[r], written_bytes=plan.write_bytes[r], sent_bytes=sent[r],
                         received_bytes=received[r], peak_wave_bytes=peak[r], predicted_peak_rss=base_rss + peak[r],
                         seconds=plan.read_bytes[r] / (read_gbps * gb) + plan.write_bytes[r] / (write_gbps * gb)
                         + max(sent[r], received[r]) / (net_gbps * gb))
            for r in range(world)]


def estimate(opts: ReshardOptions, rt: Runtime, world: int, read_gbps: float, write_gbps: float,
             net_gbps: float) -> dict[str, Any]:
    p = prepare(opts, rt, world)
    index = sliced(p.index, p.files, opts.memory_budget)
    base = peak_rss_bytes()  # what a rank holds before its first wave: the imports and the index
    plan = make_plan(index.chunks, p.files, world, opts.memory_budget, logical_numel(index), absent=index.absent)
    chunk_bytes = {c.id: c.nbytes for c in index.chunks}
    tensor_bytes = {(f.id, j): t.nbytes for f in p.files for j, t in enumerate(f.tensors)}
    # the run is assumed on this machine, all ranks on it (the bench's case): it reads ahead with cores to spare
    ranks = rank_estimates(plan, chunk_bytes, tensor_bytes, base, read_gbps, write_gbps, net_gbps,
                           overlap_io(world))
    return {"source": {"format": index.format, "layout": str(index.layout), "bytes": index.nbytes,
                       "chunks": len(index.chunks)},
            "target": {"format": p.dst_fmt.name, "layout": str(p.target.layout), "files": len(p.files),
                       "bytes": sum(f.nbytes for f in p.files)},
            "world": world, "waves": len(plan.waves), "memory_budget": opts.memory_budget,
            "speeds_gbps": {"read": read_gbps, "write": write_gbps, "network": net_gbps},
            "seconds": max(r.seconds for r in ranks), "ranks": [asdict(r) for r in ranks], "notes": index.notes}


def print_estimate(est: dict[str, Any], json_path: Path | None) -> None:
    from rich.console import Console
    from rich.table import Table

    s, t = est["source"], est["target"]
    table = Table(title=f"plan: {s['format']} {s['layout']} ({human_bytes(s['bytes'])}) -> {t['format']} "
                        f"{t['layout']} ({t['files']} files) on {est['world']} ranks, {est['waves']} waves; "
                        f"about {est['seconds']:.1f} s at {est['speeds_gbps']['read']:g} GB/s read")
    for col in ("rank", "read", "written", "sent", "received", "peak wave", "peak RSS", "s"):
        table.add_column(col, justify="right")
    for r in est["ranks"]:
        table.add_row(str(r["rank"]), *(human_bytes(r[k]) for k in ("read_bytes", "written_bytes", "sent_bytes",
                                                                     "received_bytes", "peak_wave_bytes",
                                                                     "predicted_peak_rss")), f"{r['seconds']:.1f}")
    Console(stderr=True).print(table)
    if json_path is not None:
        json_path.write_text(json.dumps(est, indent=1, default=str))
