"""Independent oracle for Megatron-FSDP (``--ckpt-format fsdp_dtensor``) checkpoints, run under the second
runtime (megatron-core 0.19.2). It uses only megatron-core (and tests/oracles/mcore.py's model builder),
never dist_convert:

  * ``make``: a GPTModel (oracles.mcore.build_model, values from oracles.mcore.randomize) wrapped in
    megatron-core's own Megatron-FSDP (``FullyShardedDataParallel``, ``optim_grads_params``: every
    parameter sharded over the data-parallel ranks), its state dict turned into the fsdp_dtensor layout by
    megatron-core's own handlers in the order Megatron-LM's ``preprocess_fsdp_dtensor_state_dict`` runs them
    (``handle_fp8_extra_state_case``, ``handle_swiglu_in_state_dict``, ``handle_experts_in_state_dict``,
    ``preprocess_state_dict_for_uneven_dtensor``) and saved the way Megatron-LM's ``save_checkpoint`` does:
    ``torch.distributed.checkpoint.save`` of {args, checkpoint_version, iteration, model, rng_state,
    opt_param_scheduler} into ``iter_NNNNNNN/``, then the tracker file.
  * ``compare``: loads a checkpoint the way Megatron-LM's ``_load_base_checkpoint`` does for fsdp_dtensor
    (the rank-0 probe ``dcp.load({'args', 'iteration', 'checkpoint_version'})``, then the same handlers on a
    fresh FSDP model's state dict and ``dcp.load_state_dict`` with ``DefaultLoadPlanner(allow_partial_load=
    False)``, i.e. ``--strict-fsdp-dtensor-load``), refuses keys the checkpoint has and the model does not,
    and compares every parameter shard of the FSDP model after the load (each rank its own, which cover
    every element) bit for bit with those of a reference loaded by megatron-core (torch_dist or legacy,
    strictly, then wrapped the same way; or another fsdp_dtensor checkpoint). Vocabulary padding rows are not compared.

  torchrun --nproc_per_node=N tests/oracles/fsdp.py make --config C.json --tp T [--ep E] --seed S \
      --iteration I --out DIR
  torchrun --nproc_per_node=N tests/oracles/fsdp.py compare --config C.json --tp T [--ep E] --ckpt DIR \
      --ref R [--ref-format auto|torch_dist|megatron|fsdp_dtensor] [--check-args]

N = T * DP for any DP >= 1 (DP > 1 is what shards parameters); MoE configs as oracles.mcore (E divides
the experts, E * ETP divides T * DP). PP is 1: Megatron-FSDP keys layers by module path only.
CPU shims (gloo, no CUDA): oracles.mcore's, plus CUDA streams/events as no-ops, the CUDA RNG state as the
CPU one, DeviceMesh on "cpu" (megatron-core hard-codes "cuda"), and ``torch.cuda.current_device() == 0``
while Megatron-FSDP is constructed (it compares its device with ``cuda:{current_device()}``); none of
them touches a layout.
"""
import argparse
import contextlib
import os
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the oracles package, helpers

from oracles import mcore as mo  # noqa: E402
from oracles.common import run_program  # noqa: E402

_SHIMMED = False


def apply_fsdp_shims():
    global _SHIMMED
    mo.apply_cpu_shims()
    import torch

    if _SHIMMED or torch.cuda.is_available():
        return
    from torch.distributed.device_mesh import DeviceMesh

    class _Stream:
        def __init__(self, *a, **k):
            pass

        def wait_stream(self, *a):
            pass

        def wait_event(self, *a):
            pass

        def synchronize(self):
            pass

        def record_event(self, *a):
            return _Event()

    class _Event(_Stream):
        def record(self, *a):
            pass

        def wait(self, *a):
            pass

        def query(self):
            return True

    torch.cuda.Stream, torch.cuda.Event = _Stream, _Event
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.current_stream = lambda *a, **k: _Stream()
    torch.cuda.empty_cache = lambda: None
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda *a, **k: None
    from_group = DeviceMesh.from_group

    def cpu_mesh(group, device_type, *a, **k):
        return from_group(group, "cpu", *a, **k)

    DeviceMesh.from_group = staticmethod(cpu_mesh)
    _SHIMMED = True


