"""Crash safety and integrity of a target.

While a conversion runs, its output lives in ``DST.dist_convert_tmp/`` with a marker file
(``MARKER``) that says it is incomplete and which conversion made it (a fingerprint of the target
files). Each rank journals every target file it finished (fsynced first) with its size and SHA-256;
``--resume`` keeps the journaled files whose checksums still match and converts only the rest. At the
end rank 0 writes the format's metadata, the tracker and the checksum manifest (``MANIFEST``: every
file of the target), removes journal and marker and renames the directory into place (the order is
staging.py's). ``verify --checksums`` checks a target against its manifest without a source.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tarfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from .datamodel import TargetFile, WrittenFile
from .durable import write_durable
from .errors import ConvertError
from .plan import balance
from .runtime import Runtime

MARKER = ".dist_convert_incomplete.json"
JOURNAL = ".dist_convert_journal"
MANIFEST = "dist_convert_checksums.json"
INCOMPLETE_SUFFIX = ".dist_convert_tmp"


def is_run_state(rel: Path) -> bool:
    """Whether ``rel`` (relative to the target root) is the marker or the journal, not target content."""
    return rel.parts[0] in (MARKER, JOURNAL)


def sha256_of(fh: IO[bytes]) -> str:
    return hashlib.file_digest(fh, "sha256").hexdigest()


def file_sha256(path: Path) -> str:
    with open(path, "rb") as fh:
        return sha256_of(fh)


def fingerprint(files: list[TargetFile], what: dict[str, Any]) -> str:
    """Identifies a conversion's target: every file, tensor, box and dtype, plus ``what`` (format,
    source, iteration...). A resumed run must produce the same one."""
    desc = [what] + [[f.name, sorted(f.objects), [[t.key, t.shape, str(t.dtype), t.offsets] for t in f.tensors]]
                     for f in files]
    return hashlib.sha256(json.dumps(desc, default=str).encode()).hexdigest()


@dataclass(frozen=True, kw_only=True)
class Entry:
    """A finished target file as journaled: ``name`` is relative to the target root."""

    file: int
    name: str
    bytes: int
    sha256: str
    record: dict[str, Any] = field(default_factory=dict)

    def written(self, prefix: str) -> WrittenFile:
        """As the writer reported it (``name`` relative to the writer's directory ``prefix``)."""
        return WrittenFile(file=self.file, name=self.name[len(prefix):].lstrip("/"), sha256=self.sha256,
                           record=self.record)


class Journal:
    """This rank's list of finished target files (one JSON line each, fsynced)."""

    def __init__(self, root: Path, rank: int, prefix: str) -> None:
        self.root, self.prefix = root, prefix
        (root / JOURNAL).mkdir(exist_ok=True)
        self.fh = open(root / JOURNAL / f"rank_{rank:05d}.jsonl", "a")

    def add(self, w: WrittenFile) -> Entry:
        name = f"{self.prefix}/{w.name}" if self.prefix else w.name
        path = self.root / name
        entry = Entry(file=w.file, name=name, bytes=path.stat().st_size, sha256=w.sha256, record=w.record)
        self.fh.write(json.dumps(asdict(entry)) + "\n")
        self.fh.flush()
        os.fsync(self.fh.fileno())
        return entry

    def close(self) -> None:
        self.fh.close()


def read_journal(root: Path) -> dict[int, Entry]:
    """Every rank's journaled files (a torn last line, from a crash mid-append, is ignored)."""
    out: dict[int, Entry] = {}
    for path in sorted((root / JOURNAL).glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                e = Entry(**json.loads(line))
            except (ValueError, TypeError):
                continue
            out[e.file] = e
    return out


def restart_journal(root: Path, entries: list[Entry]) -> None:
    """Rank 0 (``--resume``): the journal holds just ``entries`` (the files kept) before ranks add theirs."""
    shutil.rmtree(root / JOURNAL, ignore_errors=True)
    (root / JOURNAL).mkdir()
    write_durable(root / JOURNAL / "resumed.jsonl", "".join(json.dumps(asdict(e)) + "\n" for e in entries))


def write_marker(root: Path, info: dict[str, Any]) -> None:
    write_durable(root / MARKER, json.dumps({**info, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, indent=1))


def read_marker(path: Path) -> dict[str, Any] | None:
    f = path / MARKER
    if not f.is_file():
        return None
    try:
        return json.loads(f.read_text())
    except ValueError:
        return {}


def incomplete_run(path: Path) -> Path | None:
    """The interrupted (or running) conversion's directory that ``path`` is or lies in, or, when
    ``path`` does not exist, the one that writes to it (``path.dist_convert_tmp`` beside it)."""
    candidates = [path, *list(path.parents)[:2]]
    if not path.exists():
        candidates.append(path.parent / (path.name + INCOMPLETE_SUFFIX))
    return next((p for p in candidates if (p / MARKER).is_file()), None)


def refuse_incomplete(path: Path) -> None:
    """``inspect`` and ``verify`` refuse an interrupted conversion's output, saying what to do."""
    tmp = incomplete_run(path)
    if tmp is None:
        return
    info = read_marker(tmp) or {}
    raise ConvertError(f"{tmp} is an incomplete dist_convert output ({len(read_journal(tmp))} of "
                       f"{info.get('files', '?')} target files finished; started {info.get('started', '?')})",
                       "rerun the same reshard command with --resume to finish it, or delete it")


def write_manifest(root: Path, known: dict[str, Entry] | None = None) -> None:
    """Rank 0, last: size and SHA-256 of every file under ``root`` (journaled files
    take their journaled checksum: they were hashed once, as they were finished)."""
    known = known or {}
    files: dict[str, dict[str, Any]] = {}
    for p in sorted(q for q in root.rglob("*") if q.is_file()):
        rel = p.relative_to(root).as_posix()
        if is_run_state(p.relative_to(root)) or rel == MANIFEST:
            continue
        e = known.get(rel)
        files[rel] = {"bytes": e.bytes, "sha256": e.sha256} if e else {"bytes": p.stat().st_size,
                                                                        "sha256": file_sha256(p)}
    write_durable(root / MANIFEST, json.dumps({"algorithm": "sha256", "files": files}, indent=1))


def remove_run_state(root: Path) -> None:
    """Rank 0, just before the rename: the journal and the marker go (the manifest stays)."""
    shutil.rmtree(root / JOURNAL, ignore_errors=True)
    (root / MARKER).unlink(missing_ok=True)


def _load_manifest(text: str, where: str) -> dict[str, dict[str, Any]]:
    try:
        files = json.loads(text)["files"]
        return {str(k): {"bytes": int(v["bytes"]), "sha256": str(v["sha256"])} for k, v in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ConvertError(f"{where} is not a dist_convert checksum manifest",
                           "it is damaged; re-create it by converting again") from None


def check_checksums(path: Path, rt: Runtime) -> list[str]:
    """Collective: every file of the manifest of ``path`` (a directory or a ``.nemo`` archive) hashed
    by one rank (balanced by size); returns one problem line per missing, resized, changed or
    unlisted file."""
    refuse_incomplete(path)
    with contextlib.ExitStack() as stack:
        if path.is_file() and tarfile.is_tarfile(path):  # one open archive: listed once, read member by member
            tar = stack.enter_context(tarfile.open(path))
            members = {m.name.removeprefix("./"): m for m in tar.getmembers() if m.isfile()}
            present = {n: m.size for n, m in members.items()}

            def read(n: str) -> IO[bytes]:
                return tar.extractfile(members[n])
        elif path.is_dir():
            present = {p.relative_to(path).as_posix(): p.stat().st_size for p in path.rglob("*") if p.is_file()}

            def read(n: str) -> IO[bytes]:
                return open(path / n, "rb")
        else:
            raise ConvertError(f"{path} does not exist or is not a checkpoint",
                               "pass the target directory (or .nemo archive) to check")
        if MANIFEST not in present:
            raise ConvertError(f"{path} has no {MANIFEST}",
                               "only targets written by dist_convert carry checksums; compare it to its source with "
                               "`verify A B` instead")
        with read(MANIFEST) as fh:
            manifest = _load_manifest(fh.read().decode(), f"{path}:{MANIFEST}")
        names = sorted(manifest)
        owner = balance({i: manifest[n]["bytes"] for i, n in enumerate(names)}, rt.world)
        problems = [f"{n}: not in the manifest" for n in sorted(set(present) - set(manifest) - {MANIFEST})] \
            if rt.rank == 0 else []
        for n in (n for i, n in enumerate(names) if owner[i] == rt.rank):
            want = manifest[n]
            if n not in present:
                problems.append(f"{n}: missing")
            elif present[n] != want["bytes"]:
                problems.append(f"{n}: {present[n]} bytes, the manifest says {want['bytes']}")
            else:
                with read(n) as fh:
                    got = sha256_of(fh)
                if got != want["sha256"]:
                    problems.append(f"{n}: SHA-256 {got[:16]}... differs from the manifest's {want['sha256'][:16]}...")
    return [p for part in rt.all_gather_object(problems) for p in part]
