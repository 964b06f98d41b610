"""Pure unit tests of the slice algebra, the layout table and pipeline stage math (no processes)."""
import pytest
import torch

from dist_convert.config import ModelConfig, padded_vocab_size
from dist_convert.errors import ConvertError
from dist_convert.layout.boxes import Box, Kind, local_pieces, piece_box
from dist_convert.layout.rules import logical_tensors, torch_dist_key
from dist_convert.layout.topology import Layout

from flat_config import flat_config


def cfg(**kw) -> ModelConfig:
    base = dict(num_layers=4, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2,
                kv_channels=16, swiglu=True, normalization="RMSNorm", add_bias_linear=False, add_qkv_bias=False,
                untie_embeddings_and_output_weights=False, vocab_size=100, make_vocab_size_divisible_by=16,
                position_embedding_type="rope", max_position_embeddings=32, qk_layernorm=False, spec="local")
    base.update(kw)
    return flat_config(**base)


def assemble(pieces_per_rank, logical_shape):
    """Rebuild a logical tensor from per-rank local tensors using only the pieces (oracle below)."""
    out = torch.full(logical_shape, float("nan"))
    for local, pieces in pieces_per_rank:
        for p in pieces:
            out[p.lbox.slices()] = local[p.sbox.slices()].reshape(p.lbox.sizes)
    return out


def test_box_intersection_and_relative():
    a, b = Box((0, 4), (8, 4)), Box((6, 0), (4, 6))
    assert a.intersect(b) == Box((6, 4), (2, 2))
    assert a.intersect(Box((8, 0), (1, 1))) is None
    assert Box((6, 4), (2, 2)).relative_to(a) == Box((6, 0), (2, 2))


def test_swiglu_chunks_gate_and_up_separately():
    # logical fc1 = [gate; up], 2F rows; megatron's TP rank r holds [gate_r; up_r]
    F, H, tp = 6, 3, 3
    gate = torch.arange(F * H, dtype=torch.float32).reshape(F, H)
    up = 1000 + gate
    logical = torch.cat([gate, up])
    for r in range(tp):
        shape, pieces = local_pieces("fc1", Kind.GLU, (2 * F, H), 2 * F, r, tp)
        local = torch.cat([gate[r * 2:(r + 1) * 2], up[r * 2:(r + 1) * 2]])  # what megatron-core stores
        assert shape == tuple(local.shape)
        for p in pieces:
            assert torch.equal(local[p.sbox.slices()], logical[p.lbox.slices()])
    # a plain dim-0 split would differ: rank 0 would hold gate rows 0..3
    assert not torch.equal(logical[:4], torch.cat([gate[:2], up[:2]]))


@pytest.mark.parametrize("kind,shape", [(Kind.COL, (12, 5)), (Kind.ROW, (5, 12)), (Kind.REP, (12,)),
                                        (Kind.GLU, (16, 5))])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tp_chunks_reassemble(kind, shape, tp):
    logical = torch.randn(shape)
    parts = []
    for r in range(tp):
        lshape, pieces = local_pieces("t", kind, shape, shape[0], r, tp)
        local = torch.empty(lshape)
        for p in pieces:
            local[p.sbox.slices()] = logical[p.lbox.slices()]
        parts.append((local, pieces))
    assert torch.equal(assemble(parts, shape), logical)


def test_vocab_padding_rows_map_to_nothing():
    V, H, tp = 100, 4, 2
    padded = padded_vocab_size(V, 16, tp)
    assert padded == 128
    total = 0
    for r in range(tp):
        shape, pieces = local_pieces("emb", Kind.VOCAB, (padded, H), V, r, tp)
        assert shape == (64, H)
        total += sum(p.lbox.numel for p in pieces)
        assert all(p.lbox.offsets[0] + p.lbox.sizes[0] <= V for p in pieces)
    assert total == V * H
    # a rank whose whole shard is padding holds no piece at all
    assert local_pieces("emb", Kind.VOCAB, (256, H), 100, 3, 4)[1] == []


