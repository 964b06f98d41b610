"""Nemotron-H / Nemotron-3 (``NemotronHForCausalLM``): a hybrid stack where each layer is one of a Mamba2 mixer
(``M``), attention (``*``, GQA, no RoPE), a squared-ReLU MLP (``-``) or a Mixture-of-Experts MLP (``E``: a sigmoid
router with a correction bias, squared-ReLU experts and one shared expert), each with its own RMSNorm pre-norm.

The Megatron side is megatron-core's ``MambaModel`` (``hybrid_override_pattern``, the Mamba2 sizes,
``squared_relu``, ``position_embedding_type`` none, Transformer Engine's fused pre-norms): ``mixer.in_proj`` =
[z | x | B | C | dt] and ``mixer.conv1d`` over [x | B | C] are the same rows in HF and megatron-core (no
permutation); under TP each of those sections splits on its own (``layout.hybrid.MAMBA_RULES``, ``Kind.PARTS``) and
torch_dist keys each section on its own. The final norm is ``decoder.final_norm``.

transformers' ``save_pretrained`` writes the hub names: ``backbone.embedding`` (``backbone.embeddings`` is read too),
``backbone.layers.N.norm`` / ``.mixer.*``, ``backbone.norm_f``, ``lm_head``, routed experts one tensor per expert
(``mixer.experts.{e}.up_proj`` / ``down_proj``).
"""
from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..config import HYBRID_SYMBOLS, ModelConfig, hybrid_pattern_of
from ..errors import ConvertError
from ..features import MLP, Mamba, Norms, Position
from ..layout.rules import EMBEDDING, OUTPUT
from .base import (
    ANY,
    COMMON,
    COMMON_HF_KEYS,
    DTYPE_NAMES,
    EXPERT_FC1,
    EXPERT_FC2,
    Allowed,
    Family,
    HFTensors,
    Imported,
    base_config,
    divisible,
    get,
    in_layer,
    layer_prefix,
    require_int,
)
from .deepseek import MoE, router_from_hf, two_per_group
from .rows import QKV, Plain, Row, each

ARCHITECTURE = "NemotronHForCausalLM"
# transformers' layer types (and the older names it still reads) <-> megatron-core's pattern symbols
TYPES = {"linear_attention": "M", "mamba": "M", "full_attention": "*", "attention": "*", "mlp": "-", "moe": "E"}
SYMBOL_TYPES = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
# what transformers' save_pretrained writes, then the spelling Megatron-Bridge and some releases use
EMBEDDING_NAMES = ("backbone.embedding.weight", "backbone.embeddings.weight")
GATED_NORM_EPS = 1e-5  # megatron-core's MambaMixer builds its gated norm with this epsilon, whatever the config says
NORM = Plain(hf="norm.weight", logical="input_layernorm.weight")
MLP_NORM = Plain(hf="norm.weight", logical="pre_mlp_layernorm.weight")
# pattern symbol -> the rows of its layer (every MLP ungated: fc1 stored whole)
NAMES: dict[str, tuple[Row, ...]] = {
    "M": (NORM, *(Plain(hf=f"mixer.{n}", logical=f"mixer.{n}") for n in (
        "in_proj.weight", "conv1d.weight", "conv1d.bias", "A_log", "D", "dt_bias", "norm.weight", "out_proj.weight"))),
    "*": (NORM, QKV(logical="self_attention.linear_qkv.weight", q="mixer.q_proj.weight", k="mixer.k_proj.weight",
                    v="mixer.v_proj.weight"),
          Plain(hf="mixer.o_proj.weight", logical="self_attention.linear_proj.weight")),
    "-": (MLP_NORM, Plain(hf="mixer.up_proj.weight", logical="mlp.linear_fc1.weight"),
          Plain(hf="mixer.down_proj.weight", logical="mlp.linear_fc2.weight")),
    "E": (MLP_NORM, Plain(hf="mixer.gate.weight", logical="mlp.router.weight"),
          Plain(hf="mixer.gate.e_score_correction_bias", logical="mlp.router.expert_bias"),
          Plain(hf="mixer.shared_experts.up_proj.weight", logical="mlp.shared_experts.linear_fc1.weight"),
          Plain(hf="mixer.shared_experts.down_proj.weight", logical="mlp.shared_experts.linear_fc2.weight")),
}
EXPERT = (Plain(hf="mixer.experts.{e}.up_proj.weight", logical=EXPERT_FC1),
          Plain(hf="mixer.experts.{e}.down_proj.weight", logical=EXPERT_FC2))


