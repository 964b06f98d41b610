"""Soak: random conversions of a small model back to back in one launch (20 at 2 ranks, 10 at 1 and
at 4; seeded random format, TP, PP, uneven stages, VPP), each verified against the source tensor by
tensor and by its checksums, within a time bound (tests/soak_driver.py)."""
from __future__ import annotations

import subprocess

import pytest

from conftest import ENV, ROOT, torchrun

STEPS = {1: 10, 2: 20, 4: 10}  # 20 back to back in one launch, 40 in all


@pytest.mark.parametrize("world", list(STEPS))
def test_soak(gpt_a, tmp_path, world):
    cmd = torchrun(world, str(ROOT / "tests" / "soak_driver.py"), "--src", str(gpt_a.torch_dist), "--work",
                   str(tmp_path), "--steps", str(STEPS[world]), "--seed", str(1000 + world), "--deadline", "420",
                   "--num-layers", str(gpt_a.cfg["num_layers"]), "--max-tp", str(gpt_a.cfg["num_query_groups"]),
                   "--vocab-size", str(gpt_a.cfg["vocab_size"]))
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and f"SOAK OK {STEPS[world]} steps" in proc.stderr, proc.stderr[-4000:]
    assert proc.stderr.count("verify OK") == STEPS[world] and proc.stderr.count("checksums OK") == STEPS[world]
