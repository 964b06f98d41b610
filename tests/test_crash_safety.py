"""Crash safety and integrity under torchrun: a rank killed mid-run (SIGKILL), a hung rank, a full
disk; the incomplete-output marker that inspect and verify recognise; --resume; per-file checksums
and ``verify --checksums``."""
from __future__ import annotations

import json

from conftest import ok, run_cli

MANIFEST = "dist_convert_checksums.json"
MARKER = ".dist_convert_incomplete.json"


def one_error(proc) -> str:
    assert proc.returncode != 0, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("dist_convert: error:")]
    assert errors, proc.stderr[-3000:]
    return errors[0]


def test_checksums_are_recorded_and_checked(gpt_a, tmp_path):
    dst = tmp_path / "dst"
    ok(run_cli("reshard", str(gpt_a.torch_dist), str(dst), "--target-tp", "1", "--target-pp", "2",
               "--dst-format", "megatron", nproc=2, fresh=True))  # a launch of its own, as a user's
    manifest = json.loads((dst / MANIFEST).read_text())["files"]
    on_disk = {p.relative_to(dst).as_posix() for p in dst.rglob("*") if p.is_file()} - {MANIFEST}
    assert set(manifest) == on_disk  # every file, the tracker included
    assert "latest_checkpointed_iteration.txt" in manifest and not (dst / MARKER).exists()
    assert "checksums OK" in ok(run_cli("verify", str(dst), "--checksums")).stderr

    victim = dst / "iter_0000100" / "mp_rank_00_001" / "model_optim_rng.pt"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped bit pattern, same size
    victim.write_bytes(bytes(data))
    (dst / "iter_0000100" / "mp_rank_00_000" / "model_optim_rng.pt").unlink()
    (dst / "stray.txt").write_text("x")
    proc = run_cli("verify", str(dst), "--checksums", nproc=2)
    assert proc.returncode == 1
    assert "mp_rank_00_001/model_optim_rng.pt: SHA-256" in proc.stderr
    assert "mp_rank_00_000/model_optim_rng.pt: missing" in proc.stderr
    assert "stray.txt: not in the manifest" in proc.stderr


def test_killed_rank_leaves_marked_output_and_resume_finishes_it(gpt_a, tmp_path):
    dst, tmp = tmp_path / "dst", tmp_path / "dst.dist_convert_tmp"
    args = ["reshard", str(gpt_a.torch_dist), str(dst), "--target-tp", "1", "--target-pp", "2"]
    proc = run_cli(*args, nproc=2, env={"DIST_CONVERT_FAULT": "kill:rank=1:file=1"}, timeout=240)
    assert proc.returncode != 0 and "SIGKILL" in proc.stderr, proc.stderr[-3000:]
    assert not dst.exists() and (tmp / MARKER).is_file()
    assert not (tmp / "latest_checkpointed_iteration.txt").exists()
    assert not (tmp / "iter_0000100" / ".metadata").exists()
    journaled = [json.loads(line) for j in (tmp / ".dist_convert_journal").glob("*.jsonl")
                 for line in j.read_text().splitlines()]
    assert journaled, "rank 1 is killed only after it finished a file"
    kept = {e["name"]: (tmp / e["name"]).stat().st_mtime_ns for e in journaled}

    for cmd in (["inspect", str(tmp)], ["inspect", str(dst)], ["verify", str(gpt_a.torch_dist), str(dst)]):
        err = one_error(run_cli(*cmd))
        assert "incomplete dist_convert output" in err and "--resume" in err, err
    err = one_error(run_cli(*args, nproc=2))
    assert "pass --resume" in err and "--overwrite" in err

    proc = ok(run_cli(*args, "--resume", nproc=2))
    assert f"{len(kept)} finished before (--resume)" in proc.stderr
    assert not tmp.exists() and not (dst / MARKER).exists() and not (dst / ".dist_convert_journal").exists()
    assert {n: (dst / n).stat().st_mtime_ns for n in kept} == kept  # not written again
    ok(run_cli("verify", str(gpt_a.torch_dist), str(dst)))
    ok(run_cli("verify", str(dst), "--checksums"))


def test_resume_refuses_another_conversion(gpt_a, tmp_path):
    dst = tmp_path / "dst"
    proc = run_cli("reshard", str(gpt_a.megatron), str(dst), "--target-tp", "1", "--target-pp", "1",
                   env={"DIST_CONVERT_FAULT": "kill:rank=0:file=1"}, nproc=1)
    assert proc.returncode != 0
    err = one_error(run_cli("reshard", str(gpt_a.megatron), str(dst), "--target-tp", "2", "--target-pp", "1",
                            "--resume"))
    assert "started by a different conversion" in err and "--overwrite" in err
    ok(run_cli("reshard", str(gpt_a.megatron), str(dst), "--target-tp", "2", "--target-pp", "1", "--overwrite"))
    ok(run_cli("verify", str(gpt_a.megatron), str(dst)))


def test_hung_rank_times_out_with_a_clear_error(gpt_a, tmp_path):
    dst = tmp_path / "dst"
    proc = run_cli("reshard", str(gpt_a.torch_dist), str(dst), "--target-tp", "1", "--timeout", "8", nproc=2,
                   env={"DIST_CONVERT_FAULT": "hang:rank=1:wave=1"}, timeout=200)
    err = one_error(proc)
    assert "did not answer within --timeout 8 s" in err, err
    assert not dst.exists()


def test_a_rank0_phase_longer_than_the_timeout_completes(gpt_a, tmp_path):
    """Rank 0 alone packages the target (here: 20 s, 2.5 times --timeout; the timeout as the hung-rank test's, which
    a loaded machine's ordinary collectives stay well inside): the other rank waits on the patient group
    (runtime.PATIENT_S), not the collective timeout, and the job finishes."""
    dst = tmp_path / "dst"
    ok(run_cli("reshard", str(gpt_a.torch_dist), str(dst), "--target-tp", "1", "--timeout", "8", nproc=2,
               env={"DIST_CONVERT_FAULT": "sleep20:rank=0:package=1"}, timeout=200))
    ok(run_cli("verify", str(gpt_a.torch_dist), str(dst)))


def test_full_disk_fails_cleanly(gpt_a, tmp_path):
    """RLIMIT_FSIZE: writing past 64 KB fails with EFBIG, as a full disk fails with ENOSPC."""
    dst = tmp_path / "dst"
    proc = run_cli("reshard", str(gpt_a.torch_dist), str(dst), "--target-tp", "1", "--target-pp", "1",
                   "--dst-format", "megatron", nproc=2, max_file_size=64 << 10)
    err = one_error(proc)
    assert "File too large" in err and "ulimit -f" in err, err
    assert not dst.exists()
    tmp = tmp_path / "dst.dist_convert_tmp"
    assert not tmp.exists() or (tmp / MARKER).is_file()
