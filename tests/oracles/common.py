"""What the oracles share: megatron-core's CPU shims, process groups and their end, checkpoint directories,
and comparing what two checkpoints or models hold (one verdict line for each oracle)."""
from __future__ import annotations

import contextlib
import os
import socket
import sys
from pathlib import Path


def run_program(main) -> None:
    """An oracle run as a program (``torchrun tests/oracles/NAME.py ...``): one OpenMP thread per rank, library
    warnings off, ``main()``'s return code as the exit status."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import warnings

    warnings.filterwarnings("ignore")
    sys.exit(main())


def emit_layout(out: dict, path: str | None) -> None:
    """A layout report (rank 0): written to ``path`` with a one-line pointer to it on stdout, else printed whole."""
    import json

    text = json.dumps(out, indent=1, default=repr)
    if path:
        Path(path).write_text(text)
        print(json.dumps({"layout": path}))
    else:
        print(text)

def apply_cpu_shims():
    """Minimal patches so megatron-core 0.16.1 saves/loads/forwards on CPU-only torch.

    Applied only when CUDA is unavailable (the te_general_gemm one whenever TE is absent).
      * torch.cuda.synchronize: called unconditionally by the torch_dist save
        (filesystem_async.preload_tensors). -> no-op.
      * torch.cuda.current_device: device of a failure-flag tensor in the torch_dist save
        (state_dict_saver.save_state_dict_async_finalize) and of the RoPE frequencies in forward
        (RotaryEmbedding.get_emb). -> returns "cpu", a valid device argument.
      * torch.Tensor.cuda: with PP > 1 and tied embeddings, GPTModel.__init__ moves the last
        stage's output weight to CUDA before all-reducing it with the first stage. -> identity.
      * CudaRNGStatesTracker.fork: attention dropout always runs inside
        get_cuda_rng_tracker().fork(), which needs a CUDA RNG state. Dropout is 0 and the model is
        in eval mode here, so forking is a no-op context.
      * moe_utils.te_general_gemm: unbound without Transformer Engine, but the MoE router forward
        tests it against None. -> None (only if the name is missing).
      * fused_softmax.get_sliding_window_causal_mask (transformer/utils.py) builds the sliding-window
        mask with device="cuda". -> megatron-core's own function, its source compiled with device="cpu".
    """
    import torch

    # MoE router forward (moe_utils.RouterGatingLinearFunction) tests `te_general_gemm is not None`,
    # but the name is only bound when Transformer Engine imports (moe_utils.py:~34, ~1192): NameError
    # without TE. Harmless for dense models.
    try:
        from megatron.core.transformer.moe import moe_utils
    except ImportError:
        moe_utils = None
    if moe_utils is not None and not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None

    if torch.cuda.is_available():
        return
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    torch.Tensor.cuda = lambda self, *a, **k: self

    from megatron.core.tensor_parallel import random as mp_random

    @contextlib.contextmanager
    def _fork(self, name=None):
        yield

    mp_random.CudaRNGStatesTracker.fork = _fork

    import inspect

    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils as mcore_utils

    src = inspect.getsource(mcore_utils.get_sliding_window_causal_mask)
    if 'device="cuda"' in src:
        scope = {"torch": torch}
        exec(src.replace('device="cuda"', 'device="cpu"'), scope)
        fused_softmax.get_sliding_window_causal_mask = scope["get_sliding_window_causal_mask"]


def iter_dir_name(iteration):
    return f"iter_{int(iteration):07d}"


def resolve_iter_dir(path):
    """Accept a checkpoint root (with latest_checkpointed_iteration.txt) or an iteration dir."""
    tracker = os.path.join(path, "latest_checkpointed_iteration.txt")
    if os.path.isfile(tracker):
        with open(tracker) as f:
            it = f.read().strip()
        sub = "release" if it == "release" else iter_dir_name(int(it))
        d = os.path.join(path, sub)
        if not os.path.isdir(d):
            raise SystemExit(f"{tracker} says {it!r} but {d} does not exist")
        return d
    if os.path.isfile(os.path.join(path, ".metadata")) or any(
        n.startswith("mp_rank_") for n in os.listdir(path)
    ):
        return path
    raise SystemExit(f"{path}: no latest_checkpointed_iteration.txt and not an iteration dir")


def detect_format(iterdir):
    if os.path.isfile(os.path.join(iterdir, ".metadata")):
        return "torch_dist"
    if any(n.startswith("mp_rank_") for n in os.listdir(iterdir)):
        return "megatron"
    raise SystemExit(f"{iterdir}: cannot detect checkpoint format")


def report(problems, what):
    """One MISMATCH line per problem, then ORACLE OK/FAIL; the exit code (the oracles' shared verdict)."""
    for p in problems:
        print(f"MISMATCH {p}")
    print(f"ORACLE FAIL {len(problems)} problems ({what})" if problems else f"ORACLE OK {what}")
    sys.stdout.flush()
    return 1 if problems else 0


def end_parallel(serving):
    """Leave the process group; or, serving more commands in this process (tests/job_worker.py), only
    megatron-core's model-parallel state and groups, so the next command can set up another layout."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from torch.distributed import distributed_c10d as c10d

    if not serving:
        dist.destroy_process_group()
        return
    parallel_state.destroy_model_parallel()
    for group in list(c10d._world.pg_map):
        if group is not c10d.GroupMember.WORLD:
            dist.destroy_process_group(group)


def init_dist(pp: int = 1) -> tuple[int, int]:
    """gloo process group (torchrun's, the test worker's, or a one-process one) and megatron-core's groups:
    PP ``pp``, TP = world size / pp. Returns (rank, world)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        if "RANK" not in os.environ:  # a plain `python oracles/gemma3.py ...`: a group of one
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(port))
        dist.init_process_group(backend="gloo")
    world = dist.get_world_size()
    assert world % pp == 0, (world, pp)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world // pp, pipeline_model_parallel_size=pp)
    return dist.get_rank(), world


