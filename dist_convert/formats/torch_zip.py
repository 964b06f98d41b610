"""``torch.save`` files written as their tensors arrive (``SavedFiles``: the megatron and NeMo 1 rank files'
``TargetWriter``), byte for byte what ``torch.save`` writes from the same object.

torch.save writes a zip: ``data.pkl`` (the object, each tensor's storage a persistent id ``data/K``), a few small
records, then each storage's bytes as a stored record ``data/K`` at a 64-byte aligned offset, ``version``,
``.data/serialization_id``, the central directory. Every record's CRC-32 sits in its data descriptor (after its
bytes; the local header holds none) and in the central directory, and the serialization id ends with a hash of
every record's CRC. So what a file holds besides its storages' bytes follows from the object alone, tensors given
as dtype and shape: ``save_layout`` lets torch.save itself write that skeleton (``torch.serialization.skip_data``:
the storages' bytes left as holes; the tensors stand-ins from ``torch.empty``, whose pages are never touched) and
reads the records' places from the zip's own headers. ``StreamedSave`` then writes each tensor's bytes at its
place as it arrives, in any order, with the CRC-32 taken as they are written; a part of the skeleton is written
once the CRCs it holds are known, so every byte is written once (``distcp.PositionedFile`` hashes the file front to
back: in file order nothing is read back). A rank holds what its waves hold, never a whole rank file.
"""
from __future__ import annotations

import io
import pickle
import re
import struct
import zipfile
import zlib
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.serialization import config as serialization_config

from ..datamodel import TargetFile, WrittenFile
from .base import StreamedFiles
from .distcp import PositionedFile

_STORAGE = re.compile(r"^[^/]+/data/(\d+)$")  # a storage's record: archive/data/K
_SERIALIZATION_ID = "/.data/serialization_id"
_DESCRIPTOR = b"PK\x07\x08"  # a data descriptor: signature, CRC-32, sizes (APPNOTE 4.3.9)
_DESCRIPTOR_CRC = 4  # the CRC's offset in a data descriptor
_CENTRAL_CRC = 16  # the CRC's offset in a central directory entry (APPNOTE 4.3.12)
_HAS_DESCRIPTOR = 0x08  # general purpose flag bit 3: sizes and CRC follow the data
_U64 = (1 << 64) - 1


class _Sparse(io.RawIOBase):
    """What torch.save writes, with holes where it skips storage bytes (it seeks past them): written parts by
    offset, read back (holes as zeros) by ``zipfile``."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.parts: list[bytearray] = []  # adjacent writes joined: what lies between the holes
        self.pos = self.end = 0

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        data = memoryview(b).cast("B")
        last = self.starts[-1] + len(self.parts[-1]) if self.starts else 0
        assert self.pos >= last, "torch.save wrote backwards"
        if self.starts and self.pos == last:
            self.parts[-1] += data
        else:
            self.starts.append(self.pos)
            self.parts.append(bytearray(data))
        self.pos += len(data)
        self.end = max(self.end, self.pos)
        return len(data)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.pos = offset + (0 if whence == io.SEEK_SET else self.pos if whence == io.SEEK_CUR else self.end)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        n = max(0, min(len(view), self.end - self.pos))
        view[:n] = bytes(n)
        i = max(0, bisect_right(self.starts, self.pos) - 1)
        while i < len(self.starts) and self.starts[i] < self.pos + n:
            lo, hi = max(self.starts[i], self.pos), min(self.starts[i] + len(self.parts[i]), self.pos + n)
            if lo < hi:
                view[lo - self.pos:hi - self.pos] = self.parts[i][lo - self.starts[i]:hi - self.starts[i]]
            i += 1
        self.pos += n
        return n


@dataclass(frozen=True, kw_only=True)
class Record:
    """A zip record of a torch.save file: its name, its data's first byte and length, its CRC-32 (a storage's: the
    skeleton's, replaced by the one of the bytes written), and where that CRC is kept besides the central
    directory: in its data descriptor (None: an empty record has none; its CRC is 0)."""

    name: str
    at: int
    nbytes: int
    crc: int
    descriptor: int | None  # the file offset of its data descriptor's CRC
    central: int  # the file offset of its central directory entry's CRC
    storage: int | None  # K of a storage record data/K


@dataclass(frozen=True, kw_only=True)
class SaveLayout:
    """Where everything lies in a torch.save file: ``parts`` (offset, bytes: what torch.save writes around the
    storages' bytes, with the skeleton's CRCs), ``records`` in file order, ``storages`` (the index in ``records`` of
    storage K), the serialization id's record and ``size``."""

    parts: tuple[tuple[int, bytes], ...]
    records: tuple[Record, ...]
    storages: tuple[int, ...]
    serialization_id: int  # index in ``records``
    name_hash: bytes  # the serialization id's first 20 digits: a hash of the record names
    size: int


