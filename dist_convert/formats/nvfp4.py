"""NVFP4 weights as NVIDIA ModelOpt's Hugging Face export stores them (``quant_algo`` NVFP4, group 16): a linear weight
W [out, in] stored as

    <name>          uint8 [out, in/2]          two e2m1 values a byte, element 2i in the low nibble
    <name>_scale    float8_e4m3fn [out, in/16] one scale per 16 inputs
    <name>_scale_2  fp32 []                    one per tensor (amax / (6 * 448))
    <module>.input_scale  fp32 []          the activations' scale, when calibrated (not carried)

W[r, c] = e2m1(nibble) * (float32(scale[r, c // 16]) * scale_2), formed in fp32 and cast once, as ModelOpt's own
``NVFP4QTensor.dequantize`` does; config.json says ``quant_method`` modelopt, ``quant_algo`` NVFP4 or W4A16_NVFP4.
Pure functions on boxes, so a rank reads only its bytes and scales; ``SCHEME`` is their face to the hf format
(``formats/quant.py``).

``--quantize nvfp4`` writes what ModelOpt 0.47's ``export_hf_checkpoint`` writes for a model quantized weight-only
(W4A16_NVFP4) with its MLP-only preset's weight rules (``MLP_RULES``): the MLP linears (dense, shared and routed
experts, per expert) quantized, gate and up of one MLP sharing ``weight_scale_2`` (the larger amax), the rest kept
and listed in ``exclude_modules`` as ModelOpt summarises them (``exclude_patterns``), beside config.json's
``quantization_config`` and ``hf_quant_config.json``. No ``input_scale``: nothing here calibrates activations.
"""
from __future__ import annotations

import fnmatch
import json
import re
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import ConvertError
from ..layout.boxes import Box
from .mxfp4 import e2m1_codes
from .quant import Found, Quantized, Writer, finite_scale, refuse_nonfinite

# nibble -> value; 0x8 (e2m1's -0) gives +0.0, as ModelOpt's ``e2m1_values`` table does
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
ALGOS = ("NVFP4", "W4A16_NVFP4")  # ModelOpt's quant_algo of NVFP4 weights (with and without activation scales)
GROUP = 16
E2M1_MAX, E4M3_MAX = 6.0, 448.0
ALGO = "W4A16_NVFP4"  # what ``--quantize nvfp4`` writes: weights only
PRODUCER = {"name": "modelopt", "version": "0.47.0"}  # the release whose export the writer follows
QUANT_CONFIG = "hf_quant_config.json"
# ModelOpt's NVFP4 MLP-only preset, its weight quantizers' rules in order (a later match wins): (pattern on
# "<module>.weight_quantizer", quantized)
MLP_RULES = (("*", False), ("*mlp*weight_quantizer", True), ("*.mixer.up_proj.weight_quantizer", True),
             ("*.mixer.down_proj.weight_quantizer", True), ("*block_sparse_moe*weight_quantizer", True),
             ("*.experts.*weight_quantizer", True),
             *((p, False) for p in ("*block_sparse_moe.gate*", "*linear_attn.conv1d*", "*self_attention.conv1d*",
                                    "*linear_attn.in_proj_a*", "*linear_attn.in_proj_b*", "*lm_head*",
                                    "*mixer.conv1d*", "*mlp.gate.*", "*mlp.shared_expert_gate.*", "*output_layer*",
                                    "*proj_out.*", "*router*", "mtp.*", "output.*", "*embed_vision*",
                                    "*vision_tower*", "*visual*", "*vision_model*", "*multi_modal_projector*")))
# linears fed the same input share weight_scale_2 (ModelOpt's export unifies their amax): gate and up
SHARED_INPUT = re.compile(r"\.(gate_proj|up_proj|w1|w3)\.weight$")


def group_size(hf: dict[str, Any]) -> int | None:
    """The NVFP4 group size a ModelOpt config.json declares (``quantization_config`` as ModelOpt's
    ``convert_hf_quant_config_format`` writes it; None when it declares no NVFP4 weights)."""
    q = hf.get("quantization_config") or {}
    if str(q.get("quant_method", "")).lower() != "modelopt" or q.get("quant_algo") not in ALGOS:
        return None
    weights = [g.get("weights") or {} for g in (q.get("config_groups") or {}).values() if isinstance(g, dict)]
    return int(next((w["group_size"] for w in weights if w.get("group_size")), 16))


