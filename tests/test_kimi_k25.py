"""Kimi-K2.5 with images (``Kimi_K25ForConditionalGeneration``): DeepSeek-V3's language model under Kimi's MoonViT and
patch-merger projector (``features.vision.MoonViTTower``), judged by code nobody here wrote, in the newest runtime
(transformers 5.23.0, the newest release, beside megatron-core 0.19.2; 5.14.1 defines the class too and reads the
same config here: tests/test_features.py): transformers makes the tiny model (tests/oracles/kimi_k25.py make), with
an image; dist_convert converts it under torchrun to torch_dist at TP 2 EP 2 and at PP 2; megatron-core's GPTModel
loads each strictly at another layout (TP 1; TP 2 EP 2) and, fed transformers' image features computed from the
checkpoint's own vision tensors, gives transformers' logits; each comes back to the release's tensors bit for bit
with the same config.json. transformers' own save_pretrained spelling reads as the release, and the judge fails on a
changed projector weight. The pure test pins the record, config.json both ways and the refusals.
"""
from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dist_convert.errors import ConvertError
from dist_convert.models import config_from_hf, hf_from_config

from conftest import ok, oracle, run_cli
from hf_models import deepseek_oracle_config
from oracles.kimi_k25 import TEXT, TOKENS, VISION

KIMI = {"architectures": ["Kimi_K25ForConditionalGeneration"], "model_type": "kimi_k25", **TOKENS,
        "projection_hidden_size": VISION["hidden_size"], "projection_layer_norm_eps": 1e-5,
        "tie_word_embeddings": False, "text_config": {**TEXT, "num_nextn_predict_layers": 1},
        "vision_config": {**VISION, "model_type": "kimi_k25_vision", "hidden_act": "gelu_pytorch_tanh"}}


def test_kimi_k25_record_config_and_refusals():
    """The tower's record from config.json and back as it came (the unread MTP count and DeepSeek's router keys
    transformers' config lacks included); without a top-level tie flag the model is tied (Kimi_K25Config's default);
    a tower other than the release's is refused in one line."""
    cfg = config_from_hf(KIMI, None)[0]
    v = cfg.vision
    assert (v.tower, v.depth, v.hidden, v.heads, v.ffn, v.patch, v.merge, v.merged, v.out_hidden) == (
        "moonvit", 2, 32, 2, 48, 4, 2, 128, 64)
    assert (v.pos_height, v.pos_width, v.pos_time, v.image_token_id, v.video_token_id) == (4, 4, 4, 300, 301)
    assert cfg.mla and cfg.moe is not None and cfg.mtp is None and not cfg.tied
    back = hf_from_config(cfg, torch.float32, base=KIMI)
    assert {k: back.get(k) for k in KIMI if k != "text_config"} == {k: v for k, v in KIMI.items() if k != "text_config"}
    assert {k: back["text_config"].get(k) for k in KIMI["text_config"]} == KIMI["text_config"]
    assert not {"moe_layer_freq", "scoring_func", "topk_method"} & set(back["text_config"])
    assert config_from_hf(hf_from_config(cfg, torch.float32, base=None), None)[0] == cfg
    untied = {k: v for k, v in KIMI.items() if k != "tie_word_embeddings"}
    assert config_from_hf(untied, None)[0].tied
    for change, match in ((("vision_config", "hidden_act", "gelu"), "runs tanh-GELU"),
                          (("vision_config", "merge_kernel_size", [2, 3]), r"merge_kernel_size \[2, 3\]"),
                          ((None, "projection_hidden_size", 64), "projection_hidden_size 64")):
        bad = copy.deepcopy(KIMI)
        (bad[change[0]] if change[0] else bad)[change[1]] = change[2]
        with pytest.raises(ConvertError, match=match):
            config_from_hf(bad, None)


def kimi(cmd: str, *args: str, nproc: int = 1, check: bool = True):
    return oracle(cmd, nproc, *args, program="kimi_k25", runtime="newest", check=check)


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    """The oracle's tiny model (root/hf: the release's names, root/saved: transformers' save_pretrained) and the
    megatron-core config of its language model (root/oracle.json: unpadded vocabulary, as Bridge keeps it)."""
    root = tmp_path_factory.mktemp("kimi_k25")
    kimi("make", str(root))
    hf = json.loads((root / "hf" / "config.json").read_text())
    text = {**hf["text_config"], "num_nextn_predict_layers": 0, "tie_word_embeddings": hf["tie_word_embeddings"]}
    (root / "oracle.json").write_text(json.dumps({**deepseek_oracle_config(text), "make_vocab_size_divisible_by": 1}))
    return root


def judged(dst: Path, root: Path, *flags: str, nproc: int = 1) -> dict:
    proc = kimi("judge", str(dst), "--hf", str(root / "hf"), "--config", str(root / "oracle.json"), *flags,
                nproc=nproc, check=False)
    result = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    assert (proc.returncode == 0) == result["ok"], (proc.returncode, result)
    return result


def same_tensors(a_dir: Path, b_dir: Path) -> None:
    a, b = load_file(str(a_dir / "model.safetensors")), load_file(str(b_dir / "model.safetensors"))
    assert set(a) == set(b), sorted(set(a) ^ set(b))[:4]
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


# (target flags, judge ranks, judge flags): each judged at another layout than it was written at
CASES = {
    "tp2_ep2": (["--target-tp", "2", "--target-ep", "2"], 1, []),
    "pp2": (["--target-pp", "2", "--target-num-layers-in-first-stage", "1"], 2,
            ["--tp", "2", "--ep", "2", "--etp", "1"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_kimi_k25_to_megatron_judged_and_back(case, made, tmp_path):
    flags, ranks, judge_flags = CASES[case]
    dst, back = tmp_path / "dst", tmp_path / "back"
    ok(run_cli("reshard", str(made / "hf"), str(dst), "--dst-format", "torch_dist", "--target-spec", "local", *flags,
               nproc=2))
    result = judged(dst, made, *judge_flags, nproc=ranks)
    assert result["ok"] and result["loaded_tensors"] > 0, result
    assert result["image_features_max_abs_diff"] == 0.0 and result["logits_max_abs_diff_vs_hf"] < 1e-4, result
    ok(run_cli("reshard", str(dst), str(back), "--dst-format", "hf", nproc=2))
    same_tensors(made / "hf", back)
    assert json.loads((back / "config.json").read_text()) == json.loads((made / "hf" / "config.json").read_text())


def test_kimi_k25_saved_spelling_and_a_defect(made, tmp_path):
    """transformers' own save_pretrained spelling converts to the release's names bit for bit, which transformers
    loads back to the reference logits; a projector weight changed by 1e-2 before the conversion fails the judge."""
    out = tmp_path / "from_saved"
    ok(run_cli("reshard", str(made / "saved"), str(out), "--dst-format", "hf"))
    same_tensors(made / "hf", out)
    check = kimi("hf-check", str(out), "--reference", str(made / "reference.pt"), check=False)
    assert check.returncode == 0 and '"ok": true' in check.stdout, check.stdout[-2000:]
    bad = tmp_path / "bad"
    shutil.copytree(made / "hf", bad)
    tensors = load_file(str(bad / "model.safetensors"))
    tensors["mm_projector.proj.2.weight"][0, 0] += 1e-2
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    ok(run_cli("reshard", str(bad), str(tmp_path / "bad_td"), "--dst-format", "torch_dist", "--target-spec", "local"))
    result = judged(tmp_path / "bad_td", made)
    assert not result["ok"] and result["image_features_max_abs_diff"] > 0, result
