"""Bad input: a one-line error naming the cause and the fix, a non-zero exit, no complete-looking DST."""
from __future__ import annotations

import os
import pickle
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dist_convert.errors import ConvertError
from dist_convert.formats import dcp_meta, get_format
from dist_convert.formats.base import FormatOptions
from dist_convert.formats.distcp import load_metadata
from dist_convert.runtime import Runtime

from conftest import assert_refused, ok, run_cli
from hf_models import make_hf_model
from test_nemo import make_nemo

ITER = "iter_0000100"
ROUTER = "decoder.layers.0.mlp.router.weight"  # a MoE router: no tensor of a dense GPT


def damaged(src: Path, tmp_path: Path, fn) -> Path:
    copy = tmp_path / "src"
    shutil.copytree(src, copy)
    fn(copy / ITER)
    return copy


def edit_rank_file(rank_dir: str, edit):
    def fn(it: Path) -> None:
        f = it / rank_dir / "model_optim_rng.pt"
        ck = torch.load(f, weights_only=False)
        edit(ck)
        torch.save(ck, f)
    return fn


def _set_arg(name, value):
    return lambda ck: setattr(ck["args"], name, value)


DAMAGE = {
    "missing rank directory": (lambda it: shutil.rmtree(it / "mp_rank_01_001"), ["mp_rank_01_001 is missing"]),
    "disagreeing shapes": (edit_rank_file("mp_rank_01_000", lambda ck: ck["model"].__setitem__(
        "decoder.layers.0.mlp.linear_fc2.weight", torch.zeros(64, 40))), ["has shape (64, 40)", "expected (64, 48)"]),
    "disagreeing dtypes": (edit_rank_file("mp_rank_01_000", lambda ck: ck["model"].__setitem__(
        "decoder.layers.0.mlp.linear_fc2.weight", ck["model"]["decoder.layers.0.mlp.linear_fc2.weight"].half())),
        ["decoder.layers.0.mlp.linear_fc2.weight is stored as torch.float32 in mp_rank_00_000/model_optim_rng.pt",
         "but as torch.float16 in mp_rank_01_000/model_optim_rng.pt"]),
    "unknown key": (edit_rank_file("mp_rank_00_000", lambda ck: ck["model"].__setitem__(ROUTER, torch.zeros(4, 64))),
                    ["mp_rank_00_000/model_optim_rng.pt: unexpected tensors", "router", "--ignore-unexpected PATTERN"]),
    "missing key": (edit_rank_file("mp_rank_00_001", lambda ck: ck["model"].pop("decoder.final_layernorm.weight")),
                    ["mp_rank_00_001/model_optim_rng.pt: missing tensors", "final_layernorm",
                     "--allow-missing PATTERN"]),
    "truncated file": (lambda it: (it / "mp_rank_00_001" / "model_optim_rng.pt").write_bytes(
        (it / "mp_rank_00_001" / "model_optim_rng.pt").read_bytes()[:5000]), ["corrupt or truncated"]),
    "untrusted pickle": (edit_rank_file("mp_rank_00_000", lambda ck: ck.__setitem__("x", shutil.Error("boom"))),
                         ["allow-list", "--trust-pickle"]),
}


@pytest.mark.parametrize("what", list(DAMAGE))
def test_damaged_source_is_refused(gpt_a, tmp_path, what):
    fn, needles = DAMAGE[what]
    src = damaged(gpt_a.megatron, tmp_path, fn)
    proc = run_cli("reshard", str(src), str(tmp_path / "dst"), "--target-tp", "1")
    assert_refused(proc, tmp_path, *needles)


