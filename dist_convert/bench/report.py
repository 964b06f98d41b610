"""The performance targets as pure functions, and the bench's tables (with Megatron-Bridge / dist_convert ratios when
the bridge method ran), JSON and plot.

Targets (issues 22 and 48), at 2 ranks where a ratio needs a second method: the time beyond start-up (wall less a
launch that converts nothing) <= 1.3x the I/O floor and the in-process time <= 1.5x; wall <= 0.6x the whole-model
path's and <= 0.4x megatron-core's load + save; a 2-rank launch that converts nothing <= 2.5 s and ``dist_convert
--help`` <= 1 s; at every world size peak RSS per rank <= 1.2 x (checkpoint bytes / world size) + 300 MB and plan's
prediction of it within 20%; over ``--sizes``, memory flat (slope <= 0.05) and cost linear."""
from __future__ import annotations

import importlib.util
from typing import Any

from rich.console import Console
from rich.table import Table

from ..errors import ConvertError
from ..phases import COLUMNS, cell
from ..runtime import _console, human_bytes
from .measure import Outcome

TARGET_WORLD = 2  # the world size the ratio targets are stated at
FLOOR_FACTOR = 1.3  # time beyond start-up <= 1.3x the I/O floor
INPROC_FACTOR = 1.5  # the slowest rank's in-process time <= 1.5x the I/O floor
WHOLE_FACTOR = 0.6  # wall <= 0.6x the whole-model single-process path's wall
MCORE_FACTOR = 0.4  # wall <= 0.4x megatron-core's load + save
LAUNCH_S = 2.5  # a TARGET_WORLD-rank launch that converts nothing
HELP_S = 1.0  # dist_convert --help
PLAN_TOLERANCE = 0.2  # `dist_convert plan`'s predicted peak RSS within this fraction of the measured one
RSS_FACTOR = 1.2
RSS_BASE = 300 << 20  # a process with torch imported
FLAT_SLOPE = 0.05  # memory flat: RSS grows by <= 5% of the growth of a rank's share of the checkpoint
LINEAR_SLACK = 1.2  # cost linear: seconds per byte at the largest size <= 1.2x that at the smallest
CHECKS = {"floor": f"net≤{FLOOR_FACTOR}x floor", "inproc": f"in-proc≤{INPROC_FACTOR}x floor",
          "whole": f"≤{WHOLE_FACTOR}x whole", "mcore": f"≤{MCORE_FACTOR}x mcore",
          "launch": f"launch≤{LAUNCH_S}s, help≤{HELP_S:g}s", "rss": "RSS≤limit", "plan": f"plan ±{PLAN_TOLERANCE:.0%}"}


def rss_limit(nbytes: int, world: int) -> int:
    return int(RSS_FACTOR * nbytes / world + RSS_BASE)


def within_floor(net_s: float, floor_s: float) -> bool:
    return net_s <= FLOOR_FACTOR * floor_s


def at_most(wall_s: float, baseline_s: float, factor: float) -> bool:
    return wall_s <= factor * baseline_s


def rss_ok(peak_rss: int, nbytes: int, world: int) -> bool:
    return peak_rss <= rss_limit(nbytes, world)


def memory_slope(nbytes: list[int], rss: list[int], world: int) -> float:
    """Growth of peak RSS per byte of growth of a rank's share, smallest to largest checkpoint."""
    grow = (nbytes[-1] - nbytes[0]) / world
    return (rss[-1] - rss[0]) / grow if grow else 0.0


def memory_flat(nbytes: list[int], rss: list[int], world: int) -> bool:
    return memory_slope(nbytes, rss, world) <= FLAT_SLOPE


def cost_ratio(nbytes: list[int], seconds: list[float]) -> float:
    """Seconds per byte at the largest size over seconds per byte at the smallest (1: linear)."""
    return (seconds[-1] / nbytes[-1]) / (seconds[0] / nbytes[0])


def cost_linear(nbytes: list[int], seconds: list[float]) -> bool:
    return cost_ratio(nbytes, seconds) <= LINEAR_SLACK


def _verdict(ok: bool | None) -> str | None:
    return None if ok is None else ("PASS" if ok else "FAIL")


def _ratio_check(wall: float | None, base: Outcome | None, factor: float) -> str | None:
    return _verdict(at_most(wall, base.wall_s, factor)) if wall is not None and base and base.wall_s else None


