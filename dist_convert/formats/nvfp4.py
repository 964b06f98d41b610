"""NVFP4 weights as NVIDIA ModelOpt's Hugging Face export stores them (``quant_algo`` NVFP4, group 16): a linear weight
W [out, in] stored as

    <name>          uint8 [out, in/2]          two e2m1 values a byte, element 2i in the low nibble
    <name>_scale    float8_e4m3fn [out, in/16] one scale per 16 inputs
    <name>_scale_2  fp32 []                    one per tensor (amax / (6 * 448))
    <module>.input_scale  fp32 []          the activations' scale, when calibrated (not carried)

W[r, c] = e2m1(nibble) * (float32(scale[r, c // 16]) * scale_2), formed in fp32 and cast once, as ModelOpt's own
``NVFP4QTensor.dequantize`` does; config.json says ``quant_method`` modelopt, ``quant_algo`` NVFP4 or W4A16_NVFP4.
Pure functions on boxes, so a rank reads only its bytes and scales; ``SCHEME`` is their face to the hf format
(``formats/quant.py``). Written back: not yet (``--quantize`` does not offer it).
"""
from __future__ import annotations

from typing import Any

import torch

from ..errors import ConvertError
from ..layout.boxes import Box
from .quant import Found, Quantized, Scheme

# nibble -> value; 0x8 (e2m1's -0) gives +0.0, as ModelOpt's ``e2m1_values`` table does
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
ALGOS = ("NVFP4", "W4A16_NVFP4")  # ModelOpt's quant_algo of NVFP4 weights (with and without activation scales)


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


class NVFP4(Scheme):
    """Read: a ModelOpt NVFP4 weight, its uint8 bytes beside ``_scale`` (float8_e4m3fn) and ``_scale_2``."""

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
        return dequantize(parts[0], parts[1], parts[2], box, q.params[0], dtype)


SCHEME = NVFP4()
