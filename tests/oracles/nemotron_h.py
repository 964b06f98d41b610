"""Oracle for Nemotron-H (``NemotronHForCausalLM``, a hybrid Mamba2 / attention / MLP / MoE stack):
Megatron-Bridge 0.6.2's ``NemotronHBridge`` + ``HybridModelProvider`` on megatron-core 0.19.2 (``HybridModel``)
is the Megatron side; transformers' ``NemotronHForCausalLM`` (5.12.1) is the HF side. Runs in the second runtime
(.venv-mcore19, Python 3.12); imports megatron-core, Megatron-Bridge, transformers; never dist_convert.

  oracles/nemotron_h.py make HF_DIR [--seed S]
      a tiny random NemotronHForCausalLM made by transformers' own NemotronHConfig / model classes, pattern
      PATTERN below (M mamba, * attention, - MLP, E MoE; Mamba first), hidden 64; Mamba: 8 heads x head_dim 12
      (d_inner 96 != hidden), 2 groups, state 16, conv kernel 4, chunk 8; attention 4 heads, 2 kv heads,
      head_dim 16; MLP 96 (relu2); MoE 4 routed experts of 32, 1 shared expert of 48, top-2, sigmoid scores with
      a random e_score_correction_bias; vocab 300 (not a multiple of 128); untied; fp32. Every tensor random
      (norm weights in [0.5, 1.5], A_log = log U(1, 8), D ~ U(0.5, 1.5), dt_bias ~ U(0, 1) >= 0 so softplus(dt)
      stays far above time_step_min (HF's torch path clamps there, megatron does not)); a 300-token WordLevel
      tokenizer; ``save_pretrained`` (safetensors)
  oracles/nemotron_h.py bridge-import HF_DIR OUT_DIR
      Megatron-Bridge's own import (AutoBridge.from_hf_pretrained -> NemotronHBridge, to_megatron_provider
      (load_weights=True), provide_distributed_model, save_megatron_model) at TP 1 PP 1 (world size 1): a
      torch_dist checkpoint. Only the truth of the name mapping; Bridge's own TP>1 path is never trusted.
  oracles/nemotron_h.py judge --truth TRUTH_DIR --hf HF_DIR [--tp T] [--pp P] [--atol A] CKPT [CKPT ...]
      [--built-from-run-config CKPT ...]
      world size T*P. Builds Bridge's HybridModel at TP T / PP P (weights not loaded), loads TRUTH_DIR (a TP1
      torch_dist checkpoint: bridge-import) into it with megatron-core's dist_checkpointing.load -- megatron-core's
      own reshard is the truth of every rank's tensors. Then per CKPT:
        * torch_dist: dist_checkpointing.load with StrictHandling.RAISE_ALL (no missing, no unexpected key or
          object, any stored TP/PP) + TE's check of each _extra_state + module.load_state_dict; stored global
          tensors (load_plain_tensors) == the truth's bit for bit, same _extra_state objects
        * legacy (iter_*/mp_rank_TT[_PPP]/model_optim_rng.pt or a release dir, detected): each rank loads its
          own rank file's ``model`` into its stage module (every key; a missing _extra_state only when
          megatron-core's sharded_state_dict does not save it either), TE's check of each _extra_state
        * every rank's loaded tensors == the truth's, bit for bit (names, shapes, dtypes, values)
        * --built-from-run-config: loaded into the model Megatron-Bridge builds from the checkpoint's own
          run_config.yaml (load_model_config; its HybridStack spec resolved as provide() resolves it, stood in)
        * PP 1: logits on fixed ids (2 x 16 tokens > conv kernel) vs transformers' NemotronHForCausalLM (fp32,
          use_mamba_kernels=False, eager attention) within --atol (1e-4); the max abs diff is reported
        * the TP/PP the checkpoint records (args in common.pt / a legacy rank file, else run_config.yaml) is
          reported (stored_tp, stored_pp); --expect-tp/--expect-pp make a mismatch a problem
      one JSON line per CKPT on rank 0: {"ckpt", "ok", "format", "loaded_tensors", "logits_max_abs_diff_vs_hf",
      "stored_tp", "stored_pp", "problems", ...}; exit 1 if any CKPT failed.
  oracles/nemotron_h.py mutate SRC DST --hf HF_DIR --kind swap_z_x|swap_B_C|value|drop_object
      (world size 1) SRC (torch_dist, TP1 PP1) with one defect, saved as Bridge / megatron-core save it
      (save_megatron_model -> dist_checkpointing.save): swap_z_x: layer 0's in_proj z and x row sections
      exchanged; swap_B_C: layer 0's B and C sections exchanged in in_proj and conv1d (weight, bias);
      value: layer 4's A_log[3] += 1e-3; drop_object: no layer-0 mixer.in_proj._extra_state. The judge must
      fail on DST.
  oracles/nemotron_h.py layout --hf HF_DIR --tp T --pp P --out JSON
      world size T*P: per rank, the model's sharded_state_dict() (dict key, stored key, global shape, global
      offset, local shape, replica_id, dtype; ShardedObjects; for ShardedTensorFactory entries (Mamba's in_proj
      -> .z/.x/.B/.C/.dt, conv1d -> .x/.B/.C) the keys they produce, with shapes and offsets) and its legacy
      state_dict() (names, shapes, dtypes); plus the Bridge provider's Mamba/MoE fields.

What save_pretrained writes (transformers 5.12.1, seen in ``make``'s output; /tmp/hybrid/nemotron/hf_names.txt):
one model.safetensors, all F32, the hub ("original") names -- the load-time conversion mapping reverted:
  * prefix ``backbone.`` (in memory ``model.``); ``lm_head.weight``; ``backbone.norm_f.weight``
  * the embedding as ``backbone.embedding.weight`` -- WITHOUT the s: save reverts the load renaming
    ``embedding.weight -> embeddings.weight``. Megatron-Bridge 0.6.2 maps ``backbone.embeddings.weight`` and,
    not finding it, only logs "Can't find backbone.embeddings.weight in hf_keys" and keeps the initialized
    embedding (bridge-import works around it, see bridge_view, and checks embedding/output/final norm).
    A reader must accept both spellings (hub checkpoints use ``embeddings``).
  * per layer ``backbone.layers.N.norm.weight`` + ``backbone.layers.N.mixer.*``: Mamba ``in_proj.weight
    [2di+2GN+nh, H]`` (= [264, 64]), ``conv1d.weight [di+2GN, 1, 4]``, ``conv1d.bias``, ``A_log``, ``D``,
    ``dt_bias``, ``norm.weight [di]``, ``out_proj.weight``; attention ``q_proj/k_proj/v_proj/o_proj.weight``;
    MLP ``up_proj/down_proj.weight``; MoE ``gate.weight [E, H]``, ``gate.e_score_correction_bias [E]``,
    routed experts PER EXPERT ``experts.{e}.up_proj.weight [Fm, H]`` / ``experts.{e}.down_proj.weight [H, Fm]``
    (not the in-memory 3-D ``experts.up_proj``), ``shared_experts.up_proj/down_proj.weight``.
  * config.json: ``layers_block_type`` list (mamba/attention/mlp/moe), no ``hybrid_override_pattern`` key (the
    config class exposes it as a property, which Bridge reads); ``use_mamba_kernels`` false as made.

torch_dist facts (Bridge's save, megatron-core 0.19.2; /tmp/hybrid/nemotron/bridge_keys.txt): per-layer keys
``decoder.layers.{global}.*``; Mamba in_proj stored as ``mixer.in_proj.weight.{z,x,B,C,dt}`` and conv as
``mixer.conv1d.weight.{x,B,C}`` / ``mixer.conv1d.bias.{x,B,C}`` (each a whole section, TP-chunked on dim 0),
although the module's parameters are ``mixer.conv1d_weight`` / ``mixer.conv1d_bias`` in 0.19.2 (legacy
state_dict names; megatron renames the keys for DCP); ``mixer.A_log/D/dt_bias/norm.weight`` TP axis 0;
routed experts ``mlp.experts.experts.linear_fc{1,2}.weight [E, out, in]`` (legacy ``mlp.experts.linear_fc1.weight0..``);
``decoder.final_norm``; vocab not padded (should_pad_vocab False). _extra_state objects: mixer.in_proj,
mixer.out_proj, self_attention.linear_qkv, self_attention.linear_proj, mlp.linear_fc1/fc2,
mlp.shared_experts.linear_fc1/fc2, pre_mlp_layernorm, final_norm, output_layer, and per expert (shard_e_E)
mlp.experts.experts.linear_fc1/fc2._extra_state; none for core_attention, conv, A_log, D, dt_bias, mixer.norm,
router.

CPU stand-ins (neither mamba_ssm, causal_conv1d nor Transformer Engine exists here). Exactly the kernel calls
are replaced, by the same math in plain torch; every projection, split, conv, norm call, gate, router and
dispatcher is megatron-core's own code:
  * ``mamba_mixer.mamba_chunk_scan_combined`` (mamba_ssm's Triton chunked SSD scan) -> ``selective_scan``: the
    plain sequential selective scan (dt = softplus(dt + dt_bias) clipped to dt_limit, h_t = exp(dt A) h_{t-1}
    + dt B_t x_t, y_t = C_t h_t + D x_t, B/C shared by the heads of a group); ``config.use_mamba_mem_eff_path =
    False`` (megatron's own _ssm_prefill; causal_conv1d_fn absent -> megatron's own F.conv1d + SiLU path)
  * ``RMSNormGated`` (mamba_ssm's Triton gated RMSNorm, a MagicMock without mamba_ssm) -> ``GatedRMSNorm``:
    weight [d_inner]; y = x * silu(z); per group of ``group_size`` channels y * rsqrt(mean(y^2) + eps) * w
    (norm_before_gate=False). megatron-core's own ``ExtendedRMSNorm`` class body (its sharded_state_dict,
    parameter ``norm.weight``, TP axis 0) is compiled from its source on top of it.
  * TE leaves (tests/oracles/gemma3.py technique): TELayerNormColumnParallelLinear (in_proj, linear_qkv,
    MLP fc1; ``layer_norm_weight`` + ``weight``), TERowParallelLinear (out_proj, linear_proj, fc2),
    TEColumnParallelLinear (shared-expert fc1), TEDotProductAttention (megatron-core's local
    DotProductAttention, no sharded state as TE's in 0.19.2, legacy _extra_state), TENorm (final_norm,
    pre_mlp_layernorm; te.pytorch.RMSNorm op), TEColumn/RowParallelGroupedLinear (routed experts of megatron's
    own TEGroupedMLP: weight0..E-1, one _extra_state, megatron's _sharded_state_dict_grouped logic
    reproduced: keys ``mlp.experts.experts.linear_fc{1,2}.weight`` [E, out, in] + per-expert _extra_state
    objects). Each stand-in carries TE's parameter names, TE's _extra_state and the TE wrapper's
    sharded_state_dict, and the class name of what it stands for (Bridge picks TP splits by class name).
  * CPU-only switches (no effect on any name, shape or value): moe_token_dispatcher_type "allgather"
    (alltoall makes CUDA streams), moe_permute_fusion / moe_shared_expert_overlap / masked_softmax_fusion /
    persist_layer_norm / gradient_accumulation_fusion False. run_config.yaml records Bridge's own settings
    (the provider's spec and switches are restored before save).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import sys
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the oracles package, helpers

from oracles.common import is_legacy, run_program, unwrap  # noqa: E402

VOCAB = 300
PATTERN = "M*-EM-"
TINY = {"vocab_size": VOCAB, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "intermediate_size": 96, "mlp_hidden_act": "relu2", "mamba_num_heads": 8,
        "mamba_head_dim": 12, "n_groups": 2, "ssm_state_size": 16, "conv_kernel": 4, "chunk_size": 8,
        "expand": 2, "n_routed_experts": 4, "moe_intermediate_size": 32, "n_shared_experts": 1,
        "moe_shared_expert_intermediate_size": 48, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
        "norm_topk_prob": True, "routed_scaling_factor": 1.0, "layer_norm_epsilon": 1e-5,
        "tie_word_embeddings": False, "max_position_embeddings": 64, "use_conv_bias": True,
        "mamba_proj_bias": False, "use_bias": False, "attention_bias": False, "mlp_bias": False,
        "residual_in_fp32": False, "num_nextn_predict_layers": 0, "pad_token_id": 0, "eos_token_id": 1,
        "bos_token_id": 2, "use_mamba_kernels": False}
SEQ = 16  # judge input length: > conv kernel (4) and > chunk_size (8)
# Bridge settings that need CUDA kernels; off for the CPU build, restored before a save (run_config.yaml)
CPU_SWITCHES = {"moe_token_dispatcher_type": "allgather", "moe_permute_fusion": False,
                "moe_shared_expert_overlap": False, "masked_softmax_fusion": False, "persist_layer_norm": False,
                "gradient_accumulation_fusion": False, "apply_rope_fusion": False,
                "use_mamba_mem_eff_path": False, "bias_dropout_fusion": False}


# ----------------------------------------------------------------------------- CPU stand-ins


def selective_scan(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, dt_softplus=False,
                   dt_limit=(0.0, float("inf")), return_final_states=False, initial_states=None, seq_idx=None,
                   cu_seqlens=None, return_varlen_states=False, **kw):
    """mamba_ssm's mamba_chunk_scan_combined, computed as the plain sequential scan (fp32).
    x [b,l,h,p], dt [b,l,h], A [h], B/C [b,l,g,n], D [h] or [h,p], z [b,l,h,p] or None -> y [b,l,h,p]."""
    import torch
    import torch.nn.functional as F

    assert seq_idx is None and cu_seqlens is None and not return_varlen_states, "varlen not stood in"
    b, l, h, p = x.shape
    g = B.shape[2]
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    if dt_limit != (0.0, float("inf")):
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    Bh = B.float().repeat_interleave(h // g, dim=2)  # [b,l,h,n]: head i uses group i // (h/g)
    Ch = C.float().repeat_interleave(h // g, dim=2)
    xf = x.float()
    state = (initial_states.float().clone() if initial_states is not None
             else torch.zeros(b, h, p, B.shape[-1], dtype=torch.float32, device=x.device))
    ys = []
    for t in range(l):
        dA = torch.exp(dt[:, t] * A.float())  # [b,h]
        state = state * dA[:, :, None, None] + (dt[:, t, :, None] * xf[:, t])[..., None] * Bh[:, t, :, None, :]
        ys.append((state * Ch[:, t, :, None, :]).sum(-1))
    y = torch.stack(ys, dim=1)
    if D is not None:
        Df = D.float()
        y = y + (Df[:, None] if Df.dim() == 1 else Df) * xf
    if z is not None:
        y = y * F.silu(z.float())
    y = y.to(x.dtype)
    return (y, state) if return_final_states else y


_STANDINS = None


def standins():
    """The Mamba and TE stand-in classes (built once, after megatron-core is importable)."""
    global _STANDINS
    if _STANDINS is not None:
        return _STANDINS
    import torch
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedObject
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

    from oracles.te_cpu import cpu_classes, te_accepts_extra_state, te_module_extra_state

    g3 = cpu_classes()

    def tp_of(group):
        return group if group is not None else parallel_state.get_tensor_model_parallel_group()

    def new_param(shape, config, init_method=None):
        p = torch.nn.Parameter(torch.empty(*shape, dtype=config.params_dtype))
        with torch.no_grad():
            if init_method is not None and config.perform_initialization:
                init_method(p)
            else:
                p.zero_()
        return p

    class ExtraState:
        def get_extra_state(self):
            return te_module_extra_state()

        def set_extra_state(self, state):
            te_accepts_extra_state(state, type(self).__name__)

    class GatedRMSNorm(torch.nn.Module):
        """mamba_ssm.ops.triton.layernorm_gated.RMSNorm: weight [hidden]; forward(x, z) = per-group RMSNorm of
        x * silu(z) (norm_before_gate=False) times weight."""

        def __init__(self, hidden_size, eps=1e-5, group_size=None, norm_before_gate=True, device=None,
                     dtype=None):
            super().__init__()
            self.eps, self.group_size, self.norm_before_gate = eps, group_size or hidden_size, norm_before_gate
            self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype))
            self.register_parameter("bias", None)

        def forward(self, x, z=None):
            dtype = x.dtype
            y = x.float()
            if z is not None and not self.norm_before_gate:
                y = y * F.silu(z.float())
            shp = y.shape
            yg = y.reshape(*shp[:-1], shp[-1] // self.group_size, self.group_size)
            yg = yg * torch.rsqrt(yg.pow(2).mean(-1, keepdim=True) + self.eps)
            y = yg.reshape(shp) * self.weight.float()
            if z is not None and self.norm_before_gate:
                y = y * F.silu(z.float())
            return y.to(dtype)

    # megatron-core's own ExtendedRMSNorm class body on top of the plain module
    src = Path(mamba_mixer.__file__).read_text()
    m = re.search(r"^class ExtendedRMSNorm\(RMSNormGated\):\n(?:(?:    .*|)\n)+", src, re.M)
    assert m, "mamba_mixer.ExtendedRMSNorm: source changed"
    scope = dict(vars(mamba_mixer))
    scope["RMSNormGated"] = GatedRMSNorm
    exec(compile(m.group(0), mamba_mixer.__file__, "exec"), scope)
    ExtendedRMSNorm = scope["ExtendedRMSNorm"]

    class TERowParallelLinear(ExtraState, torch.nn.Module):
        """megatron-core's TERowParallelLinear (te.pytorch.Linear, parallel_mode "row"): ``weight`` TP axis 1."""

        def __init__(self, input_size, output_size, *, config, init_method, bias, input_is_parallel, skip_bias_add,
                     is_expert, tp_comm_buffer_name=None, tp_group=None, name=None, **kw):
            super().__init__()
            assert input_is_parallel and not bias and not is_expert
            self.config, self._tp_group = config, tp_of(tp_group)
            self.weight = new_param((output_size, input_size // self._tp_group.size()), config, init_method)
            set_tensor_model_parallel_attributes(self.weight, True, 1, 1)

        def forward(self, x):
            return reduce_from_tensor_model_parallel_region(F.linear(x, self.weight), group=self._tp_group), None

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            metadata = ensure_metadata_has_dp_cp_group(metadata)
            state_dict = self.state_dict(prefix="", keep_vars=True)
            return make_sharded_tensors_for_checkpoint(state_dict, prefix, {"weight": 1}, sharded_offsets,
                                                       tp_group=self._tp_group, dp_cp_group=metadata["dp_cp_group"])

    class TEColumnParallelLinear(ExtraState, torch.nn.Module):
        """megatron-core's TEColumnParallelLinear: ``weight`` TP axis 0."""

        def __init__(self, input_size, output_size, *, config, init_method, gather_output, bias, skip_bias_add,
                     is_expert, skip_weight_param_allocation=False, tp_comm_buffer_name=None, tp_group=None,
                     stride=1, name=None, **kw):
            super().__init__()
            assert not bias and not skip_weight_param_allocation
            self.config, self._tp_group, self.gather_output = config, tp_of(tp_group), gather_output
            self.weight = new_param((output_size // self._tp_group.size(), input_size), config, init_method)
            set_tensor_model_parallel_attributes(self.weight, True, 0, stride)

        def forward(self, x):
            x = copy_to_tensor_model_parallel_region(x, group=self._tp_group)
            out = F.linear(x, self.weight)
            if self.gather_output:
                out = gather_from_tensor_model_parallel_region(out, group=self._tp_group)
            return out, None

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            metadata = ensure_metadata_has_dp_cp_group(metadata)
            state_dict = self.state_dict(prefix="", keep_vars=True)
            return make_sharded_tensors_for_checkpoint(state_dict, prefix, {"weight": 0, "bias": 0}, sharded_offsets,
                                                       tp_group=self._tp_group, dp_cp_group=metadata["dp_cp_group"])

    class TEGroupedLinear(ExtraState, torch.nn.Module):
        """megatron-core's TEGroupedLinear (te.pytorch.GroupedLinear) for experts: ``weight0..N-1`` (per local
        expert), one TE _extra_state; no communication (megatron's expert dispatcher does it: TE's
        explicit_expert_comm). sharded_state_dict: megatron-core 0.19.2's _sharded_state_dict_grouped (non-FP8)."""
        parallel_mode = None

        def __init__(self, num_gemms, input_size, output_size, *, config, init_method, bias, skip_bias_add,
                     is_expert, tp_comm_buffer_name=None, pg_collection=None, name=None):
            super().__init__()
            assert not bias and is_expert
            self.config, self.num_gemms, self.use_bias = config, num_gemms, False
            self._pg_collection = pg_collection
            self._tp_group = pg_collection.expt_tp
            tp = self._tp_group.size()
            col = self.parallel_mode == "column"
            shape = (output_size // tp, input_size) if col else (output_size, input_size // tp)
            for i in range(num_gemms):
                w = new_param(shape, config, init_method)
                set_tensor_model_parallel_attributes(w, True, 0 if col else 1, 1)
                w.allreduce = False
                setattr(self, f"weight{i}", w)
            self._register_load_state_dict_pre_hook(type(self)._merge_extra_states, with_module=True)

        def _merge_extra_states(self, state_dict, prefix, *args):
            """TEGroupedLinear's merge_extra_states hook, non-FP8: a torch_dist load gives one _extra_state per
            expert (``_extra_state``, ``_extra_state1``..); the extra ones are dropped (they carry nothing)."""
            try:
                state_list = [state_dict.pop(f"{prefix}_extra_state{i}") for i in range(1, self.num_gemms)]
            except KeyError:
                return  # a legacy (torch native) state dict has only ``_extra_state``
            for i, st in enumerate(state_list, 1):
                te_accepts_extra_state(st, f"{prefix}_extra_state{i}")

        def forward(self, x, m_splits):
            m_splits = [int(s) for s in m_splits]
            parts = torch.split(x, m_splits)
            out = torch.cat([F.linear(p, getattr(self, f"weight{i}")) for i, p in enumerate(parts)])
            return out, None

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
                    expert_prefix = f"{global_expert_idx}.{prefix}"
                    new_sharded_offsets = sharded_offsets
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
                if isinstance(sh_ten, ShardedObject):
                    edp_replica_id = get_pg_rank(self._pg_collection.expt_dp_gtp_remat) if hasattr(
                        self._pg_collection, "expt_dp_gtp_remat") else get_pg_rank(self._pg_collection.expt_dp)
                else:
                    edp_replica_id = get_pg_rank(self._pg_collection.expt_dp)
                sh_ten.replica_id = (*replica_id[:2], edp_replica_id)
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

    class TEDotProductAttention(ExtraState, DotProductAttention):
        """TEDotProductAttention's math (causal softmax attention, no window) on megatron-core's local
        DotProductAttention; no sharded state (TEDotProductAttention.sharded_state_dict with vanilla softmax)."""

        def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                     softmax_scale=None, k_channels=None, v_channels=None, cp_comm_type="p2p", pg_collection=None,
                     **kw):
            super().__init__(config, layer_number, attn_mask_type, attention_type, attention_dropout=attention_dropout,
                             softmax_scale=softmax_scale, cp_comm_type=cp_comm_type, pg_collection=pg_collection)

    for cls in (TERowParallelLinear, TEColumnParallelLinear, TEColumnParallelGroupedLinear,
                TERowParallelGroupedLinear, TEDotProductAttention, ExtendedRMSNorm):
        cls.__qualname__ = cls.__name__
    _STANDINS = {"norm": g3["norm"], "ln_col": g3["qkv"], "row": TERowParallelLinear, "col": TEColumnParallelLinear,
                 "gcol": TEColumnParallelGroupedLinear, "grow": TERowParallelGroupedLinear,
                 "attn": TEDotProductAttention, "gated_norm": GatedRMSNorm, "ext_norm": ExtendedRMSNorm}
    return _STANDINS


def apply_shims():
    """oracles.gemma3's shims (oracles.bridge's TE stub for lora_layers, CUDA no-ops, CPU attention masks, CPU RNG
    for the save) plus the Mamba kernel stand-ins in megatron-core's mamba_mixer module."""
    from oracles.te_cpu import apply_bridge_cpu_shims

    apply_bridge_cpu_shims()
    from megatron.core.ssm import mamba_mixer

    c = standins()
    mamba_mixer.HAVE_MAMBA_SSM = True
    mamba_mixer.RMSNormGated = c["gated_norm"]
    mamba_mixer.ExtendedRMSNorm = c["ext_norm"]
    mamba_mixer.mamba_chunk_scan_combined = selective_scan
    mamba_mixer.mamba_split_conv1d_scan_combined = None
    mamba_mixer.causal_conv1d_fn = None


def own(holder, *path):
    """``holder.path`` replaced, level by level, by shallow copies (a shared spec stays untouched); the last."""
    import copy

    for name in path:
        child = copy.copy(getattr(holder, name))
        setattr(holder, name, child)
        holder = child
    return holder


def swap(what: str, swaps) -> None:
    """Each (holder, slot, the TE class expected there, its stand-in): the slot must hold the expected class (a
    changed spec fails here), then holds the stand-in."""
    for holder, name, want, new in swaps:
        cur = getattr(holder, name)
        assert cur is want, f"{what}: {name}={cur!r}, expected {want!r}"
        setattr(holder, name, new)


def cpu_hybrid_stack_spec(stack=None):
    """megatron-core's hybrid_stack_spec (Bridge's default for Nemotron-H), or ``stack`` (another HybridStack spec,
    as a checkpoint's ``spec`` args name it), with its TE leaves swapped for the stand-ins; each swapped slot must
    hold the expected TE class (a changed spec fails here)."""
    import copy
    from functools import partial

    from megatron.core.extensions import transformer_engine as te_ext
    from megatron.core.models.gpt.moe_module_specs import _build_shared_experts
    from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, TEGroupedMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.moe.router import TopKRouter

    c = standins()
    spec = copy.copy(hybrid_stack_spec if stack is None else stack)
    sub = own(spec, "submodules")
    mixer = own(sub, "mamba_layer", "submodules", "mixer", "submodules")
    attn = own(sub, "attention_layer", "submodules", "self_attention", "submodules")
    mlp_layer_sub = own(sub, "mlp_layer", "submodules")
    fc = mlp_layer_sub.mlp
    mlp = copy.copy(fc.keywords["submodules"])
    mlp_layer_sub.mlp = partial(fc.func, *fc.args, **{**fc.keywords, "submodules": mlp})
    own(sub, "moe_layer", "submodules")
    gdn = own(sub, "gdn_layer", "submodules", "self_attention", "submodules")
    # layer kinds not judged here (D, +, MTP): their TE classes are mocks without TE, which the provider's deepcopy
    # (_configure_mamba_chunk_size, chunk_size != 128) cannot copy
    sub.dsa_layer = sub.mla_layer = sub.mtp_block_spec = None
    swaps = [(mixer, "in_proj", te_ext.TELayerNormColumnParallelLinear, c["ln_col"]),
             (mixer, "out_proj", te_ext.TERowParallelLinear, c["row"]),
             (attn, "linear_qkv", te_ext.TELayerNormColumnParallelLinear, c["ln_col"]),
             (attn, "core_attention", te_ext.TEDotProductAttention, c["attn"]),
             (attn, "linear_proj", te_ext.TERowParallelLinear, c["row"]),
             (mlp, "linear_fc1", te_ext.TELayerNormColumnParallelLinear, c["ln_col"]),
             (mlp, "linear_fc2", te_ext.TERowParallelLinear, c["row"]),
             (sub.moe_layer.submodules, "pre_mlp_layernorm", te_ext.TENorm, c["norm"]),
             (gdn, "in_proj", te_ext.TELayerNormColumnParallelLinear, c["ln_col"]),
             (gdn, "out_norm", te_ext.TENorm, c["norm"]), (gdn, "out_proj", te_ext.TERowParallelLinear, c["row"])]
    swap("hybrid_stack_spec", swaps)
    moe = sub.moe_layer.submodules.mlp
    assert moe.func is MoELayer and moe.keywords["submodules"].router is TopKRouter, moe
    # the MoE spec with TE (get_moe_module_spec(use_te=True, moe_grouped_gemm=True)): TEGroupedMLP over
    # TEColumn/RowParallelGroupedLinear, shared experts on TEColumn/TERowParallelLinear, activation_func None
    sub.moe_layer.submodules.mlp = partial(MoELayer, submodules=MoESubmodules(
        experts=partial(TEGroupedMLP, submodules=GroupedMLPSubmodules(linear_fc1=c["gcol"], linear_fc2=c["grow"],
                                                                      activation_func=None)),
        shared_experts=partial(_build_shared_experts, submodules=MLPSubmodules(linear_fc1=c["col"],
                                                                               linear_fc2=c["row"])),
        router=TopKRouter))
    return spec


# ----------------------------------------------------------------------------- the model


def nh_provider(hf: str, load_weights: bool, tp: int, pp: int = 1, parallel_output=True):
    """Bridge's HybridModelProvider for ``hf`` (NemotronHBridge.provider_bridge), built for the CPU.
    Returns (bridge, provider, saved): ``saved`` are Bridge's values of what the CPU build changed."""
    from megatron.bridge import AutoBridge

    for name in [k for k in os.environ if k.startswith(("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"))]:
        del os.environ[name]
    bridge = AutoBridge.from_hf_pretrained(hf)
    provider = bridge.to_megatron_provider(load_weights=load_weights)
    saved = {k: getattr(provider, k) for k in (*CPU_SWITCHES, "hybrid_stack_spec")}
    for k, v in CPU_SWITCHES.items():
        setattr(provider, k, v)
    spec = cpu_hybrid_stack_spec()
    provider.hybrid_stack_spec = spec
    provider.tensor_model_parallel_size, provider.pipeline_model_parallel_size = tp, pp
    provider.parallel_output = parallel_output
    provider.finalize()
    return bridge, provider, saved


def restore_bridge_settings(provider, saved):
    """What run_config.yaml should record: Bridge's own spec and kernel switches, not the CPU build's."""
    for k, v in saved.items():
        setattr(provider, k, v)


def build(provider):
    """The model chunks (one per rank, no VPP), built as with TE: HybridStack's final_norm is TENorm (imported by
    name in hybrid_block; swapped only while this model is built)."""
    from megatron.core.models.hybrid import hybrid_block

    saved = hybrid_block.TENorm
    hybrid_block.TENorm = standins()["norm"]
    try:
        model = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)
    finally:
        hybrid_block.TENorm = saved
    for m in model:
        m.eval()
    return model


def init_dist(pp: int = 1):
    from oracles.common import init_dist as g3_init

    return g3_init(pp)


# ----------------------------------------------------------------------------- make


def cmd_make(a) -> int:
    import torch
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import NemotronHConfig, NemotronHForCausalLM, PreTrainedTokenizerFast

    t0 = time.time()
    out = Path(a.hf_dir)
    kinds = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
    config = NemotronHConfig(**TINY, layers_block_type=[kinds[s] for s in PATTERN], dtype="float32")
    torch.manual_seed(a.seed)
    model = NemotronHForCausalLM(config).float()

    def gen(name):
        return torch.Generator().manual_seed(zlib.crc32(f"{a.seed}|{name}".encode()))

    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            g = gen(name)
            if name.endswith("A_log"):
                p.copy_(torch.log(1.0 + 7.0 * torch.rand(p.shape, generator=g)))
            elif name.endswith(".D"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            elif name.endswith("dt_bias"):
                p.copy_(torch.rand(p.shape, generator=g))
            elif name.endswith("e_score_correction_bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif "norm" in name and name.endswith("weight"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            elif name.endswith("conv1d.bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("conv1d.weight"):
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
            elif "embeddings" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
            elif p.is_floating_point():
                raise SystemExit(f"make: no rule for {name} {tuple(p.shape)}")
    model.save_pretrained(out)
    model.eval()
    with torch.no_grad():  # transformers' logits of the model it made, for judges in another runtime
        torch.save({"ids": judge_ids(), "logits": model(input_ids=judge_ids(), use_cache=False).logits.float()},
                   made_logits_path(out))
    tok = Tokenizer(WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t3"))
    tok.pre_tokenizer = WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t3", pad_token="t0", eos_token="t1",
                            bos_token="t2").save_pretrained(out)
    print(json.dumps({"made": str(out), "pattern": PATTERN, "files": sorted(p.name for p in out.iterdir()),
                      "seconds": round(time.time() - t0, 2)}))
    return 0


# ----------------------------------------------------------------------------- bridge-import


HF_EMB_SAVED, HF_EMB_BRIDGE = "backbone.embedding.weight", "backbone.embeddings.weight"


def bridge_view(hf_dir: str, tmp: str) -> tuple[str, list[str]]:
    """The HF directory as Bridge 0.6.2 reads it. transformers 5.12.1's save_pretrained writes the embedding as
    ``backbone.embedding.weight`` (it reverts its load-time renaming embedding.weight -> embeddings.weight), while
    NemotronHBridge maps ``backbone.embeddings.weight`` and, not finding it, only warns and leaves the embedding
    as initialized. When that is the case, ``tmp`` gets a view of ``hf_dir`` (every file linked, the safetensors
    rewritten with that one key renamed); returns (directory, renamed keys)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    src = Path(hf_dir)
    files = sorted(src.glob("*.safetensors"))
    keys = set()
    for f in files:
        with safe_open(str(f), "pt") as h:
            keys |= set(h.keys())
    if HF_EMB_SAVED not in keys or HF_EMB_BRIDGE in keys:
        return hf_dir, []
    view = Path(tmp)
    view.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix == ".safetensors" or f.name == "model.safetensors.index.json":
            continue
        (view / f.name).symlink_to(f.resolve())
    for f in files:
        sd = load_file(str(f))
        if HF_EMB_SAVED in sd:
            sd[HF_EMB_BRIDGE] = sd.pop(HF_EMB_SAVED)
        save_file(sd, str(view / f.name), metadata={"format": "pt"})
    index = src / "model.safetensors.index.json"
    if index.is_file():
        idx = json.loads(index.read_text())
        wm = idx["weight_map"]
        wm[HF_EMB_BRIDGE] = wm.pop(HF_EMB_SAVED)
        (view / index.name).write_text(json.dumps(idx, indent=2))
    return str(view), [f"{HF_EMB_SAVED} -> {HF_EMB_BRIDGE}"]


def hf_tensors(hf_dir: str) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(hf_dir).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def cmd_bridge_import(a, serving=False) -> int:
    t0 = time.time()
    apply_shims()
    import tempfile

    import torch

    from oracles.common import end_parallel

    rank, world = init_dist(1)
    tmp = tempfile.mkdtemp(prefix="nemotron_h_bridge_view_")
    try:
        assert world == 1, f"bridge-import runs at TP 1 PP 1 (world size 1), not {world}"
        view, renamed = bridge_view(a.hf_dir, os.path.join(tmp, "hf"))
        bridge, provider, saved = nh_provider(view, load_weights=True, tp=1)
        model = build(provider)
        m = unwrap(model[0])
        # Bridge only warns about an HF tensor it does not find: make sure the ends were really imported
        hf = hf_tensors(a.hf_dir)
        emb = hf.get(HF_EMB_SAVED, hf.get(HF_EMB_BRIDGE))
        for name, got, want in (("embedding", m.embedding.word_embeddings.weight, emb),
                                ("output_layer", m.output_layer.weight, hf["lm_head.weight"]),
                                ("final_norm", m.decoder.final_norm.weight, hf["backbone.norm_f.weight"])):
            if not torch.equal(got.detach()[:want.shape[0]], want):
                raise SystemExit(f"bridge-import: Bridge did not import {name} (it only warns)")
        restore_bridge_settings(provider, saved)
        bridge.save_megatron_model(model, a.out_dir, hf_tokenizer_path=a.hf_dir)
    finally:
        end_parallel(serving)
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    if rank == 0:
        print(json.dumps({"bridge_import": str(a.out_dir), "tp": 1, "pp": 1, "renamed_for_bridge": renamed,
                          "seconds": round(time.time() - t0, 2)}))
    return 0


# ----------------------------------------------------------------------------- judge


def legacy_file(iter_dir: Path, tp_rank: int, pp_rank: int, pp: int) -> Path:
    sub = f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    return iter_dir / sub / "model_optim_rng.pt"


def load_into(m, iter_dir: Path, problems: list[str]) -> bool:
    """``iter_dir`` into module ``m`` (this rank's stage) strictly; see the module docstring. False: nothing to
    load for this rank (a legacy checkpoint of another layout)."""
    import torch
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.validation import StrictHandling

    from oracles.te_cpu import te_accepts_extra_state

    sharded = m.sharded_state_dict()
    if is_legacy(iter_dir):
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        f = legacy_file(iter_dir, tp_rank, pp_rank, pp)
        if not f.is_file():
            have = sorted(p.name for p in iter_dir.iterdir() if p.name.startswith("mp_rank_"))
            problems.append(f"legacy: no {f.relative_to(iter_dir)} for TP rank {tp_rank} PP rank {pp_rank} "
                            f"(has {have[:8]}; a legacy checkpoint is judged at its own TP/PP)")
            return False
        from megatron.core.safe_globals import SAFE_GLOBALS

        # registered for good, as megatron-core does: the safe_globals context would drop them again on exit
        torch.serialization.add_safe_globals(list(SAFE_GLOBALS))
        sd = torch.load(f, map_location="cpu", weights_only=True)["model"]
        # an _extra_state megatron-core's sharded_state_dict saves must be in the legacy file too
        wanted = {k for k in m.state_dict() if k.endswith("_extra_state") and k in sharded}
        problems += [f"legacy: _extra_state missing: {k}" for k in sorted(wanted - set(sd))]
    else:
        loaded = dist_checkpointing.load({"model": sharded}, str(iter_dir), strict=StrictHandling.RAISE_ALL)
        sd = loaded["model"]
    for k, v in sd.items():
        if k.endswith("_extra_state"):
            try:
                te_accepts_extra_state(v, k)
            except Exception as e:  # noqa: BLE001 - TE's verdict
                problems.append(f"{k}: {e}")
    res = m.load_state_dict(sd, strict=False)
    problems += [f"load_state_dict: missing {k}" for k in res.missing_keys if not k.endswith("._extra_state")]
    problems += [f"load_state_dict: unexpected {k}" for k in res.unexpected_keys]
    return True


def tensor_state(m) -> dict:
    import torch

    return {k: v.detach().clone() for k, v in m.state_dict().items() if isinstance(v, torch.Tensor)
            and not k.endswith("_extra_state")}


def judge_ids():
    import torch

    g = torch.Generator().manual_seed(1234)
    return torch.randint(3, VOCAB, (2, SEQ), generator=g)


def megatron_logits(m, ids):
    import torch

    pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    with torch.no_grad():
        return m(input_ids=ids, position_ids=pos, attention_mask=None).float()


def made_logits_path(hf: str | Path) -> Path:
    """Where ``make`` saves transformers' logits of the model it made (beside the HF directory)."""
    return Path(f"{hf}.logits.pt")


def made_logits(hf: str, ids):
    """transformers' logits of the model ``make`` made, on ``ids`` (the judge's tokens). A judge in the default
    runtime uses these instead of reloading the files there (its transformers once failed inside its own
    ``from_pretrained`` init, "Cannot copy out of meta tensor", in a worker shared with other jobs; the reload
    through ``from_pretrained`` is judged by ``cmd_judge`` in the second runtime)."""
    import torch

    made = torch.load(made_logits_path(hf))
    if not torch.equal(made["ids"], ids):
        raise SystemExit(f"{made_logits_path(hf)}: its tokens are not the judge's; rerun make")
    return made["logits"]


def hf_logits(hf: str, ids):
    import torch
    from transformers import NemotronHForCausalLM

    model = NemotronHForCausalLM.from_pretrained(hf, dtype=torch.float32, use_mamba_kernels=False,
                                                 attn_implementation="eager").eval()
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits.float()


def judge_one(ckpt: str, a, m, truth: dict, hlog, world: int) -> tuple[list[str], dict]:
    import torch

    from oracles.common import compare, compare_stored, resolve_iter_dir, stored_parallel

    problems: list[str] = []
    info: dict = {"ckpt": ckpt}
    try:
        iter_dir = Path(resolve_iter_dir(ckpt))
        legacy = is_legacy(iter_dir)
        info["format"] = "legacy" if legacy else "torch_dist"
        info["stored_tp"], info["stored_pp"] = stored_parallel(iter_dir)
        for what, want in (("tp", a.expect_tp), ("pp", a.expect_pp)):
            if want is not None and info[f"stored_{what}"] != want:
                problems.append(f"checkpoint records {what.upper()}={info[f'stored_{what}']}, expected {want}")
        if not legacy:
            sp, si = compare_stored(iter_dir, Path(resolve_iter_dir(a.truth)), False)
            problems += sp
            info.update(si)
        with torch.no_grad():  # nothing left from the previous checkpoint
            for p in m.parameters():
                p.fill_(float("nan"))
        if not load_into(m, iter_dir, problems):
            return problems, info
        got = tensor_state(m)
        info["loaded_tensors"] = len(got)
        problems += compare(got, truth, "loaded vs truth")
        if hlog is not None:
            mlog = megatron_logits(m, judge_ids())[..., :VOCAB]
            diff = (mlog - hlog).abs().max().item()
            info["logits_max_abs_diff_vs_hf"] = diff
            info["logits_scale"] = hlog.abs().max().item()
            info["argmax_agreement"] = (mlog.argmax(-1) == hlog.argmax(-1)).float().mean().item()
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

    from oracles.common import end_parallel, resolve_iter_dir

    rank, world = init_dist(a.pp)
    results = []
    try:
        if a.tp is not None and a.tp * a.pp != world:
            raise SystemExit(f"judge: --tp {a.tp} x --pp {a.pp} != world size {world}")
        _, provider, _ = nh_provider(a.hf, load_weights=False, tp=world // a.pp, pp=a.pp, parallel_output=False)
        m = unwrap(build(provider)[0])
        tproblems: list[str] = []
        load_into(m, Path(resolve_iter_dir(a.truth)), tproblems)  # megatron-core's reshard of the TP1 truth
        if tproblems:
            raise RuntimeError(f"truth {a.truth} does not load at TP {world // a.pp} PP {a.pp}: {tproblems[:3]}")
        truth = tensor_state(m)
        hlog = hf_logits(a.hf, judge_ids()) if a.pp == 1 else None
        for ckpt in a.ckpts:
            t1 = time.time()
            judged, made = m, {}
            if ckpt in a.built_from_run_config:  # a Bridge target: the model its own run_config.yaml builds
                from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec

                from oracles.hybrid import bridge_built

                judged, bp, stack = bridge_built(Path(resolve_iter_dir(ckpt)))
                judged.eval()
                made = {"provider": type(bp).__name__, "mcore_stack": stack is hybrid_stack_spec,
                        "pattern": bp.hybrid_layer_pattern}
            problems, info = judge_one(ckpt, a, judged, truth, hlog, world)
            info.update(made)
            every = [None] * world
            dist.all_gather_object(every, (problems, info.get("loaded_tensors", 0)))
            problems = [p if r == 0 else f"rank {r}: {p}" for r, (ps, _) in enumerate(every) for p in ps]
            info["loaded_tensors"] = sum(n for _, n in every)  # over all ranks (a rank's own: its stage/shard)
            info.update(load_tp=world // a.pp, load_pp=a.pp, ok=not problems, problems=problems[:50],
                        n_problems=len(problems), seconds=round(time.time() - t1, 2))
            results.append(info)
            if rank == 0:
                print(json.dumps(info), flush=True)
    finally:
        end_parallel(serving)
    if rank == 0:
        print(json.dumps({"judged": len(results), "all_ok": all(r["ok"] for r in results),
                          "seconds": round(time.time() - t0, 2)}), flush=True)
    return 0 if results and all(r["ok"] for r in results) else 1


# ----------------------------------------------------------------------------- mutate

MUTATIONS = ("swap_z_x", "swap_B_C", "value", "drop_object")


def cmd_mutate(a, serving=False) -> int:
    apply_shims()
    import torch

    from oracles.common import end_parallel, resolve_iter_dir

    rank, world = init_dist(1)
    try:
        assert world == 1, "mutate runs at world size 1"
        bridge, provider, saved = nh_provider(a.hf, load_weights=False, tp=1)
        model = build(provider)
        m = unwrap(model[0])
        problems: list[str] = []
        load_into(m, Path(resolve_iter_dir(a.src)), problems)
        assert not problems, problems
        mixer = m.decoder.layers[0].mixer
        di, gn = mixer.d_inner_local_tp, mixer.ngroups_local_tp * mixer.d_state

        def swap(t, a0, b0, n):
            x, y = t[a0:a0 + n].clone(), t[b0:b0 + n].clone()
            t[a0:a0 + n], t[b0:b0 + n] = y, x

        with torch.no_grad():
            if a.kind == "swap_z_x":
                swap(mixer.in_proj.weight, 0, di, di)
            elif a.kind == "swap_B_C":
                swap(mixer.in_proj.weight, 2 * di, 2 * di + gn, gn)
                swap(mixer.conv1d_weight, di, di + gn, gn)
                swap(mixer.conv1d_bias, di, di + gn, gn)
            elif a.kind == "value":
                m.decoder.layers[4].mixer.A_log[3] += 1e-3
        if a.kind == "drop_object":
            orig = m.sharded_state_dict

            def dropped(*args, **kw):
                sd = orig(*args, **kw)
                return {k: v for k, v in sd.items() if k != "decoder.layers.0.mixer.in_proj._extra_state"}

            m.sharded_state_dict = dropped
        restore_bridge_settings(provider, saved)
        bridge.save_megatron_model(model, a.dst, hf_tokenizer_path=a.hf)
    finally:
        end_parallel(serving)
    if rank == 0:
        print(json.dumps({"mutated": str(a.dst), "kind": a.kind}))
    return 0


# ----------------------------------------------------------------------------- layout


def describe_sharded(sd: dict) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

    def rid(r):
        return list(r) if isinstance(r, tuple) else r

    def tensor(v):
        return {"kind": "tensor", "key": v.key, "global_shape": list(v.global_shape),
                "global_offset": list(v.global_offset), "local_shape": list(v.local_shape),
                "axis_fragmentations": list(v.axis_fragmentations), "prepend_axis_num": v.prepend_axis_num,
                "replica_id": rid(v.replica_id), "dtype": str(v.dtype)}

    out = {}
    for k, v in sd.items():
        if isinstance(v, ShardedTensor):
            out[k] = tensor(v)
        elif isinstance(v, ShardedObject):
            out[k] = {"kind": "object", "key": v.key, "unique_key": v.unique_key, "global_shape": list(v.global_shape),
                      "global_offset": list(v.global_offset), "replica_id": rid(v.replica_id),
                      "value": repr(v.data)[:80]}
        elif isinstance(v, ShardedTensorFactory):
            built = v.build_fn(v.key, v.data, v.replica_id, v.flattened_range)
            parts = built if isinstance(built, list) else list(built.values()) if isinstance(built, dict) else [built]
            out[k] = {"kind": "factory", "key": v.key, "local_shape": list(v.data.shape), "dtype": str(v.data.dtype),
                      "replica_id": rid(v.replica_id), "produces": [tensor(p) for p in parts]}
        else:
            out[k] = {"kind": type(v).__name__}
    return out


def cmd_layout(a, serving=False) -> int:
    apply_shims()
    import dataclasses

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from oracles.common import end_parallel

    rank, world = init_dist(a.pp)
    try:
        assert a.tp * a.pp == world, f"layout: --tp {a.tp} x --pp {a.pp} != world size {world}"
        _, provider, saved = nh_provider(a.hf, load_weights=False, tp=a.tp, pp=a.pp)
        m = unwrap(build(provider)[0])
        state = {k: ({"shape": list(v.shape), "dtype": str(v.dtype)} if isinstance(v, torch.Tensor) else repr(v))
                 for k, v in m.state_dict().items()}
        mine = {"tp_rank": parallel_state.get_tensor_model_parallel_rank(),
                "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
                "state_dict": state, "sharded_state_dict": describe_sharded(m.sharded_state_dict()),
                "modules": {n: type(mod).__name__ for n, mod in m.named_modules() if n.count(".") <= 5}}
        every = [None] * world
        dist.all_gather_object(every, mine)
        fields = ("hybrid_layer_pattern", "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                  "num_query_groups", "kv_channels", "mamba_num_heads", "mamba_head_dim", "mamba_num_groups",
                  "mamba_state_dim", "mamba_chunk_size", "num_moe_experts", "moe_ffn_hidden_size",
                  "moe_shared_expert_intermediate_size", "moe_router_topk", "moe_router_score_function",
                  "moe_router_enable_expert_bias", "moe_router_topk_scaling_factor", "moe_router_pre_softmax",
                  "moe_router_num_groups", "moe_router_group_topk", "moe_router_dtype", "moe_grouped_gemm",
                  "layernorm_epsilon", "normalization", "activation_func", "gated_linear_unit", "add_bias_linear",
                  "position_embedding_type", "share_embeddings_and_output_weights", "vocab_size",
                  "make_vocab_size_divisible_by", "should_pad_vocab", "params_dtype", "fp32_residual_connection",
                  "first_last_layers_bf16", "is_hybrid_model", "moe_token_dispatcher_type", "moe_permute_fusion",
                  "moe_shared_expert_overlap", "use_mamba_mem_eff_path")
        prov = {}
        for f in fields:
            with contextlib.suppress(Exception):
                prov[f] = repr(saved[f] if f in saved else getattr(provider, f))
        prov["_all_dataclass_fields"] = len(dataclasses.fields(provider))
    finally:
        end_parallel(serving)
    if rank == 0:
        out = {"tp": a.tp, "pp": a.pp, "pattern": PATTERN, "provider": prov,
               "cpu_switches_in_this_build": CPU_SWITCHES,
               "ranks": {str(r): e for r, e in enumerate(every)}}
        Path(a.out).write_text(json.dumps(out, indent=1, default=repr))
        print(json.dumps({"layout": a.out, "ranks": world}))
    return 0


# ----------------------------------------------------------------------------- main


def main(argv=None, serving=False) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("make")
    sp.add_argument("hf_dir")
    sp.add_argument("--seed", type=int, default=0)
    sp = sub.add_parser("bridge-import")
    sp.add_argument("hf_dir")
    sp.add_argument("out_dir")
    sp = sub.add_parser("judge")
    sp.add_argument("ckpts", nargs="+")
    sp.add_argument("--truth", required=True, help="Bridge's own TP1 import of --hf (bridge-import)")
    sp.add_argument("--hf", required=True)
    sp.add_argument("--tp", type=int, default=None, help="load TP (world size / --pp when omitted)")
    sp.add_argument("--pp", type=int, default=1, help="load PP")
    sp.add_argument("--expect-tp", type=int, default=None, help="the TP each checkpoint must record")
    sp.add_argument("--expect-pp", type=int, default=None, help="the PP each checkpoint must record")
    sp.add_argument("--atol", type=float, default=1e-4, help="logits vs transformers, max abs")
    sp.add_argument("--built-from-run-config", nargs="*", default=[], metavar="CKPT",
                    help="Megatron-Bridge checkpoints among CKPTS judged in the model Megatron-Bridge builds from "
                    "their own run_config.yaml (load_model_config), not in the HF model's")
    sp = sub.add_parser("mutate")
    sp.add_argument("src")
    sp.add_argument("dst")
    sp.add_argument("--hf", required=True)
    sp.add_argument("--kind", choices=MUTATIONS, required=True)
    sp = sub.add_parser("layout")
    sp.add_argument("--hf", required=True)
    sp.add_argument("--tp", type=int, default=1)
    sp.add_argument("--pp", type=int, default=1)
    sp.add_argument("--out", required=True)
    a = p.parse_args(argv)
    if a.cmd == "make":
        return cmd_make(a)
    return {"bridge-import": cmd_bridge_import, "judge": cmd_judge, "layout": cmd_layout,
            "mutate": cmd_mutate}[a.cmd](a, serving)


if __name__ == "__main__":
    run_program(main)
