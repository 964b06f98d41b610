"""``reshard --optimizer``: training resumes at a new layout. The oracle is megatron-core's own DistributedOptimizer
(tests/oracles/train.py): trained checkpoints (tests/training_runs.py) in every optimizer layout it saves are
converted by the real CLI; ``train_oracle resume`` loads each strictly at the new layout (model, optimizer,
scheduler) and requires the master parameters, both Adam moments, steps and learning rates to equal, bit for bit,
those of the truth (megatron-core loading its own one-bucket fully_reshardable save at that layout, or, for the
multi-bucket run whose fully_reshardable save megatron-core shifts, its own dp_reshardable save resharded over DP),
and one more training step to give the same loss bit for bit."""
from __future__ import annotations

import shutil

import pytest
import torch
from training_runs import WORLD

from conftest import assert_refused, ok, oracle, run_cli

# (id, runtime, run, truth: the source kind megatron-core loads at the new layout, converted kinds, reshard flags,
# resume layout flags, resume world)
CASES = [
    # TP 2 -> 1 (DP 1 -> 2) from every layout megatron-core 0.16 saves
    ("0.16-tp2-to-tp1", "default", "tp2", "fully_reshardable", ("dp_reshardable", "fully_reshardable", "torch"),
     ["--target-tp", "1"], ["--tp", "1"], WORLD),
    # PP 1 -> 2 (loaded and compared; no training step at PP > 1 on CPU)
    ("0.16-tp2-to-pp2", "default", "tp2", "fully_reshardable", ("dp_reshardable",),
     ["--target-tp", "1", "--target-pp", "2"], ["--tp", "1", "--pp", "2"], WORLD),
    # five buckets per buffer, DP 2 -> 1 (megatron-core 0.19 reshards its own dp_reshardable save over DP)
    ("0.19-buckets-dp2-to-dp1", "mcore19", "dp2", "dp_reshardable", ("dp_reshardable", "torch"), [], ["--tp", "1"], 1),
]


def convert(run, kind: str, dst, flags: list[str]) -> str:
    extra = ["--dst-format", "torch_dist"] if kind == "torch" else []
    proc = ok(run_cli("reshard", str(run.source(kind) if kind else dst[0]), str(dst[-1]), *flags, *extra,
                      "--optimizer", nproc=WORLD, runtime=run.runtime))
    dropped = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.startswith("note: dropped")]
    assert all("besides the optimizer" in n for n in dropped), dropped
    return str(dst[-1])


def resume(run, layout: list[str], world: int, ckpts: list[str]) -> None:
    res = oracle("resume", world, "--config", str(run.config), *layout, "--seed", "4321",
                 *[f"--ckpt={c}" for c in ckpts], *(["--bucket-size", str(run.bucket_size)] if run.bucket_size else []),
                 program="train", runtime=run.runtime)
    assert f"RESUME ORACLE OK ckpts={len(ckpts)}" in res.stdout, res.stdout[-4000:]


@pytest.mark.parametrize("runtime,name,truth,kinds,flags,layout,world", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_training_resumes_at_the_new_layout(trained, tmp_path, runtime, name, truth, kinds, flags, layout, world):
    run = trained(runtime, name)
    converted = [convert(run, kind, [tmp_path / f"from-{kind}"], flags) for kind in kinds]
    resume(run, layout, world, [str(run.source(truth)), *converted])


def test_moe_training_resumes_at_another_ep(trained, tmp_path):
    """MoE EP 2 -> 1: the experts' chained optimizer joins the dense one. megatron-core cannot load its own EP=2
    fully_reshardable save at EP=1 (its optimizers chain differently), so the EP=1 conversions of all three
    sources must agree and train; converted back to EP=2 they equal megatron-core's own state there."""
    run = trained("default", "moe-ep2")
    ep1 = [convert(run, kind, [tmp_path / f"from-{kind}"], ["--target-ep", "1"])
           for kind in ("fully_reshardable", "dp_reshardable", "torch")]
    resume(run, ["--tp", "1", "--ep", "1"], WORLD, ep1)
    back = convert(run, None, [ep1[1], tmp_path / "back-to-ep2"], ["--target-ep", "2"])
    resume(run, ["--tp", "1", "--ep", "2"], WORLD, [str(run.source("fully_reshardable")), back])


def resumed_losses(proc) -> list[float]:
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESUME ORACLE OK"))
    return [float(x) for x in line.split("losses=[", 1)[1].split("]", 1)[0].split(",")]


def test_training_resumes_in_the_hybrid_model(trained, tmp_path):
    """--optimizer with --target-model hybrid: each parameter's master copy and Adam moments follow it to its
    HybridModel name. megatron-core 0.19.2's HybridModel (its own hybrid stack spec, built from the target's args:
    tests/oracles/hybrid.py) loads model, optimizer and scheduler strictly at TP1 DP2 (every main-param and moment
    tensor written by the load) and its next two training steps give GPTModel's losses resumed from the run itself
    within 1e-5 (the second step's depends on the moments: lr 1e-2); back to GPT, the state equals the run's bit for
    bit and trains to the same losses bit for bit."""
    run = trained("mcore19", "tp2")
    hybrid = convert(run, "fully_reshardable", [tmp_path / "hybrid"], ["--target-model", "hybrid", "--target-tp", "1"])
    back = convert(run, None, [hybrid, tmp_path / "back"], ["--target-model", "gpt", "--target-spec", "local"])
    common = ["--config", str(run.config), "--tp", "1", "--seed", "4321", "--steps", "2"]
    truth = oracle("resume", WORLD, *common, f"--ckpt={run.source('fully_reshardable')}", f"--ckpt={back}",
                   program="train", runtime=run.runtime)
    got = oracle("resume", WORLD, *common, f"--ckpt={hybrid}", "--hybrid", program="train", runtime=run.runtime)
    want, have = resumed_losses(truth), resumed_losses(got)
    assert len(want) == len(have) == 2 and all(abs(w - h) < 1e-5 for w, h in zip(want, have, strict=True)), \
        (want, have)


def test_optimizer_state_is_checked_against_the_checkpoint(trained, tmp_path):
    """A dp_reshardable source whose args do not describe its bucket layout is refused in one line (never
    guessed); so are --optimizer into a format without optimizer state and a source that holds none."""
    run = trained("default", "tp2")
    src = tmp_path / "src"
    shutil.copytree(run.source("dp_reshardable"), src)
    common = next(src.glob("iter_*/common.pt"))
    state = torch.load(common, weights_only=False)
    state["args"].overlap_grad_reduce, state["args"].ddp_bucket_size = True, 5000
    torch.save(state, common)
    assert_refused(run_cli("reshard", str(src), str(tmp_path / "dst"), "--target-tp", "1", "--optimizer"), tmp_path,
                   "bucket sizes", "--optimizer")
    assert_refused(run_cli("reshard", str(run.source("dp_reshardable")), str(tmp_path / "dst"), "--dst-format", "hf",
                           "--optimizer"), tmp_path, "--dst-format torch_dist")
    assert_refused(run_cli("reshard", str(run.reference), str(tmp_path / "dst"), "--target-tp", "1", "--optimizer"),
                   tmp_path, "no optimizer state", "drop --optimizer")
    legacy = tmp_path / "legacy"
    shutil.copytree(run.source("torch"), legacy)
    next(legacy.glob("iter_*/mp_rank_01/distrib_optim.pt")).unlink()
    assert_refused(run_cli("reshard", str(legacy), str(tmp_path / "dst"), "--target-tp", "1", "--dst-format",
                           "torch_dist", "--optimizer"), tmp_path, "distrib_optim.pt is missing")
