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
DEEPSEEK = {"vocab_size": 150, "num_hidden_layers": 3, "num_key_value_heads": 4, "tie_word_embeddings": False,
            "first_k_dense_replace": 1, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 2,
            "topk_group": 1, "n_shared_experts": 1, "moe_intermediate_size": 32, "norm_topk_prob": True,
            "routed_scaling_factor": 2.5, "rope_interleave": True, "q_lora_rank": 32, "kv_lora_rank": 32,
            "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "num_mtp_layers": 0,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
# GLM-4.5 (Glm4MoeConfig): GQA with q/k/v biases and per-head q/k norm, head_dim 32 != hidden / heads, RoPE on
# the first half of each head; layer 0 dense, layers 1-2 MoE with DeepSeek-V3's router (8 experts, top-2 of sigmoid
# + e_score_correction_bias within 1 of 2 groups, renormalised, x2.5) and one ungated shared expert; untied;
# vocab 150. num_mtp_layers 0: transformers writes num_nextn_predict_layers 1 by default (add_mtp_layer adds it).
GLM = {"vocab_size": 150, "num_hidden_layers": 3, "head_dim": 32, "tie_word_embeddings": False,
       "attention_bias": True, "use_qk_norm": True, "first_k_dense_replace": 1, "n_routed_experts": 8,
       "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "n_shared_experts": 1, "moe_intermediate_size": 32,
       "norm_topk_prob": True, "routed_scaling_factor": 2.5, "num_mtp_layers": 0,
       "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}}
# name -> (transformers config class, overrides)
FAMILIES = {
    "llama": ("LlamaConfig", {"tie_word_embeddings": False}),  # GQA, untied (Llama 2/3)
    # the docs' runnable examples (tests/test_examples.py): 4 layers, 8 heads in 4 groups (TP up to 4)
    "llama_docs": ("LlamaConfig", {"tie_word_embeddings": False, "num_hidden_layers": 4, "num_attention_heads": 8,
                                   "num_key_value_heads": 4}),
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
    # DeepSeek (MLA + DeepSeek MoE), made with DeepseekV3Config: layer 0 dense, layers 1-2 MoE (8 routed experts,
    # top-2 of sigmoid scores + e_score_correction_bias within 1 of 2 groups, renormalised, x2.5; 1 shared
    # expert, no gate); q LoRA; interleaved plain RoPE on the 8 rope dims; untied; vocab 150 (not a multiple
    # of 128). num_mtp_layers 0: transformers writes num_nextn_predict_layers 1 by default (add_mtp_layer).
    "deepseek_v3": ("DeepseekV3Config", DEEPSEEK),
    # DeepSeek-V2-Lite style, made with DeepseekV2Config: no q LoRA (q_proj), softmax scores, greedy top-2
    # without renormalising, x1.5, no correction bias
    "deepseek_v2_lite": ("DeepseekV2Config", {**{k: v for k, v in DEEPSEEK.items()
                                                 if k not in ("num_mtp_layers", "rope_interleave", "norm_topk_prob")},
                                              "q_lora_rank": None, "n_group": None, "topk_group": None,
                                              "topk_method": "greedy", "routed_scaling_factor": 1.5}),
    # dims > 128 so the FP8 test sees partial 128x128 blocks (dense 200, experts 160)
    "deepseek_v3_fp8": ("DeepseekV3Config", {**DEEPSEEK, "intermediate_size": 200, "moe_intermediate_size": 160}),
    "glm4_moe": ("Glm4MoeConfig", GLM),
    # GLM-4.7-Flash (Glm4MoeLiteConfig): DeepSeek-V3's MLA and MoE under GLM's config class, whose MoE layers are
    # given by mlp_layer_types (its first_k_dense_replace is not read); layer 0 dense
    "glm4_moe_lite": ("Glm4MoeLiteConfig", {**{k: v for k, v in DEEPSEEK.items()
                                              if k not in ("num_mtp_layers", "first_k_dense_replace")},
                                           "mlp_layer_types": ["dense", "sparse", "sparse"]}),
}
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "deepseek_v2_lite", "deepseek_v3_fp8")
DEEPSEEK_FAMILIES = ("deepseek_v3", "deepseek_v2_lite", "deepseek_v3_fp8")


def make_hf_model(root: Path, name: str, seed: int = 7, dtype: torch.dtype = torch.float32,
                  family: tuple[str, dict] | None = None, **save_kw) -> Path:
    """``save_pretrained`` of a randomly initialised model (every tensor seeded by its name, O(1) logits);
    ``family``: (transformers config class, overrides of BASE) instead of FAMILIES[name]."""
    import transformers

    cls_name, over = family or FAMILIES[name]
    config = getattr(transformers, cls_name)(**{**BASE, **over})
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            g = torch.Generator().manual_seed(zlib.crc32(f"{seed}|{pname}".encode()))
            r = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * r if "norm" in pname else (0.1 * r if pname.endswith("bias")
                                                             else r / math.sqrt(config.hidden_size)))
        for bname, b in model.named_buffers():  # DeepSeek router bias: HF inits zeros; random, nonzero
            if bname.endswith("e_score_correction_bias"):
                g = torch.Generator().manual_seed(zlib.crc32(f"{seed}|{bname}".encode()))
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
    out = root / name
    model.to(dtype)
    for bname, b in model.named_buffers():  # model.to() casts it too; the releases keep it fp32
        if bname.endswith("e_score_correction_bias"):
            b.data = b.data.float()
    model.save_pretrained(out, **save_kw)
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
    if hf["model_type"] in ("deepseek_v3", "deepseek_v2", "glm4_moe_lite"):
        return deepseek_oracle_config(hf)
    if hf["model_type"] == "glm4_moe":
        return glm_oracle_config(hf)
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


