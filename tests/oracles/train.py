"""Test oracle for checkpoints as a Megatron-LM training run leaves them: model, distributed-optimizer
state, RNG state, rerun state and the common state, written by megatron-core (never dist_convert).

  torchrun --nproc_per_node=N tests/oracles/train.py make --config C.json --tp T [--pp P] [--ep E] \
      --seed S --out ROOT [--save-kind dp_reshardable|fully_reshardable|torch ...] [--steps 2] \
      [--bucket-size B]

World size N = tp * pp * dp for any dp >= 1 (dense or MoE: this oracle adds the data-parallel
dimension oracles.mcore's dense `make` lacks). It builds the GPTModel of oracles.mcore (config loading,
build_model, randomize with --seed), wraps it in megatron-core's DistributedDataParallel with
``use_distributed_optimizer=True``, builds ``get_megatron_optimizer`` (Adam, fp32; torch's AdamW where
neither Transformer Engine nor Apex is installed) and an OptimizerParamScheduler, trains ``--steps``
steps on seeded random tokens (different per data-parallel rank) with megatron-core's
forward_backward_func over gloo, then saves at iteration ``--steps``, once per ``--save-kind``
(repeatable; default dp_reshardable), each a Megatron-LM save directory
(``latest_checkpointed_iteration.txt`` + ``iter_XXXXXXX/``):

  * ROOT/dp_reshardable, ROOT/fully_reshardable: ``--ckpt-format torch_dist`` with
    ``distrib_optim_sharding_type`` dp_reshardable (Megatron-LM's default) or fully_reshardable
    (``--dist-ckpt-optim-fully-reshardable``): model, optimizer, opt_param_scheduler, rng_state
    (ShardedObject; 3-D (pp, tp, dp) on megatron-core < 0.17 with EP > 1), rerun_state_machine (where
    megatron-core returns one: >= 0.18), args, iteration, checkpoint_version,
    num_floating_point_operations_so_far, content_metadata; saved with dist_checkpointing.save and
    Megatron-LM's default fully parallel save strategy (over the DP group).
  * ROOT/torch: ``--ckpt-format torch``: ``mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt`` (model,
    optimizer, opt_param_scheduler, rng_state list, args, iteration, checkpoint_version,
    num_floating_point_operations_so_far), written by DP rank 0 (or expert-DP rank 0), and
    ``distrib_optim.pt`` next to it (DistributedOptimizer.save_parameter_state).
  * ROOT/reference: the trained model's weights alone, as oracles.mcore's `make` writes a torch_dist
    checkpoint ({"model": sharded_state_dict}, args, iteration, checkpoint_version): the reference for
    `oracles/mcore.py compare` (the weights after training differ from `make`'s initial ones).

  torchrun --nproc_per_node=1 tests/oracles/train.py inspect --ckpt CKPT --out FILE.json

writes what a checkpoint (a save root or an iteration dir, torch_dist or legacy) holds, read with
megatron-core and torch.distributed.checkpoint: {"format", "files" (relative paths), "keys" (torch_dist:
the DCP items, tensors and objects; legacy: the top-level keys of the rank files), "common_keys" (the
common state / rank file without the model), "args" (ARG_FIELDS of the stored args)}.

`make --bucket-size B`: DDP with several buckets per gradient buffer. megatron-core splits a buffer
into buckets (of about B parameters; one bucket on PP stages after the first) only with
overlap_grad_reduce, so the DistributedDataParallelConfig gets overlap_grad_reduce=True and
bucket_size=B (the backward hooks then launch each bucket's reduce-scatter asynchronously on gloo and
finalize_model_grads waits for them; no shim is needed), and the saved args say so as Megatron-LM's
argparse names them: overlap_grad_reduce=True, ddp_bucket_size=B. The args always carry the other
DDP options that shape the buffers, as used here: ddp_num_buckets None,
ddp_pad_buckets_for_high_nccl_busbw, ddp_reduce_scatter_with_fp32_accumulation and
ddp_average_in_collective False, accumulate_allreduce_grads_in_fp32 False,
num_distributed_optimizer_instances 1, overlap_param_gather(_with_optimizer_step) False,
align_grad_reduce True. dp_reshardable then saves one optimizer.distributed....bucket_idx_K entry per
bucket. (megatron-core 0.16.1 and 0.19.2 save a fully_reshardable optimizer state that is wrong with
more than one bucket: get_parameter_state_dp_zero drops each bucket's end padding while
sharded_param_state_fully_reshardable slices with the padded param_index_map offsets, so the params
after the first bucket get shifted values; Megatron-LM PR #5077. `resume` shows it as a MISMATCH
against the dp_reshardable save of the same run.)

  torchrun --nproc_per_node=N tests/oracles/train.py resume --config C.json --tp T [--pp P] [--ep E] \
      --seed S --ckpt CKPT1 [--ckpt CKPT2 ...] [--steps 1] [--bucket-size B] [--train-iters I]

resumes training from each --ckpt (a torch_dist save root or iteration dir) in turn, at this layout
(world N = tp * pp * dp), and checks that they all hold the same training state. Per ckpt: a fresh
model + DDP + DistributedOptimizer + OptimizerParamScheduler (build_training; the scheduler for the
original run's --train-iters, by default the first ckpt's args.train_iters, as OptimizerParamScheduler
.load_state_dict insists on its decay steps), loaded as Megatron-LM's load_checkpoint loads torch_dist
(load_training: the checkpoint's content_metadata for the optimizer's sharded state dict, the (TP, PP)
refusal for dp_reshardable, strict load of every checkpoint key but the RNG and rerun state, which
are not requested; model.load_state_dict(strict=True), optimizer / scheduler load_state_dict); the
loaded iteration is the checkpoint's. Then each rank records, for every parameter its distributed
optimizer(s) own a shard of (named as model.named_parameters), the fp32 main-param shard and the Adam
exp_avg / exp_avg_sq shards (from the inner torch optimizer's state), plus the model's tensors, each
inner param group's step(s) and lr and the scheduler's num_steps (resume_record; anything the load
left unwritten still holds the NaN filled in before the load, and is a problem by itself). With
--pp 1 it then trains --steps steps (train(): iteration I + k trains on the tokens the original run
would have used there, for every ckpt the same) and records the losses (exact floats) and the
optimizer tensors after them. Every ckpt after the first is compared with the first on every rank
(same tensor names, torch.equal, equal steps / lr / num_steps / iteration / losses); the verdict is
all-reduced. Rank 0 prints per ckpt "RESUME ORACLE LOADED [i] CKPT iteration=... sharding=...
not_loaded=[...] (build, load, train seconds)", then "RESUME ORACLE OK ckpts=K layout=tpTppPepEdpD
params=M losses=[...]" (M: parameter shards owned, summed over ranks; losses: rank 0's, repr) and
exits 0, or "RESUME ORACLE MISMATCH: ..." naming the first differing tensors / fields per ckpt and
rank, and exits 1. A ckpt that fails to load ends the command with "RESUME ORACLE LOAD FAILED
ckpt=...: rank r: <error>" (tracebacks on stderr). One --ckpt alone shows that it loads strictly.
Shims for CPU-only torch's Adam (no TE / Apex), in load_training: a fresh torch Adam has no state
until its first step, which DistributedOptimizer.state_dict() needs (megatron-core's own
_init_optimizer_states_with_dummy_values gives it one); torch Adam's per-parameter "step" is taken from
the checkpoint's param groups only (torch_adam_step_shim) and made one tensor per parameter again;
the optimizer load runs under torch.no_grad (with fp32 params the main-param shards are views of
the model parameters). megatron-core cannot resume an MoE checkpoint saved at EP > 1 at EP 1 (or back):
expert parameters get an optimizer of their own only at EP > 1, and the chained optimizers' common
state does not map (the load fails, saying so).

`make`: rank 0 prints "TRAIN ORACLE SAVED kinds=... losses=..." at the end. The CPU device shims of
oracles.mcore apply, plus a few for the optimizer (see training_shims); they are undone at the end of
the command (`make` and `resume`), so a serving worker (tests/job_worker.py) runs other oracles
unchanged afterwards.
"""

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/

