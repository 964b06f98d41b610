"""Staging of a target, the one way every command writes one (reshard, speculate, ``--export-draft``).

The target is written into ``DST.dist_convert_tmp/`` beside DST, marked incomplete (integrity.MARKER).
``--resume`` continues an interrupted run with the same fingerprint; without it a stale directory is
discarded unless it holds finished (journaled) files, which only ``--overwrite`` discards. At the end
rank 0 writes the format's metadata, the tracker and the checksum manifest, in that order
(``Staging.complete``); the run state goes and the directory (or the archive made from it) is renamed
to DST, an old DST being removed only once the new one is complete (``Staging.commit``). A failed run
(``Staging.guard``) leaves nothing that looks like a checkpoint: the directory is removed unless it
holds journaled files, which are kept for ``--resume``. Rank 0 removes it only once every rank said (in the
job's store, beside the collectives) that it stopped writing into it: a rank still writing never finds it gone.
"""
from __future__ import annotations

import contextlib
import errno
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .datamodel import TargetFile
from .durable import fsync_dir, fsync_tree
from .errors import ConvertError
from .formats.base import on_rank0, write_tracker
from .integrity import (
    INCOMPLETE_SUFFIX,
    Entry,
    file_sha256,
    read_journal,
    read_marker,
    remove_run_state,
    restart_journal,
    write_manifest,
    write_marker,
)
from .interrupts import Interrupted, cleaning, cleanup_by, set_outcome
from .plan import balance
from .runtime import Runtime, collective_failure, job_store

OLD_SUFFIX = ".dist_convert_old"  # an old DST, renamed aside while the new one takes its place
LEAVE_WAIT_S = 5.0  # how long rank 0 waits for the other ranks to stop writing before it removes a failed run
LEAVE_POLL_S = 0.02
SPACE_FIX = "free space or raise the file size limit where DST lives (df -h, ulimit -f)"
# errno of a failed write -> its fix (default: SPACE_FIX)
WRITE_FIXES = {
    errno.EROFS: "choose a DST on a writable file system",
    errno.EACCES: "this user may not write there; choose a DST you may write to, or fix the folder's permissions",
    errno.EPERM: "this user may not write there; choose a DST you may write to, or fix the folder's permissions",
    errno.EDQUOT: "free space under your disk quota where DST lives (quota -s, df -h)",
}


def staging_dir(dst: Path) -> Path:
    """Where the target of ``dst`` is written until it is complete."""
    return dst.parent / (dst.name + INCOMPLETE_SUFFIX)


def refuse_existing(path: Path, overwrite: bool, what: str = "target", other: str = "another DST") -> None:
    """Every rank, before any work: an existing ``path`` is replaced only with ``--overwrite``."""
    if path.exists() and not overwrite:
        raise ConvertError(f"{what} {path} already exists", f"pass --overwrite to replace it or choose {other}")


def refuse_overlap(src: Path, dst: Path, flag: str = "DST") -> None:
    """Pure (paths only): a target equal to its source, inside it, or holding it is refused, ``--overwrite`` or
    not (the target's staging directory would land in the source, or replacing DST would delete the source)."""
    s, d = src.resolve(), dst.resolve()
    if s == d:
        why = "is the source"
    elif s in d.parents:
        why = "lies inside the source"
    elif d in s.parents:
        why = "holds the source (replacing it would delete it):"
    else:
        return
    raise ConvertError(f"{flag} {dst} {why} {src}",
                       f"choose a {flag} outside SRC that does not contain it (--overwrite never allows this)")


def write_error(e: BaseException, where: Path, staging: Path | None = None) -> ConvertError:
    """Any failure of a writer (OSError, or torch.save's RuntimeError around one) as one line naming the path and
    the cause; ``staging``: the run's staging directory, named when it vanished mid-run."""
    inner: BaseException | None = e
    while inner is not None and not isinstance(inner, OSError):
        inner = inner.__cause__ or inner.__context__
    e = inner if isinstance(inner, OSError) else e
    if staging is not None and not staging.is_dir():
        return ConvertError(f"writing {where} failed: the staging directory {staging} vanished mid-run (removed by "
                            "another process?)", "rerun, and keep other jobs and clean-ups away from DST's folder")
    if isinstance(e, OSError):
        what, why = e.filename or where, e.strerror or str(e)
        fix = WRITE_FIXES.get(e.errno or 0, SPACE_FIX)
    else:
        what, why, fix = where, (str(e).strip().splitlines() or [type(e).__name__])[0][:200], SPACE_FIX
    return ConvertError(f"writing {what} failed: {why}", fix)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


