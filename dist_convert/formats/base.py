"""The reader/writer protocol every checkpoint format implements, its options, and the helpers
readers share (key policy, iteration directories). The data it works on is in ``datamodel.py``.
"""
from __future__ import annotations

import copy
import fnmatch
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import torch
import yaml

from ..datamodel import Origin, SourceChunk, SourceIndex, Target, TargetFile, WrittenFile
from ..durable import copy_durable, write_durable
from ..errors import ConvertError
from ..layout.boxes import Piece
from ..mlm_args import LEGACY_ORIGIN_ARGS
from ..runtime import Runtime

TRACKER = "latest_checkpointed_iteration.txt"
# Training state Megatron-LM saves next to the model in its common state / legacy rank files: read past, never converted
COMMON_TRAINING_STATE = ("optimizer", "opt_param_scheduler", "rng_state", "rerun_state_machine",
                         "num_floating_point_operations_so_far", "num_tokens_so_far")
_ITER_RE = re.compile(r"^iter_(\d{7})$")
S = TypeVar("S")  # a streamed file's writer state (StreamedFiles)


@dataclass(frozen=True, kw_only=True)
class FormatOptions:
    """Reader/writer options from the command line (each format uses the ones it knows)."""

    trust_pickle: bool = False  # allow arbitrary pickled objects in .pt files
    max_shard_size: int = 5 * 10**9  # hf: bytes per written *.safetensors file
    tokenizer_dir: Path | None = None  # hf: where tokenizer files to copy into the target live
    tokenizer_model: Path | None = None  # nemo: tokenizer model file to put into the target archive
    tokenizer_vocab_file: Path | None = None  # nemo: tokenizer vocab file to put into the target archive
    nemo_style: str | None = None  # nemo target: "mcore" | "legacy" | "megatron_legacy" (None: the source's)
    torch_dist_style: str | None = None  # torch_dist target: "0.16" (common.pt) | "0.19" (None: the source's or 0.16)
    dtype: torch.dtype | None = None  # --dtype: what hf reads dequantize FP8 / MXFP4 weights to (None: bf16)
    quantize: str | None = None  # hf target: "fp8-block" / "mxfp4" writes quantized weights (--quantize)
    allow_missing: tuple[str, ...] = ()  # globs: source tensors that may be missing (left out of the conversion)
    ignore_unexpected: tuple[str, ...] = ()  # globs: unknown source tensors to skip
    optimizer: bool = False  # --optimizer: read the source's optimizer state too (torch_dist, megatron sources)
    base: Path | None = None  # --base: the model an adapter-only source adapts (its config, names and shapes)


# What a format's targets hold of a model's structural features (``config.OPTIONAL``), declared positively: a
# feature added later is refused (``features.expressed.refuse_features``) until a format says it holds it
HOLDS_LANGUAGE_MODEL = ("moe", "mla", "dsa", "mtp", "mamba", "gdn", "t5")  # a language model's, whatever its stack
HOLDS_ALL = (*HOLDS_LANGUAGE_MODEL, "vision")  # and its components beside (a vision tower: layout/vision.py)


