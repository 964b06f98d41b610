"""Mixture-of-Experts end to end: megatron-core MoE GPT checkpoints (made by the oracle at expert-parallel
layouts) resharded over TP, PP, EP and expert-TP by the real CLI under torchrun; megatron-core loads every
output strictly at the target layout and finds it equal to the source."""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest
import torch

from dist_convert.features import MoE as MoERecord
from dist_convert.formats.megatron import extra_state_keys, rank_entries
from dist_convert.layout.topology import Layout

from conftest import Source, assert_refused, make_gpt, ok, oracle, run_cli
from test_rules_vs_mcore import assert_torch_dist_matches, model_config

# M: mixed dense/MoE layers (a list moe_layer_freq: per-layer torch_dist keys), SwiGLU experts, shared
# experts with a gate, router expert bias (fp32), tied embeddings.
# S: every layer MoE (stacked torch_dist keys with layer and expert axes), GeLU, LayerNorm, untied.
MOE = {
    "M": {"num_layers": 4, "hidden_size": 32, "ffn_hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
          "swiglu": True, "normalization": "RMSNorm", "add_bias_linear": False, "vocab_size": 100,
          "make_vocab_size_divisible_by": 16, "position_embedding_type": "rope", "max_position_embeddings": 32,
          "seq_length": 32, "num_experts": 4, "moe_ffn_hidden_size": 16, "moe_shared_expert_intermediate_size": 24,
          "moe_shared_expert_gate": True, "moe_layer_freq": [0, 1, 0, 1], "moe_router_topk": 2,
          "moe_router_enable_expert_bias": True, "moe_router_score_function": "sigmoid"},
    "S": {"num_layers": 2, "hidden_size": 32, "ffn_hidden_size": 64, "num_attention_heads": 4, "swiglu": False,
          "normalization": "LayerNorm", "add_bias_linear": False, "untie_embeddings_and_output_weights": True,
          "vocab_size": 90, "make_vocab_size_divisible_by": 8, "position_embedding_type": "learned_absolute",
          "max_position_embeddings": 32, "seq_length": 32, "num_experts": 8, "moe_ffn_hidden_size": 32,
          "moe_layer_freq": 1, "moe_router_topk": 2},
}


@pytest.fixture(scope="session")
def moe_m(tmp_path_factory) -> Source:
    """M saved at TP1 EP2 (two data-parallel ranks, two experts each)."""
    return make_gpt(tmp_path_factory.mktemp("moe"), "M", MOE["M"], 1, 1, ep=2)


@pytest.fixture(scope="session")
def moe_s(tmp_path_factory) -> Source:
    """S saved at TP1 PP2 EP2 (legacy rank directories mp_rank_00_PPP_EEE)."""
    return make_gpt(tmp_path_factory.mktemp("moe"), "S", MOE["S"], 1, 2, ep=2)


def world(tp: int, pp: int, ep: int, etp: int | None) -> int:
    """The smallest world megatron-core accepts: tp*pp*dp ranks with ep*etp dividing tp*dp."""
    dp = 1
    while (tp * dp) % (ep * (etp or tp)):
        dp += 1
    return tp * pp * dp


def layout_flags(tp: int, pp: int, ep: int, etp: int | None) -> list[str]:
    return ["--tp", str(tp), "--pp", str(pp), "--ep", str(ep)] + (["--etp", str(etp)] if etp else [])


def compare(src: Source, ckpt: Path, tp: int, pp: int, ep: int, etp: int | None = None) -> None:
    res = oracle("compare", world(tp, pp, ep, etp), "--config", str(src.config), *layout_flags(tp, pp, ep, etp),
                 "--ckpt", str(ckpt), "--ref", str(src.torch_dist), "--check-args")
    assert "ORACLE OK" in res.stdout + res.stderr


LAYOUTS = [("M", 1, 1, 2, None), ("M", 2, 1, 2, 1), ("S", 1, 2, 2, None)]


@pytest.mark.parametrize("name,tp,pp,ep,etp", LAYOUTS, ids=[f"{c[0]}-tp{c[1]}pp{c[2]}ep{c[3]}etp{c[4] or c[1]}"
                                                             for c in LAYOUTS])
