"""gpt-oss (``GptOssForCausalLM``): GQA attention with q/k/v/o biases, an explicit ``head_dim`` and attention
sinks (one learnt logit per head, ``self_attn.sinks``), sliding-window and full attention layers by
``layer_types``, YaRN RoPE, RMSNorm, and a Mixture-of-Experts MLP in every layer: a router with a bias (top-k of
the logits, softmax over the k), experts with biases and transformers' clamped SwiGLU
(``gate.clamp(max=7) * sigmoid(1.702 * gate) * (up.clamp(-7, 7) + 1)``).

The Megatron side is megatron-core's own (as Megatron-Bridge's ``GPTOSSBridge`` configures it): ``softmax_type``
"learnable" (``core_attention.softmax_offset``), ``add_bias_linear`` (every linear, the router included),
``quick_geglu`` (``quick_gelu`` = x * sigmoid(1.702 x), gated) with ``glu_linear_offset`` 1 and
``activation_func_clamp_value`` 7, ``window_size`` (W - 1, 0) with ``window_attn_skip_freq`` (an int N: N - 1
sliding layers then a full one; else a 0/1 list, 1 = sliding), ``position_embedding_type`` "yarn" with
Megatron-LM's YaRN arguments, ``moe_router_pre_softmax`` False.

transformers stores the experts of a layer in four tensors: ``mlp.experts.gate_up_proj`` [E, H, 2F] with gate
and up interleaved on the last axis (even columns gate, odd up), ``gate_up_proj_bias`` [E, 2F] (interleaved too),
``down_proj`` [E, F, H] (transposed against a Linear weight) and ``down_proj_bias`` [E, H]. Each is described by
pieces of megatron-core's per-expert ``linear_fc1`` ([gate; up]) and ``linear_fc2`` through a ``View``
(``expert_tensors``), so a rank reads and writes only its experts' rows and columns.
"""
from __future__ import annotations

import argparse
import math
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..config import ModelConfig
from ..errors import ConvertError
from ..layout.boxes import Box, Piece, View
from ..layout.rules import LAYER_PREFIX, logical_tensors
from .base import (
    ATTENTION_NAMES,
    DTYPE_NAMES,
    EXPORT_FIX,
    MLP_NORM,
    Family,
    HFTensors,
    Imported,
    Name,
    base_config,
    common_args,
    dims_of,
    divisible,
    get,
    hf_dtype,
    hybrid_problems,
    in_layer,
    layer_prefix,
    require_int,
)

ARCHITECTURE = "GptOssForCausalLM"
ALPHA, LIMIT, OFFSET = 1.702, 7.0, 1.0  # transformers' GptOssExperts: alpha, limit and the + 1 of (up + 1)
SLIDING, FULL = "sliding_attention", "full_attention"
LAYER_NAMES: tuple[Name, ...] = (
    *(n for n in ATTENTION_NAMES if "_norm." not in n[0]),  # q/k/v weights and biases, o_proj weight
    ("self_attn.o_proj.bias", "self_attention.linear_proj.bias", None),
    ("self_attn.sinks", "self_attention.core_attention.softmax_offset", None),
    *MLP_NORM,
    ("mlp.router.weight", "mlp.router.weight", None),
    ("mlp.router.bias", "mlp.router.bias", None),
)
GATE_UP, GATE_UP_BIAS = "mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj_bias"
DOWN, DOWN_BIAS = "mlp.experts.down_proj", "mlp.experts.down_proj_bias"
EXPERT = "mlp.experts.local_experts.{e}.linear_fc{n}.{p}"
YARN_DEFAULTS = {"yarn_beta_fast": 32.0, "yarn_beta_slow": 1.0, "yarn_correction_range_round_to_int": True}


