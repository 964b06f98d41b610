"""Which tensors a legacy Megatron rank file (``mp_rank_TT[_PPP][_EEE]``) holds at a layout: pure layout logic
over the rules table, shared by the legacy and NeMo readers and writers, the optimizer-state sources and the
speculative base model. Keys are those of our flat view of a rank file (``chunk_key``)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import ConvertError
from .boxes import Piece, local_pieces, mcore_global_shape
from .mlp import expert_key
from .rules import EMBEDDING, TIED_COPIES, holders, logical_tensors, spec_suffix
from .topology import Layout

if TYPE_CHECKING:  # the layout reads a model config's attributes; it never imports the config's module
    from ..config import ModelConfig


def chunk_key(key: str, vp: int, layout: Layout) -> str:
    """Key of a tensor of model chunk ``vp`` in our flat view of a rank file: with VPP the file
    holds ``model0`` ... ``model{V-1}``, written here as ``model{vp}/<key>``."""
    return f"model{vp}/{key}" if layout.vpp else key


def split_chunk_key(key: str) -> tuple[str, str]:
    """(entry of the rank file: ``model`` or ``model{v}``, state-dict key)."""
    entry, sep, rest = key.partition("/")
    return (entry, rest) if sep else ("model", key)


def rank_entries(cfg: ModelConfig, layout: Layout, tp_rank: int, pp_rank: int,
                 spec: str, ep_rank: int = 0) -> dict[str, tuple[tuple[int, ...], list[Piece]]]:
    """Pure: every tensor a legacy rank file holds (all its model chunks): key -> (local shape, pieces).
    MoE: the file of expert rank ``ep_rank`` holds its routed experts under local indices, and a copy
    of every other tensor (legacy files need expert-TP = TP: the routed experts split over ``tp_rank``)."""
    if cfg.num_experts and layout.expert_tp != layout.tp:
        raise ConvertError(f"legacy rank files (mp_rank_*) split routed experts over TP; {layout} has no file naming "
                           "in Megatron-LM's legacy format",
                           "pass --target-etp equal to --target-tp, or write --dst-format torch_dist")
    mine = layout.experts_of(ep_rank, cfg.num_experts) if cfg.num_experts else range(0)
    tensors = logical_tensors(cfg)
    chunks = [c for c in layout.stack_chunks(cfg.stacks) if c[0] == pp_rank]
    out: dict[str, tuple[tuple[int, ...], list[Piece]]] = {}

    def add(key: str, name: str, vp: int) -> None:
        t = tensors[name]
        gshape = mcore_global_shape(t.kind, t.shape, cfg.padded_vocab(layout.tp))
        out[chunk_key(key, vp, layout)] = local_pieces(name, t.kind, gshape, t.shape[0], tp_rank, layout.tp,
                                                        sections=t.sections)

    for _, vp, stack, offset, count in chunks:
        for name, t in tensors.items():
            if t.stack == stack and offset <= t.layer < offset + count:
                suffix = spec_suffix(t, spec)
                if t.expert is not None:
                    if t.expert not in mine:
                        continue
                    suffix = expert_key(suffix, t.expert - mine.start, cfg.grouped_experts)
                add(f"{t.layer_prefix}{t.layer - offset}.{suffix}", name, vp)
    vps = {vp for _, vp, *_ in chunks}
    for name, t in tensors.items():
        if t.layer is None:
            for key in (name,) + t.aliases:
                for vp in vps:
                    if (pp_rank, vp) in holders(t.stage, layout):
                        add(key, name, vp)
    mtp = [(vp, stack) for _, vp, stack, _, _ in chunks if stack == "mtp"]
    if mtp and (pp_rank, mtp[0][0]) not in holders(tensors[EMBEDDING].stage, layout):
        add(EMBEDDING, EMBEDDING, mtp[0][0])  # megatron-core builds the embedding on the MTP stage too
    last = (layout.pp - 1, layout.chunks_per_rank - 1)
    if (cfg.tied and pp_rank == last[0] and layout.pp > 1
            and last not in holders(tensors[EMBEDDING].stage, layout)):  # a copy of the tied embedding
        for key in TIED_COPIES[cfg.family]:
            add(key, EMBEDDING, last[1])
    return out
