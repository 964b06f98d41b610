"""The layout table checked against megatron-core's own ``sharded_state_dict()`` and ``state_dict()``:
for several layouts, the torch_dist chunks and legacy rank files dist_convert would write are exactly
the ones megatron-core asks for (keys, global shapes, offsets, local shapes, extra-state objects), and the
parameter order the optimizer reader derives is megatron-core's own."""
from __future__ import annotations

import json

import pytest
import torch

from dist_convert.config import ModelConfig
from dist_convert.datamodel import Target
from dist_convert.formats.megatron import extra_state_keys, rank_entries
from dist_convert.formats.torch_dist import TorchDistFormat
from dist_convert.layout.rules import logical_tensors
from dist_convert.layout.topology import Layout
from dist_convert.optim.buckets import module_order
from dist_convert.optim.state import is_parameter

from conftest import CONFIGS, oracle
from flat_config import flat_config


def model_config(cfg: dict) -> ModelConfig:
    heads = cfg["num_attention_heads"]
    return flat_config(
        num_layers=cfg["num_layers"], hidden_size=cfg["hidden_size"], ffn_hidden_size=cfg["ffn_hidden_size"],
        num_attention_heads=heads, num_query_groups=cfg["num_query_groups"],
        kv_channels=cfg["hidden_size"] // heads, swiglu=cfg["swiglu"], normalization=cfg["normalization"],
        add_bias_linear=cfg["add_bias_linear"], add_qkv_bias=cfg["add_qkv_bias"] or cfg["add_bias_linear"],
        untie_embeddings_and_output_weights=cfg["untie_embeddings_and_output_weights"], vocab_size=cfg["vocab_size"],
        make_vocab_size_divisible_by=cfg["make_vocab_size_divisible_by"],
        position_embedding_type=cfg["position_embedding_type"], max_position_embeddings=cfg["max_position_embeddings"],
        qk_layernorm=cfg.get("qk_layernorm", False), spec="local")


def assert_torch_dist_matches(ranks: list[dict], cfg: ModelConfig, layout: Layout) -> None:
    """The torch_dist chunks and objects dist_convert writes at ``layout`` are the union of megatron-core's
    main-replica ShardedTensors (key, global shape, offsets, sizes with leading axes) and ShardedObjects."""
    want_tensors, want_objects = set(), set()
    for r in ranks:
        for key, gshape, offs, local in r["tensors"]:
            sizes = [1] * (len(gshape) - len(local)) + local
            want_tensors.add((key, tuple(gshape), tuple(offs), tuple(sizes)))
        want_objects.update(r["objects"])
    dtypes = dict.fromkeys(logical_tensors(cfg), torch.float32)
    files = TorchDistFormat().target_files(Target(cfg=cfg, layout=layout, dtype=torch.float32, args=None, iteration=1),
                                           dtypes)
    got_tensors = {(t.key, tuple(t.global_shape), tuple(t.offsets), tuple(t.shape)) for f in files for t in f.tensors}
    assert got_tensors == want_tensors
    assert {k for f in files for k in f.objects} == want_objects


def assert_legacy_matches(ranks: list[dict], cfg: ModelConfig, layout: Layout) -> None:
    """Each legacy rank file holds exactly megatron-core's model.state_dict() of that rank, same shapes; its
    parameters in megatron-core's named_parameters() order are what the optimizer reader lays out in buckets."""
    for r in ranks:
        entries = rank_entries(cfg, layout, r["tp_rank"], r["pp_rank"], "local")
        got = {k: list(shape) for k, (shape, _) in entries.items()}
        got.update({k: None for k in extra_state_keys(cfg, layout, r["pp_rank"], "local")})
        assert got == r["state_dict"], (r["tp_rank"], r["pp_rank"])
        params = [k for k, (_, pieces) in entries.items() if all(is_parameter(p.logical) for p in pieces)]
        assert module_order(params) == r["params"], (r["tp_rank"], r["pp_rank"])


LAYOUTS = [("A", Layout(tp=2, pp=2)), ("B", Layout(tp=2, pp=2, first=2)), ("B", Layout(tp=4, pp=1))]


