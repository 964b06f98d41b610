"""Process group set-up (NCCL with CUDA, gloo on CPU), rank-0 logging, progress and summaries."""
from __future__ import annotations

import ctypes
import datetime
import os
import resource
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

from .errors import ConvertError

_console = Console(stderr=True, highlight=False, width=None if sys.stderr.isatty() else 150)


@dataclass(kw_only=True)
class Runtime:
    """Not frozen: a handle on the job's processes, not a record (``ensure_process_group`` sets the group and
    backend of one made before the process group existed)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    group: Any = None  # the process group, None when running as one process
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str = "none"
    timeout_s: float = 1800.0  # collective timeout
    patient: Any = None  # gloo group for waits on a rank-0-only phase (PATIENT_S); None: ``group``
    threads: int = 1  # intra-op threads of this rank (casts, FP8 work): threads_per_rank

    @property
    def distributed(self) -> bool:
        return self.group is not None

    def log(self, msg: str) -> None:
        """The one logging helper: rank 0 prints."""
        if self.rank == 0:
            _console.print(msg, soft_wrap=True)  # a note or warning stays one line in a log (tables still fit 150)

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.group)

    def wait_for_rank0(self, result: Any = None) -> Any:
        """Collective, after a phase only rank 0 works in (packaging an archive, the final rename, metadata):
        the others wait on the patient gloo group, whose timeout is PATIENT_S rather than ``--timeout``, so
        a long archive or a slow file system does not read as a lost rank. Returns rank 0's ``result``."""
        if not self.distributed:
            return result
        box = [result]
        dist.broadcast_object_list(box, src=0, group=self.patient or self.group)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast_object(self, obj: Any) -> Any:
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def first_failed(self, failed: bool) -> int | None:
        """Collective: the lowest rank that failed (None when none did), so that one rank says a failure that
        several ranks met (a full disk under every rank)."""
        if not self.distributed:
            return 0 if failed else None
        first = torch.tensor([self.rank if failed else self.world], dtype=torch.int64)
        dist.all_reduce(first, op=dist.ReduceOp.MIN, group=self.group)
        return None if int(first.item()) == self.world else int(first.item())

    def progress(self, total_bytes: int, what: str) -> ProgressBar:
        return ProgressBar(total_bytes, what, enabled=self.rank == 0 and total_bytes > 0)

    def close(self) -> None:
        if self.distributed and dist.is_initialized():
            try:
                dist.barrier(group=self.group)  # nobody tears down gloo pairs a peer still uses
            finally:
                dist.destroy_process_group()


M_MMAP_THRESHOLD = -3  # glibc mallopt parameter
MMAP_THRESHOLD = 8 << 20


def map_large_allocations() -> None:
    """glibc: allocations of 8 MB and more are mapped, and unmapped when freed, always. By default glibc raises
    that threshold to the size of each such block freed (up to 32 MB), the heap then keeps blocks it never gives
    back, and a rank's peak RSS grew with the model: at 4 GB and 2 ranks 517-577 MB per rank against 461 MB
    with the threshold fixed, as fast within the noise (measured on 2 cores; 427 MB at 256 MB)."""
    try:
        ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    except (OSError, AttributeError):  # not glibc
        pass


def gpu_index(local_rank: int, visible: int, rank: int) -> int:
    """Pure: the GPU a rank of ``--backend nccl`` uses: its local rank among the GPUs this process sees. Refused
    in one line without GPUs (a CPU-only torch or node) or with fewer GPUs than local ranks (more processes per
    node than GPUs, or a per-task GPU binding that leaves each process fewer GPUs than its local rank)."""
    if visible == 0:
        err = ConvertError("--backend nccl needs GPUs and a CUDA build of torch; this process sees no GPU",
                           "use --backend gloo (or auto, which takes gloo without GPUs)")
        err.local = False  # every rank hits it: rank 0 says it (say_together)
        raise err
    if local_rank >= visible:
        err = ConvertError(f"local rank {local_rank} has no GPU of its own: this process sees {visible} "
                           f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})",
                           f"start at most {visible} processes per node (--nproc_per_node / --nproc), or bind GPUs "
                           "so that every process sees all of its node's GPUs")
        err.local = True
        raise err
    return local_rank


PATIENT_S = 24 * 3600.0  # how long ranks wait for a rank-0-only phase (torchrun stops them if rank 0 dies)
PROCESS_GROUP_BACKEND = {"gloo": "gloo", "nccl": "cpu:gloo,cuda:nccl"}  # control on CPU, bulk CUDA bytes on NCCL
NCCL_ERRORS_RAISE = "2"  # TORCH_NCCL_ASYNC_ERROR_HANDLING: abort the communicator, raise in Python (not kill)


