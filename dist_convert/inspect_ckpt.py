"""``inspect``: what a checkpoint holds (format, iteration, layout, the config fields its model uses, bytes,
dtypes; with ``--tensors`` every logical tensor, and the NaN and infinite values of each, read over the ranks). It
refuses neither missing nor unexpected tensors: the reader's notes name them. The warnings of a reader that builds
another model from the checkpoint (``readers.reader_warnings``: Megatron-LM's builder from a Megatron checkpoint's
args) are said as a conversion to that format says them."""
from __future__ import annotations

import dataclasses
import json
from collections import Counter, defaultdict, deque
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from .config import RECORDS, ModelConfig
from .convert import load_index, logical_numel, sliced
from .datamodel import SourceChunk, SourceIndex
from .errors import ConvertError
from .features import LAYOUT
from .formats.base import Format, FormatOptions
from .layout.boxes import logical_view
from .layout.rules import logical_tensors
from .layout.topology import Layout
from .layout.vision import vision_tensors
from .model_class import describe_class
from .nonfinite import nonfinite_counts, nonfinite_note, nonfinite_total
from .plan import DEFAULT_BUDGET, balance, select_source
from .readers import reader_warnings
from .runtime import Runtime, human_bytes, stop_on_error
from .verify import logical_files


def shown_name(record: str | None, f: dataclasses.Field) -> str:
    """The name inspect shows a field under: a core field its own; a record's field its Megatron-LM args name (what
    a training run's args call it), or ``record.field`` where no args name says it (how tensors are stored); a field
    holding a record (its kind) its megatron-core name."""
    args = f.metadata.get("arg") or ()
    if record is None:
        return f.name
    if f.metadata.get("record") is not None:
        return f.metadata["config"][0]
    return f"{record}.{f.name}" if f.metadata.get("kind") == LAYOUT or not args else args[0]


def inspect_names() -> list[tuple[str | None, str, str]]:
    """(record or None for the core, field, shown name) of every field of ModelConfig and its records, in order."""
    out: list[tuple[str | None, str, str]] = [(None, f.name, shown_name(None, f))
                                              for f in dataclasses.fields(ModelConfig) if f.name not in RECORDS]
    for name, cls in RECORDS.items():
        if cls.presence:
            out.append((name, "", cls.presence[0]))
        fields: dict[str, dataclasses.Field] = {}
        for path, f in cls.leaf_fields():  # a path once (its first declaration)
            fields.setdefault(path, f)
        for path, f in fields.items():  # a held record's fields under the name of the field holding it
            held, _, sub = path.partition(".")
            out.append((name, path, f"{shown_name(name, fields[held])}.{sub}" if sub else shown_name(name, f)))
    return out


def used_config(cfg: ModelConfig) -> dict[str, Any]:
    """Pure: what of the model config inspect shows, as plain values, in ModelConfig order: the core (the context
    length where known, the head size where the attention has one) and what each record shows of itself
    (``Feature.shown``)."""
    out: dict[str, Any] = {}
    shown = {r.attr: set(r.shown()) for r in cfg.records()}
    for record, field, name in inspect_names():
        if record is None:
            value = getattr(cfg, field)
            if not (field == "max_position_embeddings" and value is None or field == "kv_channels" and cfg.mla):
                out[name] = value
            continue
        rec = getattr(cfg, record)
        if rec is None:
            continue
        if not field:  # an optional feature's presence, as its args say it
            out[name] = rec.to_args()[name]
        elif "." in field:  # a field of the record a field holds (its kind's own)
            held, sub = field.split(".")
            if held in shown[record] and hasattr(getattr(rec, held), sub):
                out[name] = getattr(getattr(rec, held), sub)
        elif field in shown[record]:
            value = getattr(rec, field)
            out[name] = getattr(value, "name", value)  # a held record by its kind
    return out


def _stored_dtype(c: SourceChunk) -> str:
    """How a chunk is stored: its dtype, or the quantized form a reader dequantizes (to ``c.dtype``)."""
    dtype = str(c.dtype).replace("torch.", "")
    return f"{c.quant.scheme}->{dtype}" if c.quant is not None else dtype


