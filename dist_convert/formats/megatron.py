"""Legacy Megatron checkpoints: ``iter_NNNNNNN/mp_rank_TT[_PPP]/model_optim_rng.pt`` per rank.

Layer numbers are local to each pipeline stage; ``args`` (an argparse Namespace) holds the config.
"""
from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ..config import ModelConfig, config_from_args
from ..datamodel import (
    ORIGIN_KEY,
    SourceChunk,
    SourceIndex,
    Target,
    TargetFile,
    TargetTensor,
    WrittenFile,
    target_dtype,
)
from ..errors import ConvertError
from ..layout.hybrid import HYBRID_MTP_LAYERS, hybrid, mtp_layer_prefix
from ..layout.mlp import expert_modules, is_grouped_expert_key
from ..layout.mtp import MTP_LAYER
from ..layout.rank_files import chunk_key, rank_entries, split_chunk_key
from ..layout.rules import (
    EMBEDDING,
    OUTPUT_MODULES,
    extra_state_modules,
    logical_tensors,
    model_family,
    top_extra_state_modules,
)
from ..layout.topology import Layout
from ..optim import sources as optim_sources
from ..optim.state import COUNTERS
from ..runtime import Runtime
from ..safe_load import load_pt
from .base import (
    COMMON_TRAINING_STATE,
    IterDirFormat,
    KeyPolicy,
    add_rank_file_chunks,
    dropped_state_note,
    read_origin,
)
from .torch_zip import SavedFiles

_RANK_RE = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
MODEL_FILE = "model_optim_rng.pt"
DISTRIB_OPTIM = "distrib_optim.pt"  # the distributed optimizer's parameter state, next to MODEL_FILE
CHECKPOINT_VERSION = 3.0


def rank_dir_name(tp_rank: int, pp_rank: int, pp: int, ep_rank: int = 0, ep: int = 1) -> str:
    """Megatron-LM's ``mp_rank_TT[_PPP][_EEE]``: the pipeline part only with PP > 1, the expert part
    only with EP > 1."""
    return (f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else "")
            + (f"_{ep_rank:03d}" if ep > 1 else ""))


def parse_rank_dir(name: str, pp: int, ep: int) -> tuple[int, int, int] | None:
    """(tp, pp, ep) rank of a rank directory name, given the PP and EP sizes from the args (the name
    alone is ambiguous: ``mp_rank_00_001`` is pipeline rank 1 with EP=1, expert rank 1 with PP=1);
    None when the name does not fit those sizes."""
    m = _RANK_RE.match(name)
    if m is None:
        return None
    parts = [int(g) for g in m.groups()[1:] if g is not None]
    if len(parts) != (pp > 1) + (ep > 1):
        return None
    p = parts.pop(0) if pp > 1 else 0
    e = parts.pop(0) if ep > 1 else 0
    return int(m.group(1)), p, e


def _looks_like(path: Path) -> bool:
    return path.is_dir() and any(_RANK_RE.match(p.name) for p in path.iterdir() if p.is_dir())


MTP_LEGACY = "mtp_model_layer."  # megatron-core >= 0.17's state_dict name of MTP_LAYER
# megatron-core 0.19's state_dict names of a Mamba2 mixer's convolution (torch_dist keys keep the old ones): a
# target of style "0.19" is written with them, a source is read with either
STYLE_019 = ((".mixer.conv1d.weight", ".mixer.conv1d_weight"), (".mixer.conv1d.bias", ".mixer.conv1d_bias"))


def key_in_style(key: str, style: str) -> str:
    """A state-dict key (0.16 naming) as megatron-core of ``style`` names it."""
    for old, new in STYLE_019 if style == "0.19" else ():
        if key.endswith(old):
            return key[:-len(old)] + new
    return key


def key_from_019(key: str) -> str:
    for old, new in STYLE_019:
        if key.endswith(new):
            return key[:-len(new)] + old
    return key


def _mla_down_split(cfg: ModelConfig, stored: dict[str, tuple[tuple[int, ...], Any]]) -> bool:
    """Whether a legacy TP rank file holds a TP slice of MLA's kv down-projection (the local spec and
    Transformer Engine specs before ``duplicated`` TELinear) rather than all of it: its stored shape tells."""
    if not cfg.mla:
        return False
    rows = cfg.mla.kv_lora_rank + cfg.mla.qk_pos_emb_head_dim
    shapes = [shape for k, (shape, _) in stored.items() if k.endswith(".self_attention.linear_kv_down_proj.weight")]
    return bool(shapes) and shapes[0][0] != rows


