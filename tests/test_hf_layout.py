"""Pure tests of the hf format: the HF <-> megatron-core name and box table, config mapping, shard
packing, and that planning an HF import reads each rank's share only (no processes, no files)."""
from __future__ import annotations

import pytest
import torch

from dist_convert.config import ModelConfig
from dist_convert.cuts import split_chunks
from dist_convert.datamodel import SourceChunk, Target
from dist_convert.errors import ConvertError
from dist_convert.formats.hf import hf_tensors, pack_shards
from dist_convert.formats.megatron import MegatronFormat
from dist_convert.formats.torch_dist import TorchDistFormat
from dist_convert.layout.rules import logical_tensors
from dist_convert.layout.topology import Layout
from dist_convert.models import config_from_hf, hf_from_config
from dist_convert.plan import make_plan, select_source

from flat_config import with_flat


def hf_config(**over) -> dict:
    base = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1000, "hidden_size": 64,
            "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-5, "max_position_embeddings": 128, "tie_word_embeddings": False, "rope_theta": 1e4}
    return {**base, **over}


def test_qkv_and_gate_up_pieces_fuse_like_megatron_core():
    """Filling the fused tensors through the pieces equals megatron-core's layout built by hand:
    per query group its query heads, then one key head, then one value head; fc1 = [gate; up]."""
    cfg, _, _ = config_from_hf(hf_config(architectures=["Qwen2ForCausalLM"]), None)
    d, groups, per = cfg.kv_channels, cfg.num_query_groups, cfg.num_attention_heads // cfg.num_query_groups
    entries = hf_tensors(cfg)
    hf = {name: torch.randn(shape) for name, (shape, _) in entries.items()}
    fused = {n: torch.full(t.shape, float("nan")) for n, t in logical_tensors(cfg).items()}
    for name, (_, pieces) in entries.items():
        for p in pieces:
            fused[p.logical][p.lbox.slices()] = hf[name][p.sbox.slices()]
    for suffix in ("weight", "bias"):
        q, k, v = (hf[f"model.layers.1.self_attn.{x}_proj.{suffix}"] for x in "qkv")
        h = q.shape[1:]
        want = torch.cat([q.reshape(groups, per * d, *h), k.reshape(groups, d, *h), v.reshape(groups, d, *h)], 1)
        assert torch.equal(fused[f"decoder.layers.1.self_attention.linear_qkv.{suffix}"], want.reshape(-1, *h))
    gate, up = hf["model.layers.2.mlp.gate_proj.weight"], hf["model.layers.2.mlp.up_proj.weight"]
    assert torch.equal(fused["decoder.layers.2.mlp.linear_fc1.weight"], torch.cat([gate, up]))
    assert not any(t.isnan().any() for t in fused.values())  # every logical element is covered


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"])
@pytest.mark.parametrize("tied", [False, True])
def test_every_family_covers_each_logical_tensor_once(arch, tied):
    cfg, _, _ = config_from_hf(hf_config(architectures=[arch], tie_word_embeddings=tied), None)
    chunks = [SourceChunk(id=i, file="m.safetensors", key=n, shape=s, dtype=torch.float32, pieces=p)
              for i, (n, (s, p)) in enumerate(hf_tensors(cfg).items())]
    # raises on a gap or an overlap
    select_source(chunks, {n: torch.Size(t.shape).numel() for n, t in logical_tensors(cfg).items()})
    assert ("lm_head.weight" in hf_tensors(cfg)) is not tied


