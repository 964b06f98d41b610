"""What a target can write, positively, and the one comparison that refuses the rest.

A target (a Hugging Face family, a NeMo or Megatron-Bridge config writer) declares, for each setting it writes
(``ModelConfig.settings`` keys), the values it can write: a collection, ``ANY``, or a test of the value in the whole
model. A setting it does not name must hold its plain value (the field's default). ``unexpressed`` is the whole
comparison: a setting nobody thought of is refused by construction, never dropped.

A format or a converter that holds only some structural features (``config.OPTIONAL``: MoE, MLA, Mamba, ...)
declares those it holds (``refuse_features``): a feature added later is refused there until it is declared."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING, Any

from ..errors import ConvertError
from .base import Setting
from .position import Scaling

if TYPE_CHECKING:
    from ..config import ModelConfig


class _Any:
    """Every value (a target writes whatever the model holds)."""

    def __contains__(self, value: Any) -> bool:
        return True

    def __repr__(self) -> str:
        return "ANY"


ANY: Any = _Any()
Allowed = Collection[Any] | Callable[[Any, "ModelConfig"], bool]
CORE_FLAGS = ("add_bias_linear", "add_qkv_bias", "family")  # core settings named by their Megatron-LM arg


def allows(allowed: Allowed, value: Any, cfg: ModelConfig) -> bool:
    return bool(allowed(value, cfg)) if callable(allowed) else value in allowed


def unexpressed(cfg: ModelConfig, declared: Mapping[str, Allowed]) -> list[Setting]:
    """The model's settings a target declaring ``declared`` cannot write (empty: it writes the whole model)."""
    return [s for s in cfg.settings()
            if not (allows(declared[s.key], s.value, cfg) if s.key in declared else s.value == s.plain)]


def describe(s: Setting) -> str:
    """A setting as a refusal names it: an optional feature by what it is (or its absence), a flag with what it
    is, else ``arg=value (what)``."""
    if "." not in s.key and s.key not in CORE_FLAGS:
        return s.what if s.value else f"no {s.what}"
    if isinstance(s.value, bool):
        return f"{s.arg}={s.value} ({s.what if s.value else 'no ' + s.what})"
    return f"{s.arg}={s.value} ({s.what})"


def describe_all(problems: list[Setting], limit: int = 4) -> str:
    return ", ".join(describe(s) for s in problems[:limit]) + (" ..." if len(problems) > limit else "")


def refuse_unexpressed(cfg: ModelConfig, declared: Mapping[str, Allowed], target: str, fix: str) -> None:
    """Refuse, in one line naming each setting and its value, a model ``target`` cannot write."""
    problems = unexpressed(cfg, declared)
    if problems:
        raise ConvertError(f"the model has {describe_all(problems)}, which {target} does not express", fix)


def unheld(cfg: ModelConfig, holds: Collection[str]) -> list[Setting]:
    """The structural features (``config.OPTIONAL`` records) the model has and ``holds`` does not name."""
    from ..config import OPTIONAL

    return [s for s in cfg.settings() if s.key in OPTIONAL and s.value and s.key not in holds]


def refuse_features(cfg: ModelConfig, holds: Collection[str], what: str, fix: str) -> None:
    """Refuse, in one line, a model with a structural feature that ``what`` (e.g. "an fsdp_dtensor target") does not
    hold: ``holds`` names, positively, the ``config.OPTIONAL`` features it does."""
    lacking = unheld(cfg, holds)
    if lacking:
        raise ConvertError(f"{what} cannot hold the model's {features_named(lacking)}", fix)


def features_named(features: list[Setting]) -> str:
    """Structural features in a refusal's words ("Mixture-of-Experts layers and multi-latent attention")."""
    return " and ".join(s.what.removeprefix("a ").removeprefix("an ") for s in features)


def scaling_settings(*kinds: str) -> dict[str, Any]:
    """What a target that writes RoPE unscaled or scaled as ``kinds`` (``Scaling`` names) declares: the kind, and
    every field of those kinds at any value."""
    chosen = [k for k in Scaling.variants() if k.name in kinds]
    assert len(chosen) == len(kinds), f"no RoPE scaling named {set(kinds) - {k.name for k in chosen}}"
    return {"position.scaling": {None, *kinds},
            **{f"position.scaling.{f.name}": ANY for k in chosen for f in dataclasses.fields(k)}}
