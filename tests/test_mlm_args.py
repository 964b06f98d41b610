"""Target args (dist_convert/mlm_args.py), pure: what complete_args keeps, fills and sets, that dist_convert
reads its own output back to the same model, and that the args unpickle with weights_only under exactly
megatron-core's safe globals. tests/test_bridge_load.py loads real targets with Megatron-Bridge and
Megatron-LM."""
from __future__ import annotations

import argparse
import io

import pytest
import torch

from dist_convert.config import config_from_args
from dist_convert.errors import ConvertError
from dist_convert.layout.topology import Layout
from dist_convert.mlm_args import ARGS, BY_NAME, CFG, DERIVED, LAYOUT, SAFE_CLASSES, complete_args
from dist_convert.models import config_from_hf

from flat_config import flat_config, with_flat

# Megatron-Bridge 0.6.2 mlm_compat reads these without a default: each must be in every target's args
BRIDGE_DIRECT = ("multi_latent_attention", "heterogeneous_layers_config_path", "no_persist_layer_norm", "params_dtype",
                 "overlap_p2p_comm", "num_experts", "rotary_interleaved", "decoder_first_pipeline_num_layers",
                 "decoder_last_pipeline_num_layers", "fp8_param_gather", "swiglu", "bias_swiglu_fusion",
                 "bias_gelu_fusion", "squared_relu", "init_method_xavier_uniform", "group_query_attention",
                 "num_query_groups", "config_logger_dir", "cp_comm_type", "is_hybrid_model", "transformer_impl",
                 "moe_grouped_gemm", "qk_layernorm", "qk_l2_norm", "normalization", "mtp_num_layers",
                 "padded_vocab_size", "max_position_embeddings", "fp16_lm_cross_entropy",
                 "untie_embeddings_and_output_weights", "position_embedding_type", "rotary_percent", "rotary_base",
                 "use_rope_scaling", "init_model_with_meta_device", "fp16", "bf16", "make_vocab_size_divisible_by")

HF_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 100, "hidden_size": 64,
            "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 500000.0, "dtype": "bfloat16"}


def mlm_source() -> argparse.Namespace:
    """Megatron-LM-style args of a TP=2 PP=2 run, with fields outside the table."""
    return argparse.Namespace(num_layers=4, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
                              group_query_attention=True, num_query_groups=2, swiglu=True, normalization="RMSNorm",
                              add_bias_linear=False, vocab_size=100, make_vocab_size_divisible_by=16,
                              padded_vocab_size=128, position_embedding_type="rope", max_position_embeddings=32,
                              transformer_impl="local", tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                              world_size=16, data_parallel_size=4, lr=3e-4, tokenizer_type="GPT2BPETokenizer",
                              hidden_dropout=0.0, rotary_base=500000, norm_epsilon=1e-6, sequence_parallel=True)


def test_table_is_one_row_per_field():
    assert len(BY_NAME) == len(ARGS)
    assert all(set(a.readers) <= set("LCRB") and a.source in ("", CFG, LAYOUT, DERIVED) for a in ARGS)


@pytest.mark.parametrize("layout", [Layout(tp=1, pp=1), Layout(tp=2, pp=2, first=1), Layout(tp=1, pp=2, vpp=2)])
def test_keeps_fills_and_sets(layout):
    src = mlm_source()
    cfg = config_from_args(src, None, None, 2)
    out = complete_args(src, cfg, layout, torch.bfloat16, "torch_dist")
    assert vars(src)["world_size"] == 16 and not hasattr(src, "multi_latent_attention")  # the source is untouched
    for name in ("lr", "tokenizer_type", "hidden_dropout", "rotary_base"):  # kept
        assert getattr(out, name) == getattr(src, name)
    assert all(hasattr(out, n) for n in BRIDGE_DIRECT)
    assert out.multi_latent_attention is False and out.cp_comm_type == ["p2p"] and out.attention_dropout == 0.1
    assert out.padded_vocab_size == cfg.padded_vocab(layout.tp) and out.num_query_groups == 2
    assert (out.tensor_model_parallel_size, out.pipeline_model_parallel_size) == (layout.tp, layout.pp)
    assert out.world_size == layout.tp * layout.pp and out.data_parallel_size == 1
    assert out.sequence_parallel == (layout.tp > 1)
    assert out.decoder_first_pipeline_num_layers == layout.first
    assert out.virtual_pipeline_model_parallel_size == layout.vpp
    assert out.num_layers_per_virtual_pipeline_stage == (1 if layout.vpp else None)
    assert (out.params_dtype, out.bf16, out.fp16) == (torch.bfloat16, True, False)
    assert out.layernorm_epsilon == out.norm_epsilon == 1e-6
    assert out.no_save_optim is True and out.no_save_rng is True and out.ckpt_format == "torch_dist"
    # dist_convert reads its own target back to the same model
    assert config_from_args(out, None, None, layout.tp) == cfg
    assert Layout.from_args(out, layout.tp, layout.pp) == layout


