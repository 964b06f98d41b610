"""The training runs the tests share (tests/oracles/train.py make: megatron-core DDP with the distributed optimizer,
two Adam steps, saved the way Megatron-LM's save_checkpoint does), each made once per session at its first use
through the ``trained`` fixture (registered in conftest.py)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import CONFIGS, made_once, oracle

MOE_M = {"num_layers": 4, "hidden_size": 32, "ffn_hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
         "swiglu": True, "normalization": "RMSNorm", "add_bias_linear": False, "vocab_size": 100,
         "make_vocab_size_divisible_by": 16, "position_embedding_type": "rope", "max_position_embeddings": 32,
         "seq_length": 32, "num_experts": 4, "moe_ffn_hidden_size": 16, "moe_shared_expert_intermediate_size": 24,
         "moe_shared_expert_gate": True, "moe_layer_freq": [0, 1, 0, 1], "moe_router_topk": 2,
         "moe_router_enable_expert_bias": True, "moe_router_score_function": "sigmoid"}

BUCKET_SIZE = 20_000  # config A at TP=1: five buckets

# the training runs, each made once per session with every save kind it is used with: (runtime, name) ->
# (config, tp, ep, save kinds, DDP bucket size: None for one bucket per buffer); world 2 each (TP=2 DP=1;
# TP=1 DP=2 with EP=2; TP=1 DP=2 with several buckets, whose fully_reshardable optimizer state megatron-core
# 0.16-0.19 saves shifted (Megatron-LM PR 5077): only its weights are used)
RUNS = {
    ("default", "tp2"): (CONFIGS["A"][0], 2, 1, ("dp_reshardable", "fully_reshardable", "torch"), None),
    ("default", "moe-ep2"): (MOE_M, 1, 2, ("dp_reshardable", "fully_reshardable", "torch"), None),
    ("mcore19", "tp2"): (CONFIGS["A"][0], 2, 1, ("dp_reshardable", "fully_reshardable", "torch"), None),
    ("mcore19", "dp2"): (CONFIGS["A"][0], 1, 1, ("dp_reshardable", "fully_reshardable", "torch"), BUCKET_SIZE),
}
WORLD = 2


@dataclass(frozen=True, kw_only=True)
class Run:
    runtime: str
    config: Path
    root: Path
    cfg: dict
    bucket_size: int | None = None  # DDP buckets of about this many parameters (None: one per buffer)

    def source(self, kind: str) -> Path:
        return self.root / kind

    @property
    def reference(self) -> Path:
        return self.root / "reference"


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """``trained(runtime, name)``: that training run's checkpoints, made at its first use in the run (made_once)."""
    def get(runtime: str, name: str) -> Run:
        cfg, tp, ep, kinds, bucket_size = RUNS[runtime, name]

        def make(root: Path) -> None:
            (root / "config.json").write_text(json.dumps(cfg))
            res = oracle("make", WORLD, "--config", str(root / "config.json"), "--tp", str(tp), "--ep", str(ep),
                         "--seed", "4321", "--out", str(root), *[f"--save-kind={k}" for k in kinds],
                         *(["--bucket-size", str(bucket_size)] if bucket_size else []), program="train",
                         runtime=runtime)
            assert "TRAIN ORACLE SAVED" in res.stdout, res.stdout[-2000:]

        root = made_once(tmp_path_factory, f"train-{runtime}-{name}", make)
        return Run(runtime=runtime, config=root / "config.json", root=root, cfg=cfg, bucket_size=bucket_size)

    return get
