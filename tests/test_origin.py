"""Where a model came from (datamodel.Origin), pure: its record holds plain values only (torch.load with
weights_only and JSON read it back), torch_dist (both common-state styles), megatron and fsdp_dtensor
targets store it under its own key and their readers give it back, the former side channels in args
(hf_config, nemo_config, bridge_source, ...) of checkpoints earlier versions wrote are read into an Origin
and never written again. tests/test_hf.py and tests/test_bridge_format.py convert through torch_dist with
the source moved away."""
from __future__ import annotations

import argparse
import datetime
import io
import json
from pathlib import Path

import pytest
import torch
import yaml

from dist_convert.datamodel import ORIGIN_KEY, Origin, Target, TargetFile
from dist_convert.formats.base import FormatOptions, read_origin, tokenizer_source
from dist_convert.formats.fsdp_dtensor import FsdpDtensorFormat
from dist_convert.formats.megatron import MegatronFormat, _index_file
from dist_convert.formats.torch_dist import TorchDistFormat, open_weights
from dist_convert.layout.rules import logical_tensors
from dist_convert.layout.topology import Layout
from dist_convert.mlm_args import LEGACY_ORIGIN_ARGS, args_for_target, complete_args

from flat_config import flat_config

CFG = flat_config(num_layers=2, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4, num_query_groups=2,
                  kv_channels=8, swiglu=True, normalization="RMSNorm", add_bias_linear=False, add_qkv_bias=False,
                  untie_embeddings_and_output_weights=True, vocab_size=50, make_vocab_size_divisible_by=8,
                  position_embedding_type="rope", max_position_embeddings=16, qk_layernorm=False, spec="local")
HF = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 50, "hidden_size": 32,
      "rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "layer_types": ["full_attention", "full_attention"]}
RUN_CONFIG = {"model": {"_target_": "megatron.bridge.models.gpt_provider.GPTModelProvider", "num_layers": 2,
                        "hf_model_id": "meta-llama/Llama-3.2-1B"},
              "checkpoint": {"save": "/gone/run"}, "logger": {"started": datetime.date(2025, 1, 2)}}


def origin(tmp_path: Path) -> Origin:
    tok = tmp_path / "tokenizer"
    tok.mkdir(exist_ok=True)
    return Origin(kind="hf", hf_config=HF, nemo_config={"mcore_gpt": True, "tokenizer": {"model": "nemo:t.model"}},
                  nemo_archive=tmp_path / "model.nemo", nemo2_context=tmp_path / "ckpt" / "context",
                  bridge_run_config=RUN_CONFIG, hf_model_id="meta-llama/Llama-3.2-1B", tokenizer=tok)


def target(o: Origin, args: argparse.Namespace | None = None) -> Target:
    return Target(cfg=CFG, layout=Layout(tp=1, pp=1), dtype=None, iteration=3, origin=o,
                  args=args_for_target(args or argparse.Namespace(), CFG, Layout(tp=1, pp=1), None, "torch_dist"))


def test_record_is_plain_and_reads_back(tmp_path):
    o = origin(tmp_path)
    rec = o.record()
    buf = io.BytesIO()
    torch.save(rec, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)  # no allow-list: plain values only
    assert loaded == json.loads(json.dumps(rec)) == rec
    back = Origin.from_record(loaded)
    assert back == Origin.from_record(rec)
    # every field but the YAML date (kept as its text) comes back as it was
    assert back.hf_config == HF and back.nemo_config == o.nemo_config and back.hf_model_id == o.hf_model_id
    assert back.bridge_run_config == {**RUN_CONFIG, "logger": {"started": "2025-01-02"}}
    assert (back.kind, back.nemo_archive, back.nemo2_context, back.tokenizer) == \
        ("hf", o.nemo_archive, o.nemo2_context, o.tokenizer)
    # a record of another version: what this one knows, the rest left out
    assert Origin.from_record({"kind": "hf", "hf_config": "not a dict", "future": 1}) == Origin(kind="hf")
    assert Origin.from_record(None) == Origin()


def test_missing_artifacts_are_noted(tmp_path):
    o = origin(tmp_path)
    notes = o.missing()  # the archive and the context were never made; the tokenizer directory exists
    assert len(notes) == 2 and "model.nemo" in notes[0] and "context" in notes[1]
    assert tokenizer_source(o) == o.tokenizer and tokenizer_source(o, tmp_path) == tmp_path
    (o.tokenizer).rmdir()
    assert tokenizer_source(o) is None and "--tokenizer-dir" in o.missing()[-1]


