"""Where a rank's time goes: the phases of a job (``PHASES``), timed where they run.

Each rank is one process; ``clock`` is its accumulator. ``with phase("read"): ...`` adds the block's seconds to that
phase: as **serial** time when it runs on the main thread (the job waits for it) and as **overlapped** time on
another thread (the read-ahead and writer threads, ``runtime.overlap_io``; the hashing thread, ``durable.Digest``).
Phases nest: a phase inside another (hashing or fsync inside a write, dequantizing inside a read) is taken out of
the outer one, so the serial seconds of a rank add up to its time in phases, and ``wait`` is the rest of its wall
time (collectives waiting for slower ranks, start-up bookkeeping). ``--stats-json`` and the summary carry them per
rank; ``bench`` reports the median run's.
"""
from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

PHASES = ("index", "plan", "read", "decode", "exchange", "assemble", "write", "hash", "fsync", "finalize")
COLUMNS = (*PHASES, "wait")  # a report's phases, as tables show them
WHAT = {"index": "open the source, read its metadata, build the target's files",
        "plan": "cut chunks and plan the waves",
        "read": "read source bytes",
        "decode": "dequantize quantized source tensors",
        "exchange": "pack, move and unpack bytes between ranks",
        "assemble": "copy (and cast) a rank's own pieces into target tensors",
        "write": "write target bytes",
        "hash": "SHA-256 of written files (the manifest)",
        "fsync": "fsync written files (and waits handing written pages to the disk early)",
        "finalize": "metadata, manifest, rename into place (rank 0) and the last barrier",
        "wait": "the rest of the wall time: waiting for other ranks in collectives"}


class Clock:
    """Seconds per phase of this process, serial (main thread) and overlapped (other threads); thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._local = threading.local()
        self.serial: dict[str, float] = defaultdict(float)
        self.overlapped: dict[str, float] = defaultdict(float)

    def reset(self) -> None:
        with self._lock:
            self.serial.clear()
            self.overlapped.clear()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        stack = self._local.__dict__.setdefault("stack", [])
        stack.append(name)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            dt = time.perf_counter() - t0
            stack.pop()
            into = self.serial if threading.current_thread() is threading.main_thread() else self.overlapped
            with self._lock:
                into[name] += dt
                if stack:  # the enclosing phase keeps only its own time
                    into[stack[-1]] -= dt

    def report(self, wall_s: float) -> dict[str, dict[str, float]]:
        """{"serial": phase -> s (with ``wait``: wall minus the serial phases), "overlapped": phase -> s}."""
        with self._lock:
            serial = {p: round(self.serial[p], 4) for p in PHASES if self.serial.get(p)}
            overlapped = {p: round(self.overlapped[p], 4) for p in PHASES if self.overlapped.get(p)}
        serial["wait"] = round(max(0.0, wall_s - sum(serial.values())), 4)
        return {"serial": serial, "overlapped": overlapped}


clock = Clock()


def cell(report: dict[str, dict[str, float]], name: str) -> str:
    """One phase of a ``Clock.report`` as a table shows it: serial seconds, (+ overlapped seconds)."""
    serial, behind = report.get("serial", {}).get(name), report.get("overlapped", {}).get(name)
    return (f"{serial:.2f}" if serial else "") + (f" (+{behind:.2f})" if behind else "")


def phase(name: str):  # noqa: ANN201 - a context manager
    """``with phase(name):`` times a block into this process's ``clock``."""
    assert name in PHASES, name
    return clock.phase(name)
