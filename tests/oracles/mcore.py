"""Independent test oracle for Megatron-Core GPT checkpoints.

Uses only megatron-core (never the dist_convert package) to
  * make source checkpoints in both Megatron-LM layouts (torch_dist and legacy), and
  * check converted checkpoints against a reference (strict load + tensor equality), and
  * compute full-vocab logits of a checkpoint (TP, and EP for MoE models; no PP) for numerical
    cross-layout checks.

Launch (world size must equal tp * pp for dense models; for MoE models (config with num_experts)
it is tp * pp * dp for some dp >= 1, and megatron-core requires ep * etp to divide tp * dp):

  torchrun --nproc_per_node=N tests/oracles/mcore.py make --config C.json --tp T --pp P \
      [--vpp V] [--first N] [--last M] --seed S --iteration I --out-torch-dist D1 --out-megatron D2
  torchrun --nproc_per_node=N tests/oracles/mcore.py compare --config C.json --tp T --pp P \
      [--vpp V] [--first N] [--last M] --ckpt X --ref R [--ckpt-format auto|torch_dist|megatron] \
      [--ref-format auto|torch_dist|megatron] [--check-args]
  torchrun --nproc_per_node=T tests/oracles/mcore.py logits --config C.json --tp T [--pp 1] \
      --ckpt X --out FILE.pt [--seed S] [--ckpt-format ...]
  torchrun --nproc_per_node=T tests/oracles/mcore.py mtp --config C.json --tp T --ckpt X [--seed S]
  torchrun --nproc_per_node=N tests/oracles/mcore.py layout --config C.json --tp T --pp P \
      [--vpp V] [--first N] [--last M] --out FILE.json
  torchrun --nproc_per_node=T*P tests/oracles/mcore.py dump --config C.json --tp T --pp P --ckpt X --out DIR

All commands also take --ep E (expert_model_parallel_size, default 1) and --etp T
(expert_tensor_parallel_size, default: the same as --tp); E > 1 or T != tp need an MoE config.

`compare` prints one MISMATCH line per differing tensor and exits 1 if any rank saw one;
on success rank 0 prints "ORACLE OK <n> tensors" (n summed over ranks) and exits 0.

--vpp V (V >= 2, needs P >= 2) uses the interleaved (virtual pipeline) schedule the way Megatron-LM
does: initialize_model_parallel(..., virtual_pipeline_model_parallel_size=V), and every rank builds
V model chunks GPTModel(..., vp_stage=v) with TransformerConfig.virtual_pipeline_model_parallel_size=V,
pre_process only on pp rank 0 chunk 0 and post_process only on the last pp rank chunk V-1
(with even stages, chunk v on pp rank p holds global layers v*L/V + p*L/(P*V) .. + L/(P*V)).
Checkpoints then hold one entry per chunk, "model0" .. "model{V-1}", instead of "model": the
torch_dist sharded state dict is {"model{v}": chunk_v.sharded_state_dict()} (global, layout-free
keys), and each legacy mp_rank_TT_PPP/model_optim_rng.pt holds chunk_v.state_dict() (layer numbers
local to the chunk) under "model{v}". args.virtual_pipeline_model_parallel_size is V (None without
--vpp) and `compare --check-args` checks it. Without --vpp everything is as before.

--pipeline-layout STR (megatron-core >= 0.13) places the layers with a pipeline_model_parallel_layout
string (e.g. "Et|tt|t|tL"; stages listed VPP-major): TransformerConfig(pipeline_model_parallel_layout=STR)
builds every chunk, the VPP size is the number of stages / P (as Megatron-LM derives it; --vpp may not
disagree, --first/--last may not be given), and args get pipeline_model_parallel_layout=STR with
decoder_first/last_pipeline_num_layers and num_layers_per_virtual_pipeline_stage None; `compare
--check-args` checks the string.

Random values (`make`) depend on the seed, the TP rank (for TP-sharded tensors) and the logical
tensor with its GLOBAL layer number, not on the PP/VPP layout: the same seed and TP give the same
model at any --pp/--vpp/--first/--last, so e.g. a VPP checkpoint compares OK at --pp 1 against a
non-VPP one made with the same seed.

Config JSON uses Megatron-LM argparse names: num_layers, hidden_size, ffn_hidden_size,
num_attention_heads, num_query_groups, kv_channels, swiglu, normalization, add_bias_linear,
add_qkv_bias, untie_embeddings_and_output_weights, vocab_size (true vocab),
make_vocab_size_divisible_by, position_embedding_type, max_position_embeddings, seq_length,
qk_layernorm, and optionally norm_epsilon, rotary_base, rotary_percent, use_rope_scaling,
rope_scaling_factor (Llama-3 RoPE scaling). A rotary_percent other than 1 (partial RoPE, GLM-4.5) is
also checked by `compare --check-args`.

gpt-oss keys (each passed on only when a config gives it; Megatron-LM / TransformerConfig names):
softmax_type ("learnable": attention sinks, DotProductAttention's softmax_offset [heads / tp]),
quick_geglu (a gated MLP with megatron-core's quick_gelu, x * sigmoid(1.702 x), as Megatron-LM's
--quick-geglu), glu_linear_offset, activation_func_clamp_value, window_size ([left, right]) and
window_attn_skip_freq (int or 0/1 list, 1 = sliding), and position_embedding_type "yarn" for GQA
models with rotary_scaling_factor, yarn_original_max_position_embeddings, yarn_beta_fast,
yarn_beta_slow, yarn_correction_range_round_to_int, mscale, mscale_all_dim: set on the config as
config.yarn_* attributes the way Megatron-LM 0.19 does (argument_utils._apply_yarn_config_from_args;
megatron-core 0.16.1's GPTModel and attention read them with getattr). On CPU, megatron-core's
local attention runs the sinks (SoftmaxOne) and the sliding window (FusedScaleMaskSoftmax's torch
path) itself; only the window's mask is built on the CPU instead of "cuda" (see apply_cpu_shims).

Mixture of Experts (MoE): a config with num_experts (absent or null = dense, everything as above)
may also give moe_ffn_hidden_size (default ffn_hidden_size), moe_shared_expert_intermediate_size
(default null = no shared expert), moe_shared_expert_gate (false), moe_layer_freq (int N: MoE iff
layer % N == 0, or a list of 0/1 per layer; default 1; megatron-core stores per-layer torch_dist keys
for a list or N > 1, stacked keys for 1), moe_router_topk (2), moe_router_enable_expert_bias (false;
needs moe_router_score_function "sigmoid"), moe_router_score_function ("softmax"),
moe_router_pre_softmax (false). The model is built with
get_gpt_decoder_block_spec(use_transformer_engine=False) (SequentialMLP experts, shared experts,
mixed dense/MoE layers), the "allgather" token dispatcher (alltoall needs CUDA) and no grouped GEMM.
Expert layout: initialize_model_parallel(..., expert_model_parallel_size=E,
expert_tensor_parallel_size=T); routed experts are cut by the expert-TP group, shared experts by the
attention TP group, the router (and router.expert_bias, an fp32 buffer that `make` also fills) is
replicated. Random values of expert tensors depend on the seed, the GLOBAL expert index and the
expert-TP rank, not on EP/DP, so the same seed (and TP/ETP) gives the same model at any --ep.
args get num_experts and the moe_* keys above (moe_layer_freq as given), moe_grouped_gemm=False,
expert_model_parallel_size=E and expert_tensor_parallel_size (the effective value); `compare
--check-args` checks them. Legacy (megatron) rank dirs are mp_rank_TT[_PPP][_EEE] (Megatron-LM's
get_checkpoint_name: _PPP only with pp > 1, _EEE = expert-parallel rank only with ep > 1, TT = the
attention TP rank); only expert-data-parallel rank 0 writes them, and the legacy format is refused
when etp != tp (Megatron-LM cannot name those files). torch_dist saves dedupe DP replicas themselves.
`layout` also records each rank's ep_rank and etp_rank.

DeepSeek-style routing (MoE configs; keys set only when a config gives one, or uses MLA):
moe_router_num_groups, moe_router_group_topk (group-limited top-k: megatron-core scores a group by
the sum of its top (topk / group_topk) scores), moe_router_topk_scaling_factor, moe_router_dtype
("fp32"/"fp64"/null); with moe_router_score_function "sigmoid" and moe_router_enable_expert_bias.
args get them and `compare --check-args` checks them.

Multi-Latent Attention (MLA): multi_latent_attention true with q_lora_rank (null = no q LoRA: one
linear_q_proj), kv_lora_rank, qk_head_dim (the no-RoPE part), qk_pos_emb_head_dim, v_head_dim and
rope_type ("rope": plain RoPE with rotary_base, softmax scale 1/sqrt(qk_head_dim + qk_pos_emb_head_dim);
"yarn" passes rotary_scaling_factor, original_max_position_embeddings, beta_fast, beta_slow, mscale,
mscale_all_dim through, untested); num_query_groups must equal the heads. Built with
MLATransformerConfig and get_gpt_decoder_block_spec(use_transformer_engine=False) (also for dense
MLA models); qk_layernorm true gives the q/kv layernorms. The CPU shims MLA needs (0.16.1:
multi_latent_attention.HAVE_TE = False without TE; a local DotProductAttention that accepts MLA's
k_channels/v_channels and sizes its output by v_head_dim; without q LoRA the spec's q_layernorm is
IdentityOp, as 0.19 demands and 0.16 ignores, and 0.19's resolver keeps the spec's plain
linear_q_proj instead of demanding a fused norm+linear the local backend lacks) are applied only when
an MLA model is built. MLA applies
RoPE to de-interleaved rope dims (rope_utils: t[..., 0::2], t[..., 1::2]) like HF's
rope_interleave=True, so HF DeepSeek weights need no RoPE permutation.
The local MLA spec's tensors (0.16.1 and 0.19.2 alike; torch_dist key = legacy name here):
  decoder.layers.L.input_layernorm.weight, .pre_mlp_layernorm.weight (NOT remapped to
  linear_qkv.layer_norm_weight / linear_fc1.layer_norm_weight as in the GQA local spec; dense
  layers too), .self_attention.{linear_q_down_proj, linear_q_up_proj | linear_q_proj,
  linear_kv_down_proj, linear_kv_up_proj, linear_proj}.weight, .self_attention.{q_layernorm,
  kv_layernorm}.weight. linear_q_down_proj [q_lora_rank, h] and linear_kv_down_proj
  [kv_lora_rank + qk_pos_emb_head_dim, h] are ColumnParallelLinear in the local spec: their output
  dim 0 IS split over TP (megatron-core gathers the output before the layernorm); the TE spec makes
  them replicated TELinear instead. linear_q_up_proj [heads * (qk_head_dim + qk_pos_emb_head_dim),
  q_lora_rank], linear_q_proj [same, h] and linear_kv_up_proj [heads * (qk_head_dim + v_head_dim),
  kv_lora_rank] split dim 0 (per head: [nope; rope] and [k_nope; v]); linear_proj [h, heads *
  v_head_dim] splits dim 1; the layernorms are replicated.

Multi-Token Prediction (MTP): mtp_num_layers N (null = none; mtp_loss_scaling_factor default 0.1)
builds megatron-core's MTP block (get_gpt_mtp_block_spec over the stage's block spec: the MTP
layer's transformer layer is the last decoder layer's spec) on the last PP stage: keys
mtp.layers.K.{enorm, hnorm, eh_proj [h, 2h], final_layernorm}.weight and
mtp.layers.K.transformer_layer.<a decoder layer's names> (per MTP layer, no stacked layer axis;
megatron-core >= 0.17 names the module mtp_model_layer, so its legacy state_dict says
mtp.layers.K.mtp_model_layer.* while torch_dist keeps transformer_layer). With PP > 1 the last stage
also holds an embedding replica (the MTP input embedding), saved in torch_dist as a replica of
embedding.word_embeddings.weight and present in that stage's legacy state_dict; the models are
then asked for sharded_state_dict(metadata={"dp_cp_group": ...}) (megatron-core needs it there).
`make` randomises the MTP layers too (same values from 0.16 and 0.19 for one seed); `logits` returns
the main head's logits (megatron-core's MTP forward needs labels: next-token labels are given and the
output layer's last call is kept); `mtp` runs the forward with labels and prints
"ORACLE MTP depth=1 loss=X main_loss=Y", exit 1 if a loss is not finite. args get
multi_latent_attention, q_lora_rank, kv_lora_rank, qk_head_dim, qk_pos_emb_head_dim, v_head_dim,
rope_type and mtp_num_layers; `compare --check-args` checks them (and that a config without MLA/MTP
has no multi_latent_attention / mtp_num_layers set in the checkpoint args).
"""