@pytest.mark.parametrize("style", ["0.16", "0.19"])
def test_torch_dist_target_stores_the_origin_and_reads_it_back(tmp_path, style):
    o = origin(tmp_path)
    t = target(o)
    assert not any(hasattr(t.args, name) for name in LEGACY_ORIGIN_ARGS)
    it = tmp_path / "iter_0000003"
    it.mkdir()
    TorchDistFormat(FormatOptions(torch_dist_style=style)).finalize(t, it, [])
    assert (it / "common.pt").is_file() == (style == "0.16")
    _, common, found = open_weights(it, trust_pickle=False)
    assert found == style and common[ORIGIN_KEY] == o.record()
    back, args = read_origin("torch_dist", common[ORIGIN_KEY], common["args"])
    assert back == Origin.from_record(o.record()) and vars(args) == vars(t.args)


def test_megatron_target_stores_the_origin_in_every_rank_file(tmp_path):
    o = origin(tmp_path)
    files = [TargetFile(id=i, name=f"mp_rank_0{i}/model_optim_rng.pt", tensors=[]) for i in range(2)]
    writer = MegatronFormat().open_writer(target(o), tmp_path, files, rt=None)
    assert [w.name for w in writer.close()] == [f.name for f in files]
    for f in files:
        raw = torch.load(tmp_path / f.name, weights_only=False)
        assert raw[ORIGIN_KEY] == o.record() and not hasattr(raw["args"], "hf_config")
        indexed = _index_file(tmp_path / f.name, trust_pickle=False)
        assert read_origin("megatron", indexed["origin"], indexed["args"])[0] == Origin.from_record(o.record())


def test_fsdp_dtensor_target_stores_the_origin_as_an_item(tmp_path):
    o = origin(tmp_path)
    files = FsdpDtensorFormat().target_files(target(o), dict.fromkeys(logical_tensors(CFG), torch.float32))
    assert files[0].objects[ORIGIN_KEY] == o.record() and not hasattr(files[0].objects["args"], "hf_config")


def test_side_channels_of_earlier_versions_are_read_and_dropped(tmp_path):
    """Checkpoints dist_convert wrote before the Origin record carry it in args: read into an Origin, the
    args given back without them; Megatron-LM's own tokenizer_model stays an argument."""
    bridge_iter, tok = tmp_path / "mb" / "iter_0000001", tmp_path / "tok"
    bridge_iter.mkdir(parents=True)
    tok.mkdir()
    (bridge_iter / "run_config.yaml").write_text(yaml.safe_dump({"model": {"num_layers": 2}}))
    old = argparse.Namespace(num_layers=2, hf_config=HF, nemo_config={"mcore_gpt": True},
                             nemo_source=str(tmp_path / "model.nemo"), bridge_source=str(bridge_iter),
                             hf_model_id="org/model", nemo2_source=str(tmp_path / "n2"), bridge_layer_spec="x.y",
                             tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(tok))
    o, args = read_origin("torch_dist", None, old)
    assert o == Origin(kind="hf", hf_config=HF, nemo_config={"mcore_gpt": True}, nemo_archive=tmp_path / "model.nemo",
                       nemo2_context=tmp_path / "n2" / "context", bridge_run_config={"model": {"num_layers": 2}},
                       hf_model_id="org/model", tokenizer=tok)
    assert vars(args) == {"num_layers": 2, "tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": str(tok)}
    assert old.hf_config == HF  # the source's args are untouched
    # a Megatron-LM checkpoint: nothing but its own tokenizer, and its format as the kind
    plain, _ = read_origin("megatron", None, argparse.Namespace(tokenizer_model=str(tok)))
    assert plain == Origin(kind="megatron", tokenizer=tok)
    assert read_origin("megatron", None, argparse.Namespace(tokenizer_model="gpt2"))[0] == Origin(kind="megatron")
    # complete_args never writes them, whatever it is given
    out = complete_args(old, CFG, Layout(tp=1, pp=1))
    assert not any(hasattr(out, name) for name in LEGACY_ORIGIN_ARGS) and out.tokenizer_model == str(tok)


def test_tokenizer_model_is_written_for_megatron_lms_hf_tokenizer_only(tmp_path):
    """The Origin's tokenizer directory becomes Megatron-LM's tokenizer_model where the args name a
    HuggingFaceTokenizer without one; a location the args give is kept."""
    layout = Layout(tp=1, pp=1)
    hf = args_for_target(argparse.Namespace(tokenizer_type="HuggingFaceTokenizer"), CFG, layout, None,
                         tokenizer=tmp_path)
    assert hf.tokenizer_model == str(tmp_path)
    own = args_for_target(argparse.Namespace(tokenizer_type="HuggingFaceTokenizer", tokenizer_model="org/tok"), CFG,
                          layout, None, tokenizer=tmp_path)
    assert own.tokenizer_model == "org/tok"
    gpt2 = args_for_target(argparse.Namespace(tokenizer_type="GPT2BPETokenizer"), CFG, layout, None,
                           tokenizer=tmp_path)
    assert gpt2.tokenizer_model is None
