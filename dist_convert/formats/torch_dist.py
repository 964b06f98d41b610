"""megatron-core dist checkpoints (torch_dist): a torch.distributed.checkpoint directory
(``.metadata``, ``__R_I.distcp``) plus ``metadata.json`` (written last), in Megatron-LM's
``iter_NNNNNNN/`` layout. Layer tensors are stacked: one key per module, a leading global layer axis.

The common (unsharded) state (``args``, ``iteration``, ...) is ``common.pt`` up to megatron-core 0.18
("0.16" style; every release 0.14-0.20 loads it) and the DCP bytes item ``common_state/shard_0_1``
holding ``torch.save([dict])`` from 0.19 on ("0.19" style; 0.19+ only). Both are read; a target is
written in the source's style unless ``--torch-dist-style`` says otherwise.
"""
from __future__ import annotations

import argparse
import io
import json
import math
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from ..config import config_from_args
from ..datamodel import (
    ORIGIN_KEY,
    Origin,
    SourceChunk,
    SourceIndex,
    Target,
    TargetFile,
    TargetTensor,
    WrittenFile,
    numel,
    row_axis,
    target_dtype,
)
from ..durable import save_durable, write_durable
from ..errors import ConvertError
from ..layout.boxes import Box, Kind, mcore_global_shape, tp_chunks
from ..layout.rules import (
    OUTPUT_MODULES,
    holders,
    model_family,
    per_layer_keys,
    top_extra_state_modules,
)
from ..layout.topology import Layout
from ..layout.vision import LM_PREFIX, vision_objects
from ..optim import sources as optim_sources
from ..optim.state import COUNTERS, optimizer_tensors, renamed
from ..runtime import Runtime
from ..safe_load import load_pt
from .base import (
    COMMON_TRAINING_STATE,
    HOLDS_ALL,
    IterDirFormat,
    KeyPolicy,
    dropped_state_note,
    on_rank0,
    read_origin,
)
from .dcp_meta import MetadataIndex, TensorStorageMetadata
from .dist_keys import (
    POST_NORM_KEYS,
    DistGroup,
    block_pieces,
    dist_groups,
    expert_objects,
    layer_objects,
    spec_from_keys,
)
from .distcp import (
    ItemFileWriter,
    StoredTensor,
    check_storage,
    load_metadata,
    locate,
    read_object,
    write_metadata,
)

COMMON = "common.pt"
COMMON_ITEM = "common_state/shard_0_1"  # megatron-core >= 0.19: the common state inside the DCP
CONFIG = "metadata.json"
STYLES = ("0.16", "0.19")  # where the common state lives: common.pt, or the COMMON_ITEM
CHECKPOINT_VERSION = 3.0
# What a training run leaves besides the model (stored key prefix -> name in the note): read past, never
# converted. An MoE model's ChainedOptimizer prefixes each optimizer's keys with chained_{k}.
TRAINING_STATE = {"optimizer.": "optimizer", "chained_": "optimizer", "rng_state": "rng_state",
                  "rerun_state_machine_state": "rerun_state_machine_state"}


def _looks_like(path: Path) -> bool:
    """A torch_dist iteration directory, finished or not (an unfinished save lacks metadata.json, which
    megatron-core writes last, and maybe ``.metadata``, which DCP writes last: ``index`` refuses those).
    ``.metadata`` with neither metadata.json nor common.pt is a plain DCP (fsdp_dtensor) unless it holds
    megatron-core 0.19's common state item."""
    if not path.is_dir():
        return False
    if (path / CONFIG).is_file() or (path / COMMON).is_file():
        return True
    if not (path / ".metadata").is_file():
        return any(path.glob("__*_*.distcp"))
    try:
        return COMMON_ITEM in load_metadata(path).state_dict_metadata
    except ConvertError:
        return False


def unfinished_save(iter_dir: Path) -> ConvertError:
    return ConvertError(f"{iter_dir} has no {CONFIG}: megatron-core writes it last, so this save (async, or "
                        "interrupted) never finished",
                        "wait for the save to finish, or convert the last complete iteration (the one "
                        "latest_checkpointed_iteration.txt names)")


