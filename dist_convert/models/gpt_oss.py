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

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..config import ModelConfig
from ..errors import ConvertError
from ..features import MLP, Attention, MoE, Norms
from ..layout.boxes import Box, Piece, View
from ..layout.rules import LAYER_PREFIX, logical_tensors
from .base import (
    ANY,
    COMMON,
    COMMON_HF_KEYS,
    DTYPE_NAMES,
    INPUT_NORM,
    O_PROJ,
    PRE_MLP_NORM,
    QKV_BIAS,
    QKV_WEIGHT,
    Allowed,
    Family,
    HFTensors,
    Imported,
    base_config,
    dims_of,
    get,
    in_layer,
    layer_prefix,
    require_int,
)
from .llama import GQA_ROPE, gqa_core
from .rope import position_from_hf, rope_to_hf
from .rows import Plain, Row

ARCHITECTURE = "GptOssForCausalLM"
ALPHA, LIMIT, OFFSET = 1.702, 7.0, 1.0  # transformers' GptOssExperts: alpha, limit and the + 1 of (up + 1)
SLIDING, FULL = "sliding_attention", "full_attention"
LAYER_NAMES: tuple[Row, ...] = (
    INPUT_NORM, QKV_WEIGHT, QKV_BIAS, O_PROJ,  # no q/k norms
    Plain(hf="self_attn.o_proj.bias", logical="self_attention.linear_proj.bias"),
    Plain(hf="self_attn.sinks", logical="self_attention.core_attention.softmax_offset"),
    *PRE_MLP_NORM,
    Plain(hf="mlp.router.weight", logical="mlp.router.weight"),
    Plain(hf="mlp.router.bias", logical="mlp.router.bias"),
)
GATE_UP, GATE_UP_BIAS = "mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj_bias"
DOWN, DOWN_BIAS = "mlp.experts.down_proj", "mlp.experts.down_proj_bias"
EXPERT = "mlp.experts.local_experts.{e}.linear_fc{n}.{p}"


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


@dataclass(frozen=True, kw_only=True)
class GptOss(Family):
    architecture: str = ARCHITECTURE
    model_type: str = "gpt_oss"

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
        window = hf.get("sliding_window")
        freq = skip_freq(list(hf.get("layer_types") or [SLIDING if (i + 1) % 2 else FULL for i in range(d.layers)]),
                         d.layers, window)
        sliding = freq != 1  # 1: every layer full
        position = position_from_hf(hf, "gpt-oss", kinds=("default", "yarn"), theta_default=150000.0)
        if position.percent != 1.0:
            raise ConvertError(f"partial_rotary_factor={position.percent}: megatron-core's YaRN rotates the whole head",
                               "convert a config without partial_rotary_factor")
        cfg = ModelConfig(
            **gqa_core(d, hf, vocab_divisible_by, add_bias_linear=True, add_qkv_bias=True,
                       max_position_embeddings=int(get(hf, "max_position_embeddings", 131072))),
            position=position, norm=Norms(kind="RMSNorm", eps=float(get(hf, "rms_norm_eps", 1e-5))),
            attention=Attention(softmax_type="learnable", window=(int(window) - 1, 0) if sliding else None,
                                window_skip_freq=freq if sliding else None),
            mlp=MLP(gated=True, activation="quick_gelu", glu_linear_offset=OFFSET, clamp=LIMIT),
            moe=MoE(num_experts=experts, ffn=d.ffn, topk=require_int(hf, "num_experts_per_tok", default=4),
                    score_function="softmax", pre_softmax=False))
        return Imported(cfg=cfg, notes=[])

    @property
    def hf_keys(self) -> frozenset[str]:
        return COMMON_HF_KEYS | {"attention_bias", "swiglu_limit", "sliding_window", "layer_types", "rope.rope_type",
                                 "rope.partial_rotary_factor"}

    def to_hf(self, cfg: ModelConfig, base: dict[str, Any] | None, dtype: torch.dtype) -> dict[str, Any]:
        hf, same = base_config(self, base)
        name = DTYPE_NAMES.get(dtype, "float32")
        assert cfg.moe is not None
        window = cfg.attention.window
        hf.update({
            "architectures": [self.architecture], "model_type": self.model_type, "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.expert_ffn, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_query_groups,
            "head_dim": cfg.kv_channels, "vocab_size": cfg.vocab_size, "tie_word_embeddings": cfg.tied,
            "num_local_experts": cfg.num_experts, "attention_bias": True, "dtype": name,
            "num_experts_per_tok": cfg.moe.topk, "rms_norm_eps": cfg.norm.eps,
            "max_position_embeddings": int(cfg.max_position_embeddings or 131072),
            "sliding_window": window[0] + 1 if window else None,
            "layer_types": layer_types_of(cfg.num_layers, window, cfg.attention.window_skip_freq)})
        if not same or "torch_dtype" in hf:  # transformers 4 reads torch_dtype, 5 dtype (and saves only that)
            hf["torch_dtype"] = name
        if not same:
            hf["hidden_act"] = "silu"
        if not (same and position_from_hf(hf, "gpt-oss", kinds=("default", "yarn")) == cfg.position):
            hf.pop("rope_scaling", None)
            hf.pop("rope_theta", None)
            hf["rope_parameters"] = rope_to_hf(cfg.position)
        return hf

    def expresses(self) -> Mapping[str, Allowed]:
        """gpt-oss's own maths: attention sinks, biases everywhere, the clamped quick_gelu GLU with (up + 1),
        sliding layers by layer_types, top-k of the router logits then softmax, YaRN or plain RoPE."""
        return {**COMMON, **GQA_ROPE, "position.scaling": {None, "yarn"}, "add_bias_linear": {True},
                "add_qkv_bias": {True}, "attention.softmax_type": {"learnable"},
                "attention.window": lambda w, cfg: w is None or w[1] == 0,
                "attention.window_skip_freq": ANY, "mlp.activation": {"quick_gelu"},
                "mlp.glu_linear_offset": {OFFSET}, "mlp.clamp": {LIMIT}, "moe": {True},
                "moe.score_function": {"softmax"}, "moe.pre_softmax": {False}}

    def layer_names(self, cfg: ModelConfig, stack: str, layer: int) -> list[Row]:
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
