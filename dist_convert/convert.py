"""The reshard engine: index -> target layout -> plan -> exchange -> write, atomically."""
from __future__ import annotations

import dataclasses
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import ModelConfig, args_for_target
from .errors import ConvertError
from .exchange import Assembly, execute
from .formats import detect_format, get_format
from .formats.base import (Format, FormatOptions, SourceIndex, Target, TargetFile, iter_dir_name, numel,
                           write_tracker)
from .layout.rules import logical_tensors
from .plan import DEFAULT_BUDGET, Plan, make_plan, split_chunks, split_files
from .runtime import Runtime, human_bytes, peak_rss_bytes
from .summary import RankStats, print_summary
from .topology import Layout

DTYPES = {"keep": None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
INCOMPLETE_SUFFIX = ".dist_convert_tmp"


@dataclass
class ReshardOptions:
    src: Path
    dst: Path
    src_format: str = "auto"
    dst_format: str | None = None
    target_tp: int | None = None
    target_pp: int | None = None
    target_first: int | None = None
    target_last: int | None = None
    target_spec: str | None = None
    target_vpp: int | None = None
    vocab_size: int | None = None
    dtype: str = "keep"
    memory_budget: int = DEFAULT_BUDGET
    overwrite: bool = False
    vocab_divisible_by: int | None = None
    formats: FormatOptions = dataclasses.field(default_factory=FormatOptions)
    target_split: int | None = None  # encoder-decoder (T5): first decoder pipeline stage
    stats_json: Path | None = None  # rank 0 writes the per-rank summary here as JSON (dist_convert bench)


def load_index(path: Path, fmt_name: str, rt: Runtime, vocab_size: int | None,
               options: FormatOptions) -> tuple[Format, SourceIndex]:
    fmt = detect_format(path, options) if fmt_name == "auto" else get_format(fmt_name, options)
    return fmt, fmt.index(path, rt, vocab_size)


def sliced(index: SourceIndex, files: list[TargetFile], budget: int) -> SourceIndex:
    """The index with sliceable chunks cut to what each target piece needs (see plan.split_chunks)."""
    if not any(c.sliceable for c in index.chunks):
        return index
    return dataclasses.replace(index, chunks=split_chunks(index.chunks, files, max(1, budget // 4)))


def logical_numel(index: SourceIndex) -> dict[str, int]:
    return {name: numel(t.shape) for name, t in logical_tensors(index.cfg).items()}


def source_dtypes(index: SourceIndex) -> dict[str, torch.dtype]:
    return {p.logical: c.dtype for c in index.chunks for p in c.pieces}


def target_layout(opts: ReshardOptions, index: SourceIndex, dst_fmt: Format) -> Layout:
    src = index.layout
    if not dst_fmt.sharded:
        if (opts.target_tp or 1) != 1 or (opts.target_pp or 1) != 1 or (opts.target_vpp or 1) != 1 \
                or opts.target_split:
            raise ConvertError(f"--dst-format {dst_fmt.name} stores unsharded tensors; TP/PP do not apply",
                               "drop --target-tp/--target-pp/--target-vpp (or set them to 1)")
        return Layout(1, 1)
    pp = opts.target_pp or src.pp
    same_pp = pp == src.pp
    first = opts.target_first if opts.target_first is not None else (src.first if same_pp else None)
    last = opts.target_last if opts.target_last is not None else (src.last if same_pp else None)
    vpp = opts.target_vpp if opts.target_vpp is not None else (src.vpp if same_pp else None)
    split = opts.target_split if opts.target_split is not None else (src.split if same_pp else None)
    layout = Layout(opts.target_tp or src.tp, pp, first if pp > 1 else None, last if pp > 1 else None,
                    vpp if vpp != 1 else None, split if pp > 1 or opts.target_split else None)
    index.cfg.check_layout(layout)
    return layout


def check_vocab(opts: ReshardOptions, index: SourceIndex, cfg: ModelConfig, layout: Layout) -> None:
    known = opts.vocab_size or getattr(index.args, "vocab_size", None)
    if not known and cfg.padded_vocab(layout.tp) != index.cfg.vocab_size:
        raise ConvertError(
            f"the true vocabulary size is unknown (args give only padded_vocab_size={index.cfg.vocab_size}) and "
            f"TP={layout.tp} needs different padding",
            "pass --vocab-size with the tokenizer's vocabulary size")


def prepare_dst(dst: Path, rt: Runtime) -> Path:
    """Collective: a fresh temporary directory beside ``dst``; renamed into place at the end."""
    tmp = dst.parent / (dst.name + INCOMPLETE_SUFFIX)
    if rt.rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    rt.barrier()
    return tmp


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def commit_dst(tmp: Path, dst: Path, rt: Runtime) -> None:
    """Rank 0: swap the finished directory (or archive) into place; an old target is removed only now."""
    if rt.rank == 0:
        if dst.exists():
            old = dst.parent / (dst.name + ".dist_convert_old")
            _remove(old)
            dst.rename(old)
            tmp.rename(dst)
            _remove(old)
        else:
            tmp.rename(dst)
    rt.barrier()


def reshard(opts: ReshardOptions, rt: Runtime) -> dict:
    t0 = time.perf_counter()
    if opts.dst.exists() and not opts.overwrite:
        raise ConvertError(f"target {opts.dst} already exists", "pass --overwrite to replace it or choose another DST")
    if opts.dtype not in DTYPES:
        raise ConvertError(f"unknown --dtype {opts.dtype}", f"use one of {', '.join(DTYPES)}")
    f = opts.formats
    for flag, path in (("--tokenizer-dir", f.tokenizer_dir), ("--tokenizer-model", f.tokenizer_model),
                       ("--tokenizer-vocab-file", f.tokenizer_vocab_file)):
        if path is not None and not path.exists():
            raise ConvertError(f"{flag} {path} does not exist", f"pass an existing path to {flag}")
    src_fmt, index = load_index(opts.src, opts.src_format, rt, opts.vocab_size, opts.formats)
    dst_fmt = get_format(opts.dst_format or src_fmt.name, opts.formats)
    if f.nemo_style and dst_fmt.name != "nemo":
        raise ConvertError(f"--nemo-style applies to .nemo targets, not {dst_fmt.name}",
                           "drop --nemo-style or pass --dst-format nemo")
    layout = target_layout(opts, index, dst_fmt)
    cfg = index.cfg.replace(spec=opts.target_spec or index.cfg.spec,
                            make_vocab_size_divisible_by=opts.vocab_divisible_by or index.cfg.make_vocab_size_divisible_by)
    if dst_fmt.sharded:
        check_vocab(opts, index, cfg, layout)
    elif not (opts.vocab_size or getattr(index.args, "vocab_size", None)):
        index.notes.append(f"the true vocabulary size is unknown: exporting all {cfg.vocab_size} (padded) rows; "
                           "pass --vocab-size to strip the padding")
    dtype = DTYPES[opts.dtype]
    args = args_for_target(index.args, cfg, layout, dtype)
    target = Target(cfg, layout, dtype, args, index.iteration)
    files = dst_fmt.target_files(target, source_dtypes(index))
    if dst_fmt.any_writer:  # give every rank a part to write
        files = split_files(files, rt.world)
    index = sliced(index, files, opts.memory_budget)
    plan = make_plan(index.chunks, files, rt.world, opts.memory_budget, logical_numel(index))
    rt.log(f"[bold]reshard[/] {index.format} {index.layout} -> {dst_fmt.name} {layout}  "
           f"({len(index.chunks)} source chunks, {human_bytes(index.nbytes)}; {len(files)} target files; "
           f"{rt.world} ranks; {len(plan.waves)} waves)")
    for note in index.notes:
        rt.log(f"note: {note}")
    tmp = prepare_dst(opts.dst, rt)
    try:
        counters, write_s, my_files = _convert_into(tmp, target, index, src_fmt, dst_fmt, files, plan, rt)
        artifact = dst_fmt.package(tmp, opts.dst) if rt.rank == 0 else tmp
    except BaseException:
        if rt.rank == 0:  # a failed run leaves nothing that looks like a checkpoint
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    commit_dst(artifact, opts.dst, rt)
    mine = RankStats(rt.rank, len(my_files), sum(len(f.tensors) for f in my_files), counters["read"],
                     plan.write_bytes[rt.rank], counters["sent"], counters["received"], write_s,
                     time.perf_counter() - t0, peak_rss_bytes())
    stats = rt.all_gather_object(mine)
    print_summary(rt, stats, f"wrote {opts.dst} ({dst_fmt.name}, {layout})")
    if opts.stats_json is not None and rt.rank == 0:
        opts.stats_json.write_text(json.dumps([dataclasses.asdict(s) for s in stats]))
    return {"plan": plan, "stats": stats}


def _convert_into(tmp: Path, target: Target, index: SourceIndex, src_fmt: Format, dst_fmt: Format,
                  files: list[TargetFile], plan: Plan, rt: Runtime) -> tuple[dict[str, int], float, list[TargetFile]]:
    """Collective: exchange this rank's tensors and write each as soon as it is complete (the writer
    streams tensors or whole files), then rank 0 writes metadata and tracker last."""
    tmp_iter = tmp / iter_dir_name(index.iteration) if dst_fmt.iteration_dirs else tmp
    if rt.rank == 0:
        tmp_iter.mkdir(exist_ok=True)
    rt.barrier()
    my_files = [files[i] for i in plan.files_of(rt.rank)]
    by_id = {f.id: f for f in my_files}
    writer = dst_fmt.open_writer(target, tmp_iter, my_files, rt)
    write_s = 0.0

    def done(fid: int, j: int, tensor: torch.Tensor) -> None:
        nonlocal write_s
        tw = time.perf_counter()
        writer.put(by_id[fid], j, tensor)
        write_s += time.perf_counter() - tw

    out = Assembly(my_files, plan, rt.rank, done)
    counters = execute(plan, rt, {c.id: c for c in index.chunks}, lambda cs: src_fmt.read(index, cs), out)
    tw = time.perf_counter()
    out.finish()
    writer.close()
    write_s += time.perf_counter() - tw
    rt.barrier()
    if rt.rank == 0:
        dst_fmt.finalize(target, tmp_iter, rt)
        if dst_fmt.iteration_dirs:
            write_tracker(tmp, index.iteration)
    rt.barrier()
    return counters, write_s, my_files
