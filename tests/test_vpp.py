"""Virtual pipeline (interleaved) layouts under torchrun, judged by megatron-core building VPP model
chunks itself (tests/oracles/mcore.py --vpp): VPP targets load strictly at their layout, and VPP
sources made by megatron-core convert to plain layouts."""
from __future__ import annotations

import pytest

from conftest import ok, oracle, run_cli


@pytest.fixture(scope="module")
def vpp_source(tmp_path_factory, gpt_a):
    """Source A saved by megatron-core at TP=1 PP=2 VPP=2 in both formats."""
    root = tmp_path_factory.mktemp("vpp")
    src = {"torch_dist": root / "td", "megatron": root / "mg"}
    oracle("make", 2, "--config", str(gpt_a.config), "--tp", "1", "--pp", "2", "--vpp", "2", "--seed", "99",
           "--iteration", "100", "--out-torch-dist", str(src["torch_dist"]), "--out-megatron", str(src["megatron"]))
    return src


@pytest.mark.parametrize("fmt,tp,pp,world", [("megatron", 1, 2, 2), ("torch_dist", 2, 2, 4)])
def test_vpp_target_loads_in_megatron_core(gpt_a, tmp_path, fmt, tp, pp, world):
    dst = tmp_path / "out"
    ok(run_cli("reshard", str(gpt_a.megatron), str(dst), "--target-tp", str(tp), "--target-pp", str(pp),
               "--target-vpp", "2", "--dst-format", fmt, nproc=world))
    res = oracle("compare", tp * pp, "--config", str(gpt_a.config), "--tp", str(tp), "--pp", str(pp), "--vpp", "2",
                 "--ckpt", str(dst), "--ref", str(gpt_a.torch_dist), "--check-args")
    assert "ORACLE OK" in res.stdout


@pytest.mark.parametrize("fmt", ["megatron", "torch_dist"])
def test_vpp_source_converts_to_a_plain_layout(gpt_a, vpp_source, tmp_path, fmt):
    dst = tmp_path / "out"
    ok(run_cli("reshard", str(vpp_source[fmt]), str(dst), "--target-tp", "2", "--target-pp", "1",
               "--dst-format", "megatron", nproc=2))
    res = oracle("compare", 2, "--config", str(gpt_a.config), "--tp", "2", "--pp", "1", "--ckpt", str(dst),
                 "--ref", str(vpp_source["torch_dist"]), "--check-args")
    assert "ORACLE OK" in res.stdout
