"""The layout table for DeepSeek-class models, without processes: multi-latent attention per layer spec,
MTP layers and their placement, the DeepSeek HF names, block-scaled FP8 slices, and the planner at
DeepSeek-V3's real shape (671B, 256 experts, MTP) over 128 ranks."""
from __future__ import annotations

import pytest
import torch
from test_layout import cfg as dense_cfg

from dist_convert.bench.plan_scale import DEEPSEEK_V3, plan_case
from dist_convert.errors import ConvertError
from dist_convert.formats import fp8
from dist_convert.formats.dist_keys import dist_groups
from dist_convert.formats.hf import hf_tensors
from dist_convert.layout.boxes import Box, Kind
from dist_convert.layout.rules import logical_tensors
from dist_convert.layout.topology import Layout
from dist_convert.models import config_from_hf, hf_from_config

from hf_models import dequant_fp8

MLA = dict(multi_latent_attention=True, q_lora_rank=32, kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8,
           v_head_dim=16, qk_layernorm=True, num_query_groups=4, num_layers=3, num_experts=8, moe_ffn_hidden_size=32,
           moe_layer_pattern=(0, 1, 1), moe_shared_expert_intermediate_size=32, moe_router_expert_bias=True)


def cfg(**kw):
    return dense_cfg(**{**MLA, **kw})


def test_mla_shapes_and_splits_follow_megatron_core():
    t = logical_tensors(cfg(spec="te"))
    a = "decoder.layers.0.self_attention."
    assert t[a + "linear_q_down_proj.weight"].shape == (32, 64)
    assert t[a + "linear_q_up_proj.weight"].shape == (4 * 24, 32)  # heads x (qk_head_dim + rope)
    assert t[a + "linear_kv_down_proj.weight"].shape == (32 + 8, 64)  # [compressed kv | k_pe]
    assert t[a + "linear_kv_up_proj.weight"].shape == (4 * (16 + 16), 32)  # per head [k_nope | v]
    assert t[a + "linear_proj.weight"].shape == (64, 4 * 16)
    assert not any("linear_qkv" in n or "k_layernorm" in n for n in t)
    # TE replicates the down-projections (TELinear "duplicated"), the local spec splits them over TP
    assert t[a + "linear_kv_down_proj.weight"].kind is Kind.REP
    assert logical_tensors(cfg(spec="local", mla_down_split=True))[a + "linear_kv_down_proj.weight"].kind is Kind.COL
    no_q = logical_tensors(cfg(q_lora_rank=None))
    assert no_q[a + "linear_q_proj.weight"].shape == (96, 64)
    assert not any("q_down" in n or "q_up" in n or "q_layernorm" in n for n in no_q)


def test_mla_torch_dist_keys_follow_each_spec():
    """The MLA specs have no key map: local and TE keys differ (unlike the GQA specs)."""
    te = set(dist_groups(cfg(spec="te")))
    local = set(dist_groups(cfg(spec="local", mla_down_split=True)))
    p = "decoder.layers.0."
    assert {p + "self_attention.linear_q_up_proj.layer_norm_weight",
            p + "self_attention.linear_kv_up_proj.layer_norm_weight", p + "input_layernorm.weight",
            p + "mlp.linear_fc1.layer_norm_weight"} <= te
    assert {p + "self_attention.q_layernorm.weight", p + "self_attention.kv_layernorm.weight",
            p + "input_layernorm.weight", p + "pre_mlp_layernorm.weight"} <= local
    assert "decoder.layers.1.pre_mlp_layernorm.weight" in te  # an MoE layer keeps its own norm


