"""MXFP4 codec (dist_convert/formats/mxfp4.py): dequantization bit for bit against transformers' own
dequantizer (and its axis order), box slicing, refusals, and the quantize round trip. Pure and fast."""
from __future__ import annotations

import pytest
import torch

from dist_convert.errors import ConvertError
from dist_convert.formats import mxfp4
from dist_convert.layout.boxes import Box

GRID = torch.tensor(mxfp4.E2M1)
INT = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns (so -0.0, inf and NaN compare exactly)."""
    return t.contiguous().view(INT[t.dtype])


def random_pair(shape: tuple[int, ...], lo: int = 100, hi: int = 140, seed: int = 0):
    """Random blocks [*shape, 16] (every byte value, 0x8 nibbles included) and scales [*shape] in [lo, hi]."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape, mxfp4.BYTES), generator=g, dtype=torch.uint8)
    scales = torch.randint(lo, hi + 1, shape, generator=g, dtype=torch.uint8)
    return blocks, scales


def canonical_pair(shape: tuple[int, ...], seed: int = 0):
    """Random canonical pairs: each block's largest magnitude 4 or 6 at scales 1..252, plus scale-0 blocks
    (any nibbles) and all-zero blocks (0x0 / 0x8 nibbles) at scale 0."""
    g = torch.Generator().manual_seed(seed)
    nib = torch.randint(0, 16, (*shape, mxfp4.BLOCK), generator=g, dtype=torch.uint8)
    where = torch.randint(0, mxfp4.BLOCK, (*shape, 1), generator=g)
    top = torch.randint(6, 8, (*shape, 1), generator=g, dtype=torch.uint8) | (torch.randint(
        0, 2, (*shape, 1), generator=g, dtype=torch.uint8) << 3)
    nib = nib.scatter(-1, where, top)
    scales = torch.randint(1, 253, shape, generator=g, dtype=torch.uint8)
    flat_n, flat_s = nib.view(-1, mxfp4.BLOCK), scales.view(-1)
    flat_s[::7] = 0  # scale 0: any nibbles
    flat_n[1::11] &= 0x8  # all zero, signs kept
    flat_s[1::11] = 0
    nib = nib.unflatten(-1, (mxfp4.BYTES, 2))
    return nib[..., 0] | (nib[..., 1] << 4), scales


