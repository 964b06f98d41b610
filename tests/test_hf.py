"""Hugging Face import and export under torchrun (gloo), judged by transformers and megatron-core:
megatron-core logits of an imported checkpoint equal the transformers logits of the HF model, and
HF -> megatron-core -> HF gives back every tensor bit for bit, loadable by ``from_pretrained``."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from conftest import assert_refused, ok, oracle, run_cli
from hf_models import assert_bit_exact, hf_logits, make_hf_model, oracle_config


@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hf")
    for name in ("llama", "llama32", "mistral", "qwen2", "qwen3"):
        make_hf_model(root, name)
    return root


def tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            out.update({k: fh.get_tensor(k) for k in fh.keys()})
    return out


# (family, dst format, target tp, world size or None = one process without torchrun).
# The oracle builds megatron-core's local layer spec (no Transformer Engine on CPU), hence
# --target-spec local; imports default to TE naming, what GPU training loads.
LOGITS = [
    ("llama", "torch_dist", 4, 4),  # GQA, untied; TP=4 over 2 query groups (a rank holds half a group)
    ("llama32", "megatron", 1, None),  # tied, Llama-3 RoPE scaling
    ("qwen2", "torch_dist", 2, 4),  # qkv bias, MHA; more ranks than target files
    ("qwen3", "megatron", 2, 2),  # q/k norm, head_dim 32 != hidden/heads
]


@pytest.mark.parametrize("name,fmt,tp,world", LOGITS, ids=[f"{c[0]}-{c[1]}-tp{c[2]}-w{c[3]}" for c in LOGITS])
def test_import_gives_transformers_logits_in_megatron_core(hf_dir, tmp_path, name, fmt, tp, world):
    src, dst = hf_dir / name, tmp_path / "mcore"
    ok(run_cli("reshard", str(src), str(dst), "--target-tp", str(tp), "--dst-format", fmt, "--target-spec", "local",
               nproc=world))
    config = tmp_path / "oracle.json"
    config.write_text(json.dumps(oracle_config(src)))
    res = oracle("compare", tp, "--config", str(config), "--tp", str(tp), "--ckpt", str(dst), "--ref", str(dst),
                 "--check-args")  # strict load at the target layout; stored args describe the model
    assert "ORACLE OK" in res.stdout
    out = tmp_path / "logits.pt"
    oracle("logits", tp, "--config", str(config), "--tp", str(tp), "--ckpt", str(dst), "--out", str(out))
    got = torch.load(out)
    want = hf_logits(src, got["tokens"])
    assert want.std() > 0.5  # O(1) logits: the comparison below is not vacuous
    torch.testing.assert_close(got["logits"], want, rtol=1e-5, atol=1e-5)


# (family, mcore format, tp, pp, world there, world back, extra flags for the export)
ROUND_TRIPS = [
    ("mistral", "megatron", 2, 2, 4, 1, []),  # MQA at TP=2 (TP a multiple of the 1 group), two stages; export
    # from one torchrun rank
    ("llama", "torch_dist", 2, 2, 4, 2, ["--max-shard-size", "100KB"]),  # sharded export, each rank its files
    ("llama32", "torch_dist", 1, 2, 2, 4, []),  # tied embedding copy on the last stage; 4 ranks, 1 file
]


@pytest.mark.parametrize("name,fmt,tp,pp,w1,w2,extra", ROUND_TRIPS,
                         ids=[f"{c[0]}-{c[1]}-tp{c[2]}pp{c[3]}" for c in ROUND_TRIPS])
def test_hf_to_mcore_to_hf_is_byte_identical(hf_dir, tmp_path, name, fmt, tp, pp, w1, w2, extra):
    src, mid, back = hf_dir / name, tmp_path / "mcore", tmp_path / "hf"
    ok(run_cli("reshard", str(src), str(mid), "--target-tp", str(tp), "--target-pp", str(pp), "--dst-format", fmt,
               nproc=w1))
    ok(run_cli("reshard", str(mid), str(back), "--dst-format", "hf", *extra, nproc=w2))
    a, b = tensors(src), tensors(back)
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    cfg_a, cfg_b = (json.loads((p / "config.json").read_text()) for p in (src, back))
    # config.json key for key: none dropped, none changed; added only the dtype under transformers 4's name too
    # (docs/formats.md: restated keys), with the same value
    assert {k: cfg_b.get(k) for k in cfg_a if k != "transformers_version"} == \
        {k: v for k, v in cfg_a.items() if k != "transformers_version"}
    added = {k: v for k, v in cfg_b.items() if k not in cfg_a}
    assert set(added) <= {"torch_dtype", "dtype"}
    assert set(added.values()) <= {cfg_a.get("dtype"), cfg_a.get("torch_dtype")}
    assert (back / "tokenizer_config.json").read_text() == (src / "tokenizer_config.json").read_text()
    shards = sorted(back.glob("*.safetensors"))
    if extra:  # several shards, an index naming every tensor, each shard near the size limit
        assert len(shards) > 2
        index = json.loads((back / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == set(a) and set(index["weight_map"].values()) == {s.name for s in shards}
        assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in a.values())
    else:
        assert [s.name for s in shards] == ["model.safetensors"]
    import transformers

    model, info = transformers.AutoModelForCausalLM.from_pretrained(back, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert type(model).__name__ == cfg_a["architectures"][0]


def test_a_tied_release_storing_its_head_gets_it_back(tmp_path):
    """A tied model whose release stores lm_head.weight as a copy of the embedding (transformers' save_pretrained does
    not; some releases do) comes back from HF -> torch_dist -> HF with the copy; one without it, without."""
    from safetensors.torch import load_file, save_file

    src = make_hf_model(tmp_path / "src", "llama32")
    weights = load_file(src / "model.safetensors")
    save_file({**weights, "lm_head.weight": weights["model.embed_tokens.weight"].clone()}, src / "model.safetensors",
              metadata={"format": "pt"})
    mid, back = tmp_path / "td", tmp_path / "back"
    ok(run_cli("reshard", str(src), str(mid), "--target-tp", "2", "--dst-format", "torch_dist"))
    ok(run_cli("reshard", str(mid), str(back), "--dst-format", "hf"))
    assert "lm_head.weight" in assert_bit_exact(src, back)


def test_hf_to_torch_dist_to_hf_writes_the_source_config_back_after_it_is_gone(tmp_path):
    """The HF config.json travels in the torch_dist target (its origin record, not a path): moved, with the HF
    source deleted, the export writes the very same config.json; the tokenizer directory the record names is
    gone, which a note says."""
    src = make_hf_model(tmp_path / "src", "llama32")
    want = json.loads((src / "config.json").read_text())
    mid = tmp_path / "mcore"
    ok(run_cli("reshard", str(src), str(mid), "--target-tp", "2", "--dst-format", "torch_dist", nproc=2))
    moved = tmp_path / "elsewhere" / "mcore"
    moved.parent.mkdir()
    mid.rename(moved)
    shutil.rmtree(tmp_path / "src")
    back = tmp_path / "hf"
    proc = ok(run_cli("reshard", str(moved), str(back), "--dst-format", "hf", nproc=2))
    got = json.loads((back / "config.json").read_text())
    # every key of the source's, as it was; the export adds only transformers 4's name of the dtype
    assert {k: got[k] for k in want} == want and set(got) - set(want) <= {"torch_dtype"}, got
    assert "tokenizer directory the source came from" in proc.stderr, proc.stderr[-2000:]
    assert not (back / "tokenizer_config.json").exists()


def test_verify_and_inspect_across_formats(hf_dir, tmp_path):
    src, dst = hf_dir / "qwen3", tmp_path / "mcore"
    ok(run_cli("reshard", str(src), str(dst), "--target-tp", "2", "--target-pp", "2", "--dst-format", "torch_dist",
               nproc=2))
    proc = ok(run_cli("verify", str(src), str(dst), nproc=2))
    assert "verify OK" in proc.stderr
    info = json.loads(ok(run_cli("inspect", str(src), "--json")).stdout)
    assert info["format"] == "hf" and info["config"]["qk_layernorm"] and info["config"]["kv_channels"] == 32


def test_export_casts_and_megatron_model_without_hf_config(gpt_a, tmp_path):
    """A model trained in megatron-core (no HF config in its args) exports as Llama; --dtype bf16 casts."""
    dst = tmp_path / "hf"
    ok(run_cli("reshard", str(gpt_a.torch_dist), str(dst), "--dst-format", "hf", "--dtype", "bf16", nproc=2))
    cfg = json.loads((dst / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["vocab_size"] == gpt_a.cfg["vocab_size"]
    assert cfg["tie_word_embeddings"] and cfg["torch_dtype"] == "bfloat16"
    assert all(t.dtype == torch.bfloat16 for t in tensors(dst).values())
    ok(run_cli("verify", str(gpt_a.megatron), str(dst), "--atol", "1e-2", "--rtol", "1e-2", nproc=2))
    import transformers

    _, info = transformers.AutoModelForCausalLM.from_pretrained(dst, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info


def _edit_config(**changes):
    def fn(d: Path) -> None:
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(changes)
        (d / "config.json").write_text(json.dumps(cfg))
    return fn


def _clobber(name: str, keep: int, junk: bytes = b""):
    def fn(d: Path) -> None:
        data = (d / name).read_bytes()
        (d / name).write_bytes(data[:keep] + junk + data[keep + len(junk):] if junk else data[:keep])
    return fn


HF_DAMAGE = {
    "missing shard": (lambda d: (d / "model-00002-of-00004.safetensors").unlink(),
                      ["names shard model-00002-of-00004.safetensors, which is missing"]),
    "corrupt header": (_clobber("model-00001-of-00004.safetensors", 8, b"\x00garbage{"),
                       ["corrupt safetensors header"]),
    "truncated shard": (_clobber("model-00003-of-00004.safetensors", 5000), ["data section holds", "truncated"]),
    "unsupported architecture": (_edit_config(architectures=["GPT2LMHeadModel"]),
                                 ["GPT2LMHeadModel", "supported architectures: LlamaForCausalLM"]),
    "config and weights disagree": (_edit_config(intermediate_size=128),
                                    ["gate_proj.weight has shape (96, 64) but config.json implies (128, 64)"]),
}


@pytest.mark.parametrize("what", list(HF_DAMAGE))
def test_damaged_hf_source_is_refused(tmp_path, what):
    src = make_hf_model(tmp_path / "src", "llama", max_shard_size="100KB")
    assert (src / "model-00004-of-00004.safetensors").is_file()
    fn, needles = HF_DAMAGE[what]
    fn(src)
    assert_refused(run_cli("reshard", str(src), str(tmp_path / "dst"), "--dst-format", "torch_dist"), tmp_path,
                   *needles)


def test_hf_target_refusals(gpt_b, hf_dir, tmp_path):
    assert_refused(run_cli("reshard", str(gpt_b.torch_dist), str(tmp_path / "dst"), "--dst-format", "hf"), tmp_path,
                   "LayerNorm", "none of the supported Hugging Face families")
    assert_refused(run_cli("reshard", str(hf_dir / "llama"), str(tmp_path / "dst"), "--dst-format", "hf",
                           "--target-tp", "2"), tmp_path, "TP/PP/EP do not apply", "--target-tp")


def test_hf_to_hf_recast_and_reshard_and_a_stored_tied_head(hf_dir, tmp_path):
    """hf -> hf changes dtype and shard size only; a tied model that also stores lm_head (some
    exporters write both) imports with the copy read as a replica of the embedding."""
    out = tmp_path / "bf16"
    ok(run_cli("reshard", str(hf_dir / "qwen2"), str(out), "--dtype", "bf16", "--max-shard-size", "50KB"))
    a, b = tensors(hf_dir / "qwen2"), tensors(out)
    assert set(a) == set(b) and all(torch.equal(a[k].to(torch.bfloat16), b[k]) for k in a)
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 2
    from safetensors.torch import save_file

    both = tmp_path / "both"
    shutil.copytree(hf_dir / "llama32", both)
    stored = tensors(both)
    stored["lm_head.weight"] = stored["model.embed_tokens.weight"].clone()
    save_file(stored, str(both / "model.safetensors"), metadata={"format": "pt"})
    ok(run_cli("verify", str(both), str(hf_dir / "llama32")))
