"""Megatron-Bridge's own HF -> Megatron import, timed for ``dist_convert bench --methods bridge``:
``AutoBridge.from_hf_pretrained``, ``to_megatron_provider(load_weights=True)``, the model built at the
target layout with the HF weights loaded (``provide_distributed_model``), ``save_megatron_model`` (a
megatron-core torch_dist checkpoint, with the HF tokenizer's files). This is what Bridge's one-call
``import_ckpt`` does, with the CUDA-only choices turned off so that it also runs on CPU: the local layer
spec (no Transformer Engine), no RoPE fusion, no persistent layer norm.

Runs in the interpreter that has Megatron-Bridge (``bench --bridge-python``), by path, so it imports
only the standard library, torch, megatron-core, Megatron-Bridge and transformers, never dist_convert.
One rank: a plain process, in Bridge's own single-process context (as ``import_ckpt``); TP*PP > 1 ranks:
under torchrun, each rank loads its share of the HF weights.

  python bridge_job.py HF_DIR DST --tp T --pp P [--stats-json FILE]
  python -m torch.distributed.run --nproc_per_node=T*P bridge_job.py HF_DIR DST --tp T --pp P ...

CPU shims (only without CUDA): Bridge's ``peft/lora_layers.py`` imports ``transformer_engine.pytorch``
unconditionally, so that one module is executed with the import replaced by an inert stand-in
(megatron-core itself still sees no TE); ``torch.cuda.get_rng_state`` is the CPU generator's,
``torch.cuda.synchronize`` a no-op, ``torch.cuda.current_device`` "cpu", ``Tensor.cuda`` the identity
and megatron-core's CUDA RNG tracker's ``fork`` a null context (the model is only loaded and saved).
"""
from __future__ import annotations

import sys
from pathlib import Path

if sys.path and sys.path[0] and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)  # run by path: this directory's modules (run.py, args.py...) must not shadow others

import argparse  # noqa: E402
import contextlib  # noqa: E402
import importlib.abc  # noqa: E402
import importlib.machinery  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import time  # noqa: E402
import types  # noqa: E402
from typing import Any  # noqa: E402

T_START = time.perf_counter()
LORA = "megatron.bridge.peft.lora_layers"
TE_IMPORT = "import transformer_engine.pytorch as te"


class _NoTE(types.ModuleType):
    """Stands in for ``transformer_engine.pytorch`` in lora_layers.py: every attribute a new empty class,
    so its ``isinstance`` checks are False; ``te.ops`` is another stand-in."""

    def __getattr__(self, name: str) -> Any:
        value: Any = _NoTE(f"{self.__name__}.{name}") if name == "ops" else type(name, (), {})
        setattr(self, name, value)
        return value


class _LoraWithoutTE(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``megatron.bridge.peft.lora_layers`` and executes its source with the TE import replaced."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != LORA:
            return None
        sys.meta_path.remove(self)
        try:
            real = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if real is None or real.origin is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, origin=real.origin)

    def create_module(self, spec: Any) -> None:
        return None

    def exec_module(self, module: Any) -> None:
        path = module.__spec__.origin
        src = Path(path).read_text()
        if TE_IMPORT not in src:
            raise RuntimeError(f"{path} no longer has {TE_IMPORT!r}: the CPU shim of this Bridge version needs "
                               "updating (dist_convert/bench/bridge_job.py)")
        module.__dict__["_no_te"] = _NoTE("transformer_engine.pytorch")
        exec(compile(src.replace(TE_IMPORT, "te = _no_te"), path, "exec"), module.__dict__)


def cpu_shims() -> None:
    import torch

    if torch.cuda.is_available():
        return
    if not any(isinstance(f, _LoraWithoutTE) for f in sys.meta_path):
        sys.meta_path.insert(0, _LoraWithoutTE())
    torch.cuda.get_rng_state = torch.get_rng_state
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    torch.Tensor.cuda = lambda self, *a, **k: self
    from megatron.core.tensor_parallel import random as mp_random

    @contextlib.contextmanager
    def _fork(self: Any, name: Any = None) -> Any:
        yield

    mp_random.CudaRNGStatesTracker.fork = _fork


def peak_rss() -> int:
    """This process's own peak RSS (VmHWM; ``ru_maxrss`` would also count the bench process's peak, which
    a child started by vfork/fork keeps across exec), as dist_convert.runtime.peak_rss_bytes."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def has_tokenizer(hf: Path) -> bool:
    return any((hf / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "vocab.json"))


def import_hf(hf: Path, dst: Path, tp: int, pp: int) -> dict[str, Any]:
    """Collective over TP*PP ranks (one rank: Bridge's own temporary process group). This rank's times."""
    cpu_shims()
    import torch.distributed as dist
    from megatron.bridge import AutoBridge
    from megatron.bridge.training.model_load_save import temporary_distributed_context
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    t_import = time.perf_counter()
    if tp * pp == 1:
        context: Any = temporary_distributed_context(backend="gloo")
    else:
        dist.init_process_group(backend="gloo")
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        context = contextlib.nullcontext()
    with context:
        t0 = time.perf_counter()
        bridge = AutoBridge.from_hf_pretrained(str(hf))
        provider = bridge.to_megatron_provider(load_weights=True)
        provider.tensor_model_parallel_size, provider.pipeline_model_parallel_size = tp, pp
        provider.transformer_layer_spec = get_gpt_layer_local_spec()
        provider.apply_rope_fusion = False
        provider.persist_layer_norm = False
        provider.finalize()
        t_provider = time.perf_counter()
        model = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)
        t_model = time.perf_counter()
        bridge.save_megatron_model(model, str(dst), hf_tokenizer_path=str(hf) if has_tokenizer(hf) else None)
        dist.barrier()
        t_end = time.perf_counter()
        stats = {"import_s": t_import - T_START, "wall_s": t_end - t0, "provider_s": t_provider - t0,
                 "model_s": t_model - t_provider, "save_s": t_end - t_model,
                 "peak_rss": peak_rss()}
        ranks: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, stats)
        del model
    if dist.is_initialized():
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    return {**{k: max(r[k] for r in ranks) for k in ("import_s", "wall_s", "provider_s", "model_s", "save_s")},
            "peak_rss_per_rank": [r["peak_rss"] for r in ranks], "world": len(ranks)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bridge_job.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", type=Path, help="Hugging Face model directory")
    p.add_argument("dst", type=Path)
    p.add_argument("--tp", type=int, required=True, help="target tensor-parallel size")
    p.add_argument("--pp", type=int, required=True, help="target pipeline-parallel size")
    p.add_argument("--stats-json", type=Path, default=None)
    a = p.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != a.tp * a.pp:
        print(f"bridge_job: error: {world} ranks for TP={a.tp} x PP={a.pp}: launch TP*PP ranks", file=sys.stderr)
        return 2
    stats = import_hf(a.src, a.dst, a.tp, a.pp)
    if a.stats_json and int(os.environ.get("RANK", "0")) == 0:
        a.stats_json.write_text(json.dumps(stats))
    return 0


if __name__ == "__main__":  # megatron-core's save starts a multiprocessing.Manager: keep this guard
    import warnings

    warnings.filterwarnings("ignore")
    sys.exit(main())