def unwrap(m):
    while hasattr(m, "module"):
        m = m.module
    return m


NON_MODEL_OBJECTS = ("common_state", "rng_state", "rerun_state_machine_state", "optimizer", "content_metadata")


def stored_metadata(iter_dir: str):
    """torch DCP metadata of a torch_dist directory: {key: shape (tensors) or None (objects)}."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = FileSystemReader(iter_dir).read_metadata()
    return {k: (tuple(v.size) if isinstance(v, TensorStorageMetadata) else None)
            for k, v in md.state_dict_metadata.items()}


def model_objects(meta: dict) -> set[str]:
    return {k for k, v in meta.items() if v is None and not k.startswith(NON_MODEL_OBJECTS)}


def is_legacy(iter_dir: Path) -> bool:
    return any(p.name.startswith("mp_rank_") for p in iter_dir.iterdir())


def stored_parallel(iter_dir: Path) -> tuple[int | None, int | None]:
    """(TP, PP) a checkpoint says it was written at: Megatron-LM args (common state, or a legacy rank file),
    else Bridge's run_config.yaml model section; None where it says nothing."""
    import torch
    from megatron.core import dist_checkpointing

    args = None
    with contextlib.suppress(Exception):
        if is_legacy(iter_dir):
            from megatron.core.safe_globals import SAFE_GLOBALS

            f = sorted(iter_dir.glob("mp_rank_*/model_optim_rng.pt"))[0]
            # registered for good, as megatron-core does: the safe_globals context would drop them again on exit
            torch.serialization.add_safe_globals(list(SAFE_GLOBALS))
            args = torch.load(f, map_location="cpu", weights_only=True).get("args")
        else:
            args = dist_checkpointing.load_common_state_dict(str(iter_dir)).get("args")
    if args is not None:
        return getattr(args, "tensor_model_parallel_size", None), getattr(args, "pipeline_model_parallel_size", None)
    rc = iter_dir / "run_config.yaml"
    if rc.is_file():
        import yaml

        model = (yaml.safe_load(rc.read_text()) or {}).get("model") or {}
        return model.get("tensor_model_parallel_size"), model.get("pipeline_model_parallel_size")
    return None, None