import argparse
import json
import math
import os
import re
import sys
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the oracles package, helpers

from oracles.common import apply_cpu_shims, detect_format, end_parallel, iter_dir_name, resolve_iter_dir, run_program  # noqa: E402

# ----------------------------------------------------------------------------- config / args


def load_config(path):
    with open(path) as f:
        cfg = json.load(f)
    heads = cfg["num_attention_heads"]
    hidden = cfg["hidden_size"]
    cfg.setdefault("num_query_groups", heads)
    if cfg["num_query_groups"] is None:
        cfg["num_query_groups"] = heads
    cfg.setdefault("kv_channels", None)
    if cfg["kv_channels"] is None:
        cfg["kv_channels"] = hidden // heads
    cfg.setdefault("swiglu", False)
    if cfg.get("ffn_hidden_size") is None:  # Megatron-LM defaults
        cfg["ffn_hidden_size"] = (
            int((4 * hidden * 2 / 3) / 64) * 64 if cfg["swiglu"] else 4 * hidden
        )
    cfg.setdefault("normalization", "LayerNorm")
    cfg.setdefault("add_bias_linear", True)
    cfg.setdefault("add_qkv_bias", False)
    cfg.setdefault("untie_embeddings_and_output_weights", False)
    cfg.setdefault("make_vocab_size_divisible_by", 128)
    cfg.setdefault("position_embedding_type", "learned_absolute")
    cfg.setdefault("seq_length", cfg.get("max_position_embeddings"))
    cfg.setdefault("max_position_embeddings", cfg["seq_length"])
    cfg.setdefault("qk_layernorm", False)
    cfg.setdefault("norm_epsilon", 1e-5)
    cfg.setdefault("rotary_base", 10000)
    cfg.setdefault("rotary_percent", 1.0)
    cfg["group_query_attention"] = cfg["num_query_groups"] < heads
    if cfg.get("num_experts") is not None:  # MoE; dense configs get no new keys (their args stay as before)
        if cfg.get("moe_ffn_hidden_size") is None:  # Megatron-LM validate_args default
            cfg["moe_ffn_hidden_size"] = cfg["ffn_hidden_size"]
        cfg.setdefault("moe_shared_expert_intermediate_size", None)
        cfg.setdefault("moe_shared_expert_gate", False)
        cfg.setdefault("moe_layer_freq", 1)
        cfg.setdefault("moe_router_topk", 2)
        cfg.setdefault("moe_router_enable_expert_bias", False)
        cfg.setdefault("moe_router_score_function", "softmax")
        cfg.setdefault("moe_router_pre_softmax", False)
        if any(cfg.get(k) is not None for k in MOE_ROUTER_EXTRA) or cfg.get("multi_latent_attention"):
            for k, v in MOE_ROUTER_EXTRA.items():  # DeepSeek routing keys (only for configs that use them)
                cfg.setdefault(k, v)
        freq = cfg["moe_layer_freq"]
        if isinstance(freq, bool) or not (
            (isinstance(freq, int) and freq >= 1)
            or (isinstance(freq, list) and len(freq) == cfg["num_layers"] and set(freq) <= {0, 1})
        ):
            raise SystemExit(f"moe_layer_freq {freq!r}: need an int >= 1 or a list of num_layers 0/1")
    if cfg.get("multi_latent_attention"):  # MLA; other configs get no MLA keys
        for k, v in MLA_DEFAULTS.items():
            cfg.setdefault(k, v)
        if cfg["num_query_groups"] != heads:
            raise SystemExit("multi_latent_attention: num_query_groups must equal num_attention_heads")
        if cfg["rope_type"] not in ("rope", "yarn"):
            raise SystemExit(f"rope_type {cfg['rope_type']!r}: need 'rope' or 'yarn'")
    if cfg.get("mtp_num_layers") is not None:
        if not (isinstance(cfg["mtp_num_layers"], int) and cfg["mtp_num_layers"] >= 1):
            raise SystemExit(f"mtp_num_layers {cfg['mtp_num_layers']!r}: need an int >= 1 (or null)")
        cfg.setdefault("mtp_loss_scaling_factor", 0.1)
    return cfg


