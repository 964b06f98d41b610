"""MXFP4 weights (OCP Microscaling v1.0: e2m1 elements, e8m0 scales, 32-element blocks) as OpenAI's gpt-oss
releases store their MoE experts. A weight W of logical shape [..., rows, cols] (cols: the input axis, the
one the blocks run along) is the pair

    <name>_blocks  uint8 [..., rows, cols/32, 16]  two e2m1 nibbles per byte, element 2k low, 2k+1 high
    <name>_scales  uint8 [..., rows, cols/32]      e8m0 exponent, bias 127

W[..., r, 32 g + i] = e2m1(nibble i of blocks[..., r, g, :]) * 2**(scales[..., r, g] - 127).

gpt-oss: ``mlp.experts.gate_up_proj`` blocks [E, 2F, H/32, 16] (rows gate/up interleaved: gate even, up odd),
``mlp.experts.down_proj`` blocks [E, H, F/32, 16]. transformers' ``convert_moe_packed_tensors`` returns the
*transpose* of the logical weight, [..., cols, rows] (gate_up_proj [E, H, 2F], down_proj [E, F, H]: its
``x @ W`` orientation); ``dequantize`` here returns the blocks' own order [..., rows, cols] and
``transformers_layout`` turns one into the other. Pure functions on boxes, so a rank dequantizes only its share;
``SCHEME`` is their face to the hf format (``formats/quant.py``).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..errors import ConvertError
from ..layout.boxes import Box
from .quant import Found, Quantized, Writer, check_scale, refuse_nonfinite

BLOCK = 32  # elements per scale
BYTES = BLOCK // 2  # bytes per block
SCALE_BIAS = 127
NAN_SCALE = 255  # e8m0: the one code that is no power of two (NaN); refused on read
E2M1_EMAX = 2  # exponent of e2m1's largest binade (4, 6)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude of nibble codes 0..7; bit 3 (0x8) is the sign
BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"
# what an MXFP4 export writes into config.json (gpt-oss's: attention, router, embeddings and head stay bf16)
QUANTIZATION_CONFIG = {"quant_method": "mxfp4",
                       "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                  "model.embed_tokens", "lm_head"]}
# rounding thresholds between consecutive codes; where the upper code is even (ties go up) one ulp lower, so
# "count of thresholds strictly below x" is round-to-nearest, ties-to-even, saturating at code 7 (6.0)
_MID = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
_TIES_UP = torch.tensor([False, True, False, True, False, True, False])
_BOUNDS = torch.where(_TIES_UP, torch.nextafter(_MID, torch.zeros(())), _MID)


def e2m1_codes(mag: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..7 of magnitudes ``mag`` (float32): the nearest e2m1 magnitude, ties to even, saturating at 6."""
    return torch.bucketize(mag, _BOUNDS.to(mag.device)).to(torch.uint8)


def is_mxfp4(hf_config: Mapping[str, Any]) -> bool:
    """Whether a config.json (as a dict) declares MXFP4 weights (``quantization_config.quant_method``)."""
    q = hf_config.get("quantization_config") or {}
    return str(q.get("quant_method", "")).lower() == "mxfp4"


def check_pair(name: str, blocks_shape: tuple[int, ...] | None, scales_shape: tuple[int, ...] | None) -> None:
    """Refuse (ConvertError) an MXFP4 tensor ``name`` (the base name, or the ``_blocks`` key) whose scales are
    missing or whose blocks / scale grid do not have the shapes [..., G, 16] / [..., G]."""
    base = name.removesuffix(BLOCKS_SUFFIX).removesuffix(SCALES_SUFFIX)
    b, s = base + BLOCKS_SUFFIX, base + SCALES_SUFFIX
    redo = "re-download the release's shards or re-export the pair from one checkpoint"
    if blocks_shape is None or scales_shape is None:
        have, miss = (b, s) if scales_shape is None else (s, b)
        raise ConvertError(f"MXFP4 tensor {have} has no {miss} beside it",
                           f"the checkpoint is incomplete: copy the shard that holds {miss} (see "
                           "model.safetensors.index.json), or convert a dequantized (bf16) copy")
    blocks_shape, scales_shape = tuple(blocks_shape), tuple(scales_shape)
    if len(blocks_shape) < 2 or blocks_shape[-1] != BYTES:
        raise ConvertError(f"MXFP4 tensor {b} has shape {blocks_shape}, not [..., cols/32, {BYTES}] "
                           f"({BYTES} bytes = {BLOCK} FP4 values per block)", redo)
    if scales_shape != blocks_shape[:-1]:
        raise ConvertError(f"MXFP4 scale grid {s} has shape {scales_shape}, but {b} {blocks_shape} needs "
                           f"{blocks_shape[:-1]} (one scale per {BLOCK}-value block)", redo)


