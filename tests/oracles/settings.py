"""The settings oracle: megatron-core GPT models built as Megatron-LM builds them from a training run's args (every
args field a TransformerConfig field shares passed on, --swiglu / --squared-relu / --openai-gelu / --quick-geglu
choosing the activation, GPTModel's RoPE arguments), on CPU (gloo, one rank, the local layer spec, oracles.mcore's
CPU shims).

  make   --cases CASES.json --out DIR   each case (Megatron-LM arg names) built with seeded random weights, saved
                                        torch_dist under DIR/<case> with its args, its logits in DIR/<case>.pt
  logits --ckpts A,B,... --out DIR     each torch_dist checkpoint's model built from the args it stores, loaded
                                        strictly, its logits on DIR/tokens.pt's tokens in DIR/<name>.pt

One process judges every case of a table: the suite's settings tables (tests/test_fidelity.py) build and judge all
their models in one call each.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/

from oracles import mcore as mo

SEED, TOKENS_SEED = 11, 1234


def config_of(settings: dict) -> dict:
    """The oracles.mcore config of Megatron-LM-style ``settings`` (its defaults filled as Megatron-LM's are)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(settings, f)
    try:
        return mo.load_config(f.name)
    finally:
        os.unlink(f.name)


def logits_of(model, cfg: dict, tokens):
    import torch

    s = tokens.shape[1]
    position_ids = torch.arange(s).unsqueeze(0).expand_as(tokens)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1).view(1, 1, s, s).expand(tokens.shape[0], 1, s, s)
    model.eval()
    with torch.no_grad():
        return model(tokens, position_ids, mask)[..., : cfg["vocab_size"]].contiguous()


def cmd_make(a) -> int:
    import torch
    from megatron.core import dist_checkpointing

    with open(a.cases) as f:
        cases = json.load(f)
    for name, settings in cases.items():
        cfg = config_of(settings)
        model = mo.build_model(cfg, 1, 1, parallel_output=False)
        mo.randomize(model, cfg, SEED)
        tokens = torch.randint(0, cfg["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(TOKENS_SEED))
        torch.save({"tokens": tokens, "logits": logits_of(model, cfg, tokens)}, os.path.join(a.out, f"{name}.pt"))
        d = os.path.join(a.out, name, mo.iter_dir_name(1))
        os.makedirs(d)
        state = {"model": mo.sharded_sd(model), "args": mo.make_args(cfg, 1, 1, None, None, 1, "torch_dist"),
                 "iteration": 1, "checkpoint_version": 3.0}
        dist_checkpointing.save(state, d)
        with open(os.path.join(a.out, name, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("1")
    print(f"ORACLE MADE {len(cases)} cases", flush=True)
    return 0


def cmd_logits(a) -> int:
    """Each checkpoint's model from its own stored args: what megatron-core computes with what was written."""
    import torch
    from megatron.core import dist_checkpointing

    tokens = torch.load(os.path.join(a.out, "tokens.pt"))
    for path in a.ckpts.split(","):
        iterdir = mo.resolve_iter_dir(path)
        args = dist_checkpointing.load_common_state_dict(iterdir)["args"]
        cfg = config_of({k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool, list, tuple))
                         or v is None})
        model = mo.build_model(cfg, 1, 1, parallel_output=False)
        mo.randomize(model, cfg, 3_000_017)  # nothing the checkpoint lacks passes as loaded
        mo.load_into(model, path, "torch_dist", 1, cfg, 1)
        name = os.path.basename(os.path.normpath(path))
        torch.save(logits_of(model, cfg, tokens), os.path.join(a.out, f"{name}.pt"))
    print("ORACLE LOGITS", flush=True)
    return 0


def main(argv=None, serving=False) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("make")
    sp.add_argument("--cases", required=True)
    sp.add_argument("--out", required=True)
    sp = sub.add_parser("logits")
    sp.add_argument("--ckpts", required=True)
    sp.add_argument("--out", required=True)
    a = p.parse_args(argv)
    mo.apply_cpu_shims()
    mo.init_parallel(1, 1)
    try:
        return cmd_make(a) if a.cmd == "make" else cmd_logits(a)
    finally:
        mo.end_parallel(serving)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
