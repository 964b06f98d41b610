"""pipeline_model_parallel_layout strings under torchrun (gloo), judged by megatron-core building the
model from the same string itself (tests/oracles/mcore.py --pipeline-layout) and loading strictly."""
from __future__ import annotations

import pytest

from conftest import assert_refused, ok, oracle, run_cli

VPP_STRING = "E|tt|t|tL"  # PP=2 VPP=2: a chunk holding only the embedding, uneven chunks


@pytest.fixture(scope="module")
def string_source(tmp_path_factory, gpt_a):
    """Source A saved by megatron-core at TP=1 PP=2 with a VPP layout string, in both formats."""
    root = tmp_path_factory.mktemp("layoutstr")
    src = {"torch_dist": root / "td", "megatron": root / "mg"}
    oracle("make", 2, "--config", str(gpt_a.config), "--tp", "1", "--pp", "2", "--pipeline-layout", VPP_STRING,
           "--seed", "7", "--iteration", "100", "--out-torch-dist", str(src["torch_dist"]),
           "--out-megatron", str(src["megatron"]))
    return src


def test_even_source_to_an_uneven_string_and_back(gpt_a, tmp_path):
    """torch_dist TP=2 PP=2 (even) -> legacy TP=1 PP=2 "Et|tttL" (2 ranks) -> torch_dist TP=1 PP=2 even again:
    a layer moves back across the stages (2 ranks)."""
    uneven, back = tmp_path / "uneven", tmp_path / "back"
    ok(run_cli("reshard", str(gpt_a.torch_dist), str(uneven), "--target-tp", "1", "--target-pp", "2",
               "--target-pipeline-layout", "Et|tttL", "--dst-format", "megatron", nproc=2))
    res = oracle("compare", 2, "--config", str(gpt_a.config), "--tp", "1", "--pp", "2", "--pipeline-layout", "Et|tttL",
                 "--ckpt", str(uneven), "--ref", str(gpt_a.torch_dist), "--check-args")
    assert "ORACLE OK" in res.stdout
    ok(run_cli("reshard", str(uneven), str(back), "--target-pipeline-layout", "none", "--dst-format", "torch_dist",
               nproc=2))
    res = oracle("compare", 2, "--config", str(gpt_a.config), "--tp", "1", "--pp", "2", "--ckpt", str(back),
                 "--ref", str(gpt_a.torch_dist), "--check-args")
    assert "ORACLE OK" in res.stdout


@pytest.mark.parametrize("fmt,target,compare", [
    # PP kept, no pipeline flags: the source's string (with its VPP) is kept, legacy chunks numbered by it
    ("torch_dist", ["--target-tp", "1", "--dst-format", "megatron"], ["--tp", "1", "--pp", "2",
                                                                       "--pipeline-layout", VPP_STRING]),
    ("megatron", ["--target-tp", "2", "--target-pp", "1", "--dst-format", "torch_dist"], ["--tp", "2", "--pp", "1"]),
])
def test_string_source_reads_in_both_formats(gpt_a, string_source, tmp_path, fmt, target, compare):
    dst = tmp_path / "out"
    ok(run_cli("reshard", str(string_source[fmt]), str(dst), *target, nproc=2))
    res = oracle("compare", 2, "--config", str(gpt_a.config), *compare, "--ckpt", str(dst),
                 "--ref", str(string_source["torch_dist"]), "--check-args")
    assert "ORACLE OK" in res.stdout


def test_a_string_that_does_not_add_up_is_refused(gpt_a, tmp_path):
    proc = run_cli("reshard", str(gpt_a.torch_dist), str(tmp_path / "dst"), "--target-pipeline-layout", "Et|ttL",
                   nproc=2)
    assert proc.returncode == 2
    assert_refused(proc, tmp_path, "--target-pipeline-layout", "places 3 decoder layers")
