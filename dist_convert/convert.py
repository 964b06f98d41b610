"""The reshard engine: index -> target layout -> plan -> exchange -> write, atomically."""
from __future__ import annotations

import dataclasses
import json
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from . import faults
from .config import ModelConfig
from .cuts import split_chunks, split_files
from .datamodel import SourceIndex, Target, TargetFile, WrittenFile, numel, omit_absent
from .errors import ConvertError
from .exchange import Assembly, execute
from .features.expressed import refuse_features
from .formats import ADAPTER_FORMATS, detect_format, formats_holding, get_format
from .formats.base import Format, FormatOptions, data_dir, on_rank0
from .formats.dcp_meta import writer_note
from .integrity import Entry, Journal, fingerprint, refuse_incomplete
from .layout.rules import logical_tensors
from .layout.topology import Layout, pipeline_vpp
from .lora.merge import Merger, open_adapter
from .mlm_args import args_for_target
from .model_class import as_model_class
from .nonfinite import nonfinite_note
from .optim.state import optimizer_numel
from .phases import clock, phase
from .plan import DEFAULT_BUDGET, Plan, block_bytes, check_coverage, make_plan
from .readers import reader_warnings
from .runtime import Runtime, human_bytes, local_ranks, overlap_io, peak_gpu_bytes, peak_rss_bytes, stop_on_error
from .staging import Staging, refuse_existing, stage, write_error
from .summary import RankStats, print_summary