def deepseek_oracle_config(hf: dict) -> dict:
    """The oracle's config for an HF DeepseekV3 config, by the two codes' rules (written by hand):

    * MLA: q_lora_rank (None: one q_proj = linear_q_proj), kv_lora_rank, qk_head_dim = qk_nope_head_dim,
      qk_pos_emb_head_dim = qk_rope_head_dim, v_head_dim; the q/kv a-layernorms are the MLA
      q_layernorm/kv_layernorm (qk_layernorm True). Softmax scale: HF (nope + rope)^-0.5, megatron-core
      mscale^2 / sqrt(qk_head_dim + qk_pos_emb_head_dim) with mscale 1 for plain RoPE: the same.
      RoPE: HF rope_interleave=True de-interleaves q_rot/k_rot at run time, as megatron-core's MLA RoPE
      does (rope_utils: t[..., 0::2], t[..., 1::2]), so no weight permutation; plain rope only.
    * MoE: layer l is MoE iff l >= first_k_dense_replace, or mlp_layer_types[l] is "sparse" where the config gives
      it (GLM-4.7-Flash's Glm4MoeLiteConfig; moe_layer_freq list); experts of
      moe_intermediate_size; n_shared_experts * moe_intermediate_size shared, ungated; router: sigmoid
      scores, + e_score_correction_bias (expert_bias) for the choice only, group-limited top-k (HF:
      group score = sum of the group's top-2 biased scores; megatron-core: sum of the top
      (topk / group_topk): the same only when that is 2, or with a single group), weights = unbiased
      scores of the chosen experts renormalised (norm_topk_prob; megatron-core always renormalises sigmoid
      top-k > 1) times routed_scaling_factor; router logits in fp32 (HF casts to fp32).
    * MTP: num_nextn_predict_layers -> mtp_num_layers (None for 0)."""
    heads, layers, hidden = hf["num_attention_heads"], hf["num_hidden_layers"], hf["hidden_size"]
    rope = hf.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"deepseek oracle config: rope_type {rope.get('rope_type')!r} not mapped (plain rope only)")
    if not hf.get("rope_interleave", True):
        raise ValueError("deepseek oracle config: rope_interleave False is not megatron-core's MLA RoPE")
    v2 = hf.get("model_type") == "deepseek_v2"  # transformers' V2 router: softmax, greedy top-k, scaled, never
    # renormalised: megatron-core's pre-softmax top-k with the scaling factor
    if v2 and hf.get("topk_method", "greedy") != "greedy":
        raise ValueError("deepseek oracle config: V2 group_limited_greedy scores groups by their max (not mapped)")
    if not v2 and hf["num_experts_per_tok"] > 1 and not hf.get("norm_topk_prob", True):
        raise ValueError("deepseek oracle config: norm_topk_prob False (megatron-core renormalises sigmoid top-k)")
    groups, group_topk = (1, 1) if v2 else (hf.get("n_group") or 1, hf.get("topk_group") or 1)
    if groups > 1 and hf["num_experts_per_tok"] // group_topk != 2:
        raise ValueError("deepseek oracle config: group score rules differ unless top-k / topk_group == 2")
    k = hf.get("first_k_dense_replace") or 0
    mtp = hf.get("num_nextn_predict_layers") or 0
    return {"num_layers": layers, "hidden_size": hidden, "ffn_hidden_size": hf["intermediate_size"],
            "num_attention_heads": heads, "num_query_groups": heads, "kv_channels": hidden // heads,
            "swiglu": True, "normalization": "RMSNorm", "norm_epsilon": hf["rms_norm_eps"],
            "add_bias_linear": False, "add_qkv_bias": bool(hf.get("attention_bias", False)), "qk_layernorm": True,
            "untie_embeddings_and_output_weights": not hf["tie_word_embeddings"], "vocab_size": hf["vocab_size"],
            "make_vocab_size_divisible_by": 128, "position_embedding_type": "rope",
            "rotary_base": rope.get("rope_theta", hf.get("rope_theta", 10000.0)),
            "max_position_embeddings": hf["max_position_embeddings"], "seq_length": 16,
            "multi_latent_attention": True, "q_lora_rank": hf.get("q_lora_rank"), "kv_lora_rank": hf["kv_lora_rank"],
            "qk_head_dim": hf["qk_nope_head_dim"], "qk_pos_emb_head_dim": hf["qk_rope_head_dim"],
            "v_head_dim": hf["v_head_dim"], "rope_type": "rope",
            "num_experts": hf["n_routed_experts"], "moe_ffn_hidden_size": hf["moe_intermediate_size"],
            "moe_shared_expert_intermediate_size": (hf["moe_intermediate_size"] * hf["n_shared_experts"]
                                                    if hf.get("n_shared_experts") else None),
            "moe_shared_expert_gate": False,
            "moe_layer_freq": [int(t == "sparse") for t in hf["mlp_layer_types"]] if hf.get("mlp_layer_types")
            else [int(layer >= k) for layer in range(layers)],
            "moe_router_topk": hf["num_experts_per_tok"],
            "moe_router_score_function": "softmax" if v2 else "sigmoid", "moe_router_enable_expert_bias": not v2,
            "moe_router_pre_softmax": v2, "moe_router_num_groups": groups if groups > 1 else None,
            "moe_router_group_topk": group_topk if groups > 1 else None,
            "moe_router_topk_scaling_factor": hf.get("routed_scaling_factor") or None, "moe_router_dtype": "fp32",
            "mtp_num_layers": mtp or None}


