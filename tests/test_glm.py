"""GLM-4.5 / 4.6 / 4.7 (``Glm4MoeForCausalLM``, dist_convert/models/glm.py): GQA attention with q/k/v biases and
per-head q/k norm, partial RoPE (megatron-core's rotary_percent), DeepSeek-V3's MoE and MTP layers.

Processes: a tiny random Glm4MoeForCausalLM made by transformers (an MTP layer added as the releases store it)
converts to torch_dist at TP=2 EP=2 ETP=1 and to legacy files at TP=1 PP=2 under torchrun; megatron-core
(tests/oracles/mcore.py) loads each strictly with the stored args checked, gives transformers' logits and runs
its MTP forward; the way back to HF is bit-exact with the same config.json and loads cleanly in transformers.
Pure: GLM-4.5's real config.json, which family a model exports as, optional MTP copies, the refusals."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dist_convert.errors import ConvertError
from dist_convert.features.expressed import describe_all
from dist_convert.formats.hf import hf_tensors, source_tensors
from dist_convert.models import FAMILIES, config_from_hf, export_family, hf_from_config
from dist_convert.models.glm import Glm4Moe

from conftest import ok, oracle, run_cli
from flat_config import with_flat
from hf_models import add_mtp_layer, assert_bit_exact, hf_logits, make_hf_model, oracle_config

# GLM-4.5 (zai-org/GLM-4.5 config.json, the values that shape it): 355B parameters, 92 layers, 1 MTP layer
GLM45 = {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "attention_bias": True, "head_dim": 128,
         "hidden_act": "silu", "hidden_size": 5120, "partial_rotary_factor": 0.5, "intermediate_size": 12288,
         "max_position_embeddings": 131072, "moe_intermediate_size": 1536, "norm_topk_prob": True,
         "num_attention_heads": 96, "n_group": 1, "topk_group": 1, "n_routed_experts": 160, "n_shared_experts": 1,
         "routed_scaling_factor": 2.5, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
         "num_hidden_layers": 92, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_scaling": None,
         "rope_theta": 1000000, "num_nextn_predict_layers": 1, "tie_word_embeddings": False,
         "torch_dtype": "bfloat16", "use_qk_norm": True, "vocab_size": 151552}
# what a Qwen3-MoE config.json cannot say (Qwen3-MoE refuses them on import)
GLM_ONLY = ("partial_rotary_factor", "use_qk_norm", "routed_scaling_factor", "first_k_dense_replace", "n_group",
            "topk_group", "n_routed_experts", "n_shared_experts", "num_nextn_predict_layers")
EXPORTED = ("architectures", "partial_rotary_factor", "use_qk_norm", "attention_bias", "n_routed_experts", "n_group",
            "topk_group", "routed_scaling_factor", "first_k_dense_replace", "n_shared_experts",
            "num_nextn_predict_layers", "num_experts_per_tok", "moe_intermediate_size", "intermediate_size",
            "head_dim", "num_key_value_heads", "norm_topk_prob", "rms_norm_eps", "rope_parameters")


# -- pure -------------------------------------------------------------------------------------------------------
def test_glm45_config_both_ways_and_its_size():
    cfg, args, notes = config_from_hf(GLM45, None)
    assert not notes and not cfg.mla and cfg.mtp_num_layers == 1 and cfg.kv_channels == 128
    assert (cfg.num_query_groups, cfg.add_qkv_bias, cfg.attention.qk_norm, cfg.moe.expert_bias) == \
        (8, True, True, True)
    assert cfg.moe.layer_pattern == (0, 0, 0) + (1,) * 89 and cfg.shared_size == 1536
    assert (args.rotary_percent, args.rotary_base, args.moe_router_score_function, args.moe_router_topk,
            args.moe_router_topk_scaling_factor, args.mtp_num_layers) == (0.5, 1e6, "sigmoid", 8, 2.5, 1)
    assert args.moe_router_num_groups is None  # n_group 1: no group-limited routing
    params = sum(torch.Size(shape).numel() for shape, _ in hf_tensors(cfg).values())
    assert 355e9 < params < 362e9, params  # 355B, and the MTP layer (an MoE layer + eh_proj + 2 vocab copies)
    # the registry exports it as GLM, from its own config.json or from the model config and args alone
    assert export_family(cfg).architecture == export_family(cfg, GLM45).architecture == Glm4Moe.architecture
    for base in (GLM45, None):
        back = hf_from_config(cfg, torch.bfloat16, base=base)
        assert {k: back[k] for k in GLM45 if k != "rope_scaling"} == {k: v for k, v in GLM45.items()
                                                                      if k != "rope_scaling"}, base


def test_transformers5_rope_parameters_win_and_transformers_defaults():
    v5 = {k: v for k, v in GLM45.items() if k not in ("rope_theta", "partial_rotary_factor")}
    v5["rope_parameters"] = {"rope_type": "default", "rope_theta": 5e5, "partial_rotary_factor": 0.25}
    cfg, args, _ = config_from_hf({**v5, "partial_rotary_factor": 0.75}, None)  # transformers reads the dict's
    assert (args.rotary_percent, args.rotary_base) == (0.25, 5e5)
    back = hf_from_config(cfg, torch.bfloat16, base=v5)
    assert back["rope_parameters"]["partial_rotary_factor"] == back["partial_rotary_factor"] == 0.25
    bare = {k: v for k, v in GLM45.items() if k not in ("partial_rotary_factor", "num_nextn_predict_layers")}
    _, args, _ = config_from_hf(bare, None)  # Glm4MoeConfig's defaults: half the head rotated, one MTP layer
    assert (args.rotary_percent, args.mtp_num_layers) == (0.5, 1)


def test_gqa_moe_with_expert_bias_or_mtp_exports_as_glm_and_only_as_glm():
    cfg, args, _ = config_from_hf(GLM45, None)
    moe_families = [f for f in FAMILIES.values() if f.model_type in ("mixtral", "qwen2_moe", "qwen3_moe")]
    assert len(moe_families) == 3
    for fam in moe_families:  # the softmax MoE families keep refusing it (the expert bias, the MTP layers)
        assert fam.unexpressed(cfg)
        assert fam.unexpressed(with_flat(cfg, moe_router_expert_bias=False, mtp_num_layers=1))
    no_mtp = with_flat(cfg, mtp_num_layers=0)
    assert export_family(no_mtp).architecture == "Glm4MoeForCausalLM"
    # a Qwen3-MoE model stays Qwen3-MoE, and GLM refuses softmax routing without an expert bias
    qwen = {**{k: v for k, v in GLM45.items() if k not in GLM_ONLY}, "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe", "num_experts": 160, "decoder_sparse_step": 1, "mlp_only_layers": [],
            "attention_bias": False}
    qcfg, qargs, _ = config_from_hf(qwen, None)
    assert export_family(qcfg).architecture == "Qwen3MoeForCausalLM"
    assert "no router expert bias" in describe_all(Glm4Moe().unexpressed(qcfg))
    with pytest.raises(ConvertError) as e:  # nearest GLM, and the model routes with softmax: GLM's words
        hf_from_config(cfg.replace(moe__score_function="softmax"), torch.float32)
    assert "moe_router_score_function=softmax" in str(e.value) and "Glm4MoeForCausalLM" in str(e.value)
    assert "--dst-format torch_dist" in str(e.value) and "\n" not in str(e.value)


def test_mtp_copies_are_optional_on_read():
    """GLM-4.5 stores the head copy, 4.6 / 4.7 neither copy: a release without them reads; a stored copy is a twin."""
    cfg, _, _ = config_from_hf({**GLM45, "num_hidden_layers": 4, "n_routed_experts": 8}, None)
    fam = Glm4Moe()
    every = hf_tensors(cfg, fam)
    embed, head = "model.layers.4.embed_tokens.weight", "model.layers.4.shared_head.head.weight"
    assert {embed, head} <= set(every)
    for stored, twins in ((set(), {}), ({head}, {"lm_head.weight": [head]}),
                          ({embed, head}, {"model.embed_tokens.weight": [embed], "lm_head.weight": [head]})):
        found = (set(every) - {embed, head}) | stored
        assert set(source_tensors(cfg, fam, found)[0]) == found, stored
        assert fam.stored_copies(cfg, found) == twins


@pytest.mark.parametrize("change,needles", [
    ({"norm_topk_prob": False}, ("norm_topk_prob=false", "renormalises", "convert a GLM-4.5 config")),
    ({"n_group": 4, "topk_group": 2, "n_routed_experts": 160}, ("group-limited routing with top-k 8 over topk_group=2",
                                                                 "num_experts_per_tok / topk_group == 2")),
    ({"num_experts_per_tok": 1}, ("num_experts_per_tok=1 with norm_topk_prob=true", "num_experts_per_tok > 1")),
    ({"n_shared_experts": 0}, ("n_shared_experts=0", "n_shared_experts >= 1")),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, ("RoPE scaling", "rope_scaling null")),
    ({"partial_rotary_factor": 0.0}, ("partial_rotary_factor=0.0", "0 < factor <= 1")),
    ({"mlp_bias": True}, ("mlp_bias=true", "without those biases")),
    ({"n_group": 6, "topk_group": 4}, ("n_group=6 does not divide n_routed_experts=160", "fix n_group")),
])
def test_refusals(change, needles):
    with pytest.raises(ConvertError) as e:
        Glm4Moe().from_hf({**GLM45, **change}, None)
    assert "\n" not in str(e.value) and e.value.fix, str(e.value)
    for n in needles:
        assert n in str(e.value), str(e.value)


@pytest.mark.parametrize("copies", [(), ("shared_head.head",)], ids=["glm46-no-copies", "glm45-head-copy"])
def test_round_trip_gives_back_the_releases_own_mtp_copies(tmp_path, copies):
    """A GLM-4.6-style release (its MTP layer stored without the embedding and head copies) and a GLM-4.5-style one
    (the head copy only) come back from HF -> torch_dist (TP2) -> HF with exactly their own tensors, bit for bit:
    the torch_dist target's origin record says which copies the source held."""
    src = add_mtp_layer(make_hf_model(tmp_path, "glm4_moe"), copies=copies)
    mid, back = tmp_path / "td", tmp_path / "back"
    ok(run_cli("reshard", str(src), str(mid), "--target-tp", "2", "--dst-format", "torch_dist"))
    ok(run_cli("reshard", str(mid), str(back), "--dst-format", "hf"))
    b = assert_bit_exact(src, back)
    assert ("model.layers.3.shared_head.head.weight" in b) == bool(copies)
    assert "model.layers.3.embed_tokens.weight" not in b and "model.layers.3.eh_proj.weight" in b