def test_moe_table_matches_megatron_core(tmp_path, name, tp, pp, ep, etp):
    """What megatron-core's MoE model asks a checkpoint to hold at (TP, PP, EP, ETP): the torch_dist chunks
    and objects (per-layer or stacked keys, expert axis) and each legacy rank file's state_dict."""
    cfg_dict = {"num_query_groups": MOE[name]["num_attention_heads"], "add_qkv_bias": False, **MOE[name]}
    config = tmp_path / "c.json"
    config.write_text(json.dumps(cfg_dict))
    out = tmp_path / "layout.json"
    oracle("layout", world(tp, pp, ep, etp), "--config", str(config), *layout_flags(tp, pp, ep, etp), "--out", str(out))
    ranks = json.loads(out.read_text())
    cfg = model_config({"untie_embeddings_and_output_weights": False, "max_position_embeddings": 32,
                        **cfg_dict}).replace(moe=MoERecord.from_args(argparse.Namespace(**cfg_dict)))
    layout = Layout(tp=tp, pp=pp, ep=ep, etp=etp)
    assert_torch_dist_matches(ranks, cfg, layout)
    if etp is None:  # legacy files exist only with ETP = TP
        for r in ranks:
            entries = rank_entries(cfg, layout, r["tp_rank"], r["pp_rank"], "local", r["ep_rank"])
            got = {k: list(shape) for k, (shape, _) in entries.items()}
            got.update({k: None for k in extra_state_keys(cfg, layout, r["pp_rank"], "local")})
            assert got == r["state_dict"], (r["tp_rank"], r["pp_rank"], r["ep_rank"])


# (source, src format, dst format, target tp, pp, ep, etp, CLI world)
CASES = [
    ("M", "torch_dist", "torch_dist", 2, 1, 1, None, 2),  # EP 2 -> 1, TP 1 -> 2 (experts split over ETP=TP)
    ("M", "torch_dist", "torch_dist", 2, 1, 2, 1, 2),  # attention TP2, experts unsplit (ETP=1) on 2 EP ranks
    ("M", "megatron", "torch_dist", 1, 1, 4, None, 2),  # legacy EP2 files -> one expert per EP rank
    ("M", "torch_dist", "megatron", 1, 2, 2, None, 4),  # legacy mp_rank_00_PPP_EEE target
    ("S", "megatron", "torch_dist", 2, 1, 1, None, 2),  # stacked keys, PP2 EP2 -> TP2
]


@pytest.mark.parametrize("name,src_fmt,dst_fmt,tp,pp,ep,etp,nproc", CASES,
                         ids=[f"{c[0]}-{c[1]}-to-{c[2]}-tp{c[3]}pp{c[4]}ep{c[5]}etp{c[6] or c[3]}" for c in CASES])
def test_moe_reshard_loads_in_megatron_core(request, tmp_path, name, src_fmt, dst_fmt, tp, pp, ep, etp, nproc):
    src = request.getfixturevalue(f"moe_{name.lower()}")
    dst = tmp_path / "out"
    flags = ["--target-tp", str(tp), "--target-pp", str(pp), "--target-ep", str(ep)]
    flags += ["--target-etp", str(etp)] if etp else []
    proc = ok(run_cli("reshard", str(getattr(src, src_fmt)), str(dst), "--dst-format", dst_fmt, *flags, nproc=nproc))
    assert f"EP={ep} ETP={etp or tp}" in proc.stderr or (ep == 1 and not etp)
    compare(src, dst, tp, pp, ep, etp)


def test_moe_round_trip_is_byte_identical_and_logits_agree(moe_m, tmp_path):
    """legacy TP1 EP2 -> torch_dist TP2 ETP1 EP1 -> legacy TP1 EP2 gives back every tensor bit for bit
    (router expert bias kept in fp32); megatron-core's MoE forward gives the same logits on the source
    and on the resharded checkpoint."""
    mid, back = tmp_path / "mid", tmp_path / "back"
    ok(run_cli("reshard", str(moe_m.megatron), str(mid), "--dst-format", "torch_dist", "--target-tp", "2",
               "--target-etp", "1", "--target-ep", "1", nproc=2))
    ok(run_cli("reshard", str(mid), str(back), "--dst-format", "megatron", "--target-tp", "1", "--target-ep", "2",
               nproc=2))
    files = sorted((moe_m.megatron / "iter_0000100").glob("mp_rank_*/model_optim_rng.pt"))
    assert [f.parent.name for f in files] == ["mp_rank_00_000", "mp_rank_00_001"]
    for f in files:
        a = torch.load(f, weights_only=False)["model"]
        b = torch.load(back / f.relative_to(moe_m.megatron), weights_only=False)["model"]
        assert set(a) == set(b)
        assert any(".local_experts.1.linear_fc1.weight" in k for k in a)
        assert a["decoder.layers.1.mlp.router.expert_bias"].dtype == torch.float32
        vocab = moe_m.cfg["vocab_size"]  # padding rows are re-padded with zeros
        for k, x in a.items():
            if isinstance(x, torch.Tensor):
                y = b[k]
                assert x.dtype == y.dtype and x.shape == y.shape, k
                if k == "embedding.word_embeddings.weight":
                    x, y = x[:vocab], y[:vocab]
                assert torch.equal(x, y), k
            else:
                assert x is None and b[k] is None, k
    logits = []
    for ckpt, flags in ((moe_m.torch_dist, ["--tp", "1", "--ep", "2"]), (mid, ["--tp", "2", "--etp", "1"])):
        out = tmp_path / f"logits{len(logits)}.pt"
        oracle("logits", 2, "--config", str(moe_m.config), *flags, "--ckpt", str(ckpt), "--out", str(out))
        logits.append(torch.load(out)["logits"])
    assert torch.allclose(logits[0], logits[1], atol=1e-5, rtol=1e-5), (logits[0] - logits[1]).abs().max()


