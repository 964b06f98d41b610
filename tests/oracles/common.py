"""What the oracles share: megatron-core's CPU shims, process groups and their end, checkpoint directories,
and comparing what two checkpoints or models hold (one verdict line for each oracle); for the Megatron-Bridge
oracles also their command line, a judge's end (its JSON verdict line), a layout report's checkpoint part and the
tiny HF models' tokenizer and tensors."""
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

def bridge_oracle_parser(doc: str, mutations, pp_help: str = "pipeline stages (TP = world size / PP)"):
    """The command line of the Megatron-Bridge oracles (make / bridge-import / judge / mutate / layout) with the
    options they all take; returns the parser and its commands' parsers by name, for each oracle's own options."""
    import argparse

    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    cmds = {name: sub.add_parser(name) for name in ("make", "bridge-import", "judge", "mutate", "layout")}
    cmds["make"].add_argument("hf_dir")
    sp = cmds["bridge-import"]
    sp.add_argument("hf_dir")
    sp.add_argument("out_dir")
    sp.add_argument("--pp", type=int, default=1, help=pp_help)
    sp = cmds["judge"]
    sp.add_argument("megatron_dir")
    sp.add_argument("--truth", required=True, help="Bridge's own import of --hf (bridge-import)")
    sp.add_argument("--hf", required=True)
    sp.add_argument("--tp", type=int, default=None, help="the TP the checkpoint must record")
    sp.add_argument("--pp", type=int, default=None, help="the PP the checkpoint must record")
    sp.add_argument("--atol", type=float, default=1e-4, help="logits vs transformers, max abs")
    sp.add_argument("--allow-vocab-padding", action="store_true",
                    help="stored vocab rows past Bridge's (unpadded) vocab are accepted if zero")
    sp = cmds["mutate"]
    sp.add_argument("src")
    sp.add_argument("dst")
    sp.add_argument("--hf", required=True)
    sp.add_argument("--kind", choices=mutations, required=True)
    sp = cmds["layout"]
    sp.add_argument("hf_dir")
    sp.add_argument("--ckpt", default=None)
    sp.add_argument("--out", default=None)
    return p, cmds


def judge_error(e: Exception) -> str:
    """A judge's exception as a problem (a refused load is a verdict, not a crash): its traceback on stderr, its
    first line (500 characters at most) returned."""
    import traceback

    traceback.print_exc()
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500]


def finish_judge(info: dict, problems: list[str], world: int, rank: int, serving: bool, t0: float) -> int:
    """A judge's end, on every rank: every rank's problems gathered (another rank's prefixed ``rank R:``), the
    process group left (end_parallel), ``info`` completed with the verdict (ok, the first 50 problems, their number,
    the seconds since ``t0``) and printed as one JSON line by rank 0; the exit code, 1 on any problem."""
    import json
    import time

    import torch.distributed as dist

    every = [None] * world
    try:
        dist.all_gather_object(every, problems)  # every rank's verdict, reported by rank 0
    finally:
        end_parallel(serving)
    problems = [p if r == 0 else f"rank {r}: {p}" for r, ps in enumerate(every) for p in ps]
    info.update(ok=not problems, problems=problems[:50], n_problems=len(problems), seconds=round(time.time() - t0, 2))
    if rank == 0:
        print(json.dumps(info), flush=True)
    return 0 if not problems else 1


def check_recorded(info: dict, problems: list[str], wants: dict) -> None:
    """A problem for each parallel size the checkpoint records (``info["stored_<what>"]``) other than the one the
    judge was told to expect (``wants``: {"tp": N or None, ...}; None expects nothing)."""
    for what, want in wants.items():
        if want is not None and info[f"stored_{what}"] != want:
            problems.append(f"checkpoint records {what.upper()}={info[f'stored_{what}']}, expected {want}")


