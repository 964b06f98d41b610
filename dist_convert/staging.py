"""Staging of a target, the one way every command writes one (reshard, speculate, ``--export-draft``).

The target is written into ``DST.dist_convert_tmp/`` beside DST, marked incomplete (integrity.MARKER).
``--resume`` continues an interrupted run with the same fingerprint; without it a stale directory is
discarded unless it holds finished (journaled) files, which only ``--overwrite`` discards. At the end
rank 0 writes the format's metadata, the tracker and the checksum manifest, in that order
(``Staging.complete``); the run state goes and the directory (or the archive made from it) is renamed
to DST, an old DST being removed only once the new one is complete (``Staging.commit``). A failed run
(``Staging.guard``) leaves nothing that looks like a checkpoint: the directory is removed unless it
holds journaled files, which are kept for ``--resume``.
"""
from __future__ import annotations

import contextlib
import shutil
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
from .plan import balance
from .runtime import Runtime, collective_failure

OLD_SUFFIX = ".dist_convert_old"  # an old DST, renamed aside while the new one takes its place


def staging_dir(dst: Path) -> Path:
    """Where the target of ``dst`` is written until it is complete."""
    return dst.parent / (dst.name + INCOMPLETE_SUFFIX)


def refuse_existing(path: Path, overwrite: bool, what: str = "target", other: str = "another DST") -> None:
    """Every rank, before any work: an existing ``path`` is replaced only with ``--overwrite``."""
    if path.exists() and not overwrite:
        raise ConvertError(f"{what} {path} already exists", f"pass --overwrite to replace it or choose {other}")


def write_error(e: BaseException, where: Path) -> ConvertError:
    """Any failure of a writer (OSError, or torch.save's RuntimeError around one) as one line."""
    inner: BaseException | None = e
    while inner is not None and not isinstance(inner, OSError):
        inner = inner.__cause__ or inner.__context__
    e = inner if isinstance(inner, OSError) else e
    if isinstance(e, OSError):
        what, why = e.filename or where, e.strerror or str(e)
    else:
        what, why = where, (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
    return ConvertError(f"writing {what} failed: {why}",
                        "free space or raise the file size limit where DST lives (df -h, ulimit -f)")


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


class Staging:
    """The temporary directory ``tmp`` a target ``dst`` is written into (made by ``stage``)."""

    def __init__(self, dst: Path, rt: Runtime) -> None:
        self.dst, self.rt = dst, rt
        self.tmp = staging_dir(dst)

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
        if self.rt.rank == 0:
            src = self.tmp if artifact is None else artifact
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
        self.rt.wait_for_rank0()

    def abort(self, e: BaseException) -> BaseException:
        """A failed run leaves nothing that looks like a checkpoint: rank 0 keeps the marked directory
        when it holds journaled files (for ``--resume``, said in the error), else removes it. Returns
        the error to raise (a failed collective becomes a one-line ConvertError)."""
        err = e if isinstance(e, ConvertError) else collective_failure(e, self.rt)
        finished = len(read_journal(self.tmp)) if self.tmp.is_dir() else 0
        if not finished:
            if self.rt.rank == 0:
                shutil.rmtree(self.tmp, ignore_errors=True)
        elif err is not None:
            err.add_fix(f"{finished} finished target files are kept in {self.tmp}: rerun the same command with "
                        "--resume to convert only the rest")
        return e if err is None else err

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """The writing of the target: any failure inside is cleaned up (``abort``) and re-raised."""
        try:
            yield
        except BaseException as e:
            err = self.abort(e)
            if err is e:
                raise
            raise err from None


def stage(dst: Path, rt: Runtime, *, marker: dict[str, Any] | None = None, resume: bool = False,
          overwrite: bool = False) -> Staging:
    """Collective: the temporary directory beside ``dst`` that is renamed into place at the end,
    marked incomplete (``marker``: what the run is). Fresh unless ``resume``, which needs the
    interrupted run's directory with the same fingerprint."""
    staging = Staging(dst, rt)
    tmp, marker = staging.tmp, marker or {}

    def make() -> None:
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

    on_rank0(rt, make)
    return staging
