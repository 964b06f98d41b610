"""LoRA adapters between Megatron-Bridge and HF peft under torchrun (gloo, 2 ranks), judged by Megatron-Bridge
0.6.2's own LoRA code on CPU (tests/oracles/bridge_lora.py: its ``save_checkpoint`` makes the LoRA PEFT checkpoint,
its ``save_hf_adapter`` and merged export are the truth, its ``load_peft_adapter_checkpoint`` at TP2 and
``export_adapter_ckpt`` read what dist_convert writes) and by peft 0.21.2 (tests/oracles/peft_lora.py)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_hf import tensors

from conftest import assert_refused, ok, oracle, run_cli


def bridge_lora(cmd: str, nproc: int, *args: str) -> str:
    return oracle(cmd, nproc, *args, program="bridge_lora", runtime="mcore19").stdout


@pytest.fixture(scope="session")
def made(tmp_path_factory) -> Path:
    """A tiny Llama (with tokenizer), Megatron-Bridge's LoRA PEFT checkpoint of it (dim 4, alpha 8, every adapter
    tensor random), Bridge's HF peft export of that adapter and Bridge's merged HF model."""
    root = tmp_path_factory.mktemp("bridge_lora")
    oracle("make-hf", 1, "--root", str(root), program="bridge", runtime="mcore19")
    bridge_lora("make", 1, "--hf", str(root / "llama"), "--out", str(root / "made"))
    return root


def test_bridge_adapter_to_peft_is_bridges_save_hf_adapter(made, tmp_path):
    dst = tmp_path / "peft"
    ok(run_cli("reshard", str(made / "made" / "peft_ckpt"), str(dst), "--dst-format", "hf", nproc=2))
    out = oracle("check", 1, "--hf", str(made / "llama"), "--adapter", str(dst), "--ref",
                 str(made / "made" / "hf_adapter"), "--tensors", program="peft_lora", runtime="mcore19").stdout
    assert "ORACLE OK" in out


@pytest.mark.parametrize("source", ["hf_adapter", "peft_ckpt"])
def test_bridge_loads_the_tp2_adapter_and_exports_it_back(made, tmp_path, source):
    """Bridge's own HF export (q/k/v sharing one A) and Bridge's own checkpoint, written as Bridge's LoRA
    checkpoint at TP2: Bridge loads every adapter tensor at TP2 and its forward equals peft's."""
    dst = tmp_path / "tp2"
    ok(run_cli("reshard", str(made / "made" / source), str(dst), "--dst-format", "torch_dist", "--target-tp", "2",
               "--base", str(made / "llama"), nproc=2))
    ref = str(made / "made" / "hf_adapter")
    assert "ORACLE OK" in bridge_lora("load", 2, "--ckpt", str(dst), "--hf", str(made / "llama"), "--tp", "2",
                                      "--ref-adapter", ref)
    assert "ORACLE OK" in bridge_lora("export", 1, "--ckpt", str(dst), "--hf", str(made / "llama"), "--out",
                                      str(tmp_path / "exported"), "--ref-adapter", ref)


def test_merge_of_a_bridge_adapter_is_bridges_merge(made, tmp_path):
    dst = tmp_path / "merged"
    ok(run_cli("reshard", str(made / "llama"), str(dst), "--lora", str(made / "made" / "peft_ckpt"),
               "--dst-format", "hf", nproc=2))
    got, want = tensors(dst), tensors(made / "made" / "merged")
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-6)


def test_canonical_lora_is_refused_in_one_line(made, tmp_path):
    bridge_lora("make", 1, "--hf", str(made / "llama"), "--out", str(tmp_path / "canonical"), "--canonical")
    assert_refused(run_cli("reshard", str(tmp_path / "canonical" / "peft_ckpt"), str(tmp_path / "dst"),
                           "--dst-format", "hf", nproc=2), tmp_path, "CanonicalLoRA", "peft=LoRA")


@pytest.mark.parametrize("variant,dim", [("plain", 12), ("ranks", 16)])
def test_bridge_runs_a_block_structured_adapter_as_peft_runs_the_original(made, tmp_path, variant, dim):
    """peft's own adapter (q/k/v and gate/up each with their own A) becomes one block-structured Bridge module per
    fused tensor (plain: dim 3 x 4; ranks: q of rank 8 beside k and v of 4, scales a power of two apart, folded into
    B): Bridge loads it at TP2 and its LoRA forward gives the logits peft gives with the original adapter."""
    llama, adapter, dst = made / "llama", tmp_path / "peft", tmp_path / "tp2"
    oracle("make", 1, "--hf", str(llama), "--out", str(adapter), "--variant", variant, program="peft_lora",
           runtime="mcore19")
    ok(run_cli("reshard", str(adapter), str(dst), "--dst-format", "torch_dist", "--target-tp", "2", "--base",
               str(llama), nproc=2))
    assert f"dim: {dim}" in (dst / "release" / "run_config.yaml").read_text()
    assert "ORACLE OK" in bridge_lora("load", 2, "--ckpt", str(dst), "--hf", str(llama), "--tp", "2", "--ref-adapter",
                                      str(adapter), "--logits-only")
