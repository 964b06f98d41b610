"""Optimizer state as logical tensors: Adam's fp32 master parameter and both moments of every model
parameter are three more logical tensors with the parameter's own shape and sharding, named
``optimizer.state.<state>.<parameter>`` (the key megatron-core's model-space ``fully_reshardable`` format
stores them under, with the parameter's torch_dist key in place of its logical name). What is not a
tensor (param_groups with the step, the LR scheduler) travels in ``datamodel.OptimizerState``.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

from ..config import ModelConfig
from ..datamodel import TargetTensor, numel
from ..layout.boxes import Piece
from ..layout.rules import LogicalTensor, logical_tensors

STATES = ("param", "exp_avg", "exp_avg_sq")  # the master parameter, Adam's first and second moments
PREFIX = "optimizer.state."
# model tensors that are buffers, not parameters: no optimizer state
NOT_PARAMETERS = (".mlp.router.expert_bias",)
# Megatron-LM's training counters in the common state, carried with the optimizer state
COUNTERS = ("num_floating_point_operations_so_far", "num_tokens_so_far")


def opt_name(state: str, name: str) -> str:
    """The logical name (and, with a torch_dist key for ``name``, the stored key) of ``state`` of ``name``."""
    return f"{PREFIX}{state}.{name}"


def is_optimizer(logical: str) -> bool:
    return logical.startswith(PREFIX)


def with_parameter(logical: str, rename: Callable[[str], str]) -> str:
    """``logical`` with its parameter's name ``rename``d: an optimizer tensor follows its parameter."""
    if not is_optimizer(logical):
        return rename(logical)
    state, name = logical.removeprefix(PREFIX).split(".", 1)
    return opt_name(state, rename(name))


def is_parameter(name: str) -> bool:
    return not name.endswith(NOT_PARAMETERS)


def parameters(cfg: ModelConfig) -> dict[str, LogicalTensor]:
    """The logical tensors that are trainable parameters (those with optimizer state)."""
    return {n: t for n, t in logical_tensors(cfg).items() if is_parameter(n)}


def optimizer_numel(cfg: ModelConfig) -> dict[str, int]:
    """Every optimizer logical tensor and its size (the planner's coverage check)."""
    return {opt_name(s, n): numel(t.shape) for n, t in parameters(cfg).items() for s in STATES}


def renamed(pieces: Iterable[Piece], state: str) -> list[Piece]:
    """A stored optimizer tensor's pieces: the model tensor's, naming ``state`` of each parameter."""
    return [replace(p, logical=opt_name(state, p.logical)) for p in pieces if is_parameter(p.logical)]


def optimizer_tensors(tensors: Iterable[TargetTensor], prefix: str = "") -> list[TargetTensor]:
    """The model-space optimizer tensors of a torch_dist target file holding the model ``tensors``:
    each parameter chunk once per state, keyed ``optimizer.state.<state>.<model key>`` (after ``prefix``),
    in fp32 with the parameter's offsets and global shape (what megatron-core's fully_reshardable
    format stores and loads at any layout)."""
    import torch

    out = []
    for t in tensors:
        if not all(is_parameter(p.logical) for p in t.pieces) or not t.pieces:
            continue
        key = t.key.removeprefix(prefix)
        out += [replace(t, key=prefix + opt_name(s, key), dtype=torch.float32, pieces=renamed(t.pieces, s))
                for s in STATES]
    return out


def dist_optimizer_groups(param_groups: list[dict[str, Any]], step: float | int | None) -> tuple[dict[str, Any], ...]:
    """Param groups in the distributed optimizer's saved form: without ``params``, with ``step``."""
    out = []
    for g in param_groups:
        g = {k: v for k, v in g.items() if k != "params"}
        if step is not None:
            g["step"] = step
        out.append(g)
    return tuple(out)
