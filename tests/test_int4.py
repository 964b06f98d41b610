"""compressed-tensors ``pack-quantized`` INT4 releases (Kimi-K2-Thinking's experts), read by
dist_convert/formats/int4.py behind the quantization protocol, judged by compressed-tensors 0.20 and transformers
5.14 themselves.

A tiny DeepSeek-V3 (tests/hf_models.py, bf16) has its routed experts' linears compressed by compressed-tensors' own
code, as a release is made: ``calculate_qparams`` over each group's min / max (group 32, symmetric INT4) and
``PackedQuantizationCompressor.compress``, the config as ``QuantizationConfig`` writes it. dist_convert reads it under
torchrun (each rank its words and groups) to a plain HF checkpoint: every expert weight equals compressed-tensors' own
``decompress`` bit for bit, every other tensor the release's; transformers' ``from_pretrained`` of the release (its
compressed-tensors integration decompressing it) gives the very logits of transformers on dist_convert's export; and
the release imported to torch_dist at TP2 EP2 exports back to the same tensors. Slices whose columns cut words and
groups decode exactly as the whole does (pure).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dist_convert.formats import int4
from dist_convert.layout.boxes import Box

from conftest import ok, run_cli
from hf_models import make_hf_model

GROUP = 32


def ct_args():
    from compressed_tensors.quantization import QuantizationArgs

    return QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=GROUP)


def compress(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """compressed-tensors' own quantization of one weight: its qparams and its pack-quantized compressor."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    groups = w.view(w.shape[0], -1, GROUP)
    scale, zp = calculate_qparams(groups.amin(-1), groups.amax(-1), ct_args())
    scheme = QuantizationScheme(targets=["Linear"], weights=ct_args())
    return PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zp},
                                                 scheme)


def decompress(packed: dict[str, torch.Tensor]) -> torch.Tensor:
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    scheme = QuantizationScheme(targets=["Linear"], weights=ct_args())
    return PackedQuantizationCompressor.decompress(dict(packed), scheme)["weight"]


EXPERT = ".mlp.experts."


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> tuple[Path, Path]:
    """(the bf16 model, its INT4 release: routed experts compressed, everything else as it was)."""
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme

    root = tmp_path_factory.mktemp("int4")
    src = make_hf_model(root, "deepseek_v3", dtype=torch.bfloat16)
    out = root / "release"
    out.mkdir()
    tensors = load_file(src / "model.safetensors")
    stored = {}
    for k, t in tensors.items():
        if EXPERT in k and k.endswith(".weight"):
            stored.update({k.removesuffix("weight") + name: v for name, v in compress(t).items()})
        else:
            stored[k] = t
    save_file(stored, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    scheme = QuantizationScheme(targets=["Linear"], weights=ct_args())
    cfg["quantization_config"] = QuantizationConfig(
        config_groups={"group_0": scheme}, format="pack-quantized", quantization_status="compressed",
        ignore=["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj$",
                "re:.*mlp\\.gate$"]).model_dump(exclude_none=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in ("generation_config.json", "tokenizer_config.json"):
        if (src / f).is_file():
            (out / f).write_bytes((src / f).read_bytes())
    return src, out


def test_int4_release_reads_as_compressed_tensors_decompresses_it(release, tmp_path):
    src, rel = release
    dst = tmp_path / "hf"
    proc = ok(run_cli("reshard", str(rel), str(dst), "--dst-format", "hf", nproc=2))
    assert "compressed-tensors INT4" in proc.stdout + proc.stderr
    stored, got, plain = load_file(rel / "model.safetensors"), load_file(dst / "model.safetensors"), \
        load_file(src / "model.safetensors")
    experts = sorted(k for k in plain if EXPERT in k and k.endswith(".weight"))
    assert len(experts) == 3 * 8 * 2  # gate, up, down of 8 experts in 2 MoE layers
    for k in experts:
        base = k.removesuffix("weight")
        want = decompress({n: stored[base + n] for n in ("weight_packed", "weight_scale", "weight_shape")})
        assert got[k].dtype == want.dtype == torch.bfloat16 and torch.equal(got[k], want), k
        assert not torch.equal(want, plain[k])  # quantization changed it: the comparison is not vacuous
    assert set(got) == set(plain) and all(torch.equal(got[k], plain[k]) for k in plain if k not in experts)
    assert "quantization_config" not in json.loads((dst / "config.json").read_text())
    import transformers

    ids = torch.randint(0, 150, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = transformers.AutoModelForCausalLM.from_pretrained(rel, dtype=torch.bfloat16).eval()(ids).logits
        ours = transformers.AutoModelForCausalLM.from_pretrained(dst, dtype=torch.bfloat16).eval()(ids).logits
    assert torch.equal(theirs, ours)


def test_int4_release_imports_to_megatron_core_and_back(release, tmp_path):
    """HF INT4 -> torch_dist TP2 EP2 (each rank decoding only its experts) -> HF: the decompressed tensors."""
    _, rel = release
    td, back, direct = tmp_path / "td", tmp_path / "back", tmp_path / "direct"
    ok(run_cli("reshard", str(rel), str(td), "--dst-format", "torch_dist", "--target-tp", "2", "--target-ep", "2",
               nproc=2))
    ok(run_cli("reshard", str(td), str(back), "--dst-format", "hf", nproc=2))
    ok(run_cli("reshard", str(rel), str(direct), "--dst-format", "hf", nproc=1))
    a, b = load_file(direct / "model.safetensors"), load_file(back / "model.safetensors")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("cols,rows,box", [(96, 5, Box((0, 0), (5, 96))), (96, 5, Box((1, 13), (3, 50))),
                                           (160, 4, Box((0, 61), (4, 99))), (64, 3, Box((2, 31), (1, 2)))])
def test_slices_decode_like_the_whole(cols, rows, box):
    """A box whose columns cut int32 words and scale groups decodes to that box of the whole weight, bit for bit
    (the whole compressed and decoded by compressed-tensors)."""
    g = torch.Generator().manual_seed(cols + rows)
    packed = compress((torch.randn(rows, cols, generator=g) / math.sqrt(cols)).to(torch.bfloat16))
    whole = decompress(packed)
    words = packed["weight_packed"][int4.word_box(box).slices()]
    scales = packed["weight_scale"][int4.group_box(box, GROUP).slices()]
    assert torch.equal(int4.dequantize(words, scales, box, GROUP, torch.bfloat16), whole[box.slices()])