def compare(got: dict, want: dict, what: str) -> list[str]:
    import torch

    problems = [f"{what}: missing {k}" for k in sorted(set(want) - set(got))]
    problems += [f"{what}: unexpected {k}" for k in sorted(set(got) - set(want))]
    for k in sorted(set(got) & set(want)):
        x, y = got[k], want[k]
        if x.shape != y.shape or x.dtype != y.dtype:
            problems.append(f"{what}: {k} {tuple(x.shape)} {x.dtype} vs {tuple(y.shape)} {y.dtype}")
        elif not torch.equal(x, y):
            problems.append(f"{what}: {k} differs, max abs diff {(x.double() - y.double()).abs().max().item():.3g}")
    return problems


def compare_stored(iter_dir: Path, truth_dir: Path, allow_pad: bool) -> tuple[list[str], dict]:
    """Stored tensors (global, all layers) of the judged checkpoint vs Bridge's, bit for bit; the same
    _extra_state objects."""
    import torch
    from megatron.core import dist_checkpointing

    def plain(d):  # load_plain_tensors also returns the common state (iteration, ...): the tensors only
        return {k: v for k, v in dist_checkpointing.load_plain_tensors(str(d)).items() if isinstance(v, torch.Tensor)}

    got, want = plain(iter_dir), plain(truth_dir)
    problems = []
    for k in sorted(set(got) & set(want)):
        x, y = got[k], want[k]
        if allow_pad and x.dim() == 2 and x.shape[0] > y.shape[0] and x.shape[1:] == y.shape[1:] and \
                k in ("embedding.word_embeddings.weight", "output_layer.weight"):
            if torch.count_nonzero(x[y.shape[0]:]):
                problems.append(f"stored: {k} vocab padding rows {y.shape[0]}..{x.shape[0]} not zero")
            got[k] = x[:y.shape[0]]
    problems += compare(got, want, "stored vs Bridge import")
    mine, theirs = model_objects(stored_metadata(str(iter_dir))), model_objects(stored_metadata(str(truth_dir)))
    problems += [f"stored: _extra_state object missing: {k}" for k in sorted(theirs - mine)]
    problems += [f"stored: unexpected object: {k}" for k in sorted(mine - theirs)]
    return problems, {"stored_tensors": len(got), "stored_objects": len(mine)}


def describe_sharded(sd: dict) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

    out = {}
    for k, v in sd.items():
        if isinstance(v, ShardedTensor):
            tp_axes = [i - v.prepend_axis_num for i, f in enumerate(v.axis_fragmentations)
                       if f > 1 and i >= v.prepend_axis_num]
            out[k] = {"kind": "tensor", "key": v.key, "global_shape": list(v.global_shape),
                      "local_shape": list(v.local_shape), "global_offset": list(v.global_offset),
                      "prepend_axis_num": v.prepend_axis_num, "axis_fragmentations": list(v.axis_fragmentations),
                      "tp_split_axis_of_local": tp_axes, "replica_id": list(v.replica_id)
                      if isinstance(v.replica_id, tuple) else v.replica_id, "dtype": str(v.dtype)}
        elif isinstance(v, ShardedObject):
            out[k] = {"kind": "object", "key": v.key, "unique_key": v.unique_key, "global_shape": list(v.global_shape),
                      "global_offset": list(v.global_offset), "value": repr(v.data)[:80]}
        elif isinstance(v, ShardedTensorFactory):
            built = v.build_fn(v.key, v.data, v.replica_id, v.flattened_range)
            parts = built if isinstance(built, dict) else dict(enumerate(built if isinstance(built, list) else [built]))
            out[k] = {"kind": "factory", "key": v.key, "local_shape": list(v.data.shape),
                      "built": {pk: {"global_shape": list(p.global_shape), "global_offset": list(p.global_offset),
                                     "local_shape": list(p.local_shape),
                                     "axis_fragmentations": list(p.axis_fragmentations)} for pk, p in parts.items()}}
        else:
            out[k] = {"kind": type(v).__name__}
    return out
