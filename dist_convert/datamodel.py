"""The data model every part shares, importing no format: a source is described as *chunks* (each
one readable unit: a tensor in a rank file, a DCP chunk), a target as *files* of stored tensors. Both
carry ``Piece`` lists that say which box of which logical tensor sits where, so resharding is box
intersection (plan.py). The planner, the executor and integrity work on these alone.
"""
from __future__ import annotations

import argparse
import copy
from collections.abc import Collection
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

import torch

from .config import ModelConfig
from .errors import ConvertError
from .layout.boxes import Piece
from .layout.topology import Layout

ORIGIN_KEY = "dist_convert_origin"  # the top-level key a Megatron-LM target stores its Origin's record under
ORIGIN_VERSION = 1
# what megatron-core records of the optimizer state's layout (content_metadata)
OPTIMIZER_SHARDING = "fully_reshardable"
OPTIMIZER_KINDS = ("dp_reshardable", "fully_reshardable", "non_distributed", "legacy")


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def row_axis(shape: tuple[int, ...]) -> int | None:
    """The axis a tensor is cut into row blocks along: the first longer than 1 (torch_dist stacks a layer's
    tensor as [1, rows, ...]); None when there is none."""
    return next((d for d, n in enumerate(shape) if n > 1), None)


@dataclass(frozen=True, kw_only=True)
class OptimizerState:
    """The non-tensor optimizer state a source holds, as a target writes it.

    ``groups``: the param_groups of each optimizer megatron-core chains (the dense parameters', then with
    MoE the expert parameters'), as the distributed optimizer saves them (no ``params`` lists; each group
    carries ``step``). ``scheduler``: the OptimizerParamScheduler state (None: the source has none).
    ``counters``: Megatron-LM's training counters (floating-point operations, tokens) so far."""

    kind: str  # how the source stored it (OPTIMIZER_KINDS)
    groups: tuple[tuple[dict[str, Any], ...], ...]
    scheduler: dict[str, Any] | None = None
    counters: dict[str, Any] = field(default_factory=dict)  # optim.state.COUNTERS the source holds

    def for_layout(self, cfg: ModelConfig, layout: Layout) -> OptimizerState:
        """The state as a target at ``layout`` chains its optimizers: expert parameters have an optimizer of
        their own when EP > 1 or expert-TP != TP (megatron-core 0.19; 0.16: EP > 1), else they join the dense
        parameters' groups (``is_expert_parallel`` False)."""
        dense = self.groups[0]
        if not cfg.num_experts or not (layout.ep > 1 or layout.expert_tp != layout.tp):
            return replace(self, groups=(dense,))
        if len(self.groups) > 1:
            return self
        return replace(self, groups=(dense, tuple({**g, "is_expert_parallel": True} for g in dense)))

    def common(self) -> Any:
        """The target's ``optimizer`` entry of the common state: what megatron-core's DistributedOptimizer
        (a ChainedOptimizer of two with MoE) leaves there when it saves fully_reshardable."""
        entries = [{"optimizer": {"param_groups": [copy.deepcopy(g) for g in groups]},
                    "param_state_sharding_type": OPTIMIZER_SHARDING} for groups in self.groups]
        return entries[0] if len(entries) == 1 else dict(enumerate(entries))