def extra_state_keys(cfg: ModelConfig, layout: Layout, pp_rank: int, spec: str) -> list[str]:
    keys = []
    experts = expert_modules(cfg, cfg.num_experts // layout.ep) if cfg.num_experts else ()
    for p, vp, stack, off, count in layout.stack_chunks(cfg.stacks):
        if p != pp_rank:
            continue
        for i in range(count):
            mods = extra_state_modules(cfg, stack, spec, off + i)
            inner = mtp_layer_prefix(cfg, "self_attention") if stack == "mtp" else ""
            if hybrid(cfg) and cfg.layer_kind(stack, off + i)[0] == "attention":  # TE's attention core: state_dict
                mods += (inner + "self_attention.core_attention",)               # only (no torch_dist object)
            if cfg.layer_is_moe(stack, off + i):
                mods += tuple(mtp_layer_prefix(cfg, m) + m for m in experts) if stack == "mtp" else experts
            keys += [chunk_key(f"{stack}.layers.{i}.{m}._extra_state", vp, layout) for m in mods]
        if pp_rank == layout.pp - 1 and vp == layout.chunks_per_rank - 1:
            keys += [chunk_key(f"{m}._extra_state", vp, layout)
                     for m in OUTPUT_MODULES[cfg.family] + top_extra_state_modules(cfg)]
    return keys


def rank_target_files(target: Target, dtypes: dict[str, torch.dtype], file_name: Callable[[int, int, int], str],
                      prefix: str = "") -> list[TargetFile]:
    """Pure: one file per (tp, pp, ep) rank holding its state-dict tensors (keys after ``prefix``)."""
    cfg, layout = target.cfg, target.layout
    names = {a: n for n, t in logical_tensors(cfg).items() for a in (n,) + t.aliases}
    files = []
    for t, p, e in [(t, p, e) for e in range(layout.ep) for t, p in layout.ranks()]:
        tensors = []
        for key, (shape, pieces) in rank_entries(cfg, layout, t, p, cfg.spec, e).items():
            # a rank holding only vocabulary padding rows has no pieces: its dtype is its tensor's (a tied
            # copy's is the embedding's)
            logical = pieces[0].logical if pieces else names.get(split_chunk_key(key)[1], EMBEDDING)
            tensors.append(TargetTensor(key=prefix + key, shape=shape, dtype=target_dtype(target, dtypes, logical),
                                        pieces=pieces))
        objects = {prefix + k: None for k in extra_state_keys(cfg, layout, p, cfg.spec)}
        files.append(TargetFile(id=len(files), name=file_name(t, p, e), tensors=tensors, objects=objects))
    return files


def _index_file(path: Path, trust_pickle: bool) -> dict[str, Any]:
    try:
        ckpt = load_pt(path, trust_pickle)
        entries = sorted((k for k in ckpt if re.fullmatch(r"model\d+", k)), key=lambda k: int(k[5:])) \
            if isinstance(ckpt, dict) else []
        if not isinstance(ckpt, dict) or ("model" not in ckpt and not entries):
            keys = sorted(ckpt)[:5] if isinstance(ckpt, dict) else type(ckpt).__name__
            raise ConvertError(f"{path} has no 'model' entry (found {keys})",
                               "point SRC at a Megatron checkpoint saved with its model state")
        # TE keeps FP8 metadata in `_extra_state` (bytes or uint8 tensors): state, not weights
        tensors, objects, style = {}, [], None
        for entry in entries or ["model"]:
            for k, v in ckpt[entry].items():
                key = f"{entry}/{k}" if entries else k
                if isinstance(v, torch.Tensor) and not k.endswith("_extra_state"):
                    # megatron-core >= 0.17 names an MTP layer's TransformerLayer mtp_model_layer in state_dict (a
                    # HybridModel's MTP depth holds its layers there, mtp_model_layer.layers.N, its native name)
                    gpt = key if "." + HYBRID_MTP_LAYERS in key else key.replace("." + MTP_LEGACY, "." + MTP_LAYER)
                    tensors[key_from_019(gpt)] = (tuple(v.shape), v.dtype)
                    style = "0.19" if key_from_019(key) != key else style
                else:
                    objects.append(key)
        return {"args": ckpt.get("args"), "origin": ckpt.get(ORIGIN_KEY), "iteration": ckpt.get("iteration"),
                "tensors": tensors, "style": style,
                "objects": objects, "chunks": len(entries), "optimizer": ckpt.get("optimizer"),
                "scheduler": ckpt.get("opt_param_scheduler"), "counters": optim_sources.counters(ckpt),
                "training": [k for k in COMMON_TRAINING_STATE if k in ckpt]
                + [DISTRIB_OPTIM] * (path.parent / DISTRIB_OPTIM).is_file()}
    except ConvertError as e:
        return {"error": str(e)}


class MegatronFormat(IterDirFormat):
    name = "megatron"
    looks_like = staticmethod(_looks_like)

    def index(self, path: Path, rt: Runtime, vocab_size: int | None) -> SourceIndex:
        found = self.find(path)
        if found is None:
            raise ConvertError(f"{path} holds no mp_rank_* directories", "pass --src-format matching the checkpoint")
        iter_dir, iteration = found
        names = sorted(p.name for p in iter_dir.iterdir() if p.is_dir() and _RANK_RE.match(p.name))
        for n in names:
            if not (iter_dir / n / MODEL_FILE).is_file():
                raise ConvertError(f"{iter_dir / n / MODEL_FILE} is missing",
                                   "copy the complete checkpoint (each rank directory needs its model file)")
        mine = {n: _index_file(iter_dir / n / MODEL_FILE, self.trust_pickle) for n in names[rt.rank::rt.world]}
        indexed: dict[str, dict[str, Any]] = {}
        for part in rt.all_gather_object(mine):
            indexed.update(part)
        for n in names:
            if "error" in indexed[n]:
                raise ConvertError(indexed[n]["error"])
        args = indexed[names[0]]["args"]
        if args is None:
            raise ConvertError(f"{iter_dir / names[0] / MODEL_FILE} has no args",
                               "the checkpoint must be saved by Megatron-LM")
        origin, args = read_origin(self.name, indexed[names[0]]["origin"], args)
        files = self._rank_files(iter_dir, names, indexed, args)
        tp = 1 + max(t for t, _, _ in files)
        pp = 1 + max(p for _, p, _ in files)
        keys0 = [split_chunk_key(k)[1] for k in files[(0, 0, 0)]["tensors"]]
        legacy_grouped = [k for k in keys0 if k.endswith((".mlp.experts.weight1", ".mlp.experts.weight2"))]
        if legacy_grouped:
            raise ConvertError(f"{files[(0, 0, 0)]['rel']} stores experts as the legacy GroupedMLP "
                               f"({legacy_grouped[0]}: all local experts in one view-reinterpreted matrix), which is "
                               "not supported",
                               "load it in Megatron-LM (--moe-use-legacy-grouped-gemm) and save --ckpt-format "
                               "torch_dist, then convert that")
        spec = "te" if any("layer_norm_weight" in k for k in keys0) else "local"
        cfg = config_from_args(args, vocab_size, spec, tp, model_family(keys0))
        if cfg.moe is not None:
            cfg = cfg.replace(moe__grouped=any(is_grouped_expert_key(k) for k in keys0))
        if cfg.mla is not None:
            cfg = cfg.replace(mla__down_split=cfg.mla.down_split or _mla_down_split(cfg, files[(0, 0, 0)]["tensors"]))
        layout = Layout.from_args(args, tp, pp, encoder_decoder=cfg.t5 is not None, experts=bool(cfg.num_experts))
        if files[(0, 0, 0)]["chunks"] != (layout.vpp or 0):
            raise ConvertError(f"rank files hold {files[(0, 0, 0)]['chunks'] or 'no'} virtual pipeline chunks but "
                               f"the args say virtual_pipeline_model_parallel_size={layout.vpp}",
                               "the args do not match the rank files; check the source checkpoint")
        cfg.check_layout(layout, "source")
        chunks: list[SourceChunk] = []
        policy = KeyPolicy.of(self.options)
        for (t, p, e), f in files.items():  # expert rank 0 first: the other files' copies are replicas
            add_rank_file_chunks(chunks, f["rel"], rank_entries(cfg, layout, t, p, spec, e), f["tensors"],
                                 "the checkpoint's args", policy)
        optimizer = None
        if self.options.optimizer:
            for f in files.values():
                f["order"] = list(f["tensors"])
            found_opt, optimizer = optim_sources.legacy(cfg, layout, args, spec, iter_dir, files,
                                                        lambda path: load_pt(path, self.trust_pickle), rank_entries,
                                                        len(chunks))
            chunks += found_opt
        kept = ("optimizer", "opt_param_scheduler", DISTRIB_OPTIM, *COUNTERS) if optimizer is not None else ()
        found = Counter(k for f in files.values() for k in f["training"] if k not in kept)
        note = dropped_state_note([k if k != DISTRIB_OPTIM or n == 1 else f"{k} ({n} files)" for k, n in found.items()],
                                  optimizer is not None)
        return policy.finish(SourceIndex(format=self.name, iter_dir=iter_dir, iteration=iteration, args=args, cfg=cfg,
                                         layout=layout, chunks=chunks, notes=[note] if note else [],
                                         optimizer=optimizer, origin=origin, style=files[(0, 0, 0)]["style"]))

    @staticmethod
    def _rank_files(iter_dir: Path, names: list[str], indexed: dict[str, dict[str, Any]],
                    args: Any) -> dict[tuple[int, int, int], dict[str, Any]]:
        """The indexed rank files by (tp, pp, ep) rank, ordered expert rank, pipeline rank, tensor rank;
        the args' PP and EP sizes resolve the names (``mp_rank_00_001``: PP rank 1, or EP rank 1)."""
        ep = int(getattr(args, "expert_model_parallel_size", None) or 1)
        pp = int(getattr(args, "pipeline_model_parallel_size", None) or 0) or \
            (2 if any(n.count("_") == 3 + (ep > 1) for n in names) else 1)
        coords: dict[tuple[int, int, int], dict[str, Any]] = {}
        for n in names:
            c = parse_rank_dir(n, pp, ep)
            if c is None:
                raise ConvertError(f"rank directory {n} does not fit PP={pp} EP={ep} from the args",
                                   "remove stray mp_rank_* directories, or check the checkpoint's args")
            coords[c] = {**indexed[n], "rel": f"{n}/{MODEL_FILE}"}
        tp = 1 + max(t for t, _, _ in coords)
        for e in range(ep):
            for p in range(pp):
                for t in range(tp):
                    if (t, p, e) not in coords:
                        raise ConvertError(f"rank directory {rank_dir_name(t, p, pp, e, ep)} is missing in {iter_dir}",
                                           "copy the complete checkpoint (every mp_rank_* directory)")
        return dict(sorted(coords.items(), key=lambda kv: (kv[0][2], kv[0][1], kv[0][0])))

    def read(self, index: SourceIndex, chunks: list[SourceChunk]) -> dict[int, torch.Tensor]:
        out: dict[int, torch.Tensor] = {}
        by_file: dict[str, list[SourceChunk]] = {}
        for c in chunks:
            by_file.setdefault(c.file, []).append(c)
        for rel, group in by_file.items():
            ckpt = load_pt(index.iter_dir / rel, self.trust_pickle)
            if rel.endswith(DISTRIB_OPTIM):  # bucket space: "optimizer/buffer/state" of the coalesced buckets
                out.update((c.id, optim_sources.legacy_range(ckpt, c)) for c in group)
                continue
            for c in group:
                entry, key = split_chunk_key(c.key)
                stored = ckpt[entry]
                out[c.id] = stored[key] if key in stored else stored[key_in_style(key, "0.19")] \
                    if key_in_style(key, "0.19") in stored else stored[key.replace("." + MTP_LAYER, "." + MTP_LEGACY)]
        return out

    def target_files(self, target: Target, dtypes: dict[str, torch.dtype]) -> list[TargetFile]:
        lay = target.layout
        files = rank_target_files(target, dtypes,
                                  lambda t, p, e: f"{rank_dir_name(t, p, lay.pp, e, lay.ep)}/{MODEL_FILE}")
        style = self.options.torch_dist_style or target.style or "0.16"
        return [replace(f, tensors=[replace(t, key=key_in_style(t.key, style)) for t in f.tensors]) for f in files]

    def open_writer(self, target: Target, iter_dir: Path, files: list[TargetFile], rt: Runtime) -> SavedFiles:
        lay = target.layout
        chunk_entries = [f"model{v}" for v in range(lay.vpp)] if lay.vpp else ["model"]
        origin = target.origin.record()  # in every rank file, as the args are (Megatron-LM leaves it alone)

        def rank_file(f: TargetFile, tensors: list[torch.Tensor]) -> dict[str, Any]:
            # every model chunk has its entry, an empty one too (a layout string's stage with no layers)
            entries: dict[str, dict[str, Any]] = {e: {} for e in chunk_entries}
            for key, value in [(t.key, x) for t, x in zip(f.tensors, tensors, strict=True)] + list(f.objects.items()):
                entry, k = split_chunk_key(key)
                entries.setdefault(entry, {})[k] = value
            return {**entries, "args": target.args, "checkpoint_version": CHECKPOINT_VERSION,
                    "iteration": 0 if target.iteration == "release" else target.iteration, ORIGIN_KEY: origin}
        return SavedFiles(iter_dir, files, rank_file)

    def finalize(self, target: Target, iter_dir: Path, written: list[WrittenFile]) -> None:
        return None