from oracles import mcore as mo
from oracles.common import run_program

KINDS = ("dp_reshardable", "fully_reshardable", "torch")
ARG_FIELDS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
              "world_size", "data_parallel_size", "no_save_optim", "no_save_rng", "ckpt_format", "iteration",
              "use_distributed_optimizer", "dist_ckpt_optim_fully_reshardable")
FLOPS_PER_STEP = 123_456_789.0  # a stand-in for Megatron-LM's num_floating_point_operations(args, batch)


def mcore_version():
    from megatron.core import package_info

    return tuple(int(x) for x in package_info.__version__.split("+")[0].split(".")[:2])


@contextlib.contextmanager
def training_shims():
    """Device shims (CPU-only torch) for DDP + DistributedOptimizer + the RNG state, touching no layout
    logic, undone on exit. Beyond oracles.mcore.apply_cpu_shims (synchronize, current_device, .cuda(),
    the RNG tracker's fork):
      * torch.Tensor.type() with no argument reports ``torch.cuda.<X>Tensor`` for CPU tensors: the
        optimizer groups parameters by those names (float16/bfloat16/float32 groups unchanged).
      * tensor factories given ``device="cuda"`` (loss-scale, found-inf and norm scalars) build on CPU.
      * torch.cuda.empty_cache: no-op; torch.cuda.current_stream: a stub (0.19);
        torch.cuda.get_rng_state / set_rng_state / manual_seed: the CPU generator's (what a Megatron-LM
        rng_state holds as ``cuda_rng_state``; the CUDA RNG tracker's states are then CPU states).
    """
    import torch

    if torch.cuda.is_available():
        yield
        return
    saved = []

    def patch(owner, name, value):
        saved.append((owner, name, name in vars(owner), getattr(owner, name, None)))
        setattr(owner, name, value)

    orig_type = torch.Tensor.type

    def tensor_type(self, dtype=None, non_blocking=False, **kw):
        if dtype is None and not kw:
            t = orig_type(self)
            return "torch.cuda." + t[len("torch."):] if not t.startswith("torch.cuda.") else t
        return orig_type(self, dtype, non_blocking, **kw)

    def on_cpu(fn):
        def wrapped(*a, **kw):
            dev = kw.get("device")
            if dev is not None and str(dev).startswith("cuda"):
                kw["device"] = "cpu"
            return fn(*a, **kw)

        return wrapped

    class Stream:
        def wait_stream(self, *a, **k):
            pass

        def synchronize(self):
            pass

    patch(torch.Tensor, "type", tensor_type)
    for name in ("tensor", "zeros", "ones", "empty", "full", "arange", "zeros_like", "empty_like"):
        patch(torch, name, on_cpu(getattr(torch, name)))
    patch(torch.cuda, "empty_cache", lambda *a, **k: None)
    patch(torch.cuda, "current_stream", lambda *a, **k: Stream())
    patch(torch.cuda, "get_rng_state", lambda *a, **k: torch.get_rng_state())
    patch(torch.cuda, "set_rng_state", lambda state, *a, **k: torch.set_rng_state(state))
    patch(torch.cuda, "manual_seed", lambda seed: None)
    from megatron.core.tensor_parallel import random as mp_random

    patch(mp_random, "_set_cuda_rng_state", lambda state, *a, **k: torch.set_rng_state(state))
    try:
        yield
    finally:
        for owner, name, own, value in reversed(saved):
            if own:
                setattr(owner, name, value)
            else:
                delattr(owner, name)


