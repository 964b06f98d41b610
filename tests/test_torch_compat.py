"""torch 2.11 (the lent GPU machine's torch) against the product, developed on torch 2.13: what a CPU can show.

* A DCP save made by torch 2.11.0 itself (its ``.metadata`` and ``__0_0.distcp``, below) is read by dist_convert's
  metadata reader, its raw-byte tensor reader and its bytes-item reader, and by the fallback read through DCP.
* A ``.metadata`` dist_convert writes (forged without DCP, pickled from DCP's objects, or built by keyword) unpickles
  into torch 2.11.0's own DCP classes, transcribed below from its source, with no field those classes lack and
  every value they would hold when built; a 2.15-style TensorProperties (six items) or an unknown field is refused,
  as 2.11 refuses them.
What a CPU cannot show (NCCL, the ``cpu:gloo,cuda:nccl`` group on GPUs) is not tested here."""
from __future__ import annotations

import base64
import enum
import io
import os
import pathlib
import pickle
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from dist_convert.formats import dcp_meta
from dist_convert.formats.dcp_read import read_boxes
from dist_convert.formats.distcp import ItemFileWriter, load_metadata, locate, read_object, write_metadata
from dist_convert.layout.boxes import Box

# torch 2.11.0 (python3.12, pip torch==2.11.0, CPU) ran, in an empty directory:
#   sd = {"w": torch.arange(8, dtype=torch.float32).reshape(4, 2).to(torch.bfloat16), "obj": {"iteration": 7}}
#   torch.distributed.checkpoint.save(sd, checkpoint_id="ck", no_dist=True)
# and these are its two files, zlib-compressed and base64-encoded.
SAVED_BY_211 = {
    ".metadata": (
    "eNp9Ul1v0zAUDetHgK0S0sYPQAKxPTRqRWnLG9CNqWTpqm2vyHISp/aaxiF2xjoJCR42CclvmBf+I/+B66RfEh95iq/PPfec4/ul"
    "+uNnxSo+9UzyLKBOyITMmJ9LEjoBJcE05SyRzoxIHGKJtbrvLX+/64Ov+rPeV7tCYklQyAKJVkBzce+TppZ6fEESwbNzGIAn5M/2"
    "h2nGU5JJRoSBPyrh43WxQO6rWqEQFPhRzLFsd+FC7ZayBckYjtkNlownWm2jCZEoxnOeS4NqLFBgLSShvtVn+huM2kPekYfenZ55"
    "by7Q0WhwejgcHQPetQqE1L6qCnZD9Gp29dwcAVF1t+4KHlUPaJ5Mhf5gxO8NzOGfVm0eRYJI8PnEtVxrwVAzM4raijX3ce6rBvcv"
    "HSZJVtoy/G/nkoi/8udqJ41xkpAMLR+A2tS+1fSFqgCRVg/WVHcGLkqaNdxSjSXnMAnJ9Vp4JfqYGKIaK+ojEPf8vwsTsZiIuZBk"
    "ptUOWggeJhFfczYyEoOaK4JSLKmBoRZqFYRBCrmWWcFjqHpMkglAvF/V3Kevy346AHuHrkVPNsOE++PF/Xvq0hNooZ53UM/9DcNm"
    "SU2a2xtBbuha20As1Mo28mLmQ4BjLtj12KiFpdoKpuX72QKDCQN92ouidqfTx81+t+03O/3Wy+Yr3A2b7ajf6UZ+1OvhPjTA/oam"
    "YaTsGQ9ziArWBzK1r0gmig2utZ2W04Ka8xugxWoy"
    ),
    "__0_0.distcp": (
    "eNrtVb9v00AUPjuJE1ypP1gqitQ5SDSxHcexQSWWhbx4IC0qqspguY5pLdy451yDYIqEKEKMwFgEfwBzVzZGVAYmhgqmDggJFkbu"
    "4ja1HSUpaRYkLo6ebN333ud7n79XM1JpAHI50LOmwUVgBfam23KKdQtZhe37nq5NgrXYatNGtlAzsrmF1ishg2HkX+ubdBZI3aSF"
    "e36wZSGz5QRN12/ompDIfZbFk9r7P748pnB2amDtOVA5rd1EfmBtOKbluRuNLaeBdK00Qvk1SSQEqg/gEY1L0AMJzIBql8D6Q+T4"
    "Qd0JdO36KHVPluci5DmEw5PFb5cYXIUZyGEKLHY5dA9eGZ1BiSW1D15vrAx//3kgnDaASKrYdAIXd+CRhTAP063rWuEvqXCCwsmi"
    "JEuVSkUSFKHEcyLHcWWlUpIlpVyWeKWMr06XXvrcXh7zyHdYUoRsl2dUvtM9zJPfQRIdFeBsDLkSQScEn0wSFdFcLMlBNEmPcpN5"
    "okKYieVZpkCvAJPwaC+nYvDPEXifd4ge8Xy8Ng2GNL9mMMzVE6mkFrpIJhFfUGH8TYcR47IkPk+H96ELZJgQw3T2h3tr5zY7Gx++"
    "vVkwd5DrNVkzcNZ3XK9uIqfR9AOzJbAQ5POrhM5xmyAVQlhN93wL8dLt8DkL6VVClIOp1RSO9vYOTBs5BDNLBjDSBr0LGYM2qF2Y"
    "fWbbvuc5NjmmJnuL9Myp33RtxMLclWV4AUF2GU50TPjX1tN3ezjb3hATnu9vwnPgv9mOy2wnwY2Yqoqcrl07BwEA2lWgqmpbfaO+"
    "Vw9VwuTu0cTb6WPTGmT7pV7bL4J/zOz5ckWQeQU7Oi+XRUkscYLEYddXFEkWZUnCN6KoyB2Zfr38c7+f2Uc/k3Ga/fdxmP0SNR6z"
    "/3QWs4+qZzIGv0ODhHbPPigO6aGDItqexKBIjTooson48WRQpOKD4kOmd1Bk8Y/sD/f+AVnBZFw="
    ),
}


