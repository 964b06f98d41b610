"""Megatron-FSDP (``--ckpt-format fsdp_dtensor``) end to end: a source made by megatron-core 0.19.2's own
Megatron-FSDP and fsdp_dtensor handlers (tests/oracles/fsdp.py), converted by the real CLI under torchrun
to torch_dist and legacy files that megatron-core loads strictly and finds equal to a reference; torch_dist
converted to fsdp_dtensor, loaded back through Megatron-LM's strict fsdp_dtensor load path and compared."""
from __future__ import annotations

import argparse
import pickle
import shutil
from pathlib import Path

import pytest
from test_moe import MOE

from dist_convert.config import config_from_args
from dist_convert.formats.fsdp_dtensor import model_prefix, stored_keys, stored_pieces
from dist_convert.layout.boxes import Box

from conftest import Source, assert_refused, make_gpt, ok, oracle, run_cli

# SwiGLU (fc1 stored as _w/_v halves), RMSNorm, GQA, tied embeddings, RoPE
DENSE = {"num_layers": 3, "hidden_size": 64, "ffn_hidden_size": 96, "num_attention_heads": 4,
         "num_query_groups": 2, "swiglu": True, "normalization": "RMSNorm", "add_bias_linear": False,
         "vocab_size": 100, "make_vocab_size_divisible_by": 16, "position_embedding_type": "rope",
         "max_position_embeddings": 32, "seq_length": 32}
ITER = "iter_0000100"


@pytest.fixture(scope="module")
def ref(tmp_path_factory) -> Source:
    """The reference: megatron-core 0.16.1 saves the model (seed 1234) at TP1 as torch_dist (it loads at any TP)."""
    return make_gpt(tmp_path_factory.mktemp("fsdp"), "F", DENSE, 1, 1)


@pytest.fixture(scope="module")
def fsdp_src(ref: Source) -> Path:
    """The same model saved by megatron-core 0.19.2's Megatron-FSDP at TP1 x DP2: every parameter in two
    uneven row chunks (its vocabulary padded for TP1). A TP2 x DP2 save (TP and FSDP chunks) converts and
    compares the same way; one launch width keeps the suite short."""
    out = ref.config.parent / "F_fsdp"
    oracle("make", 2, "--config", str(ref.config), "--tp", "1", "--seed", "1234", "--iteration", "100",
           "--out", str(out), program="fsdp", runtime="mcore19")
    return out


# (direction, ranks, target TP): fsdp_dtensor (TP1) -> torch_dist / megatron at TP2 (vocabulary re-padded)
# judged by oracles.mcore's strict load at TP2; torch_dist (TP1) -> fsdp_dtensor at TP2 judged by fsdp_oracle
CASES = [("fsdp->torch_dist", 2, 2), ("fsdp->megatron", 4, 2), ("torch_dist->fsdp", 2, 2)]


@pytest.mark.parametrize("case,nproc,tp", CASES, ids=[c[0] for c in CASES])
def test_convert(ref: Source, fsdp_src: Path, tmp_path: Path, case: str, nproc: int, tp: int) -> None:
    src_fmt, dst_fmt = case.split("->")
    src = fsdp_src if src_fmt == "fsdp" else ref.torch_dist
    dst = tmp_path / "dst"
    proc = ok(run_cli("reshard", str(src), str(dst), "--dst-format", dst_fmt.replace("fsdp", "fsdp_dtensor"),
                      "--target-tp", str(tp), nproc=nproc))
    if src_fmt == "fsdp":
        assert "training-state items" in proc.stderr + proc.stdout  # rng_state, opt_param_scheduler: skipped
        judged = oracle("compare", 2, "--config", str(ref.config), "--tp", str(tp), "--ckpt", str(dst),
                        "--ref", str(ref.torch_dist), "--check-args")
    else:
        assert not (dst / ITER / "metadata.json").exists() and not (dst / ITER / "common.pt").exists()
        judged = oracle("compare", 2, "--config", str(ref.config), "--tp", str(tp), "--ckpt", str(dst),
                        "--ref", str(ref.torch_dist), "--check-args", program="fsdp", runtime="mcore19")
    assert "ORACLE OK" in judged.stdout, judged.stdout[-2000:]


