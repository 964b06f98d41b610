"""torch.distributed.checkpoint's ``.metadata`` pickle, read and written without importing DCP: its package
imports DTensor, 1.4 s of a torch_dist conversion's start-up on 2 cores (measured), for a file that is a
few dataclasses.

The classes here stand in for DCP's (same names, fields and pickled state). Reading maps DCP's globals onto
them through an allow-list (``--trust-pickle``: any other global is imported as usual); writing pickles
them under DCP's own module and class names, the objects ``FileSystemWriter.finish`` pickles (protocol 4;
only the pickler's reuse of repeated strings differs), so DCP, megatron-core and every other reader load
real DCP objects. (The plain ``pickle`` module pickles the stand-ins as themselves, so a rank can send them
to another; a ``.metadata`` is written with ``dumps``.)"""
from __future__ import annotations

import copyreg
import enum
import importlib
import io
import os
import pickle
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

DCP_METADATA = "torch.distributed.checkpoint.metadata"
DCP_FILESYSTEM = "torch.distributed.checkpoint.filesystem"
PROTOCOL = 4  # pickle.DEFAULT_PROTOCOL of the Pythons torch supports, what DCP writes
VERSION = "1.0.0"  # FileSystemWriter's CURRENT_DCP_VERSION


class _StandIn:
    """Written (``dumps``) as DCP's class ``_dcp`` (module, name) with ``_state``, what DCP's class pickles."""

    _dcp: tuple[str, str]

    def _state(self) -> Any:
        return dict(self.__dict__) or None

    def _reduce(self, cls: Any) -> tuple:
        return copyreg.__newobj__, (cls,), self._state()


@dataclass
class ChunkStorageMetadata(_StandIn):
    offsets: torch.Size
    sizes: torch.Size
    _dcp = (DCP_METADATA, "ChunkStorageMetadata")


class MemFormat(enum.Enum):
    """DCP's ``_MEM_FORMAT_ENCODING``."""

    TORCH_CONTIGUOUS_FORMAT = 0
    TORCH_CHANNELS_LAST = 1
    TORCH_PRESERVE_FORMAT = 2


_MEMORY_FORMATS = {MemFormat.TORCH_CONTIGUOUS_FORMAT: torch.contiguous_format,
                   MemFormat.TORCH_CHANNELS_LAST: torch.channels_last,
                   MemFormat.TORCH_PRESERVE_FORMAT: torch.preserve_format}


@dataclass
class TensorProperties(_StandIn):
    dtype: torch.dtype = field(default_factory=torch.get_default_dtype)
    layout: torch.layout = torch.strided
    requires_grad: bool = False
    memory_format: torch.memory_format = torch.contiguous_format
    pin_memory: bool = False
    # torch 2.15 added the stored chunk's strides as a sixth item of the pickled state; torch 2.14 and older
    # unpickle only five, and 2.15 still takes five: written as five unless a source's strides are kept
    strides: tuple[int, ...] | None = None
    _dcp = (DCP_METADATA, "TensorProperties")

    def _state(self) -> tuple:
        encoding = next(k for k, v in _MEMORY_FORMATS.items() if v == self.memory_format)
        five = self.dtype, self.layout, self.requires_grad, encoding, self.pin_memory
        return five if self.strides is None else (*five, self.strides)

    def _reduce(self, cls: Any) -> tuple:
        fn, args, state = super()._reduce(cls)
        if "strides" not in getattr(cls, "__dataclass_fields__", {"strides": None}):  # the running torch's DCP
            state = state[:5]  # is older than the source's: its class takes five
        return fn, args, state

    def __getstate__(self) -> tuple:  # the state __setstate__ takes (plain pickle, deepcopy)
        return self._state()

    def __setstate__(self, state: tuple) -> None:
        self.dtype, self.layout, self.requires_grad, encoding, self.pin_memory = state[:5]
        self.strides = state[5] if len(state) > 5 else None
        self.memory_format = _MEMORY_FORMATS[MemFormat(getattr(encoding, "value", encoding))]


