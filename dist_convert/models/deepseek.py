"""DeepSeek-V2 / V3 (``DeepseekV2ForCausalLM``, ``DeepseekV3ForCausalLM``; also configs of their architecture,
e.g. Kimi-K2): multi-latent attention, DeepSeek MoE (dense first layers, shared experts, sigmoid or softmax
routing) and multi-token-prediction layers.

HF stores MTP layer k as decoder layer ``num_hidden_layers + k`` with the extra modules ``enorm``,
``hnorm``, ``eh_proj`` and ``shared_head.norm``, plus copies of the embedding (``embed_tokens``) and
the output head (``shared_head.head``); transformers itself does not load them.

The DeepSeek MoE (``moe_from_hf`` / ``moe_to_hf`` / ``moe_problems``, the router: ``router_args``), its names
(``moe_names``) and the MTP layers (``stack_names``, ``mtp_copies``, ``drop_absent_mtp``) are shared with the
GLM-4.5 family (``models/glm.py``), which puts the same MoE and MTP layers over GQA attention.
"""
from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..config import ModelConfig
from ..errors import ConvertError
from ..features import MLA, MLP, MTP, Attention, MoE, Norms
from ..features.expressed import scaling_settings
from ..layout.mtp import MTP_LAYER
from ..layout.rules import EMBEDDING, OUTPUT
from .base import (
    ANY,
    COMMON,
    COMMON_HF_KEYS,
    DTYPE_NAMES,
    GATED_MLP,
    PRE_MLP_NORM,
    Allowed,
    Family,
    Imported,
    check_silu,
    divisible,
    expert_names,
    get,
    in_layer,
)
from .rope import position_from_hf, rope_params, rope_to_hf
from .rows import GLU, Plain, Row

# an MLA layer's attention (HF suffix after model.layers.N. -> logical suffix): every projection stored whole
MLA_NAMES: tuple[Row, ...] = tuple(Plain(hf=hf, logical=lg) for hf, lg in (
    ("input_layernorm.weight", "input_layernorm.weight"),
    ("self_attn.q_proj.weight", "self_attention.linear_q_proj.weight"),
    ("self_attn.q_a_proj.weight", "self_attention.linear_q_down_proj.weight"),
    ("self_attn.q_a_layernorm.weight", "self_attention.q_layernorm.weight"),
    ("self_attn.q_b_proj.weight", "self_attention.linear_q_up_proj.weight"),
    ("self_attn.kv_a_proj_with_mqa.weight", "self_attention.linear_kv_down_proj.weight"),
    ("self_attn.kv_a_layernorm.weight", "self_attention.kv_layernorm.weight"),
    ("self_attn.kv_b_proj.weight", "self_attention.linear_kv_up_proj.weight"),
    ("self_attn.o_proj.weight", "self_attention.linear_proj.weight"),
))
SHARED_NAMES: tuple[Row, ...] = (
    GLU(logical="mlp.shared_experts.linear_fc1.weight", gate="mlp.shared_experts.gate_proj.weight",
        up="mlp.shared_experts.up_proj.weight"),
    Plain(hf="mlp.shared_experts.down_proj.weight", logical="mlp.shared_experts.linear_fc2.weight"),
)
# an MTP layer's own modules (logical suffix after mtp.layers.K.); its decoder layer is under MTP_LAYER
MTP_NAMES: tuple[Row, ...] = tuple(Plain(hf=hf, logical=lg) for hf, lg in (
    ("enorm.weight", "enorm.weight"),
    ("hnorm.weight", "hnorm.weight"),
    ("eh_proj.weight", "eh_proj.weight"),
    ("shared_head.norm.weight", "final_layernorm.weight"),
))
MTP_COPIES = (("embed_tokens.weight", EMBEDDING), ("shared_head.head.weight", OUTPUT))
V3, V2 = "DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"
A_NORM_EPS = 1e-6  # transformers' DeepSeek builds q_a_layernorm / kv_a_layernorm with this epsilon, always
MOE_HF_KEYS = frozenset({"norm_topk_prob", "scoring_func", "topk_method", "n_group", "topk_group",
                         "routed_scaling_factor", "first_k_dense_replace", "moe_layer_freq", "n_shared_experts",
                         "num_nextn_predict_layers"})


