"""Direct DCP file access (formats/distcp.py) against torch.distributed.checkpoint itself: the
located bytes are the tensors DCP saved, and the streamed files load with DCP and carry the metadata
``dcp.save`` writes for the same tensors."""
from __future__ import annotations

import io
import json
import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex

from dist_convert.cuts import contiguous_cuts
from dist_convert.formats.distcp import ItemFileWriter, is_contiguous_box, locate, write_metadata
from dist_convert.layout.boxes import Box


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(6, 4, 5, generator=g).to(torch.bfloat16), "b": torch.randn(7, generator=g),
            "i": torch.arange(12, dtype=torch.int32).reshape(3, 4)}


def _save(path, tensors) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(tensors, storage_writer=FileSystemWriter(str(path)), no_dist=True)


def test_located_bytes_are_what_dcp_saved(tmp_path):
    tensors = _tensors()
    _save(tmp_path, tensors)
    storage = FileSystemReader(str(tmp_path)).read_metadata().storage_data
    for key, t in tensors.items():
        info = storage[MetadataIndex(key, torch.Size([0] * t.dim()))]
        stored = locate(tmp_path, info, tuple(t.shape), t.dtype)
        assert stored is not None, key
        assert torch.equal(stored.read(Box.full(tuple(t.shape))), t)
    w = tensors["w"]
    stored = locate(tmp_path, storage[MetadataIndex("w", torch.Size([0, 0, 0]))], (6, 4, 5), torch.bfloat16)
    for box in (Box((2, 0, 0), (3, 4, 5)), Box((1, 1, 0), (1, 2, 5)), Box((1, 1, 1), (2, 2, 3))):
        assert torch.equal(stored.read(box), w[box.slices()])
    # the wrong dtype or shape is not taken for the stored tensor
    assert locate(tmp_path, storage[MetadataIndex("w", torch.Size([0, 0, 0]))], (6, 4, 5), torch.float16) is None
    assert locate(tmp_path, storage[MetadataIndex("w", torch.Size([0, 0, 0]))], (6, 20), torch.bfloat16) is None


def test_items_that_are_not_plain_tensors_fall_back(tmp_path):
    base = torch.arange(20, dtype=torch.float32)
    with open(tmp_path / "x.distcp", "wb") as fh:
        fh.write(b"raw bytes, not a zip")
        start = fh.tell()
        torch.save(base[4:10], fh)  # a view: torch.save stores its whole storage at an offset
        end = fh.tell()
    assert locate(tmp_path, _StorageInfo("x.distcp", 0, start), (5,), torch.float32) is None
    assert locate(tmp_path, _StorageInfo("x.distcp", start, end - start), (6,), torch.float32) is None


def test_streamed_files_load_with_dcp_and_match_its_metadata(tmp_path):
    tensors = _tensors()
    ref, ours = tmp_path / "ref", tmp_path / "ours"
    ours.mkdir()
    _save(ref, {**tensors, "obj": ["payload", 3]})
    items = []
    for rank, keys in enumerate((["w"], ["b", "i"])):
        w = ItemFileWriter(ours, f"__{rank}_0.distcp")
        if rank == 1:
            buf = io.BytesIO()
            torch.save(["payload", 3], buf)
            w.put_bytes("obj", buf.getvalue())
        for k in keys:
            t = tensors[k]
            w.put_tensor(k, (0,) * t.dim(), tuple(t.shape), torch.cat([t.reshape(-1), t.reshape(-1)])[:t.numel()]
                         .view(t.shape))  # a view of a larger storage is written as just the tensor
        w.close()
        items += w.items
    write_metadata(ours, json.loads(json.dumps(items)))  # the records survive the journal (--resume)
    with open(ref / ".metadata", "rb") as fh:
        expected = pickle.load(fh).state_dict_metadata
    for md in expected.values():  # torch 2.15+ records each tensor's strides, which no older release unpickles;
        if getattr(getattr(md, "properties", None), "strides", None) is not None:  # dist_convert writes none
            assert md.properties.strides == torch.empty(md.size).stride()  # (contiguous, as it stores every item)
            md.properties.strides = None
    with open(ours / ".metadata", "rb") as fh:
        got = pickle.load(fh)
    assert got.state_dict_metadata == expected
    assert {s.relative_path for s in got.storage_data.values()} == {"__0_0.distcp", "__1_0.distcp"}
    out = {**{k: torch.zeros_like(t) for k, t in tensors.items()}, "obj": None}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(out, storage_reader=FileSystemReader(str(ours)), no_dist=True)
    for k, t in tensors.items():
        assert torch.equal(out[k], t), k
    assert out["obj"] == ["payload", 3]
    for k, t in tensors.items():  # and our own reader finds the raw bytes (the records carry no CRC32)
        stored = locate(ours, got.storage_data[MetadataIndex(k, torch.Size([0] * t.dim()))], tuple(t.shape), t.dtype)
        assert stored is not None and torch.equal(stored.read(Box.full(tuple(t.shape))), t)
    assert (ours / "__0_0.distcp").stat().st_size < 2 * tensors["w"].nbytes + 4096


