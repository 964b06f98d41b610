"""Oracle for the DeepSeek-Sparse-Attention families GLM-5 (``GlmMoeDsaForCausalLM``) and DeepSeek-V3.2
(``DeepseekV32ForCausalLM``), with their MTP layer: megatron-core 0.19.2's DSA GPTModel (the blocks of
get_transformer_block_with_experimental_attention_variant_spec, ``experimental_attention_variant="dsa"``,
``multi_latent_attention``: AbsorbedMLASelfAttention over DSAttention with a DSAIndexer; the MTP block of
get_gpt_mtp_block_spec, whose layer is the stage's last layer spec) as Megatron-Bridge 0.6.2's GLM-5 bridge
(``GLM5Bridge``, MLAModelProvider) builds and imports it is the Megatron side; transformers' own classes are the HF
side. ``make`` runs in the default runtime (.venv: transformers 5.14, whose GLM-5 indexer RoPE is interleaved, as
Bridge's and megatron-core's; transformers 5.12 of .venv-mcore19 rotates it half-split); every other command in the
second runtime (.venv-mcore19: megatron-core 0.19.2, Megatron-Bridge 0.6.2). Never imports dist_convert; megatron
only inside the commands that need it.

  oracles/dsa.py make HF_DIR --arch glm5|v32 --logits OUT.pt [--seed S]
      a tiny random model made by transformers' own config/model classes (GlmMoeDsaConfig/GlmMoeDsaForCausalLM,
      DeepseekV32Config/DeepseekV32ForCausalLM), save_pretrained (safetensors, fp32): 4 layers, the first dense
      (first_k_dense_replace 1, intermediate 96), then MoE (4 routed experts of 32, top-2, n_group 1, one shared
      expert, routed_scaling_factor 1.5, sigmoid routing with a random e_score_correction_bias); hidden 64, 4 heads,
      q_lora_rank 32, kv_lora_rank 32, qk_nope 16, qk_rope 8, v_head 16; vocab 300, untied; indexer 2 heads of 16,
      index_topk 4 (< the 16-token sequence, so the selection matters). rms_norm_eps 1e-6: transformers builds
      q_a_layernorm / kv_a_layernorm (and the indexer's k_norm) with eps 1e-6 whatever rms_norm_eps says, while
      megatron-core has one layernorm_epsilon for all its RMSNorms; 1e-6 makes both agree. Every tensor random and
      numerically relevant: RMSNorm weights in [0.7, 1.3], the indexer's k_norm (a LayerNorm) weight in [0.7, 1.3]
      and bias random, the router's e_score_correction_bias random. Then transformers' logits (fp32, eager,
      use_cache=False) on fixed ids (2 x 16 tokens, seeded) are saved to OUT.pt ({"ids", "logits"}), and one MTP
      layer is appended as HF layer 4 (tests/hf_models.add_mtp_layer: a whole decoder layer like the last one with
      its indexer, plus enorm, hnorm, eh_proj [h, 2h], shared_head.norm; V3.2 also the copies of the embedding and
      the head DeepSeek's releases store there, GLM-5 none; num_nextn_predict_layers 1). GLM-5's config.json gets
      ``"indexer_rope_interleave": true`` as the releases have it (Bridge reads it with no default; transformers 5.14
      ignores it and always interleaves). A 300-token WordLevel tokenizer (Bridge's save loads one).
  oracles/dsa.py bridge-import HF_DIR OUT_DIR
      Megatron-Bridge's own import (AutoBridge.from_hf_pretrained, to_megatron_provider(load_weights=True),
      provide_distributed_model, save_megatron_model) at TP 1 PP 1, with the MTP layer the GLM-5 bridge switches
      off (provider.mtp_num_layers = None) switched back on (num_nextn_predict_layers; Bridge's mapping registry
      maps it under both ``transformer_layer`` and ``mtp_model_layer``). Bridge has no DeepSeek-V3.2 bridge; V3.2's
      HF tensor names are GLM-5's, so for v32 a view of HF_DIR (links to its files) whose config.json says
      GlmMoeDsaForCausalLM / glm_moe_dsa (as slime does) is imported: only the name/value mapping is trusted from
      it. The truth of the name/value mapping; its TP layout is never trusted.
  oracles/dsa.py judge --truth TRUTH --hf HF_DIR --logits L.pt --arch glm5|v32 [--tp T] [--pp P] [--ep E]
                 [--expect-tp N] [--expect-pp N] [--expect-ep N] CKPT [CKPT ...]
      world = T*P*DP. Builds Bridge's GLM-5 provider's model (MTP on) at TP/PP/EP (sequence parallel at TP > 1:
      AbsorbedMLA asserts it), with DeepSeek-V3.2's DSA settings as transformers computes V3.2 for v32
      (dsa_indexer_rope_interleaved False: half-split indexer RoPE; dsa_indexer_rotate_activation True: the
      Hadamard rotation, which transformers skips as orthogonal) and Bridge's own for glm5 (interleaved True,
      rotate False); dsa_kernel_backend "none" (the unfused path). Loads TRUTH with megatron-core's
      dist_checkpointing (megatron-core reshards it to the judge's layout: the truth of the per-rank layout), then
      for each CKPT: dist_checkpointing.load with StrictHandling.RAISE_ALL + TE's check of every _extra_state +
      load_state_dict (every key but an unsaved _extra_state); every rank's tensors == the truth's, bit for bit
      (the model is NaN-filled before each load, so an unloaded tensor fails); at PP 1 the main logits vs
      transformers' (L.pt) within --atol (1e-4, fp32) and the MTP layer's logits (the output layer's first call of
      a forward with next-token labels, as oracles/mcore.py's ``mtp``) vs the truth model's at the same layout
      within --mtp-atol (1e-4); the checkpoint's recorded args (torch_dist common state ``args``, else Bridge's
      run_config.yaml model section): experimental_attention_variant "dsa", dsa_indexer_n_heads / head_dim / topk /
      topk_freq / rope_interleaved / scoring_relu / k_norm_epsilon, mtp_num_layers, multi_latent_attention as the
      judge built them (dsa_indexer_rotate_activation / skip_topk_offset too where recorded); and the TP/PP/EP it
      records against --expect-tp/-pp/-ep (common.check_recorded; none expected unless given). One JSON line per
      CKPT (rank 0); exit 1 if any failed.
  oracles/dsa.py bridge-load CKPT --truth TRUTH --hf HF_DIR --logits L.pt --arch glm5|v32 [--tp T] [--ep E] [--etp N]
      A Megatron-Bridge checkpoint (run_config.yaml) judged by Megatron-Bridge 0.6.2's own loader, whose model comes
      from that run_config.yaml, not from the HF config: model_load_save.load_megatron_model(model_type="gpt",
      use_cpu_init=True), i.e. load_model_config (instantiate(run_config["model"]): its ``_target_`` provider with
      the fields as written, transformer_layer_spec included), finalize, provide_distributed_model,
      _load_model_weights_from_checkpoint. Layout: Bridge's own ``mp_overrides`` with the TP / EP / ETP / sequence
      parallelism run_config.yaml records (world = TP*DP, EP*ETP dividing it), or --tp/--ep/--etp (then ETP 1,
      sequence parallel at TP > 1); PP 1. Before the provider builds, only fields no weight, key or value of the
      model's math depends on may be set (te_cpu.CPU_KERNELS, LOAD_OVERRIDES: moe_grouped_gemm / moe_permute_fusion
      False, dispatcher "allgather", moe_shared_expert_overlap False, dsa_kernel_backend "none"), never MATH_FIELDS;
      the verdict's ``overrides`` lists each one that changed a value ({} when run_config.yaml already says so).
      Bridge's weights load is not strict (dist_ckpt_strictness "assume_ok_unexpected": a checkpoint tensor no model
      key asks for is dropped silently; load_state_dict falls back to strict=False), so: the model is NaN-filled
      before it (a tensor left alone fails) and then megatron-core's key sets are checked (every checkpoint key some
      rank's model loads, every model key stored). The truth: a second model built by the same loader from CKPT's
      run_config.yaml, TRUTH loaded into it by megatron-core with StrictHandling.RAISE_ALL (as the judge). Then every
      tensor == the truth's, bit for bit; main logits vs transformers' (L.pt) within --atol (1e-4); the MTP logits vs
      the truth model's within --mtp-atol (1e-4); the indexer RoPE / rotation the provider has vs the family's
      (glm5 interleaved, no rotation; v32 half-split, rotated: transformers skips the orthogonal rotation, so logits
      cannot tell). One JSON line (rank 0): ckpt, ok, loaded_tensors (all ranks'), logits_max_abs_diff_vs_hf,
      mtp_logits_max_abs_diff, overrides, problems, with the layout, the provider class and the fields it built
      with; exit 1 on failure.
  oracles/dsa.py mutate SRC DST --hf HF_DIR --arch glm5|v32 --kind swap_indexer_heads|swap_eh_halves|k_norm_bias|
                 value|drop_object
      SRC (torch_dist) loaded at TP = world size, one defect megatron-core's loader accepts, saved by Bridge's
      save_megatron_model: the judge's negative controls. swap_indexer_heads: layer 1's indexer linear_wq_b rows of
      its two heads exchanged (changes which keys are selected); swap_eh_halves: the MTP eh_proj's two input halves
      (embedding / hidden) exchanged; k_norm_bias: layer 2's indexer k_norm bias zeroed; value: one element of the
      MTP layer's indexer linear_wk += 1e-3; drop_object: no indexer k_norm._extra_state saved.

The CPU stand-ins (no Transformer Engine, no fast_hadamard_transform on this machine). Every projection, split,
norm, RoPE, the indexer's scoring and top-k, the sparse attention and the MoE routing stay megatron-core's own code:
  * oracles.qwen3_next.apply_shims (oracles.te_cpu.apply_bridge_cpu_shims: the TE-less Bridge import, CPU masks
    and RNG; megatron's jit fuser off before megatron.core.ssm, which the experimental-attention spec imports)
  * the TE backend (TESpecProvider) of the experimental-attention block spec, of get_gpt_mtp_block_spec (the MTP
    layer's enorm / hnorm / eh_proj / final_layernorm) and of megatron-core's dense / MoE MLP specs ->
    CpuDSASpecProvider, whose leaves are plain-torch modules with TE's class names (Bridge picks a weight's TP
    split by them), parameter names, TP splits, sequence-parallel communication and _extra_state (TE 2: each norm
    and linear keeps one; DSAttention is megatron-core's own module and saves none):
      - linear() -> TELinear, parallel_mode "duplicated" (weight whole on every TP rank, replicated in the
        checkpoint, Bridge's ``parallel_mode`` None = replicated): AbsorbedMLA's linear_q_down_proj /
        linear_kv_down_proj and the indexer's linear_wq_b / linear_wk / linear_weights_proj. absorbed_mla.TELinear
        (None without TE) is set to it: AbsorbedMLA picks "duplicated" by ``submodules.linear_q_down_proj in
        [TELinear]``
      - layer_norm() -> TENorm: te.pytorch.RMSNorm (oracles.te_cpu's) or, for a config whose normalization is
        "LayerNorm" (the indexer's k_norm: megatron-core builds it from a config copy saying so, eps
        dsa_indexer_k_norm_epsilon), te.pytorch.LayerNorm (``weight`` and ``bias``)
      - column_parallel_linear / row_parallel_linear / column_parallel_layer_norm_linear -> oracles.qwen3_next's
        TEColumnParallelLinear / TERowParallelLinear and oracles.te_cpu's TELayerNormColumnParallelLinear, plus TE's
        sequence parallelism: the column-parallel input gathered along the sequence, the row-parallel output
        reduce-scattered (non-expert linears only; experts leave communication to the dispatcher, as TE's do)
      - experts: TE's non-grouped choice, SequentialMLP (moe_grouped_gemm False, moe_permute_fusion False: torch_dist
        keys are TEGroupedMLP's); MoE token dispatcher "allgather" instead of Bridge's "flex"/hybridep (DeepEP) and
        moe_shared_expert_overlap off (CUDA streams): they move tokens only, no weight or key depends on them
      - core_attention() -> qwen3_next's TEDotProductAttention stand-in (megatron-core's local DotProductAttention)
        taking TE's k_channels / v_channels (MLA's q/k and v head dims): the plain MLA a run_config without the DSA
        variant builds (bridge-load's negative controls)
  * while specs are built and modules made (cpu_spec_backend), also megatron-core's get_backend("transformer_engine")
    (MLA's Q/KV norm resolver asks it for defaults) and transformer_block.LayerNormImpl (the final norm of a block
    made from a layer spec: TENorm with TE, WrappedTorchNorm without, which refuses sequence parallelism) ->
    CpuDSASpecProvider / its TENorm; multi_latent_attention.TELinear (None without TE; MLASelfAttention picks
    "duplicated" by it, as AbsorbedMLA) -> the TELinear above
  * dsa.rotate_activation: megatron-core's, with the CUDA kernel fast_hadamard_transform.hadamard_transform(x,
    scale=d**-0.5) replaced by the same math in plain torch (x @ H.T * d**-0.5, H the Sylvester Hadamard matrix)
    and without its bf16-only assert (the kernel's limit, not the math's); H/sqrt(d) is orthonormal, so the
    indexer's q.k scores are unchanged up to rounding (which is why transformers skips it)
  * gloo has all_gather_into_tensor and reduce_scatter_tensor (torch >= 2.x), so TP > 1 with sequence parallelism
    runs as it would on GPUs.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
import zlib
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the oracles package, helpers

from oracles.common import run_program  # noqa: E402 - no megatron import at module level

VOCAB = 300
SEQ = 16
ARCHS = {"glm5": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM"), "v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM")}
CONFIG = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
          "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4, "n_shared_experts": 1,
          "n_routed_experts": 4, "routed_scaling_factor": 1.5, "kv_lora_rank": 32, "q_lora_rank": 32,
          "qk_rope_head_dim": 8, "v_head_dim": 16, "qk_nope_head_dim": 16, "n_group": 1, "topk_group": 1,
          "num_experts_per_tok": 2, "norm_topk_prob": True, "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
          "tie_word_embeddings": False, "index_topk": 4, "index_head_dim": 16, "index_n_heads": 2,
          "first_k_dense_replace": 1, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
          "hidden_act": "silu", "attention_bias": False, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2}
MUTATIONS = ("swap_indexer_heads", "swap_eh_halves", "k_norm_bias", "value", "drop_object")
# the recorded args the judge compares with what it built (run_config.yaml / Megatron-LM args names)
ARG_FIELDS = ("experimental_attention_variant", "dsa_indexer_n_heads", "dsa_indexer_head_dim", "dsa_indexer_topk",
              "dsa_indexer_topk_freq", "dsa_indexer_rope_interleaved", "dsa_indexer_scoring_relu",
              "dsa_indexer_k_norm_epsilon", "mtp_num_layers", "multi_latent_attention")
ARG_FIELDS_IF_RECORDED = ("dsa_indexer_rotate_activation", "dsa_indexer_skip_topk_offset")


# ----------------------------------------------------------------------------- make (transformers 5.14)


def hf_config(arch: str):
    import transformers

    cls = getattr(transformers, ARCHS[arch][0])
    return cls(**CONFIG, dtype="float32", architectures=[ARCHS[arch][1]])


def randomize(model, seed: int) -> None:
    """Every tensor (parameters and buffers) random, seeded by name; see the module docstring."""
    import torch

    with torch.no_grad():
        for name, t in model.state_dict().items():
            if not t.is_floating_point():
                continue
            g = torch.Generator().manual_seed(zlib.crc32(f"{seed}|{name}".encode()))
            if name.endswith("k_norm.bias"):
                v = 0.3 * torch.randn(t.shape, generator=g)
            elif "norm" in name:
                v = 0.7 + 0.6 * torch.rand(t.shape, generator=g)
            elif name.endswith("e_score_correction_bias"):
                v = 0.2 * torch.randn(t.shape, generator=g)
            elif "embed_tokens" in name:
                v = torch.randn(t.shape, generator=g)
            else:  # linears [out, in], experts [E, out, in]: unit-scale outputs
                v = torch.randn(t.shape, generator=g) / math.sqrt(t.shape[-1])
            t.copy_(v.to(t.dtype))


def judge_ids():
    import torch

    g = torch.Generator().manual_seed(1234)
    return torch.randint(3, VOCAB, (2, SEQ), generator=g)


def cmd_make(a) -> int:
    import torch
    import transformers

    from hf_models import add_mtp_layer
    from oracles.common import hf_file_tensors, save_word_tokenizer

    t0 = time.time()
    out = Path(a.hf_dir)
    config = hf_config(a.arch)
    torch.manual_seed(a.seed)
    model = getattr(transformers, ARCHS[a.arch][1])(config).float().eval()
    randomize(model, a.seed)
    model.save_pretrained(out)
    save_word_tokenizer(out, VOCAB)
    # transformers' logits from the model as saved (reloaded: what from_pretrained makes of the files)
    ref, info = getattr(transformers, ARCHS[a.arch][1]).from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if bad:
        raise RuntimeError(f"transformers' load of {out} is not clean: {bad}")
    ids = judge_ids()
    with torch.no_grad():
        logits = ref.eval()(input_ids=ids, use_cache=False).logits.float()
    Path(a.logits).parent.mkdir(parents=True, exist_ok=True)
    torch.save({"ids": ids, "logits": logits, "arch": a.arch, "transformers": transformers.__version__}, a.logits)
    # GLM-5 stores no copies of the embedding and head with its MTP layer (as Bridge writes it), V3.2 both (as V3)
    add_mtp_layer(out, copies=() if a.arch == "glm5" else ("embed_tokens", "shared_head.head"))
    if a.arch == "glm5":
        cfg = json.loads((out / "config.json").read_text())
        cfg["indexer_rope_interleave"] = True
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
    names = hf_file_tensors(out)
    print(json.dumps({"made": str(out), "arch": a.arch, "model_type": config.model_type,
                      "transformers": transformers.__version__, "logits": str(a.logits),
                      "logits_scale": logits.abs().max().item(), "tensors": len(names),
                      "mtp_tensors": sorted(k for k in names if k.startswith("model.layers.4.")),
                      "saved": names, "seconds": round(time.time() - t0, 2)}))
    return 0


# ----------------------------------------------------------------------------- CPU stand-ins (mcore19)

_SHIMMED = False


def hadamard_transform(x, scale: float):
    """fast_hadamard_transform.hadamard_transform in plain torch: x @ H.T * scale over the last dim (a power of 2),
    H the Sylvester Hadamard matrix (symmetric)."""
    import torch

    d = x.size(-1)
    assert d & (d - 1) == 0, f"Hadamard size {d} is not a power of 2"
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.size(0) < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (x.double() @ h.T * scale).to(x.dtype)


def apply_shims() -> None:
    """qwen3_next's shims and the DSA ones (see the module docstring)."""
    global _SHIMMED
    from oracles import qwen3_next

    qwen3_next.apply_shims()
    if _SHIMMED:
        return
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.experimental_attention_variant import absorbed_mla, dsa

    def rotate_activation(x):  # megatron-core's, the kernel in plain torch, no bf16-only assert
        return hadamard_transform(x, scale=x.size(-1) ** -0.5)

    dsa.rotate_activation = rotate_activation
    absorbed_mla.TELinear = multi_latent_attention.TELinear = cpu_classes()["linear"]
    _SHIMMED = True