def test_padded_vocab_rule():
    assert padded_vocab_size(50257, 128, 1) == 50304
    assert padded_vocab_size(50257, 128, 8) == 51200
    assert padded_vocab_size(128, 128, 1) == 128
    for bad in (0, -16):
        with pytest.raises(ConvertError, match=f"make_vocab_size_divisible_by={bad} .*--make-vocab-size-divisible-by"):
            padded_vocab_size(100, bad, 2)


def test_piece_box_with_layer_axis():
    from dist_convert.layout.boxes import Piece
    p = Piece(logical="x", lbox=Box((4, 0), (4, 8)), sbox=Box((2, 0, 0), (1, 4, 8)))
    assert piece_box(p, Box((5, 2), (2, 3))) == Box((2, 1, 2), (1, 2, 3))


def test_table_shapes_and_names():
    c = cfg()
    t = logical_tensors(c)
    assert t["decoder.layers.0.self_attention.linear_qkv.weight"].shape == ((4 + 2 * 2) * 16, 64)
    assert t["decoder.layers.3.mlp.linear_fc1.weight"].kind is Kind.GLU
    assert t["decoder.layers.3.mlp.linear_fc1.weight"].shape == (192, 64)
    assert "output_layer.weight" not in t  # tied
    assert torch_dist_key(t["decoder.layers.2.input_layernorm.weight"]) == \
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight"
    c2 = cfg(normalization="LayerNorm", add_bias_linear=True, add_qkv_bias=True,
             untie_embeddings_and_output_weights=True, swiglu=False, position_embedding_type="learned_absolute",
             qk_layernorm=True)
    t2 = logical_tensors(c2)
    for name in ("output_layer.weight", "embedding.position_embeddings.weight", "decoder.final_layernorm.bias",
                 "decoder.layers.1.self_attention.linear_qkv.bias", "decoder.layers.1.mlp.linear_fc2.bias",
                 "decoder.layers.1.self_attention.q_layernorm.bias"):
        assert name in t2
    assert t2["decoder.layers.0.mlp.linear_fc1.weight"].kind is Kind.COL


@pytest.mark.parametrize("layout,sizes", [(Layout(tp=1, pp=1), [8]), (Layout(tp=1, pp=4), [2, 2, 2, 2]),
                                          (Layout(tp=1, pp=3, first=2), [2, 3, 3]),
                                          (Layout(tp=1, pp=3, last=4), [2, 2, 4]),
                                          (Layout(tp=2, pp=4, first=1, last=1), [1, 3, 3, 1])])
def test_stage_sizes(layout, sizes):
    assert layout.stage_sizes(8) == sizes
    assert layout.stage_offsets(8) == [sum(sizes[:i]) for i in range(len(sizes))]


@pytest.mark.parametrize("layout,flag", [(Layout(tp=3, pp=1), "--target-tp"), (Layout(tp=1, pp=9), "--target-pp"),
                                         (Layout(tp=1, pp=3, first=1), "--target-num-layers-in-first-stage"),
                                         (Layout(tp=1, pp=2, first=3, last=3), "--target-num-layers-in-first-stage")])
def test_layout_validation_names_the_flag(layout, flag):
    with pytest.raises(ConvertError) as e:
        layout.validate(8, heads=4, groups=2, ffn=96)
    assert flag in str(e.value)


@pytest.mark.parametrize("kw,needle", [({"num_attention_heads": 6, "num_query_groups": 6}, "num_attention_heads=6"),
                                       ({"num_query_groups": 4, "ffn_hidden_size": 90}, "ffn_hidden_size=90")])
def test_target_tp_must_divide_heads_and_ffn(kw, needle):
    with pytest.raises(ConvertError) as e:
        cfg(**kw).check_layout(Layout(tp=4, pp=1))
    assert f"target TP=4 does not divide {needle}; choose --target-tp among the divisors" in str(e.value)


