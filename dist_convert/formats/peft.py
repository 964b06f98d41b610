"""Hugging Face peft LoRA adapter directories: ``adapter_config.json`` + ``adapter_model.safetensors``, keys
``base_model.model.<HF module>.lora_A.weight`` [r, in] / ``.lora_B.weight`` [out, r], scale ``lora_alpha / r``
(``alpha_pattern`` / ``rank_pattern`` per module, ``lora_alpha / sqrt(r)`` with ``use_rslora``).

An adapter names modules of a base model; the base (``--base``, else a local ``base_model_name_or_path``) gives
the model config and the HF name table (``formats/hf.py``), whose pieces say which rows of megatron-core's
fused tensors each HF module adapts. A target is laid out from any source adapter (``lora/structure.py``): a
Megatron-Bridge adapter's fused ``linear_qkv`` becomes q/k/v modules with the same A, as Bridge's own
``save_hf_adapter`` writes them.
"""
from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import replace
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch

from ..datamodel import SourceChunk, SourceIndex, Target, TargetFile, TargetTensor, WrittenFile
from ..durable import write_durable
from ..errors import ConvertError
from ..layout.boxes import Box, Piece
from ..layout.topology import Layout
from ..lora.adapter import AdapterModule, AdapterSpec, as_fraction, check_base_pieces, module_type
from ..lora.structure import Slot, compose, lay_out, placements
from ..models import export_family
from ..runtime import Runtime
from .base import FormatOptions, on_rank0
from .hf import HFFormat, hf_tensors
from .hf_shards import ShardWriter
from .safetensors_io import read_boxes, read_header

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<which>[AB])\.weight$")
# adapter_config.json settings an exact conversion cannot keep: (key, refused unless, what it is)
UNSUPPORTED = (("use_dora", False, "DoRA (a magnitude vector per output row)"),
               ("lora_bias", False, "LoRA biases (lora_bias)"), ("fan_in_fan_out", False, "fan_in_fan_out (Conv1D)"),
               ("modules_to_save", None, "modules_to_save (full copies of modules)"),
               ("target_parameters", None, "target_parameters (LoRA on 3-D expert parameters)"),
               ("layer_replication", None, "layer_replication"), ("trainable_token_indices", None,
                                                                   "trainable_token_indices"))