def threads_per_rank(*, local_ranks: int, usable_cpus: int, slurm_cpus_per_task: int | None = None) -> int:
    """Pure: intra-op threads of one rank (casts, FP8 dequantization): the cores this process may use (its CPU
    affinity: what Slurm's cgroup or ``taskset`` left it), capped by Slurm's ``SLURM_CPUS_PER_TASK`` (the
    torchrun agent is the Slurm task), shared by the node's local ranks; at least one."""
    cpus = usable_cpus if slurm_cpus_per_task is None else min(usable_cpus, slurm_cpus_per_task)
    return max(1, cpus // max(1, local_ranks))


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask), else the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def job_threads(local: int) -> int:
    """threads_per_rank from this process's environment; ``DIST_CONVERT_THREADS=N`` sets it outright (the test
    suite runs many jobs side by side on few cores and asks for one)."""
    forced = os.environ.get("DIST_CONVERT_THREADS", "")
    if forced.isdigit() and int(forced) > 0:
        return int(forced)
    slurm = os.environ.get("SLURM_CPUS_PER_TASK", "")
    return threads_per_rank(local_ranks=local, usable_cpus=usable_cpus(),
                            slurm_cpus_per_task=int(slurm) if slurm.isdigit() else None)


def init_runtime(backend: str = "auto", timeout_s: float = 1800.0) -> Runtime:
    """Join the torchrun job (or run as one process without torchrun). With GPUs the process group is
    ``cpu:gloo,cuda:nccl``: control traffic (votes, barriers, objects, errors) runs on gloo and raises Python
    exceptions; NCCL's communicator is made only when CUDA bytes are first exchanged (no ``device_id``: eager
    NCCL set-up would tie every job to CUDA even when nothing crosses ranks)."""
    map_large_allocations()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if "RANK" not in os.environ or "MASTER_ADDR" not in os.environ:
        if world != 1:
            raise RuntimeError("WORLD_SIZE > 1 but no torchrun environment")
        threads = job_threads(1)
        torch.set_num_threads(threads)
        return Runtime(threads=threads)
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    fewer = backend == "auto" and 0 < visible < local_world
    if backend == "auto":
        backend = auto_backend(visible, local_world)
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", gpu_index(local_rank, torch.cuda.device_count() if torch.cuda.is_available()
                                                else 0, rank))
        torch.cuda.set_device(device)
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", NCCL_ERRORS_RAISE)
    threads = job_threads(local_world)
    torch.set_num_threads(threads)
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend=PROCESS_GROUP_BACKEND[backend], timeout=timeout)
    patient = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=max(timeout_s, PATIENT_S)))
    rt = Runtime(rank=rank, world=world, local_rank=local_rank, group=dist.group.WORLD, device=device,
                 backend=backend, timeout_s=timeout_s, patient=patient, threads=threads)
    if fewer:
        rt.log(f"backend: gloo on CPU ({local_world} ranks on this node see {visible} GPU(s); NCCL needs a GPU of "
               "its own per rank)")
    return rt


def auto_backend(visible: int, local_ranks: int) -> str:
    """Pure: what ``--backend auto`` takes: NCCL when every rank of the node has a GPU of its own, else gloo on CPU
    (a one-GPU box running ``--nproc_per_node=2``: NCCL refuses two ranks on one device, and a conversion needs no
    GPU; ``--backend nccl`` there is refused in one line, ``gpu_index``)."""
    return "nccl" if 0 < local_ranks <= visible else "gloo"


def say_together(err: ConvertError, timeout_s: float) -> None:
    """A refusal every rank meets before its process group exists (``--backend nccl`` without GPUs): the ranks
    join over gloo so that rank 0 says it once before any rank exits; torchrun stops the job at the first rank
    that exits, and rank 0 could be stopped before it printed."""
    try:
        dist.init_process_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, ValueError):  # no gloo either: rank 0 says it alone
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"dist_convert: error: {err}", file=sys.stderr, flush=True)
        return
    if dist.get_rank() == 0:
        print(f"dist_convert: error: {err}", file=sys.stderr, flush=True)
    dist.barrier()
    dist.destroy_process_group()


