"""Build this rank's megatron-core GPTModel for its place in the target layout, without random
init, and fill its base weights through the reshard engine (each rank reads only its share of the
source; the exchange writes straight into the parameters, on the rank's device).

Where a rank builds its model follows the runtime (``placement``): on its GPU under ``--backend nccl``, on the
CPU under ``--backend gloo`` (also on a GPU node); the layer modules follow TE and the device
(``layer_spec``); the random state ModelOpt's new draft modules are initialised from is seeded as
Megatron-LM seeds it (``seed_rngs``)."""
from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..config import ModelConfig
from ..datamodel import SourceIndex, TargetFile, TargetTensor
from ..errors import ConvertError
from ..exchange import Assembly, execute
from ..features.position import LLAMA3_DEFAULT_FACTOR, Llama3
from ..formats.base import Format
from ..formats.mcore_config import transformer_fields
from ..layout.boxes import Kind
from ..layout.rank_files import rank_entries
from ..layout.rules import logical_tensors
from ..layout.topology import Layout
from ..plan import Plan, make_plan
from ..runtime import Runtime
from .modelopt_compat import cpu_stand_ins

SPECS = ("local", "te")  # the layer namings a base model's state dict may use (the layout table's specs)
DEFAULT_SEED = 1234  # Megatron-LM's --seed default
PIPELINE_SEED_STRIDE = 100  # Megatron-LM's _set_random_seed: each pipeline stage seeds seed + 100 * its rank


def layer_spec(have_te: bool, device: torch.device) -> str:
    """Pure: the layer modules of the base model and its draft. "te": megatron-core's ModelOpt spec as
    Megatron-LM's ModelOpt builder uses it on GPUs (TENorm, TEDotProductAttention; ModelOpt's EAGLE plugin
    unchanged), when Transformer Engine is importable and the rank is on a GPU; else "local" (megatron-core's
    own modules: TE's need CUDA)."""
    return "te" if have_te and device.type == "cuda" else "local"


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Where this rank builds its model, and with which layer modules."""

    device: torch.device  # the runtime's: this rank's GPU, or the CPU
    spec: str  # layer_spec

    @property
    def on_cpu(self) -> bool:
        """megatron-core's ``use_cpu_initialization``; also: CPU stand-ins for its ``torch.cuda`` calls, and no
        CUDA random state to seed."""
        return self.device.type == "cpu"


def placement(device: torch.device, have_te: bool) -> Placement:
    """Pure: the placement of a rank whose runtime runs on ``device`` (runtime.Runtime.device: the GPU of its
    local rank under ``--backend nccl``, the CPU under gloo)."""
    if device.type not in ("cpu", "cuda"):
        raise ConvertError(f"speculate builds megatron-core models on the CPU or a CUDA GPU, not on {device}",
                           "use --backend gloo (CPU) or --backend nccl (one GPU per rank)")
    if device.type == "cuda" and device.index is None:
        raise ConvertError("this rank's GPU is not known (a CUDA device without an index)",
                           "launch with torchrun and --backend nccl, which gives every local rank its own GPU")
    return Placement(device=device, spec=layer_spec(have_te, device))


def choose_seed(requested: int | None, args: argparse.Namespace | None) -> int:
    """Pure: the seed of a run: the one asked for (``SpeculateOptions.seed``), else the source's Megatron-LM
    ``--seed`` (its args), else Megatron-LM's default."""
    if requested is not None:
        return requested
    found = getattr(args, "seed", None)
    return found if isinstance(found, int) and not isinstance(found, bool) and found > 0 else DEFAULT_SEED


def init_seed(seed: int, pp_rank: int) -> int:
    """Pure: the seed a pipeline stage initialises from, as Megatron-LM's ``_set_random_seed`` derives it (the
    same on every TP rank and data-parallel replica of a stage, so that replicated tensors and replicas agree)."""
    if seed <= 0:  # Megatron-LM refuses them too
        raise ConvertError(f"seed {seed} is not a positive integer", "pass a positive --seed")
    return seed + PIPELINE_SEED_STRIDE * pp_rank