def test_mtp_layer_sits_on_the_last_stage_or_where_the_string_puts_it():
    c = cfg(mtp_num_layers=1)
    names = logical_tensors(c)
    assert "mtp.layers.0.eh_proj.weight" in names and names["mtp.layers.0.eh_proj.weight"].shape == (64, 128)
    assert "mtp.layers.0.transformer_layer.mlp.router.expert_bias" in names  # built like the last (MoE) layer
    assert "mtp.layers.0.transformer_layer.self_attention.linear_kv_up_proj.weight" in names
    keys = dist_groups(c)
    assert keys["mtp.layers.0.transformer_layer.mlp.experts.experts.linear_fc1.weight"].lead == (8,)  # no layer axis
    assert keys["mtp.layers.0.enorm.weight"].lead == ()
    assert Layout(tp=1, pp=2, first=1).stack_chunks(c.stacks)[-1] == (1, 0, "mtp", 0, 1)
    lay = Layout(tp=1, pp=2, vpp=2, pipeline_layout="Et|t|t|mL")
    c.check_layout(lay)
    assert [x for x in lay.stack_chunks(c.stacks) if x[2] == "mtp"] == [(1, 1, "mtp", 0, 1)]
    with pytest.raises(ConvertError, match="places 0 MTP layers"):
        c.check_layout(Layout(tp=1, pp=2, pipeline_layout="Et|ttL"))


def test_local_spec_refuses_a_tp_that_cannot_split_the_down_projections():
    with pytest.raises(ConvertError) as e:
        cfg(spec="local", mla_down_split=True, q_lora_rank=30).check_layout(Layout(tp=4, pp=1))
    assert "q_lora_rank=30" in str(e.value) and "--target-spec te" in str(e.value)
    cfg(spec="te", q_lora_rank=30).check_layout(Layout(tp=4, pp=1))  # replicated: any TP dividing the heads


def test_legacy_rank_files_tell_split_down_projections_by_their_shape():
    """Transformer Engine specs before TELinear's "duplicated" split MLA's down-projections over TP like the
    local spec: a TP rank file's kv_down_proj rows say which (40 rows whole, 20 at TP=2 split)."""
    from dist_convert.formats.megatron import _mla_down_split

    key = "decoder.layers.0.self_attention.linear_kv_down_proj.weight"
    c = cfg(spec="te")
    assert not _mla_down_split(c, {key: ((40, 64), torch.bfloat16)})
    assert _mla_down_split(c, {key: ((20, 64), torch.bfloat16)})
    assert not _mla_down_split(dense_cfg(), {})


def test_deepseek_v3_config_and_names():
    c, args, _ = config_from_hf(DEEPSEEK_V3, None)
    assert (c.num_experts, c.moe.layer_pattern[:4], c.mtp_num_layers) == (256, (0, 0, 0, 1), 1)
    assert (args.moe_router_score_function, args.moe_router_num_groups, args.moe_router_group_topk) == ("sigmoid", 8, 4)
    assert (args.rope_type, args.rotary_scaling_factor, args.moe_router_topk_scaling_factor) == ("yarn", 40.0, 2.5)
    names = hf_tensors(c)
    # MTP: its own 4 and 2 copies, then a decoder layer: 9 MLA + norms, router + bias, experts, shared expert
    assert sum(1 for n in names if n.startswith("model.layers.61.")) == 4 + 2 + 9 + 2 + 256 * 3 + 3
    logical = {p.logical for _, pieces in names.values() for p in pieces}
    assert logical == set(logical_tensors(c))  # every logical tensor has an HF name
    assert names["model.layers.61.shared_head.head.weight"][1][0].logical == "output_layer.weight"
    back = hf_from_config(c, torch.bfloat16, base=DEEPSEEK_V3)
    for k in ("n_routed_experts", "first_k_dense_replace", "n_group", "topk_group", "q_lora_rank", "kv_lora_rank",
              "num_nextn_predict_layers", "routed_scaling_factor", "rope_scaling", "qk_rope_head_dim"):
        assert back[k] == DEEPSEEK_V3[k], k


def test_kimi_k2_style_config_imports():
    """Kimi-K2's config: DeepseekV3ForCausalLM with 384 experts in one group, one dense layer, YaRN factor 32."""
    kimi = {**DEEPSEEK_V3, "model_type": "kimi_k2", "n_routed_experts": 384, "n_group": 1, "topk_group": 1,
            "first_k_dense_replace": 1, "num_attention_heads": 64, "num_key_value_heads": 64,
            "num_nextn_predict_layers": 0, "rope_scaling": {**DEEPSEEK_V3["rope_scaling"], "factor": 32.0}}
    c, args, _ = config_from_hf(kimi, None)
    assert (c.num_experts, c.moe.layer_pattern[:2], c.mtp_num_layers) == (384, (0, 1), 0)
    assert getattr(args, "moe_router_num_groups", None) is None  # one group: no group-limited routing
    assert hf_from_config(c, torch.bfloat16, base=kimi)["model_type"] == "kimi_k2"


