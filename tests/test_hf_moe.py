"""Hugging Face Mixture-of-Experts models (Mixtral, Qwen2-MoE, Qwen3-MoE): the name table and config
mapping against checkpoints transformers saved (pure), and HF -> HF / HF -> torch_dist -> HF through the
real CLI, byte-identical and loadable by transformers (megatron-core logits when the oracle has MoE)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dist_convert.datamodel import SourceChunk
from dist_convert.errors import ConvertError
from dist_convert.formats.hf import hf_tensors, source_tensors
from dist_convert.formats.safetensors_io import read_header
from dist_convert.layout.rules import logical_tensors
from dist_convert.models import config_from_hf, family_of, hf_from_config
from dist_convert.models.moe import hf_moe_pattern
from dist_convert.plan import select_source

from conftest import ok, oracle, run_cli
from flat_config import with_flat
from hf_models import MOE_FAMILIES, hf_logits, make_hf_model, oracle_config


@pytest.fixture(scope="session")
def moe_dir(tmp_path_factory) -> Path:
    """The three families saved by transformers (per-expert names), and Mixtral saved fused
    (``save_original_format=False``: ``mlp.experts.gate_up_proj`` / ``down_proj``, router ``mlp.gate``)."""
    root = tmp_path_factory.mktemp("hf_moe")
    for name in MOE_FAMILIES:
        make_hf_model(root, name)
    make_hf_model(root / "fused", "mixtral", save_original_format=False)
    return root


def tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _index(path: Path):
    hf = json.loads((path / "config.json").read_text())
    cfg, args, notes = config_from_hf(hf, None)
    found = {k: shape for f in path.glob("*.safetensors") for k, (_, shape) in read_header(f).items()}
    return hf, cfg, args, found


@pytest.mark.parametrize("sub", [*MOE_FAMILIES, "fused/mixtral"])
def test_every_saved_tensor_is_mapped_and_covers_each_logical_tensor_once(moe_dir, sub):
    hf, cfg, args, found = _index(moe_dir / sub)
    expected, _ = source_tensors(cfg, family_of(hf), found)
    assert set(expected) == set(found)
    assert all(tuple(found[k]) == tuple(shape) for k, (shape, _) in expected.items())
    chunks = [SourceChunk(id=i, file="model.safetensors", key=k, shape=s, dtype=torch.float32, pieces=p)
              for i, (k, (s, p)) in enumerate(expected.items())]
    select_source(chunks, {n: torch.Size(t.shape).numel() for n, t in logical_tensors(cfg).items()})  # gap/overlap
    assert set(hf_tensors(cfg, family_of(hf))) == set(tensors(moe_dir / sub.split("/")[-1]))  # what export writes


def test_expert_pieces_fuse_gate_and_up_like_megatron_core(moe_dir):
    """fc1 of a routed or shared expert = [gate; up] (Mixtral: [w1; w3]); the fused transformers form
    gives the same logical tensors as the per-expert names."""
    def fuse(path: Path) -> dict[str, torch.Tensor]:
        hf, cfg, _, found = _index(path)
        stored = tensors(path)
        out = {n: torch.full(t.shape, float("nan")) for n, t in logical_tensors(cfg).items()}
        for name, (_, pieces) in source_tensors(cfg, family_of(hf), found)[0].items():
            for p in pieces:
                out[p.logical][p.lbox.slices()] = stored[name][p.sbox.slices()]
        assert not any(t.isnan().any() for t in out.values())
        return out

    q = tensors(moe_dir / "qwen2_moe")
    got = fuse(moe_dir / "qwen2_moe")
    pre = "model.layers.2.mlp."
    assert torch.equal(got["decoder.layers.2.mlp.experts.local_experts.3.linear_fc1.weight"],
                       torch.cat([q[pre + "experts.3.gate_proj.weight"], q[pre + "experts.3.up_proj.weight"]]))
    assert torch.equal(got["decoder.layers.2.mlp.shared_experts.linear_fc1.weight"],
                       torch.cat([q[pre + "shared_expert.gate_proj.weight"], q[pre + "shared_expert.up_proj.weight"]]))
    assert torch.equal(got["decoder.layers.2.mlp.shared_experts.gate_weight"], q[pre + "shared_expert_gate.weight"])
    assert torch.equal(got["decoder.layers.0.mlp.linear_fc1.weight"],  # the dense layer (mlp_only_layers)
                       torch.cat([q["model.layers.0.mlp.gate_proj.weight"], q["model.layers.0.mlp.up_proj.weight"]]))
    m = tensors(moe_dir / "mixtral")
    per_expert, fused = fuse(moe_dir / "mixtral"), fuse(moe_dir / "fused" / "mixtral")
    assert set(per_expert) == set(fused) and all(torch.equal(per_expert[k], fused[k]) for k in per_expert)
    pre = "model.layers.1.block_sparse_moe.experts.2."
    assert torch.equal(per_expert["decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight"],
                       torch.cat([m[pre + "w1.weight"], m[pre + "w3.weight"]]))
    assert torch.equal(per_expert["decoder.layers.1.mlp.experts.local_experts.2.linear_fc2.weight"],
                       m[pre + "w2.weight"])


QWEN_MOE = {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "vocab_size": 1000,
            "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 6, "num_attention_heads": 8,
            "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "max_position_embeddings": 128,
            "tie_word_embeddings": False, "rope_theta": 1e4, "num_experts": 8, "num_experts_per_tok": 2,
            "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48, "decoder_sparse_step": 2,
            "mlp_only_layers": [3], "norm_topk_prob": False, "qkv_bias": True}


def test_layer_pattern_and_megatron_args_and_config_round_trip():
    assert hf_moe_pattern(6, 2, [3]) == (0, 1, 0, 0, 0, 1)  # (l + 1) % step == 0, not in mlp_only_layers
    assert hf_moe_pattern(3, 1, []) == (1, 1, 1)
    cfg, args, notes = config_from_hf(QWEN_MOE, None)
    assert cfg.moe.layer_pattern == (0, 1, 0, 0, 0, 1) and args.moe_layer_freq == [0, 1, 0, 0, 0, 1]
    assert (cfg.num_experts, cfg.expert_ffn, cfg.ffn_hidden_size, cfg.shared_size,
            cfg.moe.shared_gate, cfg.add_qkv_bias) == (8, 32, 96, 48, True, True)
    assert (args.moe_router_topk, args.moe_router_pre_softmax, args.expert_model_parallel_size,
            args.expert_tensor_parallel_size) == (2, True, 1, 1) and not notes
    back = hf_from_config(cfg, torch.float32, base=QWEN_MOE)
    assert {k: back[k] for k in QWEN_MOE} == QWEN_MOE  # the original step/mlp_only_layers are kept
    # from the megatron config alone (no base): an explicit list of dense layers
    back = hf_from_config(cfg, torch.float32)
    assert back["architectures"] == ["Qwen2MoeForCausalLM"] and (back["decoder_sparse_step"],
                                                                back["mlp_only_layers"]) == (1, [0, 2, 3, 4])
    assert hf_moe_pattern(6, 1, back["mlp_only_layers"]) == cfg.moe.layer_pattern
    all_moe, args, _ = config_from_hf({**QWEN_MOE, "decoder_sparse_step": 1, "mlp_only_layers": [],
                                       "num_local_experts": 8, "norm_topk_prob": True}, None)
    assert all_moe.moe.layer_pattern is None and args.moe_layer_freq == 1 and not args.moe_router_pre_softmax
    mixtral = {**QWEN_MOE, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": 4,
               "router_jitter_noise": 0.1}
    cfg, args, notes = config_from_hf(mixtral, None)
    assert (cfg.ffn_hidden_size, cfg.expert_ffn, cfg.moe.layer_pattern, args.moe_layer_freq,
            args.moe_router_pre_softmax, cfg.add_qkv_bias) == (96, 96, None, 1, False, False)
    assert "router_jitter_noise" in notes[0]


def test_export_family_from_the_model_and_refusals():
    cfg, args, _ = config_from_hf(QWEN_MOE, None)
    assert hf_from_config(cfg, torch.float32)["architectures"] == ["Qwen2MoeForCausalLM"]
    no_shared = with_flat(cfg, moe_shared_expert_intermediate_size=None, moe_shared_expert_gate=False,
                          add_qkv_bias=False).replace(moe__pre_softmax=False)  # renormalised top-k, as Mixtral
    q3 = hf_from_config(with_flat(no_shared, qk_layernorm=True), torch.float32)
    assert q3["architectures"] == ["Qwen3MoeForCausalLM"] and q3["mlp_only_layers"] == [0, 2, 3, 4]
    mixtral = hf_from_config(with_flat(no_shared, moe_layer_pattern=None), torch.float32)
    assert mixtral["architectures"] == ["MixtralForCausalLM"] and mixtral["intermediate_size"] == 32
    refusals = [
        (with_flat(cfg, moe_router_expert_bias=True), "router expert bias"),
        (with_flat(cfg, moe_shared_expert_gate=False), "moe_shared_expert_gate=False"),
        (no_shared, "dense layers between the MoE layers"),  # Mixtral has no dense layers
        (with_flat(no_shared, moe_layer_pattern=None, add_qkv_bias=True), "qkv biases"),
    ]
    mixtral_cfg = with_flat(no_shared, moe_layer_pattern=None)
    router = [(mixtral_cfg.replace(moe__pre_softmax=True), "renormalises"),
              (cfg.replace(moe__score_function="sigmoid"), "sigmoid")]
    for bad, needle in refusals + router:
        with pytest.raises(ConvertError, match=needle) as e:
            hf_from_config(bad, torch.float32)
        assert "--dst-format torch_dist" in str(e.value) and "\n" not in str(e.value)
    # an HF config of the other kind (dense vs MoE) as the base is not followed
    llama = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    assert hf_from_config(cfg, torch.float32, base=llama)["architectures"] == \
        ["Qwen2MoeForCausalLM"]
    assert hf_from_config(with_flat(cfg, num_experts=0), torch.float32,
                          base=QWEN_MOE)["architectures"] == ["Qwen2ForCausalLM"]


@pytest.mark.parametrize("sub,world", [("mixtral", 2), ("qwen2_moe", 2), ("qwen3_moe", None), ("fused/mixtral", None)])
def test_hf_to_hf_is_byte_identical_and_loads_in_transformers(moe_dir, tmp_path, sub, world):
    """The fused Mixtral is written back with per-expert names, equal to the per-expert original."""
    src, out = moe_dir / sub, tmp_path / "hf"
    ok(run_cli("reshard", str(src), str(out), "--dst-format", "hf", nproc=world))
    want = moe_dir / sub.split("/")[-1]
    a, b = tensors(want), tensors(out)
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    import transformers

    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert type(model).__name__ == json.loads((want / "config.json").read_text())["architectures"][0]
    tokens = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(hf_logits(out, tokens), hf_logits(want, tokens), rtol=0, atol=0)


# (family, target EP = oracle world). Mixtral: every layer MoE (stacked torch_dist keys), pre_softmax False;
# Qwen2-MoE: dense layer 0 (per-layer keys), gated shared expert, qkv bias, pre_softmax True;
# Qwen3-MoE: dense layers 0 and 2, q/k norm, tied embeddings, norm_topk_prob True.
VIA_TORCH_DIST = [("mixtral", 2), ("qwen2_moe", 1), ("qwen3_moe", 2)]


@pytest.mark.parametrize("name,ep", VIA_TORCH_DIST, ids=[f"{n}-ep{e}" for n, e in VIA_TORCH_DIST])
def test_hf_to_torch_dist_gives_transformers_logits_and_comes_back_byte_identical(moe_dir, tmp_path, name, ep):
    src, mid, back = moe_dir / name, tmp_path / "mcore", tmp_path / "hf"
    ok(run_cli("reshard", str(src), str(mid), "--dst-format", "torch_dist", "--target-ep", str(ep),
               "--target-spec", "local", nproc=2))
    config = tmp_path / "oracle.json"
    config.write_text(json.dumps(oracle_config(src)))
    res = oracle("compare", ep, "--config", str(config), "--tp", "1", "--ep", str(ep), "--ckpt", str(mid),
                 "--ref", str(mid), "--check-args")  # strict load at TP1/EPep; the stored MoE args describe the model
    assert "ORACLE OK" in res.stdout
    out = tmp_path / "logits.pt"
    oracle("logits", ep, "--config", str(config), "--tp", "1", "--ep", str(ep), "--ckpt", str(mid), "--out", str(out))
    got = torch.load(out)
    want = hf_logits(src, got["tokens"])
    assert want.std() > 0.5  # O(1) logits: the comparison is not vacuous
    torch.testing.assert_close(got["logits"], want, rtol=1e-4, atol=1e-4)
    ok(run_cli("reshard", str(mid), str(back), "--dst-format", "hf", nproc=2))
    a, b = tensors(src), tensors(back)
    assert set(a) == set(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    assert json.loads((back / "config.json").read_text())["architectures"] == [json.loads(
        (src / "config.json").read_text())["architectures"][0]]
