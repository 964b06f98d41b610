"""Typed model semantics, without processes: the audit of megatron-core's settings (every field of the installed
release placed), each feature record's Megatron-LM args written and read back, every Hugging Face family's
declaration written into config.json and read back, config.json keys that change the math never ignored, and the
coverage check that refuses a target missing a logical tensor."""
from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
from typing import Any

import pytest
import torch
import transformers

from dist_convert.config import RECORDS, ModelConfig, classify, config_from_args
from dist_convert.datamodel import TargetFile, TargetTensor
from dist_convert.errors import ConvertError
from dist_convert.features import (
    DSA,
    GDN,
    MLA,
    MLP,
    MTP,
    T5,
    Attention,
    Embedding,
    Linear,
    Llama3,
    Mamba,
    MLASoftmax,
    MoE,
    Norms,
    Position,
    Yarn,
)
from dist_convert.features.expressed import ANY, unexpressed
from dist_convert.features.vision import Qwen3VLTower, Qwen25VLTower, SiglipTower
from dist_convert.formats.hf import hf_tensors, source_tensors
from dist_convert.formats.mcore_config import FIELDS as MCORE_FIELDS
from dist_convert.formats.mcore_config import PROVIDER_EXPRESSES, args_from_fields, transformer_fields
from dist_convert.layout.rules import logical_tensors
from dist_convert.layout.topology import Layout
from dist_convert.mlm_args import complete_args, model_args
from dist_convert.models import FAMILIES, PREFERENCE, config_from_hf, export_family, hf_from_config
from dist_convert.models.hf_keys import HF_MATH_KEYS, flat_keys
from dist_convert.plan import check_coverage

from workers import runtime_python

# -- the audit: every megatron-core setting placed ---------------------------------------------------------------
NAMES = """
import dataclasses, inspect, json, sys, warnings
warnings.filterwarnings("ignore")
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.models.mamba.mamba_model import MambaModel
parallel = {f.name for f in dataclasses.fields(ModelParallelConfig)}
names = {f.name for f in dataclasses.fields(MLATransformerConfig)} - parallel
names |= set(inspect.signature(GPTModel.__init__).parameters) | set(inspect.signature(MambaModel.__init__).parameters)
print(json.dumps(sorted(names)))
"""


@pytest.mark.parametrize("runtime", ["default", "mcore19"])
def test_every_megatron_core_setting_is_read_covered_refused_or_known_not_math(runtime):
    """TransformerConfig and MLATransformerConfig (less ModelParallelConfig's parallel fields) and GPTModel's and
    MambaModel's arguments, as the installed megatron-core (0.16.1, 0.19.2) has them: each is read into a record,
    goes with one that is, is refused on read, or is known not to change the forward pass."""
    out = subprocess.run([str(runtime_python(runtime)), "-c", NAMES], capture_output=True, text=True, check=True)
    names = json.loads(out.stdout)
    assert len(names) > 190
    placed = {n: classify(n) for n in names if n != "self"}
    missing = sorted(n for n, (how, _) in placed.items() if how == "missing")
    assert not missing, f"megatron-core settings the audit does not place: {missing}"
    read = {n for n, (how, _) in placed.items() if how == "read"}
    assert {"rotary_percent", "window_size", "softmax_scale", "rotary_interleaved", "qk_l2_norm",
            "apply_residual_connection_post_layernorm", "moe_router_score_function"} <= read


# -- the records: Megatron-LM args written and read back ---------------------------------------------------------
CORE = dict(num_layers=4, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2,
            kv_channels=16, vocab_size=100, make_vocab_size_divisible_by=16, max_position_embeddings=64,
            untie_embeddings_and_output_weights=True, add_bias_linear=False, add_qkv_bias=True, spec="te")
YARN = dict(kind="yarn", scaling=Yarn(factor=4.0, original_max=16, beta_fast=32.0, beta_slow=1.0, mscale=1.0,
                                     mscale_all_dim=0.0, round_to_int=False))
