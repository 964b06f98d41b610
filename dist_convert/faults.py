"""Fault injection for the reliability tests: ``DIST_CONVERT_FAULT="ACTION:rank=R:POINT=N"`` makes rank
R act at the N-th time it reaches POINT. Actions: ``kill`` (SIGKILL itself, as an OOM killer or a
lost node would), ``hang`` (stop answering collectives), ``sleepS`` (take S seconds there: a slow phase).
Points: ``file`` (a target file was finished and journaled), ``wave`` (an exchange wave begins),
``package`` (rank 0's packaging of the finished target). Unset, this does nothing."""
from __future__ import annotations

import os
import signal
import time
from collections import Counter

_seen: Counter[str] = Counter()


def _spec() -> tuple[str, int, str, int] | None:
    text = os.environ.get("DIST_CONVERT_FAULT")
    if not text:
        return None
    try:
        action, rank, point = text.split(":")
        (pname, n) = point.split("=")
        return action, int(rank.removeprefix("rank=")), pname, int(n)
    except ValueError:
        raise ValueError(f"DIST_CONVERT_FAULT={text!r} is not ACTION:rank=R:POINT=N") from None


def reached(point: str, rank: int) -> None:
    """Called at each ``point``; acts when the environment asks for a fault there."""
    spec = _spec()
    if spec is None:
        return
    _seen[point] += 1
    action, frank, fpoint, n = spec
    if frank != rank or fpoint != point or _seen[point] != n:
        return
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action.startswith("sleep"):
        time.sleep(float(action.removeprefix("sleep")))
    elif action == "hang":
        while True:
            time.sleep(3600)