@pytest.mark.parametrize("name,layout", LAYOUTS, ids=[f"{n}-{lay.tp}x{lay.pp}" for n, lay in LAYOUTS])
def test_table_matches_megatron_core(tmp_path, name, layout):
    cfg_dict = CONFIGS[name][0]
    config = tmp_path / "c.json"
    config.write_text(json.dumps(cfg_dict))
    out = tmp_path / "layout.json"
    extra = ["--first", str(layout.first)] if layout.first else []
    oracle("layout", layout.tp * layout.pp, "--config", str(config), "--tp", str(layout.tp), "--pp",
           str(layout.pp), *extra, "--out", str(out))
    ranks = json.loads(out.read_text())
    cfg = model_config(cfg_dict)

    assert_torch_dist_matches(ranks, cfg, layout)
    assert_legacy_matches(ranks, cfg, layout)


def test_mla_mtp_table_matches_megatron_core(tmp_path, q_lora=32):
    """DeepSeek-class (MLA with q LoRA + dense and MoE layers + an MTP layer on the last stage), megatron-core's
    local spec: its keys differ from TE's and its down-projections are column-parallel. (Without q LoRA,
    megatron-core's strict loads of the DeepseekV2 import in tests/test_deepseek.py check the q_proj names.)"""
    import argparse

    from dist_convert.config import config_from_args

    from hf_models import DEEPSEEK, deepseek_oracle_config

    cfg_dict = deepseek_oracle_config({**DEEPSEEK, "q_lora_rank": q_lora, "num_nextn_predict_layers": 1,
                                       "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
                                       "rms_norm_eps": 1e-6, "max_position_embeddings": 64})
    layout = Layout(tp=2, pp=2, first=1)
    config = tmp_path / "c.json"
    config.write_text(json.dumps(cfg_dict))
    out = tmp_path / "layout.json"
    oracle("layout", 4, "--config", str(config), "--tp", "2", "--pp", "2", "--first", "1", "--out", str(out))
    ranks = json.loads(out.read_text())
    cfg = config_from_args(argparse.Namespace(**cfg_dict), None, "local", 2)
    assert cfg.mla and cfg.mla.down_split and cfg.mtp_num_layers == 1
    assert_torch_dist_matches(ranks, cfg, layout)
    assert_legacy_matches(ranks, cfg, layout)


@pytest.mark.parametrize("tp,ep,etp", [(2, 2, 1), (1, 2, None)], ids=["tp2-ep2-etp1", "tp1-ep2"])
def test_gpt_oss_table_matches_megatron_core(tmp_path, tp, ep, etp):
    """gpt-oss (tests/gpt_oss_models.py's config): attention sinks (core_attention.softmax_offset, split over TP
    with the heads), q/k/v/o, router and expert biases, head_dim != hidden / heads, every layer MoE; megatron-core
    takes MoE biases only at ETP 1, and legacy files exist only with ETP = TP (the second layout)."""
    import argparse

    from gpt_oss_models import CONFIG, oracle_config_of

    from dist_convert.config import config_from_args
    from dist_convert.formats.megatron import extra_state_keys, rank_entries

    cfg_dict = oracle_config_of(CONFIG)
    config = tmp_path / "c.json"
    config.write_text(json.dumps(cfg_dict))
    out = tmp_path / "layout.json"
    flags = ["--tp", str(tp), "--ep", str(ep)] + (["--etp", str(etp)] if etp else [])
    oracle("layout", 2, "--config", str(config), *flags, "--out", str(out))
    ranks = json.loads(out.read_text())
    cfg = config_from_args(argparse.Namespace(**cfg_dict), None, "local", tp)
    assert cfg.attention.softmax_type == "learnable" and cfg.mlp.activation == "quick_gelu" and cfg.kv_channels == 24
    layout = Layout(tp=tp, pp=1, ep=ep, etp=etp)
    assert_torch_dist_matches(ranks, cfg, layout)
    assert any(k.endswith("core_attention.softmax_offset") for r in ranks for k in r["state_dict"])
    if etp is None:
        for r in ranks:
            entries = rank_entries(cfg, layout, r["tp_rank"], r["pp_rank"], "local", r["ep_rank"])
            got = {k: list(shape) for k, (shape, _) in entries.items()}
            got.update({k: None for k in extra_state_keys(cfg, layout, r["pp_rank"], "local")})
            assert got == r["state_dict"], (r["tp_rank"], r["ep_rank"])
