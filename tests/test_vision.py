"""Vision-language models: a language model plus a vision component (features/vision.py, layout/vision.py,
models/vlm.py), in Megatron-Bridge 0.6.2's layout.

Pure: the vision tower's fused q/k/v (HF's [all q; all k; all v] against megatron-core's per-head order), the
language-model prefix of torch_dist keys, Qwen3-VL-MoE's fused experts in both orientations, the refusals (a format
that cannot hold the tower, the deepstack features off the first stage, a tower TP does not split).
Processes: tiny random models made by transformers' own classes, with real images (two images of different grids),
convert HF -> torch_dist under torchrun; Megatron-Bridge's own model of the family (tests/oracles/qwen3_vl.py, ...;
the second runtime) loads each target strictly at another layout, compares every tensor with its own import of the
HF model and the logits with images against transformers'; the way back to HF is bit-exact, with the same
config.json, and loads cleanly in transformers.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dist_convert.config import ModelConfig
from dist_convert.errors import ConvertError
from dist_convert.features import Linear, MoE
from dist_convert.formats.dist_keys import dist_groups
from dist_convert.formats.hf import hf_tensors
from dist_convert.layout.topology import Layout
from dist_convert.models import config_from_hf
from dist_convert.models.qwen3_vl import release_layout

from conftest import ok, oracle, run_cli

QWEN3_VL = {"architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl", "image_token_id": 290,
            "tie_word_embeddings": False,
            "text_config": {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
                            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                            "rope_parameters": {"rope_type": "default", "rope_theta": 5e4, "mrope_section": [2, 3, 3],
                                                "mrope_interleaved": True}},
            "vision_config": {"depth": 3, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64,
                              "out_hidden_size": 64, "patch_size": 4, "num_position_embeddings": 36,
                              "deepstack_visual_indexes": [0, 2]}}


def test_vision_qkv_is_hf_concatenated_per_head_in_megatron():
    """HF's attn.qkv [all q; all k; all v] <-> megatron-core's linear_qkv [q_h; k_h; v_h] per head (Bridge's
    ConcatenatedQKVMapping): row r of head h's k in HF is row H*d + h*d + r, in megatron-core 3*d*h + d + r."""
    cfg, _, _ = config_from_hf(QWEN3_VL, None)
    shape, pieces = hf_tensors(cfg)["model.visual.blocks.1.attn.qkv.weight"]
    assert shape == (96, 32)
    hf = torch.arange(96.0).repeat_interleave(32).reshape(96, 32)
    logical = torch.empty(96, 32)
    for p in pieces:
        assert p.logical == "vision_model.decoder.layers.1.self_attention.linear_qkv.weight"
        logical[p.lbox.slices()] = hf[p.sbox.slices()]
    d = 16
    order = [part * 32 + head * d + r for head in range(2) for part in range(3) for r in range(d)]
    assert logical[:, 0].tolist() == [float(i) for i in order]


def test_torch_dist_keys_in_bridges_layout():
    """The language model under language_model., the tower's layers and deepstack mergers stacked on their own axes."""
    cfg, _, _ = config_from_hf(QWEN3_VL, None)
    groups = dist_groups(cfg)
    assert groups["language_model.decoder.layers.self_attention.linear_qkv.weight"].lead == (4,)
    assert groups["vision_model.decoder.layers.self_attention.linear_qkv.weight"].lead == (3,)
    assert groups["vision_model.decoder.deepstack_merger_list.linear_fc1.weight"].lead == (2,)
    assert {"vision_model.merger.patch_norm.weight", "vision_model.pos_embed.weight",
            "language_model.embedding.word_embeddings.weight"} <= set(groups)
    assert not [k for k in groups if k.startswith(("decoder.", "embedding.", "output_layer"))]


def test_refusals():
    cfg, _, _ = config_from_hf(QWEN3_VL, None)
    with pytest.raises(ConvertError, match="deepstack features feed language layers 0-1.*--target-num-layers-in-first"):
        cfg.check_layout(Layout(tp=1, pp=4))
    cfg.check_layout(Layout(tp=1, pp=2, first=2))
    with pytest.raises(ConvertError, match="does not divide the vision tower's heads 2"):
        cfg.check_layout(Layout(tp=4, pp=1))
    with pytest.raises(ConvertError, match="mrope_section"):
        config_from_hf({**QWEN3_VL, "text_config": {**QWEN3_VL["text_config"], "rope_parameters": {
            "rope_type": "default", "rope_theta": 5e4, "mrope_section": [4, 3, 3]}}}, None)
    with pytest.raises(ConvertError, match="hidden_act='gelu'"):
        config_from_hf({**QWEN3_VL, "vision_config": {**QWEN3_VL["vision_config"], "hidden_act": "gelu"}}, None)
    with pytest.raises(ConvertError, match="deepstack_visual_indexes"):
        config_from_hf({**QWEN3_VL, "vision_config": {**QWEN3_VL["vision_config"], "deepstack_visual_indexes": [3]}},
                       None)


