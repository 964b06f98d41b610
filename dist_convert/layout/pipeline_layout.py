"""``pipeline_model_parallel_layout`` strings (megatron-core >= 0.13): explicit placement of layers on
pipeline stages, parsed and checked without megatron-core.

A string lists every pipeline stage, separated by ``|``, VPP-major: all PP ranks of virtual stage 0,
then all PP ranks of virtual stage 1, and so on (stage ``s`` is PP rank ``s % PP``, virtual stage
``s // PP``; VPP = stages / PP). Symbols: ``E`` embedding, ``t`` a transformer (decoder) layer, ``m`` a
multi-token-prediction layer, ``L`` the loss (output layer). ``(...)*N`` repeats a group (no nesting),
``x*N`` repeats one symbol (or ``|``), commas are cosmetic. Example: ``"Et|(tt|)*30mL"``.

Decoder layers are numbered in stage order, VPP-major, as megatron-core numbers them
(``PipelineParallelLayerLayout.get_layer_offset``): a chunk's first layer is the count of ``t`` in every
stage listed before it.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ..errors import ConvertError

SYMBOLS = {"E": "embedding", "t": "decoder layer", "m": "MTP layer", "L": "loss"}
FLAG = "--target-pipeline-layout"


@dataclass(frozen=True, kw_only=True)
class StageChunk:
    """One pipeline stage of a layout string: PP rank, virtual stage, its entries, its decoder layers."""
    pp: int
    vp: int
    entries: tuple[str, ...]
    first_layer: int  # global index of its first decoder layer
    layers: int  # decoder layers it holds

    @property
    def layer_range(self) -> range:
        return range(self.first_layer, self.first_layer + self.layers)


@dataclass(frozen=True, kw_only=True)
class PipelineLayout:
    text: str
    pp: int
    stages: tuple[tuple[str, ...], ...]  # in string order (VPP-major)

    @property
    def vpp(self) -> int:
        return len(self.stages) // self.pp

    def stage(self, pp_rank: int, vp: int) -> tuple[str, ...]:
        return self.stages[vp * self.pp + pp_rank]

    def chunks(self) -> list[StageChunk]:
        """Every stage in string order, with its global decoder layer range."""
        out, offset = [], 0
        for s, entries in enumerate(self.stages):
            n = entries.count("t")
            out.append(StageChunk(pp=s % self.pp, vp=s // self.pp, entries=entries, first_layer=offset, layers=n))
            offset += n
        return out

    def where(self, symbol: str) -> list[tuple[int, int]]:
        """(pp rank, virtual stage) of every stage holding ``symbol`` (``E``, ``L``, ``m``), in string order."""
        return [(c.pp, c.vp) for c in self.chunks() if symbol in c.entries]

    def count(self, symbol: str) -> int:
        return sum(entries.count(symbol) for entries in self.stages)

    @property
    def num_layers(self) -> int:
        return self.count("t")


def _repeat_count(s: str, i: int, text: str, flag: str) -> tuple[int, int]:
    """The ``N`` of a ``*N`` starting at ``s[i] == "*"``: (N, index after it)."""
    j = i + 1
    while j < len(s) and s[j].isdigit():
        j += 1
    if j == i + 1:
        raise ConvertError(f"pipeline layout {text!r}: '*' must be followed by a repeat count",
                           f"write repeats as (tt|)*N or t*N in {flag}")
    return int(s[i + 1:j]), j


def _expand_plain(s: str, text: str, flag: str) -> str:
    """Unroll ``x*N`` in a string without parentheses."""
    out, i = [], 0
    while i < len(s):
        c = s[i]
        if c == "*" or c.isdigit():
            raise ConvertError(f"pipeline layout {text!r}: {c!r} without a symbol before it",
                               f"write repeats as (tt|)*N or t*N in {flag}")
        if i + 1 < len(s) and s[i + 1] == "*":
            n, i = _repeat_count(s, i + 1, text, flag)
            out.append(c * n)
        else:
            out.append(c)
            i += 1
    return "".join(out)


def expand(text: str, flag: str = FLAG) -> str:
    """The string with commas removed and every ``(...)*N`` / ``x*N`` unrolled (one level of groups)."""
    s = text.replace(",", "")
    out, i = [], 0
    while i < len(s):
        if s[i] == ")":
            raise ConvertError(f"pipeline layout {text!r}: unbalanced ')'", f"fix the parentheses in {flag}")
        if s[i] != "(":
            j = s.find("(", i)
            j = len(s) if j < 0 else j
            if ")" in s[i:j]:
                raise ConvertError(f"pipeline layout {text!r}: unbalanced ')'", f"fix the parentheses in {flag}")
            out.append(_expand_plain(s[i:j], text, flag))
            i = j
            continue
        close = s.find(")", i)
        body = s[i + 1:close] if close > 0 else ""
        if close < 0 or not body or "(" in body:
            raise ConvertError(f"pipeline layout {text!r}: a group must be one level of (...) with something "
                               "inside", f"fix the parentheses in {flag}")
        if close + 1 >= len(s) or s[close + 1] != "*":
            raise ConvertError(f"pipeline layout {text!r}: group ({body}) has no repeat count",
                               f"write (...)*N in {flag}")
        n, i = _repeat_count(s, close + 1, text, flag)
        if i < len(s) and s[i] == "*":
            raise ConvertError(f"pipeline layout {text!r}: a repeat count cannot be repeated again",
                               f"write one *N per group in {flag}")
        out.append(_expand_plain(body, text, flag) * n)
    return "".join(out)


@lru_cache(maxsize=64)
def parse(text: str, pp: int, flag: str = FLAG) -> PipelineLayout:
    """Parse ``text`` for ``pp`` pipeline ranks; refuses syntax errors, unknown symbols and stage
    counts that are not a multiple of PP (what megatron-core's parser refuses; see ``check``)."""
    stages = tuple(tuple(stage) for stage in expand(text, flag).split("|"))
    bad = sorted({c for stage in stages for c in stage if c not in SYMBOLS})
    if bad:
        known = ", ".join(f"{k} ({v})" for k, v in SYMBOLS.items())
        raise ConvertError(f"pipeline layout {text!r} has unknown symbols {', '.join(map(repr, bad))}",
                           f"use only {known}, '|', (...)*N and ',' in {flag}")
    if pp < 1 or len(stages) % pp:
        raise ConvertError(f"pipeline layout {text!r} has {len(stages)} stages, not a multiple of PP={pp}",
                           f"give a multiple of PP={pp} stages (PP x VPP) in {flag}, or a PP dividing "
                           f"{len(stages)}")
    return PipelineLayout(text=text, pp=pp, stages=stages)


def check(layout: PipelineLayout, num_layers: int, mtp_layers: int = 0, flag: str = FLAG) -> None:
    """Refuse what megatron-core's ``PipelineParallelLayerLayout.validate_layer_layout`` refuses."""
    text = layout.text
    flat = [x for stage in layout.stages for x in stage]
    if not flat or flat[0] != "E" or flat.count("E") != 1:
        raise ConvertError(f"pipeline layout {text!r} must start with the embedding E, once",
                           f"begin {flag} with E (e.g. Ett|ttL)")
    if flat[-1] != "L" or flat.count("L") != 1:
        raise ConvertError(f"pipeline layout {text!r} must end with the loss L, once", f"end {flag} with L")
    if layout.num_layers != num_layers:
        raise ConvertError(f"pipeline layout {text!r} places {layout.num_layers} decoder layers (t) but the model "
                           f"has num_layers={num_layers}", f"give exactly {num_layers} t in {flag}")
    mtp = layout.count("m")
    if mtp != mtp_layers:
        raise ConvertError(f"pipeline layout {text!r} places {mtp} MTP layers (m) but the model has {mtp_layers}",
                           f"give exactly {mtp_layers} m in {flag}")
    if mtp:
        first_m = flat.index("m")
        holders = layout.where("m")
        if "t" in flat[first_m:]:
            raise ConvertError(f"pipeline layout {text!r} places decoder layers after MTP layers",
                               f"put every m after the last t in {flag}")
        if len(holders) != 1 or holders[0][1] != layout.vpp - 1:
            raise ConvertError(f"pipeline layout {text!r}: megatron-core needs all MTP layers in one stage, in the "
                               "last virtual stage of its PP rank", f"move every m into one such stage in {flag}")


def of_segments(sizes: list[int], mtp_layers: int = 0) -> str:
    """The layout string of stages holding ``sizes`` decoder layers, in string order (VPP-major), with the embedding
    in the first stage and the MTP layers and the loss in the last: a HybridModel pattern's ``|`` segments
    (megatron-core >= 0.19 builds segment ``v * PP + p`` as virtual stage ``v`` of PP rank ``p``)."""
    stages = ["t" * n for n in sizes]
    stages[0] = "E" + stages[0]
    stages[-1] += "m" * mtp_layers + "L"
    return "|".join(stages)


def stage_layers(text: str, pp: int, flag: str = FLAG) -> list[tuple[int, int, int, int]]:
    """(pp rank, virtual stage, first global decoder layer, layer count) of every stage, PP-rank-major
    (as ``Layout.model_chunks`` lists them)."""
    chunks = parse(text, pp, flag).chunks()
    return sorted(((c.pp, c.vp, c.first_layer, c.layers) for c in chunks), key=lambda c: (c[0], c[1]))
