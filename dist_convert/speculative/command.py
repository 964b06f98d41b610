"""``speculate``: load a GPT checkpoint into megatron-core at the target layout on every rank, add
EAGLE draft layers or Medusa heads with ModelOpt, collectively, and save a sharded torch_dist
checkpoint plus ``modelopt_state`` from which megatron-core + ModelOpt resume training."""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import ModelConfig
from ..convert import DTYPES, ReshardOptions, check_vocab, load_index, logical_numel, source_dtypes, target_layout
from ..datamodel import SourceIndex, Target
from ..durable import fsync_file
from ..errors import ConvertError
from ..features.expressed import refuse_unexpressed
from ..formats import get_format
from ..formats.base import Format, FormatOptions, iter_dir_name, resolve_iter_dir
from ..formats.mcore_config import PROVIDER_EXPRESSES
from ..formats.nemo2 import CONTEXT, WEIGHTS, check_context, write_target_context
from ..layout.topology import Layout
from ..mlm_args import args_for_target
from ..plan import DEFAULT_BUDGET
from ..runtime import Runtime, ensure_process_group, human_bytes, peak_gpu_bytes, peak_rss_bytes
from ..staging import refuse_existing, stage
from ..summary import RankStats, print_summary
from .base_model import choose_seed
from .draft_config import DraftRequest, speculative_config
from .draft_export import draft_base_config
from .modelopt_compat import alias_renamed_megatron_modules


@dataclass(frozen=True, kw_only=True)
class SpeculateOptions:
    src: Path
    dst: Path
    draft: DraftRequest
    src_format: str = "auto"
    target_tp: int | None = None
    target_pp: int | None = None
    target_first: int | None = None
    target_last: int | None = None
    export_draft: Path | None = None
    dtype: str = "keep"
    vocab_size: int | None = None
    memory_budget: int = DEFAULT_BUDGET
    overwrite: bool = False
    vocab_divisible_by: int | None = None
    formats: FormatOptions = field(default_factory=FormatOptions)
    dst_format: str | None = None  # "torch_dist" (Megatron-LM) | "nemo2" (default: nemo2 for a NeMo 2 source)
    seed: int | None = None  # the draft modules' initialisation (default: the source's Megatron-LM --seed, else 1234)


SPECULATE_FORMATS = ("torch_dist", "nemo2")
# what the dense GPTModel speculate builds expresses: no Mixture of Experts, no multi-token prediction, and
# (unnamed: their plain value) no T5, MLA or hybrid stack
SPECULATE_EXPRESSES = {**PROVIDER_EXPRESSES, "moe": {False}, "mtp": {False}}


def existing_algorithms(src: Path) -> list[str]:
    """ModelOpt modes already applied to a checkpoint (its ``modelopt_state``), [] for a base model."""
    if (src / WEIGHTS / "modelopt_state").is_dir():  # NeMo 2
        src = src / WEIGHTS
    found = resolve_iter_dir(src, lambda p: (p / "modelopt_state").is_dir()) if src.is_dir() else None
    if found is None:
        return []
    from megatron.core import dist_checkpointing

    state = dist_checkpointing.load_common_state_dict(str(found[0] / "modelopt_state"))
    return [str(mode) for mode, _ in state.get("modelopt_state_dict", [])]


def _dominant_dtype(dtypes: dict[str, torch.dtype]) -> torch.dtype:
    counts: dict[torch.dtype, int] = {}
    for d in dtypes.values():
        counts[d] = counts.get(d, 0) + 1
    return max(counts, key=counts.get)


