"""Oracle for Nemotron-H (``NemotronHForCausalLM``) checkpoints on megatron-core **0.16.1** (the default venv, Python
3.11, transformers 5.14.1; no Megatron-Bridge, no Transformer Engine, no mamba_ssm, no triton). The Megatron side is
megatron-core 0.16.1's own ``MambaModel`` built from ``models/mamba/mamba_layer_specs.mamba_stack_spec``; the HF side
is transformers' ``NemotronHForCausalLM``. Imports megatron-core and transformers; never dist_convert.
(tests/oracles/nemotron_h.py judges the same conversions on megatron-core 0.19.2 through Megatron-Bridge.)

  oracles/mamba16.py judge --hf HF_DIR [--tp T] [--pp P] [--atol A] CKPT [CKPT ...]
      world size T*P (TP = world size / P when --tp is omitted). Builds MambaModel at TP T / PP P from HF_DIR's
      config.json by this file's own mapping (``model_config``), then per CKPT (a root with
      latest_checkpointed_iteration.txt or an iteration dir; the format is detected):
        * torch_dist: ``dist_checkpointing.load`` of the model's ``sharded_state_dict()`` with
          StrictHandling.RAISE_ALL (no missing, no unexpected key or object; any stored TP/PP: megatron-core
          reshards), every stored tensor's dtype == the model's, TE's check of every _extra_state, then
          ``load_state_dict`` (every key but an _extra_state the sharded state dict does not save)
        * legacy: this rank's ``mp_rank_TT[_PPP]/model_optim_rng.pt``, its ``model`` loaded with
          ``load_state_dict``: every key of the module (a missing _extra_state only when megatron-core's
          sharded_state_dict does not save it either, i.e. TEDotProductAttention's), no unexpected key, every
          stored tensor of the module's shape and dtype, TE's check of every _extra_state
        * every loaded tensor (this rank's state_dict, _extra_state aside) == the truth, bit for bit: the HF
          safetensors mapped by ``hf_truth`` (this file's own mapping) and cut to this rank's TP shard the way
          megatron-core's modules shard them (``shard``)
        * PP 1: logits on fixed ids (2 x 16 tokens) vs transformers' NemotronHForCausalLM's (fp32, the torch
          path): those of the model ``nemotron_h.py make`` made, saved beside HF_DIR, within --atol (1e-4)
      one JSON line per CKPT on rank 0: {"ckpt", "ok", "format", "loaded_tensors" (summed over ranks),
      "logits_max_abs_diff_vs_hf", "stored_tp", "stored_pp", "problems", ...}; exit 1 if any CKPT failed.
  oracles/mamba16.py save --hf HF_DIR [--tp T] [--pp P] --out-torch-dist D1 --out-legacy D2
      the positive control: the model built as for judge, the truth loaded into it, then saved by megatron-core
      0.16.1 itself: ``dist_checkpointing.save({"model": sharded_state_dict()}, D1)`` and each rank's
      ``{"model": state_dict()}`` as D2/mp_rank_TT[_PPP]/model_optim_rng.pt (both plain iteration dirs).

The mapping (HF config.json -> TransformerConfig / MambaModel arguments; written from transformers'
configuration_nemotron_h.py and megatron-core 0.16.1's MambaMixer / MambaStack, independent of dist_convert):
  * ``layers_block_type`` (mamba|linear_attention -> M, attention|full_attention -> *, mlp -> -, moe -> E) or a
    ``hybrid_override_pattern`` string -> ``hybrid_override_pattern``; num_layers = its length
  * mamba_num_heads, mamba_head_dim, n_groups -> mamba_num_groups, ssm_state_size -> mamba_state_dim; conv_kernel
    must be 4, use_conv_bias True, mamba_proj_bias/use_bias False (MambaMixer's fixed choices)
  * num_attention_heads, num_key_value_heads -> num_query_groups, head_dim -> kv_channels; intermediate_size ->
    ffn_hidden_size with squared_relu (mlp_hidden_act relu2, not gated); RMSNorm, layer_norm_epsilon;
    position_embedding_type none; no biases; tie_word_embeddings -> share_embeddings_and_output_weights
  * MoE: n_routed_experts -> num_moe_experts, moe_intermediate_size -> moe_ffn_hidden_size,
    moe_shared_expert_intermediate_size x n_shared_experts, num_experts_per_tok -> moe_router_topk, sigmoid scores,
    moe_router_enable_expert_bias, routed_scaling_factor -> moe_router_topk_scaling_factor, n_group/topk_group ->
    group-limited routing when n_group > 1, fp32 router, grouped GEMM (TEGroupedMLP); norm_topk_prob must be true
    (megatron-core always normalizes sigmoid top-k > 1)
  * tensors: ``backbone.embedding(s).weight`` -> embedding.word_embeddings.weight; ``backbone.norm_f.weight`` ->
    decoder.final_norm.weight; ``lm_head.weight`` -> output_layer.weight; per layer ``norm.weight`` -> the fused
    norm of its kind (mixer.in_proj / self_attention.linear_qkv / mlp.linear_fc1 .layer_norm_weight,
    pre_mlp_layernorm.weight); Mamba mixer.{in_proj.weight, conv1d.weight, conv1d.bias, A_log, D, dt_bias,
    norm.weight, out_proj.weight} by identity; q/k/v -> linear_qkv group-major ([q of group g; k_g; v_g] per
    query group), o_proj -> linear_proj; up/down_proj -> mlp.linear_fc1/fc2; gate.weight -> mlp.router.weight,
    gate.e_score_correction_bias -> mlp.router.expert_bias; experts.{e}.up/down_proj (or the 3-D in-memory
    experts.up_proj/down_proj) -> mlp.experts.linear_fc1/fc2.weight{e}; shared_experts -> mlp.shared_experts
  * TP: in_proj rows = sections z, x, B, C, dt and conv1d rows = x, B, C, each section cut over TP on its own;
    A_log / D / dt_bias / mixer.norm.weight / column linears / vocab rows cut on dim 0; row linears on dim 1;
    norms, router and expert_bias replicated (expert TP = TP, EP 1).

megatron-core 0.16.1 facts this relies on (read in its sources): MambaMixer's conv is an ``nn.Conv1d`` child, so
its state_dict names are ``mixer.conv1d.weight`` / ``mixer.conv1d.bias`` (0.19.2 keeps ``conv1d_weight`` /
``conv1d_bias`` parameters on the mixer); torch_dist keys are the same in both: ``mixer.in_proj.weight.{z,x,B,C,dt}``,
``mixer.conv1d.{weight,bias}.{x,B,C}`` (``_split_tensor_factory``), per global layer ``decoder.layers.{g}.*``;
TEDotProductAttention's sharded_state_dict saves nothing for a vanilla softmax (its _extra_state is only in the
legacy state_dict); TEGroupedMLP's torch_dist keys are ``mlp.experts.experts.linear_fc{1,2}.weight`` [E, ...] with
one _extra_state per expert, its legacy names ``mlp.experts.linear_fc{1,2}.weight{e}`` + one ``_extra_state``.

CPU stand-ins (exactly the kernel calls; every projection, split, conv, gate, router, dispatcher is megatron-core's):
  * ``megatron.core.inference.contexts.attention_context.triton.tensor_ops`` (imported by mamba_mixer, needs
    triton; used only by dynamic-batching inference): a module whose three functions raise if ever called
  * ``mamba_mixer.mamba_chunk_scan_combined`` -> oracles.nemotron_h.selective_scan (the plain sequential scan);
    ``use_mamba_mem_eff_path=False`` (megatron's _ssm_prefill; causal_conv1d absent -> its own Conv1d + SiLU)
  * ``RMSNormGated`` (mamba_ssm's Triton gated norm) -> ``GatedRMSNorm`` (per-group RMSNorm of y * silu(z), times
    weight); megatron-core 0.16.1's own ``ExtendedRMSNorm`` class body compiled from its source on top of it
  * TE leaves of mamba_stack_spec swapped (each slot must hold the expected TE class): TELayerNormColumnParallelLinear
    (in_proj, linear_qkv, MLP fc1: ``layer_norm_weight`` + ``weight``), TERowParallelLinear, TEDotProductAttention
    (megatron-core's local DotProductAttention; no sharded state), TENorm (pre_mlp_layernorm; final_norm via
    mamba_block.TENorm while building), and the MoE spec rebuilt by megatron-core's own ``get_moe_module_spec(
    use_te=True, num_experts=8, moe_grouped_gemm=True, moe_use_legacy_grouped_gemm=False)`` (as mamba_layer_specs
    calls it) with TESpecProvider's TE classes swapped for stand-ins, giving TEGroupedMLP over
    TEColumn/RowParallelGroupedLinear stand-ins (``weight{e}``, one _extra_state, 0.16.1's
    ``_sharded_state_dict_grouped`` and ``merge_extra_states`` hook reproduced) and shared experts on
    TEColumn/TERowParallelLinear stand-ins. Without TE the import-time spec holds the legacy GroupedMLP instead.
    Each stand-in carries TE's parameter names, TE 2.x's _extra_state (an empty uint8 tensor; a pickled {} for the
    RMSNorm op) and the TE wrapper's sharded_state_dict.
  * CUDA: tests/oracles/mcore.py apply_cpu_shims; ``fused_softmax.get_default_causal_mask`` made on the CPU
  * CPU-only switches (no effect on names, shapes or values): allgather dispatcher, no permute fusion, no shared
    expert overlap, no masked-softmax / bias-dropout / persist-layer-norm / gradient-accumulation fusion.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the oracles package, helpers

from oracles.common import is_legacy, run_program  # noqa: E402
from oracles.nemotron_h import made_logits, megatron_logits, tensor_state  # noqa: E402

SEQ = 16  # judge input length: > conv kernel (4) and > the tiny model's chunk_size (8)
KINDS = {"mamba": "M", "linear_attention": "M", "attention": "*", "full_attention": "*", "mlp": "-", "moe": "E"}
TENSOR_OPS = "megatron.core.inference.contexts.attention_context.triton.tensor_ops"


# ----------------------------------------------------------------------------- shims and stand-ins


def stub_tensor_ops() -> None:
    """mamba_mixer imports three triton kernels of dynamic-batching inference at module level; triton is absent."""
    if TENSOR_OPS in sys.modules:
        return
    mod = types.ModuleType(TENSOR_OPS)

    def unavailable(*a, **k):
        raise RuntimeError("triton tensor_ops: not available on the CPU (dynamic-batching inference only)")

    mod.tensor_get_slice_after = mod.tensor_masked_update = mod.tensor_merge = unavailable
    sys.modules[TENSOR_OPS] = mod


_STANDINS = None


def standins() -> dict:
    global _STANDINS
    if _STANDINS is not None:
        return _STANDINS
    import torch
    import torch.nn.functional as F
    from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
    from megatron.core.ssm import mamba_mixer
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        gather_from_tensor_model_parallel_region,
        reduce_from_tensor_model_parallel_region,
    )
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint
    from megatron.core.utils import get_pg_rank, get_pg_size

    from oracles.te_cpu import ExtraState, new_param, rms, te_accepts_extra_state, te_op_extra_state, tp_of

    class TENorm(ExtraState, torch.nn.Module):
        """te.pytorch.RMSNorm as megatron-core's TENorm builds it: ``weight``, no sharded_state_dict of its own."""
        _extra = staticmethod(te_op_extra_state)

        def __init__(self, config, hidden_size, eps=1e-5):
            super().__init__()
            assert config.normalization == "RMSNorm", config.normalization
            self.eps, self.zc = eps, config.layernorm_zero_centered_gamma
            self.weight = new_param((hidden_size,), config, value=0.0 if self.zc else 1.0)

        def forward(self, x):
            return rms(x, self.weight, self.eps, self.zc)

    class TELayerNormColumnParallelLinear(ExtraState, torch.nn.Module):
        """RMSNorm (``layer_norm_weight``) fused before a column-parallel linear (``weight`` TP axis 0)."""

        def __init__(self, input_size, output_size, *, config, init_method, gather_output, bias, skip_bias_add,
                     is_expert, skip_weight_param_allocation=False, tp_comm_buffer_name=None, tp_group=None,
                     stride=1, **kw):
            super().__init__()
            assert not gather_output and not bias and not is_expert and not skip_weight_param_allocation
            self.config, self._tp_group = config, tp_of(tp_group)
            self.eps, self.zc = config.layernorm_epsilon, config.layernorm_zero_centered_gamma
            self.layer_norm_weight = new_param((input_size,), config, value=0.0 if self.zc else 1.0)
            self.weight = new_param((output_size // self._tp_group.size(), input_size), config, init_method)
            set_tensor_model_parallel_attributes(self.weight, True, 0, stride)

        def forward(self, x):
            x = copy_to_tensor_model_parallel_region(rms(x, self.layer_norm_weight, self.eps, self.zc),
                                                     group=self._tp_group)
            return F.linear(x, self.weight), None

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            metadata = ensure_metadata_has_dp_cp_group(metadata)
            return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix,
                                                       {"weight": 0, "bias": 0}, sharded_offsets,
                                                       tp_group=self._tp_group, dp_cp_group=metadata["dp_cp_group"])

    class TEColumnParallelLinear(ExtraState, torch.nn.Module):
        def __init__(self, input_size, output_size, *, config, init_method, gather_output, bias, skip_bias_add,
                     is_expert, skip_weight_param_allocation=False, tp_comm_buffer_name=None, tp_group=None,
                     stride=1, **kw):
            super().__init__()
            assert not bias and not skip_weight_param_allocation
            self.config, self._tp_group, self.gather_output = config, tp_of(tp_group), gather_output
            self.weight = new_param((output_size // self._tp_group.size(), input_size), config, init_method)
            set_tensor_model_parallel_attributes(self.weight, True, 0, stride)

        def forward(self, x):
            out = F.linear(copy_to_tensor_model_parallel_region(x, group=self._tp_group), self.weight)
            if self.gather_output:
                out = gather_from_tensor_model_parallel_region(out, group=self._tp_group)
            return out, None

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            metadata = ensure_metadata_has_dp_cp_group(metadata)
            return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix,
                                                       {"weight": 0, "bias": 0}, sharded_offsets,
                                                       tp_group=self._tp_group, dp_cp_group=metadata["dp_cp_group"])

    class TERowParallelLinear(ExtraState, torch.nn.Module):
        def __init__(self, input_size, output_size, *, config, init_method, bias, input_is_parallel, skip_bias_add,
                     is_expert, tp_comm_buffer_name=None, tp_group=None, **kw):
            super().__init__()
            assert input_is_parallel and not bias
            self.config, self._tp_group = config, tp_of(tp_group)
            self.weight = new_param((output_size, input_size // self._tp_group.size()), config, init_method)
            set_tensor_model_parallel_attributes(self.weight, True, 1, 1)

        def forward(self, x):
            return reduce_from_tensor_model_parallel_region(F.linear(x, self.weight), group=self._tp_group), None

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            metadata = ensure_metadata_has_dp_cp_group(metadata)
            return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix,
                                                       {"weight": 1}, sharded_offsets,
                                                       tp_group=self._tp_group, dp_cp_group=metadata["dp_cp_group"])

    class TEDotProductAttention(ExtraState, DotProductAttention):
        """causal softmax attention on megatron-core's local DotProductAttention; TEDotProductAttention's
        sharded_state_dict with a vanilla softmax: nothing."""

        def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                     softmax_scale=None, k_channels=None, v_channels=None, cp_comm_type="p2p", pg_collection=None,
                     **kw):
            super().__init__(config, layer_number, attn_mask_type, attention_type, attention_dropout=attention_dropout,
                             softmax_scale=softmax_scale, cp_comm_type=cp_comm_type, pg_collection=pg_collection)

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            assert self.config.softmax_type == "vanilla", self.config.softmax_type
            return {}

    class TEGroupedLinear(ExtraState, torch.nn.Module):
        """megatron-core 0.16.1's TEGroupedLinear (te.pytorch.GroupedLinear) for experts, non-FP8."""
        parallel_mode = None

        def __init__(self, num_gemms, input_size, output_size, *, config, init_method, bias, skip_bias_add,
                     is_expert, tp_comm_buffer_name=None, pg_collection=None):
            super().__init__()
            assert not bias and is_expert
            if pg_collection is None:
                from megatron.core.process_groups_config import ProcessGroupCollection

                pg_collection = ProcessGroupCollection.use_mpu_process_groups()
            self.config, self.num_gemms, self.use_bias, self._pg_collection = config, num_gemms, False, pg_collection
            self._tp_group = pg_collection.expt_tp
            tp = get_pg_size(self._tp_group)
            col = self.parallel_mode == "column"
            shape = (output_size // tp, input_size) if col else (output_size, input_size // tp)
            for i in range(num_gemms):
                w = new_param(shape, config, init_method)
                set_tensor_model_parallel_attributes(w, True, 0 if col else 1, 1)
                w.allreduce = False
                setattr(self, f"weight{i}", w)
            self._register_load_state_dict_pre_hook(type(self)._merge_extra_states, with_module=True)

        def _merge_extra_states(self, state_dict, prefix, *args):
            """TE's merge_extra_states, non-FP8: the per-expert ``_extra_state{i}`` of a torch_dist load popped."""
            try:
                state_list = [state_dict.pop(f"{prefix}_extra_state{i}") for i in range(1, self.num_gemms)]
            except KeyError:
                return  # a torch-native (legacy) state dict has only ``_extra_state``
            for i, st in enumerate(state_list, 1):
                te_accepts_extra_state(st, f"{prefix}_extra_state{i}")

        def forward(self, x, m_splits):
            parts = torch.split(x, [int(s) for s in m_splits])
            return torch.cat([F.linear(p, getattr(self, f"weight{i}")) for i, p in enumerate(parts)]), None

        def _sharded_state_dict_grouped(self, tp_axis_map, prefix="", sharded_offsets=(), metadata=None):
            singleton_local_shards = (metadata or {}).get("singleton_local_shards", False)
            sharded_state_dict = {}
            full_state_dict = self.state_dict(prefix="", keep_vars=True)
            num_global_experts = get_pg_size(self._pg_collection.ep) * self.num_gemms
            local_expert_indices_offset = get_pg_rank(self._pg_collection.ep) * self.num_gemms
            ep_axis = len(sharded_offsets)
            extra_states = [full_state_dict["_extra_state"]] * self.num_gemms  # _split_extra_state, no FP8
            for gemm_idx in range(self.num_gemms):
                global_expert_idx = local_expert_indices_offset + gemm_idx
                state_dict = {f"{gemm_idx}.weight": full_state_dict[f"weight{gemm_idx}"],
                              f"{gemm_idx}._extra_state": extra_states[gemm_idx]}
                if singleton_local_shards:
                    expert_prefix, new_sharded_offsets = f"{global_expert_idx}.{prefix}", sharded_offsets
                else:
                    expert_prefix = prefix
                    new_sharded_offsets = (*sharded_offsets, (ep_axis, global_expert_idx, num_global_experts))
                sub_sd = make_sharded_tensors_for_checkpoint(state_dict, "", tp_axis_map, new_sharded_offsets,
                                                             tp_group=self._tp_group,
                                                             dp_cp_group=metadata["dp_cp_group"])
                replace_prefix_for_sharding(sub_sd, f"{gemm_idx}.", expert_prefix)
                sharded_state_dict.update({
                    f"{prefix}weight{gemm_idx}": sub_sd[f"{gemm_idx}.weight"],
                    f"{prefix}_extra_state{'' if gemm_idx == 0 else gemm_idx}": sub_sd[f"{gemm_idx}._extra_state"]})
            for k, sh_ten in sharded_state_dict.items():
                replica_id = sh_ten.replica_id
                assert len(replica_id) == 3, (k, replica_id)
                edp = 0 if getattr(sh_ten, "is_data_parallel_fully_shard", False) else get_pg_rank(
                    self._pg_collection.expt_dp)
                sh_ten.replica_id = (*replica_id[:2], edp)
            return sharded_state_dict

    class TEColumnParallelGroupedLinear(TEGroupedLinear):
        parallel_mode = "column"

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            tp_axis_map = {}
            for gemm_idx in range(self.num_gemms):
                tp_axis_map.update({f"{gemm_idx}.weight": 0, f"{gemm_idx}.bias": 0})
            return self._sharded_state_dict_grouped(tp_axis_map, prefix, sharded_offsets, metadata)

    class TERowParallelGroupedLinear(TEGroupedLinear):
        parallel_mode = "row"

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            tp_axis_map = {f"{gemm_idx}.weight": 1 for gemm_idx in range(self.num_gemms)}
            return self._sharded_state_dict_grouped(tp_axis_map, prefix, sharded_offsets, metadata)

    class GatedRMSNorm(torch.nn.Module):
        """mamba_ssm.ops.triton.layernorm_gated.RMSNorm: weight [hidden]; forward(x, z): per group of
        ``group_size`` channels RMSNorm of x * silu(z) (norm_before_gate=False), times weight."""

        def __init__(self, hidden_size, eps=1e-5, group_size=None, norm_before_gate=True, device=None, dtype=None):
            super().__init__()
            self.eps, self.group_size, self.norm_before_gate = eps, group_size or hidden_size, norm_before_gate
            self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype))
            self.register_parameter("bias", None)

        def forward(self, x, z=None):
            dtype, y = x.dtype, x.float()
            if z is not None and not self.norm_before_gate:
                y = y * F.silu(z.float())
            shp = y.shape
            yg = y.reshape(*shp[:-1], shp[-1] // self.group_size, self.group_size)
            y = (yg * torch.rsqrt(yg.pow(2).mean(-1, keepdim=True) + self.eps)).reshape(shp) * self.weight.float()
            if z is not None and self.norm_before_gate:
                y = y * F.silu(z.float())
            return y.to(dtype)

    # megatron-core 0.16.1's own ExtendedRMSNorm class body (its sharded_state_dict) on top of the plain module
    src = Path(mamba_mixer.__file__).read_text()
    m = re.search(r"^class ExtendedRMSNorm\(RMSNormGated\):\n(?:(?:    .*|)\n)+", src, re.M)
    assert m, "mamba_mixer.ExtendedRMSNorm: source changed"
    scope = dict(vars(mamba_mixer))
    scope["RMSNormGated"] = GatedRMSNorm
    exec(compile(m.group(0), mamba_mixer.__file__, "exec"), scope)

    classes = {"TENorm": TENorm, "TELayerNormColumnParallelLinear": TELayerNormColumnParallelLinear,
               "TEColumnParallelLinear": TEColumnParallelLinear, "TERowParallelLinear": TERowParallelLinear,
               "TEDotProductAttention": TEDotProductAttention,
               "TEColumnParallelGroupedLinear": TEColumnParallelGroupedLinear,
               "TERowParallelGroupedLinear": TERowParallelGroupedLinear, "GatedRMSNorm": GatedRMSNorm,
               "ExtendedRMSNorm": scope["ExtendedRMSNorm"]}
    for name, cls in classes.items():
        cls.__qualname__ = name
    _STANDINS = classes
    return classes


def apply_shims() -> None:
    import torch

    stub_tensor_ops()
    from oracles.common import apply_cpu_shims

    apply_cpu_shims()
    from megatron.core.fusions import fused_softmax

    fused_softmax.get_default_causal_mask = lambda sq: torch.triu(torch.ones(sq, sq), diagonal=1).bool()
    from megatron.core.ssm import mamba_mixer

    from oracles.nemotron_h import selective_scan

    c = standins()
    mamba_mixer.HAVE_MAMBA_SSM = True
    mamba_mixer.RMSNormGated = c["GatedRMSNorm"]
    mamba_mixer.ExtendedRMSNorm = c["ExtendedRMSNorm"]
    mamba_mixer.mamba_chunk_scan_combined = selective_scan
    mamba_mixer.mamba_split_conv1d_scan_combined = None
    mamba_mixer.causal_conv1d_fn = None


def cpu_mamba_stack_spec():
    """megatron-core 0.16.1's mamba_stack_spec with its TE leaves swapped for the stand-ins (each swapped slot must
    hold the TE class expected there) and its MoE spec rebuilt as megatron-core builds it with TE present."""
    import copy

    from megatron.core.extensions import transformer_engine as te_ext
    from megatron.core.extensions import transformer_engine_spec_provider as tsp
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.models.mamba.mamba_layer_specs import mamba_stack_spec
    from megatron.core.transformer.moe.experts import TEGroupedMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.shared_experts import SharedExpertMLP

    from oracles.nemotron_h import own

    c = standins()
    spec = copy.copy(mamba_stack_spec)
    sub = own(spec, "submodules")
    mixer = own(sub, "mamba_layer", "submodules", "mixer", "submodules")
    attn = own(sub, "attention_layer", "submodules", "self_attention", "submodules")
    mlp = own(sub, "mlp_layer", "submodules", "mlp", "submodules")
    moe_layer = own(sub, "moe_layer", "submodules")
    swaps = [(mixer, "in_proj", "TELayerNormColumnParallelLinear"), (mixer, "out_proj", "TERowParallelLinear"),
             (attn, "linear_qkv", "TELayerNormColumnParallelLinear"), (attn, "core_attention", "TEDotProductAttention"),
             (attn, "linear_proj", "TERowParallelLinear"), (mlp, "linear_fc1", "TELayerNormColumnParallelLinear"),
             (mlp, "linear_fc2", "TERowParallelLinear"), (moe_layer, "pre_mlp_layernorm", "TENorm")]
    for holder, name, want in swaps:  # without TE the TE classes are mock-derived: compared by identity
        cur = getattr(holder, name)
        assert cur is getattr(te_ext, want), f"mamba_stack_spec: {name}={cur!r}, expected {want}"
        setattr(holder, name, c[want])
    assert moe_layer.mlp.module is MoELayer, moe_layer.mlp
    names = ("TEColumnParallelGroupedLinear", "TERowParallelGroupedLinear", "TEColumnParallelLinear",
             "TERowParallelLinear")
    saved = {n: getattr(tsp, n) for n in names}
    try:
        for n in names:
            setattr(tsp, n, c[n])
        moe = get_moe_module_spec(use_te=True, num_experts=8, moe_grouped_gemm=True, moe_use_legacy_grouped_gemm=False)
    finally:
        for n, v in saved.items():
            setattr(tsp, n, v)
    ex, sh = moe.submodules.experts, moe.submodules.shared_experts
    assert ex.module is TEGroupedMLP and ex.submodules.linear_fc1 is c["TEColumnParallelGroupedLinear"], ex
    assert sh.module is SharedExpertMLP and sh.submodules.linear_fc1 is c["TEColumnParallelLinear"], sh
    moe_layer.mlp = moe
    return spec


# ----------------------------------------------------------------------------- config and model


def hf_config(hf: str) -> dict:
    return json.loads((Path(hf) / "config.json").read_text())


def pattern_of(cfg: dict) -> str:
    if cfg.get("layers_block_type"):
        return "".join(KINDS[t] for t in cfg["layers_block_type"])
    pat = cfg.get("hybrid_override_pattern")
    assert pat and set(pat) <= set("M*-E"), f"no usable layer pattern in config.json: {pat!r}"
    return pat


def model_config(cfg: dict, tp: int, pp: int):
    import torch
    from megatron.core.activations import squared_relu
    from megatron.core.transformer import TransformerConfig

    for key, want in (("conv_kernel", 4), ("use_conv_bias", True), ("mamba_proj_bias", False), ("use_bias", False),
                      ("attention_bias", False), ("mlp_bias", False), ("mlp_hidden_act", "relu2"),
                      ("mamba_hidden_act", "silu")):
        if key in cfg and cfg[key] != want:
            raise SystemExit(f"config.json {key}={cfg[key]!r}: megatron-core's MambaModel fixes {want!r}")
    pattern = pattern_of(cfg)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
        cfg.get("dtype") or cfg.get("torch_dtype") or "float32"]
    kw = dict(
        num_layers=len(pattern), hidden_size=cfg["hidden_size"], ffn_hidden_size=cfg["intermediate_size"],
        num_attention_heads=cfg["num_attention_heads"], num_query_groups=cfg["num_key_value_heads"],
        kv_channels=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
        activation_func=squared_relu, gated_linear_unit=False, normalization="RMSNorm",
        layernorm_epsilon=cfg["layer_norm_epsilon"], add_bias_linear=False, add_qkv_bias=False,
        hidden_dropout=0.0, attention_dropout=0.0, apply_query_key_layer_scaling=False,
        is_hybrid_model=True, mamba_num_heads=cfg["mamba_num_heads"], mamba_head_dim=cfg["mamba_head_dim"],
        mamba_num_groups=cfg["n_groups"], mamba_state_dim=cfg["ssm_state_size"], use_mamba_mem_eff_path=False,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=False,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        use_cpu_initialization=True, perform_initialization=False,
        masked_softmax_fusion=False, bias_dropout_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False, apply_rope_fusion=False)
    if "E" in pattern:
        if not cfg.get("norm_topk_prob", True):
            raise SystemExit("norm_topk_prob false: megatron-core normalizes sigmoid top-k scores (not mapped)")
        if cfg.get("moe_latent_size"):
            raise SystemExit("moe_latent_size: not mapped")
        kw.update(num_moe_experts=cfg["n_routed_experts"], moe_ffn_hidden_size=cfg["moe_intermediate_size"],
                  moe_shared_expert_intermediate_size=(cfg["moe_shared_expert_intermediate_size"]
                                                       * cfg.get("n_shared_experts", 1)
                                                       if cfg.get("n_shared_experts", 1) else None),
                  moe_router_topk=cfg["num_experts_per_tok"], moe_router_score_function="sigmoid",
                  moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=cfg.get("routed_scaling_factor"),
                  moe_router_dtype="fp32", moe_router_pre_softmax=False, moe_grouped_gemm=True,
                  moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.0,
                  moe_token_dispatcher_type="allgather", moe_permute_fusion=False, moe_shared_expert_overlap=False)
        if (cfg.get("n_group") or 1) > 1:
            kw.update(moe_router_num_groups=cfg["n_group"], moe_router_group_topk=cfg["topk_group"])
    return TransformerConfig(**kw), pattern


def build(hf: str, tp: int, pp: int):
    """MambaModel for this rank's stage (no VPP) on the CPU, eval mode, parallel_output False."""
    from megatron.core import parallel_state
    from megatron.core.models.mamba.mamba_model import MambaModel
    from megatron.core.ssm import mamba_block

    cfg = hf_config(hf)
    config, pattern = model_config(cfg, tp, pp)
    saved = mamba_block.TENorm
    mamba_block.TENorm = standins()["TENorm"]
    try:
        m = MambaModel(config=config, mamba_stack_spec=cpu_mamba_stack_spec(), vocab_size=cfg["vocab_size"],
                       max_sequence_length=cfg.get("max_position_embeddings", 4096),
                       pre_process=parallel_state.is_pipeline_first_stage(),
                       post_process=parallel_state.is_pipeline_last_stage(), hybrid_override_pattern=pattern,
                       parallel_output=False, share_embeddings_and_output_weights=bool(cfg.get("tie_word_embeddings")),
                       position_embedding_type="none")
    finally:
        mamba_block.TENorm = saved
    return m.eval(), cfg


# ----------------------------------------------------------------------------- the truth


def hf_tensors(hf: str) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(hf).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return {(k[len("model."):] if k.startswith("model.") else k): v for k, v in out.items()}  # in-memory prefix


def hf_truth(cfg: dict, hf: dict) -> dict:
    """Global (TP 1) megatron tensors by name, with GLOBAL layer numbers: HF names mapped by this file's mapping.
    Values: (tensor, how it is cut over TP): None = replicated, ("dim", d), ("sections", [sizes]) on dim 0."""
    import torch

    def get(*names):
        for n in names:
            for pre in ("backbone.", "model."):
                if pre + n in hf:
                    return hf[pre + n]
            if n in hf:
                return hf[n]
        raise KeyError(f"HF tensor not found: {names}")

    pattern = pattern_of(cfg)
    H, nh, p = cfg["hidden_size"], cfg["mamba_num_heads"], cfg["mamba_head_dim"]
    di, gn = nh * p, cfg["n_groups"] * cfg["ssm_state_size"]
    nq, ng = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or H // nq
    t = {"embedding.word_embeddings.weight": (get("embeddings.weight", "embedding.weight"), ("dim", 0)),
         "decoder.final_norm.weight": (get("norm_f.weight"), None)}
    if not cfg.get("tie_word_embeddings"):
        t["output_layer.weight"] = (hf["lm_head.weight"], ("dim", 0))
    for i, kind in enumerate(pattern):
        src, dst = f"layers.{i}.", f"decoder.layers.{i}."
        norm = get(src + "norm.weight")
        if kind == "M":
            t[dst + "mixer.in_proj.layer_norm_weight"] = (norm, None)
            t[dst + "mixer.in_proj.weight"] = (get(src + "mixer.in_proj.weight"), ("sections", [di, di, gn, gn, nh]))
            t[dst + "mixer.conv1d.weight"] = (get(src + "mixer.conv1d.weight"), ("sections", [di, gn, gn]))
            t[dst + "mixer.conv1d.bias"] = (get(src + "mixer.conv1d.bias"), ("sections", [di, gn, gn]))
            for n in ("A_log", "D", "dt_bias", "norm.weight"):
                t[dst + "mixer." + n] = (get(src + "mixer." + n), ("dim", 0))
            t[dst + "mixer.out_proj.weight"] = (get(src + "mixer.out_proj.weight"), ("dim", 1))
        elif kind == "*":
            q, k, v = (get(src + f"mixer.{n}_proj.weight") for n in "qkv")
            qg = q.reshape(ng, nq // ng * hd, H)
            qkv = torch.cat([qg, k.reshape(ng, hd, H), v.reshape(ng, hd, H)], dim=1).reshape(-1, H)
            t[dst + "self_attention.linear_qkv.layer_norm_weight"] = (norm, None)
            t[dst + "self_attention.linear_qkv.weight"] = (qkv, ("dim", 0))
            t[dst + "self_attention.linear_proj.weight"] = (get(src + "mixer.o_proj.weight"), ("dim", 1))
        elif kind == "-":
            t[dst + "mlp.linear_fc1.layer_norm_weight"] = (norm, None)
            t[dst + "mlp.linear_fc1.weight"] = (get(src + "mixer.up_proj.weight"), ("dim", 0))
            t[dst + "mlp.linear_fc2.weight"] = (get(src + "mixer.down_proj.weight"), ("dim", 1))
        else:
            t[dst + "pre_mlp_layernorm.weight"] = (norm, None)
            t[dst + "mlp.router.weight"] = (get(src + "mixer.gate.weight"), None)
            t[dst + "mlp.router.expert_bias"] = (get(src + "mixer.gate.e_score_correction_bias"), None)
            for e in range(cfg["n_routed_experts"]):
                try:
                    up, down = (get(src + f"mixer.experts.{e}.{n}.weight") for n in ("up_proj", "down_proj"))
                except KeyError:  # the in-memory 3-D layout
                    up, down = get(src + "mixer.experts.up_proj")[e], get(src + "mixer.experts.down_proj")[e]
                t[dst + f"mlp.experts.linear_fc1.weight{e}"] = (up, ("dim", 0))
                t[dst + f"mlp.experts.linear_fc2.weight{e}"] = (down, ("dim", 1))
            if cfg.get("n_shared_experts", 1):
                t[dst + "mlp.shared_experts.linear_fc1.weight"] = (get(src + "mixer.shared_experts.up_proj.weight"),
                                                                   ("dim", 0))
                t[dst + "mlp.shared_experts.linear_fc2.weight"] = (get(src + "mixer.shared_experts.down_proj.weight"),
                                                                   ("dim", 1))
    return t


def shard(x, how, tp: int, r: int):
    import torch

    if how is None:
        return x
    if how[0] == "dim":
        return torch.chunk(x, tp, dim=how[1])[r]
    parts = torch.split(x, how[1], dim=0)
    return torch.cat([torch.chunk(s, tp, dim=0)[r] for s in parts], dim=0)


def rank_truth(m, truth: dict) -> dict:
    """This rank's truth under its module's state_dict names: its stage's layers (local index <- global
    layer_number - 1), its TP shard, cast to the dtype the module keeps (fp32 A_log / D / expert_bias)."""
    import torch
    from megatron.core import parallel_state

    tp, r = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
    local = {}
    for i, layer in enumerate(m.decoder.layers):
        local[f"decoder.layers.{layer.layer_number - 1}."] = f"decoder.layers.{i}."
    have = {k: v for k, v in m.state_dict().items() if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}
    out = {}
    for name, (x, how) in truth.items():
        mm = re.match(r"(decoder\.layers\.\d+\.)(.*)", name)
        if mm:
            if mm.group(1) not in local:
                continue  # another stage's layer
            name = local[mm.group(1)] + mm.group(2)
        elif name not in have:
            continue  # embedding / output layer / final norm of another stage
        out[name] = shard(x, how, tp, r).to(have[name].dtype if name in have else x.dtype).contiguous()
    return out


# ----------------------------------------------------------------------------- loading


def legacy_file(iter_dir: Path) -> Path:
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    sub = f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    return iter_dir / sub / "model_optim_rng.pt"


def sharded_dtypes(sharded: dict) -> dict:
    """{stored key: dtype} of the model's sharded state dict (factories expanded as megatron-core builds them)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    out = {}
    for v in sharded.values():
        if isinstance(v, ShardedTensor):
            out[v.key] = v.dtype
        elif isinstance(v, ShardedTensorFactory):
            built = v.build_fn(v.key, v.data, v.replica_id, v.flattened_range)
            for b in (built if isinstance(built, list) else list(built.values()) if isinstance(built, dict)
                      else [built]):
                out[b.key] = b.dtype
    return out


def load_into(m, iter_dir: Path, problems: list[str]) -> bool:
    """``iter_dir`` into module ``m`` (this rank's stage) strictly, as the module docstring says."""
    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    from oracles.te_cpu import te_accepts_extra_state

    sharded = m.sharded_state_dict()
    if is_legacy(iter_dir):
        f = legacy_file(iter_dir)
        if not f.is_file():
            have = sorted(p.name for p in iter_dir.iterdir() if p.name.startswith("mp_rank_"))
            problems.append(f"legacy: no {f.relative_to(iter_dir)} (has {have[:8]}; judged at its own TP/PP)")
            return False
        from megatron.core.safe_globals import SAFE_GLOBALS

        torch.serialization.add_safe_globals(list(SAFE_GLOBALS))
        sd = torch.load(f, map_location="cpu", weights_only=True)["model"]
        wanted = {k for k in m.state_dict() if k.endswith("_extra_state") and k in sharded}
        problems += [f"legacy: _extra_state missing: {k}" for k in sorted(wanted - set(sd))]
        mine = m.state_dict()
        for k, v in sd.items():
            if isinstance(v, torch.Tensor) and not k.endswith("_extra_state") and k in mine and \
                    (v.dtype != mine[k].dtype or v.shape != mine[k].shape):
                problems.append(f"legacy: {k} stored {tuple(v.shape)} {v.dtype}, module {tuple(mine[k].shape)} "
                                f"{mine[k].dtype}")
    else:
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        md = FileSystemReader(str(iter_dir)).read_metadata().state_dict_metadata
        for key, want in sharded_dtypes(sharded).items():
            st = md.get(key)
            if isinstance(st, TensorStorageMetadata) and st.properties.dtype != want:
                problems.append(f"torch_dist: {key} stored {st.properties.dtype}, module {want}")
        sd = dist_checkpointing.load({"model": sharded}, str(iter_dir), strict=StrictHandling.RAISE_ALL)["model"]
    for k, v in sd.items():
        if k.endswith("_extra_state") or re.search(r"_extra_state\d+$", k):
            try:
                te_accepts_extra_state(v, k)
            except Exception as e:  # noqa: BLE001 - TE's verdict
                problems.append(f"{k}: {e}")
    res = m.load_state_dict(sd, strict=False)
    problems += [f"load_state_dict: missing {k}" for k in res.missing_keys
                 if not (k.endswith("._extra_state") and k not in sharded)]
    problems += [f"load_state_dict: unexpected {k}" for k in res.unexpected_keys]
    return True


def compare(got: dict, want: dict) -> list[str]:
    import torch

    problems = [f"loaded vs truth: missing {k}" for k in sorted(set(want) - set(got))]
    problems += [f"loaded vs truth: unexpected {k}" for k in sorted(set(got) - set(want))]
    for k in sorted(set(got) & set(want)):
        x, y = got[k], want[k]
        if x.shape != y.shape or x.dtype != y.dtype:
            problems.append(f"loaded vs truth: {k} {tuple(x.shape)} {x.dtype} vs {tuple(y.shape)} {y.dtype}")
        elif not torch.equal(x, y):
            d = (x.double() - y.double()).abs()
            problems.append(f"loaded vs truth: {k} differs, max abs diff {d.nan_to_num(float('inf')).max().item():.3g}")
    return problems


# ----------------------------------------------------------------------------- logits


def judge_ids(vocab: int):
    import torch

    return torch.randint(3, vocab, (2, SEQ), generator=torch.Generator().manual_seed(1234))


# ----------------------------------------------------------------------------- commands


def init(a):
    from oracles.common import init_dist

    rank, world = init_dist(a.pp)
    if a.tp is not None and a.tp * a.pp != world:
        raise SystemExit(f"--tp {a.tp} x --pp {a.pp} != world size {world}")
    return rank, world, world // a.pp


def judge_one(ckpt: str, a, m, vocab: int, truth: dict, hlog) -> tuple[list[str], dict]:
    import torch

    from oracles.common import resolve_iter_dir, stored_parallel

    problems: list[str] = []
    info: dict = {"ckpt": ckpt}
    try:
        iter_dir = Path(resolve_iter_dir(ckpt))
        info["format"] = "legacy" if is_legacy(iter_dir) else "torch_dist"
        info["stored_tp"], info["stored_pp"] = stored_parallel(iter_dir)
        with torch.no_grad():  # nothing left from the previous checkpoint
            for p in m.parameters():
                p.fill_(float("nan"))
            saved = m.state_dict()
            for n, b in m.named_buffers():
                if n in saved and b.is_floating_point():
                    b.fill_(float("nan"))
        if not load_into(m, iter_dir, problems):
            return problems, info
        got = tensor_state(m)
        info["loaded_tensors"] = len(got)
        problems += compare(got, truth)
        if hlog is not None:
            mlog = megatron_logits(m, judge_ids(vocab))[..., :vocab]
            diff = (mlog - hlog).abs().max().item()
            info["logits_max_abs_diff_vs_hf"] = diff
            info["logits_scale"] = hlog.abs().max().item()
            if not diff <= a.atol:
                problems.append(f"logits differ from transformers' by {diff:.3g} (atol {a.atol})")
    except Exception as e:  # noqa: BLE001 - a refused load is a verdict, not a crash
        import traceback

        traceback.print_exc()
        problems.append(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500])
    return problems, info


def cmd_judge(a, serving=False) -> int:
    t0 = time.time()
    apply_shims()
    import torch.distributed as dist

    from oracles.common import end_parallel

    results = []
    rank, world = 0, 1
    try:
        rank, world, tp = init(a)
        m, cfg = build(a.hf, tp, a.pp)
        truth = rank_truth(m, hf_truth(cfg, hf_tensors(a.hf)))
        hlog = made_logits(a.hf, judge_ids(cfg["vocab_size"])) if a.pp == 1 else None
        for ckpt in a.ckpts:
            t1 = time.time()
            problems, info = judge_one(ckpt, a, m, cfg["vocab_size"], truth, hlog)
            every = [None] * world
            dist.all_gather_object(every, (problems, info.get("loaded_tensors", 0)))
            problems = [p if r == 0 else f"rank {r}: {p}" for r, (ps, _) in enumerate(every) for p in ps]
            info["loaded_tensors"] = sum(n for _, n in every)
            info.update(load_tp=tp, load_pp=a.pp, ok=not problems, problems=problems[:50], n_problems=len(problems),
                        seconds=round(time.time() - t1, 2))
            results.append(info)
            if rank == 0:
                print(json.dumps(info), flush=True)
    finally:
        end_parallel(serving)
    if rank == 0:
        print(json.dumps({"judged": len(results), "all_ok": all(r["ok"] for r in results),
                          "seconds": round(time.time() - t0, 2)}), flush=True)
    return 0 if results and all(r["ok"] for r in results) else 1


def cmd_save(a, serving=False) -> int:
    apply_shims()
    import torch
    from megatron.core import dist_checkpointing, parallel_state

    from oracles.common import end_parallel

    rank = 0
    try:
        rank, world, tp = init(a)
        m, cfg = build(a.hf, tp, a.pp)
        truth = rank_truth(m, hf_truth(cfg, hf_tensors(a.hf)))
        res = m.load_state_dict(truth, strict=False)
        assert not [k for k in res.missing_keys if not k.endswith("_extra_state")] and not res.unexpected_keys, res
        Path(a.out_torch_dist).mkdir(parents=True, exist_ok=True)
        dist_checkpointing.save({"model": m.sharded_state_dict()}, a.out_torch_dist)
        f = legacy_file(Path(a.out_legacy))
        f.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"model": m.state_dict(), "iteration": 0, "checkpoint_version": 3.0}, f)
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    finally:
        end_parallel(serving)
    if rank == 0:
        print(json.dumps({"saved": [a.out_torch_dist, a.out_legacy], "tp": tp, "pp": a.pp, "pp_rank": pp_rank}))
    return 0


def main(argv=None, serving=False) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("judge")
    sp.add_argument("ckpts", nargs="+")
    sp.add_argument("--hf", required=True)
    sp.add_argument("--tp", type=int, default=None, help="load TP (world size / --pp when omitted)")
    sp.add_argument("--pp", type=int, default=1, help="load PP")
    sp.add_argument("--atol", type=float, default=1e-4, help="logits vs transformers, max abs")
    sp = sub.add_parser("save")
    sp.add_argument("--hf", required=True)
    sp.add_argument("--tp", type=int, default=None)
    sp.add_argument("--pp", type=int, default=1)
    sp.add_argument("--out-torch-dist", required=True)
    sp.add_argument("--out-legacy", required=True)
    a = p.parse_args(argv)
    return {"judge": cmd_judge, "save": cmd_save}[a.cmd](a, serving)


if __name__ == "__main__":
    run_program(main)