def pattern_of(hf: dict[str, Any]) -> str:
    """megatron-core's pattern for ``layers_block_type`` (transformers 5; ``layer_types`` is its alias) or the older
    ``hybrid_override_pattern`` string; refused in one line when a type is unknown."""
    types = hf.get("layers_block_type") or hf.get("layer_types")
    if types:
        unknown = sorted(set(types) - set(TYPES))
        if unknown:
            raise ConvertError(f"layers_block_type has {unknown}: Nemotron-H layers are {', '.join(sorted(TYPES))}",
                               "convert a config whose layers_block_type lists only those")
        return "".join(TYPES[t] for t in types)
    pattern = hf.get("hybrid_override_pattern")
    if not pattern:
        raise ConvertError("config.json gives neither layers_block_type nor hybrid_override_pattern",
                           "use the config.json saved with the model")
    return hybrid_pattern_of(str(pattern))


def json_float(x: Any) -> float:
    """A float of config.json, where transformers writes infinity as ``{"__float__": "Infinity"}``."""
    return float(x["__float__"]) if isinstance(x, dict) and "__float__" in x else float(x)


def fixed_problems(hf: dict[str, Any]) -> list[str]:
    """What megatron-core's MambaModel fixes and a Nemotron-H config.json may state otherwise."""
    limit = hf.get("time_step_limit", hf.get("mamba_dt_limit", (0.0, math.inf)))
    checks = (
        (int(get(hf, "conv_kernel", get(hf, "mamba_d_conv", 4))) != 4, "conv_kernel other than 4"),
        (not get(hf, "use_conv_bias", get(hf, "mamba_conv_bias", True)), "a convolution without bias"),
        (bool(get(hf, "mamba_proj_bias", False) or get(hf, "use_bias", False) or get(hf, "mlp_bias", False)
              or get(hf, "attention_bias", False)), "linear-layer biases"),
        (get(hf, "mamba_hidden_act", "silu") != "silu", f"mamba_hidden_act {hf.get('mamba_hidden_act')!r}"),
        (get(hf, "mlp_hidden_act", "relu2") != "relu2", f"mlp_hidden_act {hf.get('mlp_hidden_act')!r}"),
        (tuple(json_float(x) for x in limit) != (0.0, math.inf), f"time_step_limit {list(limit)}"),
        (float(get(hf, "layer_norm_epsilon", 1e-5)) != GATED_NORM_EPS,
         f"layer_norm_epsilon {hf.get('layer_norm_epsilon')} (megatron-core's gated Mamba norm uses 1e-5)"),
        (hf.get("sliding_window") is not None, "sliding-window attention"),
        (hf.get("moe_latent_size") is not None, "latent MoE projections (moe_latent_size)"),
        (int(get(hf, "num_nextn_predict_layers", 0)) > 0, "multi-token-prediction layers"),
    )
    return [what for bad, what in checks if bad]