def dequantize(packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor, box: Box, group: int,
               dtype: torch.dtype) -> torch.Tensor:
    """``box`` of the weight in ``dtype`` from the bytes and scales its columns touch (``NVFP4.boxes``)."""
    (_, c0), (_, n) = box.offsets, box.sizes
    nibbles = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)  # element 2i: the low nibble
    values = torch.tensor(E2M1, dtype=torch.float32)[nibbles.long()]
    first = c0 - c0 // 2 * 2
    cols = torch.arange(c0, c0 + n) // group - c0 // group
    per_group = scale.to(torch.float32) * scale_2.to(torch.float32)
    return (values[:, first:first + n] * per_group[:, cols]).to(dtype)


def quantize(ws: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(bytes, scales, scale_2) of each of ``ws`` (2-D, inputs a multiple of 16), which share one scale_2, as ModelOpt
    0.47 exports them: scale_2 = the largest amax / (6 * 448) in fp32; per 16 inputs, scale = the group's amax /
    (6 * scale_2) in fp32, 0 -> 1, clamped to [2**-9, 448] and cast to float8_e4m3fn; each value divided by
    float32(scale) * scale_2 (in fp32) and rounded to the nearest e2m1 value, ties to even, saturating at 6, its
    sign bit set when it is negative (so -0.0 stores 0x0); element 2i in the low nibble."""
    scale_2 = torch.stack([w.abs().amax().float() for w in ws]).amax() / (E2M1_MAX * E4M3_MAX)
    out = []
    for w in ws:
        rows, cols = w.shape
        g = w.reshape(rows, cols // GROUP, GROUP)
        scale = g.abs().amax(dim=-1).float() / (E2M1_MAX * scale_2)
        scale = torch.where(scale == 0, torch.ones_like(scale), scale).clamp(2 ** -9, E4M3_MAX).to(torch.float8_e4m3fn)
        x = (g / (scale.to(torch.float32) * scale_2).unsqueeze(-1)).reshape(rows, cols)
        codes = e2m1_codes(x.abs()) | ((x < 0).to(torch.uint8) << 3)
        out.append((codes[:, 0::2] | (codes[:, 1::2] << 4), scale, scale_2))
    return out


def mlp_linear(module: str) -> bool:
    """Whether ModelOpt's MLP-only preset quantizes ``module``'s weight (the last matching rule of ``MLP_RULES``)."""
    return [on for pattern, on in MLP_RULES if fnmatch.fnmatchcase(module + ".weight_quantizer", pattern)][-1]


def exclude_patterns(kept: list[str], quantized: list[str]) -> list[str]:
    """``exclude_modules`` as ModelOpt summarises the modules it left unquantized: for each, the most general prefix
    cut at a dot that matches no quantized module, as ``prefix*`` or else (when only a longer name shares the
    prefix) ``prefix.*``, or the module's own name; sorted."""
    taken = {f"{q[:i]}*" for q in quantized for i in range(len(q) + 1)} | set(quantized)
    out = set()
    for name in kept:
        for i in (i for i, ch in enumerate(name) if ch == "."):
            prefix = name[:i]
            if prefix + "*" not in taken:
                out.add(prefix + "*")
                break
            if prefix not in taken and prefix + ".*" not in taken:
                out.add(prefix + ".*")
                break
        else:
            out.add(name)
    return sorted(out)


class NVFP4(Writer):
    """``--quantize nvfp4`` (W4A16_NVFP4, ModelOpt's MLP-only preset); read: a ModelOpt NVFP4 weight, its uint8 bytes
    beside ``_scale`` (float8_e4m3fn) and ``_scale_2``."""

    name = "nvfp4"
    what = "NVFP4"
    companion_note = "activation input_scale tensors (not carried by a dequantized model)"

    def stored(self, key: str, shape: tuple[int, ...], hf: dict[str, Any],
               found: Found) -> tuple[Quantized, tuple[int, ...]] | None:
        scale, scale_2 = key + "_scale", key + "_scale_2"
        if key not in found or found[key][1] != torch.uint8 or scale_2 not in found:
            return None
        group = group_size(hf)
        if group is None:
            raise ConvertError(f"{key} is stored as NVFP4 bytes without a ModelOpt NVFP4 quantization_config",
                               "use the config.json ModelOpt saved with the release (quant_method modelopt, quant_algo "
                               "NVFP4)")
        if len(shape) != 2 or scale not in found:
            raise ConvertError(f"NVFP4 weight {key} {shape} lacks its {scale} or is not a matrix",
                               "copy every shard of the release (see model.safetensors.index.json)")
        out, cols = shape
        want = ((out, -(-cols // 2)), (out, -(-cols // group)), ())
        got = (tuple(found[key][2]), tuple(found[scale][2]), tuple(found[scale_2][2]))
        if got != want or found[scale][1] != torch.float8_e4m3fn:
            raise ConvertError(f"NVFP4 weight {key}: stored {got} ({found[scale][1]} scales), but a {shape} weight in "
                               f"groups of {group} needs {want} with float8_e4m3fn scales",
                               "config.json and the weights disagree; use the config saved with the release")
        parts = ((found[key][0], key), (found[scale][0], scale), (found[scale_2][0], scale_2))
        return Quantized(self.name, parts, (group,)), shape

    def companions(self, key: str) -> tuple[str, ...]:
        return (key.removesuffix("weight") + "input_scale",)

    def boxes(self, q: Quantized, box: Box) -> tuple[Box, ...]:
        (r0, c0), (m, n) = box.offsets, box.sizes
        group = q.params[0]
        return (Box((r0, c0 // 2), (m, -(-(c0 + n) // 2) - c0 // 2)),
                Box((r0, c0 // group), (m, (c0 + n - 1) // group + 1 - c0 // group)), Box((), ()))

    def dequantize(self, q: Quantized, parts: list[torch.Tensor], box: Box, dtype: torch.dtype) -> torch.Tensor:
        finite_scale(q, 1, parts[1])
        finite_scale(q, 2, parts[2], nonzero=True)
        return dequantize(parts[0], parts[1], parts[2], box, q.params[0], dtype)

    def quantizable(self, name: str, shape: tuple[int, ...]) -> bool:
        return (name.endswith(".weight") and len(shape) == 2 and shape[1] % GROUP == 0
                and mlp_linear(name.removesuffix(".weight")))

    def shares(self, name: str) -> str:
        return SHARED_INPUT.sub(".gate_up", name)

    def quantize(self, name: str, x: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        return self.quantize_together([(name, x)])

    def quantize_together(self, items: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        for name, x in items:
            refuse_nonfinite(self.name, name, x)
        return [kv for (name, _), (packed, scale, scale_2) in zip(items, quantize([x for _, x in items]), strict=True)
                for kv in ((name, packed), (name + "_scale", scale), (name + "_scale_2", scale_2))]

    def stored_sizes(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> list[tuple[str, int]]:
        out, cols = shape
        return [(name, out * cols // 2), (name + "_scale", out * cols // GROUP), (name + "_scale_2", 4)]

    def _exclude(self, shapes: Mapping[str, tuple[int, ...]]) -> list[str]:
        """The modules (weights of 2 or more dimensions: linears, embeddings, convolutions) left unquantized, and
        ``lm_head`` (a module of every causal LM, also when it is tied to the embedding and not stored)."""
        modules = {"lm_head": False} | {n.removesuffix(".weight"): self.quantizable(n, s) for n, s in shapes.items()
                                        if n.endswith(".weight") and len(s) >= 2}
        return exclude_patterns([m for m, q in modules.items() if not q], [m for m, q in modules.items() if q])

    def quantization_config(self, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
        return {"config_groups": {"group_0": {"weights": {"dynamic": False, "num_bits": 4, "type": "float",
                                                          "group_size": GROUP}, "targets": ["Linear"]}},
                "ignore": self._exclude(shapes), "quant_algo": ALGO, "producer": dict(PRODUCER),
                "quant_method": "modelopt"}

    def side_files(self, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, str]:
        return {QUANT_CONFIG: json.dumps({"producer": dict(PRODUCER), "quantization": {
            "quant_algo": ALGO, "kv_cache_quant_algo": None, "group_size": GROUP,
            "exclude_modules": self._exclude(shapes)}}, indent=4)}


SCHEME = NVFP4()