@pytest.mark.parametrize("change,needle", [
    ({"attention_bias": True}, "attention_bias"),
    ({"num_experts_per_tok": 6, "topk_group": 2}, "topk_group"),
    ({"rope_interleave": False}, "rope_interleave"),
])
def test_deepseek_configs_megatron_core_cannot_express_are_refused(change, needle):
    with pytest.raises(ConvertError) as e:
        config_from_hf({**DEEPSEEK_V3, **change}, None)
    assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("shape,box", [((300, 200), Box((0, 0), (300, 200))), ((300, 200), Box((100, 60), (150, 77))),
                                       ((129, 129), Box((127, 1), (2, 128))), ((96, 64), Box((48, 0), (48, 64)))])
def test_fp8_slices_dequantize_like_the_whole_matrix(shape, box):
    w = torch.randn(shape) * 3
    q, s = fp8.quantize(w)
    assert s.shape == fp8.scale_grid(shape, (128, 128))
    whole = dequant_fp8(q, s)  # an independent implementation of the release's formula
    part = fp8.dequantize(q[box.slices()], s[fp8.scale_box(box, (128, 128)).slices()], box, (128, 128),
                          torch.float32)
    assert torch.equal(part, whole[box.slices()])
    q2, s2 = fp8.quantize(whole)  # exact round trip through fp32
    assert torch.equal(s2, s) and torch.equal(q2.view(torch.uint8), q.view(torch.uint8))


@pytest.mark.parametrize("case,params,write_max", [("gpt-oss-120b hf -> TP1 PP4 EP16", 116.8e9, 1.45),
                                                   ("GLM-4.5 hf -> TP4 PP8 EP16", 356.7e9, 1.2),
                                                   ("Nemotron-3-Nano hf -> TP1 PP2 EP16", 31.58e9, 1.35),
                                                   ("Qwen3-VL-235B-A22B hf -> TP4 PP4 EP16", 235.67e9, 1.15),
                                                   ("DeepSeek-V3.2 hf -> TP8 PP16 EP64", 683.50e9, 1.05),
                                                   ("GLM-5 hf -> TP4 PP8 EP16", 753.86e9, 1.16)],
                         ids=["gpt-oss-120b", "GLM-4.5", "Nemotron-3-Nano", "Qwen3-VL-235B-A22B", "DeepSeek-V3.2",
                              "GLM-5"])
def test_planner_at_gpt_oss_glm_and_nemotron_scale(case, params, write_max):
    """gpt-oss-120b (36 layers, 128 experts) over 64 ranks, GLM-4.5 (92 layers, 160 experts, its MTP layer placed
    by a layout string) over 128, Nemotron-3-Nano (52 Mamba2 / MoE / attention layers) over 32 and Qwen3-VL-235B-A22B
    (94 MoE layers, its vision tower on the first stage) over 64, DeepSeek-V3.2 (V3 with an indexer per layer) and
    GLM-5 (78 sparse-attention layers, 256 experts, MTP; 744B without its MTP layer) over 128 (DeepSeek-V3.2's case
    is bench --plan-scale's DeepSeek-V3 release with an indexer per layer, so it stands for V3 too): every rank reads
    and writes about its share (the first and last stages hold the embedding and the output layer on top; Nemotron's
    first expert rank holds every Mamba2 mixer, its files are cut so that other ranks write parts of them).
    Qwen3-Next-80B's case (79.67B, the published count) is bench --plan-scale's: it plans 78k chunks in ~25 s."""
    f = plan_case(case)
    share = f.params * 2 / f.world
    assert abs(f.params - params) < 0.1e9 and f.waves >= 1
    assert 0.8 * share <= f.write_min and f.write_max <= write_max * share
    assert 0.8 * share <= f.read_min and f.read_max <= 1.16 * share
