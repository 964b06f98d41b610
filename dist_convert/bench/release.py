"""``bench --release llama3-8b``: a release-sized case, import and export, each against the I/O floor of its own
bytes, with peak RSS per rank.

The release (a Hugging Face directory of the named shape, bf16, written by dist_convert's own hf writer in
``--max-shard-size`` shards, with a word-level tokenizer) is made once under ``--workdir`` and reused by later runs
(``bench_release.json``, written last, holds its shape and every shard's SHA-256; delete the directory to remake
it). Each rep, interleaved: the floor of the release's bytes (a plain copy, fsynced), the import (``reshard`` to
torch_dist at ``--target-tp``/``--target-pp``, default TP=2 PP=2), the floor of that checkpoint's bytes, and the
export back to hf (``--dst-format hf`` in the release's shard size), every step after ``sync`` and, with
``--drop-caches``, with the page cache emptied, so each reads its source from disk. The export must give the
release back byte for byte: its manifest's SHA-256 of every shard equals the release's. ``--export-format megatron``
exports to legacy Megatron rank files at TP=1 PP=1 instead (the whole model in one ``torch.save`` file, the largest
file any writer makes), judged by time and memory alone.

Targets (issue 60), at 2 ranks, ratios of one run: import <= 1.1x its floor, export <= 1.2x its floor, and every
rank's peak RSS <= 1 GB in both directions."""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
from pathlib import Path
from typing import Any

from rich.table import Table

from ..errors import ConvertError
from ..integrity import MANIFEST
from ..runtime import _console, human_bytes
from . import measure
from .measure import MethodFailed, Run
from .shape import LlamaShape
from .synth import shape_json

RELEASES = {  # Llama-3-8B's shape (8.03B parameters, 16.1 GB in bf16)
    "llama3-8b": LlamaShape(num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
                            num_query_groups=8, vocab_size=128256),
}
MARKER = "bench_release.json"
IMPORT_FACTOR = 1.1  # import wall <= 1.1x the floor of the release's bytes
EXPORT_FACTOR = 1.2  # export wall <= 1.2x the floor of the imported checkpoint's bytes
RSS_MAX = 1 << 30  # every rank's peak RSS, both directions
HASH_BLOCK = 16 << 20


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as fh:
        while block := fh.read(HASH_BLOCK):
            h.update(block)
    return h.hexdigest()


def release_dir(ns: argparse.Namespace) -> Path:
    """Where the release lives: under --workdir (kept across runs), else under the system's temp directory."""
    base = ns.workdir.resolve() if ns.workdir else Path(os.environ.get("TMPDIR", "/tmp"))
    return base / f"release_{ns.release}_{ns.dtype}_{ns.max_shard_size}"


def make_release(ns: argparse.Namespace) -> tuple[Path, dict[str, Any]]:
    """The release, made unless a complete one is there (its marker); its marker's record."""
    out = release_dir(ns)
    shape = RELEASES[ns.release]
    if (out / MARKER).is_file():
        record = json.loads((out / MARKER).read_text())
        if record.get("shape") == json.loads(shape_json(shape)):
            _console.print(f"[bold]bench[/] reusing the {ns.release} release in {out}")
            return out, record
    measure.remove(out)
    _console.print(f"[bold]bench[/] writing a {ns.release}-shaped hf release to {out}: {shape}")
    args = ("dist_convert.bench.synth", "--out", str(out), "--shape", shape_json(shape), "--format", "hf",
            "--tp", "1", "--pp", "1", "--dtype", ns.dtype, "--seed", str(ns.seed),
            "--max-shard-size", str(ns.max_shard_size))
    try:
        make_s = measure.run_command(measure.python_module(*args), ns.timeout)
    except MethodFailed as e:
        raise ConvertError(f"writing the {ns.release} release failed ({e})",
                           f"check the free space under {out.parent} (--workdir)") from None
    shards = {p.name: sha256_file(p) for p in sorted(out.glob("*.safetensors"))}
    record = {"shape": json.loads(shape_json(shape)), "dtype": ns.dtype, "make_s": make_s, "shards": shards,
              "bytes": measure.total_bytes(measure.source_files(out))}
    (out / MARKER).write_text(json.dumps(record, indent=1))  # last: the release is complete
    return out, record


def ranks(ns: argparse.Namespace) -> int:
    return (ns.ranks or [2])[0]


def _reshard(src: Path, dst: Path, stats: Path, ns: argparse.Namespace, *flags: str) -> Run:
    world = ranks(ns)
    cmd = measure.python_module("dist_convert", "reshard", str(src), str(dst), "--memory-budget",
                                str(ns.memory_budget), "--stats-json", str(stats),
                                *(("--nproc", str(world)) if world > 1 else ()), *flags)
    return measure.time_job(cmd, stats, measure.parse_dist_convert, ns.timeout)


def _step(name: str, runs: dict[str, list[Run]], ns: argparse.Namespace, fn: Any) -> Run:
    if ns.drop_caches:
        measure.drop_caches()
    try:
        run = fn()
    except MethodFailed as e:
        raise ConvertError(f"bench --release: the {name} failed ({e})", "fix what it names and run again") from None
    runs.setdefault(name, []).append(run)
    _console.print(f"  {name}: {run.wall_s:.2f} s" + (f" (in-process {run.inproc_s:.2f} s, peak RSS per rank "
                                                       f"{', '.join(human_bytes(r) for r in run.peak_rss_per_rank)})"
                                                       if run.inproc_s is not None else ""))
    return run


def check_round_trip(exported: Path, record: dict[str, Any]) -> bool:
    """Whether the export's manifest records every shard of the release with the release's SHA-256."""
    files = json.loads((exported / MANIFEST).read_text())["files"]
    got = {name: files[name]["sha256"] for name in files if name.endswith(".safetensors")}
    return got == record["shards"]


