"""What compressed-tensors releases share, whatever their scheme (``int4.py``'s pack-quantized INT4, ``fp8.py``'s
float-quantized FP8): how config.json says so, and the ``quantization_config`` compressed-tensors 0.20's
``ModelCompressor`` writes (its version, method, empty sparsity and transform sections, then its
``QuantizationConfig``), with ``ignore`` listing every unquantized linear module by name."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

VERSION = "0.20.0"  # the compressed-tensors release whose config and rounding the writers follow
METHOD = "compressed-tensors"
NOT_LINEAR = ("embed_tokens.", "norm.", "lm_head.", "shared_head.")  # 2-D weights of no linear module (or lm_head)


def declares(hf: Mapping[str, Any], fmt: str | None = None) -> bool:
    """Whether config.json's weights are compressed-tensors' (in format ``fmt``, when given)."""
    q = hf.get("quantization_config") or {}
    if str(q.get("quant_method", "")).lower() != METHOD:
        return False
    groups = [g for g in (q.get("config_groups") or {}).values() if isinstance(g, dict)]
    return fmt is None or fmt in {g.get("format") or q.get("format") for g in groups}


def quantization_config(weights: dict[str, Any], fmt: str, shapes: Mapping[str, tuple[int, ...]],
                        quantized: Callable[[str, tuple[int, ...]], bool]) -> dict[str, Any]:
    """The ``quantization_config`` of a checkpoint whose tensors ``shapes`` are quantized where ``quantized`` says,
    weight-only with ``weights`` (QuantizationArgs' fields) in format ``fmt``; ``ignore``: every other linear
    module (routers count as linears) and ``lm_head``."""
    kept = [n.removesuffix(".weight") for n, s in shapes.items() if len(s) == 2 and n.endswith(".weight")
            and not quantized(n, s) and not any(k in n for k in NOT_LINEAR)]
    return {"version": VERSION, "quant_method": METHOD, "sparsity_config": {}, "transform_config": {},
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": dict(weights), "input_activations": None,
                                          "output_activations": None, "format": None}},
            "kv_cache_scheme": None, "format": fmt, "quantization_status": "compressed",
            "global_compression_ratio": None, "ignore": [*kept, "lm_head"], "moe_sparsity_config": None}
