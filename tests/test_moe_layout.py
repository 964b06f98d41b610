"""The layout table's MoE rows and expert placement, pure (issue 9). Expected names and
shapes are what megatron-core 0.16.1's GPTModel (local spec, SequentialMLP) stores for this tiny
model: 2 layers, hidden 32, 4 experts of FFN 16, a gated shared expert of 24, moe_layer_freq [0, 1]."""
from __future__ import annotations

import argparse

import pytest

from dist_convert.config import ModelConfig, config_from_args, moe_layer_pattern
from dist_convert.errors import ConvertError
from dist_convert.layout.boxes import Kind
from dist_convert.layout.rules import logical_tensors, torch_dist_key
from dist_convert.layout.topology import Layout

from flat_config import flat_config, with_flat

MOE = dict(num_experts=4, moe_ffn_hidden_size=16, moe_layer_pattern=(0, 1), moe_shared_expert_intermediate_size=24,
           moe_shared_expert_gate=True)


def _cfg(**kw) -> ModelConfig:
    return flat_config(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=4,
                       kv_channels=8, swiglu=True, normalization="RMSNorm", add_bias_linear=False, add_qkv_bias=False,
                       untie_embeddings_and_output_weights=False, vocab_size=128, make_vocab_size_divisible_by=16,
                       position_embedding_type="rope", max_position_embeddings=None, qk_layernorm=False, spec="local",
                       **MOE) if not kw else with_flat(_cfg(), **kw)


def test_moe_layer_names_shapes_and_kinds():
    t = logical_tensors(_cfg())
    layer1 = {n.removeprefix("decoder.layers.1."): (v.shape, v.kind, v.expert) for n, v in t.items()
              if n.startswith("decoder.layers.1.mlp.")}
    expected = {"mlp.router.weight": ((4, 32), Kind.REP, None),
                "mlp.shared_experts.linear_fc1.weight": ((48, 32), Kind.GLU, None),
                "mlp.shared_experts.linear_fc2.weight": ((32, 24), Kind.ROW, None),
                "mlp.shared_experts.gate_weight": ((1, 32), Kind.REP, None)}
    for e in range(4):
        expected[f"mlp.experts.local_experts.{e}.linear_fc1.weight"] = ((32, 32), Kind.GLU, e)
        expected[f"mlp.experts.local_experts.{e}.linear_fc2.weight"] = ((32, 16), Kind.ROW, e)
    assert layer1 == expected
    assert {n for n in t if n.startswith("decoder.layers.0.mlp.")} == {"decoder.layers.0.mlp.linear_fc1.weight",
                                                                      "decoder.layers.0.mlp.linear_fc2.weight"}
    assert t["decoder.layers.0.mlp.linear_fc1.weight"].shape == (128, 32)


def test_moe_torch_dist_keys_and_te_names():
    t = logical_tensors(_cfg(spec="te"))
    assert torch_dist_key(t["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"]) == \
        "decoder.layers.mlp.experts.experts.linear_fc1.weight"
    # TE fuses pre_mlp_layernorm into linear_fc1 only in dense layers: an MoE layer keeps its own TENorm
    # (gpt_layer_specs: no keys map for it); the local spec maps it to the fused name in torch_dist
    assert t["decoder.layers.0.pre_mlp_layernorm.weight"].te_name == "mlp.linear_fc1.layer_norm_weight"
    assert t["decoder.layers.1.pre_mlp_layernorm.weight"].te_name is None
    assert torch_dist_key(t["decoder.layers.1.pre_mlp_layernorm.weight"], True) == \
        "decoder.layers.1.pre_mlp_layernorm.weight"
    local = logical_tensors(_cfg(spec="local"))
    assert torch_dist_key(local["decoder.layers.1.pre_mlp_layernorm.weight"]) == \
        "decoder.layers.mlp.linear_fc1.layer_norm_weight"


def test_router_expert_bias_and_dense_models_unchanged():
    t = logical_tensors(_cfg(moe_router_expert_bias=True, moe_layer_pattern=None))
    assert t["decoder.layers.0.mlp.router.expert_bias"].shape == (4,)
    assert not any(".mlp.linear_fc1." in n for n in t)
    dense = logical_tensors(_cfg(num_experts=0))
    assert not any("expert" in n or "router" in n for n in dense) and len(dense) == 2 * 6 + 2


@pytest.mark.parametrize("freq,expected", [(1, None), (None, None), (2, (1, 0, 1, 0)), ([0, 1, 1, 0], (0, 1, 1, 0))])
def test_moe_layer_freq(freq, expected):
    assert moe_layer_pattern(freq, 4) == expected


@pytest.mark.parametrize("freq", [0, [1, 0], [0, 2, 1, 1]])
def test_bad_moe_layer_freq_is_refused(freq):
    with pytest.raises(ConvertError, match="moe_layer_freq"):
        moe_layer_pattern(freq, 4)


