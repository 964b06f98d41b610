"""A tiny gpt-oss made by transformers itself (``GptOssForCausalLM``, saved with ``save_pretrained``), and the
megatron-core oracle config that describes the same model, written out by hand from the two codes' rules."""
from __future__ import annotations

import json
import math
import zlib
from pathlib import Path

import torch

WINDOW = 4  # shorter than the oracle's 16 tokens: the sliding layers' window cuts
# every tensor numerically relevant: biases and sinks non-zero, norms away from 1, 4 experts top-2, a sliding
# and a full layer (and a sliding one again), head_dim 24 != hidden / heads = 16, odd vocabulary, untied, YaRN
# (factor 4 over 16 positions, truncate false) on a 10k base
CONFIG = {"vocab_size": 151, "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 3,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24, "num_local_experts": 4,
          "num_experts_per_tok": 2, "sliding_window": WINDOW,
          "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
          "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "attention_bias": True,
          "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
                              "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16}}
GATE_UP_SCALE = 4.0  # gate/up pre-activations of std ~4: transformers' clamp at 7 cuts some of them


def init_value(name: str, shape: torch.Size, seed: int, hidden: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(f"{seed}|{name}".encode()))
    r = torch.randn(shape, generator=g)
    if "norm" in name:
        return 1.0 + 0.1 * r
    if name.endswith("sinks"):
        return r  # O(1) sink logits
    if name.endswith("bias"):
        return 0.1 * r
    if name.endswith("gate_up_proj"):
        return GATE_UP_SCALE * r / math.sqrt(hidden)
    return r / math.sqrt(hidden)


def make_gpt_oss(root: Path, name: str = "gpt_oss", seed: int = 7, dtype: torch.dtype = torch.float32,
                 **over) -> Path:
    """``save_pretrained`` of a ``GptOssForCausalLM`` of ``CONFIG`` (``over``: config overrides), every parameter
    seeded by its name."""
    import transformers

    config = transformers.GptOssConfig(**{**CONFIG, **over})
    model = transformers.GptOssForCausalLM(config)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            p.copy_(init_value(pname, p.shape, seed, config.hidden_size))
    out = root / name
    model.to(dtype).save_pretrained(out)
    (out / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64, "note": "test tokenizer"}))
    return out


def gpt_oss_oracle_config(path: Path) -> dict:
    """The megatron-core oracle's config for an HF gpt-oss directory, by the two codes' rules:

    * attention: q/k/v/o biases (add_bias_linear; megatron-core's linear_qkv takes it from add_bias_linear),
      scale head_dim^-0.5 (megatron-core's 1/sqrt(kv_channels)); sinks: HF appends sinks[h] as one more logit
      per query row and drops its probability, megatron-core's SoftmaxOne (softmax_type "learnable") does the
      same with softmax_offset; sliding layers attend to the last sliding_window keys (HF: kv > q - W),
      megatron-core's window (W - 1, 0) to kv in [q - (W - 1), q]; layer_types [sliding, full, ...] is
      window_attn_skip_freq 2 (1-based layer l slides iff l % 2 != 0).
    * YaRN: the same inv_freq ramp (beta_fast/slow, original_max_position_embeddings, truncate ->
      yarn_correction_range_round_to_int) and the same attention factor 0.1 ln(factor) + 1 on cos and sin
      (megatron-core: mscale / mscale_all_dim = 1 / 0, Megatron-LM's defaults, give that ratio).
    * experts: gate = even columns, up = odd columns of gate_up_proj; transformers computes
      gate.clamp(max=7) * sigmoid(1.702 gate) * (up.clamp(-7, 7) + 1); megatron-core's gated quick_gelu with
      activation_func_clamp_value 7 and glu_linear_offset 1 computes the same. Router: logits with a bias, top-k,
      softmax over the k (moe_router_pre_softmax False); expert outputs, biases included, times the weights."""
    return oracle_config_of(json.loads((path / "config.json").read_text()))


def oracle_config_of(hf: dict) -> dict:
    """``gpt_oss_oracle_config`` of a config.json's contents."""
    rope = hf["rope_parameters"]
    types = hf["layer_types"]
    assert types == ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(len(types))], types
    return {"num_layers": hf["num_hidden_layers"], "hidden_size": hf["hidden_size"],
            "ffn_hidden_size": hf["intermediate_size"], "num_attention_heads": hf["num_attention_heads"],
            "num_query_groups": hf["num_key_value_heads"], "kv_channels": hf["head_dim"], "swiglu": False,
            "quick_geglu": True, "glu_linear_offset": 1.0, "activation_func_clamp_value": 7.0,
            "normalization": "RMSNorm", "norm_epsilon": hf["rms_norm_eps"], "add_bias_linear": True,
            "add_qkv_bias": True, "qk_layernorm": False,
            "untie_embeddings_and_output_weights": not hf["tie_word_embeddings"], "vocab_size": hf["vocab_size"],
            "make_vocab_size_divisible_by": 128, "position_embedding_type": "yarn", "rotary_base": rope["rope_theta"],
            "rotary_scaling_factor": rope["factor"],
            "yarn_original_max_position_embeddings": rope["original_max_position_embeddings"],
            "yarn_beta_fast": rope["beta_fast"], "yarn_beta_slow": rope["beta_slow"],
            "yarn_correction_range_round_to_int": rope["truncate"], "mscale": 1.0, "mscale_all_dim": 0.0,
            "max_position_embeddings": hf["max_position_embeddings"], "seq_length": 16,
            "softmax_type": "learnable", "window_size": [hf["sliding_window"] - 1, 0], "window_attn_skip_freq": 2,
            "num_experts": hf["num_local_experts"], "moe_ffn_hidden_size": hf["intermediate_size"],
            "moe_layer_freq": 1, "moe_router_topk": hf["num_experts_per_tok"], "moe_router_pre_softmax": False,
            "moe_shared_expert_intermediate_size": None, "moe_shared_expert_gate": False}