class _Recording(pickle.Pickler):
    """A pickler that notes every tensor in the order it is pickled (torch.save numbers storages in that order)."""

    seen: list[torch.Tensor]

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            self.seen.append(obj)
        return NotImplemented


def _tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def save_layout(obj: Any) -> tuple[SaveLayout, list[torch.Tensor]]:
    """Pure: the layout of ``torch.save(obj)`` (CRC-32 on, as torch.save's default) and the tensors ``obj`` holds,
    tensor K stored as storage K. Its storages' bytes are neither read nor written: stand-ins from ``torch.empty``
    cost no memory. Each tensor must be its own contiguous storage (a view would bring its whole storage)."""
    seen: list[torch.Tensor] = []
    module = type("_pickle_module", (), {"Pickler": type("Pickler", (_Recording,), {"seen": seen}),
                                         "__name__": "pickle"})
    sparse = _Sparse()
    with torch.serialization.skip_data(), serialization_config.patch({"save.compute_crc32": True}):
        torch.save(obj, sparse, pickle_module=module)  # type: ignore[arg-type]
    records = _records(sparse)
    storages = sorted((r.storage, i) for i, r in enumerate(records) if r.storage is not None)
    assert [k for k, _ in storages] == list(range(len(seen))) and all(
        records[i].nbytes == _tensor_nbytes(t) and t.is_contiguous() and not t.storage_offset()
        for (_, i), t in zip(storages, seen, strict=True)), "every tensor must be its own contiguous storage"
    sid = next(i for i, r in enumerate(records) if r.name.endswith(_SERIALIZATION_ID))
    sparse.seek(records[sid].at)
    parts = tuple((at, bytes(data)) for at, data in zip(sparse.starts, sparse.parts, strict=True))
    return SaveLayout(parts=parts, records=tuple(records), storages=tuple(i for _, i in storages), serialization_id=sid,
                      name_hash=sparse.read(20), size=sparse.end), seen


def _records(sparse: _Sparse) -> list[Record]:
    """The records of a zip, from its central directory and local headers, in file order."""
    zf = zipfile.ZipFile(sparse)
    out, central = [], zf.start_dir
    for info in zf.infolist():
        sparse.seek(central)
        entry = struct.unpack(zipfile.structCentralDir, sparse.read(zipfile.sizeCentralDir))
        assert entry[0] == zipfile.stringCentralDir, f"no central directory entry at {central}"
        sparse.seek(info.header_offset)
        head = struct.unpack(zipfile.structFileHeader, sparse.read(zipfile.sizeFileHeader))
        at = info.header_offset + zipfile.sizeFileHeader + head[zipfile._FH_FILENAME_LENGTH] \
            + head[zipfile._FH_EXTRA_FIELD_LENGTH]
        descriptor = None
        if info.flag_bits & _HAS_DESCRIPTOR:
            sparse.seek(at + info.file_size)
            assert sparse.read(4) == _DESCRIPTOR, f"{info.filename}: no data descriptor after its data"
            descriptor = at + info.file_size + _DESCRIPTOR_CRC
        m = _STORAGE.match(info.filename)
        out.append(Record(name=info.filename, at=at, nbytes=info.file_size, crc=info.CRC, descriptor=descriptor,
                          central=central + _CENTRAL_CRC, storage=int(m.group(1)) if m else None))
        central += zipfile.sizeCentralDir + entry[zipfile._CD_FILENAME_LENGTH] \
            + entry[zipfile._CD_EXTRA_FIELD_LENGTH] + entry[zipfile._CD_COMMENT_LENGTH]
    return sorted(out, key=lambda r: r.at)


def _hash_combine(seed: int, value: int) -> int:
    """c10::hash_combine on 64-bit size_t."""
    return (seed ^ (value + 0x9E3779B9 + ((seed << 6) & _U64) + (seed >> 2))) & _U64


def serialization_id(layout: SaveLayout, crcs: list[int]) -> bytes:
    """Pure: the ``.data/serialization_id`` torch.save writes: the record names' hash, then every record's CRC-32
    (storage K's: ``crcs[K]``) combined in file order, over the records written with a data descriptor."""
    combined = 0
    for r in layout.records[:layout.serialization_id]:
        if r.descriptor is not None:
            combined = _hash_combine(combined, crcs[r.storage] if r.storage is not None else r.crc)
    return layout.name_hash + f"{combined:020d}".encode()


def patches(layout: SaveLayout, crcs: list[int]) -> list[tuple[int, bytes]]:
    """Pure: (file offset, bytes) of what the skeleton lacks once storage K's CRC-32 is ``crcs[K]``: the storages'
    CRCs, the serialization id and its CRC."""
    out = []
    for k, i in enumerate(layout.storages):
        r = layout.records[i]
        out += [(at, struct.pack("<I", crcs[k])) for at in (r.descriptor, r.central) if at is not None]
    sid, text = layout.records[layout.serialization_id], serialization_id(layout, crcs)
    out += [(sid.at, text)] + [(at, struct.pack("<I", zlib.crc32(text))) for at in (sid.descriptor, sid.central)
                               if at is not None]
    return out


