"""compressed-tensors releases read behind the quantization protocol (``formats/quant.py``), judged by
compressed-tensors 0.20 and transformers 5.14 themselves: ``pack-quantized`` INT4 (Kimi-K2-Thinking's experts,
dist_convert/formats/int4.py) and ``float-quantized`` FP8 by channel or tensor (dist_convert/formats/fp8.py).

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

from conftest import ok, oracle, run_cli
from hf_models import hf_logits, make_hf_model, oracle_config

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


def test_inspect_reports_stored_and_dequantized_bytes(release, capsys):
    """inspect of the INT4 release: what its files hold (every stored tensor counted once: packed words, scales and
    shapes for the experts) beside what it dequantizes to, and the scheme per tensor."""
    from dist_convert.cli import main

    src, rel = release
    assert main(["inspect", str(rel), "--json", "--tensors"]) == 0
    info = json.loads(capsys.readouterr().out)
    stored = sum(t.numel() * t.element_size() for t in load_file(rel / "model.safetensors").values())
    plain = sum(t.numel() * t.element_size() for t in load_file(src / "model.safetensors").values())
    assert (info["stored_bytes"], info["bytes"]) == (stored, plain) and stored < plain
    assert any("int4->bfloat16" in r["dtypes"] for r in info["tensors"])


def test_int4_release_imports_to_megatron_core_and_back(release, tmp_path):
    """HF INT4 -> torch_dist TP2 EP2 (each rank decoding only its experts) -> HF: the decompressed tensors, or with
    ``--quantize int4`` the release's own bytes; and
    imported in fp32 at TP2 (megatron-core 0.16.1's local spec): megatron-core loads it strictly and gives, within
    1e-4, the logits transformers computes in fp32 on the release's weights as compressed-tensors decompresses them
    (the fp32 HF export, whose bf16 values the test above holds to the library's ``decompress``)."""
    _, rel = release
    td, back, direct, mc = tmp_path / "td", tmp_path / "back", tmp_path / "direct", tmp_path / "mc"
    ok(run_cli("reshard", str(rel), str(td), "--dst-format", "torch_dist", "--target-tp", "2", "--target-ep", "2",
               nproc=2))
    ok(run_cli("reshard", str(td), str(back), "--dst-format", "hf", nproc=2))
    ok(run_cli("reshard", str(rel), str(direct), "--dst-format", "hf", nproc=1))
    a, b = load_file(direct / "model.safetensors"), load_file(back / "model.safetensors")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    # and quantized again: the weights lie on the release's grid, so its packed words and scales come back as they
    # were (not re-derived as amax / 7.5 of the dequantized values)
    ok(run_cli("reshard", str(td), str(tmp_path / "requant"), "--dst-format", "hf", "--quantize", "int4", nproc=2))
    a, b = load_file(rel / "model.safetensors"), load_file(tmp_path / "requant" / "model.safetensors")
    assert set(a) == set(b) and [k for k in a if not torch.equal(a[k], b[k])] == []
    ok(run_cli("reshard", str(rel), str(mc), "--dst-format", "torch_dist", "--target-tp", "2", "--target-spec",
               "local", "--dtype", "fp32", nproc=2))
    config = tmp_path / "oracle.json"
    config.write_text(json.dumps(oracle_config(rel)))
    oracle("compare", 2, "--config", str(config), "--tp", "2", "--ckpt", str(mc), "--ref", str(mc))
    out = tmp_path / "logits.pt"
    oracle("logits", 2, "--config", str(config), "--tp", "2", "--ckpt", str(mc), "--out", str(out))
    ok(run_cli("reshard", str(rel), str(tmp_path / "hf32"), "--dst-format", "hf", "--dtype", "fp32", nproc=1))
    got = torch.load(out)
    want = hf_logits(tmp_path / "hf32", got["tokens"])
    assert want.std() > 0.5
    torch.testing.assert_close(got["logits"], want, rtol=1e-4, atol=1e-4)


def test_int4_export_is_what_compressed_tensors_writes(release, tmp_path):
    """``--quantize int4`` of the bf16 model: the very tensors of the release compressed-tensors made of it (packed
    words, scales, shapes; the rest as it was), the ``quantization_config`` its ModelCompressor writes for that scheme
    with our ``ignore`` list, and transformers reads it to the release's logits."""
    import transformers
    from compressed_tensors.compressors.model_compressors.model_compressor import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme

    src, rel = release
    dst = tmp_path / "int4"
    ok(run_cli("reshard", str(src), str(dst), "--dst-format", "hf", "--quantize", "int4", nproc=2))
    got, want = load_file(dst / "model.safetensors"), load_file(rel / "model.safetensors")
    assert set(got) == set(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
    ours = json.loads((dst / "config.json").read_text())["quantization_config"]
    qc = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=ct_args())},
                            format="pack-quantized", quantization_status="compressed", ignore=ours["ignore"])
    ref = tmp_path / "ref"
    ref.mkdir()
    (ref / "config.json").write_text("{}")
    ModelCompressor(quantization_config=qc).update_config(str(ref))
    assert ours == json.loads((ref / "config.json").read_text())["quantization_config"]
    assert "lm_head" in ours["ignore"] and "model.layers.1.mlp.gate" in ours["ignore"]
    ids = torch.randint(0, 150, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = transformers.AutoModelForCausalLM.from_pretrained(rel, dtype=torch.bfloat16).eval()(ids).logits
        mine = transformers.AutoModelForCausalLM.from_pretrained(dst, dtype=torch.bfloat16).eval()(ids).logits
    assert torch.equal(theirs, mine)


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


# -- float-quantized FP8 (per channel; per tensor) -------------------------------------------------------------
def fp8_args(strategy: str):
    from compressed_tensors.quantization import QuantizationArgs

    return QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy=strategy)


