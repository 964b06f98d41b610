"""A synthetic HF peft LoRA adapter of a checkpoint, for ``bench --lora R``: every attention and dense MLP
projection of the base (its HF names: q/k/v/o, gate/up/down) gets seeded random A [R, in] and B [out, R] in float32,
``lora_alpha = 2R``; one process.

  python -m dist_convert.bench.synth_lora --base CKPT --out ADAPTER_DIR --rank R [--seed S]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ..formats import detect_format
from ..formats.hf import hf_tensors
from ..formats.peft import CONFIG, PREFIX, WEIGHTS, peft_slots
from ..formats.safetensors_io import write_file
from ..models import export_family
from ..runtime import Runtime


def write_adapter(base: Path, out: Path, rank: int, seed: int = 0) -> int:
    """Writes the adapter; returns its parameter count."""
    fmt = detect_format(base)
    index = fmt.index(base, Runtime(), None)
    slots = peft_slots(hf_tensors(index.cfg, export_family(index.cfg, index.origin.hf_config)))
    g = torch.Generator().manual_seed(seed)
    tensors = []
    for s in slots:
        tensors.append((PREFIX + s.a, torch.randn(rank, s.shape[1], generator=g) / s.shape[1] ** 0.5))
        tensors.append((PREFIX + s.b, torch.randn(s.shape[0], rank, generator=g) * 0.01))
    out.mkdir(parents=True, exist_ok=True)
    write_file(out / WEIGHTS, tensors)
    (out / CONFIG).write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": sorted(
            {s.name.rsplit(".", 1)[-1] for s in slots}), "base_model_name_or_path": str(base.resolve()),
        "bias": "none", "task_type": "CAUSAL_LM"}, indent=2))
    return sum(t.numel() for _, t in tensors)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dist_convert.bench.synth_lora", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    write_adapter(a.base, a.out, a.rank, a.seed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
