"""NeMo 2 checkpoints as NeMo 2.6.0 itself writes them (tests/oracles/nemo2.py ``make``: NeMo's own
trainer.save_checkpoint of the megatron-core model of fixture gpt_a, config A, at TP=2 PP=1, and its
io_dump of the context with an HF tokenizer) are read by every command and converted; the judges are
code nobody here wrote: megatron-core (a torch_dist target strictly loads and equals gpt_a,
tests/oracles/mcore.py compare), NeMo (a NeMo 2 target's context loads with NeMo's ``load_context`` at the
new layout, NeMo's ``configure_model`` builds the model and megatron-core loads the weights strictly,
equal to gpt_a; also for a NeMo 2 target of megatron-core's torch_dist, whose context dist_convert writes
from the model config) and ModelOpt (speculate's NeMo 2 target restored as NeMo restores it). A NeMo 2.0
context (io.json only, no model.yaml) reads the same model. Bad input (``model.yaml`` without
``config:``, weights without the ``module.`` prefix) is refused in one line.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from conftest import assert_refused, ok, oracle, run_cli


def nemo(cmd: str, nproc: int, *args: str):
    return oracle(cmd, nproc, *args, program="nemo2")


@pytest.fixture(scope="module")
def nemo2_a(gpt_a, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("nemo2")
    nemo("make-tokenizer", 1, "--out", str(root / "tok"))
    nemo("make", 2, "--config", str(gpt_a.config), "--tp", "2", "--pp", "1", "--seed", "1234", "--out",
         str(root / "ckpt"), "--tokenizer", str(root / "tok"))
    return root / "ckpt"


def test_nemo2_source_to_torch_dist_is_megatron_cores_model(nemo2_a, gpt_a, tmp_path):
    info = json.loads(ok(run_cli("inspect", str(nemo2_a), "--json")).stdout)
    assert info["format"] == "nemo2" and (info["layout"]["tp"], info["layout"]["pp"]) == (2, 1), info
    assert info["config"]["vocab_size"] == 100, info["config"]  # from the tokenizer, as NeMo sizes it
    dst = tmp_path / "dst"
    ok(run_cli("reshard", str(nemo2_a), str(dst), "--dst-format", "torch_dist", "--target-tp", "1", nproc=2))
    judged = oracle("compare", 1, "--config", str(gpt_a.config), "--tp", "1", "--pp", "1", "--ckpt", str(dst),
                    "--ref", str(gpt_a.torch_dist))
    assert "ORACLE OK" in judged.stdout, judged.stdout[-2000:]


@pytest.mark.parametrize("source", ["nemo2", "torch_dist"])
def test_nemo2_target_loads_in_nemo_at_the_new_layout(nemo2_a, gpt_a, tmp_path, source):
    """From NeMo 2 the context is carried; from megatron-core's torch_dist it is written from the model config
    (with --tokenizer-dir): either way NeMo's load_context builds it at TP=1 PP=2 and the weights load."""
    dst = tmp_path / "dst"
    src, extra = (nemo2_a, []) if source == "nemo2" else \
        (gpt_a.torch_dist, ["--dst-format", "nemo2", "--tokenizer-dir", str(nemo2_a.parent / "tok")])
    ok(run_cli("reshard", str(src), str(dst), "--target-tp", "1", "--target-pp", "2", *extra, nproc=2))
    config = yaml.safe_load((dst / "context" / "model.yaml").read_text())["config"]
    assert config.get("vocab_size") is None  # NeMo sizes the embedding from the tokenizer, padded
    oracle("dump", 2, "--config", str(gpt_a.config), "--tp", "1", "--pp", "2", "--ckpt", str(gpt_a.torch_dist),
           "--out", str(tmp_path))
    judged = nemo("load", 2, "--ckpt", str(dst), "--ref-dump", str(tmp_path), "--tp", "1", "--pp", "2",
                  "--expect-tokenizer")
    assert "ORACLE OK" in judged.stdout and "TP=1 PP=2" in judged.stdout, judged.stdout[-2000:]


