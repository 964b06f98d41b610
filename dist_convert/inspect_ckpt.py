"""``inspect``: what a checkpoint holds (format, iteration, layout, config, tensors, bytes, dtypes)."""
from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path

from rich.console import Console
from rich.table import Table

from .convert import load_index
from .formats.base import FormatOptions
from .layout.rules import logical_tensors
from .runtime import Runtime, human_bytes


def describe(path: Path, fmt: str, rt: Runtime, vocab_size: int | None, options: FormatOptions) -> dict:
    _, index = load_index(path, fmt, rt, vocab_size, options)
    dtypes = Counter(str(c.dtype).replace("torch.", "") for c in index.chunks)
    chunks = index.layout.stack_chunks(index.cfg.stacks)
    return {
        "path": str(index.iter_dir),
        "format": index.format,
        "iteration": index.iteration,
        "layout": {"tp": index.layout.tp, "pp": index.layout.pp, "first_stage_layers": index.layout.first,
                   "last_stage_layers": index.layout.last, "vpp": index.layout.vpp,
                   "pipeline_split_rank": index.layout.split, "pipeline_layout": index.layout.pipeline_layout},
        "stage_layers": [sum(n for p, _, stack, _, n in chunks if p == s and stack != "mtp")
                         for s in range(index.layout.pp)],
        "mtp_stage": next((p for p, _, stack, _, _ in chunks if stack == "mtp"), None),
        "config": dataclasses.asdict(index.cfg),
        "logical_tensors": len(logical_tensors(index.cfg)),
        "stored_chunks": len(index.chunks),
        "bytes": index.nbytes,
        "dtypes": dict(dtypes),
        "notes": index.notes,
        "adapter": None if index.adapter is None else adapter_info(index.adapter),
    }


def adapter_info(spec) -> dict:
    """What an adapter holds: kind, base, ranks, scales, targets in both namings, layers, fused-A sharing."""
    from .lora.adapter import module_type

    layers = sorted({int(p.logical.split(".")[2]) for m in spec.modules for p in m.base})
    return {"kind": spec.kind, "base": spec.base_ref, "modules": len(spec.modules),
            "ranks": sorted({m.r for m in spec.modules}), "alphas": sorted({str(m.alpha) for m in spec.modules}),
            "scales": sorted({round(m.scale, 6) for m in spec.modules}),
            "rslora": any(m.rslora for m in spec.modules),
            "targets": sorted({m.name.rsplit(".", 1)[-1] for m in spec.modules}),
            "megatron_targets": sorted({module_type(p.logical) for m in spec.modules for p in m.base}),
            "layers": layers, "shared_a": sum(1 for m in spec.modules if m.same_a),
            "params": sum(spec.logical_numel().values())}


def print_description(info: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(info, indent=2, default=str))
        return
    table = Table(title=f"{info['path']}", show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value")
    lay = info["layout"]
    rows = [("format", info["format"]), ("iteration", str(info["iteration"])),
            ("layout", f"TP={lay['tp']} PP={lay['pp']} stages={info['stage_layers']}"
                       + (f" layout={lay['pipeline_layout']!r}" if lay["pipeline_layout"] else "")
                       + (f" MTP on stage {info['mtp_stage']}" if info["mtp_stage"] is not None else "")),
            ("logical tensors", str(info["logical_tensors"])), ("stored chunks", str(info["stored_chunks"])),
            ("bytes", human_bytes(info["bytes"])),
            ("dtypes", ", ".join(f"{k}: {v} chunks" for k, v in info["dtypes"].items()))]
    if info["adapter"] is not None:
        rows += [(f"adapter {k}", str(v)) for k, v in info["adapter"].items()]
    rows += [(k, str(v)) for k, v in info["config"].items()]
    rows += [("note", n) for n in info["notes"]]
    for k, v in rows:
        table.add_row(k, v)
    Console().print(table)