def test_the_releases_config_spellings():
    """Qwen2.5-VL's releases keep transformers 4's flat config.json (the language model at the top, RoPE as
    rope_scaling type mrope): read as the nested one. Gemma 3's releases state in text_config only what differs from
    Gemma3TextConfig's defaults. A missing fullatt_block_indexes is transformers' default, not "none"."""
    from dist_convert.models.qwen25_vl import FULL_LAYERS

    text = {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "attention_bias": False}
    vision = {"depth": 32, "hidden_size": 32, "num_heads": 2, "intermediate_size": 48, "out_hidden_size": 64}
    nested = {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "vision_config": vision, "text_config": {
        **text, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}}}
    flat = {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "vision_config": vision, **text,
            "rope_theta": 1e6, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}}
    a, b = config_from_hf(nested, None)[0], config_from_hf(flat, None)[0]
    assert a == b and a.vision.full_layers == FULL_LAYERS and a.position.mrope_section == (2, 3, 3)
    sparse = {"architectures": ["Gemma3ForConditionalGeneration"], "mm_tokens_per_image": 256,
              "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34,
                              "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024},
              "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                                "num_attention_heads": 16, "num_hidden_layers": 27, "patch_size": 14,
                                "vision_use_head": False}}
    cfg = config_from_hf(sparse, None)[0]
    assert (cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels, cfg.vocab_size) == (8, 4, 256, 262208)
    assert (cfg.position.scaling, cfg.tied) == (Linear(factor=8.0), True)
    assert cfg.vision.positions == 4096 and not cfg.vision.head


def test_moe_experts_orientation_from_the_stored_shapes():
    """Qwen3-VL-MoE's fused experts: the releases' [E, H, 2F] / [E, F, H], transformers 5's own [E, 2F, H] / [E, H, F];
    told apart by the fc2 (or, when F == H, the fc1); an export writes the releases'."""
    cfg = ModelConfig(num_layers=2, hidden_size=64, moe=MoE(num_experts=4, ffn=48, topk=2))
    hf = "model.language_model.layers.1."
    assert release_layout(cfg, {hf + "mlp.experts.down_proj": ("f", None, (4, 48, 64))}, hf)
    assert not release_layout(cfg, {hf + "mlp.experts.down_proj": ("f", None, (4, 64, 48))}, hf)
    assert release_layout(cfg, [hf + "mlp.experts.down_proj"], hf)  # no shapes: what an export writes


def test_formats_that_cannot_hold_the_tower_refuse(tmp_path):
    """A Qwen3-VL model to legacy Megatron, NeMo or Bridge's GPTModelProvider would lose its tower: refused in one
    line, nothing written."""
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(QWEN3_VL))
    cfg, _, _ = config_from_hf(QWEN3_VL, None)
    from safetensors.torch import save_file

    save_file({k: torch.zeros(s) for k, (s, _) in hf_tensors(cfg).items()}, str(hf / "model.safetensors"))
    for fmt in ("megatron", "nemo", "fsdp_dtensor"):
        proc = run_cli("reshard", str(hf), str(tmp_path / fmt), "--dst-format", fmt)
        assert proc.returncode == 2 and "cannot hold the model's vision tower" in proc.stderr, proc.stderr
        assert not (tmp_path / fmt).exists()
    proc = run_cli("reshard", str(hf), str(tmp_path / "local"), "--dst-format", "torch_dist", "--target-spec", "local")
    assert proc.returncode == 2 and "Transformer Engine's layer spec only" in proc.stderr, proc.stderr


def test_inspect_shows_the_tower(qwen3_vl):
    hf, _ = qwen3_vl
    out = ok(run_cli("inspect", str(hf), "--json")).stdout
    info = json.loads(out[out.index("{"):])
    assert info["components"] == {"language model": 35, "vision (qwen3_vl)": 57}
    assert info["config"]["vision_tower"] == "qwen3_vl" and info["config"]["vision_deepstack"] == [0, 2]


