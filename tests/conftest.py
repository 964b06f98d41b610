"""Shared fixtures: source checkpoints made once per session by megatron-core (tests/oracles/mcore.py),
and helpers that launch the real CLI the way users do (torchrun from the repo root, or one process)."""
from __future__ import annotations

import fcntl
import json
import os
import resource
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from workers import PoolClient, PoolServer, Workers

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
ORACLE = ROOT / "tests" / "oracles" / "mcore.py"
# One intra-op thread in every process of the suite: the jobs (runtime.job_threads), the oracles and workers, and
# this pytest process itself, whose in-process CLI calls would otherwise set torch's thread count to the machine's
# cores. A reduction split over another number of threads rounds differently on some CPUs, so a value computed here
# and one computed in a worker are only comparable bit for bit when both ran on one thread.
SUITE_THREADS = {"OMP_NUM_THREADS": "1", "DIST_CONVERT_THREADS": "1"}
os.environ.update(SUITE_THREADS)
torch.set_num_threads(1)
# Bytecode is cached, whatever the caller's environment says (some machines set PYTHONDONTWRITEBYTECODE): the suite
# starts a few hundred Python processes (torchrun ranks, workers, oracles), and without the cache each one compiles
# every module of dist_convert and of the tests it imports (1 to 3 s each on a 2-core machine). The cache goes to the
# checkout's __pycache__ directories (git-ignored); the venvs' packages have theirs from pip.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False
ENV = {**os.environ, **SUITE_THREADS, "PYTHONWARNINGS": "ignore", "TORCHELASTIC_ERROR_FILE": ""}
# launch/test.sh runs the suite in two pytest processes (pytest-xdist, a file each at a time): the controller holds
# the run's one pool of workers and serves it to both (workers.PoolServer), so that a worker starts once for the run
POOL = "DIST_CONVERT_TEST_POOL"  # the pool's socket, set by the controller for the processes it starts
WORKERS = (PoolClient(os.environ[POOL]) if os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get(POOL)
           else Workers(ENV))


def made_once(tmp_path_factory, name: str, make) -> Path:
    """The directory ``name`` that ``make(path)`` fills once per test run, whichever of the run's pytest processes
    (launch/test.sh runs two, pytest-xdist) asks first: the others wait for it under a file lock and use what it
    made. A session fixture whose sources many files read (``gpt_a``, the training runs) is made once, not once per
    process; a ``make`` that failed leaves nothing marked made, so the next asker makes it again (and fails alike)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's directory, above each process's own
    shared = root / "made_once"
    shared.mkdir(exist_ok=True)
    path, done = shared / name, shared / f"{name}.made"
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not done.exists():
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir()
            make(path)
            done.touch()
    return path


def torchrun(nproc: int, *args: str) -> list[str]:
    return [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]


def run_cli(*args: str, nproc: int | None = None, timeout: int = 300, env: dict[str, str] | None = None,
            max_file_size: int | None = None, fresh: bool = False,
            runtime: str = "default") -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node=N dist_convert ...`` from the repo root; ``python -m dist_convert``
    when ``nproc`` is None (no torchrun). The command runs in the session's long-lived CLI worker for
    that world size (tests/job_worker.py), unless ``fresh`` asks for a launch of its own, as a user's
    (what torchrun itself does on failures, the process group's own start-up and end). ``env`` adds
    variables and ``max_file_size`` sets RLIMIT_FSIZE (bytes any process may write to one file: a full
    disk as the kernel reports it, EFBIG); both need, and get, a launch of their own. ``runtime="mcore19"``
    runs it under the second runtime (Python 3.12 + megatron-core 0.19.2), always in a worker."""
    if runtime != "default" or not (fresh or env or max_file_size is not None):
        assert not (fresh or env or max_file_size is not None), "the second runtime runs in workers only"
        return WORKERS.run("cli", nproc, list(args), timeout, runtime)
    cmd = torchrun(nproc, "dist_convert", *args) if nproc else [PY, "-m", "dist_convert", *args]

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_file_size, max_file_size))

    return subprocess.run(cmd, cwd=ROOT, env={**ENV, **(env or {})}, capture_output=True, text=True, timeout=timeout,
                          preexec_fn=limit if max_file_size is not None else None)


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def assert_refused(proc: subprocess.CompletedProcess, tmp_path: Path, *needles: str) -> None:
    """Exactly one error line naming every needle, a non-zero exit, and no DST (tmp_path/dst) at all."""
    assert proc.returncode != 0, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("dist_convert: error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    for n in needles:
        assert n in errors[0], errors[0]
    assert not (tmp_path / "dst").exists()
    assert not list(tmp_path.glob("*.dist_convert_tmp"))


def oracle(cmd: str, nproc: int, *args: str, check: bool = True, program: str = "mcore",
           runtime: str = "default") -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node=N tests/oracles/mcore.py CMD ...`` (or ``tests/oracles/t5.py`` with
    ``program="t5"``), run in the session's oracle worker for that world size; ``runtime="mcore19"``:
    under megatron-core 0.19.2 (Python 3.12, the second venv)."""
    proc = WORKERS.run("oracle", nproc, [program, cmd, *args], 600, runtime)
    return ok(proc) if check else proc


@pytest.fixture(autouse=True)
def one_thread():
    """Every test starts on one thread, and one that changed the count (an in-process job that ignored
    DIST_CONVERT_THREADS) fails here, so that what the pytest process computes never depends on the machine."""
    torch.set_num_threads(1)
    yield
    assert torch.get_num_threads() == 1, f"the test left torch on {torch.get_num_threads()} threads"


POOL_SERVER = pytest.StashKey[PoolServer]()


# Test files by their cost (seconds of test time summed in a whole run's junit, notes/suite_time.md), heaviest first:
# pytest-xdist hands files (--dist loadfile) to its processes in collection order, and this order is the longest-
# processing-time-first rule, so a run does not end on one long file while the other process idles (xdist's own
# reorder, by number of tests, put the one-test 100 s install test last). Files not named follow, as collected.
FILE_COST = {
    "test_speculate.py": 182, "test_qwen3_next.py": 168, "test_mcore19.py": 154, "test_reshard.py": 151,
    "test_mla_layout.py": 144, "test_vision.py": 130, "test_crash_safety.py": 128, "test_bench.py": 128,
    "test_hybrid_model.py": 126, "test_qwen35_vl.py": 108, "test_glm45v.py": 105, "test_install.py": 100,
    "test_newest_torch.py": 95, "test_layout_string.py": 78, "test_optimizer.py": 75, "test_examples.py": 72,
    "test_gpu_check.py": 65, "test_slurm.py": 54, "test_soak.py": 54, "test_faults.py": 51, "test_gemma3.py": 48,
    "test_readers.py": 47, "test_dsa.py": 45, "test_full_qk_norm.py": 40, "test_compressed_tensors.py": 39,
    "test_deepseek.py": 38}


def pytest_configure(config) -> None:
    """The xdist controller serves its pool to the processes it is about to start (they inherit the variable), and
    hands out the files in FILE_COST's order (its own reorder off)."""
    if getattr(config.option, "numprocesses", None) and not os.environ.get("PYTEST_XDIST_WORKER"):
        config.stash[POOL_SERVER] = server = PoolServer(WORKERS)
        os.environ[POOL] = str(server.path)
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items) -> None:
    """Heaviest files first (FILE_COST); a file's tests stay together and in their order (a stable sort)."""
    items.sort(key=lambda item: -FILE_COST.get(item.path.name, 0))


