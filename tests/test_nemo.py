""".nemo archives of megatron-core GPT models: archives are built here from megatron-core's own rank
files (NeMo's documented layout, written with tarfile + torch only), converted by the CLI, and the
results judged by megatron-core (tests/oracles/mcore.py) after unpacking them the same independent way."""
from __future__ import annotations

import shutil
import tarfile
from pathlib import Path

import pytest
import torch
import yaml

from dist_convert.errors import ConvertError
from dist_convert.features import Llama3

from conftest import assert_refused, ok, oracle, run_cli

ITER = "iter_0000100"
TOKENIZER = "c0ffee_tokenizer.model"


def nemo_config(cfg: dict, tp: int, pp: int) -> dict:
    return {"mcore_gpt": True, "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
            "num_layers": cfg["num_layers"], "hidden_size": cfg["hidden_size"],
            "ffn_hidden_size": cfg["ffn_hidden_size"], "num_attention_heads": cfg["num_attention_heads"],
            "num_query_groups": cfg["num_query_groups"], "activation": "fast-swiglu", "normalization": "rmsnorm",
            "bias": False, "share_embeddings_and_output_weights": True, "position_embedding_type": "rope",
            "make_vocab_size_divisible_by": cfg["make_vocab_size_divisible_by"],
            "max_position_embeddings": cfg["max_position_embeddings"], "precision": "32",
            "tokenizer": {"library": "sentencepiece", "model": f"nemo:{TOKENIZER}"}}


def make_nemo(src, root: Path, archive: bool = True) -> Path:
    """A .nemo of source A (TP=2 PP=2) from megatron-core's legacy rank files."""
    d = root / "extracted"
    for f in sorted((src.megatron / ITER).glob("mp_rank_*/model_optim_rng.pt")):
        t, p = (int(x) for x in f.parent.name.split("_")[2:4])
        sd = {f"model.{k}": v for k, v in torch.load(f, weights_only=False)["model"].items()}
        out = d / f"tp_rank_{t:02d}_pp_rank_{p:03d}" / "model_weights.ckpt"
        out.parent.mkdir(parents=True)
        torch.save(sd, out)
    (d / "model_config.yaml").write_text(yaml.safe_dump(nemo_config(src.cfg, 2, 2)))
    (d / TOKENIZER).write_bytes(b"sentencepiece model bytes")
    if not archive:
        return d
    path = root / "model.nemo"
    with tarfile.open(path, "w:") as tar:
        tar.add(d, arcname=".")
    return path


def unpack_as_megatron(nemo: Path, out: Path, tp: int, pp: int) -> dict:
    """Rank files of a .nemo rewritten in Megatron-LM's legacy layout; returns its model_config.yaml."""
    with tarfile.open(nemo) as tar:
        names = {m.name.removeprefix("./"): m for m in tar.getmembers() if m.isfile()}
        config = yaml.safe_load(tar.extractfile(names["model_config.yaml"]).read())
        for t in range(tp):
            for p in range(pp):
                rel = f"tp_rank_{t:02d}_pp_rank_{p:03d}/model_weights.ckpt" if pp > 1 else \
                    (f"mp_rank_{t:02d}/model_weights.ckpt" if tp > 1 else "model_weights.ckpt")
                sd = torch.load(tar.extractfile(names[rel]), weights_only=False)
                assert all(k.startswith("model.") for k in sd)
                d = out / ITER / (f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}")
                d.mkdir(parents=True)
                torch.save({"model": {k[len("model."):]: v for k, v in sd.items()}}, d / "model_optim_rng.pt")
        assert TOKENIZER in names and tar.extractfile(names[TOKENIZER]).read() == b"sentencepiece model bytes"
    (out / "latest_checkpointed_iteration.txt").write_text("100")
    return config