class Staging:
    """The temporary directory ``tmp`` a target ``dst`` is written into (made by ``stage``)."""

    def __init__(self, dst: Path, rt: Runtime, token: str = "") -> None:
        self.dst, self.rt = dst, rt
        self.tmp = staging_dir(dst)
        self.key = f"dist_convert/staging/{token}"  # this run's keys in the job's store
        self._lock = threading.Lock()
        self._aborted: BaseException | None = None

    def resumed(self, files: list[TargetFile]) -> dict[int, Entry]:
        """Collective (``--resume``): the journaled target files whose size and SHA-256 still match,
        checked in parallel; the journal is rewritten to hold just those."""
        rt, names = self.rt, {f.id for f in files}
        journal = {fid: e for fid, e in read_journal(self.tmp).items() if fid in names}
        owner = balance({fid: e.bytes for fid, e in journal.items()}, rt.world)
        good = []
        for fid, e in journal.items():
            path = self.tmp / e.name
            if owner[fid] == rt.rank and path.is_file() and path.stat().st_size == e.bytes \
                    and file_sha256(path) == e.sha256:
                good.append(fid)
        kept = {fid: journal[fid] for part in rt.all_gather_object(good) for fid in part}
        if rt.rank == 0:
            restart_journal(self.tmp, list(kept.values()))
        rt.barrier()
        return kept

    def complete(self, metadata: Callable[[dict[int, Entry]], None] | None = None,
                 tracker: int | str | None = None) -> None:
        """Collective, after every rank wrote its files: rank 0 writes, last and in this order, the
        format's metadata (``metadata(journal)``, given every journaled file by target file id), the
        tracker naming iteration ``tracker`` (Megatron-LM layouts) and the checksum manifest of every
        file. A failed write stops every rank with one line."""

        def last() -> None:
            entries = read_journal(self.tmp)
            try:
                if metadata is not None:
                    metadata(entries)
                if tracker is not None:
                    write_tracker(self.tmp, tracker)
                write_manifest(self.tmp, known={e.name: e for e in entries.values()})
            except (OSError, RuntimeError) as e:
                raise write_error(e, self.tmp) from None

        on_rank0(self.rt, last)

    def commit(self, artifact: Path | None = None) -> None:
        """Collective: rank 0 swaps the finished directory (or ``artifact``, e.g. an archive made from
        it) into place; an old target is removed only now."""

        def swap() -> None:
            src = self.tmp if artifact is None else artifact
            try:
                if self.tmp.is_dir():
                    remove_run_state(self.tmp)
                if src.is_dir():
                    fsync_tree(src)  # every file's directory entry, before the rename makes them visible
                if self.dst.exists():
                    old = self.dst.parent / (self.dst.name + OLD_SUFFIX)
                    _remove(old)
                    self.dst.rename(old)
                    src.rename(self.dst)
                    _remove(old)
                else:
                    src.rename(self.dst)
                fsync_dir(self.dst.parent)
            except OSError as e:
                raise write_error(e, self.dst) from None

        on_rank0(self.rt, swap)
        set_outcome(f"{self.dst} was complete")

    def _finished(self) -> int:
        return len(read_journal(self.tmp)) if self.tmp.is_dir() else 0

    def _all_left(self, store: Any) -> bool:
        """Rank 0: whether every rank said it stopped writing (within LEAVE_WAIT_S)."""
        if store is None or self.rt.world == 1:
            return True
        deadline = time.monotonic() + LEAVE_WAIT_S
        while (_store_call(store, "add", self.key + "/left", 0) or 0) < self.rt.world:
            if time.monotonic() > deadline:
                return False
            time.sleep(LEAVE_POLL_S)
        return True

    def abort(self, e: BaseException) -> BaseException:
        """A failed or interrupted run leaves nothing that looks like a checkpoint: the marked directory is kept
        when it holds journaled files (for ``--resume``, said in the error), else rank 0 removes it once every rank
        stopped writing (kept, marked, when a rank does not say so within LEAVE_WAIT_S: a lost one; the next run
        replaces it). Returns the error to raise: a failed collective becomes a one-line ConvertError, or
        ``Interrupted`` on rank 0 when the rank that left was interrupted. Runs once (the main thread or the
        interrupt watchdog, whichever comes first); a signal does not cut it short."""
        with cleaning(), self._lock:
            if self._aborted is None:
                self._aborted = self._abort(e)
            return self._aborted

    def _abort(self, e: BaseException) -> BaseException:
        rt, store = self.rt, job_store(self.rt)
        interrupted = isinstance(e, Interrupted)
        err = e if isinstance(e, ConvertError) else None if interrupted else collective_failure(e, rt)
        if interrupted:
            _store_call(store, "set", self.key + "/interrupted", str(e))
        finished = self._finished()  # before this rank says it left: rank 0 may remove the directory after that
        _store_call(store, "add", self.key + "/left", 1)
        left = rt.rank == 0 and self._all_left(store)  # rank 0 hosts the store with --nproc: it waits for the rest
        if rt.rank == 0 and self.tmp.is_dir():
            if not finished and left and not self._finished():
                shutil.rmtree(self.tmp, ignore_errors=True)
                set_outcome(f"nothing written, {self.tmp} removed")
            else:
                finished = self._finished()
                set_outcome(f"{self.tmp} kept with {finished} finished target files: rerun the same command with "
                            "--resume to convert only the rest" if finished else
                            f"{self.tmp} kept (no finished target file; a rank did not stop within "
                            f"{LEAVE_WAIT_S:g} s): the next run replaces it")
            if err is not None and err.group_broken and _store_call(store, "check", [self.key + "/interrupted"]):
                peer = _store_call(store, "get", self.key + "/interrupted")  # a peer's signal, e.g. b"SIGINT"
                return Interrupted.of_peer(peer.decode() if isinstance(peer, bytes) else "SIGTERM")
        if finished and err is not None:
            err.add_fix(f"{finished} finished target files are kept in {self.tmp}: rerun the same command with "
                        "--resume to convert only the rest")
        return e if err is None else err

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """The writing of the target: any failure or interrupt inside is cleaned up (``abort``) and re-raised."""
        with cleanup_by(self.abort):
            try:
                yield
            except BaseException as e:
                err = self.abort(e)
                if err is e:
                    raise
                raise err from None