_CLASSES = None


def cpu_classes() -> dict:
    global _CLASSES
    if _CLASSES is not None:
        return _CLASSES
    import torch
    import torch.nn.functional as F
    from megatron.core.tensor_parallel.mappings import (
        gather_from_sequence_parallel_region,
        reduce_scatter_to_sequence_parallel_region,
    )
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint
    from megatron.core.utils import get_tensor_model_parallel_group_if_none

    from oracles import qwen3_next, te_cpu

    base = qwen3_next.cpu_classes()
    ExtraState, new_param, rms = te_cpu.ExtraState, te_cpu.new_param, te_cpu.rms

    def sp(module) -> bool:
        return module.config.sequence_parallel and not module.is_expert and module._tp_group.size() > 1

    class CpuTEColumnParallelLinear(base["col"]):
        """qwen3_next's TEColumnParallelLinear with TE's sequence parallelism (input gathered along the sequence)."""

        def forward(self, x):
            if sp(self):
                return F.linear(gather_from_sequence_parallel_region(x, group=self._tp_group), self.weight), None
            return super().forward(x)

    class CpuTERowParallelLinear(base["row"]):
        """qwen3_next's TERowParallelLinear with TE's sequence parallelism (output reduce-scattered)."""

        def forward(self, x):
            if sp(self):
                return reduce_scatter_to_sequence_parallel_region(F.linear(x, self.weight), group=self._tp_group), None
            return super().forward(x)

    class CpuTELayerNormColumnParallelLinear(base["ln_col"]):
        """te_cpu's TELayerNormColumnParallelLinear with TE's sequence parallelism."""
        is_expert = False

        def forward(self, x):
            if sp(self):
                x = rms(x, self.layer_norm_weight, self.eps, self.zero_centered)
                return F.linear(gather_from_sequence_parallel_region(x, group=self._tp_group), self.weight), None
            return super().forward(x)

    class CpuTELinear(ExtraState, torch.nn.Module):
        """megatron-core's TELinear at parallel_mode "duplicated": the whole weight on every rank, replicated."""

        def __init__(self, input_size, output_size, *, parallel_mode, config, init_method, bias, skip_bias_add,
                     skip_weight_param_allocation, tp_comm_buffer_name=None, is_expert=False, symmetric_ar_type=None,
                     tp_group=None, name=None, gtp_remat_group=None):
            super().__init__()
            assert parallel_mode == "duplicated" and tp_group is None, (parallel_mode, tp_group)
            assert not bias and not is_expert and not skip_weight_param_allocation
            self.config, self.is_expert = config, False
            self.parallel_mode = None  # what TE's Linear is given for "duplicated" (Bridge: replicated)
            self.weight = new_param((output_size, input_size), config, init_method)
            self.weight.allreduce, self.weight.tensor_model_parallel = True, False
            self.weight.sequence_parallel = config.sequence_parallel
            self._tp_group = get_tensor_model_parallel_group_if_none(None)

        def forward(self, x):
            return F.linear(x, self.weight), None

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):  # as TELinear's: replicated
            metadata = ensure_metadata_has_dp_cp_group(metadata)
            return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, None,
                                                       sharded_offsets, tp_group=self._tp_group,
                                                       dp_cp_group=metadata["dp_cp_group"])

    class CpuTELayerNorm(ExtraState, torch.nn.Module):
        """te.pytorch.LayerNorm as megatron-core's TENorm builds it (TE 2: an op; ``weight``, ``bias``)."""
        _extra = staticmethod(te_cpu.te_op_extra_state)

        def __init__(self, config, hidden_size, eps=1e-5):
            super().__init__()
            self.eps, self.zero_centered = eps, config.layernorm_zero_centered_gamma
            self.weight = new_param((hidden_size,), config, value=0.0 if self.zero_centered else 1.0)
            self.bias = new_param((hidden_size,), config, value=0.0)
            for p in (self.weight, self.bias):
                p.sequence_parallel = config.sequence_parallel

        def forward(self, x):
            w = self.weight.float() + 1.0 if self.zero_centered else self.weight.float()
            return F.layer_norm(x.float(), x.shape[-1:], w, self.bias.float(), self.eps).to(x.dtype)

    rms_norm = base["norm"]

    class CpuTENorm:
        """megatron-core's TENorm: te.pytorch.LayerNorm or RMSNorm by ``config.normalization``."""

        def __new__(cls, config, hidden_size, eps=1e-5, has_residual=False):
            if config.normalization == "LayerNorm":
                return CpuTELayerNorm(config, hidden_size, eps)
            return rms_norm(config, hidden_size, eps)

    class CpuTEDotProductAttention(base["attn"]):
        """qwen3_next's TEDotProductAttention stand-in with TE's k_channels / v_channels (MLA's q/k head dim
        qk_head_dim + qk_pos_emb_head_dim, v head dim v_head_dim; megatron-core's local DotProductAttention, which it
        runs, has kv_channels only): the MLA attention a run_config without the DSA variant builds."""

        def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                     softmax_scale=None, k_channels=None, v_channels=None, **kwargs):
            super().__init__(config, layer_number, attn_mask_type, attention_type,
                             attention_dropout=attention_dropout, softmax_scale=softmax_scale, **kwargs)
            if softmax_scale is None and k_channels is not None:  # TE's default: 1/sqrt(k_channels)
                self.softmax_scale = k_channels ** -0.5
            if v_channels is not None:  # the context's width: v_channels per head
                self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition

    for c, name in ((CpuTEColumnParallelLinear, "TEColumnParallelLinear"),
                    (CpuTERowParallelLinear, "TERowParallelLinear"),
                    (CpuTELayerNormColumnParallelLinear, "TELayerNormColumnParallelLinear"),
                    (CpuTELinear, "TELinear"), (CpuTELayerNorm, "LayerNorm"), (CpuTENorm, "TENorm"),
                    (CpuTEDotProductAttention, "TEDotProductAttention")):
        c.__name__ = c.__qualname__ = name
    _CLASSES = {"col": CpuTEColumnParallelLinear, "row": CpuTERowParallelLinear,
                "ln_col": CpuTELayerNormColumnParallelLinear, "linear": CpuTELinear, "norm": CpuTENorm,
                "attn": CpuTEDotProductAttention}
    return _CLASSES