def aligned_box(box: Box) -> Box:
    """The smallest box containing ``box`` (of the logical [..., rows, cols]) whose columns are whole blocks."""
    c0, c1 = box.offsets[-1], box.offsets[-1] + box.sizes[-1]
    lo, hi = c0 // BLOCK * BLOCK, -(-c1 // BLOCK) * BLOCK
    return Box(box.offsets[:-1] + (lo,), box.sizes[:-1] + (hi - lo,))


def block_box(box: Box) -> tuple[Box, Box]:
    """(box of the blocks [..., rows, cols/32, 16], box of the scales [..., rows, cols/32]) that hold ``box``
    of the logical tensor [..., rows, cols] (the blocks' axis order, cols last). Leading axes (experts, rows)
    carry over; the columns must be whole 32-blocks (``aligned_box`` widens a box that is not)."""
    c0, n = box.offsets[-1], box.sizes[-1]
    if c0 % BLOCK or n % BLOCK:
        raise ConvertError(f"a slice of an MXFP4 weight over input columns [{c0}, {c0 + n}) cuts its {BLOCK}-column "
                           "scale blocks", f"shard the input axis on multiples of {BLOCK} columns (a --target-tp/"
                           f"--target-etp that divides its {BLOCK}-column blocks), or read the aligned box")
    g0, g = c0 // BLOCK, n // BLOCK
    lead_o, lead_n = box.offsets[:-1], box.sizes[:-1]
    return Box(lead_o + (g0, 0), lead_n + (g, BYTES)), Box(lead_o + (g0,), lead_n + (g,))


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, *, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """blocks uint8 [..., G, 16] + scales uint8 [..., G] -> [..., G*32] in ``dtype``, the blocks' axis order.

    Each value is ``ldexp(e2m1, scale - 127)`` evaluated in ``dtype``: exact (one e2m1 value times a power of
    two) unless it leaves ``dtype``'s range, where it is rounded as ``torch.ldexp`` rounds (to 0 / inf). Bit
    for bit what transformers' dequantizer computes (before its transpose). -0 nibbles (0x8) give -0.0;
    scale 255 (e8m0 NaN) is taken as 2**128, as transformers does (0 stays 0, the rest become inf); the hf reader
    refuses a release that holds one (``Mxfp4.dequantize``)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, not {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1:] != (BYTES,) or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} are not "
                         f"[..., G, {BYTES}] and [..., G]")
    e2m1 = torch.tensor(E2M1 + tuple(-v for v in E2M1), dtype=dtype, device=blocks.device)
    pairs = torch.stack((e2m1.repeat(16), e2m1.repeat_interleave(16)), dim=-1)  # byte -> (low, high) values
    values = pairs[blocks.to(torch.int32)].flatten(-2)  # [..., G, 32]
    exps = scales.to(torch.int32).sub_(SCALE_BIAS).unsqueeze(-1)
    return torch.ldexp(values, exps).flatten(-2)


def dequantize_box(blocks: torch.Tensor, scales: torch.Tensor, box: Box,
                   dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``box`` of the logical tensor [..., rows, cols] in ``dtype``, from the ``block_box`` slices of it."""
    bbox, sbox = block_box(box)
    if tuple(blocks.shape) != bbox.sizes or tuple(scales.shape) != sbox.sizes:
        raise ValueError(f"MXFP4 slices {tuple(blocks.shape)}, {tuple(scales.shape)} are not the blocks "
                         f"{bbox.sizes} and scales {sbox.sizes} of {box}")
    return dequantize(blocks, scales, dtype=dtype)


