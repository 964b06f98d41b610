"""ModelOpt NVFP4 releases read behind the quantization protocol (dist_convert/formats/nvfp4.py), judged by ModelOpt
0.47 itself: a tiny Llama whose MLP linears are quantized by ModelOpt's own ``NVFP4QTensor.quantize`` (group 16; the
bytes, the float8_e4m3fn scales, the per-tensor ``weight_scale_2``, an ``input_scale`` beside some) and whose
config.json carries the ``quantization_config`` ModelOpt's ``convert_hf_quant_config_format`` writes, read at 2
ranks to plain HF: every such weight equals ModelOpt's ``NVFP4QTensor.dequantize`` bit for bit, every other tensor
the release's, the input scales skipped with a note; slices cutting bytes and groups decode as ModelOpt decodes the
whole."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dist_convert.datamodel import Quantized
from dist_convert.formats.nvfp4 import SCHEME
from dist_convert.layout.boxes import Box

from conftest import ok, run_cli
from hf_models import make_hf_model

GROUP = 16


def modelopt_quantize(w: torch.Tensor) -> dict[str, torch.Tensor]:
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    q, scale, scale_2 = NVFP4QTensor.quantize(w, GROUP)
    return {"weight": q._quantized_data, "weight_scale": scale, "weight_scale_2": scale_2}


def modelopt_dequantize(stored: dict[str, torch.Tensor], shape: tuple[int, int]) -> torch.Tensor:
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    return NVFP4QTensor(torch.Size(shape), torch.bfloat16, stored["weight"]).dequantize(
        dtype=torch.bfloat16, scale=stored["weight_scale"], double_scale=stored["weight_scale_2"],
        block_sizes={-1: GROUP})


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
