"""Megatron-Bridge checkpoints as Megatron-Bridge 0.6.2 itself writes them (its own HF import of a tiny
Llama, tests/oracles/bridge.py ``import``) are read by every command, and converted to HF, torch_dist and
Bridge targets at other layouts; the judges are code nobody here wrote: the HF source's safetensors
(read by the safetensors library) and Megatron-Bridge's own loader, which builds the model from the
target's run_config.yaml (Bridge targets) or args (torch_dist) and exports HF weights that must equal the
source's bit for bit, and a Bridge target of megatron-core's own save (fixture gpt_a) loads in Bridge equal to
megatron-core's load. Bad input (a Bridge iteration without run_config.yaml) is refused in one line.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from dist_convert.formats.mcore_config import PARALLEL

from conftest import assert_refused, ok, oracle, run_cli


def bridge(cmd: str, *args: str):
    return oracle(cmd, 1, *args, program="bridge", runtime="mcore19")


@pytest.fixture(scope="module")
def bridge_ckpt(tmp_path_factory) -> tuple[Path, Path]:
    """(the HF source, Megatron-Bridge's checkpoint of it)."""
    root = tmp_path_factory.mktemp("bridge")
    bridge("make-hf", "--root", str(root))
    bridge("import", "--hf", str(root / "llama"), "--out", str(root / "mb"))
    return root / "llama", root / "mb"


def test_bridge_source_to_hf_keeps_weights_tokenizer_and_generation_config(bridge_ckpt, tmp_path):
    hf, src = bridge_ckpt
    info = json.loads(ok(run_cli("inspect", str(src), "--json")).stdout)
    assert info["format"] == "bridge" and info["layout"]["tp"] == 1, info
    dst = tmp_path / "dst"
    ok(run_cli("reshard", str(src), str(dst), "--dst-format", "hf", nproc=2))
    want, got = load_file(hf / "model.safetensors"), load_file(dst / "model.safetensors")
    assert sorted(got) == sorted(want)
    bad = [k for k in want if got[k].dtype != want[k].dtype or not got[k].equal(want[k])]
    assert not bad, bad
    held = src / "iter_0000000" / "tokenizer"  # the tokenizer as Bridge saved it with the weights
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (dst / name).read_bytes() == (held / name).read_bytes(), name
    # Bridge keeps no generation config: the one of the HF model the run_config names (hf_model_id)
    assert (dst / "generation_config.json").read_bytes() == (hf / "generation_config.json").read_bytes()


@pytest.mark.parametrize("dst_format,flags", [
    ("bridge", ["--target-tp", "2"]),
    ("torch_dist", ["--target-tp", "2", "--target-spec", "local"]),
])
def test_bridge_loads_what_dist_convert_writes_from_a_bridge_source(bridge_ckpt, tmp_path, dst_format, flags):
    """Bridge's load_megatron_model of the target (run_config.yaml or args), exported to HF: the source's."""
    hf, src = bridge_ckpt
    dst = tmp_path / "dst"
    ok(run_cli("reshard", str(src), str(dst), "--dst-format", dst_format, *flags, nproc=2))
    it = dst / "iter_0000000"
    if dst_format == "bridge":
        model = yaml.safe_load((it / "run_config.yaml").read_text())["model"]
        assert model["tensor_model_parallel_size"] == 2 and model["num_layers"] == 2, model
        assert (it / "tokenizer" / "tokenizer.json").read_bytes() == (hf / "tokenizer.json").read_bytes()
        assert (it / "train_state.pt").is_file() and (dst / "latest_train_state.pt").is_file()
    out = bridge("load", "--ckpt", str(dst), "--hf", str(hf)).stdout
    assert "ORACLE OK Megatron-Bridge load_megatron_model" in out, out[-3000:]
    ok(run_cli("verify", str(dst), str(src)))


def test_bridge_to_torch_dist_to_bridge_keeps_the_run_config_after_the_source_moved(bridge_ckpt, tmp_path):
    """run_config.yaml travels in the torch_dist target (its origin record, not the source's path): with the
    Bridge checkpoint moved away, the Bridge target still gets its model: section (the target's layout fields
    aside) and its other sections, not one written from the model config."""
    _, src = bridge_ckpt
    moved = tmp_path / "moved" / "mb"
    shutil.copytree(src, tmp_path / "mb")
    mid = tmp_path / "mid"
    ok(run_cli("reshard", str(tmp_path / "mb"), str(mid), "--dst-format", "torch_dist", "--target-tp", "2",
               nproc=2))
    moved.parent.mkdir()
    (tmp_path / "mb").rename(moved)
    dst = tmp_path / "dst"
    ok(run_cli("reshard", str(mid), str(dst), "--dst-format", "bridge", "--target-tp", "1", nproc=2))
    want = yaml.safe_load((src / "iter_0000000" / "run_config.yaml").read_text())
    got = yaml.safe_load((dst / "iter_0000000" / "run_config.yaml").read_text())
    layout = {*PARALLEL, "transformer_layer_spec", "make_vocab_size_divisible_by", "should_pad_vocab",
              "pipeline_dtype"}
    assert {k: v for k, v in got["model"].items() if k not in layout} == \
        {k: v for k, v in want["model"].items() if k not in layout}
    assert got["model"]["tensor_model_parallel_size"] == 1 and got["model"]["hf_model_id"] == \
        want["model"]["hf_model_id"]
    assert {k: got[k] for k in want if k != "model"} == {k: v for k, v in want.items() if k != "model"}
    ok(run_cli("verify", str(dst), str(moved)))


def test_bridge_iteration_without_run_config_is_refused(bridge_ckpt, tmp_path):
    _, src = bridge_ckpt
    broken = tmp_path / "mb"
    shutil.copytree(src, broken)
    (broken / "iter_0000000" / "run_config.yaml").unlink()
    assert_refused(run_cli("reshard", str(broken), str(tmp_path / "dst"), "--dst-format", "hf"), tmp_path,
                   "without run_config.yaml", "--src-format hf")


def test_bridge_target_from_megatron_core_loads_in_bridge(gpt_a, tmp_path):
    """A Bridge target of megatron-core's own save: run_config.yaml written from the model config; Bridge's
    loader builds the GPTModelProvider from it and every weight equals megatron-core's load of gpt_a."""
    dst = tmp_path / "dst"
    ok(run_cli("reshard", str(gpt_a.torch_dist), str(dst), "--dst-format", "bridge", "--target-tp", "1",
               "--target-pp", "1", "--target-spec", "local", nproc=2))
    oracle("dump", 1, "--config", str(gpt_a.config), "--tp", "1", "--pp", "1", "--ckpt", str(gpt_a.torch_dist),
           "--out", str(tmp_path))
    out = bridge("load", "--ckpt", str(dst), "--ref-dump", str(tmp_path / "ref_0_0.pt"), "--true-vocab",
                 str(gpt_a.cfg["vocab_size"])).stdout
    assert "ORACLE OK Megatron-Bridge load_megatron_model (run_config.yaml)" in out, out[-3000:]