def init_parallel(tp, ep, etp, cfg):
    """tp * dp ranks (MoE: oracles.mcore's rules)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        dist.init_process_group(backend="gloo")
    if mo.is_moe(cfg):
        mo.init_parallel(tp, 1, None, ep, etp, cfg)
        return
    if ep != 1 or etp is not None:
        raise SystemExit("--ep/--etp need an MoE config")
    if dist.get_world_size() % tp:
        raise SystemExit(f"world size {dist.get_world_size()} is not a multiple of --tp {tp}")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))


def wrap(model):
    """megatron-core's Megatron-FSDP around ``model``, as Megatron-LM's get_model builds it."""
    import torch
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, use_megatron_fsdp=True,
                                               data_parallel_sharding_strategy="optim_grads_params")
    device = torch.cuda.current_device
    torch.cuda.current_device = lambda: 0
    try:
        return FullyShardedDataParallel(model.config, ddp_config, model, device=torch.device("cpu"))
    finally:
        torch.cuda.current_device = device


def preprocess(fsdp, state, cfg):
    """Megatron-LM's preprocess_fsdp_dtensor_state_dict (core_v0.19.0), with megatron-core's handlers."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
        preprocess_state_dict_for_uneven_dtensor,
    )
    from megatron.core.transformer.fsdp_dtensor_checkpoint import (
        handle_experts_in_state_dict,
        handle_fp8_extra_state_case,
        handle_swiglu_in_state_dict,
    )

    handle_fp8_extra_state_case(state["model"])
    if cfg["swiglu"]:
        state["model"], _ = handle_swiglu_in_state_dict(fsdp, state["model"], None)
    if mo.is_moe(cfg):
        state["model"] = handle_experts_in_state_dict(state["model"], cfg["num_experts"])
    preprocess_state_dict_for_uneven_dtensor(state)
    return state


def iter_dir(path):
    """A checkpoint root (tracker file) or an iteration directory."""
    tracker = os.path.join(path, "latest_checkpointed_iteration.txt")
    if os.path.isfile(tracker):
        with open(tracker) as f:
            it = f.read().strip()
        return os.path.join(path, "release" if it == "release" else mo.iter_dir_name(int(it)))
    return path


def rng_state(tp_rank):
    """What Megatron-LM's get_rng_state returns for fsdp_dtensor: {"(pp, tp)": [state]}."""
    import numpy as np
    import torch
    from megatron.core import tensor_parallel

    state = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
             "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.cuda.get_rng_state(),
             "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}
    return {f"(0, {tp_rank})": [state]}


def cmd_make(a, cfg):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from megatron.core import parallel_state

    model = mo.build_model(cfg, a.tp, 1, ep=a.ep, etp=a.etp)
    mo.randomize(model, cfg, a.seed)
    fsdp = wrap(model)
    args = mo.make_args(cfg, a.tp, 1, None, None, a.iteration, "fsdp_dtensor", None, a.ep, a.etp)
    args.use_megatron_fsdp = True
    args.data_parallel_sharding_strategy = "optim_grads_params"
    state = {"args": args, "checkpoint_version": 3.0, "iteration": a.iteration,
             "model": fsdp.state_dict_for_save_checkpoint(),
             "rng_state": rng_state(parallel_state.get_tensor_model_parallel_rank()),
             "opt_param_scheduler": {"max_lr": 1e-4, "min_lr": 1e-5, "num_steps": a.iteration * 8,
                                     "decay_style": "cosine"},
             "num_floating_point_operations_so_far": 0}
    d = os.path.join(a.out, mo.iter_dir_name(a.iteration))
    if dist.get_rank() == 0:
        os.makedirs(d, exist_ok=True)
    dist.barrier()
    dcp.save(preprocess(fsdp, state, cfg), storage_writer=dcp.FileSystemWriter(d))
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(a.out, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(a.iteration))
        print(f"ORACLE MADE fsdp_dtensor tp={a.tp} dp={dist.get_world_size() // a.tp} "
              f"padded_vocab={mo.padded_vocab(cfg, a.tp)}", flush=True)
    return 0


def load_fsdp(fsdp, path, cfg):
    """Megatron-LM's fsdp_dtensor load into ``fsdp``, strict; returns problems with the key sets."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader

    d = iter_dir(path)
    state = preprocess(fsdp, {"model": fsdp.state_dict_for_save_checkpoint()}, cfg)
    stored = {k for k in FileSystemReader(d).read_metadata().state_dict_metadata if k.startswith("model.")}
    every = [None] * dist.get_world_size()  # each expert-parallel rank asks for its own experts only
    dist.all_gather_object(every, sorted(f"model.{k}" for k in state["model"]))
    wanted = set().union(*every)
    probs = [f"KEYS only in the checkpoint: {sorted(stored - wanted)[:4]}"] if stored - wanted else []
    dcp.load_state_dict(state_dict=state, storage_reader=FileSystemReader(d),
                        planner=DefaultLoadPlanner(allow_partial_load=False))
    return probs


def local_shards(fsdp, cfg):
    """This rank's shard of every parameter of the FSDP model, by ``state_dict`` key, vocabulary padding
    rows cut off (collective: the shard's global row offset comes from megatron-core's
    ``gather_and_compute_chunk_metadata``; its ``uneven_dtensor_to_full_tensor`` all-gathers uneven
    buffers, which gloo refuses). Two models of one layout shard alike, so equal shards on every rank
    mean equal tensors."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import gather_and_compute_chunk_metadata
    from torch.distributed.tensor import DTensor

    out = {}
    for k, v in sorted(fsdp.state_dict_for_save_checkpoint().items()):
        if k.endswith("_extra_state"):
            continue
        local, row = (v.to_local(), gather_and_compute_chunk_metadata(v).offsets[0]) if isinstance(v, DTensor) \
            else (v, 0)
        if k.endswith(("word_embeddings.weight", "output_layer.weight")):
            local = local[: max(0, min(local.shape[0], cfg["vocab_size"] - row))]
        out[k] = local
    return out