# -- processes: transformers makes the model, megatron-core judges ---------------------------------------------
@pytest.fixture(scope="module")
def glm(tmp_path_factory) -> tuple[Path, Path, str]:
    """(the HF model, its torch_dist import at TP=2 EP=2 ETP=1, the oracle config)."""
    root = tmp_path_factory.mktemp("glm")
    src = add_mtp_layer(make_hf_model(root, "glm4_moe"))
    td = root / "td"
    ok(run_cli("reshard", str(src), str(td), "--target-tp", "2", "--target-ep", "2", "--target-etp", "1",
               "--dst-format", "torch_dist", "--target-spec", "local", nproc=2))
    config = root / "oracle.json"
    config.write_text(json.dumps(oracle_config(src)))
    return src, td, str(config)


def test_torch_dist_tp2_ep2_gives_transformers_logits_in_megatron_core(glm, tmp_path):
    src, td, config = glm
    layout = ("--config", config, "--tp", "2", "--ep", "2", "--etp", "1", "--ckpt", str(td))  # world 2 = TP2 x DP1
    res = oracle("compare", 2, *layout, "--ref", str(td), "--check-args")  # strict; args: rotary_percent, MoE, MTP
    assert "ORACLE OK" in res.stdout
    out = tmp_path / "logits.pt"
    oracle("logits", 2, *layout, "--out", str(out))
    got = torch.load(out)
    want = hf_logits(src, got["tokens"])
    assert want.std() > 0.5  # O(1) logits: the comparison is not vacuous
    torch.testing.assert_close(got["logits"], want, rtol=1e-4, atol=1e-4)
    assert "ORACLE MTP depth=1" in oracle("mtp", 2, *layout).stdout