def test_hf_source_gets_model_fields():
    cfg, args, _ = config_from_hf(HF_LLAMA, None)
    cfg = cfg.replace(spec="local")
    out = complete_args(args, cfg, Layout(tp=2, pp=1), None, "torch")
    assert (out.transformer_impl, out.ckpt_format) == ("local", "torch")
    assert (out.params_dtype, out.bf16) == (torch.bfloat16, True)
    assert (out.group_query_attention, out.num_query_groups, out.kv_channels) == (True, 2, 16)
    # the HF config.json travels in the target's Origin (tests/test_origin.py), never in its args
    assert not hasattr(out, "hf_config") and out.rotary_base == 500000.0 and out.layernorm_epsilon == 1e-6
    assert out.padded_vocab_size == 256 and out.tokenizer_type == "HuggingFaceTokenizer"


def test_moe_fields():
    cfg = flat_config(num_layers=4, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=4,
                      kv_channels=16, swiglu=True, normalization="RMSNorm", add_bias_linear=False, add_qkv_bias=False,
                      untie_embeddings_and_output_weights=True, vocab_size=100, make_vocab_size_divisible_by=128,
                      position_embedding_type="rope", max_position_embeddings=64, qk_layernorm=False, spec="local",
                      num_experts=8, moe_ffn_hidden_size=32, moe_layer_pattern=(0, 1, 1, 1),
                      moe_shared_expert_intermediate_size=48, moe_shared_expert_gate=True)
    out = complete_args(argparse.Namespace(), cfg, Layout(tp=2, pp=1, ep=4, etp=1), None)
    assert (out.num_experts, out.moe_ffn_hidden_size, out.moe_layer_freq) == (8, 32, [0, 1, 1, 1])
    assert (out.expert_model_parallel_size, out.expert_tensor_parallel_size) == (4, 1)
    assert out.world_size == 4 and out.data_parallel_size == 2  # EP x ETP = 4 needs DP 2 at TP 2
    assert config_from_args(out, None, None, 2) == cfg
    dense = complete_args(out, with_flat(cfg, num_experts=0), Layout(tp=2, pp=1), None)
    assert dense.num_experts is None and dense.moe_ffn_hidden_size is None


def test_weights_only_with_megatron_core_safe_globals():
    """The args unpickle as Megatron-LM unpickles them: weights_only, exactly megatron-core's SAFE_GLOBALS."""
    safe_globals = pytest.importorskip("megatron.core.safe_globals")
    src = mlm_source()
    out = complete_args(src, config_from_args(src, None, None, 2), Layout(tp=1, pp=2), torch.float16, "torch_dist")
    buf = io.BytesIO()
    torch.save({"args": out, "checkpoint_version": 3.0}, buf)
    before = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    try:
        torch.serialization.add_safe_globals(list(safe_globals.SAFE_GLOBALS))
        buf.seek(0)
        back = torch.load(buf, weights_only=True)["args"]
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)
    assert vars(back) == vars(out)


def test_refuses_values_megatron_cannot_unpickle():
    class Custom:
        pass

    src = mlm_source()
    src.callback, src.frozen = Custom(), frozenset({1})
    with pytest.raises(ConvertError, match="callback.*Custom|frozen") as e:
        complete_args(src, config_from_args(src, None, None, 2), Layout(tp=1, pp=1), None)
    assert "callback" in str(e.value) and "frozen" in str(e.value)


def test_safe_classes_are_megatron_cores():
    """mlm_args.SAFE_CLASSES names megatron-core's SAFE_GLOBALS classes (numpy's and torch's own aside)."""
    safe_globals = pytest.importorskip("megatron.core.safe_globals")
    names = {f"{c.__module__}.{c.__qualname__}" for c in safe_globals.SAFE_GLOBALS}
    assert {n for n in names if not n.startswith(("numpy", "torch"))} <= SAFE_CLASSES