class Format(Protocol):
    name: str
    iteration_dirs: bool  # Megatron-LM layout: files under iter_NNNNNNN/ plus a tracker file
    sharded: bool  # stores TP/PP shards (False: whole tensors, e.g. hf)
    any_writer: bool  # a target file is only a group of chunks: any rank may write any part of it (DCP)
    row_blocks: bool  # its writer takes a large tensor in row blocks, in any order (``put_rows``)
    holds: tuple[str, ...]  # the structural features (config.OPTIONAL) its targets hold, positively (HOLDS_*)

    def detect(self, path: Path) -> bool: ...

    def index(self, path: Path, rt: Runtime, vocab_size: int | None) -> SourceIndex:
        """Collective: every rank gets the same index."""

    def read(self, index: SourceIndex, chunks: list[SourceChunk]) -> dict[int, torch.Tensor]:
        """Read these chunks (whole) from disk; rank-local."""

    def target_files(self, target: Target, dtypes: dict[str, torch.dtype]) -> list[TargetFile]:
        """Pure: the files of the target and what each holds."""

    def open_writer(self, target: Target, iter_dir: Path, files: list[TargetFile], rt: Runtime) -> TargetWriter:
        """A writer of this rank's ``files`` into ``iter_dir`` (metadata excluded)."""

    def finalize(self, target: Target, iter_dir: Path, written: list[WrittenFile]) -> None:
        """Rank 0, after every rank wrote ``written`` (all target files, this run's and a resumed
        run's): the metadata that marks the iteration complete."""

    def package(self, tmp: Path, dst: Path) -> Path:
        """Rank 0, last: what to rename into ``dst`` (``tmp`` itself, or e.g. an archive made from it)."""


class TargetWriter(Protocol):
    def put(self, file: TargetFile, j: int, tensor: torch.Tensor) -> list[WrittenFile]:
        """Tensor ``j`` of ``file`` is complete (called once per tensor, in any order); returns the
        files this finished."""

    def close(self) -> list[WrittenFile]:
        """Local, after the last ``put``: finish the rest (e.g. files without tensors)."""


class StreamedFiles(ABC, Generic[S]):
    """What the writers of files written as their tensors arrive share (hf_shards.ShardWriter, torch_zip.SavedFiles):
    a file is opened at its first tensor (``_start``: its writer's state, kept in ``open``) and closed with its last
    (``_close``; ``_finish``: fsynced, its ``WrittenFile``); ``close`` writes the files without tensors."""

    def __init__(self, files: list[TargetFile]) -> None:
        self.files = files
        self.open: dict[int, S] = {}
        self.closed: set[int] = set()

    @abstractmethod
    def _start(self, f: TargetFile) -> S:
        """Open ``f`` for writing: its writer's state."""

    @abstractmethod
    def _finish(self, f: TargetFile, state: S) -> WrittenFile:
        """Complete ``f`` (fsynced): what was written."""

    def _file(self, f: TargetFile) -> S:
        if f.id not in self.open:
            assert f.id not in self.closed, f"{f.name} was already written"
            self.open[f.id] = self._start(f)
        return self.open[f.id]

    def _close(self, f: TargetFile) -> WrittenFile:
        self.closed.add(f.id)
        return self._finish(f, self.open.pop(f.id))

    def close(self) -> list[WrittenFile]:
        """Local, after the last ``put``: the files without tensors."""
        out = []
        for f in self.files:
            assert f.id in self.closed or not f.tensors, f"{f.name}: tensors never arrived"
            if f.id not in self.closed:
                self._file(f)
                out.append(self._close(f))
        return out


def iter_dir_name(iteration: int | str) -> str:
    return "release" if iteration == "release" else f"iter_{int(iteration):07d}"


def data_dir(fmt: Format, iteration: int | str) -> str:
    """Where a target's files go inside it: the iteration directory (Megatron-LM layouts), the format's
    own ``subdir`` (NeMo 2: ``weights``), else the target directory itself ("")."""
    return iter_dir_name(iteration) if fmt.iteration_dirs else getattr(fmt, "subdir", "")


def resolve_iter_dir(path: Path, looks_like: Callable[[Path], bool]) -> tuple[Path, int | str] | None:
    """Find the iteration directory: ``path`` itself, or the one its tracker file names."""
    if looks_like(path):
        m = _ITER_RE.match(path.name)
        return path, (int(m.group(1)) if m else "release" if path.name == "release" else 0)
    tracker = path / TRACKER
    if tracker.is_file():
        text = tracker.read_text().strip()
        iteration: int | str = "release" if text == "release" else int(text)
        sub = path / iter_dir_name(iteration)
        if not sub.is_dir():
            raise ConvertError(f"{tracker} names iteration {text} but {sub} is missing",
                               "fix the tracker file or point SRC at an existing iter_* directory")
        return (sub, iteration) if looks_like(sub) else None
    return None


