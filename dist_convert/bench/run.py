"""``python -m dist_convert bench`` (run by ``bench.main``): make (or take) a checkpoint, then per target layout
time the I/O floor, dist_convert at each world size, the whole-model baseline, megatron-core and (from a Hugging
Face source) Megatron-Bridge's import, interleaved rep by rep."""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConvertError
from ..runtime import _console, human_bytes
from . import bridge, measure, report
from .args import DEFAULT_TARGETS, ITEMSIZE, METHODS, parse_targets
from .measure import MethodFailed, Outcome, Run
from .shape import LlamaShape, choose_shape, lcm


@dataclass(frozen=True, kw_only=True)
class Source:
    path: Path
    format: str
    tp: int
    pp: int
    nbytes: int
    files: list[Path]
    shape: str
    make_s: float | None = None
    adapter: Path | None = None  # --lora: the synthetic adapter merged by the lora method


def check_options(ns: argparse.Namespace) -> tuple[list[str], list[tuple[int, int]]]:
    methods = [m.strip() for m in ns.methods.split(",") if m.strip()]
    if not methods or set(methods) - set(METHODS):
        raise ConvertError(f"--methods {ns.methods!r} names unknown methods", f"choose among {','.join(METHODS)}")
    if ns.reps < 1:
        raise ConvertError(f"--reps {ns.reps} is not positive", "pass --reps 1 or more")
    if ns.targets and (ns.target_tp or ns.target_pp):
        raise ConvertError("--targets and --target-tp/--target-pp both given", "pass one of them")
    targets = ns.targets or ([(ns.target_tp or ns.src_tp, ns.target_pp or ns.src_pp)]
                             if ns.target_tp or ns.target_pp else parse_targets(DEFAULT_TARGETS))
    if min(min(t) for t in targets) < 1 or min(ns.src_tp, ns.src_pp) < 1:
        raise ConvertError("TP and PP must be >= 1", "fix --src-tp/--src-pp/--target-tp/--target-pp/--targets")
    if ns.optimizer and (ns.src or ns.format != "torch_dist" or ns.sizes):
        raise ConvertError("bench --optimizer writes a synthetic torch_dist checkpoint with optimizer state",
                           "drop --src/--sizes and use --format torch_dist, or drop --optimizer")
    if ns.release and (ns.src or ns.sizes or ns.plan_scale or ns.optimizer or ns.lora or ns.targets
                       or len(ns.ranks or [2]) > 1):
        raise ConvertError(f"--release {ns.release} makes its own release and times one import and one export",
                           "drop --src/--sizes/--plan-scale/--optimizer/--lora/--targets, and give --ranks one "
                           "world size (or none: 2)")
    if ns.sizes and ns.src:
        raise ConvertError("--sizes makes synthetic checkpoints; --src names an existing one", "drop one of them")
    if ns.plot:
        report.check_plot_available()
    if ns.drop_caches and not os.access("/proc/sys/vm/drop_caches", os.W_OK):
        raise ConvertError("--drop-caches needs write access to /proc/sys/vm/drop_caches", "run as root or drop it")
    if "bridge" in methods:
        ns.bridge_python = bridge.bridge_python(ns.bridge_python)
    return methods, targets


def make_source(ns: argparse.Namespace, size: int, targets: list[tuple[int, int]], work: Path) -> Source:
    """A synthetic checkpoint written by dist_convert's writers under torchrun (one rank per rank file);
    an hf one (one directory, no layout) by one process."""
    from .synth import shape_json

    shape: LlamaShape = choose_shape(size, ITEMSIZE[ns.dtype], lcm([ns.src_tp] + [t for t, _ in targets]),
                                     lcm([ns.src_pp] + [p for _, p in targets]))
    out = work / f"src_{size}"
    measure.remove(out)
    (work / f"src_{size}.config.json").write_text(json.dumps(shape.config()))  # for tests/oracles/mcore.py
    tp, pp = (1, 1) if ns.format == "hf" else (ns.src_tp, ns.src_pp)
    args = ("dist_convert.bench.synth", "--out", str(out), "--shape", shape_json(shape), "--format", ns.format,
            "--tp", str(tp), "--pp", str(pp), "--dtype", ns.dtype, "--seed", str(ns.seed),
            *(("--optimizer",) if ns.optimizer else ()))
    cmd = measure.torchrun(tp * pp, *args) if tp * pp > 1 else measure.python_module(*args)
    _console.print(f"[bold]bench[/] writing a synthetic {ns.format} checkpoint at TP={tp} PP={pp}: "
                   f"{shape} ({ns.dtype}, {human_bytes(shape.nbytes(ITEMSIZE[ns.dtype]))})")
    try:
        wall = measure.run_command(cmd, ns.timeout)
    except MethodFailed as e:
        raise ConvertError(f"writing the synthetic checkpoint failed ({e})", "check --src-tp/--src-pp/--size") from None
    files = measure.source_files(out)
    return Source(path=out, format=ns.format, tp=tp, pp=pp, nbytes=measure.total_bytes(files), files=files,
                  shape=str(shape), make_s=wall, adapter=make_adapter(ns, out, work))