def test_grouped_gemm_expert_names(moe_s, tmp_path):
    """Legacy files of TEGroupedMLP models name a rank's experts ``mlp.experts.linear_fc1.weight{i}`` (one
    extra state per grouped linear). Such a source converts to a torch_dist megatron-core loads, and a
    legacy target keeps the naming."""
    src = tmp_path / "grouped"
    shutil.copytree(moe_s.megatron, src)
    renamed = 0
    for f in sorted(src.glob("iter_*/mp_rank_*/model_optim_rng.pt")):
        ckpt = torch.load(f, weights_only=False)
        model = {}
        for k, v in ckpt["model"].items():
            head, sep, tail = k.partition(".mlp.experts.local_experts.")
            if not sep:
                model[k] = v
                continue
            local, linear, what = tail.split(".")
            if what == "_extra_state":
                model[f"{head}.mlp.experts.{linear}._extra_state"] = None
            else:
                model[f"{head}.mlp.experts.{linear}.{what}{local}"] = v
                renamed += 1
        ckpt["model"] = model
        torch.save(ckpt, f)
    assert renamed == 4 * 4 * 2  # 4 files x 4 local experts x (fc1, fc2), one layer per file
    dst, back = tmp_path / "td", tmp_path / "back"
    ok(run_cli("reshard", str(src), str(dst), "--dst-format", "torch_dist", "--target-pp", "1", "--target-ep", "1",
               nproc=2))
    compare(moe_s, dst, 1, 1, 1)
    ok(run_cli("reshard", str(src), str(back), "--target-ep", "4", nproc=2))
    model = torch.load(back / "iter_0000100" / "mp_rank_00_001_003" / "model_optim_rng.pt", weights_only=False)["model"]
    assert "decoder.layers.0.mlp.experts.linear_fc2.weight1" in model
    assert "decoder.layers.0.mlp.experts.linear_fc1._extra_state" in model
    assert not any("local_experts" in k for k in model)


@pytest.mark.parametrize("flags,needles", [
    (["--target-ep", "3"], ["EP=3 does not divide num_experts=4", "--target-ep"]),
    (["--target-etp", "3"], ["ETP=3 does not divide", "--target-etp"]),
    (["--target-tp", "2", "--target-etp", "1", "--dst-format", "megatron"], ["legacy rank files", "--target-etp"]),
    (["--dst-format", "hf", "--target-ep", "2"], ["unsharded", "--target-ep"]),
])
def test_moe_layout_refusals(moe_m, tmp_path, flags, needles):
    assert_refused(run_cli("reshard", str(moe_m.torch_dist), str(tmp_path / "dst"), *flags), tmp_path, *needles)


def test_speculate_refuses_an_moe_base(moe_m, tmp_path):
    assert_refused(run_cli("speculate", str(moe_m.torch_dist), str(tmp_path / "dst"), "--eagle-layers", "1"),
                   tmp_path, "Mixture-of-Experts", "Megatron-LM")


def test_expert_parallelism_needs_experts(gpt_a, tmp_path):
    assert_refused(run_cli("reshard", str(gpt_a.torch_dist), str(tmp_path / "dst"), "--target-ep", "2"), tmp_path,
                   "the model has no experts", "--target-ep")


def test_legacy_grouped_mlp_is_refused(moe_s, tmp_path):
    """The legacy GroupedMLP keeps a rank's experts in one view-reinterpreted matrix (weight1/weight2): no
    box of it is one expert's weight, so it is refused with the way out rather than misread."""
    src = tmp_path / "src"
    shutil.copytree(moe_s.megatron, src)
    for f in src.glob("iter_*/mp_rank_*/model_optim_rng.pt"):
        ckpt = torch.load(f, weights_only=False)
        ckpt["model"] = {k: v for k, v in ckpt["model"].items() if ".local_experts." not in k}
        ckpt["model"]["decoder.layers.0.mlp.experts.weight1"] = torch.zeros(32, 4 * 32)
        ckpt["model"]["decoder.layers.0.mlp.experts.weight2"] = torch.zeros(4 * 32, 32)
        torch.save(ckpt, f)
    assert_refused(run_cli("reshard", str(src), str(tmp_path / "dst")), tmp_path, "legacy GroupedMLP",
                   "--ckpt-format torch_dist")