def init_parallel(tp, pp, ep, cfg):
    """tp * pp * dp ranks (dp = world / (tp * pp)); MoE: ep * etp must divide tp * dp."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        dist.init_process_group(backend="gloo")
    ws = dist.get_world_size()
    if ws % (tp * pp):
        raise SystemExit(f"world size {ws} is not a multiple of tp*pp = {tp}*{pp}")
    if ep > 1 and not mo.is_moe(cfg):
        raise SystemExit("--ep needs an MoE config (num_experts)")
    extra = {"expert_model_parallel_size": ep, "expert_tensor_parallel_size": tp} if mo.is_moe(cfg) else {}
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             **extra)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    return ws // (tp * pp)


def training_args(cfg, a, dp, ckpt_format, fully_reshardable):
    """oracles.mcore's args plus what Megatron-LM's argparse records about training and checkpointing."""
    import torch.distributed as dist

    args = mo.make_args(cfg, a.tp, a.pp, None, None, a.steps, ckpt_format, None, a.ep, None)
    vars(args).update(
        rank=0, world_size=dist.get_world_size(), data_parallel_size=dp, local_rank=0,
        context_parallel_size=1, sequence_parallel=False, micro_batch_size=a.micro_batch_size,
        global_batch_size=a.micro_batch_size * dp, train_iters=a.steps, consumed_train_samples=a.steps * dp,
        seed=a.seed, data_parallel_random_init=False, optimizer="adam", lr=a.lr, min_lr=0.0,
        lr_decay_style="constant", lr_warmup_iters=0, weight_decay=0.01, start_weight_decay=0.01,
        end_weight_decay=0.01, weight_decay_incr_style="constant", adam_beta1=0.9, adam_beta2=0.999,
        adam_eps=1e-8, clip_grad=1.0, loss_scale=None, initial_loss_scale=4294967296,
        use_distributed_optimizer=True, overlap_param_gather=False, accumulate_allreduce_grads_in_fp32=False,
        **ddp_args(a.bucket_size), use_dist_ckpt=ckpt_format != "torch",
        dist_ckpt_optim_fully_reshardable=fully_reshardable, distrib_optim_fully_reshardable_mem_efficient=False,
        ckpt_fully_parallel_save=True, ckpt_fully_parallel_load=False, ckpt_assume_constant_structure=False,
        async_save=False, save="", load=None, save_interval=a.steps, no_save_optim=None, no_save_rng=None,
        no_load_optim=None, no_load_rng=None, finetune=False, rerun_mode="validate_results",
        use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=False,
    )
    return args


def ddp_args(bucket_size):
    """What Megatron-LM's argparse records about the DDP options that shape the gradient buffers
    (megatron/training/arguments.py; get_model turns them into the DistributedDataParallelConfig of
    build_training): buckets only with --overlap-grad-reduce, of --ddp-bucket-size parameters."""
    return dict(overlap_grad_reduce=bucket_size is not None, ddp_bucket_size=bucket_size, ddp_num_buckets=None,
                ddp_pad_buckets_for_high_nccl_busbw=False, ddp_reduce_scatter_with_fp32_accumulation=False,
                ddp_average_in_collective=False, num_distributed_optimizer_instances=1,
                overlap_param_gather_with_optimizer_step=False, align_grad_reduce=True)


def build_training(cfg, a, train_iters):
    """The model in megatron-core DDP, its distributed optimizer and scheduler (as Megatron-LM's
    get_model + get_megatron_optimizer + get_optimizer_param_scheduler for a run of ``train_iters``
    iterations). ``a.bucket_size``: overlap_grad_reduce with buckets of about that many parameters
    (megatron-core splits a gradient buffer into buckets only with overlap_grad_reduce; it keeps one
    bucket on PP stages after the first)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    if getattr(a, "hybrid", False):  # megatron-core's HybridModel of the checkpoint's args (oracles/hybrid.py)
        from oracles import hybrid

        model = hybrid.from_checkpoint(cfg, a.tp, a.ep, Path(mo.resolve_iter_dir(a.ckpt[0])), parallel_output=True)
    else:
        model = mo.build_model(cfg, a.tp, a.pp, ep=a.ep)
    mo.randomize(model, cfg, a.seed)
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True, grad_reduce_in_fp32=False, overlap_grad_reduce=a.bucket_size is not None,
        overlap_param_gather=False, bucket_size=a.bucket_size, pad_buckets_for_high_nccl_busbw=False,
        average_in_collective=False, reduce_scatter_with_fp32_accumulation=False,
        num_distributed_optimizer_instances=1)
    # megatron-core 0.19 computes the distributed optimizer's parameter layout inside DDP when not given
    # one (what Megatron-LM's wrap_model_chunks_with_ddp passes is the same computation)
    ddp = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
    opt_config = OptimizerConfig(optimizer="adam", lr=a.lr, min_lr=0.0, weight_decay=0.01, adam_beta1=0.9,
                                 adam_beta2=0.999, adam_eps=1e-8, clip_grad=1.0, bf16=False, fp16=False,
                                 params_dtype=model.config.params_dtype, use_distributed_optimizer=True)
    optimizer = get_megatron_optimizer(opt_config, [ddp])
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=a.lr, min_lr=0.0, lr_warmup_steps=0, lr_decay_steps=train_iters * 10,
        lr_decay_style="constant", start_wd=0.01, end_wd=0.01, wd_incr_steps=train_iters * 10,
        wd_incr_style="constant", use_checkpoint_opt_param_scheduler=False)
    return model, ddp, optimizer, scheduler