class IterDirFormat:
    """Shared by formats in Megatron-LM's layout (tracker file + iteration directory)."""

    name: str
    iteration_dirs = True
    sharded = True
    any_writer = False
    row_blocks = False
    holds: tuple[str, ...] = HOLDS_LANGUAGE_MODEL
    looks_like: Callable[[Path], bool]  # is ``path`` an iteration directory of this format?

    def __init__(self, options: FormatOptions | None = None) -> None:
        self.options = options or FormatOptions()
        self.trust_pickle = self.options.trust_pickle

    def find(self, path: Path) -> tuple[Path, int | str] | None:
        return resolve_iter_dir(path, self.looks_like)

    def detect(self, path: Path) -> bool:
        return self.find(path) is not None

    def package(self, tmp: Path, dst: Path) -> Path:
        return tmp


def on_rank0(rt: Runtime, fn: Callable[[], Any]) -> Any:
    """Collective: ``fn`` (a metadata read, the final metadata, packaging) runs on rank 0; every rank gets its
    result or its error, waiting as long as rank 0 takes (Runtime.wait_for_rank0, not ``--timeout``)."""
    result: Any = None
    if rt.rank == 0:
        try:
            result = fn()
        except ConvertError as e:
            result = e
    result = rt.wait_for_rank0(result)
    if isinstance(result, ConvertError):
        raise result
    return result


def matches(patterns: Iterable[str], *names: str) -> bool:
    """Whether any fnmatch-style glob matches any of ``names`` (``*`` also matches dots)."""
    return any(fnmatch.fnmatchcase(n, p) for p in patterns for n in names)


def _few(names: list[str]) -> str:
    return f"{names[:3]}{' ...' if len(names) > 3 else ''}"


@dataclass(kw_only=True)
class KeyPolicy:
    """Strict by default: a source tensor the model does not have, or one the model needs but the
    source lacks, is refused. ``--ignore-unexpected`` / ``--allow-missing`` globs opt in to skipping
    them (matched against the stored key, and for missing ones against the logical tensors it holds).
    Readers report each file's surprises here and pass their index through ``finish``."""

    dtype: torch.dtype | None = None  # --dtype: what hf reads dequantize FP8 / MXFP4 weights to (None: bf16)
    quantize: str | None = None  # hf target: "fp8-block" / "mxfp4" writes quantized weights (--quantize)
    allow_missing: tuple[str, ...] = ()
    ignore_unexpected: tuple[str, ...] = ()
    ignored: list[str] = field(default_factory=list)  # "where: key" of skipped unknown tensors
    absent: set[str] = field(default_factory=set)  # logical tensors left out

    @classmethod
    def of(cls, options: FormatOptions) -> KeyPolicy:
        return cls(allow_missing=tuple(options.allow_missing), ignore_unexpected=tuple(options.ignore_unexpected))

    def unexpected(self, where: str, keys: Iterable[str], fix: str, what: str = "unexpected tensors") -> None:
        """Skip the unknown stored ``keys`` of ``where`` that ``--ignore-unexpected`` matches; refuse the rest."""
        keys = sorted(keys)
        refused = [k for k in keys if not matches(self.ignore_unexpected, k)]
        if refused:
            raise ConvertError(f"{where}: {what} {_few(refused)}", f"{fix}, or pass --ignore-unexpected PATTERN to "
                               "skip them")
        self.ignored += [f"{where}: {k}" for k in keys]

    def missing(self, where: str, keys: dict[str, Collection[str]], fix: str) -> None:
        """``keys``: stored key the source lacks -> the logical tensors it would hold (a part of). Those
        ``--allow-missing`` matches (the key, or every logical tensor it holds) are left out; the rest refused."""
        refused = sorted(k for k, names in keys.items()
                         if not (matches(self.allow_missing, k) or names and all(matches(self.allow_missing, n)
                                                                                 for n in names)))
        if refused:
            raise ConvertError(f"{where}: missing tensors {_few(refused)}", f"{fix}, or pass --allow-missing PATTERN "
                               "to leave them out of the conversion")
        for names in keys.values():
            self.absent.update(names)

    def finish(self, index: SourceIndex) -> SourceIndex:
        """The index without the absent logical tensors (their pieces dropped everywhere: a chunk left
        with none is not read), with a note for what was skipped; refuses a logical tensor stored in
        two dtypes."""
        if self.absent:
            chunks = []
            for c in index.chunks:
                pieces = [p for p in c.pieces if p.logical not in self.absent]
                if pieces or not c.pieces:
                    chunks.append(replace(c, id=len(chunks), pieces=pieces))
            index = replace(index, chunks=chunks, absent=frozenset(self.absent), notes=index.notes + [
                f"left out {len(self.absent)} logical tensors the source lacks (--allow-missing): "
                f"{_few(sorted(self.absent))}"])
        if self.ignored:
            index.notes.append(f"ignored {len(self.ignored)} unexpected source tensors (--ignore-unexpected): "
                               f"{_few(self.ignored)}")
        check_dtypes(index.chunks)
        return index