VARIANTS: list[dict[str, Any]] = [
    {},
    {"position": Position(base=5e5, percent=0.5, interleaved=True, seq_len_interpolation=2.0)},
    {"position": Position(scaling=Llama3(factor=32.0))},
    {"position": Position(**YARN)},
    {"position": Position(local_base=1e4)},  # Gemma 3 without scaling (gemma-3-1b): no factor read back
    {"position": Position(local_base=1e4, scaling=Linear(factor=8.0))},
    {"position": Position(kind="mrope", mrope_section=(2, 3, 3), mrope_interleaved=True),
     "vision": Qwen3VLTower(depth=2, hidden=32, heads=2, ffn=64, out_hidden=64, deepstack=(0, 1), image_token_id=7)},
    {"vision": SiglipTower(depth=2, hidden=32, heads=2, ffn=64, patch=4, image_size=32, head=True,
                           mm_tokens=4, eps=1e-5)},
    {"vision": Qwen25VLTower(depth=2, hidden=32, heads=2, ffn=48, window=16, full_layers=(1,),
                             tokens_per_second=2, activation="silu")},
    {"position": Position(kind="learned_absolute")},
    {"attention": Attention(qk_norm=True, qk_l2_norm=True, softmax_scale=0.125, softmax_type="learnable",
                            window=(7, 0), window_skip_freq=(1, 0, 1, 0), output_gate=True)},
    {"attention": Attention(window=(3, 0), window_skip_freq=2)},
    {"norm": Norms(kind="LayerNorm", eps=1e-6, zero_centered_gamma=True, post_norms=True, residual_post_norm=True)},
    {"mlp": MLP(gated=True, activation="quick_gelu", glu_linear_offset=1.0, clamp=7.0)},
    {"mlp": MLP(gated=True, activation="gelu_tanh")},
    {"mlp": MLP(gated=False, activation="squared_relu")},
    {"mlp": MLP(gated=False, activation="gelu_tanh")},
    {"mlp": MLP(gated=False, activation="gelu")},
    {"embedding": Embedding(multiplier=8.0)},
    {"moe": MoE(num_experts=8, ffn=32, layer_pattern=(0, 1, 1, 1), shared_size=64, shared_gate=True, expert_bias=True,
                topk=4, score_function="sigmoid", topk_scaling_factor=2.5, num_groups=2, group_topk=1,
                capacity_factor=1.5, apply_probs_on_input=True, router_dtype="fp32")},
    {"mla": MLA(q_lora_rank=32, kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16),
     "position": Position(mla_names=True, **YARN), "num_query_groups": 4},
    {"mla": MLA(q_lora_rank=None, kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16),
     "position": Position(mla_names=True), "num_query_groups": 4},
    {"mla": MLA(q_lora_rank=None, kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16),
     "position": Position(mla_names=True, scaling=MLASoftmax(factor=40.0, mscale_all_dim=0.707)),
     "num_query_groups": 4},
    {"mtp": MTP(num_layers=2)},
    {"mla": MLA(q_lora_rank=32, kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16),
     "dsa": DSA(n_heads=2, head_dim=16, topk=4, topk_freq=2, skip_topk_offset=3, rope_interleaved=True,
                scoring_relu=False, k_norm_eps=1e-6, rotate_activation=False, k_norm_fp32=True),
     "position": Position(mla_names=True), "num_query_groups": 4},
    {"mamba": Mamba(pattern="M*-E", num_heads=8, head_dim=16, num_groups=2, state_dim=32),
     "moe": MoE(num_experts=4, ffn=32, topk=2)},
    {"gdn": GDN(pattern=(1, 0, 1, 0), num_key_heads=2, num_value_heads=4, key_head_dim=16, value_head_dim=8,
                conv_kernel_dim=4)},
    {"t5": T5(encoder_num_layers=2, relative_attention_num_buckets=16), "position": Position(kind="relative")},
]