@pytest.fixture(scope="module")
def hf_dequantize():
    """transformers' own MXFP4 dequantizer (``convert_moe_packed_tensors``), the truth of the release format."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    return convert_moe_packed_tensors


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_dequantize_matches_transformers(hf_dequantize, dtype):
    e, f, h = 3, 40, 64  # gpt-oss: gate_up blocks [E, 2F, H/32, 16], down blocks [E, H, F/32, 16]
    gate_up = random_pair((e, 2 * f, h // 32), seed=1)
    down = random_pair((e, h, 64 // 32), seed=2)
    for (blocks, scales), hf_shape in ((gate_up, (e, h, 2 * f)), (down, (e, 64, h))):
        ours = mxfp4.dequantize(blocks, scales, dtype=dtype)
        assert ours.shape == blocks.shape[:-2] + (blocks.shape[-2] * 32,) and ours.dtype == dtype
        ref = hf_dequantize(blocks, scales, dtype=dtype)
        assert tuple(ref.shape) == hf_shape  # transformers: [..., cols, rows], the transpose of the blocks' order
        assert torch.equal(bits(mxfp4.transformers_layout(ours)), bits(ref))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dequantize_edges_match_transformers(hf_dequantize, dtype):
    """Every scale byte 0..255 (under- and overflow, e8m0's 255) with every nibble."""
    nib = torch.arange(16, dtype=torch.uint8).repeat(2)
    block = nib[0::2] | (nib[1::2] << 4)
    blocks = block.expand(1, 256, 1, 16).contiguous()
    scales = torch.arange(256).to(torch.uint8).view(1, 256, 1)
    ours = mxfp4.dequantize(blocks, scales, dtype=dtype)
    assert torch.equal(bits(mxfp4.transformers_layout(ours)), bits(hf_dequantize(blocks, scales, dtype=dtype)))
    assert ours[0, 127, :16].tolist() == [*mxfp4.E2M1, *(-v for v in mxfp4.E2M1)]
    assert torch.signbit(ours[0, 127, 8])  # 0x8 is -0.0


BOXES = [  # of the logical [E, rows, cols] = [4, 12, 128]
    Box((0, 0, 0), (4, 12, 128)), Box((1, 0, 0), (2, 12, 128)), Box((3, 5, 0), (1, 4, 128)),
    Box((0, 0, 32), (4, 12, 64)), Box((2, 7, 96), (2, 5, 32)), Box((0, 3, 0), (1, 1, 32)),
]


@pytest.mark.parametrize("box", BOXES)
def test_box_slices_equal_full_dequantization(box):
    blocks, scales = random_pair((4, 12, 4), lo=90, hi=160, seed=3)
    full = mxfp4.dequantize(blocks, scales)
    bbox, sbox = mxfp4.block_box(box)
    part = mxfp4.dequantize_box(blocks[bbox.slices()], scales[sbox.slices()], box, torch.bfloat16)
    assert torch.equal(bits(part), bits(full[box.slices()]))


def test_block_box_and_aligned_box():
    bbox, sbox = mxfp4.block_box(Box((1, 2, 64), (3, 4, 96)))
    assert bbox == Box((1, 2, 2, 0), (3, 4, 3, 16)) and sbox == Box((1, 2, 2), (3, 4, 3))
    assert mxfp4.aligned_box(Box((0, 40), (5, 30))) == Box((0, 32), (5, 64))
    assert mxfp4.aligned_box(Box((0, 64), (5, 32))) == Box((0, 64), (5, 32))


@pytest.mark.parametrize("box", [Box((0, 0, 16), (1, 4, 32)), Box((0, 0, 0), (1, 4, 48)), Box((0, 5), (1, 1))])
def test_block_box_refuses_cut_blocks(box):
    with pytest.raises(ConvertError) as e:
        mxfp4.block_box(box)
    assert "cuts its 32-column scale blocks" in e.value.cause
    assert "multiples of 32" in e.value.fix and str(e.value) == f"{e.value.cause}; {e.value.fix}"


@pytest.mark.parametrize("blocks_shape,scales_shape,cause", [
    ((8, 90, 16), None, "has no x.down_proj_scales beside it"),
    (None, (8, 90), "x.down_proj_scales has no x.down_proj_blocks"),
    ((8, 90, 16), (8, 45), "scale grid x.down_proj_scales has shape (8, 45), but x.down_proj_blocks"),
    ((8, 90, 16), (8, 90, 1), "needs (8, 90)"),
    ((8, 90, 32), (8, 90), "not [..., cols/32, 16]"),
])
def test_check_pair_refuses(blocks_shape, scales_shape, cause):
    with pytest.raises(ConvertError) as e:
        mxfp4.check_pair("x.down_proj", blocks_shape, scales_shape)
    assert cause in e.value.cause and e.value.fix
    assert ("model.safetensors.index.json" if None in (blocks_shape, scales_shape) else "re-export") in e.value.fix
    assert "\n" not in str(e.value)


def test_check_pair_accepts():
    mxfp4.check_pair("model.layers.0.mlp.experts.gate_up_proj_blocks", (32, 5760, 90, 16), (32, 5760, 90))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_canonical_pairs_round_trip(dtype):
    blocks, scales = canonical_pair((3, 16, 5), seed=4)
    assert bool(mxfp4.canonical(blocks, scales).all())
    b, s = mxfp4.quantize(mxfp4.dequantize(blocks, scales, dtype=dtype))
    assert torch.equal(b, blocks) and torch.equal(s, scales)


def test_round_trip_exactly_for_canonical_pairs():
    """Both ways, on arbitrary pairs with finite values: bit-exact iff canonical; values always kept."""
    blocks, scales = random_pair((4, 64, 8), lo=0, hi=252, seed=5)
    blocks[0, :, :, :] &= 0x33  # small magnitudes (largest 1.5): not canonical unless scale 0
    scales[0, :4] = 0
    w = mxfp4.dequantize(blocks, scales, dtype=torch.float32)
    b, s = mxfp4.quantize(w)
    same = (b == blocks).all(dim=-1) & (s == scales)
    assert torch.equal(same, mxfp4.canonical(blocks, scales))
    assert 0 < int(same.sum()) < same.numel()
    assert torch.equal(bits(mxfp4.dequantize(b, s, dtype=torch.float32)), bits(w))
    assert bool(mxfp4.canonical(b, s).all())


def test_non_canonical_example():
    """(largest 2.0, scale 127) dequantizes to the values of (largest 4.0, scale 126), which quantize writes;
    an all-zero block at scale 127 comes back at scale 0 with its -0 nibbles."""
    nib = torch.tensor([4, 1, 2, 3, 0, 8, 12, 9] * 4, dtype=torch.uint8)  # 2, .5, 1, 1.5, 0, -0, -2, -.5
    block = (nib[0::2] | (nib[1::2] << 4)).view(1, 16)
    zero = torch.full((1, 16), 0x80, dtype=torch.uint8)  # +0, -0
    blocks, scales = torch.cat([block, zero]), torch.tensor([127, 127], dtype=torch.uint8)
    assert mxfp4.canonical(blocks, scales).tolist() == [False, False]
    b, s = mxfp4.quantize(mxfp4.dequantize(blocks, scales))
    doubled = torch.tensor([6, 2, 4, 5, 0, 8, 14, 10] * 4, dtype=torch.uint8)  # 4, 1, 2, 3, 0, -0, -4, -1
    assert torch.equal(b[0], doubled[0::2] | (doubled[1::2] << 4)) and torch.equal(b[1], zero[0])
    assert s.tolist() == [126, 0]
    assert torch.equal(mxfp4.dequantize(b, s), mxfp4.dequantize(blocks, scales))


def test_overflowing_pairs_are_not_canonical():
    """Scale 252 is the largest whose 4.0 / 6.0 stay finite in bf16 / fp32; at 253 they are inf."""
    blocks = torch.tensor([[0x76] * 16, [0x76] * 16], dtype=torch.uint8)  # 4.0, 6.0
    scales = torch.tensor([252, 253], dtype=torch.uint8)
    assert mxfp4.canonical(blocks, scales).tolist() == [True, False]
    b, s = mxfp4.quantize(mxfp4.dequantize(blocks[:1], scales[:1]))
    assert torch.equal(b, blocks[:1]) and torch.equal(s, scales[:1])
    assert bool(torch.isinf(mxfp4.dequantize(blocks[1:], scales[1:])).all())
    with pytest.raises(ConvertError, match="inf or NaN"):
        mxfp4.quantize(mxfp4.dequantize(blocks[1:], scales[1:]))


def reference_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """OCP MX by brute force: X from log2, nearest grid value by search, ties to the even code."""
    x = w.double().unflatten(-1, (-1, 32))
    amax = x.abs().amax(-1)
    shared = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2, torch.full_like(amax, -127)).clamp(-127, 127)
    mag = x.abs() / torch.pow(2.0, shared).unsqueeze(-1)
    dist = (mag.unsqueeze(-1) - GRID.double()).abs()
    best = dist == dist.amin(-1, keepdim=True)
    code = (best * (2 - torch.arange(8) % 2)).argmax(-1)  # among the nearest, an even code first
    nib = (code | (torch.signbit(x).long() << 3)).unflatten(-1, (16, 2))
    return (nib[..., 0] | (nib[..., 1] << 4)).to(torch.uint8), (shared + 127).to(torch.uint8)