def seed_rngs(place: Placement, seed: int, pp_rank: int) -> int:
    """Seed the random state ModelOpt's new draft modules are initialised from; returns the stage's seed. CPU
    initialisation (``_initialize_affine_weight_cpu``) draws from torch's CPU generator; GPU initialisation
    (``_initialize_affine_weight_gpu``, TE's duplicated linears) forks megatron-core's CUDA RNG tracker, which
    has no state until ``model_parallel_cuda_manual_seed`` adds its model-parallel, data-parallel and expert
    states (without it: "cuda rng state model-parallel-rng is not added")."""
    stage_seed = init_seed(seed, pp_rank)
    torch.manual_seed(stage_seed)
    if not place.on_cpu:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        with torch.cuda.device(place.device):
            model_parallel_cuda_manual_seed(stage_seed)
    return stage_seed


@contextlib.contextmanager
def on_device(place: Placement) -> Iterator[None]:
    """Run megatron-core and ModelOpt for this placement: CUDA calls on the rank's own GPU (they allocate on
    ``torch.cuda.current_device()``), or given CPU meanings on a CPU rank."""
    if place.on_cpu:
        with cpu_stand_ins(place.device):
            yield
    else:
        with torch.cuda.device(place.device):
            yield


def model_naming(keys: set[str], expected: dict[str, set[str]]) -> str | None:
    """Pure: which naming (a SPECS entry) the model's state-dict ``keys`` use, given the keys the layout table
    expects under each; "local" first where both fit (a stage without norms); None when none fits. The ModelOpt
    spec names norms as modules of their own (``input_layernorm.weight``), TE layer specs fuse them into the next
    linear (``self_attention.linear_qkv.layer_norm_weight``)."""
    for spec in SPECS:
        if spec in expected and keys == expected[spec]:
            return spec
    return None


def init_model_parallel(layout: Layout) -> tuple[int, int]:
    """megatron-core's process groups for the target layout (data-parallel over the rest); returns
    this rank's (tp_rank, pp_rank)."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=layout.tp,
                                             pipeline_model_parallel_size=layout.pp)
    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()


# GPTModel's arguments among transformer_fields (the rest are TransformerConfig's)
MODEL_ARGS = ("position_embedding_type", "rotary_base", "rotary_percent", "rope_scaling", "rope_scaling_factor",
              "seq_len_interpolation_factor", "share_embeddings_and_output_weights", "vocab_size")


def transformer_config(cfg: ModelConfig, args: argparse.Namespace, layout: Layout, dtype: torch.dtype,
                       place: Placement) -> Any:
    """megatron-core's TransformerConfig of the model: every setting its records hold (``transformer_fields``)."""
    import importlib

    from megatron.core.transformer import TransformerConfig

    fields = {k: v for k, v in transformer_fields(cfg).items() if k not in MODEL_ARGS}
    module, name = fields.pop("activation_func")["_target_"].rsplit(".", 1)
    fields["activation_func"] = getattr(importlib.import_module(module), name)
    if "window_size" in fields:
        fields["window_size"] = tuple(fields["window_size"])
    extra: dict[str, Any] = {}
    if layout.first is not None:
        extra["num_layers_in_first_pipeline_stage"] = layout.first
    if layout.last is not None:
        extra["num_layers_in_last_pipeline_stage"] = layout.last
    return TransformerConfig(
        **fields, hidden_dropout=float(getattr(args, "hidden_dropout", None) or 0.0),
        attention_dropout=float(getattr(args, "attention_dropout", None) or 0.0),
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        use_cpu_initialization=place.on_cpu,
        perform_initialization=False,  # every base weight is overwritten from the checkpoint
        **extra)