# DeepSeek-style router keys (Megatron-LM names and defaults); set only when a config gives one of
# them or uses MLA, so the args of older MoE configs stay as they were.
MOE_ROUTER_EXTRA = {"moe_router_num_groups": None, "moe_router_group_topk": None,
                    "moe_router_topk_scaling_factor": None, "moe_router_dtype": None}
# Multi-Latent Attention keys (Megatron-LM names; defaults of MLATransformerConfig except rope_type,
# which is plain RoPE here unless a config says "yarn").
MLA_DEFAULTS = {"q_lora_rank": None, "kv_lora_rank": 512, "qk_head_dim": 128, "qk_pos_emb_head_dim": 64,
                "v_head_dim": 128, "rope_type": "rope"}
# gpt-oss (TransformerConfig names); passed on only when a config gives them
GPT_OSS_KEYS = ("softmax_type", "glu_linear_offset", "activation_func_clamp_value", "window_size",
                "window_attn_skip_freq")
# settings Megatron-LM passes to TransformerConfig under their own names (core_transformer_config_from_args copies
# every args field a TransformerConfig field shares); passed on only when a config gives them
SETTINGS_KEYS = ("rotary_interleaved", "qk_l2_norm", "softmax_scale", "apply_residual_connection_post_layernorm",
                 "attention_output_gate", "layernorm_zero_centered_gamma")
# YaRN of GQA models: (config attribute, Megatron-LM args name, default of Megatron-LM 0.19)
YARN_GQA = (("yarn_rotary_scaling_factor", "rotary_scaling_factor", 1.0),
            ("yarn_original_max_position_embeddings", "yarn_original_max_position_embeddings", 4096),
            ("yarn_beta_fast", "yarn_beta_fast", 32.0), ("yarn_beta_slow", "yarn_beta_slow", 1.0),
            ("yarn_mscale", "mscale", 1.0), ("yarn_mscale_all_dim", "mscale_all_dim", 0.0),
            ("yarn_correction_range_round_to_int", "yarn_correction_range_round_to_int", True))
YARN_KEYS = ("rotary_scaling_factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
             "mscale", "mscale_all_dim")


def is_mla(cfg):
    return bool(cfg.get("multi_latent_attention"))


def has_mtp(cfg):
    return cfg.get("mtp_num_layers") is not None


def is_moe(cfg):
    return cfg.get("num_experts") is not None


def expert_tp(cfg, tp, etp):
    """Effective expert tensor-parallel size (None -> tp, as megatron-core and Megatron-LM)."""
    return tp if etp is None else etp


def padded_vocab(cfg, tp):
    mult = cfg["make_vocab_size_divisible_by"] * tp
    return int(math.ceil(cfg["vocab_size"] / mult) * mult)