@pytest.mark.parametrize("shape,box,contiguous", [
    ((4, 3, 2), Box((1, 0, 0), (2, 3, 2)), True),
    ((4, 3, 2), Box((1, 1, 0), (1, 2, 2)), True),
    ((4, 3, 2), Box((1, 1, 0), (2, 2, 2)), False),
    ((4, 3, 2), Box((0, 0, 0), (4, 3, 1)), False),
    ((4, 3, 2), Box((2, 2, 1), (1, 1, 1)), True),
])
def test_contiguous_boxes(shape, box, contiguous):
    assert is_contiguous_box(shape, box) is contiguous


def test_contiguous_cuts_keep_every_cell_contiguous():
    shape = (2, 8, 6)
    per_layer, rows, cols = {0, 1, 2}, {0, 4, 8}, {0, 3, 6}
    assert contiguous_cuts([per_layer, rows, cols], shape) == [per_layer, rows, {0, 6}]
    assert contiguous_cuts([{0, 2}, rows, cols], shape) == [{0, 2}, {0, 8}, {0, 6}]
    assert contiguous_cuts([per_layer, {0, 1, 2, 3, 4, 5, 6, 7, 8}, cols], shape) == [per_layer, set(range(9)), cols]


def _same(real, ours) -> None:
    """A real DCP metadata object and a stand-in one hold the same values (dataclasses compare by class)."""
    if hasattr(real, "__dataclass_fields__"):
        assert type(ours).__name__.lstrip("_") == type(real).__name__.lstrip("_"), (real, ours)
        for name in real.__dataclass_fields__:
            if name != "index":  # MetadataIndex's lookup hint: neither compared nor hashed
                _same(getattr(real, name), getattr(ours, name))
    elif isinstance(real, dict):
        assert list(map(repr, real)) == list(map(repr, ours))
        for (ka, va), (kb, vb) in zip(real.items(), ours.items(), strict=True):
            _same(ka, kb)
            _same(va, vb)
    elif isinstance(real, list | tuple) and not isinstance(real, torch.Size):
        assert len(real) == len(ours)
        for a, b in zip(real, ours, strict=True):
            _same(a, b)
    else:
        assert real == ours and type(real) is type(ours), (real, ours)


@pytest.mark.parametrize("source", ["megatron-core", "dcp.save"])
@pytest.mark.parametrize("python", [True, False], ids=["python-pickler", "as-dcp"])
def test_metadata_stand_ins_round_trip_dcp_metadata(request, tmp_path, source, python):
    """``dcp_meta`` reads a real ``.metadata`` (megatron-core 0.16.1's save, or ``dcp.save``'s) into stand-ins
    with every value DCP's own reader gives, and ``dumps`` of them (by the Python pickler under DCP's names, or
    rebuilt as DCP's objects for the C pickler) loads with plain pickle as DCP's own classes, equal to the
    original."""
    from dist_convert.formats import dcp_meta

    if source == "dcp.save":
        _save(tmp_path, {**_tensors(), "obj": ["payload", 3]})
        path = tmp_path / ".metadata"
    else:
        path = next(request.getfixturevalue("gpt_a").torch_dist.glob("iter_*")) / ".metadata"  # only then made
    real = pickle.loads(path.read_bytes())
    with open(path, "rb") as fh:
        ours = dcp_meta.loads(fh)
    _same(real, ours)
    again = pickle.loads(dcp_meta.dumps(ours, python=python))
    assert type(again) is type(real) and again == real
    assert type(next(iter(again.storage_data.values()))) is _StorageInfo


def test_row_blocks_written_out_of_order_load_as_whole_tensors(tmp_path):
    """A tensor handed over in row blocks, in any order (StreamWriter.put_rows), is laid out as torch.save
    lays it out and loads with DCP equal to the whole tensor, beside a tensor written whole; the file's
    checksum, computed as it was written, is the SHA-256 of its bytes."""
    import hashlib

    from dist_convert.datamodel import TargetFile, TargetTensor
    from dist_convert.formats.torch_dist import StreamWriter

    g = torch.Generator().manual_seed(1)
    big, small = torch.randn(300, 120, generator=g).to(torch.bfloat16), torch.randn(9, generator=g)
    tensors = [TargetTensor(key="big", shape=(300, 120), dtype=torch.bfloat16, pieces=[], offsets=(0, 0),
                            global_shape=(300, 120)),
               TargetTensor(key="small", shape=(9,), dtype=torch.float32, pieces=[], offsets=(0,), global_shape=(9,))]
    f = TargetFile(id=0, name="f", tensors=tensors)
    w = StreamWriter(tmp_path, [f])
    done = []
    for first in (256, 0, 128):  # out of order: blocks of 128 rows, the last one of 44
        done += w.put_rows(f, 0, first, big[first:first + 128].clone())
    assert not done  # the file still waits for its other tensor
    (written,) = w.put(f, 1, small)
    assert written.sha256 == hashlib.sha256((tmp_path / written.name).read_bytes()).hexdigest()
    write_metadata(tmp_path, written.record["items"])
    out = {"big": torch.zeros_like(big), "small": torch.zeros_like(small)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(out, storage_reader=FileSystemReader(str(tmp_path)), no_dist=True)
    assert torch.equal(out["big"], big) and torch.equal(out["small"], small)
