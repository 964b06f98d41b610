"""``launch/gpu_check.sh --cpu``: the device check's dry mode runs whole on this CPU machine (gloo, 2 ranks):
megatron-core makes the source, dist_convert reshards it and back bit-exactly (shared memory, and gloo for every
byte), the three verifies in one process, and the figures table is printed. (Its speculate step is GPU-only: on CPU
tests/test_speculate.py runs and judges the same command.)"""
from __future__ import annotations

import subprocess
from pathlib import Path

from conftest import ENV, ROOT


def orphans() -> set[int]:
    """Processes multiprocessing started whose parent is gone (re-parented to init)."""
    found = set()
    for proc in Path("/proc").iterdir():
        try:
            stat = (proc / "stat").read_text()
            cmd = (proc / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if proc.name.isdigit() and b"multiprocessing" in cmd and stat.rsplit(")", 1)[1].split()[1] == "1":
            found.add(int(proc.name))
    return found


def test_gpu_check_dry_mode_runs_every_step_on_cpu(tmp_path):
    """Also: no process outlives its job (megatron-core's torch_dist save starts a multiprocessing Manager, which
    dist_convert's fast exit once left running, orphaned)."""
    before = orphans()
    proc = subprocess.run(["bash", "launch/gpu_check.sh", "--cpu", "--out", str(tmp_path / "w")], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert out.count("verify OK") == 3, out[-4000:]  # the round trip, the middle layout, the two exchanges
    table = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert [row.split("|")[1].strip() for row in table[1:]] == [
        "reshard -> mid", "reshard -> back", "reshard -> back, --exchange gloo"], table
    assert "exchange: shm within node" in out and "exchange: gloo within node (--exchange gloo)" in out
    assert "gpu_check OK (cpu)" in proc.stdout
    assert orphans() <= before, "a job left processes running"


def test_one_gpu_mode_dry_run_lists_commands_the_product_accepts(tmp_path):
    """``--dry-run``: the one-GPU mode's commands (N=1) printed, none run, nothing written; every dist_convert
    command among them parses with the CLI's own parser, so a renamed flag fails here and not on the lent GPU."""
    import shlex

    from dist_convert.cli import build_parser

    work = tmp_path / "w"
    proc = subprocess.run(["bash", "launch/gpu_check.sh", "--dry-run", "--out", str(work)], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not work.exists()
    commands = [shlex.split(line[2:].split(" (must fail")[0]) for line in proc.stderr.splitlines()
                if line.startswith("+ ")]
    ours = [c[c.index("dist_convert") + 1:] for c in commands if "dist_convert" in c]
    parser = build_parser()
    for args in ours:
        parser.parse_args(args)  # SystemExit on an unknown flag or choice
    verbs = [(a[0], a[a.index("--backend") + 1] if "--backend" in a else "auto") for a in ours]
    assert verbs == [("reshard", "nccl")] * 3 + [("verify", "nccl")] * 3 + [
        ("reshard", "auto"), ("verify", "auto"), ("reshard", "nccl"), ("speculate", "nccl"), ("speculate", "nccl"),
        ("bench", "auto")], verbs
    joined = [" ".join(c) for c in commands]
    assert "--nproc_per_node=8 tests/oracles/mcore.py make" in joined[0] and "--tp 4 --pp 2" in joined[0]
    assert "--nproc_per_node=1 -m dist_convert reshard" in joined[1] and "--exchange nccl" in joined[3]
    assert sum("--nproc_per_node=2 -m dist_convert" in j for j in joined) == 3
    assert sum("tests/oracles/spec.py check" in j and "--tp 1" in j for j in joined) == 2
    assert "--size 16GB --src-tp 8 --targets 1x1 --ranks 1" in joined[-1]
    assert "gpu_check dry run (one-gpu)" in proc.stdout