@dataclass
class TensorStorageMetadata(_StandIn):
    properties: TensorProperties
    size: torch.Size
    chunks: list[ChunkStorageMetadata]
    _dcp = (DCP_METADATA, "TensorStorageMetadata")


@dataclass
class BytesStorageMetadata(_StandIn):
    _dcp = (DCP_METADATA, "BytesStorageMetadata")


@dataclass
class StorageMeta(_StandIn):
    checkpoint_id: str | os.PathLike | None = None
    save_id: str | None = None
    load_id: str | None = None
    modules: list[str] = field(default_factory=list)
    _dcp = (DCP_METADATA, "StorageMeta")


@dataclass
class Metadata(_StandIn):
    state_dict_metadata: dict[str, TensorStorageMetadata | BytesStorageMetadata]
    planner_data: Any = None
    storage_data: Any = None
    storage_meta: StorageMeta | None = None
    version: str | None = None
    _dcp = (DCP_METADATA, "Metadata")


@dataclass(frozen=True, init=False)
class MetadataIndex(_StandIn):
    fqn: str
    offset: torch.Size | None = None
    index: int | None = field(hash=False, compare=False, default=None)
    _dcp = (DCP_METADATA, "MetadataIndex")

    def __init__(self, fqn: str, offset: Any = None, index: int | None = None) -> None:
        object.__setattr__(self, "fqn", fqn)
        object.__setattr__(self, "index", index)
        object.__setattr__(self, "offset", None if offset is None else torch.Size(offset))