def row(o: Outcome, nbytes: int, others: dict[str, Outcome], startup: Outcome | None = None) -> dict[str, Any]:
    """One method's numbers, ratios and target checks (None where a number or check does not apply).
    ``others``: the floor, whole_model and mcore outcomes of the same target (the ones that ran). ``net_s``
    is a dist_convert run's wall time less the start-up of a launch at the same world size."""
    wall, inproc, rss = o.wall_s, o.inproc_s, o.peak_rss
    floor = others.get("floor")
    floor_s = floor.wall_s if floor else None
    net = wall - startup.wall_s if o.method == "dist_convert" and wall and startup and startup.wall_s else None
    checks: dict[str, str | None] = dict.fromkeys(CHECKS)
    if o.method == "dist_convert" and o.world == TARGET_WORLD:
        checks["floor"] = _verdict(within_floor(net, floor_s)) if net is not None and floor_s else None
        checks["inproc"] = _verdict(at_most(inproc, floor_s, INPROC_FACTOR)) if inproc and floor_s else None
        checks["whole"] = _ratio_check(wall, others.get("whole_model"), WHOLE_FACTOR)
        checks["mcore"] = _ratio_check(wall, others.get("mcore"), MCORE_FACTOR)
    if wall is not None and (o.method == "help" or (o.method == "startup" and o.world == TARGET_WORLD)):
        checks["launch"] = _verdict(wall <= (HELP_S if o.method == "help" else LAUNCH_S))
    if rss is not None and o.world and o.method in ("dist_convert", "optimizer", "lora"):
        checks["rss"] = _verdict(rss_ok(rss, nbytes, o.world))
    if rss is not None and o.predicted_rss:
        checks["plan"] = _verdict(abs(rss - o.predicted_rss) <= PLAN_TOLERANCE * rss)
    return {"method": o.method, "label": o.label, "world": o.world, "status": o.status, "reason": o.reason,
            "wall_s": wall, "inproc_s": inproc,
            "gb_per_s": nbytes / wall / 2**30 if wall else None,  # GB = 2**30 bytes, as human_bytes prints
            "x_floor": wall / floor_s if wall and floor_s else None,
            "inproc_x_floor": inproc / floor_s if inproc and floor_s else None,
            "net_s": net, "net_x_floor": net / floor_s if net and floor_s else None,
            "peak_rss_per_rank": rss, "rss_limit": rss_limit(nbytes, o.world) if o.world and rss else None,
            "predicted_rss": o.predicted_rss,
            "checks": checks, "runs": [r.__dict__ for r in o.runs], "output": o.output, "agreement": o.agreement}


def target_rows(outcomes: list[Outcome], nbytes: int) -> list[dict[str, Any]]:
    others = {o.method: o for o in outcomes if o.method in ("floor", "whole_model", "mcore") and o.runs}
    startup = {o.world: o for o in outcomes if o.method == "startup" and o.runs}
    return [row(o, nbytes, others, startup.get(o.world)) for o in outcomes]