def test_unknown_key_passes_with_ignore_unexpected(gpt_a, tmp_path):
    src = damaged(gpt_a.megatron, tmp_path, DAMAGE["unknown key"][0])
    proc = ok(run_cli("reshard", str(src), str(tmp_path / "dst"), "--target-tp", "1",
                      "--ignore-unexpected", "decoder.layers.*.mlp.router.*"))
    assert "note: ignored 1 unexpected source tensors (--ignore-unexpected): ['mp_rank_00_000/model_optim_rng.pt: " \
           f"{ROUTER}']" in proc.stderr
    ok(run_cli("verify", str(gpt_a.megatron), str(tmp_path / "dst")))


def test_missing_key_is_left_out_with_allow_missing(gpt_a, tmp_path):
    src = damaged(gpt_a.megatron, tmp_path, DAMAGE["missing key"][0])
    proc = ok(run_cli("reshard", str(src), str(tmp_path / "dst"), "--target-tp", "1",
                      "--allow-missing", "decoder.final_layernorm.*"))
    assert "note: left out 1 logical tensors the source lacks (--allow-missing): ['decoder.final_layernorm.weight']" \
        in proc.stderr


def test_untrusted_pickle_passes_with_trust_pickle(gpt_a, tmp_path):
    src = damaged(gpt_a.megatron, tmp_path, DAMAGE["untrusted pickle"][0])
    ok(run_cli("reshard", str(src), str(tmp_path / "dst"), "--target-tp", "1", "--trust-pickle"))
    assert (tmp_path / "dst" / ITER / "mp_rank_00_000" / "model_optim_rng.pt").is_file()


class _Payload:
    """Unpickled by plain pickle, this runs ``cmd`` in a shell."""

    def __init__(self, cmd: str) -> None:
        self.cmd = cmd

    def __reduce__(self):
        return os.system, (self.cmd,)


def _metadata_payload(it: Path) -> None:
    """A .metadata whose unpickling would create ``pwned`` beside the damaged copy (in tmp_path)."""
    marker = it.parents[1] / "pwned"
    payload = pickle.dumps(_Payload(f"touch {marker}"))
    pickle.loads(payload)  # the payload is live: plain unpickling runs it
    assert marker.exists()
    marker.unlink()
    (it / ".metadata").write_bytes(payload)


def _biggest_distcp(it: Path) -> Path:
    return max(it.glob("*.distcp"), key=lambda p: p.stat().st_size)


TORCH_DIST_DAMAGE = {
    "missing .distcp file": (lambda it: (it / "__1_0.distcp").unlink(),
                             ["__1_0.distcp is missing (.metadata stores", "copy the complete checkpoint"]),
    "truncated .distcp file": (lambda it: os.truncate(_biggest_distcp(it), _biggest_distcp(it).stat().st_size // 2),
                               ["is truncated (", "corrupt or truncated"]),
    "corrupted .metadata": (lambda it: (it / ".metadata").write_bytes((it / ".metadata").read_bytes()[:200]),
                            [".metadata is unreadable (", "corrupt or truncated"]),
    "code in .metadata": (_metadata_payload, [".metadata references posix.system, outside the allow-list",
                                              "--trust-pickle"]),
}


@pytest.mark.parametrize("what", list(TORCH_DIST_DAMAGE))
def test_damaged_torch_dist_source_is_refused(gpt_a, tmp_path, what):
    """Found while indexing, before any rank reads; code in the pickled .metadata never runs."""
    fn, needles = TORCH_DIST_DAMAGE[what]
    src = damaged(gpt_a.torch_dist, tmp_path, fn)
    assert_refused(run_cli("reshard", str(src), str(tmp_path / "dst"), "--target-tp", "1"), tmp_path, *needles)
    assert not (tmp_path / "pwned").exists()


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory) -> Path:
    """A sharded transformers checkpoint (model.safetensors.index.json + 4 shards)."""
    return make_hf_model(tmp_path_factory.mktemp("hf"), "llama", max_shard_size="100KB")


