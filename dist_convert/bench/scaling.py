"""``bench --sizes``: dist_convert at fixed world sizes (default 2 ranks) and a fixed --memory-budget over
growing synthetic checkpoints, against the I/O floor of each: is peak memory flat, is cost linear?"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..errors import ConvertError
from ..sizes import parse_size
from . import measure, report
from .run import make_source, measure_target


def parse_sizes(text: str) -> list[tuple[str, int]]:
    try:
        sizes = [(s.strip(), parse_size(s)) for s in text.split(",") if s.strip()]
    except argparse.ArgumentTypeError as e:
        raise ConvertError(f"--sizes: {e}", "pass sizes like 256MB,512MB,1GB") from None
    if len(sizes) < 2 or sorted(n for _, n in sizes) != [n for _, n in sizes] or len({n for _, n in sizes}) < 2:
        raise ConvertError(f"--sizes {text!r} needs at least two increasing sizes", "pass e.g. 256MB,512MB,1GB")
    return sizes


def run_sizes(ns: argparse.Namespace, target: tuple[int, int], work: Path) -> dict[str, Any]:
    sizes = parse_sizes(ns.sizes)
    tp, pp = target
    worlds = ns.ranks or [2]
    rows: list[dict[str, Any]] = []
    for label, size in sizes:
        src = make_source(ns, size, [target], work)
        outcomes = measure_target(src, tp, pp, worlds, ["floor", "dist_convert"], ns, work)
        floor = outcomes[0]
        for o in outcomes[1:]:
            rows.append({"size": label, "bytes": src.nbytes, "shape": src.shape, "world": o.world, "status": o.status,
                         "reason": o.reason, "floor_s": floor.wall_s, "wall_s": o.wall_s, "inproc_s": o.inproc_s,
                         "gb_per_s": src.nbytes / o.wall_s / 2**30 if o.wall_s else None,
                         "peak_rss_per_rank": o.peak_rss, "rss_limit": report.rss_limit(src.nbytes, o.world or 1),
                         "runs": [r.__dict__ for r in o.runs]})
        if not ns.keep:
            measure.remove(src.path)
    out: dict[str, Any] = {"target": {"tp": tp, "pp": pp}, "rows": rows, "verdicts": {}}
    for w in worlds:
        mine = [r for r in rows if r["world"] == w and r["status"] == "ok"]
        title = (f"{ns.format} TP={ns.src_tp} PP={ns.src_pp} -> TP={tp} PP={pp}, dist_convert at {w} ranks, "
                 f"--memory-budget {ns.memory_budget >> 20} MB, median of {ns.reps}")
        verdicts = {}
        if len(mine) == len(sizes):
            verdicts = report.sizes_verdicts([r["bytes"] for r in mine], [r["peak_rss_per_rank"] for r in mine],
                                             [r["inproc_s"] for r in mine], w)
        report.print_sizes_table(title, [r for r in rows if r["world"] == w], verdicts)
        out["verdicts"][str(w)] = verdicts
    return out
