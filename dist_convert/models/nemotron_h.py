"""Nemotron-H / Nemotron-3 (``NemotronHForCausalLM``): a hybrid stack where each layer is one of a Mamba2 mixer
(``M``), attention (``*``, GQA, no RoPE), a squared-ReLU MLP (``-``) or a Mixture-of-Experts MLP (``E``: a sigmoid
router with a correction bias, squared-ReLU experts and one shared expert), each with its own RMSNorm pre-norm.

The Megatron side is megatron-core's ``MambaModel`` (``hybrid_override_pattern``, the Mamba2 sizes,
``squared_relu``, ``position_embedding_type`` none, Transformer Engine's fused pre-norms): ``mixer.in_proj`` =
[z | x | B | C | dt] and ``mixer.conv1d`` over [x | B | C] are the same rows in HF and megatron-core (no
permutation); under TP each of those sections splits on its own (``layout.rules.MAMBA_RULES``, ``Kind.PARTS``) and
torch_dist keys each section on its own. The final norm is ``decoder.final_norm``.

transformers' ``save_pretrained`` writes the hub names: ``backbone.embedding`` (``backbone.embeddings`` is read too),
``backbone.layers.N.norm`` / ``.mixer.*``, ``backbone.norm_f``, ``lm_head``, routed experts one tensor per expert
(``mixer.experts.{e}.up_proj`` / ``down_proj``).
"""
from __future__ import annotations

import argparse
import math
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..config import HYBRID_SYMBOLS, ModelConfig, hybrid_pattern_of
from ..errors import ConvertError
from ..layout.rules import EMBEDDING, OUTPUT
from .base import (
    DTYPE_NAMES,
    EXPERT_FC1,
    EXPERT_FC2,
    Dims,
    Family,
    HFTensors,
    Imported,
    Name,
    base_config,
    common_args,
    divisible,
    get,
    hf_dtype,
    in_layer,
    layer_prefix,
    require_int,
)
from .deepseek import router_args

ARCHITECTURE = "NemotronHForCausalLM"
# transformers' layer types (and the older names it still reads) <-> megatron-core's pattern symbols
TYPES = {"linear_attention": "M", "mamba": "M", "full_attention": "*", "attention": "*", "mlp": "-", "moe": "E"}
SYMBOL_TYPES = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
# what transformers' save_pretrained writes, then the spelling Megatron-Bridge and some releases use
EMBEDDING_NAMES = ("backbone.embedding.weight", "backbone.embeddings.weight")
GATED_NORM_EPS = 1e-5  # megatron-core's MambaMixer builds its gated norm with this epsilon, whatever the config says
NORM: Name = ("norm.weight", "input_layernorm.weight", None)
MLP_NORM: Name = ("norm.weight", "pre_mlp_layernorm.weight", None)
NAMES: dict[str, tuple[Name, ...]] = {
    "M": (NORM, *((f"mixer.{n}", f"mixer.{n}", None) for n in (
        "in_proj.weight", "conv1d.weight", "conv1d.bias", "A_log", "D", "dt_bias", "norm.weight", "out_proj.weight"))),
    "*": (NORM, ("mixer.q_proj.weight", "self_attention.linear_qkv.weight", "q"),
          ("mixer.k_proj.weight", "self_attention.linear_qkv.weight", "k"),
          ("mixer.v_proj.weight", "self_attention.linear_qkv.weight", "v"),
          ("mixer.o_proj.weight", "self_attention.linear_proj.weight", None)),
    "-": (MLP_NORM, ("mixer.up_proj.weight", "mlp.linear_fc1.weight", None),
          ("mixer.down_proj.weight", "mlp.linear_fc2.weight", None)),
    "E": (MLP_NORM, ("mixer.gate.weight", "mlp.router.weight", None),
          ("mixer.gate.e_score_correction_bias", "mlp.router.expert_bias", None),
          ("mixer.shared_experts.up_proj.weight", "mlp.shared_experts.linear_fc1.weight", None),
          ("mixer.shared_experts.down_proj.weight", "mlp.shared_experts.linear_fc2.weight", None)),
}


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