def transformers_layout(w: torch.Tensor) -> torch.Tensor:
    """A logical [..., rows, cols] weight as transformers' dequantizer returns it, [..., cols, rows] (a view)."""
    return w.transpose(-1, -2)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks uint8 [..., cols/32, 16], scales uint8 [..., cols/32]) of ``w`` [..., cols], by OCP MX v1.0:

    * shared exponent X = floor(log2(amax)) - 2 (amax: the block's largest magnitude, 2: e2m1's emax),
      clamped to e8m0's [-127, 127]; an all-zero block has log2(0) = -inf, so X = -127 (scale byte 0);
    * each element |v| / 2**X rounded to the nearest e2m1 magnitude, ties to even (0.25 -> 0, 0.75 -> 1,
      5 -> 4), saturating at 6; the sign nibble bit is v's sign bit, as IEEE rounding keeps it (-0.0 and
      negatives that round to zero give 0x8).

    ``w`` is read in float32 (exact for bf16, fp16, fp32); inf / NaN are refused.

    Round trip: for a pair (16-byte block b, scale byte s), quantize(dequantize(b, s)) == (b, s) bit for bit
    (dequantized in bf16 or fp32, 0x8 nibbles included) exactly when the pair is *canonical* (``canonical``):
    s == 0, or 1 <= s <= 252 and the block's largest nibble magnitude is 4 or 6 (codes 6, 7). Every pair
    ``quantize`` writes is canonical. Any other pair with finite values (s <= 252, or a block small enough)
    comes back with the same values in canonical form: its scale raised until the largest magnitude is 4 or
    6 (or s is 0), its nibbles scaled down to match, e.g. (max 2.0, s=127) -> (max 4.0, s=126); all-zero
    blocks -> s=0. A pair whose values overflow to inf (s >= 253 and large nibbles) cannot be re-quantized."""
    if w.shape[-1] % BLOCK:
        raise ConvertError(f"a weight of shape {tuple(w.shape)} has an input axis that is not a multiple of "
                           f"{BLOCK}; MXFP4 scales {BLOCK}-value blocks along it",
                           "keep this tensor in bf16 (list it in quantization_config.modules_to_not_convert)")
    x = w.to(torch.float32).reshape(*w.shape[:-1], w.shape[-1] // BLOCK, BLOCK)
    if not bool(torch.isfinite(x).all()):
        raise ConvertError(f"a weight of shape {tuple(w.shape)} holds inf or NaN, which MXFP4 cannot store",
                           "fix the source checkpoint, or keep this tensor in bf16")
    amax = x.abs().amax(dim=-1)
    _, e = torch.frexp(amax)  # amax = m * 2**e, 0.5 <= m < 1: floor(log2(amax)) = e - 1
    shared = torch.where(amax > 0, e - 1 - E2M1_EMAX, -SCALE_BIAS).clamp_(-SCALE_BIAS, SCALE_BIAS)
    mag = torch.ldexp(x.abs(), -shared.unsqueeze(-1))  # exact: a power-of-two rescale
    nibbles = (e2m1_codes(mag) | (torch.signbit(x).to(torch.uint8) << 3)).unflatten(-1, (BYTES, 2))
    blocks = nibbles[..., 0] | (nibbles[..., 1] << 4)
    return blocks.contiguous(), (shared + SCALE_BIAS).to(torch.uint8)


def canonical(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Per block ([..., G] bool): whether (block, scale) is one ``quantize`` writes, so survives
    dequantize + quantize bit for bit (see ``quantize``)."""
    top = torch.maximum(blocks & 0x7, (blocks >> 4) & 0x7).amax(dim=-1)
    return (scales == 0) | ((scales <= 252) & (top >= 6))


# -- the hf reader's and writer's side: a pair stands in for the tensor transformers dequantizes it to ----------
EXPERT_WEIGHTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")  # what gpt-oss releases store in MXFP4


def stored_pair(name: str, found: Mapping[str, tuple[str, Any, tuple[int, ...]]]
                ) -> tuple[tuple[str, str, str, str], tuple[int, ...]] | None:
    """When tensor ``name`` is stored as an MXFP4 pair in ``found`` (stored name -> (file, dtype, shape)): its
    (blocks file, blocks key, scales file, scales key) and the shape transformers dequantizes it to
    ([..., cols, rows]: the transpose of the blocks' [..., rows, cols]); None when it is not. A pair missing
    its other half or with a scale grid of the wrong shape is refused (``check_pair``)."""
    b, s = name + BLOCKS_SUFFIX, name + SCALES_SUFFIX
    if b not in found and s not in found:
        return None
    check_pair(name, found[b][2] if b in found else None, found[s][2] if s in found else None)
    shape = tuple(found[b][2])
    if len(shape) < 3:
        raise ConvertError(f"MXFP4 tensor {b} has shape {shape}: an MXFP4 weight has at least rows and blocks",
                           "re-download the release's shards")
    rows, cols = shape[-3], shape[-2] * BLOCK
    return (found[b][0], b, found[s][0], s), shape[:-3] + (cols, rows)


