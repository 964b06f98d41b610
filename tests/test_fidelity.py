"""No silent drop, judged by the codes themselves: two tables of tiny models, each differing from a plain Llama in one
setting that changes the math.

* megatron-core -> Hugging Face: megatron-core 0.16.1 builds each GPT from Megatron-LM-style args (the settings
  oracle: every args field a TransformerConfig field shares passed on, as Megatron-LM does) and saves it; the export
  either gives transformers' logits equal to megatron-core's within 1e-4, as the family the setting maps to, or is
  refused in one line naming the setting, with no target left behind.
* Hugging Face -> megatron-core: transformers makes each model from one config.json field changed; the import either
  gives megatron-core's logits (its model built from the args dist_convert wrote) equal to transformers' within 1e-4,
  or is refused in one line naming the field.

A case that converts and computes something else fails the suite. Not in the tables: ``layernorm_zero_centered_gamma``
(megatron-core's local spec has no zero-centred torch norm on CPU; Gemma 3's tests carry it through Transformer
Engine's stand-ins) and the structural features (MoE, MLA, Mamba, GDN), whose families have tables of their own.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import assert_refused, ok, oracle, run_cli
from hf_models import LLAMA3_ROPE, hf_logits, make_hf_model

# a plain Llama in Megatron-LM's names: GQA, SwiGLU, RMSNorm, RoPE, no biases, untied
BASE = {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 96, "num_attention_heads": 4, "num_query_groups": 2,
        "kv_channels": 16, "swiglu": True, "normalization": "RMSNorm", "norm_epsilon": 1e-5, "add_bias_linear": False,
        "add_qkv_bias": False, "untie_embeddings_and_output_weights": True, "vocab_size": 100,
        "make_vocab_size_divisible_by": 16, "position_embedding_type": "rope", "max_position_embeddings": 64,
        "seq_length": 16, "rotary_base": 10000, "qk_layernorm": False}
REFUSE = "refused: "
# (case, Megatron-LM args changed, the HF architecture it exports as, or REFUSE + what the refusal names)
MCORE_CASES = [
    ("plain", {}, "LlamaForCausalLM"),
    ("rotary_base", {"rotary_base": 500000}, "LlamaForCausalLM"),
    ("rotary_percent", {"rotary_percent": 0.5}, REFUSE + "rotary_percent=0.5"),
    ("rotary_interleaved", {"rotary_interleaved": True}, REFUSE + "rotary_interleaved=True"),
    ("llama3_scaling", {"use_rope_scaling": True, "rope_scaling_factor": 8.0}, "LlamaForCausalLM"),
    ("seq_len_interpolation", {"rotary_seq_len_interpolation_factor": 2.0},
     REFUSE + "rotary_seq_len_interpolation_factor=2.0"),
    ("yarn", {"position_embedding_type": "yarn", "rotary_scaling_factor": 4.0,
              "yarn_original_max_position_embeddings": 16, "yarn_correction_range_round_to_int": False},
     "LlamaForCausalLM"),
    ("window", {"window_size": [7, 0]}, "MistralForCausalLM"),
    ("window_skip_freq", {"window_size": [7, 0], "window_attn_skip_freq": 2}, REFUSE + "window_attn_skip_freq=2"),
    ("softmax_scale", {"softmax_scale": 0.1}, REFUSE + "softmax_scale=0.1"),
    ("off_by_one", {"softmax_type": "off-by-one"}, REFUSE + "softmax_type=off-by-one"),
    ("sinks", {"softmax_type": "learnable"}, REFUSE + "softmax_type=learnable"),
    ("qk_layernorm", {"qk_layernorm": True}, "Qwen3ForCausalLM"),
    ("qk_l2_norm", {"qk_l2_norm": True}, REFUSE + "qk_l2_norm=True"),
    ("qkv_bias", {"add_qkv_bias": True}, "Qwen2ForCausalLM"),
    ("linear_bias", {"add_bias_linear": True}, REFUSE + "add_bias_linear=True"),
    ("layernorm", {"normalization": "LayerNorm"}, REFUSE + "normalization=LayerNorm"),
    ("eps", {"norm_epsilon": 1e-6}, "LlamaForCausalLM"),
    ("residual_post_norm", {"apply_residual_connection_post_layernorm": True},
     REFUSE + "apply_residual_connection_post_layernorm=True"),
    ("gelu_mlp", {"swiglu": False}, REFUSE + "swiglu=False"),
    ("squared_relu", {"swiglu": False, "squared_relu": True}, REFUSE + "glu_activation=squared_relu"),
    ("openai_gelu", {"swiglu": False, "openai_gelu": True}, REFUSE + "glu_activation=gelu_tanh"),
    ("quick_geglu", {"swiglu": False, "quick_geglu": True, "glu_linear_offset": 1.0,
                     "activation_func_clamp_value": 7.0}, REFUSE + "glu_activation=quick_gelu"),
    ("learned_absolute", {"position_embedding_type": "learned_absolute"},
     REFUSE + "position_embedding_type=learned_absolute"),
    ("no_position", {"position_embedding_type": "none"}, REFUSE + "position_embedding_type=none"),
    ("output_gate", {"attention_output_gate": True}, REFUSE + "attention_output_gate=True"),
    ("tied", {"untie_embeddings_and_output_weights": False}, "LlamaForCausalLM"),
]
# (case, transformers config class, overrides of hf_models.BASE, the import's fate: None converts, else what the
# refusal names)
HF_CASES = [
    ("plain", "LlamaConfig", {}, None),
    ("rope_theta", "LlamaConfig", {"rope_theta": 500000.0}, None),
    ("llama3", "LlamaConfig", {"rope_scaling": {**LLAMA3_ROPE, "factor": 8.0}}, None),
    ("yarn", "LlamaConfig", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                              "original_max_position_embeddings": 16}}, None),
    ("linear", "LlamaConfig", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "RoPE type 'linear'"),
    ("dynamic", "LlamaConfig", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "RoPE type 'dynamic'"),
    ("attention_bias", "LlamaConfig", {"attention_bias": True}, "attention_bias=true"),
    ("mlp_bias", "LlamaConfig", {"mlp_bias": True}, "mlp_bias=true"),
    ("gelu", "LlamaConfig", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("head_dim", "LlamaConfig", {"head_dim": 32}, None),
    ("eps", "LlamaConfig", {"rms_norm_eps": 1e-5}, None),
    ("tied", "LlamaConfig", {"tie_word_embeddings": True}, None),
    ("mistral_window", "MistralConfig", {"sliding_window": 8}, None),
    ("qwen2_window", "Qwen2Config", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
     "use_sliding_window"),
    ("qwen3_attention_bias", "Qwen3Config", {"attention_bias": True}, "attention_bias=true"),
]


# -- megatron-core -> Hugging Face ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mcore_models(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mcore_settings")
    cases = root / "cases.json"
    cases.write_text(json.dumps({name: {**BASE, **change} for name, change, _ in MCORE_CASES}))
    oracle("make", 1, "--cases", str(cases), "--out", str(root), program="settings")
    return root


@pytest.mark.parametrize("name,change,want", MCORE_CASES, ids=[c[0] for c in MCORE_CASES])
def test_megatron_setting_exports_with_megatron_logits_or_is_refused(mcore_models, tmp_path, name, change, want):
    dst = tmp_path / "dst"
    proc = run_cli("reshard", str(mcore_models / name), str(dst), "--dst-format", "hf")
    if want.startswith(REFUSE):
        assert_refused(proc, tmp_path, want.removeprefix(REFUSE), "--dst-format torch_dist")
        return
    ok(proc)
    assert json.loads((dst / "config.json").read_text())["architectures"] == [want]
    made = torch.load(mcore_models / f"{name}.pt")
    got = hf_logits(dst, made["tokens"])
    assert made["logits"].std() > 0.5  # O(1) logits: the comparison is not vacuous
    torch.testing.assert_close(got, made["logits"], rtol=0, atol=1e-4)



# -- megatron-core -> NeMo -> megatron-core ---------------------------------------------------------------------------
# the settings a megatron-core model's model_config.yaml carries under megatron-core's own names (NeMo hands them to
# TransformerConfig as they stand) and llama3 RoPE scaling (scale_positional_embedding)
NEMO_CASES = ["window", "window_skip_freq", "softmax_scale", "off_by_one", "rotary_interleaved",
              "seq_len_interpolation", "llama3_scaling", "qk_l2_norm", "output_gate"]


@pytest.fixture(scope="module")
def nemo_round_trips(mcore_models) -> Path:
    """Each case to .nemo and back to torch_dist; the settings oracle builds each from the args it ends with."""
    root = mcore_models / "nemo"
    back = []
    for name in NEMO_CASES:
        nemo = root / f"{name}.nemo"
        ok(run_cli("reshard", str(mcore_models / name), str(nemo), "--dst-format", "nemo"))
        back.append(root / name)
        ok(run_cli("reshard", str(nemo), str(back[-1]), "--dst-format", "torch_dist", "--target-spec", "local",
                   "--vocab-size", "100"))  # .nemo keeps the padded vocabulary only
    torch.save(torch.load(mcore_models / "plain.pt")["tokens"], root / "tokens.pt")
    oracle("logits", 1, "--ckpts", ",".join(map(str, back)), "--out", str(root), program="settings")
    return root


@pytest.mark.parametrize("name", NEMO_CASES)
def test_megatron_setting_survives_a_nemo_round_trip(mcore_models, nemo_round_trips, name):
    made = torch.load(mcore_models / f"{name}.pt")
    torch.testing.assert_close(torch.load(nemo_round_trips / f"{name}.pt"), made["logits"], rtol=0, atol=1e-4)


def test_a_bridge_target_refuses_what_gptmodelprovider_cannot_say(mcore_models, tmp_path):
    assert_refused(run_cli("reshard", str(mcore_models / "yarn"), str(tmp_path / "b"), "--dst-format", "bridge"),
                   tmp_path, "position_embedding_type=yarn", "GPTModelProvider")


def test_a_legacy_nemo_target_refuses_what_legacy_nemo_cannot_say(mcore_models, tmp_path):
    assert_refused(run_cli("reshard", str(mcore_models / "window"), str(tmp_path / "w.nemo"), "--dst-format", "nemo",
                           "--nemo-style", "legacy"), tmp_path, "window_size=", "legacy NeMo")

# -- Hugging Face -> megatron-core ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_imports(tmp_path_factory) -> tuple[Path, dict[str, object]]:
    """Every HF case made by transformers and imported to torch_dist (or refused), then judged by one settings-oracle
    call: megatron-core built from each target's own args."""
    root = tmp_path_factory.mktemp("hf_settings")
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(5))
    torch.save(tokens, root / "tokens.pt")
    outcomes: dict[str, object] = {}
    for name, cls, over, _ in HF_CASES:
        src = make_hf_model(root / "hf", name, family=(cls, {**over, "tie_word_embeddings":
                                                            over.get("tie_word_embeddings", False)}))
        dst = root / "mcore" / name
        outcomes[name] = run_cli("reshard", str(src), str(dst), "--dst-format", "torch_dist", "--target-spec", "local")
    done = [str(root / "mcore" / n) for n, proc in outcomes.items() if proc.returncode == 0]
    oracle("logits", 1, "--ckpts", ",".join(done), "--out", str(root), program="settings")
    return root, outcomes


