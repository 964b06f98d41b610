"""End to end: the real CLI under torchrun (gloo) reshards megatron-core checkpoints; megatron-core
itself loads every output strictly at the target layout and finds it equal to the source (which it
loads at the same layout by its own resharding of the torch_dist twin)."""
from __future__ import annotations

import re

import pytest
import torch

from conftest import ok, oracle, run_cli

# (source, src format, dst format, target tp, pp, first-stage layers, world size or None = no torchrun,
#  extra flags)
CASES = [
    ("A", "torch_dist", "torch_dist", 1, 1, None, 2, ["--memory-budget", "64K"]),  # 4 -> 1 file, 2 procs, many waves
    ("A", "megatron", "megatron", 1, 4, None, 4, []),  # PP up; tied embedding copy on the last stage
    ("A", "megatron", "torch_dist", 2, 1, None, None, []),  # one process without torchrun; format change
    ("A", "torch_dist", "megatron", 1, 3, 2, 2, []),  # uneven target stages [2, 1, 1]
    ("B", "megatron", "megatron", 1, 2, 3, 2, []),  # uneven source [2, 4] -> [3, 3]; untied, biases
    ("B", "torch_dist", "torch_dist", 4, 1, None, 4, []),  # TP up from 2 to 4, more ranks than files
    ("B", "megatron", "torch_dist", 2, 2, None, 1, []),  # torchrun with a single rank; uneven [2, 4] -> [3, 3]
]


@pytest.mark.parametrize("name,src_fmt,dst_fmt,tp,pp,first,world,extra", CASES,
                         ids=[f"{c[0]}-{c[1]}-to-{c[2]}-tp{c[3]}pp{c[4]}{'f' + str(c[5]) if c[5] else ''}-w{c[6]}"
                              for c in CASES])
def test_reshard_loads_in_megatron_core(request, tmp_path, name, src_fmt, dst_fmt, tp, pp, first, world, extra):
    src = request.getfixturevalue(f"gpt_{name.lower()}")
    dst = tmp_path / "out"
    args = ["reshard", str(getattr(src, src_fmt)), str(dst), "--target-tp", str(tp), "--target-pp", str(pp),
            "--dst-format", dst_fmt, *extra]
    if first:
        args += ["--target-num-layers-in-first-stage", str(first)]
    proc = ok(run_cli(*args, nproc=world, fresh=world is None))  # one launch as a user's: python -m dist_convert
    assert "wrote" in proc.stderr and "peak RSS" in proc.stderr  # the summary table
    if "--memory-budget" in extra:  # a small budget really splits the exchange into waves
        assert int(re.search(r"(\d+) waves", proc.stderr).group(1)) > 4
    assert not list(tmp_path.glob("*.dist_convert_tmp"))
    layout = ["--tp", str(tp), "--pp", str(pp)] + (["--first", str(first)] if first else [])
    res = oracle("compare", tp * pp, "--config", str(src.config), *layout, "--ckpt", str(dst),
                 "--ref", str(src.torch_dist), "--check-args")
    assert "ORACLE OK" in res.stdout + res.stderr


def test_round_trip_is_byte_identical(gpt_a, tmp_path):
    """megatron TP2 PP2 -> torch_dist TP1 PP4 -> megatron TP2 PP2 gives back every tensor bit for bit
    (vocabulary padding rows excepted: they are re-padded with zeros)."""
    mid, back = tmp_path / "mid", tmp_path / "back"
    ok(run_cli("reshard", str(gpt_a.megatron), str(mid), "--target-tp", "1", "--target-pp", "4",
               "--dst-format", "torch_dist", nproc=2))
    ok(run_cli("reshard", str(mid), str(back), "--target-tp", "2", "--target-pp", "2", "--dst-format", "megatron",
               nproc=2))
    vocab = gpt_a.cfg["vocab_size"]
    orig_files = sorted((gpt_a.megatron / "iter_0000100").glob("mp_rank_*/model_optim_rng.pt"))
    assert len(orig_files) == 4
    for f in orig_files:
        a = torch.load(f, weights_only=False)
        b = torch.load(back / f.relative_to(gpt_a.megatron), weights_only=False)
        assert set(a["model"]) == set(b["model"])
        for key, t in a["model"].items():
            u = b["model"][key]
            if not isinstance(t, torch.Tensor):
                assert u is None and t is None
                continue
            assert t.dtype == u.dtype and t.shape == u.shape, key
            if key in ("embedding.word_embeddings.weight", "output_layer.weight"):
                tp_rank = int(f.parent.name.split("_")[2])
                rows = max(0, min(t.shape[0], vocab - tp_rank * t.shape[0]))
                assert torch.equal(t[:rows], u[:rows]) and not u[rows:].any(), key
            else:
                assert torch.equal(t, u), key
        assert b["iteration"] == a["iteration"] and b["args"].tensor_model_parallel_size == 2


