"""megatron-core 0.19 checkpoints and the second runtime: the common state as the DCP item
``common_state/shard_0_1`` (no common.pt) read and written, ``--torch-dist-style``, unfinished async
saves refused, TP a multiple of the query groups, and dist_convert itself under Python 3.12 +
megatron-core 0.19.2. Judged by megatron-core 0.16.1 and 0.19.2 loading strictly (tests/oracles/mcore.py)."""
from __future__ import annotations

import io
import json
import pickle
import shutil

import pytest
import torch
from test_speculate import spec_oracle
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex

from dist_convert.formats.dcp_meta import as_dcp
from dist_convert.formats.distcp import load_metadata

from conftest import CONFIGS, assert_refused, make_gpt, ok, oracle, run_cli

ITEM = "common_state/shard_0_1"


@pytest.fixture(scope="session")
def src19(tmp_path_factory):
    """Config A with gpt_a's seed, saved by megatron-core 0.19.2 at TP=2 PP=1: the same tensors as gpt_a."""
    cfg, *_ = CONFIGS["A"]
    return make_gpt(tmp_path_factory.mktemp("src19"), "A19", cfg, 2, 1, runtime="mcore19")


def it(root):
    return root / "iter_0000100"


def style_of(root) -> str:
    d = it(root)
    items = load_metadata(d).state_dict_metadata  # torch 2.13's DCP cannot unpickle 2.15's (strides)
    config = json.loads((d / "metadata.json").read_text())
    if (d / "common.pt").is_file():
        assert ITEM not in items and config["common_backend"] == "torch"
        return "0.16"
    assert ITEM in items and "common_backend" not in config
    return "0.19"


def test_a_019_save_has_no_common_pt_and_holds_gpt_a(src19, gpt_a):
    """What 0.19.2 writes (so the cases below test what they say), and that it is read: verify finds every
    logical tensor equal to gpt_a's (0.16.1's save at TP=2 PP=2, same seed) under both runtimes."""
    assert style_of(src19.torch_dist) == "0.19"
    for runtime in ("default", "mcore19"):
        proc = ok(run_cli("verify", str(src19.torch_dist), str(gpt_a.torch_dist), nproc=2, runtime=runtime))
        out = proc.stdout + proc.stderr
        assert "compared 26 logical tensors" in out and "verify OK: all logical tensors equal" in out, out
        info = json.loads(ok(run_cli("inspect", str(src19.torch_dist), "--json", nproc=2, runtime=runtime)).stdout)
        assert (info["format"], info["iteration"], info["layout"]["tp"], info["config"]["spec"]) == \
            ("torch_dist", 100, 2, "local")  # local: no core_attention._extra_state in the keys


# (name, world, runtime of the CLI, source, flags, style written, oracle runtime, oracle tp, pp)
CASES = [
    ("019_kept_tp1_pp2", 2, "default", "src19", ["--target-tp", "1", "--target-pp", "2"], "0.19", "mcore19", 1, 2),
    ("019_to_016_tp4", 4, "default", "src19", ["--target-tp", "4", "--torch-dist-style", "0.16"], "0.16",
     "default", 4, 1),
    ("016_under_mcore19", 2, "mcore19", "gpt_a", ["--target-tp", "1", "--target-pp", "1"], "0.16", "mcore19", 1, 1),
    ("016_to_019_under_mcore19", 2, "mcore19", "gpt_a", ["--target-tp", "4", "--target-pp", "1",
                                                           "--torch-dist-style", "0.19"], "0.19", "mcore19", 4, 1),
    ("019_to_megatron_under_mcore19", 2, "mcore19", "src19", ["--dst-format", "megatron", "--target-pp", "2"], None,
     "default", 2, 2),
]


@pytest.mark.parametrize("name,world,runtime,src,flags,style,judge,tp,pp", CASES, ids=[c[0] for c in CASES])
def test_reshard_between_releases(request, tmp_path, gpt_a, name, world, runtime, src, flags, style, judge, tp, pp):
    """Each target loads strictly in megatron-core (``judge``) and equals gpt_a. TP=4 holds 2 query groups
    (TP a multiple of the groups, as megatron-core allows)."""
    source = request.getfixturevalue(src)
    dst = tmp_path / "dst"
    ok(run_cli("reshard", str(source.torch_dist), str(dst), *flags, nproc=world, runtime=runtime))
    if style is not None:
        assert style_of(dst) == style
    oracle("compare", tp * pp, "--config", str(gpt_a.config), "--tp", str(tp), "--pp", str(pp), "--ckpt", str(dst),
           "--ref", str(gpt_a.torch_dist), "--check-args", runtime=judge)
    if style == "0.19":  # megatron-core 0.16 cannot read the 0.19 style (what --torch-dist-style 0.16 is for)
        proc = oracle("compare", tp * pp, "--config", str(gpt_a.config), "--tp", str(tp), "--pp", str(pp),
                      "--ckpt", str(dst), "--ref", str(gpt_a.torch_dist), check=False)
        assert proc.returncode != 0 and "common.pt" in proc.stdout + proc.stderr


