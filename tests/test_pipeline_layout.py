"""pipeline_model_parallel_layout strings, pure (no processes): our parser against megatron-core's own
PipelineParallelLayerLayout (imported from the installed megatron-core; plain Python), and how Layout,
target_layout and the target args follow a string."""
from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest

from dist_convert.convert import ReshardOptions, target_layout
from dist_convert.errors import ConvertError
from dist_convert.layout import pipeline_layout as pl
from dist_convert.layout.topology import Layout
from dist_convert.mlm_args import args_for_target

SYMBOL = {"embedding": "E", "decoder": "t", "mtp": "m", "loss": "L"}

# (string, PP, decoder layers, MTP layers): strings megatron-core accepts
GOOD = [
    ("EttttL", 1, 4, None),
    ("Et|tttL", 2, 4, None),
    ("Ettt|tL", 2, 4, None),
    ("Et*3|t*3L", 2, 6, None),
    ("Ett,tt|ttL", 2, 6, None),
    ("E|tt|tt|L", 2, 4, None),  # VPP=2; the first and last chunks hold no decoder layer
    ("Et|t|t|tL", 2, 4, None),  # VPP=2
    ("Et|t|t|tL", 4, 4, None),
    ("Ett||ttL", 3, 4, None),  # an empty stage
    ("E(t|)*3tL", 2, 4, None),  # VPP=2
    ("|Ett|ttL", 3, 4, None),  # megatron-core accepts leading empty stages (Layout refuses them)
    ("Et|(tt|)*30mL", 16, 61, 1),  # DeepSeek-V3 style, VPP=2
    ("Et|(tt|)*30mL", 32, 61, 1),
    ("Et|(tt|)*30mL", 8, 61, 1),  # VPP=4
    ("Ettt|(tt|)*29,m|L", 16, 61, 1),  # megatron-core's docstring example
    ("Et*3|(tt|)*29,m|L", 16, 61, 1),
]

# (string, PP, decoder layers, MTP layers): strings megatron-core refuses
BAD = [
    ("Et|ttt", 2, 4, None),  # no L
    ("tE|tttL", 2, 4, None),  # E not first
    ("Et|ttL", 2, 4, None),  # 3 decoder layers for 4
    ("Et|ttL", 3, 3, None),  # 2 stages at PP=3
    ("Ext|tttL", 2, 4, None),  # unknown symbol
    ("Et|tt(L", 2, 3, None),  # a lone parenthesis
    ("Et|(tt|L", 2, 3, None),
    ("EEt|tttL", 2, 4, None),
    ("Et|tmtL", 2, 3, 1),  # a decoder layer after MTP
    ("Et|tm|tt|L", 2, 4, 1),  # MTP not in the last virtual stage of its rank
    ("Et|tttL", 2, 4, 1),  # the model's MTP layer is not placed
    ("Et |tttL", 2, 4, None),  # whitespace
    ("", 1, 0, None),
]


def mcore_placement(text: str, pp: int, num_layers: int, mtp: int | None) -> dict:
    """megatron-core's (pp rank, vp stage) -> (entries, decoder layer ids), after its own validation."""
    from megatron.core import parallel_state
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    ref = PipelineParallelLayerLayout(text, pp)
    ref.validate_layer_layout(num_layers, mtp)
    vpp = ref.virtual_pipeline_model_parallel_size
    parallel_state.set_virtual_pipeline_model_parallel_world_size(vpp if vpp > 1 else None)
    try:
        return {(p, v): ([SYMBOL[x.name] for x in ref.layout[p][v]],
                         ref.get_layer_id_list(vp_stage=v if vpp > 1 else None, pp_rank=p))
                for p in range(pp) for v in range(vpp)}
    finally:
        parallel_state.set_virtual_pipeline_model_parallel_world_size(None)


@pytest.mark.parametrize("text,pp,layers,mtp", GOOD)
def test_placement_matches_megatron_core(text, pp, layers, mtp):
    ours = pl.parse(text, pp)
    pl.check(ours, layers, mtp or 0)
    want = mcore_placement(text, pp, layers, mtp)
    got = {(c.pp, c.vp): (list(c.entries), list(c.layer_range)) for c in ours.chunks()}
    assert got == want
    assert ours.vpp == len(want) // pp
    # every decoder layer exactly once, contiguous in stage order
    assert [i for c in ours.chunks() for i in c.layer_range] == list(range(layers))