def run_release(ns: argparse.Namespace, work: Path) -> dict[str, Any]:
    src, record = make_release(ns)
    files = [p for p in measure.source_files(src) if p.name != MARKER]
    mid, back = work / "torch_dist", work / "hf"
    flags = ("--dst-format", "torch_dist", "--target-tp", str(ns.target_tp or 2), "--target-pp", str(ns.target_pp or 2))
    runs: dict[str, list[Run]] = {}
    agree = []
    for rep in range(ns.reps):
        _console.print(f"[bold]bench[/] {ns.release} rep {rep + 1}/{ns.reps}"
                       f"{' (page cache dropped before each step)' if ns.drop_caches else ' (warm page cache)'}")
        measure.remove(mid)
        _step("import floor", runs, ns, lambda: measure.time_floor(files, work / "floor"))
        measure.remove(work / "floor")
        _step("import", runs, ns, lambda: _reshard(src, mid, work / "import.json", ns, *flags))
        _step("export floor", runs, ns, lambda: measure.time_floor(measure.source_files(mid), work / "floor"))
        measure.remove(work / "floor")
        measure.remove(back)
        _step("export", runs, ns, lambda: _reshard(mid, back, work / "export.json", ns, *export_flags(ns)))
        if ns.export_format == "hf":
            agree.append(check_round_trip(back, record))
        measure.remove(back)
    measure.remove(mid)
    return release_rows(runs, record, ns, all(agree) if ns.export_format == "hf" else None)


def export_flags(ns: argparse.Namespace) -> tuple[str, ...]:
    """The export's: back to hf in the release's shard size, or legacy Megatron rank files at TP=1 PP=1 (one file
    of the whole model, written as its tensors arrive: formats/torch_zip.py)."""
    if ns.export_format == "megatron":
        return "--dst-format", "megatron", "--target-tp", "1", "--target-pp", "1"
    return "--dst-format", "hf", "--max-shard-size", str(ns.max_shard_size)


def _median(runs: list[Run], key: str) -> float | None:
    vals = [getattr(r, key) for r in runs if getattr(r, key) is not None]
    return statistics.median(vals) if vals else None


def release_rows(runs: dict[str, list[Run]], record: dict[str, Any], ns: argparse.Namespace,
                 agree: bool | None) -> dict[str, Any]:
    """Pure: per direction, the median wall, its floor's, the ratio, in-process time and every rank's peak RSS (the
    largest over reps), with the targets' verdicts (``agree``: whether an hf export gave the release back; None for
    a megatron export)."""
    rows = []
    for step, factor in (("import", IMPORT_FACTOR), ("export", EXPORT_FACTOR)):
        wall, floor = _median(runs[step], "wall_s"), _median(runs[f"{step} floor"], "wall_s")
        rss = [max(r.peak_rss_per_rank[i] for r in runs[step]) for i in range(len(runs[step][0].peak_rss_per_rank))]
        ratio = wall / floor if wall and floor else None
        rows.append({"step": step, "wall_s": wall, "floor_s": floor, "x_floor": ratio,
                     "inproc_s": _median(runs[step], "inproc_s"), "peak_rss_per_rank": rss,
                     "floor_walls": [r.wall_s for r in runs[f"{step} floor"]],
                     "walls": [r.wall_s for r in runs[step]],
                     "checks": {f"≤{factor}x floor": ratio is not None and ratio <= factor,
                                "RSS≤1 GB": max(rss) <= RSS_MAX}})
    if agree is not None:
        rows[1]["checks"]["release back byte for byte"] = agree
    return {"release": ns.release, "export_format": ns.export_format, "bytes": record["bytes"],
            "shape": record["shape"], "reps": ns.reps,
            "ranks": ranks(ns), "cold": bool(ns.drop_caches), "memory_budget": ns.memory_budget,
            "max_shard_size": ns.max_shard_size, "rows": rows}


def markdown(result: dict[str, Any]) -> str:
    lines = ["| step | floor s | wall s | wall/floor | in-proc s | peak RSS per rank | checks |",
             "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        checks = ", ".join(f"{k} {'PASS' if v else 'FAIL'}" for k, v in r["checks"].items())
        lines.append(f"| {r['step']} | {r['floor_s']:.2f} | {r['wall_s']:.2f} | {r['x_floor']:.2f} | "
                     f"{r['inproc_s']:.2f} | {', '.join(human_bytes(x) for x in r['peak_rss_per_rank'])} | {checks} |")
    return "\n".join(lines) + "\n"


def print_release(result: dict[str, Any]) -> None:
    table = Table(title=f"{result['release']} ({human_bytes(result['bytes'])}), export to {result['export_format']}, "
                        f"{result['ranks']} ranks, median of {result['reps']}, "
                        f"{'cold' if result['cold'] else 'warm'} page cache")
    for col in ("step", "floor s", "wall s", "wall/floor", "in-proc s", "peak RSS per rank", "checks"):
        table.add_column(col, justify="left" if col in ("step", "checks") else "right")
    for r in result["rows"]:
        table.add_row(r["step"], f"{r['floor_s']:.2f}", f"{r['wall_s']:.2f}", f"{r['x_floor']:.2f}",
                      f"{r['inproc_s']:.2f}", ", ".join(human_bytes(x) for x in r["peak_rss_per_rank"]),
                      ", ".join(f"{k} {'[green]PASS[/]' if v else '[red]FAIL[/]'}" for k, v in r["checks"].items()))
    _console.print(table)


def failed(result: dict[str, Any]) -> bool:
    return not all(v for r in result["rows"] for v in r["checks"].values())
