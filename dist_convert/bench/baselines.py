"""The whole-model single-process converter that other tools use, written naively on purpose:

1. load every source shard fully into one process (``torch.load`` of every rank file without mmap, or
   a full ``torch.distributed.checkpoint`` load of every global tensor),
2. concatenate the shards of each tensor into the full logical tensor (the whole model in memory),
3. split each full tensor for every target rank (copies) and save the target files in the same format.

dist_convert's layout table (the pieces of the source index and of the target files) says where each
shard goes, so the output is a correct checkpoint that ``dist_convert verify`` compares with others.

  python -m dist_convert.bench.baselines SRC DST --tp T --pp P [--stats-json FILE]
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from ..convert import ReshardOptions, check_vocab, load_index, source_dtypes, target_layout
from ..datamodel import SourceIndex, Target, TargetFile, WrittenFile
from ..errors import ConvertError
from ..formats.base import FormatOptions, iter_dir_name, write_tracker
from ..layout.boxes import Box
from ..layout.rank_files import split_chunk_key
from ..layout.rules import logical_tensors
from ..mlm_args import args_for_target
from ..runtime import Runtime, peak_rss_bytes
from ..safe_load import load_pt
from .measure import job_args


def load_every_shard(index: SourceIndex, trust_pickle: bool) -> dict[int, torch.Tensor]:
    """Step 1: every stored chunk in memory (chunk id -> tensor), read in full."""
    if index.format == "torch_dist":
        md = FileSystemReader(str(index.iter_dir)).read_metadata().state_dict_metadata
        full = {k: torch.empty(tuple(md[k].size), dtype=md[k].properties.dtype) for k in {c.key for c in index.chunks}}
        dcp.load(full, storage_reader=FileSystemReader(str(index.iter_dir)), no_dist=True)
        return {c.id: full[c.key][Box(c.offsets or (0,) * len(c.shape), c.shape).slices()] for c in index.chunks}
    if index.format != "megatron":
        raise ConvertError(f"the whole-model baseline reads torch_dist or megatron, not {index.format}",
                           "pass --format torch_dist or --format megatron to bench")
    files: dict[str, dict] = {}
    out = {}
    for c in index.chunks:
        if c.file not in files:
            files[c.file] = load_pt(index.iter_dir / c.file, trust_pickle, mmap=False)
        entry, key = split_chunk_key(c.key)
        out[c.id] = files[c.file][entry][key]
    return out


def concatenate(index: SourceIndex, shards: dict[int, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Step 2: the full logical tensors (replicated shards are copied again, as a naive tool does)."""
    dtypes = source_dtypes(index)
    full = {name: torch.empty(t.shape, dtype=dtypes[name]) for name, t in logical_tensors(index.cfg).items()}
    for c in index.chunks:
        for p in c.pieces:
            full[p.logical][p.lbox.slices()].copy_(shards[c.id][p.sbox.slices()].reshape(p.lbox.sizes))
    return full


def split(files: list[TargetFile], full: dict[str, torch.Tensor]) -> dict[tuple[int, int], torch.Tensor]:
    """Step 3: each target rank's tensors, copied out of the full ones (vocabulary padding stays zero)."""
    out = {}
    for f in files:
        for j, t in enumerate(f.tensors):
            data = torch.zeros(t.shape, dtype=t.dtype)
            for p in t.pieces:
                data[p.sbox.slices()].copy_(full[p.logical][p.lbox.slices()].reshape(p.sbox.sizes))
            out[(f.id, j)] = data
    return out


def whole_model(src: Path, dst: Path, target_tp: int, target_pp: int, trust_pickle: bool = True) -> dict:
    """Convert ``src`` to ``dst`` at (target_tp, target_pp), same format, in this one process."""
    t0 = time.perf_counter()
    rt = Runtime()
    options = FormatOptions(trust_pickle=trust_pickle)
    fmt, index = load_index(src, "auto", rt, None, options)
    opts = ReshardOptions(src=src, dst=dst, target_tp=target_tp, target_pp=target_pp, formats=options)
    layout = target_layout(opts, index, fmt)
    check_vocab(opts, index, index.cfg, layout)
    target = Target(cfg=index.cfg, layout=layout, dtype=None, iteration=index.iteration, origin=index.origin,
                    args=args_for_target(index.args, index.cfg, layout, None, tokenizer=index.origin.tokenizer))
    files = fmt.target_files(target, source_dtypes(index))
    shards = load_every_shard(index, trust_pickle)
    t_load = time.perf_counter()
    full = concatenate(index, shards)
    del shards
    t_concat = time.perf_counter()
    iter_dir = dst / iter_dir_name(index.iteration)
    iter_dir.mkdir(parents=True)
    # torch_dist: one save of every target rank's chunks; else one target rank file at a time
    written: list[WrittenFile] = []
    for group in ([files] if fmt.name == "torch_dist" else [[f] for f in files]):
        data = split(group, full)
        writer = fmt.open_writer(target, iter_dir, group, rt)
        for f in group:
            for j in range(len(f.tensors)):
                written += writer.put(f, j, data[(f.id, j)])
        written += writer.close()
        del data
    fmt.finalize(target, iter_dir, written)
    write_tracker(dst, index.iteration)
    t1 = time.perf_counter()
    return {"wall_s": t1 - t0, "load_s": t_load - t0, "concat_s": t_concat - t_load, "split_write_s": t1 - t_concat,
            "peak_rss": peak_rss_bytes(), "world": 1}


def main(argv: list[str] | None = None) -> int:
    a = job_args("dist_convert.bench.baselines", __doc__, argv)
    try:
        if a.dst.exists():
            raise ConvertError(f"target {a.dst} already exists", "remove it or choose another DST")
        stats = whole_model(a.src, a.dst, a.tp, a.pp)
    except ConvertError as e:
        print(f"dist_convert: error: {e}", file=sys.stderr)
        return 2
    if a.stats_json:
        a.stats_json.write_text(json.dumps(stats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