def _store_call(store: Any, op: str, *args: Any) -> Any:
    """An operation on the job's store that may fail (its host, rank 0 or torchrun's agent, is gone): None then."""
    if store is None:
        return None
    try:
        return getattr(store, op)(*args)
    except (RuntimeError, OSError, ValueError):
        return None


def stage(dst: Path, rt: Runtime, *, marker: dict[str, Any] | None = None, resume: bool = False,
          overwrite: bool = False) -> Staging:
    """Collective: the temporary directory beside ``dst`` that is renamed into place at the end,
    marked incomplete (``marker``: what the run is). Fresh unless ``resume``, which needs the
    interrupted run's directory with the same fingerprint."""
    tmp, marker = staging_dir(dst), marker or {}

    def make() -> str:
        try:
            made()
        except OSError as e:
            raise write_error(e, tmp) from None
        return secrets.token_hex(8)  # this run's name in the job's store

    def made() -> None:
        before = read_marker(tmp)
        if resume:
            if before is None:
                raise ConvertError(f"--resume: there is no interrupted conversion to {dst} ({tmp} "
                                   f"{'is not one' if tmp.exists() else 'does not exist'})", "run without --resume")
            if before.get("fingerprint") != marker.get("fingerprint"):
                raise ConvertError(f"--resume: {tmp} was started by a different conversion (source, target layout, "
                                   f"format or world size differ: it had {before.get('world', '?')} ranks)",
                                   "rerun with the interrupted run's arguments and world size, or drop --resume "
                                   "and pass --overwrite to start over")
            return
        if tmp.exists():
            finished = len(read_journal(tmp)) if before is not None else 0
            if finished and not overwrite:
                raise ConvertError(f"an interrupted conversion to {dst} left {finished} finished target files in "
                                   f"{tmp}", "pass --resume to continue it, or --overwrite to start over")
            _remove(tmp)
        tmp.mkdir(parents=True)
        write_marker(tmp, marker)

    return Staging(dst, rt, on_rank0(rt, make))
