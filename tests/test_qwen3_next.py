"""Qwen3-Next (``Qwen3NextForCausalLM``) and Qwen3.5 (``Qwen3_5ForCausalLM``, ``Qwen3_5MoeForCausalLM``),
dist_convert/models/qwen3_next.py: Gated DeltaNet layers among gated full-attention layers, converted under torchrun
and judged by code nobody here wrote.

transformers makes each tiny random model (tests/oracles/qwen3_next.py: key heads 2 < value heads 4, dk != dv,
partial RoPE, 2 query heads per group, every tensor random, the gated output norm in [0.5, 2]); Megatron-Bridge 0.6.2
imports it at TP 1 on megatron-core 0.19.2 (the names' and values' truth: its output norm is HF's minus 1), and
megatron-core's own ``dist_checkpointing`` reshards that import to the judged layout: every rank's tensors of
dist_convert's targets must equal those, loaded strictly (torch_dist: no missing or unexpected key or object;
legacy: each rank's own file), and megatron-core's GPTModel gives transformers' logits within 1e-4 (the CPU has no
flash-linear-attention: the oracle stands in for its kernels with megatron-core's own torch gated delta rule and the
same math; every projection, split, conv, norm and gate stays megatron-core's). Back to HF: bit-exact, a clean
``from_pretrained``, the same config. A q/gate swap megatron-core's loader accepts must fail the judge. A release
carrying its MTP layer (``mtp.*``, which transformers skips) converts the rest with one note.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import ok, oracle, run_cli


def qwen(cmd: str, *args: str, nproc: int = 1, check: bool = True):
    return oracle(cmd, nproc, *args, program="qwen3_next", runtime="mcore19", check=check)


def verdicts(proc) -> dict[str, dict]:
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {Path(v["ckpt"]).name: v for v in lines if "ckpt" in v}


UNPADDED = ["--make-vocab-size-divisible-by", "1"]  # 300 rows, as Bridge imports it (padding is tested elsewhere)
TD_TP2 = ["--dst-format", "torch_dist", "--target-tp", "2", *UNPADDED]
TD_PP2 = ["--dst-format", "torch_dist", "--target-tp", "1", "--target-pp", "2", *UNPADDED]
# per architecture: target name -> (flags, source name), in order; then the judge runs: (judge layout flags, world,
# targets judged there). Qwen3-Next carries the most (EP2, TP1 PP2 -> legacy TP2, a mutation); Qwen3.5 adds its flat
# in_proj and dense MLP, Qwen3.5-MoE the pairing of both.
ARCHS = {
    "qwen3_next": (
        {"td_tp2_ep2": (TD_TP2 + ["--target-ep", "2"], "hf"), "td_pp2": (TD_PP2, "hf"),
         "td_release": (TD_TP2 + ["--target-ep", "2"], "hf_release"),
         "legacy_tp2": (["--dst-format", "megatron", "--target-tp", "2", "--target-pp", "1"], "td_pp2"),
         "hf_back": (["--dst-format", "hf"], "td_tp2_ep2"),
         "hf_back_legacy": (["--dst-format", "hf"], "legacy_tp2")},
        [(["--tp", "2", "--ep", "2"], 2, ["td_tp2_ep2", "td_pp2", "td_release", "mutated"]),
         (["--tp", "2"], 2, ["legacy_tp2"])]),
    "qwen3_5": (
        {"td_tp2": (TD_TP2, "hf"), "td_pp2": (TD_PP2, "hf"),
         "legacy_tp2": (["--dst-format", "megatron", "--target-tp", "2", *UNPADDED], "hf"),
         "hf_back": (["--dst-format", "hf"], "td_tp2"), "hf_back_legacy": (["--dst-format", "hf"], "legacy_tp2")},
        [(["--tp", "2"], 2, ["td_tp2", "td_pp2", "legacy_tp2"])]),
    "qwen3_5_moe": (
        {"td_tp2_ep2": (TD_TP2 + ["--target-ep", "2"], "hf"), "hf_back": (["--dst-format", "hf"], "td_tp2_ep2")},
        [(["--tp", "2", "--ep", "2"], 2, ["td_tp2_ep2"])]),
}


def release_with_mtp(hf: Path, out: Path) -> None:
    """The model as the Qwen3-Next releases store it: with an MTP layer (``mtp.*``) transformers' loader skips."""
    from safetensors.torch import load_file, save_file

    out.mkdir()
    for f in hf.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(hf / "model.safetensors"))
    tensors.update({"mtp.fc.weight": torch.randn(64, 128), "mtp.layers.0.input_layernorm.weight": torch.randn(64)})
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module", params=sorted(ARCHS))
def converted(request, tmp_path_factory) -> tuple[str, Path]:
    arch = request.param
    root = tmp_path_factory.mktemp(arch)
    qwen("make", str(root / "hf"), "--arch", arch)
    qwen("bridge-import", str(root / "hf"), str(root / "truth"))
    if arch == "qwen3_next":
        release_with_mtp(root / "hf", root / "hf_release")
    for name, (flags, src) in ARCHS[arch][0].items():
        proc = ok(run_cli("reshard", str(root / src), str(root / name), *flags, nproc=2))
        if src == "hf_release":  # read past with one note; the judge checks the rest converted
            assert "skipped 2 tensors under mtp." in proc.stdout + proc.stderr
    if arch == "qwen3_next":
        qwen("mutate", str(root / "truth"), str(root / "mutated"), "--hf", str(root / "hf"), "--kind", "swap_q_gate")
    return arch, root


def test_megatron_targets_judged_by_megatron_core(converted):
    arch, root = converted
    for layout, world, names in ARCHS[arch][1]:
        proc = qwen("judge", "--truth", str(root / "truth"), "--hf", str(root / "hf"), *layout,
                    *(str(root / n) for n in names), nproc=world, check=False)
        got = verdicts(proc)
        assert set(got) == set(names), proc.stdout[-3000:] + proc.stderr[-3000:]
        for n in names:
            if n == "mutated":  # the judge can fail
                assert not got[n]["ok"] and proc.returncode != 0, got[n]
                continue
            assert got[n]["ok"] and got[n]["loaded_tensors"] > 0, got[n]
            if "--pp" not in layout:
                assert got[n]["logits_max_abs_diff_vs_hf"] < 1e-4, got[n]


def test_back_to_hf_is_bit_exact(converted):
    from safetensors.torch import load_file

    arch, root = converted
    hf = root / "hf"
    a = load_file(str(hf / "model.safetensors"))
    for back in [n for n in ARCHS[arch][0] if n.startswith("hf_back")]:
        b = load_file(str(root / back / "model.safetensors"))
        assert set(a) == set(b), back
        for k in a:
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), (back, k)
        src, dst = json.loads((hf / "config.json").read_text()), json.loads((root / back / "config.json").read_text())
        assert {k: dst.get(k) for k in src if k != "transformers_version"} == \
            {k: v for k, v in src.items() if k != "transformers_version"}, back
    import transformers

    model, info = transformers.AutoModelForCausalLM.from_pretrained(root / "hf_back", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info