def nemotron_problems(cfg: ModelConfig, args: argparse.Namespace) -> list[str]:
    """What of a model ``NemotronHForCausalLM`` cannot express (its router's maths included, where the args say it)."""
    problems = []
    if cfg.hybrid_pattern is None:
        problems.append("no Mamba2 hybrid stack (Nemotron-H is megatron-core's MambaModel)")
        return problems
    if cfg.swiglu or cfg.activation != "squared_relu":
        problems.append(f"a {cfg.activation}{'-gated' if cfg.swiglu else ''} MLP (Nemotron-H's is squared ReLU)")
    if cfg.normalization != "RMSNorm" or cfg.zero_centered_gamma or cfg.post_norms or cfg.qk_layernorm:
        problems.append("norms other than Nemotron-H's plain RMSNorm pre-norms")
    if cfg.add_bias_linear or cfg.add_qkv_bias:
        problems.append("linear-layer biases")
    if cfg.position_embedding_type != "none":
        problems.append(f"{cfg.position_embedding_type} position embeddings (Nemotron-H has none)")
    if cfg.mtp_num_layers or cfg.softmax_type != "vanilla" or cfg.mla:
        problems.append("multi-token prediction, attention sinks or multi-latent attention")
    if "E" in cfg.hybrid_pattern and not (cfg.moe_router_expert_bias and cfg.moe_shared_expert_intermediate_size):
        problems.append("MoE layers without a router correction bias or a shared expert")
    a = vars(args)
    if "E" in cfg.hybrid_pattern and (a.get("moe_router_score_function") not in (None, "sigmoid")
                                      or a.get("moe_router_pre_softmax")):
        problems.append("a router scoring other than Nemotron-H's (sigmoid scores, top-k renormalised)")
    return problems