def tensor_rows(cfg: ModelConfig, chunks: Iterable[SourceChunk], layout: Layout | None = None,
                nonfinite: dict[str, tuple[int, int]] | None = None) -> list[dict[str, Any]]:
    """Pure: one row per logical tensor of the model, in model order, then the stored logical tensors the model
    does not name (an adapter's, the optimizer state's; their shape is the extent of their stored boxes):
    name, global shape, stored dtypes, how TP splits it (``kind``; None when unknown), the routed expert and, with
    ``layout``, its EP rank, how many stored pieces hold it (0: the source lacks it) and, with ``nonfinite``
    (``nonfinite_by_tensor``), its NaN and infinite values."""
    pieces: Counter[str] = Counter()
    dtypes: dict[str, set[str]] = defaultdict(set)
    extent: dict[str, list[int]] = {}
    for c in chunks:
        for p in c.pieces:
            pieces[p.logical] += 1
            dtypes[p.logical].add(_stored_dtype(c))
            end = [o + s for o, s in zip(p.lbox.offsets, p.lbox.sizes, strict=True)]
            extent[p.logical] = [max(a, b) for a, b in zip(extent.get(p.logical, end), end, strict=True)]
    model = logical_tensors(cfg)
    rows = []
    for t in model.values():
        ep_rank = None if t.expert is None or layout is None else layout.expert_rank(t.expert, cfg.num_experts)
        rows.append({"name": t.name, "shape": list(t.shape), "dtypes": sorted(dtypes.get(t.name, ())),
                     "kind": t.kind.value, "expert": t.expert, "ep_rank": ep_rank, "pieces": pieces[t.name]})
    for name in sorted(set(pieces) - set(model)):
        rows.append({"name": name, "shape": extent[name], "dtypes": sorted(dtypes[name]), "kind": None,
                     "expert": None, "ep_rank": None, "pieces": pieces[name]})
    if nonfinite is not None:
        for r in rows:
            r["nan"], r["inf"] = nonfinite.get(r["name"], (0, 0))
    return rows


def nonfinite_by_tensor(index: SourceIndex, fmt: Format, rt: Runtime,
                        budget: int = DEFAULT_BUDGET) -> dict[str, tuple[int, int]]:
    """Collective: the NaN and infinite values of each logical tensor that holds any (``nonfinite_counts``), every
    stored box read once: the chunks (cut to a quarter of ``budget``) spread over the ranks, each rank reading half a
    budget at a time and counting each piece of a logical tensor it holds."""
    if index.adapter is None:
        index = sliced(index, logical_files(index, [n for n in logical_tensors(index.cfg) if n not in index.absent]),
                       budget)
    kept = select_source(index.chunks, logical_numel(index), index.absent)
    chunks = {c.id: c for c in index.chunks if c.id in kept}
    owner = balance({i: c.nbytes for i, c in chunks.items()}, rt.world)
    mine = deque(c for i, c in chunks.items() if owner[i] == rt.rank)
    counts: dict[str, tuple[int, int]] = {}
    error: ConvertError | None = None
    with rt.progress(sum(c.nbytes for c in mine), "reading values") as bar:
        while mine:
            batch, held = [mine.popleft()], 0
            while mine and (held := held + batch[-1].nbytes) + mine[0].nbytes <= budget // 2:
                batch.append(mine.popleft())
            try:
                data = fmt.read(index, batch)
            except ConvertError as e:
                error = e
                break
            for c in batch:
                for p in kept[c.id]:
                    block = data[c.id][p.sbox.slices()]
                    nan, inf = nonfinite_counts(block if p.view is None else logical_view(block, p.view))
                    if nan or inf:
                        before = counts.get(p.logical, (0, 0))
                        counts[p.logical] = (before[0] + nan, before[1] + inf)
                bar.advance(c.nbytes)
    stop_on_error(rt, error)
    return nonfinite_total(rt.all_gather_object(counts))


def describe(path: Path, fmt: str, rt: Runtime, vocab_size: int | None, options: FormatOptions,
             tensors: bool = False) -> dict:
    """Collective: what ``path`` holds (``tensors``: also every logical tensor, under "tensors"). Missing and
    unexpected tensors are not refused, whatever ``options`` say: the index's notes name them."""
    options = dataclasses.replace(options, allow_missing=("*",), ignore_unexpected=("*",))
    reader, index = load_index(path, fmt, rt, vocab_size, options)
    dtypes = Counter(str(c.dtype).replace("torch.", "") for c in index.chunks)
    chunks = index.layout.stack_chunks(index.cfg.stacks)
    stage_layers = [sum(n for p, _, stack, _, n in chunks if p == s and stack != "mtp") for s in range(index.layout.pp)]
    info = {
        "path": str(index.iter_dir),
        "format": index.format,
        "model": describe_class(index.cfg, stage_layers),
        "iteration": index.iteration,
        "layout": {"tp": index.layout.tp, "pp": index.layout.pp, "first_stage_layers": index.layout.first,
                   "last_stage_layers": index.layout.last, "vpp": index.layout.vpp,
                   "pipeline_split_rank": index.layout.split, "pipeline_layout": index.layout.pipeline_layout,
                   "ep": index.layout.ep, "expert_tp": index.layout.expert_tp},
        "stage_layers": stage_layers,
        "mtp_stage": next((p for p, _, stack, _, _ in chunks if stack == "mtp"), None),
        "config": used_config(index.cfg),
        "config_all": dataclasses.asdict(index.cfg),
        "logical_tensors": len(logical_tensors(index.cfg)),
        "components": components(index.cfg),
        "stored_chunks": len(index.chunks),
        "bytes": index.nbytes,
        "stored_bytes": sum(c.stored_nbytes for c in index.chunks),  # a quantized source: its packed parts
        "dtypes": dict(dtypes),
        "notes": index.notes,
        "warnings": reader_warnings(index.cfg, index.format),  # a reader of this format that builds another model
        "adapter": None if index.adapter is None else adapter_info(index.adapter),
    }
    for warning in info["warnings"]:  # the lines a conversion to this format says
        rt.log(f"[yellow]warning[/]: {warning}")
    if tensors:
        nonfinite = nonfinite_by_tensor(index, reader, rt)
        if note := nonfinite_note([nonfinite], what="logical tensors", then=""):
            info["notes"] = [*index.notes, note]
        rows = tensor_rows(index.cfg, index.chunks, index.layout, nonfinite)
        # an adapter source stores the adapter's tensors only: the base model's are not in it
        info["tensors"] = rows if index.adapter is None else [r for r in rows if r["pieces"]]
    return info


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


