"""Streamed ``torch.save`` files (``formats/torch_zip.py``): the layout of a file follows from its object alone (pure,
no file), a file written as its tensors arrive, in any order, is byte for byte what ``torch.save`` (``save_durable``)
writes, every CRC-32 checks out (zipfile's ``testzip``, which notices one left unpatched), ``torch.load`` gives the
tensors back bit for bit, and the reported SHA-256 is the file's. In-process, no ranks: a few seconds."""
from __future__ import annotations

import argparse
import gc
import hashlib
import io
import random
import weakref
import zipfile

import pytest
import torch

from dist_convert.datamodel import TargetFile, TargetTensor
from dist_convert.durable import save_durable
from dist_convert.formats import torch_zip
from dist_convert.formats.torch_zip import SavedFiles, StreamedSave, part_needs, patches, save_layout, serialization_id

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int8,
          torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2]


def tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if not dtype.is_floating_point:
        return torch.randint(-100 if dtype.is_signed else 0, 100, shape, generator=g).to(dtype)
    return (torch.randn(shape, generator=g) * 10).to(dtype)


def every_dtype() -> dict:
    return {str(d): tensor((3, 5), d, i) for i, d in enumerate(DTYPES)}


def rank_file() -> dict:
    """As a legacy Megatron rank file: two model chunks (one empty), _extra_state objects, args, counters."""
    return {"model0": {"embedding.word_embeddings.weight": tensor((96, 16), torch.bfloat16, 1),
                       "decoder.layers.0.self_attention.linear_qkv.weight": tensor((48, 16), torch.bfloat16, 2),
                       "decoder.layers.0.self_attention.core_attention._extra_state": None,
                       "decoder.final_layernorm.weight": tensor((16,), torch.float32, 3)},
            "model1": {}, "args": argparse.Namespace(hidden_size=16, tokenizer_type="GPT2BPETokenizer"),
            "checkpoint_version": 3.0, "iteration": 0, "dist_convert_origin": {"kind": "hf", "hf_config": None}}


STRUCTURES = {
    "nested": lambda: {"a": {"b": {"c": tensor((7,), torch.float32, 0)}, "d": [tensor((2, 2), torch.int64, 1)]},
                       "e": tensor((4, 3), torch.bfloat16, 2), "f": "text", "g": 1.5},
    "dtypes": every_dtype,
    "empty and 0-dim": lambda: {"empty": torch.zeros(0), "empty2": torch.zeros(0, 8, dtype=torch.bfloat16),
                                "scalar": torch.tensor(3.25), "fp8 scalar": torch.tensor(2.0).to(torch.float8_e4m3fn),
                                "between": tensor((5,), torch.float16, 3), "last empty": torch.zeros(0, 1)},
    "no tensors": lambda: {"args": argparse.Namespace(x=1), "iteration": 7},
    "only empty tensors": lambda: {"x": torch.zeros(0), "y": None},
    "rank file": rank_file,
    "odd sizes": lambda: {f"t{i}": tensor((n,), torch.uint8, i) for i, n in enumerate((1, 63, 64, 65, 129, 1000))},
}


def saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def assemble(obj) -> bytes:
    """Pure, no file: the skeleton's parts, every storage's bytes and the patches for their CRCs, in one buffer."""
    layout, tensors = save_layout(obj)
    out = bytearray(layout.size)
    for at, data in layout.parts:
        out[at:at + len(data)] = data
    for k, t in enumerate(tensors):
        r = layout.records[layout.storages[k]]
        out[r.at:r.at + r.nbytes] = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    for at, value in patches(layout, [torch_zip.zlib.crc32(t.view(-1).view(torch.uint8).numpy()) for t in tensors]):
        out[at:at + len(value)] = value
    return bytes(out)


@pytest.mark.parametrize("name", list(STRUCTURES))
def test_layout_plus_patches_is_torch_save(name):
    obj = STRUCTURES[name]()
    assert assemble(obj) == saved(obj)