@dataclass
class StorageInfo(_StandIn):
    """DCP's ``filesystem._StorageInfo``: where an item's bytes are."""

    relative_path: str
    offset: int
    length: int
    transform_descriptors: Any = None
    _dcp = (DCP_FILESYSTEM, "_StorageInfo")

    def _state(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


def _opaque(module: str, name: str) -> type:
    """A stand-in for a DCP class that metadata may hold and nothing here reads (a planner's records): its
    pickled state, or its constructor's arguments (an enum's value), kept as they came."""

    class Opaque(_StandIn):
        _dcp = (module, name)

        def __init__(self, *args: Any) -> None:
            self.__dict__["_args"] = args

        def __setstate__(self, state: Any) -> None:
            self.__dict__.update(state if isinstance(state, dict) else {"_value": state})

        def _state(self) -> Any:
            return self.__dict__.get("_value", dict(self.__dict__) or None)

        def _reduce(self, cls: Any) -> tuple:
            return (cls, self._args) if "_args" in self.__dict__ else super()._reduce(cls)

    Opaque.__name__ = Opaque.__qualname__ = name
    return Opaque


STAND_INS: dict[tuple[str, str], type] = {c._dcp: c for c in (
    ChunkStorageMetadata, TensorProperties, TensorStorageMetadata, BytesStorageMetadata, StorageMeta, Metadata,
    MetadataIndex, StorageInfo, *(_opaque("torch.distributed.checkpoint.planner", n)
                                  for n in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")))}
STAND_INS[(DCP_METADATA, "_MEM_FORMAT_ENCODING")] = MemFormat
_NAMES = {c: k for k, c in STAND_INS.items()}
# the other globals a DCP .metadata holds (torch dtypes are allowed too)
_ALLOWED: dict[str, frozenset[str]] = {
    "torch.serialization": frozenset({"_get_layout"}),  # torch.layout values (torch.strided)
    "torch": frozenset({"Size"}),
    "collections": frozenset({"OrderedDict"}),
    "pathlib": frozenset({"PosixPath", "PurePosixPath"}),  # StorageMeta.checkpoint_id as FileSystemWriter saves it
}


class Untrusted(pickle.UnpicklingError):
    """A global outside the allow-list."""


class _Unpickler(pickle.Unpickler):
    def __init__(self, fh: Any, trust: bool) -> None:
        super().__init__(fh)
        self.trust = trust

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in STAND_INS:
            return STAND_INS[(module, name)]
        if (self.trust or name in _ALLOWED.get(module, ())
                or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))):
            return super().find_class(module, name)
        raise Untrusted(f"{module}.{name}")


def loads(fh: Any, trust: bool = False) -> Any:
    """Unpickle a DCP ``.metadata`` into the stand-ins (``trust``: other globals are imported too)."""
    return _Unpickler(fh, trust).load()


class _Pickler(pickle._Pickler):  # the Python pickler: its save_global can name a class DCP's way
    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, _StandIn):
            return obj._reduce(type(obj))
        if isinstance(obj, MemFormat):
            return MemFormat, (obj.value,)
        return NotImplemented

    def save_global(self, obj: Any, name: str | None = None) -> None:
        named = _NAMES.get(obj) if isinstance(obj, type) else None
        if named is None and isinstance(obj, torch.dtype):
            named = ("torch", str(obj).removeprefix("torch."))
        if named is None:
            return super().save_global(obj, name)
        module, qualname = named
        self.save(module)
        self.save(qualname)
        self.write(pickle.STACK_GLOBAL)
        self.memoize(obj)


# torch releases whose DCP reads the forged .metadata as its own: the suite checks every one of them
# (launch/setup.sh: 2.13; launch/setup_newest.sh: 2.15; 2.11, the lent GPU machine's: its classes as its source
# defines them, tests/test_torch_compat.py, and its own dcp.load seen reading what the forge wrote); any other
# release is checked at start-up
VERIFIED_TORCH = ("2.11", "2.13", "2.15")
WRITER_ENV = "DIST_CONVERT_DCP_METADATA"  # "forge" | "dcp" | "auto" (the default): how .metadata is pickled
_forge_problem: list[str | None] = []  # the start-up check's answer, once per process


def forge_problem(sample: Metadata | None = None) -> str | None:
    """Why the running torch's DCP does not unpickle a ``.metadata`` forged here (the Python pickler naming the
    stand-ins DCP's way) into what its own classes, built by keyword, hold; None when it does. ``sample``: the
    metadata to try (default: one of every kind of item a writer here records). Imports DCP."""
    md = sample or finished(Metadata(
        state_dict_metadata={"w": TensorStorageMetadata(TensorProperties(dtype=torch.bfloat16), torch.Size([4, 2]),
                                                        [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([4, 2]))]),
                             "obj": BytesStorageMetadata()},
        storage_data={MetadataIndex("w", (0, 0)): StorageInfo("__0_0.distcp", 0, 64),
                      MetadataIndex("obj"): StorageInfo("__0_0.distcp", 64, 8)}), Path("ckpt"))
    try:
        got = pickle.loads(dumps(md, python=True))
        want = constructed(md)
    except Exception as e:  # noqa: BLE001 - any failure is the answer
        return f"{type(e).__name__}: {e}"
    if type(got) is not type(want) or got != want:
        return "DCP's classes unpickle it to other values than they hold when built"
    return None


def use_forge() -> bool:
    """Whether ``.metadata`` is forged (fast: no DCP import) or pickled from DCP's own objects (``constructed``):
    forged on the torch releases the suite verifies, else as the start-up check (``forge_problem``) says;
    ``DIST_CONVERT_DCP_METADATA=forge|dcp`` decides instead."""
    how = os.environ.get(WRITER_ENV, "auto")
    if how in ("forge", "dcp"):
        return how == "forge"
    if ".".join(torch.__version__.split(".")[:2]) in VERIFIED_TORCH:
        return True
    if not _forge_problem:
        _forge_problem.append(forge_problem())
    return _forge_problem[0] is None


def writer_note() -> str | None:
    """The note a run writing ``.metadata`` prints when it does not forge it (None when it does)."""
    if use_forge():
        return None
    why = f" ({_forge_problem[0]})" if _forge_problem and _forge_problem[0] else ""
    return (f"torch {torch.__version__}'s DCP metadata classes differ from the ones dist_convert writes{why}: "
            "every .metadata is pickled from DCP's own objects instead (importing DCP adds about 1.5 s)")


