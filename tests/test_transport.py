"""The exchange path (dist_convert/transport.py): a pure decision from the plan and the job's nodes
(nothing crossing ranks, same-node peers over /dev/shm, other nodes over gloo or NCCL, a forced path, NCCL
refused without CUDA); the staging buffers' accounting; and end to end on CPU: shm and gloo give the same bytes
and leave nothing in /dev/shm, and two torchrun agents as two "nodes" on this machine equal one node."""
from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path

import pytest
import torch

from dist_convert.bench.report import exchange_rows
from dist_convert.datamodel import SourceChunk, TargetTensor
from dist_convert.errors import ConvertError
from dist_convert.estimate import rank_estimates, shm_segments
from dist_convert.layout.boxes import Box
from dist_convert.plan import Plan, StagingBytes, Transfer, Wave, aligned, staging_bytes
from dist_convert.transport import (
    PAGE,
    Segment,
    decide,
    launch_env,
    leftover_segments,
    map_part,
    node_map,
    node_of,
    pair_bytes,
    remove_stale,
    segment_offsets,
    segment_path,
    segment_sizes,
    shm_need,
    shm_room,
)

from conftest import ENV, PY, ROOT, assert_refused, ok, run_cli


def _t(reader: int, writer: int, nbytes: int, chunk: int = 0) -> Transfer:
    n = nbytes // 2
    return Transfer(chunk=chunk, src_box=Box((0,), (n,)), reader=reader, file=0, tensor=0, dst_box=Box((0,), (n,)),
                    writer=writer, nbytes=nbytes, dtype=torch.bfloat16)


def _plan(world: int, *waves: list[Transfer]) -> Plan:
    return Plan(world=world, reader_of={}, writer_of={}, waves=[Wave(transfers=list(w)) for w in waves],
                read_bytes=[0] * world, write_bytes=[0] * world, skipped_chunks=0)


def test_nodes_from_torchrun_numbers():
    """Homogeneous nodes: rank r on node r // LOCAL_WORLD_SIZE; gathered GROUP_RANKs win (uneven nodes)."""
    assert [node_of(r, 2) for r in range(5)] == [0, 0, 1, 1, 2]
    assert node_map(4, 2) == (0, 0, 1, 1)
    assert node_map(4, 4) == (0, 0, 0, 0)
    assert node_map(3, 2, [0, 1, 1]) == (0, 1, 1)
    assert node_map(3, 1, [0, None, 1]) == (0, 1, 2)  # one unknown: the rule
    with pytest.raises(ValueError):
        node_of(0, 0)
    env = launch_env({"LOCAL_WORLD_SIZE": "8", "GROUP_RANK": "3", "TORCHELASTIC_RUN_ID": "a-b/c"})
    assert (env.local_world_size, env.group_rank, env.run_id) == (8, 3, "abc")
    assert launch_env({}).local_world_size is None and launch_env({}).run_id == "job"


def test_path_decision():
    """auto: same-node peers over shm, other nodes over gloo (NCCL with CUDA); nothing crossing: local, no
    collective; forced paths; a full /dev/shm falls back with a note; NCCL refused without CUDA."""
    nodes = (0, 0, 1, 1)
    plan = _plan(4, [_t(0, 1, 100), _t(1, 2, 50), _t(3, 3, 1000)], [_t(2, 0, 30)])
    pairs = pair_bytes(plan)
    assert pairs == {(0, 1): 100, (1, 2): 50, (2, 0): 30}

    p = decide(pairs, nodes)
    assert (p.within, p.across, p.cross_rank_bytes, p.cross_node_bytes) == ("shm", "gloo", 180, 80)
    assert [p.via(0, 0), p.via(0, 1), p.via(1, 2)] == ["local", "shm", "gloo"]
    assert p.uses_shm and p.collective == "gloo"
    assert p.describe().startswith("exchange: shm within node, gloo across 2 nodes; 180 B cross ranks")

    assert (decide(pairs, nodes, cuda=True).across, decide(pairs, nodes, cuda=True).within) == ("nccl", "shm")
    g = decide(pairs, nodes, "gloo")
    assert (g.within, g.across, g.uses_shm) == ("gloo", "gloo", False) and "(--exchange gloo)" in g.describe()
    assert (decide(pairs, nodes, "nccl", cuda=True).within, decide(pairs, nodes, "shm").across) == ("nccl", "gloo")
    full = decide(pairs, nodes, shm_ok=False, shm_why="/dev/shm has 1 MB free")
    assert full.within == "gloo" and "/dev/shm has 1 MB free: same-node peers use gloo" in full.describe()

    one_node = decide(pairs, (0, 0, 0, 0))
    assert (one_node.within, one_node.across, one_node.cross_node_bytes) == ("shm", "local", 0)
    assert "across" not in one_node.describe()
    across_only = decide({(0, 1): 5}, (0, 1))
    assert (across_only.within, across_only.across) == ("local", "gloo")

    nothing = decide(pair_bytes(_plan(2, [_t(0, 0, 10), _t(1, 1, 10)])), (0, 0), "gloo")
    assert (nothing.within, nothing.across, nothing.collective, nothing.uses_shm) == ("local", "local", None, False)
    assert "no collective" in nothing.describe()
    one_rank = decide(pair_bytes(_plan(1, [_t(0, 0, 10)])), (0,), "gloo")  # no peer: its own bytes, a check
    assert (one_rank.via(0, 0), one_rank.collective, one_rank.cross_rank_bytes) == ("gloo", "gloo", 0)
    assert "its own bytes through gloo" in one_rank.describe()
    assert decide(pair_bytes(_plan(1, [_t(0, 0, 10)])), (0,)).via(0, 0) == "local"  # auto: a copy

    with pytest.raises(ConvertError, match=r"--exchange nccl needs a CUDA runtime.*use --exchange auto"):
        decide(pairs, nodes, "nccl", cuda=False)
    with pytest.raises(ConvertError, match="unknown --exchange"):
        decide(pairs, nodes, "rdma")


