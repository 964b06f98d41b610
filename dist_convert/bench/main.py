"""``python -m dist_convert bench``: check the options, then run what they ask for (``run``: per target layout,
every method; ``scaling``: dist_convert over growing sizes; ``plan_scale``: the planner at scale) and report
it. The command's entry point, apart from the measuring it drives (so ``run`` and ``scaling`` need not
import each other)."""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..errors import ConvertError
from ..runtime import _console
from . import measure, report
from .run import check_options, run_targets


def machine() -> dict[str, Any]:
    return {"host": socket.gethostname(), "cpus": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__, "loadavg_start": os.getloadavg()}


def bench_main(ns: argparse.Namespace) -> int:
    try:
        return _bench(ns)
    except ConvertError as e:
        print(f"dist_convert: error: {e}", flush=True, file=sys.stderr)
        return 2


def _bench(ns: argparse.Namespace) -> int:
    methods, targets = check_options(ns)
    if ns.workdir:
        ns.workdir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="dc_bench.", dir=ns.workdir)).resolve()  # jobs may run elsewhere
    result: dict[str, Any] = {"machine": machine(), "workdir": str(work), "memory_budget": ns.memory_budget}
    try:
        if ns.release:
            from .release import failed as release_failed
            from .release import print_release, run_release
            result["release"] = run_release(ns, work)
            print_release(result["release"])
            failed = release_failed(result["release"])
        elif ns.plan_scale:
            from .plan_scale import run_plan_scale
            result["plan_scale"] = run_plan_scale()
            failed = False
        elif ns.sizes:
            from .scaling import run_sizes
            result["sizes"] = run_sizes(ns, targets[0], work)
            failed = any(r["status"] != "ok" for r in result["sizes"]["rows"])
        else:
            result.update(run_targets(ns, methods, targets, work))
            failed = any(r["status"] == "failed" for t in result["targets"] for r in t["rows"])
            failed |= any(c["agree"] is False for t in result["targets"] for c in t.get("bridge", []))
    finally:
        if not ns.keep:
            measure.remove(work)
    m = result["machine"]
    m["loadavg_end"] = os.getloadavg()
    _console.print(f"machine: {m['cpus']} CPUs, load average {m['loadavg_start'][0]:.2f} at start, "
                   f"{m['loadavg_end'][0]:.2f} at end (1 min)")
    if ns.json:
        ns.json.write_text(json.dumps(result, indent=1, default=str))
    if ns.markdown and "targets" in result:
        ns.markdown.write_text(report.markdown(result))
    if ns.markdown and "release" in result:
        from .release import markdown
        ns.markdown.write_text(markdown(result["release"]))
    if ns.plot:
        if "targets" in result:
            report.plot(str(ns.plot), result["targets"])
        else:
            report.plot_sizes(str(ns.plot), result["sizes"]["rows"])
    return 1 if failed else 0
