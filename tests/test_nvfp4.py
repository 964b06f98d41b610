"""ModelOpt NVFP4 releases read behind the quantization protocol (dist_convert/formats/nvfp4.py), judged by ModelOpt
0.47 itself: a tiny Llama whose MLP linears are quantized by ModelOpt's own ``NVFP4QTensor.quantize`` (group 16; the
bytes, the float8_e4m3fn scales, the per-tensor ``weight_scale_2``, an ``input_scale`` beside some) and whose
config.json carries the ``quantization_config`` ModelOpt's ``convert_hf_quant_config_format`` writes, read at 2
ranks to plain HF: every such weight equals ModelOpt's ``NVFP4QTensor.dequantize`` bit for bit, every other tensor
the release's, the input scales skipped with a note; slices cutting bytes and groups decode as ModelOpt decodes the
whole.

Written with ``--quantize nvfp4``: ModelOpt's own export is the truth. A tiny Qwen3-MoE (dense and MoE layers, tied
embeddings, a router) and a Mixtral (``block_sparse_moe.experts.N.w1/w2/w3``) are quantized by ModelOpt
(``mtq.quantize`` with its MLP-only preset, weight quantizers only: W4A16_NVFP4) and saved by its
``export_hf_checkpoint``; dist_convert's export of the same bf16 weights holds the very bytes of every tensor, gate
and up sharing ``weight_scale_2`` per expert, and the same ``quantization_config`` and ``hf_quant_config.json``.
ModelOpt's Qwen3-MoE release imports to torch_dist at TP2 EP2 in fp32: its weights ModelOpt's dequantization bit for
bit, and megatron-core 0.16.1 loads it strictly and gives transformers' logits on them within 1e-4."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dist_convert.datamodel import Quantized
from dist_convert.formats.nvfp4 import SCHEME
from dist_convert.layout.boxes import Box

from conftest import ok, oracle, run_cli
from hf_models import hf_logits, make_hf_model, oracle_config

GROUP = 16


def modelopt_quantize(w: torch.Tensor) -> dict[str, torch.Tensor]:
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    q, scale, scale_2 = NVFP4QTensor.quantize(w, GROUP)
    return {"weight": q._quantized_data, "weight_scale": scale, "weight_scale_2": scale_2}


def modelopt_dequantize(stored: dict[str, torch.Tensor], shape: tuple[int, int],
                        dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    return NVFP4QTensor(torch.Size(shape), dtype, stored["weight"]).dequantize(
        dtype=dtype, scale=stored["weight_scale"], double_scale=stored["weight_scale_2"], block_sizes={-1: GROUP})


def modelopt_export(src: Path, out: Path) -> None:
    """ModelOpt 0.47 quantizes the model at ``src`` (bf16) with its NVFP4 MLP-only preset, weights only (its input
    quantizers dropped: W4A16_NVFP4, nothing to calibrate), and exports it as a Hugging Face checkpoint."""
    import modelopt.torch.quantization as mtq
    import transformers
    from modelopt.torch.export import export_hf_checkpoint

    cfg = copy.deepcopy(mtq.config.NVFP4_MLP_ONLY_CFG)
    cfg["quant_cfg"] = [e for e in cfg["quant_cfg"] if not str(e.get("quantizer_name")).endswith("input_quantizer")]
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    export_hf_checkpoint(mtq.quantize(model, cfg, forward_loop=None), export_dir=str(out))


@pytest.fixture(scope="module")
def releases(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """family -> (the bf16 model, ModelOpt's W4A16_NVFP4 export of it)."""
    root = tmp_path_factory.mktemp("nvfp4")
    out = {}
    for name in ("qwen3_moe", "mixtral"):
        src = make_hf_model(root, name, dtype=torch.bfloat16)
        modelopt_export(src, root / f"{name}-nvfp4")
        out[name] = src, root / f"{name}-nvfp4"
    return out


def dequantized(stored: dict[str, torch.Tensor], key: str, dtype: torch.dtype) -> torch.Tensor:
    """ModelOpt's dequantization of NVFP4 weight ``key`` of an export's tensors."""
    parts = {"weight": stored[key], "weight_scale": stored[key + "_scale"], "weight_scale_2": stored[key + "_scale_2"]}
    return modelopt_dequantize(parts, (stored[key].shape[0], stored[key].shape[1] * 2), dtype)


def plan(tmp_path: Path, src: Path, *args: str) -> dict:
    """``dist_convert plan`` at 2 ranks, its JSON."""
    from dist_convert.cli import main

    out = tmp_path / "plan.json"
    assert main(["plan", str(src), *args, "--world", "2", "--json", str(out)]) == 0
    return json.loads(out.read_text())


def tensors(path: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_nvfp4_release_reads_as_modelopt_dequantizes_it(tmp_path):
    from modelopt.torch.export.convert_hf_config import convert_hf_quant_config_format

    src = make_hf_model(tmp_path, "llama", dtype=torch.bfloat16)
    rel, dst = tmp_path / "release", tmp_path / "hf"
    rel.mkdir()
    plain = load_file(src / "model.safetensors")
    stored, mlp = {}, [k for k in plain if ".mlp." in k and k.endswith("proj.weight")]
    for k, t in plain.items():
        if k in mlp:
            stored.update({k.removesuffix("weight") + n: v for n, v in modelopt_quantize(t).items()})
            if "gate_proj" in k:  # a calibrated release's activation scale
                stored[k.removesuffix("weight") + "input_scale"] = torch.tensor(0.01)
        else:
            stored[k] = t
    save_file(stored, rel / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = convert_hf_quant_config_format(
        {"producer": {"name": "modelopt", "version": "0.47.0"},
         "quantization": {"quant_algo": "NVFP4", "group_size": GROUP, "exclude_modules": ["lm_head"]}})
    (rel / "config.json").write_text(json.dumps(cfg))
    proc = ok(run_cli("reshard", str(rel), str(dst), "--dst-format", "hf", nproc=2))
    assert "dequantized 6 NVFP4 weights" in proc.stdout + proc.stderr
    assert "skipped 2 activation input_scale" in proc.stdout + proc.stderr
    got = load_file(dst / "model.safetensors")
    for k in mlp:
        base = k.removesuffix("weight")
        want = modelopt_dequantize({n: stored[base + n] for n in ("weight", "weight_scale", "weight_scale_2")},
                                   tuple(plain[k].shape))
        assert torch.equal(got[k].view(torch.int16), want.view(torch.int16)), k  # bits, signed zeros included
        assert not torch.equal(want, plain[k]), k
    assert set(got) == set(plain) and all(torch.equal(got[k], plain[k]) for k in plain if k not in mlp)


@pytest.mark.parametrize("box", [Box((0, 0), (6, 64)), Box((1, 7), (4, 33)), Box((5, 15), (1, 2))])
def test_nvfp4_slices_decode_like_modelopt_decodes_the_whole(box):
    w = (torch.randn(6, 64, generator=torch.Generator().manual_seed(2)) / 8).to(torch.bfloat16)
    stored = modelopt_quantize(w)
    whole = modelopt_dequantize(stored, (6, 64))
    q = Quantized("nvfp4", (("f", "w"), ("f", "s"), ("f", "s2")), (GROUP,))
    boxes = SCHEME.boxes(q, box)
    parts = [t[b.slices()] for t, b in zip((stored["weight"], stored["weight_scale"], stored["weight_scale_2"]),
                                           boxes, strict=True)]
    assert torch.equal(SCHEME.dequantize(q, parts, box, torch.bfloat16).view(torch.int16),
                       whole[box.slices()].contiguous().view(torch.int16))


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_nvfp4_export_is_what_modelopt_exports(releases, tmp_path, name):
    """``--quantize nvfp4`` at 2 ranks, in 2 shards (gate and up kept in one file, as their shared scale needs):
    every tensor ModelOpt's export holds, byte for byte, and its two configs."""
    src, truth = releases[name]
    dst = tmp_path / "ours"
    ok(run_cli("reshard", str(src), str(dst), "--dst-format", "hf", "--quantize", "nvfp4", "--max-shard-size", "60KB",
               nproc=2))
    assert len(list(dst.glob("*.safetensors"))) > 1
    want, got = tensors(truth), tensors(dst)
    assert set(got) == set(want)
    for k, t in want.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape, k
        assert torch.equal(got[k].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), k
    quantized = [k for k, t in want.items() if t.dtype == torch.uint8]
    assert len(quantized) == {"qwen3_moe": 2 * 3 + 4 * 3, "mixtral": 2 * 4 * 3}[name]  # dense MLPs, experts
    plain = tensors(src)
    for k in quantized:  # the comparison is not vacuous: quantization changed every such weight
        assert not torch.equal(dequantized(want, k, torch.bfloat16), plain[k]), k
    gate = next(k for k in quantized if k.endswith(("gate_proj.weight", "w1.weight")))
    up = gate.replace("gate_proj", "up_proj").replace("w1.", "w3.")
    assert torch.equal(want[gate + "_scale_2"], want[up + "_scale_2"])
    for f in ("hf_quant_config.json",):
        assert json.loads((dst / f).read_text()) == json.loads((truth / f).read_text())
    assert (json.loads((dst / "config.json").read_text())["quantization_config"]
            == json.loads((truth / "config.json").read_text())["quantization_config"])
    est = plan(tmp_path, src, "--dst-format", "hf", "--quantize", "nvfp4", "--max-shard-size", "60KB")
    stored = sum(t.numel() * t.element_size() for t in got.values())
    assert est["target"]["stored_bytes"] == sum(r["written_bytes"] for r in est["ranks"]) == stored
    assert est["target"]["bytes"] == sum(t.numel() * t.element_size() for t in plain.values()) > stored


def test_nvfp4_release_imports_to_megatron_core_bit_exactly(releases, tmp_path):
    """ModelOpt's Qwen3-MoE release -> torch_dist TP2 EP2 in fp32 (each rank decoding its experts' bytes) -> HF: every
    NVFP4 weight ModelOpt's dequantization in fp32 bit for bit, every other tensor the release's; megatron-core loads
    the target strictly (at TP1 EP2: it reshards on load) and gives the logits transformers computes on those
    weights within 1e-4."""
    _, rel = releases["qwen3_moe"]
    mc, back = tmp_path / "mc", tmp_path / "hf32"
    est = plan(tmp_path, rel, "--dst-format", "torch_dist", "--target-tp", "2", "--target-ep", "2")
    stored = sum(t.numel() * t.element_size() for t in tensors(rel).values())
    assert est["source"]["stored_bytes"] == sum(r["read_bytes"] for r in est["ranks"]) == stored
    assert est["source"]["bytes"] > stored
    ok(run_cli("reshard", str(rel), str(mc), "--dst-format", "torch_dist", "--target-tp", "2", "--target-ep", "2",
               "--target-spec", "local", "--dtype", "fp32", nproc=2))
    ok(run_cli("reshard", str(mc), str(back), "--dst-format", "hf", nproc=2))
    stored, got = tensors(rel), tensors(back)
    quantized = [k for k, t in stored.items() if t.dtype == torch.uint8]
    assert len(quantized) == 18 and set(got) == {k for k in stored if not k.endswith(("_scale", "_scale_2"))}
    for k in quantized:
        want = dequantized(stored, k, torch.float32)
        assert got[k].dtype == torch.float32 and torch.equal(got[k], want), k
    assert all(torch.equal(got[k], stored[k].float()) for k in got if k not in quantized)
    config = tmp_path / "oracle.json"
    config.write_text(json.dumps(oracle_config(rel)))
    out = tmp_path / "logits.pt"
    oracle("logits", 2, "--config", str(config), "--tp", "1", "--ep", "2", "--ckpt", str(mc), "--out", str(out))
    logits = torch.load(out)
    want = hf_logits(back, logits["tokens"])
    assert want.std() > 0.5
    torch.testing.assert_close(logits["logits"], want, rtol=1e-4, atol=1e-4)


def test_nvfp4_release_resharded_to_nvfp4_keeps_its_weights(releases, tmp_path):
    """ModelOpt's release read and written again with ``--quantize nvfp4``: the same scales, the same per-tensor
    scales and the same values; the bytes differ only where ModelOpt stored a negative value that rounds to zero as
    e2m1's -0 (nibble 0x8), which its own dequantization reads as +0 and so comes back as 0x0."""
    _, rel = releases["qwen3_moe"]
    dst = tmp_path / "again"
    ok(run_cli("reshard", str(rel), str(dst), "--dst-format", "hf", "--quantize", "nvfp4", "--dtype", "fp32",
               nproc=2))
    want, got = tensors(rel), tensors(dst)
    assert set(got) == set(want)
    quantized = [k for k, t in want.items() if t.dtype == torch.uint8]
    negative_zeros = 0
    for k in quantized:
        for s in ("_scale", "_scale_2"):
            assert torch.equal(got[k + s].reshape(-1).view(torch.uint8), want[k + s].reshape(-1).view(torch.uint8))
        nibbles = [torch.stack((t & 0xF, t >> 4)) for t in (want[k], got[k])]
        assert torch.equal(torch.where(nibbles[0] == 0x8, 0, nibbles[0]), nibbles[1]), k
        negative_zeros += int((nibbles[0] == 0x8).sum())
        assert torch.equal(dequantized(got, k, torch.float32), dequantized(want, k, torch.float32)), k
    assert negative_zeros > 0  # the case the docstring speaks of is there
    assert json.loads((dst / "config.json").read_text())["quantization_config"] == json.loads(
        (rel / "config.json").read_text())["quantization_config"]