def cpu_backend():
    """TESpecProvider's choices (mc19 extensions/transformer_engine_spec_provider.py), CPU leaves."""
    from functools import partial

    from megatron.core.models.backends import BackendSpecProvider
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP

    c = cpu_classes()

    class CpuDSASpecProvider(BackendSpecProvider):
        def linear(self):
            return c["linear"]

        def column_parallel_linear(self):
            return c["col"]

        def row_parallel_linear(self):
            return c["row"]

        def fuse_layernorm_and_linear(self):
            return True

        def column_parallel_layer_norm_linear(self):
            return c["ln_col"]

        def layer_norm(self, rms_norm=False, for_qk=False, has_residual=False):
            return c["norm"]  # TENorm (TE >= 1.9 for qk too); it picks LayerNorm/RMSNorm from the config

        def core_attention(self):
            return c["attn"]

        def grouped_mlp_modules(self, moe_use_grouped_gemm):
            assert not moe_use_grouped_gemm, "the CPU build needs moe_grouped_gemm=False"
            return partial(SequentialMLP, submodules=MLPSubmodules(linear_fc1=c["col"], linear_fc2=c["row"],
                                                                   activation_func=None))

        def activation_func(self):
            return None

    return CpuDSASpecProvider()


# ----------------------------------------------------------------------------- the model (mcore19)


