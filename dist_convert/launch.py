"""``--nproc N``: dist_convert starts its own N local workers (what ``torchrun --standalone
--nproc_per_node=N`` does for one node), each running the same command line without ``--nproc``.

The launcher never imports torch: importing it takes about 2 s on a small machine, which torchrun's
launcher pays before its workers start to pay it again. Here the workers start at once and import torch
side by side. Each worker gets torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT; OMP_NUM_THREADS unless set); rank 0 hosts the rendezvous store. When a worker
fails the others are stopped; the workers print their own output and one-line errors, and the launcher
adds one line only for a worker that died without one (a signal)."""
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


def _stop(procs: list[subprocess.Popen], codes: list[int | None]) -> None:
    """The workers still running after a failure: GRACE_S to leave by themselves (a rank that learns of a
    peer's failure prints its own error), then SIGTERM, then SIGKILL."""
    for sig in (None, signal.SIGTERM, signal.SIGKILL):
        if sig is not None:
            for p, c in zip(procs, codes, strict=True):
                if c is None and p.poll() is None:
                    p.send_signal(sig)
        _wait_all(procs, codes, GRACE_S)
        if all(c is not None for c in codes):
            return


def run_workers(nproc: int, args: list[str]) -> int:
    """Run ``python args`` in ``nproc`` local workers (rank i in worker i) and wait for them all; after the
    first failure stop the rest. Returns ``exit_code`` of the workers."""
    port, cpus = free_port(), os.cpu_count() or 1
    procs: list[subprocess.Popen] = []
    codes: list[int | None] = [None] * nproc
    first: int | None = None  # the worker that failed first

    def forward(signum: int, _frame: object) -> None:  # scancel / kill reach every worker
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
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
            time.sleep(POLL_S)
        if first is not None:
            _stop(procs, codes)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if first is not None and (codes[first] or 0) < 0:  # killed: it printed nothing of its own
        name = signal.Signals(-(codes[first] or 0)).name
        print(f"dist_convert: error: local worker {first} was killed by {name}"
              f"{' (out of memory?)' if name == 'SIGKILL' else ''}; lower --memory-budget or see the system log",
              file=sys.stderr)
    return exit_code(codes, first)


def self_launch(nproc: int, argv: list[str]) -> int:
    """Run ``dist_convert argv`` (minus --nproc) in ``nproc`` local workers."""
    if nproc < 1:
        print(f"dist_convert: error: --nproc {nproc} is not a positive number of processes; pass --nproc 1 or "
              "more", file=sys.stderr)
        return 2
    return run_workers(nproc, ["-m", "dist_convert", *without_nproc(argv)])