def drop_key(iter_dir: Path, key: str) -> None:
    """Remove ``key`` from a DCP ``.metadata`` (as if its tensor had never been saved)."""
    md = pickle.loads((iter_dir / ".metadata").read_bytes())
    assert key in md.state_dict_metadata, sorted(md.state_dict_metadata)[:5]
    del md.state_dict_metadata[key]
    md.storage_data = {i: s for i, s in md.storage_data.items() if i.fqn != key}
    (iter_dir / ".metadata").write_bytes(pickle.dumps(md))


def test_missing_up_half_refused(fsdp_src: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(fsdp_src, bad)
    drop_key(bad / ITER, "model.module.decoder.layers.1.mlp.linear_fc1.weight_v")
    proc = run_cli("reshard", str(bad), str(tmp_path / "dst"), "--dst-format", "torch_dist", nproc=2)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert_refused(proc, tmp_path, "decoder.layers.1.mlp.linear_fc1.weight_v", "_v up rows", "--allow-missing")


def test_moe_round_trip(tmp_path: Path) -> None:
    """MoE (mixed dense/MoE layers, SwiGLU routed and shared experts, expert bias) saved at TP1 EP2 ->
    fsdp_dtensor (experts under global indices) -> torch_dist at EP2 again, each output judged."""
    src = make_gpt(tmp_path, "M", {**MOE["M"], "num_layers": 2, "moe_layer_freq": [1, 0]}, 1, 1, ep=2)
    mid, back = tmp_path / "fsdp", tmp_path / "back"
    ok(run_cli("reshard", str(src.torch_dist), str(mid), "--dst-format", "fsdp_dtensor", "--target-ep", "1", nproc=2))
    judged = oracle("compare", 2, "--config", str(src.config), "--tp", "1", "--ckpt", str(mid), "--ref",
                    str(src.torch_dist), "--check-args", program="fsdp", runtime="mcore19")
    assert "ORACLE OK" in judged.stdout, judged.stdout[-2000:]
    ok(run_cli("reshard", str(mid), str(back), "--dst-format", "torch_dist", "--target-ep", "2", nproc=2))
    judged = oracle("compare", 2, "--config", str(src.config), "--tp", "1", "--ep", "2", "--ckpt", str(back),
                    "--ref", str(src.torch_dist), "--check-args")
    assert "ORACLE OK" in judged.stdout, judged.stdout[-2000:]


def test_key_map() -> None:
    """Pure: SwiGLU halves map to the gate / up rows of the logical fc1; grouped experts keep their global index."""
    cfg = config_from_args(argparse.Namespace(**DENSE, transformer_impl="local"), None, None, 1)
    keys = stored_keys(cfg)
    assert "decoder.layers.2.mlp.linear_fc1.weight" not in keys and "output_layer.weight" not in keys  # tied
    (v,) = stored_pieces(keys["decoder.layers.2.mlp.linear_fc1.weight_v"], Box((10, 0), (5, 64)))
    assert (v.logical, v.lbox, v.sbox) == ("decoder.layers.2.mlp.linear_fc1.weight", Box((106, 0), (5, 64)),
                                           Box((0, 0), (5, 64)))
    (w,) = stored_pieces(keys["embedding.word_embeddings.weight"], Box((96, 0), (16, 64)))  # rows 100.. pad
    assert w.lbox == Box((96, 0), (4, 64))
    moe = config_from_args(argparse.Namespace(**MOE["M"], transformer_impl="transformer_engine"), None, None, 1)
    assert "decoder.layers.1.mlp.experts.linear_fc1.weight3_v" in stored_keys(moe, grouped=True)
    assert model_prefix(["args", "model.module.module.decoder.layers.0.x"]) == "model.module.module."
