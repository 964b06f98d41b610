"""Checkpoint formats behind one reader/writer protocol (see base.py). Each format's module is imported
when it is first needed (a conversion between formats that do not use torch.distributed.checkpoint never
imports it)."""
from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ConvertError

if TYPE_CHECKING:
    from ..config import ModelConfig
    from .base import Format, FormatOptions

# name -> (module, class), in detection order: hf first (config.json + safetensors: nothing else has them);
# peft (adapter_config.json) and bridge_lora (run_config.yaml with a peft: section) before what they extend;
# bridge before torch_dist (a Bridge iteration is a torch_dist save plus run_config.yaml); nemo before
# megatron (an extracted .nemo at TP>1 PP=1 also has mp_rank_XX/ directories)
FORMATS: dict[str, tuple[str, str]] = {
    "hf": ("hf", "HFFormat"), "peft": ("peft", "PeftFormat"), "nemo2": ("nemo2", "Nemo2Format"),
    "bridge_lora": ("bridge_lora", "BridgeLoraFormat"), "bridge": ("bridge", "BridgeFormat"),
    "torch_dist": ("torch_dist", "TorchDistFormat"), "fsdp_dtensor": ("fsdp_dtensor", "FsdpDtensorFormat"),
    "nemo": ("nemo", "NemoFormat"), "megatron": ("megatron", "MegatronFormat"),
}


def format_class(name: str) -> type:
    module, cls = FORMATS[name]
    return getattr(importlib.import_module(f".{module}", __name__), cls)


def get_format(name: str, options: FormatOptions | None = None) -> Format:
    if name not in FORMATS:
        raise ConvertError(f"unknown format {name!r}", f"use one of: {', '.join(FORMATS)}")
    return format_class(name)(options)


ADAPTER_FORMATS = ("peft", "bridge_lora")  # a LoRA adapter alone, not a model


def formats_holding(cfg: ModelConfig) -> list[str]:
    """The model formats whose targets hold every structural feature of ``cfg`` (their ``holds``)."""
    from ..features.expressed import unheld

    return [name for name in FORMATS if name not in ADAPTER_FORMATS and not unheld(cfg, format_class(name).holds)]


def detect_format(path: Path, options: FormatOptions | None = None) -> Format:
    if not path.exists():
        raise ConvertError(f"checkpoint {path} does not exist", "check the SRC path")
    for name in FORMATS:
        fmt = format_class(name)(options)
        if fmt.detect(path):
            return fmt
    raise ConvertError(f"{path} is not a checkpoint in a known format ({', '.join(FORMATS)})",
                       "point at the checkpoint root (with latest_checkpointed_iteration.txt), an iter_* "
                       "directory or a Hugging Face model directory, or pass --src-format")
