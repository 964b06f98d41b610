"""Who builds a model from what a target says about it, and where one of them builds another model.

Every format's writers refuse a model their own description cannot hold (the HF families, NeMo's and Megatron-Bridge's
config writers: ``features.expressed``). A Megatron checkpoint's description is its Megatron-LM ``args``, and the
program that builds from them is Megatron-LM's own builder, which Megatron-Bridge's Megatron-LM-compat loader follows:
``core_transformer_config_from_args``, then at core_v0.19 ``gpt_config_from_args`` / ``GPTModelBuilder``
(``hybrid_config_from_args`` for a hybrid pattern), at core_v0.16 ``gpt_builders.gpt_builder`` (``mamba_builders.
mamba_builder``), which hands ``GPTModel`` / ``MambaModel`` its arguments itself. Both pass every args field named like
a ``TransformerConfig`` field, choose the activation from ``--swiglu`` / ``--quick-geglu`` / ``--squared-relu``, and
build RoPE from ``use_rope_scaling`` alone: ``rope_scaling_factor`` never reaches ``GPTModel`` (it runs 8).

core_v0.16 (with megatron-core 0.16.1) builds less (``Release``): its ``TransformerConfig`` has no field for
DeepSeek sparse attention's indexer settings but heads, head size and top-k, and megatron-core 0.16.1's indexer
differs from 0.19's in any case (RoPE on its last ``qk_pos_emb_head_dim`` features, always MLA-interleaved; its key
LayerNorm at the norm epsilon; an indexer in every layer); ``core_transformer_config_from_args`` sets no ``yarn_*``
on a GPT (not MLA) config, which ``GPTModel``'s YaRN branch reads (it fails); the builders never pass
``rotary_seq_len_interpolation_factor``; ``moe_router_force_biased`` and ``moe_expert_rank_capacity_factor`` have no
field.

``MEGATRON_LM`` declares, positively, what that builder makes of a model's settings; ``reader_warnings`` names, in one
line per reader, what a target's readers would build otherwise (the args still record the true value, which
dist_convert, Megatron-Bridge's providers and NeMo read). ``tests/test_readers.py`` runs Megatron-LM's builder
itself on the args dist_convert writes for every family, and checks this table against what it builds: core_v0.19
from megatron-core 0.19.2's wheel, core_v0.16 from a Megatron-LM source tree at core_v0.16.1 where one is at hand.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .features import Llama3
from .features.expressed import ANY, Allowed, describe, describe_all, unexpressed
from .features.position import LLAMA3_DEFAULT_FACTOR
from .formats.mcore_config import MLA_PROVIDER_EXPRESSES, PROVIDER_EXPRESSES

if TYPE_CHECKING:
    from .config import ModelConfig


def _activation(value: Any, cfg: ModelConfig) -> bool:
    """--swiglu (SiLU) or --quick-geglu gated, GELU (the default) or --squared-relu plain: nothing else."""
    return value in (("silu", "quick_gelu") if cfg.mlp.gated else ("gelu", "squared_relu"))


@dataclass(frozen=True)
class Misread:
    """A setting a reader takes from the target and builds otherwise: ``when`` the model's value is misread, what
    the reader builds, and what to use instead."""

    key: str
    when: Callable[[ModelConfig], bool]
    builds: str
    instead: str


@dataclass(frozen=True)
class Release:
    """An earlier release of a reader that builds less than the reader's ``expresses``: per setting key, the values
    that release builds as the model has them and what it builds otherwise; what to use instead."""

    name: str
    narrows: Mapping[str, tuple[Allowed, str]]
    instead: str


@dataclass(frozen=True)
class Reader:
    name: str
    formats: tuple[str, ...]  # the target formats it builds from
    expresses: Mapping[str, Allowed]  # setting key -> the values it builds as the model has them (newest release)
    instead: str  # what to use instead when a setting is outside ``expresses``
    misreads: tuple[Misread, ...] = ()  # every release
    releases: tuple[Release, ...] = ()  # earlier releases that build less


MEGATRON_LM = Reader(
    name="Megatron-LM's model builder (checkpoint args)",
    formats=("torch_dist", "megatron", "fsdp_dtensor"),
    expresses={
        **PROVIDER_EXPRESSES, **MLA_PROVIDER_EXPRESSES, "mlp.activation": _activation,
        "position.kind": {"rope", "yarn", "learned_absolute", "none"},  # YaRN also without MLA (its yarn_* args)
        "gdn": ANY, "mamba": ANY,  # the layer variants and the hybrid builder take their TransformerConfig fields
        "t5": ANY,  # pretrain_t5 builds from the same core_transformer_config_from_args (not judged here)
    },
    instead="load it with Megatron-Bridge (its provider for the family) or convert with --dst-format hf",
    misreads=(Misread("position.scaling.factor", lambda cfg: isinstance(cfg.position.scaling, Llama3) and
                      cfg.position.scaling.factor != LLAMA3_DEFAULT_FACTOR, "factor 8",
                      "pass rope_scaling_factor to GPTModel in gpt_builders.py, or load with Megatron-Bridge, "
                      "which reads it"),),
    releases=(Release("core_v0.16", {
        "position.kind": (lambda v, cfg: v != "yarn" or cfg.mla is not None,
                          "fails: no yarn_* on its GPT config, which GPTModel reads"),
        "dsa": ({False}, "builds megatron-core 0.16.1's indexer (RoPE on its last features, MLA-interleaved; the "
                         "key norm at the norm epsilon; one in every layer)"),
        "position.seq_len_interpolation": ({None}, "builds none (gpt_builder never passes it)"),
        "moe.force_biased": ({None}, "builds none (no such TransformerConfig field)"),
        "moe.rank_capacity_factor": ({None}, "builds none (no such TransformerConfig field)"),
    }, "use Megatron-LM core_v0.19, or Megatron-Bridge, on megatron-core 0.19"),),
)
READERS: tuple[Reader, ...] = (MEGATRON_LM,)


def reader_warnings(cfg: ModelConfig, fmt: str, release: str | None = None) -> list[str]:
    """One line per reader of ``fmt`` that builds another model than ``cfg`` from the target's description (and per
    misread); ``release``: only what that release of the readers builds otherwise (None: every release's)."""
    out = []
    for reader in READERS:
        if fmt not in reader.formats:
            continue
        dropped = unexpressed(cfg, reader.expresses)
        if dropped:
            out.append(f"{reader.name} does not build this model: it drops {describe_all(dropped)}; {reader.instead}")
        for r in () if dropped else reader.releases:
            if release in (None, r.name):
                narrowed = {**reader.expresses, **{k: allowed for k, (allowed, _) in r.narrows.items()}}
                if wrong := unexpressed(cfg, narrowed):
                    out.append(f"{reader.name} at {r.name} does not build this model: "
                               + "; ".join(f"for {describe(s)} it {r.narrows[s.key][1]}" for s in wrong)
                               + f"; {r.instead}")
        settings = {s.key: s for s in cfg.settings()}
        for m in reader.misreads:
            if m.key in settings and m.when(cfg):
                s = settings[m.key]
                out.append(f"{reader.name} ignores {s.arg}={s.value} (builds {m.builds}); {m.instead}")
    return out