def check_probe(a, cfg):
    """The rank-0 probe of Megatron-LM's load_checkpoint: args, iteration, checkpoint_version."""
    import torch.distributed.checkpoint as dcp

    probe = {"args": None, "iteration": None, "checkpoint_version": None}
    dcp.load(state_dict=probe, checkpoint_id=iter_dir(a.ckpt))
    flat = argparse.Namespace(**{**vars(a), "pp": 1, "vpp": None, "pipeline_layout": None})  # Megatron-FSDP: PP=1
    probs = [f"ARGS {p}" for p in mo.check_args(probe["args"], cfg, flat)]
    if probe["checkpoint_version"] != 3.0 or not isinstance(probe["iteration"], int):
        probs.append(f"PROBE checkpoint_version={probe['checkpoint_version']!r} iteration={probe['iteration']!r}")
    if getattr(probe["args"], "ckpt_format", None) != "fsdp_dtensor":
        probs.append(f"ARGS ckpt_format={getattr(probe['args'], 'ckpt_format', None)!r}")
    return probs


def cmd_compare(a, cfg):
    import torch
    import torch.distributed as dist

    bad = check_probe(a, cfg) if a.check_args else []
    ref_model = mo.build_model(cfg, a.tp, 1, ep=a.ep, etp=a.etp)
    mo.randomize(ref_model, cfg, 2_000_003)  # different contents before loading
    if a.ref_format != "fsdp_dtensor":
        mo.load_into(ref_model, a.ref, a.ref_format, 1, cfg, a.tp, a.ep, a.etp)
    ref = wrap(ref_model)
    if a.ref_format == "fsdp_dtensor":
        bad += [f"REF {p}" for p in load_fsdp(ref, a.ref, cfg)]
    ck_model = mo.build_model(cfg, a.tp, 1, ep=a.ep, etp=a.etp)
    mo.randomize(ck_model, cfg, 1_000_003)
    ck = wrap(ck_model)
    bad += load_fsdp(ck, a.ckpt, cfg)
    got, want = local_shards(ck, cfg), local_shards(ref, cfg)
    if set(got) != set(want):
        bad.append(f"KEYS differ: {sorted(set(got) ^ set(want))[:4]}")
    n = 0
    for k in sorted(set(got) & set(want)):
        x, y = got[k], want[k]
        n += 1
        if x.shape != y.shape:
            bad.append(f"{k}: shape {tuple(x.shape)} vs {tuple(y.shape)}")
        elif not torch.equal(x, y):
            bad.append(f"{k}: max abs diff {(x.double() - y.double()).abs().max().item():.6g}")
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, ([f"MISMATCH rank={dist.get_rank()} {b}" for b in bad], n))
    if dist.get_rank() == 0:
        lines = [ln for g in gathered for ln in g[0]]
        for ln in lines:
            print(ln)
        print(f"ORACLE FAIL {len(lines)} mismatches" if lines else
              f"ORACLE OK {sum(g[1] for g in gathered)} tensors (ckpt=fsdp_dtensor, ref={a.ref_format})", flush=True)
    return 1 if any(g[0] for g in gathered) else 0


def main(argv=None, serving=False):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("make", "compare"):
        sp = sub.add_parser(name)
        sp.add_argument("--config", required=True)
        sp.add_argument("--tp", type=int, required=True)
        sp.add_argument("--ep", type=int, default=1)
        sp.add_argument("--etp", type=int, default=None)
        if name == "make":
            sp.add_argument("--seed", type=int, required=True)
            sp.add_argument("--iteration", type=int, required=True)
            sp.add_argument("--out", required=True)
        else:
            sp.add_argument("--ckpt", required=True)
            sp.add_argument("--ref", required=True)
            sp.add_argument("--ref-format", choices=("auto", "torch_dist", "megatron", "fsdp_dtensor"),
                            default="auto")
            sp.add_argument("--check-args", action="store_true",
                            help="also require the probe's args to match the config at --tp")
    a = p.parse_args(argv)
    apply_fsdp_shims()
    import torch.distributed as dist

    cfg = mo.load_config(a.config)
    init_parallel(a.tp, a.ep, a.etp, cfg)
    try:
        rc = {"make": cmd_make, "compare": cmd_compare}[a.cmd](a, cfg)
        dist.barrier()
    finally:
        mo.end_parallel(serving)
    return rc


if __name__ == "__main__":
    run_program(main)
