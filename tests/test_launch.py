"""Start-up and launch: the CLI parses without importing torch (``--help`` is instant), a conversion between
formats that do not use torch.distributed.checkpoint never imports it, ``--nproc N`` starts its own workers
(the same result as torchrun, one error line on failure), and ``dist_convert plan`` predicts exactly the
bytes each rank of a real run reads and writes."""
from __future__ import annotations

import json
import subprocess

import pytest

from dist_convert.cli import main as cli_main
from dist_convert.errors import ConvertError
from dist_convert.runtime import auto_backend, gpu_index, job_threads, threads_per_rank, usable_cpus

from conftest import ENV, PY, ROOT, assert_refused, ok, run_cli


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)


def test_parsing_imports_no_torch_and_formats_load_lazily(gpt_a, tmp_path):
    """Parsing imports no torch; no format imports torch.distributed.checkpoint or DTensor, and neither does a
    torch_dist reshard and verify (the ``.metadata`` through formats/dcp_meta.py)."""
    dst = tmp_path / "dst"
    ok(_python("import sys; from dist_convert.cli import build_parser, main; build_parser().parse_args(['reshard', "
               "'a', 'b', '--target-tp', '2']); assert 'torch' not in sys.modules, 'torch imported to parse'; "
               "from dist_convert.formats import FORMATS, get_format; [get_format(f) for f in FORMATS]; "
               f"assert main(['reshard', '{gpt_a.torch_dist}', '{dst}', '--target-tp', '1', '--target-pp', '2']) == 0; "
               f"assert main(['verify', '{gpt_a.torch_dist}', '{dst}']) == 0; "
               "bad = [m for m in ('torch.distributed.checkpoint', 'torch.distributed.tensor') if m in sys.modules]; "
               "assert not bad, bad"))


def test_nproc_starts_its_own_workers(gpt_a, tmp_path):
    """``--nproc 2`` from one plain process equals a torchrun launch of 2; a failure is one error line (the
    workers'), no launcher traceback."""
    mine, theirs = tmp_path / "mine", tmp_path / "theirs"
    flags = ["--target-tp", "1", "--target-pp", "2"]
    cmd = [PY, "-m", "dist_convert", "reshard", str(gpt_a.torch_dist), str(mine), *flags, "--nproc", "2"]
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ok(run_cli("reshard", str(gpt_a.torch_dist), str(theirs), *flags, nproc=2))
    assert cli_main(["verify", str(mine), str(theirs)]) == 0
    cmd[-1] = "1"  # the failure needs one worker only: DST exists now
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("dist_convert: error:") and "--overwrite" in lines[0], lines


def test_plan_predicts_what_each_rank_reads_and_writes(gpt_a, tmp_path):
    """``plan --world 2`` gives per rank the bytes the real 2-rank run reads and writes (the same planner), its
    waves and a peak-memory and time estimate; ``--world`` must be positive."""
    flags = ["--target-tp", "1", "--target-pp", "2", "--memory-budget", "64KB"]
    est_path, stats_path = tmp_path / "plan.json", tmp_path / "stats.json"
    assert cli_main(["plan", str(gpt_a.torch_dist), *flags, "--world", "2", "--read-gbps", "2", "--json",
                     str(est_path)]) == 0
    ok(run_cli("reshard", str(gpt_a.torch_dist), str(tmp_path / "dst"), *flags, "--stats-json", str(stats_path),
               nproc=2))
    est, stats = json.loads(est_path.read_text()), json.loads(stats_path.read_text())
    assert est["world"] == 2 and est["waves"] > 1
    for r, s in zip(est["ranks"], stats, strict=True):
        assert (r["read_bytes"], r["written_bytes"]) == (s["read_bytes"], s["written_bytes"])
        assert (r["sent_bytes"], r["received_bytes"]) == (s["sent_bytes"], s["received_bytes"])
        assert r["predicted_peak_rss"] > r["peak_wave_bytes"] > 0
    assert est["seconds"] >= max(r["read_bytes"] for r in est["ranks"]) / (2 * 2**30)
    assert cli_main(["plan", str(gpt_a.torch_dist), "--world", "0"]) == 2


def test_overlapped_io_gives_the_same_target(gpt_a, tmp_path, monkeypatch):
    """With cores to spare a rank reads the next wave in a thread and writes in another (off on this 2-core
    machine, runtime.overlap_io); forced on, the target is the same and its checksums hold."""
    import dist_convert.convert as convert

    flags = ["--target-tp", "1", "--target-pp", "2", "--memory-budget", "64KB"]
    assert cli_main(["reshard", str(gpt_a.torch_dist), str(tmp_path / "inline"), *flags]) == 0
    monkeypatch.setattr(convert, "overlap_io", lambda local_ranks: True)
    assert cli_main(["reshard", str(gpt_a.torch_dist), str(tmp_path / "overlapped"), *flags]) == 0
    assert cli_main(["verify", str(tmp_path / "inline"), str(tmp_path / "overlapped")]) == 0
    assert cli_main(["verify", str(tmp_path / "overlapped"), "--checksums"]) == 0


def test_a_gpu_backend_without_the_gpus_it_needs_is_refused_in_one_line(gpt_a, tmp_path):
    """--backend nccl on a CPU-only torch (this machine), and more local ranks than visible GPUs (pure): one
    error line naming the cause and the flag, no traceback, no target."""
    proc = run_cli("reshard", str(gpt_a.torch_dist), str(tmp_path / "dst"), "--target-tp", "1", "--backend", "nccl",
                   nproc=2, fresh=True)
    assert_refused(proc, tmp_path, "--backend nccl needs GPUs", "--backend gloo")
    assert "Traceback" not in proc.stderr.split("dist_convert: error:")[0]
    assert gpu_index(3, 4, 3) == 3
    # --backend auto: NCCL only when every local rank has a GPU of its own; a one-GPU box at 2 ranks runs gloo
    assert [auto_backend(v, n) for v, n in ((8, 8), (1, 1), (1, 2), (4, 8), (0, 1))] == \
        ["nccl", "nccl", "gloo", "gloo", "gloo"]
    with pytest.raises(ConvertError, match=r"local rank 4 has no GPU of its own: this process sees 4 .*--nproc_per"):
        gpu_index(4, 4, 4)


@pytest.mark.parametrize("local_ranks, cpus, slurm, expect", [
    (8, 128, None, 16),  # a whole node's cores shared by its 8 ranks
    (8, 128, 32, 4),  # Slurm gave the torchrun task 32 CPUs (--cpus-per-task): 4 per rank, not 16
    (8, 16, 64, 2),  # the affinity mask is tighter than Slurm's count: the mask wins
    (4, 2, None, 1),  # more ranks than cores: one thread each, never 0
    (1, 2, None, 2),
])
def test_threads_per_rank_follow_the_cores_the_job_was_given(local_ranks, cpus, slurm, expect):
    assert threads_per_rank(local_ranks=local_ranks, usable_cpus=cpus, slurm_cpus_per_task=slurm) == expect



def test_job_threads_read_slurm_and_the_override(monkeypatch):
    monkeypatch.delenv("DIST_CONVERT_THREADS", raising=False)
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "1")
    assert job_threads(1) == 1  # Slurm gave the task one CPU, whatever the machine has
    monkeypatch.delenv("SLURM_CPUS_PER_TASK")
    assert job_threads(1) == usable_cpus()
    monkeypatch.setenv("DIST_CONVERT_THREADS", "3")
    assert job_threads(8) == 3