def test_nemo_archive_to_torch_dist_loads_in_megatron_core(gpt_a, tmp_path):
    nemo = make_nemo(gpt_a, tmp_path)
    dst = tmp_path / "td"
    ok(run_cli("reshard", str(nemo), str(dst), "--target-tp", "1", "--target-pp", "1", "--dst-format", "torch_dist",
               "--vocab-size", "100", nproc=2))
    res = oracle("compare", 1, "--config", str(gpt_a.config), "--tp", "1", "--pp", "1", "--ckpt", str(dst),
                 "--ref", str(gpt_a.torch_dist))
    assert "ORACLE OK" in res.stdout


def test_nemo_to_nemo_relayout_keeps_tokenizer_and_updates_config(gpt_a, tmp_path):
    nemo = make_nemo(gpt_a, tmp_path)
    dst = tmp_path / "out.nemo"
    vocab = tmp_path / "new_vocab.json"
    vocab.write_text('{"a": 0}')
    ok(run_cli("reshard", str(nemo), str(dst), "--target-tp", "1", "--target-pp", "2", "--vocab-size", "100",
               "--tokenizer-vocab-file", str(vocab), nproc=2))
    assert dst.is_file() and not list(tmp_path.glob("*.dist_convert_tmp*"))
    config = unpack_as_megatron(dst, tmp_path / "unpacked", 1, 2)
    assert (config["tensor_model_parallel_size"], config["pipeline_model_parallel_size"]) == (1, 2)
    assert config["tokenizer"]["model"] == f"nemo:{TOKENIZER}"  # carried over
    assert config["tokenizer"]["vocab_file"] == "nemo:new_vocab.json"  # the override, inside the archive
    with tarfile.open(dst) as tar:
        assert tar.extractfile("./new_vocab.json").read() == b'{"a": 0}'

    res = oracle("compare", 2, "--config", str(gpt_a.config), "--tp", "1", "--pp", "2", "--ckpt",
                 str(tmp_path / "unpacked"), "--ckpt-format", "megatron", "--ref", str(gpt_a.torch_dist))
    assert "ORACLE OK" in res.stdout


def test_nemo_to_megatron_to_nemo_keeps_model_config_and_artifacts(gpt_a, tmp_path):
    """model_config.yaml travels in the legacy target's rank files (their origin record), moved with them:
    the .nemo written from it has the source's config (with the new layout) and its tokenizer artifact."""
    nemo = make_nemo(gpt_a, tmp_path)
    mid, moved = tmp_path / "mid", tmp_path / "elsewhere" / "mid"
    ok(run_cli("reshard", str(nemo), str(mid), "--target-tp", "1", "--target-pp", "1", "--dst-format", "megatron",
               "--vocab-size", "100", nproc=2))
    moved.parent.mkdir()
    mid.rename(moved)
    dst = tmp_path / "back.nemo"
    ok(run_cli("reshard", str(moved), str(dst), "--target-tp", "2", "--target-pp", "1", "--dst-format", "nemo",
               nproc=2))
    config = unpack_as_megatron(dst, tmp_path / "unpacked", 2, 1)  # checks the tokenizer artifact too
    want = nemo_config(gpt_a.cfg, 2, 1)
    assert {k: config[k] for k in want} == want, config  # precision and the tokenizer section: the source's


def test_extracted_nemo_directory_and_verify(gpt_a, tmp_path):
    extracted = make_nemo(gpt_a, tmp_path, archive=False)
    ok(run_cli("verify", str(extracted), str(gpt_a.megatron), "--vocab-size", "100", nproc=2))


