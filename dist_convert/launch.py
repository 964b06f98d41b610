"""``--nproc N``: dist_convert starts its own N local workers (what ``torchrun --standalone
--nproc_per_node=N`` does for one node), each running the same command line without ``--nproc``.

The launcher never imports torch: importing it takes about 2 s on a small machine, which torchrun's
launcher pays before its workers start to pay it again. Here the workers start at once and import torch
side by side. Each worker gets torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT; OMP_NUM_THREADS unless set); rank 0 hosts the rendezvous store. When a worker
fails the others are stopped; the workers print their own output and one-line errors, and the launcher
adds one line only for a worker that died without one (a signal). A SIGINT or SIGTERM to the launcher goes to
every worker (each stops with one line from rank 0 and exit 130); workers still running INTERRUPT_GRACE_S later get
SIGTERM, then SIGKILL, and a second signal to the launcher escalates at once."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

POLL_S = 0.02
GRACE_S = 10.0  # after a failure, how long the other workers get to leave before they are killed
INTERRUPT_GRACE_S = 10.0  # after a SIGINT / SIGTERM to the launcher, how long the workers get before SIGTERM
INTERRUPTED = 130  # the exit code of an interrupted run


def without_nproc(argv: list[str]) -> list[str]:
    """Pure: ``argv`` without ``--nproc N`` / ``--nproc=N``."""
    out, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        if a == "--nproc":
            skip = i + 1 < len(argv)
            continue
        if a.startswith("--nproc="):
            continue
        out.append(a)
    return out


def worker_env(base: dict[str, str], rank: int, nproc: int, port: int, cpus: int) -> dict[str, str]:
    """Pure: the environment of local worker ``rank`` of ``nproc`` (torchrun's variables for one node)."""
    env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
           "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "ROLE_WORLD_SIZE": str(nproc),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    env.setdefault("OMP_NUM_THREADS", str(max(1, cpus // nproc)))
    # torch's C++ warnings (a store or socket call failing as a peer leaves) would follow each one-line error
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    return env


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def exit_code(returncodes: Sequence[int | None], first: int | None) -> int:
    """Pure: 0 when no worker failed (``first`` is None), else the code of the worker that failed first
    (128 + N for signal N)."""
    if first is None:
        return 0
    code = returncodes[first] or 1
    return code if code > 0 else 128 - code


def _wait_all(procs: list[subprocess.Popen], codes: list[int | None], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while any(c is None for c in codes) and time.monotonic() < deadline:
        for i, p in enumerate(procs):
            if codes[i] is None:
                codes[i] = p.poll()
        time.sleep(POLL_S)


def _stop(procs: list[subprocess.Popen], codes: list[int | None],
          steps: tuple[signal.Signals | None, ...] = (None, signal.SIGTERM, signal.SIGKILL)) -> list[int]:
    """The workers still running after a failure: GRACE_S to leave by themselves (a rank that learns of a
    peer's failure prints its own error), then SIGTERM, then SIGKILL. Returns the workers this had to kill."""
    killed = []
    for sig in steps:
        if sig is not None:
            for i, (p, c) in enumerate(zip(procs, codes, strict=True)):
                if c is None and p.poll() is None:
                    p.send_signal(sig)
                    if sig == signal.SIGKILL:
                        killed.append(i)
        _wait_all(procs, codes, GRACE_S)
        if all(c is not None for c in codes):
            break
    return killed


def death_line(worker: int, returncode: int, interrupted: str | None, killed: bool) -> str | None:
    """Pure: the launcher's line for a worker that ended by a signal (it printed nothing of its own), else None.
    Only a SIGKILL nobody here sent suggests memory (the OOM killer's signal)."""
    if returncode >= 0:
        return None
    name = signal.Signals(-returncode).name
    if killed:
        return (f"interrupted ({interrupted or 'signal'}); local worker {worker} did not stop within "
                f"{INTERRUPT_GRACE_S:g} s and was killed ({name}); a DST.dist_convert_tmp it leaves is replaced by the "
                "next run, or continued with --resume")
    if interrupted:
        return f"interrupted ({interrupted}); local worker {worker} ended by {name} before it could clean up"
    if name == "SIGKILL":
        return (f"local worker {worker} was killed by SIGKILL (out of memory?); lower --memory-budget or see the "
                "system log")
    return f"local worker {worker} was stopped by {name}; see who sent it (scancel, kill, a time limit)"


def run_workers(nproc: int, args: list[str]) -> int:
    """Run ``python args`` in ``nproc`` local workers (rank i in worker i) and wait for them all; after the
    first failure stop the rest. Returns ``exit_code`` of the workers."""
    port, cpus = free_port(), os.cpu_count() or 1
    procs: list[subprocess.Popen] = []
    codes: list[int | None] = [None] * nproc
    first: int | None = None  # the worker that failed first
    signals: list[tuple[int, float]] = []  # (signal, when) the launcher received

    def forward(signum: int, _frame: object) -> None:  # Ctrl-C, scancel, kill: every worker gets it
        signals.append((signum, time.monotonic()))
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    killed: list[int] = []
    try:
        for rank in range(nproc):
            env = worker_env(dict(os.environ), rank, nproc, port, cpus)
            procs.append(subprocess.Popen([sys.executable, *args], env=env))
        while first is None and any(c is None for c in codes):
            for i, p in enumerate(procs):
                if codes[i] is None:
                    codes[i] = p.poll()
                    if codes[i] and first is None:
                        first = i
            if signals and (len(signals) > 1 or time.monotonic() - signals[0][1] > INTERRUPT_GRACE_S):
                break  # the workers did not leave on the signal (or it came twice): escalate
            time.sleep(POLL_S)
        if signals and any(c is None for c in codes):
            killed = _stop(procs, codes, (signal.SIGTERM, signal.SIGKILL))
        elif first is not None:  # an interrupted worker: the run is being stopped, the rest get SIGTERM at once
            killed = _stop(procs, codes, (signal.SIGTERM, signal.SIGKILL) if codes[first] == INTERRUPTED else
                           (None, signal.SIGTERM, signal.SIGKILL))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    interrupted = signal.Signals(signals[0][0]).name if signals else None
    culprit = killed[0] if killed and interrupted else first
    if culprit is not None and (line := death_line(culprit, codes[culprit] or 0, interrupted, culprit in killed)):
        print(f"dist_convert: error: {line}", file=sys.stderr)
    if interrupted:
        return INTERRUPTED
    return exit_code(codes, first)


def self_launch(nproc: int, argv: list[str]) -> int:
    """Run ``dist_convert argv`` (minus --nproc) in ``nproc`` local workers."""
    if nproc < 1:
        print(f"dist_convert: error: --nproc {nproc} is not a positive number of processes; pass --nproc 1 or "
              "more", file=sys.stderr)
        return 2
    return run_workers(nproc, ["-m", "dist_convert", *without_nproc(argv)])