def collective_failure(e: BaseException, rt: Runtime) -> ConvertError | None:
    """A failed collective (gloo/NCCL: a peer timed out, hung, crashed or was killed) as a one-line
    error for this rank; None for any other exception."""
    msg = str(e)
    if not (isinstance(e, (RuntimeError, dist.DistError)) and rt.distributed):
        return None
    if "Timed out" in msg or "timed out" in msg or "Timeout" in msg:
        err = ConvertError(f"rank {rt.rank}: another rank did not answer within --timeout {rt.timeout_s:g} s "
                           "(it hung, is stuck on I/O, or is much slower)",
                           "see that rank's output; raise --timeout if a step is legitimately slow")
    elif any(k in msg for k in ("Connection closed", "Connection reset", "Broken pipe", "NCCL", "peer")):
        err = ConvertError(f"rank {rt.rank}: another rank stopped mid-run (it crashed or was killed)",
                           "see torchrun's failure summary for that rank (e.g. SIGKILL: out of memory) and fix it")
    else:
        return None
    err.local, err.group_broken = True, True
    return err


def job_store(rt: Runtime) -> Any:
    """The job's key-value store (torchrun's, or rank 0's with ``--nproc``): a channel beside the collectives that
    a rank can use whatever collective the others are in (None in one process)."""
    if not rt.distributed or not dist.is_initialized():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, AttributeError, ValueError):
        return None


def ensure_process_group(rt: Runtime) -> None:
    """Libraries that need torch.distributed (megatron-core) also run in one process without
    torchrun: a one-rank gloo group over an in-memory store."""
    if rt.distributed:
        return
    dist.init_process_group(backend="gloo", store=dist.HashStore(), rank=0, world_size=1)
    rt.group, rt.backend = dist.group.WORLD, "gloo"


OVERLAP_CORES = 4  # cores per local rank from which a rank reads ahead and writes in threads


def overlap_io(local_ranks: int) -> bool:
    """Whether a rank reads ahead and writes in a thread (exchange.execute, convert.BackgroundWrites): only
    with OVERLAP_CORES cores per local rank. Measured on 2 cores (1 GB, TP=2 -> TP=1 PP=2, page cache warm),
    the threads gained nothing: at 2 ranks 3.8-4.9 s against 3.7-4.4 s inline and 130 MB more per rank; at
    1 rank, once blocks are written from the read buffers, 3.5-5.7 s against 3.8-3.9 s and 634-662 MB against
    412-422 MB (queued writes keep their waves' buffers)."""
    return job_threads(local_ranks) >= OVERLAP_CORES  # the cores Slurm / the affinity mask gave, not the node's


def local_ranks(rt: Runtime) -> int:
    """The ranks of this job on this node (torchrun's LOCAL_WORLD_SIZE; else the whole world)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", rt.world))


def peak_gpu_bytes(rt: Runtime) -> int:
    """The most memory torch's caching allocator handed out on this rank's GPU (0 on CPU)."""
    return torch.cuda.max_memory_allocated(rt.device) if rt.device.type == "cuda" else 0


def peak_rss_bytes() -> int:
    """This process's own peak RSS. On Linux ``VmHWM`` of /proc/self/status: ``ru_maxrss`` also counts the
    peak of the process that started it (a vfork/fork child keeps its parent's high-water mark across
    exec), so a job started by a large process would report that process's peak."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb * 1024 if sys.platform != "darwin" else kb


_bar_open = False  # a progress bar is shown and has not finished its last line (see ``line_start``)


def line_start() -> str:
    """What to write before a line of its own: a newline while a progress bar may have left its line unfinished
    (a signal can cut its final render short, or the interrupt watchdog speak while the main thread renders it)."""
    return "\n" if _bar_open else ""


class ProgressBar:
    """A rich progress bar with bytes, GB/s and ETA (rank 0 only)."""

    def __init__(self, total: int, what: str, enabled: bool) -> None:
        self._p: Progress | None = None
        if enabled:
            self._p = Progress(TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(),
                               TransferSpeedColumn(), TimeRemainingColumn(), console=_console, transient=False)
            self._task = self._p.add_task(what, total=total)

    def __enter__(self) -> ProgressBar:
        global _bar_open
        if self._p:
            _bar_open = True
            self._p.start()
        return self

    def advance(self, nbytes: int) -> None:
        if self._p:
            self._p.advance(self._task, nbytes)

    def __exit__(self, *exc: Any) -> None:
        global _bar_open
        if self._p:
            self._p.stop()
            _bar_open = False  # only once its last line is written in full


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TB"


def stop_on_error(rt: Runtime, error: ConvertError | None) -> None:
    """Collective: every rank stops when any rank has an error. The lowest rank that has one says it (one line,
    whichever rank that is); the others stop quietly."""
    first = rt.first_failed(error is not None)
    if first is None:
        return
    if error is not None and first == rt.rank:
        error.local = True
        raise error
    quiet = ConvertError(f"rank {first} failed (see its error above)", "fix that cause and rerun")
    quiet.quiet = True
    raise quiet
