"""DeepSeek-V3-shaped families of GLM's and DeepSeek's later releases: GLM-4.7-Flash (``Glm4MoeLiteForCausalLM``: MLA
and DeepSeek's MoE), and the DeepSeek Sparse Attention models GLM-5 (``GlmMoeDsaForCausalLM``) and DeepSeek-V3.2
(``DeepseekV32ForCausalLM``), whose attention adds a lightning indexer (``self_attn.indexer.{wq_b, wk, k_norm,
weights_proj}``, megatron-core's ``self_attention.core_attention.indexer.{linear_wq_b, linear_wk, k_norm,
linear_weights_proj}``) choosing the top-k keys of each query.

What transformers 5.14 computes and what megatron-core 0.19 is told (``DSA`` record):
- the indexer's RoPE: GLM-5 interleaved (transformers 5.14, as Megatron-Bridge's GLM-5 bridge; 5.12 rotated half),
  V3.2 rotate-half, whatever ``indexer_rope_interleave`` says; ReLU'd scores; the key LayerNorm with eps 1e-6;
- top-k sharing (GLM-5's ``indexer_types`` / ``index_topk_pattern`` / ``index_topk_freq`` with
  ``index_skip_topk_offset``, whose transformers default 2 is also megatron-core's meaning; Megatron-Bridge reads
  an absent offset as 0): megatron-core shares from every ``topk_freq``-th layer on, so other patterns are refused;
  V3.2's indexer runs in every layer;
- the Hadamard rotation of the indexer's q and k (an orthonormal map: the same scores, another rounding) is off for
  GLM-5 (Megatron-Bridge's choice) and on for V3.2 (DeepSeek's reference and megatron-core's default);
- GLM's configs give rms_norm_eps 1e-5. megatron-core has one epsilon for every norm, as GLM's Megatron training,
  Megatron-Bridge, vLLM and SGLang use it; transformers builds the q/kv latent norms with 1e-6 whatever the config
  says. The GLM families take rms_norm_eps for all of them and say so in a note; V3.2 is held to 1e-6 as V3 is.

The MLA, MoE and MTP names, the routing and the MTP copies are DeepSeek-V3's (``models/deepseek.py``).
"""
from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..config import ModelConfig
from ..errors import ConvertError
from ..features import DSA
from ..layout.dsa import INDEXER
from .base import ANY, COMMON_HF_KEYS, DTYPE_NAMES, Allowed, Family, Imported, get
from .deepseek import (
    A_NORM_EPS,
    MLA_NAMES,
    MOE_HF_KEYS,
    V3,
    config_from_hf,
    drop_absent_mtp,
    hf_from_config,
    mla_expresses,
    moe_expresses,
    mtp_copies,
    mtp_optional_sets,
    stack_names,
)
from .rows import Plain, Row

GLM47_FLASH, GLM5, V32 = "Glm4MoeLiteForCausalLM", "GlmMoeDsaForCausalLM", "DeepseekV32ForCausalLM"
K_NORM_EPS = 1e-6  # transformers' DSA indexer: nn.LayerNorm(index_head_dim, eps=1e-6), whatever config.json says
INDEXER_NAMES: tuple[Row, ...] = tuple(Plain(hf=hf, logical=lg).under(INDEXER, "self_attn.indexer.") for hf, lg in (
    ("wq_b.weight", "linear_wq_b.weight"), ("wk.weight", "linear_wk.weight"), ("k_norm.weight", "k_norm.weight"),
    ("k_norm.bias", "k_norm.bias"), ("weights_proj.weight", "linear_weights_proj.weight")))
DSA_HF_KEYS = frozenset({"layer_types", "index_n_heads", "index_head_dim", "index_topk", "index_topk_freq",
                         "index_skip_topk_offset", "index_topk_pattern", "indexer_types", "indexer_rope_interleave"})
SHARE_OFFSET_DEFAULT = 2  # transformers' GlmMoeDsaConfig index_skip_topk_offset


