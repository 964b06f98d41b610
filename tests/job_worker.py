"""A long-lived test worker: one launch runs many commands, so the suite pays the interpreter, torch,
megatron-core and process-group start-up once per (program, world size) instead of once per command.

  torchrun --standalone --nproc_per_node=N tests/job_worker.py --program cli|oracle --socket SOCK --spool DIR
  python tests/job_worker.py --program cli --socket SOCK --spool DIR        # one process, no torchrun

Every rank connects to the test session's Unix socket SOCK and says its rank; the session sends each
rank the same job (``{"id": n, "argv": [...], "cwd": dir or null}``, one JSON line, run in ``cwd``) and
every rank answers ``{"id": n, "rc": rc}`` once it has run it, with its stdout and stderr (file descriptors 1 and 2, so
C++ output too) in ``DIR/job{n}.rank{r}.out`` / ``.err``. Programs:
  * ``cli``: ``dist_convert.cli.main(argv)``; under torchrun in the worker's process group, joined once
    (``--backend``/``--timeout`` of a job do not apply); without torchrun exactly as one process runs it.
  * ``oracle``: ``argv[0]`` is ``mcore``, ``t5`` or ``spec``; the rest goes to ``main(..., serving=True)``
    of ``tests/oracles/mcore.py``, ``tests/oracles/t5.py`` or ``tests/oracles/spec.py``, which tears down
    megatron-core's model-parallel groups at the end of the job and keeps the process group.
After every job the ranks meet in a barrier: a job that broke the process group (a lost peer) ends the
worker, and the session starts a fresh one for the next job. EOF on the socket ends the worker.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing.util
import os
import socket
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def program(name: str) -> Callable[[list[str]], int]:
    if name == "cli":
        from dist_convert.cli import main
        from dist_convert.runtime import init_runtime

        if "RANK" not in os.environ:  # one process, as `python -m dist_convert` runs
            return main
        rt = init_runtime("gloo", 300.0)
        return lambda argv: main(argv, runtime=rt)
    if name == "oracle":  # each oracle (tests/oracles/) imported at its first job (the spec oracle needs ModelOpt)
        import importlib

        return lambda argv: importlib.import_module(f"oracles.{argv[0]}").main(argv[1:], serving=True)
    raise SystemExit(f"unknown program {name!r}")


def run_captured(run: Callable[[list[str]], int], argv: list[str], out: Path, err: Path) -> int:
    """``run(argv)`` with fds 1 and 2 sent to ``out`` and ``err``; SystemExit and uncaught exceptions
    become exit codes as they would for a process (a traceback and 1). The environment is the worker's again
    after each job, as a process's would be: a job's ``os.environ`` settings (Megatron-LM's attention backend sets
    NVTE_FUSED_ATTN) never reach the next job."""
    sys.stdout.flush()
    sys.stderr.flush()
    env = dict(os.environ)
    saved = os.dup(1), os.dup(2)
    with open(out, "wb") as fo, open(err, "wb") as fe:
        os.dup2(fo.fileno(), 1)
        os.dup2(fe.fileno(), 2)
        try:
            rc = run(argv)
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if e.code is not None and not isinstance(e.code, int):
                print(e.code, file=sys.stderr)
        except BaseException:  # noqa: BLE001 - a bug in the command: its traceback, as a process would print
            traceback.print_exc()
            rc = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.environ.clear()
            os.environ.update(env)
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
    return int(rc or 0)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--program", required=True, choices=("cli", "oracle"))
    p.add_argument("--socket", required=True)
    p.add_argument("--spool", type=Path, required=True)
    a = p.parse_args()
    sys.path.insert(1, str(ROOT))
    run = program(a.program)
    rank = int(os.environ.get("RANK", "0"))
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(a.socket)
    lines, reply = conn.makefile("r"), conn.makefile("w")
    reply.write(json.dumps({"rank": rank}) + "\n")
    reply.flush()
    import torch.distributed as dist

    for line in lines:
        job = json.loads(line)
        n = job["id"]
        os.chdir(job.get("cwd") or ROOT)  # a job may run elsewhere (docs examples use relative paths)
        try:
            rc = run_captured(run, job["argv"], a.spool / f"job{n}.rank{rank}.out", a.spool / f"job{n}.rank{rank}.err")
        finally:
            os.chdir(ROOT)
        healthy = True
        if dist.is_initialized():
            try:
                dist.barrier()
            except Exception:  # noqa: BLE001 - a peer is gone: this worker is done
                healthy = False
        reply.write(json.dumps({"id": n, "rc": rc}) + "\n")
        reply.flush()
        if not healthy:
            break
    # The session closed the socket, or a peer is gone. What a normal exit would stop goes first: the
    # multiprocessing children of this process (megatron-core's torch_dist save keeps a Manager server
    # for its whole life), which would otherwise outlive it. Then leave without the interpreter's
    # teardown, which aborts in a gloo group's destructor when the peers are already gone.
    multiprocessing.util._exit_function()
    os._exit(0)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import warnings

    warnings.filterwarnings("ignore")
    sys.exit(main())
