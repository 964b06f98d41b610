"""LoRA adapters under torchrun (gloo, 2 ranks), judged by HF peft 0.21.2 and megatron-core (tests/oracles/peft_lora.py,
tests/oracles/mcore.py; Megatron-Bridge's side: tests/test_lora_bridge.py):

- merge (``reshard BASE DST --lora ADAPTER``): peft's own ``merge_and_unload`` of its own adapter is the truth of
  the merged weights (HF targets) and of the logits megatron-core computes from a merged torch_dist target;
- adapter only: a peft adapter written as Megatron-Bridge's LoRA checkpoint at TP2 and back is loaded by peft
  and changes every weight as the original does (peft's ``get_delta_weight``), including the zero blocks of
  modules peft left out; ``verify`` compares adapters of different structure by their products;
- bad input is refused in one line with no target left behind.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from test_hf import tensors

from conftest import assert_refused, ok, oracle, run_cli
from hf_models import hf_logits, make_hf_model, oracle_config

VARIANTS = ("plain", "patterns", "rslora", "qv", "dora", "ranks")


def peft(cmd: str, *args: str) -> str:
    return oracle(cmd, 1, *args, program="peft_lora", runtime="mcore19").stdout


@pytest.fixture(scope="session")
def lora(tmp_path_factory) -> Path:
    """A tiny Llama, peft's adapters of it (each variant) and peft's merges of two of them."""
    root = tmp_path_factory.mktemp("lora")
    make_hf_model(root, "llama")
    for variant in VARIANTS:
        peft("make", "--hf", str(root / "llama"), "--out", str(root / variant), "--variant", variant)
    for variant in ("patterns", "rslora"):
        peft("merge", "--hf", str(root / "llama"), "--adapter", str(root / variant), "--out",
             str(root / f"merged-{variant}"))
    return root


@pytest.mark.parametrize("variant,dtype", [("patterns", "keep"), ("rslora", "bf16")])
def test_merge_into_hf_equals_peft_merge_and_unload(lora, tmp_path, variant, dtype):
    dst = tmp_path / "merged"
    ok(run_cli("reshard", str(lora / "llama"), str(dst), "--lora", str(lora / variant), "--dst-format", "hf",
               "--dtype", dtype, nproc=2))
    got, want, base = tensors(dst), tensors(lora / f"merged-{variant}"), tensors(lora / "llama")
    assert set(got) == set(want)
    changed = [k for k in want if not torch.equal(want[k], base[k])]
    assert len(changed) == 14  # the adapter changes every adapted weight (the test is not vacuous)
    for k in want:
        if dtype == "keep":
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-6)
        else:  # merged in float32, then cast once: a bf16 rounding of peft's float32 merge (peft's runs in another
            # process; within 1e-6 of it, a value next to a rounding boundary may round either way, and no further)
            assert got[k].dtype == torch.bfloat16
            lo, hi = (want[k] - 1e-6).bfloat16(), (want[k] + 1e-6).bfloat16()
            assert bool(((lo <= got[k]) & (got[k] <= hi)).all()), k


def test_merge_into_torch_dist_tp2_gives_peft_logits_in_megatron_core(lora, tmp_path):
    dst = tmp_path / "mcore"
    ok(run_cli("reshard", str(lora / "llama"), str(dst), "--lora", str(lora / "patterns"), "--dst-format",
               "torch_dist", "--target-tp", "2", "--target-spec", "local", nproc=2))
    config = tmp_path / "oracle.json"
    config.write_text(json.dumps(oracle_config(lora / "llama")))
    out = tmp_path / "logits.pt"
    oracle("logits", 2, "--config", str(config), "--tp", "2", "--ckpt", str(dst), "--out", str(out))  # strict load
    got = torch.load(out)
    want = hf_logits(lora / "merged-patterns", got["tokens"])
    assert (want - hf_logits(lora / "llama", got["tokens"])).abs().max() > 0.1  # the merge changes the logits
    torch.testing.assert_close(got["logits"], want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family,variant,layout", [
    ("qwen3", "plain", ("--target-tp", "2")),  # q/k norm, head_dim 32 != hidden / heads
    ("qwen3_moe", "qv", ("--target-tp", "2", "--target-ep", "2")),  # MoE: attention adapters; experts refused
])
def test_merge_across_families_and_layouts(tmp_path, family, variant, layout):
    make_hf_model(tmp_path, family)
    base, adapter, merged = tmp_path / family, tmp_path / "adapter", tmp_path / "merged"
    peft("make", "--hf", str(base), "--out", str(adapter), "--variant", variant)
    peft("merge", "--hf", str(base), "--adapter", str(adapter), "--out", str(merged))
    ok(run_cli("reshard", str(base), str(tmp_path / "mcore"), "--lora", str(adapter), "--dst-format", "torch_dist",
               *layout, nproc=2))
    ok(run_cli("reshard", str(tmp_path / "mcore"), str(tmp_path / "hf"), "--dst-format", "hf", nproc=2))
    got, want = tensors(tmp_path / "hf"), tensors(merged)
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-6)
    if family == "qwen3_moe":  # peft puts adapters on the packed experts as target_parameters: one line
        peft("make", "--hf", str(base), "--out", str(tmp_path / "experts"))
        assert_refused(run_cli("reshard", str(base), str(tmp_path / "dst"), "--lora", str(tmp_path / "experts"),
                               "--dst-format", "hf", nproc=2), tmp_path, "target_parameters")


@pytest.mark.parametrize("variant", ["plain", "qv", "ranks"])
def test_peft_adapter_to_bridge_lora_tp2_and_back(lora, tmp_path, variant):
    mega, back = tmp_path / "bridge", tmp_path / "peft"
    ok(run_cli("reshard", str(lora / variant), str(mega), "--dst-format", "torch_dist", "--target-tp", "2",
               "--base", str(lora / "llama"), nproc=2))
    peft_section = (mega / "release" / "run_config.yaml").read_text().split("peft:")[1]
    assert "_target_: megatron.bridge.peft.lora.LoRA" in peft_section
    ok(run_cli("reshard", str(mega), str(back), "--dst-format", "hf", nproc=2))
    out = peft("check", "--hf", str(lora / "llama"), "--adapter", str(back), "--ref", str(lora / variant))
    assert "ORACLE OK" in out
    ok(run_cli("verify", str(lora / variant), str(mega), "--base", str(lora / "llama")))


def test_peft_to_peft_keeps_tensors_and_config(lora, tmp_path):
    dst = tmp_path / "peft"
    ok(run_cli("reshard", str(lora / "patterns"), str(dst), "--base", str(lora / "llama"), nproc=2))
    assert "ORACLE OK" in peft("check", "--hf", str(lora / "llama"), "--adapter", str(dst), "--ref",
                               str(lora / "patterns"), "--tensors")


def test_inspect_shows_an_adapter(lora):
    proc = ok(run_cli("inspect", str(lora / "patterns"), "--json"))
    info = json.loads(proc.stdout[proc.stdout.index("{"):])["adapter"]
    assert info["kind"] == "peft" and info["modules"] == 14 and info["ranks"] == [2, 4, 6, 8]
    assert info["megatron_targets"] == ["linear_fc1", "linear_fc2", "linear_proj", "linear_qkv"]


def renamed_adapter(src: Path, dst: Path, old: str, new: str) -> Path:
    shutil.copytree(src, dst)
    t = tensors(dst)
    save_file({k.replace(old, new): v for k, v in t.items()}, str(dst / "adapter_model.safetensors"))
    return dst


def test_bad_adapters_are_refused(lora, tmp_path):
    base = str(lora / "llama")
    cases = [
        (["reshard", base, "DST", "--lora", str(lora / "dora"), "--dst-format", "hf"], ("DoRA",)),
        (["reshard", str(lora / "plain"), "DST", "--dst-format", "nemo", "--base", base], ("holds whole models",)),
        (["reshard", base, "DST", "--lora", str(lora / "plain"), "--optimizer", "--dst-format", "torch_dist"],
         ("--optimizer",)),
        (["reshard", str(lora / "patterns"), "DST", "--dst-format", "torch_dist", "--base", base],
         ("no power of two", "--dst-format hf")),
        (["reshard", base, "DST", "--lora", str(renamed_adapter(lora / "plain", tmp_path / "l5", "layers.1.",
                                                                "layers.5.")), "--dst-format", "hf"],
         ("model.layers.5.", "--base")),
    ]
    make_hf_model(tmp_path, "qwen3")  # head_dim 32: another model's shapes
    cases.append((["reshard", str(tmp_path / "qwen3"), "DST", "--lora", str(lora / "plain"), "--dst-format", "hf"],
                  ("do not adapt the base",)))
    for args, needles in cases:
        args = [str(tmp_path / "dst") if a == "DST" else a for a in args]
        assert_refused(run_cli(*args, nproc=2), tmp_path, *needles)
