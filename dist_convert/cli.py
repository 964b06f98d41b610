"""Command line of dist_convert: ``torchrun --nproc_per_node=N dist_convert <reshard|speculate|inspect|verify> ...``
(or ``--nproc N`` without torchrun); ``plan`` and ``bench`` run in one process (``bench`` launches its own jobs).
The parser (``flags``) imports no torch: ``--help`` and ``--version`` stay fast."""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import TYPE_CHECKING

from .errors import ConvertError
from .flags import DEFAULT_TIMEOUT_S, build_parser, format_options

if TYPE_CHECKING:  # torch, the formats and the runtime are imported when a command runs, not to parse
    from .runtime import Runtime

__all__ = ["build_parser", "entry", "format_options", "leave", "main", "run"]


def run(ns: argparse.Namespace, rt: Runtime) -> int:
    if ns.cmd in ("reshard", "speculate"):
        from .staging import refuse_overlap
        for path, flag in ((ns.dst, "DST"), (getattr(ns, "export_draft", None), "--export-draft")):
            if path is not None:
                refuse_overlap(ns.src, path, flag)
    if ns.cmd in ("reshard", "plan"):
        from .convert import ReshardOptions, reshard
        formats = format_options(ns)
        opts = ReshardOptions(src=ns.src, dst=getattr(ns, "dst", None), src_format=ns.src_format,
                              dst_format=ns.dst_format,
                              target_tp=ns.target_tp, target_pp=ns.target_pp, target_first=ns.target_first,
                              target_last=ns.target_last, target_spec=ns.target_spec, target_vpp=ns.target_vpp,
                              vocab_size=ns.vocab_size, dtype=ns.dtype, memory_budget=ns.memory_budget,
                              overwrite=getattr(ns, "overwrite", False), vocab_divisible_by=ns.vocab_divisible_by,
                              formats=formats, target_split=ns.target_split, stats_json=getattr(ns, "stats_json", None),
                              resume=getattr(ns, "resume", False), target_ep=ns.target_ep, target_etp=ns.target_etp,
                              target_pipeline_layout=ns.target_pipeline_layout,
                              exchange=getattr(ns, "exchange", "auto"), lora=getattr(ns, "lora", None),
                              target_model=ns.target_model)
        if ns.cmd == "plan":
            from .estimate import estimate, print_estimate
            if ns.world < 1:
                raise ConvertError(f"--world {ns.world} is not a positive number of ranks", "pass --world 1 or more")
            est = estimate(opts, rt, ns.world, ns.read_gbps, ns.write_gbps or ns.read_gbps, ns.network_gbps)
            if rt.rank == 0:
                print_estimate(est, ns.json)
            return 0
        reshard(opts, rt)
        return 0
    if ns.cmd == "speculate":
        from .speculative.command import SpeculateOptions, speculate
        from .speculative.draft_config import DraftRequest
        draft = DraftRequest(eagle_layers=ns.eagle_layers, eagle_version=ns.eagle_version,
                             medusa_heads=ns.medusa_heads, medusa_layers=ns.medusa_layers, spec_config=ns.spec_config)
        speculate(SpeculateOptions(src=ns.src, dst=ns.dst, draft=draft, src_format=ns.src_format,
                                   target_tp=ns.target_tp, target_pp=ns.target_pp, target_first=ns.target_first,
                                   target_last=ns.target_last, export_draft=ns.export_draft, dtype=ns.dtype,
                                   vocab_size=ns.vocab_size, memory_budget=ns.memory_budget, overwrite=ns.overwrite,
                                   vocab_divisible_by=ns.vocab_divisible_by, formats=format_options(ns),
                                   dst_format=ns.dst_format, seed=ns.seed), rt)
        return 0
    if ns.cmd == "inspect":
        from .inspect_ckpt import describe, print_description
        info = describe(ns.ckpt, ns.format, rt, ns.vocab_size, format_options(ns), tensors=ns.tensors)
        if rt.rank == 0:
            print_description(info, ns.json)
        return 0
    if ns.checksums:
        from .integrity import check_checksums
        bad = False
        for path in [p for p in (ns.a, ns.b) if p is not None]:
            problems = check_checksums(path, rt)
            for line in problems[:20]:
                rt.log(f"[red]CHECKSUM[/] {path}: {line}")
            bad |= bool(problems)
            rt.log(f"[red]checksums failed[/]: {len(problems)} problems in {path}" if problems
                   else f"[green]checksums OK[/]: every file of {path} matches its manifest")
        if ns.b is None or bad:
            return 1 if bad else 0
    elif ns.b is None:
        raise ConvertError("verify needs B, the checkpoint to compare A with",
                           "pass B, or --checksums to check A alone")
    from .verify import verify
    mismatches = verify(ns.a, ns.b, rt, ns.a_format, ns.b_format, ns.atol, ns.rtol, ns.vocab_size,
                        format_options(ns), ns.memory_budget, exchange=ns.exchange)
    for m in mismatches[:20]:
        rt.log(f"[red]MISMATCH[/] {m.name}: {m.detail}")
    if mismatches:
        rt.log(f"[red]verify failed[/]: {len(mismatches)} logical tensors differ")
        return 1
    rt.log("[green]verify OK[/]: all logical tensors equal")
    return 0