def test_legacy_pp2_loads_as_the_torch_dist_and_goes_back_to_hf_bit_exact(glm, tmp_path):
    """TP=1 PP=2 legacy files (1 + 2 layers, the MTP layer on the last stage): megatron-core loads them strictly
    to the very tensors of the TP=2 EP=2 torch_dist import (so to the same logits), and they export back to HF
    bit for bit, config.json included, loading in transformers with only the MTP layer left unused."""
    src, td, config = glm
    mg, back = tmp_path / "mg", tmp_path / "hf"
    ok(run_cli("reshard", str(src), str(mg), "--target-tp", "1", "--target-pp", "2",
               "--target-num-layers-in-first-stage", "1", "--dst-format", "megatron", "--target-spec", "local",
               nproc=2))
    res = oracle("compare", 2, "--config", config, "--tp", "1", "--pp", "2", "--first", "1", "--ckpt", str(mg),
                 "--ref", str(td), "--ref-format", "torch_dist", "--check-args")
    assert "ORACLE OK" in res.stdout
    ok(run_cli("reshard", str(mg), str(back), "--dst-format", "hf", nproc=2))
    b = assert_bit_exact(src, back)
    assert any(".layers.3.eh_proj." in k for k in b)
    assert b["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    hf, again = (json.loads((d / "config.json").read_text()) for d in (src, back))
    assert {k: again[k] for k in EXPORTED} == {k: hf[k] for k in EXPORTED}
    import transformers

    model, info = transformers.AutoModelForCausalLM.from_pretrained(back, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"] and not info["error_msgs"]
    assert info["unexpected_keys"] and all(k.startswith("model.layers.3.") for k in info["unexpected_keys"])
    tokens = torch.randint(0, hf["vocab_size"], (1, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(model.eval()(tokens).logits, hf_logits(src, tokens))
