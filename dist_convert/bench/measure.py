"""Timing: the I/O floor in this process, every other method as a subprocess (torchrun for the
distributed ones) that reports its in-process time and peak RSS per rank through a JSON file.

Every measurement starts after ``os.sync()`` (nothing dirty left from the run before) and ends after
the command returned and ``os.sync()`` again, so each method's wall time includes making its output
durable. The source files are in the page cache for every method alike (they were just written)."""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dist_convert

PACKAGE_PARENT = Path(dist_convert.__file__).resolve().parents[1]
FROM_CHECKOUT = (PACKAGE_PARENT / "pyproject.toml").is_file()  # a source checkout (or an editable install of one)
# Where child jobs (``python -m`` / ``torchrun -m``) run: a checkout's root, whose package they import;
# an installed package's jobs run where bench was started and import it from the environment.
REPO_ROOT = PACKAGE_PARENT if FROM_CHECKOUT else Path.cwd()
COPY_BLOCK = 16 << 20


@dataclass(kw_only=True)
class Run:
    """Not frozen: ``measure_target`` adds to ``detail`` (the load average after the run) once it has it."""

    wall_s: float  # the whole command (start-up included) and the sync after it
    inproc_s: float | None = None  # the slowest rank's own time, from its report
    peak_rss_per_rank: list[int] = field(default_factory=list)
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass(kw_only=True)
class Outcome:
    """One method at one target: its runs (median reported) or why it did not run. Not frozen: it is filled in
    as the method runs (runs, status and reason, the output kept, the predicted RSS, the agreement check)."""

    # floor | help | startup | startup_torchrun | dist_convert | optimizer | lora | whole_model | mcore | bridge
    method: str
    label: str
    world: int | None
    runs: list[Run] = field(default_factory=list)
    status: str = "ok"  # ok | failed | n/a
    reason: str | None = None
    output: str | None = None  # kept output directory (--keep, or until the bridge agreement check)
    agreement: dict[str, Any] | None = None  # bridge: its output compared with dist_convert's (bridge.compare)
    predicted_rss: int | None = None  # dist_convert: the busiest rank's peak RSS as `dist_convert plan` predicts it

    @property
    def wall_s(self) -> float | None:
        return statistics.median(r.wall_s for r in self.runs) if self.runs else None

    @property
    def inproc_s(self) -> float | None:
        vals = [r.inproc_s for r in self.runs if r.inproc_s is not None]
        return statistics.median(vals) if vals else None

    @property
    def peak_rss(self) -> int | None:
        """Median over runs of the largest peak RSS of any rank."""
        vals = [max(r.peak_rss_per_rank) for r in self.runs if r.peak_rss_per_rank]
        return int(statistics.median(vals)) if vals else None


class MethodFailed(Exception):
    pass


