"""Checkpoint formats behind one reader/writer protocol (see base.py)."""
from __future__ import annotations

from pathlib import Path

from ..errors import ConvertError
from .base import Format
from .megatron import MegatronFormat
from .torch_dist import TorchDistFormat

FORMATS: dict[str, type] = {f.name: f for f in (TorchDistFormat, MegatronFormat)}


def get_format(name: str, trust_pickle: bool = False) -> Format:
    if name not in FORMATS:
        raise ConvertError(f"unknown format {name!r}", f"use one of: {', '.join(FORMATS)}")
    return FORMATS[name](trust_pickle)


def detect_format(path: Path, trust_pickle: bool = False) -> Format:
    if not path.exists():
        raise ConvertError(f"checkpoint {path} does not exist", "check the SRC path")
    for cls in FORMATS.values():
        fmt = cls(trust_pickle)
        if fmt.detect(path):
            return fmt
    raise ConvertError(f"{path} is not a checkpoint in a known format ({', '.join(FORMATS)})",
                       "point at the checkpoint root (with latest_checkpointed_iteration.txt) or an iter_* "
                       "directory, or pass --src-format")
