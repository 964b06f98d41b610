"""``bench --methods bridge``: Megatron-Bridge's HF -> Megatron import (``bridge_job.py``, run by the
interpreter ``--bridge-python`` names) against dist_convert's import of the same Hugging Face model.

The two outputs are compared before any ratio is reported: both are torch_dist checkpoints, so every
tensor of each is read back with ``torch.distributed.checkpoint`` (one tensor pair in memory at a time)
and compared bit for bit (names, shapes, dtypes, values). Non-tensor entries (common state, the local
spec's empty ``_extra_state``) are not compared. dist_convert is told what Bridge does for the same
model: the local layer spec (``--target-spec local``, as the job uses off Transformer Engine) and an
unpadded vocabulary (``--make-vocab-size-divisible-by 1``; Bridge's HF providers do not pad).
"""
from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

from ..errors import ConvertError
from .measure import TORCHRUN, Outcome

BRIDGE_JOB = Path(__file__).with_name("bridge_job.py")
# what the dist_convert method adds for an hf source, so that its output is Bridge's
DIST_CONVERT_HF_FLAGS = ("--dst-format", "torch_dist", "--target-spec", "local", "--make-vocab-size-divisible-by", "1")
PROBE = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('megatron.bridge') else 3)"


def bridge_python(value: Path | None) -> Path:
    """The interpreter of the Bridge job: ``--bridge-python`` (checked to exist) or this one."""
    if value is None:
        return Path(sys.executable)
    if not value.is_file():
        raise ConvertError(f"--bridge-python {value} is not a file", "pass the python of an environment with "
                           "Megatron-Bridge, e.g. --bridge-python VENV/bin/python")
    return value


def why_not(python: Path, src_format: str) -> str | None:
    """Why the bridge method cannot run here (None when it can): an hf source and Bridge in ``python``."""
    if src_format != "hf":
        return "Megatron-Bridge imports Hugging Face models: pass --format hf or --src HF_DIR"
    try:
        rc = subprocess.run([str(python), "-c", PROBE], capture_output=True, timeout=120).returncode
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{python} did not run ({e}); pass --bridge-python PATH"
    if rc == 3:
        return f"Megatron-Bridge is not installed for {python}; pass --bridge-python PATH of a python that has it"
    return None if rc == 0 else f"{python} -c 'import importlib.util' exited {rc}; pass --bridge-python PATH"


def command(python: Path, src: Path, dst: Path, tp: int, pp: int, stats: Path) -> list[str]:
    """The job by path (the other interpreter need not have dist_convert): one process, or torchrun."""
    args = [str(BRIDGE_JOB), str(src), str(dst), "--tp", str(tp), "--pp", str(pp), "--stats-json", str(stats)]
    world = tp * pp
    return [str(python), "-m", TORCHRUN, "--standalone", f"--nproc_per_node={world}", *args] if world > 1 \
        else [str(python), *args]


def iter_dir(ckpt: Path) -> Path:
    """A Megatron checkpoint root's iteration directory (Bridge writes iter_0000000, dist_convert release)."""
    tracker = ckpt / "latest_checkpointed_iteration.txt"
    if not tracker.is_file():
        return ckpt
    it = tracker.read_text().strip()
    return ckpt / ("release" if it == "release" else f"iter_{int(it):07d}")


def _tensors(path: Path) -> dict[str, Any]:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return {k: v for k, v in md.items() if isinstance(v, TensorStorageMetadata)}


def _load(path: Path, key: str, meta: Any) -> Any:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    out = {key: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)}
    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized, assuming ... a single process"
        warnings.simplefilter("ignore")
        dcp.load(out, storage_reader=FileSystemReader(str(path)), no_dist=True)
    return out[key]


def compare(a: Path, b: Path) -> dict[str, Any]:
    """Every tensor of torch_dist checkpoints ``a`` and ``b``: {"agree", "tensors", "bytes", "problems"}."""
    import torch

    da, db = iter_dir(a), iter_dir(b)
    ta, tb = _tensors(da), _tensors(db)
    problems = [f"only in {a.name}: {k}" for k in sorted(set(ta) - set(tb))]
    problems += [f"only in {b.name}: {k}" for k in sorted(set(tb) - set(ta))]
    nbytes = 0
    for k in sorted(set(ta) & set(tb)):
        ma, mb = ta[k], tb[k]
        if tuple(ma.size) != tuple(mb.size) or ma.properties.dtype != mb.properties.dtype:
            problems.append(f"{k}: {tuple(ma.size)} {ma.properties.dtype} vs {tuple(mb.size)} {mb.properties.dtype}")
            continue
        x, y = _load(da, k, ma), _load(db, k, mb)
        if not torch.equal(x, y):
            problems.append(f"{k}: values differ (max abs diff {(x.double() - y.double()).abs().max().item():.3g})")
        nbytes += x.numel() * x.element_size()
    return {"agree": not problems, "tensors": len(set(ta) & set(tb)), "bytes": nbytes, "problems": problems[:20],
            "compared": [str(a), str(b)]}


def check_agreement(outcomes: list[Outcome]) -> None:
    """Each bridge outcome's last output against a dist_convert output (same world size preferred)."""
    dcs = [o for o in outcomes if o.method == "dist_convert" and o.output]
    for o in outcomes:
        if o.method != "bridge" or not o.output:
            continue
        if not dcs:
            o.agreement = {"agree": None, "problems": ["no dist_convert output to compare with (add dist_convert "
                                                       "to --methods)"]}
            continue
        ref = next((d for d in dcs if d.world == o.world), dcs[0])
        o.agreement = {**compare(Path(o.output), Path(ref.output)), "against": ref.label}


def comparison(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Bridge / dist_convert ratios: each bridge row against each dist_convert row of the same target."""
    def ratio(x: float | None, y: float | None) -> float | None:
        return x / y if x and y else None

    out = []
    for b in (r for r in rows if r["method"] == "bridge" and r["status"] == "ok"):
        for d in (r for r in rows if r["method"] == "dist_convert" and r["status"] == "ok"):
            out.append({"bridge_world": b["world"], "dist_convert_world": d["world"], "bridge_wall_s": b["wall_s"],
                        "dist_convert_wall_s": d["wall_s"], "wall_ratio": ratio(b["wall_s"], d["wall_s"]),
                        "bridge_inproc_s": b["inproc_s"], "dist_convert_inproc_s": d["inproc_s"],
                        "inproc_ratio": ratio(b["inproc_s"], d["inproc_s"]),
                        "bridge_peak_rss": b["peak_rss_per_rank"], "dist_convert_peak_rss": d["peak_rss_per_rank"],
                        "rss_ratio": ratio(b["peak_rss_per_rank"], d["peak_rss_per_rank"]),
                        "agree": (b.get("agreement") or {}).get("agree")})
    return out