@dataclass(frozen=True, kw_only=True)
class NemotronH(Family):
    architecture: str = ARCHITECTURE
    model_type: str = "nemotron_h"
    scope: ClassVar[str] = "no supported Hugging Face family (NemotronHForCausalLM included)"
    hf_layers: ClassVar[str] = "backbone.layers."

    def from_hf(self, hf: dict[str, Any], vocab_divisible_by: int | None) -> Imported:
        problems = fixed_problems(hf)
        if problems:
            raise ConvertError(f"the Nemotron-H config has {', '.join(problems)}, which megatron-core's MambaModel "
                               "does not build", "convert a config megatron-core expresses (as the Nemotron-H "
                               "releases are)")
        pattern = pattern_of(hf)
        heads, hidden = require_int(hf, "num_attention_heads"), require_int(hf, "hidden_size")
        groups = require_int(hf, "num_key_value_heads", default=heads)
        head_dim = require_int(hf, "head_dim", default=hidden // heads)
        ffn, vocab = require_int(hf, "intermediate_size"), require_int(hf, "vocab_size")
        mamba = {"mamba_num_heads": require_int(hf, "mamba_num_heads"),
                 "mamba_head_dim": require_int(hf, "mamba_head_dim"),
                 "mamba_num_groups": require_int(hf, "n_groups", "mamba_n_groups"),
                 "mamba_state_dim": require_int(hf, "ssm_state_size")}
        moe_cfg: dict[str, Any] = {}
        moe_args: dict[str, Any] = {}
        if "E" in pattern:
            experts = require_int(hf, "n_routed_experts", "num_local_experts")
            expert_ffn = require_int(hf, "moe_intermediate_size")
            shared = require_int(hf, "moe_shared_expert_intermediate_size")
            moe_cfg = {"num_experts": experts, "moe_ffn_hidden_size": expert_ffn,
                       "moe_shared_expert_intermediate_size": shared, "moe_router_expert_bias": True}
            moe_args = {"num_experts": experts, "moe_ffn_hidden_size": expert_ffn,
                        "moe_shared_expert_intermediate_size": shared, "moe_shared_expert_gate": False,
                        "moe_grouped_gemm": False, "expert_model_parallel_size": 1, "expert_tensor_parallel_size": 1,
                        **router_args(hf, True, experts, require_int(hf, "num_experts_per_tok", default=2),
                                      "Nemotron-H")}
        cfg = ModelConfig(
            num_layers=len(pattern), hidden_size=hidden, ffn_hidden_size=ffn, num_attention_heads=heads,
            num_query_groups=groups, kv_channels=head_dim, swiglu=False, activation="squared_relu",
            normalization="RMSNorm", add_bias_linear=False, add_qkv_bias=False,
            untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False), vocab_size=vocab,
            make_vocab_size_divisible_by=divisible(vocab_divisible_by), position_embedding_type="none",
            max_position_embeddings=int(get(hf, "max_position_embeddings", 4096)), qk_layernorm=False, spec="te",
            hybrid_pattern=pattern, **mamba, **moe_cfg)
        dims = Dims(heads=heads, hidden=hidden, layers=len(pattern), ffn=ffn, vocab=vocab, groups=groups,
                    head_dim=head_dim)
        args = common_args(dims, cfg, hf_dtype(hf), 10000.0, hf, is_hybrid_model=True, hybrid_override_pattern=pattern,
                           squared_relu=True, **mamba, **moe_args)
        args.position_embedding_type, args.use_rotary_position_embeddings = "none", False
        args.norm_epsilon = float(get(hf, "layer_norm_epsilon", 1e-5))
        args.mamba_chunk_size = int(get(hf, "chunk_size", get(hf, "mamba_chunk_size", 128)))
        return Imported(cfg=cfg, args=args, notes=[])

    def to_hf(self, cfg: ModelConfig, args: argparse.Namespace, base: dict[str, Any] | None,
              dtype: torch.dtype) -> dict[str, Any]:
        hf, same = base_config(self, base)
        a = vars(args)
        name = DTYPE_NAMES.get(dtype, "float32")
        assert cfg.hybrid_pattern is not None
        hf.update({
            "architectures": [self.architecture], "model_type": self.model_type, "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.ffn_hidden_size, "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_query_groups, "head_dim": cfg.kv_channels, "vocab_size": cfg.vocab_size,
            "tie_word_embeddings": cfg.tied, "mamba_num_heads": cfg.mamba_num_heads,
            "mamba_head_dim": cfg.mamba_head_dim, "n_groups": cfg.mamba_num_groups,
            "ssm_state_size": cfg.mamba_state_dim, "dtype": name})
        if "hybrid_override_pattern" in hf and "layers_block_type" not in hf:  # the older form, as the source had it
            hf["hybrid_override_pattern"] = cfg.hybrid_pattern
        elif not (same and "layers_block_type" in hf and pattern_of(hf) == cfg.hybrid_pattern):  # else kept as spelt
            hf["layers_block_type"] = [SYMBOL_TYPES[s] for s in cfg.hybrid_pattern]
        if cfg.num_experts:
            hf.update({"n_routed_experts": cfg.num_experts, "moe_intermediate_size": cfg.expert_ffn,
                       "moe_shared_expert_intermediate_size": cfg.moe_shared_expert_intermediate_size,
                       "num_experts_per_tok": int(get(a, "moe_router_topk", 2))})
        if same:
            return hf
        hf.update({"max_position_embeddings": int(cfg.max_position_embeddings or 4096),
                   "layer_norm_epsilon": float(get(a, "norm_epsilon", 1e-5)), "mlp_hidden_act": "relu2",
                   "mamba_hidden_act": "silu", "conv_kernel": 4, "use_conv_bias": True, "mamba_proj_bias": False,
                   "use_bias": False, "mlp_bias": False, "attention_bias": False,
                   "chunk_size": int(get(a, "mamba_chunk_size", 128))})
        if cfg.num_experts:
            hf.update({"routed_scaling_factor": float(get(a, "moe_router_topk_scaling_factor", 1.0)),
                       "n_group": int(get(a, "moe_router_num_groups", 1)),
                       "topk_group": int(get(a, "moe_router_group_topk", 1)), "norm_topk_prob": True,
                       "n_shared_experts": 1})
        return hf

    def affinity(self, cfg: ModelConfig) -> int:
        return 10 if cfg.hybrid_pattern is not None else 0

    def why_not(self, cfg: ModelConfig, args: argparse.Namespace) -> str | None:
        return ", ".join(nemotron_problems(cfg, args)) or None

    def layer_names(self, cfg: ModelConfig, stack: str, layer: int) -> list[Name]:
        assert cfg.hybrid_pattern is not None
        symbol = cfg.hybrid_pattern[layer]
        names = list(NAMES[symbol])
        if symbol == "E":
            for e in range(cfg.num_experts):
                names += [(f"mixer.experts.{e}.up_proj.weight", EXPERT_FC1.format(e=e), None),
                          (f"mixer.experts.{e}.down_proj.weight", EXPERT_FC2.format(e=e), None)]
        assert symbol in HYBRID_SYMBOLS
        return in_layer(names, layer_prefix(stack, layer))

    def top_names(self, cfg: ModelConfig) -> tuple[tuple[str, str], ...]:
        return ((EMBEDDING_NAMES[0], EMBEDDING), ("backbone.norm_f.weight", "decoder.final_norm.weight"),
                ("lm_head.weight", OUTPUT))

    def alternatives(self, cfg: ModelConfig, found: Collection[str], expected: HFTensors) -> HFTensors:
        """The embedding under the other spelling releases use (``backbone.embeddings.weight``), where stored."""
        spelled = [n for n in EMBEDDING_NAMES[1:] if n in found]
        return {spelled[0]: expected[EMBEDDING_NAMES[0]]} if spelled and EMBEDDING_NAMES[0] in expected else {}


FAMILIES = (NemotronH(),)