def saved_by_211(where: Path) -> Path:
    for name, lines in SAVED_BY_211.items():
        (where / name).write_bytes(zlib.decompress(base64.b64decode("".join(lines))))
    return where


W_211 = torch.arange(8, dtype=torch.float32).reshape(4, 2).to(torch.bfloat16)


def test_a_torch_211_save_is_read(tmp_path):
    """The stand-ins take 2.11's pickled state (a bytes item's MetadataIndex pickles no ``offset``); the tensor's
    bytes are found in 2.11's ``torch.save`` layout and read raw; the object unpickles through the allow-list."""
    ck = saved_by_211(tmp_path)
    md = load_metadata(ck)
    assert isinstance(md, dcp_meta.Metadata) and md.version == "1.0.0"
    w = md.state_dict_metadata["w"]
    assert isinstance(w, dcp_meta.TensorStorageMetadata) and w.size == torch.Size([4, 2])
    assert w.properties.dtype == torch.bfloat16 and w.properties.memory_format == torch.contiguous_format
    assert w.properties.strides is None
    assert w.chunks == [dcp_meta.ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([4, 2]))]
    assert isinstance(md.state_dict_metadata["obj.iteration"], dcp_meta.BytesStorageMetadata)
    assert md.planner_data == {"w": ("w",), "obj.iteration": ("obj", "iteration")}
    info = md.storage_data[dcp_meta.MetadataIndex("w", (0, 0))]
    stored = locate(ck, info, (4, 2), torch.bfloat16)
    assert stored is not None, "2.11's torch.save layout not recognised: every read would go through dcp.load"
    assert torch.equal(stored.read(Box((0, 0), (4, 2))), W_211) and torch.equal(stored.read(Box((1, 1), (2, 1))),
                                                                                 W_211[1:3, 1:])
    assert read_object(ck, md, "obj.iteration", trust_pickle=False) == 7


def test_a_torch_211_save_is_read_through_dcp(tmp_path):
    """The fallback read (dcp.load of the running torch with the stand-ins rebuilt as its classes)."""
    ck = saved_by_211(tmp_path)
    out = torch.zeros(2, 2, dtype=torch.bfloat16)
    read_boxes(ck, False, {"w": [(Box((2, 0), (2, 2)), out)]})
    assert torch.equal(out, W_211[2:])


# torch 2.11.0's DCP metadata classes as its source defines them (tag v2.11.0, the torch-2.11.0 wheel's files):
# torch/distributed/checkpoint/metadata.py and, for _StorageInfo, torch/distributed/checkpoint/filesystem.py.
# Fields, defaults and pickled state are copied; docstrings and helpers left out. (torch 2.13.0's are the same.)
@dataclass
class ChunkStorageMetadata:
    offsets: torch.Size
    sizes: torch.Size


class _MEM_FORMAT_ENCODING(enum.Enum):  # noqa: N801 - torch's name
    TORCH_CONTIGUOUS_FORMAT = 0
    TORCH_CHANNELS_LAST = 1
    TORCH_PRESERVE_FORMAT = 2