def make_args(cfg, tp, pp, first, last, iteration, ckpt_format, vpp=None, ep=1, etp=None, layout=None):
    import torch

    d = dict(cfg)
    d.update(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        padded_vocab_size=padded_vocab(cfg, tp),
        decoder_first_pipeline_num_layers=first,
        decoder_last_pipeline_num_layers=last,
        transformer_impl="local",
        params_dtype=torch.float32,
        bf16=False,
        fp16=False,
        virtual_pipeline_model_parallel_size=vpp,
        iteration=iteration,
        ckpt_format=ckpt_format,
        use_rotary_position_embeddings=cfg["position_embedding_type"] == "rope",
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    if vpp is not None:
        # Megatron-LM derives V from one of these flags (uneven stages need the second one)
        uneven = first is not None or last is not None
        d.update(
            num_layers_per_virtual_pipeline_stage=None if uneven or layout else cfg["num_layers"] // (pp * vpp),
            num_virtual_stages_per_pipeline_rank=vpp if uneven else None,
        )
    if layout is not None:  # Megatron-LM derives V from the string; no per-stage flags with it
        d.update(pipeline_model_parallel_layout=layout)
    if is_mla(cfg) or has_mtp(cfg):  # the MLA/MTP keys of cfg are already in d
        d.setdefault("multi_latent_attention", False)
        d.setdefault("mtp_num_layers", None)
    if is_moe(cfg):  # the MoE keys of cfg are already in d (moe_layer_freq as given: int or list)
        d.update(
            moe_grouped_gemm=False,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=expert_tp(cfg, tp, etp),
        )
    return argparse.Namespace(**d)


# ----------------------------------------------------------------------------- model


def init_parallel(tp, pp, vpp=None, ep=1, etp=None, cfg=None):
    """Dense (cfg None or without num_experts): world must be tp*pp, no --ep/--etp. MoE: world =
    tp*pp*dp, ep*etp must divide tp*dp and num_experts % ep == 0."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        dist.init_process_group(backend="gloo")
    ws = dist.get_world_size()
    extra = {}
    if cfg is not None and is_moe(cfg):
        e_tp = expert_tp(cfg, tp, etp)
        if ep < 1 or e_tp < 1 or ws % (tp * pp):
            raise SystemExit(f"world size {ws} is not a multiple of tp*pp = {tp}*{pp} (or bad --ep/--etp)")
        dp = ws // (tp * pp)
        if (tp * dp) % (ep * e_tp):
            raise SystemExit(f"ep*etp = {ep}*{e_tp} must divide tp*dp = {tp}*{dp} (world {ws}, pp {pp})")
        if cfg["num_experts"] % ep:
            raise SystemExit(f"num_experts {cfg['num_experts']} not divisible by --ep {ep}")
        extra = dict(expert_model_parallel_size=ep, expert_tensor_parallel_size=e_tp)
    else:
        if ep != 1 or (etp is not None and etp != tp):
            raise SystemExit("--ep/--etp need an MoE config (num_experts)")
        if ws != tp * pp:
            raise SystemExit(f"world size {ws} != tp*pp = {tp}*{pp}")
    if vpp is not None and (vpp < 2 or pp < 2):
        raise SystemExit(f"--vpp {vpp} needs --vpp >= 2 and --pp >= 2 (Megatron-LM drops a VPP of 1)")
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        **extra,
    )
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))


def transformer_config(cfg, tp, pp, first=None, last=None, vpp=None, ep=1, etp=None, layout=None):
    """The TransformerConfig of config ``cfg`` at this layout, as Megatron-LM's core_transformer_config_from_args
    makes it (shared by GPTModel here and oracles/hybrid.py's HybridModel)."""
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    extra = {}
    if is_moe(cfg):
        extra.update(
            num_moe_experts=cfg["num_experts"],
            moe_ffn_hidden_size=cfg["moe_ffn_hidden_size"],
            moe_layer_freq=cfg["moe_layer_freq"],
            moe_router_topk=cfg["moe_router_topk"],
            moe_shared_expert_intermediate_size=cfg["moe_shared_expert_intermediate_size"],
            moe_shared_expert_gate=cfg["moe_shared_expert_gate"],
            moe_router_enable_expert_bias=cfg["moe_router_enable_expert_bias"],
            moe_router_score_function=cfg["moe_router_score_function"],
            moe_router_pre_softmax=cfg["moe_router_pre_softmax"],
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=expert_tp(cfg, tp, etp),
            moe_token_dispatcher_type="allgather",  # alltoall builds torch.cuda.Stream() (token_dispatcher.py:445)
            moe_grouped_gemm=False,
        )
        for k in MOE_ROUTER_EXTRA:  # DeepSeek routing (TransformerConfig has the same names)
            if cfg.get(k) is not None:
                extra[k] = cfg[k]
    config_cls = TransformerConfig
    if is_mla(cfg):
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        apply_mla_shims()
        config_cls = MLATransformerConfig
        extra.update(
            q_lora_rank=cfg["q_lora_rank"], kv_lora_rank=cfg["kv_lora_rank"], qk_head_dim=cfg["qk_head_dim"],
            qk_pos_emb_head_dim=cfg["qk_pos_emb_head_dim"], v_head_dim=cfg["v_head_dim"],
            rope_type=cfg["rope_type"], rotary_base=cfg["rotary_base"], rotary_percent=cfg["rotary_percent"],
            apply_rope_fusion=False,
        )
        if cfg["rope_type"] == "rope":
            extra.update(rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)  # softmax scale 1/sqrt(d)
        else:
            extra.update({k: cfg[k] for k in YARN_KEYS if cfg.get(k) is not None})
    if has_mtp(cfg):
        extra.update(mtp_num_layers=cfg["mtp_num_layers"], mtp_loss_scaling_factor=cfg["mtp_loss_scaling_factor"])
    for k in GPT_OSS_KEYS + SETTINGS_KEYS:  # TransformerConfig has the same names
        if cfg.get(k) is not None:
            extra[k] = tuple(cfg[k]) if k == "window_size" else cfg[k]
    activation = F.silu if cfg["swiglu"] else F.gelu
    if cfg.get("quick_geglu"):  # as Megatron-LM's --quick-geglu (core_transformer_config_from_args)
        from megatron.core.fusions.fused_bias_geglu import quick_gelu

        activation = quick_gelu
    elif cfg.get("squared_relu"):  # Megatron-LM's --squared-relu
        from megatron.core.activations import squared_relu

        activation = squared_relu
    elif cfg.get("openai_gelu") and not cfg["swiglu"]:  # Megatron-LM's --openai-gelu
        from megatron.core.transformer.utils import openai_gelu

        activation = openai_gelu
    if first is not None:
        extra["num_layers_in_first_pipeline_stage"] = first
    if last is not None:
        extra["num_layers_in_last_pipeline_stage"] = last
    if vpp is not None:
        extra["virtual_pipeline_model_parallel_size"] = vpp
    if layout is not None:
        extra["pipeline_model_parallel_layout"] = layout
    config = config_cls(
        num_layers=cfg["num_layers"],
        hidden_size=cfg["hidden_size"],
        ffn_hidden_size=cfg["ffn_hidden_size"],
        num_attention_heads=cfg["num_attention_heads"],
        num_query_groups=cfg["num_query_groups"],
        kv_channels=cfg["kv_channels"],
        normalization=cfg["normalization"],
        layernorm_epsilon=cfg["norm_epsilon"],
        add_bias_linear=cfg["add_bias_linear"],
        add_qkv_bias=cfg["add_qkv_bias"],
        gated_linear_unit=cfg["swiglu"] or bool(cfg.get("quick_geglu")),
        activation_func=activation,
        qk_layernorm=cfg["qk_layernorm"],
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32,
        params_dtype=torch.float32,
        use_cpu_initialization=True,
        perform_initialization=True,
        **extra,
    )
    if cfg["position_embedding_type"] == "yarn" and not is_mla(cfg):
        for attr, key, default in YARN_GQA:  # Megatron-LM 0.19's _apply_yarn_config_from_args
            setattr(config, attr, cfg[key] if cfg.get(key) is not None else default)
    return config


def build_model(cfg, tp, pp, first=None, last=None, parallel_output=True, vpp=None, vp_stage=None,
                ep=1, etp=None, layout=None):
    """One GPTModel; with vpp, the chunk for virtual stage vp_stage (as Megatron-LM's get_model)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec

    config = transformer_config(cfg, tp, pp, first, last, vpp, ep, etp, layout)
    if is_moe(cfg) or is_mla(cfg):
        # the block spec gives mixed dense/MoE layers (get_gpt_layer_local_spec(num_experts=N) makes
        # every layer MoE) and MLA layers from config.multi_latent_attention; qk_layernorm (MLA: the
        # q/kv layernorms) comes from config.qk_layernorm
        spec = get_gpt_decoder_block_spec(
            config, use_transformer_engine=False, normalization=cfg["normalization"], vp_stage=vp_stage
        )
        if is_mla(cfg):
            for layer_spec in spec.layer_specs:
                use_mla_core_attention(layer_spec, cfg["q_lora_rank"])
    else:
        spec = get_gpt_layer_local_spec(
            normalization=cfg["normalization"], qk_layernorm=cfg["qk_layernorm"], qk_l2_norm=bool(cfg.get("qk_l2_norm"))
        )
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab(cfg, tp),
        max_sequence_length=cfg["max_position_embeddings"],
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
        parallel_output=parallel_output,
        share_embeddings_and_output_weights=not cfg["untie_embeddings_and_output_weights"],
        position_embedding_type=cfg["position_embedding_type"],
        rotary_percent=cfg["rotary_percent"],
        rotary_base=cfg["rotary_base"],
        rope_scaling=cfg.get("use_rope_scaling", False),
        rope_scaling_factor=cfg.get("rope_scaling_factor", 8.0),
        seq_len_interpolation_factor=cfg.get("rotary_seq_len_interpolation_factor"),
        vp_stage=vp_stage,
        **({"mtp_block_spec": mtp_spec(config, spec, cfg, vp_stage)} if has_mtp(cfg) else {}),
    )
    return model


def mtp_spec(config, spec, cfg, vp_stage):
    """The MTP block spec as Megatron-LM's gpt_builders makes it: megatron-core's
    get_gpt_mtp_block_spec over this stage's decoder block spec (its last layer spec is the MTP
    layer's transformer layer), or, on a stage without decoder layers, over the layer spec a
    Megatron-LM run would use (MoE if the config has experts). None on stages without MTP."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec

    if hasattr(spec, "layer_specs") and not spec.layer_specs:
        spec = get_gpt_layer_local_spec(
            num_experts=cfg.get("num_experts"), moe_grouped_gemm=False, qk_layernorm=cfg["qk_layernorm"],
            multi_latent_attention=is_mla(cfg), normalization=cfg["normalization"])
        if is_mla(cfg):
            use_mla_core_attention(spec, cfg["q_lora_rank"])
    return get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False, vp_stage=vp_stage)


def apply_mla_shims():
    """CPU shims for megatron-core's MLA without Transformer Engine, applied only when an MLA model
    is built (see FIELD_NOTES): megatron-core 0.16.1 imports TE names even without TE (its
    multi_latent_attention sets HAVE_TE = True and then isinstance-checks linear_proj against a
    stand-in TELinear) -> HAVE_TE = False there when transformer_engine is not importable.
    (torch.cuda.current_device -> "cpu", which MLA's RoPE needs, is in apply_cpu_shims.)"""
    import importlib.util

    from megatron.core.transformer import multi_latent_attention as mla

    if importlib.util.find_spec("transformer_engine") is None:
        mla.HAVE_TE = False
        _local_q_proj_without_q_lora()


def _local_q_proj_without_q_lora():
    """megatron-core >= 0.19 (mla_qk_norm_config.QKNormConfigResolver): with qk_layernorm and no q LoRA it
    insists on the backend's fused norm+linear for linear_q_proj (in the TE spec that norm is the fused
    input layernorm); the local backend has none (and without TE the TE backend's is a stand-in), so no
    local MLA model without q LoRA builds. Keep the spec's plain linear_q_proj (the local spec has a
    separate input_layernorm): the 0.16 model, keys unchanged. Only without Transformer Engine."""
    try:
        from megatron.core.transformer import mla_qk_norm_config as qk
    except ImportError:  # 0.16: no resolver
        return
    cls = qk.QKNormConfigResolver
    if getattr(cls, "_oracle_patched", False):
        return
    orig = cls._mla_fused_linear_or_default

    def pick(self, module_spec, module_name):
        if module_name == "linear_q_proj" and module_spec is not None and not self._is_fused_norm_linear(module_spec):
            return module_spec
        return orig(self, module_spec, module_name)

    cls._mla_fused_linear_or_default = pick
    cls._oracle_patched = True


_MLA_DPA = None


def mla_core_attention_cls():
    """The local DotProductAttention with MLA's k_channels/v_channels: megatron-core's MLA passes
    k_channels=qk_head_dim+qk_pos_emb_head_dim and v_channels=v_head_dim (only TE's attention takes
    them); the local one sizes its output by kv_channels * heads, so this subclass sizes it by
    v_channels (the scores are q.k with the softmax_scale MLA passes)."""
    global _MLA_DPA
    if _MLA_DPA is None:
        from megatron.core import parallel_state
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        class MLADotProductAttention(DotProductAttention):
            def __init__(self, *args, k_channels=None, v_channels=None, **kw):
                super().__init__(*args, **kw)
                if v_channels is not None:
                    tp = self.pg_collection.tp.size() if getattr(self, "pg_collection", None) is not None \
                        else parallel_state.get_tensor_model_parallel_world_size()
                    self.hidden_size_per_partition = v_channels * self.config.num_attention_heads // tp
                    self.hidden_size_per_attention_head = v_channels

        _MLA_DPA = MLADotProductAttention
    return _MLA_DPA


def use_mla_core_attention(layer_spec, q_lora_rank="unset"):
    """Swap the local DotProductAttention of an MLA layer spec for mla_core_attention_cls(). Without q
    LoRA (q_lora_rank None) the spec's q_layernorm becomes IdentityOp: megatron-core builds no
    q_layernorm then (0.16 ignores the spec's; 0.19 refuses a non-trivial one), so the keys are the same."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.identity_op import IdentityOp

    sub = getattr(getattr(layer_spec, "submodules", None), "self_attention", None)
    sub = getattr(sub, "submodules", None)
    if sub is None:
        return
    if getattr(sub, "core_attention", None) is DotProductAttention:
        sub.core_attention = mla_core_attention_cls()
    if q_lora_rank is None and hasattr(sub, "q_layernorm"):
        sub.q_layernorm = IdentityOp


def build_chunks(cfg, tp, pp, first=None, last=None, vpp=None, parallel_output=True, ep=1, etp=None,
                 layout=None):
    """This rank's model chunks: [model] without VPP, else one chunk per virtual stage 0..vpp-1."""
    if vpp is None:
        return [build_model(cfg, tp, pp, first, last, parallel_output, ep=ep, etp=etp, layout=layout)]
    return [build_model(cfg, tp, pp, first, last, parallel_output, vpp=vpp, vp_stage=v, ep=ep, etp=etp,
                        layout=layout) for v in range(vpp)]


def sharded_sd(model):
    """model.sharded_state_dict() as Megatron-LM asks for it. With MTP on a stage without the
    embedding (PP > 1), megatron-core's GPTModel ties the stage's embedding replica through
    metadata["dp_cp_group"] (gpt_model.py sharded_state_dict), so MTP models get that metadata;
    other models are asked exactly as before (no metadata)."""
    if getattr(model.config, "mtp_num_layers", None) is None:
        return model.sharded_state_dict()
    from megatron.core import parallel_state

    return model.sharded_state_dict(
        metadata={"dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)})


def model_keys(vpp):
    """Checkpoint entries holding the model chunks, as Megatron-LM names them."""
    return ["model"] if vpp is None else [f"model{v}" for v in range(vpp)]


def global_param_name(model, name):
    """`name` with the chunk-local decoder layer index replaced by the global (0-based) layer."""
    m = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
    if m is None or not hasattr(model, "decoder"):
        return name
    layer_number = getattr(model.decoder.layers[int(m.group(1))], "layer_number", None)  # 1-based, global
    if layer_number is None:
        return name
    return f"decoder.layers.{layer_number - 1}.{m.group(2)}"


def seed_name(model, name):
    """The name a tensor's random values are keyed by: the global layer number, and the MTP layer's
    transformer layer as `transformer_layer` (megatron-core >= 0.17 calls the module mtp_model_layer,
    0.16 transformer_layer; torch_dist keys say transformer_layer in both), so both runtimes make the
    same model from the same seed."""
    return global_param_name(model, name).replace(".mtp_model_layer.", ".transformer_layer.")


def randomize(model, cfg, seed):
    """Overwrite every parameter of `model` (or of each chunk in a list of VPP chunks) with seeded
    random values (norm weights ~1 +- 0.1, biases ~N(0, 0.1), matrices ~N(0, 1/hidden)).

    Each tensor gets its own generator seeded from (seed, tp_rank, name with the GLOBAL layer
    number), so values do not depend on the PP/VPP layout; TP-replicated tensors leave tp_rank out
    so they are identical on all TP ranks. The tied output layer on the last PP stage uses the seed
    of the first stage's word embeddings so the copies agree.
    Every row of the (padded) vocab, padding included, is random and nonzero.

    MoE: routed-expert parameters (``.mlp.experts.local_experts.{i}.``) are keyed by the GLOBAL
    expert index (ep_rank * experts_per_rank + i) and, if expert-TP-sharded, the expert-TP rank
    instead of the TP rank, so values do not depend on EP/DP. The router's persistent fp32 buffer
    ``router.expert_bias`` is filled too (0.1 * N(0, 1), replicated key).
    """
    import torch
    from megatron.core import parallel_state

    if isinstance(model, (list, tuple)):
        for chunk in model:
            randomize(chunk, cfg, seed)
        return
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    if is_moe(cfg):
        ep_rank = parallel_state.get_expert_model_parallel_rank()
        etp_rank = parallel_state.get_expert_tensor_parallel_rank()
        n_local = cfg["num_experts"] // parallel_state.get_expert_model_parallel_world_size()
    expert_re = re.compile(r"(.*\.mlp\.experts\.local_experts\.)(\d+)(\..*)")
    scale = 1.0 / math.sqrt(cfg["hidden_size"])
    with torch.no_grad():
        for name, p in model.named_parameters():
            key_name = seed_name(model, name)
            if name == "output_layer.weight" and model.share_embeddings_and_output_weights:
                key_name = "embedding.word_embeddings.weight"
            sharded = bool(getattr(p, "tensor_model_parallel", False))
            shard_rank = tp_rank
            m = expert_re.fullmatch(key_name) if is_moe(cfg) else None
            if m is not None:  # routed expert: global expert index, expert-TP rank
                key_name = f"{m.group(1)}{ep_rank * n_local + int(m.group(2))}{m.group(3)}"
                shard_rank = etp_rank
            # the "0" was the pp rank; kept so PP=1 models keep their former values
            key = f"{seed}|0|{shard_rank if sharded else -1}|{key_name}"
            g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
            r = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if "norm" in name and name.endswith("weight"):
                v = 1.0 + 0.1 * r
            elif name.endswith("bias"):
                v = 0.1 * r
            else:  # matrices incl. embeddings: std 1/sqrt(hidden) keeps logits O(1)
                v = scale * r
            p.copy_(v.to(p.dtype))
        if is_moe(cfg):
            for name, b in model.named_buffers():
                if not name.endswith("router.expert_bias") or b is None:
                    continue
                key = f"{seed}|0|-1|{seed_name(model, name)}"
                g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
                b.copy_((0.1 * torch.randn(b.shape, generator=g, dtype=torch.float32)).to(b.dtype))


# ----------------------------------------------------------------------------- checkpoint io








def legacy_rank_file(iterdir, tp_rank, pp_rank, pp, ep_rank=0, ep=1):
    """Megatron-LM get_checkpoint_name: mp_rank_TT[_PPP][_EEE] (_PPP iff pp > 1, _EEE iff ep > 1)."""
    sub = f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    if ep > 1:
        sub += f"_{ep_rank:03d}"
    return os.path.join(iterdir, sub, "model_optim_rng.pt")


def refuse_legacy_etp(cfg, tp, etp):
    if is_moe(cfg) and expert_tp(cfg, tp, etp) != tp:
        raise SystemExit(
            f"legacy (megatron) format with etp {expert_tp(cfg, tp, etp)} != tp {tp}: Megatron-LM's "
            "mp_rank_TT[_PPP][_EEE] names cannot tell the expert-TP rank; refused")


def load_into(model, path, fmt, pp, cfg=None, tp=None, ep=1, etp=None):
    """Strictly load checkpoint `path` into `model`. Returns (iterdir, fmt, args or None)."""
    return load_chunks([model], path, fmt, pp, None, cfg, tp, ep, etp)


def load_chunks(chunks, path, fmt, pp, vpp, cfg=None, tp=None, ep=1, etp=None):
    """Strictly load checkpoint `path` into this rank's model chunks (one without VPP, else vpp:
    entries "model0".. of the torch_dist state dict / legacy rank file). Returns (iterdir, fmt,
    args or None). MoE (cfg, tp, ep, etp given): the legacy file is picked by (tp, pp, ep rank) and
    refused when etp != tp."""
    import torch
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.validation import StrictHandling

    keys = model_keys(vpp)
    assert len(keys) == len(chunks), (keys, len(chunks))
    iterdir = resolve_iter_dir(path)
    if fmt == "auto":
        fmt = detect_format(iterdir)
    if fmt == "torch_dist":
        common = dist_checkpointing.load_common_state_dict(iterdir)
        loaded = dist_checkpointing.load(
            {k: sharded_sd(c) for k, c in zip(keys, chunks, strict=True)}, iterdir,
            strict=StrictHandling.RAISE_ALL
        )
        for k, c in zip(keys, chunks, strict=True):  # a chunk with no tensors (layout string) loads nothing
            c.load_state_dict(loaded.get(k, {}), strict=True)
        ck_args = common.get("args") if isinstance(common, dict) else None
    elif fmt == "megatron":
        if cfg is not None:
            refuse_legacy_etp(cfg, tp, etp)
        f = legacy_rank_file(
            iterdir,
            parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_pipeline_model_parallel_rank(),
            pp,
            parallel_state.get_expert_model_parallel_rank() if ep > 1 else 0,
            ep,
        )
        if not os.path.isfile(f):
            raise SystemExit(f"missing legacy shard {f} (legacy checkpoints load only at their layout)")
        sd = torch.load(f, map_location="cpu", weights_only=False)
        have = sorted(k for k in sd if re.fullmatch(r"model\d*", k))
        if have != sorted(keys):
            raise SystemExit(f"{f}: model entries {have}, expected {sorted(keys)} (wrong --vpp?)")
        for k, c in zip(keys, chunks, strict=True):
            c.load_state_dict(sd[k], strict=True)
        ck_args = sd.get("args")
    else:
        raise SystemExit(f"unknown format {fmt}")
    return iterdir, fmt, ck_args


# ----------------------------------------------------------------------------- commands


def cmd_make(a, cfg):
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state

    if a.out_megatron:
        refuse_legacy_etp(cfg, a.tp, a.etp)
    chunks = build_chunks(cfg, a.tp, a.pp, a.first, a.last, a.vpp, ep=a.ep, etp=a.etp, layout=a.pipeline_layout)
    randomize(chunks, cfg, a.seed)
    keys = model_keys(a.vpp)
    rank = dist.get_rank()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    it = a.iteration

    if a.out_torch_dist:
        d = os.path.join(a.out_torch_dist, iter_dir_name(it))
        if rank == 0:
            os.makedirs(d, exist_ok=True)
        dist.barrier()
        args = make_args(cfg, a.tp, a.pp, a.first, a.last, it, "torch_dist", a.vpp, a.ep, a.etp, a.pipeline_layout)
        state = {k: sharded_sd(c) for k, c in zip(keys, chunks, strict=True)}
        state.update({
            "args": args,
            "iteration": it,
            "checkpoint_version": 3.0,
            # what Megatron-LM >= core 0.14 records for the default (non-singleton) layout
            "content_metadata": {"singleton_local_shards": False, "chained_optim_avoid_prefix": True},
        })
        dist_checkpointing.save(state, d)
        dist.barrier()
        if rank == 0:
            with open(os.path.join(a.out_torch_dist, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write(str(it))

    if a.out_megatron:
        d = os.path.join(a.out_megatron, iter_dir_name(it))
        ep_rank = parallel_state.get_expert_model_parallel_rank() if is_moe(cfg) else 0
        f = legacy_rank_file(d, tp_rank, pp_rank, a.pp, ep_rank, a.ep)
        # as Megatron-LM: only expert-data-parallel rank 0 writes (one file per (tp, pp, ep))
        if not is_moe(cfg) or parallel_state.get_expert_data_parallel_rank() == 0:
            os.makedirs(os.path.dirname(f), exist_ok=True)
            args = make_args(cfg, a.tp, a.pp, a.first, a.last, it, "torch", a.vpp, a.ep, a.etp, a.pipeline_layout)
            state = {k: c.state_dict() for k, c in zip(keys, chunks, strict=True)}
            state.update({"args": args, "checkpoint_version": 3.0, "iteration": it})
            torch.save(state, f)
        dist.barrier()
        if rank == 0:
            with open(os.path.join(a.out_megatron, "latest_checkpointed_iteration.txt"), "w") as fh:
                fh.write(str(it))
    if rank == 0:
        vp = "" if a.vpp is None else f" vpp={a.vpp}"
        if is_moe(cfg):
            vp += f" ep={a.ep} etp={expert_tp(cfg, a.tp, a.etp)} dp={dist.get_world_size() // (a.tp * a.pp)}"
        print(f"ORACLE MADE tp={a.tp} pp={a.pp}{vp} padded_vocab={padded_vocab(cfg, a.tp)}", flush=True)
    return 0


def vocab_rows(cfg, tp, tp_rank):
    """Number of rows of this rank's vocab slice that belong to the true vocab."""
    per = padded_vocab(cfg, tp) // tp
    start = tp_rank * per
    return max(0, min(per, cfg["vocab_size"] - start))


def check_args(ck_args, cfg, a):
    """Problems with the args stored in a checkpoint that claims to be at layout (tp, pp, vpp)."""
    if ck_args is None:
        return ["checkpoint has no args"]
    probs = []
    want = {
        "tensor_model_parallel_size": a.tp,
        "pipeline_model_parallel_size": a.pp,
        "padded_vocab_size": padded_vocab(cfg, a.tp),
        "virtual_pipeline_model_parallel_size": a.vpp,
    }
    for k in (
        "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
        "kv_channels", "swiglu", "normalization", "add_bias_linear", "add_qkv_bias",
        "untie_embeddings_and_output_weights", "vocab_size", "position_embedding_type",
        "max_position_embeddings", "group_query_attention",
    ):
        want[k] = cfg[k]
    if is_moe(cfg):
        want["expert_model_parallel_size"] = a.ep
        want["expert_tensor_parallel_size"] = expert_tp(cfg, a.tp, a.etp)
        for k in (
            "num_experts", "moe_layer_freq", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
            "moe_shared_expert_gate", "moe_router_topk", "moe_router_enable_expert_bias",
            "moe_router_score_function", "moe_router_pre_softmax",
        ):
            want[k] = cfg[k]
        for k in MOE_ROUTER_EXTRA:
            if k in cfg:
                want[k] = cfg[k]
    if is_mla(cfg):
        for k in ("multi_latent_attention", "qk_layernorm", "rope_type", *MLA_DEFAULTS):
            want[k] = cfg[k]
    if has_mtp(cfg):
        want["mtp_num_layers"] = cfg["mtp_num_layers"]
    for k in (*GPT_OSS_KEYS, "quick_geglu", *(key for _, key, _ in YARN_GQA)):
        if cfg.get(k) is not None:
            want[k] = tuple(cfg[k]) if k == "window_size" else cfg[k]
    if cfg["rotary_percent"] != 1.0:  # partial RoPE (GLM-4.5): checked only where a config gives one
        want["rotary_percent"] = cfg["rotary_percent"]
    want["pipeline_model_parallel_layout"] = a.pipeline_layout
    for k, v in want.items():
        got = getattr(ck_args, k, None if k == "pipeline_model_parallel_layout" else "<absent>")
        if k == "vocab_size" and got is None:
            continue  # Megatron-LM args may leave vocab_size unset (tokenizer decides)
        if k == "expert_tensor_parallel_size" and got is None and v == a.tp:
            continue  # None means "= tp" (megatron-core model_parallel_config.py:413)
        if got != v:
            probs.append(f"args.{k}={got!r} expected {v!r}")
    if not is_mla(cfg) and getattr(ck_args, "multi_latent_attention", False):
        probs.append("args.multi_latent_attention=True for a config without MLA")
    if not has_mtp(cfg) and getattr(ck_args, "mtp_num_layers", None) is not None:
        probs.append(f"args.mtp_num_layers={ck_args.mtp_num_layers!r} for a config without MTP")
    return probs


def check_vocab_shapes(path, cfg, tp):
    """torch_dist loads vocab-padded tensors with allow_shape_mismatch=True (missing rows become
    zeros, extra rows are dropped), so a wrong padded vocab would load silently. Check the stored
    global shapes against the padded vocab for `tp` instead."""
    from megatron.core import dist_checkpointing

    md = dist_checkpointing.load_tensors_metadata(resolve_iter_dir(path))
    want = padded_vocab(cfg, tp)
    keys = ["embedding.word_embeddings.weight"]
    if cfg["untie_embeddings_and_output_weights"]:
        keys.append("output_layer.weight")
    probs = []
    for k in keys:
        if k not in md:
            probs.append(f"{k} absent from checkpoint")
        elif md[k].global_shape[0] != want:
            probs.append(f"{k} global shape {tuple(md[k].global_shape)}, padded vocab should be {want}")
    return probs


def cmd_compare(a, cfg):
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    rank = dist.get_rank()
    c_ck = build_chunks(cfg, a.tp, a.pp, a.first, a.last, a.vpp, ep=a.ep, etp=a.etp, layout=a.pipeline_layout)
    c_ref = build_chunks(cfg, a.tp, a.pp, a.first, a.last, a.vpp, ep=a.ep, etp=a.etp, layout=a.pipeline_layout)
    # Different random contents before loading, so an un-loaded tensor cannot compare equal.
    randomize(c_ck, cfg, 1_000_003)
    randomize(c_ref, cfg, 2_000_003)
    _, fmt_ck, ck_args = load_chunks(c_ck, a.ckpt, a.ckpt_format, a.pp, a.vpp, cfg, a.tp, a.ep, a.etp)
    _, fmt_ref, _ = load_chunks(c_ref, a.ref, a.ref_format, a.pp, a.vpp, cfg, a.tp, a.ep, a.etp)

    bad = []
    if a.check_args:
        bad += [f"ARGS {p}" for p in check_args(ck_args, cfg, a)]
        if fmt_ck == "torch_dist":
            bad += [f"SHAPE {p}" for p in check_vocab_shapes(a.ckpt, cfg, a.tp)]
    nrows = vocab_rows(cfg, a.tp, tp_rank)
    n = 0
    for v, (m_ck, m_ref) in enumerate(zip(c_ck, c_ref, strict=True)):
        vp = "" if a.vpp is None else f"vp={v} "
        sd_ck = m_ck.state_dict()
        sd_ref = m_ref.state_dict()
        if set(sd_ck) != set(sd_ref):
            bad.append(f"{vp}KEYS differ: {sorted(set(sd_ck) ^ set(sd_ref))}")
        for k in sorted(set(sd_ck) & set(sd_ref)):
            x, y = sd_ck[k], sd_ref[k]
            if not isinstance(x, torch.Tensor) or k.endswith("_extra_state"):
                continue
            if k.endswith("word_embeddings.weight") or k.endswith("output_layer.weight"):
                x, y = x[:nrows], y[:nrows]
            n += 1
            if x.shape != y.shape:
                bad.append(f"{vp}{k}: shape {tuple(x.shape)} vs {tuple(y.shape)}")
            elif not torch.equal(x, y):
                diff = (x.double() - y.double()).abs().max().item()
                bad.append(f"{vp}{k}: max abs diff {diff:.6g}")
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    tag = f"rank={rank} tp={tp_rank} pp={pp_rank}"
    if is_moe(cfg):
        tag += (f" ep={parallel_state.get_expert_model_parallel_rank()}"
                f" etp={parallel_state.get_expert_tensor_parallel_rank()}")
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, ([f"MISMATCH {tag} {b}" for b in bad], n))
    if rank == 0:
        lines = [ln for g in gathered for ln in g[0]]
        total = sum(g[1] for g in gathered)
        for ln in lines:
            print(ln)
        if lines:
            print(f"ORACLE FAIL {len(lines)} mismatches (ckpt={fmt_ck}, ref={fmt_ref})")
        else:
            print(f"ORACLE OK {total} tensors (ckpt={fmt_ck}, ref={fmt_ref})")
        sys.stdout.flush()
    return 1 if any(g[0] for g in gathered) else 0


def loaded_model(a, cfg, cmd, parallel_output):
    """The model at (--tp, --ep, PP=1) with --ckpt loaded strictly, in eval mode (randomised first, so
    nothing the checkpoint lacks can pass as loaded)."""
    if a.pp != 1 or a.vpp is not None:
        raise SystemExit(f"{cmd} needs --pp 1 and no --vpp")
    model = build_model(cfg, a.tp, 1, parallel_output=parallel_output, ep=a.ep, etp=a.etp)
    randomize(model, cfg, 3_000_017)
    load_into(model, a.ckpt, a.ckpt_format, 1, cfg, a.tp, a.ep, a.etp)
    model.eval()
    return model


def cmd_logits(a, cfg):
    import torch
    import torch.distributed as dist

    model = loaded_model(a, cfg, "logits", parallel_output=False)
    # same tokens on every rank (TP/EP/DP); local spec: causal mask type, a bool mask (True = masked)
    # of shape [b, 1, s, s]
    tokens, position_ids, mask = causal_inputs(cfg, a.seed)
    with torch.no_grad():
        if has_mtp(cfg):  # megatron-core's MTP path needs labels; the main head's logits are the
            logits = main_head_logits(model, tokens, position_ids, mask)  # output layer's last call
        else:
            logits = model(tokens, position_ids, mask)  # [b, s, padded_vocab], gathered over TP
    logits = logits[..., : cfg["vocab_size"]].contiguous()
    if dist.get_rank() == 0:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        torch.save({"tokens": tokens, "logits": logits}, a.out)
        print(f"ORACLE LOGITS {tuple(logits.shape)} -> {a.out}", flush=True)
    return 0


def causal_inputs(cfg, seed):
    """Seeded tokens (the same on every rank), position ids and the local spec's bool causal mask."""
    import torch

    g = torch.Generator().manual_seed(seed)
    b, s = 2, min(16, cfg["seq_length"])
    tokens = torch.randint(0, cfg["vocab_size"], (b, s), generator=g)
    position_ids = torch.arange(s).unsqueeze(0).expand(b, s)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1).view(1, 1, s, s).expand(b, 1, s, s)
    return tokens, position_ids, mask


def next_token_labels(tokens):
    """labels[i] = tokens[i + 1]; the last position gets token 0 (it is left out of the losses)."""
    import torch

    return torch.cat([tokens[:, 1:], torch.zeros_like(tokens[:, :1])], dim=1)


def main_head_logits(model, tokens, position_ids, mask):
    """Main-head logits [b, s, v] of an MTP model: megatron-core's forward with MTP needs labels and
    then returns losses, so run it with next-token labels and keep the output layer's last call
    (megatron-core calls it for the MTP depths first, then for the main head). A copy: megatron-core's
    vocab-parallel cross-entropy then works on the logits in place."""
    calls = []
    h = model.output_layer.register_forward_hook(lambda mod, inp, out: calls.append(out[0].detach().clone()))
    try:
        model(tokens, position_ids, mask, labels=next_token_labels(tokens))
    finally:
        h.remove()
    return calls[-1].transpose(0, 1)  # [s, b, v] -> [b, s, v]


def cmd_mtp(a, cfg):
    """Forward WITH labels, so megatron-core's MTP path (mtp block, its output-layer calls and
    per-token losses) runs; prints `ORACLE MTP depth=K loss=X ... main_loss=Y` (mean token losses
    from megatron-core's own compute_language_model_loss; depth K's labels are the tokens shifted
    by K + 1, the last K + 1 positions left out) and fails if any loss is not finite. TP/EP, no PP."""
    if not has_mtp(cfg):
        raise SystemExit("mtp needs a config with mtp_num_layers")
    model = loaded_model(a, cfg, "mtp", parallel_output=True)
    return say_mtp_losses(model, cfg, *causal_inputs(cfg, a.seed))


def say_mtp_losses(model, cfg, tokens, position_ids, mask) -> int:
    """``model``'s forward with labels (a GPTModel's or HybridModel's, built with parallel_output): the per-token
    losses megatron-core's compute_language_model_loss records, said as ``ORACLE MTP depth=K loss=X ...
    main_loss=Y`` on rank 0; 1 if any is not finite."""
    import torch
    import torch.distributed as dist

    losses = []
    inner = model.compute_language_model_loss

    def recording(labels, logits):
        out = inner(labels, logits)
        losses.append(out.detach().clone())  # [b, s] per-token cross-entropy
        return out

    model.compute_language_model_loss = recording
    try:
        with torch.no_grad():
            main = model(tokens, position_ids, mask, labels=next_token_labels(tokens))
    finally:
        del model.compute_language_model_loss
    k = cfg["mtp_num_layers"]
    if len(losses) != k + 1:
        raise SystemExit(f"expected {k + 1} loss computations (MTP depths + main), saw {len(losses)}")
    s = tokens.shape[1]
    vals = [losses[d][:, : s - (d + 2)].double().mean().item() for d in range(k)]
    main_loss = main[:, : s - 1].double().mean().item()
    ok = all(math.isfinite(v) for v in vals + [main_loss])
    if dist.get_rank() == 0:
        depth = " ".join(f"depth={d + 1} loss={v:.6f}" for d, v in enumerate(vals))
        print(f"ORACLE MTP {depth} main_loss={main_loss:.6f}" + ("" if ok else " NOT FINITE"), flush=True)
    return 0 if ok else 1


def cmd_dump(a, cfg):
    """megatron-core's own state dict of CKPT at (tp, pp), per rank: OUT/ref_{tp_rank}_{pp_rank}.pt."""
    import torch
    from megatron.core import parallel_state

    model = build_model(cfg, a.tp, a.pp)
    load_into(model, a.ckpt, a.ckpt_format, a.pp)
    t, p = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()
    torch.save(model.state_dict(), os.path.join(a.out, f"ref_{t}_{p}.pt"))
    return 0


def cmd_layout(a, cfg):
    """Dump what megatron-core itself asks a checkpoint to hold at (tp, pp): the main-replica
    ShardedTensors / ShardedObjects of ``sharded_state_dict()``, the legacy ``state_dict()`` keys and the
    trainable parameters in ``named_parameters()`` order (what DDP lays out in its buffers, reversed).
    With --vpp, each rank's entry has "chunks": one such dict per virtual stage (plus vp_stage,
    pre_process, post_process and the chunk's global 0-based decoder "layers")."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factories

    def describe(model):
        ssd = sharded_sd(model)
        apply_factories(ssd)
        tensors, objects = [], []
        for v in nested_values(ssd):
            main = not any(v.replica_id) if isinstance(v.replica_id, tuple) else v.replica_id == 0
            if isinstance(v, ShardedTensor) and main:
                tensors.append([v.key, list(v.global_shape), list(v.global_offset), list(v.local_shape)])
            elif isinstance(v, ShardedObject) and main:
                objects.append(v.unique_key)
        legacy = {k: (list(t.shape) if isinstance(t, torch.Tensor) else None) for k, t in model.state_dict().items()}
        params = [n for n, p in model.named_parameters() if p.requires_grad]  # DDP's buffer order (reversed)
        return {"tensors": tensors, "objects": objects, "state_dict": legacy, "params": params}

    chunks = build_chunks(cfg, a.tp, a.pp, a.first, a.last, a.vpp, ep=a.ep, etp=a.etp, layout=a.pipeline_layout)
    mine = {"tp_rank": parallel_state.get_tensor_model_parallel_rank(),
            "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
            "ep_rank": parallel_state.get_expert_model_parallel_rank(),
            "etp_rank": parallel_state.get_expert_tensor_parallel_rank()}
    if a.vpp is None:
        mine.update(describe(chunks[0]))
    else:
        mine["chunks"] = [
            {"vp_stage": v, "pre_process": c.pre_process, "post_process": c.post_process,
             "layers": [layer.layer_number - 1 for layer in c.decoder.layers], **describe(c)}
            for v, c in enumerate(chunks)
        ]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    if dist.get_rank() == 0:
        with open(a.out, "w") as f:
            json.dump(out, f)
    return 0


def main(argv=None, serving=False):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    def common(sp):
        sp.add_argument("--config", required=True)
        sp.add_argument("--tp", type=int, required=True)
        sp.add_argument("--pp", type=int, default=1)
        sp.add_argument("--first", type=int, default=None, help="layers in first PP stage")
        sp.add_argument("--last", type=int, default=None, help="layers in last PP stage")
        sp.add_argument("--vpp", type=int, default=None,
                        help="virtual pipeline (interleaved) stages per PP rank; default: no VPP")
        sp.add_argument("--pipeline-layout", default=None,
                        help="pipeline_model_parallel_layout string (VPP = its stages / PP)")
        sp.add_argument("--ep", type=int, default=1, help="expert_model_parallel_size (MoE configs)")
        sp.add_argument("--etp", type=int, default=None,
                        help="expert_tensor_parallel_size (MoE configs); default: the same as --tp")

    fmts = ["auto", "torch_dist", "megatron"]
    sp = sub.add_parser("make")
    common(sp)
    sp.add_argument("--seed", type=int, required=True)
    sp.add_argument("--iteration", type=int, required=True)
    sp.add_argument("--out-torch-dist", default=None)
    sp.add_argument("--out-megatron", default=None)
    sp = sub.add_parser("compare")
    common(sp)
    sp.add_argument("--ckpt", required=True)
    sp.add_argument("--ref", required=True)
    sp.add_argument("--ckpt-format", choices=fmts, default="auto")
    sp.add_argument("--ref-format", choices=fmts, default="auto")
    sp.add_argument("--check-args", action="store_true",
                    help="also require the ckpt's stored args (and, for torch_dist, its stored "
                         "vocab rows) to match the config at (tp, pp, vpp)")
    sp = sub.add_parser("logits")
    common(sp)
    sp.add_argument("--ckpt", required=True)
    sp.add_argument("--ckpt-format", choices=fmts, default="auto")
    sp.add_argument("--out", required=True)
    sp.add_argument("--seed", type=int, default=1234)
    sp = sub.add_parser("mtp")
    common(sp)
    sp.add_argument("--ckpt", required=True)
    sp.add_argument("--ckpt-format", choices=fmts, default="auto")
    sp.add_argument("--seed", type=int, default=1234)
    sp = sub.add_parser("layout")
    common(sp)
    sp.add_argument("--out", required=True)
    sp = sub.add_parser("dump")
    common(sp)
    sp.add_argument("--ckpt", required=True)
    sp.add_argument("--ckpt-format", choices=fmts, default="auto")
    sp.add_argument("--out", required=True)
    a = p.parse_args(argv)

    apply_cpu_shims()
    import torch.distributed as dist

    cfg = load_config(a.config)
    if a.pipeline_layout is not None:
        a.vpp = layout_vpp(a)
    init_parallel(a.tp, a.pp, a.vpp, a.ep, a.etp, cfg)
    try:
        rc = {"make": cmd_make, "compare": cmd_compare, "logits": cmd_logits, "layout": cmd_layout,
              "dump": cmd_dump, "mtp": cmd_mtp}[a.cmd](a, cfg)
        dist.barrier()
    finally:
        end_parallel(serving)
    return rc


def layout_vpp(a):
    """The VPP size a --pipeline-layout string gives at --pp (None for 1), as Megatron-LM derives it."""
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    stages = PipelineParallelLayerLayout.get_num_stages_from_str(a.pipeline_layout)
    if stages % a.pp or a.first is not None or a.last is not None:
        raise SystemExit(f"--pipeline-layout has {stages} stages for --pp {a.pp} (or --first/--last given)")
    vpp = stages // a.pp if stages > a.pp else None
    if a.vpp is not None and a.vpp != vpp:
        raise SystemExit(f"--vpp {a.vpp} disagrees with --pipeline-layout (VPP {vpp})")
    return vpp






if __name__ == "__main__":
    run_program(main)
