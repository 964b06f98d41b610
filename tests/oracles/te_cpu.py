"""CPU stand-ins for Transformer Engine: the TE-less import of Megatron-Bridge's LoRA layers, TE's ``_extra_state``
as TE saves and checks it, and plain-torch modules with the names, TP splits and state of the TE classes Megatron-Bridge
builds (its Gemma 3 spec, reused by the Nemotron-H and Qwen3-Next judges; the Qwen VL models' are oracles/te_vl.py's,
built on these); a checkpoint loaded strictly into such a model (load_strict; load_to_mutate, a mutation's source).
Used only where TE is absent: the oracles say so."""
from __future__ import annotations

import copy
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import io
import pickle
import sys
import types
from pathlib import Path

from oracles.common import apply_cpu_shims, is_legacy, resolve_iter_dir, unwrap

LORA = "megatron.bridge.peft.lora_layers"


TE_IMPORT = "import transformer_engine.pytorch as te"


CPU_KERNELS = {"gradient_accumulation_fusion": False, "apply_rope_fusion": False, "masked_softmax_fusion": False,
               "bias_dropout_fusion": False, "bias_swiglu_fusion": False, "bias_gelu_fusion": False,
               "no_persist_layer_norm": True, "persist_layer_norm": False, "fp8": None, "fp8_param_gather": False,
               "cross_entropy_loss_fusion": False}


class _Inert(types.ModuleType):
    """``te`` for lora_layers.py: every attribute a fresh class (isinstance is False), ``ops`` likewise."""

    def __getattr__(self, name: str):
        value = _Inert(f"{self.__name__}.{name}") if name == "ops" else type(name, (), {})
        setattr(self, name, value)
        return value


class _LoraLoader(importlib.abc.Loader):
    def __init__(self, path: str) -> None:
        self.path = path

    def create_module(self, spec):
        return None

    def exec_module(self, module) -> None:
        src = Path(self.path).read_text()
        assert TE_IMPORT in src, f"{self.path}: the TE import changed; update the stub"
        module.__dict__["_te_stub"] = _Inert("transformer_engine.pytorch")
        exec(compile(src.replace(TE_IMPORT, "te = _te_stub"), self.path, "exec"), module.__dict__)


class _LoraFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != LORA:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        return importlib.machinery.ModuleSpec(fullname, _LoraLoader(spec.origin), origin=spec.origin)


