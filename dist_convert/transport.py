"""How a job's bytes cross ranks: a pure decision from the plan and the job's shape, and the shared
memory segments of the ``shm`` path.

Paths, per pair of ranks (docs/exchange.md):

- ``local``: reader and writer are the same rank (a copy, no transport); a job where nothing crosses ranks
  uses no collective at all. One exception: a one-rank job with ``--exchange gloo|nccl`` has no peer, so its own
  bytes go through the one-rank collective (``ExchangePath.own``): a check of that transport on one device, which
  ``launch/gpu_check.sh`` runs on a one-GPU machine.
- ``shm``: peers on the same node. Each sender packs its payloads for them straight into its segment, a file
  under /dev/shm reserved once per job at its largest wave (one copy, cast included); its readers map it once
  and the name is removed before the first wave; per wave, a barrier, the readers unpack from the mapping, a
  barrier (exchange.Mover).
- ``gloo``: the CPU collective (``all_to_all_single``), across nodes on a CPU runtime, or when asked.
- ``nccl``: the bulk bytes over NCCL; only with a CUDA runtime (``--backend nccl``), across nodes by default.

``auto``: same-node peers over shm (the bytes are in host memory at both ends: NCCL would add a copy to the
GPU and one back on top of the packing copy), other nodes over NCCL with a CUDA runtime, else gloo. Without a
usable /dev/shm (missing, or too small for the largest wave) same-node peers use the collective too."""
from __future__ import annotations

import mmap
import os
import re
import socket
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import ConvertError
from .plan import Plan, aligned
from .runtime import human_bytes

EXCHANGES = ("auto", "shm", "gloo", "nccl")
COLLECTIVES = ("gloo", "nccl")
SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "dist_convert."
PAGE = mmap.ALLOCATIONGRANULARITY  # each peer's part of a segment starts on a page boundary
SHM_HEADROOM = 64 << 20  # bytes /dev/shm keeps free beyond a wave's segments


def node_of(rank: int, local_world_size: int) -> int:
    """Pure: the node of ``rank`` in a job of homogeneous nodes of ``local_world_size`` ranks (torchrun numbers
    ranks node by node)."""
    if local_world_size < 1:
        raise ValueError(f"local world size {local_world_size} is not positive")
    return rank // local_world_size


def node_map(world: int, local_world_size: int, group_ranks: Sequence[int | None] | None = None) -> tuple[int, ...]:
    """Pure: the node of every rank. ``group_ranks``: each rank's GROUP_RANK (torchrun's node rank) where
    known, which wins over the homogeneous rule (nodes with different numbers of ranks)."""
    rule = [node_of(r, local_world_size) for r in range(world)]
    if group_ranks is None or any(g is None for g in group_ranks):
        return tuple(rule)
    return tuple(int(g) for g in group_ranks)  # type: ignore[arg-type]


@dataclass(frozen=True, kw_only=True)
class LaunchEnv:
    """What torchrun says about this rank's node (None: not set; then the job is taken as one node)."""

    local_world_size: int | None
    group_rank: int | None
    run_id: str
    shm_dir: Path = SHM_DIR  # DIST_CONVERT_SHM_DIR: where segments go (a test points it at a missing directory)


def launch_env(env: Mapping[str, str] | None = None) -> LaunchEnv:
    """The one place the node variables are read."""
    env = os.environ if env is None else env
    lws, grp = env.get("LOCAL_WORLD_SIZE"), env.get("GROUP_RANK")
    return LaunchEnv(local_world_size=int(lws) if lws else None, group_rank=int(grp) if grp else None,
                     run_id=re.sub(r"[^A-Za-z0-9]", "", env.get("TORCHELASTIC_RUN_ID", ""))[:12] or "job",
                     shm_dir=Path(env.get("DIST_CONVERT_SHM_DIR") or SHM_DIR))


def pair_bytes(plan: Plan) -> dict[tuple[int, int], int]:
    """Pure: payload bytes from reader to writer over the whole plan, for pairs of different ranks."""
    out: dict[tuple[int, int], int] = defaultdict(int)
    for w in plan.waves:
        for t in w.transfers:
            if t.reader != t.writer:
                out[(t.reader, t.writer)] += t.nbytes
    return dict(out)