def exchange_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Pure: per ``--methods exchange`` run that moved bytes, the median of its runs' exchange seconds (the slowest
    rank's) and the bytes that crossed ranks over them (GB = 2**30 bytes)."""
    out = []
    for r in rows:
        runs = [x["detail"] for x in r["runs"] if x["detail"].get("exchanged_bytes")]
        if not r["method"].startswith("exchange_") or r["status"] != "ok" or not runs:
            continue
        secs = sorted(d["exchange_s"] for d in runs)
        median, nbytes = secs[len(secs) // 2], runs[0]["exchanged_bytes"]
        out.append({"label": r["label"], "world": r["world"], "exchange_s": median, "bytes": nbytes,
                    "gb_per_s": nbytes / median / 2**30 if median else None, "wall_s": r["wall_s"]})
    return out


def phase_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Pure: per dist_convert row, the phases of its median run (by wall time): the slowest rank's serial seconds
    per phase (``wait`` included) and the seconds its threads overlapped with them (phases.py)."""
    out = []
    for r in rows:
        runs = sorted((x for x in r["runs"] if x["detail"].get("phases")), key=lambda x: x["wall_s"])
        if r["method"] != "dist_convert" or r["status"] != "ok" or not runs:
            continue
        median = runs[len(runs) // 2]
        out.append({"label": r["label"], "world": r["world"], "wall_s": median["wall_s"],
                    "inproc_s": median["inproc_s"], **median["detail"]["phases"]})
    return out


def _phase_cells(r: dict[str, Any]) -> list[str]:
    return [r["label"], _num(r["inproc_s"]), *(cell(r, p) for p in COLUMNS)]


def print_phases(rows: list[dict[str, Any]]) -> None:
    """Where the median run's time went: serial seconds (+ seconds overlapped on the read, write and hashing
    threads)."""
    if not rows:
        return
    table = Table(title="phases of the median run, slowest rank: serial s (+ overlapped s)")
    for col in ("method", "in-proc s", *COLUMNS):
        table.add_column(col, justify="left" if col == "method" else "right", no_wrap=col == "method")
    for r in rows:
        table.add_row(*_phase_cells(r))
    (_console if _console.is_terminal else Console(stderr=True, highlight=False, width=220)).print(table)


def print_exchange(rows: list[dict[str, Any]]) -> None:
    for r in rows:
        _console.print(f"  {r['label']}: {human_bytes(r['bytes'])} across ranks in {r['exchange_s']:.2f} s exchange "
                       f"({_num(r['gb_per_s'], '{:.3g}')} GB/s), wall {_num(r['wall_s'])} s")


def tally(rows: list[dict[str, Any]]) -> dict[str, int]:
    """How many target checks passed and failed."""
    verdicts = [v for r in rows for v in r["checks"].values() if v]
    return {"PASS": verdicts.count("PASS"), "FAIL": verdicts.count("FAIL")}


def _num(v: float | None, fmt: str = "{:.2f}") -> str:
    return "" if v is None else fmt.format(v)


def _cells(r: dict[str, Any]) -> list[str]:
    return [r["label"], _num(r["wall_s"]), _num(r["inproc_s"]), _num(r["gb_per_s"], "{:.3g}"), _num(r["x_floor"]),
            _num(r["net_x_floor"]), human_bytes(r["peak_rss_per_rank"]) if r["peak_rss_per_rank"] is not None else "",
            human_bytes(r["rss_limit"]) if r["rss_limit"] is not None else "",
            human_bytes(r["predicted_rss"]) if r.get("predicted_rss") else ""]


HEAD = ("method", "wall s", "in-proc s", "GB/s", "wall/floor", "net/floor", "RSS/rank", "RSS limit", "plan's RSS",
        *CHECKS.values())


def print_table(title: str, rows: list[dict[str, Any]]) -> None:
    table = Table(title=title)
    for col in HEAD:
        table.add_column(col, justify="left" if col == "method" else "right", no_wrap=col == "method")
    notes = []
    for r in rows:
        if r["status"] != "ok":
            table.add_row(r["label"], r["status"])
            notes.append(f"{r['label']}: {r['status']}: {r['reason']}")
            continue
        table.add_row(*_cells(r), *(_color(r["checks"][k]) for k in CHECKS))
    # a log or a pipe gets the whole table unwrapped; a terminal, its own width
    (_console if _console.is_terminal else Console(stderr=True, highlight=False, width=220)).print(table)
    for note in notes:
        _console.print(note)
    t = tally(rows)
    _console.print(f"targets: {t['PASS']} PASS, {t['FAIL']} FAIL")


def markdown(result: dict[str, Any]) -> str:
    """The per-target tables as Markdown: times, ratios to the floor, peak RSS per rank, verdicts."""
    src, m = result["source"], result["machine"]
    out = [f"Source: synthetic {src['shape']} ({src['dtype']}, {human_bytes(src['bytes'])}, {src['format']} "
           f"TP={src['tp']} PP={src['pp']}, {src['files']} files). Machine: {m['cpus']} CPUs, {m['platform']}, "
           f"torch {m['torch']}.", ""]
    for t in result["targets"]:
        out += [f"**{src['format']} TP={src['tp']} PP={src['pp']} -> {t['name']}**", "",
                "| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
        for r in t["rows"]:
            if r["status"] != "ok":
                out.append(f"| {r['label']} | {r['status']}: {r['reason']} |" + " |" * (len(HEAD) - 2))
                continue
            out.append("| " + " | ".join([*_cells(r), *(r["checks"][k] or "" for k in CHECKS)]) + " |")
        tl = tally(t["rows"])
        out += ["", f"Targets: {tl['PASS']} PASS, {tl['FAIL']} FAIL.", ""]
        phases = phase_rows(t["rows"])
        if phases:
            head = ("method", "in-proc s", *COLUMNS)
            out += ["Phases of the median run, slowest rank: serial s (+ overlapped s on the read, write and hashing "
                    "threads)",
                    "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            out += ["| " + " | ".join(_phase_cells(r)) + " |" for r in phases] + [""]
        if t.get("bridge"):
            out += ["| " + " | ".join(BRIDGE_HEAD) + " |", "|" + "---|" * len(BRIDGE_HEAD)]
            out += ["| " + " | ".join(_bridge_cells(c)) + " |" for c in t["bridge"]]
            out += [""] + [f"{r['label']} output: {_agreement(r['agreement'])}" for r in t["rows"]
                           if r["method"] == "bridge" and r["status"] == "ok"] + [""]
    return "\n".join(out)


def _agreement(a: dict[str, Any] | None) -> str:
    if not a or a.get("agree") is None:
        return "not checked" + (f" ({a['problems'][0]})" if a and a.get("problems") else "")
    if a["agree"]:
        return f"identical ({a['tensors']} tensors, {human_bytes(a['bytes'])}, vs {a['against']})"
    return f"DIFFERENT from {a['against']}: " + "; ".join(a["problems"][:3])


BRIDGE_HEAD = ("Bridge / dist_convert", "Bridge wall s", "dist_convert wall s", "wall ratio", "Bridge in-proc s",
               "dist_convert in-proc s", "in-proc ratio", "Bridge RSS/rank", "dist_convert RSS/rank", "RSS ratio")


def _bridge_cells(c: dict[str, Any]) -> list[str]:
    """A ratio is printed only where the two outputs were compared and are identical."""
    shown = c["agree"] is True

    def r(v: float | None) -> str:
        return _num(v) + ("x" if v is not None else "") if shown else "-"

    pair = f"Bridge w={c['bridge_world']} / dist_convert w={c['dist_convert_world']}"
    return [pair, _num(c["bridge_wall_s"]), _num(c["dist_convert_wall_s"]), r(c["wall_ratio"]),
            _num(c["bridge_inproc_s"]), _num(c["dist_convert_inproc_s"]), r(c["inproc_ratio"]),
            human_bytes(c["bridge_peak_rss"]), human_bytes(c["dist_convert_peak_rss"]), r(c["rss_ratio"])]


def print_bridge(title: str, comparisons: list[dict[str, Any]], rows: list[dict[str, Any]]) -> None:
    """Megatron-Bridge's import against dist_convert's (wall includes each interpreter's start-up and imports)."""
    table = Table(title=title)
    for col in BRIDGE_HEAD:
        table.add_column(col, justify="left" if col == BRIDGE_HEAD[0] else "right", no_wrap=col == BRIDGE_HEAD[0])
    for c in comparisons:
        table.add_row(*_bridge_cells(c))
    if comparisons:
        _console.print(table)
    for r in rows:
        if r["method"] == "bridge" and r["status"] == "ok":
            _console.print(f"{r['label']} output: {_agreement(r['agreement'])}")


def _color(v: str | None) -> str:
    return "" if v is None else f"[green]{v}[/]" if v == "PASS" else f"[red]{v}[/]"


def print_sizes_table(title: str, rows: list[dict[str, Any]], verdicts: dict[str, Any]) -> None:
    table = Table(title=title)
    for col in ("size", "bytes", "floor s", "wall s", "in-proc s", "GB/s", "peak RSS/rank", "RSS limit"):
        table.add_column(col, justify="right")
    for r in rows:
        rss = human_bytes(r["peak_rss_per_rank"]) if r["peak_rss_per_rank"] else r["status"]
        table.add_row(r["size"], human_bytes(r["bytes"]), _num(r["floor_s"]), _num(r["wall_s"]), _num(r["inproc_s"]),
                      _num(r["gb_per_s"], "{:.3g}"), rss, human_bytes(r["rss_limit"]))
    _console.print(table)
    for key, v in verdicts.items():
        _console.print(f"{key}: {v['value']:.3f} (target {v['target']}) {_color(v['verdict'])}")


def sizes_verdicts(nbytes: list[int], rss: list[int], inproc: list[float], world: int) -> dict[str, Any]:
    slope, ratio = memory_slope(nbytes, rss, world), cost_ratio(nbytes, inproc)
    return {"memory slope (RSS growth / growth of bytes per rank)":
            {"value": slope, "target": f"<= {FLAT_SLOPE}", "verdict": _verdict(memory_flat(nbytes, rss, world))},
            "cost ratio (in-proc s per byte, largest / smallest)":
            {"value": ratio, "target": f"<= {LINEAR_SLACK}", "verdict": _verdict(cost_linear(nbytes, inproc))}}


def check_plot_available() -> None:
    if importlib.util.find_spec("matplotlib") is None:
        raise ConvertError("--plot needs matplotlib, which is not installed in this environment",
                           "install it (e.g. .venv/bin/pip install matplotlib) or drop --plot")


def _axes(panels: int = 2) -> tuple[Any, list[Any]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4.2))
    return fig, list(axes)


