"""T5's logical tensors beyond a GPT layer's: megatron-core's ``T5Model`` decoder layers add cross-attention
(``CrossAttention``: ``linear_q``, a fused ``linear_kv``, ``linear_proj``, and its pre-norm), suffixes after
``decoder.layers.<N>.``; and its top-level tensors (shared embedding, relative position biases, the two stacks'
final norms, the LM head)."""
from __future__ import annotations

from .boxes import Kind
from .tensors import Cond, Rule, hidden, linear_bias, norm_bias

# linear_kv rows are group-major [k_g; v_g], so a dim-0 split is exact
CROSS_RULES: tuple[Rule, ...] = (
    Rule("pre_cross_attn_layernorm.weight", Kind.REP, hidden),
    Rule("pre_cross_attn_layernorm.bias", Kind.REP, hidden, norm_bias),
    Rule("cross_attention.linear_q.weight", Kind.COL, lambda c: (c.num_attention_heads * c.kv_channels, c.hidden_size)),
    Rule("cross_attention.linear_q.bias", Kind.COL, lambda c: (c.num_attention_heads * c.kv_channels,), linear_bias),
    Rule("cross_attention.linear_kv.weight", Kind.COL,
         lambda c: (2 * c.num_query_groups * c.kv_channels, c.hidden_size)),
    Rule("cross_attention.linear_kv.bias", Kind.COL, lambda c: (2 * c.num_query_groups * c.kv_channels,),
         linear_bias),
    Rule("cross_attention.linear_proj.weight", Kind.ROW,
         lambda c: (c.hidden_size, c.num_attention_heads * c.kv_channels)),
    Rule("cross_attention.linear_proj.bias", Kind.REP, hidden, linear_bias),
)

# Top-level tensors and where they live (see ``rules.holders``): "embed" (first stage and the first decoder stage),
# "encoder"/"decoder" (every stage of that stack), "encoder_last" (the last encoder stage), "last" pipeline stage.
_relative: Cond = lambda c: c.position.kind == "relative"  # noqa: E731
T5_TOP_RULES: tuple[tuple[Rule, str], ...] = (
    (Rule("embedding.word_embeddings.weight", Kind.VOCAB, lambda c: (c.vocab_size, c.hidden_size)), "embed"),
    (Rule("embedding.position_embeddings.weight", Kind.REP, lambda c: (c.max_position_embeddings or 0, c.hidden_size),
          lambda c: c.position.kind == "learned_absolute", aliases=("position_embeddings.weight",)), "embed"),
    (Rule("encoder_relative_pos_emb.relative_attention_bias.weight", Kind.REP,
          lambda c: (c.t5.relative_attention_num_buckets, c.num_attention_heads), _relative), "encoder"),
    (Rule("decoder_relative_pos_emb.relative_attention_bias.weight", Kind.REP,
          lambda c: (c.t5.relative_attention_num_buckets, c.num_attention_heads), _relative), "decoder"),
    (Rule("encoder.final_layernorm.weight", Kind.REP, hidden), "encoder_last"),
    (Rule("encoder.final_layernorm.bias", Kind.REP, hidden, norm_bias), "encoder_last"),
    (Rule("decoder.final_layernorm.weight", Kind.REP, hidden), "last"),
    (Rule("decoder.final_layernorm.bias", Kind.REP, hidden, norm_bias), "last"),
    (Rule("lm_head.output_layer.weight", Kind.VOCAB, lambda c: (c.vocab_size, c.hidden_size),
          lambda c: c.untie_embeddings_and_output_weights, aliases=("output_layer.weight",)), "last"),
    # with shared embeddings the T5 head has a (vocab-parallel) bias
    (Rule("lm_head.output_layer.bias", Kind.VOCAB, lambda c: (c.vocab_size,), lambda c: c.tied,
          aliases=("output_layer.bias",)), "last"),
)

# a decoder layer's cross-attention modules with an ``_extra_state`` entry, by spec
CROSS_EXTRA_STATE_MODULES = {
    "local": ("cross_attention.linear_q", "cross_attention.linear_kv", "cross_attention.linear_proj"),
    "te": ("cross_attention.linear_q", "cross_attention.linear_kv", "cross_attention.core_attention",
           "cross_attention.linear_proj"),
}
