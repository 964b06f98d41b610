"""How target files are written (durable.py) and source spans read (distcp.mapped): the checksum a writer reports
is the SHA-256 of the bytes on disk, whatever the order, size and thread its parts were hashed in; the early
write-back is wired to the kernel where there is one; a mapped read is the stored bytes, and writing into it
never reaches the file."""
from __future__ import annotations

import hashlib
import os
import signal
import sys

import pytest
import torch

from dist_convert import durable
from dist_convert.durable import Digest, DurableFile, save_durable
from dist_convert.formats import distcp
from dist_convert.formats.distcp import StoredTensor
from dist_convert.formats.safetensors_io import write_file
from dist_convert.integrity import file_sha256
from dist_convert.layout.boxes import Box


def _bytes(n: int, seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).numpy().tobytes()


def test_digest_in_the_hashing_thread_is_sha256_in_order(monkeypatch):
    monkeypatch.setattr(durable, "HASH_AHEAD", 1000)  # the writer waits for the thread every few parts
    parts = [_bytes(n, i) for i, n in enumerate((10, 3000, 1, 0, 999, 70_000, 5))]
    d = Digest()
    for i, p in enumerate(parts):
        (d.update_now if i % 3 == 2 else d.update)(memoryview(p))  # buffers valid only during the call: inline
        assert d.waiting <= 1000
    assert d.hexdigest() == hashlib.sha256(b"".join(parts)).hexdigest()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork is POSIX's")
def test_a_forked_child_hashes_on_a_thread_of_its_own():
    Digest().update(memoryview(b"parent"))  # the parent's hashing thread is running
    pid = os.fork()
    if pid == 0:  # the child: a digest through the thread, within 20 s, else exit 1
        signal.alarm(20)
        d = Digest()
        d.update(memoryview(b"child"))
        os._exit(0 if d.hexdigest() == hashlib.sha256(b"child").hexdigest() else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.parametrize("sizes", [(5, 17), (durable.WRITEBACK_BYTES + 3, 100, durable.WRITEBACK_BYTES)])
def test_durable_file_reports_the_sha256_of_what_is_on_disk(tmp_path, sizes):
    parts = [_bytes(n, i) for i, n in enumerate(sizes)]
    with DurableFile(tmp_path / "f") as fh:
        for i, p in enumerate(parts):  # inline and on the hashing thread, in turn
            assert (fh.write_kept if i % 2 else fh.write)(p) == len(p)
        assert fh.tell() == sum(sizes)
        sha = fh.close()
    assert (tmp_path / "f").read_bytes() == b"".join(parts)
    assert sha == hashlib.sha256(b"".join(parts)).hexdigest() == file_sha256(tmp_path / "f")


def test_torch_save_and_safetensors_through_the_durable_file(tmp_path):
    obj = {"w": torch.randn(700, 800), "n": 3}  # 2.2 MB: torch.save hands its bytes over in several writes
    sha = save_durable(obj, tmp_path / "a.pt")
    assert sha == file_sha256(tmp_path / "a.pt")
    back = torch.load(tmp_path / "a.pt", weights_only=True)
    assert torch.equal(back["w"], obj["w"]) and back["n"] == 3
    sha = write_file(tmp_path / "b.safetensors", [("w", obj["w"]), ("e", torch.empty(0))])
    assert sha == file_sha256(tmp_path / "b.safetensors")


def test_an_error_leaves_the_file_closed_unsynced(tmp_path):
    with pytest.raises(ValueError), DurableFile(tmp_path / "f") as fh:
        fh.write(b"abc")
        raise ValueError("the writer failed")
    assert fh.fd == -1 and (tmp_path / "f").read_bytes() == b"abc"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux's")
def test_early_write_back_is_wired_to_the_kernel(tmp_path):
    assert durable._SFR is not None  # else every file would wait for its fsync, silently
    with DurableFile(tmp_path / "f") as fh:
        fh.write(_bytes(durable.WRITEBACK_BYTES + 1, 0))
        assert fh.writeback.handed == durable.WRITEBACK_BYTES + 1  # handed to the disk at once
        fh.close()


def test_mapped_reads_are_the_stored_bytes_and_private(tmp_path):
    t = torch.randn(1100, 300)  # 1.3 MB: above distcp.MAP_MIN
    head = b"x" * 4099  # the tensor starts off a page boundary
    (tmp_path / "f").write_bytes(head + t.numpy().tobytes())
    stored = StoredTensor(path=tmp_path / "f", offset=len(head), shape=(1100, 300), dtype=torch.float32)
    whole = stored.read(Box.full((1100, 300)))
    assert whole.numel() * 4 >= distcp.MAP_MIN and torch.equal(whole, t)
    for box in (Box((1000, 0), (100, 300)), Box((3, 7), (1000, 200)), Box((5, 5), (2, 3))):  # mapped, mapped, read
        assert torch.equal(stored.read(box), t[box.slices()])
    whole.zero_()  # a private mapping: the file keeps its bytes
    assert (tmp_path / "f").read_bytes()[len(head):] == t.numpy().tobytes()
    rows = stored.read(Box((10, 0), (1000, 300)))
    (tmp_path / "f").unlink()  # the mapping outlives the file's name
    assert torch.equal(rows, t[10:1010])


def test_a_file_system_that_cannot_map_is_read(tmp_path, monkeypatch):
    t = torch.randn(1100, 300)
    (tmp_path / "f").write_bytes(t.numpy().tobytes())

    def refuse(*args, **kwargs):
        raise OSError(19, "No such device")  # what mmap(2) says where the file system has no mmap

    monkeypatch.setattr(distcp.mmap, "mmap", refuse)
    stored = StoredTensor(path=tmp_path / "f", offset=0, shape=(1100, 300), dtype=torch.float32)
    assert torch.equal(stored.read(Box((3, 7), (1000, 200))), t[3:1003, 7:207])