def _save(fig: Any, axes: list[Any], path: str) -> None:
    for ax in axes:
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _per_rank(r: dict[str, Any]) -> float:
    """Throughput per rank: source bytes / wall s / ranks, in GB/s."""
    return r["gb_per_s"] / (r["world"] or 1)


def plot_sizes(path: str, rows: list[dict[str, Any]]) -> None:
    """--sizes: wall and in-process seconds, and peak RSS per rank, against the checkpoint size; throughput per
    rank against ranks, one line per size."""
    fig, (ax_t, ax_m, ax_r) = _axes(3)
    for w in sorted({r["world"] for r in rows}):
        ok = [r for r in rows if r["world"] == w and r["status"] == "ok"]
        gib = [r["bytes"] / 2**30 for r in ok]
        ax_t.plot(gib, [r["wall_s"] for r in ok], "o-", label=f"dist_convert w={w} wall")
        ax_t.plot(gib, [r["inproc_s"] for r in ok], "o--", label=f"dist_convert w={w} in-process")
        ax_m.plot(gib, [r["peak_rss_per_rank"] / 2**30 for r in ok], "o-", label=f"dist_convert w={w}")
        ax_m.plot(gib, [r["rss_limit"] / 2**30 for r in ok], ":", label=f"RSS target w={w}")
    floors = {r["bytes"]: r["floor_s"] for r in rows}
    ax_t.plot([b / 2**30 for b in floors], list(floors.values()), "k:", label="I/O floor")
    for size in dict.fromkeys(r["size"] for r in rows):
        ok = sorted((r for r in rows if r["size"] == size and r["status"] == "ok"), key=lambda r: r["world"])
        ax_r.plot([r["world"] for r in ok], [_per_rank(r) for r in ok], "o-", label=f"dist_convert {size}")
    ax_t.set(xlabel="checkpoint GB", ylabel="s", title="time")
    ax_m.set(xlabel="checkpoint GB", ylabel="GB", title="peak RSS per rank")
    ax_r.set(xlabel="ranks", ylabel="GB/s per rank (source bytes / wall s / ranks)", title="throughput per rank")
    ax_r.xaxis.get_major_locator().set_params(integer=True)
    _save(fig, [ax_t, ax_m, ax_r], path)


