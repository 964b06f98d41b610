"""The test run's side of tests/job_worker.py: long-lived workers by (program, world size, runtime), started on
first use, restarted when a job ended it, stopped at the end of the run; with pytest-xdist, one pool for the run's
pytest processes (PoolServer in the controller, PoolClient in each process)."""
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
import threading
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


MIN_FREE = 5 << 30  # bytes of memory left available before a worker starts (two jobs can run at once, see Workers)


def mem_available() -> int:
    """The machine's available memory in bytes (/proc/meminfo's MemAvailable; unbounded where there is none)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 62


Key = tuple[str, int | None, str]  # (program, world, runtime)


class Workers:
    """The test run's workers, by (program, world, runtime). At most ``max_ranks`` worker processes stay alive
    (each holds torch, and the oracle's megatron-core, in memory: about 250 MB per CLI rank, 370 MB per oracle rank,
    more with Megatron-Bridge and transformers loaded, plus a torchrun agent per worker and megatron-core's save
    Manager per rank that saved), and a worker starts only while ``min_free`` bytes of memory are available: starting
    one more first stops the least recently used idle ones. 20 keeps most workers of the three runtimes warm (16 made
    them evict each other: 24 min 56 s against 20 min 04 s with 20, the same day). With the tests' worlds trimmed (no
    worker for a single job at an odd world size), a clean-clone run started workers 28 times at 20 (15.0 GB in use
    at most) and 19 times at 24, which brought memory in use to 18.7 GB of this 24 GB machine: too close to the edge
    for a suite that must not flake.

    Jobs may come from several threads (PoolServer: one per pytest process of the run): a worker runs one job at a
    time, and a job whose worker is busy gets a second worker of the same key."""

    def __init__(self, env: dict[str, str], max_ranks: int = 20, min_free: int = MIN_FREE) -> None:
        self.env, self.max_ranks, self.min_free = env, max_ranks, min_free
        self.lock = threading.Lock()
        self.order: list[Worker] = []  # every worker the run started, least recently used first
        self.busy: set[Worker] = set()

    def _take(self, key: Key) -> Worker:
        """An idle worker of ``key`` (a live one first), or a new one; room made for it if it must start."""
        with self.lock:
            idle = [w for w in self.order if (w.program, w.world, w.runtime) == key and w not in self.busy]
            worker = max(idle, key=lambda w: w.alive) if idle else Worker(key[0], key[1], self.env, key[2])
            if worker in self.order:
                self.order.remove(worker)
            self.busy.add(worker)
            if not worker.alive:
                for other in [w for w in self.order if w not in self.busy and w.alive]:
                    if (sum(w.nranks for w in self.order if w.alive) + worker.nranks <= self.max_ranks
                            and mem_available() >= self.min_free):
                        break
                    other.stop()
            self.order.append(worker)
            return worker

    def run(self, program: str, world: int | None, argv: list[str], timeout: float,
            runtime: str = "default", cwd: str | None = None) -> subprocess.CompletedProcess:
        worker = self._take((program, world, runtime))
        try:
            return worker.run(argv, timeout, cwd)
        finally:
            with self.lock:
                self.busy.discard(worker)

    def stop(self) -> None:
        with self.lock:
            for w in self.order:
                w.stop()

    def summary(self) -> str:
        """One line: how many worker starts the run paid for and how long they took, the restarted ones named
        (a start costs a few seconds of imports per rank: a worker started again is time the suite loses)."""
        by_key: dict[str, list[float]] = {}
        for w in self.order:
            by_key.setdefault(f"{w.program}/w{w.world or 0}/{w.runtime}", []).extend(w.starts)
        starts = [t for ts in by_key.values() for t in ts]
        again = sorted(f"{k} x{len(ts)}" for k, ts in by_key.items() if len(ts) > 1)
        return (f"test workers: {len(starts)} starts of {len(by_key)} kinds of worker, {sum(starts):.0f} s starting"
                + (f"; started again: {', '.join(again)}" if again else ""))


class PoolServer:
    """The run's one pool of workers, served over a Unix socket to the pytest processes of the run (pytest-xdist):
    a worker is started once for all of them, not once per process. One JSON line per job each way."""

    def __init__(self, workers: Workers) -> None:
        self.workers, self.dir = workers, Path(tempfile.mkdtemp(prefix="dcw-pool-"))
        self.path = self.dir / "sock"
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(str(self.path))
        self.server.listen()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):  # the socket closed at the end of the run
            while True:
                conn, _ = self.server.accept()
                threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn, conn.makefile("r") as requests:
            for line in requests:
                try:
                    proc = self.workers.run(**json.loads(line))
                    reply = {"rc": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}
                except subprocess.TimeoutExpired as e:
                    reply = {"timeout": e.timeout, "stdout": e.output, "stderr": e.stderr}
                except Exception as e:  # noqa: BLE001 - a worker that did not start: the test sees the error
                    reply = {"error": f"{type(e).__name__}: {e}"}
                conn.sendall((json.dumps(reply) + "\n").encode())

    def close(self) -> None:
        self.server.close()
        shutil.rmtree(self.dir, ignore_errors=True)


class PoolClient:
    """Workers.run of the run's PoolServer, for a pytest process of the run."""

    def __init__(self, path: str) -> None:
        self.path, self.conn = path, None

    def run(self, program: str, world: int | None, argv: list[str], timeout: float,
            runtime: str = "default", cwd: str | None = None) -> subprocess.CompletedProcess:
        if self.conn is None:
            self.conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.conn.connect(self.path)
            self.replies = self.conn.makefile("r")
        request = {"program": program, "world": world, "argv": argv, "timeout": timeout, "runtime": runtime,
                   "cwd": cwd}
        self.conn.sendall((json.dumps(request) + "\n").encode())
        reply = json.loads(self.replies.readline())
        if "error" in reply:
            raise RuntimeError(reply["error"])
        if "timeout" in reply:
            raise subprocess.TimeoutExpired(argv, reply["timeout"], output=reply["stdout"], stderr=reply["stderr"])
        return subprocess.CompletedProcess(argv, reply["rc"], reply["stdout"], reply["stderr"])

    def stop(self) -> None:
        if self.conn is not None:
            self.replies.close()
            self.conn.close()
            self.conn = None
