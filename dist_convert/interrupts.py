"""SIGINT and SIGTERM in a rank: the run stops at once, cleans up as a failure does, and exits 130 with one line.

``install`` (the CLI, in a real launch) makes the first SIGINT or SIGTERM raise ``Interrupted`` in the main thread,
which unwinds the run through ``Staging.guard`` (the staging directory kept when it holds finished files, else
removed once every rank stopped writing) to ``cli.main`` (rank 0 says it; exit 130). A signal that arrives while
the run already cleans up (``cleaning``) is only recorded: it never cuts the cleanup short. Python runs a handler
only between bytecodes, so a main thread blocked in C (a collective whose peers hang, a stuck write) would not
see it: a watchdog thread wakes on the same signal (``signal.set_wakeup_fd``) and, when the main thread has not
left within ``FORCE_S``, runs the registered cleanup itself and ends the process (``os._exit(130)``)."""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

SIGNALS = (signal.SIGINT, signal.SIGTERM)
EXIT_CODE = 130  # what a shell reports for a job stopped by Ctrl-C (128 + SIGINT), for SIGTERM too
FORCE_S = 5.0  # how long the watchdog lets the main thread unwind before it finishes the run itself


class Interrupted(BaseException):
    """A SIGINT or SIGTERM reached this rank. A BaseException, as KeyboardInterrupt: ``except Exception`` blocks
    of the run do not swallow it."""

    def __init__(self, signum: int, where: str = "") -> None:
        self.signum = signum
        super().__init__(signal.Signals(signum).name + where)

    @classmethod
    def of_peer(cls, name: str) -> Interrupted:
        """Another rank's interrupt (its signal's name), learnt by this one: this process reports it."""
        signum = int(getattr(signal, name.split()[0], signal.SIGTERM))
        _state.signum = _state.signum or signum
        _state.where = " on another rank"
        return cls(signum, _state.where)


@dataclass(kw_only=True)
class _State:
    """Not frozen: this process's interrupt state."""

    signum: int | None = None  # the first signal received
    depth: int = 0  # > 0 while cleaning up: a signal is recorded, not raised
    outcome: str | None = None  # what the cleanup left (said in the final line)
    cleanup: Callable[[Interrupted], None] | None = None  # the watchdog's cleanup (the staging's abort)
    say: Callable[[str], None] | None = None  # prints the final line (rank 0)
    done: threading.Event | None = None
    installed: bool = False
    said: bool = False
    where: str = ""  # " on another rank" when that rank was the one interrupted
    lock: threading.Lock = field(default_factory=threading.Lock)


_state = _State()


def received() -> int | None:
    """The signal this process received, if any."""
    return _state.signum


def signame() -> str:
    return signal.Signals(_state.signum).name if _state.signum is not None else "signal"


def set_outcome(text: str) -> None:
    _state.outcome = text


def line() -> str:
    """The one line of an interrupted run."""
    return f"interrupted ({signame()}{_state.where}); {_state.outcome or 'nothing written'}"


def announce() -> None:
    """Say ``line()`` once (the main thread or the watchdog, whichever gets there first). The line is written
    under the lock: the watchdog, which ends the process right after, never returns from here while the main
    thread is still writing it (that race once lost the line, the exit code alone reaching the user)."""
    with _state.lock:
        if _state.said or _state.say is None:
            return
        _state.said = True
        _state.say(line())


@contextlib.contextmanager
def cleaning() -> Iterator[None]:
    """A cleanup that a signal must not cut short: a signal arriving inside is only recorded."""
    _state.depth += 1
    try:
        yield
    finally:
        _state.depth -= 1


@contextlib.contextmanager
def cleanup_by(fn: Callable[[Interrupted], None]) -> Iterator[None]:
    """While inside: ``fn`` is what the watchdog runs when the main thread does not unwind in time."""
    before, _state.cleanup = _state.cleanup, fn
    try:
        yield
    finally:
        _state.cleanup = before


def _handler(signum: int, _frame: object) -> None:
    if _state.signum is not None or _state.depth > 0:
        _state.signum = _state.signum or signum
        return
    _state.signum = signum
    raise Interrupted(signum)


def _watch(fd: int, done: threading.Event) -> None:
    while True:
        try:
            data = os.read(fd, 64)
        except OSError:
            return
        got = [b for b in data if b in (int(s) for s in SIGNALS)]
        if got:
            _state.signum = _state.signum or got[0]  # the handler has not run: the main thread is blocked in C
            break
    if done.wait(FORCE_S):
        return
    with contextlib.suppress(BaseException):  # whatever state the stuck main thread left, the process ends
        if _state.cleanup is not None:
            _state.cleanup(Interrupted(_state.signum or signal.SIGTERM))
    with contextlib.suppress(BaseException):
        announce()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()
    os._exit(EXIT_CODE)


def install(say: Callable[[str], None]) -> bool:
    """In the main thread of a real launch: SIGINT / SIGTERM raise ``Interrupted``, and the watchdog stands by.
    ``say`` prints the final line (the CLI: rank 0's). False when it cannot (not the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    _state.say = say
    if _state.installed:
        return True
    r, w = os.pipe()
    os.set_blocking(w, False)
    signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    for sig in SIGNALS:
        signal.signal(sig, _handler)
    _state.done = threading.Event()
    threading.Thread(target=_watch, args=(r, _state.done), name="interrupts", daemon=True).start()
    _state.installed = True
    return True


def finished() -> None:
    """The main thread is leaving: the watchdog stands down."""
    if _state.done is not None:
        _state.done.set()