def test_layout_math():
    """Storages lie 64-byte aligned in key order between the parts; each gap between storages waits for the CRC of
    the storage before it, the tail (central directory, serialization id) for every storage, the head for none."""
    layout, tensors = save_layout(every_dtype())
    assert len(tensors) == len(layout.storages) == len(DTYPES) and layout.size == len(saved(every_dtype()))
    spans = [(layout.records[i].at, layout.records[i].nbytes) for i in layout.storages]
    assert all(at % 64 == 0 for at, _ in spans) and spans == sorted(spans)
    assert [r.storage for r in layout.records if r.storage is not None] == list(range(len(DTYPES)))
    # the parts and the storages' bytes tile the file
    pieces = sorted([(at, len(d)) for at, d in layout.parts] + spans)
    assert pieces[0][0] == 0 and all(a + n == b for (a, n), (b, _) in zip(pieces, pieces[1:], strict=False))
    assert sum(pieces[-1]) == layout.size
    every = frozenset(range(len(DTYPES)))
    assert part_needs(layout) == [frozenset()] + [frozenset({k}) for k in range(len(DTYPES) - 1)] + [every]


def test_serialization_id_is_torch_s_hash_beyond_4_gib():
    """The serialization id combines every record's CRC as torch's writer does, here of a skeleton's own CRCs, in a
    zip64 file (offsets past 4 GiB; the stand-in's pages are never touched)."""
    layout, _ = save_layout({"big": torch.empty(4 << 30 | 5, dtype=torch.uint8), "after": torch.empty(3),
                             "empty": torch.empty(0)})
    after = layout.records[layout.storages[1]]
    assert after.at > 1 << 32 and after.at % 64 == 0 and layout.records[layout.storages[2]].descriptor is None
    sid = layout.records[layout.serialization_id]
    text = next(data for at, data in layout.parts if at <= sid.at < at + len(data))
    start = sid.at - next(at for at, data in layout.parts if at <= sid.at < at + len(data))
    crcs = [layout.records[i].crc for i in layout.storages]
    assert serialization_id(layout, crcs) == text[start:start + sid.nbytes]


def stream(path, obj, order: str, seed: int = 0) -> str:
    layout, tensors = save_layout(obj)
    ks = list(range(len(tensors)))
    if order == "reverse":
        ks.reverse()
    elif order == "random":
        random.Random(seed).shuffle(ks)
    out = StreamedSave(path, layout)
    for k in ks:
        out.write(k, tensors[k])
    return out.close()


@pytest.mark.parametrize("order", ["in order", "reverse", "random"])
@pytest.mark.parametrize("name", list(STRUCTURES))
def test_streamed_file_is_torch_save(tmp_path, name, order):
    obj = STRUCTURES[name]()
    sha = stream(tmp_path / "f.pt", obj, order, seed=len(name))
    data = (tmp_path / "f.pt").read_bytes()
    assert data == saved(obj)
    assert sha == hashlib.sha256(data).hexdigest()
    assert zipfile.ZipFile(tmp_path / "f.pt").testzip() is None


def test_torch_load_gives_the_tensors_back_bitwise(tmp_path):
    obj = {**every_dtype(), "empty": torch.zeros(0, 3), "scalar": torch.tensor(-1.5, dtype=torch.bfloat16)}
    stream(tmp_path / "f.pt", obj, "random")
    back = torch.load(tmp_path / "f.pt", weights_only=True)
    assert back.keys() == obj.keys()
    for k, v in obj.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape
        assert torch.equal(back[k].view(-1).view(torch.uint8), v.view(-1).view(torch.uint8))
    assert torch.load(tmp_path / "f.pt", weights_only=False, mmap=True).keys() == obj.keys()