def glm_oracle_config(hf: dict) -> dict:
    """The oracle's config for an HF Glm4Moe config, by the two codes' rules (written by hand):

    * attention: GQA (num_key_value_heads groups, head_dim channels), q/k/v biases iff attention_bias (o_proj
      never has one: add_bias_linear False), per-head q/k RMSNorm iff use_qk_norm (megatron-core's
      q_layernorm / k_layernorm over kv_channels, before RoPE as in HF); scale head_dim^-0.5 both sides.
    * RoPE: HF rotates the first int(head_dim * partial_rotary_factor) dims of each head with rotate_half
      (cos/sin = cat(freqs, freqs)) and passes the rest through; megatron-core's RotaryEmbedding with
      rotary_percent does the same on int(kv_channels * rotary_percent) dims (not interleaved). HF takes
      the factor from rope_parameters (default 0.5), then the top level.
    * MoE: layer l is MoE iff l >= first_k_dense_replace; experts of moe_intermediate_size, dense layers
      of intermediate_size; n_shared_experts * moe_intermediate_size shared, ungated; the router is
      DeepSeek-V3's (see deepseek_oracle_config): sigmoid, + e_score_correction_bias (expert_bias) for the
      choice, group score = sum of the top 2 (megatron-core: top topk / group_topk), renormalised (megatron-core
      renormalises sigmoid top-k > 1), x routed_scaling_factor, logits in fp32.
    * MTP: num_nextn_predict_layers -> mtp_num_layers (None for 0); the MTP layer is the last layer's spec."""
    heads, layers, hidden = hf["num_attention_heads"], hf["num_hidden_layers"], hf["hidden_size"]
    rope = hf.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"glm oracle config: rope_type {rope.get('rope_type')!r} not mapped (plain rope only)")
    factor = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.5))
    topk, groups, group_topk = hf["num_experts_per_tok"], hf.get("n_group") or 1, hf.get("topk_group") or 1
    if topk == 1 or not hf.get("norm_topk_prob", True):
        raise ValueError("glm oracle config: megatron-core renormalises sigmoid top-k only for k > 1")
    if groups > 1 and topk // group_topk != 2:
        raise ValueError("glm oracle config: group score rules differ unless top-k / topk_group == 2")
    k = hf.get("first_k_dense_replace", 1)
    mtp = hf.get("num_nextn_predict_layers") or 0
    return {"num_layers": layers, "hidden_size": hidden, "ffn_hidden_size": hf["intermediate_size"],
            "num_attention_heads": heads, "num_query_groups": hf["num_key_value_heads"],
            "kv_channels": hf.get("head_dim") or hidden // heads, "swiglu": True, "normalization": "RMSNorm",
            "norm_epsilon": hf["rms_norm_eps"], "add_bias_linear": False,
            "add_qkv_bias": bool(hf.get("attention_bias", False)), "qk_layernorm": bool(hf.get("use_qk_norm")),
            "untie_embeddings_and_output_weights": not hf["tie_word_embeddings"], "vocab_size": hf["vocab_size"],
            "make_vocab_size_divisible_by": 128, "position_embedding_type": "rope",
            "rotary_base": rope.get("rope_theta", hf.get("rope_theta", 10000.0)), "rotary_percent": factor,
            "max_position_embeddings": hf["max_position_embeddings"], "seq_length": 16,
            "num_experts": hf["n_routed_experts"], "moe_ffn_hidden_size": hf["moe_intermediate_size"],
            "moe_shared_expert_intermediate_size": hf["moe_intermediate_size"] * hf["n_shared_experts"],
            "moe_shared_expert_gate": False, "moe_layer_freq": [int(layer >= k) for layer in range(layers)],
            "moe_router_topk": topk, "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
            "moe_router_pre_softmax": False, "moe_router_num_groups": groups if groups > 1 else None,
            "moe_router_group_topk": group_topk if groups > 1 else None,
            "moe_router_topk_scaling_factor": hf.get("routed_scaling_factor") or None, "moe_router_dtype": "fp32",
            "mtp_num_layers": mtp or None}