DTYPES = {"keep": None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MLM_CKPT_FORMAT = {"torch_dist": "torch_dist", "megatron": "torch"}  # Megatron-LM's --ckpt-format of a target


@dataclass(frozen=True, kw_only=True)
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
    resume: bool = False  # continue the interrupted run in DST.dist_convert_tmp
    target_ep: int | None = None  # MoE: expert-parallel size (default: the source's)
    target_etp: int | None = None  # MoE: expert-tensor-parallel size (default: the source's relation to TP)
    target_pipeline_layout: str | None = None  # megatron-core pipeline_model_parallel_layout string
    exchange: str = "auto"  # --exchange: how bytes cross ranks (transport.decide)
    lora: Path | None = None  # --lora: an adapter to merge into the model as it is written
    target_model: str | None = None  # --target-model: gpt | hybrid (None: the source's model class)


def load_index(path: Path, fmt_name: str, rt: Runtime, vocab_size: int | None,
               options: FormatOptions) -> tuple[Format, SourceIndex]:
    refuse_incomplete(path)  # an interrupted conversion's output is not a checkpoint yet
    fmt = detect_format(path, options) if fmt_name == "auto" else get_format(fmt_name, options)
    return fmt, fmt.index(path, rt, vocab_size)


def sliced(index: SourceIndex, files: list[TargetFile], budget: int) -> SourceIndex:
    """The index with sliceable chunks cut to what each target piece needs (see cuts.split_chunks)."""
    if not any(c.sliceable for c in index.chunks):
        return index
    return dataclasses.replace(index, chunks=split_chunks(index.chunks, files, max(1, budget // 4)))


def logical_numel(index: SourceIndex) -> dict[str, int]:
    """Every logical tensor the conversion covers (with --optimizer: the optimizer state's too; an adapter
    source: the adapter's)."""
    if index.adapter is not None:
        return index.adapter.logical_numel()
    out = {name: numel(t.shape) for name, t in logical_tensors(index.cfg).items()}
    return out if index.optimizer is None else {**out, **optimizer_numel(index.cfg)}


def source_dtypes(index: SourceIndex) -> dict[str, torch.dtype]:
    """Each logical tensor's stored dtype (absent ones: the most common, so target files can list them)."""
    found = {p.logical: c.dtype for c in index.chunks for p in c.pieces}
    common = Counter(found.values()).most_common(1)[0][0] if found else torch.float32
    return {**dict.fromkeys(index.absent, common), **found}


def target_layout(opts: ReshardOptions, index: SourceIndex, dst_fmt: Format) -> Layout:
    src = index.layout
    if not dst_fmt.sharded:
        if any((x or 1) != 1 for x in (opts.target_tp, opts.target_pp, opts.target_vpp, opts.target_ep,
                                       opts.target_etp)) or opts.target_split or opts.target_pipeline_layout:
            raise ConvertError(f"--dst-format {dst_fmt.name} stores unsharded tensors; TP/PP/EP do not apply",
                               "drop --target-tp/--target-pp/--target-vpp/--target-ep/--target-etp/"
                               "--target-pipeline-layout (or set them to 1)")
        return Layout(tp=1, pp=1)
    pp = opts.target_pp or src.pp
    same_pp = pp == src.pp
    text = pipeline_layout_of(opts, src, pp)
    first = opts.target_first if opts.target_first is not None else (src.first if same_pp else None)
    last = opts.target_last if opts.target_last is not None else (src.last if same_pp else None)
    vpp = opts.target_vpp if opts.target_vpp is not None else (src.vpp if same_pp else None)
    if text is not None:  # the string decides VPP; no per-stage sizes with it
        first = last = None
        vpp = pipeline_vpp(text, pp)
    elif src.pipeline_layout is not None and opts.target_vpp is None:
        vpp = None  # the source's VPP came from its string, which this target drops
    split = opts.target_split if opts.target_split is not None else (src.split if same_pp else None)
    tp = opts.target_tp or src.tp
    # ETP follows TP unless the source had one of its own (e.g. ETP=1 under TP=2) or --target-etp is given; MoE
    # layers with linear biases (gpt-oss) take only ETP 1 in megatron-core
    biased_moe = bool(index.cfg.num_experts and index.cfg.add_bias_linear)
    etp = opts.target_etp or (src.etp if src.etp is not None else 1 if biased_moe else tp)
    layout = Layout(tp=tp, pp=pp, first=first if pp > 1 else None, last=last if pp > 1 else None,
                    vpp=vpp if vpp != 1 else None, split=split if pp > 1 or opts.target_split else None,
                    ep=opts.target_ep or src.ep, etp=None if etp == tp else etp, pipeline_layout=text)
    index.cfg.check_layout(layout)
    return layout


def pipeline_layout_of(opts: ReshardOptions, src: Layout, pp: int) -> str | None:
    """The target's layout string: --target-pipeline-layout (``none``: no string), else the source's when
    PP is kept and no other pipeline-stage flag is given."""
    stage_flags = any(x is not None for x in (opts.target_first, opts.target_last, opts.target_vpp))
    text = opts.target_pipeline_layout
    if text is None:
        return src.pipeline_layout if pp == src.pp and not stage_flags else None
    if text.lower() == "none":
        return None
    if opts.target_first is not None or opts.target_last is not None:
        raise ConvertError("--target-pipeline-layout places every layer; it cannot be combined with "
                           "--target-num-layers-in-first/last-stage", "drop one of them")
    if opts.target_vpp is not None and opts.target_vpp != (pipeline_vpp(text, pp) or 1):
        raise ConvertError(f"--target-vpp {opts.target_vpp} disagrees with --target-pipeline-layout {text!r}, "
                           f"which gives VPP={pipeline_vpp(text, pp) or 1} at PP={pp} (its stages / PP)",
                           "drop --target-vpp (the layout string sets VPP)")
    return text


def check_vocab(opts: ReshardOptions, index: SourceIndex, cfg: ModelConfig, layout: Layout) -> None:
    known = opts.vocab_size or getattr(index.args, "vocab_size", None)
    if not known and cfg.padded_vocab(layout.tp) != index.cfg.vocab_size:
        raise ConvertError(
            f"the true vocabulary size is unknown (args give only padded_vocab_size={index.cfg.vocab_size}) and "
            f"TP={layout.tp} needs different padding",
            "pass --vocab-size with the tokenizer's vocabulary size")


def carry_vocab_padding(opts: ReshardOptions, index: SourceIndex, cfg: ModelConfig, layout: Layout,
                        rt: Runtime) -> tuple[SourceIndex, ModelConfig]:
    """Resuming training (--optimizer): the vocabulary padding rows source and target share are trained values
    (they enter the loss's softmax) that megatron-core keeps when it reshards, weights and optimizer state alike.
    They travel as rows of the logical tensors: the source is indexed again with that many rows as its
    vocabulary (the target's args keep the true one)."""
    rows = min(index.cfg.padded_vocab(index.layout.tp), cfg.padded_vocab(layout.tp))
    if rows == cfg.vocab_size:
        return index, cfg
    _, again = load_index(opts.src, opts.src_format, rt, rows, opts.formats)
    again = as_model_class(again, opts.target_model, "torch_dist")  # the only target with optimizer state
    again.notes.append(f"carrying the {rows - cfg.vocab_size} vocabulary padding rows source and target share "
                       f"(rows {cfg.vocab_size}-{rows - 1}), as megatron-core's own resharding keeps them")
    return again, cfg.replace(vocab_size=rows)


@dataclass(frozen=True, kw_only=True)
class Prepared:
    """What a conversion is before it runs: the source index, the target and its files (split for ``world``)."""

    src_fmt: Format
    dst_fmt: Format
    index: SourceIndex
    target: Target
    files: list[TargetFile]


def prepare(opts: ReshardOptions, rt: Runtime, world: int) -> Prepared:
    """Collective (the index): check the options, index the source, lay out the target and its files."""
    if opts.dtype not in DTYPES:
        raise ConvertError(f"unknown --dtype {opts.dtype}", f"use one of {', '.join(DTYPES)}")
    f = opts.formats
    for flag, path in (("--tokenizer-dir", f.tokenizer_dir), ("--tokenizer-model", f.tokenizer_model),
                       ("--tokenizer-vocab-file", f.tokenizer_vocab_file)):
        if path is not None and not path.exists():
            raise ConvertError(f"{flag} {path} does not exist", f"pass an existing path to {flag}")
    src_fmt, index = load_index(opts.src, opts.src_format, rt, opts.vocab_size, opts.formats)
    dst_fmt = get_format(adapter_target(opts, index, src_fmt.name), opts.formats)
    index = as_model_class(index, opts.target_model, dst_fmt.name)
    if f.nemo_style and dst_fmt.name != "nemo":
        raise ConvertError(f"--nemo-style applies to .nemo targets, not {dst_fmt.name}",
                           "drop --nemo-style or pass --dst-format nemo")
    if f.quantize and dst_fmt.name != "hf":
        raise ConvertError(f"--quantize {f.quantize} applies to hf targets, not {dst_fmt.name}",
                           "drop --quantize or pass --dst-format hf")
    if f.optimizer and dst_fmt.name != "torch_dist":
        raise ConvertError(f"--optimizer writes the optimizer state into a torch_dist target, not {dst_fmt.name}",
                           "pass --dst-format torch_dist, or drop --optimizer to convert the model alone")
    if f.torch_dist_style and dst_fmt.name not in ("torch_dist", "megatron"):
        raise ConvertError(f"--mcore-style applies to torch_dist and megatron targets, not {dst_fmt.name}",
                           "drop --mcore-style or pass --dst-format torch_dist / megatron")
    refuse_features(index.cfg, dst_fmt.holds, f"a {dst_fmt.name} target", "converting without it would drop it; "
                    f"pass --dst-format {' or '.join(formats_holding(index.cfg))}")
    layout = target_layout(opts, index, dst_fmt)
    spec = opts.target_spec or index.cfg.spec
    # MLA's down-projections: split over TP in the local spec, replicated in today's TE spec (the source's
    # own choice stays when the spec does)
    cfg = index.cfg.replace(spec=spec, make_vocab_size_divisible_by=index.cfg.make_vocab_size_divisible_by
                            if opts.vocab_divisible_by is None else opts.vocab_divisible_by)
    if cfg.mla is not None and spec != index.cfg.spec:
        cfg = cfg.replace(mla__down_split=spec == "local")
    if cfg.mla or cfg.vision or cfg.mamba:
        cfg.check_layout(layout)  # the target spec decides how MLA's down-projections split; a tower, a hybrid
        # stack need TE's
    if dst_fmt.sharded:
        check_vocab(opts, index, cfg, layout)
    elif not (opts.vocab_size or getattr(index.args, "vocab_size", None)):
        index.notes.append(f"the true vocabulary size is unknown: exporting all {cfg.vocab_size} (padded) rows; "
                           "pass --vocab-size to strip the padding")
    true_vocab = cfg.vocab_size
    if index.optimizer is not None:
        index, cfg = carry_vocab_padding(opts, index, cfg, layout, rt)
    dtype = DTYPES[opts.dtype]
    args = args_for_target(index.args, cfg, layout, dtype, MLM_CKPT_FORMAT.get(dst_fmt.name),
                           optimizer_saved=index.optimizer is not None, tokenizer=index.origin.tokenizer)
    args.vocab_size = true_vocab
    index.notes.extend(index.origin.missing())
    index.warnings.extend(reader_warnings(cfg, dst_fmt.name))  # said at the start and again under the summary
    target = Target(cfg=cfg, layout=layout, dtype=dtype, args=args, iteration=index.iteration,
                    style=index.style if index.format == dst_fmt.name else None,
                    optimizer=index.optimizer and index.optimizer.for_layout(cfg, layout), origin=index.origin,
                    adapter=index.adapter)
    files = omit_absent(dst_fmt.target_files(target, source_dtypes(index)), index.absent)
    # before anything is written: the target holds every logical tensor of the source, or says it drops it
    check_coverage(files, logical_numel(index), index.absent,
                   index.adapter.twin_a() if index.adapter is not None else frozenset())
    if dst_fmt.any_writer:  # give every rank a part to write
        files = split_files(files, world)
    return Prepared(src_fmt=src_fmt, dst_fmt=dst_fmt, index=index, target=target, files=files)


ADAPTER_TARGETS = {"hf": "peft", "peft": "peft", "torch_dist": "bridge_lora", "bridge": "bridge_lora",
                   "bridge_lora": "bridge_lora"}


def adapter_target(opts: ReshardOptions, index: SourceIndex, src_format: str) -> str:
    """The target format's name: ``--dst-format`` (default: the source's); for an adapter source the adapter
    format of that side (hf: a peft directory; torch_dist, bridge: a Megatron-Bridge LoRA checkpoint)."""
    name = opts.dst_format or src_format
    if opts.lora is not None and (index.adapter is not None or opts.formats.optimizer):
        raise ConvertError("--lora merges an adapter into a whole model; " + (
            f"the source {opts.src} is an adapter itself" if index.adapter is not None else
            "the optimizer state (--optimizer) is of the model without it"),
            "pass the base model as SRC" if index.adapter is not None else "drop --optimizer (or --lora)")
    if index.adapter is None:
        if name in ADAPTER_FORMATS:
            raise ConvertError(f"--dst-format {name} writes LoRA adapters, and {opts.src} is a whole model",
                               "convert an adapter (SRC = a peft directory or a Megatron-Bridge LoRA checkpoint), or "
                               "merge one into the model with --lora")
        return name
    if name not in ADAPTER_TARGETS:
        raise ConvertError(f"{opts.src} is a LoRA adapter; --dst-format {name} holds whole models",
                           "pass --dst-format hf (an HF peft directory) or torch_dist (a Megatron-Bridge LoRA "
                           "checkpoint), or merge the adapter into its base: reshard BASE DST --lora ADAPTER")
    if opts.formats.optimizer:
        raise ConvertError("--optimizer converts a model's optimizer state; the source is an adapter",
                           "drop --optimizer")
    return ADAPTER_TARGETS[name]


def reshard(opts: ReshardOptions, rt: Runtime) -> dict:
    t0 = time.perf_counter()
    clock.reset()
    refuse_existing(opts.dst, opts.overwrite)
    with phase("index"):
        p = prepare(opts, rt, rt.world)
    src_fmt, dst_fmt, index, target, files = p.src_fmt, p.dst_fmt, p.index, p.target, p.files
    layout = target.layout
    merger = open_adapter(opts.lora, index, rt, opts.formats) if opts.lora is not None else None
    run = {"dst_format": dst_fmt.name, "src": str(opts.src.resolve()), "src_format": index.format,
           "iteration": index.iteration, "files": len(files)}
    if opts.lora is not None:
        run["lora"] = str(opts.lora.resolve())
    marker = {**run, "world": rt.world, "fingerprint": fingerprint(files, run)}
    staging = stage(opts.dst, rt, marker=marker, resume=opts.resume, overwrite=opts.overwrite)
    with staging.guard():
        finished = staging.resumed(files) if opts.resume else {}
        todo = [f for f in files if f.id not in finished]
        with phase("plan"):
            index = sliced(index, todo, opts.memory_budget)
            work = merger.work_files(todo, source_dtypes(index)) if merger is not None else todo  # uncast: merged
            plan = make_plan(index.chunks, work, rt.world, opts.memory_budget, logical_numel(index),
                             absent=index.absent)
        rt.log(f"[bold]reshard[/] {index.format} {index.layout} -> {dst_fmt.name} {layout}  "
               f"({len(index.chunks)} source chunks, {human_bytes(index.nbytes)}; {len(files)} target files"
               f"{f', {len(finished)} finished before (--resume)' if opts.resume else ''}; {rt.world} ranks; "
               f"{len(plan.waves)} waves)")
        for note in index.notes + ([dcp_note] if getattr(dst_fmt, "writes_dcp", False) and (dcp_note := writer_note())
                                   else []):
            rt.log(f"note: {note}")
        for warning in index.warnings:
            rt.log(f"[yellow]warning[/]: {warning}")
        nonfinite: dict[str, tuple[int, int]] = {}
        counters, write_s, my_files = _convert_into(staging, target, index, src_fmt, dst_fmt, files, plan, rt,
                                                    opts.memory_budget, exchange=opts.exchange, work=work,
                                                    merge=merger, nonfinite=nonfinite)
        if note := nonfinite_note(rt.all_gather_object(nonfinite)):
            rt.log(f"note: {note}")
        with phase("finalize"):
            artifact = on_rank0(rt, lambda: package(dst_fmt, staging.tmp, opts.dst, rt.rank))
    with phase("finalize"):
        staging.commit(artifact)
    wall = time.perf_counter() - t0
    mine = RankStats(rank=rt.rank, files=len(my_files), tensors=sum(len(f.tensors) for f in my_files),
                     read_bytes=counters["read"] + (merger.reader.read_bytes if merger is not None else 0),
                     written_bytes=sum(f.stored_nbytes for f in my_files),  # as stored (packed, when quantized)
                     sent_bytes=counters["sent"],
                     received_bytes=counters["received"], write_s=write_s, wall_s=wall,
                     peak_rss=peak_rss_bytes(), exchange_s=counters.get("exchange_ns", 0) / 1e9,
                     peak_gpu=peak_gpu_bytes(rt), device=str(rt.device), phases=clock.report(wall))
    stats = rt.all_gather_object(mine)
    print_summary(rt, stats, f"wrote {opts.dst} ({dst_fmt.name}, {layout})", warnings=index.warnings)
    if opts.stats_json is not None and rt.rank == 0:
        opts.stats_json.write_text(json.dumps([dataclasses.asdict(s) for s in stats]))
    return {"plan": plan, "stats": stats}


def package(fmt: Format, tmp: Path, dst: Path, rank: int) -> Path:
    """Rank 0, after every rank wrote: what to rename into ``dst`` (e.g. a ``.nemo`` archive streamed from
    ``tmp``); the other ranks wait for it on the patient group, however long it takes."""
    faults.reached("package", rank)
    try:
        return fmt.package(tmp, dst)
    except OSError as e:
        raise write_error(e, dst, tmp) from None


class BackgroundWrites:
    """Completed target tensors written in a thread (``threaded``: with cores to spare, runtime.overlap_io),
    in order, while the next waves are read and exchanged; at most ``depth`` wait. A write's error is raised
    by the next ``put`` (so the run stops at the next wave) and kept in ``error``."""

    def __init__(self, write: Callable[[int, int, int | None, torch.Tensor], None], depth: int = 2,
                 threaded: bool = True) -> None:
        self.write, self.depth, self.threaded = write, depth, threaded
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="write")
        self.pending: deque[Future] = deque()
        self.error: ConvertError | None = None

    def _reap(self, keep: int) -> None:
        while len(self.pending) > keep:
            try:
                self.pending.popleft().result()
            except ConvertError as e:
                self.error = self.error or e

    def put(self, fid: int, j: int, first_row: int | None, tensor: torch.Tensor) -> None:
        if not self.threaded:
            self.write(fid, j, first_row, tensor)
            return
        self._reap(self.depth)
        if self.error is not None:
            raise self.error
        self.pending.append(self.pool.submit(self.write, fid, j, first_row, tensor))

    def drain(self) -> None:
        """Wait for every write (their errors in ``error``; other exceptions propagate)."""
        try:
            self._reap(0)
        finally:
            self.pool.shutdown(wait=True)


def _convert_into(staging: Staging, target: Target, index: SourceIndex, src_fmt: Format, dst_fmt: Format,
                  files: list[TargetFile], plan: Plan, rt: Runtime,
                  budget: int, *, exchange: str = "auto", work: list[TargetFile] | None = None,
                  merge: Merger | None = None, nonfinite: dict[str, tuple[int, int]] | None = None
                  ) -> tuple[dict[str, int], float, list[TargetFile]]:
    """Collective: exchange this rank's tensors and write each as soon as it is complete (the writer
    streams tensors or whole files; each finished file is journaled with its checksum), then rank 0
    writes metadata, tracker and checksum manifest last. ``work``: the files as the plan moves them (``merge``'s
    float32 working copies of the tensors an adapter is merged into)."""
    tmp = staging.tmp
    prefix = data_dir(dst_fmt, index.iteration)
    tmp_iter = tmp / prefix if prefix else tmp
    error: ConvertError | None = None
    try:
        if rt.rank == 0:
            tmp_iter.mkdir(exist_ok=True)
    except OSError as e:
        error = write_error(e, tmp_iter, tmp)
    stop_on_error(rt, error)  # every rank learns of a failure here: none goes on writing alone
    by_id = {f.id: f for f in files}
    my_files = [by_id[i] for i in plan.files_of(rt.rank)]
    journal: Journal | None = None
    try:
        journal = Journal(tmp, rt.rank, prefix)
        writer = dst_fmt.open_writer(target, tmp_iter, my_files, rt)
    except ConvertError as e:
        error = e
    except (OSError, RuntimeError) as e:
        error = write_error(e, tmp_iter, tmp)
    if error is not None and journal is not None:
        journal.close()
    stop_on_error(rt, error)
    assert journal is not None
    write_s = 0.0

    def finished(written: list[WrittenFile]) -> None:
        for w in written:
            journal.add(w)
            faults.reached("file", rt.rank)

    def write(fid: int, j: int, first_row: int | None, tensor: torch.Tensor) -> None:
        nonlocal write_s
        tw = time.perf_counter()
        try:
            with phase("write"):
                finished(writer.put(by_id[fid], j, tensor) if first_row is None else
                         writer.put_rows(by_id[fid], j, first_row, tensor))
        except ConvertError:  # a refusal of the writer's (e.g. --quantize of non-finite values): as it is
            raise
        except Exception as e:  # noqa: BLE001 - a failed write stops every rank at the next wave
            raise write_error(e, tmp_iter / by_id[fid].name, tmp) from e
        write_s += time.perf_counter() - tw

    overlap = overlap_io(local_ranks(rt))
    background = BackgroundWrites(write, threaded=overlap)
    # a writer that takes row blocks (DCP formats) gets tensors in blocks: memory stays flat as they grow, and a
    # block one transfer fills is written from the read or receive buffer itself
    blocks = block_bytes(budget) if dst_fmt.row_blocks else None
    working = {f.id: f for f in work or files}
    out = Assembly([working[f.id] for f in my_files], plan, rt.rank, background.put, block_bytes=blocks, merge=merge)
    try:
        try:
            counters = execute(plan, rt, {c.id: c for c in index.chunks}, lambda cs: src_fmt.read(index, cs), out,
                               read_ahead=overlap, exchange=exchange, nonfinite=nonfinite)
            tw = time.perf_counter()
            with phase("write"):
                out.finish()
        finally:
            background.drain()
        error = out.error or background.error
        if error is None:
            try:
                with phase("write"):
                    finished(writer.close())
            except ConvertError as e:
                error = e
            except Exception as e:  # noqa: BLE001 - as in done()
                error = write_error(e, tmp_iter, tmp)
        stop_on_error(rt, error)
        write_s += time.perf_counter() - tw
    finally:
        try:
            journal.close()
        except OSError as e:  # the journal's last flush: as any write (every rank meets below, or has failed)
            close_error = write_error(e, tmp / ".dist_convert_journal", tmp)
        else:
            close_error = None
    stop_on_error(rt, close_error)

    def metadata(entries: dict[int, Entry]) -> None:
        lost = [f.name for f in files if f.id not in entries]
        assert not lost, f"target files never written: {lost[:3]}"
        dst_fmt.finalize(target, tmp_iter, [entries[f.id].written(prefix) for f in files])

    with phase("finalize"):
        staging.complete(metadata, tracker=index.iteration if dst_fmt.iteration_dirs else None)
    return counters, write_s, my_files