def part_needs(layout: SaveLayout) -> list[frozenset[int]]:
    """Pure: for each part, the storages whose CRC-32 it holds (the serialization id's part: every storage)."""
    sid, every = layout.records[layout.serialization_id], frozenset(range(len(layout.storages)))
    fields = [(x, frozenset({k})) for k, i in enumerate(layout.storages)
              for x in (layout.records[i].descriptor, layout.records[i].central) if x is not None]
    fields += [(x, every) for x in (sid.at, sid.descriptor, sid.central) if x is not None]
    return [frozenset().union(*(needs for x, needs in fields if at <= x < at + len(data))) for at, data in layout.parts]


def _raw(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


class StreamedSave:
    """A torch.save file of a known layout, written as its storages arrive in any order (``write``): each part of
    the skeleton once the CRCs it holds are known. ``close`` (every storage written) fsyncs it and returns its
    SHA-256, taken as it was written."""

    def __init__(self, path: Path, layout: SaveLayout) -> None:
        self.path, self.layout = path, layout
        self.crcs: dict[int, int] = {}
        self.due = list(zip(layout.parts, part_needs(layout), strict=True))
        self.fh = PositionedFile(path)
        self.fh.reserve(layout.size)
        self._write_due()

    def write(self, k: int, t: torch.Tensor) -> None:
        """Storage ``k``'s bytes: those of tensor ``t`` (C order)."""
        r = self.layout.records[self.layout.storages[k]]
        assert k not in self.crcs and _tensor_nbytes(t) == r.nbytes, f"{self.path.name}: storage {k} of " \
            f"{r.nbytes} bytes written twice or as {_tensor_nbytes(t)} bytes"
        raw = _raw(t)
        self.crcs[k] = zlib.crc32(raw)
        if r.nbytes:
            self.fh.pwrite(raw, r.at)
        self._write_due()

    def _write_due(self) -> None:
        ready = [(part, needs) for part, needs in self.due if needs <= self.crcs.keys()]
        if not ready:
            return
        self.due = [(part, needs) for part, needs in self.due if not needs <= self.crcs.keys()]
        crcs = [self.crcs.get(k, 0) for k in range(len(self.layout.storages))]
        fields = patches(self.layout, crcs)
        for (at, data), _ in ready:
            buf = bytearray(data)
            for x, value in fields:
                if at <= x < at + len(buf):
                    buf[x - at:x - at + len(value)] = value
            self.fh.pwrite(bytes(buf), at)

    def close(self) -> str:
        assert not self.due, f"{self.path.name}: {len(self.layout.storages) - len(self.crcs)} storages never written"
        return self.fh.close()


class SavedFiles(StreamedFiles[tuple[StreamedSave, dict[int, int]]]):
    """The ``TargetWriter`` of formats whose files are ``torch.save``d objects (legacy Megatron, NeMo 1 rank files):
    ``build(file, tensors)`` is the object a file holds given its tensors (``file.tensors`` order). A file is laid
    out at its first tensor (``build`` of stand-ins), each tensor written as it arrives, the file closed (fsynced,
    hashed as written) with its last; a tensor ``build`` adds (a buffer) is written with the skeleton."""

    def __init__(self, out_dir: Path, files: list[TargetFile], build: Callable[[TargetFile, list[torch.Tensor]], Any]):
        super().__init__(files)
        self.out_dir, self.build = out_dir, build

    def _start(self, f: TargetFile) -> tuple[StreamedSave, dict[int, int]]:
        """The file's writer, and which storage each tensor j is."""
        stand_ins = [torch.empty(t.shape, dtype=t.dtype) for t in f.tensors]
        layout, seen = save_layout(self.build(f, stand_ins))
        j_of = {id(x): j for j, x in enumerate(stand_ins)}
        path = self.out_dir / f.name
        path.parent.mkdir(parents=True, exist_ok=True)
        out = StreamedSave(path, layout)
        for k, x in enumerate(seen):
            if id(x) not in j_of:
                out.write(k, x)
        return out, {j_of[id(x)]: k for k, x in enumerate(seen) if id(x) in j_of}

    def put(self, file: TargetFile, j: int, tensor: torch.Tensor) -> list[WrittenFile]:
        t = file.tensors[j]
        assert tensor.dtype == t.dtype and tuple(tensor.shape) == tuple(t.shape), \
            f"{file.name}: {t.key} arrived as {tensor.dtype} {tuple(tensor.shape)}, planned {t.dtype} {t.shape}"
        out, k_of = self._file(file)
        out.write(k_of.pop(j), tensor)
        return [] if k_of else [self._close(file)]

    def _finish(self, f: TargetFile, state: tuple[StreamedSave, dict[int, int]]) -> WrittenFile:
        return WrittenFile(file=f.id, name=f.name, sha256=state[0].close())