def read_boxes_of(box: Box) -> tuple[Box, Box, Box]:
    """For ``box`` of the dequantized tensor in transformers' layout [..., cols, rows]: (the box of the blocks,
    the box of the scales, and the block-aligned box in the blocks' order that they dequantize to)."""
    lead_o, lead_n = box.offsets[:-2], box.sizes[:-2]
    (c0, r0), (nc, nr) = box.offsets[-2:], box.sizes[-2:]
    aligned = aligned_box(Box(lead_o + (r0, c0), lead_n + (nr, nc)))
    blocks, scales = block_box(aligned)
    return blocks, scales, aligned


def dequantize_to(blocks: torch.Tensor, scales: torch.Tensor, box: Box, dtype: torch.dtype) -> torch.Tensor:
    """``box`` of the dequantized tensor in transformers' layout [..., cols, rows], from the blocks and scales
    ``read_boxes_of(box)`` names: dequantized in ``dtype`` (bit for bit transformers'), the columns outside
    ``box`` dropped, transposed."""
    _, _, aligned = read_boxes_of(box)
    full = dequantize(blocks, scales, dtype=dtype)
    c0 = box.offsets[-2] - aligned.offsets[-1]
    return full[..., c0:c0 + box.sizes[-2]].transpose(-1, -2).contiguous()


def quantizable(name: str, shape: tuple[int, ...]) -> bool:
    """Whether ``--quantize mxfp4`` stores HF tensor ``name`` as a pair: gpt-oss's expert weights (the rest of a
    gpt-oss release, biases included, stays in high precision), whose input axis is whole 32-blocks."""
    return name.endswith(EXPERT_WEIGHTS) and len(shape) == 3 and shape[-2] % BLOCK == 0


def stored(name: str, x: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The pair a file holds for ``x`` (transformers' layout [E, cols, rows]): blocks and scales of its transpose."""
    blocks, scales = quantize(x.transpose(-1, -2))
    return [(name + BLOCKS_SUFFIX, blocks), (name + SCALES_SUFFIX, scales)]


def stored_sizes(name: str, shape: tuple[int, ...]) -> list[tuple[str, int]]:
    """(name, bytes) of what ``stored`` writes for a tensor of ``shape``."""
    n = 1
    for d in shape:
        n *= d
    return [(name + BLOCKS_SUFFIX, n // 2), (name + SCALES_SUFFIX, n // BLOCK)]


class Mxfp4(Writer):
    """``--quantize mxfp4`` (gpt-oss's expert weights); read: a tensor stored as its ``_blocks`` / ``_scales`` pair."""

    name = "mxfp4"
    what = "MXFP4"
    config = QUANTIZATION_CONFIG

    def stored(self, key: str, shape: tuple[int, ...], hf: dict[str, Any],
               found: Found) -> tuple[Quantized, tuple[int, ...]] | None:
        pair = None if key in found else stored_pair(key, found)
        if pair is None:
            return None
        (bf, bk, sf, sk), shape = pair
        return Quantized(self.name, ((bf, bk), (sf, sk))), shape

    def boxes(self, q: Quantized, box: Box) -> tuple[Box, ...]:
        return read_boxes_of(box)[:2]

    def dequantize(self, q: Quantized, parts: list[torch.Tensor], box: Box, dtype: torch.dtype) -> torch.Tensor:
        check_scale(q, 1, parts[1] == NAN_SCALE, "NaN (e8m0 255)")
        return dequantize_to(parts[0], parts[1], box, dtype)

    def quantizable(self, name: str, shape: tuple[int, ...]) -> bool:
        return quantizable(name, shape)

    def quantize(self, name: str, x: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        refuse_nonfinite(self.name, name, x)
        return stored(name, x)

    def stored_sizes(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> list[tuple[str, int]]:
        return stored_sizes(name, shape)

    def check_target(self, shapes: Mapping[str, tuple[int, ...]], architecture: str) -> None:
        if not any(quantizable(n, s) for n, s in shapes.items()):
            raise ConvertError(f"--quantize mxfp4 stores gpt-oss's expert weights ({', '.join(EXPERT_WEIGHTS)}), "
                               f"and this {architecture} has none", "drop --quantize mxfp4 for this model")


SCHEME = Mxfp4()
