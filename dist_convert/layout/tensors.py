"""The records of the layout table: a rule (a name pattern, its partition kind and shape, the models that have
it) and the logical tensor a rule makes of one model, and the few shapes and conditions many features' rules share.

Each feature's rules live in a module of their own (``attention.py``, ``mlp.py``, ``dsa.py``, ``mtp.py``,
``hybrid.py``, ``t5.py``; ``vision.py`` for a vision component); ``rules.py`` assembles them into a model's logical
tensors."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .boxes import Kind

if TYPE_CHECKING:  # the layout reads a model config's attributes; it never imports the config's module
    from ..config import ModelConfig

Cond = Callable[["ModelConfig"], bool]
Shape = Callable[["ModelConfig"], tuple[int, ...]]
Sections = Callable[["ModelConfig"], tuple[tuple[str, int], ...]]  # named row sections, in order
_always: Cond = lambda c: True  # noqa: E731
hidden: Shape = lambda c: (c.hidden_size,)  # noqa: E731  (one per hidden unit: norms, row-parallel biases)
linear_bias: Cond = lambda c: c.add_bias_linear  # noqa: E731
norm_bias: Cond = lambda c: c.norm.bias  # noqa: E731  (LayerNorm; RMSNorm has none)


@dataclass(frozen=True)
class Rule:
    name: str  # per-layer suffix (after <stack>.layers.N.) or a full top-level name
    kind: Kind
    shape: Shape
    when: Cond = _always
    te_name: str | None = None  # name in Transformer Engine fused layer specs (and torch_dist keys)
    aliases: tuple[str, ...] = ()  # further names megatron-core stores the same tensor under
    # MoE models: "all" layers, "dense" layers only, or "moe" layers only; "indexed": layers with a DSA indexer
    layers: str = "all"
    per_expert: bool = False  # one tensor per (global) expert: ``name`` has an ``{e}`` field
    dist_name: str | None = None  # torch_dist key suffix when it differs from te_name / name
    mixer: str | None = None  # the layer kind it belongs to: "mamba" / "gdn" (None: attention, or MLP by its name)
    # Kind.PARTS: the named row sections, each split over TP on its own; ``dist_split``: torch_dist keys each
    # section on its own (``<key>.<section>``, megatron-core's ShardedTensorFactory of the Mamba2 / GDN mixers)
    sections: Sections | None = None
    dist_split: bool = False


@dataclass(frozen=True, kw_only=True)
class LogicalTensor:
    name: str
    kind: Kind
    shape: tuple[int, ...]
    layer: int | None  # layer number within its stack, None for top-level tensors
    suffix: str  # rule name: per-layer suffix or the top-level name
    stage: str  # "layer", or a top-level placement (see ``rules.TOP_RULES`` / ``holders``)
    te_name: str | None
    stack: str | None = None  # "decoder" / "encoder" for layer tensors
    aliases: tuple[str, ...] = ()
    expert: int | None = None  # MoE: the global expert index of a routed expert's tensor
    dist_suffix: str | None = None  # torch_dist key suffix when it differs from te_name / suffix
    items: str = "layers."  # what the stack calls its numbered items (``<stack>.<items><N>.``)
    sections: tuple[int, ...] = ()  # Kind.PARTS: row counts of the sections split over TP on their own
    section_names: tuple[str, ...] = ()  # torch_dist keys them one by one (``<key>.<name>``)

    @property
    def layer_prefix(self) -> str:
        return f"{self.stack}.{self.items}"
