"""DeepSeek-class models under torchrun (gloo), judged by transformers and megatron-core: tiny
DeepseekV3ForCausalLM models (MLA with and without q LoRA, dense + MoE layers, sigmoid group-limited
routing with a correction bias, shared experts, an MTP layer as the release stores it) imported into
megatron-core give transformers' logits; megatron-core's own MLA + MoE + MTP saves reshard to what
megatron-core makes at the new layout; HF -> megatron -> HF is bit-exact; FP8 releases dequantize to the
formula's values."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_hf import tensors

from conftest import assert_refused, ok, oracle, run_cli
from hf_models import (
    add_mtp_layer,
    assert_bit_exact,
    dequant_fp8,
    hf_logits,
    make_hf_model,
    oracle_config,
    quantize_fp8,
)


@pytest.fixture(scope="module")
def ds(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("deepseek")
    add_mtp_layer(make_hf_model(root, "deepseek_v3"))
    make_hf_model(root, "deepseek_v2_lite")
    make_hf_model(root, "glm4_moe_lite")
    quantize_fp8(make_hf_model(root, "deepseek_v3_fp8"), root / "fp8")
    return root


def write_config(path: Path, cfg: dict) -> str:
    path.write_text(json.dumps(cfg))
    return str(path)


# (HF model, target format, TP, world): imports megatron-core must load strictly and run to transformers' logits
LOGITS = [
    ("deepseek_v3", "torch_dist", 2, 2),  # q LoRA, MTP layer (its forward runs too), down-projections split over TP
    ("deepseek_v2_lite", "megatron", 2, None),  # DeepseekV2: q_proj, softmax routing; legacy files, one process
    ("glm4_moe_lite", "torch_dist", 2, 2),  # GLM-4.7-Flash: V3's MLA and MoE, its MoE layers by mlp_layer_types
]


@pytest.mark.parametrize("name,fmt,tp,world", LOGITS, ids=[f"{c[0]}-{c[1]}-tp{c[2]}" for c in LOGITS])
def test_import_gives_transformers_logits_in_megatron_core(ds, tmp_path, name, fmt, tp, world):
    src, dst = ds / name, tmp_path / "mcore"
    ok(run_cli("reshard", str(src), str(dst), "--target-tp", str(tp), "--dst-format", fmt, "--target-spec", "local",
               nproc=world))
    cfg = oracle_config(src)
    config = write_config(tmp_path / "oracle.json", cfg)
    res = oracle("compare", tp, "--config", config, "--tp", str(tp), "--ckpt", str(dst), "--ref", str(dst),
                 "--check-args")  # strict load at the target layout; the stored args describe the model
    assert "ORACLE OK" in res.stdout
    out = tmp_path / "logits.pt"
    oracle("logits", tp, "--config", config, "--tp", str(tp), "--ckpt", str(dst), "--out", str(out))
    got = torch.load(out)
    want = hf_logits(src, got["tokens"])
    assert want.std() > 0.5  # O(1) logits: the comparison is not vacuous
    torch.testing.assert_close(got["logits"], want, rtol=1e-4, atol=1e-4)
    if cfg.get("mtp_num_layers"):
        assert "ORACLE MTP depth=1" in oracle("mtp", tp, "--config", config, "--tp", str(tp), "--ckpt", str(dst)).stdout
    back = tmp_path / "hf"  # and back: the same architecture and config, every tensor bit for bit
    ok(run_cli("reshard", str(dst), str(back), "--dst-format", "hf", nproc=world))
    a, b = tensors(src), tensors(back)
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    hf, again = (json.loads((d / "config.json").read_text()) for d in (src, back))
    for k in ("architectures", "q_lora_rank", "n_routed_experts", "num_experts_per_tok", "routed_scaling_factor",
              "first_k_dense_replace", "mlp_layer_types", "n_shared_experts"):
        assert k not in hf or again.get(k) == hf[k], k


# (runtime, TP, PP of megatron-core's save, the sources converted: (format, target EP, world))
MADE = [("default", 2, 2, [("torch_dist", 1, 2), ("megatron", 2, 4)]),
        # 0.19-style torch_dist, and legacy files naming the MTP layer's TransformerLayer mtp_model_layer; the
        # CLI under the second runtime
        ("mcore19", 2, 1, [("megatron", 2, 2)])]


@pytest.mark.parametrize("runtime,tp,pp,sources", MADE, ids=[c[0] for c in MADE])
def test_megatron_core_mla_saves_reshard_to_what_megatron_core_loads(ds, tmp_path, runtime, tp, pp, sources):
    """megatron-core's own MLA + MoE + MTP model (MTP on the last stage), saved as torch_dist and legacy,
    converted to TP=1 PP=1 (EP=2 from legacy): megatron-core's strict load of it equals megatron-core's
    own load of the torch_dist save at TP=1 (its DCP reshards)."""
    config = write_config(tmp_path / "c.json", oracle_config(ds / "deepseek_v3"))
    made = {"torch_dist": tmp_path / "src_td", "megatron": tmp_path / "src_mg"}
    oracle("make", tp * pp, "--config", config, "--tp", str(tp), "--pp", str(pp), *(["--first", "1"] if pp > 1 else []),
           "--seed", "3", "--iteration", "5", "--out-torch-dist", str(made["torch_dist"]),
           "--out-megatron", str(made["megatron"]), runtime=runtime)
    for fmt, ep, world in sources:
        dst = tmp_path / f"dst_{fmt}"
        ok(run_cli("reshard", str(made[fmt]), str(dst), "--target-tp", "1", "--target-pp", "1", "--target-ep", str(ep),
                   "--dst-format", "torch_dist", nproc=world, runtime=runtime))
        res = oracle("compare", ep, "--config", config, "--tp", "1", "--pp", "1", "--ep", str(ep), "--ckpt", str(dst),
                     "--ref", str(made["torch_dist"]), "--ref-format", "torch_dist", "--check-args", runtime=runtime)
        assert "ORACLE OK" in res.stdout


def test_hf_to_megatron_to_hf_is_bit_exact_with_the_mtp_layer(ds, tmp_path):
    """MTP on the last of two stages (with its embedding copy in the legacy rank file), TE naming, then back:
    every tensor of the release, the MTP layer's embedding and head copies included, bit for bit."""
    src, td, mg, back = ds / "deepseek_v3", tmp_path / "td", tmp_path / "mg", tmp_path / "hf"
    ok(run_cli("reshard", str(src), str(td), "--target-tp", "2", "--target-pp", "2",
               "--target-num-layers-in-first-stage", "1", "--dst-format", "torch_dist", nproc=2))
    ok(run_cli("reshard", str(td), str(mg), "--target-tp", "1", "--dst-format", "megatron", nproc=4))
    ok(run_cli("reshard", str(mg), str(back), "--dst-format", "hf", nproc=2))
    b = assert_bit_exact(src, back)
    assert any(".layers.3.eh_proj." in k for k in b)
    assert b["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    hf = json.loads((back / "config.json").read_text())
    assert (hf["num_nextn_predict_layers"], hf["n_group"], hf["routed_scaling_factor"]) == (1, 2, 2.5)


def test_fp8_release_dequantizes_to_the_formula(ds, tmp_path):
    src, td, back = ds / "fp8", tmp_path / "td", tmp_path / "hf"
    ok(run_cli("reshard", str(src), str(td), "--target-tp", "2", "--dst-format", "torch_dist", nproc=2))
    ok(run_cli("reshard", str(td), str(back), "--dst-format", "hf", nproc=None))
    q, got = tensors(src), tensors(back)
    scaled = [k for k in got if k + "_scale_inv" in q]
    assert len(scaled) > 20 and not any(k.endswith("_scale_inv") for k in got)
    assert any(q[k].shape[0] % 128 for k in scaled)  # partial blocks
    for k, t in got.items():
        want = dequant_fp8(q[k], q[k + "_scale_inv"]).to(torch.bfloat16) if k in scaled else q[k]
        assert t.dtype == want.dtype and torch.equal(t, want), k
    # dequantized in fp32 and written back with --quantize fp8-block (sharded): the release, bit for bit
    td32, again = tmp_path / "td32", tmp_path / "fp8"
    ok(run_cli("reshard", str(src), str(td32), "--target-tp", "2", "--dst-format", "torch_dist", "--dtype", "fp32",
               nproc=2))
    ok(run_cli("reshard", str(td32), str(again), "--dst-format", "hf", "--quantize", "fp8-block", "--max-shard-size",
               "200KB", nproc=2))
    back = tensors(again)
    assert set(back) == set(q) and len(list(again.glob("*.safetensors"))) > 1
    for k, t in q.items():
        assert back[k].dtype == t.dtype and torch.equal(back[k].view(torch.uint8), t.view(torch.uint8)), k
    assert json.loads((again / "config.json").read_text())["quantization_config"]["weight_block_size"] == [128, 128]


def _edit_fp8(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        t = load_file(f)
        edit(t)
        save_file(t, f)
    return dst


@pytest.mark.parametrize("case,needles", [
    ("no scale", ("without its scale", "_scale_inv")),
    ("wrong grid", ("_scale_inv has shape", "float32 grid")),
    ("attention bias", ("attention_bias", "megatron-core")),
    ("mtp copy differs", ("model.layers.3.shared_head.head.weight", "differs from lm_head.weight")),
    ("quantize torch_dist", ("--quantize fp8-block applies to hf targets", "--dst-format hf")),
    ("tp splits no heads", ("TP=8 does not divide num_attention_heads=4", "--target-tp")),
])
def test_bad_deepseek_input_is_refused(ds, tmp_path, case, needles):
    src = tmp_path / "src"
    if case == "attention bias":
        shutil.copytree(ds / "deepseek_v2_lite", src)
        hf = json.loads((src / "config.json").read_text())
        (src / "config.json").write_text(json.dumps({**hf, "attention_bias": True}))
    elif case == "mtp copy differs":  # the MTP layer's copy of the output head is not the head
        shutil.copytree(ds / "deepseek_v3", src)
        t = load_file(src / "model-mtp.safetensors")
        t["model.layers.3.shared_head.head.weight"][5, 7] += 1.0
        save_file(t, src / "model-mtp.safetensors")
    elif case == "quantize torch_dist":
        src = ds / "fp8"
    elif case == "tp splits no heads":
        src = ds / "deepseek_v3"
    else:
        name = "model.layers.0.self_attn.kv_b_proj.weight_scale_inv"

        def edit(t):
            if name in t:
                if case == "no scale":
                    del t[name]
                else:
                    t[name] = torch.ones(t[name].shape[0] + 1, t[name].shape[1])
        _edit_fp8(ds / "fp8", src, edit)
    flags = {"quantize torch_dist": ["--quantize", "fp8-block"], "tp splits no heads": ["--target-tp", "8"]}
    extra = flags.get(case, [])
    assert_refused(run_cli("reshard", str(src), str(tmp_path / "dst"), "--dst-format", "torch_dist", *extra), tmp_path,
                   *needles)


def test_qwen3_fp8_release_dequantizes_too(tmp_path):
    """Block-scaled FP8 is not DeepSeek's alone: a Qwen3 FP8 release (same layout) imports the same way."""
    src = quantize_fp8(make_hf_model(tmp_path, "qwen3"), tmp_path / "qwen3_fp8")
    td, back = tmp_path / "td", tmp_path / "hf"
    ok(run_cli("reshard", str(src), str(td), "--target-tp", "2", "--dst-format", "torch_dist", "--dtype", "fp32"))
    ok(run_cli("reshard", str(td), str(back), "--dst-format", "hf"))
    q, got = tensors(src), tensors(back)
    scaled = [k for k in got if k + "_scale_inv" in q]
    assert len(scaled) >= 14
    for k, t in got.items():
        want = dequant_fp8(q[k], q[k + "_scale_inv"]) if k in scaled else q[k]
        assert torch.equal(t, want), k
