"""What each source format holds of the optimizer state (``--optimizer``): the chunks of its tensors and
the ``OptimizerState`` around them.

- torch_dist ``fully_reshardable`` (``optimizer.state.{param,exp_avg,exp_avg_sq}.<model key>``) and the
  non-distributed optimizer's (``optimizer.state.{fp32_param,exp_avg,exp_avg_sq}.<model key>``): the model's
  own sharding, read by the torch_dist reader itself (``model_space_keys``).
- torch_dist ``dp_reshardable`` and legacy ``distrib_optim.pt``: bucket space (``read.py``).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ..config import ModelConfig
from ..datamodel import OptimizerState, SourceChunk, SourceIndex, numel
from ..errors import ConvertError
from ..features.expressed import refuse_features
from ..layout.rank_files import rank_entries
from ..layout.topology import Layout
from .read import (
    FIX,
    Entries,
    boundaries_checked,
    check_sizes,
    dp_group_idx,
    flat_chunks,
    parse_bucket_key,
    rank_buffers,
)
from .state import COUNTERS, STATES, dist_optimizer_groups, is_parameter, opt_name

NO_STATE = "drop --optimizer to convert the model alone"
# The structural features whose optimizer state --optimizer converts: per parameter, as the model's tensors (judged
# dense and MoE by megatron-core's own optimizer load, a HybridModel of attention and MLP layers by its training
# resumed, tests/test_optimizer.py); T5's two stacks, Mamba2 and Gated DeltaNet layers and DeepSeek sparse
# attention's indexer not yet
HOLDS = ("moe", "mla", "mtp", "vision", "mamba")


def check_supported(cfg: ModelConfig, where: str, states: set[str]) -> None:
    """Refuse what --optimizer does not convert: a structural feature outside ``HOLDS``, and optimizers other than
    Adam (``states``: the per-parameter states the source stores)."""
    refuse_features(cfg, HOLDS, f"{where}: --optimizer", NO_STATE)
    if cfg.mamba is not None and "M" in cfg.mamba.full_pattern:
        raise ConvertError(f"{where}: --optimizer cannot hold the model's Mamba2 layers (M in its hybrid pattern "
                           f"{cfg.mamba.full_pattern})", NO_STATE)
    if states and not {"exp_avg", "exp_avg_sq"} <= states:
        raise ConvertError(f"{where}: the optimizer stores {sorted(states)} per parameter; --optimizer converts "
                           "Adam's (param, exp_avg, exp_avg_sq)", NO_STATE)


def sharding_kind(keys: list[str]) -> str | None:
    """How a torch_dist checkpoint stores optimizer state (None: it holds none)."""
    if any(parse_bucket_key(k) for k in keys):
        return "dp_reshardable"
    if any(k.startswith("optimizer.state.param.") for k in keys):
        return "fully_reshardable"
    if any(k.startswith(("optimizer.state.exp_avg.", "optimizer.state.fp32_param.")) for k in keys):
        return "non_distributed"
    return None


def _entries_list(entry: Any) -> list[Any]:
    """The per-optimizer entries of a (possibly chained) optimizer's saved state."""
    if isinstance(entry, dict) and entry and all(isinstance(k, int) for k in entry):
        return [entry[k] for k in sorted(entry)]
    return list(entry) if isinstance(entry, list | tuple) else [entry]


def _groups(saved: Any, where: str, step_of: Callable[[Any], Any] = lambda s: None) -> tuple[dict[str, Any], ...]:
    inner = saved.get("optimizer", saved) if isinstance(saved, dict) else None
    if not isinstance(inner, dict) or not isinstance(inner.get("param_groups"), list):
        raise ConvertError(f"{where}: the optimizer state has no param_groups", f"the checkpoint is incomplete; {FIX}")
    return dist_optimizer_groups(inner["param_groups"], step_of(inner))