def read_common(iter_dir: Path, md: Any, trust_pickle: bool) -> tuple[dict[str, Any], str]:
    """The common state dict and the style it was stored in ("0.16": common.pt, "0.19": the DCP item)."""
    if (iter_dir / COMMON).is_file():
        common, style, where = load_pt(iter_dir / COMMON, trust_pickle, mmap=False), "0.16", iter_dir / COMMON
    else:
        loaded, where = read_object(iter_dir, md, COMMON_ITEM, trust_pickle), iter_dir / COMMON_ITEM
        if loaded is None:
            raise ConvertError(f"{iter_dir} has neither {COMMON} nor the DCP item {COMMON_ITEM} (the common state "
                               "with args)", "the checkpoint is incomplete or not saved by megatron-core; re-copy it")
        common, style = (loaded[0] if isinstance(loaded, list | tuple) and loaded else loaded), "0.19"
    if not isinstance(common, dict):
        raise ConvertError(f"the common state in {where} is a {type(common).__name__}, not a dict",
                           "the checkpoint is corrupt or not saved by megatron-core; re-copy it")
    return common, style


def training_state_note(keys: Iterable[str], common: dict[str, Any], kept: bool = False,
                        loads: str | None = None) -> str | None:
    """One line on the training state the source holds and a conversion drops (None: none); ``kept``:
    the optimizer state (and its scheduler) is converted, not dropped; ``loads``: see ``dropped_state_note``."""
    counts: Counter[str] = Counter()
    for k in keys:
        for prefix, name in TRAINING_STATE.items():
            if k.startswith(prefix) and not (kept and name == "optimizer"):
                counts[name] += 1
    sharding = (common.get("content_metadata") or {}).get("distrib_optim_sharding_type")
    parts = [f"{name} ({n} items{f', {sharding}' if name == 'optimizer' and sharding else ''})"
             for name, n in counts.items()]
    kept_common = ("optimizer", "opt_param_scheduler", *COUNTERS) if kept else ()
    return dropped_state_note(parts + [k for k in COMMON_TRAINING_STATE
                                       if k in common and k not in counts and k not in kept_common], kept, loads)


def open_weights(iter_dir: Path, trust_pickle: bool) -> tuple[Any, dict[str, Any], str]:
    """A finished megatron-core save's DCP metadata, common state and style; refuses ModelOpt and
    unfinished saves."""
    if (iter_dir / "modelopt_state").is_dir():
        raise ConvertError(f"{iter_dir} is a ModelOpt checkpoint (modelopt_state/): its draft modules and "
                           "per-layer base keys only load into a model converted by ModelOpt",
                           "restore it with megatron-core + ModelOpt, or convert the base checkpoint it came from")
    if not (iter_dir / CONFIG).is_file() or not (iter_dir / ".metadata").is_file():
        raise unfinished_save(iter_dir)
    md = load_metadata(iter_dir, trust_pickle)
    check_storage(iter_dir, md)
    common, style = read_common(iter_dir, md, trust_pickle)
    return md, common, style


