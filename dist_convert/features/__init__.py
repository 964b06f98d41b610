"""Typed model semantics: one frozen record per megatron-core capability, each owning its Megatron-LM ``args``
reading and writing (``features.base``), and the audit of every megatron-core setting (``features.audit``)."""
from .attention import Attention, Embedding, Norms
from .base import LAYOUT, NUMERICS, SETTING, SIZE, Feature
from .blocks import (
    DSA,
    GDN,
    HYBRID_SYMBOLS,
    MLA,
    MTP,
    T5,
    Mamba,
    hybrid_pattern_of,
    linear_attention_freq,
    linear_attention_pattern,
)
from .mlp import MLP, MoE, moe_layer_pattern
from .position import Linear, Llama3, MLASoftmax, Position, Scaling, Yarn

__all__ = ["DSA", "GDN", "HYBRID_SYMBOLS", "LAYOUT", "MLA", "MLP", "MTP", "NUMERICS", "SETTING", "SIZE", "T5",
           "Attention", "Embedding", "Feature", "Linear", "Llama3", "MLASoftmax", "Mamba", "MoE", "Norms", "Position",
           "Scaling", "Yarn", "hybrid_pattern_of", "linear_attention_freq", "linear_attention_pattern",
           "moe_layer_pattern"]
