"""megatron-core's own path to a new layout: build the GPTModel at the target layout, load the torch_dist
source with ``dist_checkpointing.load`` (megatron-core reshards at load, strictly), save the target with
``dist_checkpointing.save``. The model config comes from the source's args. CPU-only torch works
through a few no-op patches (as in tests/oracles/mcore.py).

  torchrun --nproc_per_node=TP*PP -m dist_convert.bench.mcore_job SRC DST --tp T --pp P [--stats-json FILE]
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from .measure import job_args

T_START = time.perf_counter()


def apply_cpu_shims() -> None:
    """megatron-core 0.16 save/load on CPU-only torch: CUDA calls in its torch_dist path become no-ops."""
    import torch

    if torch.cuda.is_available():
        return
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    torch.Tensor.cuda = lambda self, *a, **k: self
    from megatron.core.tensor_parallel import random as mp_random

    @contextlib.contextmanager
    def _fork(self: Any, name: Any = None) -> Any:
        yield

    mp_random.CudaRNGStatesTracker.fork = _fork


def iter_dir(path: Path) -> tuple[Path, str]:
    tracker = path / "latest_checkpointed_iteration.txt"
    if not tracker.is_file():
        return path, path.name
    it = tracker.read_text().strip()
    name = "release" if it == "release" else f"iter_{int(it):07d}"
    return path / name, name


def padded_vocab(args: argparse.Namespace, tp: int) -> int:
    multiple = int(getattr(args, "make_vocab_size_divisible_by", 128) or 128) * tp
    return -(-int(args.vocab_size) // multiple) * multiple


def build_model(args: argparse.Namespace, tp: int, pp: int) -> Any:
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    def get(name: str, default: Any) -> Any:
        value = getattr(args, name, None)
        return default if value is None else value

    dtype = args.params_dtype
    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads, num_query_groups=get("num_query_groups", None),
        kv_channels=get("kv_channels", None), normalization=get("normalization", "LayerNorm"),
        layernorm_epsilon=get("norm_epsilon", 1e-5), add_bias_linear=get("add_bias_linear", True),
        add_qkv_bias=get("add_qkv_bias", False), gated_linear_unit=get("swiglu", False),
        activation_func=F.silu if get("swiglu", False) else F.gelu, qk_layernorm=get("qk_layernorm", False),
        hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        pipeline_dtype=dtype, params_dtype=dtype, bf16=bool(get("bf16", False)), fp16=bool(get("fp16", False)),
        use_cpu_initialization=True, perform_initialization=False)
    spec = get_gpt_layer_local_spec(normalization=config.normalization, qk_layernorm=config.qk_layernorm)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=padded_vocab(args, tp),
                    max_sequence_length=get("max_position_embeddings", 4096),
                    pre_process=parallel_state.is_pipeline_first_stage(),
                    post_process=parallel_state.is_pipeline_last_stage(),
                    share_embeddings_and_output_weights=not get("untie_embeddings_and_output_weights", False),
                    position_embedding_type=get("position_embedding_type", "learned_absolute"),
                    rotary_percent=get("rotary_percent", 1.0), rotary_base=get("rotary_base", 10000))
    return model.to(dtype)  # as Megatron-LM's Float16Module: the local norms are built in fp32


def convert(src: Path, dst: Path, tp: int, pp: int) -> dict:
    """Collective over TP*PP ranks. Returns this rank's timings and peak RSS."""
    apply_cpu_shims()
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.validation import StrictHandling

    from ..runtime import peak_rss_bytes

    t_import = time.perf_counter()
    dist.init_process_group(backend="gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    t0 = time.perf_counter()
    src_dir, name = iter_dir(src)
    common = dist_checkpointing.load_common_state_dict(str(src_dir))
    args = common["args"]
    model = build_model(args, tp, pp)
    t_build = time.perf_counter()
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(src_dir),
                                     strict=StrictHandling.RAISE_ALL)
    model.load_state_dict(loaded["model"], strict=True)
    del loaded
    t_load = time.perf_counter()
    out_args = copy.copy(args)
    out_args.tensor_model_parallel_size, out_args.pipeline_model_parallel_size = tp, pp
    out_args.padded_vocab_size = padded_vocab(args, tp)
    dst_dir = dst / name
    if dist.get_rank() == 0:
        dst_dir.mkdir(parents=True)
    dist.barrier()
    state = {"model": model.sharded_state_dict(), "args": out_args, "checkpoint_version": 3.0,
             "iteration": common.get("iteration", 0)}
    dist_checkpointing.save(state, str(dst_dir))
    dist.barrier()
    if dist.get_rank() == 0:
        iteration = str(int(name[5:])) if name.startswith("iter_") else "release"
        (dst / "latest_checkpointed_iteration.txt").write_text(iteration)
    t_end = time.perf_counter()
    return {"import_s": t_import - T_START, "wall_s": t_end - t0, "build_s": t_build - t0,
            "load_s": t_load - t_build, "save_s": t_end - t_load,
            "peak_rss": peak_rss_bytes()}


def main(argv: list[str] | None = None) -> int:
    a = job_args("dist_convert.bench.mcore_job", __doc__, argv)
    mine = convert(a.src, a.dst, a.tp, a.pp)
    import torch.distributed as dist

    ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    if dist.get_rank() == 0 and a.stats_json:
        summary = {k: max(r[k] for r in ranks) for k in ("import_s", "wall_s", "build_s", "load_s", "save_s")}
        a.stats_json.write_text(json.dumps({**summary, "peak_rss_per_rank": [r["peak_rss"] for r in ranks],
                                            "world": len(ranks)}))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":  # megatron-core's save starts a multiprocessing.Manager: keep this guard
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import warnings

    warnings.filterwarnings("ignore")
    sys.exit(main())
