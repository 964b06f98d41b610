"""How megatron-core names and stacks a model in torch_dist (pure, no files): each stored key, the logical
tensor at each coordinate of its leading layer / expert axes, the ``_extra_state`` objects it saves, and
what the stored keys of a checkpoint show about its layer spec. ``torch_dist.py`` reads and writes with it."""
from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable
from dataclasses import dataclass

from ..config import ModelConfig
from ..layout.boxes import Box, Kind, Piece, chunk_pieces
from ..layout.hybrid import mtp_layer_prefix
from ..layout.rules import (
    LogicalTensor,
    extra_state_modules,
    logical_tensors,
    per_layer_keys,
    torch_dist_key,
)
from ..layout.vision import VISION_STACKS, key_prefix, stack_sizes


@dataclass(kw_only=True)
class DistGroup:
    """One torch_dist key: the sizes of its leading placement axes (the layer axis of stacked keys,
    the expert axis of routed experts; none for top-level and per-layer dense keys) and the logical
    tensor at each coordinate of them. Not frozen: ``dist_groups`` fills ``members`` in as it meets them."""

    lead: tuple[int, ...]
    members: dict[tuple[int, ...], LogicalTensor]
    row_offset: int = 0  # a section key (``<key>.<section>``): its members are rows from here of their tensors


def placement(t: LogicalTensor, cfg: ModelConfig, per_layer: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(leading axis sizes, coordinates of ``t`` on them) in its torch_dist key: megatron-core puts the
    global layer first (stacked keys) and a routed expert's global index after it."""
    lead: tuple[int, ...] = ()
    at: tuple[int, ...] = ()
    if t.layer is not None and (not per_layer or t.stack in VISION_STACKS) and t.stack != "mtp":
        lead, at = (stack_sizes(cfg)[t.stack],), (t.layer,)
    if t.expert is not None:
        lead, at = lead + (cfg.num_experts,), at + (t.expert,)
    return lead, at


def dist_groups(cfg: ModelConfig, tensors: Iterable[LogicalTensor] | None = None) -> dict[str, DistGroup]:
    """torch_dist key -> its group (aliases: a group of their own with the same tensor). ``tensors``: these
    instead of the model's (a LoRA adapter's, ``lora/bridge.py``)."""
    per_layer = per_layer_keys(cfg)
    groups: dict[str, DistGroup] = {}
    for t in logical_tensors(cfg).values() if tensors is None else tensors:
        lead, at = placement(t, cfg, per_layer)
        key = key_prefix(cfg, t.name) + torch_dist_key(t, (per_layer and t.stack not in VISION_STACKS)
                                                       or t.stack == "mtp")
        for suffix, offset, member in sections_of(t):
            groups.setdefault(key + suffix, DistGroup(lead=lead, members={}, row_offset=offset)).members[at] = member
        for alias in t.aliases:
            groups[alias] = DistGroup(lead=(), members={(): t})
    return groups


def sections_of(t: LogicalTensor) -> list[tuple[str, int, LogicalTensor]]:
    """(key suffix, first row, stored tensor) of each torch_dist key holding ``t``: one, ``t`` itself, unless
    megatron-core keys its sections one by one (Mamba2's in_proj ``.z .x .B .C .dt``, conv1d ``.x .B .C``; Gated
    DeltaNet's ``.query .key .value .z .beta .alpha``): then each a whole section, column-parallel on its own."""
    if not t.section_names:
        return [("", 0, t)]
    out, row = [], 0
    for name, n in zip(t.section_names, t.sections, strict=True):
        out.append((f".{name}", row, dataclasses.replace(t, kind=Kind.COL, shape=(n,) + t.shape[1:], sections=(),
                                                        section_names=())))
        row += n
    return out


def block_pieces(g: DistGroup, box: Box) -> list[Piece]:
    """Pieces of a stored block holding ``box`` of the key's global tensor (one per leading coordinate)."""
    n = len(g.lead)
    inner = Box(box.offsets[n:], box.sizes[n:])
    shift = (g.row_offset,) + (0,) * (len(inner.offsets) - 1)
    pieces = []
    for idx in itertools.product(*(range(k) for k in box.sizes[:n])):
        t = g.members[tuple(o + i for o, i in zip(box.offsets[:n], idx, strict=True))]
        for p in chunk_pieces(t.name, t.kind, inner, t.shape[0], (0,) * len(inner.sizes), lead=idx):
            pieces.append(Piece(p.logical, p.lbox.shifted(shift), p.sbox) if g.row_offset else p)
    return pieces


def layer_objects(cfg: ModelConfig, stack: str, layer: int, layers: int, per_layer: bool) -> dict[str, list]:
    """The ShardedObjects (``_extra_state``) megatron-core saves for one layer, except its experts'."""
    prefix, shard = (f"{stack}.layers.{layer}.", "shard_0_1") if per_layer or stack == "mtp" else \
        (f"{stack}.layers.", f"shard_{layer}_{layers}")
    return {f"{prefix}{m}._extra_state/{shard}": [None] for m in extra_state_modules(cfg, stack, cfg.spec, layer)}


def expert_objects(cfg: ModelConfig, stack: str, layer: int, layers: int, expert: int,
                   per_layer: bool) -> dict[str, list]:
    """The ShardedObjects of one routed expert (SequentialMLP's; GroupedMLP saves the same ones)."""
    e = cfg.num_experts
    prefix, shard = (f"{stack}.layers.", f"shard_{layer}.{expert}_{layers}.{e}") if \
        not per_layer and stack != "mtp" else (f"{stack}.layers.{layer}.", f"shard_{expert}_{e}")
    if stack == "mtp":
        prefix += mtp_layer_prefix(cfg, "mlp")
    return {f"{prefix}mlp.experts.experts.linear_fc{j}._extra_state/{shard}": [None] for j in (1, 2)}


POST_NORM_KEYS = (".linear_proj.post_layernorm.weight", ".linear_fc2.post_layernorm.weight")


TE_EVIDENCE = (".core_attention._extra_state", "layernorm._extra_state", "decoder.final_norm._extra_state")


def spec_from_keys(stored: Iterable[str]) -> str | None:
    """The layer-spec naming a torch_dist checkpoint's own keys show: Transformer Engine's attention, or
    (Megatron-Bridge's Gemma spec, whose attention saves none) TE 2's norms keep an ``_extra_state`` (a HybridModel's
    ``decoder.final_norm`` too), the local spec's do not (None: no ``_extra_state`` keys at all, so no evidence). The
    fused-norm names (``.layer_norm_weight``) are no evidence: megatron-core's local spec saves under them too."""
    extra = [k for k in stored if "._extra_state" in k]
    if not extra:
        return None
    return "te" if any(e in k for e in TE_EVIDENCE for k in extra) else "local"