@dataclass
class TensorProperties:
    dtype: torch.dtype = field(default_factory=torch.get_default_dtype)
    layout: torch.layout = field(default=torch.strided)
    requires_grad: bool = False
    memory_format: torch.memory_format = field(default=torch.contiguous_format)
    pin_memory: bool = False

    def __setstate__(self, state):  # 2.11: exactly five items (2.15 pickles six)
        (self.dtype, self.layout, self.requires_grad, mem_format_encoding, self.pin_memory) = state
        if mem_format_encoding == _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT:
            memory_format = torch.contiguous_format
        elif mem_format_encoding == _MEM_FORMAT_ENCODING.TORCH_CHANNELS_LAST:
            memory_format = torch.channels_last
        elif mem_format_encoding == _MEM_FORMAT_ENCODING.TORCH_PRESERVE_FORMAT:
            memory_format = torch.preserve_format
        else:
            raise RuntimeError(f"Invalid torch.memory_format encoding: {mem_format_encoding}")
        self.memory_format = memory_format


@dataclass
class TensorStorageMetadata:
    properties: TensorProperties
    size: torch.Size
    chunks: list[ChunkStorageMetadata]


@dataclass
class BytesStorageMetadata:
    pass


@dataclass
class StorageMeta:
    checkpoint_id: str | os.PathLike | None = None
    save_id: str | None = None
    load_id: str | None = None
    modules: list[str] = field(default_factory=list)


@dataclass
class Metadata:
    state_dict_metadata: dict[str, TensorStorageMetadata | BytesStorageMetadata]
    planner_data: Any = None
    storage_data: Any = None
    storage_meta: StorageMeta | None = None
    version: str | None = None


@dataclass(frozen=True)
class MetadataIndex:
    fqn: str
    offset: torch.Size | None = None
    index: int | None = field(hash=False, compare=False, default=None)

    def __init__(self, fqn: str, offset: Sequence[int] | None = None, index: int | None = None):
        object.__setattr__(self, "fqn", fqn)
        object.__setattr__(self, "index", index)
        if offset is not None:
            object.__setattr__(self, "offset", torch.Size(offset))


@dataclass
class _StorageInfo:
    relative_path: str
    offset: int
    length: int
    transform_descriptors: Sequence[str] | None = None

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if v is not None}


TORCH_211 = {("torch.distributed.checkpoint.metadata", c.__name__): c for c in (
    ChunkStorageMetadata, _MEM_FORMAT_ENCODING, TensorProperties, TensorStorageMetadata, BytesStorageMetadata,
    StorageMeta, Metadata, MetadataIndex)}