def test_rope_scaling_is_a_record_of_its_kind():
    """RoPE scaling is one record of its kind on Position: its settings are the kind and that kind's fields (named by
    its own args names), YaRN under multi-latent attention reads MLA's names and defaults, a kind that does not fit
    the position embedding is refused, and args giving two kinds at once are refused in one line."""
    yarn = ModelConfig(**CORE, position=Position(**YARN))
    settings = {s.key: s for s in yarn.settings()}
    assert settings["position.scaling"].value == "yarn" and settings["position.scaling"].arg == "rope_scaling"
    assert (settings["position.scaling.factor"].value, settings["position.scaling.factor"].arg) == (
        4.0, "rotary_scaling_factor")
    assert (settings["position.scaling.beta_fast"].plain, settings["position.scaling.original_max"].value) == (32.0, 16)
    llama3 = {s.key: s for s in ModelConfig(**CORE, position=Position(scaling=Llama3(factor=32.0))).settings()}
    assert (llama3["position.scaling.factor"].arg, "position.scaling.beta_fast" in llama3) == (
        "rope_scaling_factor", False)
    mla = argparse.Namespace(multi_latent_attention=True, rope_type="yarn", beta_fast=16.0,
                             original_max_position_embeddings=2048, yarn_beta_fast=99.0)
    assert Position.from_args(mla).scaling == Yarn(factor=40.0, beta_fast=16.0, original_max=2048)
    for bad in (dict(kind="rope", scaling=Yarn()), dict(kind="yarn"), dict(scaling=MLASoftmax(factor=2.0)),
                dict(kind="learned_absolute", scaling=Llama3())):
        with pytest.raises(ConvertError, match="RoPE scaling"):
            Position(**bad)
    two = argparse.Namespace(position_embedding_type="yarn", use_rope_scaling=True, rotary_scaling_factor=4.0)
    with pytest.raises(ConvertError, match="yarn and llama3 scaling at once"):
        Position.from_args(two)
    assert yarn.replace(position__scaling__factor=8.0).position.scaling.factor == 8.0


@pytest.mark.parametrize("change", VARIANTS, ids=lambda c: "+".join(c) or "plain")
def test_records_write_their_args_and_read_them_back(change):
    """Each record says itself in Megatron-LM args (``to_args``) and reads them back (``from_args``), through the
    args every target stores (complete_args), field by field."""
    cfg = ModelConfig(**{**CORE, **change})
    args = complete_args(argparse.Namespace(), cfg, Layout(tp=1, pp=1))
    back = config_from_args(args, None, cfg.spec, 1, "t5" if cfg.t5 is not None else "gpt")
    assert back == cfg, cfg.differences(back) or [f for f in dataclasses.fields(cfg)
                                                   if getattr(cfg, f.name) != getattr(back, f.name)]



# the variants a GPTModelProvider-style config expresses (MLA, Mamba, GDN, T5 and Gemma 3's records are other
# model classes', judged by their own formats' tests)
PROVIDER_VARIANTS = [c for c in VARIANTS if not unexpressed(ModelConfig(**{**CORE, **c}), PROVIDER_EXPRESSES)]


@pytest.mark.parametrize("change", PROVIDER_VARIANTS, ids=lambda c: "+".join(c) or "plain")
def test_transformer_config_fields_carry_what_the_provider_declares(change):
    """A model written as TransformerConfig fields (Megatron-Bridge's run_config.yaml, NeMo 2's model config) and
    read back computes the same, for every setting those configs declare they express."""
    cfg = ModelConfig(**{**CORE, **change})
    fields = {**transformer_fields(cfg), "seq_length": cfg.max_position_embeddings}  # as each writer adds it
    args = args_from_fields(fields, "the test config", "")
    args.padded_vocab_size = 112
    back = config_from_args(args, cfg.vocab_size, cfg.spec, 1)
    assert not cfg.differences(back), cfg.differences(back)


def test_every_transformer_config_name_reaches_its_records_args_name():
    """A record field whose megatron-core name is not its Megatron-LM args name is translated when read from
    TransformerConfig fields (else the setting would read as its default)."""
    handled = set(MCORE_FIELDS) | {"activation_func"}
    for cls in (*RECORDS.values(),):
        for f in cls.all_fields():
            renamed = set(f.metadata.get("config", ())) - set(f.metadata.get("arg", ()))
            assert renamed <= handled, (cls.__name__, f.name, renamed - handled)

def test_settings_unconverted_are_refused_on_read():
    args = model_args(ModelConfig(**CORE), torch.float32)
    args.moe_latent_size = 64
    with pytest.raises(ConvertError, match="moe_latent_size=64 .*latent MoE projections") as e:
        config_from_args(args, None, "te", 1)
    assert "\n" not in str(e.value)