def tensor_table(rows: list[dict[str, Any]], title: str = "logical tensors") -> Table:
    """The ``--tensors`` rows as a rich table (the expert column only for a model with routed experts)."""
    experts = any(r["expert"] is not None for r in rows)
    bad = any(r.get("nan") or r.get("inf") for r in rows)  # the column only where a value is not finite
    table = Table(title=title)
    for col in ("name", "shape", "dtype", "TP split") + (("expert (EP rank)",) if experts else ()) + ("pieces",) + \
            (("non-finite",) if bad else ()):
        table.add_column(col, justify="right" if col in ("pieces", "expert (EP rank)") else "left")
    for r in rows:
        expert = "" if r["expert"] is None else str(r["expert"]) + (
            "" if r["ep_rank"] is None else f" ({r['ep_rank']})")
        nonfinite = f"{r['nan']} NaN, {r['inf']} inf" if r.get("nan") or r.get("inf") else ""
        table.add_row(r["name"], "x".join(map(str, r["shape"])), ", ".join(r["dtypes"]) or "-", r["kind"] or "?",
                      *((expert,) if experts else ()), str(r["pieces"]) if r["pieces"] else "absent",
                      *((nonfinite,) if bad else ()))
    return table


def components(cfg: ModelConfig) -> dict[str, int] | None:
    """Logical tensors per component of a multimodal model (the language model, the vision tower and projectors);
    None for a language model alone."""
    if cfg.vision is None:
        return None
    tower = len(vision_tensors(cfg))
    return {"language model": len(logical_tensors(cfg)) - tower, f"vision ({cfg.vision.tower})": tower}


def print_description(info: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(info, indent=2, default=str))
        return
    table = Table(title=f"{info['path']}", show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value", overflow="fold")
    lay = info["layout"]
    experts = f" EP={lay['ep']} ETP={lay['expert_tp']}" if info["config"].get("num_experts") else ""
    rows = [("format", info["format"]), ("model", info["model"]), ("iteration", str(info["iteration"])),
            ("layout", f"TP={lay['tp']} PP={lay['pp']}{experts} stages={info['stage_layers']}"
                       + (f" VPP={lay['vpp']}" if lay["vpp"] else "")
                       + (f" layout={lay['pipeline_layout']!r}" if lay["pipeline_layout"] else "")
                       + (f" MTP on stage {info['mtp_stage']}" if info["mtp_stage"] is not None else "")),
            ("logical tensors", str(info["logical_tensors"])
             + (f" ({', '.join(f'{k}: {n}' for k, n in info['components'].items())})" if info["components"] else "")),
            ("stored chunks", str(info["stored_chunks"])),
            ("bytes", human_bytes(info["bytes"]) if info["stored_bytes"] == info["bytes"] else
             f"{human_bytes(info['stored_bytes'])} stored, {human_bytes(info['bytes'])} dequantized"),
            ("dtypes", ", ".join(f"{k}: {v} chunks" for k, v in info["dtypes"].items()))]
    if info["adapter"] is not None:
        rows += [(f"adapter {k}", str(v)) for k, v in info["adapter"].items()]
    rows += [(k, str(v)) for k, v in info["config"].items()]
    rows += [("note", n) for n in info["notes"]]
    for k, v in rows:
        table.add_row(k, v)
    console = Console()
    console.print(table)
    if "tensors" in info:
        rows = info["tensors"]
        if not console.is_terminal:  # piped: one line per tensor, whole names (a terminal wraps them to fit)
            console = Console(width=max(console.width, max((len(r["name"]) for r in rows), default=0) + 90))
        console.print(tensor_table(rows))
