"""compressed-tensors ``pack-quantized`` INT4 weights (W4A16), as Kimi-K2-Thinking ships its MoE experts: a linear
weight W [out, in] stored as

    <name>_packed  int32 [out, ceil(in/8)]   element 8w + k in bits 4k..4k+3 of word w, stored as q + 8
    <name>_scale   [out, ceil(in/g)]         one scale per group of g inputs (channel strategy: g = in), the
                                             weight's dtype
    <name>_shape   int64 [2]                 (out, in)

symmetric (q in [-8, 7], no zero point), W[r, c] = q[r, c] * scale[r, c // g] computed in the scale's dtype, as
compressed-tensors' own decompression does (``unpack_from_int32`` then ``dequantize``). Pure functions on boxes, so
a rank reads and decodes only its rows and the words and groups its columns touch; ``SCHEME`` is their face to the
hf format (``formats/quant.py``). ``--quantize int4`` writes the routed experts' linears this way (group 32, as
Kimi-K2-Thinking ships), byte for byte as compressed-tensors 0.20 packs them, and the rest as it is.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import ConvertError
from ..layout.boxes import Box
from . import compressed
from .quant import Found, Quantized, Writer, finite_scale, refuse_nonfinite

PER_WORD = 8  # 4-bit values per int32
OFFSET = 8  # stored as q + 8 (unsigned nibbles)
SUFFIXES = ("_packed", "_scale", "_shape")
FORMAT = "pack-quantized"
GROUP = 32  # what ``--quantize int4`` writes (Kimi-K2-Thinking's group)
GROUP_WEIGHTS = {"num_bits": 4, "type": "int", "symmetric": True, "group_size": GROUP, "strategy": "group",
                 "dynamic": False}
# the routed experts' linears, per expert: what ``--quantize int4`` stores (the rest stays as it is)
EXPERT_LINEAR = re.compile(r"\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")


def weights_args(hf: Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``weights`` quantization args of a compressed-tensors pack-quantized config.json (None when it is not
    one); refused in one line when they are not symmetric INT4 by group or channel."""
    q = hf.get("quantization_config") or {}
    if not compressed.declares(hf, FORMAT):
        return None
    groups = [g for g in (q.get("config_groups") or {}).values() if isinstance(g, dict) and g.get("weights")]
    if len(groups) != 1:
        raise ConvertError(f"quantization_config has {len(groups)} weight groups; one pack-quantized INT4 group "
                           "converts here", "convert a release quantized with one scheme")
    w = groups[0]["weights"]
    fix = "convert a symmetric INT4 release (W4A16: num_bits 4, type int, symmetric, group or channel strategy)"
    if (int(w.get("num_bits", 0)), str(w.get("type", "int"))) != (4, "int") or not w.get("symmetric", True):
        raise ConvertError(f"compressed-tensors weights {w}: this reader decodes symmetric 4-bit integers", fix)
    if str(w.get("strategy", "group")) not in ("group", "channel"):
        raise ConvertError(f"compressed-tensors weight strategy {w.get('strategy')!r}", fix)
    return w