def test_nemo20_context_without_model_yaml_and_hf_export_with_the_tokenizer(nemo2_a, gpt_a, tmp_path):
    """io.json alone (NeMo 2.0) gives the same model; HF export carries the tokenizer artifacts."""
    old = tmp_path / "nemo20"
    shutil.copytree(nemo2_a, old)
    (old / "context" / "model.yaml").unlink()
    ok(run_cli("verify", str(old), str(gpt_a.torch_dist)))
    dst = tmp_path / "hf"
    ok(run_cli("reshard", str(old), str(dst), "--dst-format", "hf"))
    tok = next(p for p in (nemo2_a / "context").rglob("tokenizer.json"))
    assert (dst / "tokenizer.json").read_bytes() == tok.read_bytes()
    ok(run_cli("verify", str(dst), str(gpt_a.torch_dist)))


def prefixless(weights: Path, out: Path) -> Path:
    """A copy of a NeMo 2 checkpoint whose weights lost the ``module.`` prefix (a plain megatron-core save)."""
    md = FileSystemReader(str(weights)).read_metadata()
    sd = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()
          if isinstance(v, TensorStorageMetadata)}
    dcp.load(sd, storage_reader=FileSystemReader(str(weights)), no_dist=True)
    writer = FileSystemWriter(str(out / "weights"))
    dcp.save({k.removeprefix("module."): v for k, v in sd.items()}, storage_writer=writer, no_dist=True)
    for name in ("common.pt", "metadata.json"):
        shutil.copy(weights / name, out / "weights" / name)
    return out


def test_nemo2_bad_input_is_refused(nemo2_a, gpt_a, tmp_path):
    broken = tmp_path / "noconfig"
    shutil.copytree(nemo2_a, broken)
    (broken / "context" / "model.yaml").write_text(yaml.safe_dump({"_target_": "GPTModel"}))
    assert_refused(run_cli("reshard", str(broken), str(tmp_path / "dst"), "--dst-format", "hf"), tmp_path,
                   "model.yaml has no config:")
    plain = prefixless(nemo2_a / "weights", tmp_path / "plain")
    shutil.copytree(nemo2_a / "context", plain / "context")
    assert_refused(run_cli("reshard", str(plain), str(tmp_path / "dst"), "--dst-format", "hf"), tmp_path,
                   "lack the prefix 'module.'", "--src-format torch_dist")


def test_speculate_on_a_nemo2_model_writes_nemo2_that_modelopt_restores(nemo2_a, gpt_a, tmp_path):
    """EAGLE-3 added to the NeMo 2 model: weights/ with the draft and modelopt_state/, context/ carried; NeMo's
    restore path (ModelOpt's restore_sharded_modelopt_state with prefix module.) and megatron-core load it."""
    dst = tmp_path / "spec"
    ok(run_cli("speculate", str(nemo2_a), str(dst), "--eagle-layers", "1", nproc=2))
    assert (dst / "weights" / "modelopt_state").is_dir() and not (dst / "latest_checkpointed_iteration.txt").exists()
    config = yaml.safe_load((dst / "context" / "model.yaml").read_text())["config"]
    assert (config["tensor_model_parallel_size"], config["pipeline_model_parallel_size"]) == (2, 1), config
    proc = oracle("check", 2, "--config", str(gpt_a.config), "--tp", "2", "--pp", "1", "--algo", "eagle",
                  "--ckpt", str(dst), "--ref", str(gpt_a.torch_dist), "--nemo2", program="spec", check=False)
    assert proc.returncode == 0 and "SPEC ORACLE OK" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    assert "draft tokens" in proc.stdout
    assert_refused(run_cli("speculate", str(dst), str(tmp_path / "dst"), "--eagle-layers", "1"), tmp_path,
                   "already a speculative model")
    assert_refused(run_cli("reshard", str(dst), str(tmp_path / "dst"), "--dst-format", "hf"), tmp_path,
                   "ModelOpt checkpoint")