def skip_freq(types: list[str], layers: int, window: Any) -> int | list[int] | None:
    """megatron-core's ``window_attn_skip_freq`` for HF ``layer_types``: an int N when the layers are N - 1
    sliding then one full, repeated (1-based layer l slides iff l % N != 0), else a 0/1 list (1 = sliding);
    None when every layer slides. Refused when a type is neither sliding nor full attention, when there is not one
    type per layer, or when layers slide without a ``sliding_window``."""
    if len(types) != layers or set(types) - {SLIDING, FULL}:
        raise ConvertError(f"layer_types {types} are not one of {SLIDING!r} / {FULL!r} per layer ({layers} layers): "
                           "megatron-core's window_attn_skip_freq expresses only sliding or full attention per layer",
                           "convert a config whose layer_types list sliding_attention or full_attention for every "
                           "layer")
    if SLIDING in types and not (isinstance(window, int) and window >= 1):
        raise ConvertError(f"layer_types has sliding_attention layers but sliding_window is {window!r}",
                           "set sliding_window in config.json to the window the model was trained with")
    pattern = [int(t == SLIDING) for t in types]
    if all(pattern):
        return None
    period = pattern.index(0) + 1
    if pattern == [int((layer + 1) % period != 0) for layer in range(layers)]:
        return period
    return pattern


def layer_types_of(layers: int, window: Any, freq: Any) -> list[str]:
    """HF ``layer_types`` from megatron-core's ``window_size`` and ``window_attn_skip_freq`` (utils.
    is_layer_window_attention, with 1-based layer numbers)."""
    if not window:
        return [FULL] * layers
    if freq is None:
        return [SLIDING] * layers
    if isinstance(freq, int):
        return [SLIDING if (layer + 1) % freq else FULL for layer in range(layers)]
    return [SLIDING if freq[layer] else FULL for layer in range(layers)]


def rope_args(hf: dict[str, Any]) -> dict[str, Any]:
    """Megatron-LM's RoPE arguments for ``rope_parameters`` (or transformers 4's ``rope_theta``/``rope_scaling``):
    default RoPE, or YaRN with megatron-core's YarnRotaryEmbedding (``rotary_scaling_factor``, ``yarn_*``,
    ``mscale``/``mscale_all_dim`` as Megatron-LM names them)."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", get(hf, "rope_theta", 150000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ConvertError(f"partial_rotary_factor={params['partial_rotary_factor']}: megatron-core's YaRN rotates "
                           "the whole head", "convert a config without partial_rotary_factor")
    if kind == "default":
        return {"position_embedding_type": "rope", "rotary_base": theta}
    if kind != "yarn":
        raise ConvertError(f"gpt-oss RoPE type {kind!r}: megatron-core expresses default RoPE and YaRN here",
                           "convert a config whose rope_parameters.rope_type is yarn or default")
    original = require_int(params, "original_max_position_embeddings")
    factor = params.get("factor") or require_int(hf, "max_position_embeddings") / original
    mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
    if not (mscale and mscale_all):  # transformers: the ratio only when both are given, else mscale(factor)
        mscale, mscale_all = 1.0, 0.0  # megatron-core: mscale(factor, 1) / mscale(factor, 0) = mscale(factor)
    attention = params.get("attention_factor")
    implied = (0.1 * float(mscale) * math.log(factor) + 1.0) / (0.1 * float(mscale_all) * math.log(factor) + 1.0) \
        if factor > 1 else 1.0
    if attention is not None and not math.isclose(float(attention), implied, rel_tol=1e-9):
        raise ConvertError(f"rope_parameters.attention_factor={attention} differs from YaRN's {implied:.6g}: "
                           "megatron-core computes it from factor, mscale and mscale_all_dim",
                           "convert a config without attention_factor (or with the value YaRN implies)")
    return {"position_embedding_type": "yarn", "rotary_base": theta, "rotary_scaling_factor": float(factor),
            "yarn_original_max_position_embeddings": original,
            "yarn_beta_fast": float(params.get("beta_fast") or 32.0),
            "yarn_beta_slow": float(params.get("beta_slow") or 1.0),
            "yarn_correction_range_round_to_int": bool(params.get("truncate", True)),
            "mscale": float(mscale), "mscale_all_dim": float(mscale_all)}


def rope_parameters(args: argparse.Namespace) -> dict[str, Any]:
    """transformers' ``rope_parameters`` from the RoPE arguments (the inverse of ``rope_args``)."""
    a = vars(args)
    out: dict[str, Any] = {"rope_type": "default", "rope_theta": float(get(a, "rotary_base", 150000.0))}
    if get(a, "position_embedding_type", "rope") != "yarn":
        return out
    out.update(rope_type="yarn", factor=float(get(a, "rotary_scaling_factor", 1.0)),
               original_max_position_embeddings=int(get(a, "yarn_original_max_position_embeddings", 4096)),
               beta_fast=float(get(a, "yarn_beta_fast", 32.0)), beta_slow=float(get(a, "yarn_beta_slow", 1.0)),
               truncate=bool(get(a, "yarn_correction_range_round_to_int", True)))
    mscale, mscale_all = float(get(a, "mscale", 1.0)), float(get(a, "mscale_all_dim", 0.0))
    if mscale_all:
        out.update(mscale=mscale, mscale_all_dim=mscale_all)
    return out


