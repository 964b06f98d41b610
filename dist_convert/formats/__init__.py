"""Checkpoint formats behind one reader/writer protocol (see base.py)."""
from __future__ import annotations

from pathlib import Path

from ..errors import ConvertError
from .base import Format, FormatOptions
from .bridge import BridgeFormat
from .fsdp_dtensor import FsdpDtensorFormat
from .hf import HFFormat
from .megatron import MegatronFormat
from .nemo import NemoFormat
from .nemo2 import Nemo2Format
from .torch_dist import TorchDistFormat

# bridge before torch_dist (a Bridge iteration is a torch_dist save plus run_config.yaml); nemo before
# megatron: an extracted .nemo at TP>1 PP=1 also has mp_rank_XX/ directories
FORMATS: dict[str, type] = {f.name: f for f in (Nemo2Format, BridgeFormat, TorchDistFormat, FsdpDtensorFormat,
                                                      NemoFormat, MegatronFormat, HFFormat)}


def get_format(name: str, options: FormatOptions | None = None) -> Format:
    if name not in FORMATS:
        raise ConvertError(f"unknown format {name!r}", f"use one of: {', '.join(FORMATS)}")
    return FORMATS[name](options)


def detect_format(path: Path, options: FormatOptions | None = None) -> Format:
    if not path.exists():
        raise ConvertError(f"checkpoint {path} does not exist", "check the SRC path")
    for cls in FORMATS.values():
        fmt = cls(options)
        if fmt.detect(path):
            return fmt
    raise ConvertError(f"{path} is not a checkpoint in a known format ({', '.join(FORMATS)})",
                       "point at the checkpoint root (with latest_checkpointed_iteration.txt), an iter_* "
                       "directory or a Hugging Face model directory, or pass --src-format")
