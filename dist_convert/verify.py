"""Distributed comparison of every logical tensor of two checkpoints, in any formats and layouts."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .convert import load_index, logical_numel, sliced, source_dtypes
from .datamodel import SourceIndex, TargetFile, TargetTensor, numel
from .errors import ConvertError
from .exchange import Assembly, execute
from .formats.base import FormatOptions
from .layout.boxes import Box, Piece
from .layout.rules import logical_tensors
from .nonfinite import nonfinite_counts, nonfinite_note
from .plan import DEFAULT_BUDGET, balance, make_plan
from .runtime import Runtime


@dataclass(frozen=True, kw_only=True)
class Mismatch:
    name: str
    detail: str


def logical_files(index: SourceIndex, names: list[str]) -> list[TargetFile]:
    """A target that holds each logical tensor whole, in its source dtype."""
    tensors = logical_tensors(index.cfg)
    dtypes = source_dtypes(index)
    files = []
    for i, name in enumerate(names):
        shape = tensors[name].shape
        full = Box.full(shape)
        piece = Piece(logical=name, lbox=full, sbox=full)
        tensor = TargetTensor(key=name, shape=shape, dtype=dtypes[name], pieces=[piece])
        files.append(TargetFile(id=i, name=name, tensors=[tensor]))
    return files


def _gather_logical(index: SourceIndex, fmt, names: list[str], writer_of: dict[int, int], rt: Runtime,
                    budget: int, exchange: str = "auto") -> dict[str, torch.Tensor]:
    files = logical_files(index, names)
    index = sliced(index, files, budget)
    plan = make_plan(index.chunks, files, rt.world, budget, logical_numel(index), writer_of=writer_of,
                     absent=index.absent)
    mine = [files[i] for i in plan.files_of(rt.rank)]
    out = Assembly(mine, plan, rt.rank)
    execute(plan, rt, {c.id: c for c in index.chunks}, lambda cs: fmt.read(index, cs), out,
            what=f"reading {_label(index.iter_dir)}", exchange=exchange)
    data = out.finish()
    return {f.name: data[(f.id, 0)] for f in mine}


def _label(iter_dir: Path) -> str:
    """The checkpoint's name: its root for Megatron-LM iteration directories, else the directory."""
    return iter_dir.parent.name if iter_dir.name.startswith(("iter_", "release")) else iter_dir.name


def compare(a: torch.Tensor, b: torch.Tensor, atol: float, rtol: float) -> str | None:
    if a.shape != b.shape:
        return f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
    if atol == 0 and rtol == 0:
        if a.dtype != b.dtype:
            return f"dtype {a.dtype} vs {b.dtype} (pass --atol/--rtol to compare across a cast)"
        if torch.equal(a, b):
            return None
        if a.is_floating_point() and torch.equal(a.isnan(), b.isnan()) and torch.equal(
                torch.where(a.isnan(), 0, a), torch.where(b.isnan(), 0, b)):
            return None  # NaN where the other has NaN: carried unchanged
    else:
        fa, fb = a.float(), b.float()
        if torch.allclose(fa, fb, atol=atol, rtol=rtol, equal_nan=True):
            return None
    diff = (a.float() - b.float()).abs()
    idx = int(diff.flatten().argmax())
    return f"max |diff| {diff.max().item():.3g} at flat index {idx}"


