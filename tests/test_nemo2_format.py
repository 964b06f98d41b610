"""NeMo 2 checkpoints (``weights/`` with ``module.``-prefixed keys + ``context/``), in the layout NeMo
2.x writes: the weights are megatron-core's own save of fixture gpt_a (config A at TP=2 PP=2), re-keyed
with the ``module.`` prefix by torch.distributed.checkpoint (as NeMo's MegatronParallel names them), the
common state Lightning's, and ``context/model.yaml`` the model's GPTConfig fields. Judged by
megatron-core: a torch_dist target strictly loads and equals gpt_a (tests/mcore_oracle.py compare), and
a NeMo 2 target at another layout carries the context with the new TP/PP and equals the source. Bad
input (``model.yaml`` without ``config:``, weights without the prefix) is refused in one line.
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

ITER = "iter_0000100"


def nemo_config(cfg: dict, tp: int, pp: int) -> dict:
    """GPTConfig fields of config A as NeMo's model.yaml stores them (vocab_size null)."""
    return {"_target_": "nemo.collections.llm.gpt.model.base.GPTConfig", "num_layers": cfg["num_layers"],
            "hidden_size": cfg["hidden_size"], "ffn_hidden_size": cfg["ffn_hidden_size"],
            "num_attention_heads": cfg["num_attention_heads"], "num_query_groups": cfg["num_query_groups"],
            "gated_linear_unit": cfg["swiglu"],
            "activation_func": {"_call_": False, "_target_": "torch.nn.functional.silu"},
            "normalization": cfg["normalization"], "add_bias_linear": cfg["add_bias_linear"],
            "add_qkv_bias": cfg["add_qkv_bias"],
            "share_embeddings_and_output_weights": not cfg["untie_embeddings_and_output_weights"],
            "position_embedding_type": cfg["position_embedding_type"], "seq_length": cfg["seq_length"],
            "make_vocab_size_divisible_by": cfg["make_vocab_size_divisible_by"], "vocab_size": None,
            "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
            "params_dtype": {"_call_": False, "_target_": "torch.float32"}}


def nemo2_from(torch_dist: Path, cfg: dict, tp: int, pp: int, out: Path, prefix: str = "module.") -> Path:
    """A NeMo 2 directory holding megatron-core's save ``torch_dist`` with every key prefixed."""
    it = torch_dist / ITER
    md = FileSystemReader(str(it)).read_metadata()
    sd = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()
          if isinstance(v, TensorStorageMetadata)}
    dcp.load(sd, storage_reader=FileSystemReader(str(it)), no_dist=True)
    weights = out / "weights"
    dcp.save({prefix + k: v for k, v in sd.items()}, storage_writer=FileSystemWriter(str(weights)), no_dist=True)
    torch.save({"epoch": 0, "global_step": 100, "state_dict": {}, "pytorch-lightning_version": "2.5.6"},
               weights / "common.pt")
    (weights / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                                       "common_backend": "torch", "common_backend_version": 1}))
    (out / "context").mkdir()
    (out / "context" / "model.yaml").write_text(yaml.safe_dump(
        {"_target_": "nemo.collections.llm.gpt.model.base.GPTModel", "config": nemo_config(cfg, tp, pp)}))
    return out


@pytest.fixture(scope="module")
def nemo2_a(gpt_a, tmp_path_factory) -> Path:
    return nemo2_from(gpt_a.torch_dist, gpt_a.cfg, gpt_a.tp, gpt_a.pp, tmp_path_factory.mktemp("nemo2") / "ckpt")


def test_nemo2_source_to_torch_dist_is_megatron_cores_model(nemo2_a, gpt_a, tmp_path):
    info = json.loads(ok(run_cli("inspect", str(nemo2_a), "--json")).stdout)
    assert info["format"] == "nemo2" and (info["layout"]["tp"], info["layout"]["pp"]) == (2, 2), info
    dst = tmp_path / "dst"
    ok(run_cli("reshard", str(nemo2_a), str(dst), "--dst-format", "torch_dist", "--target-pp", "1",
               "--vocab-size", "100", nproc=2))
    judged = oracle("compare", 2, "--config", str(gpt_a.config), "--tp", "2", "--pp", "1", "--ckpt", str(dst),
                    "--ref", str(gpt_a.torch_dist))
    assert "ORACLE OK" in judged.stdout, judged.stdout[-2000:]


def test_nemo2_target_carries_the_context_with_the_new_layout(nemo2_a, gpt_a, tmp_path):
    dst = tmp_path / "dst"
    ok(run_cli("reshard", str(nemo2_a), str(dst), "--target-tp", "1", "--target-pp", "2", "--vocab-size", "100",
               nproc=2))
    config = yaml.safe_load((dst / "context" / "model.yaml").read_text())["config"]
    assert (config["tensor_model_parallel_size"], config["pipeline_model_parallel_size"]) == (1, 2), config
    assert config["vocab_size"] is None  # NeMo sizes the embedding from the tokenizer, padded
    md = FileSystemReader(str(dst / "weights")).read_metadata().state_dict_metadata
    assert all(k.startswith("module.") for k in md), sorted(md)[:3]
    ok(run_cli("verify", str(dst), str(gpt_a.torch_dist), "--vocab-size", "100"))


def test_nemo2_bad_input_is_refused(nemo2_a, gpt_a, tmp_path):
    broken = tmp_path / "noconfig"
    shutil.copytree(nemo2_a, broken)
    (broken / "context" / "model.yaml").write_text(yaml.safe_dump({"_target_": "GPTModel"}))
    assert_refused(run_cli("reshard", str(broken), str(tmp_path / "dst"), "--dst-format", "hf"), tmp_path,
                   "model.yaml has no config:")
    plain = nemo2_from(gpt_a.torch_dist, gpt_a.cfg, 2, 2, tmp_path / "plain", prefix="")
    assert_refused(run_cli("reshard", str(plain), str(tmp_path / "dst"), "--dst-format", "hf"), tmp_path,
                   "lack the prefix 'module.'", "--src-format torch_dist")
    assert_refused(run_cli("reshard", str(gpt_a.torch_dist), str(tmp_path / "dst"), "--dst-format", "nemo2"),
                   tmp_path, "needs the context/ of a NeMo 2 source", "--dst-format bridge")


def test_speculate_on_a_nemo2_model_writes_nemo2_that_modelopt_restores(nemo2_a, gpt_a, tmp_path):
    """EAGLE-3 added to the NeMo 2 model: weights/ with the draft and modelopt_state/, context/ carried; NeMo's
    restore path (ModelOpt's restore_sharded_modelopt_state with prefix module.) and megatron-core load it."""
    dst = tmp_path / "spec"
    ok(run_cli("speculate", str(nemo2_a), str(dst), "--target-tp", "2", "--target-pp", "1", "--eagle-layers", "1",
               "--vocab-size", "100", nproc=2))
    assert (dst / "weights" / "modelopt_state").is_dir() and not (dst / "latest_checkpointed_iteration.txt").exists()
    config = yaml.safe_load((dst / "context" / "model.yaml").read_text())["config"]
    assert (config["tensor_model_parallel_size"], config["pipeline_model_parallel_size"]) == (2, 1), config
    proc = oracle("check", 2, "--config", str(gpt_a.config), "--tp", "2", "--pp", "1", "--algo", "eagle",
                  "--ckpt", str(dst), "--ref", str(gpt_a.torch_dist), "--nemo2", program="spec", check=False)
    assert proc.returncode == 0 and "SPEC ORACLE OK" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    assert "draft tokens" in proc.stdout
