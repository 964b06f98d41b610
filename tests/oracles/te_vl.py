"""CPU stand-ins for Transformer Engine in Megatron-Bridge's Qwen vision-language models: the leaves of the TE specs
Bridge builds Qwen3-VL (dense and MoE: language model, vision tower, mergers; tests/oracles/qwen3_vl.py) and
Qwen2.5-VL (its language model; tests/oracles/qwen25_vl.py) from, as plain-torch modules with TE's parameter names,
TE's _extra_state, megatron-core's TE wrappers' sharded_state_dict (same make_sharded_tensors_for_checkpoint call,
same TP axis map) and the class names of what they stand for (Bridge's AutoMapping picks a weight's TP split by its
module's class name); megatron-core's TESpecProvider as a CPU backend giving them; and the patch that puts that
backend (and the TENorm stand-in as the block's final layernorm) in place while a model is built. What each stand-in
holds and computes, and which of them a model uses: those oracles' docstrings. Built on oracles.te_cpu (ExtraState,
new_param, tp_of, rms and its RMSNorm stand-in). Used only where TE is absent: the oracles say so."""
from __future__ import annotations

import contextlib
import functools

_CLASSES = None


def cpu_classes():
    """The stand-in classes (built once, after megatron-core is importable): ``norm`` (TENorm: RMSNorm or LayerNorm
    by config.normalization), ``ln_col``, ``col``, ``row``, ``attn`` (also TE's packed THD attention), ``gcol`` /
    ``grow`` (the grouped experts' linears); each described in oracles/qwen3_vl.py's docstring."""
    global _CLASSES
    if _CLASSES is not None:
        return _CLASSES
    import torch
    import torch.nn.functional as F
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        reduce_from_tensor_model_parallel_region,
    )
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint
    from megatron.core.utils import get_pg_rank, get_pg_size

    from oracles import te_cpu

    ExtraState, new_param, tp_of = te_cpu.ExtraState, te_cpu.new_param, te_cpu.tp_of
    CpuRMSNorm = te_cpu.cpu_classes()["norm"]  # te.pytorch.RMSNorm as TENorm builds it (class name "RMSNorm")

    def norm(x, config, weight, bias, eps):
        if config.normalization == "RMSNorm":
            return te_cpu.rms(x, weight, eps, config.layernorm_zero_centered_gamma)
        assert config.normalization == "LayerNorm", config.normalization
        w = weight + 1.0 if config.layernorm_zero_centered_gamma else weight
        return F.layer_norm(x, (x.shape[-1],), w, bias, eps)

    def sharded(module, prefix, axes, sharded_offsets, metadata):  # megatron-core's TE wrappers' sharded_state_dict
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        return make_sharded_tensors_for_checkpoint(module.state_dict(prefix="", keep_vars=True), prefix, axes,
                                                   sharded_offsets, tp_group=module._tp_group,
                                                   dp_cp_group=metadata["dp_cp_group"])

    def bias_out(module, out):  # TE's return_bias = skip_bias_add and bias (TELinear.__init__)
        if module.bias is None:
            return out, None
        return (out, module.bias) if module.skip_bias_add else (out + module.bias, None)

    class CpuTELayerNorm(ExtraState, torch.nn.Module):
        """te.pytorch.LayerNorm as megatron-core's TENorm builds it (TE 2.x: an op, ``weight`` and ``bias``)."""
        _extra = staticmethod(te_cpu.te_op_extra_state)

        def __init__(self, config, hidden_size, eps=1e-5):
            super().__init__()
            self.config, self.eps = config, eps
            self.weight = new_param((hidden_size,), config, value=0.0 if config.layernorm_zero_centered_gamma else 1.0)
            self.bias = new_param((hidden_size,), config, value=0.0)
            for p in (self.weight, self.bias):
                p.sequence_parallel = config.sequence_parallel

        def forward(self, x):
            return norm(x, self.config, self.weight, self.bias, self.eps)

    class CpuTENorm:
        """megatron-core's TENorm: a factory choosing the TE norm by config.normalization."""

        def __new__(cls, config, hidden_size, eps=1e-5, **kwargs):
            if config.normalization == "RMSNorm":
                return CpuRMSNorm(config, hidden_size, eps)
            assert config.normalization == "LayerNorm", config.normalization
            return CpuTELayerNorm(config, hidden_size, eps)

    class CpuTELayerNormColumnParallelLinear(ExtraState, torch.nn.Module):
        """TELayerNormColumnParallelLinear: a norm (``layer_norm_weight``, ``layer_norm_bias`` with LayerNorm)
        fused before a column-parallel linear (``weight``, ``bias``: TP axis 0)."""

        def __init__(self, input_size, output_size, *, config, init_method, gather_output, bias, skip_bias_add,
                     is_expert, skip_weight_param_allocation=False, tp_comm_buffer_name=None, tp_group=None,
                     stride=1, name=None):
            super().__init__()
            assert not gather_output and not is_expert and not skip_weight_param_allocation
            self.config, self._tp_group, self.skip_bias_add = config, tp_of(tp_group), skip_bias_add
            tp = self._tp_group.size()
            self.eps = config.layernorm_epsilon
            self.layer_norm_weight = new_param((input_size,), config,
                                               value=0.0 if config.layernorm_zero_centered_gamma else 1.0)
            self.layer_norm_bias = (new_param((input_size,), config, value=0.0)
                                    if config.normalization == "LayerNorm" else None)
            self.weight = new_param((output_size // tp, input_size), config, init_method)
            set_tensor_model_parallel_attributes(self.weight, True, 0, stride)
            self.bias = new_param((output_size // tp,), config, value=0.0) if bias else None
            if self.bias is not None:
                set_tensor_model_parallel_attributes(self.bias, True, 0, stride)

        def forward(self, x):
            x = norm(x, self.config, self.layer_norm_weight, self.layer_norm_bias, self.eps)
            x = copy_to_tensor_model_parallel_region(x, group=self._tp_group)
            return bias_out(self, F.linear(x, self.weight))

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            return sharded(self, prefix, {"weight": 0, "bias": 0}, sharded_offsets, metadata)

    class CpuTEColumnParallelLinear(ExtraState, torch.nn.Module):
        """TEColumnParallelLinear: ``weight``, ``bias`` TP axis 0."""

        def __init__(self, input_size, output_size, *, config, init_method, gather_output, bias, skip_bias_add,
                     is_expert, skip_weight_param_allocation=False, tp_comm_buffer_name=None, tp_group=None,
                     stride=1, name=None):
            super().__init__()
            assert not gather_output and not is_expert and not skip_weight_param_allocation
            self.config, self._tp_group, self.skip_bias_add = config, tp_of(tp_group), skip_bias_add
            tp = self._tp_group.size()
            self.weight = new_param((output_size // tp, input_size), config, init_method)
            set_tensor_model_parallel_attributes(self.weight, True, 0, stride)
            self.bias = new_param((output_size // tp,), config, value=0.0) if bias else None
            if self.bias is not None:
                set_tensor_model_parallel_attributes(self.bias, True, 0, stride)

        def forward(self, x):
            x = copy_to_tensor_model_parallel_region(x, group=self._tp_group)
            return bias_out(self, F.linear(x, self.weight))

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            return sharded(self, prefix, {"weight": 0, "bias": 0}, sharded_offsets, metadata)

    class CpuTERowParallelLinear(ExtraState, torch.nn.Module):
        """TERowParallelLinear: ``weight`` TP axis 1, ``bias`` replicated, added after the all-reduce."""

        def __init__(self, input_size, output_size, *, config, init_method, bias, input_is_parallel, skip_bias_add,
                     is_expert, tp_comm_buffer_name=None, tp_group=None, name=None):
            super().__init__()
            assert input_is_parallel and not is_expert
            self.config, self._tp_group, self.skip_bias_add = config, tp_of(tp_group), skip_bias_add
            tp = self._tp_group.size()
            self.weight = new_param((output_size, input_size // tp), config, init_method)
            set_tensor_model_parallel_attributes(self.weight, True, 1, 1)
            self.bias = new_param((output_size,), config, value=0.0) if bias else None

        def forward(self, x):
            return bias_out(self, reduce_from_tensor_model_parallel_region(F.linear(x, self.weight),
                                                                           group=self._tp_group))

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            return sharded(self, prefix, {"weight": 1}, sharded_offsets, metadata)

    class CpuTEGroupedLinear(ExtraState, torch.nn.Module):
        """megatron-core 0.19.2's TEGroupedLinear (te.pytorch.GroupedLinear) for the routed experts: ``weight0..N-1``
        (one per local expert; N = experts / EP), no bias (add_bias_linear False), one TE module _extra_state (an
        empty uint8 tensor without FP8). No communication: the expert TP split is explicit (explicit_expert_comm;
        the MoE token dispatcher gathers and reduces), so each weight is the expert-TP shard. sharded_state_dict:
        megatron-core's _sharded_state_dict_grouped, non-FP8 (each local expert i = global expert
        ep_rank * N + i: its weight with an expert axis (ep_axis = len(sharded_offsets), global E) appended to the
        offsets, the module's one _extra_state repeated as that expert's ShardedObject, ``_extra_state`` /
        ``_extra_state1``.. in the dict; replica ids (PP, TP, expert-DP rank)); load: TE's merge_extra_states hook
        for a non-FP8 checkpoint (the per-expert ``_extra_state1``.. popped; each checked as TE would)."""
        parallel_mode = None

        def __init__(self, num_gemms, input_size, output_size, *, config, init_method, bias, skip_bias_add,
                     is_expert, tp_comm_buffer_name=None, pg_collection=None, name=None):
            super().__init__()
            assert is_expert and not bias, "TEGroupedLinear stand-in: experts without bias only"
            if pg_collection is None:
                pg_collection = ProcessGroupCollection.use_mpu_process_groups()
            self.config, self.num_gemms, self.use_bias = config, num_gemms, False
            self._pg_collection, self._tp_group = pg_collection, pg_collection.expt_tp
            tp = self._tp_group.size()
            use_expert_pgs = (config.expert_model_parallel_size > 1
                              or config.expert_tensor_parallel_size != config.tensor_model_parallel_size)
            col = self.parallel_mode == "column"
            shape = (output_size // tp, input_size) if col else (output_size, input_size // tp)
            for i in range(num_gemms):  # as _set_expert_parameter_attributes
                w = new_param(shape, config, init_method)
                set_tensor_model_parallel_attributes(w, True, 0 if col else 1, 1)
                w.allreduce = not use_expert_pgs
                setattr(self, f"weight{i}", w)
            self._register_load_state_dict_pre_hook(type(self)._merge_extra_states, with_module=True)

        def _merge_extra_states(self, state_dict, prefix, *args):
            if not any("_extra_state" in str(k) for k in state_dict):
                return
            try:
                extra = [state_dict.pop(f"{prefix}_extra_state{i}") for i in range(1, self.num_gemms)]
            except KeyError:
                return  # "_extra_state{i}" only exists in a dist checkpoint
            for i, st in enumerate(extra, 1):
                te_cpu.te_accepts_extra_state(st, f"{prefix}_extra_state{i}")

        def forward(self, x, m_splits):
            parts = torch.split(x, [int(n) for n in m_splits])
            return torch.cat([F.linear(p, getattr(self, f"weight{i}")) for i, p in enumerate(parts)]), None

        def _sharded_state_dict_grouped(self, tp_axis_map, prefix="", sharded_offsets=(), metadata=None):
            metadata = ensure_metadata_has_dp_cp_group(metadata)
            singleton_local_shards = metadata.get("singleton_local_shards", False)
            out = {}
            full = self.state_dict(prefix="", keep_vars=True)
            num_global = get_pg_size(self._pg_collection.ep) * self.num_gemms
            offset = get_pg_rank(self._pg_collection.ep) * self.num_gemms
            ep_axis = len(sharded_offsets)
            extra_states = [full["_extra_state"]] * self.num_gemms  # _split_extra_state without FP8
            for i in range(self.num_gemms):
                g = offset + i
                sd = {f"{i}.weight": full[f"weight{i}"], f"{i}._extra_state": extra_states[i]}
                if singleton_local_shards:
                    expert_prefix, offsets = f"{g}.{prefix}", sharded_offsets
                else:
                    expert_prefix, offsets = prefix, (*sharded_offsets, (ep_axis, g, num_global))
                sub = make_sharded_tensors_for_checkpoint(sd, "", tp_axis_map, offsets, tp_group=self._tp_group,
                                                          dp_cp_group=metadata["dp_cp_group"])
                replace_prefix_for_sharding(sub, f"{i}.", expert_prefix)
                out[f"{prefix}weight{i}"] = sub[f"{i}.weight"]
                out[f"{prefix}_extra_state{'' if i == 0 else i}"] = sub[f"{i}._extra_state"]
            for k, sh in out.items():
                assert len(sh.replica_id) == 3, (k, sh.replica_id)
                if isinstance(sh, ShardedObject):
                    edp = get_pg_rank(getattr(self._pg_collection, "expt_dp_gtp_remat", self._pg_collection.expt_dp))
                else:
                    edp = get_pg_rank(self._pg_collection.expt_dp)
                sh.replica_id = (*sh.replica_id[:2], edp)
            return out

    class CpuTEColumnParallelGroupedLinear(CpuTEGroupedLinear):
        """TEColumnParallelGroupedLinear (experts' linear_fc1): weight{i} expert-TP axis 0."""
        parallel_mode = "column"

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            axes = {}
            for i in range(self.num_gemms):
                axes.update({f"{i}.weight": 0, f"{i}.bias": 0})
            return self._sharded_state_dict_grouped(axes, prefix, sharded_offsets, metadata)

    class CpuTERowParallelGroupedLinear(CpuTEGroupedLinear):
        """TERowParallelGroupedLinear (experts' linear_fc2): weight{i} expert-TP axis 1."""
        parallel_mode = "row"

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            return self._sharded_state_dict_grouped({f"{i}.weight": 1 for i in range(self.num_gemms)}, prefix,
                                                    sharded_offsets, metadata)

    class CpuTEDotProductAttention(ExtraState, DotProductAttention):
        """TEDotProductAttention: megatron-core's local DotProductAttention, plus TE's packed (THD) attention."""

        def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                     softmax_scale=None, k_channels=None, v_channels=None, cp_comm_type=None, pg_collection=None,
                     **kwargs):
            assert k_channels is None or k_channels == config.kv_channels, k_channels
            assert v_channels is None or v_channels == config.kv_channels, v_channels
            super().__init__(config, layer_number, attn_mask_type, attention_type, attention_dropout=attention_dropout,
                             softmax_scale=softmax_scale, cp_comm_type=cp_comm_type, pg_collection=pg_collection)

        def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None, **kwargs):
            if packed_seq_params is None:
                return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                       attention_bias=attention_bias, packed_seq_params=None)
            assert packed_seq_params.qkv_format == "thd" and attention_bias is None and attention_mask is None
            assert packed_seq_params.cu_seqlens_q_padded is None and packed_seq_params.cu_seqlens_kv_padded is None
            mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
            assert mask_type in (AttnMaskType.no_mask, AttnMaskType.padding, AttnMaskType.causal), mask_type
            cq = packed_seq_params.cu_seqlens_q.tolist()
            ck = packed_seq_params.cu_seqlens_kv.tolist()
            if key.shape[1] != query.shape[1]:  # GQA: [t, groups, d] -> [t, heads, d]
                key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
                value = value.repeat_interleave(query.shape[1] // value.shape[1], dim=1)
            out = torch.empty(query.shape[0], query.shape[1], value.shape[-1], dtype=query.dtype)
            for i in range(len(cq) - 1):
                q, k, v = query[cq[i]:cq[i + 1]], key[ck[i]:ck[i + 1]], value[ck[i]:ck[i + 1]]
                scores = torch.einsum("shd,thd->hst", q.float(), k.float()) * self.softmax_scale
                if mask_type == AttnMaskType.causal:
                    sq, sk = scores.shape[-2:]
                    scores = scores.masked_fill(torch.ones(sq, sk, dtype=torch.bool).triu(1 + sk - sq),
                                                float("-inf"))
                probs = torch.softmax(scores, dim=-1)
                out[cq[i]:cq[i + 1]] = torch.einsum("hst,thd->shd", probs, v.float()).to(query.dtype)
            return out.reshape(out.shape[0], -1)

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            return {}  # TEDotProductAttention.sharded_state_dict in 0.19.2, softmax_type "vanilla": nothing

    for cls, name in ((CpuTELayerNorm, "LayerNorm"), (CpuTENorm, "TENorm"),
                      (CpuTELayerNormColumnParallelLinear, "TELayerNormColumnParallelLinear"),
                      (CpuTEColumnParallelLinear, "TEColumnParallelLinear"),
                      (CpuTERowParallelLinear, "TERowParallelLinear"),
                      (CpuTEGroupedLinear, "TEGroupedLinear"),
                      (CpuTEColumnParallelGroupedLinear, "TEColumnParallelGroupedLinear"),
                      (CpuTERowParallelGroupedLinear, "TERowParallelGroupedLinear"),
                      (CpuTEDotProductAttention, "TEDotProductAttention")):
        cls.__name__ = cls.__qualname__ = name
    _CLASSES = {"norm": CpuTENorm, "ln_col": CpuTELayerNormColumnParallelLinear, "col": CpuTEColumnParallelLinear,
                "row": CpuTERowParallelLinear, "attn": CpuTEDotProductAttention,
                "gcol": CpuTEColumnParallelGroupedLinear, "grow": CpuTERowParallelGroupedLinear}
    return _CLASSES



def cpu_backend(model: str, column_linear: bool = True, experts: bool = True):
    """TESpecProvider's choices (megatron-core 0.19.2 extensions/transformer_engine_spec_provider.py) for a GPT
    layer, with the CPU leaves; what ``model`` does not use raises: TELinear always, TEColumnParallelLinear unless
    ``column_linear``, the grouped experts unless ``experts``."""
    from megatron.core.models.backends import BackendSpecProvider

    c = cpu_classes()

    class CpuTESpecProvider(BackendSpecProvider):
        def linear(self):
            raise NotImplementedError(f"TELinear: not used by {model}")

        def column_parallel_linear(self):
            if not column_linear:
                raise NotImplementedError(f"TEColumnParallelLinear: not used by {model}'s language model")
            return c["col"]

        def row_parallel_linear(self):
            return c["row"]

        def fuse_layernorm_and_linear(self):
            return True

        def column_parallel_layer_norm_linear(self):
            return c["ln_col"]

        def layer_norm(self, rms_norm=False, for_qk=False, has_residual=False):
            return c["norm"]  # TENorm (it picks RMSNorm / LayerNorm from config.normalization, not rms_norm)

        def core_attention(self):
            return c["attn"]

        def grouped_mlp_modules(self, moe_use_grouped_gemm):
            # TESpecProvider with TE >= 1.7 and grouped GEMM (Qwen3VLMoEModelProvider.provide always passes
            # moe_grouped_gemm=True): megatron-core's own TEGroupedMLP over TEColumn/RowParallelGroupedLinear;
            # activation_func would be TEActivationOp, built only with use_te_activation_func (False: asserted)
            if not experts:
                raise NotImplementedError(f"{model} has no experts")
            if not moe_use_grouped_gemm:
                raise NotImplementedError(f"SequentialMLP of TE linears: not what Bridge builds for {model}'s experts")
            from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, TEGroupedMLP

            return functools.partial(TEGroupedMLP, submodules=GroupedMLPSubmodules(
                linear_fc1=c["gcol"], linear_fc2=c["grow"], activation_func=None))

        def activation_func(self):
            return None

    return CpuTESpecProvider()


@contextlib.contextmanager
def gpt_build_patches(backend):
    """While a model is built: megatron-core's TESpecProvider (what get_gpt_layer_with_transformer_engine_spec
    asks) is ``backend`` and the block's final layernorm (transformer_block.LayerNormImpl, TENorm with TE) the TENorm
    stand-in; both restored on exit (other oracles share a test worker)."""
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer import transformer_block

    saved = gpt_layer_specs.TESpecProvider, transformer_block.LayerNormImpl
    gpt_layer_specs.TESpecProvider = lambda: backend
    transformer_block.LayerNormImpl = cpu_classes()["norm"]
    try:
        yield
    finally:
        gpt_layer_specs.TESpecProvider, transformer_block.LayerNormImpl = saved