def expert_tensors(cfg: ModelConfig, layer: int) -> HFTensors:
    """The four expert tensors of decoder layer ``layer`` as transformers stores them, each a piece per expert (and
    per half of fc1) with the view that reads it: expert e's fc1 gate rows on the even columns of
    ``gate_up_proj[e]`` (step 2), its up rows on the odd ones, both transposed (logical rows run along the stored
    last axis, columns along the hidden axis); fc2 transposed in ``down_proj[e]``; the fc2 bias a plain row."""
    experts, ffn, hidden = cfg.num_experts, cfg.expert_ffn, cfg.hidden_size
    mc = f"{LAYER_PREFIX}{layer}."

    def name(e: int, n: int, p: str) -> str:
        return mc + EXPERT.format(e=e, n=n, p=p)

    fc1, fc1_bias = View(axes=(2, 1), steps=(1, 1, 2)), View(axes=(1,), steps=(1, 2))
    fc2 = View(axes=(2, 1), steps=(1, 1, 1))
    span = 2 * ffn - 1  # the covering box of every other column of 2F
    return {
        GATE_UP: ((experts, hidden, 2 * ffn), [
            Piece(name(e, 1, "weight"), Box((half * ffn, 0), (ffn, hidden)), Box((e, 0, half), (1, hidden, span)),
                  view=fc1) for e in range(experts) for half in (0, 1)]),
        GATE_UP_BIAS: ((experts, 2 * ffn), [
            Piece(name(e, 1, "bias"), Box((half * ffn,), (ffn,)), Box((e, half), (1, span)), view=fc1_bias)
            for e in range(experts) for half in (0, 1)]),
        DOWN: ((experts, ffn, hidden), [
            Piece(name(e, 2, "weight"), Box.full((hidden, ffn)), Box((e, 0, 0), (1, ffn, hidden)), view=fc2)
            for e in range(experts)]),
        DOWN_BIAS: ((experts, hidden), [
            Piece(name(e, 2, "bias"), Box.full((hidden,)), Box((e, 0), (1, hidden))) for e in range(experts)]),
    }


