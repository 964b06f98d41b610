"""Megatron-FSDP checkpoints (Megatron-LM ``--ckpt-format fsdp_dtensor``): one plain
torch.distributed.checkpoint directory per iteration (``iter_NNNNNNN/.metadata`` + ``__R_0.distcp``,
tracker file beside it; no ``metadata.json``, no ``common.pt``), as megatron-core 0.19 and Megatron-LM write it:

* ``dcp.save`` of Megatron-LM's whole state dict: ``args`` (the argparse Namespace), ``iteration`` and
  ``checkpoint_version`` as DCP bytes items (``torch.save`` blobs), the model under ``model.``, training
  state under ``optimizer.``, ``rng_state.``, ``opt_param_scheduler.``, ``rerun_state_machine.`` ...
* model keys are ``nn.Module.state_dict`` names of the wrapped model under ``model.module.`` (the
  Megatron-FSDP wrapper; Float16Module adds no prefix); one key per layer with its global number
  (``decoder.layers.{i}.``), no layer axis, no ``_extra_state``;
* every tensor is stored whole in logical (TP-unsharded) shape, as DTensor chunks of any FSDP/TP
  split (word embeddings padded as the source's TP pads them);
* SwiGLU fc1 (dense, routed and shared experts) as two tensors, ``linear_fc1.weight_w`` (gate rows) and
  ``linear_fc1.weight_v`` (up rows) (``handle_swiglu_in_state_dict``), biases likewise;
* routed experts under their global index: ``mlp.experts.local_experts.{e}.`` (SequentialMLP) or
  ``mlp.experts.linear_fc1.weight{e}`` (TEGroupedMLP, ``weight{e}_w`` with SwiGLU)
  (``handle_experts_in_state_dict``).

Pipeline parallelism: Megatron-FSDP keys layers by module path only, so this reads and writes PP=1.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

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
from ..features.expressed import refuse_features
from ..layout.boxes import Box, Kind, Piece, chunk_pieces, mcore_global_shape, tp_chunks
from ..layout.mlp import expert_key, is_grouped_expert_key
from ..layout.rules import LogicalTensor, logical_tensors, model_family, spec_suffix
from ..layout.topology import Layout
from ..runtime import Runtime
from .base import IterDirFormat, KeyPolicy, on_rank0, read_origin
from .dcp_meta import TensorStorageMetadata
from .distcp import METADATA, check_storage, load_metadata, read_object, write_metadata
from .torch_dist import StreamWriter, TorchDistFormat

# Megatron-LM's model keys: "model." + the Megatron-FSDP wrapper's "module." (Float16Module adds none: its
# state_dict is its module's); Megatron-LM's own tools also accept one "module." more: read it, never write it
PREFIXES = ("model.module.module.", "model.module.")
OBJECTS = ("args", "iteration", "checkpoint_version", ORIGIN_KEY)
CHECKPOINT_VERSION = 3.0
HALVES = ("_w", "_v")  # SwiGLU fc1: the gate rows, then the up rows


def _looks_like(path: Path) -> bool:
    """A DCP directory without megatron-core's own files (those make it torch_dist)."""
    return (path / METADATA).is_file() and not (path / "metadata.json").is_file() and not (path / "common.pt").is_file()