@dataclass(frozen=True, kw_only=True)
class MlaMoe(Family):
    """One of the three architectures (module docstring); the fields say where they differ."""

    architecture: str
    model_type: str
    glm: bool  # GLM's: rms_norm_eps for every norm (module docstring)
    dense_default: int  # the config class's leading dense layers when config.json names none
    eps_default: float  # the config class's rms_norm_eps
    indexer_heads: int | None = None  # a DSA family: the config class's index_n_heads
    interleaved: bool = False  # the indexer's RoPE
    rotate: bool = False  # the indexer's Hadamard rotation (NUMERICS)

    @property
    def sparse(self) -> bool:
        return self.indexer_heads is not None

    # -- config.json <-> model ---------------------------------------------------------------------------
    def from_hf(self, hf: dict[str, Any], vocab_divisible_by: int | None) -> Imported:
        hf = {"rms_norm_eps": self.eps_default, **{k: v for k, v in hf.items() if v is not None}}
        if hf.get("q_lora_rank") is None:
            raise ConvertError(f"q_lora_rank null: transformers' {self.architecture} always projects the query "
                               "through its q latent", "use the config.json saved with the model")
        layers = int(get(hf, "num_hidden_layers", 0))
        pattern = self._mlp_pattern(hf, layers)
        # DeepSeek-V3's reading, with the leading dense layers and the norm epsilon this family has; the DSA classes
        # always interleave the MLA RoPE (their configs have no rope_interleave), GLM-4.7-Flash's follows the key
        fixed = {"first_k_dense_replace": 0, "moe_layer_freq": 1, **({"rope_interleave": True} if self.sparse else {})}
        cfg = config_from_hf({**hf, **fixed}, self.architecture, vocab_divisible_by, v3=True, one_eps=not self.glm)
        moe = replace(cfg.moe, layer_pattern=None if all(pattern) else pattern) \
            if cfg.moe is not None and any(pattern) else None
        cfg = cfg.replace(moe=moe, dsa=self._dsa_from_hf(hf, layers) if self.sparse else None)
        notes = []
        if cfg.norm.eps != A_NORM_EPS:
            notes.append(f"rms_norm_eps={cfg.norm.eps} is taken for every norm, as megatron-core, Megatron-Bridge, "
                         f"vLLM and SGLang do; transformers' {self.architecture} builds q_a_layernorm / "
                         f"kv_a_layernorm with eps {A_NORM_EPS}")
        return Imported(cfg=cfg, notes=notes)

    def _mlp_pattern(self, hf: dict[str, Any], layers: int) -> tuple[int, ...]:
        """1 per MoE layer: ``mlp_layer_types`` where config.json gives it, else the leading dense layers."""
        types = hf.get("mlp_layer_types")
        if types is None:
            dense = int(get(hf, "first_k_dense_replace", self.dense_default)) \
                if self.architecture != GLM47_FLASH else self.dense_default  # Glm4MoeLiteConfig reads no such key
            return tuple(int(i >= dense) for i in range(layers))
        if len(types) != layers or set(types) - {"dense", "sparse"}:
            raise ConvertError(f"mlp_layer_types {types!r} is not one 'dense' or 'sparse' per layer ({layers})",
                               "use the config.json saved with the model")
        return tuple(int(t == "sparse") for t in types)

    def _dsa_from_hf(self, hf: dict[str, Any], layers: int) -> DSA:
        heads, dim = int(get(hf, "index_n_heads", self.indexer_heads)), int(get(hf, "index_head_dim", 128))
        rope = int(hf["qk_rope_head_dim"])
        if dim <= rope or rope % 2:
            raise ConvertError(f"index_head_dim={dim} with qk_rope_head_dim={rope}: the indexer rotates the first "
                               "qk_rope_head_dim (an even number) of its features and keeps the rest",
                               "use the config.json saved with the model")
        kinds = set(hf.get("layer_types") or ["deepseek_sparse_attention"])
        if kinds != {"deepseek_sparse_attention"}:
            raise ConvertError(f"layer_types {sorted(kinds)}: transformers' {self.architecture} builds every layer as "
                               "deepseek_sparse_attention", "use the config.json saved with the model")
        stated = hf.get("indexer_rope_interleave")
        if stated is not None and bool(stated) != self.interleaved:
            raise ConvertError(f"indexer_rope_interleave={str(stated).lower()}, but transformers' {self.architecture} "
                               f"always applies {'interleaved' if self.interleaved else 'rotate-half'} RoPE in its "
                               "indexer (Megatron-Bridge would follow the key)",
                               f"convert a config with indexer_rope_interleave {str(self.interleaved).lower()} or "
                               "without the key")
        freq, offset = self._sharing(hf, layers)
        return DSA(n_heads=heads, head_dim=dim, topk=int(get(hf, "index_topk", 2048)), topk_freq=freq,
                   skip_topk_offset=offset, rope_interleaved=self.interleaved, scoring_relu=True,
                   k_norm_eps=K_NORM_EPS, rotate_activation=self.rotate)

    def _sharing(self, hf: dict[str, Any], layers: int) -> tuple[int, int]:
        """(topk_freq, skip_topk_offset) of megatron-core for the layers that run their indexer: transformers'
        ``indexer_types`` (else ``index_topk_pattern``, else every ``index_topk_freq``-th layer from the offset)."""
        types = hf.get("indexer_types")
        pattern = hf.get("index_topk_pattern")
        if types is None and pattern is not None:
            types = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern]
        freq = max(int(get(hf, "index_topk_freq", 1)), 1)
        offset = int(get(hf, "index_skip_topk_offset", SHARE_OFFSET_DEFAULT))
        if types is None:
            types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)]
        full = tuple(t == "full" for t in types)
        if len(full) != layers or set(types) - {"full", "shared"}:
            raise ConvertError(f"indexer_types {types!r} is not one 'full' or 'shared' per layer ({layers})",
                               "use the config.json saved with the model")
        if all(full):
            return 1, 0
        shown = "".join("FS"[not f] for f in full)
        if self.architecture != GLM5:
            raise ConvertError(f"config.json shares the indexer's top-k between layers ({shown}), but transformers' "
                               f"{self.architecture} runs an indexer in every layer",
                               "convert a config without index_topk_freq / indexer_types")
        for f, o in [(freq, max(offset, 1))] + [(f, o) for f in range(2, layers + 1) for o in range(1, layers + 1)]:
            if f > 1 and all(DSA(topk_freq=f, skip_topk_offset=o).computes_topk(i) == full[i] for i in range(layers)):
                return f, o
        raise ConvertError(f"indexer top-k sharing {shown} (F: the layer runs its indexer): megatron-core shares the "
                           "top-k of every N-th layer from an offset, not this",
                           "convert a config whose shared layers follow index_topk_freq / index_skip_topk_offset")

    @property
    def hf_keys(self) -> frozenset[str]:
        return COMMON_HF_KEYS | MOE_HF_KEYS | (DSA_HF_KEYS if self.sparse else frozenset()) | {
            "attention_bias", "mlp_bias", "hidden_act", "rope_interleave", "rope.rope_type"}

    def to_hf(self, cfg: ModelConfig, base: dict[str, Any] | None, dtype: torch.dtype) -> dict[str, Any]:
        hf = hf_from_config(cfg, self.architecture, base, DTYPE_NAMES.get(dtype, "float32"),
                            model_type=self.model_type, v3=True)
        pattern = cfg.moe.layer_pattern or (1,) * cfg.num_layers if cfg.moe is not None else (0,) * cfg.num_layers
        hf["mlp_layer_types"] = ["sparse" if m else "dense" for m in pattern]
        hf["first_k_dense_replace"] = pattern.index(1) if 1 in pattern else cfg.num_layers
        if cfg.moe is None:  # transformers' config classes want the MoE sizes even with every layer dense
            hf.update(n_routed_experts=1, num_experts_per_tok=1)
        if self.architecture != GLM47_FLASH:
            hf.pop("rope_interleave", None)  # the DSA config classes have no such key (always interleaved)
        dsa = cfg.dsa
        if dsa is not None:
            hf.update(index_n_heads=dsa.n_heads, index_head_dim=dsa.head_dim, index_topk=dsa.topk)
            hf.pop("index_topk_pattern", None)
            if self.architecture == GLM5:  # Megatron-Bridge reads indexer_rope_interleave without a default
                hf["indexer_rope_interleave"] = dsa.rope_interleaved
                if "indexer_types" in hf or dsa.topk_freq > 1:
                    hf["indexer_types"] = ["full" if cfg.has_indexer("decoder", i) else "shared"
                                           for i in range(cfg.num_layers)]
                if dsa.topk_freq > 1:  # said explicitly: Megatron-Bridge reads an absent offset as 0, transformers 2
                    hf.update(index_topk_freq=dsa.topk_freq, index_skip_topk_offset=dsa.skip_topk_offset)
                elif "index_topk_freq" in hf:
                    hf["index_topk_freq"] = 1
        return hf

    def expresses(self) -> Mapping[str, Allowed]:
        out: dict[str, Allowed] = {**mla_expresses(), "moe": {True, False}, "mtp": {True, False},
                                   **moe_expresses(True), "moe.layer_pattern": ANY}
        if self.glm:
            out["norm.eps"] = ANY
        if self.sparse:
            share = self.architecture == GLM5
            out.update({"dsa": {True}, "dsa.topk": ANY, "dsa.rope_interleaved": {self.interleaved},
                        "dsa.scoring_relu": {True}, "dsa.k_norm_eps": {K_NORM_EPS},
                        "dsa.topk_freq": ANY if share else {1}, "dsa.skip_topk_offset": ANY if share else {0}})
        return out

    # -- names --------------------------------------------------------------------------------------------
    def layer_names(self, cfg: ModelConfig, stack: str, layer: int) -> list[Row]:
        indexer = INDEXER_NAMES if cfg.has_indexer(stack, layer) else ()
        return stack_names(cfg, stack, layer, MLA_NAMES + indexer)

    def as_stored(self, cfg: ModelConfig, found: Collection[str], notes: list[str]) -> ModelConfig:
        return drop_absent_mtp(cfg, found, notes)

    def stored_copies(self, cfg: ModelConfig, found: Collection[str]) -> dict[str, list[str]]:
        return mtp_copies(cfg, found)

    def optional_sets(self, cfg: ModelConfig) -> dict[str, tuple[list[str], bool]]:
        # GLM-5's MTP layer without copies of the embedding and the head, as Megatron-Bridge's GLM-5 bridge writes it
        return {**super().optional_sets(cfg), **mtp_optional_sets(cfg, written=not self.glm)}


FAMILIES = (  # in the order of preference (models/__init__.py)
    MlaMoe(architecture=GLM47_FLASH, model_type="glm4_moe_lite", glm=True, dense_default=1, eps_default=1e-5),
    MlaMoe(architecture=V32, model_type="deepseek_v32", glm=False, dense_default=3, eps_default=1e-6,
           indexer_heads=64, rotate=True),
    MlaMoe(architecture=GLM5, model_type="glm_moe_dsa", glm=True, dense_default=3, eps_default=1e-5,
           indexer_heads=32, interleaved=True),
)
assert V3 not in {f.architecture for f in FAMILIES}
