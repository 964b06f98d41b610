"""Journal, marker, manifest and fingerprint (dist_convert/integrity.py) without processes."""
from __future__ import annotations

import hashlib
import json
import tarfile

import pytest
import torch

from dist_convert.datamodel import TargetFile, TargetTensor, WrittenFile
from dist_convert.errors import ConvertError
from dist_convert.integrity import (
    JOURNAL,
    MANIFEST,
    MARKER,
    Journal,
    check_checksums,
    fingerprint,
    read_journal,
    refuse_incomplete,
    remove_run_state,
    restart_journal,
    write_manifest,
    write_marker,
)
from dist_convert.runtime import Runtime


def _files(dtype=torch.float32, shape=(4, 2)) -> list[TargetFile]:
    w = TargetTensor(key="w", shape=shape, dtype=dtype, pieces=[], offsets=(0, 0), global_shape=shape)
    return [TargetFile(id=0, name="a", tensors=[w]), TargetFile(id=1, name="b", tensors=[])]


def test_fingerprint_sees_every_file_tensor_and_dtype():
    base = fingerprint(_files(), {"src": "x"})
    assert base == fingerprint(_files(), {"src": "x"})
    assert len({base, fingerprint(_files(torch.bfloat16), {"src": "x"}),
                fingerprint(_files(shape=(2, 4)), {"src": "x"}), fingerprint(_files(), {"src": "y"}),
                fingerprint(_files()[:1], {"src": "x"})}) == 5


def test_journal_records_checksums_and_survives_a_torn_line(tmp_path):
    (tmp_path / "iter").mkdir()
    (tmp_path / "iter" / "f0").write_bytes(b"hello")
    (tmp_path / "iter" / "f1").write_bytes(b"world!")
    j = Journal(tmp_path, 3, "iter")
    sha = {n: hashlib.sha256(b).hexdigest() for n, b in (("f0", b"hello"), ("f1", b"world!"))}
    j.add(WrittenFile(file=0, name="f0", sha256=sha["f0"], record={"items": [1]}))
    j.add(WrittenFile(file=1, name="f1", sha256=sha["f1"]))
    j.close()
    with open(tmp_path / JOURNAL / "rank_00003.jsonl", "a") as fh:
        fh.write('{"file": 2, "name": "iter/f2", "by')  # a crash mid-append
    got = read_journal(tmp_path)
    assert sorted(got) == [0, 1]
    assert got[0].name == "iter/f0" and got[0].bytes == 5 and got[0].sha256 == sha["f0"]
    assert got[0].written("iter") == WrittenFile(file=0, name="f0", sha256=sha["f0"], record={"items": [1]})
    restart_journal(tmp_path, [got[1]])
    assert sorted(read_journal(tmp_path)) == [1]


def test_marker_makes_inspect_and_verify_refuse(tmp_path):
    dst, tmp = tmp_path / "dst", tmp_path / "dst.dist_convert_tmp"
    (tmp / "iter_0000001").mkdir(parents=True)
    write_marker(tmp, {"files": 7})
    for path in (dst, tmp, tmp / "iter_0000001"):
        with pytest.raises(ConvertError, match=r"incomplete dist_convert output \(0 of 7 target files.*--resume"):
            refuse_incomplete(path)
    remove_run_state(tmp)
    assert not (tmp / MARKER).exists()
    refuse_incomplete(dst)  # no marker: nothing to refuse


def test_manifest_check_finds_every_kind_of_damage(tmp_path):
    root = tmp_path / "t"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "x.bin").write_bytes(b"x" * 1000)
    (root / "y.json").write_text("{}")
    (root / "z").write_text("zz")
    write_manifest(root)
    assert set(json.loads((root / MANIFEST).read_text())["files"]) == {"sub/x.bin", "y.json", "z"}
    rt = Runtime()
    assert check_checksums(root, rt) == []
    with tarfile.open(tmp_path / "t.nemo", "w:") as tar:  # archives are checked member by member
        for p in sorted(root.rglob("*")):
            if p.is_file():
                tar.add(p, arcname=f"./{p.relative_to(root)}")
    assert check_checksums(tmp_path / "t.nemo", rt) == []
    (root / "sub" / "x.bin").write_bytes(b"x" * 999 + b"y")
    (root / "y.json").write_text("{ }")
    (root / "z").unlink()
    (root / "new").write_text("")
    problems = check_checksums(root, rt)
    assert any(p.startswith("sub/x.bin: SHA-256") for p in problems)
    assert "y.json: 3 bytes, the manifest says 2" in problems and "z: missing" in problems
    assert "new: not in the manifest" in problems and len(problems) == 4
    (root / MANIFEST).unlink()
    with pytest.raises(ConvertError, match="has no dist_convert_checksums.json"):
        check_checksums(root, rt)


def test_integrity_imports_first():
    """integrity imports on its own, first: it needs the data model, not the formats (which import it)."""
    import subprocess
    import sys
    subprocess.run([sys.executable, "-c", "import dist_convert.integrity"], check=True)
