"""Nemotron-H (``NemotronHForCausalLM``) targets loaded by megatron-core **0.16.1**'s ``MambaModel`` (the default
runtime; tests/test_nemotron_h.py judges on 0.19.2 through Megatron-Bridge).

transformers makes the tiny random model (tests/oracles/nemotron_h.py ``make``, in the second runtime); the real CLI
converts it to a TP2 torch_dist target, a TP2 legacy target (megatron-core 0.16 names by default: the Mamba conv as
``mixer.conv1d.weight`` / ``.bias``) and a TP1 PP2 legacy target. tests/oracles/mamba16.py builds 0.16.1's MambaModel
from the HF config by its own mapping and loads each target strictly (torch_dist: dist_checkpointing with
RAISE_ALL; legacy: each rank's own file, every key); every loaded tensor must equal the HF tensors mapped and cut to
the rank's TP shard by the oracle's own mapping, bit for bit, and at PP 1 the logits must equal transformers' within
1e-4. A legacy target written for megatron-core 0.19 (``--mcore-style 0.19``: ``conv1d_weight`` names) must fail.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import ok, oracle, run_cli

UNPADDED = ["--make-vocab-size-divisible-by", "1"]  # 300 rows, as the HF model (and the oracle's model) has
TARGETS = {
    "td_tp2": ["--dst-format", "torch_dist", "--target-tp", "2", *UNPADDED],
    "legacy_tp2": ["--dst-format", "megatron", "--target-tp", "2", *UNPADDED],  # default: megatron-core 0.16 names
    "legacy_tp2_mcore19": ["--dst-format", "megatron", "--target-tp", "2", "--mcore-style", "0.19", *UNPADDED],
    "legacy_pp2": ["--dst-format", "megatron", "--target-tp", "1", "--target-pp", "2", *UNPADDED],
}


def verdicts(proc) -> dict[str, dict]:
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {Path(v["ckpt"]).name: v for v in lines if "ckpt" in v}


def judge(*args: str):
    return oracle("judge", 2, *args, program="mamba16", check=False)


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("nemotron_h_mcore16")
    oracle("make", 1, str(root / "hf"), program="nemotron_h", runtime="mcore19")
    for name, flags in TARGETS.items():
        ok(run_cli("reshard", str(root / "hf"), str(root / name), *flags, nproc=2))
    return root


def test_tp2_targets_load_into_mcore16_mamba_model(converted):
    """At TP 2: the torch_dist and the (0.16-named) legacy target load strictly, equal the HF tensors on every rank
    and give transformers' logits; the legacy target with megatron-core 0.19's conv names does not load."""
    names = ["td_tp2", "legacy_tp2", "legacy_tp2_mcore19"]
    proc = judge("--hf", str(converted / "hf"), "--tp", "2", *(str(converted / n) for n in names))
    got = verdicts(proc)
    assert set(got) == set(names), proc.stdout[-3000:] + proc.stderr[-3000:]
    for n in names[:2]:
        assert got[n]["ok"] and got[n]["loaded_tensors"] > 0, got[n]
        assert got[n]["logits_max_abs_diff_vs_hf"] < 1e-4, got[n]
    assert (got["td_tp2"]["format"], got["legacy_tp2"]["format"]) == ("torch_dist", "legacy")
    bad = got["legacy_tp2_mcore19"]
    assert not bad["ok"] and proc.returncode != 0, bad  # the judge can fail
    assert any("unexpected decoder.layers.0.mixer.conv1d_weight" in p for p in bad["problems"]), bad["problems"]


def test_pp2_legacy_loads_into_mcore16_mamba_model(converted):
    """At TP 1 PP 2: each stage loads its own rank file (local layer numbers) and equals the HF tensors."""
    proc = judge("--hf", str(converted / "hf"), "--tp", "1", "--pp", "2", str(converted / "legacy_pp2"))
    got = verdicts(proc)
    assert proc.returncode == 0 and set(got) == {"legacy_pp2"}, proc.stdout[-3000:] + proc.stderr[-3000:]
    v = got["legacy_pp2"]
    assert v["ok"] and v["loaded_tensors"] > 0 and (v["stored_tp"], v["stored_pp"]) == (1, 2), v
