"""``bench --plan-scale``: the planner alone at real shapes, no tensors: DeepSeek-V3 (61 layers, 256 experts,
MTP: 685B parameters), DeepSeek-V3.2 (V3 with a sparse-attention indexer per layer), GLM-5 (78 sparse-attention
layers, 256 experts, MTP), gpt-oss-120b (36 layers, 128 experts: 117B), GLM-4.5 (92 layers, 160 experts, MTP:
357B), Nemotron-3-Nano (52 hybrid Mamba2 / MoE / attention layers: 31.6B), Qwen3-Next-80B (48 Gated DeltaNet /
gated attention layers, 512 experts: 79.7B) and Qwen3-VL-235B-A22B (94 MoE layers, a 27-layer vision tower:
235.7B); the chunks an HF release or a torch_dist save at one layout would be indexed as, planned into a torch_dist
target at another over many ranks.
Reports what every rank of such a run computes before it reads a byte: plan time, chunks, waves,
per-rank bytes read / written and the per-wave memory bound."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import torch

from ..cuts import split_chunks, split_files
from ..datamodel import Origin, SourceChunk, Target, TargetFile, numel
from ..formats.hf import hf_tensors, pack_shards
from ..formats.torch_dist import TorchDistFormat
from ..layout.rules import logical_tensors
from ..layout.topology import Layout
from ..models import config_from_hf
from ..plan import make_plan
from ..runtime import human_bytes as human
from ..runtime import peak_rss_bytes

# DeepSeek-V3's config.json (the release's values that shape the tensors)
DEEPSEEK_V3: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_nextn_predict_layers": 1, "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
    "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8,
    "topk_group": 4, "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3,
    "norm_topk_prob": True, "scoring_func": "sigmoid", "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"}, "torch_dtype": "bfloat16"}
# gpt-oss-120b's config.json (its experts ship in MXFP4; planned here as the bf16 tensors they dequantize to)
GPT_OSS_120B: dict[str, Any] = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880,
    "intermediate_size": 2880, "num_hidden_layers": 36, "num_attention_heads": 64, "num_key_value_heads": 8,
    "head_dim": 64, "num_local_experts": 128, "num_experts_per_tok": 4, "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 18, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "attention_bias": True, "swiglu_limit": 7.0,
    "rope_theta": 150000, "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                          "truncate": False, "original_max_position_embeddings": 4096},
    "torch_dtype": "bfloat16"}
# GLM-4.5's config.json (355B; its MTP layer makes 357B)
GLM_45: dict[str, Any] = {
    "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "vocab_size": 151552, "hidden_size": 5120,
    "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_hidden_layers": 92, "num_attention_heads": 96,
    "num_key_value_heads": 8, "head_dim": 128, "n_routed_experts": 160, "n_shared_experts": 1,
    "num_experts_per_tok": 8, "first_k_dense_replace": 3, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
    "routed_scaling_factor": 2.5, "num_nextn_predict_layers": 1, "partial_rotary_factor": 0.5, "use_qk_norm": True,
    "attention_bias": True, "rope_theta": 1000000, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
# NVIDIA-Nemotron-3-Nano-30B-A3B's config.json (52 hybrid layers: 23 Mamba2, 23 MoE, 6 attention; 31.6B)
NEMOTRON_3_NANO: dict[str, Any] = {
    "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "vocab_size": 131072, "hidden_size": 2688,
    "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME", "num_attention_heads": 32,
    "num_key_value_heads": 2, "head_dim": 128, "intermediate_size": 1856, "mamba_num_heads": 64, "mamba_head_dim": 64,
    "n_groups": 8, "ssm_state_size": 128, "conv_kernel": 4, "n_routed_experts": 128, "num_experts_per_tok": 6,
    "moe_intermediate_size": 1856, "moe_shared_expert_intermediate_size": 3712, "n_group": 1, "topk_group": 1,
    "norm_topk_prob": True, "routed_scaling_factor": 2.5, "layer_norm_epsilon": 1e-5, "tie_word_embeddings": False,
    "max_position_embeddings": 262144, "torch_dtype": "bfloat16"}
# Qwen3-Next-80B-A3B's config.json (48 layers, 3 Gated DeltaNet : 1 gated attention, 512 experts; 79.7B)
QWEN3_NEXT_80B: dict[str, Any] = {
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "vocab_size": 151936, "hidden_size": 2048,
    "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
    "intermediate_size": 5120, "full_attention_interval": 4, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32, "num_experts": 512,
    "num_experts_per_tok": 10, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "partial_rotary_factor": 0.25,
    "rope_theta": 10000000, "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16"}
# Qwen3-VL-235B-A22B's config.json (94 MoE layers of 128 experts, a 27-layer vision tower with 3 deepstack mergers)
QWEN3_VL_235B: dict[str, Any] = {
    "architectures": ["Qwen3VLMoeForConditionalGeneration"], "model_type": "qwen3_vl_moe", "image_token_id": 151655,
    "video_token_id": 151656, "vision_start_token_id": 151652, "vision_end_token_id": 151653,
    "tie_word_embeddings": False, "text_config": {
        "model_type": "qwen3_vl_moe_text", "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
        "num_hidden_layers": 94, "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128,
        "moe_intermediate_size": 1536, "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "rms_norm_eps": 1e-6, "max_position_embeddings": 262144, "hidden_act": "silu",
        "attention_bias": False, "rope_scaling": {"rope_type": "default", "mrope_section": [24, 20, 20],
                                                  "mrope_interleaved": True}, "rope_theta": 5000000},
    "vision_config": {"model_type": "qwen3_vl_moe", "depth": 27, "hidden_size": 1152, "intermediate_size": 4304,
                      "num_heads": 16, "out_hidden_size": 4096, "patch_size": 16, "spatial_merge_size": 2,
                      "temporal_patch_size": 2, "in_channels": 3, "num_position_embeddings": 2304,
                      "deepstack_visual_indexes": [8, 16, 24], "hidden_act": "gelu_pytorch_tanh"},
    "torch_dtype": "bfloat16"}
# DeepSeek-V3.2's config.json: V3's shapes with a lightning indexer in every layer (64 heads of 128, top-2048)
DEEPSEEK_V32: dict[str, Any] = {
    **{k: v for k, v in DEEPSEEK_V3.items() if k not in ("moe_layer_freq", "topk_method")},
    "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32", "index_n_heads": 64,
    "index_head_dim": 128, "index_topk": 2048}
# GLM-5's config.json (78 MLA layers with a DSA indexer each, 256 experts, MTP)
GLM_5: dict[str, Any] = {
    "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "vocab_size": 154880, "hidden_size": 6144,
    "intermediate_size": 12288, "moe_intermediate_size": 2048, "num_hidden_layers": 78, "num_attention_heads": 64,
    "num_key_value_heads": 64, "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512, "q_lora_rank": 2048, "qk_rope_head_dim": 64, "v_head_dim": 256, "qk_nope_head_dim": 192,
    "n_group": 1, "topk_group": 1, "num_experts_per_tok": 8, "norm_topk_prob": True, "first_k_dense_replace": 3,
    "num_nextn_predict_layers": 1, "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 32,
    "indexer_rope_interleave": True, "max_position_embeddings": 202752, "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000}, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16"}
MODELS = {"DeepSeek-V3": DEEPSEEK_V3, "DeepSeek-V3.2": DEEPSEEK_V32, "GLM-5": GLM_5, "gpt-oss-120b": GPT_OSS_120B,
          "GLM-4.5": GLM_45, "Nemotron-3-Nano": NEMOTRON_3_NANO, "Qwen3-Next-80B": QWEN3_NEXT_80B,
          "Qwen3-VL-235B-A22B": QWEN3_VL_235B}
HF_SHARDS = {"DeepSeek-V3": 163, "DeepSeek-V3.2": 163, "GLM-5": 282, "gpt-oss-120b": 15, "GLM-4.5": 93,
             "Nemotron-3-Nano": 13, "Qwen3-Next-80B": 41, "Qwen3-VL-235B-A22B": 96}
# the cases planned: (model, source layout or None for its HF release, target layout, ranks); DeepSeek-V3's
# Megatron recipes (16 and 8 pipeline stages, MTP on the last)
CASES: dict[str, tuple[str, Layout | None, Layout, int]] = {
    "hf -> TP8 PP16 EP64": ("DeepSeek-V3", None,
                            Layout(tp=8, pp=16, ep=64, etp=1, pipeline_layout="Et*4|(tttt|)*14tmL"), 128),
    "TP8 PP16 EP64 -> TP4 PP8 EP32": ("DeepSeek-V3",
                                      Layout(tp=8, pp=16, ep=64, etp=1, pipeline_layout="Et*4|(tttt|)*14tmL"),
                                      Layout(tp=4, pp=8, ep=32, etp=1, pipeline_layout="Et*7|(tttttttt|)*6ttttttmL"),
                                      128),
    "DeepSeek-V3.2 hf -> TP8 PP16 EP64": ("DeepSeek-V3.2", None,
                                          Layout(tp=8, pp=16, ep=64, etp=1, pipeline_layout="Et*4|(tttt|)*14tmL"),
                                          128),
    "GLM-5 hf -> TP4 PP8 EP16": ("GLM-5", None,
                                 Layout(tp=4, pp=8, ep=16, etp=1, pipeline_layout="Et*10|(t*10|)*6t*8mL"), 128),
    "gpt-oss-120b hf -> TP1 PP4 EP16": ("gpt-oss-120b", None, Layout(tp=1, pp=4, ep=16, etp=1), 64),
    "GLM-4.5 hf -> TP4 PP8 EP16": ("GLM-4.5", None,
                                   Layout(tp=4, pp=8, ep=16, etp=1, pipeline_layout="Et*11|(t*12|)*6t*9mL"), 128),
    "Nemotron-3-Nano hf -> TP1 PP2 EP16": ("Nemotron-3-Nano", None, Layout(tp=1, pp=2, ep=16, etp=1), 32),
    "Qwen3-Next-80B hf -> TP2 PP4 EP16": ("Qwen3-Next-80B", None, Layout(tp=2, pp=4, ep=16, etp=1), 64),
    # 94 layers: 22 on the first stage, beside the vision tower (the deepstack features feed layers 0-2 there)
    "Qwen3-VL-235B-A22B hf -> TP4 PP4 EP16": ("Qwen3-VL-235B-A22B", None,
                                              Layout(tp=4, pp=4, ep=16, etp=1, first=22), 64),
}


@dataclass(frozen=True, kw_only=True)
class PlanFigures:
    case: str
    world: int
    params: int
    source_chunks: int  # as indexed
    read_chunks: int  # after cutting to what each target needs
    target_files: int
    waves: int
    plan_s: float  # index + target files + cuts + plan, one process
    read_max: int  # bytes, the busiest rank
    read_min: int
    write_max: int
    write_min: int
    wave_bound: int  # bytes a rank may hold in one wave (--memory-budget)
    planner_rss: int  # peak RSS of the planning process


def hf_chunks(cfg: Any, dtype: torch.dtype = torch.bfloat16, shards: int = HF_SHARDS["DeepSeek-V3"]
              ) -> list[SourceChunk]:
    """The chunks ``HFFormat`` indexes for an HF release of ``cfg`` in ``shards`` files."""
    tensors = hf_tensors(cfg)
    sizes = [(k, numel(shape) * dtype.itemsize) for k, (shape, _) in tensors.items()]
    packs = pack_shards(sizes, -(-sum(n for _, n in sizes) // shards))
    file_of = {k: i for i, names in enumerate(packs) for k in names}
    return [SourceChunk(id=i, file=f"model-{file_of[k] + 1:05d}-of-{len(packs):05d}.safetensors", key=k, shape=shape,
                        dtype=dtype, pieces=pieces, offsets=(0,) * len(shape), sliceable=True)
            for i, (k, (shape, pieces)) in enumerate(tensors.items())]


def torch_dist_chunks(target: Target, dtypes: dict[str, torch.dtype]) -> list[SourceChunk]:
    """The chunks ``TorchDistFormat`` indexes for a save at ``target.layout``: its stored chunks."""
    files = TorchDistFormat().target_files(target, dtypes)
    return [SourceChunk(id=i, file=t.key, key=t.key, shape=t.shape, dtype=t.dtype, pieces=t.pieces, offsets=t.offsets,
                        sliceable=True, contiguous_cuts=True, origin=t.offsets, origin_shape=t.shape)
            for i, t in enumerate(t for f in files for t in f.tensors)]


def plan_case(case: str, budget: int = 4 << 30) -> PlanFigures:
    model, src_layout, dst_layout, world = CASES[case]
    t0 = time.perf_counter()
    cfg, args, _ = config_from_hf(MODELS[model], None)
    origin = Origin(kind="hf", hf_config=MODELS[model])
    dtypes = dict.fromkeys(logical_tensors(cfg), torch.bfloat16)
    dtypes.update({n: torch.float32 for n in dtypes if n.endswith(".mlp.router.expert_bias")})
    if src_layout is None:
        chunks = hf_chunks(cfg, shards=HF_SHARDS[model])
    else:
        cfg.check_layout(src_layout, "source")
        chunks = torch_dist_chunks(Target(cfg=cfg, layout=src_layout, dtype=None, args=args, iteration=0,
                                          origin=origin), dtypes)
    cfg.check_layout(dst_layout)
    target = Target(cfg=cfg, layout=dst_layout, dtype=None, args=args, iteration=0, origin=origin)
    files: list[TargetFile] = split_files(TorchDistFormat().target_files(target, dtypes), world)
    cut = split_chunks(chunks, files, budget // 4)
    lnumel = {n: numel(t.shape) for n, t in logical_tensors(cfg).items()}
    plan = make_plan(cut, files, world, budget, lnumel)
    elapsed = time.perf_counter() - t0
    return PlanFigures(case=case, world=world, params=sum(lnumel.values()), source_chunks=len(chunks),
                       read_chunks=len(cut), target_files=len(files), waves=len(plan.waves), plan_s=elapsed,
                       read_max=max(plan.read_bytes), read_min=min(plan.read_bytes), write_max=max(plan.write_bytes),
                       write_min=min(plan.write_bytes), wave_bound=budget, planner_rss=peak_rss_bytes())


def run_plan_scale() -> list[dict[str, Any]]:
    """Every case, printed as a table; returned as dicts (bench --json)."""
    rows = [dataclasses.asdict(plan_case(c)) for c in CASES]
    print(f"{'case':34} {'ranks':>5} {'chunks':>8} {'files':>6} {'waves':>5} {'plan s':>7} "
          f"{'read/rank':>19} {'write/rank':>19} {'planner RSS':>11}")
    for r in rows:
        print(f"{r['case']:34} {r['world']:5d} {r['read_chunks']:8d} {r['target_files']:6d} {r['waves']:5d} "
              f"{r['plan_s']:7.1f} {human(r['read_min']):>8}-{human(r['read_max']):>9} "
              f"{human(r['write_min']):>8}-{human(r['write_max']):>9} {human(r['planner_rss']):>11}")
    return rows