def sample_weights() -> torch.Tensor:
    g = torch.Generator().manual_seed(6)
    w = torch.randn(6, 40, 128, generator=g) * torch.logspace(-30, 30, 40, base=2).view(1, 40, 1)
    ties = torch.tensor([4.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0, -0.25, -0.0, -0.1, 7.0, 5.5, 0.0, 6.5])
    w[0, 0, :32] = torch.cat([ties, ties * 0.5])  # exact ties, negative zero, saturation
    w[0, 1, :32] = ties.repeat(2) * 2.0 ** -126  # near e8m0's smallest scale (clamped)
    w[0, 2, :32] = 0.0
    return w.to(torch.bfloat16)


def test_quantize_matches_reference_rules():
    w = sample_weights()
    b, s = mxfp4.quantize(w)
    rb, rs = reference_quantize(w)
    assert torch.equal(s, rs) and torch.equal(b, rb)
    assert s[0, 2, 0] == 0 and s[0, 0, 0] == 127  # all-zero block -> scale byte 0; 4.0 max -> 2**0


def test_quantize_error_bound_and_idempotent():
    w = sample_weights()
    b, s = mxfp4.quantize(w)
    y = mxfp4.dequantize(b, s, dtype=torch.float32)
    x = w.float()
    step = torch.pow(2.0, s.float() - 127).repeat_interleave(32, dim=-1)  # 2**X per element
    m = x.abs() / step
    half_gap = torch.where(m < 2, 0.25, torch.where(m < 4, 0.5, 1.0))  # half the e2m1 spacing there
    bound = torch.where(m <= 6, half_gap, m - 6) * step  # over 6: saturated at 6 (m < 8)
    assert bool(((x - y).abs() <= bound).all()) and bool((m < 8).all())
    assert bool(((x - y).abs() <= x.abs().unflatten(-1, (-1, 32)).amax(-1).repeat_interleave(32, -1) / 2).all())
    b2, s2 = mxfp4.quantize(mxfp4.dequantize(b, s))
    assert torch.equal(b2, b) and torch.equal(s2, s)


