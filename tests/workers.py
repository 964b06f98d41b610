"""The test session's side of tests/job_worker.py: one long-lived worker per (program, world size),
started on first use, restarted when a job ended it, stopped at the end of the session."""
from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "job_worker.py"
# the three interpreters a worker can run under: the default venv's (Python 3.11 + megatron-core 0.16.1), the
# second runtime (Python 3.12 + megatron-core 0.19.2, launch/setup_mcore19.sh) and the newest stack (torch 2.15 +
# megatron-core 0.19.2, launch/setup_newest.sh)
RUNTIMES = {"default": Path(sys.executable), "mcore19": ROOT / ".venv-mcore19" / "bin" / "python",
            "newest": ROOT / ".venv-newest" / "bin" / "python"}
# launch/test.sh sets up .venv-mcore19 and .venv-newest while the first tests run: it names, per runtime, the file
# that the set-up's exit status is written to, and the first use of that runtime waits for it
SETUP_STATUS = {"mcore19": "DIST_CONVERT_MCORE19_SETUP_STATUS", "newest": "DIST_CONVERT_NEWEST_SETUP_STATUS"}
SETUP_WAIT = 1800.0  # seconds: the set-up of a clean machine on a loaded 2-core one takes 5-7 minutes


def runtime_python(runtime: str) -> Path:
    """The interpreter of ``runtime``, once a set-up still running beside the tests (launch/test.sh) has finished."""
    status = os.environ.get(SETUP_STATUS.get(runtime, ""), "")
    if status:
        path, deadline = Path(status), time.monotonic() + SETUP_WAIT
        while not (path.is_file() and path.read_text().strip()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the set-up of {runtime} did not finish within {SETUP_WAIT:.0f} s ({path})")
            time.sleep(1.0)
        rc = path.read_text().strip()
        if rc != "0":
            raise RuntimeError(f"the set-up of {runtime} failed (exit {rc}): launch/test.sh prints its log at the end")
    return RUNTIMES[runtime]
START_TIMEOUT = 180.0  # seconds for a worker's ranks to import and connect (a loaded 2-core machine)


class Worker:
    """``program`` run by ``world`` ranks under torchrun, or by one plain process when ``world`` is None,
    with the interpreter of ``runtime`` (see RUNTIMES)."""

    def __init__(self, program: str, world: int | None, env: dict[str, str], runtime: str = "default") -> None:
        self.program, self.world, self.env, self.runtime = program, world, env, runtime
        self.proc: subprocess.Popen | None = None
        self.jobs = 0
        self.starts: list[float] = []  # seconds each start took, until every rank connected

    @property
    def nranks(self) -> int:
        return self.world or 1

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _start(self) -> None:
        self.spool = Path(tempfile.mkdtemp(prefix=f"dcw-{self.program}{self.world or 0}-{self.runtime}-"))
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(str(self.spool / "sock"))
        server.listen(self.nranks)
        server.settimeout(1.0)
        args = [str(WORKER), "--program", self.program, "--socket", str(self.spool / "sock"), "--spool",
                str(self.spool)]
        python = runtime_python(self.runtime)
        if not python.exists():
            raise RuntimeError(f"{python} is missing: run bash launch/setup_mcore19.sh (launch/test.sh does)")
        began = time.monotonic()
        cmd = ([str(python), "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={self.world}", *args]
               if self.world else [str(python), *args])
        self.log = self.spool / "worker.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        conns: dict[int, socket.socket] = {}
        deadline = time.monotonic() + START_TIMEOUT
        try:
            while len(conns) < self.nranks:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"worker {self.program} w={self.world} did not start:\n{self._log_tail()}")
                try:
                    conn, _ = server.accept()
                except TimeoutError:
                    continue
                conn.settimeout(None)
                rank = json.loads(conn.makefile("r").readline())["rank"]
                conns[rank] = conn
        except BaseException:
            self.stop()
            raise
        finally:
            server.close()
        self.conns = [conns[r] for r in range(self.nranks)]
        self.replies = [c.makefile("r") for c in self.conns]
        self.starts.append(time.monotonic() - began)

    def _log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:] if self.log.exists() else ""

    def run(self, argv: list[str], timeout: float, cwd: str | None = None) -> subprocess.CompletedProcess:
        """Run one job on every rank: rank 0's output first, then the others', as torchrun merges them.
        The exit code is the first non-zero one of any rank (0 if none), as torchrun reports it."""
        if not self.alive:
            if self.proc is not None:
                self.stop()
            self._start()
        n = self.jobs
        self.jobs += 1
        line = (json.dumps({"id": n, "argv": argv, "cwd": cwd}) + "\n").encode()
        for c in self.conns:
            c.sendall(line)
        rcs: dict[int, int] = {}
        deadline = time.monotonic() + timeout
        by_fd = {f.fileno(): (r, f) for r, f in enumerate(self.replies)}
        while len(rcs) < self.nranks:
            ready, _, _ = select.select([fd for fd, (r, _) in by_fd.items() if r not in rcs], [], [], 1.0)
            for fd in ready:
                r, f = by_fd[fd]
                text = f.readline()
                if text:
                    rcs[r] = json.loads(text)["rc"]
            if len(rcs) < self.nranks and self.proc.poll() is not None:
                break  # a rank died (killed, crashed): what it wrote is the job's output
            if time.monotonic() > deadline:
                out, err = self._read(n, "out"), self._read(n, "err") + self._log_tail()
                self.stop(kill=True)
                raise subprocess.TimeoutExpired(argv, timeout, output=out, stderr=err)
        stderr = self._read(n, "err")
        if len(rcs) < self.nranks:  # the worker ended mid-job
            stderr += f"\n[worker ended: exit {self.proc.poll()}]\n{self._log_tail()}"
            self.stop(kill=True)
            rc = 1
        else:
            rc = next((x for x in rcs.values() if x != 0), 0)
        return subprocess.CompletedProcess(argv, rc, self._read(n, "out"), stderr)

    def _read(self, n: int, what: str) -> str:
        parts = []
        for r in range(self.nranks):
            f = self.spool / f"job{n}.rank{r}.{what}"
            if f.exists():
                parts.append(f.read_text(errors="replace"))
                f.unlink()
        return "".join(parts)

    def stop(self, kill: bool = False) -> None:
        """End the worker: EOF on its sockets (it exits between jobs), or SIGKILL to all its processes."""
        if self.proc is not None:
            for f in getattr(self, "replies", []):  # a socket closes when its file objects do too
                f.close()
            for c in getattr(self, "conns", []):
                c.close()
            try:
                if kill:
                    raise subprocess.TimeoutExpired(self.proc.args, 0)
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            self.proc = None
            self.conns, self.replies = [], []
        shutil.rmtree(getattr(self, "spool", ""), ignore_errors=True)