def constructed(md: Metadata) -> Any:
    """``md`` as DCP's own objects, each built by keyword through its constructor as ``FileSystemWriter`` builds
    them (no stand-in state involved): what is pickled when the running torch's classes differ from the
    stand-ins (``use_forge``)."""
    meta, fs = importlib.import_module(DCP_METADATA), importlib.import_module(DCP_FILESYSTEM)
    items: dict[str, Any] = {}
    for key, v in md.state_dict_metadata.items():
        if isinstance(v, BytesStorageMetadata):
            items[key] = meta.BytesStorageMetadata()
            continue
        chunks = [meta.ChunkStorageMetadata(offsets=c.offsets, sizes=c.sizes) for c in v.chunks]
        items[key] = meta.TensorStorageMetadata(properties=meta.TensorProperties(dtype=v.properties.dtype),
                                                size=v.size, chunks=chunks)
    storage = {meta.MetadataIndex(fqn=i.fqn, offset=i.offset): fs._StorageInfo(
        relative_path=s.relative_path, offset=s.offset, length=s.length) for i, s in (md.storage_data or {}).items()}
    sm = md.storage_meta
    return meta.Metadata(state_dict_metadata=items, storage_data=storage, version=md.version,
                         storage_meta=None if sm is None else meta.StorageMeta(checkpoint_id=sm.checkpoint_id,
                                                                                save_id=sm.save_id))


PYTHON_PICKLER_MAX = 10000  # items: past about this the Python pickler is slower than importing DCP (1.4 s)


def dumps(md: Metadata, python: bool | None = None) -> bytes:
    """``md`` pickled as DCP's own classes: by the Python pickler, which names the stand-ins DCP's way without
    importing DCP, for up to PYTHON_PICKLER_MAX items (0.1 ms per item here: 261 in 24 ms) unless DCP is imported
    already; else rebuilt as DCP's objects (importing DCP) and pickled by the C pickler, as DCP itself does.
    ``python``: force one way."""
    if python is None:
        if not use_forge():
            return pickle.dumps(constructed(md), protocol=PROTOCOL)
        python = len(md.storage_data or ()) <= PYTHON_PICKLER_MAX and DCP_METADATA not in sys.modules
    if not python:
        return pickle.dumps(as_dcp(md), protocol=PROTOCOL)
    buf = io.BytesIO()
    _Pickler(buf, protocol=PROTOCOL).dump(md)
    return buf.getvalue()


def as_dcp(obj: Any) -> Any:
    """``obj`` with every stand-in replaced by the DCP object it stands for (imports DCP)."""
    if isinstance(obj, MemFormat):
        return _dcp_class(DCP_METADATA, "_MEM_FORMAT_ENCODING")(obj.value)
    if isinstance(obj, _StandIn):
        cls = _dcp_class(*obj._dcp)
        fn, args, *state = obj._reduce(cls)
        if fn is not copyreg.__newobj__:
            return cls(*args)
        out = cls.__new__(cls)
        value = as_dcp(state[0]) if state else None
        if value is not None:
            setstate = getattr(out, "__setstate__", None)
            if setstate is not None:
                setstate(value)
            else:
                out.__dict__.update(value)
        return out
    if isinstance(obj, dict):
        return type(obj)((as_dcp(k), as_dcp(v)) for k, v in obj.items())
    if isinstance(obj, list):
        return [as_dcp(v) for v in obj]
    if isinstance(obj, tuple) and not isinstance(obj, torch.Size):
        return tuple(as_dcp(v) for v in obj)
    return obj


def _dcp_class(module: str, name: str) -> Any:
    return getattr(importlib.import_module(module), name)


def finished(md: Metadata, iter_dir: Path) -> Metadata:
    """``md`` as ``FileSystemWriter.finish`` completes it before pickling: version and storage meta."""
    md.version = VERSION
    md.storage_meta = StorageMeta(checkpoint_id=Path(iter_dir), save_id=str(uuid.uuid4()))
    return md