def gpt_oss_problems(cfg: ModelConfig, args: argparse.Namespace) -> list[str]:
    """What of a model ``GptOssForCausalLM`` cannot express (its experts' maths and router included)."""
    a = vars(args)
    problems = []
    if cfg.family != "gpt" or cfg.mla:
        problems.append("an encoder-decoder architecture" if cfg.family != "gpt" else "multi-latent attention")
    if cfg.post_norms or cfg.zero_centered_gamma or cfg.normalization != "RMSNorm" or cfg.qk_layernorm:
        problems.append("norms other than gpt-oss's (plain RMSNorm pre-norms, no q/k norms)")
    if not (cfg.swiglu and cfg.activation == "quick_gelu"):
        problems.append(f"a {cfg.activation if cfg.swiglu else 'non'}-gated MLP (gpt-oss gates with quick_gelu)")
    if not (cfg.add_bias_linear and cfg.add_qkv_bias):
        problems.append("linear layers without biases")
    if cfg.softmax_type != "learnable":
        problems.append(f"softmax_type={cfg.softmax_type} (gpt-oss has learnable attention sinks)")
    if cfg.position_embedding_type not in ("rope", "yarn"):
        problems.append(f"{cfg.position_embedding_type} position embeddings")
    if not cfg.num_experts:
        problems.append("no Mixture-of-Experts layers")
    elif cfg.moe_layer_pattern is not None or cfg.moe_shared_expert_intermediate_size or cfg.moe_router_expert_bias:
        problems.append("dense layers, shared experts or a router expert bias (gpt-oss has none)")
    if cfg.mtp_num_layers:
        problems.append("multi-token-prediction layers")
    problems += hybrid_problems(cfg)
    if problems:
        return problems
    # the expert and router maths is not in the tensors: the arguments say it
    offset, clamp = get(a, "glu_linear_offset", 0.0), get(a, "activation_func_clamp_value", None)
    if (float(offset), clamp) != (OFFSET, LIMIT):
        problems.append(f"a gated MLP with glu_linear_offset={offset} and activation_func_clamp_value={clamp} "
                        f"(transformers' gpt-oss computes (up + {OFFSET:g}) with a clamp of {LIMIT:g})")
    if get(a, "moe_router_score_function", "softmax") != "softmax" or get(a, "moe_router_pre_softmax", False):
        problems.append("a router other than top-k of the logits then softmax (moe_router_pre_softmax, "
                        "moe_router_score_function)")
    return problems