# -- Hugging Face families: what they declare they write -----------------------------------------------------------
def hf_json(cls: str, arch: str, **kw: Any) -> dict[str, Any]:
    """config.json as transformers writes it for ``cls`` (every default key included)."""
    return {**getattr(transformers, cls)(**kw).to_dict(), "architectures": [arch]}


SMALL = dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6)
MOE_KW = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
DS_KW = dict(SMALL, num_key_value_heads=4, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
             n_group=2, topk_group=1, n_shared_experts=1, moe_intermediate_size=32, q_lora_rank=32, kv_lora_rank=32,
             qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
DSA_KW = dict(index_n_heads=2, index_head_dim=16, index_topk=4)
VL_TEXT = dict(head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 5e5, "mrope_section": [2, 3, 3],
                                           "mrope_interleaved": True})
VL_VISION = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64,
                 num_position_embeddings=16, deepstack_visual_indexes=[0])
Q35_TEXT = dict(head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                linear_value_head_dim=8, rope_parameters={"rope_type": "default", "rope_theta": 1e5,
                                                          "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 2],
                                                          "mrope_interleaved": True})
M3_ROPE = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 16.0, "original_max_position_embeddings": 16,
           "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1}
SAMPLES = {
    "LlamaForCausalLM": ("LlamaConfig", SMALL),
    "MistralForCausalLM": ("MistralConfig", dict(SMALL, sliding_window=8)),
    "Qwen2ForCausalLM": ("Qwen2Config", SMALL),
    "Qwen3ForCausalLM": ("Qwen3Config", dict(SMALL, head_dim=32)),
    "MixtralForCausalLM": ("MixtralConfig", dict(SMALL, num_local_experts=4, num_experts_per_tok=2)),
    "OlmoeForCausalLM": ("OlmoeConfig", dict(SMALL, num_key_value_heads=4, num_experts=4, num_experts_per_tok=2)),
    "MiniMaxM2ForCausalLM": ("MiniMaxM2Config", dict(SMALL, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                                     rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                                      "partial_rotary_factor": 0.5})),
    "Qwen2MoeForCausalLM": ("Qwen2MoeConfig", dict(SMALL, **MOE_KW, shared_expert_intermediate_size=48,
                                                   mlp_only_layers=[0])),
    "Qwen3MoeForCausalLM": ("Qwen3MoeConfig", dict(SMALL, **MOE_KW, decoder_sparse_step=2, norm_topk_prob=True)),
    "DeepseekV3ForCausalLM": ("DeepseekV3Config", DS_KW),
    "DeepseekV2ForCausalLM": ("DeepseekV2Config", dict(DS_KW, q_lora_rank=None, n_group=None, topk_group=None,
                                                       topk_method="greedy")),
    "Glm4MoeLiteForCausalLM": ("Glm4MoeLiteConfig", {k: v for k, v in DS_KW.items() if k != "first_k_dense_replace"}),
    "GlmMoeDsaForCausalLM": ("GlmMoeDsaConfig", dict(DS_KW, **DSA_KW, rms_norm_eps=1e-5, indexer_rope_interleave=True,
                                                      index_topk_freq=2, index_skip_topk_offset=1)),
    "DeepseekV32ForCausalLM": ("DeepseekV32Config", dict(DS_KW, **DSA_KW)),
    "Glm4MoeForCausalLM": ("Glm4MoeConfig", dict(SMALL, head_dim=32, attention_bias=True, use_qk_norm=True,
                                                 first_k_dense_replace=1, n_routed_experts=8, n_group=2, topk_group=1,
                                                 num_experts_per_tok=2,
                                                 n_shared_experts=1, moe_intermediate_size=32)),
    "Gemma3ForCausalLM": ("Gemma3TextConfig", dict(SMALL, head_dim=16, sliding_window=8,
                                                   layer_types=["sliding_attention"] * 3 + ["full_attention"])),
    "GptOssForCausalLM": ("GptOssConfig", dict(SMALL, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                               sliding_window=8)),
    "NemotronHForCausalLM": ("NemotronHConfig", dict(
        SMALL, layers_block_type=["mamba", "attention", "mlp", "moe"], mamba_num_heads=8, mamba_head_dim=16,
        n_groups=2, ssm_state_size=16, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=48, head_dim=16, layer_norm_epsilon=1e-5)),
    "Qwen3NextForCausalLM": ("Qwen3NextConfig", dict(SMALL, **MOE_KW, head_dim=16,
                                                     shared_expert_intermediate_size=48, linear_num_key_heads=2,
                                                     linear_num_value_heads=4, linear_key_head_dim=16,
                                                     linear_value_head_dim=8)),
    "Qwen3_5ForCausalLM": ("Qwen3_5TextConfig", dict(SMALL, head_dim=16, linear_num_key_heads=2,
                                                     linear_num_value_heads=4, linear_key_head_dim=16,
                                                     linear_value_head_dim=8)),
    "Qwen3_5MoeForCausalLM": ("Qwen3_5MoeTextConfig", dict(SMALL, **MOE_KW, head_dim=16,
                                                           shared_expert_intermediate_size=48, linear_num_key_heads=2,
                                                           linear_num_value_heads=4, linear_key_head_dim=16,
                                                           linear_value_head_dim=8)),
    "Qwen3VLForConditionalGeneration": ("Qwen3VLConfig", dict(text_config=dict(SMALL, **VL_TEXT),
                                                               vision_config=VL_VISION)),
    "Qwen3VLMoeForConditionalGeneration": ("Qwen3VLMoeConfig", dict(
        text_config=dict(SMALL, **VL_TEXT, **MOE_KW, mlp_only_layers=[0]), vision_config=VL_VISION)),
    "Qwen3_5ForConditionalGeneration": ("Qwen3_5Config", dict(
        text_config=dict(SMALL, **Q35_TEXT), vision_config={k: v for k, v in VL_VISION.items() if "deep" not in k})),
    "Qwen3_5MoeForConditionalGeneration": ("Qwen3_5MoeConfig", dict(
        text_config=dict(SMALL, **Q35_TEXT, **MOE_KW, shared_expert_intermediate_size=48),
        vision_config={k: v for k, v in VL_VISION.items() if "deep" not in k})),
    "Glm4vMoeForConditionalGeneration": ("Glm4vMoeConfig", dict(
        text_config=dict(SMALL, head_dim=32, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5,
                                          "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=48, out_hidden_size=64,
                           patch_size=4, image_size=16))),
    "Ministral3ForCausalLM": ("Ministral3Config", dict(SMALL, head_dim=16, rope_parameters=M3_ROPE)),
    "Mistral3ForConditionalGeneration": ("Mistral3Config", dict(
        text_config=dict(SMALL, model_type="ministral3", head_dim=16, rope_parameters=M3_ROPE),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           head_dim=16, patch_size=4, image_size=16))),
    "Qwen2_5_VLForConditionalGeneration": ("Qwen2_5_VLConfig", dict(
        text_config=dict(SMALL, rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                 "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=48, out_hidden_size=64,
                           fullatt_block_indexes=[1]))),
    "Gemma3ForConditionalGeneration": ("Gemma3Config", dict(
        text_config=dict(SMALL, head_dim=16, sliding_window=8,
                         layer_types=["sliding_attention"] * 3 + ["full_attention"]),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=32, patch_size=4, vision_use_head=False), mm_tokens_per_image=4)),
    "Kimi_K25ForConditionalGeneration": ("Kimi_K25Config", dict(
        text_config=dict(DS_KW, model_type="deepseek_v3"), projection_hidden_size=32,
        vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                           patch_size=4, pos_emb_height=4, pos_emb_width=4))),
}
assert set(SAMPLES) == set(FAMILIES)