def judge_stored(iter_dir: Path, truth_dir: Path, info: dict, problems: list[str], allow_pad: bool,
                 vocab_keys=("embedding.word_embeddings.weight", "output_layer.weight")) -> int | None:
    """A judge's checks of a torch_dist checkpoint as stored: its tensors and objects against Bridge's import's
    (compare_stored, the counts into ``info``); returns the rows of its word embedding ``vocab_keys[0]`` (perhaps
    padded), None and a problem where it has none."""
    shape = stored_metadata(str(iter_dir)).get(vocab_keys[0])
    if shape is None:
        problems.append(f"stored: no {vocab_keys[0]}")
    sp, si = compare_stored(iter_dir, truth_dir, allow_pad, vocab_keys)
    problems += sp
    info.update(si)
    return None if shape is None else shape[0]


def judge_logits(info: dict, problems: list[str], mlog, rlog, hlog, atol: float, how: str = "") -> None:
    """A judge's logits verdict: the judged model's logits ``mlog`` against transformers' ``hlog`` (max abs
    difference, a problem past ``atol``; ``how`` names what the judge made fair), against Bridge's own import's
    ``rlog``, transformers' scale and the share of equal argmaxes, all in ``info``."""
    diff = (mlog - hlog).abs().max().item()
    info["logits_max_abs_diff_vs_hf"] = diff
    info["logits_max_abs_diff_vs_bridge_model"] = (mlog - rlog).abs().max().item()
    info["logits_scale"] = hlog.abs().max().item()
    if not diff <= atol:
        problems.append(f"logits differ from transformers' by {diff:.3g} (atol {atol}{how})")
    info["argmax_agreement"] = (mlog.argmax(-1) == hlog.argmax(-1)).float().mean().item()


def drop_objects(m, drop) -> None:
    """``m``'s sharded_state_dict without the entries whose key ``drop(key)`` holds (a mutation: a save then leaves
    them out)."""
    orig = m.sharded_state_dict

    def dropped(*args, **kw):
        return {k: v for k, v in orig(*args, **kw).items() if not drop(k)}

    m.sharded_state_dict = dropped


def bridge_provider(hf: str, load_weights: bool):
    """Megatron-Bridge's AutoBridge for ``hf`` and the model provider it makes (to_megatron_provider), as it makes
    it. First the NVTE_* attention selection variables are cleared: a provider's attention backend sets them in
    os.environ, and a shared worker's earlier job (another Bridge model, backend auto) may leave NVTE_FUSED_ATTN=1,
    which some backends refuse (Gemma 3's flash backend)."""
    from megatron.bridge import AutoBridge

    for name in [k for k in os.environ if k.startswith(("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"))]:
        del os.environ[name]
    bridge = AutoBridge.from_hf_pretrained(hf)
    return bridge, bridge.to_megatron_provider(load_weights=load_weights)


def size_vocab(provider, vocab_rows: int | None) -> None:
    """A provider sized like a stored checkpoint whose vocab tensors have ``vocab_rows`` rows (padded: no further
    padding); None or Bridge's own vocab size: unchanged."""
    if vocab_rows is not None and vocab_rows != provider.vocab_size:
        provider.should_pad_vocab = False
        provider.vocab_size = vocab_rows


def make_on_rank0(make, a) -> int:
    """``make(a)``; in a served worker of several ranks, on rank 0 only, the others waiting for it."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        try:
            return make(a) if dist.get_rank() == 0 else 0
        finally:
            dist.barrier()
    return make(a)


def save_word_tokenizer(out: Path, vocab: int) -> None:
    """A WordLevel tokenizer of ``vocab`` tokens t0.. (unk t3, pad t0, eos t1, bos t2) saved in ``out``: what
    Bridge's save_megatron_model(hf_tokenizer_path=) loads with AutoTokenizer."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t3"))
    tok.pre_tokenizer = WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t3", pad_token="t0", eos_token="t1",
                            bos_token="t2").save_pretrained(out)