def test_safetensors_header_longer_than_the_file_is_refused(hf_llama, tmp_path):
    """More hf rows (missing shard, garbage header, truncated shard): test_hf.py::test_damaged_hf_source_is_refused."""
    src = tmp_path / "src"
    shutil.copytree(hf_llama, src)
    shard = src / "model-00002-of-00004.safetensors"
    with open(shard, "r+b") as fh:
        fh.write(struct.pack("<Q", shard.stat().st_size))
    assert_refused(run_cli("reshard", str(src), str(tmp_path / "dst"), "--dst-format", "torch_dist"), tmp_path,
                   f"{shard} has a corrupt safetensors header (declared length {shard.stat().st_size}", "re-download")


def _td_keys(it: Path) -> None:
    md = load_metadata(it)
    sdm = md.state_dict_metadata
    sdm["decoder.layers.mlp.router.weight"] = sdm.pop("decoder.final_layernorm.weight")
    (it / ".metadata").write_bytes(dcp_meta.dumps(md))


def _hf_keys(d: Path) -> None:
    for shard in d.glob("*.safetensors"):
        sd = load_file(shard)
        if "model.layers.1.self_attn.k_proj.weight" in sd:
            del sd["model.layers.1.self_attn.k_proj.weight"]
            sd["model.layers.0.mlp.router.weight"] = torch.zeros(4, 64)
            save_file(sd, shard, metadata={"format": "pt"})


def _nemo_keys(d: Path) -> None:
    f = d / "tp_rank_00_pp_rank_001" / "model_weights.ckpt"
    sd = torch.load(f, weights_only=False)
    sd[f"model.{ROUTER}"] = sd.pop("model.decoder.final_layernorm.weight")
    torch.save(sd, f)


# format -> (damage: one unknown and one missing tensor, --ignore-unexpected, --allow-missing, what is left out)
KEY_CASES = {
    "torch_dist": (_td_keys, "*.router.*", "decoder.final_layernorm.*", "decoder.final_layernorm.weight"),
    "hf": (_hf_keys, "model.layers.*.mlp.router.*", "decoder.layers.1.self_attention.linear_qkv.*",
           "decoder.layers.1.self_attention.linear_qkv.weight"),  # k_proj is a part of the fused QKV
    "nemo": (_nemo_keys, "model.decoder.layers.*.mlp.router.*", "decoder.final_layernorm.weight",
             "decoder.final_layernorm.weight"),  # the logical name, without the stored key's "model." prefix
}


@pytest.mark.parametrize("fmt", list(KEY_CASES))
def test_every_reader_is_strict_unless_told(gpt_a, hf_llama, tmp_path, fmt):
    """Each reader's index (in process): unknown, then missing tensors refused naming the flag; with
    both flags the missing logical tensor is left out (no chunk holds a piece of it) with notes."""
    damage, ignore, allow, gone = KEY_CASES[fmt]
    if fmt == "torch_dist":
        src = damaged(gpt_a.torch_dist, tmp_path, damage)
    elif fmt == "hf":
        src = shutil.copytree(hf_llama, tmp_path / "src")
        damage(src)
    else:
        src = make_nemo(gpt_a, tmp_path, archive=False)
        damage(src)

    def index(**kw):
        return get_format(fmt, FormatOptions(**kw)).index(src, Runtime(), 100 if fmt == "nemo" else None)

    with pytest.raises(ConvertError, match=r"\['[^]]*router[^]]*'\]; .*, or pass --ignore-unexpected PATTERN to skip"):
        index()
    with pytest.raises(ConvertError, match=r"missing tensors \[.*--allow-missing PATTERN"):
        index(ignore_unexpected=(ignore,))
    with pytest.raises(ConvertError, match="missing tensors"):
        index(ignore_unexpected=(ignore,), allow_missing=("*.bias",))
    idx = index(ignore_unexpected=(ignore,), allow_missing=("nothing", allow))
    assert idx.absent == {gone}
    assert not any(p.logical == gone for c in idx.chunks for p in c.pieces) and all(c.pieces for c in idx.chunks)
    assert any(n.startswith("ignored 1 unexpected source tensors") and "router" in n for n in idx.notes)
    assert f"left out 1 logical tensors the source lacks (--allow-missing): ['{gone}']" in idx.notes