def sample(arch: str) -> dict[str, Any]:
    cls, kw = SAMPLES[arch]
    return hf_json(cls, arch, **kw)


@pytest.mark.parametrize("arch", PREFERENCE)
def test_each_family_writes_what_it_declares_and_reads_it_back(arch):
    """A transformers-written config.json of each family imports, exports as the same family and reads back as the
    same model; every value the family declares it can write for a setting (a finite list) is written and read back,
    and a value it does not declare is refused by the export in one line naming the setting."""
    cfg, _, _ = config_from_hf(sample(arch), None)
    fam = FAMILIES[arch]
    assert not fam.unexpressed(cfg), fam.unexpressed(cfg)
    assert export_family(cfg, sample(arch)) is fam
    hf_from_config(cfg, torch.float32, sample(arch))  # reads its own config.json back (hf_from_config checks)
    declared = fam.expresses()
    for s in cfg.settings():  # every other value of a finite declaration: written, read back the same
        allowed = declared.get(s.key)
        if allowed is None or allowed is ANY or callable(allowed) or "." not in s.key \
                or s.key in ("position.kind", "position.scaling"):  # these two come with fields of their own
            continue
        for value in set(allowed) - {s.value}:
            other = cfg.replace(**{s.key.replace(".", "__"): value})
            if not fam.unexpressed(other):
                back = config_from_hf(hf_from_config(other, torch.float32), None)[0]
                assert not other.differences(back), (s.key, value, other.differences(back))
    undeclared = next(s for s in cfg.settings() if s.key == "norm.residual_post_norm")
    assert undeclared.key not in declared and fam.unexpressed(cfg.replace(norm__residual_post_norm=True))