def glm_view(hf: str, arch: str) -> tuple[str, str | None]:
    """(the directory Bridge's GLM-5 bridge reads, a temporary directory to remove or None): HF_DIR for glm5; for
    v32 a view of it (links to its files) whose config.json says GlmMoeDsaForCausalLM / glm_moe_dsa, with V3.2's
    half-split indexer RoPE (indexer_rope_interleave false)."""
    if arch == "glm5":
        return hf, None
    tmp = tempfile.mkdtemp(prefix="dsa_glm_view_")
    for p in Path(hf).iterdir():
        if p.name != "config.json":
            os.symlink(p.resolve(), Path(tmp) / p.name)
    cfg = json.loads((Path(hf) / "config.json").read_text())
    cfg.update(architectures=["GlmMoeDsaForCausalLM"], model_type="glm_moe_dsa", indexer_rope_interleave=False)
    (Path(tmp) / "config.json").write_text(json.dumps(cfg, indent=2))
    return tmp, tmp


def dsa_provider(view: str, arch: str, load_weights: bool, tp: int = 1, pp: int = 1, ep: int = 1):
    """Bridge's GLM-5 provider for ``view`` (glm_view's), MTP on, at TP/PP/EP, with the CPU choices."""
    from oracles.common import bridge_provider
    from oracles.te_cpu import CPU_KERNELS

    bridge, provider = bridge_provider(view, load_weights)
    for k, v in CPU_KERNELS.items():
        if hasattr(provider, k):
            setattr(provider, k, v)
    cfg = json.loads((Path(view) / "config.json").read_text())
    provider.mtp_num_layers = cfg.get("num_nextn_predict_layers") or None  # Bridge's GLM-5 bridge: None
    provider.moe_grouped_gemm = False
    provider.moe_permute_fusion = False
    provider.moe_token_dispatcher_type = "allgather"  # flex/hybridep needs DeepEP; moves tokens only
    provider.moe_shared_expert_overlap = False
    provider.dsa_kernel_backend = "none"
    if arch == "v32":  # DeepSeek-V3.2 as transformers computes it
        provider.dsa_indexer_rope_interleaved = False
        provider.dsa_indexer_rotate_activation = True
    provider.tensor_model_parallel_size, provider.pipeline_model_parallel_size = tp, pp
    provider.expert_model_parallel_size = ep
    provider.expert_tensor_parallel_size = 1
    provider.sequence_parallel = tp > 1  # AbsorbedMLA asserts it at TP > 1
    provider.finalize()
    return bridge, provider