@pytest.mark.parametrize("damage,needles", [
    (lambda d: (d / "model_config.yaml").unlink(), ["has no model_config.yaml"]),
    (lambda d: (d / "model_config.yaml").write_text(yaml.safe_dump({**yaml.safe_load(
        (d / "model_config.yaml").read_text()), "mcore_gpt": False})),
     ["not megatron-core based", "megatron-core keys", "set mcore_gpt: true"]),
    (lambda d: shutil.rmtree(d / "tp_rank_01_pp_rank_001"), ["tp_rank_01_pp_rank_001/model_weights.ckpt is missing"]),
    (lambda d: (d / "model_config.yaml").write_text(yaml.safe_dump({**yaml.safe_load(
        (d / "model_config.yaml").read_text()), "num_moe_experts": 4})),
     ["model_config.yaml describes Mixture-of-Experts layers", ".nemo sources are not read with yet"]),
])
def test_bad_nemo_is_refused(gpt_a, tmp_path, damage, needles):
    extracted = make_nemo(gpt_a, tmp_path, archive=False)
    damage(extracted)
    path = tmp_path / "bad.nemo"
    with tarfile.open(path, "w:") as tar:
        tar.add(extracted, arcname=".")
    assert_refused(run_cli("reshard", str(path), str(tmp_path / "dst"), "--dst-format", "torch_dist",
                           "--vocab-size", "100"), tmp_path, *needles)


def test_model_config_names_megatron_core_reads_are_carried_or_refused():
    """megatron-core names in a megatron-core model's model_config.yaml reach megatron-core as they stand (NeMo passes
    them on): carried; those dist_convert does not convert, and position embeddings megatron-core has not, refused.
    A legacy NeMo model reads none of them."""
    from dist_convert.formats.nemo import config_from_nemo

    y = {"num_layers": 2, "hidden_size": 8, "num_attention_heads": 2, "ffn_hidden_size": 16,
         "position_embedding_type": "rope", "window_size": [4, 0], "softmax_scale": 0.5,
         "seq_len_interpolation_factor": 2.0, "scale_positional_embedding": True}
    cfg = config_from_nemo(y, 128, 100)[0]
    assert (cfg.attention.window, cfg.attention.softmax_scale) == ((4, 0), 0.5)
    pos = cfg.position
    assert (pos.seq_len_interpolation, pos.scaling) == (2.0, Llama3(factor=8.0))
    assert config_from_nemo(y, 128, 100, legacy=True)[0].attention.window is None
    for bad, needle in (({"moe_latent_size": 4}, "moe_latent_size=4"), ({"position_embedding_type": "alibi"}, "alibi")):
        with pytest.raises(ConvertError, match=needle):
            config_from_nemo({**y, **bad}, 128, 100)

def test_nemo_without_transformer_engine_key_keeps_local_names(gpt_a, tmp_path):
    """NeMo reads an absent ``transformer_engine`` as False (local layer names): a .nemo without the key
    converts to a legacy target with local names and args, which megatron-core's local spec loads strictly."""
    from dist_convert.formats.nemo import config_from_nemo

    y = {"num_layers": 2, "hidden_size": 8, "num_attention_heads": 2, "ffn_hidden_size": 16}
    assert config_from_nemo(y, 128, 100)[1].transformer_impl == "local"
    assert config_from_nemo({**y, "transformer_engine": True}, 128, 100)[1].transformer_impl == "transformer_engine"
    nemo, extracted, dst = tmp_path / "a.nemo", tmp_path / "x", tmp_path / "dst"
    ok(run_cli("reshard", str(gpt_a.megatron), str(nemo), "--dst-format", "nemo", "--target-pp", "1", nproc=2))
    extracted.mkdir()
    with tarfile.open(nemo) as tar:
        tar.extractall(extracted, filter="data")
    config = yaml.safe_load((extracted / "model_config.yaml").read_text())
    config.pop("transformer_engine", None)
    (extracted / "model_config.yaml").write_text(yaml.safe_dump(config))
    ok(run_cli("reshard", str(extracted), str(dst), "--dst-format", "megatron", nproc=2))
    sd = torch.load(dst / "release" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
    assert "decoder.layers.0.input_layernorm.weight" in sd["model"] and sd["args"].transformer_impl == "local"
    assert not any("layer_norm_weight" in k or "core_attention" in k for k in sd["model"])
    oracle("compare", 2, "--config", str(gpt_a.config), "--tp", "2", "--pp", "1", "--ckpt", str(dst),
           "--ref", str(gpt_a.torch_dist))