def build_base_model(cfg: ModelConfig, args: argparse.Namespace, layout: Layout, dtype: torch.dtype,
                     place: Placement) -> Any:
    """The GPTModel of this rank on ``place.device`` (ModelOpt's layer spec; with the local placement spec its
    core attention and norms are megatron-core's own: modelopt_compat.use_local_layers). Call it ``on_device``."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.post_training.modelopt.gpt.model_specs import get_gpt_modelopt_spec

    config = transformer_config(cfg, args, layout, dtype, place)
    spec = get_gpt_modelopt_spec(config, local_core_attention=place.spec == "local", remap_te_layernorm=True)
    pos = cfg.position
    model = GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=cfg.padded_vocab(layout.tp),
        max_sequence_length=int(cfg.max_position_embeddings or getattr(args, "seq_length", 4096)),
        pre_process=parallel_state.is_pipeline_first_stage(), post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=cfg.tied, position_embedding_type=pos.kind, rotary_percent=pos.percent,
        rotary_base=int(pos.base), rope_scaling=isinstance(pos.scaling, Llama3),
        rope_scaling_factor=pos.scaling.factor if isinstance(pos.scaling, Llama3) else LLAMA3_DEFAULT_FACTOR,
        seq_len_interpolation_factor=pos.seq_len_interpolation)
    if not place.on_cpu:
        model.cuda(place.device)  # parameters are made there; buffers megatron-core makes on the CPU follow
    return model


def rank_files(cfg: ModelConfig, layout: Layout, coords: list[tuple[int, int]], dtype: torch.dtype,
               spec: str = "local") -> list[TargetFile]:
    """Pure: one target 'file' per global rank: the base tensors of its (tp_rank, pp_rank) model, in
    megatron-core ``state_dict`` names of ``spec`` (SPECS). Data-parallel replicas get their own copy: each
    replica's parameters must hold the whole shard, and the plan reads every source byte once and sends it
    to each rank that holds it (no rank receives a byte twice; test_speculate_device)."""
    files = []
    for rank, (t, p) in enumerate(coords):
        tensors = [TargetTensor(key=key, shape=shape, dtype=dtype, pieces=pieces)
                   for key, (shape, pieces) in rank_entries(cfg, layout, t, p, spec).items()]
        files.append(TargetFile(id=rank, name=f"rank{rank}", tensors=tensors))
    return files


def fill_base_weights(model: Any, index: SourceIndex, fmt: Format, cfg: ModelConfig, layout: Layout,
                      dtype: torch.dtype, rt: Runtime, coords: list[tuple[int, int]], budget: int,
                      logical_numel: dict[str, int]) -> tuple[Plan, dict[str, int]]:
    """Collective: copy the source's base weights into every rank's model parameters (on their device)."""
    state = {k: v for k, v in model.state_dict().items()
             if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}
    t_rank, p_rank = coords[rt.rank]
    expected = {spec: set(rank_entries(cfg, layout, t_rank, p_rank, spec)) for spec in SPECS}
    naming = model_naming(set(state), expected)
    if naming is None:
        raise ConvertError(f"megatron-core's model holds {sorted(set(state) ^ expected['local'])[:4]} unlike the "
                           "layout table", "this model configuration is not supported by speculate; report it with "
                           "the config")
    files = rank_files(cfg, layout, coords, dtype, naming)
    mine = files[rt.rank]
    out: dict[tuple[int, int], torch.Tensor] = {}
    vocab_keys = {n for n, t in logical_tensors(cfg).items() if t.kind is Kind.VOCAB}
    for j, t in enumerate(mine.tensors):
        param = state[t.key]
        if tuple(param.shape) != t.shape or param.dtype != dtype:
            raise ConvertError(f"model tensor {t.key} is {tuple(param.shape)} {param.dtype}, the plan expects "
                               f"{t.shape} {dtype}", "report this with the model config")
        if any(p.logical in vocab_keys for p in t.pieces) or not t.pieces:
            param.zero_()  # vocabulary padding rows stay zero
        out[(mine.id, j)] = param.data  # the exchange copies what arrives (on the CPU) into place, on any device
    plan = make_plan(index.chunks, files, rt.world, budget, logical_numel, writer_of={f.id: f.id for f in files})
    with torch.no_grad():
        counters = execute(plan, rt, {c.id: c for c in index.chunks}, lambda cs: fmt.read(index, cs),
                           Assembly([mine], plan, rt.rank, into=out), what="loading base weights")
    counters["tensors"] = len(mine.tensors)
    return plan, counters