def read_config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads((path / CONFIG).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConvertError(f"{path / CONFIG} is not readable JSON ({e})", "restore the adapter's adapter_config.json") \
            from None
    if not isinstance(config, dict):
        raise ConvertError(f"{path / CONFIG} holds no JSON object", "restore the adapter's adapter_config.json")
    return config


def check_config(config: dict[str, Any], where: Path) -> None:
    """Refuse, in one line, what the adapter holds besides plain LoRA matrices."""
    if config.get("peft_type", "LORA") != "LORA":
        raise ConvertError(f"{where} is a {config.get('peft_type')} adapter, not LoRA",
                           "convert LoRA adapters only (peft_type LORA)")
    for key, default, what in UNSUPPORTED:
        if config.get(key) not in (default, [], {}, ()) and not (default is False and config.get(key) is None):
            raise ConvertError(f"{where} uses {what}, which dist_convert does not convert exactly",
                               f"train or save the adapter without {key}, or merge it with peft's own "
                               "merge_and_unload")
    if config.get("bias", "none") != "none":
        raise ConvertError(f"{where} trains biases (bias={config['bias']!r})",
                           "train the adapter with bias='none', or merge it with peft's own merge_and_unload")


def pattern_value(patterns: dict[str, Any] | None, module: str, default: Any) -> Any:
    """peft's per-module setting: the first pattern key ``k`` with ``(.*\\.)?(k)$`` matching the module name."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def peft_slots(hf: dict[str, tuple[tuple[int, ...], list[Piece]]]) -> list[Slot]:
    """Every HF module of the base an adapter may hold (its weight adapts an adaptable logical tensor)."""
    out = []
    for name, (shape, pieces) in hf.items():
        if name.endswith(".weight") and len(shape) == 2 and pieces and all(module_type(p.logical) for p in pieces):
            m = name.removesuffix(".weight")
            out.append(Slot(name=m, a=f"{m}.lora_A.weight", b=f"{m}.lora_B.weight", shape=(shape[0], shape[1]),
                            base=tuple(pieces)))
    return out


def peft_modules(config: dict[str, Any], found: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                 slots: dict[str, Slot], where: Path) -> tuple[AdapterModule, ...]:
    """The adapter's modules from its stored tensors, checked against the base's modules and shapes."""
    fix = "pass the base model this adapter was trained on with --base"
    byname: dict[str, dict[str, tuple[int, ...]]] = {}
    for key, (_, shape) in found.items():
        m = _KEY.match(key)
        if m is None:
            raise ConvertError(f"{where / WEIGHTS} holds {key}, not a LoRA matrix (lora_A / lora_B of a module)",
                               "convert adapters of plain LoRA matrices only (no embedding LoRA, DoRA or biases)")
        byname.setdefault(m.group("module"), {})[m.group("which")] = shape
    alpha = as_fraction(config.get("lora_alpha", 8), f"{where / CONFIG} lora_alpha", "restore adapter_config.json")
    out = []
    for name, mats in sorted(byname.items()):
        if set(mats) != {"A", "B"}:
            raise ConvertError(f"{where / WEIGHTS} holds lora_{'A' if 'A' in mats else 'B'} of {name} without its "
                               f"lora_{'B' if 'A' in mats else 'A'}", "re-save the adapter with peft")
        slot = slots.get(name)
        if slot is None:
            raise ConvertError(f"{where} adapts {name}, which the base model has no adaptable module of (or not "
                               "under that name)", fix)
        check_base_pieces(name, list(slot.base))
        (ra, cols), (rows, rb) = mats["A"], mats["B"]
        if (rows, cols) != slot.shape or ra != rb:
            raise ConvertError(f"{where}: {name} has lora_A {tuple(mats['A'])} and lora_B {tuple(mats['B'])}, which do "
                               f"not adapt the base's {slot.shape} weight", fix)
        a = as_fraction(pattern_value(config.get("alpha_pattern"), name, alpha), f"the alpha of {name}",
                        "restore adapter_config.json")
        out.append(AdapterModule(name=name, a=slot.a, b=slot.b, r=ra, alpha=a, rslora=bool(config.get("use_rslora")),
                                 shape=slot.shape, base=slot.base))
    return tuple(out)


def shared_a(modules: tuple[AdapterModule, ...], path: Path) -> tuple[AdapterModule, ...]:
    """The modules with ``same_a`` set where projections of one fused tensor (q/k/v, gate/up) hold bitwise equal A
    at the same scale, as Megatron-Bridge's export of a fused adapter does: laid out as one block again."""
    def columns(m: AdapterModule) -> tuple:
        return tuple(sorted((p.logical, p.lbox.offsets[1], p.lbox.sizes[1]) for p in m.base))

    groups: dict[tuple, list[AdapterModule]] = {}
    for m in modules:
        groups.setdefault(columns(m), []).append(m)
    out = {m.name: m for m in modules}
    for group in groups.values():
        if len(group) < 2:
            continue
        tensors = read_boxes(path / WEIGHTS, [(PREFIX + m.a, Box.full((m.r, m.shape[1]))) for m in group])
        for i, m in enumerate(group):
            twin = next((g for g, t in zip(group[:i], tensors, strict=False) if out[g.name].same_a is None
                         and (g.r, g.exact_scale, g.rslora) == (m.r, m.exact_scale, m.rslora)
                         and torch.equal(t, tensors[i])), None)
            if twin is not None:
                out[m.name] = replace(m, same_a=twin.name)
    return tuple(out[m.name] for m in modules)


def peft_config(laid: list, base_ref: str | None, source: dict[str, Any] | None) -> dict[str, Any]:
    """adapter_config.json of a laid-out adapter: one r and lora_alpha (the most common), patterns for the rest."""
    def number(x: Fraction) -> int | float:
        return int(x) if x.denominator == 1 else float(x)

    mods = [x.module for x in laid]
    rslora = {m.rslora for m in mods}
    if len(rslora) > 1:
        raise ConvertError("the adapter mixes rslora and plain modules, which one adapter_config.json cannot state",
                           "merge the adapter into the base (--lora) instead")
    r = Counter(m.r for m in mods).most_common(1)[0][0] if mods else 8
    alpha = Counter(m.alpha for m in mods).most_common(1)[0][0] if mods else Fraction(r)
    out = {"alpha_pattern": {m.name: number(m.alpha) for m in mods if m.alpha != alpha},
           "auto_mapping": None, "base_model_name_or_path": base_ref, "bias": "none", "fan_in_fan_out": False,
           "inference_mode": True, "init_lora_weights": True, "lora_alpha": number(alpha), "lora_dropout": 0.0,
           "modules_to_save": None, "peft_type": "LORA", "r": r,
           "rank_pattern": {m.name: m.r for m in mods if m.r != r},
           "target_modules": sorted({m.name.rsplit(".", 1)[-1] for m in mods}),
           "task_type": (source or {}).get("task_type", "CAUSAL_LM"), "use_dora": False,
           "use_rslora": rslora == {True}}
    return out


class PeftFormat(HFFormat):
    name = "peft"

    def __init__(self, options: FormatOptions | None = None) -> None:
        super().__init__(options)

    def detect(self, path: Path) -> bool:
        return path.is_dir() and (path / CONFIG).is_file()

    def base_path(self, path: Path) -> Path:
        if self.options.base is not None:
            return self.options.base
        ref = read_config(path).get("base_model_name_or_path")
        if isinstance(ref, str) and Path(ref).is_dir():
            return Path(ref)
        raise ConvertError(f"{path} is an adapter of {ref!r}, which is not a local model directory",
                           "pass the base model (any format dist_convert reads) with --base")

    def index(self, path: Path, rt: Runtime, vocab_size: int | None) -> SourceIndex:
        from . import detect_format

        base_path = self.base_path(path)
        base = detect_format(base_path, self.options).index(base_path, rt, vocab_size)
        return on_rank0(rt, lambda: self.index_on(path, base))

    def index_on(self, path: Path, base: SourceIndex) -> SourceIndex:
        """The index of the adapter at ``path`` on the model ``base`` indexes (rank-local)."""
        config = read_config(path)
        check_config(config, path)
        if not (path / WEIGHTS).is_file():
            raise ConvertError(f"{path} has no {WEIGHTS}" + (" (only the pickled adapter_model.bin)" if
                                                             (path / "adapter_model.bin").is_file() else ""),
                               "save the adapter with safetensors (peft save_pretrained's default)")
        found = read_header(path / WEIGHTS)
        fam = export_family(base.cfg, base.origin.hf_config)
        slots = {s.name: s for s in peft_slots(hf_tensors(base.cfg, fam))}
        modules = shared_a(peft_modules(config, found, slots, path), path)
        spec = AdapterSpec(kind="peft", modules=modules, base_ref=config.get("base_model_name_or_path"),
                           config=config)
        chunks = []
        for m in modules:
            for logical in (m.a, m.b):
                key = PREFIX + logical
                dtype, shape = found[key]
                full = Box.full(tuple(shape))
                chunks.append(SourceChunk(id=len(chunks), file=WEIGHTS, key=key, shape=tuple(shape), dtype=dtype,
                                          pieces=[Piece(logical, full, full)], offsets=(0,) * len(shape),
                                          sliceable=True))
        return SourceIndex(format=self.name, iter_dir=path, iteration="release", args=base.args, cfg=base.cfg,
                           layout=Layout(tp=1, pp=1), chunks=chunks, origin=base.origin, adapter=spec,
                           notes=[f"adapter of {len(modules)} modules on {base.format} base {base.iter_dir}"])

    def laid(self, target: Target) -> list:
        fam = export_family(target.cfg, target.origin.hf_config)
        return lay_out(target.adapter.modules, peft_slots(hf_tensors(target.cfg, fam)))

    def target_files(self, target: Target, dtypes: dict[str, torch.dtype]) -> list[TargetFile]:
        assert target.adapter is not None, "convert.adapter_target sends only adapter sources here"
        laid = self.laid(target)
        placed = placements(laid)
        tensors = []
        for x in laid:
            m = x.module
            for logical, shape in ((m.a, (m.r, m.shape[1])), (m.b, (m.shape[0], m.r))):
                full = Box.full(shape)
                pieces = compose([Piece(logical, full, full)], placed)
                dtype = target.dtype or (dtypes[pieces[0].logical] if pieces else torch.float32)
                tensors.append(TargetTensor(key=PREFIX + logical, shape=shape, dtype=dtype, pieces=pieces))
        return [TargetFile(id=0, name=WEIGHTS, tensors=tensors)]

    def open_writer(self, target: Target, out_dir: Path, files: list[TargetFile], rt: Runtime) -> ShardWriter:
        return ShardWriter(out_dir, files, None, lambda f: {})  # as hf's: written as the tensors arrive

    def finalize(self, target: Target, out_dir: Path, written: list[WrittenFile]) -> None:
        spec, laid = target.adapter, self.laid(target)
        same = spec.kind == "peft" and {(m.name, m.r, m.alpha, m.rslora) for m in spec.modules} == {
            (x.module.name, x.module.r, x.module.alpha, x.module.rslora) for x in laid}
        # the source's own config when its modules are kept as they were; else one written for the new modules
        config = spec.config if same else peft_config(laid, spec.base_ref if spec.kind == "peft" else
                                                      target.origin.hf_model_id, spec.config)
        write_durable(out_dir / CONFIG, json.dumps(config, indent=2, sort_keys=True))
