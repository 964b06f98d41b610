"""The command line itself (issue 35), in this process: --version, which flags each subcommand carries, help
text everywhere, and inspect (the config fields a model uses, --tensors) on a tiny HF Llama."""
from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch
from rich.console import Console
from safetensors.torch import load_file, save_file

from dist_convert import __version__
from dist_convert.cli import build_parser, format_options, main
from dist_convert.config import RECORDS, ModelConfig
from dist_convert.datamodel import SourceChunk
from dist_convert.formats.base import FormatOptions
from dist_convert.inspect_ckpt import inspect_names, tensor_rows, tensor_table, used_config
from dist_convert.layout.boxes import Box, Piece
from dist_convert.layout.rank_files import rank_entries
from dist_convert.layout.rules import logical_tensors
from dist_convert.layout.topology import Layout

from flat_config import flat_config, with_flat

ROOT = Path(__file__).resolve().parents[1]
JOB = {"--nproc", "--backend", "--timeout"}  # how a job of ranks starts and waits
KEYS = {"--allow-missing", "--ignore-unexpected"}
SOURCE = {"--vocab-size", "--trust-pickle"}
# subcommand -> (flags it must have, flags it must not have)
FLAGS = {
    "reshard": (JOB | KEYS | SOURCE | {"--memory-budget", "--exchange"}, set()),
    "plan": (KEYS | SOURCE | {"--memory-budget", "--world"}, JOB | {"--exchange"}),
    "speculate": (JOB | KEYS | SOURCE | {"--memory-budget"}, {"--exchange"}),
    "inspect": (JOB | SOURCE | {"--tensors", "--json"}, KEYS | {"--memory-budget", "--exchange"}),
    "verify": (JOB | KEYS | SOURCE | {"--memory-budget", "--exchange"}, set()),
    "bench": ({"--memory-budget"}, JOB - {"--timeout"} | KEYS),
}
DENSE = flat_config(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
                    kv_channels=8, swiglu=True, normalization="RMSNorm", add_bias_linear=False, add_qkv_bias=False,
                    untie_embeddings_and_output_weights=True, vocab_size=128, make_vocab_size_divisible_by=16,
                    position_embedding_type="rope", max_position_embeddings=None, qk_layernorm=False, spec="local")
MOE_MLA = with_flat(DENSE, num_experts=4, moe_ffn_hidden_size=16, moe_layer_pattern=(0, 1),
                        multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=16, qk_head_dim=8,
                        qk_pos_emb_head_dim=4, v_head_dim=8, mtp_num_layers=1)
FEATURE_FIELDS = ("encoder_num_layers", "num_experts", "moe_ffn_hidden_size", "multi_latent_attention", "q_lora_rank",
                  "mtp_num_layers", "hybrid_override_pattern", "mamba_num_heads", "linear_attention_freq",
                  "linear_num_key_heads")


def subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_version_prints_dist_convert_torch_and_megatron_core(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"dist_convert {__version__}"
    assert f"torch {importlib.metadata.version('torch')}" in lines
    assert any(line.startswith("megatron-core ") for line in lines), lines
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert __version__ == pyproject["project"]["version"]


def test_parsing_and_version_import_no_torch():
    code = ("import sys\nfrom dist_convert.cli import build_parser\n"
            "build_parser().parse_args(['inspect', 'x', '--tensors'])\n"
            "try:\n    build_parser().parse_args(['--version'])\nexcept SystemExit:\n    pass\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("dist_convert ")


@pytest.mark.parametrize("cmd", sorted(FLAGS))
def test_each_subcommand_carries_only_its_flags(cmd):
    options = {s for a in subparsers()[cmd]._actions for s in a.option_strings}
    must, must_not = FLAGS[cmd]
    assert must <= options, must - options
    assert not options & must_not, options & must_not


def test_a_removed_flag_is_refused(capsys):
    for argv in (["inspect", "x", "--memory-budget", "1G"], ["inspect", "x", "--allow-missing", "*"],
                 ["plan", "x", "--world", "2", "--nproc", "2"]):
        with pytest.raises(SystemExit) as exit_:
            build_parser().parse_args(argv)
        assert exit_.value.code == 2
        assert "unrecognized arguments" in capsys.readouterr().err


def test_every_argument_has_help_and_every_command_a_description():
    parser = build_parser()
    for name, p in [("dist_convert", parser), *subparsers().items()]:
        assert p.description, name
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                continue
            assert a.help and a.help != argparse.SUPPRESS, (name, a.option_strings or a.dest)
        text = p.format_help()
        assert "``" not in text, (name, text[text.index("``") - 80:][:200])
        assert "--help" in text


def test_format_options_fills_what_a_subcommand_lacks():
    parser = build_parser()
    inspect_ns = parser.parse_args(["inspect", "x", "--trust-pickle"])
    opts = format_options(inspect_ns)
    assert opts.trust_pickle and opts.allow_missing == () and opts.ignore_unexpected == ()
    assert dataclasses.replace(opts, trust_pickle=False) == FormatOptions()
    plan_ns = parser.parse_args(["plan", "x", "--world", "2", "--allow-missing", "a.*", "--dtype", "bf16"])
    opts = format_options(plan_ns)
    assert opts.allow_missing == ("a.*",) and opts.dtype == torch.bfloat16 and not opts.trust_pickle


def test_every_config_field_is_shown_always_or_in_exactly_one_group():
    """Every field of ModelConfig's core and of each feature record (each type it comes as: the vision towers) has one
    name of its own in inspect (its record is its group)."""
    placed = inspect_names()
    names = [n for _, _, n in placed]
    assert len(set(names)) == len(names), {n for n in names if names.count(n) > 1}
    core = {f.name for f in dataclasses.fields(ModelConfig)} - set(RECORDS)
    fields = core | {f"{r}.{path}" for r, cls in RECORDS.items() for path, _ in cls.leaf_fields()}
    assert {"vision.deepstack", "vision.window", "vision.mm_tokens"} <= fields
    assert {f if r is None else f"{r}.{f}" for r, f, _ in placed if f} == fields


def test_dense_config_shows_no_feature_rows():
    shown = used_config(DENSE)
    assert not set(FEATURE_FIELDS) & set(shown), set(FEATURE_FIELDS) & set(shown)
    assert {"num_layers", "kv_channels", "vocab_size", "spec"} <= set(shown)
    assert not {"glu_activation", "softmax_type", "max_position_embeddings", "post_norms"} & set(shown)
    assert list(shown) == [n for _, _, n in inspect_names() if n in shown]  # ModelConfig order
    changed = used_config(with_flat(DENSE, activation="gelu_tanh", max_position_embeddings=4096))
    assert (changed["glu_activation"], changed["max_position_embeddings"]) == ("gelu_tanh", 4096)


def test_moe_mla_mtp_config_shows_its_rows():
    shown = used_config(MOE_MLA)
    assert {"num_experts", "moe_ffn_hidden_size", "moe_layer_freq", "multi_latent_attention", "q_lora_rank",
            "kv_lora_rank", "v_head_dim", "mla.down_split", "mtp_num_layers"} <= set(shown)
    assert shown["moe_layer_freq"] == (0, 1)
    assert "kv_channels" not in shown  # MLA has head dims of its own
    assert not {"encoder_num_layers", "hybrid_override_pattern", "mamba_num_heads", "linear_num_key_heads"} & set(shown)


def test_tensor_rows_of_tp2_ep2_rank_files():
    cfg = with_flat(DENSE, num_experts=4, moe_ffn_hidden_size=16, moe_layer_pattern=(0, 1))
    layout = Layout(tp=2, ep=2)
    chunks = []
    for ep in range(2):
        for tp in range(2):
            for key, (shape, pieces) in rank_entries(cfg, layout, tp, 0, "local", ep_rank=ep).items():
                chunks.append(SourceChunk(id=len(chunks), file=f"mp_rank_{tp:02d}_{ep:03d}", key=key, shape=shape,
                                          dtype=torch.bfloat16, pieces=pieces))
    gone = "decoder.final_layernorm.weight"
    chunks = [dataclasses.replace(c, pieces=[p for p in c.pieces if p.logical != gone]) for c in chunks]
    extra = Piece("optimizer.state.exp_avg.x", Box((4,), (4,)), Box((0,), (4,)))
    chunks.append(SourceChunk(id=len(chunks), file="o", key="x", shape=(4,), dtype=torch.float32, pieces=[extra]))
    rows = {r["name"]: r for r in tensor_rows(cfg, chunks, layout)}
    assert list(rows)[:len(logical_tensors(cfg))] == list(logical_tensors(cfg))  # model order, then the rest
    qkv = rows["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert (qkv["kind"], qkv["dtypes"], qkv["expert"], qkv["pieces"]) == ("column", ["bfloat16"], None, 4)
    assert qkv["shape"] == [(4 + 2 * 2) * 8, 32]
    fc1 = rows["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"]
    assert (fc1["kind"], fc1["expert"], fc1["ep_rank"], fc1["shape"]) == ("glu", 3, 1, [32, 32])
    assert fc1["pieces"] == 4  # gate and up halves on each of the 2 TP ranks of its EP rank
    assert rows["decoder.layers.1.mlp.router.weight"]["kind"] == "replicated"
    assert rows["embedding.word_embeddings.weight"]["kind"] == "vocab"
    assert rows[gone]["pieces"] == 0 and rows[gone]["dtypes"] == []
    console = Console(width=200, record=True)
    console.print(tensor_table(list(rows.values())))
    text = console.export_text()
    assert "expert (EP rank)" in text and "3 (1)" in text and "absent" in text
    assert rows["optimizer.state.exp_avg.x"] == {"name": "optimizer.state.exp_avg.x", "shape": [8],
                                                 "dtypes": ["float32"], "kind": None, "expert": None,
                                                 "ep_rank": None, "pieces": 1}


@pytest.fixture(scope="session")
def hf_llama(tmp_path_factory) -> Path:
    from hf_models import make_hf_model

    return make_hf_model(tmp_path_factory.mktemp("cli_hf"), "llama", dtype=torch.bfloat16)


def inspect_json(capsys, *argv: str) -> dict:
    assert main(["inspect", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_inspect_shows_used_config_and_tensors(hf_llama, capsys):
    info = inspect_json(capsys, str(hf_llama), "--tensors")
    assert info["format"] == "hf" and info["config"]["num_layers"] == 2
    assert not set(FEATURE_FIELDS) & set(info["config"]) and info["config_all"]["moe"] is None
    rows = {r["name"]: r for r in info["tensors"]}
    assert len(rows) == info["logical_tensors"]
    qkv = rows["decoder.layers.1.self_attention.linear_qkv.weight"]
    # q_proj, k_proj and v_proj each hold one piece per query group (2): megatron-core interleaves them by group
    assert (qkv["kind"], qkv["shape"], qkv["dtypes"], qkv["pieces"]) == ("column", [128, 64], ["bfloat16"], 6)
    assert all(r["pieces"] > 0 and r["dtypes"] == ["bfloat16"] for r in rows.values())
    assert "tensors" not in inspect_json(capsys, str(hf_llama))
    assert main(["inspect", str(hf_llama), "--tensors"]) == 0
    table = capsys.readouterr().out
    assert "decoder.layers.1.self_attention.linear_qkv.weight" in table and "TP split" in table
    assert "num_experts" not in table and "expert (EP rank)" not in table


def test_inspect_notes_missing_and_unexpected_tensors_without_flags(hf_llama, tmp_path, capsys):
    """inspect has no --allow-missing / --ignore-unexpected: it describes what is there and notes the rest."""
    src = tmp_path / "damaged"
    src.mkdir()
    for f in hf_llama.iterdir():
        if f.name != "model.safetensors":
            (src / f.name).write_bytes(f.read_bytes())
    tensors = load_file(hf_llama / "model.safetensors")
    del tensors["model.norm.weight"]
    tensors["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    info = inspect_json(capsys, str(src), "--tensors")
    notes = "\n".join(info["notes"])
    assert "left out 1 logical tensors" in notes and "decoder.final_layernorm.weight" in notes, notes
    assert "ignored 1 unexpected source tensors" in notes and "model.layers.0.mlp.extra.weight" in notes, notes
    assert {r["name"]: r["pieces"] for r in info["tensors"]}["decoder.final_layernorm.weight"] == 0
