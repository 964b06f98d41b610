"""Model configs for the pure tests, described in the flat vocabulary they were written in (Megatron-LM-like field
names: ``swiglu``, ``num_experts``, ``q_lora_rank``, ...) and built as ``ModelConfig``'s core and feature records.

``flat_config`` maps each flat name onto its record field (nothing else: the tests' assertions judge the records'
behaviour); ``with_flat`` changes flat fields of a config the same way."""
from __future__ import annotations

import dataclasses
from typing import Any

from dist_convert.config import ModelConfig
from dist_convert.features import GDN, MLA, MLP, MTP, T5, Attention, Mamba, MoE, Norms, Position

CORE = {f.name for f in dataclasses.fields(ModelConfig)} - {"position", "attention", "norm", "mlp", "embedding",
                                                              "moe", "mla", "mtp", "mamba", "gdn", "t5"}
# flat name -> (record, field)
FIELDS = {
    "swiglu": ("mlp", "gated"), "activation": ("mlp", "activation"), "normalization": ("norm", "kind"),
    "zero_centered_gamma": ("norm", "zero_centered_gamma"), "post_norms": ("norm", "post_norms"),
    "position_embedding_type": ("position", "kind"), "qk_layernorm": ("attention", "qk_norm"),
    "softmax_type": ("attention", "softmax_type"), "attention_output_gate": ("attention", "output_gate"),
    "num_experts": ("moe", "num_experts"), "moe_ffn_hidden_size": ("moe", "ffn"),
    "moe_layer_pattern": ("moe", "layer_pattern"), "moe_shared_expert_intermediate_size": ("moe", "shared_size"),
    "moe_shared_expert_gate": ("moe", "shared_gate"), "moe_router_expert_bias": ("moe", "expert_bias"),
    "moe_grouped": ("moe", "grouped"), "q_lora_rank": ("mla", "q_lora_rank"), "kv_lora_rank": ("mla", "kv_lora_rank"),
    "qk_head_dim": ("mla", "qk_head_dim"), "qk_pos_emb_head_dim": ("mla", "qk_pos_emb_head_dim"),
    "v_head_dim": ("mla", "v_head_dim"), "mla_down_split": ("mla", "down_split"),
    "mtp_num_layers": ("mtp", "num_layers"),
    "hybrid_pattern": ("mamba", "pattern"), "mamba_num_heads": ("mamba", "num_heads"),
    "mamba_head_dim": ("mamba", "head_dim"), "mamba_num_groups": ("mamba", "num_groups"),
    "mamba_state_dim": ("mamba", "state_dim"), "linear_attention_pattern": ("gdn", "pattern"),
    "linear_num_key_heads": ("gdn", "num_key_heads"), "linear_num_value_heads": ("gdn", "num_value_heads"),
    "linear_key_head_dim": ("gdn", "key_head_dim"), "linear_value_head_dim": ("gdn", "value_head_dim"),
    "linear_conv_kernel_dim": ("gdn", "conv_kernel_dim"), "encoder_num_layers": ("t5", "encoder_num_layers"),
    "relative_attention_num_buckets": ("t5", "relative_attention_num_buckets"),
}
RECORDS = {"position": Position, "attention": Attention, "norm": Norms, "mlp": MLP, "moe": MoE, "mla": MLA,
           "mtp": MTP, "mamba": Mamba, "gdn": GDN, "t5": T5}
# an optional record exists when its own field says so
PRESENT = {"moe": lambda v: bool(v.get("num_experts")), "mla": lambda v: bool(v.pop("multi_latent_attention", False)),
           "mtp": lambda v: bool(v.get("num_layers")), "mamba": lambda v: v.get("pattern") is not None,
           "gdn": lambda v: v.get("pattern") is not None, "t5": lambda v: bool(v)}


def _split(flat: dict[str, Any]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    core: dict[str, Any] = {}
    records: dict[str, dict[str, Any]] = {}
    for k, v in flat.items():
        if k == "multi_latent_attention":
            records.setdefault("mla", {})[k] = v
        elif k in FIELDS:
            record, field = FIELDS[k]
            records.setdefault(record, {})[field] = v
        else:
            core[k] = v
    mlp = records.setdefault("mlp", {})
    mlp.setdefault("activation", "silu" if mlp.get("gated", True) else "gelu")
    return core, records


def flat_config(**flat: Any) -> ModelConfig:
    """A ModelConfig from flat field names (the records a flat name belongs to, built with it)."""
    core, records = _split(flat)
    kw: dict[str, Any] = dict(core)
    for name, values in records.items():
        values = dict(values)
        if name in PRESENT:
            present = PRESENT[name](values) or (name == "t5" and core.get("family") == "t5")
            values.pop("multi_latent_attention", None)
            if not present:
                continue
        kw[name] = RECORDS[name](**values)
    if kw.get("mla") is not None and "mla_down_split" not in flat:
        kw["mla"] = dataclasses.replace(kw["mla"], down_split=core.get("spec") == "local")
    return ModelConfig(**kw)


def with_flat(cfg: ModelConfig, **flat: Any) -> ModelConfig:
    """``cfg`` with flat fields changed (an optional record made or dropped as its own field says)."""
    core, records = _split(flat)
    if "swiglu" in flat and "activation" not in flat:
        records["mlp"]["activation"] = cfg.mlp.activation if flat["swiglu"] == cfg.mlp.gated else \
            ("silu" if flat["swiglu"] else "gelu")
    elif "activation" not in flat:
        records["mlp"].pop("activation")
    kw: dict[str, Any] = dict(core)
    for name, values in records.items():
        values = dict(values)
        current = getattr(cfg, name)
        present = PRESENT[name](dict(values)) if name in PRESENT and name != "t5" else None
        values.pop("multi_latent_attention", None)
        if name in PRESENT and name != "t5" and not present and (
                "num_experts" in values or "num_layers" in values or "pattern" in values
                or "multi_latent_attention" in flat):
            kw[name] = None
            continue
        if not values:
            continue
        kw[name] = dataclasses.replace(current, **values) if current is not None else RECORDS[name](**values)
    if "family" in core and core["family"] != "t5":
        kw["t5"] = None
    return dataclasses.replace(cfg, **kw)