def test_config_from_megatron_args():
    args = argparse.Namespace(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, swiglu=True,
                              vocab_size=128, num_experts=4, moe_ffn_hidden_size=16, moe_layer_freq=[0, 1],
                              moe_shared_expert_intermediate_size=24, moe_shared_expert_gate=True)
    cfg = config_from_args(args, None, "local", 1)
    assert (cfg.num_experts, cfg.expert_ffn, cfg.moe.layer_pattern, cfg.shared_fc1_rows) == (4, 16, (0, 1), 48)
    assert not cfg.is_moe_layer(0) and cfg.is_moe_layer(1)


def test_expert_placement_and_layout_checks():
    lay = Layout(tp=2, pp=1, ep=2)
    assert lay.expert_tp == 2 and str(lay) == "TP=2 PP=1 EP=2 ETP=2"
    assert [list(lay.experts_of(r, 8)) for r in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert str(Layout(tp=2, pp=1)) == "TP=2 PP=1" and Layout(tp=2, etp=1).expert_tp == 1
    lay.validate_experts(8, 16)
    with pytest.raises(ConvertError, match="EP=3 does not divide num_experts=8.*--target-ep"):
        Layout(ep=3).validate_experts(8, 16)
    with pytest.raises(ConvertError, match="ETP=3 does not divide the expert FFN size 16.*--target-etp"):
        Layout(tp=1, etp=3).validate_experts(8, 16)


def test_legacy_rank_dirs_with_expert_rank():
    from dist_convert.formats.megatron import parse_rank_dir, rank_dir_name
    assert rank_dir_name(1, 0, 1) == "mp_rank_01" and rank_dir_name(0, 1, 2) == "mp_rank_00_001"
    assert rank_dir_name(0, 1, 2, 3, 4) == "mp_rank_00_001_003" and rank_dir_name(0, 0, 1, 1, 2) == "mp_rank_00_001"
    # the same name means pipeline rank 1 or expert rank 1: the args decide
    assert parse_rank_dir("mp_rank_00_001", pp=2, ep=1) == (0, 1, 0)
    assert parse_rank_dir("mp_rank_00_001", pp=1, ep=2) == (0, 0, 1)
    assert parse_rank_dir("mp_rank_03_001_002", pp=2, ep=4) == (3, 1, 2)
    assert parse_rank_dir("mp_rank_00_001", pp=2, ep=2) is None and parse_rank_dir("mp_rank_00", pp=2, ep=1) is None
    assert parse_rank_dir("model", pp=1, ep=1) is None
    for t, p, e in [(0, 0, 0), (1, 2, 3)]:
        assert parse_rank_dir(rank_dir_name(t, p, 4, e, 4), 4, 4) == (t, p, e)


def test_legacy_rank_file_of_an_expert_rank():
    from dist_convert.formats.megatron import rank_entries
    cfg = _cfg()
    lay = Layout(tp=1, pp=1, ep=2)
    files = [rank_entries(cfg, lay, 0, 0, "local", ep_rank=e) for e in range(2)]
    experts = [sorted(k for k in f if "local_experts" in k) for f in files]
    assert experts[0] == experts[1] == [f"decoder.layers.1.mlp.experts.local_experts.{i}.linear_fc{j}.weight"
                                        for i in range(2) for j in (1, 2)]
    shape, pieces = files[1]["decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight"]
    assert shape == (32, 32)
    assert {p.logical for p in pieces} == {"decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"}
    shared = set(files[0]) - set(experts[0])
    assert shared == set(files[1]) - set(experts[1]) and "decoder.layers.1.mlp.router.weight" in shared
    tp2 = rank_entries(cfg, Layout(tp=2, pp=1, ep=2), 1, 0, "local", ep_rank=1)
    shape, pieces = tp2["decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight"]
    assert shape == (16, 32) and [p.lbox.offsets[0] for p in pieces] == [8, 24]  # gate and up halves of rank 1


def test_router_expert_bias_is_never_cast():
    """megatron-core keeps router.expert_bias in fp32 whatever the params dtype: --dtype leaves it alone."""
    import torch

    from dist_convert.datamodel import Target
    from dist_convert.formats.megatron import MegatronFormat
    from dist_convert.formats.torch_dist import TorchDistFormat

    cfg = _cfg(moe_router_expert_bias=True)
    dtypes = {n: torch.float32 for n in logical_tensors(cfg)}
    target = Target(cfg=cfg, layout=Layout(tp=2, ep=2), dtype=torch.bfloat16, args=None, iteration=1)
    for fmt in (TorchDistFormat(), MegatronFormat()):
        got = {t.key: t.dtype for f in fmt.target_files(target, dtypes) for t in f.tensors}
        bias = {k: d for k, d in got.items() if k.endswith("router.expert_bias")}
        assert bias and set(bias.values()) == {torch.float32}, fmt.name
        assert {d for k, d in got.items() if k not in bias} == {torch.bfloat16}, fmt.name
