"""Legacy Megatron checkpoints: ``iter_NNNNNNN/mp_rank_TT[_PPP]/model_optim_rng.pt`` per rank.

Layer numbers are local to each pipeline stage; ``args`` (an argparse Namespace) holds the config.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch

from ..config import ModelConfig, config_from_args
from ..errors import ConvertError
from ..layout.boxes import Piece, local_pieces, mcore_global_shape
from ..layout.rules import EMBEDDING, EXTRA_STATE_MODULES, LAYER_PREFIX, OUTPUT, logical_tensors, spec_suffix
from ..runtime import Runtime
from ..safe_load import load_pt
from ..topology import Layout
from .base import (IterDirFormat, SourceChunk, SourceIndex, Target, TargetFile, TargetTensor,
                   check_piece_shapes)

_RANK_RE = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
MODEL_FILE = "model_optim_rng.pt"
CHECKPOINT_VERSION = 3.0


def rank_dir_name(tp_rank: int, pp_rank: int, pp: int) -> str:
    return f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def _looks_like(path: Path) -> bool:
    return path.is_dir() and any(_RANK_RE.match(p.name) for p in path.iterdir() if p.is_dir())


def rank_entries(cfg: ModelConfig, layout: Layout, tp_rank: int, pp_rank: int,
                 spec: str) -> dict[str, tuple[tuple[int, ...], list[Piece]]]:
    """Pure: every tensor a legacy rank file holds: key -> (local shape, pieces)."""
    tensors = logical_tensors(cfg)
    sizes = layout.stage_sizes(cfg.num_layers)
    offset = sum(sizes[:pp_rank])
    first, last = pp_rank == 0, pp_rank == layout.pp - 1
    out: dict[str, tuple[tuple[int, ...], list[Piece]]] = {}

    def add(key: str, name: str) -> None:
        t = tensors[name]
        gshape = mcore_global_shape(t.kind, t.shape, cfg.padded_vocab(layout.tp))
        out[key] = local_pieces(name, t.kind, gshape, t.shape[0], tp_rank, layout.tp)

    for name, t in tensors.items():
        if t.layer is not None:
            if offset <= t.layer < offset + sizes[pp_rank]:
                add(f"{LAYER_PREFIX}{t.layer - offset}.{spec_suffix(t, spec)}", name)
        elif (t.stage == "first" and first) or (t.stage == "last" and last):
            add(name, name)
    if last and cfg.tied and layout.pp > 1:  # the last stage keeps a copy of the tied embedding
        add(OUTPUT, EMBEDDING)
    return out


def extra_state_keys(cfg: ModelConfig, layout: Layout, pp_rank: int, spec: str) -> list[str]:
    sizes = layout.stage_sizes(cfg.num_layers)
    keys = [f"{LAYER_PREFIX}{i}.{m}._extra_state" for i in range(sizes[pp_rank]) for m in EXTRA_STATE_MODULES[spec]]
    if pp_rank == layout.pp - 1:
        keys.append("output_layer._extra_state")
    return keys


def _index_file(path: Path, trust_pickle: bool) -> dict[str, Any]:
    try:
        ckpt = load_pt(path, trust_pickle)
        if not isinstance(ckpt, dict) or "model" not in ckpt:
            keys = sorted(ckpt)[:5] if isinstance(ckpt, dict) else type(ckpt).__name__
            if isinstance(ckpt, dict) and "model0" in ckpt:
                raise ConvertError(f"{path} holds virtual pipeline chunks (model0, model1, ...)",
                                   "virtual pipeline layouts are not supported yet; convert from a non-VPP checkpoint")
            raise ConvertError(f"{path} has no 'model' entry (found {keys})",
                               "point SRC at a Megatron checkpoint saved with its model state")
        model = ckpt["model"]
        # TE keeps FP8 metadata in `_extra_state` (bytes or uint8 tensors): state, not weights
        tensors = {k: (tuple(v.shape), v.dtype) for k, v in model.items()
                   if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}
        objects = [k for k in model if k not in tensors]
        return {"args": ckpt.get("args"), "iteration": ckpt.get("iteration"), "tensors": tensors,
                "objects": objects}
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
        coords: dict[tuple[int, int], str] = {}
        for d in sorted(p for p in iter_dir.iterdir() if p.is_dir()):
            m = _RANK_RE.match(d.name)
            if not m:
                continue
            if m.group(3) is not None:
                raise ConvertError(f"{d.name} is an expert-parallel rank directory",
                                   "MoE / expert-parallel checkpoints are not supported yet")
            coords[(int(m.group(1)), int(m.group(2) or 0))] = f"{d.name}/{MODEL_FILE}"
        tp = 1 + max(t for t, _ in coords)
        pp = 1 + max(p for _, p in coords)
        for t in range(tp):
            for p in range(pp):
                if (t, p) not in coords:
                    raise ConvertError(f"rank directory {rank_dir_name(t, p, pp)} is missing in {iter_dir}",
                                       "copy the complete checkpoint (every mp_rank_* directory)")
                if not (iter_dir / coords[(t, p)]).is_file():
                    raise ConvertError(f"{iter_dir / coords[(t, p)]} is missing",
                                       "copy the complete checkpoint (each rank directory needs its model file)")
        order = sorted(coords, key=lambda c: (c[1], c[0]))
        mine = {c: _index_file(iter_dir / coords[c], self.trust_pickle) for c in order[rt.rank::rt.world]}
        files: dict[tuple[int, int], dict[str, Any]] = {}
        for part in rt.all_gather_object(mine):
            files.update(part)
        for c in order:
            if "error" in files[c]:
                raise ConvertError(files[c]["error"])
        args = files[(0, 0)]["args"]
        if args is None:
            raise ConvertError(f"{iter_dir / coords[(0, 0)]} has no args",
                               "the checkpoint must be saved by Megatron-LM")
        spec = "te" if any("layer_norm_weight" in k for k in files[(0, 0)]["tensors"]) else "local"
        cfg = config_from_args(args, vocab_size, spec, tp)
        layout = Layout(tp, pp, getattr(args, "decoder_first_pipeline_num_layers", None) if pp > 1 else None,
                        getattr(args, "decoder_last_pipeline_num_layers", None) if pp > 1 else None)
        layout.validate(cfg.num_layers, cfg.num_attention_heads, cfg.num_query_groups, cfg.ffn_hidden_size, "source")
        chunks: list[SourceChunk] = []
        for c in order:
            rel = coords[c]
            expected = rank_entries(cfg, layout, c[0], c[1], spec)
            have = files[c]["tensors"]
            unknown = sorted(set(have) - set(expected))
            missing = sorted(set(expected) - set(have))
            if unknown:
                raise ConvertError(f"{rel}: unexpected tensors {unknown[:3]}{' ...' if len(unknown) > 3 else ''}",
                                   "the args do not describe this model (or it is not a GPT model); check the "
                                   "source checkpoint's args")
            if missing:
                raise ConvertError(f"{rel}: missing tensors {missing[:3]}{' ...' if len(missing) > 3 else ''}",
                                   "the rank file is incomplete or from another model; re-copy the checkpoint")
            for key, (shape, pieces) in expected.items():
                check_piece_shapes(key, rel, shape, have[key][0])
                chunks.append(SourceChunk(len(chunks), rel, key, shape, have[key][1], pieces))
        return SourceIndex(self.name, iter_dir, iteration, args, cfg, layout, chunks)

    def read(self, index: SourceIndex, chunks: list[SourceChunk]) -> dict[int, torch.Tensor]:
        out: dict[int, torch.Tensor] = {}
        by_file: dict[str, list[SourceChunk]] = {}
        for c in chunks:
            by_file.setdefault(c.file, []).append(c)
        for rel, group in by_file.items():
            model = load_pt(index.iter_dir / rel, self.trust_pickle)["model"]
            for c in group:
                out[c.id] = model[c.key]
        return out

    def target_files(self, target: Target, dtypes: dict[str, torch.dtype]) -> list[TargetFile]:
        cfg, layout = target.cfg, target.layout
        files = []
        for t, p in layout.ranks():
            tensors = []
            for key, (shape, pieces) in rank_entries(cfg, layout, t, p, cfg.spec).items():
                logical = pieces[0].logical if pieces else (OUTPUT if key == OUTPUT and not cfg.tied else EMBEDDING)
                tensors.append(TargetTensor(key, shape, target.dtype or dtypes[logical], pieces))
            objects = {k: None for k in extra_state_keys(cfg, layout, p, cfg.spec)}
            files.append(TargetFile(len(files), f"{rank_dir_name(t, p, layout.pp)}/{MODEL_FILE}", tensors, objects))
        return files

    def write(self, target: Target, iter_dir: Path, files: list[TargetFile],
              data: dict[tuple[int, int], torch.Tensor], rt: Runtime) -> None:
        for f in files:
            model: dict[str, Any] = {t.key: data[(f.id, j)] for j, t in enumerate(f.tensors)}
            model.update(f.objects)
            path = iter_dir / f.name
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "wb") as fh:
                torch.save({"model": model, "args": target.args, "checkpoint_version": CHECKPOINT_VERSION,
                            "iteration": 0 if target.iteration == "release" else target.iteration}, fh)
                fh.flush()
                os.fsync(fh.fileno())  # durable before the tracker and the rename make it visible

    def finalize(self, target: Target, iter_dir: Path, rt: Runtime) -> None:
        return None
