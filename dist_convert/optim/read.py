"""Source chunks of the distributed optimizer's state in bucket space: torch_dist ``dp_reshardable``
(``optimizer.distributed.dp_group_idx_{I}.gbuf_idx_{G}.dtype_(...).bucket_idx_{B}.<state>``, one 1-D tensor
per bucket) and legacy ``distrib_optim.pt`` (each buffer's buckets concatenated). Each parameter's range
becomes one chunk of its local (TP-sharded) shape, whose pieces name the parameter's optimizer state;
``SourceChunk.flat`` says where in the stored 1-D tensor it starts.

Which (TP, PP, EP) rank an optimizer ``dp_group_idx`` belongs to is its rank in megatron-core's model-parallel
group: ``tp + TP * pp`` for the dense parameters' optimizer, ``etp + ETP * (ep + EP * pp)`` for the expert
parameters' (chained as ``chained_1.`` when experts have buffers of their own).
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..config import ModelConfig
from ..datamodel import SourceChunk, numel
from ..errors import ConvertError
from ..layout.boxes import Piece
from ..layout.rules import EMBEDDING
from ..layout.topology import Layout
from .buckets import BufferLayout, bucket_layout, check_boundaries, ddp_bucket_size, module_order
from .state import STATES, is_parameter, renamed

Entries = dict[str, tuple[tuple[int, ...], list[Piece]]]  # state-dict key -> (local shape, pieces)
_BUCKET_RE = re.compile(r"^(?:chained_(\d+)\.)?optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_(.+)"
                        r"\.bucket_idx_(\d+)\.(\w+)$")
FIX = "convert without --optimizer, or from a fully_reshardable save (--dist-ckpt-optim-fully-reshardable)"


@dataclass(frozen=True, kw_only=True)
class Buffer:
    """One DDP buffer of one optimizer rank: its parameters (state-dict key, local shape, pieces) in
    ``named_parameters()`` order and their layout."""

    chunk: int  # model chunk (virtual stage) on the rank
    params: tuple[tuple[str, tuple[int, ...], list[Piece]], ...]
    layout: BufferLayout


def _is_expert(pieces: list[Piece]) -> bool:
    return any(".mlp.experts." in p.logical for p in pieces)


def rank_buffers(cfg: ModelConfig, layout: Layout, entries: Entries, *, experts: bool | None, pp_rank: int, dp: int,
                 args: Any, order: Callable[[list[str]], list[str]] = module_order) -> list[Buffer]:
    """The DDP buffers of one rank's parameters (``entries``: its legacy state-dict tensors, keys with a
    ``model{v}/`` prefix under VPP): one per model chunk holding any, restricted to expert parameters
    (``experts`` True), to the others (False) or all (None: experts share the dense buffers)."""
    chunks: dict[int, list[str]] = {}
    for key, (_, pieces) in entries.items():
        if not pieces or not all(is_parameter(p.logical) for p in pieces):
            continue
        if experts is not None and _is_expert(pieces) != experts:
            continue
        vp = int(key[5:key.index("/")]) if key.startswith("model") and "/" in key else 0
        chunks.setdefault(vp, []).append(key)
    out = []
    shared_possible = layout.pp > 1 and (cfg.tied or bool(cfg.mtp_num_layers))
    for vp in sorted(chunks):
        keys = order(chunks[vp])
        params = tuple((k, entries[k][0], entries[k][1]) for k in keys)
        shared = [shared_possible and all(p.logical == EMBEDDING for p in pieces) for _, _, pieces in params]
        size = ddp_bucket_size(args, dp, pp_rank == 0 and vp == 0)
        lay = bucket_layout([numel(s) for _, s, _ in params], shared, size, dp,
                            bool(getattr(args, "ddp_pad_buckets_for_high_nccl_busbw", False)))
        out.append(Buffer(chunk=vp, params=params, layout=lay))
    return out


def flat_chunks(chunks: list[SourceChunk], buffer: Buffer, key_of: Callable[[int, str], str], file: str,
                dtype: torch.dtype, coalesced: bool) -> None:
    """Append one chunk per parameter and state of ``buffer``: bucket ``b``'s ``state`` is the stored 1-D
    tensor ``key_of(b, state)`` (with ``coalesced``: all buckets in one, ``key_of(0, state)``)."""
    for (_, shape, pieces), slot in zip(buffer.params, buffer.layout.slots, strict=True):
        start = buffer.layout.coalesced_start(slot) if coalesced else slot.start
        for state in STATES:
            key = key_of(0 if coalesced else slot.bucket, state)
            chunks.append(SourceChunk(id=len(chunks), file=file or key, key=key, shape=shape, dtype=dtype,
                                      pieces=renamed(pieces, state), flat=start))


def parse_bucket_key(key: str) -> tuple[int, int, int, str, int, str] | None:
    """(chained optimizer, dp_group_idx, gbuf_idx, dtype text, bucket_idx, state) of a dp_reshardable key."""
    m = _BUCKET_RE.match(key)
    if m is None:
        return None
    k, idx, g, dt, b, state = m.groups()
    return int(k or 0), int(idx), int(g), dt, int(b), state


def check_sizes(where: str, buffers: list[Buffer], unpadded: Any, padded: Any) -> None:
    """The derived bucket sizes equal what the checkpoint recorded (per buffer: {dtypes: [sizes]})."""
    def sizes(recorded: Any) -> list[list[int]]:
        return [list(next(iter(d.values()))) if isinstance(d, dict) and len(d) == 1 else None for d in recorded]

    want_u, want_p = sizes(unpadded), sizes(padded) if padded is not None else []
    got_u = [list(b.layout.unpadded) for b in buffers]
    got_p = [list(b.layout.padded) for b in buffers]
    if None in want_u or got_u != want_u or (want_p and got_p != want_p):
        raise ConvertError(f"{where}: the buffer layout derived from the model and args has bucket sizes {got_u} "
                           f"(padded {got_p}), the checkpoint records {want_u} (padded {want_p})",
                           f"the args do not describe this optimizer state's layout (DDP bucket options, mixed "
                           f"parameter dtypes); {FIX}")


def dp_group_idx(layout: Layout, tp: int, pp: int, ep: int = 0, expert: bool = False) -> int:
    """megatron-core's ``data_parallel_group_idx`` of a rank: its rank in the (expert) model-parallel group."""
    if expert:
        return tp + layout.expert_tp * (ep + layout.ep * pp)
    return tp + layout.tp * pp


def boundaries_checked(where: str, buffers: list[Buffer], stored: Callable[[int, int], list[tuple[int, int]]]) -> None:
    """Check every buffer's parameter ranges against the stored chunks of each bucket's saved tensor."""
    for g, buf in enumerate(buffers):
        for b in range(len(buf.layout.unpadded)):
            check_boundaries(f"{where} buffer {g} bucket {b}", buf.layout, b, stored(g, b))