TORCH_211[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = _StorageInfo
# the other globals torch 2.11's FileSystemWriter pickles into a .metadata (dtypes aside)
OTHER_GLOBALS = {("torch", "Size"): torch.Size, ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
                 ("pathlib", "PosixPath"): pathlib.PosixPath}


class As211(pickle.Unpickler):
    """Unpickles a .metadata into the classes above: what torch 2.11's DCP would hold."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in TORCH_211:
            return TORCH_211[(module, name)]
        if (module, name) in OTHER_GLOBALS:
            return OTHER_GLOBALS[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"torch 2.11's .metadata holds no {module}.{name}")


def unknown_fields(obj: Any, seen: set[int] | None = None) -> list[str]:
    """Attributes of any object of the classes above that its 2.11 class does not define (unpickling sets them
    silently), and required fields left unset."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    found = []
    if is_dataclass(obj) and not isinstance(obj, type):
        names = {f.name for f in fields(obj)}
        found += [f"{type(obj).__name__}.{k}" for k in vars(obj) if k not in names]
        found += [f"{type(obj).__name__}.{f.name} unset" for f in fields(obj)
                  if not hasattr(obj, f.name)]
        children = list(vars(obj).values())
    elif isinstance(obj, dict):
        children = [*obj.keys(), *obj.values()]
    elif isinstance(obj, (list, tuple)) and not isinstance(obj, torch.Size):
        children = list(obj)
    else:
        children = []
    for child in children:
        found += unknown_fields(child, seen)
    return found


def built_211(items: list[dict[str, Any]]) -> tuple[dict, dict]:
    """What FileSystemWriter of 2.11 holds for ``items`` (ItemFileWriter.items), each object built by keyword."""
    sdm: dict[str, Any] = {}
    storage = {}
    for it in items:
        if "offsets" in it:
            t = sdm.setdefault(it["key"], TensorStorageMetadata(
                properties=TensorProperties(dtype=getattr(torch, it["dtype"])), size=torch.Size(it["global_shape"]),
                chunks=[]))
            t.chunks.append(ChunkStorageMetadata(offsets=torch.Size(it["offsets"]), sizes=torch.Size(it["sizes"])))
            index = MetadataIndex(fqn=it["key"], offset=it["offsets"])
        else:
            sdm[it["key"]] = BytesStorageMetadata()
            index = MetadataIndex(fqn=it["key"])
        storage[index] = _StorageInfo(relative_path=it["file"], offset=it["at"], length=it["length"])
    return sdm, storage


def written(tmp_path: Path) -> list[dict[str, Any]]:
    """A .distcp as dist_convert writes one: tensors of several dtypes (one in two chunks, one large enough to
    be written from a template) and an object."""
    w = ItemFileWriter(tmp_path, "__0_0.distcp")
    big = torch.randn(64, 512).to(torch.bfloat16)
    w.put_tensor("decoder.big", (0, 0), (128, 512), big)
    w.put_tensor("decoder.big", (64, 0), (128, 512), big)
    w.put_tensor("decoder.norm", (0,), (16,), torch.ones(16))
    w.put_tensor("fp8", (0, 0), (4, 8), torch.zeros(4, 8).to(torch.float8_e4m3fn))
    w.put_tensor("step", (), (), torch.tensor(3, dtype=torch.int64))
    w.put_bytes("common_state/shard_0_1", pickle.dumps({"iteration": 5}))
    w.close()
    return w.items


@pytest.mark.parametrize("how", ["forge", "dcp_objects", "built_by_keyword"])
def test_what_dist_convert_writes_torch_211_reads(tmp_path, monkeypatch, how):
    """``forge``: the Python pickler naming the stand-ins DCP's way (the default on the releases the suite
    verifies); ``dcp_objects``: the stand-ins rebuilt as the running torch's DCP objects, C pickler (past
    PYTHON_PICKLER_MAX items, or with DCP imported); ``built_by_keyword``: DIST_CONVERT_DCP_METADATA=dcp (what a
    failed start-up check chooses)."""
    items = written(tmp_path)
    if how == "dcp_objects":
        monkeypatch.setattr(dcp_meta, "PYTHON_PICKLER_MAX", -1)
    monkeypatch.setenv(dcp_meta.WRITER_ENV, "dcp" if how == "built_by_keyword" else "forge")
    write_metadata(tmp_path, items)
    md = As211(io.BytesIO((tmp_path / ".metadata").read_bytes())).load()
    assert type(md) is Metadata and not unknown_fields(md), unknown_fields(md)
    sdm, storage = built_211(items)
    assert md.state_dict_metadata == sdm and md.storage_data == storage
    assert md.version == "1.0.0" and md.planner_data is None
    assert type(md.storage_meta) is StorageMeta and Path(md.storage_meta.checkpoint_id) == tmp_path
    assert isinstance(md.storage_meta.save_id, str) and md.storage_meta.modules == []


def _one_tensor(tmp_path: Path, strides: tuple[int, ...] | None = None) -> dcp_meta.Metadata:
    props = dcp_meta.TensorProperties(dtype=torch.float32, strides=strides)
    return dcp_meta.finished(dcp_meta.Metadata(
        state_dict_metadata={"t": dcp_meta.TensorStorageMetadata(
            props, torch.Size([3]), [dcp_meta.ChunkStorageMetadata(torch.Size([0]), torch.Size([3]))])},
        storage_data={dcp_meta.MetadataIndex("t", (0,)): dcp_meta.StorageInfo("__0_0.distcp", 0, 9)}), tmp_path)


def test_a_metadata_torch_211_would_refuse_is_caught(tmp_path):
    """The checks above can fail: 2.15's six-item TensorProperties (its strides) breaks 2.11's unpickling, and a
    field 2.11 lacks is found."""
    assert not unknown_fields(As211(io.BytesIO(dcp_meta.dumps(_one_tensor(tmp_path), python=True))).load())
    with pytest.raises(ValueError, match="too many values to unpack"):
        As211(io.BytesIO(dcp_meta.dumps(_one_tensor(tmp_path, strides=(1,)), python=True))).load()
    extra = _one_tensor(tmp_path)
    extra.storage_meta.__dict__["shard_ids"] = [0]
    assert unknown_fields(As211(io.BytesIO(dcp_meta.dumps(extra, python=True))).load()) == ["StorageMeta.shard_ids"]