# -- processes: transformers makes the models, Megatron-Bridge judges ---------------------------------------------
def vl(program: str, cmd: str, *args: str, nproc: int = 1, check: bool = True):
    return oracle(cmd, nproc, *args, program=program, runtime="mcore19", check=check)


@pytest.fixture(scope="module")
def qwen3_vl(tmp_path_factory) -> tuple[Path, Path]:
    """(HF model, Bridge's own torch_dist import of it at TP=2)."""
    root = tmp_path_factory.mktemp("qwen3_vl")
    vl("qwen3_vl", "make", str(root / "hf"))
    vl("qwen3_vl", "bridge-import", str(root / "hf"), str(root / "bridge"), nproc=2)
    return root / "hf", root / "bridge"


def judged(program: str, dst: Path, truth: Path, hf: Path, *flags: str) -> dict:
    proc = vl(program, "judge", str(dst), "--truth", str(truth), "--hf", str(hf), *flags, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(lines[-1])
    assert proc.returncode == 0 and result["ok"] and result["loaded_tensors"] > 0, result
    assert result["logits_max_abs_diff_vs_hf"] < 1e-4, result
    return result


def back_to_hf_is_exact(dst: Path, hf: Path, tmp_path: Path, nproc: int, model_class: str) -> None:
    """torch_dist -> HF gives the source's safetensors bit for bit and its config.json, and transformers loads it
    cleanly."""
    back = tmp_path / "back"
    ok(run_cli("reshard", str(dst), str(back), "--dst-format", "hf", nproc=nproc))
    from safetensors.torch import load_file

    a, b = load_file(str(hf / "model.safetensors")), load_file(str(back / "model.safetensors"))
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    assert json.loads((back / "config.json").read_text()) == json.loads((hf / "config.json").read_text())
    import transformers

    _, info = getattr(transformers, model_class).from_pretrained(back, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info


# (target flags, nproc, judge flags): Bridge loads each at TP=1 (one process; it reshards on load)
QWEN3_VL_CASES = {
    "tp2": (["--target-tp", "2"], 2, ["--tp", "2", "--pp", "1"]),
    "tp1_pp2": (["--target-tp", "1", "--target-pp", "2"], 2, ["--tp", "1", "--pp", "2"]),
}


@pytest.mark.parametrize("case", sorted(QWEN3_VL_CASES))
def test_qwen3_vl_to_megatron_judged_by_bridge_and_back(case, qwen3_vl, tmp_path):
    hf, truth = qwen3_vl
    flags, nproc, judge_flags = QWEN3_VL_CASES[case]
    dst = tmp_path / "dst"
    ok(run_cli("reshard", str(hf), str(dst), "--dst-format", "torch_dist", *flags, nproc=nproc))
    result = judged("qwen3_vl", dst, truth, hf, *judge_flags)
    assert result["logits_max_abs_diff_vs_hf_raw"] > 1e-4  # Bridge's tanh-GELU mergers, fixed for the judgement
    back_to_hf_is_exact(dst, hf, tmp_path, nproc, "Qwen3VLForConditionalGeneration")


def test_qwen3_vl_judge_fails_on_a_defect(qwen3_vl, tmp_path):
    """The judge is no rubber stamp: Bridge's own checkpoint with each vision head's q and k rows exchanged fails."""
    hf, truth = qwen3_vl
    vl("qwen3_vl", "mutate", str(truth), str(tmp_path / "bad"), "--hf", str(hf), "--kind", "swap_qkv_heads")
    proc = vl("qwen3_vl", "judge", str(tmp_path / "bad"), "--truth", str(truth), "--hf", str(hf), check=False)
    result = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    assert proc.returncode == 1 and not result["ok"] and result["logits_max_abs_diff_vs_hf"] > 1e-2, result


def test_bridge_qwen3_vl_checkpoint_to_hf_and_to_bridge(qwen3_vl, tmp_path):
    """Megatron-Bridge's own Qwen3-VL save (run_config.yaml: Qwen3VLModelProvider with its serialized HF text and
    vision configs; no Megatron-LM args) exports as the HF model it came from, bit for bit, and reshards to a Bridge
    checkpoint at TP=1 PP=2 (its run_config.yaml carried, the layout fields updated) that Bridge's model loads."""
    hf, bridge = qwen3_vl
    back = tmp_path / "back"
    ok(run_cli("reshard", str(bridge), str(back), "--dst-format", "hf", nproc=2))
    from safetensors.torch import load_file

    a, b = load_file(str(hf / "model.safetensors")), load_file(str(back / "model.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    src, out = json.loads((hf / "config.json").read_text()), json.loads((back / "config.json").read_text())
    for section in ("text_config", "vision_config"):
        assert {k: src[section].get(k) for k in out[section] if k != "dtype"} == \
            {k: v for k, v in out[section].items() if k != "dtype"}, section
    resharded = tmp_path / "bridge_pp2"
    ok(run_cli("reshard", str(bridge), str(resharded), "--dst-format", "bridge", "--target-tp", "1", "--target-pp",
               "2", nproc=2))
    judged("qwen3_vl", resharded, bridge, hf, "--tp", "1", "--pp", "2")


@pytest.fixture(scope="module")
def qwen25_vl(tmp_path_factory) -> tuple[Path, Path]:
    """(HF Qwen2.5-VL, windowed and full-attention tower blocks; Bridge's own torch_dist import of it at TP=2)."""
    root = tmp_path_factory.mktemp("qwen25_vl")
    vl("qwen25_vl", "make", str(root / "hf"))
    vl("qwen25_vl", "bridge-import", str(root / "hf"), str(root / "bridge"), nproc=2)
    return root / "hf", root / "bridge"


def test_qwen25_vl_to_megatron_judged_by_bridge_and_back(qwen25_vl, tmp_path):
    """Qwen2.5-VL at TP=2: the tower under visual. (Hugging Face's module, replicated), the Qwen2 language model under
    language_model. with megatron-core's MRoPE. Bridge's provider ignores mrope_section (it keeps [16, 24, 24]); the
    judge sets the HF one on the built model and says so."""
    hf, truth = qwen25_vl
    dst = tmp_path / "dst"
    ok(run_cli("reshard", str(hf), str(dst), "--dst-format", "torch_dist", "--target-tp", "2", nproc=2))
    result = judged("qwen25_vl", dst, truth, hf, "--tp", "2", "--pp", "1")
    assert result["loaded_visual_tensors"] > 0 and result["mrope_section"]["hf"] == [2, 3, 3]
    back_to_hf_is_exact(dst, hf, tmp_path, 2, "Qwen2_5_VLForConditionalGeneration")


@pytest.fixture(scope="module")
def gemma3_vl(tmp_path_factory) -> tuple[Path, Path]:
    """(HF Gemma 3 with images, SigLIP tower; Bridge's own torch_dist import of it at TP=2, which Bridge makes in
    bf16 whatever the HF model's dtype: the tiny model's values are exact in bf16)."""
    root = tmp_path_factory.mktemp("gemma3_vl")
    vl("gemma3_vl", "make", str(root / "hf"))
    vl("gemma3_vl", "bridge-import", str(root / "hf"), str(root / "bridge"), nproc=2)
    return root / "hf", root / "bridge"


def test_gemma3_vl_to_megatron_judged_by_bridge_and_back(gemma3_vl, tmp_path):
    """Gemma 3 with images at TP=2 in bf16 (as Bridge holds it): SigLIP under vision_tower. (replicated), the
    projector's norm and column-parallel projection (HF stores it transposed), the Gemma 3 language model under
    language_model.; back to HF in fp32, the source's dtype, bit for bit. The judge corrects Bridge's post-norm
    epsilon (TE's default 1e-5 for rms_norm_eps 1e-6) and says so."""
    hf, truth = gemma3_vl
    dst = tmp_path / "dst"
    ok(run_cli("reshard", str(hf), str(dst), "--dst-format", "torch_dist", "--target-tp", "2", "--dtype", "bf16",
               nproc=2))
    result = judged("gemma3_vl", dst, truth, hf, "--tp", "2", "--pp", "1")
    assert result["image_tokens"] > 0 and result["loaded_dtypes"] == ["torch.bfloat16"]
    back = tmp_path / "back"
    ok(run_cli("reshard", str(dst), str(back), "--dst-format", "hf", "--dtype", "fp32", nproc=2))
    from safetensors.torch import load_file

    a, b = load_file(str(hf / "model.safetensors")), load_file(str(back / "model.safetensors"))
    assert set(a) == set(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    assert json.loads((back / "config.json").read_text()) == json.loads((hf / "config.json").read_text())


@pytest.fixture(scope="module")
def qwen3_vl_moe(tmp_path_factory) -> tuple[Path, Path]:
    """(HF Qwen3-VL-MoE, experts fused as transformers 5 saves them; Bridge's own torch_dist import at TP=2)."""
    root = tmp_path_factory.mktemp("qwen3_vl_moe")
    vl("qwen3_vl", "make", str(root / "hf"), "--moe")
    vl("qwen3_vl", "bridge-import", str(root / "hf"), str(root / "bridge"), nproc=2)
    return root / "hf", root / "bridge"


def test_qwen3_vl_moe_at_ep2_judged_by_bridge_and_back(qwen3_vl_moe, tmp_path):
    """Qwen3-VL-MoE at TP=1 EP=2: Bridge's model loads it strictly, equal to its import, with transformers' logits.
    Back to HF the experts are written as the releases store them (transposed against transformers 5's own save,
    which transformers loads either way): the same values, a clean from_pretrained with equal logits; and that
    release-layout checkpoint goes round once more bit for bit."""
    hf, truth = qwen3_vl_moe
    dst = tmp_path / "dst"
    ok(run_cli("reshard", str(hf), str(dst), "--dst-format", "torch_dist", "--target-tp", "1", "--target-ep", "2",
               nproc=2))
    judged("qwen3_vl", dst, truth, hf, "--tp", "1", "--pp", "1", "--expect-ep", "2")
    back = tmp_path / "back"
    ok(run_cli("reshard", str(dst), str(back), "--dst-format", "hf", nproc=2))
    from safetensors.torch import load_file

    a, b = load_file(str(hf / "model.safetensors")), load_file(str(back / "model.safetensors"))
    assert set(a) == set(b)
    fused = [k for k in a if k.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))]
    assert fused and all(torch.equal(a[k].transpose(1, 2), b[k]) for k in fused)
    assert all(torch.equal(a[k], b[k]) for k in a if k not in fused)
    assert json.loads((back / "config.json").read_text()) == json.loads((hf / "config.json").read_text())
    import transformers

    cls = transformers.Qwen3VLMoeForConditionalGeneration
    model, info = cls.from_pretrained(back, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    ids = torch.arange(1, 17).reshape(1, 16) * 7 % 280
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, cls.from_pretrained(hf)(input_ids=ids).logits)
    again = tmp_path / "again"
    ok(run_cli("reshard", str(back), str(tmp_path / "tp2"), "--dst-format", "torch_dist", "--target-tp", "2", nproc=2))
    ok(run_cli("reshard", str(tmp_path / "tp2"), str(again), "--dst-format", "hf", nproc=2))
    c = load_file(str(again / "model.safetensors"))
    assert set(b) == set(c) and all(torch.equal(b[k], c[k]) for k in b)


def test_lora_of_the_language_model_merges_into_a_vision_language_model(qwen3_vl, tmp_path):
    """A peft adapter on Qwen3-VL's language model (peft's own, every projection) merged while importing to
    torch_dist TP=2, then exported to HF: bit for bit peft's merge_and_unload, the tower untouched."""
    hf, _ = qwen3_vl

    def peft(cmd: str, *args: str) -> None:
        oracle(cmd, 1, *args, program="peft_lora", runtime="mcore19")

    peft("make", "--hf", str(hf), "--out", str(tmp_path / "adapter"))
    peft("merge", "--hf", str(hf), "--adapter", str(tmp_path / "adapter"), "--out", str(tmp_path / "truth"))
    ok(run_cli("reshard", str(hf), str(tmp_path / "tp2"), "--dst-format", "torch_dist", "--target-tp", "2",
               "--lora", str(tmp_path / "adapter"), nproc=2))
    ok(run_cli("reshard", str(tmp_path / "tp2"), str(tmp_path / "back"), "--dst-format", "hf", nproc=2))
    from safetensors.torch import load_file

    want, got = load_file(str(tmp_path / "truth" / "model.safetensors")), load_file(
        str(tmp_path / "back" / "model.safetensors"))
    assert set(want) == set(got) and all(torch.equal(want[k], got[k]) for k in want)
    base = load_file(str(hf / "model.safetensors"))
    assert all(torch.equal(base[k], got[k]) for k in base if k.startswith("model.visual."))
    assert any(not torch.equal(base[k], got[k]) for k in base if ".self_attn.q_proj." in k)