def test_logits_equal_across_tp(gpt_a, tmp_path):
    """megatron-core forward logits of the TP=2 and TP=1 conversions of one checkpoint agree."""
    outs = []
    for tp in (2, 1):
        dst = tmp_path / f"tp{tp}"
        ok(run_cli("reshard", str(gpt_a.torch_dist), str(dst), "--target-tp", str(tp), "--target-pp", "1",
                   nproc=2))
        logits = tmp_path / f"logits{tp}.pt"
        oracle("logits", tp, "--config", str(gpt_a.config), "--tp", str(tp), "--ckpt", str(dst), "--out", str(logits))
        outs.append(torch.load(logits))
    assert torch.equal(outs[0]["tokens"], outs[1]["tokens"])
    a, b = outs[0]["logits"], outs[1]["logits"]
    assert a.shape[-1] == gpt_a.cfg["vocab_size"] and a.std() > 0.1
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_cast_and_verify_with_tolerance(gpt_b, tmp_path):
    dst = tmp_path / "bf16"
    ok(run_cli("reshard", str(gpt_b.megatron), str(dst), "--target-tp", "1", "--target-pp", "1", "--dtype", "bf16",
               "--dst-format", "torch_dist", nproc=2))
    info = ok(run_cli("inspect", str(dst), "--json"))
    import json
    desc = json.loads(info.stdout)
    assert desc["dtypes"] == {"bfloat16": desc["stored_chunks"]} and desc["layout"]["tp"] == 1
    exact = run_cli("verify", str(gpt_b.megatron), str(dst), nproc=2)
    assert exact.returncode == 1 and "MISMATCH" in exact.stderr
    ok(run_cli("verify", str(gpt_b.megatron), str(dst), "--atol", "1e-2", "--rtol", "1e-2", nproc=2))


def test_verify_across_formats_and_detects_a_changed_tensor(gpt_a, tmp_path):
    ok(run_cli("verify", str(gpt_a.megatron), str(gpt_a.torch_dist), nproc=2))
    import shutil
    bad = tmp_path / "bad"
    shutil.copytree(gpt_a.megatron, bad)
    f = bad / "iter_0000100" / "mp_rank_01_001" / "model_optim_rng.pt"
    ck = torch.load(f, weights_only=False)
    ck["model"]["decoder.layers.1.mlp.linear_fc2.weight"][3, 5] += 1e-3
    torch.save(ck, f)
    proc = run_cli("verify", str(gpt_a.torch_dist), str(bad), nproc=4)
    assert proc.returncode == 1
    assert "decoder.layers.3.mlp.linear_fc2.weight" in proc.stderr  # global layer number (stage 1 starts at 2)
    assert proc.stderr.count("MISMATCH") == 1


def test_transformer_engine_naming_both_ways(gpt_a, tmp_path):
    """--target-spec te writes TE fused names (and TE's extra states); reading them back and
    writing the local spec gives a checkpoint megatron-core loads, equal to the source."""
    te, back = tmp_path / "te", tmp_path / "local"
    ok(run_cli("reshard", str(gpt_a.megatron), str(te), "--target-tp", "1", "--target-pp", "2", "--target-spec", "te",
               nproc=2))
    model = torch.load(te / "iter_0000100" / "mp_rank_00_000" / "model_optim_rng.pt", weights_only=False)["model"]
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in model
    assert "decoder.layers.1.mlp.linear_fc1.layer_norm_weight" in model
    assert "decoder.layers.0.self_attention.core_attention._extra_state" in model
    assert not any("input_layernorm" in k or "pre_mlp_layernorm" in k for k in model)
    ok(run_cli("reshard", str(te), str(back), "--target-tp", "2", "--target-pp", "2", "--target-spec", "local",
               nproc=2))
    res = oracle("compare", 4, "--config", str(gpt_a.config), "--tp", "2", "--pp", "2", "--ckpt", str(back),
                 "--ref", str(gpt_a.torch_dist), "--check-args")
    assert "ORACLE OK" in res.stdout + res.stderr


def test_release_checkpoint_keeps_its_release_directory(gpt_a, tmp_path):
    import shutil
    src = tmp_path / "rel"
    shutil.copytree(gpt_a.megatron, src)
    (src / "iter_0000100").rename(src / "release")
    (src / "latest_checkpointed_iteration.txt").write_text("release")
    dst = tmp_path / "out"
    ok(run_cli("reshard", str(src), str(dst), "--target-tp", "1", "--target-pp", "1"))
    assert (dst / "latest_checkpointed_iteration.txt").read_text() == "release"
    assert (dst / "release" / "mp_rank_00" / "model_optim_rng.pt").is_file()
    ok(run_cli("verify", str(src / "release"), str(dst)))  # an iteration directory works as a path too