@contextmanager
def cpu_spec_backend():
    """The CPU backend (cpu_backend) in place of TESpecProvider while specs are built and modules made: the
    experimental-attention block spec's _get_backend_spec_provider, gpt_layer_specs' TESpecProvider (MTP block,
    dense / MoE MLPs) and the one megatron.core.models.backends.get_backend("transformer_engine") returns (MLA's
    Q/KV norm resolver asks it for defaults); and TENorm as the final norm a TransformerBlock of a layer spec (not a
    block spec) takes (transformer_block's LayerNormImpl: TENorm with TE, WrappedTorchNorm without)."""
    from megatron.core.extensions import transformer_engine_spec_provider as te_spec
    from megatron.core.models.gpt import experimental_attention_variant_module_specs as eav
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer import transformer_block

    backend = cpu_backend()
    saved = (eav._get_backend_spec_provider, gpt_layer_specs.TESpecProvider, te_spec.TESpecProvider,
             transformer_block.LayerNormImpl)
    eav._get_backend_spec_provider = lambda config: backend
    gpt_layer_specs.TESpecProvider = te_spec.TESpecProvider = lambda: backend
    transformer_block.LayerNormImpl = cpu_classes()["norm"]
    try:
        yield
    finally:
        (eav._get_backend_spec_provider, gpt_layer_specs.TESpecProvider, te_spec.TESpecProvider,
         transformer_block.LayerNormImpl) = saved


def build(provider):
    """The model chunks, with the CPU backend in place of TESpecProvider while the specs are built."""
    with cpu_spec_backend():
        model = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)
    for m in model:
        m.eval()
    return model


def setup(hf: str, arch: str, load_weights: bool, tp: int = 1, pp: int = 1, ep: int = 1):
    """Process groups (ETP 1, as the provider), Bridge's provider and the model: (rank, world, bridge, provider,
    model, the glm view's temporary directory or None)."""
    from oracles.qwen3_next import init_dist

    rank, world = init_dist(tp, pp, ep, 1)
    view, tmp = glm_view(hf, arch)
    bridge, provider = dsa_provider(view, arch, load_weights, tp, pp, ep)
    return rank, world, bridge, provider, build(provider), view, tmp


# ----------------------------------------------------------------------------- bridge-import


def cmd_bridge_import(a, serving=False) -> int:
    t0 = time.time()
    apply_shims()
    from oracles.common import end_parallel

    arch = "v32" if json.loads((Path(a.hf_dir) / "config.json").read_text())["model_type"] == "deepseek_v32" \
        else "glm5"
    tmp = None
    rank = 0
    try:
        rank, _, bridge, provider, model, view, tmp = setup(a.hf_dir, arch, load_weights=True)
        bridge.save_megatron_model(model, a.out_dir, hf_tokenizer_path=view)
    finally:
        end_parallel(serving)
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    if rank == 0:
        print(json.dumps({"bridge_import": str(a.out_dir), "arch": arch, "tp": 1, "pp": 1,
                          "mtp_num_layers": provider.mtp_num_layers, "seconds": round(time.time() - t0, 2)}))
    return 0


# ----------------------------------------------------------------------------- judge


def vocab_gathered(t):
    """Logits split over TP along the last (vocab) dim, whole."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    if dist.get_world_size(group) == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def forward_logits(m, ids):
    """(main logits, MTP depth-1 logits), each [b, s, vocab], fp32: megatron-core's forward with next-token labels
    (its MTP path then runs the output layer for the MTP depth first, the main head last), the output layer's
    calls recorded (copies: the vocab-parallel cross-entropy works on them in place), gathered over TP."""
    import torch

    from oracles.mcore import next_token_labels

    calls = []
    h = m.output_layer.register_forward_hook(lambda mod, inp, out: calls.append(out[0].detach().clone()))
    pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    try:
        with torch.no_grad():
            m(input_ids=ids, position_ids=pos, attention_mask=None, labels=next_token_labels(ids))
    finally:
        h.remove()
    assert len(calls) == 2, f"expected 2 output-layer calls (MTP, main), saw {len(calls)}"
    return tuple(vocab_gathered(c).transpose(0, 1).float()[..., :VOCAB] for c in (calls[-1], calls[0]))


def recorded_args(iter_dir: Path) -> tuple[dict | None, str]:
    """The model args a checkpoint records: Megatron-LM's ``args`` in the torch_dist common state, else Bridge's
    run_config.yaml model section; (None, "") where it records neither."""
    from megatron.core import dist_checkpointing

    try:
        args = dist_checkpointing.load_common_state_dict(str(iter_dir)).get("args")
    except Exception:  # noqa: BLE001 - a legacy checkpoint: no common state
        args = None
    if args is not None:
        return vars(args), "common.pt args"
    rc = iter_dir / "run_config.yaml"
    if rc.is_file():
        import yaml

        return (yaml.safe_load(rc.read_text()) or {}).get("model") or {}, "run_config.yaml model"
    return None, ""


def check_args(iter_dir: Path, provider, info: dict, problems: list[str]) -> None:
    args, where = recorded_args(iter_dir)
    info["args_from"] = where or None
    if args is None:
        problems.append("args: the checkpoint records no args (neither common.pt args nor run_config.yaml)")
        return
    for f in ARG_FIELDS + ARG_FIELDS_IF_RECORDED:
        want = getattr(provider, f)
        if f not in args:
            if f in ARG_FIELDS:
                problems.append(f"args: {f} not recorded ({where}); the judge built {want!r}")
            continue
        got = args[f]
        same = math.isclose(got, want) if isinstance(want, float) and isinstance(got, (int, float)) else got == want
        if not same:
            problems.append(f"args: {f} = {got!r} ({where}), the judge built {want!r}")
    info["stored_tp"] = args.get("tensor_model_parallel_size")
    info["stored_pp"] = args.get("pipeline_model_parallel_size")
    info["stored_ep"] = args.get("expert_model_parallel_size")


def error_line(e: BaseException) -> str:
    """A judge's exception as a problem: its traceback on stderr; its type and whole message (whitespace collapsed,
    600 characters at most: megatron-core's CheckpointingException names the keys past its first line)."""
    import traceback

    traceback.print_exc()
    return f"{type(e).__name__}: {' '.join(str(e).split())}"[:600]