@pytest.mark.parametrize("flags,needles", [
    (["--target-pp", "5"], ["PP=5 exceeds num_layers=4", "--target-pp"]),
    (["--target-pp", "2", "--target-num-layers-in-first-stage", "5"], ["--target-num-layers-in-first-stage"]),
    (["--target-tp", "3"], ["TP=3 does not divide num_attention_heads=4", "--target-tp"]),
    (["--make-vocab-size-divisible-by", "-8"], ["make_vocab_size_divisible_by=-8 is not a positive padding multiple",
                                                "--make-vocab-size-divisible-by N"]),
])
def test_impossible_target_layout_is_refused(gpt_a, tmp_path, flags, needles):
    assert_refused(run_cli("reshard", str(gpt_a.torch_dist), str(tmp_path / "dst"), *flags), tmp_path, *needles)


def test_unknown_vocab_needs_the_flag(gpt_a, tmp_path):
    tp1 = tmp_path / "tp1"
    ok(run_cli("reshard", str(gpt_a.megatron), str(tp1), "--target-tp", "1", "--target-pp", "1"))
    src = damaged(tp1, tmp_path, edit_rank_file("mp_rank_00", _set_arg("vocab_size", None)))
    # padded 112 rows at TP=1 (divisor 16); TP=2 needs a multiple of 32: only the true size tells how to re-pad
    assert_refused(run_cli("reshard", str(src), str(tmp_path / "dst"), "--target-tp", "2"), tmp_path,
                   "vocabulary size is unknown", "--vocab-size")
    ok(run_cli("reshard", str(src), str(tmp_path / "dst"), "--target-tp", "2", "--vocab-size", "100"))
    ok(run_cli("verify", str(gpt_a.megatron), str(tmp_path / "dst"), "--vocab-size", "100"))


def test_existing_dst_needs_overwrite(gpt_a, tmp_path):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    proc = run_cli("reshard", str(gpt_a.torch_dist), str(dst), "--target-tp", "1", nproc=2)
    assert proc.returncode != 0 and "already exists" in proc.stderr and "--overwrite" in proc.stderr
    assert (dst / "keep.txt").exists()
    ok(run_cli("reshard", str(gpt_a.torch_dist), str(dst), "--target-tp", "1", "--overwrite", nproc=2))
    assert not (dst / "keep.txt").exists() and (dst / "latest_checkpointed_iteration.txt").read_text() == "100"


def test_corrupt_dcp_chunk_fails_every_rank_cleanly(gpt_a, tmp_path):
    """One rank hits the damaged chunk mid-exchange (the file keeps its size, so indexing cannot tell);
    all ranks stop (no hang) and no DST appears."""
    def corrupt(it: Path) -> None:
        info = next(v for k, v in load_metadata(it).storage_data.items() if k.fqn == "embedding.word_embeddings.weight")
        with open(it / info.relative_path, "r+b") as fh:
            fh.seek(info.offset)
            fh.write(b"\xff" * 64)  # the item's zip header
    src = damaged(gpt_a.torch_dist, tmp_path, corrupt)
    proc = run_cli("reshard", str(src), str(tmp_path / "dst"), "--target-tp", "1", nproc=2, timeout=120)
    assert proc.returncode != 0
    assert "corrupt or truncated" in proc.stderr
    assert not (tmp_path / "dst").exists() and not list(tmp_path.glob("*.dist_convert_tmp"))


def test_source_not_a_checkpoint(tmp_path):
    (tmp_path / "empty").mkdir()
    assert_refused(run_cli("reshard", str(tmp_path / "empty"), str(tmp_path / "dst")), tmp_path,
                   "not a checkpoint in a known format", "--src-format")
    assert_refused(run_cli("inspect", str(tmp_path / "nope")), tmp_path, "does not exist")