def check_dtypes(chunks: list[SourceChunk]) -> None:
    """Refuse a logical tensor whose parts are stored with different dtypes."""
    first: dict[str, SourceChunk] = {}
    for c in chunks:
        for p in c.pieces:
            f = first.setdefault(p.logical, c)
            if f.dtype != c.dtype:
                raise ConvertError(f"{p.logical} is stored as {f.dtype} in {f.file} ({f.key}) but as {c.dtype} in "
                                   f"{c.file} ({c.key})",
                                   "the files disagree; re-copy them from one checkpoint")


def add_rank_file_chunks(chunks: list[SourceChunk], rel: str, expected: dict[str, tuple[tuple[int, ...], list[Piece]]],
                         have: dict[str, tuple[tuple[int, ...], torch.dtype]], described_by: str,
                         policy: KeyPolicy) -> None:
    """Check one rank file's tensors against the layout table's ``expected`` entries; append its chunks."""
    policy.unexpected(rel, set(have) - set(expected),
                      f"{described_by} does not describe this model (or it is not a GPT model); check the source")
    policy.missing(rel, {k: {p.logical for p in v[1]} for k, v in expected.items() if k not in have},
                   "the rank file is incomplete or from another model; re-copy the checkpoint")
    for key, (shape, pieces) in expected.items():
        if key in have:
            check_piece_shapes(key, rel, shape, have[key][0])
            chunks.append(SourceChunk(id=len(chunks), file=rel, key=key, shape=shape, dtype=have[key][1],
                                      pieces=pieces))


# tokenizer (and generation config) files that travel with a model between formats
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "generation_config.json")


def tokenizer_source(origin: Origin, override: Path | None = None) -> Path | None:
    """Where a target's tokenizer files come from: ``--tokenizer-dir``, else the directory the source's
    Origin names (an HF model directory, Bridge's tokenizer/, a NeMo 2 artifact) while it exists."""
    if override is not None:
        return override
    return origin.tokenizer if origin.tokenizer is not None and origin.tokenizer.is_dir() else None