def make_adapter(ns: argparse.Namespace, base: Path, work: Path) -> Path | None:
    """--lora R: a synthetic peft adapter of rank R of ``base`` (None without --lora)."""
    if not ns.lora:
        return None
    out = work / f"{base.name}_lora{ns.lora}"
    measure.remove(out)
    try:
        measure.run_command(measure.python_module("dist_convert.bench.synth_lora", "--base", str(base), "--out",
                                                  str(out), "--rank", str(ns.lora), "--seed", str(ns.seed)),
                            ns.timeout)
    except MethodFailed as e:
        raise ConvertError(f"writing the synthetic adapter failed ({e})", "check --lora") from None
    return out


def existing_source(path: Path) -> Source:
    from ..convert import load_index
    from ..formats.base import FormatOptions
    from ..runtime import Runtime

    fmt, index = load_index(path, "auto", Runtime(), None, FormatOptions(trust_pickle=True))
    if fmt.name not in ("torch_dist", "megatron", "hf"):
        raise ConvertError(f"--src {path} is {fmt.name}; bench compares torch_dist, megatron or hf checkpoints",
                           "pass a torch_dist or megatron checkpoint or a Hugging Face model directory to --src")
    files = measure.source_files(path)
    cfg = index.cfg
    shape = f"{cfg.num_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}"
    return Source(path=path, format=fmt.name, tp=index.layout.tp, pp=index.layout.pp, nbytes=measure.total_bytes(files),
                  files=files, shape=shape)


Job = tuple[Outcome, Callable[[Path, Path], Run]]


