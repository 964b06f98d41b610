"""The end-of-run table: per rank tensors, bytes read/written/moved, times and peak memory."""
from __future__ import annotations

from dataclasses import dataclass

from rich.table import Table

from .runtime import Runtime, _console, human_bytes


@dataclass
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


def print_summary(rt: Runtime, stats: list[RankStats], title: str) -> None:
    if rt.rank != 0:
        return
    table = Table(title=title)
    for col in ("rank", "files", "tensors", "read", "written", "sent", "received", "write s", "wall s", "peak RSS"):
        table.add_column(col, justify="right")
    for s in stats:
        table.add_row(str(s.rank), str(s.files), str(s.tensors), human_bytes(s.read_bytes),
                      human_bytes(s.written_bytes), human_bytes(s.sent_bytes), human_bytes(s.received_bytes),
                      f"{s.write_s:.2f}", f"{s.wall_s:.2f}", human_bytes(s.peak_rss))
    _console.print(table)