def train(cfg, a, ddp, optimizer, scheduler, dp, first=0):
    """``--steps`` steps of Megatron-LM's train_step (megatron/training/training.py): while the rerun
    state machine asks for it, zero the grad buffers and run forward_backward_func (the no-pipelining
    schedule at PP=1; finalize_model_grads reduces over DP, waiting for the buckets' reduce-scatters
    with overlap_grad_reduce) on a RerunDataIterator; optimizer.step (which all-gathers the updated
    parameters); scheduler.step. Iteration ``first + k`` (0-based) trains on the tokens seeded by
    (seed, first + k, DP rank), so a run resumed at iteration I sees what the original run would
    have seen next. Returns this rank's loss per step (exact floats)."""
    import functools

    import torch
    from megatron.core import parallel_state
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.rerun_state_machine import RerunDataIterator, get_rerun_state_machine

    config = ddp.module.config
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp.no_sync
    dp_rank = parallel_state.get_data_parallel_rank()
    b, s = a.micro_batch_size, min(16, cfg["seq_length"])
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1).view(1, 1, s, s).expand(b, 1, s, s)
    position_ids = torch.arange(s).unsqueeze(0).expand(b, s)

    def loss_func(output_tensor):
        loss = output_tensor.float().mean()
        return loss, {"lm loss": loss.detach()}

    def forward_step(data_iterator, model):
        tokens, labels = next(data_iterator)
        return model(tokens, position_ids, mask, labels=labels), functools.partial(loss_func)

    def batches():
        for step in range(first, first + a.steps):  # seeded per (step, DP rank): the same on its TP ranks
            g = torch.Generator().manual_seed(a.seed * 1000 + step * 17 + dp_rank)
            data = torch.randint(0, cfg["vocab_size"], (b, s + 1), generator=g)
            yield data[:, :-1], data[:, 1:]

    rerun = get_rerun_state_machine()
    data_iterator = RerunDataIterator(batches())
    losses = []
    for step in range(a.steps):
        while rerun.should_run_forward_backward(data_iterator):
            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            out = get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=data_iterator, model=[ddp], num_microbatches=1,
                seq_length=s, micro_batch_size=b, forward_only=False)
        ok, grad_norm, _ = optimizer.step()
        if not ok:
            raise SystemExit(f"optimizer step {step} was skipped (grad norm {grad_norm})")
        scheduler.step(increment=a.micro_batch_size * dp)
        losses.append(float(out[0]["lm loss"]) if out else None)
    return losses


def check_trained(model, initial):
    """Every parameter moved away from its initial value, and all DP replicas hold the same trained
    parameters (the optimizer's all-gather ran)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    same = [n for n, p in model.named_parameters() if torch.equal(p.detach(), initial[n])]
    if same:
        raise SystemExit(f"parameters unchanged by training: {same}")
    group = parallel_state.get_data_parallel_group()
    if dist.get_world_size(group) == 1:
        return
    # expert parameters (allreduce False) are replicated over the expert-DP group only
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters() if getattr(p, "allreduce", True)])
    other = flat.clone()
    dist.broadcast(other, src=dist.get_global_rank(group, 0), group=group)
    if not torch.equal(flat, other):
        raise SystemExit("data-parallel replicas differ after training")


def rng_state_object(ep):
    """Megatron-LM's get_rng_state (megatron/training/checkpointing.py) for torch_dist: one ShardedObject
    'rng_state' holding [state] (data_parallel_random_init False), over (pp, tp); on megatron-core < 0.17
    with EP > 1 over (pp, tp, dp) with replica 0."""
    import random

    import numpy as np
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    state = [{
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": torch.cuda.get_rng_state(),
        "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }]
    pp, tp = ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size()
    pp_rank, tp_rank = ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()
    dp_rank = ps.get_data_parallel_rank(with_context_parallel=True)
    if ep > 1 and mcore_version() < (0, 17):
        dp = ps.get_data_parallel_world_size(with_context_parallel=True)
        return state, ShardedObject("rng_state", state, (pp, tp, dp), (pp_rank, tp_rank, dp_rank), replica_id=0)
    return state, ShardedObject("rng_state", state, (pp, tp), (pp_rank, tp_rank), replica_id=dp_rank)


def sharded_metadata(fully_reshardable):
    """Megatron-LM's _build_sharded_state_dict_metadata (checkpointing.py) with the distributed optimizer."""
    from megatron.core import parallel_state

    md = {"distrib_optim_sharding_type": "fully_reshardable" if fully_reshardable else "dp_reshardable"}
    if fully_reshardable:
        md["distrib_optim_fully_reshardable_mem_efficient"] = False
    md.update(singleton_local_shards=False, chained_optim_avoid_prefix=True,
              dp_cp_group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    return md


def write_tracker(root, iteration):
    import torch.distributed as dist

    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(iteration))


def save_torch_dist(root, kind, cfg, a, dp, model, optimizer, scheduler, flops):
    """Megatron-LM's save_checkpoint + generate_state_dict (megatron/training/checkpointing.py, core_v0.16.1
    and core_v0.19.0) for ckpt_format torch_dist."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
    from megatron.core.dist_checkpointing.utils import _clean_metadata_for_serialization
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    it = a.steps
    d = os.path.join(root, mo.iter_dir_name(it))
    if dist.get_rank() == 0:
        os.makedirs(d, exist_ok=True)
    dist.barrier()
    fully = kind == "fully_reshardable"
    _, rng = rng_state_object(a.ep)
    rerun = get_rerun_state_machine().state_dict(data_iterator=None, ckpt_format="torch_dist")
    md = sharded_metadata(fully)
    state = {"args": training_args(cfg, a, dp, "torch_dist", fully), "checkpoint_version": 3.0, "iteration": it,
             "model": model.sharded_state_dict(metadata=md)}
    state["optimizer"] = optimizer.sharded_state_dict(state, metadata=md)
    state["opt_param_scheduler"] = scheduler.state_dict()
    if rerun:
        state["rerun_state_machine"] = rerun
    state["rng_state"] = rng
    state["num_floating_point_operations_so_far"] = flops
    strategy = FullyParallelSaveStrategyWrapper(
        dist_checkpointing.serialization.get_default_save_sharded_strategy(),
        parallel_state.get_data_parallel_group(with_context_parallel=True), False)
    dist_checkpointing.save(state, d, strategy, content_metadata=_clean_metadata_for_serialization(md))
    write_tracker(root, it)


def save_legacy(root, cfg, a, dp, model, optimizer, scheduler, flops):
    """Megatron-LM's save_checkpoint + generate_state_dict for ckpt_format torch: DistributedOptimizer
    .save_parameter_state to distrib_optim.pt (all DP ranks take part, DP rank 0 writes), then
    model_optim_rng.pt from DP rank 0 or expert-DP rank 0."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    it = a.steps
    ep_rank = ps.get_expert_model_parallel_rank() if mo.is_moe(cfg) else 0
    f = mo.legacy_rank_file(os.path.join(root, mo.iter_dir_name(it)), ps.get_tensor_model_parallel_rank(),
                            ps.get_pipeline_model_parallel_rank(), a.pp, ep_rank, a.ep)
    os.makedirs(os.path.dirname(f), exist_ok=True)
    rng, _ = rng_state_object(a.ep)
    rerun = get_rerun_state_machine().state_dict(data_iterator=None, ckpt_format="torch")  # None: torch_dist only
    optimizer.save_parameter_state(os.path.join(os.path.dirname(f), "distrib_optim.pt"))
    dp_rank = ps.get_data_parallel_rank()
    edp_rank = ps.get_expert_data_parallel_rank() if mo.is_moe(cfg) else dp_rank
    if dp_rank == 0 or edp_rank == 0:
        state = {"args": training_args(cfg, a, dp, "torch", False), "checkpoint_version": 3.0, "iteration": it,
                 "model": model.state_dict_for_save_checkpoint(), "optimizer": optimizer.state_dict(),
                 "opt_param_scheduler": scheduler.state_dict()}
        if rerun:
            state["rerun_state_machine"] = rerun
        state["rng_state"] = rng
        state["num_floating_point_operations_so_far"] = flops
        torch.save(state, f)
    write_tracker(root, it)


