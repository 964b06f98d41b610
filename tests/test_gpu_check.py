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