@pytest.mark.parametrize("text,pp,layers,mtp", BAD)
def test_refused_like_megatron_core(text, pp, layers, mtp):
    with pytest.raises((AssertionError, IndexError, ValueError)):
        mcore_placement(text, pp, layers, mtp)
    with pytest.raises(ConvertError) as e:
        pl.check(pl.parse(text, pp), layers, mtp or 0)
    assert "\n" not in str(e.value) and "--target-pipeline-layout" in str(e.value)


def test_layout_follows_the_string():
    lay = Layout(tp=1, pp=2, vpp=2, pipeline_layout="Et|t|tt|ttL")
    assert lay.model_chunks(6) == [(0, 0, 0, 1), (0, 1, 2, 2), (1, 0, 1, 1), (1, 1, 4, 2)]
    assert lay.stack_chunks([("decoder", 6)])[1] == (0, 1, "decoder", 2, 2)
    assert lay.stage_sizes(6) == [3, 3]
    assert lay.stage_of_layer(6) == [0, 1, 0, 0, 1, 1]
    assert lay.chunks_per_rank == 2
    assert str(lay) == "TP=1 PP=2 VPP=2 layout='Et|t|tt|ttL'"
    lay.validate(6, 4, 2, 64)
    uneven = Layout(tp=2, pp=2, pipeline_layout="Et|tttL")
    assert uneven.model_chunks(4) == [(0, 0, 0, 1), (1, 0, 1, 3)]
    assert uneven.stage_sizes(4) == [1, 3] and uneven.stage_offsets(4) == [0, 1]
    uneven.validate(4, 4, 2, 64)


def test_legacy_rank_files_number_layers_by_the_string():
    from test_plan import CFG

    from dist_convert.formats.megatron import rank_entries

    lay = Layout(tp=1, pp=2, pipeline_layout="Et|" + "t" * (CFG.num_layers - 1) + "L")
    last = rank_entries(CFG, lay, 0, 1, "local")
    first = rank_entries(CFG, lay, 0, 0, "local")
    assert {k.split(".")[2] for k in first if k.startswith("decoder.layers.")} == {"0"}
    assert "decoder.layers.1.mlp.linear_fc2.weight" not in first
    local = [k for k in last if k.startswith("decoder.layers.") and k.endswith("linear_fc2.weight")]
    assert len(local) == CFG.num_layers - 1
    pieces = last["decoder.layers.0.mlp.linear_fc2.weight"][1]
    assert pieces[0].logical == "decoder.layers.1.mlp.linear_fc2.weight"


@pytest.mark.parametrize("lay,layers,needle", [
    (Layout(tp=1, pp=2, pipeline_layout="Et|ttL"), 4, "places 3 decoder layers (t) but the model has num_layers=4"),
    (Layout(tp=1, pp=2, pipeline_layout="Et|tt|L"), 3, "not a multiple of PP=2"),
    (Layout(tp=1, pp=3, pipeline_layout="|Ett|ttL"), 4, "not supported yet"),
    (Layout(tp=1, pp=2, pipeline_layout="Et|tt|mL", vpp=None), 3, "stages"),
    (Layout(tp=1, pp=2, pipeline_layout="Et|tttmL"), 4, "places 1 MTP layers (m) but the model has 0"),
    (Layout(tp=1, pp=2, first=1, pipeline_layout="Et|tttL"), 4, "uneven first/last"),
    (Layout(tp=1, pp=2, vpp=2, pipeline_layout="Et|tttL"), 4, "VPP=1 at PP=2, not 2"),
    (Layout(tp=1, pp=1, vpp=2, pipeline_layout="Et|tttL"), 4, "need PP >= 2"),
    (Layout(tp=1, pp=2, pipeline_layout="Et|tyL"), 2, "unknown symbols 'y'"),
])
def test_layout_refuses_strings(lay, layers, needle):
    with pytest.raises(ConvertError) as e:
        lay.validate(layers, 4, 2, 64)
    assert needle in str(e.value) and "\n" not in str(e.value)
    assert "--target-pipeline-layout" in str(e.value) or "--target-pp" in str(e.value)


def test_source_strings_name_the_source_args():
    with pytest.raises(ConvertError, match="the source's pipeline_model_parallel_layout"):
        Layout(tp=1, pp=2, pipeline_layout="Et|ttL").validate(4, 4, 2, 64, what="source")


