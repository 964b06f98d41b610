"""Synthetic Llama-shaped checkpoints, written by dist_convert's own format writers (no megatron-core).

Values are seeded and cheap: one random pool is drawn once and every row of every logical tensor is
a window of it, at an offset that depends on the tensor's name and the row. Any box of a logical
tensor can so be produced on its own, and the TP shards of one tensor agree wherever they meet.

Launch (one rank per source rank file: world = TP * PP), from the repository root:
  torchrun --nproc_per_node=N -m dist_convert.bench.synth --out DIR --shape JSON --format torch_dist \
      --tp T --pp P [--dtype bf16] [--seed S]

``--optimizer`` (torch_dist) adds a distributed Adam's state in model space, as megatron-core's
fully_reshardable save stores it (``dist_convert reshard --optimizer`` converts it with the weights).

``--format hf`` (one process, ``--tp 1 --pp 1``) writes a Hugging Face Llama directory instead: dist_convert's
own hf export of the same values (``config.json``, safetensors) and a word-level tokenizer of the
vocabulary's size, so that a loader that reads the tokenizer (Megatron-Bridge does) finds one.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import zlib
from pathlib import Path

import torch

from ..config import config_from_args
from ..datamodel import OptimizerState, Target, TargetTensor
from ..formats import get_format
from ..formats.base import FormatOptions, write_tracker
from ..layout.boxes import Box
from ..layout.rules import logical_tensors
from ..layout.topology import Layout
from ..mlm_args import args_for_target
from ..optim.state import STATES, opt_name
from ..runtime import Runtime, init_runtime
from .shape import LlamaShape, make_args

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
POOL = 1 << 23  # random values drawn once (longer than any row)
ROW_STRIDE = 7919  # pool offset between consecutive rows of a tensor
ITERATION = 1000
SCALE = 0.02  # std of the values (initializer-like)


class Values:
    """Seeded content of every logical tensor: row ``r`` of tensor ``name`` is a window of the pool."""

    def __init__(self, seed: int, dtype: torch.dtype) -> None:
        g = torch.Generator().manual_seed(seed)
        self.seed = seed
        self.pool = (torch.randn(POOL, generator=g) * SCALE).to(dtype)

    def block(self, name: str, box: Box, shape: tuple[int, ...]) -> torch.Tensor:
        """``box`` of the logical tensor ``name`` of ``shape`` (1-D tensors are one row)."""
        row_len = shape[-1]
        if row_len >= POOL:
            raise ValueError(f"{name}: rows of {row_len} elements exceed the value pool")
        r0, nr = (box.offsets[0], box.sizes[0]) if len(shape) == 2 else (0, 1)
        c0, nc = box.offsets[-1], box.sizes[-1]
        offset = zlib.crc32(f"{self.seed}|{name}".encode())
        starts = (torch.arange(r0, r0 + nr, dtype=torch.int64) * ROW_STRIDE + offset) % (POOL - row_len + 1)
        windows = self.pool.as_strided((POOL - row_len + 1, row_len), (1, 1))
        return windows[:, c0:c0 + nc][starts].reshape(box.sizes)


def stored(t: TargetTensor, shapes: dict[str, tuple[int, ...]], values: Values) -> torch.Tensor:
    """One stored target tensor (vocabulary padding rows stay zero, as dist_convert writes them)."""
    data = torch.zeros(t.shape, dtype=t.dtype)
    for p in t.pieces:
        data[p.sbox.slices()].copy_(values.block(p.logical, p.lbox, shapes[p.logical]).reshape(p.sbox.sizes))
    return data


# the param groups of megatron-core's distributed Adam (weights with weight decay, the rest without)
SYNTH_GROUPS = tuple({"wd_mult": wd, "lr_mult": 1.0, "is_expert_parallel": False, "is_decoupled_lr": False,
                      "lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1 * wd, "step": ITERATION}
                     for wd in (1.0, 0.0))


def synthetic_target(shape: LlamaShape, dtype: torch.dtype, layout: Layout, optimizer: bool = False) -> Target:
    """``optimizer``: with the model-space (fully_reshardable) optimizer state of a distributed Adam."""
    base = make_args(shape, dtype, ITERATION)
    cfg = config_from_args(base, None, "local", layout.tp)
    cfg.check_layout(layout, "source")
    state = OptimizerState(kind="fully_reshardable", groups=(SYNTH_GROUPS,), scheduler={"num_steps": ITERATION}) \
        if optimizer else None
    return Target(cfg=cfg, layout=layout, dtype=dtype,
                  args=args_for_target(base, cfg, layout, dtype, optimizer_saved=optimizer), iteration=ITERATION,
                  optimizer=state)


def write_synthetic(out: Path, shape: LlamaShape, dtype: torch.dtype, fmt_name: str, layout: Layout, seed: int,
                    rt: Runtime, optimizer: bool = False, max_shard_size: int | None = None) -> None:
    """Collective: every rank writes its share of the rank files (rank i: files i, i + world, ...);
    ``max_shard_size``: hf's bytes per shard (None: the format's default)."""
    fmt = get_format(fmt_name, FormatOptions(max_shard_size=max_shard_size) if max_shard_size else None)
    target = synthetic_target(shape, dtype, layout, optimizer)
    tensors = logical_tensors(target.cfg)
    files = fmt.target_files(target, {name: dtype for name in tensors})
    iter_dir = out if fmt_name == "hf" else out / f"iter_{ITERATION:07d}"
    if rt.rank == 0:
        iter_dir.mkdir(parents=True, exist_ok=True)
    rt.barrier()
    mine = files[rt.rank::rt.world]
    shapes = {n: t.shape for n, t in tensors.items()}
    shapes.update({opt_name(s, n): t.shape for n, t in tensors.items() for s in STATES})
    values = Values(seed, dtype)
    writer = fmt.open_writer(target, iter_dir, mine, rt)
    written = []
    for f in mine:
        for j, t in enumerate(f.tensors):
            written += writer.put(f, j, stored(t, shapes, values))
    written += writer.close()
    every = [w for part in rt.all_gather_object(written) for w in part]
    if rt.rank == 0:
        fmt.finalize(target, iter_dir, every)
        if fmt_name == "hf":
            write_tokenizer(out, shape.vocab_size)
        else:
            write_tracker(out, ITERATION)
    rt.barrier()


def write_tokenizer(out: Path, vocab_size: int) -> None:
    """A word-level tokenizer of ``vocab_size`` tokens ``t0``.. (unknown ``t0``, eos ``t1``, bos ``t2``) in
    the ``tokenizers`` JSON that transformers' ``PreTrainedTokenizerFast`` reads, written as plain JSON."""
    model = {"type": "WordLevel", "vocab": {f"t{i}": i for i in range(vocab_size)}, "unk_token": "t0"}
    tok = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
           "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None, "decoder": None, "model": model}
    (out / "tokenizer.json").write_text(json.dumps(tok))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "t0", "eos_token": "t1", "bos_token": "t2",
         "model_max_length": 4096}))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dist_convert.bench.synth", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--shape", required=True, help="JSON of a LlamaShape")
    p.add_argument("--format", choices=("torch_dist", "megatron", "hf"), default="torch_dist")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--optimizer", action="store_true",
                   help="torch_dist: add a distributed Adam's state in model space (fully_reshardable)")
    p.add_argument("--max-shard-size", type=int, default=None, help="hf: bytes per safetensors shard")
    a = p.parse_args(argv)
    shape = LlamaShape(**json.loads(a.shape))
    rt = init_runtime("gloo")
    try:
        write_synthetic(a.out, shape, DTYPES[a.dtype], a.format, Layout(tp=a.tp, pp=a.pp), a.seed, rt, a.optimizer,
                        a.max_shard_size)
    finally:
        rt.close()
    return 0


def shape_json(shape: LlamaShape) -> str:
    return json.dumps(dataclasses.asdict(shape))


if __name__ == "__main__":
    sys.exit(main())
