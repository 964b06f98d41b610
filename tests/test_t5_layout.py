"""Pure tests of the T5 (encoder-decoder) layout: stacks on pipeline stages around the split rank,
where embeddings, relative position biases, final norms and the tied head copy live, and the planner
covering every byte of T5 targets (execution simulated in memory)."""
import pytest
import torch
from test_plan import assert_targets_hold, legacy_source, logical_model, numel, simulate

from dist_convert.datamodel import Target
from dist_convert.errors import ConvertError
from dist_convert.formats.megatron import MegatronFormat, rank_entries
from dist_convert.formats.torch_dist import TorchDistFormat
from dist_convert.layout.rules import logical_tensors
from dist_convert.layout.topology import Layout
from dist_convert.plan import make_plan

from flat_config import flat_config, with_flat

T5 = flat_config(num_layers=4, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=4,
                 kv_channels=8, swiglu=False, normalization="LayerNorm", add_bias_linear=True, add_qkv_bias=True,
                 untie_embeddings_and_output_weights=False, vocab_size=50, make_vocab_size_divisible_by=8,
                 position_embedding_type="learned_absolute", max_position_embeddings=16, qk_layernorm=False,
                 spec="local", family="t5", encoder_num_layers=2)
T5_REL = with_flat(T5, position_embedding_type="relative", untie_embeddings_and_output_weights=True, swiglu=True,
                    normalization="RMSNorm", add_bias_linear=False, add_qkv_bias=False)


def test_stacks_sit_on_both_sides_of_the_split_rank():
    assert Layout(tp=1, pp=3, split=1).stack_chunks(T5.stacks) == [(0, 0, "encoder", 0, 2), (1, 0, "decoder", 0, 2),
                                                             (2, 0, "decoder", 2, 2)]
    assert Layout(tp=2, pp=1).stack_chunks(T5.stacks) == [(0, 0, "encoder", 0, 2), (0, 0, "decoder", 0, 4)]


def test_rank_files_hold_what_each_stage_needs():
    keys = [set(rank_entries(T5, Layout(tp=1, pp=3, split=1), 0, p, "local")) for p in range(3)]
    top = [{k for k in ks if ".layers." not in k} for ks in keys]
    emb = {"embedding.word_embeddings.weight", "embedding.position_embeddings.weight", "position_embeddings.weight"}
    assert top[0] == emb | {"encoder.final_layernorm.weight", "encoder.final_layernorm.bias"}
    assert top[1] == emb  # the first decoder stage embeds the decoder input
    # the last stage: head bias, decoder norm, and (tied, no embedding here) a copy of the word embeddings
    assert top[2] == {"lm_head.output_layer.bias", "output_layer.bias", "decoder.final_layernorm.weight",
                      "decoder.final_layernorm.bias", "lm_head.output_layer.weight", "output_layer.weight"}
    assert "decoder.layers.1.cross_attention.linear_kv.weight" in keys[2]  # local layer numbers
    assert not any(k.startswith("encoder.layers") for k in keys[1] | keys[2])
    rel = [{k for k in rank_entries(T5_REL, Layout(tp=1, pp=3, split=2), 0, p, "local") if "relative" in k}
           for p in range(3)]
    assert rel == [{"encoder_relative_pos_emb.relative_attention_bias.weight"}] * 2 + \
        [{"decoder_relative_pos_emb.relative_attention_bias.weight"}]


def test_cross_attention_kv_is_split_by_groups():
    t = logical_tensors(T5)["decoder.layers.0.cross_attention.linear_kv.weight"]
    assert t.shape == (2 * 4 * 8, 32) and t.kind.value == "column"


@pytest.mark.parametrize("cfg", [T5, T5_REL], ids=["tied-learned", "untied-relative"])
@pytest.mark.parametrize("src,dst,fmt", [(Layout(tp=2, pp=1), Layout(tp=1, pp=3, split=1), "megatron"),
                                         (Layout(tp=1, pp=2, split=1), Layout(tp=2, pp=1), "torch_dist"),
                                         (Layout(tp=2, pp=3, split=2), Layout(tp=1, pp=2, split=1), "megatron")])
def test_plan_covers_t5_targets(cfg, src, dst, fmt):
    model = logical_model(cfg)
    chunks, data = legacy_source(cfg, src, model)
    writer = MegatronFormat() if fmt == "megatron" else TorchDistFormat()
    files = writer.target_files(Target(cfg=cfg, layout=dst, dtype=None, args=None, iteration=1),
                                {n: torch.float32 for n in model})
    plan = make_plan(chunks, files, 3, 64 << 10, numel(cfg))
    assert_targets_hold(simulate(plan, files, data), files, model)
    written = {pc.logical for f in files for t in f.tensors for pc in t.pieces}
    assert written == set(model)


@pytest.mark.parametrize("layout,needle", [
    (Layout(tp=1, pp=2), "needs a pipeline split rank"),
    (Layout(tp=1, pp=2, split=2), "needs a pipeline split rank in [1, 1]"),
    (Layout(tp=1, pp=4, split=1), "not an even split"),  # 4 decoder layers over 3 stages
    (Layout(tp=1, pp=1, split=1), "needs PP > 1"),
    (Layout(tp=1, pp=2, vpp=2, split=1), "no virtual or uneven"),
])
def test_bad_t5_layouts_are_refused(layout, needle):
    with pytest.raises(ConvertError, match="pipeline-split-rank|split rank|virtual") as e:
        T5.check_layout(layout)
    assert needle in str(e.value)


def test_split_rank_on_a_gpt_model_is_refused():
    gpt = with_flat(T5, family="gpt", encoder_num_layers=0)
    with pytest.raises(ConvertError, match="only encoder-decoder"):
        gpt.check_layout(Layout(tp=1, pp=2, split=1))


def test_split_rank_in_args_counts_only_for_encoder_decoder_models():
    import argparse

    args = argparse.Namespace(pipeline_model_parallel_split_rank=1)
    assert Layout.from_args(args, 1, 2).split is None  # an unused Megatron-LM GPT argument
    assert Layout.from_args(args, 1, 2, encoder_decoder=True).split == 1
