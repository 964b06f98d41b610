"""Soak: back-to-back random conversions in one torchrun launch, each through the CLI's parser and
dispatcher (``dist_convert.cli``), each followed by ``verify`` against the original checkpoint.

  torchrun --nproc_per_node=N tests/soak_driver.py --src CKPT --work DIR --steps K --seed S --deadline SEC

Every step converts the previous step's output to a random format and layout (seeded), so an
error anywhere in the chain surfaces. Rank 0 prints one line per step and "SOAK OK <k> steps" at
the end; any failed step, or running past the deadline, exits non-zero.
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

from dist_convert.cli import build_parser, run
from dist_convert.runtime import init_runtime

FORMATS = ("torch_dist", "megatron", "nemo", "hf")


def layout_args(rng: random.Random, fmt: str, num_layers: int, max_tp: int) -> list[str]:
    """A random target layout the format supports (hf stores whole tensors; .nemo has no VPP)."""
    if fmt == "hf":
        return []
    tp = rng.choice([t for t in (1, 2, 4) if t <= max_tp])
    pp = rng.choice([p for p in (1, 2, 4) if p <= num_layers])
    out = ["--target-tp", str(tp), "--target-pp", str(pp), "--target-vpp", "1"]
    kind = rng.choice(("even", "uneven", "vpp")) if pp == 2 else "even"
    if kind == "uneven" and fmt != "nemo":
        first = rng.choice((1, num_layers - 1))
        out += ["--target-num-layers-in-first-stage", str(first)]
    elif kind == "vpp" and fmt != "nemo" and num_layers % (pp * 2) == 0:
        out[-1] = "2"
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--src", type=Path, required=True)
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--deadline", type=float, required=True, help="seconds for all steps")
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--max-tp", type=int, default=2, help="largest TP the model allows (query groups)")
    p.add_argument("--vocab-size", type=int, required=True,
                   help="the true vocabulary size (.nemo configs do not record it, as NeMo's do not)")
    a = p.parse_args()
    rt = init_runtime("gloo", 120.0)
    rng = random.Random(a.seed)
    parser, prev, t_start = build_parser(), a.src, time.monotonic()
    for step in range(a.steps):
        fmt = rng.choice(FORMATS)
        dst = a.work / f"step{step:02d}_{fmt}{'.nemo' if fmt == 'nemo' else ''}"
        conv = ["reshard", str(prev), str(dst), "--dst-format", fmt, *layout_args(rng, fmt, a.num_layers, a.max_tp)]
        vocab = ["--vocab-size", str(a.vocab_size)]
        t0 = time.monotonic()
        for argv in (conv + vocab, ["verify", str(a.src), str(dst), *vocab], ["verify", str(dst), "--checksums"]):
            rc = run(parser.parse_args(argv), rt)
            if rc != 0:
                rt.log(f"SOAK FAILED at step {step}: {' '.join(argv)} exited {rc}")
                return 1
        rt.log(f"step {step:2d}: {' '.join(conv[3:])} ok in {time.monotonic() - t0:.1f} s")
        prev = dst
        if time.monotonic() - t_start > a.deadline:
            rt.log(f"SOAK FAILED: {step + 1} of {a.steps} steps took over --deadline {a.deadline:g} s")
            return 1
    rt.log(f"SOAK OK {a.steps} steps in {time.monotonic() - t_start:.1f} s")
    rt.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
