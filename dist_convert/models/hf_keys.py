"""The config.json keys that change what a Hugging Face model computes, across the families transformers has for
the models converted here (read in transformers 5.14's configuration and modeling code), each with the test of a
value that changes nothing. A family maps the keys it names in ``Family.hf_keys`` (or refuses them itself); any
other of these keys with a value that changes the math is refused on import, never ignored (``unmapped``).

Keys not listed here are sizes every family reads (hidden_size, ...), token ids, or training-only settings
(dropout, router aux-loss coefficients, router jitter, initialisation)."""
from __future__ import annotations

import copy
from collections.abc import Callable, Collection
from typing import Any

from ..errors import ConvertError
from .hf_defaults import ALIASES, DEFAULTS, DISAGREE
from .rope import rope_params

Plain = Callable[[Any, dict[str, Any]], bool]


def _is(*plain: Any) -> Plain:
    return lambda v, hf: v in plain


def _never(v: Any, hf: dict[str, Any]) -> bool:  # a key every family must map (the norm epsilon, the RoPE base)
    return v is None


def _full_layers(v: Any, hf: dict[str, Any]) -> bool:
    return not v or all(t == "full_attention" for t in v)


def _no_window(v: Any, hf: dict[str, Any]) -> bool:
    """A sliding_window that applies to no layer: none, switched off (Qwen's use_sliding_window), or every layer
    full attention by layer_types."""
    if v is None or hf.get("use_sliding_window") is False:
        return True
    return "layer_types" in hf and _full_layers(hf["layer_types"], hf)


def _head_dim_scalar(v: Any, hf: dict[str, Any]) -> bool:
    heads = hf.get("num_attention_heads") or 1
    return v is None or float(v) == float(hf.get("head_dim") or (hf.get("hidden_size") or 0) // heads)


HF_MATH_KEYS: dict[str, Plain] = {
    # attention
    "attention_bias": _is(None, False), "qkv_bias": _is(None, False), "use_qk_norm": _is(None, False),
    "sliding_window": _no_window, "use_sliding_window": _is(None, False), "layer_types": _full_layers,
    "attn_logit_softcapping": _is(None), "final_logit_softcapping": _is(None),
    "query_pre_attn_scalar": _head_dim_scalar, "use_bidirectional_attention": _is(None, False),
    "attention_chunk_size": _is(None), "no_rope_layers": _is(None), "attention_multiplier": _is(None, 1.0),
    "clip_qkv": _is(None),
    # RoPE (rope_parameters / rope_scaling / top-level keys, flattened as rope.*)
    "rope.rope_theta": _never, "rope.rope_type": _is("default"), "rope.partial_rotary_factor": _is(None, 1.0),
    "rope.mrope_section": _is(None), "rope.mrope_interleaved": _is(None, False), "rope_interleave": _is(None, True),
    "rope.llama_4_scaling_beta": _is(None, 0, 0.0),
    # norms, MLP, embeddings
    "rms_norm_eps": _never, "layer_norm_epsilon": _never, "tie_word_embeddings": _never,
    "hidden_act": _is(None, "silu"), "hidden_activation": _is(None, "silu"), "mlp_bias": _is(None, False),
    "swiglu_limit": _is(None), "embedding_multiplier": _is(None, 1.0), "logits_scaling": _is(None, 1.0),
    "residual_multiplier": _is(None, 1.0),
    # Mixture of Experts and multi-token prediction
    "norm_topk_prob": _is(None), "scoring_func": _is(None, "softmax"), "topk_method": _is(None, "greedy"),
    "n_group": _is(None, 1), "topk_group": _is(None, 1), "routed_scaling_factor": _is(None, 1.0),
    "first_k_dense_replace": _is(None, 0), "moe_layer_freq": _is(None, 1), "decoder_sparse_step": _is(None, 1),
    "mlp_only_layers": lambda v, hf: not v, "moe_latent_size": _is(None), "num_nextn_predict_layers": _is(None, 0),
    "n_shared_experts": _is(None, 0), "shared_expert_intermediate_size": _is(None, 0),
    # DeepSeek sparse attention (an indexer choosing each query's top-k keys)
    **dict.fromkeys(("index_topk", "index_n_heads", "index_head_dim", "index_topk_pattern", "indexer_types",
                     "indexer_rope_interleave"), _is(None)), "index_topk_freq": _is(None, 1),
}


def flat_keys(hf: dict[str, Any]) -> dict[str, Any]:
    """config.json's keys with its RoPE parameters as ``rope.<key>`` (``rope_params``; per-layer-type dicts of
    ``rope_parameters`` each add theirs, a value that changes the math winning)."""
    out = {k: v for k, v in hf.items() if k not in ("rope_parameters", "rope_scaling", "rope_theta")}
    params = hf.get("rope_parameters") or {}
    nested = [d for d in params.values() if isinstance(d, dict)]
    for d in [*nested, rope_params(hf)]:
        for k, v in ({**d, "rope_type": d.get("rope_type", d.get("type", "default"))}).items():
            key = f"rope.{k}"
            test = HF_MATH_KEYS.get(key)
            if key not in out or (test is not None and not test(v, hf)):
                out[key] = v
    if nested and hf.get("rope_theta") is not None:
        out.setdefault("rope.rope_theta", hf["rope_theta"])
    return out


def unmapped(hf: dict[str, Any], mapped: Collection[str]) -> list[tuple[str, Any]]:
    """(key, value) of every key of ``HF_MATH_KEYS`` config.json sets to a value that changes the math and that
    ``mapped`` (the family's ``hf_keys``) does not take."""
    flat = flat_keys(hf)
    return [(k, flat[k]) for k, plain in HF_MATH_KEYS.items() if k in flat and k not in mapped
            and not plain(flat[k], hf)]


# keys a family also reads under an older name (beside the config classes' own, hf_defaults.ALIASES): present, they
# give the key's value, so its default does not apply
OLDER_NAMES: dict[str, tuple[str, ...]] = {"layers_block_type": ("hybrid_override_pattern",)}


def as_transformers_reads(hf: dict[str, Any], model_type: str) -> dict[str, Any]:
    """config.json with each absent key that matters at the default transformers' config class for ``model_type``
    gives it (``hf_defaults.DEFAULTS``, generated from the classes themselves), so that a config without a key is
    the model transformers builds from it; refused in one line where transformers releases disagree."""
    out = dict(hf)
    rope_given = any(k in hf for k in ("rope_parameters", "rope_theta", "rope_scaling"))
    for key, default in DEFAULTS.get(model_type, {}).items():
        if key == "rope.rope_theta":  # inside a flat rope_parameters that lacks it (no top-level rope_theta either)
            params = hf.get("rope_parameters")
            absent = isinstance(params, dict) and "rope_theta" not in params and "rope_theta" not in hf and \
                not any(isinstance(v, dict) for v in params.values())
            if absent:
                out["rope_parameters"] = {**params, "rope_theta": _known(default, "rope_parameters.rope_theta")}
        elif key not in hf and not (key == "rope_parameters" and rope_given) and \
                not any(a in hf for a in ALIASES.get(model_type, {}).get(key, ()) + OLDER_NAMES.get(key, ())):
            out[key] = copy.deepcopy(_known(default, key))
    return out


def _known(default: Any, key: str) -> Any:
    if default == DISAGREE:
        raise ConvertError(f"config.json has no {key}, and the transformers releases give an absent {key} different "
                           "defaults", f"add {key} to config.json with the value the model was made with")
    return default
