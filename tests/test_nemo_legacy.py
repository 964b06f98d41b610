"""Legacy NeMo Megatron GPT .nemo archives (``mcore_gpt: false``): built here from megatron-core's own rank
files by renaming keys with the table below (NeMo's mcore <-> legacy key map) and, for ``megatron_legacy:
true``, permuting QKV rows the way NeMo's attention undoes it; converted by the CLI; judged by megatron-core
(tests/oracles/mcore.py) or compared tensor by tensor with this file's translation of megatron-core's own
state dict at the target layout (megatron-core reshards the reference on load)."""
from __future__ import annotations

import argparse
import tarfile
from pathlib import Path

import pytest
import torch
import yaml

from dist_convert.datamodel import Target
from dist_convert.errors import ConvertError
from dist_convert.formats.nemo_legacy import nemo_target_files, source_style
from dist_convert.layout.topology import Layout

from conftest import Source, assert_refused, make_gpt, ok, oracle, run_cli
from flat_config import flat_config, with_flat

ITER = "iter_0000100"
TOKENIZER = "legacy_tokenizer.model"
INV_FREQ = "model.language_model.rotary_pos_emb.inv_freq"
# Legacy NeMo GPT has neither grouped-query attention nor q/k layernorm. L: GeLU, LayerNorm with biases,
# untied output layer, learned positions. S: SwiGLU, RMSNorm, no biases, tied embeddings, RoPE.
CONFIGS = {
    "L": {"num_layers": 4, "hidden_size": 48, "ffn_hidden_size": 64, "num_attention_heads": 4,
          "num_query_groups": 4, "swiglu": False, "normalization": "LayerNorm", "add_bias_linear": True,
          "add_qkv_bias": True, "untie_embeddings_and_output_weights": True, "vocab_size": 90,
          "make_vocab_size_divisible_by": 8, "position_embedding_type": "learned_absolute",
          "max_position_embeddings": 32, "seq_length": 32},
    "S": {"num_layers": 4, "hidden_size": 64, "ffn_hidden_size": 96, "num_attention_heads": 4,
          "num_query_groups": 4, "swiglu": True, "normalization": "RMSNorm", "add_bias_linear": False,
          "add_qkv_bias": False, "untie_embeddings_and_output_weights": False, "vocab_size": 100,
          "make_vocab_size_divisible_by": 16, "position_embedding_type": "rope", "max_position_embeddings": 32,
          "seq_length": 32},
}
# megatron-core (local spec) -> legacy NeMo, after build_key_mapping in NeMo's
# scripts/checkpoint_converters/convert_gpt_nemo_to_mcore.py (which writes the TE names
# linear_qkv.layer_norm_* / linear_fc1.layer_norm_* for input_layernorm / post_attention_layernorm)
TOP = {"embedding.word_embeddings.": "language_model.embedding.word_embeddings.",
       "embedding.position_embeddings.": "language_model.embedding.position_embeddings.",
       "decoder.final_layernorm.": "language_model.encoder.final_layernorm.",
       "decoder.layers.": "language_model.encoder.layers.",
       "output_layer.": "language_model.output_layer."}
LAYER = {".self_attention.linear_qkv.": ".self_attention.query_key_value.",
         ".self_attention.linear_proj.": ".self_attention.dense.", ".pre_mlp_layernorm.": ".post_attention_layernorm.",
         ".mlp.linear_fc1.": ".mlp.dense_h_to_4h.", ".mlp.linear_fc2.": ".mlp.dense_4h_to_h."}


def to_megatron_legacy(w: torch.Tensor, heads: int) -> torch.Tensor:
    """megatron-core QKV rows of one TP rank ([heads, 3, head_dim]) in megatron_legacy order ([3, heads, head_dim])."""
    return w.reshape(heads, 3, -1, *w.shape[1:]).transpose(0, 1).reshape(w.shape)