def speculate(opts: SpeculateOptions, rt: Runtime) -> dict:
    t0 = time.perf_counter()
    for path, flag in ((opts.dst, "DST"), (opts.export_draft, "--export-draft")):
        if path is not None:
            refuse_existing(path, opts.overwrite, flag, "another path")
    if opts.dtype not in DTYPES:
        raise ConvertError(f"unknown --dtype {opts.dtype}", f"use one of {', '.join(DTYPES)}")
    alias_renamed_megatron_modules()  # before anything imports ModelOpt
    present = existing_algorithms(opts.src) if rt.rank == 0 else None
    present = rt.broadcast_object(present)
    if present:
        raise ConvertError(f"{opts.src} is already a speculative model ({', '.join(present)} applied by ModelOpt)",
                           "start from the base checkpoint (speculate adds one draft to a base model)")
    reshard_opts = ReshardOptions(src=opts.src, dst=opts.dst, src_format=opts.src_format, dst_format="torch_dist",
                                  target_tp=opts.target_tp, target_pp=opts.target_pp, target_first=opts.target_first,
                                  target_last=opts.target_last, target_spec="local", target_vpp=1,
                                  vocab_size=opts.vocab_size, dtype=opts.dtype, memory_budget=opts.memory_budget,
                                  overwrite=opts.overwrite, vocab_divisible_by=opts.vocab_divisible_by,
                                  formats=opts.formats)
    src_fmt, index = load_index(opts.src, opts.src_format, rt, opts.vocab_size, opts.formats)
    refuse_unexpressed(index.cfg, SPECULATE_EXPRESSES, "the GPTModel speculate builds (megatron-core's "
                       "TransformerConfig with ModelOpt's layer spec)", "add the draft in Megatron-LM with ModelOpt; "
                       "dist_convert reshard converts the result")
    dst_format = opts.dst_format or ("nemo2" if index.format == "nemo2" else "torch_dist")
    if dst_format not in SPECULATE_FORMATS:
        raise ConvertError(f"speculate writes {' or '.join(SPECULATE_FORMATS)}, not {dst_format}",
                           "pass --dst-format torch_dist or nemo2 (then reshard converts the result)")
    layout = target_layout(reshard_opts, index, get_format("torch_dist"))
    cfg = index.cfg.replace(spec="local", make_vocab_size_divisible_by=opts.vocab_divisible_by
                            or index.cfg.make_vocab_size_divisible_by)
    check_vocab(reshard_opts, index, cfg, layout)
    dtype = DTYPES[opts.dtype] or _dominant_dtype(source_dtypes(index))
    if dst_format == "nemo2":
        check_context(Target(cfg=cfg, layout=layout, dtype=dtype, args=index.args, iteration=index.iteration,
                             origin=index.origin))
    algo, spec_cfg = speculative_config(opts.draft, cfg, dtype)
    if opts.export_draft is not None:
        draft_base_config(cfg, dtype, index.origin.hf_config)  # refuse an inexpressible model first
    if rt.world % (layout.tp * layout.pp):
        raise ConvertError(f"world size {rt.world} is not a multiple of target TP x PP = {layout.tp * layout.pp}",
                           f"launch a multiple of {layout.tp * layout.pp} processes (--nproc_per_node) or change "
                           "--target-tp/--target-pp")
    args = args_for_target(index.args, cfg, layout, dtype, "torch_dist", tokenizer=index.origin.tokenizer)
    rt.log(f"[bold]speculate[/] {index.format} {index.layout} -> {dst_format} {layout} + {algo} "
           f"({human_bytes(index.nbytes)}; {rt.world} ranks, data-parallel {rt.world // (layout.tp * layout.pp)})")
    if layout.pp > 1:
        index.notes.append("ModelOpt 0.47 supports pipeline parallelism for saving and exporting speculative models, "
                           "not for their training forward (EAGLE-3 takes aux hidden states from layers on other "
                           "stages); train the draft at PP=1")
    for note in index.notes:
        rt.log(f"note: {note}")

    ensure_process_group(rt)
    try:
        return _run(opts, rt, index, src_fmt, cfg, args, layout, dtype, algo, spec_cfg, t0, dst_format)
    finally:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()


def _fsync_small_files(root: Path) -> None:
    """megatron-core fsyncs the ``.distcp`` files and ``.metadata`` it saves, not ``common.pt`` or
    ``metadata.json``: every file but the ``.distcp`` ones, fsynced."""
    for f in root.rglob("*"):
        if f.is_file() and f.suffix != ".distcp":
            fsync_file(f)


def _run(opts: SpeculateOptions, rt: Runtime, index: SourceIndex, src_fmt: Format, cfg: ModelConfig,
         args: argparse.Namespace, layout: Layout, dtype: torch.dtype, algo: str, spec_cfg: dict, t0: float,
         dst_format: str) -> dict:
    from .draft_export import export_draft
    from .runner import build_and_convert, save_speculative

    model, place, plan, counters = build_and_convert(index, src_fmt, cfg, args, layout, dtype, algo, spec_cfg, rt,
                                                     opts.memory_budget, logical_numel(index),
                                                     choose_seed(opts.seed, index.args))
    staging = stage(opts.dst, rt, overwrite=opts.overwrite)
    tw = time.perf_counter()
    nemo2 = dst_format == "nemo2"
    sub = WEIGHTS if nemo2 else iter_dir_name(index.iteration)
    with staging.guard():
        save_speculative(model, place, staging.tmp / sub, args, index.iteration, rt, nemo2=nemo2)
        rt.barrier()

        def finish(_: object) -> None:
            if nemo2:  # NeMo's context/ (the source's, with the target layout)
                write_target_context(staging.tmp / CONTEXT, Target(cfg=cfg, layout=layout, dtype=dtype, args=args,
                                                                   iteration=index.iteration, origin=index.origin),
                                     opts.formats.tokenizer_dir)
            _fsync_small_files(staging.tmp)

        staging.complete(finish, tracker=None if nemo2 else index.iteration)
    staging.commit()
    if opts.export_draft is not None:
        export_draft(model, algo, spec_cfg, cfg, dtype, opts.export_draft, rt, overwrite=opts.overwrite,
                     hf_config=index.origin.hf_config)
    write_s = time.perf_counter() - tw
    written = sum(f.stat().st_size for f in (opts.dst / sub).glob(f"__{rt.rank}_*.distcp"))
    mine = RankStats(rank=rt.rank, files=1, tensors=counters["tensors"], read_bytes=counters["read"],
                     written_bytes=written, sent_bytes=counters["sent"], received_bytes=counters["received"],
                     write_s=write_s, wall_s=time.perf_counter() - t0, peak_rss=peak_rss_bytes(),
                     peak_gpu=peak_gpu_bytes(rt), device=str(rt.device))
    print_summary(rt, rt.all_gather_object(mine), f"wrote {opts.dst} ({dst_format} + modelopt_state {algo}, {layout})")
    return {"algorithm": algo, "config": spec_cfg, "plan": plan}
