"""The ModelOpt speculative-decoding config for a base model: EAGLE (ModelOpt's EAGLE-3 defaults, or
EAGLE-1) with draft sizes taken from the base model, or Medusa; ``--spec-config`` gives a full one."""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..config import ModelConfig
from ..errors import ConvertError
from ..features import Llama3

ALGORITHMS = ("eagle", "medusa")
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass(frozen=True, kw_only=True)
class DraftRequest:
    eagle_layers: int | None = None
    eagle_version: int = 3
    medusa_heads: int | None = None
    medusa_layers: int = 1
    spec_config: Path | None = None


def _load_spec_config(path: Path) -> tuple[str, dict[str, Any]]:
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConvertError(f"cannot read --spec-config {path} ({e})",
                           "pass a JSON file with a ModelOpt config") from None
    if not isinstance(raw, dict) or raw.get("algorithm") not in ALGORITHMS or not isinstance(raw.get("config"), dict):
        raise ConvertError(f"--spec-config {path} is not {{\"algorithm\": \"eagle\"|\"medusa\", \"config\": {{...}}}}",
                           "write the config as ModelOpt's EAGLE3_DEFAULT_CFG is written")
    return raw["algorithm"], raw["config"]


def eagle_defaults() -> dict[str, Any]:
    from modelopt.torch.speculative.config import EAGLE3_DEFAULT_CFG

    return copy.deepcopy(EAGLE3_DEFAULT_CFG["config"])


def speculative_config(req: DraftRequest, cfg: ModelConfig, dtype: torch.dtype) -> tuple[str, dict[str, Any]]:
    """(algorithm, ModelOpt config) for ``mtsp.convert``."""
    chosen = [n for n, v in (("--eagle-layers", req.eagle_layers), ("--medusa-heads", req.medusa_heads)) if v]
    if len(chosen) > 1:
        raise ConvertError("both --eagle-layers and --medusa-heads were given", "choose one algorithm")
    if not chosen and req.spec_config is None:
        raise ConvertError("no speculative algorithm was requested",
                           "pass --eagle-layers N, --medusa-heads N or --spec-config FILE.json")
    if req.spec_config is not None:
        algo, config = _load_spec_config(req.spec_config)
        if chosen and {"eagle": "--eagle-layers", "medusa": "--medusa-heads"}[algo] not in chosen:
            raise ConvertError(f"--spec-config asks for {algo} but {chosen[0]} was given", "choose one algorithm")
    else:
        algo = "eagle" if req.eagle_layers else "medusa"
        config = eagle_defaults() if algo == "eagle" else {}
    if algo == "medusa":
        if req.medusa_heads:
            config.update(medusa_num_heads=req.medusa_heads, medusa_num_layers=req.medusa_layers)
        return algo, config
    if req.eagle_version not in (1, 3):
        raise ConvertError(f"--eagle-version {req.eagle_version} is not supported", "use --eagle-version 1 or 3")
    arch = config.setdefault("eagle_architecture_config", {})
    theta = float(cfg.position.base)
    sizes = {
        "intermediate_size": cfg.ffn_hidden_size, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_query_groups, "head_dim": cfg.kv_channels,
        "rms_norm_eps": cfg.norm.eps, "rope_theta": theta,
        "rope_scaling": {"rope_type": "default", "rope_theta": theta},
        "torch_dtype": _DTYPE_NAMES.get(dtype, "bfloat16"),
    }
    if isinstance(cfg.position.scaling, Llama3):
        sizes["rope_scaling"] = {"rope_type": "llama3", "rope_theta": theta, "factor": cfg.position.scaling.factor}
    for key, value in sizes.items():
        if req.spec_config is None or key not in arch:
            arch[key] = value
    if req.eagle_layers:
        arch["num_hidden_layers"] = req.eagle_layers
    if req.eagle_version == 1:
        arch.update(use_aux_hidden_state=False, use_last_layernorm=False)
    return algo, config
