"""gpt-oss (``GptOssForCausalLM``) judged by code nobody here wrote: transformers makes and saves a tiny model
(tests/gpt_oss_models.py: biases, sinks, norms away from 1, 4 experts top-2, sliding and full layers, YaRN,
head_dim != hidden / heads, odd vocabulary, untied), dist_convert converts it under torchrun, and megatron-core
0.16.1 (tests/oracles/mcore.py, local spec on CPU) loads the result strictly and computes the logits that are
compared with transformers'. Back to HF: bit-exact tensors, the same config.json, a clean from_pretrained.

On CPU megatron-core's own local attention runs the sinks (SoftmaxOne) and the sliding window (the torch path
of FusedScaleMaskSoftmax); the oracle builds only the window's mask on the CPU instead of "cuda". The window (4)
is shorter than the oracle's 16 tokens, so it cuts: ``test_every_part_of_the_model_changes_the_logits`` shows
the logits depend on it, on the sinks, the clamp and YaRN."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gpt_oss_models import CONFIG, gpt_oss_oracle_config, make_gpt_oss
from test_hf import tensors

from dist_convert.config import config_from_args
from dist_convert.datamodel import SourceChunk
from dist_convert.errors import ConvertError
from dist_convert.formats.hf import hf_tensors, source_tensors
from dist_convert.formats.safetensors_io import read_header
from dist_convert.layout.boxes import logical_view
from dist_convert.layout.rules import logical_tensors
from dist_convert.layout.topology import Layout
from dist_convert.models import config_from_hf, family_of, hf_from_config
from dist_convert.models.gpt_oss import layer_types_of, skip_freq
from dist_convert.plan import select_source

from conftest import ok, oracle, run_cli
from flat_config import with_flat
from hf_models import hf_logits

HF_CONFIG = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", **CONFIG}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    """The fp32 model (``gpt_oss``) and the same in bf16 (``gpt_oss_bf16``), both saved by transformers."""
    root = tmp_path_factory.mktemp("gpt_oss")
    make_gpt_oss(root)
    make_gpt_oss(root, "gpt_oss_bf16", dtype=torch.bfloat16)
    return root


@pytest.fixture(scope="module")
def mcore(models, tmp_path_factory) -> Path:
    """HF -> torch_dist at TP2 EP2 (experts unsplit: megatron-core takes MoE biases only at ETP 1), 2 ranks."""
    out = tmp_path_factory.mktemp("gpt_oss_mcore") / "torch_dist"
    proc = ok(run_cli("reshard", str(models / "gpt_oss"), str(out), "--dst-format", "torch_dist", "--target-tp", "2",
                      "--target-ep", "2", "--target-spec", "local", nproc=2))  # ETP 1: biased MoE's default
    assert "TP=2 PP=1 EP=2 ETP=1" in proc.stderr
    return out


def test_stored_tensors_are_megatron_cores_experts_by_torch_indexing(models):
    """Every saved tensor is mapped and covers each logical tensor once; the pieces (views included) give
    megatron-core's per-expert fc1 = [gate; up] with gate = gate_up_proj[e][:, 0::2] (transformers'
    ``_apply_gate``: gate_up[..., ::2]) and up = [:, 1::2], transposed; fc2 = down_proj[e].T; the biases alike.
    Export writes the same names (the fused expert tensors included)."""
    path = models / "gpt_oss"
    hf = json.loads((path / "config.json").read_text())
    cfg, _, notes = config_from_hf(hf, None)
    found = {k: shape for k, (_, shape) in read_header(path / "model.safetensors").items()}
    expected, _ = source_tensors(cfg, family_of(hf), found)
    assert set(expected) == set(found) and not notes
    assert all(tuple(found[k]) == tuple(shape) for k, (shape, _) in expected.items())
    logical = logical_tensors(cfg)
    chunks = [SourceChunk(id=i, file="model.safetensors", key=k, shape=s, dtype=torch.float32, pieces=p)
              for i, (k, (s, p)) in enumerate(expected.items())]
    select_source(chunks, {n: torch.Size(t.shape).numel() for n, t in logical.items()})  # no gap, no overlap
    assert set(hf_tensors(cfg, family_of(hf))) == set(found)
    stored = tensors(path)
    got = {n: torch.full(t.shape, float("nan")) for n, t in logical.items()}
    for name, (_, pieces) in expected.items():
        for p in pieces:
            block = stored[name][p.sbox.slices()]
            got[p.logical][p.lbox.slices()] = logical_view(block, p.view) if p.view else block.reshape(p.lbox.sizes)
    assert not any(t.isnan().any() for t in got.values())
    for layer in range(cfg.num_layers):
        hf_pre, mc = f"model.layers.{layer}.", f"decoder.layers.{layer}."
        gate_up, bias = stored[hf_pre + "mlp.experts.gate_up_proj"], stored[hf_pre + "mlp.experts.gate_up_proj_bias"]
        for e in range(cfg.num_experts):
            ex = f"{mc}mlp.experts.local_experts.{e}."
            assert torch.equal(got[ex + "linear_fc1.weight"], torch.cat([gate_up[e][:, 0::2].T, gate_up[e][:, 1::2].T]))
            assert torch.equal(got[ex + "linear_fc1.bias"], torch.cat([bias[e][0::2], bias[e][1::2]]))
            assert torch.equal(got[ex + "linear_fc2.weight"], stored[hf_pre + "mlp.experts.down_proj"][e].T)
            assert torch.equal(got[ex + "linear_fc2.bias"], stored[hf_pre + "mlp.experts.down_proj_bias"][e])
        assert torch.equal(got[mc + "self_attention.core_attention.softmax_offset"], stored[hf_pre + "self_attn.sinks"])
        assert torch.equal(got[mc + "mlp.router.bias"], stored[hf_pre + "mlp.router.bias"])
        assert torch.equal(got[mc + "self_attention.linear_proj.bias"], stored[hf_pre + "self_attn.o_proj.bias"])


def test_every_part_of_the_model_changes_the_logits(models):
    """The comparison with megatron-core is not vacuous: transformers' own logits move when the sinks are zeroed,
    the clamp is lifted, the window is widened past the sequence, or YaRN is replaced by plain RoPE."""
    import transformers

    path = models / "gpt_oss"
    tokens = torch.randint(0, CONFIG["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))
    want = hf_logits(path, tokens)

    def logits(**over) -> torch.Tensor:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **over).eval()
        return model

    changes = {}
    with torch.no_grad():
        model = logits()
        for layer in model.model.layers:
            layer.self_attn.sinks.zero_()
        changes["sinks"] = model(tokens).logits
        model = logits()
        for layer in model.model.layers:
            layer.mlp.experts.limit = float("inf")
        changes["clamp"] = model(tokens).logits
        changes["window"] = logits(sliding_window=64)(tokens).logits
        changes["yarn"] = logits(rope_parameters={"rope_type": "default", "rope_theta": 10000.0})(tokens).logits
    for what, other in changes.items():
        assert (other - want).abs().max() > 1e-2, what


def test_config_and_megatron_args():
    cfg, args, notes = config_from_hf(HF_CONFIG, None)
    assert (cfg.attention.softmax_type, cfg.mlp.activation, cfg.mlp.gated, cfg.add_bias_linear, cfg.add_qkv_bias,
            cfg.kv_channels, cfg.num_experts, cfg.expert_ffn, cfg.position.kind) == \
        ("learnable", "quick_gelu", True, True, True, 24, 4, 32, "yarn")
    a = vars(args)
    assert {k: a[k] for k in ("swiglu", "quick_geglu", "glu_linear_offset", "activation_func_clamp_value",
                              "window_size", "window_attn_skip_freq", "rotary_base", "rotary_scaling_factor",
                              "yarn_original_max_position_embeddings", "yarn_correction_range_round_to_int",
                              "moe_router_topk", "moe_router_pre_softmax")} == {
        "swiglu": False, "quick_geglu": True, "glu_linear_offset": 1.0, "activation_func_clamp_value": 7.0,
        "window_size": (3, 0), "window_attn_skip_freq": 2, "rotary_base": 10000.0, "rotary_scaling_factor": 4.0,
        "yarn_original_max_position_embeddings": 16, "yarn_correction_range_round_to_int": False,
        "moe_router_topk": 2, "moe_router_pre_softmax": False}
    # the args read back (a torch_dist target's args) give the same model config
    assert config_from_args(args, None, "te", 1) == cfg
    # with the source's config.json: kept; from the args alone: the same model
    assert {k: v for k, v in hf_from_config(cfg, torch.float32, HF_CONFIG).items()
            if k != "torch_dtype"} == {**HF_CONFIG, "dtype": "float32"}
    alone = hf_from_config(cfg, torch.float32)
    assert {k: alone[k] for k in HF_CONFIG} == HF_CONFIG
    import transformers

    transformers.GptOssConfig(**alone)  # transformers takes it as it is
    # layer_types <-> window_attn_skip_freq
    s, f = "sliding_attention", "full_attention"
    for types, freq in (([s, f, s, f], 2), ([s, s, f] * 2, 3), ([s, f, f], [1, 0, 0]), ([s] * 3, None),
                        ([f] * 3, 1)):
        assert skip_freq(types, len(types), 4) == freq, types
        assert layer_types_of(len(types), None if freq == 1 else (3, 0), freq) == types


def one_line(e: pytest.ExceptionInfo, *needles: str) -> None:
    msg = str(e.value)
    assert "\n" not in msg and e.value.fix, msg
    for n in needles:
        assert n in msg, msg


@pytest.mark.parametrize("over,needles", [
    ({"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]},
     ("chunked_attention", "window_attn_skip_freq", "sliding_attention or full_attention")),
    ({"layer_types": ["sliding_attention", "full_attention"]}, ("3 layers", "for every layer")),
    ({"sliding_window": None}, ("sliding_window is None", "set sliding_window")),
    ({"attention_bias": False}, ("attention_bias=false", "attention_bias true")),
    ({"swiglu_limit": 5.0}, ("swiglu_limit=5.0", "swiglu_limit 7")),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, ("'linear'", "yarn or default")),
    ({"rope_parameters": {**CONFIG["rope_parameters"], "attention_factor": 2.0}}, ("attention_factor=2.0",
                                                                                  "without attention_factor")),
], ids=["layer-type", "layer-count", "no-window", "no-attention-bias", "swiglu-limit", "rope-type", "yarn-factor"])
def test_import_refusals(over, needles):
    with pytest.raises(ConvertError) as e:
        config_from_hf({**HF_CONFIG, **over}, None)
    one_line(e, *needles)


def test_layout_and_export_refusals():
    cfg, args, _ = config_from_hf(HF_CONFIG, None)
    with pytest.raises(ConvertError) as e:  # TransformerConfig asserts ETP 1 for biased MoE layers
        cfg.check_layout(Layout(tp=2, pp=1, ep=2))
    one_line(e, "ETP=2", "--target-etp 1")
    cfg.check_layout(Layout(tp=2, pp=1, ep=2, etp=1))
    # the maths the tensors do not hold: another gate offset or clamp, another router, no sinks
    for bad, needle in ((cfg.replace(mlp__glu_linear_offset=0.0), "glu_linear_offset=0.0"),
                        (cfg.replace(moe__pre_softmax=True), "top-k")):
        with pytest.raises(ConvertError) as e:
            hf_from_config(bad, torch.float32)
        one_line(e, needle, "--dst-format torch_dist")
    with pytest.raises(ConvertError) as e:
        hf_from_config(with_flat(cfg, softmax_type="vanilla"), torch.float32)
    one_line(e, "softmax_type=vanilla", "--dst-format torch_dist")


def test_hf_to_torch_dist_loads_in_megatron_core_with_transformers_logits(models, mcore, tmp_path):
    """(a) TP2 EP2: megatron-core's strict load at that layout with the stored args checked, then its logits
    (TP2 EP2, 4 ranks) within 1e-4 of transformers' in fp32."""
    config = tmp_path / "oracle.json"
    config.write_text(json.dumps(gpt_oss_oracle_config(models / "gpt_oss")))
    layout = ["--tp", "2", "--ep", "2", "--etp", "1"]
    res = oracle("compare", 4, "--config", str(config), *layout, "--ckpt", str(mcore), "--ref", str(mcore),
                 "--check-args")
    assert "ORACLE OK" in res.stdout
    out = tmp_path / "logits.pt"
    oracle("logits", 4, "--config", str(config), *layout, "--ckpt", str(mcore), "--out", str(out))
    got = torch.load(out)
    want = hf_logits(models / "gpt_oss", got["tokens"])
    assert got["tokens"].shape[1] > CONFIG["sliding_window"] and want.std() > 0.5
    torch.testing.assert_close(got["logits"], want, rtol=1e-4, atol=1e-4)


