"""Qwen3.5 with images (``Qwen3_5ForConditionalGeneration``, ``Qwen3_5MoeForConditionalGeneration``): the Qwen3.5 Gated
DeltaNet language model under Qwen3-VL's tower without deepstack, judged by code nobody here wrote. transformers
5.12.1 makes each tiny model (tests/oracles/qwen35_vl.py make: dense, and MoE with a gated shared expert);
dist_convert converts it under torchrun to torch_dist at TP 2, TP 1 PP 2 and EP 2; Megatron-Bridge 0.6.2's own
Qwen3.5-VL model (its Qwen3VLModel with the Gated DeltaNet language model, on megatron-core 0.19.2; the gated delta
rule's CUDA kernel stood in by megatron-core's own torch implementation) loads each strictly, equals Bridge's own
import tensor for tensor and gives transformers' logits with images (its merger's tanh GELU made exact, as for
Qwen3-VL); each comes back to the HF model bit for bit with the same config.json.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_vision import back_to_hf_is_exact, vl

from dist_convert.errors import ConvertError
from dist_convert.formats.bridge import vl_config
from dist_convert.models import config_from_hf

from conftest import ok, run_cli

TEXT = {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"], "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
        "rope_parameters": {"rope_type": "default", "rope_theta": 5e4, "partial_rotary_factor": 0.5,
                            "mrope_section": [2, 3, 3], "mrope_interleaved": True}}
QWEN35_VL = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "image_token_id": 290,
             "text_config": TEXT, "vision_config": {"depth": 2, "hidden_size": 32, "num_heads": 2,
                                                    "intermediate_size": 64, "out_hidden_size": 64, "patch_size": 4,
                                                    "num_position_embeddings": 36}}


def test_the_record_of_qwen35_with_images():
    """MRoPE over the rotated part of the head (here half: 16 of 32 dims, sections summing to 8), no deepstack
    (a stray deepstack key is what transformers ignores), GDN layers; the multimodal RoPE is the model's (no note
    calling it the text model); sections that do not cover the rotated dims, and a Bridge checkpoint of it (its
    run_config.yaml records no HF text config), are refused in one line."""
    cfg, _, notes = config_from_hf(QWEN35_VL, None)
    assert cfg.position.kind == "mrope" and cfg.position.percent == 0.5 and cfg.position.mrope_interleaved
    assert cfg.vision.deepstack == () and cfg.gdn.pattern == (1, 1, 1, 0) and not any("RoPE" in n for n in notes)
    stray = {**QWEN35_VL, "vision_config": {**QWEN35_VL["vision_config"], "deepstack_visual_indexes": [0]}}
    assert config_from_hf(stray, None)[0] == cfg
    bad = {**QWEN35_VL, "text_config": {**TEXT, "rope_parameters": {**TEXT["rope_parameters"],
                                                                     "mrope_section": [4, 6, 6]}}}
    with pytest.raises(ConvertError, match=r"mrope_section \[4, 6, 6\] does not cover the 16 rotated"):
        config_from_hf(bad, None)
    with pytest.raises(ConvertError, match="Qwen35VLModelProvider checkpoint: its run_config.yaml does not record"):
        vl_config({"_target_": "megatron.bridge.models.qwen_vl.qwen35_vl_provider.Qwen35VLModelProvider"})


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """{"dense" | "moe": (HF model, Bridge's own torch_dist import of it at TP 1)}."""
    root = tmp_path_factory.mktemp("qwen35_vl")
    out = {}
    for kind, flags in (("dense", []), ("moe", ["--moe"])):
        vl("qwen35_vl", "make", str(root / kind), *flags)
        vl("qwen35_vl", "bridge-import", str(root / kind), str(root / f"{kind}_bridge"))
        out[kind] = (root / kind, root / f"{kind}_bridge")
    return out


# (model, target flags, judge ranks, judge flags)
CASES = {
    "dense_tp2": ("dense", ["--target-tp", "2"], 2, ["--tp", "2", "--pp", "1"]),
    "dense_tp1_pp2": ("dense", ["--target-tp", "1", "--target-pp", "2"], 1, ["--tp", "1", "--pp", "2"]),
    "moe_ep2": ("moe", ["--target-tp", "1", "--target-ep", "2"], 2, ["--ep", "2", "--expect-ep", "2"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_qwen35_vl_to_megatron_judged_by_bridge_and_back(case, models, tmp_path):
    kind, flags, ranks, judge_flags = CASES[case]
    hf, truth = models[kind]
    dst = tmp_path / "dst"
    ok(run_cli("reshard", str(hf), str(dst), "--dst-format", "torch_dist", *flags, nproc=2))
    proc = vl("qwen35_vl", "judge", str(dst), "--truth", str(truth), "--hf", str(hf), *judge_flags, nproc=ranks,
              check=False)
    result = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    assert proc.returncode == 0 and result["ok"] and result["loaded_tensors"] > 0, result
    assert result["logits_max_abs_diff_vs_hf"] < 1e-4 < result["logits_max_abs_diff_vs_hf_raw"], result
    back_to_hf_is_exact(dst, hf, tmp_path, 2, json.loads((hf / "config.json").read_text())["architectures"][0])


def test_qwen35_vl_judge_fails_on_a_defect(models, tmp_path):
    """The judge is no rubber stamp: Bridge's own checkpoint with a GDN layer's b and a projections exchanged fails."""
    hf, truth = models["dense"]
    vl("qwen35_vl", "mutate", str(truth), str(tmp_path / "bad"), "--hf", str(hf), "--kind", "swap_b_a")
    proc = vl("qwen35_vl", "judge", str(tmp_path / "bad"), "--truth", str(truth), "--hf", str(hf), check=False)
    result = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    assert proc.returncode == 1 and not result["ok"] and result["logits_max_abs_diff_vs_hf"] > 1e-2, result