def pytest_sessionfinish(session, exitstatus) -> None:
    WORKERS.stop()
    if POOL_SERVER in session.config.stash:
        session.config.stash[POOL_SERVER].close()


def pytest_terminal_summary(terminalreporter) -> None:
    if isinstance(WORKERS, Workers) and WORKERS.order:
        terminalreporter.write_line(WORKERS.summary())


@dataclass
class Source:
    name: str
    config: Path
    tp: int
    pp: int
    first: int | None
    torch_dist: Path
    megatron: Path
    cfg: dict
    ep: int = 1  # MoE: expert-parallel size (the oracle runs tp * pp * ep ranks: ep data-parallel replicas)

    def layout_args(self) -> list[str]:
        return (["--tp", str(self.tp), "--pp", str(self.pp)] + (["--first", str(self.first)] if self.first else [])
                + (["--ep", str(self.ep)] if self.ep > 1 else []))


# A: SwiGLU, RMSNorm, GQA, tied embeddings, RoPE.  B: GeLU, LayerNorm with biases, QKV bias,
# untied output layer, learned positions, qk-layernorm, made with uneven pipeline stages.
CONFIGS = {
    "A": ({"num_layers": 4, "hidden_size": 64, "ffn_hidden_size": 96, "num_attention_heads": 4,
           "num_query_groups": 2, "swiglu": True, "normalization": "RMSNorm", "add_bias_linear": False,
           "add_qkv_bias": False, "untie_embeddings_and_output_weights": False, "vocab_size": 100,
           "make_vocab_size_divisible_by": 16, "position_embedding_type": "rope", "max_position_embeddings": 32,
           "seq_length": 32}, 2, 2, None),
    "B": ({"num_layers": 6, "hidden_size": 48, "ffn_hidden_size": 64, "num_attention_heads": 4,
           "num_query_groups": 4, "swiglu": False, "normalization": "LayerNorm", "add_bias_linear": True,
           "add_qkv_bias": True, "untie_embeddings_and_output_weights": True, "vocab_size": 90,
           "make_vocab_size_divisible_by": 8, "position_embedding_type": "learned_absolute",
           "max_position_embeddings": 32, "seq_length": 32, "qk_layernorm": True}, 2, 2, 2),
}


def make_gpt(root: Path, name: str, cfg: dict, tp: int, pp: int, first: int | None = None, ep: int = 1,
             runtime: str = "default", save: bool = True) -> Source:
    """A megatron-core GPT with config ``cfg``, saved by the oracle at (tp, pp[, ep]) in both Megatron-LM formats
    (by megatron-core 0.19.2 with ``runtime="mcore19"``); ``save=False``: the Source of one saved there before."""
    src = Source(name, root / f"{name}.json", tp, pp, first, root / f"{name}_torch_dist", root / f"{name}_megatron",
                 cfg, ep)
    if save:
        root.mkdir(parents=True, exist_ok=True)
        src.config.write_text(json.dumps(cfg))
        oracle("make", tp * pp * ep, "--config", str(src.config), *src.layout_args(), "--seed", "1234",
               "--iteration", "100", "--out-torch-dist", str(src.torch_dist), "--out-megatron", str(src.megatron),
               runtime=runtime)
    return src


def session_source(tmp_path_factory, name: str) -> Source:
    """CONFIGS[name] saved once per test run (made_once), read by the tests of every process."""
    root = made_once(tmp_path_factory, f"src-{name}", lambda path: make_gpt(path, name, *CONFIGS[name]))
    return make_gpt(root, name, *CONFIGS[name], save=False)


@pytest.fixture(scope="session")
def gpt_a(tmp_path_factory) -> Source:
    return session_source(tmp_path_factory, "A")


@pytest.fixture(scope="session")
def gpt_b(tmp_path_factory) -> Source:
    return session_source(tmp_path_factory, "B")


from training_runs import trained  # noqa: E402,F401 - the session's training runs (after CONFIGS and oracle)
