"""Smoke tests proving the megatron-core oracle (tests/oracles/mcore.py) can fail.

A legacy (megatron-format) checkpoint is compared against its torch_dist twin after
perturbing copies of it: changes in vocab padding rows must be ignored, a change of one
element in a layer weight or in a true-vocab embedding row must be reported.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import oracle

CONFIG = {
    "num_layers": 2,
    "hidden_size": 32,
    "ffn_hidden_size": 64,
    "num_attention_heads": 4,
    "num_query_groups": 2,
    "swiglu": True,
    "normalization": "RMSNorm",
    "add_bias_linear": False,
    "add_qkv_bias": False,
    "untie_embeddings_and_output_weights": False,
    "vocab_size": 100,  # padded to 112 at tp=1 with divisible_by 16
    "make_vocab_size_divisible_by": 16,
    "position_embedding_type": "rope",
    "max_position_embeddings": 32,
    "seq_length": 16,
}
SHARD = Path("iter_0000005") / "mp_rank_00" / "model_optim_rng.pt"


def _torchrun(nproc, cmd, *args):
    """The oracle as every test runs it (the session's oracle worker for ``nproc`` ranks)."""
    return oracle(cmd, nproc, *map(str, args), check=False)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    d = tmp_path_factory.mktemp("oracle")
    cfg = d / "cfg.json"
    cfg.write_text(json.dumps(CONFIG))
    r = _torchrun(1, "make", "--config", cfg, "--tp", 1, "--pp", 1, "--seed", 3,
                  "--iteration", 5, "--out-torch-dist", d / "td", "--out-megatron", d / "leg")
    assert r.returncode == 0, r.stdout + r.stderr
    return d, cfg


def _perturbed_copy(d, name, edit):
    dst = d / name
    shutil.copytree(d / "leg", dst)
    ck = torch.load(dst / SHARD, weights_only=False)
    edit(ck["model"])
    torch.save(ck, dst / SHARD)
    return dst


def _compare(cfg, ckpt, ref):
    return _torchrun(1, "compare", "--config", cfg, "--tp", 1, "--pp", 1,
                     "--ckpt", ckpt, "--ref", ref, "--check-args")


def test_padding_rows_are_ignored(made):
    d, cfg = made

    def edit(sd):
        sd["embedding.word_embeddings.weight"][100:] += 1.0  # padding rows only

    r = _compare(cfg, _perturbed_copy(d, "pad", edit), d / "td")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ORACLE OK" in r.stdout


def test_single_element_changes_are_rejected(made):
    d, cfg = made

    def edit(sd):
        sd["decoder.layers.1.mlp.linear_fc2.weight"][3, 5] += 1e-3
        sd["embedding.word_embeddings.weight"][99, 0] += 1e-3  # last true-vocab row

    r = _compare(cfg, _perturbed_copy(d, "bad", edit), d / "td")
    assert r.returncode != 0
    mism = [ln for ln in r.stdout.splitlines() if ln.startswith("MISMATCH")]
    assert len(mism) == 2, r.stdout
    assert any("decoder.layers.1.mlp.linear_fc2.weight" in ln for ln in mism)
    assert any("embedding.word_embeddings.weight" in ln for ln in mism)
    assert "ORACLE FAIL" in r.stdout


# MLA + DeepSeek MoE (dense layer 0, sigmoid + expert bias, groups) + one MTP layer: a change in the MTP
# layer's MLA weight or in its router's expert_bias buffer must be reported (legacy vs legacy: no torch_dist save).
MLA_CONFIG = {**CONFIG, "hidden_size": 32, "untie_embeddings_and_output_weights": True, "qk_layernorm": True,
              "num_query_groups": 4, "multi_latent_attention": True, "q_lora_rank": 16, "kv_lora_rank": 16,
              "qk_head_dim": 8, "qk_pos_emb_head_dim": 4, "v_head_dim": 8, "num_experts": 4,
              "moe_ffn_hidden_size": 16, "moe_shared_expert_intermediate_size": 16, "moe_layer_freq": [0, 1],
              "moe_router_topk": 2, "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
              "moe_router_num_groups": 2, "moe_router_group_topk": 1, "moe_router_topk_scaling_factor": 2.5,
              "mtp_num_layers": 1}
MTP = "mtp.layers.0.transformer_layer."


def test_mla_mtp_changes_are_rejected(tmp_path):
    cfg = tmp_path / "mla.json"
    cfg.write_text(json.dumps(MLA_CONFIG))
    r = _torchrun(1, "make", "--config", cfg, "--tp", 1, "--pp", 1, "--seed", 3, "--iteration", 5,
                  "--out-megatron", tmp_path / "leg")
    assert r.returncode == 0, r.stdout + r.stderr
    dst = tmp_path / "bad"
    shutil.copytree(tmp_path / "leg", dst)
    ck = torch.load(dst / SHARD, weights_only=False)
    sd = ck["model"]
    assert f"{MTP}self_attention.linear_kv_down_proj.weight" in sd and "mtp.layers.0.eh_proj.weight" in sd
    assert ck["args"].multi_latent_attention and ck["args"].mtp_num_layers == 1
    sd[f"{MTP}self_attention.linear_kv_down_proj.weight"][1, 2] += 1e-3
    sd[f"{MTP}mlp.router.expert_bias"][0] += 1e-3
    torch.save(ck, dst / SHARD)
    r = _torchrun(1, "compare", "--config", cfg, "--tp", 1, "--pp", 1, "--ckpt", dst, "--ref", tmp_path / "leg",
                  "--check-args")
    assert r.returncode != 0
    mism = [ln for ln in r.stdout.splitlines() if ln.startswith("MISMATCH")]
    assert len(mism) == 2, r.stdout
    assert any("linear_kv_down_proj" in ln for ln in mism) and any("expert_bias" in ln for ln in mism)