class StreamWriter:
    """One ``__<file id>_0.distcp`` per target file, opened at its first tensor (objects go first);
    each tensor is appended as soon as it is complete, or its blob is laid out at its first row block
    and each block written in place as it completes; the file is closed (fsynced) with its last."""

    def __init__(self, iter_dir: Path, files: list[TargetFile]) -> None:
        self.iter_dir, self.files = iter_dir, files
        self.open: dict[int, ItemFileWriter] = {}
        self.left = {f.id: len(f.tensors) for f in files}
        self.rows_left: dict[tuple[int, int], tuple[int, int]] = {}  # (file, tensor) -> (data offset, rows due)

    def _file(self, f: TargetFile) -> ItemFileWriter:
        if f.id not in self.open:
            w = self.open[f.id] = ItemFileWriter(self.iter_dir, f"__{f.id}_0.distcp")
            for key, obj in f.objects.items():
                buf = io.BytesIO()
                torch.save(obj, buf)  # megatron-core stores ShardedObjects as torch.save([data, ...])
                w.put_bytes(key, buf.getvalue())
        return self.open[f.id]

    def _done(self, f: TargetFile) -> WrittenFile:
        w = self.open.pop(f.id)
        w.close()
        return WrittenFile(file=f.id, name=w.rel, record={"items": w.items}, sha256=w.sha256)

    def _tensor_done(self, f: TargetFile) -> list[WrittenFile]:
        self.left[f.id] -= 1
        return [] if self.left[f.id] else [self._done(f)]

    def put(self, file: TargetFile, j: int, tensor: torch.Tensor) -> list[WrittenFile]:
        t = file.tensors[j]
        assert t.offsets is not None and t.global_shape is not None
        self._file(file).put_tensor(t.key, t.offsets, t.global_shape, tensor)
        return self._tensor_done(file)

    def put_rows(self, file: TargetFile, j: int, first_row: int, block: torch.Tensor) -> list[WrittenFile]:
        """Rows ``first_row ...`` of tensor ``j`` along its row axis (datamodel.row_axis; blocks in any order;
        the tensor is done with its last row)."""
        t = file.tensors[j]
        assert t.offsets is not None and t.global_shape is not None
        d = row_axis(t.shape)
        assert d is not None, t.shape
        w = self._file(file)
        key = (file.id, j)
        if key not in self.rows_left:
            self.rows_left[key] = (w.reserve_tensor(t.key, t.offsets, t.global_shape, t.shape, t.dtype), t.shape[d])
        data_at, due = self.rows_left[key]
        w.write_data(data_at, first_row * (t.nbytes // t.shape[d]), block)
        if due - block.shape[d]:
            self.rows_left[key] = (data_at, due - block.shape[d])
            return []
        del self.rows_left[key]
        return self._tensor_done(file)

    def close(self) -> list[WrittenFile]:
        """The files without tensors (objects only)."""
        out = []
        for f in self.files:
            assert not self.left[f.id], f"{f.name}: {self.left[f.id]} tensors never arrived"
            if not f.tensors:
                self._file(f)
                out.append(self._done(f))
        return out


class TorchDistFormat(IterDirFormat):
    name = "torch_dist"
    looks_like = staticmethod(_looks_like)
    any_writer = True
    row_blocks = True  # StreamWriter.put_rows
    holds = HOLDS_ALL  # a vision tower under vision_model., the language model under language_model. (Bridge's)
    writes_dcp = True  # a .metadata: dcp_meta.writer_note at start-up
    prefix = ""  # of every model key (NeMo 2: "module.")

    def __init__(self, options=None) -> None:
        super().__init__(options)
        self._storage: dict[Path, dict] = {}
        self._located: dict[Path, dict] = {}

    def index(self, path: Path, rt: Runtime, vocab_size: int | None) -> SourceIndex:
        return on_rank0(rt, lambda: self._index(path, vocab_size))

    def _index(self, path: Path, vocab_size: int | None) -> SourceIndex:
        found = self.find(path)
        if found is None:
            raise ConvertError(f"{path} is not a {self.name} checkpoint (no .metadata)", "pass the right --src-format")
        iter_dir, iteration = found
        md, common, style = open_weights(iter_dir, self.trust_pickle)
        args = common.get("args")
        if args is None:
            raise ConvertError(f"the common state of {iter_dir} holds no args",
                               "the checkpoint must be saved by Megatron-LM (args in the common state); a "
                               "Megatron-Bridge or NeMo 2 checkpoint is read with --src-format bridge or nemo2")
        origin, args = read_origin(self.name, common.get(ORIGIN_KEY), args)
        return self.index_weights(iter_dir, iteration, md, common, style, args, vocab_size, origin)

    def index_weights(self, iter_dir: Path, iteration: int | str, md: Any, common: dict[str, Any], style: str,
                      args: argparse.Namespace, vocab_size: int | None, origin: Origin) -> SourceIndex:
        """The index of a megatron-core weights directory whose model is described by ``args`` (keys
        carry ``self.prefix``) and came from ``origin``."""
        if (common.get("content_metadata") or {}).get("singleton_local_shards"):
            raise ConvertError(f"{iter_dir} was saved with singleton_local_shards (per-layer keys)",
                               "this layout is not supported yet; save with megatron-core's default stacked layout")
        tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
        pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
        items = {k: v for k, v in md.state_dict_metadata.items() if not k.startswith(tuple(TRAINING_STATE))}
        foreign = sorted(k for k in items if not k.startswith(self.prefix))
        if foreign and self.prefix:
            raise ConvertError(f"{iter_dir}: keys such as {foreign[0]!r} lack the prefix {self.prefix!r} that "
                               f"{self.name} model weights carry", "this is not a NeMo 2 model's weights/ directory; "
                               "convert it with --src-format torch_dist, or re-copy the checkpoint")
        items = {k.removeprefix(self.prefix): v for k, v in items.items()}
        stored = {k: v for k, v in items.items() if isinstance(v, TensorStorageMetadata)}
        cfg = config_from_args(args, vocab_size, spec_from_keys(items), tp, model_family(set(stored)))
        if not cfg.norm.post_norms and any(k.endswith(POST_NORM_KEYS) for k in stored):
            # the stored modules say so: Megatron-Bridge's Gemma 2/3 spec, whose embedding scales by sqrt(hidden)
            cfg = cfg.replace(norm__post_norms=True, embedding__multiplier=math.sqrt(cfg.hidden_size))
        layout = Layout.from_args(args, tp, pp, encoder_decoder=cfg.t5 is not None, experts=bool(cfg.num_experts))
        cfg.check_layout(layout, "source")
        groups = dist_groups(cfg)
        policy = KeyPolicy.of(self.options)
        chunks = self.group_chunks(iter_dir, stored, groups, policy,
                                   "the args do not describe this model (or it is not a GPT model); check the source")
        index = SourceIndex(format=self.name, iter_dir=iter_dir, iteration=iteration, args=args, cfg=cfg, layout=layout,
                            chunks=chunks, style=style, origin=origin)
        if self.options.optimizer:
            index.optimizer = optim_sources.torch_dist_state(self, index, md, common, groups)
        note = training_state_note(md.state_dict_metadata, common, kept=self.options.optimizer)
        index.notes += [note] if note else []
        return policy.finish(index)

    def group_chunks(self, iter_dir: Path, stored: dict[str, Any], groups: dict[str, DistGroup], policy: KeyPolicy,
                     fix: str) -> list[SourceChunk]:
        """The chunks of the ``stored`` keys (DCP metadata) the torch_dist ``groups`` expect, the keys either side
        lacks reported to ``policy`` (refused unless --ignore-unexpected / --allow-missing say otherwise)."""
        policy.unexpected(str(iter_dir), set(stored) - set(groups), fix)
        policy.missing(str(iter_dir), {k: {t.name for t in g.members.values()} for k, g in groups.items()
                                       if k not in stored}, fix)
        chunks: list[SourceChunk] = []
        for key, g in groups.items():
            if key in stored:
                self.key_chunks(chunks, key, key, g, stored[key])
        return chunks

    def key_chunks(self, chunks: list[SourceChunk], stored_key: str, key: str, g: DistGroup, meta: Any,
                    state: str | None = None) -> None:
        """Append the chunks of one stored key holding the tensors of torch_dist key ``key`` (``state``: an
        optimizer state of them, under the same sharding)."""
        t0 = next(iter(g.members.values()))
        n = len(g.lead)
        expect = g.lead + mcore_global_shape(t0.kind, t0.shape, int(meta.size[n]))
        if tuple(meta.size) != expect or (t0.kind is Kind.VOCAB and meta.size[n] < t0.shape[0]):
            raise ConvertError(f"{stored_key} has global shape {tuple(meta.size)}, expected {expect} from the args",
                               "the args disagree with the stored tensors; pass --vocab-size if the vocabulary "
                               "is the difference, else check the checkpoint")
        for c in meta.chunks:
            box = Box(tuple(c.offsets), tuple(c.sizes))
            pieces = block_pieces(g, box)
            chunks.append(SourceChunk(id=len(chunks), file=self.prefix + stored_key, key=self.prefix + stored_key,
                                      shape=tuple(c.sizes), dtype=meta.properties.dtype,
                                      pieces=renamed(pieces, state) if state else pieces,
                                      offsets=tuple(c.offsets), sliceable=True, contiguous_cuts=True,
                                      origin=tuple(c.offsets), origin_shape=tuple(c.sizes)))

    def read(self, index: SourceIndex, chunks: list[SourceChunk]) -> dict[int, torch.Tensor]:
        """Each chunk's bytes with one positioned read where the item is a plain stored tensor
        (distcp.locate), else through ``dcp.load``."""
        out: dict[int, torch.Tensor] = {}
        fallback = []
        for c in chunks:
            stored = self._locate(index, c) if c.flat is None else None
            if stored is None:
                fallback.append(c)
                continue
            box = Box(tuple(a - b for a, b in zip(c.offsets, c.origin, strict=True)), c.shape)
            try:
                out[c.id] = stored.read(box)
            except (OSError, EOFError) as e:
                raise ConvertError(f"reading {c.key} from {stored.path} failed ({e})",
                                   "a .distcp file is corrupt or truncated; re-copy the checkpoint") from None
        out.update(self._read_dcp(index, fallback))
        return out

    def _locate(self, index: SourceIndex, c: SourceChunk) -> StoredTensor | None:
        """Where chunk ``c``'s stored item lies (cached per item; None: read it through DCP)."""
        cache = self._located.setdefault(index.iter_dir, {})
        key = (c.key, c.origin)
        if key not in cache:
            if index.iter_dir not in self._storage:
                self._storage[index.iter_dir] = load_metadata(index.iter_dir, self.trust_pickle).storage_data
            info = self._storage[index.iter_dir].get(MetadataIndex(c.key, torch.Size(c.origin)))
            cache[key] = locate(index.iter_dir, info, c.origin_shape, c.dtype) if info is not None else None
        return cache[key]

    def _read_dcp(self, index: SourceIndex, chunks: list[SourceChunk]) -> dict[int, torch.Tensor]:
        if not chunks:
            return {}
        from .dcp_read import read_boxes

        # a bucket-space chunk (``flat``) is a range of a stored 1-D tensor, viewed as its parameter's shape
        out = {c.id: torch.empty(c.shape if c.flat is None else (numel(c.shape),), dtype=c.dtype) for c in chunks}
        requests: dict[str, list[tuple[Box, torch.Tensor]]] = {}
        for c in chunks:
            box = Box(c.offsets or (), c.shape) if c.flat is None else Box((c.flat,), (numel(c.shape),))
            requests.setdefault(c.key, []).append((box, out[c.id]))
        read_boxes(index.iter_dir, self.trust_pickle, requests)
        return {c.id: out[c.id].view(c.shape) for c in chunks}

    saves_objects = True  # the _extra_state objects megatron-core saves with the modules (a LoRA adapter: none)

    def target_groups(self, target: Target) -> dict[str, DistGroup]:
        """The torch_dist keys of the target (the model's)."""
        return dist_groups(target.cfg)

    def target_files(self, target: Target, dtypes: dict[str, torch.dtype]) -> list[TargetFile]:
        """One file per target (tp, pp, ep) rank with its main-replica chunks, as megatron-core saves
        them (a routed expert's chunks per expert-TP rank, in the file of its expert rank)."""
        cfg, layout = target.cfg, target.layout
        per_layer = per_layer_keys(cfg)
        stage = {(stack, off + i): p for p, _, stack, off, n in layout.stack_chunks(cfg.stacks) for i in range(n)}
        layers = dict(cfg.stacks)
        ranks = [(t, p, e) for e in range(layout.ep) for p in range(layout.pp) for t in range(layout.tp)]
        tensors: dict[tuple[int, int, int], list[TargetTensor]] = {r: [] for r in ranks}
        objects: dict[tuple[int, int, int], dict[str, Any]] = {r: {} for r in ranks}
        for key, g in self.target_groups(target).items():
            for at, t in g.members.items():
                holder = stage[(t.stack, t.layer)] if t.stage == "layer" else holders(t.stage, layout)[0][0]
                gshape = mcore_global_shape(t.kind, t.shape, cfg.padded_vocab(layout.tp))
                dtype = target_dtype(target, dtypes, t.name)
                degree, ep_rank = (layout.tp, 0) if t.expert is None else \
                    (layout.expert_tp, layout.expert_rank(t.expert, cfg.num_experts))
                for r in range(1 if t.kind is Kind.REP else degree):
                    for c in tp_chunks(t.kind, gshape, r, degree):
                        box = Box(at + c.offsets, (1,) * len(at) + c.sizes)
                        tensors[(r % layout.tp, holder, ep_rank)].append(
                            TargetTensor(key=self.prefix + key, shape=box.sizes, dtype=dtype,
                                         pieces=block_pieces(g, box), offsets=box.offsets,
                                         global_shape=g.lead + gshape))
        for (stack, layer), p in stage.items() if self.saves_objects else ():
            objects[(0, p, 0)].update(layer_objects(cfg, stack, layer, layers[stack], per_layer))
            if cfg.layer_is_moe(stack, layer):
                for e in range(cfg.num_experts):
                    objects[(0, p, layout.expert_rank(e, cfg.num_experts))].update(
                        expert_objects(cfg, stack, layer, layers[stack], e, per_layer))
        for m in top_extra_state_modules(cfg) if self.saves_objects else ():
            objects[(0, layout.pp - 1, 0)][f"{m}._extra_state/shard_0_1"] = [None]
        # GPTModel drops its output layer's _extra_state, T5 and MambaModel keep it
        if self.saves_objects and (cfg.t5 is not None or cfg.mamba is not None):
            for m in OUTPUT_MODULES[cfg.family]:
                objects[(0, layout.pp - 1, 0)][f"{m}._extra_state/shard_0_1"] = [None]
        if self.saves_objects and cfg.vision is not None:  # the language model's under its prefix, then the tower's
            objects = {r: {LM_PREFIX + k: v for k, v in o.items()} for r, o in objects.items()}
            objects[(0, 0, 0)].update(vision_objects(cfg))
        if target.optimizer is not None:  # model-space (fully_reshardable) optimizer state beside each chunk
            for r in ranks:
                tensors[r] += optimizer_tensors(tensors[r], self.prefix)
        return [TargetFile(id=i, name=f"tp{t}_pp{p}" + (f"_ep{e}" if layout.ep > 1 else ""), tensors=tensors[(t, p, e)],
                           objects={self.prefix + k: v for k, v in objects[(t, p, e)].items()})
                for i, (t, p, e) in enumerate(ranks)]

    def open_writer(self, target: Target, iter_dir: Path, files: list[TargetFile], rt: Runtime) -> StreamWriter:
        return StreamWriter(iter_dir, files)

    def common_state(self, target: Target) -> dict[str, Any]:
        """The target's common (unsharded) state: Megatron-LM's args, checkpoint version and iteration, and
        where the model came from (``ORIGIN_KEY``: a key megatron-core and Megatron-LM leave alone)."""
        common = {"args": target.args, "checkpoint_version": CHECKPOINT_VERSION,
                  "iteration": 0 if target.iteration == "release" else target.iteration,
                  ORIGIN_KEY: target.origin.record()}
        if target.optimizer is not None:  # what megatron-core's fully_reshardable save leaves in the common state
            common["optimizer"] = target.optimizer.common()
            if target.optimizer.scheduler is not None:
                common["opt_param_scheduler"] = target.optimizer.scheduler
            common.update(target.optimizer.counters)
            common["content_metadata"] = {"distrib_optim_sharding_type": "fully_reshardable",
                                          "distrib_optim_fully_reshardable_mem_efficient": False,
                                          "singleton_local_shards": False, "chained_optim_avoid_prefix": True}
        return common

    def finalize(self, target: Target, iter_dir: Path, written: list[WrittenFile]) -> None:
        """``.metadata``, the common state (common.pt, or with style "0.19" its own DCP item in one more
        ``.distcp`` file), then metadata.json, which marks the directory complete."""
        items = sorted((it for w in written for it in w.record["items"]), key=lambda it: (it["file"], it["at"]))
        common = self.common_state(target)
        style = self.options.torch_dist_style or target.style or STYLES[0]
        config = {"sharded_backend": "torch_dist", "sharded_backend_version": 1}
        if style == "0.19":
            w = ItemFileWriter(iter_dir, f"__{1 + max((w.file for w in written), default=-1)}_0.distcp")
            buf = io.BytesIO()
            torch.save([common], buf)  # as megatron-core saves a ShardedObject's data
            w.put_bytes(COMMON_ITEM, buf.getvalue())
            w.close()
            items += w.items
        else:
            save_durable(common, iter_dir / COMMON)
            config.update(common_backend="torch", common_backend_version=1)
        write_metadata(iter_dir, items)
        write_durable(iter_dir / CONFIG, json.dumps(config))
