"""A real Slurm cluster of two (or more) nodes on this one machine, for tests of the sbatch templates.

Debian's ``slurm-wlm`` and ``munge`` run everything from a private directory: a munge daemon with its
own key and socket, ``slurmctld`` and one ``slurmd -N nX`` per node, all on free ports, with spool,
state, pid and log files under the directory. Nothing under /etc is used or changed (``SLURM_CONF``
points the client commands at the private configuration). Node names ``n1``, ``n2``... do not
resolve; every node's ``NodeAddr`` is 127.0.0.1, which the templates use for the rendezvous.

    cluster = LocalSlurm(tmp_dir, nodes=2)
    cluster.start()                      # waits until every node is idle
    job = cluster.sbatch(["--nodes=2", "slurm/convert.sbatch", "reshard", ...], cwd=repo)
    info = cluster.wait(job, timeout=300)   # scontrol's fields: JobState, ExitCode, StdOut, ...
    cluster.stop()                       # cancels jobs, then stops the daemons by their pid files

``python tests/slurm_cluster.py DIR`` starts one in DIR, prints how to use it and keeps it up until
interrupted (for trying the templates by hand).
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "scontrol", "scancel", "sinfo", "squeue", "munge", "unmunge")
SBIN = ("/usr/sbin", "/sbin", "/usr/local/sbin")
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                "DEADLINE", "PREEMPTED"}


def which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path=os.pathsep.join(SBIN))


def ensure_debian(what: str, programs: list[str], packages: list[str], timeout: float = 900) -> str | None:
    """Install Debian ``packages`` when any of ``programs`` is missing. Returns None when they are all there, else
    the reason they cannot be installed here (for a pytest skip); ``what`` names them in that reason."""
    missing = [p for p in programs if which(p) is None]
    if not missing:
        return None
    if os.geteuid() != 0:
        return f"{what} is not installed ({', '.join(missing)} missing) and installing it needs root"
    if which("apt-get") is None:
        return f"{what} is not installed ({', '.join(missing)} missing) and there is no apt-get to install it"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", "-q", *packages]):
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return f"{what} could not be installed: {' '.join(cmd)} ran over {timeout:.0f} s"
        if proc.returncode != 0:
            return f"{what} could not be installed: {' '.join(cmd)} exited {proc.returncode}: {proc.stderr[-500:]}"
    missing = [p for p in programs if which(p) is None]
    return f"apt-get installed {' and '.join(packages)}, but {', '.join(missing)} is still missing" if missing else None


def ensure_slurm(timeout: float = 900) -> str | None:
    """Install Debian's slurm-wlm and munge when missing (``ensure_debian``)."""
    return ensure_debian("Slurm", DAEMONS + CLIENTS, ["slurm-wlm", "munge"], timeout)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a daemon that exited but is not reaped yet is a zombie: gone for our purpose
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def free_ports(n: int) -> list[int]:
    """n distinct ports that are free now (kept bound until all are chosen, so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def parse_fields(text: str) -> dict[str, str]:
    """``scontrol show ... -o`` output (Key=Value pairs on one line) as a dict; values without spaces."""
    out: dict[str, str] = {}
    for token in text.split():
        key, sep, value = token.partition("=")
        if sep:
            out[key] = value
    return out


class LocalSlurm:
    def __init__(self, root: Path, nodes: int = 2, partition: str = "debug", cpus: int | None = None) -> None:
        self.root = Path(root).resolve()
        self.nodes = [f"n{i + 1}" for i in range(nodes)]
        self.partition = partition
        self.cpus = cpus or os.cpu_count() or 1
        self.conf = self.root / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.socket.2"
        # no SLURM_*/SBATCH_*/SRUN_* settings of an outer job or of the user's cluster leak in
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))}
        self.env.update(SLURM_CONF=str(self.conf), PATH=os.pathsep.join([os.environ.get("PATH", ""), *SBIN]))
        self.started = False

    # -- daemons ---------------------------------------------------------------------------------------
    def pid_files(self) -> list[Path]:
        """Newest first: nodes, controller, munge (the order to stop them in)."""
        return [*(self.root / f"slurmd-{n}.pid" for n in self.nodes), self.root / "slurmctld.pid",
                self.root / "munge" / "munged.pid"]

    def _write_config(self) -> None:
        ctld_port, *node_ports = free_ports(1 + len(self.nodes))
        host = socket.gethostname().split(".")[0]
        r = self.root
        lines = [
            "ClusterName=dctest",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={r}/state",
            f"SlurmdSpoolDir={r}/spool/%n",
            f"SlurmctldPidFile={r}/slurmctld.pid",
            f"SlurmdPidFile={r}/slurmd-%n.pid",
            f"SlurmctldLogFile={r}/slurmctld.log",
            f"SlurmdLogFile={r}/slurmd-%n.log",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/backfill",
            "SchedulerParameters=batch_sched_delay=0,sched_min_interval=0",
            "ReturnToService=2",
            "MpiDefault=none",
            "SlurmdParameters=config_overrides",
            "JobCompType=jobcomp/none",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "MailProg=/bin/true",
            "MinJobAge=3600",  # keep finished jobs visible to scontrol
            "KillWait=5",
            "InactiveLimit=0",
            "SlurmdTimeout=60",
            "SlurmctldTimeout=60",
            *(f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={p} CPUs={self.cpus} RealMemory=1000 "
              "State=UNKNOWN" for n, p in zip(self.nodes, node_ports, strict=True)),
            f"PartitionName={self.partition} Nodes={','.join(self.nodes)} Default=YES OverSubscribe=YES "
            "MaxTime=INFINITE State=UP",
        ]
        self.conf.write_text("\n".join(lines) + "\n")

    def _start_munge(self) -> None:
        d = self.root / "munge"
        d.mkdir(mode=0o700)
        key = d / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o400)
        self._run(["munged", "--force", f"--key-file={key}", f"--socket={self.munge_socket}",
                   f"--pid-file={d / 'munged.pid'}", f"--log-file={d / 'munged.log'}",
                   f"--seed-file={d / 'munged.seed'}"])
        cred = self._run(["munge", f"--socket={self.munge_socket}", "-n"]).stdout
        check = subprocess.run([which("unmunge"), f"--socket={self.munge_socket}"], input=cred, text=True,
                               capture_output=True, timeout=30)
        assert check.returncode == 0 and "Success" in check.stdout, f"munge does not work: {check.stdout}"

    def start(self, timeout: float = 90) -> LocalSlurm:
        self.root.mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o700)  # munged refuses group/world writable directories
        for sub in ("state", "spool"):
            (self.root / sub).mkdir(exist_ok=True)
        self.started = True  # from here on stop() cleans up whatever did start
        self._write_config()
        self._start_munge()
        self._run(["slurmctld", "-c", "-f", str(self.conf)])
        for n in self.nodes:
            (self.root / "spool" / n).mkdir(exist_ok=True)
            self._run(["slurmd", "-f", str(self.conf), "-N", n])
        deadline = time.monotonic() + timeout
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            proc = subprocess.run([which("sinfo"), "-h", "-N", "-o", "%N %t"], env=self.env, capture_output=True,
                                  text=True, timeout=30)
            states = dict(line.split() for line in proc.stdout.splitlines() if line.strip())
            if len(states) == len(self.nodes) and all(s == "idle" for s in states.values()):
                return self
            time.sleep(0.5)
        raise RuntimeError(f"Slurm nodes not idle after {timeout} s: {states}\n{self.logs_tail()}")

    def stop(self) -> None:
        if not self.started:
            return
        if self.conf.exists():
            for job in self.job_ids():
                subprocess.run([which("scancel"), job], env=self.env, capture_output=True, timeout=30)
            deadline = time.monotonic() + 30
            while self.job_ids(states="RUNNING,COMPLETING,PENDING,CONFIGURING") and time.monotonic() < deadline:
                time.sleep(0.5)
        self._kill(self.pid_files())
        self.started = False

    @staticmethod
    def _kill(pid_files: list[Path], timeout: float = 15) -> None:
        """SIGTERM the daemons named by the pid files, all at once; SIGKILL whatever is left after timeout."""
        pids = []
        for pid_file in pid_files:
            try:
                pid = int(pid_file.read_text().split()[0])
                os.kill(pid, signal.SIGTERM)
                pids.append(pid)
            except (OSError, ValueError, IndexError):
                continue
        deadline = time.monotonic() + timeout
        while pids and time.monotonic() < deadline:
            time.sleep(0.1)
            pids = [p for p in pids if _alive(p)]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _run(self, cmd: list[str], **kw) -> subprocess.CompletedProcess:
        proc = subprocess.run([which(cmd[0]) or cmd[0], *cmd[1:]], env=self.env, capture_output=True, text=True,
                              timeout=60, **kw)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}\n"
                               f"{self.logs_tail()}")
        return proc

    def logs_tail(self, chars: int = 3000) -> str:
        out = []
        for log in sorted(self.root.glob("*.log")) + sorted(self.root.glob("munge/*.log")):
            out.append(f"--- {log.name}\n{log.read_text(errors='replace')[-chars:]}")
        return "\n".join(out)

    # -- jobs ------------------------------------------------------------------------------------------
    def job_ids(self, states: str = "all") -> list[str]:
        proc = subprocess.run([which("squeue"), "-h", "-t", states, "-o", "%i"], env=self.env, capture_output=True,
                              text=True, timeout=30)
        return proc.stdout.split()

    def sbatch(self, args: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
        proc = subprocess.run([which("sbatch"), "--parsable", *args], cwd=cwd, env={**self.env, **(env or {})},
                              capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            raise RuntimeError(f"sbatch {' '.join(args)} exited {proc.returncode}: {proc.stderr}")
        return proc.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        proc = self._run(["scontrol", "show", "job", "-o", job_id])
        return parse_fields(proc.stdout)

    def wait(self, job_id: str, timeout: float) -> dict[str, str]:
        """Poll until the job reaches a final state; on timeout cancel it and raise."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if info.get("JobState") in FINAL_STATES:
                return info
            if time.monotonic() > deadline:
                subprocess.run([which("scancel"), job_id], env=self.env, capture_output=True, timeout=30)
                raise TimeoutError(f"job {job_id} not finished after {timeout} s: {info}\n{self.logs_tail()}")
            time.sleep(0.5)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    reason = ensure_slurm()
    if reason:
        print(reason, file=sys.stderr)
        return 1
    def interrupt(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt)  # also when started in the background (SIGINT ignored there)
    signal.signal(signal.SIGTERM, interrupt)
    cluster = LocalSlurm(Path(argv[0]))
    try:
        cluster.start()
        print(f"Slurm cluster up: nodes {', '.join(cluster.nodes)}, partition {cluster.partition}\n"
              f"  export SLURM_CONF={cluster.conf}\n  sinfo; sbatch --partition={cluster.partition} ...\n"
              "Ctrl-C (or SIGTERM) stops it.", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    finally:
        cluster.stop()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