def moe_names(num_experts: int) -> tuple[Row, ...]:
    return (Plain(hf="mlp.gate.weight", logical="mlp.router.weight"),
            Plain(hf="mlp.gate.e_score_correction_bias", logical="mlp.router.expert_bias"),
            *expert_names("mlp", num_experts), *SHARED_NAMES)


def stack_names(cfg: ModelConfig, stack: str, layer: int, attention: tuple[Row, ...]) -> list[Row]:
    """The rows of every tensor of one decoder or MTP layer with ``attention``'s rows and DeepSeek's MoE; HF
    numbers MTP layer k as decoder layer ``num_layers + k`` and stores copies of the embedding and the output head
    with it."""
    moe = cfg.layer_is_moe(stack, layer)
    rows = attention + PRE_MLP_NORM + (moe_names(cfg.num_experts) if moe else GATED_MLP)
    if stack == "decoder":
        return in_layer(rows, f"decoder.layers.{layer}.")
    copies = [Plain(hf=hf, logical=OUTPUT if name == OUTPUT and not cfg.tied else EMBEDDING)
              for hf, name in MTP_COPIES]
    return in_layer(MTP_NAMES, f"mtp.layers.{layer}.") + in_layer(rows, f"mtp.layers.{layer}.{MTP_LAYER}") + copies


def layer_names(cfg: ModelConfig, stack: str, layer: int) -> list[Row]:
    return stack_names(cfg, stack, layer, MLA_NAMES)


def mtp_copies(cfg: ModelConfig, found: Collection[str]) -> dict[str, list[str]]:
    """The copies of the embedding and the output head stored with each MTP layer, by the key they copy
    (they are compared with it on read, never read as the tensor itself)."""
    out: dict[str, list[str]] = {}
    for k in range(cfg.mtp_num_layers):
        for suffix, name in MTP_COPIES:
            key = f"model.layers.{cfg.num_layers + k}.{suffix}"
            if key in found:
                primary = "lm_head.weight" if name == OUTPUT and not cfg.tied else "model.embed_tokens.weight"
                out.setdefault(primary, []).append(key)
    return out


def drop_absent_mtp(cfg: ModelConfig, found: Collection[str], notes: list[str]) -> ModelConfig:
    """The model without its MTP layers when ``config.json`` declares them and the weights hold none."""
    if cfg.mtp_num_layers and f"model.layers.{cfg.num_layers}.eh_proj.weight" not in found:
        notes.append(f"config.json declares {cfg.mtp_num_layers} MTP layers (num_nextn_predict_layers) but the "
                     "weights hold none; converting the model without them")
        return cfg.replace(mtp=None)
    return cfg


def mtp_optional_sets(cfg: ModelConfig, written: bool = True) -> dict[str, tuple[list[str], bool]]:
    """The MTP layers' copies of the embedding and of the output head: DeepSeek-V3 and GLM-4.5 releases store
    them, GLM-4.6 and later neither (``written``: whether an export writes them when the source said nothing)."""
    return {f"mtp {suffix.removesuffix('.weight')}": (
        [f"model.layers.{cfg.num_layers + k}.{suffix}" for k in range(cfg.mtp_num_layers)], written)
        for suffix, _ in MTP_COPIES} if cfg.mtp_num_layers else {}


def router_from_hf(hf: dict[str, Any], v3: bool, experts: int, topk: int, name: str = "DeepSeek-V3") -> dict[str, Any]:
    """The MoE record's router fields for DeepSeek's routing. V3 (and ``name``, a family routing as V3 does):
    sigmoid scores, a correction bias for the choice, group-limited top-k (group score: sum of the top 2),
    renormalised (top-k > 1), scaled. V2: softmax, greedy top-k, scaled, never renormalised."""
    groups, group_topk = int(get(hf, "n_group", 1)), int(get(hf, "topk_group", 1))
    scale = float(get(hf, "routed_scaling_factor", 1.0))
    out: dict[str, Any] = {"topk": topk, "topk_scaling_factor": None if scale == 1.0 else scale,
                           "router_dtype": "fp32"}
    if experts % max(1, groups):
        raise ConvertError(f"n_group={groups} does not divide n_routed_experts={experts}",
                           "fix n_group in config.json")
    if v3:
        if bool(hf.get("norm_topk_prob", True)) != (topk > 1):
            raise ConvertError(f"norm_topk_prob={str(hf.get('norm_topk_prob', True)).lower()} with sigmoid routing to "
                               f"{topk} expert(s): megatron-core renormalises the top-k sigmoid scores exactly when "
                               "top-k > 1", f"convert a {name} config with norm_topk_prob {str(topk > 1).lower()}")
        out.update(score_function="sigmoid", expert_bias=True, pre_softmax=False)
        if groups > 1:
            if topk % group_topk or topk // group_topk != 2:
                raise ConvertError(f"group-limited routing with top-k {topk} over topk_group={group_topk}: "
                                   f"megatron-core scores a group by its top (top-k / topk_group) experts, {name} "
                                   "by its top 2", "convert a config where num_experts_per_tok / topk_group == 2")
            out.update(num_groups=groups, group_topk=group_topk)
    else:
        method = hf.get("topk_method", "greedy")
        if method != "greedy":
            raise ConvertError(f"DeepSeek-V2 topk_method={method!r}: megatron-core scores a group by the sum of its "
                               "top experts, DeepSeek-V2 by its best one", "convert a config with topk_method greedy")
        out.update(score_function="softmax", expert_bias=False, pre_softmax=True)
    return out


