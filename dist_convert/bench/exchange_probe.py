"""The exchange alone, without storage: ``torchrun --nproc_per_node=W -m dist_convert.bench.exchange_probe --size
512MB --exchange shm --json OUT``. Every rank holds its source chunks in memory (touched), every target file is
written by rank 0, and ``exchange.execute`` moves them; rank 0 writes each rank's exchange seconds and the bytes
that crossed ranks (what ``docs/exchange.md`` quotes for shm against gloo)."""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from ..datamodel import SourceChunk, TargetFile, TargetTensor
from ..exchange import Assembly, execute
from ..layout.boxes import Box, Piece
from ..plan import make_plan
from ..runtime import init_runtime
from ..sizes import parse_size

ROW = 4096  # elements per row of every synthetic tensor (bf16)


def synthetic(size: int, tensors: int) -> tuple[list[SourceChunk], list[TargetFile], dict[str, int]]:
    """``tensors`` logical tensors of ``size`` bytes in all, each stored as two row halves (two source chunks) and
    written whole into one target file."""
    rows = max(2, size // tensors // (ROW * 2)) // 2 * 2
    chunks, targets = [], []
    for i in range(tensors):
        name = f"t{i}"
        full = Box((0, 0), (rows, ROW))
        targets.append(TargetTensor(key=name, shape=(rows, ROW), dtype=torch.bfloat16,
                                    pieces=[Piece(logical=name, lbox=full, sbox=full)]))
        for h in range(2):
            part = Box((h * rows // 2, 0), (rows // 2, ROW))
            chunks.append(SourceChunk(id=len(chunks), file=f"src{h}", key=name, shape=(rows // 2, ROW),
                                      dtype=torch.bfloat16,
                                      pieces=[Piece(logical=name, lbox=part, sbox=Box((0, 0), (rows // 2, ROW)))]))
    return chunks, [TargetFile(id=0, name="target", tensors=targets)], {f"t{i}": rows * ROW for i in range(tensors)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="exchange_probe", description=__doc__)
    ap.add_argument("--size", type=parse_size, default=512 << 20)
    ap.add_argument("--tensors", type=int, default=32)
    ap.add_argument("--exchange", default="auto")
    ap.add_argument("--memory-budget", type=parse_size, default=256 << 20)
    ap.add_argument("--json", type=Path, default=None)
    ns = ap.parse_args(argv)
    rt = init_runtime("gloo")
    chunks, files, numel = synthetic(ns.size, ns.tensors)
    plan = make_plan(chunks, files, rt.world, ns.memory_budget, numel, writer_of={0: 0})
    g = torch.Generator().manual_seed(rt.rank)
    data = {c.id: torch.randn(c.shape, generator=g).to(c.dtype) for c in chunks if plan.reader_of.get(c.id) == rt.rank}
    out = Assembly([files[0]] if rt.rank == 0 else [], plan, rt.rank)
    t0 = time.perf_counter()
    stats = execute(plan, rt, {c.id: c for c in chunks}, lambda cs: {c.id: data[c.id] for c in cs}, out,
                    exchange=ns.exchange)
    wall = time.perf_counter() - t0
    rows = rt.all_gather_object({"rank": rt.rank, "wall_s": wall, "sent": stats["sent"], "received": stats["received"],
                                 **{k.replace("_ns", "_s"): stats.get(k, 0) / 1e9
                                    for k in ("exchange_ns", "pack_ns", "move_ns", "unpack_ns")}})
    if rt.rank == 0:
        result = {"exchange": ns.exchange, "bytes": sum(r["sent"] for r in rows), "waves": len(plan.waves),
                  "ranks": rows}
        print(json.dumps(result))
        if ns.json:
            ns.json.write_text(json.dumps(result))
    rt.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