@dataclass(frozen=True, kw_only=True)
class NemotronH(Family):
    architecture: str = ARCHITECTURE
    model_type: str = "nemotron_h"
    hf_layers: ClassVar[str] = "backbone.layers."

    def from_hf(self, hf: dict[str, Any], vocab_divisible_by: int | None) -> Imported:
        problems = fixed_problems(hf)
        if problems:
            raise ConvertError(f"the Nemotron-H config has {', '.join(problems)}, which megatron-core's MambaModel "
                               "does not build", "convert a config megatron-core expresses (as the Nemotron-H "
                               "releases are)")
        pattern = pattern_of(hf)
        heads, hidden = require_int(hf, "num_attention_heads"), require_int(hf, "hidden_size")
        moe = None
        if "E" in pattern:
            experts = require_int(hf, "n_routed_experts", "num_local_experts")
            moe = MoE(num_experts=experts, ffn=require_int(hf, "moe_intermediate_size"),
                      shared_size=require_int(hf, "moe_shared_expert_intermediate_size"),
                      **router_from_hf(hf, True, experts, require_int(hf, "num_experts_per_tok", default=2),
                                       "Nemotron-H"))
        cfg = ModelConfig(
            num_layers=len(pattern), hidden_size=hidden, ffn_hidden_size=require_int(hf, "intermediate_size"),
            num_attention_heads=heads, num_query_groups=require_int(hf, "num_key_value_heads", default=heads),
            kv_channels=require_int(hf, "head_dim", default=hidden // heads), add_bias_linear=False,
            add_qkv_bias=False, untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
            vocab_size=require_int(hf, "vocab_size"), make_vocab_size_divisible_by=divisible(vocab_divisible_by),
            max_position_embeddings=int(get(hf, "max_position_embeddings", 4096)), spec="te",
            position=Position(kind="none"), mlp=MLP(gated=False, activation="squared_relu"),
            norm=Norms(kind="RMSNorm", eps=float(get(hf, "layer_norm_epsilon", 1e-5))), moe=moe,
            mamba=Mamba(pattern=pattern, num_heads=require_int(hf, "mamba_num_heads"),
                        head_dim=require_int(hf, "mamba_head_dim"),
                        num_groups=require_int(hf, "n_groups", "mamba_n_groups"),
                        state_dim=require_int(hf, "ssm_state_size")))
        return Imported(cfg=cfg, notes=[])

    @property
    def hf_keys(self) -> frozenset[str]:
        return COMMON_HF_KEYS | {"layer_norm_epsilon", "attention_bias", "mlp_bias", "sliding_window",
                                 "moe_latent_size", "num_nextn_predict_layers", "norm_topk_prob", "scoring_func",
                                 "topk_method", "n_group", "topk_group", "routed_scaling_factor", "n_shared_experts"}

    def to_hf(self, cfg: ModelConfig, base: dict[str, Any] | None, dtype: torch.dtype) -> dict[str, Any]:
        hf, same = base_config(self, base)
        name = DTYPE_NAMES.get(dtype, "float32")
        mamba = cfg.mamba
        assert mamba is not None
        hf.update({
            "architectures": [self.architecture], "model_type": self.model_type, "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.ffn_hidden_size, "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_query_groups, "head_dim": cfg.kv_channels, "vocab_size": cfg.vocab_size,
            "tie_word_embeddings": cfg.tied, "mamba_num_heads": mamba.num_heads, "mamba_head_dim": mamba.head_dim,
            "n_groups": mamba.num_groups, "ssm_state_size": mamba.state_dim, "dtype": name,
            "layer_norm_epsilon": cfg.norm.eps})
        if "hybrid_override_pattern" in hf and "layers_block_type" not in hf:  # the older form, as the source had it
            hf["hybrid_override_pattern"] = mamba.pattern
        elif not (same and "layers_block_type" in hf and pattern_of(hf) == mamba.pattern):  # else kept as spelt
            hf["layers_block_type"] = [SYMBOL_TYPES[s] for s in mamba.pattern]
        if cfg.moe is not None:
            moe = cfg.moe
            hf.update({"n_routed_experts": cfg.num_experts, "moe_intermediate_size": cfg.expert_ffn,
                       "moe_shared_expert_intermediate_size": moe.shared_size, "num_experts_per_tok": moe.topk,
                       "routed_scaling_factor": float(moe.topk_scaling_factor or 1.0), "n_group": moe.num_groups or 1,
                       "topk_group": (moe.group_topk or 1) if moe.num_groups else 1, "norm_topk_prob": moe.topk > 1,
                       "n_shared_experts": 1})
        if same:
            return hf
        hf.update({"max_position_embeddings": int(cfg.max_position_embeddings or 4096), "mlp_hidden_act": "relu2",
                   "mamba_hidden_act": "silu", "conv_kernel": 4, "use_conv_bias": True, "mamba_proj_bias": False,
                   "use_bias": False, "mlp_bias": False, "attention_bias": False, "chunk_size": 128})
        return hf

    def expresses(self) -> Mapping[str, Allowed]:
        """megatron-core's MambaModel as Nemotron-H builds it: no position embeddings, a squared-ReLU MLP, the
        gated Mamba norm's epsilon of 1e-5, MoE layers with DeepSeek-V3's sigmoid router and a shared expert."""
        return {**COMMON, "norm.eps": {GATED_NORM_EPS}, "mamba": {True}, "position.kind": {"none"},
                "mlp.gated": {False}, "mlp.activation": {"squared_relu"}, "moe": {True, False},
                "moe.score_function": {"sigmoid"}, "moe.expert_bias": {True},
                "moe.shared_size": lambda v, cfg: v is not None, "moe.topk_scaling_factor": ANY,
                "moe.num_groups": ANY, "moe.group_topk": two_per_group}

    def layer_names(self, cfg: ModelConfig, stack: str, layer: int) -> list[Row]:
        assert cfg.mamba is not None
        symbol = cfg.mamba.pattern[layer]
        rows = list(NAMES[symbol]) + (each(EXPERT, e=range(cfg.num_experts)) if symbol == "E" else [])
        assert symbol in HYBRID_SYMBOLS
        return in_layer(rows, layer_prefix(stack, layer))

    def top_names(self, cfg: ModelConfig) -> tuple[tuple[str, str], ...]:
        return ((EMBEDDING_NAMES[0], EMBEDDING), ("backbone.norm_f.weight", "decoder.final_norm.weight"),
                ("lm_head.weight", OUTPUT))

    def alternatives(self, cfg: ModelConfig, found: Collection[str], expected: HFTensors) -> HFTensors:
        """The embedding under the other spelling releases use (``backbone.embeddings.weight``), where stored."""
        spelled = [n for n in EMBEDDING_NAMES[1:] if n in found]
        return {spelled[0]: expected[EMBEDDING_NAMES[0]]} if spelled and EMBEDDING_NAMES[0] in expected else {}


FAMILIES = (NemotronH(),)
