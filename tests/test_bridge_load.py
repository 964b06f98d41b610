"""Targets that other loaders load by their args alone: Megatron-Bridge 0.6.2's loader for Megatron-LM
checkpoints (``load_megatron_model``) builds the model from a torch_dist target's args and loads it, and
every weight equals the reference (the HF source through Bridge's own HF export, or megatron-core's load);
Megatron-LM 0.19 (megatron-core 0.19.2's megatron.training) unpickles the args with weights_only, runs
``--use-checkpoint-args`` and ``check_checkpoint_args``, and its TransformerConfig is the model's. The
oracle (tests/oracles/bridge.py) runs in the second runtime and never imports dist_convert.

Bridge's loader reads the common state through ``dist_checkpointing.load_common_state_dict``, which reads
the 0.16-style ``common.pt`` dist_convert writes (and the 0.19 ``common_state`` item): it needs no 0.19 style.
CPU only: targets use local layer specs (``--target-spec local``); a Transformer Engine target needs TE to
be built by either loader.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from dist_convert.mlm_args import ARGS

from conftest import ok, oracle, run_cli
from hf_models import oracle_config

# case -> (source, reshard flags, nproc of the conversion, reference)
CASES = {
    "hf_llama_tp1": ("hf", ["--dst-format", "torch_dist", "--target-tp", "1", "--target-spec", "local"], None, "hf"),
    "gpt_a_tp2pp2_to_tp1pp1": ("gpt_a", ["--target-tp", "1", "--target-pp", "1"], 4, "mcore"),
}
# table rows whose default is Megatron-LM's after validate_args, or a name Megatron-LM 0.19 no longer has
POST_VALIDATE = {"consumed_train_samples", "skipped_train_samples", "consumed_valid_samples"}


def bridge(cmd: str, *args: str):
    return oracle(cmd, 1, *args, program="bridge", runtime="mcore19")


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hf")
    bridge("make-hf", "--root", str(root))
    return root / "llama"


@pytest.mark.parametrize("case", sorted(CASES))
def test_bridge_and_megatron_lm_load_target(case, request, tmp_path):
    source, flags, nproc, ref = CASES[case]
    if source == "hf":
        hf_llama = request.getfixturevalue("hf_llama")
        src, config, null_tok = hf_llama, tmp_path / "config.json", []
        config.write_text(json.dumps(oracle_config(hf_llama)))
    else:
        gpt = request.getfixturevalue(source)
        src, config, null_tok = gpt.torch_dist, gpt.config, ["--null-tokenizer"]  # megatron-core made: no tokenizer
    dst = tmp_path / "dst"
    ok(run_cli("reshard", str(src), str(dst), *flags, nproc=nproc))
    if ref == "hf":
        reference = ["--hf", str(src)]
    else:
        oracle("dump", 1, "--config", str(config), "--tp", "1", "--pp", "1", "--ckpt", str(dst), "--out", str(tmp_path))
        reference = ["--ref-dump", str(tmp_path / "ref_0_0.pt")]
    out = bridge("load", "--ckpt", str(dst), *reference, *null_tok).stdout
    assert "ORACLE OK Megatron-Bridge load_megatron_model (local, TP=1)" in out, out[-3000:]
    out = bridge("mlm", "--ckpt", str(dst), "--config", str(config), *null_tok).stdout
    assert "ORACLE OK Megatron-LM" in out, out[-3000:]


def test_table_defaults_are_megatron_lm_defaults(tmp_path):
    """Every kept-or-filled row of mlm_args.ARGS has Megatron-LM 0.19's own argparse default."""
    bridge("defaults", "--out", str(tmp_path / "d.json"))
    mlm = json.loads((tmp_path / "d.json").read_text())
    rows = [a for a in ARGS if a.source == "" and a.name not in POST_VALIDATE]
    wrong = {a.name: (a.default, mlm.get(a.name, "<absent>")) for a in rows if mlm.get(a.name, "<absent>") != a.default}
    assert not wrong, wrong
