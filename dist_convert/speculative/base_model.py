"""Build this rank's megatron-core GPTModel for its place in the target layout, without random
init, and fill its base weights through the reshard engine (each rank reads only its share of the
source; the exchange writes straight into the parameters)."""
from __future__ import annotations

import argparse
from typing import Any

import torch

from ..config import ModelConfig
from ..datamodel import SourceIndex, TargetFile, TargetTensor
from ..errors import ConvertError
from ..exchange import Assembly, execute
from ..formats.base import Format
from ..layout.boxes import Kind
from ..layout.rank_files import rank_entries
from ..layout.rules import logical_tensors
from ..layout.topology import Layout
from ..plan import Plan, make_plan
from ..runtime import Runtime
from .modelopt_compat import HAVE_TE


def init_model_parallel(layout: Layout) -> tuple[int, int]:
    """megatron-core's process groups for the target layout (data-parallel over the rest); returns
    this rank's (tp_rank, pp_rank)."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=layout.tp,
                                             pipeline_model_parallel_size=layout.pp)
    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()


def transformer_config(cfg: ModelConfig, args: argparse.Namespace, layout: Layout, dtype: torch.dtype) -> Any:
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    extra: dict[str, Any] = {}
    if layout.first is not None:
        extra["num_layers_in_first_pipeline_stage"] = layout.first
    if layout.last is not None:
        extra["num_layers_in_last_pipeline_stage"] = layout.last
    return TransformerConfig(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads, num_query_groups=cfg.num_query_groups,
        kv_channels=cfg.kv_channels, normalization=cfg.normalization,
        layernorm_epsilon=float(getattr(args, "norm_epsilon", None) or 1e-5),
        add_bias_linear=cfg.add_bias_linear, add_qkv_bias=cfg.add_qkv_bias, gated_linear_unit=cfg.swiglu,
        activation_func=F.silu if cfg.swiglu else F.gelu, qk_layernorm=cfg.qk_layernorm,
        hidden_dropout=float(getattr(args, "hidden_dropout", None) or 0.0),
        attention_dropout=float(getattr(args, "attention_dropout", None) or 0.0),
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        use_cpu_initialization=not torch.cuda.is_available(),
        perform_initialization=False,  # every base weight is overwritten from the checkpoint
        **extra)


def build_base_model(cfg: ModelConfig, args: argparse.Namespace, layout: Layout, dtype: torch.dtype) -> Any:
    """The GPTModel of this rank (ModelOpt's layer spec, local core attention without TE)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.post_training.modelopt.gpt.model_specs import get_gpt_modelopt_spec

    config = transformer_config(cfg, args, layout, dtype)
    spec = get_gpt_modelopt_spec(config, local_core_attention=not HAVE_TE, remap_te_layernorm=True)
    model = GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=cfg.padded_vocab(layout.tp),
        max_sequence_length=int(cfg.max_position_embeddings or getattr(args, "seq_length", 4096)),
        pre_process=parallel_state.is_pipeline_first_stage(), post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=cfg.tied, position_embedding_type=cfg.position_embedding_type,
        rotary_percent=float(getattr(args, "rotary_percent", None) or 1.0),
        rotary_base=int(getattr(args, "rotary_base", None) or 10000),
        rope_scaling=bool(getattr(args, "use_rope_scaling", False)),
        rope_scaling_factor=float(getattr(args, "rope_scaling_factor", None) or 8.0))
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model


def rank_files(cfg: ModelConfig, layout: Layout, coords: list[tuple[int, int]], dtype: torch.dtype) -> list[TargetFile]:
    """One target 'file' per global rank: the base tensors of its (tp_rank, pp_rank) model, in
    megatron-core ``state_dict`` names. Data-parallel replicas get their own copy."""
    files = []
    for rank, (t, p) in enumerate(coords):
        tensors = [TargetTensor(key=key, shape=shape, dtype=dtype, pieces=pieces)
                   for key, (shape, pieces) in rank_entries(cfg, layout, t, p, "local").items()]
        files.append(TargetFile(id=rank, name=f"rank{rank}", tensors=tensors))
    return files


def fill_base_weights(model: Any, index: SourceIndex, fmt: Format, cfg: ModelConfig, layout: Layout,
                      dtype: torch.dtype, rt: Runtime, coords: list[tuple[int, int]], budget: int,
                      logical_numel: dict[str, int]) -> tuple[Plan, dict[str, int]]:
    """Collective: copy the source's base weights into every rank's model parameters."""
    files = rank_files(cfg, layout, coords, dtype)
    mine = files[rt.rank]
    state = {k: v for k, v in model.state_dict().items()
             if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}
    expected = {t.key for t in mine.tensors}
    if set(state) != expected:
        raise ConvertError(f"megatron-core's model holds {sorted(set(state) ^ expected)[:4]} unlike the layout table",
                           "this model configuration is not supported by speculate; report it with the config")
    out: dict[tuple[int, int], torch.Tensor] = {}
    vocab_keys = {n for n, t in logical_tensors(cfg).items() if t.kind is Kind.VOCAB}
    for j, t in enumerate(mine.tensors):
        param = state[t.key]
        if tuple(param.shape) != t.shape or param.dtype != dtype:
            raise ConvertError(f"model tensor {t.key} is {tuple(param.shape)} {param.dtype}, the plan expects "
                               f"{t.shape} {dtype}", "report this with the model config")
        if any(p.logical in vocab_keys for p in t.pieces) or not t.pieces:
            param.zero_()  # vocabulary padding rows stay zero
        out[(mine.id, j)] = param.data if param.device.type == "cpu" else torch.zeros_like(param, device="cpu")
    plan = make_plan(index.chunks, files, rt.world, budget, logical_numel, writer_of={f.id: f.id for f in files})
    with torch.no_grad():
        counters = execute(plan, rt, {c.id: c for c in index.chunks}, lambda cs: fmt.read(index, cs),
                           Assembly([mine], plan, rt.rank, into=out), what="loading base weights")
        for j, t in enumerate(mine.tensors):
            if state[t.key].device.type != "cpu":
                state[t.key].copy_(out[(mine.id, j)], non_blocking=True)
    counters["tensors"] = len(mine.tensors)
    return plan, counters