@pytest.mark.parametrize("arch", PREFERENCE)
def test_config_keys_that_change_the_math_are_mapped_or_refused(arch):
    """Every key of HF_MATH_KEYS set to a value that changes the math is either one the family maps (its
    ``hf_keys``) or refused on import naming the key; none is dropped."""
    fam = FAMILIES[arch]
    base = sample(arch)
    non_plain = {"attention_bias": True, "qkv_bias": True, "use_qk_norm": True, "sliding_window": 7,
                 "use_sliding_window": True, "layer_types": ["sliding_attention"] * 4, "attn_logit_softcapping": 30.0,
                 "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 3.0, "use_bidirectional_attention": True,
                 "attention_chunk_size": 8, "clip_qkv": 8.0, "no_rope_layers": [1, 0, 1, 0],
                 "attention_multiplier": 0.5,
                 "rope_interleave": False, "hidden_act": "gelu", "hidden_activation": "gelu", "mlp_bias": True,
                 "swiglu_limit": 3.0, "embedding_multiplier": 2.0, "logits_scaling": 2.0, "residual_multiplier": 0.5,
                 "norm_topk_prob": False, "scoring_func": "sigmoid", "topk_method": "noaux_tc", "n_group": 4,
                 "topk_group": 2, "routed_scaling_factor": 2.0, "first_k_dense_replace": 2, "moe_layer_freq": 2,
                 "decoder_sparse_step": 2, "mlp_only_layers": [1], "moe_latent_size": 16,
                 "num_nextn_predict_layers": 1, "n_shared_experts": 2, "shared_expert_intermediate_size": 16}
    refused = 0
    text = "text_config" if "text_config" in base else None  # a vision-language model's language model
    for key in HF_MATH_KEYS:
        if key.startswith("rope.") or key in fam.hf_keys or key not in non_plain:
            continue
        with pytest.raises(ConvertError) as e:
            config_from_hf({**base, text: {**base[text], key: non_plain[key]}} if text else
                           {**base, key: non_plain[key]}, None)
        assert key in str(e.value) and "\n" not in str(e.value), (key, str(e.value))
        refused += 1
    if "rope.partial_rotary_factor" not in fam.hf_keys:
        with pytest.raises(ConvertError, match="partial_rotary_factor"):
            config_from_hf({**base, text: {**base[text], "partial_rotary_factor": 0.5}} if text else
                           {**base, "partial_rotary_factor": 0.5}, None)
    assert refused > 0 or arch in ("Qwen2MoeForCausalLM",)


def test_flat_keys_see_rope_parameters_of_every_spelling():
    nested = {"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                  "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}
    assert flat_keys(nested)["rope.rope_type"] == "linear"
    assert flat_keys({"rope_scaling": {"type": "yarn"}, "rope_theta": 5.0})["rope.rope_type"] == "yarn"
    assert flat_keys({"partial_rotary_factor": 0.25})["rope.partial_rotary_factor"] == 0.25