def hf_file_tensors(hf_dir) -> dict:
    """The tensors an HF directory's safetensors files hold, unread: {name: {"shape", "dtype"}}."""
    from safetensors import safe_open

    out = {}
    for f in sorted(Path(hf_dir).glob("*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            for k in sf.keys():
                t = sf.get_slice(k)
                out[k] = {"shape": list(t.get_shape()), "dtype": t.get_dtype()}
    return out


def load_hf_tensors(hf_dir) -> dict:
    """Every tensor of an HF directory's safetensors files: {name: tensor}."""
    from safetensors.torch import load_file

    hf = {}
    for f in sorted(Path(hf_dir).glob("*.safetensors")):
        hf.update(load_file(str(f)))
    return hf


def matching_rows(local, parts) -> list:
    """For each row of ``local``: the name of the one row of ``parts`` ((name, tensor) pairs) equal to it, like
    q3 (row 3 of the tensor named q), else the list of all equal ones (none or several)."""
    import torch

    out = []
    for row in local:
        hit = [f"{name}{i}" for name, t in parts for i in range(t.shape[0]) if torch.equal(t[i], row)]
        out.append(hit[0] if len(hit) == 1 else hit)
    return out


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


def init_dist(pp: int = 1, ep: int = 1) -> tuple[int, int]:
    """gloo process group (torchrun's, the test worker's, or a one-process one) and megatron-core's groups:
    PP ``pp``, EP ``ep`` (expert parallel; data parallel = EP for the rest), TP = world size / (pp * ep).
    Returns (rank, world)."""
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
    assert world % (pp * ep) == 0, f"world size {world} is not a multiple of PP * EP = {pp * ep}"
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world // (pp * ep),
                                             pipeline_model_parallel_size=pp, expert_model_parallel_size=ep)
    return dist.get_rank(), world


def bridge_import(a, serving: bool, save, ep: int | None = None) -> int:
    """The ``bridge-import`` command's frame: process groups at PP ``a.pp`` and EP ``ep`` (TP = world / (PP * EP)),
    ``save(tp)`` (Bridge's own import of ``a.hf_dir``, saved to ``a.out_dir``; returns more facts for the report, or
    None), the groups left, and rank 0's one JSON line."""
    import json
    import time

    t0 = time.time()
    rank, world = init_dist(a.pp, ep or 1)
    tp = world // (a.pp * (ep or 1))
    try:
        facts = save(tp) or {}
    finally:
        end_parallel(serving)
    if rank == 0:
        print(json.dumps({"bridge_import": str(a.out_dir), "tp": tp, "pp": a.pp, **({"ep": ep} if ep else {}),
                          **facts, "seconds": round(time.time() - t0, 2)}))
    return 0


def unwrap(m):
    while hasattr(m, "module"):
        m = m.module
    return m


def tensor_state(model) -> dict:
    """The first model chunk's tensors, detached, but its _extra_state ones."""
    import torch

    return {k: v.detach() for k, v in unwrap(model[0]).state_dict().items() if isinstance(v, torch.Tensor)
            and not k.endswith("_extra_state")}


def describe_state(m) -> dict:
    """A module's state_dict() as a layout report gives it: {name: {"shape", "dtype"}} for tensors, else the repr."""
    import torch

    return {k: ({"shape": list(v.shape), "dtype": str(v.dtype)} if isinstance(v, torch.Tensor) else repr(v))
            for k, v in m.state_dict().items()}


def tp_gathered(t):
    """A tensor split over megatron-core's tensor-parallel group along dim 0 (a vocab-parallel tensor's rows),
    whole."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    if dist.get_world_size(group) == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts)


NON_MODEL_OBJECTS = ("common_state", "rng_state", "rerun_state_machine_state", "optimizer", "content_metadata")


def stored_metadata(iter_dir: str):
    """torch DCP metadata of a torch_dist directory: {key: shape (tensors) or None (objects)}."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = FileSystemReader(iter_dir).read_metadata()
    return {k: (tuple(v.size) if isinstance(v, TensorStorageMetadata) else None)
            for k, v in md.state_dict_metadata.items()}


def stored_detail(iter_dir: str) -> dict:
    """A torch_dist directory's .metadata in its own order: {key: {"shape", "dtype"}} for tensors, "object" for bytes
    items."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = FileSystemReader(iter_dir).read_metadata()
    return {k: ({"shape": list(v.size), "dtype": str(v.properties.dtype)} if isinstance(v, TensorStorageMetadata)
                else "object") for k, v in md.state_dict_metadata.items()}


def describe_checkpoint(iter_dir: Path) -> dict:
    """What a layout report (``layout --ckpt``) says of a checkpoint besides its keys: its common state (each value's
    repr, 300 characters at most), run_config.yaml's model section where there is one, every file under its root."""
    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(str(iter_dir))
    out = {"common_state": {k: repr(v)[:300] for k, v in common.items()}}
    rc = iter_dir / "run_config.yaml"
    if rc.is_file():
        import yaml

        out["run_config_model"] = (yaml.safe_load(rc.read_text()) or {}).get("model")
    out["files"] = sorted(str(p.relative_to(iter_dir.parent)) for p in iter_dir.parent.rglob("*") if p.is_file())
    return out


def object_replicas(m, described: dict, factories: bool = False) -> dict:
    """describe_sharded's ShardedObjects (with ``factories`` also its ShardedTensorFactory entries, e.g. a SwiGLU
    linear_fc1) with their replica ids (which ranks write each _extra_state / each factory's tensors)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensorFactory

    kinds = (ShardedObject, ShardedTensorFactory) if factories else ShardedObject
    for k, v in m.sharded_state_dict().items():
        if isinstance(v, kinds):
            described[k]["replica_id"] = list(v.replica_id) if isinstance(v.replica_id, tuple) else v.replica_id
    return described


def model_objects(meta: dict) -> set[str]:
    return {k for k, v in meta.items() if v is None and not k.startswith(NON_MODEL_OBJECTS)}


def is_legacy(iter_dir: Path) -> bool:
    return any(p.name.startswith("mp_rank_") for p in iter_dir.iterdir())


def stored_args(iter_dir: Path):
    """The Megatron-LM args a checkpoint holds (common state, or a legacy rank file); None if none."""
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
    return args


def stored_parallel(iter_dir: Path) -> tuple[int | None, int | None]:
    """(TP, PP) a checkpoint says it was written at: Megatron-LM args (common state, or a legacy rank file),
    else Bridge's run_config.yaml model section; None where it says nothing."""
    args = stored_args(iter_dir)
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


def compare_stored(iter_dir: Path, truth_dir: Path, allow_pad: bool,
                   vocab_keys=("embedding.word_embeddings.weight", "output_layer.weight")) -> tuple[list[str], dict]:
    """Stored tensors (global, all layers) of the judged checkpoint vs Bridge's, bit for bit; the same
    _extra_state objects. With ``allow_pad``, the vocab tensors (``vocab_keys``: a model's own names, e.g. under
    ``language_model.``) may have more rows than Bridge's (which does not pad): those rows must be zero and are cut
    off before the comparison."""
    import torch
    from megatron.core import dist_checkpointing

    def plain(d):  # load_plain_tensors also returns the common state (iteration, ...): the tensors only
        return {k: v for k, v in dist_checkpointing.load_plain_tensors(str(d)).items() if isinstance(v, torch.Tensor)}

    got, want = plain(iter_dir), plain(truth_dir)
    problems = []
    for k in sorted(set(got) & set(want)):
        x, y = got[k], want[k]
        if allow_pad and x.dim() == 2 and x.shape[0] > y.shape[0] and x.shape[1:] == y.shape[1:] and \
                k in vocab_keys:
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