@pytest.mark.parametrize("heads,groups,tp,ok", [(4, 2, 4, True), (8, 2, 8, True), (8, 4, 2, True), (8, 1, 8, True),
                                                (12, 6, 4, False), (12, 3, 2, False)])
def test_target_tp_divides_or_is_a_multiple_of_the_query_groups(heads, groups, tp, ok):
    """megatron-core holds TP | groups and groups | TP (a rank then holds a contiguous part of one group)."""
    c = cfg(num_attention_heads=heads, num_query_groups=groups, ffn_hidden_size=96)
    if ok:
        c.check_layout(Layout(tp=tp, pp=1))
        return
    with pytest.raises(ConvertError) as e:
        c.check_layout(Layout(tp=tp, pp=1))
    assert (f"target TP={tp} neither divides num_query_groups={groups} nor is a multiple of it; choose --target-tp "
            f"among the divisors or multiples of {groups}") in str(e.value)


def test_config_from_megatron_lm_args():
    import argparse

    from dist_convert.config import config_from_args
    # Megatron-LM defaults: num_query_groups=1 is ignored unless group_query_attention is on
    args = argparse.Namespace(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=1,
                              group_query_attention=False, padded_vocab_size=128, vocab_size=None,
                              transformer_impl="transformer_engine")
    c = config_from_args(args, None, None, 1)
    assert c.num_query_groups == 4 and c.kv_channels == 16 and c.ffn_hidden_size == 256
    assert c.vocab_size == 128 and c.spec == "te" and c.add_bias_linear and c.add_qkv_bias
    args.group_query_attention = True
    assert config_from_args(args, 100, "local", 1).num_query_groups == 1
    assert config_from_args(args, 100, "local", 1).vocab_size == 100
    with pytest.raises(ConvertError, match="--vocab-size"):
        config_from_args(argparse.Namespace(num_layers=2, hidden_size=8, num_attention_heads=2), None, None, 1)


def test_virtual_pipeline_chunks_interleave_like_megatron_core():
    """Chunk v of pipeline rank p holds layers v*(L/V) + p*(L/(P*V)) onwards (megatron-core's
    get_transformer_layer_offset), every layer exactly once."""
    layout = Layout(tp=1, pp=2, vpp=3)
    chunks = layout.model_chunks(12)
    assert chunks == [(0, 0, 0, 2), (0, 1, 4, 2), (0, 2, 8, 2), (1, 0, 2, 2), (1, 1, 6, 2), (1, 2, 10, 2)]
    assert layout.stage_of_layer(12) == [0, 0, 1, 1, 0, 0, 1, 1, 0, 0, 1, 1]
    assert str(layout) == "TP=1 PP=2 VPP=3"


def test_virtual_pipeline_rank_files_hold_model_chunks():
    from test_plan import CFG

    from dist_convert.formats.megatron import rank_entries

    last = rank_entries(CFG, Layout(tp=1, pp=2, vpp=2), 0, 1, "local")
    assert "model1/output_layer.weight" in last and "model1/decoder.final_layernorm.weight" in last
    assert "model0/decoder.layers.0.mlp.linear_fc2.weight" in last
    assert not any(k.startswith("model0/") and "output" in k for k in last)
    first = rank_entries(CFG, Layout(tp=1, pp=2, vpp=2), 0, 0, "local")
    assert "model0/embedding.word_embeddings.weight" in first and "model1/embedding.word_embeddings.weight" not in first


@pytest.mark.parametrize("layout,needle", [
    (Layout(tp=1, pp=2, vpp=3), "does not divide num_layers=8"),
    (Layout(tp=1, pp=1, vpp=2), "needs VPP >= 2 and PP >= 2"),
    (Layout(tp=1, pp=2, first=2, vpp=2), "uneven first/last"),
])
def test_impossible_virtual_pipeline_layouts(layout, needle):
    with pytest.raises(ConvertError, match=needle):
        layout.validate(8, 4, 2, 64)
