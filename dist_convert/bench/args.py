"""The ``bench`` subcommand's arguments, apart from its machinery: building the parser of every
launch imports only this (``bench.main`` is imported when ``bench`` runs)."""
from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

METHODS = ("floor", "startup", "dist_convert", "whole_model", "mcore", "bridge", "torchrun", "exchange")
# bridge only when asked (it needs an hf source and Megatron-Bridge); torchrun: the start-up of a torchrun launch;
# exchange: dist_convert at each world size above 1 with --exchange shm and with --exchange gloo (their exchange
# seconds and GB/s; a target whose bytes cross ranks, e.g. --format megatron --targets 1x1)
DEFAULT_METHODS = METHODS[:5]
ITEMSIZE = {"bf16": 2, "fp16": 2, "fp32": 4}
DEFAULT_TARGETS = "1x2,4x1"
RELEASE_SHAPES = ("llama3-8b",)  # bench.release.RELEASES (named here: the parser imports no torch)


def _ints(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive integers, e.g. 1,2,4")
    return out


def parse_targets(text: str) -> list[tuple[int, int]]:
    try:
        return [(int(t), int(p)) for t, p in (x.lower().split("x") for x in text.split(",") if x.strip())]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of TPxPP layouts like 1x2,4x1") from None


def add_bench_parser(sub: Any, parse_size: Callable[[str], int], default_budget: int) -> None:
    """The ``bench`` subcommand's arguments (``parse_size``, ``default_budget``: the CLI's)."""
    b = sub.add_parser("bench", help="time dist_convert against the I/O floor, a whole-model single-process "
                                     "converter, megatron-core's own load + save and Megatron-Bridge's HF import "
                                     "(one process; launches torchrun)",
                       description="Time dist_convert against the I/O floor, a whole-model single-process converter, "
                                   "megatron-core's own load + save and Megatron-Bridge's HF import. Runs in one "
                                   "process: it makes a synthetic checkpoint (or takes --src) and launches each "
                                   "measured job itself (dist_convert --nproc N, megatron-core under torchrun); "
                                   "prints the median of --reps runs per method and world size.")
    b.add_argument("--size", type=parse_size, default=1 << 30, help="synthetic checkpoint size (default 1GB)")
    b.add_argument("--sizes", default=None, help="scaling mode, e.g. 256MB,512MB,1GB: dist_convert at 2 ranks "
                                                 "per size with a fixed --memory-budget (memory flat, cost linear)")
    b.add_argument("--plan-scale", action="store_true",
                   help="plan DeepSeek-V3 (671B, 256 experts, MTP) from its HF release and from one Megatron layout "
                        "to another over 128 ranks, without tensors: plan time, per-rank bytes, memory bound")
    b.add_argument("--release", choices=RELEASE_SHAPES, default=None,
                   help="a release-sized case instead: a Hugging Face release of this shape (llama3-8b: 16.1 GB bf16), "
                        "made once under --workdir, imported to torch_dist (--target-tp/--target-pp, default 2x2) and "
                        "exported back, each against the floor of its own bytes, at --ranks (default 2); use with "
                        "--drop-caches")
    b.add_argument("--max-shard-size", type=parse_size, default=5 * 10**9,
                   help="--release: the release's shard size and the export's (default 5GB)")
    b.add_argument("--export-format", choices=("hf", "megatron"), default="hf",
                   help="--release: what the export writes: hf (the release back, checked byte for byte; default) or "
                        "megatron (legacy rank files at TP=1 PP=1: the whole model in one torch.save file, streamed)")
    b.add_argument("--dtype", choices=tuple(ITEMSIZE), default="bf16",
                   help="dtype of the synthetic checkpoint's tensors (default bf16)")
    b.add_argument("--format", choices=("torch_dist", "megatron", "hf"), default="torch_dist",
                   help="synthetic checkpoint format (hf: a Llama directory with a tokenizer, imported to torch_dist)")
    b.add_argument("--src-tp", type=int, default=2, help="layout of the synthetic checkpoint (default TP=2 PP=1; "
                                                         "hf: ignored)")
    b.add_argument("--src-pp", type=int, default=1, help="pipeline stages of the synthetic checkpoint (default 1)")
    b.add_argument("--src", type=Path, default=None, help="time this existing checkpoint (torch_dist, megatron or a "
                                                          "Hugging Face directory) instead of a synthetic one")
    b.add_argument("--target-tp", type=int, default=None, help="one target layout (with --target-pp)")
    b.add_argument("--target-pp", type=int, default=None, help="one target layout (with --target-tp)")
    b.add_argument("--targets", type=parse_targets, default=None, help=f"TPxPP list (default {DEFAULT_TARGETS})")
    b.add_argument("--ranks", type=_ints, default=None, help="dist_convert world sizes (default 1,2,4; --sizes: 2)")
    b.add_argument("--reps", type=int, default=3, help="runs per measurement; the median is reported")
    b.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                   help=f"subset of {','.join(METHODS)} (default {','.join(DEFAULT_METHODS)}; torchrun: with startup, "
                        "also time the start-up of a torchrun launch; exchange: --exchange shm against gloo)")
    b.add_argument("--bridge-python", type=Path, default=None,
                   help="python of an environment with Megatron-Bridge, for --methods bridge (default: this one)")
    b.add_argument("--memory-budget", type=parse_size, default=default_budget, help="passed to dist_convert")
    b.add_argument("--seed", type=int, default=0, help="seed of the synthetic values")
    b.add_argument("--no-predict", action="store_true",
                   help="skip `dist_convert plan`'s memory prediction for each dist_convert run (one process each)")
    b.add_argument("--optimizer", action="store_true",
                   help="the synthetic torch_dist checkpoint also holds a distributed Adam's state (model space), "
                        "and each dist_convert world size runs twice: weights only, and with --optimizer")
    b.add_argument("--lora", type=int, default=0, metavar="R",
                   help="each dist_convert world size also runs with --lora: a synthetic peft adapter of rank R on "
                        "every projection merged as the target is written (method lora)")
    b.add_argument("--workdir", type=Path, default=None, help="where to write (default: a new directory in $TMPDIR)")
    b.add_argument("--keep", action="store_true", help="keep the source and each method's last output")
    b.add_argument("--drop-caches", action="store_true", help="empty the page cache before every run (root)")
    b.add_argument("--timeout", type=float, default=3600.0, help="seconds per command")
    b.add_argument("--json", type=Path, default=None, help="write every number here")
    b.add_argument("--markdown", type=Path, default=None, help="write the tables as Markdown (for the README)")
    b.add_argument("--plot", type=Path, default=None, help="PNG of throughput and peak RSS against ranks")