def test_staging_buffers_are_sized_by_the_largest_wave():
    """Per rank, the most aligned bytes sent and received over the collective in one wave; shared-memory peers
    (the predicate) and local copies do not count; the /dev/shm need is per node and page-aligned."""
    plan = _plan(3, [_t(0, 1, 100), _t(0, 2, 10), _t(1, 1, 4000)], [_t(0, 1, 30), _t(2, 0, 500), _t(1, 0, 6)])
    assert staging_bytes(plan, 0) == StagingBytes(send=aligned(100) + aligned(10), receive=aligned(500) + aligned(6))
    assert staging_bytes(plan, 1) == StagingBytes(send=aligned(6), receive=aligned(100))
    assert staging_bytes(plan, 1).total == aligned(6) + aligned(100)
    nodes = (0, 0, 1)  # 0 and 1 share a node: their bytes go through /dev/shm, not the staging buffers
    over = lambda a, b: nodes[a] != nodes[b]  # noqa: E731
    assert staging_bytes(plan, 0, over) == StagingBytes(send=aligned(10), receive=aligned(500))
    assert staging_bytes(plan, 1, over) == StagingBytes(send=0, receive=0)
    assert segment_sizes(plan, nodes) == [PAGE, PAGE, 0] and shm_need(plan, nodes) == 2 * PAGE
    assert segment_sizes(_plan(3, [_t(0, 1, 30), _t(0, 1, PAGE), _t(0, 2, 9)]), nodes) == [2 * PAGE, 0, 0]
    assert shm_need(plan, (0, 1, 2)) == 0
    assert segment_offsets({2: PAGE + 1, 1: 10, 3: 0}) == ({1: 0, 2: PAGE}, 3 * PAGE)


def test_the_memory_model_holds_shared_memory_for_the_whole_job():
    """plan's prediction (estimate): between the ranks of one CPU node a rank maps its own segment and its part
    of each sender's for the whole job, and a wave's send and receive buffers are those segments, not more."""
    plan = _plan(3, [_t(0, 1, 100), _t(0, 2, 10), _t(1, 1, 4000)], [_t(0, 1, 30), _t(2, 0, 500), _t(1, 0, 6)])
    # own segment + the part of each sender's: rank 0 sends to two peers in a wave, receives from 1 and 2
    assert shm_segments(plan) == [2 * PAGE + 2 * PAGE, PAGE + PAGE, PAGE + PAGE]
    chunks = {0: SourceChunk(id=0, file="f", key="w", shape=(4000,), dtype=torch.bfloat16, pieces=[])}
    tensors = {(0, 0): TargetTensor(key="w", shape=(4000,), dtype=torch.bfloat16, pieces=[])}
    base = 1000

    def peaks(shm: bool) -> list[int]:
        return [r.predicted_peak_rss - base for r in
                rank_estimates(plan, chunks, tensors, base, 1.0, 1.0, 1.0, shm=shm)]

    # with buffers, the largest wave's: rank 0's second (sends 30, receives 500 + 6, assembles the 8000-byte
    # tensor), rank 1's first (receives 100), rank 2's second (sends 500)
    assert peaks(False) == [30 + 506 + 8000, 100 + 8000, 500 + 8000]
    assert peaks(True) == [8000 + 4 * PAGE, 8000 + 2 * PAGE, 8000 + 2 * PAGE]  # the segments, in every wave