@dataclass(frozen=True, kw_only=True)
class ExchangePath:
    """The job's exchange: how peers on one node (``within``) and on different nodes (``across``) move bytes
    (``local``: no such bytes), and how many bytes cross ranks and nodes."""

    within: str
    across: str
    own: str = "local"  # a rank's own bytes: a copy, or at world 1 with --exchange gloo|nccl that collective
    nodes: tuple[int, ...]  # node of each rank
    cross_rank_bytes: int
    cross_node_bytes: int
    requested: str = "auto"
    note: str | None = None  # why a path differs from what was asked (e.g. /dev/shm too small)

    def via(self, a: int, b: int) -> str:
        if a == b:
            return self.own
        return self.within if self.nodes[a] == self.nodes[b] else self.across

    @property
    def uses_shm(self) -> bool:
        return "shm" in (self.within, self.across)

    @property
    def collective(self) -> str | None:
        """The collective transport the job uses (gloo or nccl), if any."""
        return next((p for p in (self.across, self.within, self.own) if p in COLLECTIVES), None)

    def describe(self) -> str:
        if self.own != "local":
            return (f"exchange: one rank, its own bytes through {self.own} (--exchange {self.requested}: a check of "
                    "the transport)")
        if self.cross_rank_bytes == 0:
            return "exchange: local (no bytes cross ranks; no collective transport)"
        n = len(set(self.nodes))
        parts = []
        if self.cross_rank_bytes > self.cross_node_bytes:
            parts.append(f"{self.within} within node")
        if self.cross_node_bytes:
            parts.append(f"{self.across} across {n} nodes")
        forced = f" (--exchange {self.requested})" if self.requested != "auto" else ""
        line = (f"exchange: {', '.join(parts)}{forced}; {human_bytes(self.cross_rank_bytes)} cross ranks"
                + (f", {human_bytes(self.cross_node_bytes)} across nodes" if 0 < self.cross_node_bytes else ""))
        return line + (f"; {self.note}" if self.note else "")


def decide(pairs: Mapping[tuple[int, int], int], nodes: Sequence[int], requested: str = "auto", cuda: bool = False,
           shm_ok: bool = True, shm_why: str = "") -> ExchangePath:
    """Pure: the exchange of a job whose plan moves ``pairs`` bytes (``pair_bytes``) between ranks on ``nodes``.
    ``cuda``: the runtime device is CUDA (an NCCL group); ``shm_ok``: /dev/shm can hold the largest wave
    (``shm_why`` says why not). ``nccl`` without CUDA is refused naming the flag."""
    if requested not in EXCHANGES:
        raise ConvertError(f"unknown --exchange {requested}", f"use one of {', '.join(EXCHANGES)}")
    if requested == "nccl" and not cuda:
        raise ConvertError("--exchange nccl needs a CUDA runtime (GPUs and --backend nccl); this job runs on CPU "
                           "with gloo", "use --exchange auto, shm or gloo")
    cross = {p: n for p, n in pairs.items() if n > 0 and p[0] != p[1]}
    same = sum(n for (a, b), n in cross.items() if nodes[a] == nodes[b])
    other = sum(cross.values()) - same
    collective = "nccl" if cuda else "gloo"
    note = None
    if requested in COLLECTIVES:
        within = across = requested
    else:  # auto or shm: same-node peers over shared memory, others over the runtime's collective
        within, across = "shm", collective
        if same and not shm_ok:
            within = collective
            note = f"{shm_why or '/dev/shm is not usable'}: same-node peers use {collective}"
    own = requested if requested in COLLECTIVES and len(nodes) == 1 else "local"  # no peer: the check of it
    return ExchangePath(within=within if same else "local", across=across if other else "local", own=own,
                        nodes=tuple(nodes), cross_rank_bytes=same + other, cross_node_bytes=other,
                        requested=requested, note=note)


def segment_sizes(plan: Plan, nodes: Sequence[int]) -> list[int]:
    """Pure: per rank, its shm segment: the most it packs for its same-node peers in any one wave, each peer's
    part page-aligned (0: it sends nothing over shared memory). A node's /dev/shm holds its ranks' segments."""
    out = [0] * len(nodes)
    for w in plan.waves:
        per: dict[tuple[int, int], int] = defaultdict(int)  # (sender, receiver) -> aligned bytes
        for t in w.transfers:
            if t.reader != t.writer and nodes[t.reader] == nodes[t.writer]:
                per[(t.reader, t.writer)] += aligned(t.nbytes)
        wave: dict[int, int] = defaultdict(int)
        for (a, _), n in per.items():
            wave[a] += page_aligned(n)
        for a, n in wave.items():
            out[a] = max(out[a], n)
    return out


