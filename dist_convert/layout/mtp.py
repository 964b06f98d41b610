"""Multi-token prediction's logical tensors: megatron-core's ``MultiTokenPredictionLayer`` (its embedding and hidden
norms, ``eh_proj`` and final norm), suffixes after ``mtp.layers.<K>.``. The layer's ``TransformerLayer`` follows
under ``transformer_layer.`` (``MTP_LAYER``), with the rules of a decoder layer (``rules.LAYER_RULES``, built like
the last decoder layer)."""
from __future__ import annotations

from .boxes import Kind
from .tensors import Rule, hidden

# eh_proj maps [enorm(embedding); hnorm(hidden)] (2h) to h, column-parallel
MTP_RULES: tuple[Rule, ...] = (
    Rule("enorm.weight", Kind.REP, hidden),
    Rule("hnorm.weight", Kind.REP, hidden),
    Rule("eh_proj.weight", Kind.COL, lambda c: (c.hidden_size, 2 * c.hidden_size)),
    Rule("final_layernorm.weight", Kind.REP, hidden),
)
MTP_LAYER = "transformer_layer."
MTP_TE2_MODULES = ("enorm", "hnorm", "eh_proj", "final_layernorm")  # an MTP layer's own Transformer Engine 2 modules