def fp8_compress(w: torch.Tensor, strategy: str) -> tuple[dict[str, torch.Tensor], object]:
    """compressed-tensors' own FP8 quantization of one weight (its qparams, its float-quantized compressor)."""
    from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    lo, hi = (w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)) if strategy == "channel" else (w.amin(), w.amax())
    scale, zp = calculate_qparams(lo, hi, fp8_args(strategy))
    scheme = QuantizationScheme(targets=["Linear"], weights=fp8_args(strategy))
    return FloatQuantizationCompressor.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zp},
                                                scheme), scheme


def test_fp8_channel_release_reads_as_compressed_tensors_decompresses_it(tmp_path):
    """A tiny Qwen3-MoE whose every linear (experts per expert) is FP8 per output channel, some with a static
    input_scale: read at 2 ranks to plain HF, every weight the library's ``decompress`` bit for bit, the input scales
    dropped with a note; imported to torch_dist at TP2 EP2 (each rank its rows and experts), the same tensors come
    back."""
    from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme

    src = make_hf_model(tmp_path, "qwen3_moe", dtype=torch.bfloat16)
    rel, dst, td, back = tmp_path / "release", tmp_path / "hf", tmp_path / "td", tmp_path / "back"
    rel.mkdir()
    plain = load_file(src / "model.safetensors")
    stored, linears = {}, [k for k in plain if k.endswith("proj.weight")]
    for k, t in plain.items():
        if k in linears:
            packed, _ = fp8_compress(t, "channel")
            stored.update({k.removesuffix("weight") + n: v for n, v in packed.items()})
            if ".self_attn." in k:  # a static scheme's activation scale, which a dequantized model does not use
                stored[k.removesuffix("weight") + "input_scale"] = torch.tensor([0.02])
        else:
            stored[k] = t
    save_file(stored, rel / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=fp8_args("channel"))},
        format="float-quantized", quantization_status="compressed", ignore=["lm_head"]).model_dump(exclude_none=True)
    (rel / "config.json").write_text(json.dumps(cfg))
    proc = ok(run_cli("reshard", str(rel), str(dst), "--dst-format", "hf", nproc=2))
    assert "skipped 12 activation input_scale" in proc.stdout + proc.stderr  # q, k, v, o of 3 layers
    got = load_file(dst / "model.safetensors")
    scheme = QuantizationScheme(targets=["Linear"], weights=fp8_args("channel"))
    for k in linears:
        base = k.removesuffix("weight")
        want = FloatQuantizationCompressor.decompress(
            {"weight": stored[k], "weight_scale": stored[base + "weight_scale"]}, scheme)["weight"]
        assert got[k].dtype == want.dtype and torch.equal(got[k], want) and not torch.equal(want, plain[k]), k
    assert set(got) == set(plain) and all(torch.equal(got[k], plain[k]) for k in plain if k not in linears)
    assert sum(".experts." in k for k in linears) == 3 * 4
    ok(run_cli("reshard", str(rel), str(td), "--dst-format", "torch_dist", "--target-tp", "2", "--target-ep", "2",
               nproc=2))
    ok(run_cli("reshard", str(td), str(back), "--dst-format", "hf", nproc=2))
    again = load_file(back / "model.safetensors")
    assert set(again) == set(got) and all(torch.equal(again[k], got[k]) for k in got)


