"""Pure tests of the ModelOpt configs ``speculate`` builds, and of the draft's serving names."""
from __future__ import annotations

import json

import pytest
import torch

from dist_convert.errors import ConvertError
from dist_convert.features import Llama3
from dist_convert.speculative.draft_config import DraftRequest, speculative_config
from dist_convert.speculative.draft_export import serving_names

from flat_config import flat_config

CFG = flat_config(num_layers=4, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2,
                  kv_channels=16, swiglu=True, normalization="RMSNorm", add_bias_linear=False, add_qkv_bias=False,
                  untie_embeddings_and_output_weights=False, vocab_size=100, make_vocab_size_divisible_by=16,
                  position_embedding_type="rope", max_position_embeddings=32, qk_layernorm=False, spec="local")
CFG = CFG.replace(norm__eps=1e-6, position__base=500000.0, position__scaling=Llama3(factor=32.0))


def test_eagle3_defaults_take_sizes_from_the_base_model():
    algo, cfg = speculative_config(DraftRequest(eagle_layers=2), CFG, torch.bfloat16)
    arch = cfg["eagle_architecture_config"]
    assert algo == "eagle" and arch["use_aux_hidden_state"] and arch["use_last_layernorm"]
    assert (arch["num_hidden_layers"], arch["intermediate_size"], arch["num_attention_heads"],
            arch["num_key_value_heads"], arch["head_dim"]) == (2, 96, 4, 2, 16)
    assert arch["rms_norm_eps"] == 1e-6 and arch["rope_theta"] == 500000 and arch["torch_dtype"] == "bfloat16"
    assert arch["rope_scaling"] == {"rope_type": "llama3", "rope_theta": 500000, "factor": 32.0}


def test_eagle1_and_medusa():
    _, cfg = speculative_config(DraftRequest(eagle_layers=1, eagle_version=1), CFG, torch.float32)
    arch = cfg["eagle_architecture_config"]
    assert not arch["use_aux_hidden_state"] and not arch["use_last_layernorm"] and arch["torch_dtype"] == "float32"
    assert speculative_config(DraftRequest(medusa_heads=4, medusa_layers=2), CFG, torch.float32) == (
        "medusa", {"medusa_num_heads": 4, "medusa_num_layers": 2})


def test_spec_config_file_wins_over_base_sizes(tmp_path):
    f = tmp_path / "spec.json"
    f.write_text(json.dumps({"algorithm": "eagle", "config": {"eagle_architecture_config": {
        "intermediate_size": 256, "num_hidden_layers": 3, "use_aux_hidden_state": False}}}))
    _, cfg = speculative_config(DraftRequest(spec_config=f), CFG, torch.float32)
    arch = cfg["eagle_architecture_config"]
    assert (arch["intermediate_size"], arch["num_hidden_layers"], arch["head_dim"]) == (256, 3, 16)
    _, cfg = speculative_config(DraftRequest(eagle_layers=1, spec_config=f), CFG, torch.float32)
    assert cfg["eagle_architecture_config"]["num_hidden_layers"] == 1
    with pytest.raises(ConvertError, match="--spec-config asks for eagle but --medusa-heads"):
        speculative_config(DraftRequest(medusa_heads=2, spec_config=f), CFG, torch.float32)


def test_serving_names_follow_modelopts_export_tables():
    qkv = "eagle_module.decoder.layers.0.self_attention.linear_qkv.weight"
    assert [n for n, _ in serving_names(qkv, True, 1)] == [
        "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight"]
    assert serving_names("eagle_module.decoder.layers.0.input_layernorm.weight", True, 1) == [
        ("midlayer.hidden_norm.weight", None)]
    assert serving_names("eagle_module.decoder.layers.1.mlp.linear_fc1.weight", True, 2) == [
        ("midlayer.1.mlp.gate_proj.weight", "gate"), ("midlayer.1.mlp.up_proj.weight", "up")]
    assert serving_names("eagle_module.enorm.weight", True, 1) == [("midlayer.input_layernorm.weight", None)]
    assert serving_names("eagle_module.decoder.layers.1.input_layernorm.weight", False, 2) == [
        ("layers.1.input_layernorm.weight", None)]
    assert serving_names("medusa_heads.2.medusa_layers.0.linear.bias", False, 1) == [
        ("medusa_heads.2.0.linear.bias", None)]
    assert serving_names("medusa_heads.2.lm_head.weight", False, 3) == [("medusa_heads.2.3.weight", None)]
    with pytest.raises(ConvertError, match="unexpected EAGLE tensor"):
        serving_names("eagle_module.mystery.weight", True, 1)