def job_args(prog: str, doc: str | None, argv: list[str] | None) -> argparse.Namespace:
    """The command line every timed job shares: SRC DST --tp T --pp P [--stats-json FILE]."""
    p = argparse.ArgumentParser(prog=f"python -m {prog}", description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", type=Path)
    p.add_argument("dst", type=Path)
    p.add_argument("--tp", type=int, required=True, help="target tensor-parallel size")
    p.add_argument("--pp", type=int, required=True, help="target pipeline-parallel size")
    p.add_argument("--stats-json", type=Path, default=None)
    return p.parse_args(argv)


def child_env() -> dict[str, str]:
    """A checkout's root goes first on PYTHONPATH (the jobs import this package, not another
    installed one); an installed package's site directory is never put there (ahead of the stdlib)."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "TORCHELASTIC_ERROR_FILE": ""}
    if FROM_CHECKOUT:
        path = os.environ.get("PYTHONPATH")
        env["PYTHONPATH"] = f"{REPO_ROOT}{os.pathsep}{path}" if path else str(REPO_ROOT)
    return env


TORCHRUN = "torch.distributed.run"


def torchrun(nproc: int, module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", TORCHRUN, "--standalone", f"--nproc_per_node={nproc}",
            "-m", module, *args]


def python_module(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def source_files(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file())


def total_bytes(files: list[Path]) -> int:
    return sum(p.stat().st_size for p in files)


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def run_command(cmd: list[str], timeout: float) -> float:
    """Run ``cmd`` from the repository root; wall seconds including the sync after it. A torchrun job
    keeps each rank's output in a log directory of its own, so that a failure names the rank that
    failed first and what that rank printed (not torchrun's summary of it)."""
    with tempfile.TemporaryDirectory(prefix="dist_convert_bench_logs_") as logs:
        if TORCHRUN in cmd:
            at = cmd.index(TORCHRUN) + 1
            cmd = [*cmd[:at], "--log-dir", logs, "--redirects", "3", *cmd[at:]]
        os.sync()
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=REPO_ROOT, env=child_env(), capture_output=True, text=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            raise MethodFailed(f"timed out after {timeout:.0f} s (raise --timeout)") from None
        os.sync()
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            raise MethodFailed(failure_reason(proc, Path(logs)))
    return wall


_ROOT_RANK = re.compile(r"Root Cause.*?local_rank: (\d+)\).*?exitcode\s*:\s*(-?\d+)[^\n]*?(\((SIG\w+)\))?\n", re.S)


def failure_reason(proc: subprocess.CompletedProcess, logs: Path) -> str:
    """One line: the exit code, the rank torchrun found failing first (with its signal), and the last
    lines that rank (or the one process) wrote to stderr, warnings left out."""
    where, text = "", proc.stderr or proc.stdout or ""
    m = _ROOT_RANK.search(proc.stderr or "")
    if m:
        local, code, sig = m.group(1), m.group(2), m.group(4)
        where = f"rank {local} exit {code}{f' ({sig})' if sig else ''}: "
        rank_err = [f for f in logs.rglob("stderr.log") if f.parent.name == local]
        text = rank_err[0].read_text(errors="replace") if rank_err else ""
    lines = [ln.strip() for ln in text.splitlines()
             if ln.strip() and "Warning" not in ln and "warnings.warn" not in ln]
    return f"exit {proc.returncode}: {where}{' | '.join(lines[-3:])[:400] or 'no output'}"


def time_floor(files: list[Path], out: Path) -> Run:
    """Read every source byte and write as many to one file on the same disk, fsynced."""
    buf = bytearray(COPY_BLOCK)
    view = memoryview(buf)
    os.sync()
    t0 = time.perf_counter()
    with open(out, "wb") as dst:
        for f in files:
            with open(f, "rb", buffering=0) as src:
                while n := src.readinto(buf):
                    dst.write(view[:n])
        dst.flush()
        os.fsync(dst.fileno())
    os.sync()
    return Run(wall_s=time.perf_counter() - t0)


def parse_dist_convert(stats: Any) -> tuple[float, list[int], dict]:
    """``reshard --stats-json`` (one RankStats dict per rank) or the start-up probe's per-rank dicts."""
    detail = {k: [s[k] for s in stats] for k in ("read_bytes", "written_bytes", "sent_bytes") if k in stats[0]}
    if "write_s" in stats[0]:
        detail["write_s"] = max(s["write_s"] for s in stats)
    if "exchange_s" in stats[0]:  # the slowest rank's time moving bytes between ranks, and the bytes moved
        detail["exchange_s"] = max(s["exchange_s"] for s in stats)
        detail["exchanged_bytes"] = sum(s["sent_bytes"] for s in stats)
    slowest = max(stats, key=lambda s: s["wall_s"])
    if slowest.get("phases"):  # where the slowest rank's time went (phases.py)
        detail["phases"] = slowest["phases"]
    return max(s["wall_s"] for s in stats), [s["peak_rss"] for s in stats], detail


def parse_single(stats: Any) -> tuple[float, list[int], dict]:
    """The whole-model baseline: one process."""
    return stats["wall_s"], [stats["peak_rss"]], {k: v for k, v in stats.items() if k.endswith("_s")}


def parse_mcore(stats: Any) -> tuple[float, list[int], dict]:
    return stats["wall_s"], list(stats["peak_rss_per_rank"]), {k: v for k, v in stats.items() if k.endswith("_s")}


Parser = Callable[[Any], tuple[float, list[int], dict]]


def time_job(cmd: list[str], stats_path: Path, parse: Parser, timeout: float) -> Run:
    remove(stats_path)
    wall = run_command(cmd, timeout)
    if not stats_path.is_file():
        raise MethodFailed(f"the command wrote no stats to {stats_path}")
    inproc, rss, detail = parse(json.loads(stats_path.read_text()))
    return Run(wall_s=wall, inproc_s=inproc, peak_rss_per_rank=rss, detail=detail)


def drop_caches() -> None:
    """Empty the page cache (root only), so every method reads the source from disk."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as fh:
        fh.write("3\n")
