"""The end-of-run table: per rank tensors, bytes read/written/moved, times, throughput and peak memory."""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field

from rich.table import Table

from .phases import COLUMNS, cell
from .runtime import Runtime, _console, human_bytes


@dataclass(frozen=True, kw_only=True)
class RankStats:
    rank: int
    files: int
    tensors: int
    read_bytes: int
    written_bytes: int
    sent_bytes: int
    received_bytes: int
    write_s: float
    wall_s: float
    peak_rss: int
    node: str = field(default_factory=lambda: node_name())
    exchange_s: float = 0.0  # moving bytes between ranks: packing, transport, unpacking (exchange.execute)
    peak_gpu: int = 0  # the most GPU memory torch allocated on this rank (0 on CPU)
    device: str = "cpu"  # the rank's runtime device (cuda:N under --backend nccl)
    phases: dict[str, dict[str, float]] = field(default_factory=dict)  # phases.Clock.report: where the time went


def node_name() -> str:
    """The node a rank runs on: the launcher's name for it (Slurm's node name), else the host name."""
    return os.environ.get("DIST_CONVERT_NODE") or os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def throughput(s: RankStats) -> float:
    """A rank's GB/s (2**30 bytes): the bytes it read and wrote over its wall time."""
    return (s.read_bytes + s.written_bytes) / s.wall_s / 2**30 if s.wall_s > 0 else 0.0


def print_summary(rt: Runtime, stats: list[RankStats], title: str, *, warnings: list[str] | None = None) -> None:
    """Rank 0: the table, where the time went, and the run's warnings again (said at its start, which a long run's
    output has scrolled away)."""
    if rt.rank != 0:
        return
    table = Table(title=title)
    multi_node = len({s.node for s in stats}) > 1  # then a last column says where each rank ran
    for col in ("rank", "files", "tensors", "read", "written", "sent", "received", "write s", "wall s", "GB/s",
                "peak RSS"):
        table.add_column(col, justify="right")
    if multi_node:
        table.add_column("node")
    for s in stats:
        table.add_row(str(s.rank), str(s.files), str(s.tensors), human_bytes(s.read_bytes),
                      human_bytes(s.written_bytes), human_bytes(s.sent_bytes), human_bytes(s.received_bytes),
                      f"{s.write_s:.2f}", f"{s.wall_s:.2f}", f"{throughput(s):.3g}", human_bytes(s.peak_rss),
                      *([s.node] if multi_node else []))
    _console.print(table)
    if any(s.phases for s in stats):
        print_phases(stats)
    for warning in warnings or []:
        rt.log(f"[yellow]warning[/]: {warning}")


def print_phases(stats: list[RankStats]) -> None:
    """Where each rank's wall time went (phases.py): serial seconds per phase, with the seconds its read and write
    threads overlapped in parentheses."""
    table = Table(title="where the time went: serial s (+ overlapped s)")
    heads = [p for p in COLUMNS if any(cell(s.phases, p) for s in stats if s.phases)]
    for col in ("rank", *heads):
        table.add_column(col, justify="right")
    for s in stats:
        table.add_row(str(s.rank), *(cell(s.phases, p) for p in heads))
    _console.print(table)