def nemo_transpose_last_dim(mixed: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """NeMo's ParallelAttention._transpose_last_dim(mixed, 3, True) (megatron_legacy): [.., 3*np*hn] viewed as
    [.., 3, np, hn], the last-but-two axes swapped, viewed back."""
    shape = mixed.shape
    return mixed.view(*shape[:-1], 3, heads, head_dim).transpose(-2, -3).contiguous().view(*shape)


def to_legacy(sd: dict, cfg: dict, tp: int, megatron_legacy: bool, split_glu: bool, extra_state: bool) -> dict:
    """A megatron-core rank state dict in legacy NeMo keys (``model.`` prefixed)."""
    tied = not cfg["untie_embeddings_and_output_weights"]
    out = {}
    for k, v in sd.items():
        if k.endswith("_extra_state") and (not extra_state or k.startswith("output_layer.")):
            continue
        if tied and k == "output_layer.weight":  # the last stage's copy of the tied embedding (PP > 1)
            out["model.word_embeddings.weight"] = v
            continue
        name = next(new + k[len(old):] for old, new in TOP.items() if k.startswith(old))
        for old, new in LAYER.items():
            name = name.replace(old, new)
        name = "model." + name
        if megatron_legacy and ".query_key_value." in name and isinstance(v, torch.Tensor):
            v = to_megatron_legacy(v, cfg["num_attention_heads"] // tp)
        if split_glu and ".dense_h_to_4h." in name and isinstance(v, torch.Tensor):
            out[name], out[name.replace(".dense_h_to_4h.", ".dense_h_to_4h_2.")] = v.chunk(2, dim=0)
            continue
        out[name] = v
    if cfg["position_embedding_type"] == "rope":  # NeMo's RotaryEmbedding buffer, on every stage
        d = cfg["hidden_size"] // cfg["num_attention_heads"]
        out[INV_FREQ] = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    return out


def legacy_yaml(cfg: dict, tp: int, pp: int, megatron_legacy: bool, activation: str) -> dict:
    return {"mcore_gpt": False, "megatron_legacy": megatron_legacy, "transformer_engine": False,
            "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp, "num_layers": cfg["num_layers"],
            "hidden_size": cfg["hidden_size"], "ffn_hidden_size": cfg["ffn_hidden_size"],
            "num_attention_heads": cfg["num_attention_heads"], "activation": activation,
            "normalization": cfg["normalization"].lower(), "bias": cfg["add_bias_linear"],
            "share_embeddings_and_output_weights": not cfg["untie_embeddings_and_output_weights"],
            "position_embedding_type": cfg["position_embedding_type"],
            "make_vocab_size_divisible_by": cfg["make_vocab_size_divisible_by"],
            "max_position_embeddings": cfg["max_position_embeddings"], "encoder_seq_length": cfg["seq_length"],
            "precision": 32, "tokenizer": {"library": "sentencepiece", "model": f"nemo:{TOKENIZER}"}}


@pytest.fixture(scope="module")
def gpt_l(tmp_path_factory) -> Source:
    return make_gpt(tmp_path_factory.mktemp("legacy_src"), "L", CONFIGS["L"], 2, 1)


@pytest.fixture(scope="module")
def gpt_s(tmp_path_factory) -> Source:
    return make_gpt(tmp_path_factory.mktemp("legacy_src"), "S", CONFIGS["S"], 1, 2)


@pytest.fixture(scope="module")
def s_reference(gpt_s, tmp_path_factory) -> dict[tuple[int, int], dict]:
    """megatron-core's own state dicts of S at TP=2 PP=1."""
    return mcore_reference(gpt_s, tmp_path_factory.mktemp("s_ref"), 2, 1)


def make_legacy_nemo(src: Source, root: Path, megatron_legacy: bool, activation: str, archive: bool = True,
                     yaml_changes: dict | None = None) -> Path:
    """A legacy .nemo of ``src`` from megatron-core's rank files (tar or extracted directory)."""
    d = root / "extracted"
    split = activation in ("swiglu", "geglu", "reglu")
    for f in sorted((src.megatron / ITER).glob("mp_rank_*/model_optim_rng.pt")):
        t, p = int(f.parent.name.split("_")[2]), int((f.parent.name.split("_")[3:] or [0])[0])
        sd = to_legacy(torch.load(f, weights_only=False)["model"], src.cfg, src.tp, megatron_legacy, split, True)
        out = d / rank_file(t, p, src.tp, src.pp)
        out.parent.mkdir(parents=True)
        torch.save(sd, out)
    y = {**legacy_yaml(src.cfg, src.tp, src.pp, megatron_legacy, activation), **(yaml_changes or {})}
    (d / "model_config.yaml").write_text(yaml.safe_dump(y))
    (d / TOKENIZER).write_bytes(b"legacy tokenizer bytes")
    if not archive:
        return d
    path = root / "model.nemo"
    with tarfile.open(path, "w:") as tar:
        tar.add(d, arcname=".")
    return path


def mcore_reference(src: Source, tmp: Path, tp: int, pp: int) -> dict[tuple[int, int], dict]:
    """megatron-core's own state dicts of ``src`` at (tp, pp): built there, torch_dist loaded (megatron-core
    reshards it), per rank."""
    oracle("dump", tp * pp, "--config", str(src.config), "--tp", str(tp), "--pp", str(pp), "--ckpt",
           str(src.torch_dist), "--ckpt-format", "torch_dist", "--out", str(tmp))
    return {(t, p): torch.load(tmp / f"ref_{t}_{p}.pt", weights_only=False) for t in range(tp) for p in range(pp)}


def rank_file(t: int, p: int, tp: int, pp: int) -> str:
    """NeMo's name of a rank's weights in a .nemo (NLPSaveRestoreConnector)."""
    if pp > 1:
        return f"tp_rank_{t:02d}_pp_rank_{p:03d}/model_weights.ckpt"
    return f"mp_rank_{t:02d}/model_weights.ckpt" if tp > 1 else "model_weights.ckpt"


def unpack(nemo: Path, tp: int, pp: int) -> tuple[dict, dict[tuple[int, int], dict]]:
    """model_config.yaml and rank state dicts of a .nemo tar."""
    with tarfile.open(nemo) as tar:
        names = {m.name.removeprefix("./"): m for m in tar.getmembers() if m.isfile()}
        assert tar.extractfile(names[TOKENIZER]).read() == b"legacy tokenizer bytes"
        config = yaml.safe_load(tar.extractfile(names["model_config.yaml"]).read())
        files = {}
        for t in range(tp):
            for p in range(pp):
                files[(t, p)] = torch.load(tar.extractfile(names[rank_file(t, p, tp, pp)]), weights_only=False)
    return config, files


def vocab_rows(cfg: dict, tp: int, t: int) -> int:
    """Rows of TP rank t's vocabulary slice inside the true vocabulary (the rest is padding)."""
    multiple = cfg["make_vocab_size_divisible_by"] * tp
    per = -(-cfg["vocab_size"] // multiple) * multiple // tp
    return max(0, min(per, cfg["vocab_size"] - t * per))


def assert_same(got: dict, want: dict, vocab: int, where: str) -> None:
    """Same keys, bit-equal tensors (``vocab``: this rank's rows of the true vocabulary; the rest is padding)."""
    got = {k: v for k, v in got.items() if not k.endswith("_extra_state")}
    assert sorted(got) == sorted(want), (where, sorted(set(got) ^ set(want)))
    for k, w in want.items():
        g = got[k]
        assert g.shape == w.shape, (where, k, g.shape, w.shape)
        if "word_embeddings" in k or "output_layer" in k:
            g, w = g[:vocab], w[:vocab]
        assert torch.equal(g, w), (where, k)


def test_test_permutation_is_what_nemo_undoes():
    """Pure: NeMo's megatron_legacy forward turns this file's stored QKV rows back into megatron-core's."""
    heads, hn, hidden = 3, 4, 5
    w = torch.randn(heads * 3 * hn, hidden)
    x = torch.randn(2, 7, hidden)
    assert torch.equal(nemo_transpose_last_dim(x @ to_megatron_legacy(w, heads).T, heads, hn), x @ w.T)
    assert not torch.equal(to_megatron_legacy(w, heads), w)


def test_megatron_legacy_nemo_to_torch_dist_loads_in_megatron_core(gpt_l, tmp_path):
    nemo = make_legacy_nemo(gpt_l, tmp_path, megatron_legacy=True, activation="gelu")
    dst = tmp_path / "td"
    ok(run_cli("reshard", str(nemo), str(dst), "--target-tp", "1", "--target-pp", "1", "--dst-format", "torch_dist",
               "--vocab-size", "90", nproc=2))
    res = oracle("compare", 1, "--config", str(gpt_l.config), "--tp", "1", "--pp", "1", "--ckpt", str(dst),
                 "--ref", str(gpt_l.torch_dist))
    assert "ORACLE OK" in res.stdout


def test_legacy_nemo_directory_verifies_equal_to_megatron_core_source(gpt_l, tmp_path):
    extracted = make_legacy_nemo(gpt_l, tmp_path, megatron_legacy=False, activation="gelu", archive=False)
    ok(run_cli("verify", str(extracted), str(gpt_l.megatron), "--vocab-size", "90"))


def test_legacy_nemo_to_legacy_nemo_at_tp2_keeps_style(gpt_s, s_reference, tmp_path):
    """megatron_legacy QKV, split SwiGLU (dense_h_to_4h_2), the tied copy on the source's last stage, rotary
    inv_freq: TP=1 PP=2 -> TP=2 PP=1."""
    nemo = make_legacy_nemo(gpt_s, tmp_path, megatron_legacy=True, activation="swiglu")
    dst = tmp_path / "out.nemo"
    ok(run_cli("reshard", str(nemo), str(dst), "--target-tp", "2", "--target-pp", "1", "--vocab-size", "100",
               nproc=2))
    config, files = unpack(dst, 2, 1)
    assert (config["mcore_gpt"], config["megatron_legacy"], config["activation"]) == (False, True, "swiglu")
    assert (config["tensor_model_parallel_size"], config["pipeline_model_parallel_size"]) == (2, 1)
    for c, sd in s_reference.items():
        assert_same(files[c], to_legacy(sd, gpt_s.cfg, 2, True, True, False), vocab_rows(gpt_s.cfg, 2, c[0]),
                    f"rank {c}")
    assert INV_FREQ in files[(1, 0)] and "model.language_model.encoder.layers.3.mlp.dense_h_to_4h_2.weight" in \
        files[(1, 0)]


def test_mcore_source_to_megatron_legacy_nemo_without_torchrun(gpt_s, s_reference, tmp_path):
    """--nemo-style from a megatron-core checkpoint: fused fast-swiglu dense_h_to_4h, one process."""
    dst = tmp_path / "out.nemo"
    ok(run_cli("reshard", str(gpt_s.megatron), str(dst), "--dst-format", "nemo", "--nemo-style", "megatron_legacy",
               "--target-tp", "2", "--target-pp", "1", "--tokenizer-model", str(_tokenizer(tmp_path))))
    config, files = unpack(dst, 2, 1)
    assert (config["mcore_gpt"], config["megatron_legacy"], config["transformer_engine"]) == (False, True, False)
    assert config["activation"] == "fast-swiglu"
    for c, sd in s_reference.items():
        assert_same(files[c], to_legacy(sd, gpt_s.cfg, 2, True, False, False), vocab_rows(gpt_s.cfg, 2, c[0]),
                    f"rank {c}")


def _tokenizer(tmp_path: Path) -> Path:
    path = tmp_path / TOKENIZER
    path.write_bytes(b"legacy tokenizer bytes")
    return path


def _add_unknown_key(d: Path) -> None:
    f = d / rank_file(0, 0, 2, 1)
    sd = torch.load(f, weights_only=False)
    sd["model.language_model.encoder.layers.0.self_attention.head_scale_tensor"] = torch.ones(1, 2, 1, 1)
    torch.save(sd, f)


@pytest.mark.parametrize("yaml_changes,damage,needles", [
    ({"num_query_groups": 2}, None, ["num_query_groups=2", "no grouped-query attention"]),
    ({}, _add_unknown_key, ["unexpected tensors", "head_scale_tensor"]),
])
def test_bad_legacy_nemo_is_refused(gpt_l, tmp_path, yaml_changes, damage, needles):
    extracted = make_legacy_nemo(gpt_l, tmp_path, megatron_legacy=True, activation="gelu", archive=False,
                                 yaml_changes=yaml_changes)
    if damage:
        damage(extracted)
    assert_refused(run_cli("reshard", str(extracted), str(tmp_path / "dst"), "--dst-format", "torch_dist",
                           "--vocab-size", "90"), tmp_path, *needles)


def test_legacy_target_refuses_uneven_stages_and_non_nemo_targets(gpt_l, tmp_path):
    assert_refused(run_cli("reshard", str(gpt_l.megatron), str(tmp_path / "dst"), "--dst-format", "nemo",
                           "--nemo-style", "legacy", "--target-pp", "2", "--target-num-layers-in-first-stage", "1"),
                   tmp_path, "splits layers evenly", "--nemo-style mcore")
    assert_refused(run_cli("reshard", str(gpt_l.megatron), str(tmp_path / "dst"), "--dst-format", "torch_dist",
                           "--nemo-style", "legacy"), tmp_path, "--nemo-style applies to .nemo targets")


@pytest.mark.parametrize("changes,needles", [
    ({"transformer_engine": True}, ["transformer_engine: true", "not supported"]),
    ({"headscale": True}, ["headscale: true", "convert_gpt_nemo_to_mcore.py"]),
    ({"transformer_block_type": "post_ln"}, ["transformer_block_type: post_ln"]),
    ({"normalize_attention_scores": False}, ["normalize_attention_scores: false"]),
    ({"position_embedding_type": "alibi"}, ["position_embedding_type: alibi"]),
    ({"mcore_gpt": True}, ["mcore_gpt: true", "legacy NeMo keys", "set mcore_gpt: false"]),
])
def test_unsupported_legacy_configs_are_named(changes, needles):
    """Pure: what the reader refuses from model_config.yaml and the first rank file's keys."""
    y = {**legacy_yaml(CONFIGS["L"], 2, 1, True, "gelu"), **changes}
    with pytest.raises(ConvertError) as e:
        source_style(y, {"model.language_model.embedding.word_embeddings.weight": None})
    for n in needles:
        assert n in str(e.value)
    with pytest.raises(ConvertError, match="set mcore_gpt: true"):
        source_style({"mcore_gpt": False}, {"model.decoder.layers.0.mlp.linear_fc1.weight": None})


@pytest.mark.parametrize("change,needle", [
    ({"num_query_groups": 2}, "no grouped-query attention"),
    ({"qk_layernorm": True}, "no q/k layernorm"),
    ({"add_bias_linear": False}, "QKV bias exactly when"),
    ({"position_embedding_type": "none"}, "position_embedding_type=none"),
])
def test_legacy_target_refuses_models_legacy_nemo_cannot_hold(change, needle):
    """Pure: --nemo-style legacy/megatron_legacy targets of models legacy NeMo GPT has no keys for."""
    cfg = flat_config(num_layers=2, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4, num_query_groups=4,
                      kv_channels=8, swiglu=False, normalization="LayerNorm", add_bias_linear=True, add_qkv_bias=True,
                      untie_embeddings_and_output_weights=True, vocab_size=50, make_vocab_size_divisible_by=8,
                      position_embedding_type="learned_absolute", max_position_embeddings=16, qk_layernorm=False,
                      spec="local")
    fine = nemo_target_files(Target(cfg=cfg, layout=Layout(tp=2, pp=1), dtype=torch.float32,
                                    args=argparse.Namespace(), iteration="release"),
                             {}, lambda t, p, e: f"{t}_{p}", "megatron_legacy")
    assert len(fine) == 2 and "model.language_model.output_layer.weight" in [t.key for t in fine[0].tensors]
    target = Target(cfg=with_flat(cfg, **change), layout=Layout(tp=2, pp=1), dtype=torch.float32,
                    args=argparse.Namespace(), iteration="release")
    for style in ("legacy", "megatron_legacy"):
        with pytest.raises(ConvertError) as e:
            nemo_target_files(target, {}, lambda t, p, e: f"{t}_{p}", style)
        assert needle in str(e.value) and "--nemo-style mcore" in str(e.value)
