"""Ministral 3 (``Ministral3ForCausalLM``; with images ``Mistral3ForConditionalGeneration``): Mistral with YaRN and
Llama 4's query scaling by position (``Position.query_scale_beta``), under transformers' Pixtral encoder and Mistral 3's
projector (kept whole by Megatron-Bridge), judged by code nobody here wrote. transformers 5.12.1 makes the tiny model
(tests/oracles/ministral3.py make: YaRN with a short original length, so that the query scaling acts within the
judge's input); dist_convert converts it under torchrun to torch_dist at TP 2 and TP 1 PP 2; Megatron-Bridge 0.6.2's
own Ministral 3 model loads each strictly, equals Bridge's own import tensor for tensor and gives transformers' logits
with an image (its provider's YaRN fields set from the HF config, which it ignores: the judge reports both); each
comes back to the HF model bit for bit with the same config.json. The pure tests pin the record and the refusals.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_vision import back_to_hf_is_exact, vl

from dist_convert.errors import ConvertError
from dist_convert.features import Position
from dist_convert.formats.bridge import vl_config
from dist_convert.models import config_from_hf, hf_from_config
from dist_convert.readers import reader_warnings

from conftest import ok, run_cli

ROPE = {"rope_type": "yarn", "rope_theta": 5e4, "factor": 4.0, "original_max_position_embeddings": 8,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1}
TEXT = {"model_type": "ministral3", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": 32, "rope_parameters": ROPE, "tie_word_embeddings": False}
MINISTRAL3 = {**TEXT, "architectures": ["Ministral3ForCausalLM"]}
MISTRAL3 = {"architectures": ["Mistral3ForConditionalGeneration"], "model_type": "mistral3", "image_token_index": 290,
            "tie_word_embeddings": False, "text_config": TEXT,
            "vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                              "num_attention_heads": 2, "head_dim": 16, "patch_size": 4, "image_size": 16}}


def test_the_query_scaling_is_a_setting_with_yarn():
    """The beta is read and written with YaRN's parameters; a family that does not map it (Mistral) refuses a config
    that sets it, a position record without YaRN refuses it, Megatron-LM's builder (none) and a Bridge provider written
    from the config (GPTModelProvider: none) name it; the vision record and config.json go back as they came."""
    cfg = config_from_hf(MINISTRAL3, None)[0]
    assert cfg.position.kind == "yarn" and cfg.position.query_scale_beta == 0.1
    assert cfg.position.scaling.original_max == 8 and cfg.position.scaling.factor == 4.0
    out = hf_from_config(cfg, torch.float32, base=MINISTRAL3)
    assert out["rope_parameters"]["llama_4_scaling_beta"] == 0.1 and config_from_hf(out, None)[0] == cfg
    with pytest.raises(ConvertError, match="llama_4_scaling_beta"):
        config_from_hf({**MINISTRAL3, "architectures": ["MistralForCausalLM"], "model_type": "mistral"}, None)
    with pytest.raises(ConvertError, match="llama_4_scaling_beta=0.1 without YaRN"):
        Position(query_scale_beta=0.1)
    mistral = {"architectures": ["MistralForCausalLM"], "model_type": "mistral"}
    assert hf_from_config(cfg, torch.float32, base=mistral)["architectures"] == ["Ministral3ForCausalLM"]
    plain = cfg.replace(position__query_scale_beta=0.0)  # without it, Mistral's own family would do
    assert hf_from_config(plain, torch.float32, base=mistral)["architectures"] == ["MistralForCausalLM"]
    warned = reader_warnings(cfg, "torch_dist")
    assert len(warned) == 1 and "llama_4_scaling_beta=0.1" in warned[0]
    vlm = config_from_hf(MISTRAL3, None)[0]
    v = vlm.vision
    assert (v.tower, v.depth, v.head_size, v.merge, v.out_hidden, v.image_token_id) == ("pixtral", 2, 16, 2, 64, 290)
    back = hf_from_config(vlm, torch.float32, base=MISTRAL3)
    assert {k: back["vision_config"].get(k) for k in MISTRAL3["vision_config"]} == MISTRAL3["vision_config"]
    assert back["text_config"]["model_type"] == "ministral3" and back["image_token_index"] == 290
    with pytest.raises(ConvertError, match="vision_feature_layer=-2"):
        config_from_hf({**MISTRAL3, "vision_feature_layer": -2}, None)
    provider = {"_target_": "megatron.bridge.models.ministral3.ministral3_provider.Ministral3ModelProvider",
                "hf_config": {**MISTRAL3, "_target_": "transformers.Mistral3Config"}, "yarn_rotary_scaling_factor": 4.0}
    assert vl_config(provider) == MISTRAL3  # a Bridge checkpoint's recorded HF config
    with pytest.raises(ConvertError, match=r"yarn_rotary_scaling_factor=16.0 \(hf_config: 4.0\): Megatron-Bridge"):
        vl_config({**provider, "yarn_rotary_scaling_factor": 16.0})  # its provider's default, not the HF config's


@pytest.fixture(scope="module")
def ministral3(tmp_path_factory) -> tuple[Path, Path]:
    """(HF model, Bridge's own torch_dist import of it at TP 1)."""
    root = tmp_path_factory.mktemp("ministral3")
    vl("ministral3", "make", str(root / "hf"))
    vl("ministral3", "bridge-import", str(root / "hf"), str(root / "bridge"))
    return root / "hf", root / "bridge"


# (target flags, judge ranks, judge flags)
CASES = {
    "tp2": (["--target-tp", "2"], 2, ["--tp", "2", "--pp", "1"]),
    "tp1_pp2": (["--target-tp", "1", "--target-pp", "2"], 1, ["--tp", "1", "--pp", "2"]),
}


def verdict(proc) -> dict:
    return json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])


@pytest.mark.parametrize("case", sorted(CASES))
def test_ministral3_to_megatron_judged_by_bridge_and_back(case, ministral3, tmp_path):
    hf, truth = ministral3
    flags, ranks, judge_flags = CASES[case]
    dst = tmp_path / "dst"
    ok(run_cli("reshard", str(hf), str(dst), "--dst-format", "torch_dist", *flags, nproc=2))
    proc = vl("ministral3", "judge", str(dst), "--truth", str(truth), "--hf", str(hf), *judge_flags, nproc=ranks,
              check=False)
    result = verdict(proc)
    assert proc.returncode == 0 and result["ok"] and result["loaded_tensors"] > 0, result
    assert result["logits_max_abs_diff_vs_hf"] < 1e-4, result
    back_to_hf_is_exact(dst, hf, tmp_path, 2, "Mistral3ForConditionalGeneration")


def test_ministral3_judge_fails_on_a_defect(ministral3, tmp_path):
    """Bridge's own checkpoint (its run_config.yaml records the HF config) exports as the HF model bit for bit; the
    judge is no rubber stamp: that checkpoint with one projector weight changed fails."""
    hf, truth = ministral3
    ok(run_cli("reshard", str(truth), str(tmp_path / "back"), "--dst-format", "hf"))
    a, b = load_file(str(hf / "model.safetensors")), load_file(str(tmp_path / "back" / "model.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    vl("ministral3", "mutate", str(truth), str(tmp_path / "bad"), "--hf", str(hf), "--kind", "projector_value")
    result = verdict(vl("ministral3", "judge", str(tmp_path / "bad"), "--truth", str(truth), "--hf", str(hf),
                        check=False))
    assert not result["ok"], result