def jobs(src: Source, tp: int, pp: int, ranks: list[int], methods: list[str], ns: argparse.Namespace) -> list[Job]:
    """Each method as (its outcome record, a function timing one run into (dst, stats file))."""
    out: list[Job] = []
    if "floor" in methods:
        out.append((Outcome(method="floor", label="I/O floor", world=None),
                    lambda dst, _: measure.time_floor(src.files, dst)))
    if "startup" in methods:
        def helped(dst: Path, stats: Path) -> Run:
            return Run(wall_s=measure.run_command(measure.python_module("dist_convert", "--help"), ns.timeout))
        out.append((Outcome(method="help", label="dist_convert --help", world=None), helped))
        launchers = ("nproc", "torchrun") if "torchrun" in methods else ("nproc",)  # torchrun: for reference
        for w, launcher in [(n, k) for n in ranks for k in launchers[:1 + (n > 1)]]:
            def start(dst: Path, stats: Path, w: int = w, launcher: str = launcher) -> Run:
                args = ("dist_convert.bench.startup", "--stats-json", str(stats))
                cmd = measure.torchrun(w, *args) if launcher == "torchrun" else \
                    measure.python_module(*args, *(("--nproc", str(w)) if w > 1 else ()))
                return measure.time_job(cmd, stats, measure.parse_dist_convert, ns.timeout)
            name = "startup" if launcher == "nproc" else "startup_torchrun"
            out.append((Outcome(method=name, label=f"start-up{' torchrun' if name != 'startup' else ''} w={w}",
                                world=w), start))
    if "dist_convert" in methods:
        # one process, or `--nproc w` (dist_convert's own launch); --optimizer: each world size also converts the
        # optimizer state (method "optimizer", beside the weights); --lora: also merges an adapter (method "lora")
        variants = [()] + [("--optimizer",)] * bool(ns.optimizer) + [("--lora", str(src.adapter))] * bool(src.adapter)
        for w, flags in [(w, f) for w in ranks for f in variants]:
            def dc(dst: Path, stats: Path, w: int = w, flags: tuple[str, ...] = flags) -> Run:
                cmd = measure.python_module(
                    "dist_convert", "reshard", str(src.path), str(dst), "--target-tp", str(tp), "--target-pp", str(pp),
                    "--memory-budget", str(ns.memory_budget), "--stats-json", str(stats),
                    *(bridge.DIST_CONVERT_HF_FLAGS if src.format == "hf" else ()), *flags,
                    *(("--nproc", str(w)) if w > 1 else ()))
                return measure.time_job(cmd, stats, measure.parse_dist_convert, ns.timeout)
            name = flags[0].removeprefix("--") if flags else "dist_convert"
            out.append((Outcome(method=name, label=f"dist_convert{' ' + flags[0] if flags else ''} w={w}", world=w),
                        dc))
    if "exchange" in methods:  # the same reshard over shared memory and over gloo (transport.py)
        for w, path in [(w, p) for w in ranks if w > 1 for p in ("shm", "gloo")]:
            def ex(dst: Path, stats: Path, w: int = w, path: str = path) -> Run:
                cmd = measure.python_module(
                    "dist_convert", "reshard", str(src.path), str(dst), "--target-tp", str(tp), "--target-pp", str(pp),
                    "--memory-budget", str(ns.memory_budget), "--stats-json", str(stats), "--exchange", path,
                    *(bridge.DIST_CONVERT_HF_FLAGS if src.format == "hf" else ()), "--nproc", str(w))
                return measure.time_job(cmd, stats, measure.parse_dist_convert, ns.timeout)
            out.append((Outcome(method=f"exchange_{path}", label=f"dist_convert --exchange {path} w={w}", world=w), ex))
    if "whole_model" in methods:
        o = Outcome(method="whole_model", label="whole-model w=1", world=1)
        if src.format == "hf":
            o.status, o.reason = "n/a", "the whole-model baseline converts torch_dist or megatron checkpoints"

        def whole(dst: Path, stats: Path) -> Run:
            cmd = measure.python_module("dist_convert.bench.baselines", str(src.path), str(dst), "--tp", str(tp),
                                        "--pp", str(pp), "--stats-json", str(stats))
            return measure.time_job(cmd, stats, measure.parse_single, ns.timeout)
        out.append((o, whole))
    if "mcore" in methods:
        o = Outcome(method="mcore", label=f"mcore load+save w={tp * pp}", world=tp * pp)
        if src.format == "hf":
            o.status, o.reason = "n/a", "megatron-core loads Megatron checkpoints (for an hf source: --methods bridge)"
        elif src.format != "torch_dist":
            o.status, o.reason = "n/a", "dist_checkpointing reads torch_dist; legacy files load only at their layout"
        elif importlib.util.find_spec("megatron.core") is None:
            o.status, o.reason = "n/a", "megatron-core is not installed"

        def mc(dst: Path, stats: Path) -> Run:
            cmd = measure.torchrun(tp * pp, "dist_convert.bench.mcore_job", str(src.path), str(dst), "--tp", str(tp),
                                   "--pp", str(pp), "--stats-json", str(stats))
            return measure.time_job(cmd, stats, measure.parse_mcore, ns.timeout)
        out.append((o, mc))
    if "bridge" in methods:
        o = Outcome(method="bridge", label=f"Megatron-Bridge import w={tp * pp}", world=tp * pp)
        reason = bridge.why_not(ns.bridge_python, src.format)
        if reason:
            o.status, o.reason = "n/a", reason

        def br(dst: Path, stats: Path) -> Run:
            cmd = bridge.command(ns.bridge_python, src.path, dst, tp, pp, stats)
            return measure.time_job(cmd, stats, measure.parse_mcore, ns.timeout)
        out.append((o, br))
    return out


