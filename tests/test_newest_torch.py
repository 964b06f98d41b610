"""The newest stack (.venv-newest, launch/setup_newest.sh): torch 2.15.0, what ``torch>=2.6`` resolves to on a
GPU node today, with megatron-core 0.19.2, against the suite's torch 2.13.0 (.venv, .venv-mcore19).

* torch's own ``dcp.save`` / ``dcp.load`` under 2.15 against dist_convert's ``.metadata`` and ``.distcp`` access,
  and the start-up check of the forged metadata (tests/test_distcp.py, tests/test_dcp_forge.py, run by 2.15);
* dist_convert itself under 2.15: the core conversions of a megatron-core 0.16.1 checkpoint, judged by
  megatron-core 0.16.1 (torch 2.13) loading them strictly: what 2.15 writes, 2.13 reads;
* megatron-core 0.19.2's own save under 2.15 (its ``.metadata`` carries torch 2.15's tensor strides, which no
  older torch unpickles) read by dist_convert under 2.13, and resharded into a checkpoint megatron-core 0.16.1
  loads;
* the fallback when a torch release no longer reads the forge (DCP's own objects), end to end.
megatron-core 0.19.2's strict load does not run under torch 2.15 (``load_tensors_metadata`` passes the new
``strides`` field to ``torch.empty``), so no judge here loads under 2.15 with megatron-core."""
from __future__ import annotations

import json
import subprocess

import pytest

from dist_convert.formats import dcp_meta
from dist_convert.formats.distcp import METADATA

from conftest import CONFIGS, ENV, ROOT, make_gpt, ok, oracle, run_cli
from workers import runtime_python


def test_torch_dcp_round_trips_under_the_newest_torch():
    """tests/test_distcp.py and tests/test_dcp_forge.py, run by torch 2.15: dcp.save's files and metadata read by
    dist_convert, dist_convert's files loaded by dcp.load, the forge read as DCP's own classes."""
    python = str(runtime_python("newest"))
    version = subprocess.run([python, "-c", "import torch; print(torch.__version__)"], capture_output=True,
                             text=True, env=ENV, check=True).stdout.strip()
    assert version.startswith("2.15"), version
    proc = subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_distcp.py",
                           "tests/test_dcp_forge.py", "-k", "not megatron-core"],  # gpt_a: the session's, not 2.15's
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and " passed" in proc.stdout and "failed" not in proc.stdout, proc.stdout[-4000:]


# (name, flags, world of the judge's load: tp, pp)
CASES = [("torch_dist_tp1_pp2", ["--target-tp", "1", "--target-pp", "2"], 1, 2),
         ("megatron_tp2_pp1", ["--dst-format", "megatron", "--target-tp", "2", "--target-pp", "1"], 2, 1),
         ("torch_dist_tp4", ["--target-tp", "4", "--target-pp", "1"], 4, 1)]


@pytest.mark.parametrize("name,flags,tp,pp", CASES, ids=[c[0] for c in CASES])
def test_dist_convert_under_the_newest_torch(tmp_path, gpt_a, name, flags, tp, pp):
    dst = tmp_path / "dst"
    ok(run_cli("reshard", str(gpt_a.torch_dist), str(dst), *flags, nproc=2, runtime="newest"))
    res = oracle("compare", tp * pp, "--config", str(gpt_a.config), "--tp", str(tp), "--pp", str(pp),
                 "--ckpt", str(dst), "--ref", str(gpt_a.torch_dist), "--check-args")
    assert "ORACLE OK" in res.stdout + res.stderr


@pytest.fixture(scope="module")
def src_newest(tmp_path_factory):
    """Config A with gpt_a's seed, saved by megatron-core 0.19.2 under torch 2.15 at TP=2 PP=1."""
    cfg, *_ = CONFIGS["A"]
    return make_gpt(tmp_path_factory.mktemp("src_newest"), "A215", cfg, 2, 1, runtime="newest")


def test_newest_torch_save_reads_and_reshards_for_older_stacks(tmp_path, gpt_a, src_newest):
    iter_dir = next(src_newest.torch_dist.glob("iter_*"))
    with open(iter_dir / METADATA, "rb") as fh:
        md = dcp_meta.loads(fh)
    strides = [v.properties.strides for v in md.state_dict_metadata.values() if hasattr(v, "properties")]
    assert any(s is not None for s in strides)  # torch 2.15's sixth item: what 2.13's DCP cannot unpickle
    proc = ok(run_cli("verify", str(src_newest.torch_dist), str(gpt_a.torch_dist), nproc=2))
    assert "verify OK: all logical tensors equal" in proc.stdout + proc.stderr
    dst = tmp_path / "dst"
    ok(run_cli("reshard", str(src_newest.torch_dist), str(dst), "--target-tp", "1", "--target-pp", "2",
               "--mcore-style", "0.16", nproc=2))
    res = oracle("compare", 2, "--config", str(gpt_a.config), "--tp", "1", "--pp", "2", "--ckpt", str(dst),
                 "--ref", str(gpt_a.torch_dist), "--check-args")
    assert "ORACLE OK" in res.stdout + res.stderr


def test_forge_fallback_end_to_end(tmp_path, gpt_a):
    """A torch whose DCP would read the forge otherwise gets DCP's own objects, with one note; megatron-core loads
    the target (DIST_CONVERT_DCP_METADATA=dcp makes this torch take that path)."""
    dst = tmp_path / "dst"
    proc = ok(run_cli("reshard", str(gpt_a.torch_dist), str(dst), "--target-tp", "1", "--target-pp", "1",
                      nproc=2, env={dcp_meta.WRITER_ENV: "dcp"}))
    notes = [line for line in (proc.stdout + proc.stderr).splitlines() if "DCP's own objects" in line]
    assert len(notes) == 1, proc.stdout
    res = oracle("compare", 1, "--config", str(gpt_a.config), "--tp", "1", "--pp", "1", "--ckpt", str(dst),
                 "--ref", str(gpt_a.torch_dist), "--check-args")
    assert "ORACLE OK" in res.stdout + res.stderr
    assert json.loads((next(dst.glob("iter_*")) / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