def read_origin(kind: str, record: Any, args: Any) -> tuple[Origin, Any]:
    """The Origin of a checkpoint with Megatron-LM args (torch_dist, megatron, fsdp_dtensor) and the args
    without dist_convert's former side channels: the ``ORIGIN_KEY`` record dist_convert stored (``record``),
    else what earlier dist_convert versions left in the args (``hf_config``, ``nemo_config``, ...), else
    nothing but the tokenizer directory Megatron-LM's own ``tokenizer_model`` names (``kind`` then).
    ``tokenizer_model`` is a Megatron-LM argument (its tokenizer's location): it stays in the args."""
    found = {name: getattr(args, name) for name in LEGACY_ORIGIN_ARGS if getattr(args, name, None) is not None}
    if found:
        args = copy.copy(args)
        for name in found:
            delattr(args, name)
    tok = getattr(args, "tokenizer_model", None)
    tokenizer = Path(tok) if isinstance(tok, str) and Path(tok).is_dir() else None
    if isinstance(record, dict):
        stored = Origin.from_record(record)
        return replace(stored, kind=stored.kind or kind, tokenizer=stored.tokenizer or tokenizer), args
    return _legacy_origin(kind, found, tokenizer), args


def _legacy_origin(kind: str, found: dict[str, Any], tokenizer: Path | None) -> Origin:
    """What dist_convert before the Origin record left in a target's args, as an Origin (its paths read now)."""
    def document(name: str) -> dict[str, Any] | None:
        return found[name] if isinstance(found.get(name), dict) else None

    def path(name: str, sub: str = "") -> Path | None:
        value = found.get(name)
        return Path(value) / sub if isinstance(value, str) else None

    run_config = None
    bridge = path("bridge_source", "run_config.yaml")
    if bridge is not None and bridge.is_file():
        try:
            loaded = yaml.safe_load(bridge.read_text())
            run_config = loaded if isinstance(loaded, dict) and isinstance(loaded.get("model"), dict) else None
        except (OSError, yaml.YAMLError):
            run_config = None
    source = ("hf" if "hf_config" in found else "nemo" if "nemo_config" in found else
              "bridge" if "bridge_source" in found else "nemo2" if "nemo2_source" in found else kind)
    model_id = found.get("hf_model_id")
    return Origin(kind=source, hf_config=document("hf_config"), nemo_config=document("nemo_config"),
                  nemo_archive=path("nemo_source"), nemo2_context=path("nemo2_source", "context"),
                  bridge_run_config=run_config, hf_model_id=model_id if isinstance(model_id, str) else None,
                  tokenizer=tokenizer)


def copy_tokenizer_files(src: Path, dst: Path) -> None:
    """The TOKENIZER_FILES of ``src`` into ``dst`` (made if needed), each fsynced; files ``dst`` has are kept."""
    dst.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (src / name).is_file() and not (dst / name).exists():
            copy_durable(src / name, dst / name)


def dropped_state_note(parts: list[str], optimizer_kept: bool = False, loads: str | None = None) -> str | None:
    """The one note line on the training state a conversion drops (None: the source holds none);
    ``optimizer_kept``: --optimizer converts the optimizer state, so only the rest is dropped; ``loads``: how the
    target is loaded without it (default: what the target's Megatron-LM args say)."""
    if not parts:
        return None
    if loads is not None:
        return f"dropped the training state (not converted): {', '.join(parts)}; {loads}"
    if optimizer_kept:
        return (f"dropped the training state besides the optimizer's (not converted): {', '.join(parts)}; the "
                "target's args say no_save_rng, so Megatron-LM loads it without RNG state")
    return (f"dropped the training state (not converted): {', '.join(parts)}; the target's args say no_save_optim "
            "and no_save_rng, so Megatron-LM loads it without optimizer or RNG state")


def write_tracker(root: Path, iteration: int | str) -> None:
    write_durable(root / TRACKER, str(iteration))


def check_piece_shapes(chunk_key: str, where: str, expected: tuple[int, ...], found: tuple[int, ...]) -> None:
    if tuple(expected) != tuple(found):
        raise ConvertError(f"{where}: {chunk_key} has shape {tuple(found)}, expected {tuple(expected)} from the "
                           "model config and layout",
                           "rank files disagree with the args; check that all rank files come from one checkpoint")
