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
    _dcp = (DCP_METADATA, "TensorProperties")

    def _state(self) -> tuple:
        encoding = next(k for k, v in _MEMORY_FORMATS.items() if v == self.memory_format)
        return self.dtype, self.layout, self.requires_grad, encoding, self.pin_memory

    def __setstate__(self, state: tuple) -> None:
        self.dtype, self.layout, self.requires_grad, encoding, self.pin_memory = state
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


PYTHON_PICKLER_MAX = 10000  # items: past about this the Python pickler is slower than importing DCP (1.4 s)


def dumps(md: Metadata, python: bool | None = None) -> bytes:
    """``md`` pickled as DCP's own classes: by the Python pickler, which names the stand-ins DCP's way without
    importing DCP, for up to PYTHON_PICKLER_MAX items (0.1 ms per item here: 261 in 24 ms) unless DCP is imported
    already; else rebuilt as DCP's objects (importing DCP) and pickled by the C pickler, as DCP itself does.
    ``python``: force one way."""
    if python is None:
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
