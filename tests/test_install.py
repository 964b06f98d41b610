"""A user's install: a fresh venv, torch first (this machine's CPU wheel), then ``pip install <checkout>``
(not editable, no set-up script, no --no-deps, so the declared dependencies are what gets installed);
the console script then runs from outside the checkout: --help, inspect, reshard + verify, and bench,
whose jobs must find the installed package.

pip installs with ``--no-compile`` and the commands run with bytecode writes allowed (this machine's
environment sets PYTHONDONTWRITEBYTECODE): the first command compiles what it imports and the rest reuse it,
instead of pip compiling every module of torch and the dependencies up front (about 30 s on 2 cores); what
gets installed, and from where, is the same."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dist_convert.bench.shape import LlamaShape
from dist_convert.bench.synth import synthetic_target, write_synthetic
from dist_convert.layout.rules import logical_tensors
from dist_convert.layout.topology import Layout
from dist_convert.runtime import Runtime

pytestmark = pytest.mark.install

ROOT = Path(__file__).resolve().parents[1]
PYTHON = shutil.which("python3.11") or sys.executable
TORCH = "torch==2.13.0"  # the local CPU wheel; never a bare 'torch' (pip would fetch a multi-GB CUDA build)
SHAPE = LlamaShape(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
                   vocab_size=300)


def run(cmd: list[str], cwd: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    """``cmd`` with nothing of this checkout on the path (the test runner's PYTHONPATH dropped)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONDONTWRITEBYTECODE")}
    proc = subprocess.run(cmd, cwd=cwd, env={**env, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"},
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd[:4]}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def copy_checkout(dst: Path) -> Path:
    """The working tree's files (tracked and untracked, not ignored): pip's build litters the copy."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                                capture_output=True, check=True).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: nothing says which files are the package's")
    for rel in (r for r in listed if r and (ROOT / r).is_file()):
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, dst / rel)
    return dst


def test_pip_install_gives_a_working_console_script(tmp_path):
    src = copy_checkout(tmp_path / "checkout")
    venv, work = tmp_path / "venv", tmp_path / "work"
    work.mkdir()
    run([PYTHON, "-m", "venv", str(venv)], tmp_path)
    py, script = venv / "bin" / "python", venv / "bin" / "dist_convert"
    pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-compile"]
    run([*pip, TORCH], tmp_path)
    run([*pip, str(src)], tmp_path)
    where = run([str(py), "-c", "import dist_convert; print(dist_convert.__file__)"], work).stdout.strip()
    assert Path(where).is_relative_to(venv), where  # the installed copy, not the checkout

    out = run([str(script), "--help"], work).stdout
    assert all(cmd in out for cmd in ("reshard", "speculate", "inspect", "verify", "bench")), out

    ckpt = tmp_path / "ckpt"
    write_synthetic(ckpt, SHAPE, torch.float32, "torch_dist", Layout(tp=2, pp=1), 0, Runtime())
    info = json.loads(run([str(script), "inspect", str(ckpt), "--json"], work).stdout)
    assert info["format"] == "torch_dist" and info["iteration"] == 1000
    assert (info["layout"]["tp"], info["layout"]["pp"]) == (2, 1) and info["config"]["num_layers"] == 2
    assert info["logical_tensors"] == len(logical_tensors(synthetic_target(SHAPE, torch.float32,
                                                                           Layout(tp=2, pp=1)).cfg))

    dst = tmp_path / "dst"
    run([str(script), "reshard", str(ckpt), str(dst), "--dst-format", "megatron", "--target-tp", "1"], work)
    assert "verify OK" in run([str(script), "verify", str(ckpt), str(dst)], work).stderr
    assert "checksums OK" in run([str(script), "verify", str(dst), "--checksums"], work).stderr

    bench = run([str(script), "bench", "--size", "8MB", "--src-tp", "1", "--targets", "1x1", "--ranks", "1",
                 "--reps", "1", "--methods", "floor,dist_convert", "--workdir", str(tmp_path / "bench")], work)
    assert "dist_convert w=1" in bench.stderr and "failed" not in bench.stderr, bench.stderr[-3000:]
