"""The sbatch templates on a real two-node Slurm cluster started on this machine (tests/slurm_cluster.py:
Debian's slurm-wlm + munge, installed here when missing; skipped only where they cannot be installed).

* slurm/convert.sbatch with --nodes=2 and 2 CPU ranks per node (gloo) reshards a megatron-core checkpoint;
  the job completes, its log exists, the ranks of both nodes each read a share of the source (no rank
  and no node reads it all), and `dist_convert verify` and megatron-core itself find the result equal
  to the source.
* A rank that dies on the second node fails the whole job promptly (srun stops the first node, whose
  ranks would otherwise wait for their peers), and leaves no process behind.
* slurm/convert_single_node.sbatch with a bad argument: job FAILED, the error line in the job log.
* slurm/speculate.sbatch passes its arguments to `dist_convert speculate`.

Select with ``-m slurm``."""
from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, ok, oracle, run_cli
from slurm_cluster import LocalSlurm, ensure_slurm, free_ports

pytestmark = pytest.mark.slurm

RANKS_PER_NODE = 2
JOB_ENV = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHON": sys.executable}
CPU_ONLY = ["--gpus-per-node=0"]  # the templates ask for GPUs; these nodes have none (gloo)
RANK_LINE = re.compile(r"dist_convert rank (\d+)/(\d+) on (\S+) \(local rank (\d+)\)")
SIZE = r"(\d+(?:\.\d+)? [KMGT]?B)"
SUMMARY_ROW = re.compile(rf"│\s+(\d+) │\s+(\d+) │\s+(\d+) │\s+{SIZE} │\s+{SIZE} │")
SOURCE_BYTES = re.compile(rf"source chunks, {SIZE};")
NODE_COLUMN = re.compile(r"│\s+(\d+) │.*│ (n\d+)\s+│\s*$", re.M)  # the summary's last column on multi-node runs


def parse_size(text: str) -> float:
    num, unit = text.split()
    return float(num) * 1024 ** ["B", "KB", "MB", "GB", "TB"].index(unit)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = ensure_slurm()
    if reason:
        pytest.skip(reason)
    c = LocalSlurm(tmp_path_factory.mktemp("slurm"), nodes=2)
    try:
        c.start()
        yield c
    finally:
        c.stop()


def submit(cluster: LocalSlurm, workdir: Path, template: str, sbatch_args: list[str], args: list[str],
           timeout: float, **env: str) -> tuple[dict[str, str], str]:
    """sbatch ROOT/slurm/TEMPLATE from workdir, wait for the job; returns scontrol's fields and the job log."""
    job = cluster.sbatch([*CPU_ONLY, f"--partition={cluster.partition}", *sbatch_args,
                          str(ROOT / "slurm" / template), *args], cwd=workdir, env={**JOB_ENV, **env})
    info = cluster.wait(job, timeout=timeout)
    log = workdir / f"{info['JobName']}-{job}.log"  # the templates' per-job log: %x-%j.log in the submit dir
    assert log.is_file() and info["StdOut"] == str(log), (info, sorted(workdir.iterdir()))
    return info, log.read_text(errors="replace")


def processes_mentioning(needle: str) -> list[str]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if needle in cmd:
                out.append(f"{d.name}: {cmd}")
    return out