def cmd_judge(a, serving=False) -> int:
    apply_shims()
    import torch

    from oracles.common import check_recorded, compare, end_parallel, resolve_iter_dir, unwrap
    from oracles.nemotron_h import tensor_state
    from oracles.qwen3_next import ensure_pg, load_into, nan_fill

    t_all = time.time()
    truth_dir = Path(resolve_iter_dir(a.truth))
    rank, tmp = ensure_pg()[0], None
    results, setup_problems = [], []
    ref = torch.load(a.logits, map_location="cpu", weights_only=True)
    ids, hlog = ref["ids"], ref["logits"]
    tlog = tmtp = None
    try:
        rank, world, _, provider, model, _, tmp = setup(a.hf, a.arch, False, a.tp, a.pp, a.ep)
        m = unwrap(model[0])
        nan_fill(m)
        load_into(m, truth_dir, setup_problems)
        truth = tensor_state(m)
        if a.pp == 1:
            tlog, tmtp = forward_logits(m, ids)
    except Exception as e:  # noqa: BLE001
        setup_problems.append(f"setup: {error_line(e)}")
    for ck in a.ckpts:
        t0 = time.time()
        problems: list[str] = list(setup_problems)
        info: dict = {"ckpt": ck, "truth": str(truth_dir), "arch": a.arch, "tp": a.tp, "pp": a.pp, "ep": a.ep}
        if not setup_problems:
            try:
                iter_dir = Path(resolve_iter_dir(ck))
                nan_fill(m)
                load_into(m, iter_dir, problems)
                got = tensor_state(m)
                info["loaded_tensors"] = len(got)
                problems += compare(got, truth, "loaded vs truth")
                check_args(iter_dir, provider, info, problems)
                check_recorded(info, problems, {"tp": a.expect_tp, "pp": a.expect_pp, "ep": a.expect_ep})
                if a.pp == 1:
                    mlog, mmtp = forward_logits(m, ids)
                    diff = (mlog - hlog).abs().max().item()
                    info["logits_max_abs_diff_vs_hf"] = diff
                    info["truth_logits_max_abs_diff_vs_hf"] = (tlog - hlog).abs().max().item()
                    info["logits_scale"] = hlog.abs().max().item()
                    info["argmax_agreement"] = (mlog.argmax(-1) == hlog.argmax(-1)).float().mean().item()
                    if not diff <= a.atol:
                        problems.append(f"logits differ from transformers' by {diff:.3g} (atol {a.atol})")
                    mdiff = (mmtp - tmtp).abs().max().item()
                    info["mtp_logits_max_abs_diff"] = mdiff
                    info["mtp_logits_scale"] = tmtp.abs().max().item()
                    if not mdiff <= a.mtp_atol:
                        problems.append(f"MTP logits differ from the truth model's by {mdiff:.3g} "
                                        f"(atol {a.mtp_atol})")
            except BaseException as e:  # noqa: BLE001 - a refused load is a verdict (SystemExit from resolve too)
                problems.append(error_line(e))
        gather_verdict(info, problems, t0)
        results.append(info)
        if rank == 0:
            print(json.dumps(info), flush=True)
    end_parallel(serving)
    if tmp:
        shutil.rmtree(tmp, ignore_errors=True)
    if rank == 0:
        print(json.dumps({"judged": len(results), "failed": sum(not r["ok"] for r in results),
                          "seconds": round(time.time() - t_all, 2)}), flush=True)
    return 0 if results and all(r["ok"] for r in results) else 1


# ----------------------------------------------------------------------------- bridge-load

# provider fields bridge-load sets on the provider Bridge instantiated from run_config.yaml, before it builds: the CPU
# kernels (oracles.te_cpu.CPU_KERNELS) and the stand-ins' MoE choices (see the module docstring); no weight, key or
# value of the model's math depends on them
LOAD_OVERRIDES = {"moe_grouped_gemm": False, "moe_permute_fusion": False, "moe_token_dispatcher_type": "allgather",
                  "moe_shared_expert_overlap": False, "dsa_kernel_backend": "none"}
# never overridden: the model's math comes from run_config.yaml as written
MATH_FIELDS = ("experimental_attention_variant", "multi_latent_attention", "mtp_num_layers", "q_lora_rank",
               "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "rope_type", "rotary_base",
               "rotary_scaling_factor", "normalization", "layernorm_epsilon", "num_moe_experts", "moe_router_topk",
               "moe_router_score_function", "moe_router_topk_scaling_factor", "moe_router_enable_expert_bias",
               "moe_layer_freq", "transformer_layer_spec") + ARG_FIELDS[1:] + ARG_FIELDS_IF_RECORDED
# the indexer's RoPE and rotation each family's HF model computes (the rotation is orthogonal: logits cannot tell)
ARCH_DSA = {"glm5": {"dsa_indexer_rope_interleaved": True, "dsa_indexer_rotate_activation": False},
            "v32": {"dsa_indexer_rope_interleaved": False, "dsa_indexer_rotate_activation": True}}


def plain(v):
    """A value for the JSON verdict: as it is if JSON has it, else its repr (a callable by its qualified name)."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if callable(v) and hasattr(v, "__qualname__"):
        return f"{getattr(v, '__module__', '')}.{v.__qualname__}"
    return repr(v)


def load_layout(a, model_args: dict) -> dict:
    """Bridge's mp_overrides for the load: the layout run_config.yaml records (TP, EP, ETP, sequence parallelism),
    or --tp/--ep/--etp; PP 1 (Bridge's loader's own default, and the logits need it)."""
    tp = a.tp or model_args.get("tensor_model_parallel_size") or 1
    ep = a.ep or model_args.get("expert_model_parallel_size") or 1
    if a.tp or a.ep:
        etp, sp = a.etp or 1, tp > 1
    else:
        etp = a.etp or model_args.get("expert_tensor_parallel_size") or tp
        sp = model_args.get("sequence_parallel")
        sp = tp > 1 if sp is None else sp
    return {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": 1, "expert_model_parallel_size": ep,
            "expert_tensor_parallel_size": etp, "sequence_parallel": sp}


def strict_keys(m, iter_dir: Path) -> list[str]:
    """megatron-core's strict key check (StrictHandling.RAISE_ALL's sets) of model ``m`` against ``iter_dir``: a
    checkpoint key no rank's model loads (Bridge's "assume_ok_unexpected" load ignores it), a model key the
    checkpoint lacks. Missing keys on rank 0 only (they are every rank's)."""
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    local = {sh.key for sh in nested_values(m.sharded_state_dict()) if hasattr(sh, "key")}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, local)
    stored = {sh.key for sh in load_sharded_metadata(str(iter_dir)).values()} - {"common_state"}
    problems = [f"strict: model key not in the checkpoint: {k}" for k in sorted(local - stored)]
    if dist.get_rank() == 0:
        problems += [f"strict: checkpoint key no model key loads: {k}" for k in sorted(stored - set().union(*every))]
    return problems


