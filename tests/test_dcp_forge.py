"""The forged ``.metadata`` (formats/dcp_meta.py) against the running torch's own DCP classes: the start-up check
finds nothing to complain about on this torch, finds a forge that no longer matches, and the fallback (DCP's own
objects, built by keyword) writes a ``.metadata`` that ``dcp.load`` reads. tests/test_newest_torch.py runs this
file under torch 2.15 too (.venv-newest)."""
from __future__ import annotations

import copy
import io
import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from dist_convert.formats import dcp_meta
from dist_convert.formats.distcp import ItemFileWriter, write_metadata


def _sample(props: dcp_meta.TensorProperties) -> dcp_meta.Metadata:
    chunk = dcp_meta.ChunkStorageMetadata(torch.Size([0]), torch.Size([3]))
    md = dcp_meta.Metadata(state_dict_metadata={"t": dcp_meta.TensorStorageMetadata(props, torch.Size([3]), [chunk])},
                           storage_data={dcp_meta.MetadataIndex("t", (0,)): dcp_meta.StorageInfo("__0_0.distcp", 0, 9)})
    return dcp_meta.finished(md, Path("ckpt"))


class _ChangedState(dcp_meta.TensorProperties):
    """A stand-in whose pickled state no longer is what DCP's class takes (as after a torch release changed it)."""

    def _state(self) -> tuple:
        return (self.dtype,)


def test_the_running_torch_reads_the_forge_as_its_own():
    assert dcp_meta.forge_problem() is None, torch.__version__
    assert dcp_meta.forge_problem(_sample(dcp_meta.TensorProperties(dtype=torch.float16))) is None


def test_a_forge_the_running_torch_reads_otherwise_is_found():
    problem = dcp_meta.forge_problem(_sample(_ChangedState(dtype=torch.float16)))
    assert problem is not None


def test_the_fallback_writes_what_dcp_loads(tmp_path, monkeypatch):
    """DIST_CONVERT_DCP_METADATA=dcp (what a failed start-up check chooses): the .metadata is pickled from DCP's own
    objects; DCP reads it, loads the tensors, and it holds what the forge would have written."""
    t = {"w": torch.randn(5, 4).to(torch.bfloat16), "b": torch.arange(7, dtype=torch.int64)}
    w = ItemFileWriter(tmp_path, "__0_0.distcp")
    for k, v in t.items():
        w.put_tensor(k, (0,) * v.dim(), tuple(v.shape), v)
    w.close()
    monkeypatch.setenv(dcp_meta.WRITER_ENV, "dcp")
    assert not dcp_meta.use_forge() and "DCP's own objects" in dcp_meta.writer_note()
    write_metadata(tmp_path, w.items)
    fallback = (tmp_path / ".metadata").read_bytes()
    out = {k: torch.zeros_like(v) for k, v in t.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(out, storage_reader=FileSystemReader(str(tmp_path)), no_dist=True)
    assert all(torch.equal(out[k], v) for k, v in t.items())
    monkeypatch.setenv(dcp_meta.WRITER_ENV, "forge")
    assert dcp_meta.use_forge() and dcp_meta.writer_note() is None
    write_metadata(tmp_path, w.items)
    forged, dcp_own = pickle.loads((tmp_path / ".metadata").read_bytes()), pickle.loads(fallback)
    assert forged.state_dict_metadata == dcp_own.state_dict_metadata
    assert forged.storage_data == dcp_own.storage_data


@pytest.mark.parametrize("strides", [None, (1,)])
def test_tensor_properties_of_any_release_are_read(strides):
    """torch 2.15 pickles a sixth item (the chunk's strides); 2.14 and older five: both are read, and written
    back as they came (five stay five: older releases read them)."""
    md = _sample(dcp_meta.TensorProperties(dtype=torch.float32, strides=strides))
    again = dcp_meta.loads(io.BytesIO(dcp_meta.dumps(md, python=True)))
    props = again.state_dict_metadata["t"].properties
    assert props == md.state_dict_metadata["t"].properties and len(props._state()) == (5 if strides is None else 6)
    copied = copy.deepcopy(props)  # plain pickle and deepcopy go through the same state
    assert copied == props == pickle.loads(pickle.dumps(props)) and copied._state() == props._state()