@dataclass(frozen=True, kw_only=True)
class GptOss(Family):
    architecture: str = ARCHITECTURE
    model_type: str = "gpt_oss"
    scope: ClassVar[str] = "no supported Hugging Face family (GptOssForCausalLM included)"

    def from_hf(self, hf: dict[str, Any], vocab_divisible_by: int | None) -> Imported:
        d = dims_of(hf)
        if hf.get("attention_bias") is False:
            raise ConvertError("attention_bias=false: megatron-core's add_bias_linear gives q/k/v/o a bias whenever "
                               "the router and the experts have theirs (gpt-oss always has those)",
                               "convert a config with attention_bias true (as the gpt-oss releases have)")
        if hf.get("swiglu_limit") is not None and float(hf["swiglu_limit"]) != LIMIT:
            raise ConvertError(f"swiglu_limit={hf['swiglu_limit']}: transformers' GptOssExperts clamps at {LIMIT:g} "
                               "whatever config.json says", f"convert a config with swiglu_limit {LIMIT:g}")
        experts = require_int(hf, "num_local_experts", "num_experts")
        freq = skip_freq(list(hf.get("layer_types") or [SLIDING if (i + 1) % 2 else FULL for i in range(d.layers)]),
                         d.layers, hf.get("sliding_window"))
        window = hf.get("sliding_window")
        sliding = freq != 1  # 1: every layer full
        rope = rope_args(hf)
        cfg = ModelConfig(
            num_layers=d.layers, hidden_size=d.hidden, ffn_hidden_size=d.ffn, num_attention_heads=d.heads,
            num_query_groups=d.groups, kv_channels=d.head_dim, swiglu=True, activation="quick_gelu",
            normalization="RMSNorm", add_bias_linear=True, add_qkv_bias=True,
            untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False), vocab_size=d.vocab,
            make_vocab_size_divisible_by=divisible(vocab_divisible_by),
            position_embedding_type=rope["position_embedding_type"],
            max_position_embeddings=int(get(hf, "max_position_embeddings", 131072)), qk_layernorm=False, spec="te",
            num_experts=experts, moe_ffn_hidden_size=d.ffn, softmax_type="learnable")
        args = common_args(
            d, cfg, hf_dtype(hf), rope["rotary_base"], hf,
            **{k: v for k, v in rope.items() if k not in ("rotary_base", "position_embedding_type")},
            quick_geglu=True, glu_linear_offset=OFFSET, activation_func_clamp_value=LIMIT, softmax_type="learnable",
            window_size=(int(window) - 1, 0) if sliding else None, window_attn_skip_freq=freq if sliding else None,
            num_experts=experts, moe_ffn_hidden_size=d.ffn, moe_layer_freq=1,
            moe_router_topk=require_int(hf, "num_experts_per_tok", default=4), moe_router_pre_softmax=False,
            moe_router_score_function="softmax", moe_router_enable_expert_bias=False, moe_grouped_gemm=False,
            moe_shared_expert_intermediate_size=None, moe_shared_expert_gate=False,
            expert_model_parallel_size=1, expert_tensor_parallel_size=1)
        args.swiglu = False  # Megatron-LM: --quick-geglu, not --swiglu (they are exclusive)
        args.position_embedding_type = rope["position_embedding_type"]
        args.use_rotary_position_embeddings = rope["position_embedding_type"] == "rope"
        args.norm_epsilon = float(get(hf, "rms_norm_eps", 1e-5))
        return Imported(cfg=cfg, args=args, notes=[])

    def to_hf(self, cfg: ModelConfig, args: argparse.Namespace, base: dict[str, Any] | None,
              dtype: torch.dtype) -> dict[str, Any]:
        hf, same = base_config(self, base)
        a = vars(args)
        name = DTYPE_NAMES.get(dtype, "float32")
        hf.update({
            "architectures": [self.architecture], "model_type": self.model_type, "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.expert_ffn, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_query_groups,
            "head_dim": cfg.kv_channels, "vocab_size": cfg.vocab_size, "tie_word_embeddings": cfg.tied,
            "num_local_experts": cfg.num_experts, "attention_bias": True, "dtype": name})
        if not same or "torch_dtype" in hf:  # transformers 4 reads torch_dtype, 5 dtype (and saves only that)
            hf["torch_dtype"] = name
        if "moe_router_topk" in a or not same:
            hf["num_experts_per_tok"] = int(get(a, "moe_router_topk", 4))
        if same:
            return hf
        window, freq = get(a, "window_size", None), get(a, "window_attn_skip_freq", None)
        hf.update({
            "max_position_embeddings": int(cfg.max_position_embeddings or 131072),
            "rms_norm_eps": float(get(a, "norm_epsilon", 1e-5)), "hidden_act": "silu",
            "sliding_window": int(window[0]) + 1 if window else None,
            "layer_types": layer_types_of(cfg.num_layers, window, freq), "rope_parameters": rope_parameters(args)})
        return hf

    def affinity(self, cfg: ModelConfig) -> int:
        """Attention sinks or the quick_gelu gate: gpt-oss's own evidence."""
        return 6 if cfg.softmax_type == "learnable" or (cfg.swiglu and cfg.activation == "quick_gelu") else 0

    def why_not(self, cfg: ModelConfig, args: argparse.Namespace) -> str | None:
        return ", ".join(gpt_oss_problems(cfg, args)) or None

    def refusal(self, problem: str) -> ConvertError:
        return ConvertError(f"the model has {problem}, which {self.scope} can express", EXPORT_FIX)

    def layer_names(self, cfg: ModelConfig, stack: str, layer: int) -> list[Name]:
        """The per-layer rows; the four fused expert tensors are ``alternatives`` (they need views)."""
        return in_layer(LAYER_NAMES, layer_prefix(stack, layer))

    def alternatives(self, cfg: ModelConfig, found: Collection[str], expected: HFTensors) -> HFTensors:
        """gpt-oss's only layout of its experts (``expert_tensors``), whether stored or not: the name table has no
        other rows for them, and a missing one is reported as missing."""
        logical = logical_tensors(cfg)
        out: HFTensors = {}
        for layer in range(cfg.num_layers):
            for key, value in expert_tensors(cfg, layer).items():
                if all(p.logical in logical for p in value[1]):
                    out[f"model.layers.{layer}.{key}"] = value
        return out


FAMILIES = (GptOss(),)
