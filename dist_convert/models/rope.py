"""RoPE in ``config.json`` <-> the ``Position`` record, for every family: transformers 4 style (``rope_theta``,
``rope_scaling``, a top-level ``partial_rotary_factor``) and 5 style (``rope_parameters``), default RoPE, Llama-3
frequency scaling, YaRN and linear scaling, partial RoPE."""
from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import replace
from typing import Any

from ..errors import ConvertError
from ..features import Llama3, Position, Yarn

# Megatron-core's Llama-3 RoPE scaling implements only these frequency parameters.
LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def rope_params(hf: dict[str, Any]) -> dict[str, Any]:
    """The RoPE parameters of a config.json as one flat dict: ``rope_parameters`` (transformers 5; one of its
    per-layer-type dicts is not flat and is left to the family), else ``rope_scaling`` with the top-level
    ``rope_theta`` and ``partial_rotary_factor`` (transformers 4); ``rope_type`` "default" when unscaled."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    out = {**scaling, **params}
    if "type" in out and "rope_type" not in out:
        out["rope_type"] = out.pop("type")
    out.setdefault("rope_type", "default")
    for key in ("rope_theta", "partial_rotary_factor"):
        if key not in out and hf.get(key) is not None:
            out[key] = hf[key]
    return out


def position_from_hf(hf: dict[str, Any], name: str, *, kinds: Collection[str] = ("default",),
                     partial_default: float = 1.0, theta_default: float = 10000.0, mla: bool = False) -> Position:
    """The ``Position`` of a config.json whose RoPE the family ``name`` takes in ``kinds`` (default, llama3, yarn);
    refused in one line otherwise. ``partial_default``: the rotated share when config.json states none."""
    p = rope_params(hf)
    kind = p["rope_type"]
    if kind not in kinds:
        named = " or ".join(sorted(kinds, reverse=True))
        raise ConvertError(f"{name} RoPE type {kind!r}: megatron-core expresses {named} for it",
                           f"convert a config whose rope_type is {named}")
    share = p.get("partial_rotary_factor")
    percent = float(partial_default if share is None else share)
    if not 0.0 < percent <= 1.0:
        raise ConvertError(f"partial_rotary_factor={percent} is not a share of the head",
                           "fix partial_rotary_factor in config.json (0 < factor <= 1)")
    pos = Position(kind="rope", base=float(p.get("rope_theta", theta_default)), percent=percent, mla_names=mla)
    if kind == "llama3":
        if not all(float(p.get(k, v)) == v for k, v in LLAMA3_FIXED.items()):
            raise ConvertError(f"Llama-3 RoPE scaling {p}: megatron-core's implements low_freq_factor 1, "
                               "high_freq_factor 4 and original_max_position_embeddings 8192 only",
                               "convert a config with those Llama-3 scaling parameters (as the releases have)")
        return replace(pos, scaling=Llama3(factor=float(p.get("factor", 8.0))))
    if kind == "yarn":
        pos = replace(pos, kind="yarn", scaling=yarn_from_hf(p, hf))
    return replace(pos, query_scale_beta=float(p.get("llama_4_scaling_beta") or 0.0))


def yarn_from_hf(p: dict[str, Any], hf: dict[str, Any]) -> Yarn:
    """The ``Yarn`` scaling of transformers' YaRN parameters: megatron-core computes the attention factor as
    mscale(factor, mscale) / mscale(factor, mscale_all_dim), transformers the same ratio when both are given, else
    mscale(factor): (1, 0) then, which megatron-core turns into the same."""
    original = p.get("original_max_position_embeddings") or hf.get("max_position_embeddings")
    if original is None:  # transformers' standardize_rope_params takes max_position_embeddings then
        raise ConvertError("YaRN rope parameters lack original_max_position_embeddings",
                           "use the config.json saved with the model")
    factor = float(p.get("factor") or int(hf.get("max_position_embeddings") or original) / int(original))
    mscale, mscale_all = p.get("mscale"), p.get("mscale_all_dim")
    if not (mscale and mscale_all):
        mscale, mscale_all = 1.0, 0.0
    attention = p.get("attention_factor")
    implied = yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(mscale_all))
    if attention is not None and not math.isclose(float(attention), implied, rel_tol=1e-9):
        raise ConvertError(f"rope_parameters.attention_factor={attention} differs from YaRN's {implied:.6g}: "
                           "megatron-core computes it from factor, mscale and mscale_all_dim",
                           "convert a config without attention_factor (or with the value YaRN implies)")
    return Yarn(factor=factor, original_max=int(original), beta_fast=float(p.get("beta_fast") or 32.0),
                beta_slow=float(p.get("beta_slow") or 1.0), mscale=float(mscale), mscale_all_dim=float(mscale_all),
                round_to_int=bool(p.get("truncate", True)))


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention temperature (megatron-core's _yarn_get_mscale, transformers' get_mscale)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_to_hf(pos: Position) -> dict[str, Any]:
    """transformers 5's ``rope_parameters`` for a ``Position`` (the inverse of ``position_from_hf``)."""
    out: dict[str, Any] = {"rope_type": "default", "rope_theta": float(pos.base)}
    s = pos.scaling
    if isinstance(s, Llama3):
        out.update(rope_type="llama3", factor=s.factor, **LLAMA3_FIXED)
    elif isinstance(s, Yarn):
        out.update(rope_type="yarn", factor=s.factor, original_max_position_embeddings=s.original_max,
                   beta_fast=s.beta_fast, beta_slow=s.beta_slow, truncate=s.round_to_int)
        if s.mscale_all_dim:
            out.update(mscale=s.mscale, mscale_all_dim=s.mscale_all_dim)
    if pos.percent != 1.0:
        out["partial_rotary_factor"] = float(pos.percent)
    if pos.query_scale_beta:
        out["llama_4_scaling_beta"] = float(pos.query_scale_beta)
    return out
