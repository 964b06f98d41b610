"""Bad input: a one-line error naming the cause and the fix, a non-zero exit, no complete-looking DST."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from conftest import assert_refused, ok, run_cli

ITER = "iter_0000100"


def damaged(src: Path, tmp_path: Path, fn) -> Path:
    copy = tmp_path / "src"
    shutil.copytree(src, copy)
    fn(copy / ITER)
    return copy


def edit_rank_file(rank_dir: str, edit):
    def fn(it: Path) -> None:
        f = it / rank_dir / "model_optim_rng.pt"
        ck = torch.load(f, weights_only=False)
        edit(ck)
        torch.save(ck, f)
    return fn


def _set_arg(name, value):
    return lambda ck: setattr(ck["args"], name, value)


DAMAGE = {
    "missing rank directory": (lambda it: shutil.rmtree(it / "mp_rank_01_001"), ["mp_rank_01_001 is missing"]),
    "disagreeing shapes": (edit_rank_file("mp_rank_01_000", lambda ck: ck["model"].__setitem__(
        "decoder.layers.0.mlp.linear_fc2.weight", torch.zeros(64, 40))), ["has shape (64, 40)", "expected (64, 48)"]),
    "unknown key": (edit_rank_file("mp_rank_00_000", lambda ck: ck["model"].__setitem__(
        "decoder.layers.0.mlp.router.weight", torch.zeros(4, 64))), ["unexpected tensors", "router"]),
    "missing key": (edit_rank_file("mp_rank_00_001", lambda ck: ck["model"].pop("decoder.final_layernorm.weight")),
                    ["missing tensors", "final_layernorm"]),
    "truncated file": (lambda it: (it / "mp_rank_00_001" / "model_optim_rng.pt").write_bytes(
        (it / "mp_rank_00_001" / "model_optim_rng.pt").read_bytes()[:5000]), ["corrupt or truncated"]),
    "untrusted pickle": (edit_rank_file("mp_rank_00_000", lambda ck: ck.__setitem__("x", shutil.Error("boom"))),
                         ["allow-list", "--trust-pickle"]),
}


@pytest.mark.parametrize("what", list(DAMAGE))
def test_damaged_source_is_refused(gpt_a, tmp_path, what):
    fn, needles = DAMAGE[what]
    src = damaged(gpt_a.megatron, tmp_path, fn)
    proc = run_cli("reshard", str(src), str(tmp_path / "dst"), "--target-tp", "1")
    assert_refused(proc, tmp_path, *needles)


@pytest.mark.parametrize("flags,needles", [
    (["--target-tp", "4"], ["TP=4 does not divide num_query_groups=2", "--target-tp"]),
    (["--target-pp", "5"], ["PP=5 exceeds num_layers=4", "--target-pp"]),
    (["--target-pp", "2", "--target-num-layers-in-first-stage", "5"], ["--target-num-layers-in-first-stage"]),
    (["--target-tp", "3"], ["TP=3 does not divide", "--target-tp"]),
])
def test_impossible_target_layout_is_refused(gpt_a, tmp_path, flags, needles):
    assert_refused(run_cli("reshard", str(gpt_a.torch_dist), str(tmp_path / "dst"), *flags), tmp_path, *needles)


def test_unknown_vocab_needs_the_flag(gpt_a, tmp_path):
    tp1 = tmp_path / "tp1"
    ok(run_cli("reshard", str(gpt_a.megatron), str(tp1), "--target-tp", "1", "--target-pp", "1"))
    src = damaged(tp1, tmp_path, edit_rank_file("mp_rank_00", _set_arg("vocab_size", None)))
    # padded 112 rows at TP=1 (divisor 16); TP=2 needs a multiple of 32: only the true size tells how to re-pad
    assert_refused(run_cli("reshard", str(src), str(tmp_path / "dst"), "--target-tp", "2"), tmp_path,
                   "vocabulary size is unknown", "--vocab-size")
    ok(run_cli("reshard", str(src), str(tmp_path / "dst"), "--target-tp", "2", "--vocab-size", "100"))
    ok(run_cli("verify", str(gpt_a.megatron), str(tmp_path / "dst"), "--vocab-size", "100"))


def test_existing_dst_needs_overwrite(gpt_a, tmp_path):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    proc = run_cli("reshard", str(gpt_a.torch_dist), str(dst), "--target-tp", "1", nproc=2)
    assert proc.returncode != 0 and "already exists" in proc.stderr and "--overwrite" in proc.stderr
    assert (dst / "keep.txt").exists()
    ok(run_cli("reshard", str(gpt_a.torch_dist), str(dst), "--target-tp", "1", "--overwrite", nproc=2))
    assert not (dst / "keep.txt").exists() and (dst / "latest_checkpointed_iteration.txt").read_text() == "100"


def test_truncated_dcp_chunk_fails_every_rank_cleanly(gpt_a, tmp_path):
    """One rank hits the damaged chunk mid-exchange; all ranks stop (no hang) and no DST appears."""
    def truncate(it: Path) -> None:
        f = max(it.glob("*.distcp"), key=lambda p: p.stat().st_size)
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 3])
    src = damaged(gpt_a.torch_dist, tmp_path, truncate)
    proc = run_cli("reshard", str(src), str(tmp_path / "dst"), "--target-tp", "1", nproc=2, timeout=120)
    assert proc.returncode != 0
    assert "corrupt or truncated" in proc.stderr
    assert not (tmp_path / "dst").exists() and not list(tmp_path.glob("*.dist_convert_tmp"))


def test_source_not_a_checkpoint(tmp_path):
    (tmp_path / "empty").mkdir()
    assert_refused(run_cli("reshard", str(tmp_path / "empty"), str(tmp_path / "dst")), tmp_path,
                   "not a checkpoint in a known format", "--src-format")
    assert_refused(run_cli("inspect", str(tmp_path / "nope")), tmp_path, "does not exist")