def plain(value: Any) -> Any:
    """``value`` as plain values only (dicts, lists, str, int, float, bool, None: what ``torch.load(weights_only=
    True)`` and JSON read), anything else (a date YAML parsed, a path) as its string."""
    if isinstance(value, dict):
        return {k if isinstance(k, str | int | float | bool) or k is None else str(k): plain(v)
                for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value if isinstance(value, str | int | float | bool) or value is None else str(value)


@dataclass(frozen=True, kw_only=True)
class Origin:
    """Where a model came from: the documents its source format kept with it, which a later export writes back
    (an HF target the source's own config.json, a Bridge target its run_config.yaml, a .nemo target its
    model_config.yaml). Readers fill it in the index, the engine hands it to the target, writers read it there;
    it never travels in the Megatron-LM args. Targets with Megatron-LM's common state (torch_dist and Bridge,
    megatron rank files, fsdp_dtensor) store ``record()`` under ``ORIGIN_KEY``, so a chain of conversions keeps
    it; the documents travel themselves, only artifact files to copy (tokenizer files, NeMo's archive and
    context/) are named by path.

    Not hashable (it holds dicts): compare it, never key by it."""

    kind: str | None = None  # the format the model was first read from (a chain keeps it); None: nothing known
    hf_config: dict[str, Any] | None = None  # the HF config.json it was imported from
    hf_model_id: str | None = None  # Megatron-Bridge's hf_model_id: the HF model (hub id or directory) it came from
    nemo_config: dict[str, Any] | None = None  # NeMo 1 model_config.yaml
    nemo_archive: Path | None = None  # the NeMo 1 .nemo (tar or directory) whose artifacts a .nemo target copies
    nemo2_context: Path | None = None  # the NeMo 2 context/ directory a nemo2 target copies (relaid out)
    bridge_run_config: dict[str, Any] | None = None  # Megatron-Bridge's run_config.yaml, parsed
    tokenizer: Path | None = None  # a directory holding the tokenizer files (HF model, Bridge tokenizer/, NeMo 2)
    # which of its family's optional sets of stored copies the HF source held (models.base.Family.optional_sets)
    hf_stored: dict[str, bool] | None = None

    DOCUMENTS: ClassVar[tuple[str, ...]] = ("hf_config", "nemo_config", "bridge_run_config")
    PATHS: ClassVar[tuple[str, ...]] = ("nemo_archive", "nemo2_context", "tokenizer")

    def record(self) -> dict[str, Any]:
        """Plain values only (``torch.load(weights_only=True)`` and JSON read it): paths as strings."""
        out: dict[str, Any] = {"version": ORIGIN_VERSION, "kind": self.kind, "hf_model_id": self.hf_model_id,
                               "hf_stored": None if self.hf_stored is None else dict(self.hf_stored)}
        out.update({name: plain(getattr(self, name)) for name in self.DOCUMENTS})
        out.update({name: None if getattr(self, name) is None else str(getattr(self, name)) for name in self.PATHS})
        return out

    @classmethod
    def from_record(cls, record: Any) -> Origin:
        """The Origin ``record()`` stored; a field of the wrong type is left out (a record from a later
        version keeps the fields this one knows)."""
        if not isinstance(record, dict):
            return cls()
        given: dict[str, Any] = {}
        for name in ("kind", "hf_model_id"):
            if isinstance(record.get(name), str):
                given[name] = record[name]
        for name in cls.DOCUMENTS:
            if isinstance(record.get(name), dict):
                given[name] = record[name]
        stored = record.get("hf_stored")
        if isinstance(stored, dict) and all(isinstance(k, str) and isinstance(v, bool) for k, v in stored.items()):
            given["hf_stored"] = stored
        for name in cls.PATHS:
            if isinstance(record.get(name), str):
                given[name] = Path(record[name])
        return cls(**given)

    def missing(self) -> list[str]:
        """Notes on the artifact paths it names that are gone: a target goes without those files."""
        what = {"nemo_archive": ("the .nemo archive", "its tokenizer artifacts are not copied (pass "
                                 "--tokenizer-model / --tokenizer-vocab-file)"),
                "nemo2_context": ("the NeMo 2 context/", "a nemo2 target's context/ is written from the model config"),
                "tokenizer": ("the tokenizer directory", "no tokenizer files are copied (pass --tokenizer-dir)")}
        return [f"{what[name][0]} the source came from ({path}) no longer exists: {what[name][1]}"
                for name in self.PATHS for path in [getattr(self, name)] if path is not None and not path.exists()]


@dataclass(frozen=True)
class Quantized:
    """How one HF tensor is stored quantized (``formats/quant.py``): its scheme's name, the stored parts that make it
    ((file, key) each, in the scheme's order) and the scheme's parameters (e.g. FP8's block size)."""

    scheme: str
    parts: tuple[tuple[str, str], ...]
    params: tuple[Any, ...] = ()
    stored_bytes: int = 0  # what the stored parts of the whole tensor hold (its companions too)
    numel: int = 0  # the elements of the whole tensor they dequantize to


@dataclass(frozen=True, kw_only=True)
class SourceChunk:
    id: int
    file: str  # path relative to the iteration directory
    key: str  # name in the file / DCP key
    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: list[Piece]
    offsets: tuple[int, ...] | None = None  # DCP: chunk offset in the stored global tensor
    sliceable: bool = False  # boxes of it can be read on their own: cuts.split_chunks cuts it
    contiguous_cuts: bool = False  # only boxes that are one contiguous byte run (DCP items read by offset)
    origin: tuple[int, ...] | None = None  # DCP: offsets of the stored item this chunk is (a part of)
    origin_shape: tuple[int, ...] | None = None  # DCP: that stored item's shape
    # a quantized hf tensor (formats/quant.py): the stored parts standing in for tensor ``key``; ``shape`` is what
    # they dequantize to and ``dtype`` what the reader dequantizes to
    quant: Quantized | None = None
    twins: tuple[tuple[str, str], ...] = ()  # (file, key) of stored copies the reader checks equal (hf: MTP's)
    flat: int | None = None  # bucket space (optimizer state): where in a stored 1-D tensor this chunk starts

    @property
    def nbytes(self) -> int:
        return numel(self.shape) * self.dtype.itemsize

    @property
    def stored_nbytes(self) -> int:
        """What the source stores for this chunk: its share of a quantized tensor's parts, else ``nbytes``."""
        q = self.quant
        return self.nbytes if q is None else q.stored_bytes * numel(self.shape) // max(q.numel, 1)


@dataclass(kw_only=True)
class SourceIndex:
    """Not frozen, by design: a source is indexed in steps. The format's reader builds the model's index, then
    adds the optimizer state's chunks and record to it (``--optimizer``), and the reader and the engine append
    notes as they find things to report (``KeyPolicy.finish``, ``convert``)."""

    format: str
    iter_dir: Path
    iteration: int | str  # "release" for release/ checkpoints
    args: argparse.Namespace
    cfg: ModelConfig
    layout: Layout
    chunks: list[SourceChunk]
    origin: Origin  # where the model came from (the documents a later export writes back)
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # a target's reader that builds another model (readers.py)
    absent: frozenset[str] = frozenset()  # logical tensors the source lacks, left out (--allow-missing)
    style: str | None = None  # on-disk style where a format has several (torch_dist: "0.16" | "0.19")
    optimizer: OptimizerState | None = None  # of a source read with --optimizer (None: the model only)
    adapter: Any = None  # lora.adapter.AdapterSpec of an adapter-only source (its chunks: the adapter's tensors)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.chunks)


@dataclass(frozen=True, kw_only=True)
class TargetTensor:
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: list[Piece]
    offsets: tuple[int, ...] | None = None  # DCP: chunk offset in the global tensor
    global_shape: tuple[int, ...] | None = None
    stored_bytes: int | None = None  # what the file holds for it when that is not ``nbytes`` (hf --quantize)

    @property
    def nbytes(self) -> int:
        return numel(self.shape) * self.dtype.itemsize

    @property
    def stored_nbytes(self) -> int:
        return self.nbytes if self.stored_bytes is None else self.stored_bytes


@dataclass(frozen=True, kw_only=True)
class TargetFile:
    id: int
    name: str  # a rank file (legacy) or a group of DCP chunks written by one rank
    tensors: list[TargetTensor]
    objects: dict[str, Any] = field(default_factory=dict)  # non-tensor entries (e.g. _extra_state)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def stored_nbytes(self) -> int:
        """What the file holds (a quantized hf target's packed parts)."""
        return sum(t.stored_nbytes for t in self.tensors)


def omit_absent(files: list[TargetFile], absent: Collection[str]) -> list[TargetFile]:
    """Pure: the target files without the tensors that hold only logical tensors the source lacks
    (``SourceIndex.absent``, from ``--allow-missing``). File ids, names and objects stay; a tensor
    without pieces (vocabulary padding only) stays. A tensor mixing absent and present logical
    tensors is refused: its absent part could only be written as zeros."""
    if not absent:
        return files
    out = []
    for f in files:
        tensors = []
        for t in f.tensors:
            gone = {p.logical for p in t.pieces if p.logical in absent}
            if gone and len(gone) < len({p.logical for p in t.pieces}):
                raise ConvertError(f"target tensor {t.key} of {f.name} holds {sorted(gone)[0]}, which the source "
                                   "lacks, together with tensors it has",
                                   "drop the --allow-missing pattern that matches it, or choose another --dst-format")
            if not gone:
                tensors.append(t)
        out.append(replace(f, tensors=tensors))
    return out


@dataclass(frozen=True, kw_only=True)
class Target:
    cfg: ModelConfig
    layout: Layout
    dtype: torch.dtype | None  # None: keep each tensor's source dtype
    args: argparse.Namespace
    iteration: int | str
    style: str | None = None  # the source's on-disk style, kept when the format stays (torch_dist: "0.16" | "0.19")
    optimizer: OptimizerState | None = None  # to write with the model (--optimizer; None: the model only)
    origin: Origin = Origin()  # the source's (SourceIndex.origin); empty for a model made from nothing
    adapter: Any = None  # lora.adapter.AdapterSpec: an adapter-only target, laid out from this source adapter


# Tensors megatron-core keeps in their own dtype whatever the params dtype (MoE router.expert_bias: fp32)
KEEP_DTYPE = (".mlp.router.expert_bias",)


def target_dtype(target: Target, dtypes: dict[str, torch.dtype], logical: str) -> torch.dtype:
    """The dtype a target tensor holding ``logical`` is written in: ``--dtype``'s, else the source's;
    tensors megatron-core keeps in their own dtype (and optimizer state) are never cast."""
    keep = target.dtype is None or logical.endswith(KEEP_DTYPE) or logical.startswith("optimizer.state.")
    return dtypes[logical] if keep else target.dtype


@dataclass(frozen=True, kw_only=True)
class WrittenFile:
    """A target file on disk, fsynced: what a writer reports when it finished one."""

    file: int  # TargetFile id
    name: str  # its path relative to the writer's directory
    sha256: str  # its checksum, taken as the writer wrote it (durable.DurableFile, distcp.PositionedFile)
    record: dict[str, Any] = field(default_factory=dict)  # what ``finalize`` needs of it (JSON; journaled)