# -- the megatron-core models no family expresses: refused in one line ---------------------------------------------
@pytest.mark.parametrize("change,needle", [
    (dict(position__percent=0.5), "rotary_percent=0.5"),
    (dict(position__interleaved=True), "rotary_interleaved=True"),
    (dict(attention__softmax_scale=0.1), "softmax_scale=0.1"),
    (dict(attention__window=(7, 0), attention__window_skip_freq=2), "window_attn_skip_freq=2"),
    (dict(norm__residual_post_norm=True), "apply_residual_connection_post_layernorm=True"),
    (dict(attention__qk_l2_norm=True), "qk_l2_norm=True"),
    (dict(mlp__activation="gelu"), "glu_activation=gelu"),
    (dict(position__seq_len_interpolation=2.0), "rotary_seq_len_interpolation_factor=2.0"),
])
def test_a_setting_no_family_expresses_is_refused_naming_it(change, needle):
    cfg, _, _ = config_from_hf(sample("LlamaForCausalLM"), None)
    with pytest.raises(ConvertError) as e:
        hf_from_config(cfg.replace(**change), torch.float32)
    assert needle in str(e.value) and "--dst-format torch_dist" in str(e.value) and "\n" not in str(e.value)


def test_a_window_on_every_layer_exports_as_mistral():
    cfg, _, _ = config_from_hf(sample("LlamaForCausalLM"), None)
    out = hf_from_config(cfg.replace(attention__window=(7, 0)), torch.float32)
    assert out["architectures"] == ["MistralForCausalLM"] and out["sliding_window"] == 8


# -- coverage: a forgotten name-table row is refused before anything is written --------------------------------------
def test_a_missing_name_table_row_is_refused():
    cfg, _, _ = config_from_hf(sample("Qwen3ForCausalLM"), None)
    table = hf_tensors(cfg)
    numel = {n: torch.Size(t.shape).numel() for n, t in logical_tensors(cfg).items()}

    def files(tensors: dict) -> list[TargetFile]:
        return [TargetFile(id=0, name="model.safetensors", tensors=[
            TargetTensor(key=k, shape=shape, dtype=torch.float32, pieces=pieces) for k, (shape, pieces) in
            tensors.items()])]

    check_coverage(files(table), numel)  # the whole table covers every logical tensor
    gone = "model.layers.1.self_attn.k_norm.weight"
    with pytest.raises(ConvertError, match="decoder.layers.1.self_attention.k_layernorm.weight") as e:
        check_coverage(files({k: v for k, v in table.items() if k != gone}), numel)
    assert "\n" not in str(e.value)
    half = "model.layers.0.self_attn.v_proj.weight"  # a part of a fused tensor: the QKV rows of v are left out
    with pytest.raises(ConvertError, match="linear_qkv.weight"):
        check_coverage(files({k: v for k, v in table.items() if k != half}), numel)
    check_coverage(files({k: v for k, v in table.items() if k != gone}), numel,
                   dropped={"decoder.layers.1.self_attention.k_layernorm.weight"})  # declared dropped: allowed


# -- round trips keep the source's own stored copies ---------------------------------------------------------------
def test_optional_copies_are_recorded_and_written_back_as_the_source_had_them():
    hf = {**sample("Glm4MoeForCausalLM"), "num_nextn_predict_layers": 1}
    cfg, _, _ = config_from_hf(hf, None)
    fam = FAMILIES["Glm4MoeForCausalLM"]
    everything = hf_tensors(cfg, fam, {"mtp embed_tokens": True, "mtp shared_head.head": True})
    copies = {"model.layers.4.embed_tokens.weight", "model.layers.4.shared_head.head.weight"}
    assert copies <= set(everything)
    glm46 = set(everything) - copies  # GLM-4.6: neither copy stored
    expected, stored = source_tensors(cfg, fam, glm46)
    assert stored == {"mtp embed_tokens": False, "mtp shared_head.head": False} and not copies & set(expected)
    assert set(hf_tensors(cfg, fam, stored)) == glm46  # written back without them
    glm45 = glm46 | {"model.layers.4.shared_head.head.weight"}
    _, stored = source_tensors(cfg, fam, glm45)
    assert set(hf_tensors(cfg, fam, stored)) == glm45
    assert copies <= set(hf_tensors(cfg, fam))  # a model from nothing: as DeepSeek-V3 releases store them
    tied, _, _ = config_from_hf({**sample("LlamaForCausalLM"), "tie_word_embeddings": True}, None)
    llama = FAMILIES["LlamaForCausalLM"]
    names = set(hf_tensors(tied, llama))
    _, stored = source_tensors(tied, llama, names | {"lm_head.weight"})
    assert "lm_head.weight" not in names and set(hf_tensors(tied, llama, stored)) == names | {"lm_head.weight"}
