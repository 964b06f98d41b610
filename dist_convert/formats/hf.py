"""Hugging Face safetensors checkpoints of every registered model family (``dist_convert/models/``):
``config.json`` plus ``model.safetensors`` or ``model-00001-of-00004.safetensors`` style shards with
``model.safetensors.index.json``.

HF keeps q/k/v and gate/up as separate tensors; megatron-core fuses them (``layout/fused.py``). Here each
HF tensor is described by pieces of the fused logical tensors (from the family's name table), so import
fuses and export splits through the same box algebra as every other reshard. Nothing here knows a family.
"""
from __future__ import annotations

import copy
import json
from collections.abc import Callable, Collection
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ..datamodel import (
    Origin,
    SourceChunk,
    SourceIndex,
    Target,
    TargetFile,
    TargetTensor,
    WrittenFile,
    numel,
    target_dtype,
)
from ..durable import write_durable
from ..errors import ConvertError
from ..layout.boxes import Box
from ..layout.rules import logical_tensors
from ..layout.topology import Layout
from ..mlm_args import HF_TOKENIZER, model_args
from ..models import export_family, family_of, hf_from_config, import_config, naming_family
from ..models.base import TIED_HEAD, Family, HFTensors, hf_dtype, part_pieces
from ..models.rows import names
from ..phases import phase
from ..runtime import Runtime, stop_on_error
from .base import HOLDS_ALL, FormatOptions, KeyPolicy, copy_tokenizer_files, on_rank0, tokenizer_source
from .hf_shards import ShardWriter, unit_key
from .quant import Writer
from .safetensors_io import read_boxes, read_header
from .schemes import SCHEMES, WRITERS, scheme_of

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some older checkpoints saved; recomputed by every loader

def hf_tensors(cfg, fam: Family | None = None, stored: dict[str, bool] | None = None) -> HFTensors:
    """Pure: every tensor of the HF checkpoint of ``cfg`` as family ``fam`` names it (default: the family
    ``cfg`` exports as): name -> (shape, pieces), in HF order. ``stored``: which of the family's optional sets of
    copies to hold (``Family.optional_sets``; by default the family's choice)."""
    fam = fam or naming_family(cfg)
    logical = logical_tensors(cfg)
    out: HFTensors = {}
    top = dict(fam.top_names(cfg))
    first, *rest = list(top)
    out[first] = part_pieces(top[first], logical[top[first]].shape, None, cfg)
    for stack, count in cfg.stacks:
        for layer in range(count):
            hf = f"{fam.hf_layers}{fam.hf_layer(cfg, stack, layer)}."
            for hf_suffix, name, part in names(fam.layer_names(cfg, stack, layer)):
                if name in logical:
                    shape, pieces = part_pieces(name, logical[name].shape, part, cfg)
                    shift = fam.shifts.get(hf_suffix, 0.0)
                    out[hf + hf_suffix] = shape, [replace(p, shift=shift) for p in pieces] if shift else pieces
    for hf, name, part in names(fam.component_names(cfg)):  # a vision tower and its projectors
        out[hf] = part_pieces(name, logical[name].shape, part, cfg)
    out.update(fam.alternatives(cfg, out.keys(), out))  # the layouts a family stores without a name-table row
    for hf_name in rest:
        if top[hf_name] in logical:
            out[hf_name] = part_pieces(top[hf_name], logical[top[hf_name]].shape, None, cfg)
    for name, (keys, default) in fam.optional_sets(cfg).items():
        if not (stored or {}).get(name, default):
            for key in keys:
                out.pop(key, None)
        elif name == TIED_HEAD:  # the tied embedding stored a second time: a replica
            out.update(dict.fromkeys(keys, out[first]))
    return out


def source_tensors(cfg, fam: Family, found: Collection[str]) -> tuple[HFTensors, dict[str, bool]]:
    """Pure: the tensors expected in an HF source whose stored names are ``found`` (the family's names, or its
    alternative layouts where the checkpoint has them: then the names they replace are not expected), and which of
    the family's optional sets of copies it stores (a set is stored when any of its names is)."""
    sets = {name: any(k in found for k in keys) for name, (keys, _) in fam.optional_sets(cfg).items()}
    expected = hf_tensors(cfg, fam, sets)
    alternatives = fam.alternatives(cfg, found, expected)
    if alternatives:
        replaced = {p.logical for _, pieces in alternatives.values() for p in pieces}
        expected = {k: v for k, v in expected.items() if not {p.logical for p in v[1]} <= replaced}
        expected.update(alternatives)
    return expected, sets