def main(argv: list[str] | None = None, runtime: Runtime | None = None) -> int:
    """Parse ``argv`` and run the subcommand; errors become one ``dist_convert: error:`` line and exit 2.
    ``runtime``: an already joined process group to run in (kept open afterwards), instead of joining
    the torchrun job here and leaving it at the end."""
    ns = build_parser().parse_args(argv)
    if ns.cmd == "bench":  # one process that launches its own torchrun jobs
        from .bench.main import bench_main
        return bench_main(ns)
    if getattr(ns, "nproc", None) is not None and runtime is None and "LOCAL_RANK" not in os.environ:
        from .launch import self_launch
        return self_launch(ns.nproc, list(sys.argv[1:] if argv is None else argv))
    from . import interrupts

    if runtime is None:  # a real launch: SIGINT / SIGTERM end this rank with one line (rank 0's) and exit 130
        interrupts.install(_say if os.environ.get("RANK", "0") == "0" else lambda _text: None)
    try:
        return _main(ns, runtime)
    except interrupts.Interrupted:
        interrupts.announce()
        return interrupts.EXIT_CODE
    finally:
        interrupts.finished()


def _say(text: str) -> None:
    """One error line, in one write: other ranks' lines never land inside it, nor it after a progress bar's."""
    runtime = sys.modules.get(f"{__package__}.runtime")  # a progress bar is shown only where it was imported
    sys.stderr.write(f"{runtime.line_start() if runtime else ''}dist_convert: error: {text}\n")
    sys.stderr.flush()


PEER_SIGNAL_S = 0.3  # a rank that lost its peers waits this long for the signal that stops the job, if one comes


def _main(ns: argparse.Namespace, runtime: Runtime | None) -> int:
    from . import interrupts
    from .runtime import collective_failure, init_runtime, say_together

    rt = runtime
    timeout = getattr(ns, "timeout", DEFAULT_TIMEOUT_S)  # plan has no --timeout: one process, no collective waits
    if rt is None:
        try:
            rt = init_runtime(getattr(ns, "backend", "auto"), timeout)
        except ConvertError as e:  # a device the job cannot use: said once (the rank it concerns, or rank 0)
            if e.local:
                print(f"dist_convert: error: {e}", file=sys.stderr)
            else:
                say_together(e, timeout)
            return 2
        except (RuntimeError, ValueError) as e:
            if interrupts.received():
                raise interrupts.Interrupted(interrupts.received()) from None
            print(f"dist_convert: error: cannot start the process group ({e}); launch with torchrun", file=sys.stderr)
            return 2
    broken = False
    try:
        return run(ns, rt)
    except interrupts.Interrupted:
        broken = True  # the others are leaving too, or will learn of it from a failed collective
        raise
    except Exception as e:  # noqa: BLE001 - only our errors and failed collectives are reported as one line
        err = e if isinstance(e, ConvertError) else collective_failure(e, rt)
        if err is not None and err.group_broken and runtime is None:
            time.sleep(PEER_SIGNAL_S)  # a peer was interrupted: the launcher's SIGTERM is on its way
        if interrupts.received():  # a signal came while this rank stopped (e.g. its peers left on it first)
            broken = True
            raise interrupts.Interrupted(interrupts.received()) from None
        if err is None:  # a bug: the traceback; torchrun stops the other ranks (a barrier could wait forever)
            broken = True
            raise
        broken = err.group_broken
        if not err.quiet and (rt.rank == 0 or err.local):
            _say(str(err))
        return 2
    finally:
        if not broken and runtime is None:  # a failed collective leaves nothing to tear down together
            rt.close()


def leave(code: int) -> None:
    """Exit with ``code`` without the interpreter's teardown, which takes 0.4 s once torch is imported
    (measured on 2 cores): every file is closed and every thread joined by then; only the streams flush, and
    child processes a library started are stopped (megatron-core's torch_dist save starts a multiprocessing
    Manager, which the skipped teardown would leave running, orphaned, at 270 MB each)."""
    if "multiprocessing" in sys.modules:
        import multiprocessing

        for child in multiprocessing.active_children():
            child.terminate()
            child.join(timeout=5)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def entry() -> None:
    """The ``dist_convert`` command (and ``python -m dist_convert``)."""
    leave(main())


if __name__ == "__main__":
    entry()