def gather_verdict(info: dict, problems: list[str], t0: float) -> None:
    """Every rank's problems, worst logits differences and tensor counts into rank 0's ``info`` (the verdict)."""
    import torch.distributed as dist

    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (problems, info.get("logits_max_abs_diff_vs_hf"),
                                   info.get("mtp_logits_max_abs_diff"), info.get("loaded_tensors")))
    allp = [p if r == 0 else f"rank {r}: {p}" for r, (ps, _, _, _) in enumerate(every) for p in ps]
    for i, k in ((1, "logits_max_abs_diff_vs_hf"), (2, "mtp_logits_max_abs_diff")):
        vals = [e[i] for e in every if e[i] is not None]
        info[k] = max(vals) if vals else None
    info["loaded_tensors"] = sum(e[3] or 0 for e in every)  # all ranks' local tensors
    info.update(ok=not allp, problems=allp[:50], n_problems=len(allp), seconds=round(time.time() - t0, 2))


class _Judged(Exception):
    """The verdict's problems are recorded: stop judging."""


def cmd_bridge_load(a, serving=False) -> int:
    """Megatron-Bridge's own loader (model_load_save.load_megatron_model) on a Bridge checkpoint: the model from
    its run_config.yaml; see the module docstring."""
    t0 = time.time()
    apply_shims()
    import torch
    import torch.distributed as dist
    import yaml
    from megatron.bridge.training import checkpointing as bridge_ckpt
    from megatron.bridge.training import model_load_save

    from oracles.common import compare, end_parallel, resolve_iter_dir, tensor_state, unwrap
    from oracles.qwen3_next import ensure_pg, init_dist, load_into, nan_fill
    from oracles.te_cpu import CPU_KERNELS

    assert not set(LOAD_OVERRIDES) & set(MATH_FIELDS) and not set(CPU_KERNELS) & set(MATH_FIELDS)
    rank = ensure_pg()[0]
    problems: list[str] = []
    info: dict = {"ckpt": a.ckpt, "truth": a.truth, "hf": a.hf, "arch": a.arch, "loader": "megatron.bridge.training."
                  "model_load_save.load_megatron_model(model_type='gpt', use_cpu_init=True, mp_overrides=layout)"}
    overrides: dict = {}
    seen: dict = {}
    state = {"load_dir": None, "problems": problems}  # load_dir None: Bridge's own weights load
    ref = torch.load(a.logits, map_location="cpu", weights_only=True)
    ids, hlog = ref["ids"], ref["logits"]
    orig_config, orig_weights = model_load_save.load_model_config, bridge_ckpt._load_model_weights_from_checkpoint

    def load_model_config(checkpoint_path):
        cfg, mlm_args = orig_config(checkpoint_path)  # Bridge: instantiate(run_config["model"])
        seen["cfg"] = cfg
        for k, v in {**CPU_KERNELS, **LOAD_OVERRIDES}.items():
            if hasattr(cfg, k) and getattr(cfg, k) != v:
                overrides[k] = {"run_config": plain(getattr(cfg, k)), "loaded_with": v}
                setattr(cfg, k, v)
        return cfg, mlm_args

    def load_weights(checkpoint_path, model, *args, **kwargs):
        state["model"] = model
        for c in model:
            nan_fill(unwrap(c))  # a tensor the load leaves alone stays NaN
        if state["load_dir"] is None:
            return orig_weights(checkpoint_path, model, *args, **kwargs)
        try:
            load_into(unwrap(model[0]), state["load_dir"], state["problems"])  # the truth, strictly
        except BaseException as e:  # noqa: BLE001 - megatron-core's refusal: a problem; Bridge's own load still judged
            state["problems"].append(error_line(e))
        return None

    def bridge_loaded(iter_dir: Path, layout: dict):
        model_load_save.load_model_config = load_model_config
        bridge_ckpt._load_model_weights_from_checkpoint = load_weights
        try:
            with cpu_spec_backend():
                model = model_load_save.load_megatron_model(str(iter_dir), model_type="gpt", use_cpu_init=True,
                                                            skip_temp_dist_context=True, mp_overrides=layout)
        finally:
            model_load_save.load_model_config = orig_config
            bridge_ckpt._load_model_weights_from_checkpoint = orig_weights
        model = model if isinstance(model, list) else [model]
        for c in model:
            c.eval()
        return model

    try:
        iter_dir, truth_dir = Path(resolve_iter_dir(a.ckpt)), Path(resolve_iter_dir(a.truth))
        rc_file = iter_dir / "run_config.yaml"
        if not rc_file.is_file():
            raise FileNotFoundError(f"{rc_file}: not a Megatron-Bridge checkpoint (no run_config.yaml)")
        model_args = (yaml.safe_load(rc_file.read_text()) or {}).get("model") or {}
        layout = load_layout(a, model_args)
        info["layout"] = layout
        info["world"] = dist.get_world_size()
        init_dist(layout["tensor_model_parallel_size"], 1, layout["expert_model_parallel_size"],
                  layout["expert_tensor_parallel_size"])
        # the truth: megatron-core's strict load of TRUTH into a second model Bridge's loader builds from CKPT's
        # run_config.yaml the same way
        state["load_dir"], state["problems"] = truth_dir, (tprob := [])
        truth_model = bridge_loaded(iter_dir, layout)
        truth = tensor_state(truth_model)
        try:
            tlog, tmtp = forward_logits(unwrap(truth_model[0]), ids)
        except Exception as e:  # noqa: BLE001
            tprob.append(error_line(e))
            tlog = tmtp = None
        problems += [f"truth into the run_config model: {p}" for p in tprob]
        # the judged load: Bridge's own, then the strict checks (also where Bridge's load raises: which keys)
        state["load_dir"], state["problems"] = None, problems
        state.pop("model", None)
        try:
            model = bridge_loaded(iter_dir, layout)
        except BaseException as e:  # noqa: BLE001 - torch's CheckpointException is a BaseException
            problems.append(f"Bridge's loader: {error_line(e)}")
            if "model" in state:
                problems += strict_keys(unwrap(state["model"][0]), iter_dir)
            raise _Judged() from e
        cfg, m = seen["cfg"], unwrap(model[0])
        info["provider"] = f"{type(cfg).__module__}.{type(cfg).__qualname__}"
        info["built"] = {k: plain(getattr(cfg, k, None)) for k in ("transformer_layer_spec",
                                                                   "experimental_attention_variant",
                                                                   "multi_latent_attention", "mtp_num_layers",
                                                                   "dsa_indexer_rope_interleaved",
                                                                   "dsa_indexer_rotate_activation")}
        for k, want in ARCH_DSA[a.arch].items():
            if getattr(cfg, k, None) != want:
                problems.append(f"run_config: {k} = {getattr(cfg, k, None)!r}, {a.arch} computes {want!r}")
        got = tensor_state(model)
        info["loaded_tensors"] = len(got)
        problems += [f"not loaded by Bridge's loader (still NaN): {k}" for k, v in got.items()
                     if v.is_floating_point() and torch.isnan(v).any()]
        problems += strict_keys(m, iter_dir)
        problems += compare(got, truth, "loaded vs truth")
        mlog, mmtp = forward_logits(m, ids)
        info["logits_max_abs_diff_vs_hf"] = diff = (mlog - hlog).abs().max().item()
        info["logits_scale"] = hlog.abs().max().item()
        if not diff <= a.atol:
            problems.append(f"logits differ from transformers' by {diff:.3g} (atol {a.atol})")
        if tmtp is not None:
            info["truth_logits_max_abs_diff_vs_hf"] = (tlog - hlog).abs().max().item()
            info["mtp_logits_max_abs_diff"] = mdiff = (mmtp - tmtp).abs().max().item()
            if not mdiff <= a.mtp_atol:
                problems.append(f"MTP logits differ from the truth model's by {mdiff:.3g} (atol {a.mtp_atol})")
    except _Judged:
        pass
    except BaseException as e:  # noqa: BLE001 - a refused load is a verdict (SystemExit from resolve too)
        problems.append(error_line(e))
    info["overrides"] = overrides
    gather_verdict(info, problems, t0)
    end_parallel(serving)
    if rank == 0:
        print(json.dumps(info), flush=True)
    return 0 if info["ok"] else 1