class Workers:
    """The session's workers, by (program, world). At most ``max_ranks`` worker processes stay alive
    (each holds torch, and the oracle's megatron-core, in memory: about 250 MB per CLI rank, 370 MB per oracle rank,
    more with Megatron-Bridge and transformers loaded, plus a torchrun agent per worker and megatron-core's save
    Manager per rank that saved): starting one more first stops the least recently used. 20 keeps most workers of
    the three runtimes warm (16 made them evict each other: 24 min 56 s against 20 min 04 s with 20, the same day).
    With the tests' worlds trimmed (no worker for a single job at an odd world size), a clean-clone run started
    workers 28 times at 20 (15.0 GB in use at most) and 19 times at 24, which brought memory in use to 18.7 GB of this
    24 GB machine: too close to the edge for a suite that must not flake."""

    def __init__(self, env: dict[str, str], max_ranks: int = 20) -> None:
        self.env, self.max_ranks = env, max_ranks
        self.pool: dict[tuple[str, int | None, str], Worker] = {}  # least recently used first
        self.started: dict[tuple[str, int | None, str], Worker] = {}  # every worker of the session, for summary()

    def run(self, program: str, world: int | None, argv: list[str], timeout: float,
            runtime: str = "default", cwd: str | None = None) -> subprocess.CompletedProcess:
        key = (program, world, runtime)
        self.pool.pop(key, None)
        worker = self.started.get(key) or self.started.setdefault(key, Worker(program, world, self.env, runtime))
        if not worker.alive:
            for other in list(self.pool.values()):
                if sum(w.nranks for w in self.pool.values() if w.alive) + worker.nranks <= self.max_ranks:
                    break
                other.stop()
        self.pool[key] = worker
        return worker.run(argv, timeout, cwd)

    def stop(self) -> None:
        for w in self.pool.values():
            w.stop()
        self.pool.clear()

    def summary(self) -> str:
        """One line: how many worker starts the session paid for and how long they took, the restarted ones named
        (a start costs a few seconds of imports per rank: a worker started again is time the suite loses)."""
        starts = [t for w in self.started.values() for t in w.starts]
        again = sorted((f"{p}/w{w or 0}/{r} x{len(x.starts)}" for (p, w, r), x in self.started.items()
                        if len(x.starts) > 1))
        return (f"test workers: {len(starts)} starts of {len(self.started)} workers, {sum(starts):.0f} s starting"
                + (f"; started again: {', '.join(again)}" if again else ""))