def moe_from_hf(hf: dict[str, Any], layers: int, ffn: int, v3: bool, name: str = "DeepSeek-V3") -> MoE | None:
    """DeepSeek's MoE as ``config.json`` states it: layer l is MoE iff l >= first_k_dense_replace (and
    l % moe_layer_freq == 0), experts of moe_intermediate_size, an ungated shared expert of n_shared_experts
    experts, the router of ``router_from_hf``; None without routed experts."""
    experts = int(get(hf, "n_routed_experts", 0))
    if not experts:
        return None
    dense = int(get(hf, "first_k_dense_replace", 0))
    freq = int(get(hf, "moe_layer_freq", 1))
    pattern = tuple(int(layer >= dense and layer % freq == 0) for layer in range(layers))
    topk = int(get(hf, "num_experts_per_tok", 1))
    expert_ffn = int(get(hf, "moe_intermediate_size", ffn))
    shared = int(get(hf, "n_shared_experts", 0)) * expert_ffn
    return MoE(num_experts=experts, ffn=expert_ffn, layer_pattern=None if all(pattern) else pattern,
               shared_size=shared or None, shared_gate=False, **router_from_hf(hf, v3, experts, topk, name))


def config_from_hf(hf: dict[str, Any], architecture: str, vocab_divisible_by: int | None, *, v3: bool | None = None,
                   one_eps: bool = True) -> ModelConfig:
    """The model config of a DeepSeek-V2/V3 ``config.json`` (``v3``: V3's routing, MTP and interleaved RoPE, for
    another architecture of V3's shape; ``one_eps``: refuse an rms_norm_eps other than the latent norms' 1e-6)."""
    v3 = architecture == V3 if v3 is None else v3
    try:
        heads, hidden = int(hf["num_attention_heads"]), int(hf["hidden_size"])
        layers, ffn, vocab = int(hf["num_hidden_layers"]), int(hf["intermediate_size"]), int(hf["vocab_size"])
        kv_lora, nope = int(hf["kv_lora_rank"]), int(hf["qk_nope_head_dim"])
        rope_dim, v_dim = int(hf["qk_rope_head_dim"]), int(hf["v_head_dim"])
    except KeyError as e:
        raise ConvertError(f"config.json lacks {e.args[0]}", "use the config.json saved with the model") from None
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ConvertError("attention_bias / mlp_bias = true: megatron-core's MLA and MoE layers have no such biases",
                           "convert a model without them")
    check_silu(hf)
    if v3 and hf.get("rope_interleave") is False:
        raise ConvertError("rope_interleave=false: megatron-core's MLA always de-interleaves the RoPE dimensions",
                           "convert a config with rope_interleave true (as DeepSeek releases have)")
    eps = float(get(hf, "rms_norm_eps", 1e-6))
    if eps != A_NORM_EPS and one_eps:
        raise ConvertError(f"rms_norm_eps={eps}: transformers' {architecture} builds q_a_layernorm / kv_a_layernorm "
                           f"with eps {A_NORM_EPS} whatever config.json says, megatron-core's MLA every norm with "
                           "one epsilon", f"convert a config with rms_norm_eps {A_NORM_EPS} (as DeepSeek releases "
                                          "have)")
    q_lora = hf.get("q_lora_rank")
    mtp = int(get(hf, "num_nextn_predict_layers", 0)) if v3 else 0
    return ModelConfig(
        num_layers=layers, hidden_size=hidden, ffn_hidden_size=ffn, num_attention_heads=heads,
        num_query_groups=heads, kv_channels=hidden // heads, add_bias_linear=False, add_qkv_bias=False,
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings"), vocab_size=vocab,
        make_vocab_size_divisible_by=divisible(vocab_divisible_by),
        max_position_embeddings=int(get(hf, "max_position_embeddings", 4096)), spec="te",
        position=position_from_hf(hf, architecture, kinds=("default", "yarn"), mla=True),
        attention=Attention(qk_norm=True), norm=Norms(kind="RMSNorm", eps=eps), mlp=MLP(gated=True, activation="silu"),
        mla=MLA(q_lora_rank=int(q_lora) if q_lora else None, kv_lora_rank=kv_lora, qk_head_dim=nope,
                qk_pos_emb_head_dim=rope_dim, v_head_dim=v_dim),
        mtp=MTP(num_layers=mtp) if mtp else None, moe=moe_from_hf(hf, layers, ffn, v3))