# ----------------------------------------------------------------------------- mutate


def cmd_mutate(a, serving=False) -> int:
    """A copy of SRC with one defect (MUTATIONS, see the module docstring), saved by Bridge's save_megatron_model
    at TP = world size."""
    apply_shims()
    import torch

    from oracles.common import drop_objects, end_parallel, resolve_iter_dir, unwrap
    from oracles.qwen3_next import ensure_pg, load_into

    rank, tmp = 0, None
    try:
        world = ensure_pg()[1]
        rank, _, bridge, provider, model, view, tmp = setup(a.hf, a.arch, False, tp=world)
        m = unwrap(model[0])
        problems: list[str] = []
        load_into(m, Path(resolve_iter_dir(a.src)), problems)
        assert not problems, problems
        mtp_layer = m.mtp.layers[0]
        with torch.no_grad():
            if a.kind == "swap_indexer_heads":
                w = m.decoder.layers[1].self_attention.core_attention.indexer.linear_wq_b.weight
                d = provider.dsa_indexer_head_dim
                w[:2 * d] = torch.cat([w[d:2 * d], w[:d]]).clone()
            elif a.kind == "swap_eh_halves":  # [out/TP, 2h]: the input halves are whole on every rank
                w = mtp_layer.eh_proj.weight
                h = provider.hidden_size
                w.copy_(torch.cat([w[:, h:], w[:, :h]], dim=1))
            elif a.kind == "k_norm_bias":
                m.decoder.layers[2].self_attention.core_attention.indexer.k_norm.bias.zero_()
            elif a.kind == "value":
                mtp_layer.mtp_model_layer.self_attention.core_attention.indexer.linear_wk.weight[3, 5] += 1e-3
        if a.kind == "drop_object":
            drop_objects(m, lambda k: k.endswith("indexer.k_norm._extra_state"))
        bridge.save_megatron_model(model, a.dst, hf_tokenizer_path=view)
    finally:
        end_parallel(serving)
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    if rank == 0:
        print(json.dumps({"mutated": str(a.dst), "kind": a.kind}))
    return 0


# ----------------------------------------------------------------------------- main


def main(argv=None, serving=False) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("make")
    sp.add_argument("hf_dir")
    sp.add_argument("--arch", choices=tuple(ARCHS), required=True)
    sp.add_argument("--logits", required=True, help="where transformers' logits go (outside HF_DIR)")
    sp.add_argument("--seed", type=int, default=0)
    sp = sub.add_parser("bridge-import")
    sp.add_argument("hf_dir")
    sp.add_argument("out_dir")
    sp = sub.add_parser("judge")
    sp.add_argument("ckpts", nargs="+")
    sp.add_argument("--truth", required=True, help="Bridge's own TP1 import of --hf (bridge-import)")
    sp.add_argument("--hf", required=True)
    sp.add_argument("--logits", required=True, help="make's transformers logits")
    sp.add_argument("--arch", choices=tuple(ARCHS), required=True)
    sp.add_argument("--tp", type=int, default=1)
    sp.add_argument("--pp", type=int, default=1)
    sp.add_argument("--ep", type=int, default=1)
    for what in ("tp", "pp", "ep"):
        sp.add_argument(f"--expect-{what}", type=int, default=None,
                        help=f"the {what.upper()} every checkpoint must record (default: not checked)")
    sp.add_argument("--atol", type=float, default=1e-4, help="main logits vs transformers, max abs")
    sp.add_argument("--mtp-atol", type=float, default=1e-4, help="MTP logits vs the truth model's, max abs")
    sp = sub.add_parser("bridge-load")
    sp.add_argument("ckpt", help="a Megatron-Bridge checkpoint (run_config.yaml)")
    sp.add_argument("--truth", required=True, help="Bridge's own TP1 import of --hf (bridge-import)")
    sp.add_argument("--hf", required=True)
    sp.add_argument("--logits", required=True, help="make's transformers logits")
    sp.add_argument("--arch", choices=tuple(ARCHS), required=True)
    for what in ("tp", "ep", "etp"):
        sp.add_argument(f"--{what}", type=int, default=None,
                        help=f"load at this {what.upper()} (Bridge's mp_overrides; default: run_config.yaml's)")
    sp.add_argument("--atol", type=float, default=1e-4, help="main logits vs transformers, max abs")
    sp.add_argument("--mtp-atol", type=float, default=1e-4, help="MTP logits vs the truth model's, max abs")
    sp = sub.add_parser("mutate")
    sp.add_argument("src")
    sp.add_argument("dst")
    sp.add_argument("--hf", required=True)
    sp.add_argument("--arch", choices=tuple(ARCHS), required=True)
    sp.add_argument("--kind", choices=MUTATIONS, required=True)
    a = p.parse_args(argv)
    if a.cmd == "make":
        from oracles.common import make_on_rank0

        return make_on_rank0(cmd_make, a)
    cmds = {"bridge-import": cmd_bridge_import, "judge": cmd_judge, "bridge-load": cmd_bridge_load,
            "mutate": cmd_mutate}
    return cmds[a.cmd](a, serving)


if __name__ == "__main__":
    run_program(main)