@pytest.mark.parametrize("strategy,box", [("channel", Box((3, 5), (4, 20))), ("tensor", Box((2, 0), (5, 64)))])
def test_fp8_slices_decode_like_the_whole_library_decompression(strategy, box):
    from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor

    from dist_convert.datamodel import Quantized
    from dist_convert.formats.fp8 import FLOAT_QUANTIZED

    w = (torch.randn(8, 64, generator=torch.Generator().manual_seed(1)) / 8).to(torch.bfloat16)
    packed, scheme = fp8_compress(w, strategy)
    whole = FloatQuantizationCompressor.decompress(dict(packed), scheme)["weight"]
    q = Quantized("fp8-channel", (("f", "w"), ("f", "s")), (tuple(packed["weight_scale"].shape),))
    wbox, sbox = FLOAT_QUANTIZED.boxes(q, box)
    part = FLOAT_QUANTIZED.dequantize(q, [packed["weight"][wbox.slices()], packed["weight_scale"][sbox.slices()]],
                                      box, torch.bfloat16)
    assert torch.equal(part, whole[box.slices()])


def test_fp8_channel_export_is_what_compressed_tensors_writes(tmp_path):
    """``--quantize fp8-channel`` of a tiny Llama (bf16): every linear weight and scale byte for byte what
    compressed-tensors' own qparams and compressor make of the same weight (signed zeros and ties included), the
    config's ``quantization_config`` what its ModelCompressor writes for the model transformers builds with that
    scheme applied, transformers loads it cleanly, and dist_convert reads it back to the library's decompression."""
    import transformers
    from compressed_tensors.compressors.model_compressors.model_compressor import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme, apply_quantization_config

    src = make_hf_model(tmp_path, "llama", dtype=torch.bfloat16)
    plain = load_file(src / "model.safetensors")
    first = next(k for k in plain if k.endswith("q_proj.weight"))
    plain[first][0, :4] = torch.tensor([-0.0, 0.0, 1e-30, -1e-30], dtype=torch.bfloat16)  # signed zeros, underflow
    plain[first][1] = 0.0  # an all-zero row: the eps scale
    save_file(plain, src / "model.safetensors", metadata={"format": "pt"})
    dst, back = tmp_path / "fp8", tmp_path / "back"
    ok(run_cli("reshard", str(src), str(dst), "--dst-format", "hf", "--quantize", "fp8-channel", nproc=2))
    got = load_file(dst / "model.safetensors")
    linears = [k for k in plain if k.endswith("proj.weight")]
    for k in linears:
        want, _ = fp8_compress(plain[k], "channel")
        base = k.removesuffix("weight")
        assert torch.equal(got[k].view(torch.uint8), want["weight"].view(torch.uint8)), k
        assert torch.equal(got[base + "weight_scale"], want["weight_scale"]), k
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(src))
    scheme = QuantizationScheme(targets=["Linear"], weights=fp8_args("channel"))
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    qc = QuantizationConfig.from_pretrained(model, format="float-quantized")
    qc.quantization_status = "compressed"
    ref = tmp_path / "ref"
    ref.mkdir()
    (ref / "config.json").write_text("{}")
    ModelCompressor(quantization_config=qc).update_config(str(ref))
    want_cfg = json.loads((ref / "config.json").read_text())["quantization_config"]
    assert json.loads((dst / "config.json").read_text())["quantization_config"] == want_cfg
    _, info = transformers.AutoModelForCausalLM.from_pretrained(dst, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    ok(run_cli("reshard", str(dst), str(back), "--dst-format", "hf", nproc=1))
    again = load_file(back / "model.safetensors")
    from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor

    for k in linears:
        base = k.removesuffix("weight")
        want = FloatQuantizationCompressor.decompress({"weight": got[k], "weight_scale": got[base + "weight_scale"]},
                                                      scheme)["weight"]
        assert torch.equal(again[k], want), k


def test_quantize_offers_every_writing_scheme_and_only_those():
    """``--quantize``'s choices are the protocol's writers."""
    from dist_convert.cli import build_parser
    from dist_convert.formats.schemes import SCHEMES, WRITERS

    reshard = next(a for a in build_parser()._subparsers._group_actions[0].choices["reshard"]._actions
                   if a.dest == "quantize")
    assert set(reshard.choices) == {"none", *WRITERS} and set(WRITERS) <= set(SCHEMES)