def _read_index(path: Path) -> tuple[dict, dict]:
    """(weight_map, index json) of an HF directory (a single model.safetensors gets an index made up)."""
    idx = path / "model.safetensors.index.json"
    if idx.exists():
        index = json.loads(idx.read_text())
        return index["weight_map"], index
    from safetensors import safe_open

    with safe_open(path / "model.safetensors", "pt") as f:
        keys = list(f.keys())
    return {k: "model.safetensors" for k in keys}, {"metadata": {}, "weight_map": {}}


def _load_all(path: Path) -> dict:
    from safetensors.torch import load_file

    wmap, _ = _read_index(path)
    out = {}
    for shard in sorted(set(wmap.values())):
        out.update(load_file(path / shard))
    return out


def add_mtp_layer(path: Path, seed: int = 11, copies: tuple[str, ...] = ("embed_tokens", "shared_head.head")) -> Path:
    """Append a DeepSeek-V3-release MTP layer in place: HF layer L = num_hidden_layers holds a whole decoder
    layer (input_layernorm, self_attn.*, post_attention_layernorm, mlp.* like the model's last layer) plus
    enorm, hnorm, eh_proj [h, 2h], shared_head.norm, and embed_tokens.weight / shared_head.head.weight as
    exact copies of the model's embedding / lm_head (``copies``: which of the two; GLM-4.5 releases store the head
    copy only, 4.6 and 4.7 neither); written as one extra safetensors shard (the index made or updated),
    config.json gets num_nextn_predict_layers 1. Random values seeded by name (dtype of the model's weights;
    e_score_correction_bias fp32, random)."""
    from safetensors.torch import save_file

    cfg = json.loads((path / "config.json").read_text())
    n = cfg["num_hidden_layers"]
    wmap, index = _read_index(path)
    sd = _load_all(path)
    last = f"model.layers.{n - 1}."
    new = f"model.layers.{n}."
    h = cfg["hidden_size"]
    dtype = sd["model.embed_tokens.weight"].dtype
    mtp = {}

    def rand(name, shape, kind):
        g = torch.Generator().manual_seed(zlib.crc32(f"{seed}|{name}".encode()))
        r = torch.randn(shape, generator=g)
        if kind == "norm":
            return (1.0 + 0.1 * r).to(dtype)
        if kind == "bias":
            return (0.1 * r).float()
        return (r / math.sqrt(h)).to(dtype)

    for k, t in sd.items():
        if k.startswith(last):
            name = new + k[len(last):]
            kind = "bias" if k.endswith("e_score_correction_bias") else ("norm" if "norm" in k else "w")
            mtp[name] = rand(name, t.shape, kind)
    mtp[new + "enorm.weight"] = rand(new + "enorm.weight", (h,), "norm")
    mtp[new + "hnorm.weight"] = rand(new + "hnorm.weight", (h,), "norm")
    mtp[new + "eh_proj.weight"] = rand(new + "eh_proj.weight", (h, 2 * h), "w")
    mtp[new + "shared_head.norm.weight"] = rand(new + "shared_head.norm.weight", (h,), "norm")
    if "embed_tokens" in copies:
        mtp[new + "embed_tokens.weight"] = sd["model.embed_tokens.weight"].clone()
    if "shared_head.head" in copies:
        mtp[new + "shared_head.head.weight"] = sd["lm_head.weight"].clone()
    shard = "model-mtp.safetensors"
    save_file(mtp, path / shard, metadata={"format": "pt"})
    wmap = {**wmap, **{k: shard for k in mtp}}
    total = sum(t.numel() * t.element_size() for t in sd.values()) + sum(
        t.numel() * t.element_size() for t in mtp.values())
    index = {"metadata": {**index.get("metadata", {}), "total_size": total}, "weight_map": dict(sorted(wmap.items()))}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    cfg["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path


FP8_BLOCK = 128
FP8_MAX = 448.0  # float8_e4m3fn


def fp8_quantized_name(name: str, t: torch.Tensor) -> bool:
    """Whether the DeepSeek-V3 FP8 release stores `name` as float8 + _scale_inv: every 2-D linear weight
    except embeddings, lm_head / shared_head.head, norms, the router gate (and its bias)."""
    if t.dim() != 2 or not name.endswith(".weight"):
        return False
    if "embed_tokens" in name or name.startswith("lm_head") or "shared_head.head" in name or "norm" in name:
        return False
    return not name.endswith("mlp.gate.weight")


def quantize_fp8(src: Path, dst: Path) -> Path:
    """Write src (an HF DeepSeek directory) in the DeepSeek-V3 FP8 release layout at dst: each quantized
    weight [M, N] -> float8_e4m3fn with `<name>_scale_inv` fp32 [ceil(M/128), ceil(N/128)], per 128x128
    block (edge blocks partial) scale_inv = amax / 448, W_fp8 = W / scale_inv; the rest as stored
    (e_score_correction_bias fp32); same shards and index; config gets quantization_config."""
    import shutil

    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy2(f, dst / f.name)
    wmap, index = _read_index(src)
    new_map, total = {}, 0
    for shard in sorted(set(wmap.values())):
        out = {}
        for name, t in load_file(src / shard).items():
            if fp8_quantized_name(name, t):
                q, s_inv = _quantize_blocks(t.float())
                out[name], out[name + "_scale_inv"] = q, s_inv
            else:
                out[name] = t
        save_file(out, dst / shard, metadata={"format": "pt"})
        for k, t in out.items():
            new_map[k] = shard
            total += t.numel() * t.element_size()
    if (src / "model.safetensors.index.json").exists() or len(set(wmap.values())) > 1:
        index = {"metadata": {**index.get("metadata", {}), "total_size": total},
                 "weight_map": dict(sorted(new_map.items()))}
        (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def _quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    m, n = w.shape
    bm, bn = math.ceil(m / FP8_BLOCK), math.ceil(n / FP8_BLOCK)
    s_inv = torch.empty(bm, bn, dtype=torch.float32)
    q = torch.empty(m, n, dtype=torch.float8_e4m3fn)
    for i in range(bm):
        for j in range(bn):
            blk = w[i * FP8_BLOCK:(i + 1) * FP8_BLOCK, j * FP8_BLOCK:(j + 1) * FP8_BLOCK]
            amax = blk.abs().max().item()
            sc = amax / FP8_MAX if amax > 0 else 1.0
            s_inv[i, j] = sc
            q[i * FP8_BLOCK:(i + 1) * FP8_BLOCK, j * FP8_BLOCK:(j + 1) * FP8_BLOCK] = (
                (blk / sc).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn))
    return q, s_inv


def dequant_fp8(w: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """Plain reference: W[i, j] = float32(W_fp8[i, j]) * scale_inv[i // 128, j // 128]."""
    m, n = w.shape
    rows = torch.arange(m) // FP8_BLOCK
    cols = torch.arange(n) // FP8_BLOCK
    return w.float() * scale_inv.float()[rows][:, cols]


def assert_bit_exact(a_dir: Path, b_dir: Path) -> dict:
    """Two HF directories hold the same tensors, names, dtypes and bits; returns the first's tensors."""
    from safetensors.torch import load_file

    a, b = ({k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(f).items()} for d in (a_dir, b_dir))
    assert set(a) == set(b), sorted(set(a) ^ set(b))[:10]
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    return b