def install_shims() -> None:
    if not any(isinstance(f, _LoraFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _LoraFinder())
    apply_cpu_shims()


def te_module_extra_state():
    import torch

    return torch.empty(0, dtype=torch.uint8)  # TransformerEngineBaseModule.get_extra_state without FP8


def te_op_extra_state():
    import torch

    return torch.frombuffer(bytearray(pickle.dumps({})), dtype=torch.uint8)  # BasicOperation: no quantizer state


def te_accepts_extra_state(state, where: str) -> None:
    """What TE's set_extra_state accepts: None, an empty tensor, a uint8 tensor holding a pickle, a BytesIO
    (TE 1.x); anything else raises there (``Unsupported checkpoint format``)."""
    import torch

    if state is None:
        return
    if isinstance(state, torch.Tensor):
        if state.numel():
            pickle.loads(state.detach().cpu().numpy().tobytes())
        return
    if isinstance(state, io.BytesIO):
        return
    raise RuntimeError(f"{where}: _extra_state of type {type(state).__name__}: TE refuses it")


def rms(x, weight, eps: float, zero_centered: bool):
    import torch

    w = weight.float() + 1.0 if zero_centered else weight.float()
    y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return (y * w).to(x.dtype)


def tp_of(group):
    """A stand-in's tensor-parallel group: the one given, else megatron-core's."""
    from megatron.core import parallel_state

    return group if group is not None else parallel_state.get_tensor_model_parallel_group()


def new_param(shape, config, init_method=None, value=None):
    """A stand-in's parameter: filled with ``value``, else initialised as megatron-core would, else zeros."""
    import torch

    p = torch.nn.Parameter(torch.empty(*shape, dtype=config.params_dtype))
    with torch.no_grad():
        if value is not None:
            p.fill_(value)
        elif init_method is not None and config.perform_initialization:
            init_method(p)
        else:
            p.zero_()
    return p


class ExtraState:
    """TE's _extra_state: saved as the module gives it, checked on load as TE would."""
    _extra = staticmethod(te_module_extra_state)

    def get_extra_state(self):
        return self._extra()

    def set_extra_state(self, state):
        te_accepts_extra_state(state, type(self).__name__)


_CLASSES = None


def cpu_classes():
    """The stand-in classes (built once, after megatron-core is importable)."""
    global _CLASSES
    if _CLASSES is not None:
        return _CLASSES
    import torch
    import torch.nn.functional as F
    from megatron.bridge.models.gemma.gemma3_provider import _is_local_attn_layer
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        reduce_from_tensor_model_parallel_region,
    )
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

    class CpuTENorm(ExtraState, torch.nn.Module):
        """te.pytorch.RMSNorm as megatron-core's TENorm builds it (TE 2.x: an op, weight ``weight``)."""
        _extra = staticmethod(te_op_extra_state)

        def __init__(self, config, hidden_size, eps=1e-5, has_residual=False):
            super().__init__()
            assert config.normalization == "RMSNorm", config.normalization
            self.eps, self.zero_centered = eps, config.layernorm_zero_centered_gamma
            self.weight = new_param((hidden_size,), config, value=0.0 if self.zero_centered else 1.0)
            self.weight.sequence_parallel = config.sequence_parallel

        def forward(self, x):
            return rms(x, self.weight, self.eps, self.zero_centered)

    class CpuTELayerNormColumnParallelLinear(ExtraState, torch.nn.Module):
        """TELayerNormColumnParallelLinear: RMSNorm (``layer_norm_weight``) fused before a column-parallel linear."""

        def __init__(self, input_size, output_size, *, config, init_method, gather_output, bias, skip_bias_add,
                     is_expert, skip_weight_param_allocation=False, tp_comm_buffer_name=None, tp_group=None,
                     stride=1, name=None):
            super().__init__()
            assert not gather_output and not bias and not is_expert and not skip_weight_param_allocation
            self.config, self._tp_group = config, tp_of(tp_group)
            tp = self._tp_group.size()
            self.eps, self.zero_centered = config.layernorm_epsilon, config.layernorm_zero_centered_gamma
            self.layer_norm_weight = new_param((input_size,), config, value=0.0 if self.zero_centered else 1.0)
            self.weight = new_param((output_size // tp, input_size), config, init_method)
            set_tensor_model_parallel_attributes(self.weight, True, 0, stride)

        def forward(self, x):
            x = rms(x, self.layer_norm_weight, self.eps, self.zero_centered)
            x = copy_to_tensor_model_parallel_region(x, group=self._tp_group)
            return F.linear(x, self.weight), None

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):  # as megatron-core's wrapper
            metadata = ensure_metadata_has_dp_cp_group(metadata)
            state_dict = self.state_dict(prefix="", keep_vars=True)
            return make_sharded_tensors_for_checkpoint(state_dict, prefix, {"weight": 0, "bias": 0}, sharded_offsets,
                                                       tp_group=self._tp_group, dp_cp_group=metadata["dp_cp_group"])

    class CpuTERowParallelLinearLayerNorm(ExtraState, torch.nn.Module):
        """Bridge's TERowParallelLinearLayerNorm: TERowParallelLinear + ``post_layernorm = TENorm(config, out)``."""

        def __init__(self, input_size, output_size, *, config, init_method, bias, input_is_parallel, skip_bias_add,
                     is_expert, tp_comm_buffer_name=None, tp_group=None, name=None):
            super().__init__()
            assert input_is_parallel and not bias and not is_expert
            self.config, self._tp_group = config, tp_of(tp_group)
            tp = self._tp_group.size()
            self.weight = new_param((output_size, input_size // tp), config, init_method)
            set_tensor_model_parallel_attributes(self.weight, True, 1, 1)
            self.post_layernorm = CpuTENorm(config, output_size)  # as Bridge: TENorm's default eps

        def forward(self, x):
            out = reduce_from_tensor_model_parallel_region(F.linear(x, self.weight), group=self._tp_group)
            return self.post_layernorm(out), None

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):  # as TERowParallelLinear's
            metadata = ensure_metadata_has_dp_cp_group(metadata)
            state_dict = self.state_dict(prefix="", keep_vars=True)
            return make_sharded_tensors_for_checkpoint(state_dict, prefix, {"weight": 1}, sharded_offsets,
                                                       tp_group=self._tp_group, dp_cp_group=metadata["dp_cp_group"])

    class CpuGemma3DotProductAttention(ExtraState, DotProductAttention):
        """Gemma3TEDotProductAttention's per-layer window on megatron-core's local attention."""

        def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                     softmax_scale=None, cp_comm_type=None, pg_collection=None, **kwargs):
            config = copy.deepcopy(config)
            assert not config.is_vision_language
            if _is_local_attn_layer(layer_number, config.interleaved_attn_pattern):
                config.window_size = (config.window_size - 1, 0)
            else:
                config.window_size = None
            config.window_attn_skip_freq = None
            super().__init__(config, layer_number, attn_mask_type, attention_type, attention_dropout=attention_dropout,
                             softmax_scale=softmax_scale, cp_comm_type=cp_comm_type, pg_collection=pg_collection)

    # Bridge picks a weight's TP split by its module's class name (AutoMapping._MODULE_TYPE_REGISTRY): the
    # stand-ins carry the names of the classes they stand for (te.pytorch.RMSNorm is what TENorm builds)
    for cls, name in ((CpuTENorm, "RMSNorm"), (CpuTELayerNormColumnParallelLinear, "TELayerNormColumnParallelLinear"),
                      (CpuTERowParallelLinearLayerNorm, "TERowParallelLinearLayerNorm"),
                      (CpuGemma3DotProductAttention, "Gemma3TEDotProductAttention")):
        cls.__name__ = cls.__qualname__ = name
    _CLASSES = {"norm": CpuTENorm, "qkv": CpuTELayerNormColumnParallelLinear,
                "row_ln": CpuTERowParallelLinearLayerNorm, "attn": CpuGemma3DotProductAttention}
    return _CLASSES


def apply_bridge_cpu_shims():
    """``install_shims`` plus: the attention masks megatron-core makes on "cuda" made on the CPU."""
    import torch

    install_shims()
    from megatron.core.fusions import fused_softmax

    def sliding(sq, skv, window_size):  # megatron-core's, on the CPU
        m = torch.ones(sq, skv, dtype=torch.bool)
        return ~torch.tril(torch.triu(m, diagonal=skv - sq - window_size[0]), diagonal=skv - sq + window_size[1])

    fused_softmax.get_sliding_window_causal_mask = sliding
    fused_softmax.get_default_causal_mask = lambda sq: torch.triu(torch.ones(sq, sq), diagonal=1).bool()
    if not getattr(torch.cuda, "_gemma3_rng", False):
        torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()  # the save records it
        torch.cuda._gemma3_rng = True


def load_strict(model, iter_dir: Path, problems: list[str]) -> None:
    """The checkpoint into ``model`` as megatron-core loads it, strictly: dist_checkpointing.load with RAISE_ALL
    (missing and unexpected keys raise; resharding as needed), TE's check of every _extra_state, then
    load_state_dict: every key but an _extra_state the sharded state dict does not save. A legacy checkpoint: its
    rank file's ``model``, the same checks. ``model``: the rank's chunks, one per virtual pipeline stage (saved and
    loaded as Megatron-LM's ``model0``, ``model1``, ... where there are several)."""
    import torch
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.validation import StrictHandling

    chunks = [unwrap(m) for m in model]  # one per virtual pipeline stage: Megatron-LM's model0, model1, ...
    names = ["model"] if len(chunks) == 1 else [f"model{v}" for v in range(len(chunks))]
    if is_legacy(iter_dir):
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        pp, pp_rank = parallel_state.get_pipeline_model_parallel_world_size(), \
            parallel_state.get_pipeline_model_parallel_rank()
        f = iter_dir / (f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else "")) / "model_optim_rng.pt"
        if not f.is_file():
            problems.append(f"legacy checkpoint: no {f.relative_to(iter_dir)} (the judge loads TP x PP = world size)")
            return
        from megatron.core.safe_globals import SAFE_GLOBALS

        # registered for good, as megatron-core does: the safe_globals context would drop them again on exit
        torch.serialization.add_safe_globals(list(SAFE_GLOBALS))
        state = torch.load(f, map_location="cpu", weights_only=True)
        sds = [state[n] for n in names]
    else:
        request = {n: m.sharded_state_dict() for n, m in zip(names, chunks, strict=True)}
        loaded = dist_checkpointing.load(request, str(iter_dir), strict=StrictHandling.RAISE_ALL)
        sds = [loaded[n] for n in names]
    for m, sd in zip(chunks, sds, strict=True):
        _load_chunk(m, sd, problems)