def shm_need(plan: Plan, nodes: Sequence[int]) -> int:
    """Pure: the most /dev/shm one node's segments take (``segment_sizes`` summed per node)."""
    per: dict[int, int] = defaultdict(int)
    for rank, n in enumerate(segment_sizes(plan, nodes)):
        per[nodes[rank]] += n
    return max(per.values(), default=0)


def page_aligned(n: int) -> int:
    return -(-n // PAGE) * PAGE


def shm_room(need: int, where: Path = SHM_DIR) -> str | None:
    """Why /dev/shm cannot take ``need`` bytes at once (None: it can)."""
    if not where.is_dir() or not os.access(where, os.W_OK):
        return f"{where} is missing or not writable"
    st = os.statvfs(where)
    free = st.f_bavail * st.f_frsize
    if free < need + SHM_HEADROOM:
        return f"{where} has {human_bytes(free)} free and a wave needs {human_bytes(need)}"
    return None


def segment_offsets(sizes: Mapping[int, int]) -> tuple[dict[int, int], int]:
    """Pure: where each peer's part (``sizes``: peer -> bytes) starts in a sender's segment (page-aligned, in peer
    order, empty parts left out), and the segment's size."""
    offsets, pos = {}, 0
    for peer in sorted(p for p, n in sizes.items() if n > 0):
        offsets[peer] = pos
        pos += page_aligned(sizes[peer])
    return offsets, pos


def host_tag() -> str:
    """This host, as a segment name says it (a /dev/shm shared across containers holds other hosts' segments)."""
    return re.sub(r"[^A-Za-z0-9]", "", socket.gethostname())[:16] or "host"


def segment_path(run: str, token: str, rank: int, where: Path = SHM_DIR, pid: int | None = None) -> Path:
    """Segment of ``rank`` in one execute call (``token``: rank 0's); the owner's host and pid are in the name so
    that a later run can remove what a killed one left (``remove_stale``)."""
    return where / f"{SHM_PREFIX}{run}.{token}.r{rank}.{host_tag()}.p{os.getpid() if pid is None else pid}"


def remove_stale(where: Path = SHM_DIR) -> list[Path]:
    """Remove the segments this host's dead processes left (a rank killed inside a wave, before its segment's
    name was removed: SIGKILL, or torchrun's SIGTERM to the survivors); returns them."""
    gone = []
    for path in leftover_segments(where):
        host, _, pid = path.name.rpartition(".p")
        if not host.endswith(f".{host_tag()}") or not pid.isdigit() or _alive(int(pid)):
            continue
        try:
            path.unlink()
            gone.append(path)
        except OSError:
            pass
    return gone


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Segment:
    """A sender's segment for one wave: a file under /dev/shm, reserved in full (``posix_fallocate``: a full
    /dev/shm is an OSError here, never a SIGBUS while packing) and mapped shared. ``unlink`` removes the name;
    the pages live until the last mapping (a receiver's block still being written) is dropped."""

    def __init__(self, path: Path, size: int) -> None:
        self.path = path
        self.buf: torch.Tensor | None = None
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.posix_fallocate(fd, 0, max(size, 1))
            self.buf = torch.frombuffer(mmap.mmap(fd, max(size, 1)), dtype=torch.uint8)  # keeps the mapping
        except BaseException:
            self.unlink()
            raise
        finally:
            os.close(fd)

    def unlink(self) -> None:
        self.buf = None
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def map_part(path: Path, offset: int, size: int) -> torch.Tensor:
    """A receiver's part of a peer's segment: mapped copy-on-write (writes stay private), from a page boundary;
    the tensor keeps the mapping alive after the file is unlinked."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return torch.frombuffer(mmap.mmap(fd, size, access=mmap.ACCESS_COPY, offset=offset), dtype=torch.uint8)
    finally:
        os.close(fd)


def leftover_segments(where: Path = SHM_DIR) -> list[Path]:
    """Segments of any dist_convert run still under /dev/shm (a run leaves none)."""
    return sorted(where.glob(f"{SHM_PREFIX}*")) if where.is_dir() else []