def moe_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """DeepSeek's MoE keys of ``config.json`` for an MoE model (``moe_expresses`` says what they express)."""
    moe = cfg.moe
    assert moe is not None
    pattern = moe.layer_pattern or (1,) * cfg.num_layers
    return {"n_routed_experts": cfg.num_experts, "moe_intermediate_size": cfg.expert_ffn,
            "n_shared_experts": (moe.shared_size or 0) // cfg.expert_ffn, "num_experts_per_tok": moe.topk,
            "first_k_dense_replace": pattern.index(1), "routed_scaling_factor": float(moe.topk_scaling_factor or 1.0),
            "n_group": moe.num_groups or 1, "topk_group": moe.group_topk or 1 if moe.num_groups else 1,
            "norm_topk_prob": moe.score_function == "sigmoid" and moe.topk > 1}


def _dense_then_moe(pattern: Any, cfg: ModelConfig) -> bool:
    """DeepSeek's first_k_dense_replace: dense layers first, then MoE layers only."""
    if pattern is None:
        return True
    first = pattern.index(1) if 1 in pattern else len(pattern)
    return 1 in pattern and all(pattern[first:])


def two_per_group(group_topk: Any, cfg: ModelConfig) -> bool:
    """megatron-core scores a group by its top (top-k / group top-k) experts, DeepSeek and GLM by their top 2."""
    moe = cfg.moe
    return moe is None or not moe.num_groups or (group_topk and moe.topk % group_topk == 0
                                                 and moe.topk // group_topk == 2)


def moe_expresses(v3: bool) -> dict[str, Allowed]:
    """What DeepSeek's MoE keys write: V3's sigmoid router with a correction bias (group-limited, renormalised
    for top-k > 1, scaled) or V2's softmax before top-k, dense layers first, ungated shared experts of whole
    experts, the router in fp32 or not."""
    router: dict[str, Allowed] = {"moe.score_function": {"sigmoid"}, "moe.expert_bias": {True},
                                  "moe.num_groups": ANY, "moe.group_topk": two_per_group} if v3 else \
        {"moe.score_function": {"softmax"}, "moe.pre_softmax": {True}}
    return {"moe.layer_pattern": _dense_then_moe, "moe.topk_scaling_factor": ANY,
            "moe.shared_size": lambda v, cfg: not v or v % cfg.expert_ffn == 0, **router}


def hf_from_config(cfg: ModelConfig, architecture: str, base: dict[str, Any] | None, dtype_name: str, *,
                   model_type: str | None = None, v3: bool | None = None) -> dict[str, Any]:
    """``config.json`` of an MLA model (``base``, the source's DeepSeek config, updated, when of that architecture;
    ``v3``: V3's routing and MTP keys, for another architecture of V3's shape)."""
    same = isinstance(base, dict) and architecture in (base.get("architectures") or [])
    hf: dict[str, Any] = dict(base) if same else {}
    mla = cfg.mla
    assert mla is not None
    v3 = architecture == V3 if v3 is None else v3
    hf.update({
        "architectures": [architecture],
        "model_type": hf.get("model_type") or model_type or ("deepseek_v3" if v3 else "deepseek_v2"),
        "hidden_act": "silu", "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_hidden_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_attention_heads,
        "q_lora_rank": mla.q_lora_rank, "kv_lora_rank": mla.kv_lora_rank, "qk_nope_head_dim": mla.qk_head_dim,
        "qk_rope_head_dim": mla.qk_pos_emb_head_dim, "v_head_dim": mla.v_head_dim,
        "head_dim": mla.qk_pos_emb_head_dim, "qk_head_dim": mla.q_head_dim, "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": cfg.tied, "max_position_embeddings": int(cfg.max_position_embeddings or 4096),
        "attention_bias": False, "rms_norm_eps": cfg.norm.eps, "torch_dtype": dtype_name, "dtype": dtype_name})
    if v3:
        hf.update(num_nextn_predict_layers=cfg.mtp_num_layers, rope_interleave=True)
    if cfg.moe is not None:
        hf.update(moe_to_hf(cfg), moe_layer_freq=1)
        if v3:
            hf.update(scoring_func="sigmoid", topk_method="noaux_tc")
        else:
            hf.update(norm_topk_prob=False, topk_method="greedy")
    else:  # every layer dense
        hf.update(n_routed_experts=None, first_k_dense_replace=cfg.num_layers,
                  moe_intermediate_size=cfg.ffn_hidden_size, n_shared_experts=0)
    if not (same and _kept_rope(hf, cfg)):
        params = rope_to_hf(replace(cfg.position, mla_names=False))
        for key in ("rope_parameters", "rope_scaling"):
            hf.pop(key, None)
        hf["rope_theta"] = params.pop("rope_theta")
        if params["rope_type"] == "yarn":
            yarn = cfg.position.scaling
            params["mscale"], params["mscale_all_dim"] = yarn.mscale, yarn.mscale_all_dim
            hf["rope_scaling"] = {"type": "yarn", **{k: v for k, v in params.items() if k != "rope_type"}}
    return hf


def _kept_rope(hf: dict[str, Any], cfg: ModelConfig) -> bool:
    try:
        return position_from_hf(hf, "", kinds=(rope_params(hf)["rope_type"],), mla=True) == cfg.position
    except ConvertError:
        return False


def mla_expresses() -> dict[str, Allowed]:
    """What transformers' DeepSeek-shaped attention computes: MLA with its q/kv latent norms (eps 1e-6), plain or
    YaRN RoPE. With plain RoPE megatron-core's MLA still scales the softmax by mscale(rotary_scaling_factor,
    mscale_all_dim)^2 where that is not 1 (``MLASoftmax``), transformers' DeepSeek only under YaRN: not expressed."""
    return {**COMMON, "norm.eps": {A_NORM_EPS}, "mla": {True}, "attention.qk_norm": {True},
            "position.kind": {"rope", "yarn"}, **scaling_settings("yarn")}


@dataclass(frozen=True, kw_only=True)
class DeepSeek(Family):
    architecture: str
    model_type: str

    def from_hf(self, hf: dict[str, Any], vocab_divisible_by: int | None) -> Imported:
        return Imported(cfg=config_from_hf(hf, self.architecture, vocab_divisible_by), notes=[])

    @property
    def hf_keys(self) -> frozenset[str]:
        return COMMON_HF_KEYS | MOE_HF_KEYS | {"attention_bias", "mlp_bias", "hidden_act", "rope_interleave",
                                               "rope.rope_type"}

    def to_hf(self, cfg: ModelConfig, base: dict[str, Any] | None, dtype: torch.dtype) -> dict[str, Any]:
        return hf_from_config(cfg, self.architecture, base, DTYPE_NAMES.get(dtype, "float32"))

    def expresses(self) -> Mapping[str, Allowed]:
        v3 = self.architecture == V3
        return {**mla_expresses(), "moe": {True, False} if v3 else {True}, "mtp": {True, False} if v3 else {False},
                **moe_expresses(v3)}

    def layer_names(self, cfg: ModelConfig, stack: str, layer: int) -> list[Row]:
        return layer_names(cfg, stack, layer)

    def as_stored(self, cfg: ModelConfig, found: Collection[str], notes: list[str]) -> ModelConfig:
        return drop_absent_mtp(cfg, found, notes)

    def stored_copies(self, cfg: ModelConfig, found: Collection[str]) -> dict[str, list[str]]:
        return mtp_copies(cfg, found)

    def optional_sets(self, cfg: ModelConfig) -> dict[str, tuple[list[str], bool]]:
        return {**super().optional_sets(cfg), **mtp_optional_sets(cfg)}


FAMILIES = (DeepSeek(architecture=V3, model_type="deepseek_v3"), DeepSeek(architecture=V2, model_type="deepseek_v2"))
