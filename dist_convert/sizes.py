"""Byte sizes as the command line spells them (``512M``, ``2GB``); imports only argparse, so that the CLI
and ``bench`` parse with it before torch is imported."""
from __future__ import annotations

import argparse


def parse_size(text: str) -> int:
    units = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "M": 1 << 20, "MB": 1 << 20, "G": 1 << 30, "GB": 1 << 30,
             "T": 1 << 40, "TB": 1 << 40}
    t = text.strip().upper().replace("IB", "B")
    num = t.rstrip("KMGTB")
    try:
        return int(float(num) * units[t[len(num):]])
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 512M or 2GB") from None
