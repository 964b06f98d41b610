"""Loading Megatron ``.pt`` pickles without executing code from the input."""
from __future__ import annotations

import pickle
import re
import warnings
from pathlib import Path
from typing import IO, Any

import torch

from .errors import ConvertError

_level = 0  # 0: nothing registered, 1: basic types, 2: megatron-core's own safe list too


def _register_allowlist(level: int) -> None:
    global _level
    if _level >= level:
        return
    import argparse
    import io
    import pathlib
    import types

    torch.serialization.add_safe_globals([argparse.Namespace, types.SimpleNamespace, pathlib.PosixPath, io.BytesIO])
    if level >= 2:  # the enums and classes megatron-core itself declares safe for its checkpoints
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                from megatron.core.safe_globals import register_safe_globals
                register_safe_globals()
            except ImportError:  # pragma: no cover - megatron-core missing
                pass
    _level = level


def load_pt(path: Path, trust_pickle: bool, mmap: bool = True, stream: IO[bytes] | None = None) -> Any:
    """``torch.load`` with ``weights_only=True`` and an allow-list; ``trust_pickle`` lifts it.
    ``stream`` (e.g. a member of a tar archive) is read instead of ``path``, without mmap."""
    _register_allowlist(1)

    def load() -> Any:
        if stream is not None:
            stream.seek(0)
            return torch.load(stream, map_location="cpu", weights_only=not trust_pickle)
        return torch.load(path, map_location="cpu", mmap=mmap, weights_only=not trust_pickle)

    try:
        try:
            return load()
        except pickle.UnpicklingError as e:
            if _level >= 2 or "Unsupported global" not in str(e):
                raise
            _register_allowlist(2)  # megatron args may hold megatron-core enums: allow those, retry
            return load()
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "weights_only" in str(e) or "Unsupported global" in str(e):
            named = re.search(r"(?:GLOBAL|global) ([\w.]+)", str(e))  # torch names the refused object this way
            what = f"references {named.group(1)}, outside the safe allow-list" if named else \
                f"holds objects outside the safe allow-list ({first[:160]})"
            raise ConvertError(f"{path} {what} (not executed)",
                               "pass --trust-pickle only if you trust this file") from None
        raise ConvertError(f"{path} is not a readable torch file ({first[:160]})",
                           "the file is corrupt or truncated; re-copy it from the original checkpoint") from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConvertError(f"{path} is not a readable torch file ({msg[:160]})",
                           "the file is corrupt or truncated; re-copy it from the original checkpoint") from None
