"""Durable writes: every file of a target is on disk (written, flushed, ``os.fsync``ed) before the
tracker and the rename make the target visible, and a directory is fsynced after an entry in it was
renamed or created, so that a crash leaves the old state or the new one, never a half of either.
The one helper every metadata file goes through (data files fsync as their writers close them)."""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch


def write_durable(path: Path, data: str | bytes) -> None:
    """Write ``data`` (text as UTF-8) to ``path``, flush and fsync it."""
    with open(path, "wb") as fh:
        fh.write(data.encode() if isinstance(data, str) else data)
        fh.flush()
        os.fsync(fh.fileno())


def save_durable(obj: Any, path: Path) -> None:
    """``torch.save`` fsynced: durable before the metadata and the rename make the target visible."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as fh:
        torch.save(obj, fh)
        fh.flush()
        os.fsync(fh.fileno())


def copy_durable(src: Path, dst: Path) -> None:
    """``shutil.copy2`` fsynced."""
    shutil.copy2(src, dst)
    fsync_file(dst)


def fsync_file(path: Path) -> None:
    """Fsync a file something else wrote (e.g. a library that does not)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Fsync a directory: its entries (files created or renamed in it) are durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """Fsync every directory under ``root`` and ``root`` itself, deepest first."""
    for sub in sorted((p for p in root.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        fsync_dir(sub)
    fsync_dir(root)
