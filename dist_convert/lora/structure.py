"""How one adapter's modules are laid into another structure's (pure).

A target module ``Y`` (an HF peft module, or a Megatron-Bridge fused one) adapts the boxes of the logical base
tensors its ``base`` pieces name; every source module ``M`` adapting an overlapping box contributes its own
rank-``r_M`` block: ``A_Y``'s rows ``[c_M, c_M + r_M)`` are ``A_M`` (on the columns both cover) and ``B_Y``'s columns
``[c_M, c_M + r_M)`` are ``B_M`` (on the rows both cover); the rest of ``A_Y`` and ``B_Y`` is zero. So
``B_Y @ A_Y`` equals the sum of the sources' products on ``Y``'s box exactly: a Bridge adapter's fused
``linear_qkv`` becomes peft's q/k/v modules (each the rows of B it covers, the whole A), and peft's q/k/v modules
one block-structured fused module of rank ``r_q + r_k + r_v`` (zero blocks add exact zeros). The boxes are
*placements*: ``Piece(M's A or B, box of it, box of Y's)``, which ``compose`` joins to the target's own pieces.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from fractions import Fraction

from ..errors import ConvertError
from ..layout.boxes import Box, Piece
from .adapter import AdapterModule, stored_at

KEEP_PEFT = "merge the adapter into the base (--lora) instead, or keep the peft layout (--dst-format hf)"


@dataclass(frozen=True, kw_only=True)
class Slot:
    """A module a target format can hold: ``name`` + ``.weight`` (``shape``), its A and B logical names, its base."""

    name: str
    a: str
    b: str
    shape: tuple[int, int]
    base: tuple[Piece, ...]


@dataclass(frozen=True, kw_only=True)
class Laid:
    """A target module (``module.r``: its rank with the blocks and padding) and where its A and B come from."""

    module: AdapterModule
    a: tuple[Piece, ...]  # Piece(source A, box of it, box of this module's A)
    b: tuple[Piece, ...]


def lay_out(sources: Sequence[AdapterModule], slots: Sequence[Slot], *, multiple: int = 1,
            keep_empty: bool = False) -> list[Laid]:
    """Each slot as a module holding the sources' products on its box, of rank the sum of its blocks' (``with_rank``
    gives every module one rank). ``multiple``: ranks are padded with zeros up to a multiple of it. ``keep_empty``:
    slots no source touches are kept as zero modules (Bridge wraps every layer), else dropped."""
    by_logical: dict[str, list[tuple[AdapterModule, Piece]]] = {}
    for m in sources:
        for p in m.base:
            by_logical.setdefault(p.logical, []).append((m, p))
    out = []
    for y in slots:
        offset: dict[str, int] = {}
        order: list[AdapterModule] = []
        twins: set[str] = set()
        a: dict[tuple, Piece] = {}
        b: dict[tuple, Piece] = {}
        for yp in y.base:
            for m, mp in by_logical.get(yp.logical, ()):
                o = yp.lbox.intersect(mp.lbox)
                if o is None:
                    continue
                shared = m.same_a in offset  # one block for modules with one A (a fused adapter exported)
                if m.name not in offset:
                    offset[m.name] = offset[m.same_a] if shared else sum(x.r for x in order if x.name not in twins)
                    order.append(m)
                    if shared:
                        twins.add(m.name)
                c = offset[m.name]
                (yr, yc), (mr, mc) = stored_at(yp, o), stored_at(mp, o)
                n, k = o.sizes
                b[(m.b, mr, yr, n)] = Piece(m.b, Box((mr, 0), (n, m.r)), Box((yr, c), (n, m.r)))
                if m.name not in twins:
                    a[(m.a, mc, yc, k)] = Piece(m.a, Box((0, mc), (m.r, k)), Box((c, yc), (m.r, k)))
        if not order and not keep_empty:
            continue
        r = -(-max(sum(m.r for m in order if m.name not in twins), 1) // multiple) * multiple
        out.append(Laid(module=AdapterModule(name=y.name, a=y.a, b=y.b, r=r, alpha=_alpha(y.name, order, r),
                                             rslora=_keeps_rslora(order, r), shape=y.shape, base=y.base),
                        a=tuple(a.values()), b=tuple(b.values())))
    return out


def _keeps_rslora(order: list[AdapterModule], r: int) -> bool:
    return len(order) == 1 and order[0].rslora and order[0].r == r


def _alpha(name: str, order: list[AdapterModule], r: int) -> Fraction:
    """The alpha giving rank ``r`` the sources' one scale (refused when they differ or it is irrational)."""
    if not order:
        return Fraction(r)  # a zero module: any scale; Bridge's convention alpha = dim
    if _keeps_rslora(order, r):
        return order[0].alpha
    scales = {m.exact_scale for m in order}
    if None in scales:
        raise ConvertError(f"{order[0].name} is an rslora module (alpha / sqrt(r), r={order[0].r} not a square) that "
                           f"becomes part of {name} of rank {r}, whose scale cannot equal it exactly", KEEP_PEFT)
    if len(scales) > 1:
        raise ConvertError(f"the modules {', '.join(m.name for m in order)} that form {name} have different scales "
                           f"({', '.join(str(s) for s in sorted(scales))}; peft alpha_pattern / rank_pattern), which "
                           "one fused module cannot hold", KEEP_PEFT)
    return scales.pop() * r


def with_rank(laid: list[Laid], dim: int, alpha: Fraction) -> list[Laid]:
    """Every module at rank ``dim`` and ``alpha`` (zero modules too: a format with one alpha states one)."""
    return [replace(x, module=replace(x.module, r=dim, alpha=alpha)) for x in laid]


def compose(pieces: Sequence[Piece], placed: dict[str, Sequence[Piece]]) -> list[Piece]:
    """Pieces of a stored tensor onto target-module tensors, turned into pieces onto the source tensors placed
    there (``placed``: target tensor -> placements); regions nothing is placed in get no piece (zeros)."""
    out = []
    for p in pieces:
        lead = len(p.sbox.sizes) - len(p.lbox.sizes)
        for q in placed.get(p.logical, ()):
            o = p.lbox.intersect(q.sbox)
            if o is None:
                continue
            rel = o.relative_to(p.lbox)
            src = Box(tuple(a + b - c for a, b, c in zip(q.lbox.offsets, o.offsets, q.sbox.offsets, strict=True)),
                      o.sizes)
            dst = Box(p.sbox.offsets[:lead] + tuple(a + b for a, b in zip(p.sbox.offsets[lead:], rel.offsets,
                                                                          strict=True)),
                      p.sbox.sizes[:lead] + o.sizes)
            out.append(Piece(q.logical, src, dst))
    return out


def placements(laid: list[Laid]) -> dict[str, tuple[Piece, ...]]:
    out: dict[str, tuple[Piece, ...]] = {}
    for x in laid:
        out[x.module.a] = x.a
        out[x.module.b] = x.b
    return out
