"""Pure: the typed fused parts (layout/fused.py) against torch ground truth and the implementations the
formats had before they used them (hf part_pieces, boxes.tp_chunks, NeMo legacy moves, the draft export)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dist_convert.formats.hf import part_pieces
from dist_convert.formats.nemo_legacy import move_rows, qkv_moves
from dist_convert.layout.boxes import Box, Kind, Piece, local_pieces, tp_chunks
from dist_convert.layout.fused import GLU, QKV, Block, fused_for, glu, qkv, row_box
from dist_convert.speculative.draft_export import draft_tensors

H = 5  # columns of the test weights
# (heads, groups, head_dim): MHA, GQA, MQA-like, GQA with several heads per group
CONFIGS = [(4, 4, 2), (4, 2, 3), (4, 1, 2), (8, 2, 4), (6, 3, 1)]


def cfg_of(heads: int, groups: int, d: int) -> SimpleNamespace:
    return SimpleNamespace(num_attention_heads=heads, num_query_groups=groups, kv_channels=d,
                           attention=SimpleNamespace(output_gate=False))


def old_part_pieces(logical, lshape, part, cfg):
    """hf.part_pieces before layout/fused.py, written out."""
    def rows(shape, lo, n):
        return Box((lo,) + (0,) * (len(shape) - 1), (n,) + tuple(shape[1:]))
    if part is None:
        return lshape, [Piece(logical, Box.full(lshape), Box.full(lshape))]
    if part in ("gate", "up"):
        f = lshape[0] // 2
        shape = (f,) + lshape[1:]
        return shape, [Piece(logical, rows(lshape, 0 if part == "gate" else f, f), Box.full(shape))]
    d, groups = cfg.kv_channels, cfg.num_query_groups
    per_group = cfg.num_attention_heads // groups
    n = per_group * d if part == "q" else d
    start = {"q": 0, "k": per_group * d, "v": (per_group + 1) * d}[part]
    shape = (groups * n,) + lshape[1:]
    return shape, [Piece(logical, rows(lshape, g * (per_group + 2) * d + start, n), rows(shape, g * n, n))
                   for g in range(groups)]


def old_glu_chunks(global_shape, tp_rank, tp):
    half = global_shape[0] // 2
    n = half // tp
    rest0 = (0,) * (len(global_shape) - 1)
    return [Box((tp_rank * n,) + rest0, (n,) + global_shape[1:]),
            Box((half + tp_rank * n,) + rest0, (n,) + global_shape[1:])]


def old_qkv_moves(heads, head_dim):
    return [(h * 3 * head_dim + s * head_dim, s * heads * head_dim + h * head_dim, head_dim)
            for h in range(heads) for s in range(3)]


def truth_qkv(fused: torch.Tensor, heads: int, groups: int, d: int) -> dict[str, torch.Tensor]:
    """q/k/v of a group-major fused tensor, by reshaping it per group."""
    per = heads // groups
    g = fused.reshape(groups, per + 2, d, *fused.shape[1:])
    return {"q": g[:, :per].reshape(groups * per * d, *fused.shape[1:]),
            "k": g[:, per].reshape(groups * d, *fused.shape[1:]),
            "v": g[:, per + 1].reshape(groups * d, *fused.shape[1:])}


def cut(t: torch.Tensor, shape: tuple[int, ...], pieces: list[Piece]) -> torch.Tensor:
    out = torch.full(shape, float("nan"), dtype=t.dtype)
    for p in pieces:
        out[p.sbox.slices()] = t[p.lbox.slices()]
    return out


def test_qkv_rows_mha_gqa_mqa():
    mha = QKV(heads=4, groups=4, head_dim=2)  # per group: q_g, k_g, v_g, 2 rows each
    assert mha.rows("q") == [(0, 2), (6, 2), (12, 2), (18, 2)]
    assert mha.rows("k") == [(2, 2), (8, 2), (14, 2), (20, 2)]
    assert mha.rows("v") == [(4, 2), (10, 2), (16, 2), (22, 2)]
    gqa = QKV(heads=4, groups=2, head_dim=3)  # per group: 2 query heads (6 rows), k (3), v (3)
    assert gqa.rows("q") == [(0, 6), (12, 6)]
    assert gqa.rows("k") == [(6, 3), (18, 3)]
    assert gqa.rows("v") == [(9, 3), (21, 3)]
    assert gqa.rows("v", group=1) == [(21, 3)]
    assert gqa.total_rows == 24 == (4 + 2 * 2) * 3
    mqa = QKV(heads=4, groups=1, head_dim=2)
    assert (mqa.rows("q"), mqa.rows("k"), mqa.rows("v")) == ([(0, 8)], [(8, 2)], [(10, 2)])
    assert [b for b in mqa.blocks()] == [Block(part="q", group=0, start=0, rows=8),
                                         Block(part="k", group=0, start=8, rows=2),
                                         Block(part="v", group=0, start=10, rows=2)]
    assert qkv(cfg_of(4, 2, 3)) == gqa


@pytest.mark.parametrize("heads,groups,d", CONFIGS)
@pytest.mark.parametrize("part", ["q", "k", "v"])
def test_qkv_pieces_match_old_part_pieces_and_torch(heads, groups, d, part):
    cfg, fused = cfg_of(heads, groups, d), qkv(cfg_of(heads, groups, d))
    for lshape in [(fused.total_rows, H), (fused.total_rows,)]:  # weight, bias
        logical = "decoder.layers.0.self_attention.linear_qkv.weight"
        got = fused.pieces(logical, lshape, part)
        assert got == old_part_pieces(logical, lshape, part, cfg)
        assert part_pieces(logical, lshape, part, cfg) == got
        t = torch.randn(lshape)
        assert torch.equal(cut(t, *got), truth_qkv(t, heads, groups, d)[part])


@pytest.mark.parametrize("rows", [2, 8, 48])
@pytest.mark.parametrize("part", ["gate", "up", None])
def test_glu_pieces_match_old_part_pieces(rows, part):
    cfg = cfg_of(4, 2, 3)  # GLU sizes come from the tensor (dense, expert and shared MLPs differ)
    for lshape in [(rows, H), (rows,)]:
        logical = "decoder.layers.0.mlp.linear_fc1.weight"
        got = part_pieces(logical, lshape, part, cfg)
        assert got == old_part_pieces(logical, lshape, part, cfg)
        if part is not None:
            t = torch.randn(lshape)
            assert torch.equal(cut(t, *got), t.chunk(2)[0 if part == "gate" else 1])


def test_glu_tp_rows():
    g = GLU(ffn=8)
    assert g.tp_rows(0, 1) == [(0, 8), (8, 8)]
    assert [g.tp_rows(r, 2) for r in range(2)] == [[(0, 4), (8, 4)], [(4, 4), (12, 4)]]
    assert [g.tp_rows(r, 4) for r in range(4)] == [[(0, 2), (8, 2)], [(2, 2), (10, 2)], [(4, 2), (12, 2)],
                                                   [(6, 2), (14, 2)]]
    with pytest.raises(ValueError):
        g.tp_rows(0, 3)


@pytest.mark.parametrize("shape", [(16, 5), (32,), (48, 3)])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tp_chunks_glu_unchanged(shape, tp):
    for r in range(tp):
        assert tp_chunks(Kind.GLU, shape, r, tp) == old_glu_chunks(shape, r, tp)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_glu_unshard_inverts_tp_rows(tp):
    full = torch.randn(16, H)
    g = glu(16)
    local = [torch.cat([full[s:s + n] for s, n in g.tp_rows(r, tp)]) for r in range(tp)]
    for r, t in enumerate(local):  # what a rank holds: [gate_r; up_r], as local_pieces describes it
        shape, pieces = local_pieces("fc1", Kind.GLU, (16, H), 16, r, tp)
        assert shape == tuple(t.shape)
        assert all(torch.equal(t[p.sbox.slices()], full[p.lbox.slices()]) for p in pieces)
    assert torch.equal(g.unshard(local), full)
    halves = [p.chunk(2, dim=0) for p in local]  # the draft export's gather before fused.py
    assert torch.equal(g.unshard(local), torch.cat([h[0] for h in halves] + [h[1] for h in halves]))


@pytest.mark.parametrize("heads,groups,d", CONFIGS)
def test_qkv_tp_rows_are_contiguous(heads, groups, d):
    f = QKV(heads=heads, groups=groups, head_dim=d)
    full = torch.randn(f.total_rows, H)
    for tp in [t for t in (1, 2, 4) if f.total_rows % t == 0]:
        local = [full[r * f.total_rows // tp:(r + 1) * f.total_rows // tp] for r in range(tp)]
        assert torch.equal(f.unshard(local), full)


@pytest.mark.parametrize("fused", [QKV(heads=h, groups=g, head_dim=d) for h, g, d in CONFIGS]
                         + [GLU(ffn=1), GLU(ffn=6)])
def test_split_fuse_round_trip(fused):
    t = torch.randn(fused.total_rows, H)
    parts = fused.split(t)
    assert list(parts) == list(fused.parts)
    assert all(parts[p].shape == fused.part_shape(tuple(t.shape), p) for p in fused.parts)
    assert torch.equal(fused.fuse(**parts), t)
    if isinstance(fused, QKV):
        truth = truth_qkv(t, fused.heads, fused.groups, fused.head_dim)
        assert all(torch.equal(parts[p], truth[p]) for p in "qkv")
    else:
        assert torch.equal(torch.cat([parts["gate"], parts["up"]]), t)


def test_refusals():
    with pytest.raises(ValueError):
        QKV(heads=4, groups=3, head_dim=2)
    with pytest.raises(ValueError):
        GLU(ffn=4).rows("q")
    with pytest.raises(ValueError):
        GLU(ffn=4).split(torch.zeros(7, 2))
    with pytest.raises(ValueError):
        GLU(ffn=2).fuse(gate=torch.zeros(2, 3))
    with pytest.raises(ValueError):
        fused_for("kv", cfg_of(4, 4, 2), 8)
    with pytest.raises(ValueError):
        glu(7)


@pytest.mark.parametrize("heads,d", [(1, 2), (2, 3), (4, 2)])
def test_nemo_megatron_legacy_moves(heads, d):
    assert qkv_moves(heads, d) == old_qkv_moves(heads, d)
    f = QKV(heads=heads, groups=heads, head_dim=d)  # legacy NeMo: no GQA
    t = torch.randn(f.total_rows, H)
    legacy = torch.empty_like(t)
    for src, dst, n in qkv_moves(heads, d):
        legacy[dst:dst + n] = t[src:src + n]
    parts = f.split(t)
    assert torch.equal(legacy, torch.cat([parts["q"], parts["k"], parts["v"]]))


def test_nemo_split_glu_moves():
    g = glu(12)
    assert g.moves(("gate",)) == [(0, 0, 6)] and g.moves(("up",)) == [(6, 0, 6)]
    pieces = [Piece("fc1", row_box((24, H), 6, 12), row_box((12, H), 0, 12))]  # one rank's [gate_r; up_r]
    assert move_rows(pieces, g.moves(("up",))) == move_rows(pieces, [(6, 0, 6)])


@pytest.mark.parametrize("heads,groups,d", [(4, 2, 2), (4, 4, 1)])
def test_draft_tensors_unchanged(heads, groups, d):
    cfg, f = cfg_of(heads, groups, d), QKV(heads=heads, groups=groups, head_dim=d)
    full = {"eagle_module.decoder.layers.0.self_attention.linear_qkv.weight": torch.randn(f.total_rows, H),
            "eagle_module.decoder.layers.0.mlp.linear_fc1.weight": torch.randn(12, H),
            "eagle_module.fc.weight": torch.randn(H, 2 * H)}
    got = draft_tensors(full, cfg, eagle3=True, layers=1, vocab=10)
    want = []
    for name, t in full.items():
        if name == "eagle_module.fc.weight":
            want.append(("fc.weight", t))
            continue
        names = ({"q": "q_proj", "k": "k_proj", "v": "v_proj"} if "qkv" in name
                 else {"gate": "gate_proj", "up": "up_proj"})
        for part, proj in names.items():
            shape, pieces = old_part_pieces(name, tuple(t.shape), part, cfg)
            kind = "self_attn" if "qkv" in name else "mlp"
            want.append((f"midlayer.{kind}.{proj}.weight", cut(t, shape, pieces)))
    assert [n for n, _ in got] == sorted(n for n, _ in want)
    want_d = dict(want)
    assert all(torch.equal(t, want_d[n]) and t.is_contiguous() for n, t in got)