def test_a_segment_round_trips_and_is_gone_after_unlink(tmp_path):
    """A sender's segment, a receiver's page-aligned part mapped from it, still readable after the unlink; a
    /dev/shm that cannot hold a wave is said so."""
    path = segment_path("test", "tok", 0, where=tmp_path)
    seg = Segment(path, 2 * PAGE)
    seg.buf[PAGE:PAGE + 4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    part = map_part(path, PAGE, 4)
    seg.unlink()
    assert part.tolist() == [1, 2, 3, 4] and leftover_segments(tmp_path) == []
    part[0] = 9  # private to the receiver
    assert shm_room(1 << 60, tmp_path) is not None and "missing" in shm_room(0, tmp_path / "no")
    dead = subprocess.run([PY, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout
    stale, live = segment_path("r", "t", 1, tmp_path, int(dead)), segment_path("r", "t", 0, tmp_path)
    stale.touch()
    live.touch()
    assert remove_stale(tmp_path) == [stale] and leftover_segments(tmp_path) == [live]


def test_bench_reports_exchange_seconds_per_path():
    """bench --methods exchange: per path, the median exchange seconds and the GB/s of the bytes moved."""
    runs = [{"detail": {"exchange_s": s, "exchanged_bytes": 2**30}} for s in (1.0, 4.0, 2.0)]
    rows = [{"method": "exchange_shm", "label": "shm w=2", "world": 2, "status": "ok", "wall_s": 5.0, "runs": runs},
            {"method": "dist_convert", "label": "w=2", "world": 2, "status": "ok", "wall_s": 5.0, "runs": runs},
            {"method": "exchange_gloo", "label": "gloo w=2", "world": 2, "status": "failed", "wall_s": None,
             "runs": []}]
    assert exchange_rows(rows) == [{"label": "shm w=2", "world": 2, "exchange_s": 2.0, "bytes": 2**30,
                                    "gb_per_s": 0.5, "wall_s": 5.0}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_shm_gloo_and_two_nodes_give_the_same_bytes(gpt_a, tmp_path):
    """World 2 on one node with --exchange shm and --exchange gloo, auto without a shared-memory directory, and two
    torchrun agents of 2 ranks as two nodes (auto: shm within each, gloo across): byte-identical targets, each
    path said once,
    exchange seconds in the stats, nothing left in /dev/shm; --exchange nccl without CUDA is one error line
    naming the flag."""
    before = set(leftover_segments())
    # one target file (rank 0 writes it) read by both ranks: half the bytes cross ranks
    flags = ["--dst-format", "megatron", "--target-tp", "1", "--target-pp", "1", "--memory-budget", "64KB"]
    outs = {}
    for path in ("shm", "gloo"):
        stats = tmp_path / f"{path}.json"
        proc = ok(run_cli("reshard", str(gpt_a.torch_dist), str(tmp_path / path), *flags, "--exchange", path,
                          "--stats-json", str(stats), nproc=2))
        lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("exchange:")]
        assert len(lines) == 1 and lines[0].startswith(f"exchange: {path} within node"), proc.stderr[-2000:]
        ranks = json.loads(stats.read_text())
        assert sum(r["sent_bytes"] for r in ranks) == sum(r["received_bytes"] for r in ranks) > 0, ranks
        assert all(r["exchange_s"] > 0 for r in ranks), ranks
        outs[path] = _files(tmp_path / path)
    assert outs["shm"] == outs["gloo"] and len(outs["shm"]) > 2
    # auto without a usable shared-memory directory: gloo within the node, said once with the reason
    missing = tmp_path / "no_shm"
    proc = ok(run_cli("reshard", str(gpt_a.torch_dist), str(tmp_path / "fallback"), *flags, nproc=2,
                      env={"DIST_CONVERT_SHM_DIR": str(missing)}))
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("exchange:")]
    assert len(lines) == 1 and lines[0].startswith("exchange: gloo within node;"), proc.stderr[-2000:]
    assert f"{missing} is missing or not writable: same-node peers use gloo" in " ".join(proc.stderr.split())
    assert _files(tmp_path / "fallback") == outs["shm"]

    port, two = _free_port(), tmp_path / "two"
    agents = [subprocess.Popen([PY, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(n),
                                "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(port),
                                "dist_convert", "reshard", str(gpt_a.torch_dist), str(two), *flags],
                               cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for n in (0, 1)]
    results = [a.communicate(timeout=240) for a in agents]
    assert [a.returncode for a in agents] == [0, 0], results[0][1][-3000:] + results[1][1][-3000:]
    # world 4: same-node peers over shm and the other node's over gloo, in the same waves
    assert "exchange: shm within node, gloo across 2 nodes;" in results[0][1], results[0][1][-2000:]
    assert _files(two) == outs["shm"]

    # one rank, --exchange gloo: its own bytes through the one-rank collective (the one-device transport check)
    stats = tmp_path / "one.json"
    proc = ok(run_cli("reshard", str(gpt_a.torch_dist), str(tmp_path / "one"), *flags, "--exchange", "gloo",
                      "--stats-json", str(stats), nproc=1))
    assert "exchange: one rank, its own bytes through gloo" in proc.stderr, proc.stderr[-2000:]
    (one,) = json.loads(stats.read_text())
    assert one["sent_bytes"] == one["received_bytes"] > 0 and _files(tmp_path / "one") == outs["shm"]

    proc = run_cli("reshard", str(gpt_a.torch_dist), str(tmp_path / "dst"), *flags, "--exchange", "nccl", nproc=2)
    assert_refused(proc, tmp_path, "--exchange nccl needs a CUDA runtime", "--exchange auto")
    assert set(leftover_segments()) <= before