def _load_chunk(m, sd: dict, problems: list[str]) -> None:
    """One model chunk's state dict, loaded as megatron-core loads it (``load_strict``)."""
    for k, v in sd.items():
        if k.endswith("_extra_state"):
            try:
                te_accepts_extra_state(v, k)
            except Exception as e:  # noqa: BLE001 - TE's verdict
                problems.append(f"{k}: {e}")
    res = m.load_state_dict(sd, strict=False)
    # as Megatron-LM's and Bridge's loaders: a module's _extra_state the sharded state dict does not save
    # (TEDotProductAttention's; the tied output layer's) may be absent; every other key must be there
    problems += [f"load_state_dict: missing {k}" for k in res.missing_keys if not k.endswith("._extra_state")]
    problems += [f"load_state_dict: unexpected {k}" for k in res.unexpected_keys]


def against_bridge_import(provider_of, build, iter_dir: Path, info: dict, problems: list[str],
                          towers: tuple[str, ...] = ()):
    """Bridge's model with the judged checkpoint loaded strictly (``load_strict``) and Bridge's own import of the HF
    model at the same layout, in memory (``provider_of(load_weights)`` -> (bridge, provider)): every loaded tensor
    compared with the import's; ``info`` gets how many were loaded, and how many under each prefix of ``towers``
    (``loaded_<prefix>_tensors``). Returns (model, ref, the provider ``model`` was built by)."""
    from oracles.common import compare, tensor_state

    provider = provider_of(False)[1]
    model = build(provider)
    load_strict(model, iter_dir, problems)
    ref = build(provider_of(True)[1])
    got, want = tensor_state(model), tensor_state(ref)
    info["loaded_tensors"] = len(got)
    for prefix in towers:
        info[f"loaded_{prefix.rstrip('.')}_tensors"] = sum(k.startswith(prefix) for k in got)
    problems += compare(got, want, "loaded vs Bridge import")
    return model, ref, provider


def load_to_mutate(model, src: str):
    """A mutation's source: the checkpoint at ``src`` (its root or an iteration directory) loaded into ``model`` as
    load_strict loads it, with nothing wrong; returns the first chunk's module, to be changed and saved."""
    problems: list[str] = []
    load_strict(model, Path(resolve_iter_dir(src)), problems)
    assert not problems, problems
    return unwrap(model[0])