def measure_target(src: Source, tp: int, pp: int, ranks: list[int], methods: list[str], ns: argparse.Namespace,
                   work: Path) -> list[Outcome]:
    """Every method, ``--reps`` times, interleaved (rep 1 of each, then rep 2, ...) so drift hits all alike.
    With a bridge method, the last outputs of bridge and dist_convert are kept until they are compared."""
    todo = jobs(src, tp, pp, ranks, methods, ns)
    compared = {"bridge", "dist_convert"} if any(o.method == "bridge" and o.status == "ok" for o, _ in todo) else set()
    base = work / f"out_tp{tp}_pp{pp}"
    base.mkdir(parents=True, exist_ok=True)
    for rep in range(ns.reps):
        for i, (o, fn) in enumerate(todo):
            if o.status != "ok":
                continue
            dst, stats = base / f"{i}_{o.method}", base / f"{i}.stats.json"
            measure.remove(dst)
            if ns.drop_caches:
                measure.drop_caches()
            try:
                o.runs.append(fn(dst, stats))
                r = o.runs[-1]
                r.detail["load1"] = os.getloadavg()[0]  # 1-minute load average just after the run
                _console.print(f"  TP={tp} PP={pp} {o.label} rep {rep + 1}/{ns.reps}: {r.wall_s:.2f} s"
                               + (f" (in-process {r.inproc_s:.2f} s)" if r.inproc_s is not None else ""))
            except MethodFailed as e:
                o.status, o.reason = ("n/a" if o.method == "mcore" else "failed"), str(e)
                _console.print(f"  [red]{o.label} failed[/]: {e}")
            if (ns.keep or o.method in compared) and rep == ns.reps - 1 and o.method != "floor" and dst.exists():
                o.output = str(dst)
            else:
                measure.remove(dst)
    outcomes = [o for o, _ in todo]
    for o in outcomes:
        if o.method in ("dist_convert", "optimizer") and o.status == "ok" and o.world and not ns.no_predict:
            o.predicted_rss = predicted_rss(src, tp, pp, o.world, o.method == "optimizer", ns, base)
    if compared:
        bridge.check_agreement(outcomes)
        for o in outcomes:
            if not ns.keep and o.method in compared and o.output:
                measure.remove(Path(o.output))
                o.output = None
    return outcomes


def predicted_rss(src: Source, tp: int, pp: int, world: int, optimizer: bool, ns: argparse.Namespace,
                  work: Path) -> int | None:
    """The busiest rank's peak RSS that ``dist_convert plan`` predicts for this run (None: the plan failed)."""
    out = work / f"plan_w{world}{'_opt' if optimizer else ''}.json"
    cmd = measure.python_module("dist_convert", "plan", str(src.path), "--target-tp", str(tp), "--target-pp", str(pp),
                                "--world", str(world), "--memory-budget", str(ns.memory_budget), "--json", str(out),
                                *(bridge.DIST_CONVERT_HF_FLAGS if src.format == "hf" else ()),
                                *(("--optimizer",) if optimizer else ()))
    try:
        measure.run_command(cmd, ns.timeout)
    except MethodFailed as e:
        _console.print(f"  [red]plan failed[/]: {e}")
        return None
    return max(r["predicted_peak_rss"] for r in json.loads(out.read_text())["ranks"])


def run_targets(ns: argparse.Namespace, methods: list[str], targets: list[tuple[int, int]], work: Path) -> dict:
    src = existing_source(ns.src.resolve()) if ns.src else make_source(ns, ns.size, targets, work)
    if ns.src and ns.lora:
        src = dataclasses.replace(src, adapter=make_adapter(ns, src.path, work))
    _console.print(f"source: {src.format} TP={src.tp} PP={src.pp}, {len(src.files)} files, {human_bytes(src.nbytes)}"
                   + (f" (written in {src.make_s:.1f} s)" if src.make_s else ""))
    out = {"source": {"path": str(src.path), "format": src.format, "tp": src.tp, "pp": src.pp, "bytes": src.nbytes,
                      "files": len(src.files), "shape": src.shape, "dtype": ns.dtype, "make_s": src.make_s},
           "targets": []}
    for tp, pp in targets:
        t0 = time.perf_counter()
        rows = report.target_rows(measure_target(src, tp, pp, ns.ranks or [1, 2, 4], methods, ns, work), src.nbytes)
        name = f"TP={tp} PP={pp}"
        loads = [r["detail"]["load1"] for row in rows for r in row["runs"] if "load1" in r["detail"]]
        noise = f"; load average {min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} CPUs" if loads else ""
        report.print_table(f"{src.format} TP={src.tp} PP={src.pp} -> {name}: {human_bytes(src.nbytes)}, "
                           f"median of {ns.reps} ({time.perf_counter() - t0:.0f} s{noise})", rows)
        out["targets"].append({"name": name, "tp": tp, "pp": pp, "rows": rows})
        report.print_phases(report.phase_rows(rows))
        exchanges = report.exchange_rows(rows)
        if exchanges:
            out["targets"][-1]["exchange"] = exchanges
            report.print_exchange(exchanges)
        if any(r["method"] == "bridge" for r in rows):
            out["targets"][-1]["bridge"] = bridge.comparison(rows)
            report.print_bridge(f"Megatron-Bridge / dist_convert, hf -> torch_dist {name}, median of {ns.reps}",
                                out["targets"][-1]["bridge"], rows)
    return out
