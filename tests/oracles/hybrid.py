"""Oracle for megatron-core's HybridModel (``megatron/core/models/hybrid``, megatron-core 0.19.2; the successor of
GPTModel): builds the model from a GPT config (``tests/oracles/mcore.py``'s JSON) and a hybrid layer pattern, loads a
checkpoint into it strictly and computes its logits the way ``mcore.py logits`` does for a GPTModel, so the two can
be compared. Runs in the second runtime (.venv-mcore19); imports megatron-core only (never dist_convert).

  torchrun --nproc_per_node=N tests/oracles/hybrid.py logits --config C.json --pattern P --tp T [--ep E] --ckpt X \
      --out F.pt

The HybridStack spec the checkpoint's args name (``spec``, imported as Megatron-LM's hybrid builder imports its
``--spec`` under ``--use-checkpoint-args``; megatron-core's own ``hybrid_stack_spec`` where none is named) builds the
model (rank 0 prints ``ORACLE SPEC module.name``), its Transformer Engine classes stood in by CPU modules
of the same names and state (``oracles.nemotron_h.cpu_hybrid_stack_spec``: each swapped slot must hold the expected
TE class; MoE layers: TEGroupedMLP over stand-in grouped linears; the q/k norms megatron-core 0.19's SelfAttention
builds from ``qk_layernorm`` where the spec names none: TENorm, stood in too). The TransformerConfig is mcore.py's
(``transformer_config``) with ``num_layers`` = the pattern's length.
The checkpoint is loaded with dist_checkpointing.load(StrictHandling.RAISE_ALL) (no missing, no unexpected key),
TE's check of each ``_extra_state`` and load_state_dict (``oracles.te_cpu.load_strict``); the model is randomised
first so nothing it lacks passes as loaded. Rank 0 saves {"tokens", "logits"} (the true vocabulary's columns,
gathered over TP) and prints ``ORACLE LOGITS <shape> -> F.pt``; a failed strict load exits 1 naming the problems.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the oracles package


def build(cfg: dict, pattern: str, tp: int, ep: int = 1, stack=None):
    """megatron-core's HybridModel of ``cfg`` with ``pattern`` and the HybridStack spec ``stack`` (None:
    megatron-core's own), on the CPU (see the module docstring)."""
    from megatron.core.models.hybrid import hybrid_block
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    from oracles import mcore, nemotron_h

    config = mcore.transformer_config({**cfg, "num_layers": len(pattern)}, tp, 1, ep=ep)
    for k, v in nemotron_h.CPU_SWITCHES.items():
        if hasattr(config, k):
            setattr(config, k, v)
    from megatron.core.transformer import attention

    # HybridStack's final norm, and the q/k norms SelfAttention builds from config.qk_layernorm where its spec names
    # none (TENorm, imported by name in each module; None without TE)
    saved = hybrid_block.TENorm, attention.TENorm
    hybrid_block.TENorm = attention.TENorm = nemotron_h.standins()["norm"]
    try:
        model = HybridModel(config=config, hybrid_stack_spec=nemotron_h.cpu_hybrid_stack_spec(stack),
                            vocab_size=mcore.padded_vocab(cfg, tp), max_sequence_length=cfg["max_position_embeddings"],
                            hybrid_layer_pattern=pattern, parallel_output=False,
                            share_embeddings_and_output_weights=not cfg["untie_embeddings_and_output_weights"],
                            position_embedding_type=cfg["position_embedding_type"],
                            rotary_percent=cfg.get("rotary_percent", 1.0), rotary_base=cfg.get("rotary_base", 10000))
    finally:
        hybrid_block.TENorm, attention.TENorm = saved
    return model


def cmd_logits(a) -> int:
    import torch
    import torch.distributed as dist
    from megatron.core.transformer.spec_utils import import_module

    from oracles import mcore, nemotron_h
    from oracles.common import resolve_iter_dir, stored_args
    from oracles.te_cpu import load_strict

    nemotron_h.apply_shims()
    cfg = mcore.load_config(a.config)
    iter_dir = Path(resolve_iter_dir(a.ckpt))
    spec = getattr(stored_args(iter_dir), "spec", None)
    mcore.init_parallel(a.tp, 1, ep=a.ep, cfg=cfg)
    try:
        model = build(cfg, a.pattern, a.tp, a.ep, import_module(spec) if spec else None)
        with torch.no_grad():
            for p in model.parameters():
                p.uniform_(-3.0, 3.0)  # nothing the checkpoint lacks passes as loaded
        problems: list[str] = []
        load_strict([model], iter_dir, problems)
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, problems)
        problems = [f"rank {r}: {p}" for r, ps in enumerate(every) for p in ps]
        if problems:
            if dist.get_rank() == 0:
                print(json.dumps({"ok": False, "problems": problems[:50]}), flush=True)
            return 1
        model.eval()
        tokens, position_ids, mask = mcore.causal_inputs(cfg, a.seed)
        with torch.no_grad():
            logits = model(tokens, position_ids, mask)[..., : cfg["vocab_size"]].contiguous()
        if dist.get_rank() == 0:
            os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
            torch.save({"tokens": tokens, "logits": logits}, a.out)
            print(f"ORACLE SPEC {'.'.join(spec) if spec else None}", flush=True)
            print(f"ORACLE LOGITS {tuple(logits.shape)} -> {a.out}", flush=True)
        return 0
    finally:
        from oracles.common import end_parallel

        end_parallel(a.serving)


def main(argv=None, serving=False) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("logits")
    sp.add_argument("--config", required=True)
    sp.add_argument("--pattern", required=True, help="the hybrid layer pattern (M, *, -, E)")
    sp.add_argument("--tp", type=int, required=True)
    sp.add_argument("--ep", type=int, default=1, help="expert parallel (MoE configs; world = TP * DP)")
    sp.add_argument("--ckpt", required=True)
    sp.add_argument("--out", required=True)
    sp.add_argument("--seed", type=int, default=1234, help="the tokens' seed (mcore.py logits' default)")
    a = p.parse_args(argv)
    a.serving = serving
    return cmd_logits(a)


if __name__ == "__main__":
    from oracles.common import run_program

    run_program(main)