def plot(path: str, targets: list[dict[str, Any]]) -> None:
    """Throughput per rank (GB/s of wall time / ranks) and peak RSS per rank against ranks, one line per target."""
    fig, (ax_t, ax_m) = _axes()
    for t in targets:
        rows = [r for r in t["rows"] if r["status"] == "ok"]
        dc = sorted((r for r in rows if r["method"] == "dist_convert"), key=lambda r: r["world"])
        line = ax_t.plot([r["world"] for r in dc], [_per_rank(r) for r in dc], "o-", label=f"dist_convert {t['name']}")
        color = line[0].get_color()
        ax_m.plot([r["world"] for r in dc], [r["peak_rss_per_rank"] / 2**30 for r in dc], "o-", color=color,
                  label=f"dist_convert {t['name']}")
        for r in rows:
            marker = {"whole_model": "s", "mcore": "^", "bridge": "D"}.get(r["method"])
            if r["method"] == "floor":
                ax_t.axhline(r["gb_per_s"], color=color, ls=":", label=f"I/O floor (one process) {t['name']}")
            elif marker:
                ax_t.plot([r["world"]], [_per_rank(r)], marker, color=color, label=f"{r['method']} {t['name']}")
                ax_m.plot([r["world"]], [r["peak_rss_per_rank"] / 2**30], marker, color=color,
                          label=f"{r['method']} {t['name']}")
        ax_m.plot([r["world"] for r in dc], [r["rss_limit"] / 2**30 for r in dc], "--", color=color, alpha=0.5,
                  label=f"RSS target {t['name']}")
    ax_t.set(xlabel="ranks", ylabel="GB/s per rank (source bytes / wall s / ranks)", title="throughput per rank")
    ax_m.set(xlabel="ranks", ylabel="GB", title="peak RSS per rank")
    for ax in (ax_t, ax_m):
        ax.xaxis.get_major_locator().set_params(integer=True)
    _save(fig, [ax_t, ax_m], path)
