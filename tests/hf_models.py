"""Tiny random Hugging Face models made by transformers itself (the oracle for the hf format), and
the megatron-core oracle config that describes the same model, written out by hand."""
from __future__ import annotations

import json
import math
import zlib
from pathlib import Path

import torch

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
BASE = {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "rms_norm_eps": 1e-6}
# name -> (transformers config class, overrides)
FAMILIES = {
    "llama": ("LlamaConfig", {"tie_word_embeddings": False}),  # GQA, untied (Llama 2/3)
    "llama32": ("LlamaConfig", {"tie_word_embeddings": True, "rope_scaling": LLAMA3_ROPE, "rope_theta": 500000.0,
                                "max_position_embeddings": 16384}),  # Llama 3.2: tied, Llama-3 RoPE scaling
    "mistral": ("MistralConfig", {"tie_word_embeddings": False, "num_key_value_heads": 1}),  # MQA
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True, "num_key_value_heads": 4}),  # qkv bias, MHA
    "qwen3": ("Qwen3Config", {"tie_word_embeddings": False, "head_dim": 32}),  # q/k norm, head_dim != h/heads
    # Mixture of Experts: 4 experts, top-2, expert FFN 32
    "mixtral": ("MixtralConfig", {"tie_word_embeddings": False, "num_local_experts": 4, "num_experts_per_tok": 2,
                                  "intermediate_size": 32}),  # every layer MoE, top-k renormalised
    "qwen2_moe": ("Qwen2MoeConfig", {"tie_word_embeddings": False, "num_hidden_layers": 3, "num_experts": 4,
                                     "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                     "shared_expert_intermediate_size": 48, "mlp_only_layers": [0],
                                     "decoder_sparse_step": 1, "norm_topk_prob": False}),  # dense layer 0, gated shared
    "qwen3_moe": ("Qwen3MoeConfig", {"tie_word_embeddings": True, "num_hidden_layers": 3, "num_experts": 4,
                                     "num_experts_per_tok": 2, "moe_intermediate_size": 32, "decoder_sparse_step": 2,
                                     "norm_topk_prob": True, "head_dim": 32}),  # layers 0, 2 dense; q/k norm
}
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")


def make_hf_model(root: Path, name: str, seed: int = 7, dtype: torch.dtype = torch.float32, **save_kw) -> Path:
    """``save_pretrained`` of a randomly initialised model (every tensor seeded by its name, O(1) logits)."""
    import transformers

    cls_name, over = FAMILIES[name]
    config = getattr(transformers, cls_name)(**{**BASE, **over})
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            g = torch.Generator().manual_seed(zlib.crc32(f"{seed}|{pname}".encode()))
            r = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * r if "norm" in pname else (0.1 * r if pname.endswith("bias")
                                                             else r / math.sqrt(config.hidden_size)))
    out = root / name
    model.to(dtype).save_pretrained(out, **save_kw)
    (out / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64, "note": "test tokenizer"}))
    return out


def hf_logits(path: Path, tokens: torch.Tensor) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits


def oracle_config(path: Path) -> dict:
    """The megatron-core oracle's config (Megatron-LM names) for an HF model directory."""
    hf = json.loads((path / "config.json").read_text())
    rope = hf.get("rope_parameters") or {}
    heads = hf["num_attention_heads"]
    cfg = {"num_layers": hf["num_hidden_layers"], "hidden_size": hf["hidden_size"],
           "ffn_hidden_size": hf["intermediate_size"], "num_attention_heads": heads,
           "num_query_groups": hf["num_key_value_heads"],
           "kv_channels": hf.get("head_dim") or hf["hidden_size"] // heads, "swiglu": True,
           "normalization": "RMSNorm", "norm_epsilon": hf["rms_norm_eps"], "add_bias_linear": False,
           "add_qkv_bias": hf["model_type"] == "qwen2" or (hf["model_type"] == "qwen2_moe"
                                                              and hf.get("qkv_bias", True)),
           "qk_layernorm": hf["model_type"] in ("qwen3", "qwen3_moe"),
           "untie_embeddings_and_output_weights": not hf["tie_word_embeddings"], "vocab_size": hf["vocab_size"],
           "make_vocab_size_divisible_by": 128, "position_embedding_type": "rope",
           "rotary_base": rope.get("rope_theta", hf.get("rope_theta", 10000.0)),
           "max_position_embeddings": hf["max_position_embeddings"], "seq_length": 16}
    if rope.get("rope_type") == "llama3":
        cfg.update(use_rope_scaling=True, rope_scaling_factor=rope["factor"])
    if hf["model_type"] in ("mixtral", "qwen2_moe", "qwen3_moe"):
        cfg.update(moe_oracle_keys(hf))
    return cfg


def moe_oracle_keys(hf: dict) -> dict:
    """The oracle's MoE keys (Megatron-LM names) for an HF MoE config, by the transformers rules:
    Mixtral: every layer MoE, experts of intermediate_size, softmax -> top-k -> renormalise (topk on
    logits then softmax: pre_softmax False). Qwen-MoE: layer l is MoE iff l is not in mlp_only_layers and
    (l + 1) % decoder_sparse_step == 0; norm_topk_prob False is softmax before top-k (pre_softmax True)."""
    experts = hf.get("num_local_experts") or hf["num_experts"]
    if hf["model_type"] == "mixtral":
        return {"num_experts": experts, "moe_ffn_hidden_size": hf["intermediate_size"], "moe_layer_freq": 1,
                "moe_router_topk": hf["num_experts_per_tok"], "moe_router_pre_softmax": False,
                "moe_shared_expert_intermediate_size": None, "moe_shared_expert_gate": False}
    step, only = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or [])
    pattern = [int(layer not in only and (layer + 1) % step == 0) for layer in range(hf["num_hidden_layers"])]
    shared = hf.get("shared_expert_intermediate_size") if hf["model_type"] == "qwen2_moe" else None
    return {"num_experts": experts, "moe_ffn_hidden_size": hf["moe_intermediate_size"],
            "moe_layer_freq": 1 if all(pattern) else pattern, "moe_router_topk": hf["num_experts_per_tok"],
            "moe_router_pre_softmax": not hf.get("norm_topk_prob", False),
            "moe_shared_expert_intermediate_size": shared or None, "moe_shared_expert_gate": bool(shared)}