def test_tp_a_multiple_of_the_query_groups_runs_in_megatron_core(tmp_path, gpt_a):
    """TP=4 over 2 query groups: each rank holds a contiguous quarter of the group-major QKV rows. The
    logits megatron-core computes from it (attention all-gathers the groups) equal those at TP=2."""
    dst = tmp_path / "tp4"
    ok(run_cli("reshard", str(gpt_a.torch_dist), str(dst), "--dst-format", "megatron", "--target-tp", "4",
               "--target-pp", "1", nproc=4))
    logits = {}
    for tp, ckpt in ((4, dst), (2, gpt_a.torch_dist)):
        out = tmp_path / f"logits{tp}.pt"
        oracle("logits", tp, "--config", str(gpt_a.config), "--tp", str(tp), "--ckpt", str(ckpt), "--out", str(out))
        logits[tp] = torch.load(out)["logits"]
    assert logits[2].std() > 0.5
    torch.testing.assert_close(logits[4], logits[2], rtol=1e-5, atol=1e-5)


def _replace_common(iter_dir, payload: bytes) -> None:
    """Point the checkpoint's common_state item at ``payload`` (a new .distcp file), as a save would store it."""
    (iter_dir / "__9_0.distcp").write_bytes(payload)
    md = as_dcp(load_metadata(iter_dir))  # the 2.15 save's metadata as this torch's DCP objects
    md.storage_data[MetadataIndex(ITEM)] = _StorageInfo("__9_0.distcp", 0, len(payload))
    with open(iter_dir / ".metadata", "wb") as fh:
        pickle.dump(md, fh)


def _blob(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


BAD = [
    ("unfinished", lambda d: (d / "metadata.json").unlink(), ["no metadata.json", "never finished",
                                                               "latest_checkpointed_iteration.txt"]),
    ("not_a_dict", lambda d: _replace_common(d, _blob(["args"])), ["common state", "is a str, not a dict"]),
    ("no_common", lambda d: _replace_common(d, _blob([{"iteration": 3}])), ["holds no args"]),
]


@pytest.mark.parametrize("name,damage,needles", BAD, ids=[b[0] for b in BAD])
def test_damaged_019_checkpoints_are_refused(src19, tmp_path, name, damage, needles):
    src = tmp_path / "src"
    shutil.copytree(src19.torch_dist, src)
    damage(it(src))
    assert_refused(run_cli("reshard", str(it(src)), str(tmp_path / "dst"), "--target-tp", "1", nproc=2), tmp_path,
                   *needles)


def test_mcore_style_needs_a_megatron_core_target(src19, tmp_path):
    assert_refused(run_cli("reshard", str(src19.torch_dist), str(tmp_path / "dst"), "--dst-format", "hf",
                           "--torch-dist-style", "0.19", nproc=2), tmp_path, "--mcore-style",
                   "--dst-format torch_dist / megatron")


def test_speculate_under_mcore19(src19, tmp_path):
    """EAGLE-3 added by ModelOpt 0.47 on megatron-core 0.19.2, saved as 0.19 saves (no common.pt), restored
    there by megatron-core + ModelOpt: base weights equal, draft weights real, a forward pass with draft tokens."""
    dst = tmp_path / "spec"
    ok(run_cli("speculate", str(src19.torch_dist), str(dst), "--eagle-layers", "1", nproc=2, runtime="mcore19"))
    assert style_of(dst) == "0.19"
    assert "draft tokens" in spec_oracle(src19, dst, 2, 1, "eagle", runtime="mcore19")


def test_layer_spec_comes_from_the_stored_keys():
    """torch_dist keys are the same for both specs but for Transformer Engine attention's own _extra_state."""
    from dist_convert.formats.dist_keys import spec_from_keys

    layer = "decoder.layers.self_attention"
    assert spec_from_keys([f"{layer}.core_attention._extra_state/shard_0_4", f"{layer}.linear_qkv.weight"]) == "te"
    assert spec_from_keys([f"{layer}.linear_qkv._extra_state/shard_0_4", f"{layer}.linear_qkv.weight"]) == "local"
    assert spec_from_keys([f"{layer}.linear_qkv.weight"]) is None  # no evidence: args.transformer_impl decides
