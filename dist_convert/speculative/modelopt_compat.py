"""What megatron-core and ModelOpt need on nodes without Transformer Engine or without CUDA, and
between the versions pinned here.

Applied only where the local layer spec is built (no TE, or a rank placed on the CPU), where the rank's model
lives on the CPU, or where the module is absent; ranks on a GPU with TE run both libraries unchanged.
- ModelOpt 0.47's exporter imports ``megatron.core.models.hybrid.hybrid_model.HybridModel``, the
  later name of megatron-core 0.16's ``MambaModel``; without that module the exporter's imports stop
  half way. ``alias_renamed_megatron_modules`` provides the new name (before ModelOpt is imported).
- With the local spec (base_model.layer_spec: no TE, or a CPU rank, whose TE modules would need CUDA),
  ModelOpt's megatron EAGLE plugin and megatron-core's ModelOpt layer spec name TE modules; they are
  swapped for megatron-core's own local equivalents (same parameters, same checkpoint keys).
- On a CPU rank (no CUDA, or ``--backend gloo`` on a GPU node), megatron-core 0.16 calls a few
  ``torch.cuda`` functions unconditionally while building tied pipeline stages and saving;
  ``cpu_stand_ins`` gives them CPU meanings for the duration of a call.
"""
from __future__ import annotations

import contextlib
import importlib
import sys
import types
from collections.abc import Iterator
from typing import Any

import torch

HAVE_TE = True
try:  # the import is the probe
    import transformer_engine  # noqa: F401
except ImportError:
    HAVE_TE = False

_applied = False


def alias_renamed_megatron_modules() -> None:
    """``megatron.core.models.hybrid.hybrid_model.HybridModel`` for megatron-core versions that call
    it ``megatron.core.models.mamba.MambaModel``."""
    try:
        importlib.import_module("megatron.core.models.hybrid.hybrid_model")
        return
    except ImportError:
        pass
    from megatron.core.models.mamba import MambaModel

    package = types.ModuleType("megatron.core.models.hybrid")
    module = types.ModuleType("megatron.core.models.hybrid.hybrid_model")
    module.HybridModel = MambaModel
    package.hybrid_model = module
    package.__path__ = []
    sys.modules[package.__name__] = package
    sys.modules[module.__name__] = module


def use_local_layers() -> list[str]:
    """Swap TE modules for local ones in ModelOpt's EAGLE plugin and the ModelOpt layer spec, for a model
    built with the local spec (idempotent); returns what was swapped ([] when done before)."""
    global _applied
    if _applied:
        return []
    from megatron.core import parallel_state
    from megatron.core.post_training.modelopt import layers as modelopt_layers
    from megatron.core.post_training.modelopt.gpt import model_specs
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from modelopt.torch.speculative.plugins import megatron_eagle

    class ReplicatedLinear(modelopt_layers.Linear):
        """Stands in for ``TELinear(parallel_mode="duplicated")``: the full weight on every TP rank."""

        def __init__(self, input_size: int, output_size: int, *, parallel_mode: str = "duplicated",
                     config: Any, init_method: Any, bias: bool = True, skip_bias_add: bool = False,
                     skip_weight_param_allocation: bool = False, tp_comm_buffer_name: str | None = None,
                     is_expert: bool = False, tp_group: Any = None) -> None:
            if parallel_mode != "duplicated":
                raise ValueError(f"only duplicated TELinear has a local stand-in, not {parallel_mode}")
            super().__init__(input_size, output_size, config=config, init_method=init_method, bias=bias,
                             skip_bias_add=skip_bias_add, skip_weight_param_allocation=skip_weight_param_allocation,
                             is_expert=is_expert,
                             tp_group=tp_group or parallel_state.get_tensor_model_parallel_group())

    @contextlib.contextmanager
    def attention_without_context_parallel(attention_mask: Any, num_attention_heads: int) -> Iterator[None]:
        if parallel_state.get_context_parallel_world_size() > 1:
            raise RuntimeError("EAGLE with context parallelism needs Transformer Engine")
        yield

    megatron_eagle.TELinear = ReplicatedLinear
    megatron_eagle.TENorm = WrappedTorchNorm
    megatron_eagle.te_dot_product_attention_with_cp = attention_without_context_parallel
    model_specs.Norm = WrappedTorchNorm
    model_specs.TEDotProductAttention = DotProductAttention
    _applied = True
    return ["TELinear", "TENorm", "te_dot_product_attention_with_cp", "Norm", "TEDotProductAttention"]


@contextlib.contextmanager
def cpu_stand_ins(device: torch.device) -> Iterator[None]:
    """For a rank whose model lives on the CPU (``device``: the runtime's; also on a GPU node under
    ``--backend gloo``): ``torch.cuda.synchronize`` is a no-op, ``current_device`` is the CPU and
    ``Tensor.cuda`` returns the tensor itself, restored afterwards. A CUDA rank runs unchanged."""
    if device.type != "cpu":
        yield
        return
    saved = torch.cuda.synchronize, torch.cuda.current_device, torch.Tensor.cuda
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    torch.Tensor.cuda = lambda self, *a, **k: self
    try:
        yield
    finally:
        torch.cuda.synchronize, torch.cuda.current_device, torch.Tensor.cuda = saved
