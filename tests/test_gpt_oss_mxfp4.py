"""gpt-oss MXFP4 releases under torchrun (gloo): a release written by an independent quantizer (the OCP MX rules by
brute force, tests/test_mxfp4.py's ``reference_quantize``) from a tiny transformers-made gpt-oss is dequantized on
read bit for bit as transformers' own dequantizer does, each rank reading only its experts' blocks; through
torch_dist at EP2 and back with ``--quantize mxfp4`` the release's own blocks and scales come back bit for bit.
Bad input (a tensor without its scales, a scale grid of the wrong shape, ``--quantize mxfp4`` where it cannot
apply) is refused in one line, with no target."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from gpt_oss_models import make_gpt_oss
from safetensors.torch import load_file, save_file
from test_hf import tensors
from test_mxfp4 import bits, reference_quantize

from conftest import assert_refused, ok, run_cli
from hf_models import make_hf_model

EXPERTS = ("gate_up_proj", "down_proj")


def write_release(src: Path, dst: Path) -> Path:
    """``src`` (a bf16 gpt-oss saved by transformers) as OpenAI's release stores it: each expert weight W
    (transformers' [E, cols, rows]) as ``W_blocks`` [E, rows, cols/32, 16] + ``W_scales`` [E, rows, cols/32] of
    its transpose, the rest as saved; config.json with the release's quantization_config."""
    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        out = {}
        for k, t in load_file(f).items():
            if k.endswith(tuple(f"mlp.experts.{e}" for e in EXPERTS)):
                out[k + "_blocks"], out[k + "_scales"] = reference_quantize(t.transpose(-1, -2))
            else:
                out[k] = t
        save_file(out, f, metadata={"format": "pt"})
    index = dst / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        wm = {}
        for k, v in data["weight_map"].items():
            if k.endswith(tuple(f"mlp.experts.{e}" for e in EXPERTS)):
                wm[k + "_blocks"] = wm[k + "_scales"] = v
            else:
                wm[k] = v
        index.write_text(json.dumps({**data, "weight_map": wm}))
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    return write_release(make_gpt_oss(root, "bf16", dtype=torch.bfloat16), root / "release")


def test_mxfp4_release_dequantizes_as_transformers_and_comes_back_bit_for_bit(release, tmp_path):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rel = tensors(release)
    plain = tmp_path / "plain"  # dequantized to bf16 (--dtype keep), one process
    proc = ok(run_cli("reshard", str(release), str(plain), "--dst-format", "hf"))
    assert "dequantized 6 MXFP4 weights to bfloat16 on read" in proc.stderr
    got = tensors(plain)
    assert "quantization_config" not in json.loads((plain / "config.json").read_text())
    n = 0
    for k, t in rel.items():
        if k.endswith("_blocks"):
            name = k.removesuffix("_blocks")
            want = convert_moe_packed_tensors(t, rel[name + "_scales"], dtype=torch.bfloat16)
            assert got[name].dtype == torch.bfloat16 and torch.equal(bits(got[name]), bits(want)), name
            n += 1
        elif not k.endswith("_scales"):
            assert torch.equal(got[k], t), k
    assert n == 6 and set(got) == {k.removesuffix("_blocks") for k in rel if not k.endswith("_scales")}

    mid, back = tmp_path / "mid", tmp_path / "back"  # each of 2 ranks reads its experts' blocks only
    ok(run_cli("reshard", str(release), str(mid), "--dst-format", "torch_dist", "--target-ep", "2", nproc=2))
    ok(run_cli("reshard", str(mid), str(back), "--dst-format", "hf", "--quantize", "mxfp4", nproc=2))
    again = tensors(back)
    assert set(again) == set(rel)
    assert all(again[k].dtype == rel[k].dtype and torch.equal(again[k], rel[k]) for k in rel), \
        [k for k in rel if not torch.equal(again[k], rel[k])]
    cfg = json.loads((back / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "mxfp4"


def edit(release: Path, dst: Path, change) -> Path:
    shutil.copytree(release, dst)
    for f in dst.glob("*.safetensors"):
        t = load_file(f)
        change(t)
        save_file(t, f, metadata={"format": "pt"})
    return dst


def test_bad_mxfp4_input_is_refused(release, tmp_path):
    key = "model.layers.0.mlp.experts.down_proj"
    lost = edit(release, tmp_path / "lost", lambda t: t.pop(key + "_scales"))
    assert_refused(run_cli("reshard", str(lost), str(tmp_path / "dst"), "--dst-format", "torch_dist"), tmp_path,
                   f"{key}_blocks has no {key}_scales")
    grid = edit(release, tmp_path / "grid",
                lambda t: t.update({key + "_scales": t[key + "_scales"][:, :-1].contiguous()}))
    assert_refused(run_cli("reshard", str(grid), str(tmp_path / "dst"), "--dst-format", "torch_dist"), tmp_path,
                   f"{key}_scales has shape")
    assert_refused(run_cli("reshard", str(release), str(tmp_path / "dst"), "--dst-format", "torch_dist",
                           "--quantize", "mxfp4"), tmp_path, "--quantize mxfp4 applies to hf targets")
    llama = make_hf_model(tmp_path, "llama")  # no expert weights to store in MXFP4
    assert_refused(run_cli("reshard", str(llama), str(tmp_path / "dst"), "--dst-format", "hf", "--quantize", "mxfp4"),
                   tmp_path, "--quantize mxfp4 stores gpt-oss's expert weights", "LlamaForCausalLM has none")
