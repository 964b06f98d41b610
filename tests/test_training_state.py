"""Checkpoints as a training run leaves them (tests/oracles/train.py: megatron-core DDP with the distributed
optimizer, two Adam steps, saved the way Megatron-LM's save_checkpoint does) under megatron-core 0.16.1 and
0.19.2: torch_dist with dp_reshardable or fully_reshardable optimizer state, RNG state and (0.19) rerun state,
and legacy ``--ckpt-format torch`` rank files with ``distrib_optim.pt``. The real CLI converts each; the target
must hold the trained weights bit-exactly (mcore_oracle compare, strict load, against the trained model's own
weights), say in one ``note:`` line of its log what training state it dropped, hold none of it, and record that in its
args (``no_save_optim``, ``no_save_rng``) with the new layout sizes, world size and data-parallel size."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from training_runs import WORLD

from conftest import ok, oracle, run_cli


def inspect(path: Path, runtime: str, tmp_path: Path, world: int = WORLD) -> dict:
    """What the checkpoint holds (train_oracle inspect: rank 0 reads, in the oracle worker of ``world`` ranks)."""
    out = tmp_path / f"inspect-{path.name}.json"
    oracle("inspect", world, "--ckpt", str(path), "--out", str(out), program="train", runtime=runtime)
    return json.loads(out.read_text())


def test_oracle_saves_training_state(trained, tmp_path):
    """What the oracle wrote is what Megatron-LM writes: the key families and common state per version."""
    for runtime, new in (("default", False), ("mcore19", True)):
        run = trained(runtime, "tp2")
        dp = inspect(run.source("dp_reshardable"), runtime, tmp_path)
        keys = dp["keys"]
        assert any(k.startswith("optimizer.distributed.dp_group_idx_1.gbuf_idx_0.dtype_") and k.endswith(".exp_avg")
                   for k in keys), keys
        assert "rng_state/shard_0.1_1.2" in keys
        assert ("common_state/shard_0_1" in keys) == new and ("common.pt" in dp["files"]) != new
        assert any(k.startswith("rerun_state_machine_state/") for k in keys) == new
        for k in ("args", "iteration", "checkpoint_version", "opt_param_scheduler", "content_metadata",
                  "num_floating_point_operations_so_far", "optimizer"):
            assert k in dp["common_keys"], (k, dp["common_keys"])
        assert dp["args"]["no_save_optim"] is None and dp["args"]["world_size"] == WORLD
        full = inspect(run.source("fully_reshardable"), runtime, tmp_path)
        assert "optimizer.state.exp_avg.embedding.word_embeddings.weight" in full["keys"]
        legacy = inspect(run.source("torch"), runtime, tmp_path)
        assert {"mp_rank_00/distrib_optim.pt", "mp_rank_01/model_optim_rng.pt"} <= set(legacy["files"])
        assert {"optimizer", "opt_param_scheduler", "rng_state"} <= set(legacy["keys"])
    moe = inspect(trained("default", "moe-ep2").source("dp_reshardable"), "default", tmp_path)
    assert "rng_state/shard_0.0.1_1.1.2" in moe["keys"]  # megatron-core < 0.17 with EP > 1: (pp, tp, dp)
    assert any(k.startswith("chained_1.optimizer.distributed.") for k in moe["keys"])


# (id, runtime, run, save kind, reshard flags, nproc, target (tp, pp, ep)). The 0.19 targets are laid out
# for two ranks so that their checks run in the 0.19 oracle worker the training run started.
CASES = [
    ("0.16-tp2-dp_reshardable-tp1", "default", "tp2", "dp_reshardable", ["--target-tp", "1"], 2, (1, 1, 1)),
    ("0.16-tp2-fully_reshardable-megatron-tp1", "default", "tp2", "fully_reshardable",
     ["--target-tp", "1", "--dst-format", "megatron"], 2, (1, 1, 1)),
    ("0.16-tp2-torch-tp1", "default", "tp2", "torch", ["--target-tp", "1"], 2, (1, 1, 1)),
    ("0.16-moe-ep2-dp_reshardable-ep1", "default", "moe-ep2", "dp_reshardable",
     ["--target-tp", "1", "--target-ep", "1"], 4, (1, 1, 1)),
    ("0.16-moe-ep2-torch-torch_dist-ep1", "default", "moe-ep2", "torch",
     ["--target-ep", "1", "--dst-format", "torch_dist"], 2, (1, 1, 1)),
    ("0.19-tp2-dp_reshardable-tp1pp2", "mcore19", "tp2", "dp_reshardable",
     ["--target-tp", "1", "--target-pp", "2"], 2, (1, 2, 1)),
    ("0.19-tp2-fully_reshardable-megatron-tp1pp2", "mcore19", "tp2", "fully_reshardable",
     ["--target-tp", "1", "--target-pp", "2", "--dst-format", "megatron"], 2, (1, 2, 1)),
    ("0.19-tp2-torch-torch_dist-tp1pp2", "mcore19", "tp2", "torch",
     ["--target-tp", "1", "--target-pp", "2", "--dst-format", "torch_dist"], 2, (1, 2, 1)),
    ("0.19-dp2-dp_reshardable-tp2", "mcore19", "dp2", "dp_reshardable", ["--target-tp", "2"], 4, (2, 1, 1)),
    ("0.19-dp2-fully_reshardable-megatron-tp1pp2", "mcore19", "dp2", "fully_reshardable",
     ["--target-tp", "1", "--target-pp", "2", "--dst-format", "megatron"], 2, (1, 2, 1)),
]
TRAINING_KEYS = ("optimizer.", "chained_", "rng_state", "rerun_state_machine_state")
TRAINING_COMMON = ("optimizer", "rng_state", "rerun_state_machine")


@pytest.mark.parametrize("runtime,name,kind,flags,nproc,target", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_training_checkpoint_converts(trained, tmp_path, runtime, name, kind, flags, nproc, target):
    """Convert a trained checkpoint; the target holds the trained weights, one note names the training state
    dropped (optimizer, RNG, and the rerun state where 0.18+ saved it), none of it remains, and the args say so.
    Every check runs; the failure lists all that did not hold."""
    run = trained(runtime, name)
    src, dst = run.source(kind), tmp_path / "dst"
    proc = ok(run_cli("reshard", str(src), str(dst), *flags, nproc=nproc))
    tp, pp, ep = target
    layout = ["--tp", str(tp), "--pp", str(pp)] + (["--ep", str(ep)] if "num_experts" in run.cfg else [])
    res = oracle("compare", tp * pp, "--config", str(run.config), *layout, "--ckpt", str(dst),
                 "--ref", str(run.reference), "--check-args", runtime=runtime)
    assert "ORACLE OK" in res.stdout, res.stdout[-3000:]

    problems = []
    log = proc.stdout + proc.stderr  # rank 0's log lines (dist_convert.runtime logs to stderr)
    notes = [ln for ln in log.splitlines() if ln.startswith("note:")]
    dropped = ["optimizer", "rng"] + (["rerun"] if runtime == "mcore19" and kind != "torch" else [])
    if len(notes) != 1 or not all(w in notes[0].lower() for w in dropped):
        problems.append(f"want one note: line naming {dropped}, got {notes}")
    got = inspect(dst, runtime, tmp_path, tp * pp)
    if left := [k for k in got["keys"] if k.startswith(TRAINING_KEYS)]:
        problems.append(f"training state kept: {left[:4]}")
    if left := [k for k in got["common_keys"] if k in TRAINING_COMMON]:
        problems.append(f"training state kept in the common state: {left}")
    if left := [f for f in got["files"] if f.endswith("distrib_optim.pt")]:
        problems.append(f"optimizer files kept: {left}")
    want = {"no_save_optim": True, "no_save_rng": True, "tensor_model_parallel_size": tp,
            "pipeline_model_parallel_size": pp, "world_size": tp * pp, "data_parallel_size": 1}
    if bad := {k: got["args"][k] for k in want if got["args"][k] != want[k]}:
        problems.append(f"target args {bad}, want {want}")
    assert not problems, problems