def test_from_args_reads_the_string_and_derives_vpp():
    args = argparse.Namespace(pipeline_model_parallel_layout="Et|t|t|tL", virtual_pipeline_model_parallel_size=2,
                              decoder_first_pipeline_num_layers=None, decoder_last_pipeline_num_layers=None)
    assert Layout.from_args(args, 1, 2) == Layout(tp=1, pp=2, vpp=2, pipeline_layout="Et|t|t|tL")
    assert Layout.from_args(args, 1, 4) == Layout(tp=1, pp=4, pipeline_layout="Et|t|t|tL")
    assert Layout.from_args(argparse.Namespace(), 1, 2).pipeline_layout is None


def _index(src: Layout, layers: int = 4):
    from test_layout import cfg
    return SimpleNamespace(layout=src, cfg=cfg(num_layers=layers))


SHARDED = SimpleNamespace(sharded=True, name="megatron")


@pytest.mark.parametrize("src,kw,want", [
    (Layout(tp=1, pp=2), dict(target_pipeline_layout="Et|tttL"), Layout(tp=1, pp=2, pipeline_layout="Et|tttL")),
    (Layout(tp=1, pp=2), dict(target_pipeline_layout="Et|t|t|tL"),
     Layout(tp=1, pp=2, vpp=2, pipeline_layout="Et|t|t|tL")),
    (Layout(tp=1, pp=2), dict(target_pipeline_layout="Et|t|t|tL", target_vpp=2),
     Layout(tp=1, pp=2, vpp=2, pipeline_layout="Et|t|t|tL")),
    (Layout(tp=1, pp=2), dict(target_pp=4, target_pipeline_layout="Et|t|t|tL"),
     Layout(tp=1, pp=4, pipeline_layout="Et|t|t|tL")),
    (Layout(tp=1, pp=2, pipeline_layout="Et|tttL"), dict(target_tp=2), Layout(tp=2, pp=2, pipeline_layout="Et|tttL")),
    (Layout(tp=1, pp=2, pipeline_layout="Et|tttL"), dict(target_pp=4), Layout(tp=1, pp=4)),
    (Layout(tp=1, pp=2, pipeline_layout="Et|tttL"), dict(target_first=1), Layout(tp=1, pp=2, first=1)),
    (Layout(tp=1, pp=2, vpp=2, pipeline_layout="Et|t|t|tL"), dict(target_vpp=1), Layout(tp=1, pp=2)),
    (Layout(tp=1, pp=2, vpp=2, pipeline_layout="Et|t|t|tL"), dict(target_pipeline_layout="none"), Layout(tp=1, pp=2)),
    (Layout(tp=1, pp=2, vpp=2, pipeline_layout="Et|t|t|tL"), dict(target_first=1), Layout(tp=1, pp=2, first=1)),
])
def test_target_layout_string(src, kw, want):
    assert target_layout(ReshardOptions(src="s", dst="d", **kw), _index(src), SHARDED) == want


@pytest.mark.parametrize("kw,needle", [
    (dict(target_pipeline_layout="Et|tttL", target_first=1), "cannot be combined"),
    (dict(target_pipeline_layout="Et|tttL", target_vpp=2), "disagrees with --target-pipeline-layout"),
    (dict(target_pipeline_layout="Et|ttL"), "--target-pipeline-layout"),
    (dict(target_pipeline_layout="Et|t|tL", target_pp=2), "not a multiple of PP=2"),
])
def test_target_layout_refusals(kw, needle):
    with pytest.raises(ConvertError, match=needle):
        target_layout(ReshardOptions(src="s", dst="d", **kw), _index(Layout(tp=1, pp=2)), SHARDED)
    with pytest.raises(ConvertError, match="--target-pipeline-layout"):
        target_layout(ReshardOptions(src="s", dst="d", target_pipeline_layout="Et|tttL"), _index(Layout(tp=1, pp=2)),
                      SimpleNamespace(sharded=False, name="hf"))


def test_target_args_carry_the_string():
    from test_layout import cfg
    src = argparse.Namespace(num_layers_per_virtual_pipeline_stage=2, decoder_first_pipeline_num_layers=1,
                             num_virtual_stages_per_pipeline_rank=None)
    out = args_for_target(src, cfg(), Layout(tp=1, pp=2, vpp=2, pipeline_layout="Et|t|t|tL"), None)
    assert out.pipeline_model_parallel_layout == "Et|t|t|tL" and out.virtual_pipeline_model_parallel_size == 2
    assert out.num_layers_per_virtual_pipeline_stage is None and out.decoder_first_pipeline_num_layers is None
    plain = args_for_target(argparse.Namespace(pipeline_model_parallel_layout="Et|tttL"), cfg(), Layout(tp=1, pp=2),
                            None)
    assert plain.pipeline_model_parallel_layout is None