def test_quantize_refusals():
    with pytest.raises(ConvertError, match="not a multiple of 32.*modules_to_not_convert"):
        mxfp4.quantize(torch.zeros(4, 48))
    with pytest.raises(ConvertError, match="inf or NaN.*fix the source"):
        mxfp4.quantize(torch.tensor([float("nan")] + [0.0] * 31))


def test_config():
    assert mxfp4.is_mxfp4({"quantization_config": mxfp4.QUANTIZATION_CONFIG})
    assert not mxfp4.is_mxfp4({"quantization_config": {"quant_method": "fp8"}}) and not mxfp4.is_mxfp4({})
    assert mxfp4.QUANTIZATION_CONFIG["quant_method"] == "mxfp4"


@pytest.mark.parametrize("box", [Box((0, 0, 0), (3, 64, 80)), Box((1, 7, 3), (2, 40, 50)),
                                 Box((2, 33, 79), (1, 31, 1))])
def test_reader_boxes_in_transformers_layout(hf_dequantize, box):
    """A box of transformers' [E, cols, rows] layout, read through the block-aligned blocks and scales that cover it
    (columns cut mid-block included), is that box of transformers' own dequantization."""
    blocks, scales = random_pair((3, 80, 64 // 32), seed=5)  # rows 80, cols 64
    found = {"w_blocks": ("a.safetensors", torch.uint8, tuple(blocks.shape)),
             "w_scales": ("b.safetensors", torch.uint8, tuple(scales.shape))}
    pair, shape = mxfp4.stored_pair("w", found)
    assert pair == ("a.safetensors", "w_blocks", "b.safetensors", "w_scales") and shape == (3, 64, 80)
    bbox, sbox, _ = mxfp4.read_boxes_of(box)
    got = mxfp4.dequantize_to(blocks[bbox.slices()], scales[sbox.slices()], box, torch.bfloat16)
    want = hf_dequantize(blocks, scales, dtype=torch.bfloat16)[box.slices()]
    assert torch.equal(bits(got), bits(want))
    assert mxfp4.stored_pair("v", found) is None
    with pytest.raises(ConvertError, match="has no w_scales"):
        mxfp4.stored_pair("w", {"w_blocks": found["w_blocks"]})