def test_an_unpatched_crc_is_noticed(tmp_path, monkeypatch):
    """What guards the CRCs: a file whose storages keep the skeleton's CRCs fails zipfile's check, naming the
    storage; torch.load alone would not notice."""
    real = patches
    monkeypatch.setattr(torch_zip, "patches", lambda layout, crcs: [
        p for p in real(layout, crcs) if not any(p[0] in (layout.records[i].descriptor, layout.records[i].central)
                                                 for i in layout.storages)])
    obj = {"a": torch.arange(100.0), "b": torch.ones(3)}
    stream(tmp_path / "f.pt", obj, "in order")
    assert zipfile.ZipFile(tmp_path / "f.pt").testzip() == "archive/data/0"
    assert torch.equal(torch.load(tmp_path / "f.pt", weights_only=True)["a"], obj["a"])


def test_shared_or_view_tensors_are_refused():
    base = torch.arange(10.0)
    with pytest.raises(AssertionError, match="own contiguous storage"):
        save_layout({"view": base[2:5]})
    with pytest.raises(AssertionError, match="own contiguous storage"):
        save_layout({"a": base, "b": base.view(2, 5)})


def planned(objects: dict) -> tuple[list[TargetFile], list[list[torch.Tensor]]]:
    specs = [[("w", (64, 32), torch.bfloat16), ("b", (32,), torch.float32), ("e", (0, 4), torch.bfloat16),
              ("s", (), torch.float32)], [("x", (9, 7), torch.float16)], []]
    files = [TargetFile(id=i, name=f"mp_rank_{i:02d}/model_weights.ckpt", objects=objects,
                        tensors=[TargetTensor(key=k, shape=s, dtype=d, pieces=[]) for k, s, d in spec])
             for i, spec in enumerate(specs)]
    return files, [[tensor(s, d, 10 * i + j) for j, (_, s, d) in enumerate(spec)] for i, spec in enumerate(specs)]


def test_saved_files_as_a_target_writer(tmp_path):
    """The NeMo 1 writer's shape: tensors of two files interleaved in a random order, a file without tensors written
    by ``close``, a buffer among the objects (legacy NeMo's inv_freq) written with the skeleton; each file is
    ``save_durable``'s and reported once, with its SHA-256, when its last tensor arrives; no tensor is kept."""
    files, values = planned({"inv_freq": torch.arange(4.0), "extra": None})

    def build(f, tensors):
        return {**{t.key: x for t, x in zip(f.tensors, tensors, strict=True)}, **f.objects}

    w = SavedFiles(tmp_path / "out", files, build)
    arrivals = [(f, j) for f in files for j in range(len(f.tensors))]
    random.Random(3).shuffle(arrivals)
    reported, kept = [], []
    for n, (f, j) in enumerate(arrivals):
        x = values[f.id][j].clone()
        kept.append(weakref.ref(x))
        got = w.put(f, j, x)
        assert [g.file for g in got] == ([f.id] if all((f, i) in arrivals[:n + 1] for i in range(len(f.tensors)))
                                         else [])
        reported += got
        del x
    gc.collect()
    assert all(r() is None for r in kept)
    reported += w.close()
    assert sorted(g.file for g in reported) == [0, 1, 2]
    for g in reported:
        f = files[g.file]
        expect = save_durable(build(f, values[f.id]), tmp_path / "expect" / f.name)
        data = (tmp_path / "out" / f.name).read_bytes()
        assert data == (tmp_path / "expect" / f.name).read_bytes()
        assert g.sha256 == expect == hashlib.sha256(data).hexdigest() and g.name == f.name


def test_a_tensor_that_does_not_fit_its_plan_is_refused(tmp_path):
    files, _ = planned({})
    w = SavedFiles(tmp_path, files, lambda f, tensors: dict(zip([t.key for t in f.tensors], tensors, strict=True)))
    with pytest.raises(AssertionError, match="planned"):
        w.put(files[1], 0, torch.zeros(9, 7))