COMPARE_BYTES = 64 << 20  # rows of a stored head and its embedding compared at a time, per rank


def differing_tied_heads(index: SourceIndex, rt: Runtime, read: Callable[[SourceIndex, list[SourceChunk]],
                                                                          dict[int, torch.Tensor]]) -> list[str]:
    """Collective: a note for each output head a tied model's checkpoint stores (``TIED_HEAD``) with values that
    differ from the embedding's (empty when none does). Both are read in row blocks of ``COMPARE_BYTES``, the blocks
    spread over the ranks (no rank holds either whole), and compared bit for bit. transformers (5.x,
    ``PreTrainedModel.tie_weights``) ties only copies it finds equal: a head that differs stays the model's own
    output layer, so the index is then read untied, keeping both."""
    if not (index.origin.hf_stored or {}).get(TIED_HEAD):
        return []
    heads = set(family_of(index.origin.hf_config).optional_sets(index.cfg)[TIED_HEAD][0])
    first: dict[tuple, SourceChunk] = {}
    pairs: list[tuple[SourceChunk, SourceChunk]] = []
    for c in index.chunks:  # the head: a chunk holding the very pieces the embedding's chunk holds
        emb = first.setdefault(tuple((p.logical, p.lbox) for p in c.pieces), c)
        if emb is not c and c.key in heads:
            pairs.append((emb, c))
    blocks = []
    for emb, head in pairs:
        rows = max(1, COMPARE_BYTES // max(1, emb.nbytes // max(1, emb.shape[0])))
        blocks += [(emb, head, r, min(rows, emb.shape[0] - r)) for r in range(0, emb.shape[0], rows)]
    differ, error = set(), None
    for emb, head, r, n in blocks[rt.rank::rt.world]:
        parts = [replace(c, offsets=(r, *[0] * (len(c.shape) - 1)), shape=(n, *c.shape[1:]), twins=())
                 for c in (emb, head)]
        try:
            got = read(index, parts)
        except ConvertError as e:  # a damaged shard: every rank stops, the lowest that met it says why
            error = e
            break
        a, b = got[emb.id], got[head.id]
        same = torch.equal(_bits(a), _bits(b)) if a.dtype == b.dtype else torch.equal(a.float(), b.float())
        if not same:
            differ.add((emb.file, emb.key, head.file, head.key))
    stop_on_error(rt, error)
    found = sorted(set().union(*rt.all_gather_object(differ)))
    return [f"{CONFIG} ties the output layer to the embedding (tie_word_embeddings), but {head_file} stores "
            f"{head_key} with values that differ from {emb_key}{'' if emb_file == head_file else f' ({emb_file})'}: "
            "both are kept and the model is read untied (an output layer of its own), as transformers loads it (it "
            "ties only copies stored equal); set tie_word_embeddings to false in config.json to say so"
            for emb_file, emb_key, head_file, head_key in found]


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(-1).view(torch.uint8)


def _looks_like(path: Path) -> bool:
    return path.is_dir() and (path / CONFIG).is_file() and (
        (path / INDEX).is_file() or any(path.glob("*.safetensors")))


def shard_files(path: Path) -> list[str]:
    """The safetensors files of a checkpoint, checking that every shard the index names exists."""
    if (path / INDEX).is_file():
        try:
            weight_map = json.loads((path / INDEX).read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ConvertError(f"{path / INDEX} is not a valid safetensors index ({e!r})",
                               "re-download the model or remove the broken index file") from None
        files = sorted(set(weight_map.values()))
        for f in files:
            if not (path / f).is_file():
                raise ConvertError(f"{INDEX} names shard {f}, which is missing in {path}",
                                   "download or copy every shard of the model")
        return files
    if (path / SINGLE).is_file():
        return [SINGLE]
    return sorted(p.name for p in path.glob("*.safetensors"))


def pack_shards(sizes: list[tuple[str, int]], max_bytes: int,
                together: Callable[[str], str] | None = None) -> list[list[str]]:
    """Pure: consecutive tensors grouped into shards of at most ``max_bytes`` (a bigger tensor alone); tensors of one
    ``together`` key share a shard (placed where the first of them is)."""
    units: dict[str, list[tuple[str, int]]] = {}
    for name, n in sizes:
        units.setdefault(together(name) if together else name, []).append((name, n))
    shards: list[list[str]] = []
    used = 0
    for unit in units.values():
        n = sum(b for _, b in unit)
        if not shards or (used + n > max_bytes and shards[-1]):
            shards.append([])
            used = 0
        shards[-1].extend(name for name, _ in unit)
        used += n
    return shards


class HFFormat:
    name = "hf"
    iteration_dirs = False
    sharded = False
    any_writer = False
    row_blocks = True  # hf_shards.ShardWriter.put_rows: a shard is written as its tensors' rows arrive
    holds = HOLDS_ALL

    def __init__(self, options: FormatOptions | None = None) -> None:
        self.options = options or FormatOptions()

    def detect(self, path: Path) -> bool:
        return _looks_like(path)

    def index(self, path: Path, rt: Runtime, vocab_size: int | None) -> SourceIndex:
        index = on_rank0(rt, lambda: self._index(path, vocab_size))
        untied = differing_tied_heads(index, rt, self.read)
        return on_rank0(rt, lambda: self._index(path, vocab_size, untied)) if untied else index

    def _index(self, path: Path, vocab_size: int | None, untied: list[str] | None = None) -> SourceIndex:
        """Rank 0: the index of the checkpoint at ``path``; ``untied``: the notes of a tied output head stored with
        values of its own (``differing_tied_heads``), read as transformers builds that model: untied."""
        if not (path / CONFIG).is_file():
            raise ConvertError(f"{path} has no {CONFIG}", "point SRC at a Hugging Face model directory")
        try:
            hf = json.loads((path / CONFIG).read_text())
        except json.JSONDecodeError as e:
            raise ConvertError(f"{path / CONFIG} is not valid JSON ({e})", "restore the model's config.json") from None
        fam = family_of(hf)
        imported = import_config({**hf, "tie_word_embeddings": False} if untied else hf, None)
        cfg, notes = imported.cfg, [*(untied or ()), *imported.notes]
        if vocab_size is not None and vocab_size != cfg.vocab_size:
            raise ConvertError(f"--vocab-size {vocab_size} disagrees with vocab_size={cfg.vocab_size} in {CONFIG}",
                               "drop --vocab-size: Hugging Face checkpoints state their vocabulary size")
        found: dict[str, tuple[str, torch.dtype, tuple[int, ...]]] = {}
        for f in shard_files(path):
            for key, (dtype, shape) in read_header(path / f).items():
                if key in found:
                    raise ConvertError(f"tensor {key} is stored in both {found[key][0]} and {f}",
                                       "remove stray *.safetensors files from the model directory")
                found[key] = (f, dtype, shape)
        cfg = fam.as_stored(cfg, found, notes)  # e.g. MTP layers a config declares and the weights lack
        expected, sets = source_tensors(cfg, fam, found)
        quantized, parts = {}, set()  # tensors stored quantized (formats/quant.py), dequantized on read
        companions: dict[str, int] = {}
        for key, (shape, _) in expected.items():
            hit = next(((sc, h) for sc in SCHEMES.values() if (h := sc.stored(key, shape, hf, found)) is not None),
                       None)
            if hit is not None:
                sc, hit = hit
                beside = {k for k in sc.companions(key) if k in found}
                held = sum(numel(found[k][2]) * found[k][1].itemsize for k in {k for _, k in hit[0].parts} | beside)
                quantized[key] = replace(hit[0], stored_bytes=held, numel=numel(hit[1]))
                parts |= {k for _, k in hit[0].parts if k != key} | beside
                if beside and sc.companion_note:
                    companions[sc.companion_note] = companions.get(sc.companion_note, 0) + len(beside)
                found[key] = (hit[0].parts[0][0], torch.uint8, hit[1])  # as the reader sees it: its first part
        notes += [f"skipped {n} {what}" for what, n in companions.items()]
        ignored = sorted(k for k in found if k.endswith(IGNORED_SUFFIXES))
        if ignored:
            notes.append(f"skipped {len(ignored)} rotary inv_freq buffers (recomputed by every loader)")
        unconverted = sorted(k for k in found if fam.unconverted and k.startswith(tuple(fam.unconverted)))
        if unconverted:
            notes.append(f"skipped {len(unconverted)} tensors under {', '.join(fam.unconverted)} ("
                         f"{'; '.join(fam.unconverted.values())}): the converted model is the rest")
            ignored += unconverted
        policy = KeyPolicy.of(self.options)
        policy.unexpected(str(path), set(found) - set(expected) - set(ignored) - parts,
                          "the weights belong to another architecture or config; use the matching config.json",
                          f"tensors not in a {hf['architectures'][0]} with this config.json:")
        policy.missing(str(path), {k: {p.logical for p in v[1]} for k, v in expected.items() if k not in found},
                       "download or copy every shard of the model")
        copies = fam.stored_copies(cfg, found)  # primary key -> its stored copies, compared on read
        chunks = []
        for key, (shape, pieces) in expected.items():
            if key not in found or any(key in c for c in copies.values()):
                continue
            f, dtype, have = found[key]
            for k in (key, *copies.get(key, ())):
                if tuple(found[k][2]) != tuple(shape):
                    raise ConvertError(f"{found[k][0]}: {k} has shape {tuple(found[k][2])} but {CONFIG} implies "
                                       f"{tuple(shape)}", "config.json and the weights disagree; use the config "
                                       "saved with these weights")
            twins = tuple((found[k][0], k) for k in copies.get(key, ()))
            if key in quantized:
                dtype = self.options.dtype or torch.bfloat16  # dequantized on read
            chunks.append(SourceChunk(id=len(chunks), file=f, key=key, shape=shape, dtype=dtype, pieces=pieces,
                                      offsets=(0,) * len(shape), sliceable=True, twins=twins,
                                      quant=quantized.get(key)))
        dtype = hf_dtype(hf)
        for sc in SCHEMES.values():
            n = sum(1 for c in chunks if c.quant is not None and c.quant.scheme == sc.name)
            if n:
                notes.append(f"dequantized {n} {sc.what} weights to "
                             f"{str(self.options.dtype or torch.bfloat16).removeprefix('torch.')} on read")
                dtype = self.options.dtype or torch.bfloat16
        args = model_args(cfg, dtype, tokenizer_type=HF_TOKENIZER)
        origin = Origin(kind=self.name, hf_config=copy.deepcopy(hf), tokenizer=path.resolve(),  # as the file holds it
                        hf_stored=sets or None)
        return policy.finish(SourceIndex(format=self.name, iter_dir=path, iteration="release", args=args, cfg=cfg,
                                         layout=Layout(tp=1, pp=1), chunks=chunks, notes=notes, origin=origin))

    def read(self, index: SourceIndex, chunks: list[SourceChunk]) -> dict[int, torch.Tensor]:
        by_file: dict[str, list[tuple[SourceChunk, str, Box]]] = {}
        for c in chunks:
            box = Box(c.offsets or (0,) * len(c.shape), c.shape)
            if c.quant is None:
                by_file.setdefault(c.file, []).append((c, c.key, box))
                continue
            for (f, key), b in zip(c.quant.parts, scheme_of(c.quant).boxes(c.quant, box), strict=True):
                by_file.setdefault(f, []).append((c, key, b))  # each part's slice, dequantized below
        raw: dict[tuple[int, str], torch.Tensor] = {}
        for f, group in by_file.items():
            for (c, key, _), t in zip(group, read_boxes(index.iter_dir / f, [(k, b) for _, k, b in group]),
                                      strict=True):
                raw[(c.id, key)] = t
        for c in chunks:
            for f, key in c.twins:
                if not torch.equal(read_boxes(index.iter_dir / f, [(key, Box(c.offsets or (0,) * len(c.shape),
                                                                             c.shape))])[0], raw[(c.id, c.key)]):
                    raise ConvertError(f"{key} ({f}) differs from {c.key}, of which the release stores it as a copy",
                                       "the checkpoint is inconsistent; re-download it")
        out: dict[int, torch.Tensor] = {}
        for c in chunks:
            if c.quant is None:
                out[c.id] = raw[(c.id, c.key)]
                continue
            with phase("decode"):
                out[c.id] = scheme_of(c.quant).dequantize(c.quant, [raw[(c.id, k)] for _, k in c.quant.parts],
                                                          Box(c.offsets or (0,) * len(c.shape), c.shape), c.dtype)
        return out

    def target_files(self, target: Target, dtypes: dict[str, torch.dtype]) -> list[TargetFile]:
        base = target.origin.hf_config
        hf_from_config(target.cfg, target.dtype or torch.float32, base)  # refuses inexpressible models
        fam = export_family(target.cfg, base)
        tensors = {name: TargetTensor(key=name, shape=shape, dtype=target_dtype(target, dtypes, pieces[0].logical),
                                      pieces=pieces)
                   for name, (shape, pieces) in hf_tensors(target.cfg, fam, target.origin.hf_stored).items()}
        if self.options.quantize:
            WRITERS[self.options.quantize].check_target({n: t.shape for n, t in tensors.items()}, fam.architecture)
            tensors = {n: replace(t, stored_bytes=sum(b for _, b in self._stored_sizes(t))) for n, t in tensors.items()}
        shards = pack_shards([(n, t.stored_nbytes) for n, t in tensors.items()], self.options.max_shard_size,
                             lambda n: unit_key(self._scheme(), tensors[n]))
        names = [SINGLE] if len(shards) == 1 else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                                                   for i in range(len(shards))]
        return [TargetFile(id=i, name=name, tensors=[tensors[n] for n in shard]) for i, (name, shard) in
                enumerate(zip(names, shards, strict=True))]

    def open_writer(self, target: Target, out_dir: Path, files: list[TargetFile], rt: Runtime) -> ShardWriter:
        def record(f: TargetFile) -> dict[str, Any]:
            # what finalize needs of the file (it keeps no state between calls): its stored names and dtypes
            return {"stored": [[k, n] for t in f.tensors for k, n in self._stored_sizes(t)],
                    "dtypes": sorted({str(t.dtype).removeprefix("torch.") for t in f.tensors})}

        return ShardWriter(out_dir, files, self._scheme(), record)

    def _scheme(self) -> Writer | None:
        return WRITERS[self.options.quantize] if self.options.quantize else None

    def _stored_sizes(self, t: TargetTensor) -> list[tuple[str, int]]:
        """(name, bytes) of what the file holds for target tensor ``t``."""
        sc = self._scheme()
        return sc.stored_sizes(t.key, t.shape, t.dtype) if sc and sc.quantizable(t.key, t.shape) else \
            [(t.key, t.nbytes)]

    def finalize(self, target: Target, out_dir: Path, written: list[WrittenFile]) -> None:
        """Rank 0: the shard index, config.json and tokenizer files (from what the writers recorded of each file)."""
        dtypes = {getattr(torch, d) for w in written for d in w.record.get("dtypes", ())}
        dtype = dtypes.pop() if len(dtypes) == 1 else (target.dtype or torch.float32)
        if len(written) > 1:
            stored = [(w.name, k, n) for w in written for k, n in w.record["stored"]]
            weight_map = {k: name for name, k, _ in stored}
            total = sum(n for _, _, n in stored)
            write_durable(out_dir / INDEX, json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                      indent=2))
        model_id = target.origin.hf_model_id  # Megatron-Bridge: the HF model it was imported from
        for d in (tokenizer_source(target.origin, self.options.tokenizer_dir),
                  Path(model_id) if model_id is not None and Path(model_id).is_dir() else None):
            if d is not None:
                copy_tokenizer_files(d, out_dir)
        hf = hf_from_config(target.cfg, dtype, target.origin.hf_config)
        if self.options.quantize:
            fam = export_family(target.cfg, target.origin.hf_config)
            shapes = {n: shape for n, (shape, _) in hf_tensors(target.cfg, fam, target.origin.hf_stored).items()}
            hf["quantization_config"] = WRITERS[self.options.quantize].quantization_config(shapes)
            for name, text in WRITERS[self.options.quantize].side_files(shapes).items():
                write_durable(out_dir / name, text)
        else:
            hf.pop("quantization_config", None)  # dequantized on read: the target holds plain weights
        write_durable(out_dir / CONFIG, json.dumps(hf, indent=2))


    def package(self, tmp: Path, dst: Path) -> Path:
        return tmp