def save_reference(root, cfg, a, model):
    """The trained weights alone, as oracles.mcore's make writes torch_dist (its compare loads them)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    d = os.path.join(root, mo.iter_dir_name(a.steps))
    if dist.get_rank() == 0:
        os.makedirs(d, exist_ok=True)
    dist.barrier()
    state = {"model": model.sharded_state_dict(), "iteration": a.steps, "checkpoint_version": 3.0,
             "args": mo.make_args(cfg, a.tp, a.pp, None, None, a.steps, "torch_dist", None, a.ep, None),
             "content_metadata": {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}}
    dist_checkpointing.save(state, d)
    write_tracker(root, a.steps)


def init_run(seed):
    """Megatron-LM's initialize: the rerun state machine in --rerun-mode (default validate_results) and
    _set_random_seed (python, numpy, torch, then the model-parallel RNG tracker)."""
    import random

    import numpy as np
    import torch
    from megatron.core import rerun_state_machine as rsm
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    rsm.destroy_rerun_state_machine()
    rsm.initialize_rerun_state_machine(mode=rsm.RerunMode.VALIDATE_RESULTS)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def cmd_make(a, cfg, dp):
    import torch.distributed as dist
    from megatron.core import rerun_state_machine as rsm

    t0 = time.monotonic()
    init_run(a.seed)
    model, ddp, optimizer, scheduler = build_training(cfg, a, a.steps)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    losses = [round(x, 5) for x in train(cfg, a, ddp, optimizer, scheduler, dp)]
    check_trained(model, initial)
    flops = FLOPS_PER_STEP * a.steps
    t1 = time.monotonic()
    for kind in a.save_kind:
        root = os.path.join(a.out, kind)
        if kind == "torch":
            save_legacy(root, cfg, a, dp, model, optimizer, scheduler, flops)
        else:
            save_torch_dist(root, kind, cfg, a, dp, model, optimizer, scheduler, flops)
    save_reference(os.path.join(a.out, "reference"), cfg, a, model)
    rsm.destroy_rerun_state_machine()
    if dist.get_rank() == 0:
        print(f"TRAIN ORACLE SAVED kinds={','.join(a.save_kind)} tp={a.tp} pp={a.pp} ep={a.ep} dp={dp} "
              f"mcore={'.'.join(map(str, mcore_version()))} losses={losses} "
              f"(build+train {t1 - t0:.1f} s, saves {time.monotonic() - t1:.1f} s)", flush=True)
    return 0


# checkpoint entries `resume` does not ask for (Megatron-LM loads them only at an unchanged layout;
# converted checkpoints hold none): every other key of the checkpoint must be loaded
NOT_RESUMED = ("rng_state", "rerun_state_machine_state")


def load_training(iterdir, a, model, ddp, optimizer, scheduler):
    """Megatron-LM's load_checkpoint (megatron/training/checkpointing.py, core_v0.16.1 / core_v0.19.0)
    for ckpt_format torch_dist, without the RNG and rerun state: the common state's args and
    content_metadata (load_content_metadata; Megatron-LM's fallback for checkpoints without one), the
    refusal of a (TP, PP) change for a sharding type that is not fully reshardable, the sharded state
    dict {model, optimizer.sharded_state_dict(..., is_loading=True), opt_param_scheduler} built with
    that metadata plus dp_cp_group, dist_checkpointing.load with the default load strategy, then the
    model's load_state_dict(strict=True), optimizer.load_state_dict, scheduler.load_state_dict.
    Strictness: StrictHandling.RETURN_ALL, and any key this rank asked for that the checkpoint lacks
    (unexpected) or any checkpoint key no rank asked for (missing) other than NOT_RESUMED fails the
    load (RAISE_ALL itself would refuse the RNG state left out on purpose). Before the load, every
    model tensor and every optimizer main-param / Adam state tensor is filled with NaN, so a value
    the load leaves unwritten shows (see resume_record). Returns (iteration, sharding type, the
    NOT_RESUMED checkpoint keys left out)."""
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
    from megatron.core.dist_checkpointing.validation import StrictHandling
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    common = dist_checkpointing.load_common_state_dict(iterdir)
    ck = common.get("args")
    if getattr(ck, "no_save_optim", False) or "optimizer" not in common:
        raise RuntimeError(f"{iterdir}: the checkpoint holds no optimizer state (args.no_save_optim "
                           f"{getattr(ck, 'no_save_optim', None)}, common keys {sorted(common)})")
    ckpt_tp_pp = (getattr(ck, "tensor_model_parallel_size", 1), getattr(ck, "pipeline_model_parallel_size", 1))
    md = dist_checkpointing.load_content_metadata(preloaded_state_dict=common)
    if md is None:
        md = {"distrib_optim_sharding_type": "fully_sharded_model_space"
              if getattr(ck, "ckpt_fully_parallel_save", False) else "dp_zero_gather_scatter"}
    sharding = md["distrib_optim_sharding_type"]
    if ckpt_tp_pp != (a.tp, a.pp) and sharding not in DistributedOptimizer.checkpoint_fully_reshardable_formats:
        raise RuntimeError(f"(TP, PP) mismatch after resume ({(a.tp, a.pp)} vs {ckpt_tp_pp} from checkpoint): not "
                           f"supported for DistributedOptimizer with sharding type {sharding}.")
    md = {**md, "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
    # torch's Adam (no TE / Apex here) creates its state at the first step, and DistributedOptimizer
    # .state_dict() (called by sharded_state_dict) then asserts on the missing "step": give a fresh
    # optimizer its state with megatron-core's own _init_optimizer_states_with_dummy_values (one step
    # on zero gradients, as its fsdp_dtensor load path does); the load overwrites all of it
    for opt in distributed_optimizers(optimizer):
        if not opt.optimizer.state:
            opt._init_optimizer_states_with_dummy_values()
        torch_adam_step_shim(opt)
    state = {"checkpoint_version": 3.0, "model": model.sharded_state_dict(metadata=md)}
    state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=True, metadata=md)
    state["opt_param_scheduler"] = scheduler.state_dict()
    with torch.no_grad():
        for t in list(model_tensors(model).values()) + [t for _, t in optimizer_tensors(model, optimizer)]:
            if t.is_floating_point():
                t.fill_(float("nan"))
    loaded, missing, unexpected = dist_checkpointing.load(
        state, iterdir, get_default_load_sharded_strategy(iterdir), strict=StrictHandling.RETURN_ALL)
    skipped = sorted(k for k in missing if k.startswith(NOT_RESUMED))
    missing = sorted(k for k in missing if not k.startswith(NOT_RESUMED))
    bad = [None] * dist.get_world_size()
    dist.all_gather_object(bad, sorted(unexpected))
    if missing or any(bad):
        raise RuntimeError(f"strict load: checkpoint keys not loaded {missing[:8]} ({len(missing)}); keys asked "
                           f"for but absent: " + "; ".join(f"rank {r}: {u[:8]}" for r, u in enumerate(bad) if u))
    if getattr(a, "hybrid", False):  # as in oracles.te_cpu.load_strict: an _extra_state the stand-ins' sharded state
        # dict does not save (TEDotProductAttention's) may be absent, as TE's modules allow; every other key strictly
        res = ddp.module.load_state_dict(loaded["model"], strict=False)
        bad = [k for k in res.missing_keys if not k.endswith("._extra_state")] + list(res.unexpected_keys)
        if bad:
            raise RuntimeError(f"load_state_dict: missing or unexpected {bad[:8]}")
    else:
        ddp.load_state_dict(loaded["model"], strict=True)
    # no_grad: with fp32 parameters the main-param shards are views of the (leaf, requires_grad)
    # model parameters, and load_parameter_state_from_dp_reshardable (unlike the fully_reshardable
    # one) copies into them without torch.no_grad: an autograd error otherwise
    try:
        with torch.no_grad():
            optimizer.load_state_dict(loaded["optimizer"])
    except KeyError as e:  # name what megatron-core's bare KeyError means here (Megatron-LM fails alike)
        saved, built = common["optimizer"], len(distributed_optimizers(optimizer))
        if isinstance(saved, dict) and all(isinstance(k, int) for k in saved) and len(saved) != built:
            raise RuntimeError(
                f"optimizer.load_state_dict: KeyError {e}: the checkpoint's common optimizer state is that "
                f"of {len(saved)} chained optimizers ({sorted(saved)}), this layout builds {built} "
                "(megatron-core puts expert parameters in an optimizer of their own only at EP > 1); "
                "ChainedOptimizer/DistributedOptimizer.load_state_dict cannot map one onto the other") from e
        raise
    for opt in distributed_optimizers(optimizer):
        for st in opt.optimizer.state.values():  # one "step" tensor per param again (torch_adam_step_shim)
            if isinstance(st.get("step"), torch.Tensor):
                st["step"] = st["step"].clone()
    scheduler.load_state_dict(loaded["opt_param_scheduler"])
    return loaded["iteration"], sharding, skipped


def torch_adam_step_shim(opt):
    """torch's Adam keeps a per-parameter "step" tensor in its state (TE's / Apex's FusedAdam, which
    Megatron-LM runs with, keep it in the param groups). DistributedOptimizer.load_state_dict sets
    every state's "step" from the checkpoint's param groups (megatron-core: the step "is handled
    separately via param_groups"), then its parameter-state loader calls
    _set_main_param_and_optimizer_states, which copies every key of the state from the loaded
    tensors: the fully_reshardable loader passes no "step" (KeyError 'step'), the dp_reshardable one
    the step tensor the state held when the sharded state dict was built (the dummy step's 1, which
    would overwrite the loaded step). On this instance (torch Adam only) "step" is always the state's
    own, as loaded from the param groups (a no-op copy); load_training then gives every state its own
    step tensor again (load_state_dict sets one tensor object for all; torch's Adam increments each
    in place)."""
    import torch

    if not isinstance(opt.optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return
    orig = opt._set_main_param_and_optimizer_states

    def set_states(model_param, tensors):
        group_index, group_order = opt.model_param_group_index_map[model_param]
        state = opt.optimizer.state[opt.optimizer.param_groups[group_index]["params"][group_order]]
        if "step" in state:
            tensors = {**tensors, "step": state["step"]}
        return orig(model_param, tensors)

    opt._set_main_param_and_optimizer_states = set_states


def model_tensors(model):
    """The model's parameters and persistent buffers (state_dict names; no _extra_state)."""
    import torch

    return {k: v for k, v in model.state_dict(keep_vars=True).items()
            if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}


def distributed_optimizers(optimizer):
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def optimizer_tensors(model, optimizer):
    """[(name:kind, tensor)] for every parameter this rank's distributed optimizer(s) own a shard of:
    the fp32 main-param shard ("param") and the Adam exp_avg / exp_avg_sq shards, from the inner
    torch optimizer's state (DistributedOptimizer._get_main_param_and_optimizer_states)."""
    names = {p: n for n, p in model.named_parameters()}
    out = []
    for opt in distributed_optimizers(optimizer):
        for p in opt.model_param_group_index_map:
            st = opt._get_main_param_and_optimizer_states(p)
            out += [(f"{names[p]}:{k}", st[k]) for k in ("param", "exp_avg", "exp_avg_sq")]
    return out


def resume_record(model, optimizer, scheduler):
    """This rank's loaded training state: optimizer tensors (optimizer_tensors) and the model's tensors
    ("model:" + name), cloned; per inner param group (chain index, group index) its params' Adam
    steps and lr; the scheduler's num_steps; and the tensors still holding the NaN load_training
    filled in (values the load did not write)."""
    import torch

    tensors = {k: t.detach().clone() for k, t in optimizer_tensors(model, optimizer)}
    owned = len(tensors) // 3
    tensors.update({f"model:{k}": t.detach().clone() for k, t in model_tensors(model).items()})
    groups = {}
    for c, opt in enumerate(distributed_optimizers(optimizer)):
        inner = opt.optimizer
        for g, group in enumerate(inner.param_groups):
            steps = sorted({float(inner.state[q]["step"]) for q in group["params"] if "step" in inner.state.get(q, {})})
            groups[f"{c}.{g}"] = {"steps": steps, "lr": group["lr"]}
    unloaded = [k for k, t in tensors.items() if t.is_floating_point() and torch.isnan(t).any()]
    return {"tensors": tensors, "owned": owned, "groups": groups, "num_steps": scheduler.num_steps,
            "unloaded": unloaded}


def record_differences(ref, got):
    """What differs between two records of one rank (names of tensors first)."""
    import torch

    out = []
    rt, gt = ref["tensors"], got["tensors"]
    if rt.keys() != gt.keys():
        out.append(f"tensor names differ: only in the first {sorted(rt.keys() - gt.keys())[:6]}, "
                   f"only here {sorted(gt.keys() - rt.keys())[:6]}")
    diff = [k for k in rt if k in gt and not (rt[k].dtype == gt[k].dtype and rt[k].shape == gt[k].shape
                                               and torch.equal(rt[k], gt[k]))]
    if diff:
        out.append(f"{len(diff)} tensors differ: {', '.join(diff[:8])}{' ...' if len(diff) > 8 else ''}")
    for field in ("iteration", "groups", "num_steps", "losses"):
        if ref[field] != got[field]:
            out.append(f"{field} {got[field]!r} != {ref[field]!r}")
    return out


def error_text(e):
    """One line for an exception; for torch.distributed.checkpoint's CheckpointException (whose str is a
    multi-line traceback per rank) the exceptions it wraps."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        return "; ".join(f"{type(x).__name__}: {x}" for x, _ in failures.values())
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def cmd_resume(a, cfg, dp):
    """Load each --ckpt into a fresh training setup at this layout, record, train, compare (module doc)."""
    import torch
    import torch.distributed as dist
    from megatron.core import rerun_state_machine as rsm
    from torch.distributed.checkpoint.api import CheckpointException

    rank, ws = dist.get_rank(), dist.get_world_size()
    first = None
    problems = []  # (ckpt index, [this rank's differences])
    train_iters = a.train_iters
    for i, path in enumerate(a.ckpt):
        t0 = time.monotonic()
        iterdir = mo.resolve_iter_dir(path)
        if mo.detect_format(iterdir) != "torch_dist":
            raise SystemExit(f"RESUME ORACLE: {path} is not a torch_dist checkpoint")
        if train_iters is None:  # the original run's --train-iters (the scheduler checks its decay steps)
            from megatron.core import dist_checkpointing

            train_iters = getattr(dist_checkpointing.load_common_state_dict(iterdir).get("args"), "train_iters", None)
            if train_iters is None:
                raise SystemExit(f"RESUME ORACLE: {path}: no args.train_iters; give --train-iters")
        init_run(a.seed)
        model, ddp, optimizer, scheduler = build_training(cfg, a, train_iters)
        t1 = time.monotonic()
        error = None
        try:
            iteration, sharding, skipped = load_training(iterdir, a, model, ddp, optimizer, scheduler)
        except (Exception, SystemExit, CheckpointException) as e:  # noqa: BLE001 - every rank's message below
            import traceback  # (torch.distributed.checkpoint's CheckpointException is a BaseException)

            traceback.print_exc()
            error = error_text(e)
        errors = [None] * ws
        dist.all_gather_object(errors, error)
        if any(errors):
            msg = "; ".join(f"rank {r}: {m}" for r, m in enumerate(errors) if m)
            if rank == 0:
                print(f"RESUME ORACLE LOAD FAILED ckpt={path}: {msg}", flush=True)
            rsm.destroy_rerun_state_machine()
            raise SystemExit(f"RESUME ORACLE LOAD FAILED ckpt={path}: {msg}")
        t2 = time.monotonic()
        rec = resume_record(model, optimizer, scheduler)
        rec["iteration"] = iteration
        rec["losses"] = train(cfg, a, ddp, optimizer, scheduler, dp, first=iteration) if a.pp == 1 else []
        if a.pp == 1:  # the state after the resumed steps as well
            rec["tensors"].update({f"after:{k}": t.detach().clone() for k, t in optimizer_tensors(model, optimizer)})
        t3 = time.monotonic()
        rsm.destroy_rerun_state_machine()
        del model, ddp, optimizer, scheduler
        mine = [f"{len(rec['unloaded'])} tensors not written by the load: {', '.join(rec['unloaded'][:8])}"] \
            if rec["unloaded"] else []
        if first is None:
            first = rec
        else:
            mine += record_differences(first, rec)
        problems.append((i, mine))
        if rank == 0:
            print(f"RESUME ORACLE LOADED [{i}] {path} iteration={iteration} sharding={sharding} "
                  f"not_loaded={skipped} (build {t1 - t0:.1f} s, load {t2 - t1:.1f} s, train {t3 - t2:.1f} s)",
                  flush=True)
    count = torch.tensor([sum(len(m) for _, m in problems)], dtype=torch.int64)
    dist.all_reduce(count)
    owned = torch.tensor([first["owned"]], dtype=torch.int64)
    dist.all_reduce(owned)
    every = [None] * ws
    dist.all_gather_object(every, problems)
    if rank == 0:
        layout = f"tp{a.tp}pp{a.pp}ep{a.ep}dp{dp}"
        if count.item():
            lines = [f"ckpt[{i}]={a.ckpt[i]} rank {r}: {p}" for i in range(len(a.ckpt)) for r in range(ws)
                     for p in dict(every[r])[i]]
            print(f"RESUME ORACLE MISMATCH: layout={layout} {len(lines)} problems (later ckpts compared with "
                  f"ckpt[0]): " + " | ".join(lines), flush=True)
        else:
            print(f"RESUME ORACLE OK ckpts={len(a.ckpt)} layout={layout} params={owned.item()} "
                  f"losses={first['losses']!r}", flush=True)
    return 1 if count.item() else 0


def cmd_inspect(a):
    import json

    import torch
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint import FileSystemReader

    iterdir = mo.resolve_iter_dir(a.ckpt)
    fmt = mo.detect_format(iterdir)
    files = sorted(os.path.relpath(os.path.join(r, f), iterdir) for r, _, fs in os.walk(iterdir) for f in fs)
    if fmt == "torch_dist":
        keys = sorted(FileSystemReader(iterdir).read_metadata().state_dict_metadata)
        common = dist_checkpointing.load_common_state_dict(iterdir)
    else:
        keys, common = set(), {}
        for f in files:
            if f.endswith("model_optim_rng.pt"):
                sd = torch.load(os.path.join(iterdir, f), map_location="cpu", weights_only=False)
                keys |= set(sd)
                common = {k: v for k, v in sd.items() if not k.startswith("model")}
        keys = sorted(keys)
    args = common.get("args")
    out = {"format": fmt, "files": files, "keys": keys, "common_keys": sorted(common),
           "args": {k: getattr(args, k, "<absent>") for k in ARG_FIELDS} if args is not None else None}
    with open(a.out, "w") as f:
        json.dump(out, f, default=repr)
    return 0


def main(argv=None, serving=False):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("make")
    sp.add_argument("--config", required=True)
    sp.add_argument("--tp", type=int, required=True)
    sp.add_argument("--pp", type=int, default=1)
    sp.add_argument("--ep", type=int, default=1, help="expert_model_parallel_size (MoE configs)")
    sp.add_argument("--seed", type=int, required=True)
    sp.add_argument("--steps", type=int, default=2, help="training steps; the checkpoint's iteration")
    sp.add_argument("--micro-batch-size", type=int, default=2)
    sp.add_argument("--lr", type=float, default=1e-2)
    sp.add_argument("--out", required=True, help="ROOT: ROOT/<save kind>/ and ROOT/reference/")
    sp.add_argument("--save-kind", action="append", choices=KINDS, default=None,
                    help="repeatable; default dp_reshardable")
    sp.add_argument("--bucket-size", type=int, default=None,
                    help="DDP buckets of about N parameters (overlap_grad_reduce); default: one bucket per buffer")
    sp = sub.add_parser("resume")
    sp.add_argument("--config", required=True)
    sp.add_argument("--tp", type=int, required=True)
    sp.add_argument("--pp", type=int, default=1, help="> 1: load and compare only (no training step)")
    sp.add_argument("--ep", type=int, default=1, help="expert_model_parallel_size (MoE configs)")
    sp.add_argument("--seed", type=int, required=True, help="the training run's --seed (its data)")
    sp.add_argument("--ckpt", action="append", required=True,
                    help="repeatable: torch_dist save roots or iteration dirs; each is compared with the first")
    sp.add_argument("--steps", type=int, default=1, help="training steps after each load (PP 1)")
    sp.add_argument("--train-iters", type=int, default=None,
                    help="the original run's --train-iters (its scheduler); default: the first ckpt's args")
    sp.add_argument("--micro-batch-size", type=int, default=2)
    sp.add_argument("--lr", type=float, default=1e-2)
    sp.add_argument("--bucket-size", type=int, default=None,
                    help="DDP buckets of about N parameters (overlap_grad_reduce), as the run that saved")
    sp.add_argument("--hybrid", action="store_true",
                    help="megatron-core's HybridModel (>= 0.19) of the first --ckpt's args instead of GPTModel "
                         "(tests/oracles/hybrid.py; PP 1)")
    sp = sub.add_parser("inspect")
    sp.add_argument("--ckpt", required=True)
    sp.add_argument("--out", required=True)
    a = p.parse_args(argv)
    if a.cmd == "inspect":
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
        return cmd_inspect(a) if rank == 0 else 0
    if a.cmd == "make":
        a.save_kind = a.save_kind or ["dp_reshardable"]
        if a.pp != 1:
            raise SystemExit("--pp > 1: the pipelined schedules need CUDA streams; only --pp 1 is supported here")

    mo.apply_cpu_shims()
    import torch.distributed as dist

    cfg = mo.load_config(a.config)
    with training_shims():
        dp = init_parallel(a.tp, a.pp, a.ep, cfg)
        try:
            rc = (cmd_make if a.cmd == "make" else cmd_resume)(a, cfg, dp)
            dist.barrier()
        finally:
            mo.end_parallel(serving)
    return rc


if __name__ == "__main__":
    run_program(main)
