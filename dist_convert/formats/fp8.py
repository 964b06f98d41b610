"""Block-scaled FP8 weights as DeepSeek-V3 (and Qwen3 FP8) releases store them: a ``float8_e4m3fn``
weight W (M, N) with ``<name>_scale_inv`` in fp32 on a grid of ceil(M/bm) x ceil(N/bn) blocks (edge
blocks partial), ``W = float32(W_fp8) * scale_inv[i // bm, j // bn]``. Pure functions on boxes, so a
rank dequantizes only the slice it reads; ``SCHEME`` is their face to the hf format (``formats/quant.py``).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..errors import ConvertError
from ..layout.boxes import Box
from . import compressed
from .quant import Found, Quantized, Writer, finite_scale, refuse_nonfinite

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALE_SUFFIX = "_scale_inv"
DEFAULT_BLOCK = (128, 128)
# what ``--quantize fp8-block`` writes into config.json (DeepSeek-V3's)
QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                       "weight_block_size": list(DEFAULT_BLOCK)}
# HF weights the releases keep in high precision: embeddings, output heads, norms, routers
_KEEP = ("embed_tokens.", "lm_head.", "shared_head.head.", "norm.", "mlp.gate.weight",
         "block_sparse_moe.gate.weight", "shared_expert_gate.weight")


def quantizable(name: str, shape: tuple[int, ...]) -> bool:
    """Whether an FP8 release stores HF tensor ``name`` in FP8: every 2-D linear weight but the ``_KEEP`` ones."""
    return len(shape) == 2 and name.endswith(".weight") and not any(k in name for k in _KEEP)


def block_size(hf: dict[str, Any]) -> tuple[int, int]:
    """The (rows, columns) of a scale block from ``quantization_config`` (DeepSeek's default: 128 x 128)."""
    q = hf.get("quantization_config") or {}
    block = q.get("weight_block_size") or DEFAULT_BLOCK
    if len(block) != 2 or min(int(b) for b in block) < 1:
        raise ConvertError(f"quantization_config.weight_block_size={block!r} is not two positive sizes",
                           "fix quantization_config in config.json (DeepSeek-V3: [128, 128])")
    return int(block[0]), int(block[1])


def scale_grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    if len(shape) != 2:
        raise ConvertError(f"an FP8 weight of shape {shape} is not a matrix; only 2-D weights have block scales",
                           "convert a checkpoint quantized the DeepSeek-V3 way (2-D weights only)")
    return -(-shape[0] // block[0]), -(-shape[1] // block[1])


def scale_box(box: Box, block: tuple[int, int]) -> Box:
    """The box of the scale grid covering ``box`` of the weight."""
    (r0, c0), (m, n) = box.offsets, box.sizes
    lo = (r0 // block[0], c0 // block[1])
    hi = ((r0 + m - 1) // block[0] + 1, (c0 + n - 1) // block[1] + 1)
    return Box(lo, (hi[0] - lo[0], hi[1] - lo[1]))


def dequantize(w: torch.Tensor, scale: torch.Tensor, box: Box, block: tuple[int, int],
               dtype: torch.dtype) -> torch.Tensor:
    """``box`` of the weight (its FP8 values ``w``) in ``dtype``; ``scale`` is the ``scale_box`` of it."""
    (r0, c0), (m, n) = box.offsets, box.sizes
    rows = torch.arange(r0, r0 + m) // block[0] - r0 // block[0]
    cols = torch.arange(c0, c0 + n) // block[1] - c0 // block[1]
    out = w.to(torch.float32)
    out.mul_(scale.to(torch.float32)[rows][:, cols])
    return out.to(dtype)


def quantize(w: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 weight, fp32 scale_inv) of a 2-D weight: each block scaled so its largest magnitude is
    float8_e4m3fn's largest finite value (448); an all-zero block gets scale 1."""
    grid = scale_grid(tuple(w.shape), block)
    m, n = w.shape
    x = w.to(torch.float32)
    pad = torch.zeros(grid[0] * block[0], grid[1] * block[1], dtype=torch.float32)
    pad[:m, :n] = x
    blocks = pad.view(grid[0], block[0], grid[1], block[1])
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / torch.finfo(torch.float8_e4m3fn).max, torch.ones_like(amax))
    q = (blocks / scale[:, None, :, None]).view_as(pad)[:m, :n].to(torch.float8_e4m3fn)
    return q.contiguous(), scale


class Fp8Block(Writer):
    """``--quantize fp8-block``; read: a weight stored in an FP8 dtype beside its ``_scale_inv`` grid."""

    name = "fp8-block"
    what = "block-scaled FP8"
    config = QUANTIZATION_CONFIG

    def stored(self, key: str, shape: tuple[int, ...], hf: dict[str, Any],
               found: Found) -> tuple[Quantized, tuple[int, ...]] | None:
        if key not in found or found[key][1] not in FP8_DTYPES or compressed.declares(hf):
            return None
        f, dtype, stored = found[key]
        name = key + SCALE_SUFFIX
        if name not in found:
            raise ConvertError(f"{key} is stored in FP8 ({dtype}) without its scale {name}",
                               "convert a complete FP8 checkpoint (every *_scale_inv shard), or its bf16 release")
        block = block_size(hf)
        grid = scale_grid(tuple(stored), block)
        sf, sdtype, sshape = found[name]
        if tuple(sshape) != grid or sdtype not in (torch.float32, torch.bfloat16):
            raise ConvertError(f"{name} has shape {tuple(sshape)} ({sdtype}); a {tuple(stored)} weight in "
                               f"{block[0]}x{block[1]} blocks needs a {grid} float32 grid",
                               "the FP8 scales do not match the weights or quantization_config.weight_block_size; "
                               "re-download the checkpoint")
        return Quantized(self.name, ((f, key), (sf, name)), block), tuple(stored)

    def boxes(self, q: Quantized, box: Box) -> tuple[Box, ...]:
        return box, scale_box(box, q.params)

    def dequantize(self, q: Quantized, parts: list[torch.Tensor], box: Box, dtype: torch.dtype) -> torch.Tensor:
        finite_scale(q, 1, parts[1])
        return dequantize(parts[0], parts[1], box, q.params, dtype)

    def quantizable(self, name: str, shape: tuple[int, ...]) -> bool:
        return quantizable(name, shape)

    def quantize(self, name: str, x: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        refuse_nonfinite(self.name, name, x)
        q, scale = quantize(x)
        return [(name, q), (name + SCALE_SUFFIX, scale)]

    def stored_sizes(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> list[tuple[str, int]]:
        rows, cols = scale_grid(shape, DEFAULT_BLOCK)
        return [(name, shape[0] * shape[1]), (name + SCALE_SUFFIX, 4 * rows * cols)]


SCHEME = Fp8Block()


# -- compressed-tensors ``float-quantized`` FP8 (e.g. FP8-dynamic releases): per-channel or per-tensor scales --------
CHANNEL_WEIGHTS = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "strategy": "channel",
                   "dynamic": False}


class FloatQuantized(Writer):
    """compressed-tensors ``float-quantized`` FP8. Read: ``weight`` in float8_e4m3fn with ``weight_scale`` [out, 1]
    (channel) or [1] (tensor); W = float(weight in the scale's dtype) * scale, compressed-tensors' ``dequantize``. A
    static scheme's ``input_scale`` (the activations' calibration) is not carried (a note says so): the dequantized
    model computes in high precision. Written (``--quantize fp8-channel``, weight-only as FP8-dynamic releases are)
    as compressed-tensors 0.20 writes it: per output row, scale = amax / 448 in the weight's dtype (0 -> the dtype's
    eps), FP8 = the weight / scale (signed zeros made +0) clamped to +-448, rounded to nearest even; every linear
    weight but the embeddings, heads, norms and routers, which the config's ``ignore`` lists by module name."""

    name = "fp8-channel"
    what = "compressed-tensors FP8"
    companion_note = "activation input_scale tensors (not carried by a dequantized model)"

    def quantizable(self, name: str, shape: tuple[int, ...]) -> bool:
        return quantizable(name, shape)

    def quantize(self, name: str, x: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        refuse_nonfinite(self.name, name, x)
        scale = x.abs().amax(dim=-1, keepdim=True) / torch.tensor(448.0, dtype=x.dtype)
        scale = torch.where(scale == 0, torch.tensor(torch.finfo(x.dtype).eps, dtype=x.dtype), scale)
        q = torch.clamp(x / scale + 0.0, -448.0, 448.0).to(torch.float8_e4m3fn)
        return [(name, q), (name + "_scale", scale)]

    def stored_sizes(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> list[tuple[str, int]]:
        return [(name, shape[0] * shape[1]), (name + "_scale", shape[0] * dtype.itemsize)]

    def quantization_config(self, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
        return compressed.quantization_config(CHANNEL_WEIGHTS, "float-quantized", shapes, self.quantizable)

    def stored(self, key: str, shape: tuple[int, ...], hf: dict[str, Any],
               found: Found) -> tuple[Quantized, tuple[int, ...]] | None:
        if key not in found or found[key][1] not in FP8_DTYPES or not compressed.declares(hf, "float-quantized"):
            return None
        f, dtype, stored = found[key]
        name = key + "_scale"
        if name not in found:
            raise ConvertError(f"{key} is stored in FP8 ({dtype}) without its scale {name}",
                               "copy every shard of the release (see model.safetensors.index.json)")
        sf, _, sshape = found[name]
        if len(stored) != 2 or tuple(sshape) not in ((stored[0], 1), (1,)):
            raise ConvertError(f"{name} has shape {tuple(sshape)}: a {tuple(stored)} FP8 weight takes one scale per "
                               "output channel [out, 1] or one per tensor [1]",
                               "convert a release quantized by channel or by tensor (block and group FP8 are other "
                               "schemes)")
        return Quantized(self.name, ((f, key), (sf, name)), (tuple(sshape),)), tuple(stored)

    def companions(self, key: str) -> tuple[str, ...]:
        return (key.removesuffix("weight") + "input_scale",)

    def boxes(self, q: Quantized, box: Box) -> tuple[Box, ...]:
        per_channel = len(q.params[0]) == 2  # the rows' scales, else the one scale
        return box, Box((box.offsets[0], 0), (box.sizes[0], 1)) if per_channel else Box((0,), (1,))

    def dequantize(self, q: Quantized, parts: list[torch.Tensor], box: Box, dtype: torch.dtype) -> torch.Tensor:
        w, scale = parts
        finite_scale(q, 1, scale)
        return (w.to(scale.dtype) * scale).to(dtype)


FLOAT_QUANTIZED = FloatQuantized()