@pytest.mark.parametrize("name,cls,over,refusal", HF_CASES, ids=[c[0] for c in HF_CASES])
def test_hf_field_imports_with_transformers_logits_or_is_refused(hf_imports, tmp_path, name, cls, over, refusal):
    root, outcomes = hf_imports
    proc = outcomes[name]
    if refusal is not None:
        assert proc.returncode != 0, proc.stderr[-2000:]
        errors = [line for line in proc.stderr.splitlines() if line.startswith("dist_convert: error:")]
        assert len(errors) == 1 and refusal in errors[0], proc.stderr[-2000:]
        assert not (root / "mcore" / name).exists()
        return
    ok(proc)
    tokens = torch.load(root / "tokens.pt")
    want = hf_logits(root / "hf" / name, tokens)
    got = torch.load(root / f"{name}.pt")
    assert want.std() > 0.5
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def test_the_judge_sees_a_dropped_setting(mcore_models, hf_imports):
    """The tables' judges are not blind: a setting dropped on the way (the window case's checkpoint exported as if it
    had none, the rotary_base case's read as the plain one's) would differ from the oracle by far more than 1e-4."""
    window, plain = torch.load(mcore_models / "window.pt"), torch.load(mcore_models / "plain.pt")
    assert torch.equal(window["tokens"], plain["tokens"])
    assert (window["logits"] - plain["logits"]).abs().max() > 0.1
    root, _ = hf_imports
    assert (torch.load(root / "rope_theta.pt") - torch.load(root / "plain.pt")).abs().max() > 0.1