def word_box(box: Box) -> Box:
    """The words of ``box`` (of the logical [rows, cols]): whole words covering its columns."""
    (r0, c0), (m, n) = box.offsets, box.sizes
    w0 = c0 // PER_WORD
    return Box((r0, w0), (m, -(-(c0 + n) // PER_WORD) - w0))


def group_box(box: Box, group: int) -> Box:
    """The scales of ``box``: the groups its columns touch."""
    (r0, c0), (m, n) = box.offsets, box.sizes
    g0 = c0 // group
    return Box((r0, g0), (m, (c0 + n - 1) // group + 1 - g0))


def unpack(words: torch.Tensor) -> torch.Tensor:
    """int32 [rows, W] -> int8 [rows, 8 W]: element 8w + k from bits 4k..4k+3 of word w, minus 8."""
    nibbles = words.contiguous().view(torch.uint8)  # little-endian: byte k // 2 of word w, low nibble first
    return (torch.stack((nibbles & 0xF, nibbles >> 4), dim=-1).flatten(-2).to(torch.int8) - OFFSET)


def dequantize(words: torch.Tensor, scale: torch.Tensor, box: Box, group: int, dtype: torch.dtype) -> torch.Tensor:
    """``box`` of the weight in ``dtype``, from its ``word_box`` and ``group_box`` slices: q * scale of q's group,
    in the scale's dtype (compressed-tensors' ``dequantize``), then cast."""
    (_, c0), (_, n) = box.offsets, box.sizes
    first = c0 - c0 // PER_WORD * PER_WORD
    q = unpack(words)[:, first:first + n]
    cols = torch.arange(c0, c0 + n) // group - c0 // group
    return (q.to(scale.dtype) * scale[:, cols]).to(dtype)


class PackQuantized(Writer):
    """Read: a weight stored as its ``_packed`` / ``_scale`` / ``_shape`` triple under a compressed-tensors
    pack-quantized ``quantization_config``."""

    name = "int4"
    what = "compressed-tensors INT4"

    def stored(self, key: str, shape: tuple[int, ...], hf: dict[str, Any],
               found: Found) -> tuple[Quantized, tuple[int, ...]] | None:
        packed, scale, _ = (key + s for s in SUFFIXES)
        if key in found or packed not in found:
            return None
        w = weights_args(hf)
        if w is None:
            raise ConvertError(f"{packed} is stored without a compressed-tensors pack-quantized quantization_config",
                               "use the config.json saved with the release")
        if scale not in found:
            raise ConvertError(f"INT4 weight {packed} has no {scale} beside it",
                               "copy every shard of the release (see model.safetensors.index.json)")
        if len(shape) != 2:
            raise ConvertError(f"{key} of shape {shape} is stored as INT4; only 2-D linear weights are",
                               "convert a release quantized that way (per-expert linear weights)")
        out, cols = shape
        group = int(w.get("group_size") or cols) if w.get("strategy", "group") == "group" else cols
        want = ((out, -(-cols // PER_WORD)), (out, -(-cols // group)))
        (pf, pdtype, pshape), (sf, _, sshape) = found[packed], found[scale]
        if pdtype != torch.int32 or (tuple(pshape), tuple(sshape)) != want:
            raise ConvertError(f"{packed} {tuple(pshape)} ({pdtype}) and {scale} {tuple(sshape)}: a {shape} weight in "
                               f"groups of {group} needs int32 words {want[0]} and scales {want[1]}",
                               "config.json and the weights disagree; use the config saved with the release")
        return Quantized(self.name, ((pf, packed), (sf, scale)), (group,)), shape

    def companions(self, key: str) -> tuple[str, ...]:
        return (key + "_shape",)

    def boxes(self, q: Quantized, box: Box) -> tuple[Box, ...]:
        return word_box(box), group_box(box, q.params[0])

    def dequantize(self, q: Quantized, parts: list[torch.Tensor], box: Box, dtype: torch.dtype) -> torch.Tensor:
        finite_scale(q, 1, parts[1])
        return dequantize(parts[0], parts[1], box, q.params[0], dtype)

    def quantizable(self, name: str, shape: tuple[int, ...]) -> bool:
        return bool(EXPERT_LINEAR.search(name)) and len(shape) == 2 and shape[1] % GROUP == 0

    def quantize(self, name: str, x: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        refuse_nonfinite(self.name, name, x)
        packed, scale = quantize(x)
        base = name.removesuffix("weight")
        return [(base + "weight_packed", packed), (base + "weight_scale", scale),
                (base + "weight_shape", torch.tensor(tuple(x.shape), dtype=torch.int64))]

    def stored_sizes(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> list[tuple[str, int]]:
        base = name.removesuffix("weight")
        out, cols = shape
        return [(base + "weight_packed", out * cols // 2),
                (base + "weight_scale", out * cols // GROUP * dtype.itemsize), (base + "weight_shape", 16)]

    def quantization_config(self, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
        return compressed.quantization_config(GROUP_WEIGHTS, FORMAT, shapes, self.quantizable)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int32 words, scales) of a 2-D weight in groups of 32, as compressed-tensors 0.20 quantizes it: per group,
    scale = amax / 7.5 in the weight's dtype (0 -> the dtype's eps); q = round-half-even of clamp(w / scale, -8, 7)
    (the division in the weight's dtype, signed zeros made +0); packed eight a word, element 8w + k in bits 4k..4k+3
    as q + 8. A group that already lies on a 4-bit grid (a release's weights, dequantized and not changed since)
    keeps that grid's scale (``on_grid``), so a round trip gives the release back byte for byte."""
    rows, cols = w.shape
    g = w.reshape(rows, cols // GROUP, GROUP)
    amax = g.abs().amax(dim=-1, keepdim=True)
    scale = amax / torch.tensor(7.5, dtype=w.dtype)
    scale = torch.where(scale == 0, torch.tensor(torch.finfo(w.dtype).eps, dtype=w.dtype), scale)
    grid, found = on_grid(g, amax)
    scale = torch.where(found, grid, scale)
    q = torch.round(torch.clamp(g / scale + 0.0, -8.0, 7.0)).to(torch.int16).reshape(rows, cols) + OFFSET
    nibbles = q.to(torch.uint8).reshape(rows, cols // 2, 2)
    packed = (nibbles[..., 0] | (nibbles[..., 1] << 4)).contiguous().view(torch.int32)
    return packed, scale.squeeze(-1)


def on_grid(g: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group of ``g`` [..., GROUP] (``amax``: its largest magnitude): a scale s in g's dtype whose grid holds
    every value exactly as ``dequantize`` computes it (q * s in that dtype, q in [-8, 7]), and whether one was found.
    A quantizer's largest value is 7 s or -8 s: the candidates are amax / 8 and the values next to amax / 7."""
    dtype = g.dtype
    seventh = (amax / torch.tensor(7.0, dtype=dtype)).contiguous()
    bits = seventh.view(torch.int16 if dtype.itemsize == 2 else torch.int32)
    candidates = [amax / torch.tensor(8.0, dtype=dtype)] + [(bits + d).view(dtype) for d in (0, -1, 1, -2, 2)]
    best = torch.zeros_like(amax)
    found = torch.zeros_like(amax, dtype=torch.bool)
    for s in candidates:
        s = torch.where(s > 0, s, torch.ones_like(s))
        q = torch.round(torch.clamp(g / s + 0.0, -8.0, 7.0))
        fits = ((q * s).to(dtype) == g).all(dim=-1, keepdim=True) & (amax > 0) & ~found
        best = torch.where(fits, s, best)
        found |= fits
    return best, found


SCHEME = PackQuantized()