def model_space_state(common: dict[str, Any], kind: str, where: str) -> OptimizerState:
    """The non-tensor state of a fully_reshardable or non-distributed torch_dist save (in its common state)."""
    def common_step(inner: dict[str, Any]) -> Any:  # the non-distributed optimizer's one step for all params
        step = (inner.get("state") or {}).get("common_step")
        return step.item() if isinstance(step, torch.Tensor) else step

    entries = _entries_list(common.get("optimizer"))
    groups = tuple(_groups(e, where, common_step if kind == "non_distributed" else lambda s: None) for e in entries)
    return OptimizerState(kind=kind, groups=groups, scheduler=common.get("opt_param_scheduler"),
                          counters=counters(common))


def counters(common: dict[str, Any]) -> dict[str, Any]:
    """The training counters of a common state (or legacy rank file) carried with the optimizer state."""
    return {k: common[k] for k in COUNTERS if k in common}


def dp_reshardable(cfg: ModelConfig, layout: Layout, args: Any, spec: str, stored: dict[str, Any],
                   read_object: Callable[[str], Any], rank_entries: Callable[..., Entries], first_id: int,
                   where: str) -> tuple[list[SourceChunk], list[tuple[str, list[str]]]]:
    """Chunks of a dp_reshardable save's buckets (``stored``: DCP tensor metadata by key) and, per chained
    optimizer, its ``optimizer`` object key (param_groups). Checks the derived layout against each rank's
    ``per_bucket_numel(_unpadded)`` and the saved chunks."""
    parsed = {k: p for k in stored if (p := parse_bucket_key(k))}
    check_supported(cfg, where, {p[5] for p in parsed.values()})
    optimizers = sorted({p[0] for p in parsed.values()})
    separate = len(optimizers) > 1
    if optimizers not in ([0], [0, 1]):
        raise ConvertError(f"{where}: optimizer state of chained optimizers {optimizers}", f"expected one, or two with "
                           f"MoE (dense, expert); {FIX}")
    if separate and layout.expert_tp != layout.tp:
        raise ConvertError(f"{where}: reading bucket-space expert optimizer state with expert-TP {layout.expert_tp} "
                           f"!= TP {layout.tp} is not supported yet", FIX)
    dense_dp = int(getattr(args, "data_parallel_size", 0) or 1) * int(getattr(args, "context_parallel_size", 1) or 1)
    expert_dp = max(1, dense_dp * layout.tp // (layout.expert_tp * layout.ep))
    chunks: list[SourceChunk] = []
    objects: list[tuple[str, list[str]]] = []
    for k in optimizers:
        prefix = f"chained_{k}." if separate else ""
        expert = separate and k == 1
        ranks = [(t, p, e) for p in range(layout.pp) for e in (range(layout.ep) if expert else [0])
                 for t in range(layout.tp)]
        group_keys = []
        for t, p, e in ranks:
            idx = dp_group_idx(layout, t, p, e, expert)
            base = f"{prefix}optimizer.distributed.dp_group_idx_{idx}"
            group_keys.append(f"{base}.optimizer/shard_0_1")
            entries = rank_entries(cfg, layout, t, p, spec, e)
            buffers = rank_buffers(cfg, layout, entries, experts=expert if separate else None, pp_rank=p,
                                   dp=expert_dp if expert else dense_dp, args=args)
            unpadded = read_object(f"{base}.per_bucket_numel_unpadded/shard_0_1")
            padded = read_object(f"{base}.per_bucket_numel/shard_0_1")
            if unpadded is None:
                raise ConvertError(f"{where}: {base}.per_bucket_numel_unpadded is missing",
                                   f"the optimizer state is incomplete; re-copy the checkpoint, or {NO_STATE}")
            here = f"{where}: {base} (TP rank {t}, PP rank {p}{f', EP rank {e}' if expert else ''})"
            check_sizes(here, buffers, unpadded[0], padded[0] if padded else None)
            dtypes = {g: dt for (kk, i, g, dt, _, _) in parsed.values() if kk == k and i == idx}
            if sorted(dtypes) != list(range(len(buffers))):
                raise ConvertError(f"{here}: saved buffers {sorted(dtypes)}, the model has {len(buffers)}",
                                   f"the args do not describe this optimizer state; {FIX}")

            def key_of(g: int, b: int, state: str, base: str = base, dtypes: dict = dtypes) -> str:
                return f"{base}.gbuf_idx_{g}.dtype_{dtypes[g]}.bucket_idx_{b}.{state}"

            def saved_chunks(g: int, b: int, key_of: Callable = key_of) -> list[tuple[int, int]]:
                meta = stored.get(key_of(g, b, "param"))
                if meta is None:
                    raise ConvertError(f"{where}: {key_of(g, b, 'param')} is missing",
                                       f"the optimizer state is incomplete; re-copy the checkpoint, or {NO_STATE}")
                return [(int(c.offsets[0]), int(c.sizes[0])) for c in meta.chunks]

            boundaries_checked(here, buffers, saved_chunks)
            for g, buf in enumerate(buffers):
                for b in range(len(buf.layout.unpadded)):
                    for state in ("param", "exp_avg", "exp_avg_sq"):
                        if key_of(g, b, state) not in stored:
                            raise ConvertError(f"{where}: {key_of(g, b, state)} is missing",
                                               f"the optimizer state is incomplete; re-copy it, or {NO_STATE}")
                dtype = stored[key_of(g, 0, "param")].properties.dtype
                flat_chunks(chunks, buf, lambda b, s, g=g, key_of=key_of: key_of(g, b, s), "", dtype, coalesced=False)
        objects.append((prefix, group_keys))
    chunks = [replace(c, id=c.id + first_id) for c in chunks]
    return chunks, objects


def legacy(cfg: ModelConfig, layout: Layout, args: Any, spec: str, iter_dir: Path,
           files: dict[tuple[int, int, int], Any], load: Callable[[Path], Any], rank_entries: Callable[..., Entries],
           first_id: int) -> tuple[list[SourceChunk], OptimizerState]:
    """Chunks of the legacy distributed optimizer's ``distrib_optim.pt`` files (``files``: the indexed rank
    files by (tp, pp, ep), each with its ``rel`` path, stored key ``order`` and saved ``optimizer``), each
    parameter placed in its buffer by the rank file's own parameter order."""
    chunks: list[SourceChunk] = []
    first = files[(0, 0, 0)]
    if first["optimizer"] is None:
        raise ConvertError(f"{iter_dir / first['rel']} holds no optimizer state", NO_STATE)
    check_supported(cfg, str(iter_dir), set())
    saved = _entries_list(first["optimizer"])
    if not (iter_dir / first["rel"]).parent.joinpath("distrib_optim.pt").is_file() and any(
            isinstance(e, dict) and "state" in e.get("optimizer", {}) for e in saved):
        raise ConvertError(f"{iter_dir / first['rel']} holds a non-distributed optimizer's state; converting it from "
                           "legacy rank files is not supported yet", f"{NO_STATE}, or save with "
                           "--use-distributed-optimizer")
    separate = len(saved) > 1
    dense_dp = int(getattr(args, "data_parallel_size", 0) or 1) * int(getattr(args, "context_parallel_size", 1) or 1)
    expert_dp = max(1, dense_dp * layout.tp // (layout.expert_tp * layout.ep))
    for (t, p, e), f in files.items():
        rel = str(Path(f["rel"]).parent / "distrib_optim.pt")
        path = iter_dir / rel
        if not path.is_file():
            raise ConvertError(f"{path} is missing (the distributed optimizer's state of {f['rel']})",
                               f"copy it with the checkpoint, or {NO_STATE}")
        stored = _entries_list(load(path))
        entries = rank_entries(cfg, layout, t, p, spec, e)
        rank_order = {k: i for i, k in enumerate(f["order"])}

        def order(keys: list[str], rank_order: dict[str, int] = rank_order) -> list[str]:
            return sorted(keys, key=rank_order.__getitem__)

        for k, state in enumerate(stored):
            expert = separate and k == 1
            if state is None:
                if e == 0 and not expert:
                    raise ConvertError(f"{path} holds no dense optimizer state",
                                       f"re-copy the checkpoint, or {NO_STATE}")
                continue  # the dense state lives in expert rank 0's file
            if e != 0 and not expert:
                continue
            buffers = rank_buffers(cfg, layout, entries, experts=expert if separate else None, pp_rank=p,
                                   dp=expert_dp if expert else dense_dp, args=args, order=order)
            gbufs = [g for g in state if isinstance(g, int)]
            if not state.get("buckets_coalesced") or gbufs != list(range(len(buffers))):
                raise ConvertError(f"{path}: optimizer {k} holds buffers {gbufs}"
                                   f"{'' if state.get('buckets_coalesced') else ' (not buckets_coalesced)'}, the "
                                   f"model has {len(buffers)}", f"the args do not describe this optimizer state; {FIX}")
            for g, buf in enumerate(buffers):
                (dtypes, tensors), = state[g].items()
                if tensors.get("numel_unpadded") != sum(buf.layout.unpadded):
                    raise ConvertError(f"{path}: buffer {g} holds {tensors.get('numel_unpadded')} elements, the model "
                                       f"and args lay out {sum(buf.layout.unpadded)}",
                                       f"the args do not describe this optimizer state's layout; {FIX}")
                flat_chunks(chunks, buf, lambda b, s, k=k, g=g, dtypes=dtypes: f"{k}/{g}/{s}", rel,
                            tensors["param"].dtype, coalesced=True)
    chunks = [replace(c, id=c.id + first_id) for c in chunks]
    groups = tuple(_groups(s, str(iter_dir / first["rel"])) for s in saved)
    return chunks, OptimizerState(kind="legacy", groups=groups, scheduler=first.get("scheduler"),
                                  counters=first.get("counters", {}))


def legacy_range(saved: Any, c: SourceChunk) -> torch.Tensor:
    """Chunk ``c`` (key ``optimizer/buffer/state``) of a loaded ``distrib_optim.pt``."""
    k, g, state = c.key.split("/")
    (tensors,) = _entries_list(saved)[int(k)][int(g)].values()
    n = numel(c.shape)
    return tensors[state].narrow(0, c.flat, n).view(c.shape).clone()


def torch_dist_state(fmt: Any, index: SourceIndex, md: Any, common: dict[str, Any],
                     groups: dict[str, Any]) -> OptimizerState:
    """Add a torch_dist source's optimizer state chunks to ``index`` (``fmt``: its TorchDistFormat; ``groups``:
    its model keys' DistGroups); return the non-tensor state."""
    from ..formats.distcp import read_object

    where = str(index.iter_dir)
    items = {k.removeprefix(fmt.prefix): v for k, v in md.state_dict_metadata.items()}
    kind = sharding_kind(list(items))
    if kind is None:
        raise ConvertError(f"{where} holds no optimizer state", NO_STATE)
    if kind != "dp_reshardable":
        check_supported(index.cfg, where, {k.split(".")[2] for k in items if k.startswith("optimizer.state.")})
    else:
        def read(key: str) -> Any:
            return read_object(index.iter_dir, md, fmt.prefix + key, fmt.trust_pickle)

        found, objects = dp_reshardable(index.cfg, index.layout, index.args, index.cfg.spec, items, read,
                                        rank_entries, len(index.chunks), where)
        index.chunks += [replace(c, file=fmt.prefix + c.key, key=fmt.prefix + c.key) for c in found]
        saved = [read(keys[0]) for _, keys in objects]
        if any(s is None for s in saved):
            raise ConvertError(f"{where}: the optimizer's param_groups object is missing",
                               f"the optimizer state is incomplete; {NO_STATE}")
        groups_of = tuple(_groups(s[0] if isinstance(s, list) else s, where) for s in saved)
        return OptimizerState(kind=kind, groups=groups_of, scheduler=common.get("opt_param_scheduler"),
                              counters=counters(common))
    param_state = "param" if kind == "fully_reshardable" else "fp32_param"
    for key, g in groups.items():
        if not all(is_parameter(t.name) for t in g.members.values()):
            continue
        for state in STATES:
            stored_key = opt_name(param_state if state == "param" else state, key)
            if stored_key in items:
                fmt.key_chunks(index.chunks, stored_key, key, g, items[stored_key], state)
            elif state == "param" and kind == "non_distributed" and key in items:
                fmt.key_chunks(index.chunks, key, key, g, items[key], state)  # fp32: the weights themselves
    return model_space_state(common, kind, where)
