"""The megatron-core + ModelOpt side of ``speculate``: build, fill, convert, save, export."""
from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from ..config import ModelConfig
from ..convert import sliced
from ..datamodel import SourceIndex
from ..formats.base import Format
from ..layout.topology import Layout
from ..plan import Plan
from ..runtime import Runtime
from .base_model import (
    Placement,
    build_base_model,
    fill_base_weights,
    init_model_parallel,
    on_device,
    placement,
    rank_files,
    seed_rngs,
)
from .modelopt_compat import HAVE_TE, use_local_layers

CHECKPOINT_VERSION = 3.0


def build_and_convert(index: SourceIndex, fmt: Format, cfg: ModelConfig, args: argparse.Namespace, layout: Layout,
                      dtype: torch.dtype, algo: str, spec_cfg: dict[str, Any], rt: Runtime, budget: int,
                      logical_numel: dict[str, int], seed: int) -> tuple[Any, Placement, Plan, dict[str, int]]:
    """Collective: every rank's speculative model, base weights from the source, on the runtime's device
    (and its placement); ``seed``: what the new draft modules are initialised from (base_model.seed_rngs)."""
    import modelopt.torch.speculative as mtsp

    place = placement(rt.device, HAVE_TE)
    if place.spec == "local":
        use_local_layers()
    tp_rank, pp_rank = init_model_parallel(layout)
    seed_rngs(place, seed, pp_rank)
    coords = rt.all_gather_object((tp_rank, pp_rank))
    index = sliced(index, rank_files(cfg, layout, coords, dtype), budget)
    with on_device(place):
        t0 = time.perf_counter()
        model = build_base_model(cfg, args, layout, dtype, place)
        t1 = time.perf_counter()
        plan, counters = fill_base_weights(model, index, fmt, cfg, layout, dtype, rt, coords, budget, logical_numel)
        t2 = time.perf_counter()
        model.config.perform_initialization = True  # the new draft modules get ModelOpt's initialisation
        mtsp.convert(model, [(algo, spec_cfg)])
        t3 = time.perf_counter()
    rt.log(f"built the base model ({place.spec} layers, on {place.device.type}) in {t1 - t0:.2f} s, loaded its "
           f"weights in {t2 - t1:.2f} s, added {algo} with ModelOpt in {t3 - t2:.2f} s")
    return model, place, plan, counters


def sharded_metadata() -> dict[str, Any]:
    from megatron.core import parallel_state

    return {"singleton_local_shards": False, "chained_optim_avoid_prefix": True,
            "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}


def save_speculative(model: Any, place: Placement, iter_dir: Path, args: argparse.Namespace, iteration: int | str,
                     rt: Runtime, nemo2: bool = False) -> None:
    """Collective: megatron-core's torch_dist save of the whole speculative model and ModelOpt's sharded
    ``modelopt_state`` beside it: Megatron-LM's checkpoint (args in the common state), or with ``nemo2``
    a NeMo 2 ``weights/`` directory as NeMo's MegatronCheckpointIO saves it (keys prefixed ``module.``,
    Lightning's step in the common state; ModelOpt's state saved as NeMo's save_modelopt_state does)."""
    from megatron.core import dist_checkpointing
    from modelopt.torch.opt.plugins.mcore_dist_checkpointing import save_sharded_modelopt_state

    if rt.rank == 0:
        iter_dir.mkdir(parents=True)
    rt.barrier()
    content = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    step = 0 if iteration == "release" else iteration
    if nemo2:
        state = {"sharded_state_dict": model.sharded_state_dict(prefix="module.", metadata=sharded_metadata()),
                 "epoch": 0, "global_step": step, "state_dict": {}, "content_metadata": content}
    else:
        state = {"model": model.sharded_state_dict(metadata=sharded_metadata()), "args": args, "iteration": step,
                 "checkpoint_version": CHECKPOINT_VERSION, "content_metadata": content}
    with on_device(place):
        dist_checkpointing.save(state, str(iter_dir), content_metadata=content)
        save_sharded_modelopt_state([model], str(iter_dir))