@dataclass(frozen=True, kw_only=True)
class StoredKey:
    """One model tensor of the checkpoint: all of logical tensor ``tensor``, or one half of a SwiGLU fc1
    (``half`` 0: the gate rows ``_w``, 1: the up rows ``_v``)."""

    tensor: LogicalTensor
    half: int | None = None

    def row_offset(self) -> int:
        return 0 if self.half is None else self.half * (self.tensor.shape[0] // 2)

    def global_shape(self, padded_rows: int) -> tuple[int, ...]:
        t = self.tensor
        if self.half is not None:
            return (t.shape[0] // 2,) + tuple(t.shape[1:])
        return mcore_global_shape(t.kind, t.shape, padded_rows if t.kind is Kind.VOCAB else None)


def module_key(t: LogicalTensor, spec: str, grouped: bool) -> str:
    """``state_dict`` name of ``t`` in a PP=1 GPTModel with global expert indices (no wrapper prefix)."""
    if t.layer is None:
        return t.name
    suffix = spec_suffix(t, spec)
    if t.expert is not None and grouped:
        suffix = expert_key(t.suffix, t.expert, grouped=True)
    return f"{t.layer_prefix}{t.layer}.{suffix}"


def stored_keys(cfg: ModelConfig, grouped: bool = False) -> dict[str, StoredKey]:
    """Pure: every model key of an fsdp_dtensor checkpoint of ``cfg`` (without the wrapper prefix)."""
    out: dict[str, StoredKey] = {}
    for t in logical_tensors(cfg).values():
        key = module_key(t, cfg.spec, grouped)
        if t.kind is Kind.GLU:
            out.update((key + h, StoredKey(tensor=t, half=i)) for i, h in enumerate(HALVES))
        else:
            out[key] = StoredKey(tensor=t)
    return out


def stored_pieces(s: StoredKey, box: Box) -> list[Piece]:
    """Pieces of a stored chunk holding ``box`` of key ``s``'s global tensor (padding rows map to nothing)."""
    t = s.tensor
    zeros = (0,) * len(box.offsets)
    logical = box.shifted((s.row_offset(),) + zeros[1:])
    return chunk_pieces(t.name, Kind.COL if s.half is not None else t.kind, logical, t.shape[0], zeros)


def model_prefix(keys: list[str]) -> str | None:
    """The wrapper prefix of the model keys, or None."""
    for p in PREFIXES:
        if any(k.startswith(p + "decoder.layers.") or k.startswith(p + "embedding.") for k in keys):
            return p
    return None


def spec_evidence(keys: list[str]) -> str | None:
    """The layer-spec naming the stored keys show (TE fused layernorms, or local ones)."""
    if any(k.endswith(".self_attention.linear_qkv.layer_norm_weight") for k in keys):
        return "te"
    if any(k.endswith(".input_layernorm.weight") for k in keys):
        return "local"
    return None


# The structural features an fsdp_dtensor checkpoint holds (a GPTModel's layers, keyed by module path)
HOLDS = ("moe", "mla", "mtp")


def _refuse_layout(layout: Layout, cfg: ModelConfig, what: str) -> None:
    refuse_features(cfg, HOLDS, f"an fsdp_dtensor {what}", "choose another --dst-format (torch_dist or megatron)")
    if layout.pp != 1 or layout.vpp:
        raise ConvertError(f"fsdp_dtensor {what} at {layout}: Megatron-FSDP checkpoints key layers by module path "
                           "and have no pipeline stages", "pass --target-pp 1" if what == "target" else
                           "convert a checkpoint saved with pipeline_model_parallel_size 1")


class FsdpDtensorFormat(IterDirFormat):
    name = "fsdp_dtensor"
    holds = HOLDS
    looks_like = staticmethod(_looks_like)
    any_writer = True
    row_blocks = True  # StreamWriter
    writes_dcp = True  # a .metadata: dcp_meta.writer_note at start-up

    def __init__(self, options=None) -> None:
        super().__init__(options)
        self._reader = TorchDistFormat(options)  # the same DCP chunk reads (positioned, else dcp.load)

    def index(self, path: Path, rt: Runtime, vocab_size: int | None) -> SourceIndex:
        return on_rank0(rt, lambda: self._index(path, vocab_size))

    def _index(self, path: Path, vocab_size: int | None) -> SourceIndex:
        found = self.find(path)
        if found is None:
            raise ConvertError(f"{path} is not an fsdp_dtensor checkpoint (no .metadata)",
                               "pass the right --src-format")
        iter_dir, iteration = found
        md = load_metadata(iter_dir, self.trust_pickle)
        check_storage(iter_dir, md)
        keys = sorted(md.state_dict_metadata)
        prefix = model_prefix(keys)
        if prefix is None and any(k.startswith(("decoder.layers.", "embedding.")) for k in keys):
            raise ConvertError(f"{iter_dir} holds megatron-core torch_dist keys but neither metadata.json nor "
                               "common.pt", "copy those files from the original checkpoint")
        if prefix is None or any(k.startswith("model0.") for k in keys):
            raise ConvertError(f"{iter_dir} holds no Megatron-FSDP model (keys {PREFIXES[1]}...)",
                               "pass the right --src-format (a plain torch DCP directory is not a Megatron checkpoint)")
        args = read_object(iter_dir, md, "args", self.trust_pickle)
        if args is None:
            raise ConvertError(f"{iter_dir} has no 'args' item (Megatron-LM saves its arguments there)",
                               "convert a checkpoint saved by Megatron-LM's save_checkpoint, which stores the model "
                               "config in args")
        tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
        pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
        stored = {k[len(prefix):]: v for k, v in md.state_dict_metadata.items()
                  if k.startswith(prefix) and isinstance(v, TensorStorageMetadata)}
        cfg = config_from_args(args, vocab_size, spec_evidence(list(stored)), tp, model_family(set(stored)))
        grouped = any(is_grouped_expert_key(k) for k in stored)
        if cfg.moe is not None:
            cfg = cfg.replace(moe__grouped=grouped)
        layout = Layout.from_args(args, tp, pp, experts=bool(cfg.num_experts))
        _refuse_layout(layout, cfg, "source")
        cfg.check_layout(layout, "source")
        expected = stored_keys(cfg, grouped)
        policy = KeyPolicy.of(self.options)
        fix = "the args do not describe this model (or it is not a GPT model); check the source"
        policy.unexpected(str(iter_dir), {prefix + k for k in set(stored) - set(expected)}, fix)
        strays = [k for k in keys if k.startswith("model.") and not k.startswith(prefix)]
        policy.unexpected(str(iter_dir), strays, "model keys under two wrapper prefixes; check the source")
        missing = {prefix + k: {s.tensor.name} for k, s in expected.items() if k not in stored}
        halves = any(k.endswith(HALVES) for k in missing)
        why = " (a SwiGLU fc1 needs both halves: _w gate rows, _v up rows)" if halves else ""
        policy.missing(str(iter_dir), missing, f"the checkpoint is incomplete or from another model{why}; re-copy it")
        chunks: list[SourceChunk] = []
        for key, s in expected.items():
            if key not in stored:
                continue
            meta = stored[key]
            want = s.global_shape(int(meta.size[0]))
            if tuple(meta.size) != want or (s.tensor.kind is Kind.VOCAB and meta.size[0] < s.tensor.shape[0]):
                raise ConvertError(f"{prefix}{key} has global shape {tuple(meta.size)}, expected {want} from the args",
                                   "the args disagree with the stored tensors; pass --vocab-size if the vocabulary "
                                   "is the difference, else check the checkpoint")
            for c in meta.chunks:
                box = Box(tuple(c.offsets), tuple(c.sizes))
                chunks.append(SourceChunk(id=len(chunks), file=prefix + key, key=prefix + key, shape=box.sizes,
                                          dtype=meta.properties.dtype, pieces=stored_pieces(s, box),
                                          offsets=box.offsets, sliceable=True, contiguous_cuts=True,
                                          origin=box.offsets, origin_shape=box.sizes))
        training = [k for k in keys if not k.startswith("model.") and k not in OBJECTS]
        notes = [f"skipped {len(training)} training-state items (optimizer/rng/scheduler)"] if training else []
        origin, args = read_origin(self.name, read_object(iter_dir, md, ORIGIN_KEY, self.trust_pickle), args)
        return policy.finish(SourceIndex(format=self.name, iter_dir=iter_dir, iteration=iteration, args=args, cfg=cfg,
                                         layout=layout, chunks=chunks, notes=notes, origin=origin))

    def read(self, index: SourceIndex, chunks: list[SourceChunk]) -> dict[int, torch.Tensor]:
        return self._reader.read(index, chunks)

    def target_files(self, target: Target, dtypes: dict[str, torch.dtype]) -> list[TargetFile]:
        """One file per target (tp, ep) rank holding that rank's TP boxes of the global tensors (a routed
        expert's in the file of its expert rank); the objects Megatron-LM reads first in file 0."""
        cfg, layout = target.cfg, target.layout
        _refuse_layout(layout, cfg, "target")
        grouped = cfg.spec == "te" and bool(getattr(target.args, "moe_grouped_gemm", False))
        prefix = PREFIXES[1]
        padded = cfg.padded_vocab(layout.tp)
        ranks = [(t, e) for e in range(layout.ep) for t in range(layout.tp)]
        tensors: dict[tuple[int, int], list[TargetTensor]] = {r: [] for r in ranks}
        for key, s in stored_keys(cfg, grouped).items():
            t = s.tensor
            gshape = mcore_global_shape(t.kind, t.shape, padded if t.kind is Kind.VOCAB else None)
            degree, ep_rank = (layout.tp, 0) if t.expert is None else \
                (layout.expert_tp, layout.expert_rank(t.expert, cfg.num_experts))
            dtype = target_dtype(target, dtypes, t.name)
            for r in range(1 if t.kind is Kind.REP else degree):
                boxes = tp_chunks(t.kind, gshape, r, degree)
                box = boxes[s.half] if s.half is not None else boxes[0]
                box = box.shifted((-s.row_offset(),) + (0,) * (len(box.offsets) - 1))
                tensors[(r % layout.tp, ep_rank)].append(TargetTensor(key=prefix + key, shape=box.sizes, dtype=dtype,
                                                                      pieces=stored_pieces(s, box), offsets=box.offsets,
                                                                      global_shape=s.global_shape(padded)))
        args = copy.copy(target.args)
        args.ckpt_format = "fsdp_dtensor"
        objects = {"args": args, "checkpoint_version": CHECKPOINT_VERSION,
                   "iteration": 0 if target.iteration == "release" else target.iteration,
                   ORIGIN_KEY: target.origin.record()}  # an item Megatron-LM's load does not ask for
        return [TargetFile(id=i, name=f"tp{t}" + (f"_ep{e}" if layout.ep > 1 else ""), tensors=tensors[(t, e)],
                           objects=objects if i == 0 else {}) for i, (t, e) in enumerate(ranks)]

    def open_writer(self, target: Target, iter_dir: Path, files: list[TargetFile], rt: Runtime) -> StreamWriter:
        return StreamWriter(iter_dir, files)  # the same streaming DCP item files as torch_dist

    def finalize(self, target: Target, iter_dir: Path, written: list[WrittenFile]) -> None:
        """``.metadata`` last (fsynced); nothing else: Megatron-LM's fsdp_dtensor load reads only the DCP."""
        write_metadata(iter_dir, sorted((it for w in written for it in w.record["items"]),
                                        key=lambda it: (it["file"], it["at"])))