def test_config_round_trip_and_megatron_args():
    hf = hf_config(architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=32, tie_word_embeddings=True,
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    cfg, args, notes = config_from_hf(hf, None)
    assert (cfg.kv_channels, cfg.num_query_groups, cfg.attention.qk_norm, cfg.tied) == (32, 2, True, True)
    assert args.use_rope_scaling and args.rope_scaling_factor == 8.0 and args.norm_epsilon == 1e-5 and not notes
    back = hf_from_config(cfg, torch.bfloat16, base=hf)
    assert {k: back[k] for k in hf} == {**hf, "head_dim": 32}
    assert back["torch_dtype"] == "bfloat16"
    cfg, args, notes = config_from_hf(hf_config(rope_scaling={"rope_type": "yarn", "factor": 4.0}), None)
    assert (cfg.position.kind, args.position_embedding_type, args.rotary_scaling_factor) == ("yarn", "yarn", 4.0)
    assert not notes  # carried into megatron-core's YaRN, no longer kept only in the origin's config.json


def test_export_family_from_megatron_config_alone():
    cfg, args, _ = config_from_hf(hf_config(architectures=["Qwen2ForCausalLM"]), None)
    out = hf_from_config(cfg, torch.float32)  # no base: the HF config.json is not given
    assert out["architectures"] == ["Qwen2ForCausalLM"] and out["rope_theta"] == 1e4
    with pytest.raises(ConvertError, match="LayerNorm"):
        hf_from_config(with_flat(cfg, normalization="LayerNorm"), torch.float32)


@pytest.mark.parametrize("bad,match", [
    ({"architectures": ["GPT2LMHeadModel"]}, "supported architectures: LlamaForCausalLM"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
])
def test_unsupported_configs_are_refused(bad, match):
    with pytest.raises(ConvertError, match=match):
        config_from_hf(hf_config(**bad), None)


def test_pack_shards():
    sizes = [("a", 40), ("b", 40), ("c", 40), ("d", 200), ("e", 10)]
    assert pack_shards(sizes, 100) == [["a", "b"], ["c"], ["d"], ["e"]]
    assert pack_shards(sizes, 10**9) == [["a", "b", "c", "d", "e"]]


def _llama8b() -> ModelConfig:
    hf = hf_config(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                   num_attention_heads=32, num_key_value_heads=8)
    return config_from_hf(hf, None)


@pytest.mark.parametrize("fmt,tp,pp", [(MegatronFormat, 8, 1), (TorchDistFormat, 4, 2)])
def test_import_plan_reads_only_each_ranks_share(fmt, tp, pp):
    """Llama-3-8B-shaped import over 8 ranks: HF tensors are cut at the target pieces, each rank
    reads within 15% of an even share, nearly all bytes are read where they are written, and no
    read exceeds the wave budget."""
    cfg, args, _ = _llama8b()
    chunks = [SourceChunk(id=i, file="x.safetensors", key=n, shape=s, dtype=torch.bfloat16, pieces=p,
                          offsets=(0,) * len(s), sliceable=True)
              for i, (n, (s, p)) in enumerate(hf_tensors(cfg).items())]
    target = Target(cfg=cfg, layout=Layout(tp=tp, pp=pp), dtype=None, args=args, iteration="release")
    files = fmt().target_files(target, {n: torch.bfloat16 for n in logical_tensors(cfg)})
    budget = 256 << 20
    cut = split_chunks(chunks, files, budget // 4)
    assert max(c.nbytes for c in cut) <= budget // 4
    numel = {n: torch.Size(t.shape).numel() for n, t in logical_tensors(cfg).items()}
    plan = make_plan(cut, files, 8, budget, numel)
    total = sum(c.nbytes for c in chunks)
    assert sum(plan.read_bytes) == total  # every byte read once
    assert max(plan.read_bytes) <= 1.15 * total / 8
    remote = sum(t.nbytes for w in plan.waves for t in w.transfers if t.reader != t.writer)
    assert remote < 0.02 * plan.moved_bytes


@pytest.mark.parametrize("fmt,layout,world", [(MegatronFormat, Layout(tp=2, pp=2, first=2), 3),
                                              (TorchDistFormat, Layout(tp=2, pp=1), 2),
                                              (TorchDistFormat, Layout(tp=1, pp=3), 4)])
def test_split_sources_fill_every_target_exactly(fmt, layout, world):
    """HF tensors cut by split_chunks (tiny blocks) and read as slices, planned and executed in
    memory: every target tensor holds exactly the logical values (vocab padding zero)."""
    from test_plan import assert_targets_hold, logical_model, simulate

    cfg, args, _ = config_from_hf(hf_config(architectures=["Qwen2ForCausalLM"], vocab_size=50), None)
    cfg = cfg.replace(make_vocab_size_divisible_by=8)
    model = logical_model(cfg)
    stored, chunks = {}, []
    for i, (name, (shape, pieces)) in enumerate(hf_tensors(cfg).items()):
        stored[name] = torch.full(shape, float("nan"))
        for p in pieces:
            stored[name][p.sbox.slices()] = model[p.logical][p.lbox.slices()]
        chunks.append(SourceChunk(id=i, file="m.safetensors", key=name, shape=shape, dtype=torch.float32, pieces=pieces,
                                  offsets=(0,) * len(shape), sliceable=True))
    files = fmt().target_files(Target(cfg=cfg, layout=layout, dtype=None, args=args, iteration="release"),
                               {n: torch.float32 for n in model})
    cut = split_chunks(chunks, files, 2048)
    assert len(cut) > 3 * len(chunks) and max(c.nbytes for c in cut) <= 2048
    data = {c.id: stored[c.key][tuple(slice(o, o + n) for o, n in zip(c.offsets, c.shape, strict=True))] for c in cut}
    plan = make_plan(cut, files, world, 16 << 10, {n: t.numel() for n, t in model.items()})
    assert_targets_hold(simulate(plan, files, data), files, model)