def test_two_node_reshard_splits_work_and_verifies(cluster, gpt_a, tmp_path):
    dst = tmp_path / "tp1_pp2"
    info, log = submit(cluster, tmp_path, "convert.sbatch", ["--nodes=2"],
                       ["reshard", str(gpt_a.torch_dist), str(dst), "--target-tp", "1", "--target-pp", "2",
                        "--dst-format", "torch_dist"],
                       timeout=300, NPROC_PER_NODE=str(RANKS_PER_NODE), RDZV_PORT=str(free_ports(1)[0]))
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", f"{info}\n{log[-6000:]}"
    assert info["NodeList"] == "n[1-2]" and info["NumNodes"] == "2", info
    assert f"dist_convert job {info['JobId']}: OK" in log and "wrote" in log, log[-6000:]

    # which node each rank ran on (every rank prints one line), and what each rank read (rank 0's summary)
    world = 2 * RANKS_PER_NODE
    node_of = {int(r): node for r, w, node, _ in RANK_LINE.findall(log) if int(w) == world}
    assert sorted(node_of) == list(range(world)), log[-6000:]
    assert sorted(node_of.values()) == ["n1"] * RANKS_PER_NODE + ["n2"] * RANKS_PER_NODE, node_of
    assert {int(r): n for r, n in NODE_COLUMN.findall(log)} == node_of, log[-6000:]  # the summary agrees
    read = {int(m[0]): parse_size(m[3]) for m in SUMMARY_ROW.findall(log)}
    assert sorted(read) == list(range(world)), log[-6000:]
    source = parse_size(SOURCE_BYTES.search(log).group(1))
    per_node = {n: sum(b for r, b in read.items() if node_of[r] == n) for n in ("n1", "n2")}
    assert all(b > 0 for b in per_node.values()), per_node  # both nodes read a share ...
    assert all(b < 0.75 * source for b in per_node.values()), (per_node, source)  # ... no node (or rank) all
    assert max(read.values()) < 0.5 * source and min(read.values()) > 0, read
    # each byte read once, except the vocabulary padding rows, which nobody needs to read (fp32 source)
    cfg = gpt_a.cfg
    multiple = cfg["make_vocab_size_divisible_by"] * gpt_a.tp
    padding = (-(-cfg["vocab_size"] // multiple) * multiple - cfg["vocab_size"]) * cfg["hidden_size"] * 4 \
        * (2 if cfg["untie_embeddings_and_output_weights"] else 1)
    assert padding > 0 and abs(sum(read.values()) - (source - padding)) <= 0.005 * source, (read, source, padding)

    # the result: dist_convert's own comparison, and megatron-core loading it at TP=1 PP=2
    proc = ok(run_cli("verify", str(gpt_a.torch_dist), str(dst), nproc=2))
    assert "verify OK" in proc.stderr
    res = oracle("compare", 2, "--config", str(gpt_a.config), "--tp", "1", "--pp", "2", "--ckpt", str(dst),
                 "--ref", str(gpt_a.torch_dist), "--check-args")
    assert "ORACLE OK" in res.stdout + res.stderr
    assert (tmp_path / f"dist_convert-{info['JobId']}.ranks").is_dir()  # per-rank files of the job


def test_a_rank_dying_on_one_node_fails_the_job(cluster, gpt_a, tmp_path):
    """The rank on node n2 exits 3 at start; the rank on n1 would wait for it for the whole
    collective timeout. The job must end FAILED well before that, with no process left running."""
    python = tmp_path / "python_failing_on_n2"
    python.write_text(f"""#!/bin/bash
if [ "$SLURMD_NODENAME" = n2 ] && [ "$1 $2" = "-m dist_convert" ]; then
  echo "simulated crash of rank $RANK on $SLURMD_NODENAME" >&2; exit 3
fi
exec {sys.executable} "$@"
""")
    python.chmod(0o755)
    dst = tmp_path / "never"
    t0 = time.monotonic()
    info, log = submit(cluster, tmp_path, "convert.sbatch", ["--nodes=2"],
                       ["reshard", str(gpt_a.torch_dist), str(dst), "--target-tp", "1", "--target-pp", "2",
                        "--timeout", "600"],
                       timeout=240, NPROC_PER_NODE="1", RDZV_PORT=str(free_ports(1)[0]), PYTHON=str(python))
    assert info["JobState"] == "FAILED" and info["ExitCode"] != "0:0", f"{info}\n{log[-6000:]}"
    assert time.monotonic() - t0 < 200, "the job waited for the collective timeout instead of failing"
    assert re.search(r"simulated crash of rank \d on n2", log), log[-6000:]
    assert f"dist_convert job {info['JobId']}: FAILED" in log, log[-6000:]
    assert not dst.exists()
    deadline = time.monotonic() + 20
    while processes_mentioning(str(dst)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not processes_mentioning(str(dst)), processes_mentioning(str(dst))


def test_single_node_template_fails_on_a_bad_argument(cluster, tmp_path):
    info, log = submit(cluster, tmp_path, "convert_single_node.sbatch", [],
                       ["reshard", str(tmp_path / "no_such_checkpoint"), str(tmp_path / "dst"), "--target-tp", "1"],
                       timeout=120, NPROC_PER_NODE="1")
    assert info["JobState"] == "FAILED" and info["ExitCode"] != "0:0", f"{info}\n{log[-6000:]}"
    assert info["NumNodes"] == "1"
    errors = [line for line in log.splitlines() if "dist_convert: error:" in line]
    assert errors and "no_such_checkpoint" in errors[0], log[-6000:]
    assert f"dist_convert job {info['JobId']}: FAILED" in log
    assert not (tmp_path / "dst").exists()


def test_speculate_template_passes_arguments_to_speculate(cluster, tmp_path):
    info, log = submit(cluster, tmp_path, "speculate.sbatch", ["--nodes=1"], ["--help"], timeout=120,
                       NPROC_PER_NODE="1")
    assert info["JobState"] == "COMPLETED", f"{info}\n{log[-6000:]}"
    assert "command: dist_convert speculate --help" in log and "usage: dist_convert speculate" in log, log[-4000:]
