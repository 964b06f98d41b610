"""DeepSeek sparse attention's logical tensors (megatron-core's DSA spec: ``AbsorbedMLASelfAttention`` over
``DSAttention``): the lightning indexer of a layer that computes its top-k (``ModelConfig.has_indexer``), replicated
over TP. The MLA tensors are ``attention.MLA_RULES``', with the q/kv norms as modules of their own (``DSA_UNFUSED``:
the indexer reads the normed q latent). Suffixes after ``<stack>.layers.<N>.``."""
from __future__ import annotations

from typing import TYPE_CHECKING

from .boxes import Kind
from .hybrid import mtp_layer_prefix
from .mlp import MLP_EXTRA_STATE, SHARED_EXPERT_MODULES
from .mtp import MTP_TE2_MODULES
from .tensors import Rule, Shape

if TYPE_CHECKING:  # the layout reads a model config's attributes; it never imports the config's module
    from ..config import ModelConfig

_ix: Shape = lambda c: (c.dsa.head_dim,)  # noqa: E731
INDEXER = "self_attention.core_attention.indexer."
DSA_RULES: tuple[Rule, ...] = (
    Rule(INDEXER + "linear_wq_b.weight", Kind.REP,
         lambda c: (c.dsa.n_heads * c.dsa.head_dim, c.mla.q_lora_rank or c.hidden_size), layers="indexed"),
    Rule(INDEXER + "linear_wk.weight", Kind.REP, lambda c: (c.dsa.head_dim, c.hidden_size), layers="indexed"),
    Rule(INDEXER + "k_norm.weight", Kind.REP, _ix, layers="indexed"),
    Rule(INDEXER + "k_norm.bias", Kind.REP, _ix, layers="indexed"),
    Rule(INDEXER + "linear_weights_proj.weight", Kind.REP, lambda c: (c.dsa.n_heads, c.hidden_size), layers="indexed"),
)
DSA_UNFUSED = frozenset({"self_attention.q_layernorm.weight", "self_attention.kv_layernorm.weight"})


def dsa_layer_modules(cfg: ModelConfig, stack: str, layer: int) -> tuple[str, ...]:
    """The ``_extra_state`` modules of a layer of megatron-core's DSA spec (Transformer Engine 2's linears and norms;
    the DSAttention core has none); an MTP layer adds its own norms and eh_proj."""
    mla = cfg.mla
    assert mla is not None
    norm = cfg.attention.qk_norm
    q = ("linear_q_proj",) if mla.q_lora_rank is None else \
        ("linear_q_down_proj", *(("q_layernorm",) if norm else ()), "linear_q_up_proj")
    attn = (*q, "linear_kv_down_proj", *(("kv_layernorm",) if norm else ()), "linear_kv_up_proj", "linear_proj")
    indexer = tuple(INDEXER + m for m in ("linear_wq_b", "linear_wk", "k_norm", "linear_weights_proj")) \
        if cfg.has_indexer(stack, layer) else ()
    mixer, mlp = cfg.layer_kind(stack, layer)  # a HybridModel's layer has one of the two
    out = ("input_layernorm", *("self_attention." + m for m in attn), *indexer) if mixer else ()
    out += MLP_EXTRA_STATE[mlp]
    if mlp == "moe" and cfg.shared_size:
        out += SHARED_EXPERT_MODULES
    return MTP_TE2_MODULES + tuple(mtp_layer_prefix(cfg, m) + m for m in out) if stack == "mtp" else out