def verify(path_a: Path, path_b: Path, rt: Runtime, fmt_a: str = "auto", fmt_b: str = "auto", atol: float = 0.0,
           rtol: float = 0.0, vocab_size: int | None = None, options: FormatOptions | None = None,
           budget: int = DEFAULT_BUDGET, *, exchange: str = "auto") -> list[Mismatch]:
    options = options or FormatOptions()
    fa, ia = load_index(path_a, fmt_a, rt, vocab_size, options)
    fb, ib = load_index(path_b, fmt_b, rt, vocab_size, options)
    if ia.adapter is not None or ib.adapter is not None:
        return verify_adapters(fa, ia, fb, ib, rt, atol, rtol)
    ta, tb = logical_tensors(ia.cfg), logical_tensors(ib.cfg)
    mismatches = [Mismatch(name=n, detail="only in A") for n in ta if n not in tb]
    mismatches += [Mismatch(name=n, detail="only in B") for n in tb if n not in ta]
    mismatches += [Mismatch(name=n, detail=f"shape {ta[n].shape} vs {tb[n].shape}")
                   for n in ta if n in tb and ta[n].shape != tb[n].shape]
    absent = ia.absent | ib.absent  # left out by --allow-missing: not compared
    names = [n for n in ta if n in tb and ta[n].shape == tb[n].shape and n not in absent]
    if absent:
        rt.log(f"note: not compared (--allow-missing): {sorted(absent)[:5]}{' ...' if len(absent) > 5 else ''}")
    if not names:
        raise ConvertError("the two checkpoints share no logical tensors", "compare checkpoints of the same model")
    sizes = {i: numel(ta[n].shape) for i, n in enumerate(names)}
    writer_of = balance(sizes, rt.world)
    found: tuple[dict[str, tuple[int, int]], dict[str, tuple[int, int]]] = ({}, {})
    ga = _gather_logical(ia, fa, names, writer_of, rt, budget, exchange)
    gb = _gather_logical(ib, fb, names, writer_of, rt, budget, exchange)
    local = [Mismatch(name=n, detail=d) for n in ga if (d := compare(ga[n], gb[n], atol, rtol))]
    bad = ({n: c for n, t in ga.items() if any(c := nonfinite_counts(t))},
           {n: c for n, t in gb.items() if any(c := nonfinite_counts(t))})
    for part, (bad_a, bad_b) in rt.all_gather_object((local, bad)):
        mismatches += part
        found[0].update(bad_a)
        found[1].update(bad_b)
    for side, counts in zip("AB", found, strict=True):
        if note := nonfinite_note([counts], what="logical tensors", then=""):
            rt.log(f"note: {side}: {note}")
    rt.log(f"compared {len(names)} logical tensors: {ia.format} {ia.layout} vs {ib.format} {ib.layout}")
    return mismatches


def verify_adapters(fa, ia: SourceIndex, fb, ib: SourceIndex, rt: Runtime, atol: float,
                    rtol: float) -> list[Mismatch]:
    """Two LoRA adapters compared by what they do: on every base tensor either adapts, the sum of its modules'
    ``scale * B @ A`` (float32), so adapters of different structure (peft's q/k/v, Bridge's fused qkv, ranks
    padded or blocked) compare equal when they change the model equally. Each rank computes its share."""
    from .layout.boxes import Box
    from .lora.merge import AdapterReader, Merger

    if ia.adapter is None or ib.adapter is None:
        raise ConvertError(f"{ia.iter_dir if ia.adapter is None else ib.iter_dir} is a whole model and the other a "
                           "LoRA adapter", "compare two adapters, or two models (merge an adapter: reshard --lora)")
    ma = Merger(ia.adapter, AdapterReader(ia, lambda cs: fa.read(ia, cs)))
    mb = Merger(ib.adapter, AdapterReader(ib, lambda cs: fb.read(ib, cs)))
    shapes = logical_tensors(ia.cfg)
    names = sorted(set(ma.modules) | set(mb.modules))
    local = []
    for name in names[rt.rank::rt.world]:
        box = Box.full(shapes[name].shape)
        da, db = ma.delta(name, box), mb.delta(name, box)
        detail = compare(da, db, atol, rtol)
        if detail is not None:
            local.append(Mismatch(name=f"{name} (scale * B @ A)", detail=detail))
    mismatches = [m for part in rt.all_gather_object(local) for m in part]
    rt.log(f"compared the adapters' products on {len(names)} base tensors: {ia.format} {ia.layout} vs {ib.format} "
           f"{ib.layout}")
    return mismatches