def test_hf_to_megatron_legacy_pp2_equals_the_torch_dist_target(models, mcore, tmp_path):
    """(b) legacy TP1 PP2 (stages of 2 and 1 layers): megatron-core loads both strictly at that layout and finds
    every tensor equal to the torch_dist target's, whose logits (a) checks."""
    dst = tmp_path / "legacy"
    ok(run_cli("reshard", str(models / "gpt_oss"), str(dst), "--dst-format", "megatron", "--target-pp", "2",
               "--target-num-layers-in-first-stage", "2", "--target-spec", "local", nproc=2))
    config = tmp_path / "oracle.json"
    config.write_text(json.dumps(gpt_oss_oracle_config(models / "gpt_oss")))
    res = oracle("compare", 2, "--config", str(config), "--tp", "1", "--pp", "2", "--first", "2", "--ckpt", str(dst),
                 "--ref", str(mcore), "--check-args")
    assert "ORACLE OK" in res.stdout and "ckpt=megatron" in res.stdout


@pytest.mark.parametrize("name", ["gpt_oss", "gpt_oss_bf16"])
def test_back_to_hf_is_bit_exact_with_the_same_config(models, mcore, tmp_path, name):
    """(c) torch_dist -> HF (fp32: the TP2 EP2 target of (a); bf16: through its own TP1 EP2 torch_dist): the
    same tensors bit for bit and dtype, the same config.json, and transformers loads it cleanly."""
    src = models / name
    mid = mcore
    if name != "gpt_oss":
        mid = tmp_path / "torch_dist"
        ok(run_cli("reshard", str(src), str(mid), "--dst-format", "torch_dist", "--target-ep", "2", nproc=2))
    back = tmp_path / "hf"
    ok(run_cli("reshard", str(mid), str(back), "--dst-format", "hf", nproc=2))
    a, b = tensors(src), tensors(back)
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    assert json.loads((back / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    import transformers

    model, info = transformers.AutoModelForCausalLM.from_pretrained(back, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert type(model).__name__ == "GptOssForCausalLM"
