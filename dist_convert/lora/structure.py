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

from collections import Counter
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
        if len(order) == 1 and order[0].rslora and order[0].r == r:  # kept as it is: rslora stays rslora
            alpha, rslora, factor = order[0].alpha, True, {}
        else:
            scale, factor = one_scale(y.name, order)
            alpha, rslora = scale * r, False
        by_b = {m.b: factor.get(m.name, 1) for m in order}
        out.append(Laid(module=AdapterModule(name=y.name, a=y.a, b=y.b, r=r, alpha=alpha, rslora=rslora,
                                             shape=y.shape, base=y.base), a=tuple(a.values()),
                        b=tuple(scaled(p, by_b[p.logical]) for p in b.values())))
    return out


def power_of_two(x: Fraction) -> bool:
    return x > 0 and x.numerator & (x.numerator - 1) == 0 and x.denominator & (x.denominator - 1) == 0


def scaled(p: Piece, factor: Fraction) -> Piece:
    return p if factor == 1 else replace(p, scale=p.scale * float(factor))


def one_scale(name: str, modules: Sequence[AdapterModule]) -> tuple[Fraction, dict[str, Fraction]]:
    """The one scale a module ``name`` holding these modules' blocks gets (the most common of theirs; 1 for none),
    and the factor each other one's B is stored with so its product keeps its own scale: a power of two, exact in
    binary floating point (peft's ``rank_pattern`` at one alpha gives such). Refused otherwise, and for rslora
    scales alpha / sqrt(r) with r not a square."""
    irrational = next((m for m in modules if m.exact_scale is None), None)
    if irrational is not None:
        raise ConvertError(f"{irrational.name} is an rslora module (alpha / sqrt(r), r={irrational.r} not a square) "
                           f"that becomes part of {name}, whose scale cannot equal it exactly", KEEP_PEFT)
    scales = [m.exact_scale for m in modules]
    scale = Counter(scales).most_common(1)[0][0] if scales else Fraction(1)
    bad = sorted({s for s in scales if not power_of_two(s / scale)})
    if bad:
        raise ConvertError(f"{name} holds modules with scales {scale} and {', '.join(str(s) for s in bad)} (peft "
                           "alpha_pattern / rank_pattern), whose ratio is no power of two: one alpha cannot state "
                           "both exactly", KEEP_PEFT)
    return scale, {m.name: m.exact_scale / scale for m in modules if m.exact_scale != scale}


def with_rank(laid: list[Laid], dim: int) -> list[Laid]:
    """Every module at rank ``dim`` and one alpha (a format with one ``dim`` and ``alpha``: Megatron-Bridge's LoRA;
    zero modules too): modules of another scale store their B times its ratio to the common one (``one_scale``)."""
    scale, factor = one_scale("the adapter", [x.module for x in laid if x.b])
    return [replace(x, module=replace(x.module, r=dim, alpha=scale * dim, rslora=False),
                    b=tuple(scaled(p, factor.get(x.module.name, 1)) for p in x.b)) for x in laid]


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
            out.append(Piece(q.logical, src, dst, scale=q.scale * p.scale))
    return out


def placements(laid: list[Laid]) -> dict[str, tuple[Piece, ...]]:
    out: dict[str, tuple[Piece, ...]] = {}
    for x in laid:
        out[x.module.a] = x.a
        out[x.module.b] = x.b
    return out
