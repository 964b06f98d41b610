"""Pure tests of the planner: every target byte covered exactly once, every source byte read once,
bytes in flight per rank within the budget, reads balanced. Execution is simulated in memory."""
import itertools
from collections import defaultdict

import pytest
import torch

from dist_convert.cuts import split_files
from dist_convert.datamodel import SourceChunk, Target
from dist_convert.exchange import Assembly, execute
from dist_convert.formats.megatron import MegatronFormat, rank_entries
from dist_convert.formats.torch_dist import TorchDistFormat
from dist_convert.layout.rules import logical_tensors
from dist_convert.layout.topology import Layout
from dist_convert.plan import Plan, aligned, make_plan
from dist_convert.runtime import Runtime

from flat_config import flat_config, with_flat

CFG = flat_config(num_layers=4, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4, num_query_groups=2,
                  kv_channels=8, swiglu=True, normalization="LayerNorm", add_bias_linear=True, add_qkv_bias=True,
                  untie_embeddings_and_output_weights=False, vocab_size=50, make_vocab_size_divisible_by=8,
                  position_embedding_type="learned_absolute", max_position_embeddings=16, qk_layernorm=False,
                  spec="local")


def logical_model(cfg):
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(t.shape, generator=g) for n, t in logical_tensors(cfg).items()}


def legacy_source(cfg, layout, model):
    """Chunks of a legacy checkpoint at ``layout`` and their stored data, built from the pieces."""
    chunks, data = [], {}
    for p in range(layout.pp):
        for t in range(layout.tp):
            for key, (shape, pieces) in rank_entries(cfg, layout, t, p, "local").items():
                local = torch.full(shape, 7.0)  # padding rows hold junk that must not leak
                for pc in pieces:
                    local[pc.sbox.slices()] = model[pc.logical][pc.lbox.slices()].reshape(pc.sbox.sizes)
                c = SourceChunk(id=len(chunks), file=f"mp_rank_{t:02d}_{p:03d}", key=key, shape=shape,
                                dtype=torch.float32, pieces=pieces)
                chunks.append(c)
                data[c.id] = local
    return chunks, data


def simulate(plan, files, data):
    out = {(f.id, j): torch.zeros(t.shape, dtype=t.dtype) for f in files for j, t in enumerate(f.tensors)}
    for w in plan.waves:
        for tr in w.transfers:
            assert plan.reader_of[tr.chunk] == tr.reader and plan.writer_of[tr.file] == tr.writer
            dst = out[(tr.file, tr.tensor)][tr.dst_box.slices()]
            dst.copy_(data[tr.chunk][tr.src_box.slices()].reshape(dst.shape))
    return out


def assert_targets_hold(out, files, model):
    """Every simulated target tensor holds exactly its pieces of the logical model, zeros elsewhere."""
    for f in files:
        for j, t in enumerate(f.tensors):
            expect = torch.zeros(t.shape)
            for pc in t.pieces:
                expect[pc.sbox.slices()] = model[pc.logical][pc.lbox.slices()].reshape(pc.sbox.sizes)
            assert torch.equal(out[(f.id, j)], expect), (f.name, t.key)


def numel(cfg):
    out = {}
    for n, t in logical_tensors(cfg).items():
        k = 1
        for s in t.shape:
            k *= s
        out[n] = k
    return out


def wave_peak_bytes(plan: Plan, by_id: dict[int, SourceChunk]) -> list[int]:
    """Largest per-rank bytes in memory over all waves (reads + send and receive buffers + the target
    bytes filled), recounted from the plan's transfers independently of the planner's own bookkeeping."""
    peak = [0] * plan.world
    for w in plan.waves:
        used = [0] * plan.world
        for r, cids in w.reads.items():
            for cid in cids:
                used[r] += max(by_id[cid].nbytes, sum(t.nbytes for t in w.transfers if t.chunk == cid))
        for t in w.transfers:
            used[t.writer] += t.nbytes
            if t.reader != t.writer:
                used[t.reader] += aligned(t.nbytes)
                used[t.writer] += aligned(t.nbytes)
        peak = [max(a, b) for a, b in zip(peak, used, strict=True)]
    return peak


CASES = list(itertools.product([Layout(tp=2, pp=2), Layout(tp=1, pp=1), Layout(tp=2, pp=1, first=None, last=None),
                                Layout(tp=1, pp=2, vpp=2)],
                               [Layout(tp=1, pp=4), Layout(tp=2, pp=1), Layout(tp=1, pp=3, first=2), Layout(tp=2, pp=2),
                                Layout(tp=2, pp=2, vpp=2)],
                               [1, 3, 4], ["megatron", "torch_dist"]))


@pytest.mark.parametrize("src,dst,world,fmt", CASES)
def test_plan_covers_every_target_byte_once(src, dst, world, fmt):
    model = logical_model(CFG)
    chunks, data = legacy_source(CFG, src, model)
    writer = MegatronFormat() if fmt == "megatron" else TorchDistFormat()
    files = writer.target_files(Target(cfg=CFG, layout=dst, dtype=None, args=None, iteration=1),
                                {n: torch.float32 for n in model})
    budget = 64 << 10
    plan = make_plan(chunks, files, world, budget, numel(CFG))
    # each needed source chunk is read by exactly one rank; replicas (TP copies of norms) are skipped
    read = [cid for w in plan.waves for r, cids in w.reads.items() for cid in cids]
    assert len(read) == len(set(read)) == len(plan.reader_of)
    assert (plan.skipped_chunks > 0) == (src.tp > 1 or (src.pp > 1 and not CFG.untie_embeddings_and_output_weights))
    # every target element gets exactly one value: transfers are disjoint and cover all pieces
    per_tensor = {}
    for w in plan.waves:
        for tr in w.transfers:
            per_tensor.setdefault((tr.file, tr.tensor), []).append(tr.dst_box)
    for f in files:
        for j, t in enumerate(f.tensors):
            boxes = per_tensor.get((f.id, j), [])
            assert sum(b.numel for b in boxes) == sum(p.lbox.numel for p in t.pieces)
            assert not any(a.intersect(b) for a, b in itertools.combinations(boxes, 2))
    # the stored values are exactly the logical tensors (padding rows zero)
    assert_targets_hold(simulate(plan, files, data), files, model)
    # bytes in flight per rank per wave stay within the budget
    assert max(wave_peak_bytes(plan, {c.id: c for c in chunks})) <= budget


def test_reads_are_balanced_and_each_byte_read_once():
    model = logical_model(CFG)
    chunks, _ = legacy_source(CFG, Layout(tp=2, pp=2), model)
    files = MegatronFormat().target_files(Target(cfg=CFG, layout=Layout(tp=1, pp=1), dtype=None, args=None,
                                                 iteration=1), {n: torch.float32 for n in model})
    plan = make_plan(chunks, files, 4, 1 << 30, numel(CFG))
    unique = sum(c.nbytes for c in chunks if c.id in plan.reader_of)
    assert sum(plan.read_bytes) == unique
    biggest = max(c.nbytes for c in chunks)
    cap = 1.15 * unique / 4  # the writer reads what it writes up to 15% over a fair share ...
    assert plan.write_bytes[0] == sum(f.nbytes for f in files) and plan.read_bytes[0] > cap - biggest
    # ... and the rest is balanced over the others
    assert max(plan.read_bytes) <= max(cap, min(plan.read_bytes) + biggest)
    assert max(plan.read_bytes[1:]) - min(plan.read_bytes[1:]) <= biggest
    assert sum(plan.write_bytes) == sum(f.nbytes for f in files)


def test_budget_splits_waves():
    model = logical_model(CFG)
    chunks, _ = legacy_source(CFG, Layout(tp=2, pp=1), model)
    files = TorchDistFormat().target_files(Target(cfg=CFG, layout=Layout(tp=1, pp=2), dtype=None, args=None,
                                                  iteration=1), {n: torch.float32 for n in model})
    big = make_plan(chunks, files, 2, 1 << 30, numel(CFG))
    small = make_plan(chunks, files, 2, 16 << 10, numel(CFG))
    assert len(big.waves) == 1 and len(small.waves) > 4
    assert small.moved_bytes == big.moved_bytes


def test_missing_source_shard_is_refused():
    from dist_convert.errors import ConvertError
    model = logical_model(CFG)
    chunks, _ = legacy_source(CFG, Layout(tp=2, pp=1), model)
    chunks = [c for c in chunks if not (c.file.startswith("mp_rank_01") and "linear_proj.weight" in c.key)]
    files = MegatronFormat().target_files(Target(cfg=CFG, layout=Layout(tp=1, pp=1), dtype=None, args=None,
                                                 iteration=1), {n: torch.float32 for n in model})
    with pytest.raises(ConvertError, match="do not cover"):
        make_plan(chunks, files, 2, 1 << 30, numel(CFG))


def test_absent_tensors_are_neither_read_nor_written():
    """--allow-missing: a logical tensor one rank file lacks is left out everywhere: the plan reads
    none of it (not even the half another rank has) and omit_absent drops it from every target file."""
    from dist_convert.datamodel import TargetFile, TargetTensor, omit_absent
    from dist_convert.errors import ConvertError
    from dist_convert.layout.boxes import Box, Piece
    model = logical_model(CFG)
    chunks, data = legacy_source(CFG, Layout(tp=2, pp=2), model)
    gone = "decoder.layers.1.mlp.linear_fc2.weight"
    chunks = [c for c in chunks if not (c.file == "mp_rank_01_000" and c.key == gone)]
    for fmt in (MegatronFormat(), TorchDistFormat()):
        full = fmt.target_files(Target(cfg=CFG, layout=Layout(tp=1, pp=2), dtype=None, args=None, iteration=1),
                                {n: torch.float32 for n in model})
        with pytest.raises(ConvertError, match=f"source shards of {gone} do not cover it"):
            make_plan(chunks, full, 2, 1 << 20, numel(CFG))
        files = omit_absent(full, {gone})
        assert [(f.id, f.name, f.objects) for f in files] == [(f.id, f.name, f.objects) for f in full]
        kept = [(f.id, t) for f in files for t in f.tensors]
        assert len(kept) == sum(len(f.tensors) for f in full) - 1
        assert all(p.logical != gone for _, t in kept for p in t.pieces)
        plan = make_plan(chunks, files, 2, 1 << 20, numel(CFG), absent={gone})
        by_id = {c.id: c for c in chunks}
        assert all(p.logical != gone for cid in plan.reader_of for p in by_id[cid].pieces)
        assert_targets_hold(simulate(plan, files, data), files, model)
        assert omit_absent(full, frozenset()) is full
    a = Piece(logical="a", lbox=Box((0,), (1,)), sbox=Box((0,), (1,)))
    b = Piece(logical="b", lbox=Box((0,), (1,)), sbox=Box((1,), (1,)))
    mixed = [TargetFile(id=0, name="f",
                        tensors=[TargetTensor(key="ab", shape=(2,), dtype=torch.float32, pieces=[a, b])])]
    with pytest.raises(ConvertError, match="holds a, which the source lacks, together with tensors it has"):
        omit_absent(mixed, {"a"})
    assert omit_absent(mixed, {"a", "b"})[0].tensors == []


def test_vocab_shard_that_is_all_padding_is_zero_filled():
    cfg = CFG.replace(num_query_groups=4, vocab_size=40)  # padded to 64 at TP=4: rank 3 holds rows 48..63
    model = logical_model(cfg)
    chunks, data = legacy_source(cfg, Layout(tp=1, pp=1), model)
    for fmt in (MegatronFormat(), TorchDistFormat()):
        files = fmt.target_files(Target(cfg=cfg, layout=Layout(tp=4, pp=1), dtype=None, args=None, iteration=1),
                                 {n: torch.float32 for n in model})
        plan = make_plan(chunks, files, 2, 1 << 20, numel(cfg))
        out = simulate(plan, files, data)
        emb = [(f, j, t) for f in files for j, t in enumerate(f.tensors) if t.key == "embedding.word_embeddings.weight"]
        assert len(emb) == 4 and all(t.shape == (16, 32) for _, _, t in emb)
        assert emb[3][2].pieces == [] and not out[(emb[3][0].id, emb[3][1])].any()
        rank2 = out[(emb[2][0].id, emb[2][1])]
        assert torch.equal(rank2[:8], model["embedding.word_embeddings.weight"][32:40]) and not rank2[8:].any()


def test_waves_are_packed_near_the_lower_bound_at_scale():
    """A Llama-70B-shaped TP8 PP8 -> TP4 PP16 plan over 64 ranks: local, balanced reads, and first-fit
    packing needs few waves more than the busiest rank's bytes / budget."""
    big = with_flat(CFG, num_layers=80, hidden_size=8192, ffn_hidden_size=28672, num_attention_heads=64,
                      num_query_groups=8, kv_channels=128, normalization="RMSNorm", add_bias_linear=False,
                      add_qkv_bias=False, untie_embeddings_and_output_weights=True, vocab_size=128256,
                      make_vocab_size_divisible_by=128, position_embedding_type="rope")
    src = Layout(tp=8, pp=8)
    chunks = []
    for p in range(src.pp):
        for t in range(src.tp):
            for key, (shape, pieces) in rank_entries(big, src, t, p, "local").items():
                chunks.append(SourceChunk(id=len(chunks), file=f"{t}_{p}", key=key, shape=shape, dtype=torch.bfloat16,
                                          pieces=pieces))
    names = numel(big)
    target = Target(cfg=big, layout=Layout(tp=4, pp=16), dtype=None, args=None, iteration=1)
    files = TorchDistFormat().target_files(target, {n: torch.bfloat16 for n in names})
    budget = 256 << 20
    plan = make_plan(chunks, files, 64, budget, names)
    unique = sum(c.nbytes for c in chunks if c.id in plan.reader_of)
    assert sum(plan.read_bytes) == unique
    # each rank reads what it writes (embedding and head stages write more), at most 15% over a fair
    # share of reads, so that almost nothing crosses the network
    assert max(plan.read_bytes) <= 1.15 * unique / 64
    moved = [t.nbytes for w in plan.waves for t in w.transfers if t.reader != t.writer]
    assert sum(moved) < 0.02 * sum(t.nbytes for w in plan.waves for t in w.transfers)
    per_rank = [0] * 64
    by_id = {c.id: c for c in chunks}
    for w in plan.waves:
        for r, cids in w.reads.items():
            per_rank[r] += sum(by_id[c].nbytes for c in cids)
        for t in w.transfers:
            per_rank[t.writer] += t.nbytes
            if t.reader != t.writer:
                per_rank[t.reader] += t.nbytes
                per_rank[t.writer] += t.nbytes
    lower = max(per_rank) / budget
    assert len(plan.waves) <= 2.5 * lower, (len(plan.waves), lower)
    # over budget only where one chunk alone (held + its send copy) is larger than the budget
    assert max(wave_peak_bytes(plan, by_id)) <= max(budget, 2 * max(c.nbytes for c in chunks))


def test_split_files_give_every_rank_a_part():
    model = logical_model(CFG)
    chunks, data = legacy_source(CFG, Layout(tp=2, pp=1), model)
    files = TorchDistFormat().target_files(Target(cfg=CFG, layout=Layout(tp=1, pp=2), dtype=None, args=None,
                                                  iteration=1), {n: torch.float32 for n in model})
    parts = split_files(files, 4)
    assert len(files) == 2 and len(parts) == 4
    key = lambda t: (t.key, t.offsets)  # noqa: E731
    assert sorted(key(t) for f in parts for t in f.tensors) == sorted(key(t) for f in files for t in f.tensors)
    assert sum(len(f.objects) for f in parts) == sum(len(f.objects) for f in files)
    for f in files:  # each file's two parts are near-equal in bytes
        a, b = (p.nbytes for p in parts if p.name.startswith(f.name + "."))
        assert abs(a - b) <= max(t.nbytes for t in f.tensors)
    plan = make_plan(chunks, parts, 4, 1 << 30, numel(CFG))
    assert all(plan.write_bytes)
    assert_targets_hold(simulate(plan, parts, data), parts, model)
    assert split_files(files, 2) == files


@pytest.mark.parametrize("block", [None, 512])
def test_tensors_are_handed_over_once_complete_and_not_held(block, monkeypatch):
    """The real exchange at one rank: every target tensor reaches the writer exactly once, complete,
    and waves in target order keep few tensors in assembly at a time. With row blocks (``block`` bytes) each
    block reaches it once instead, the blocks of a tensor tile its rows, and at most a few blocks are held
    at a time, however large a tensor is."""
    import dist_convert.plan

    monkeypatch.setattr(dist_convert.plan, "BLOCK_MIN", 0)  # a writer's floor; this model's tensors are smaller
    model = logical_model(CFG)
    chunks, data = legacy_source(CFG, Layout(tp=2, pp=2), model)
    files = MegatronFormat().target_files(Target(cfg=CFG, layout=Layout(tp=1, pp=1), dtype=None, args=None,
                                                 iteration=1), {n: torch.float32 for n in model})
    plan = make_plan(chunks, files, 1, 4 << 10, numel(CFG))
    handed, held, blocks = {}, [], defaultdict(dict)

    def done(fid, j, first_row, t):
        if first_row is None:
            assert (fid, j) not in handed
            handed[(fid, j)] = t
        else:
            assert first_row not in blocks[(fid, j)]
            blocks[(fid, j)][first_row] = t
        held.append(sum(b.nbytes for b in out.blocks.values()))

    out = Assembly(files, plan, 0, done, block_bytes=block)
    by_id = {c.id: c for c in chunks}
    execute(plan, Runtime(), by_id, lambda cs: {c.id: data[c.id] for c in cs}, out)
    out.finish()
    assert not out.blocks
    for key, parts in blocks.items():
        rows = [parts[r] for r in sorted(parts)]
        assert all(b.nbytes <= block for b in rows)
        assert sum(b.shape[0] for b in rows) == files[key[0]].tensors[key[1]].shape[0]
        handed[key] = torch.cat(rows)
    assert len(handed) == sum(len(f.tensors) for f in files)
    assert_targets_hold(handed, files, model)
    biggest = max(t.nbytes for f in files for t in f.tensors)
    assert len(plan.waves) > 5 and (max(held) <= 4 * biggest if block is None else bool(blocks))
    if block:
        assert max(held) <= (4 << 10) + 4 * block < biggest, (max(held), biggest)  # the budget, not the tensor


def test_box_index_finds_exactly_the_overlapping_boxes():
    """BoxIndex (the planner's overlap query) against brute force, over random cuts, replicas and queries."""
    import random

    from dist_convert.layout.boxes import Box, BoxIndex

    rng = random.Random(0)
    for _ in range(200):
        shape = (rng.randint(1, 40), rng.randint(1, 40))
        boxes = []
        for _ in range(rng.randint(1, 12)):
            r0, c0 = rng.randrange(shape[0]), rng.randrange(shape[1])
            boxes.append(Box((r0, c0), (rng.randint(1, shape[0] - r0), rng.randint(1, shape[1] - c0))))
        index = BoxIndex([(b, i) for i, b in enumerate(boxes)])
        for _ in range(10):
            r0, c0 = rng.randrange(shape[0]), rng.randrange(shape[1])
            q = Box((r0, c0), (rng.randint(1, shape[0] - r0), rng.randint(1, shape[1] - c0)))
            want = {(i, b.intersect(q)) for i, b in enumerate(boxes) if b.intersect(q) is not None}
            assert {(v, inter) for _, inter, v in index.overlapping(q)} == want


def test_cutting_a_chunk_of_many_pieces_keeps_every_piece_of_each_cell():
    """gpt-oss's HF expert tensors hold every expert of a layer, gate and up interleaved: hundreds of strided pieces
    per chunk. split_chunks looks up the pieces near each cell through an index of their covering boxes; each cell
    must hold exactly the parts that testing every piece of the chunk finds (``piece_within``), in the same order."""
    from dataclasses import replace

    from dist_convert.bench.plan_scale import GPT_OSS_120B, hf_chunks
    from dist_convert.cuts import split_chunks
    from dist_convert.layout.boxes import Box, piece_within
    from dist_convert.models import config_from_hf

    hf = {**GPT_OSS_120B, "num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"],
          "num_local_experts": 16, "hidden_size": 64, "intermediate_size": 48, "num_attention_heads": 8,
          "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 256}
    cfg, args, _ = config_from_hf(hf, None)
    dtypes = dict.fromkeys(logical_tensors(cfg), torch.bfloat16)
    target = Target(cfg=cfg, layout=Layout(tp=2, pp=1, ep=4, etp=1), dtype=None, args=args, iteration=0)
    files = split_files(TorchDistFormat().target_files(target, dtypes), 8)
    chunks = hf_chunks(cfg, shards=2)
    assert max(len(c.pieces) for c in chunks) >= 32  # the expert tensors
    by_key = {c.key: c for c in chunks}
    cut = split_chunks(chunks, files, 1 << 30)
    assert len(cut) > len(chunks)
    for c in cut:
        whole = by_key[c.key]
        box = Box(c.offsets, c.shape)  # HF chunks start at the origin: chunk coordinates are the tensor's
        brute = [replace(p, sbox=p.sbox.relative_to(box)) for sp in whole.pieces
                 if (p := piece_within(sp, box)) is not None]
        assert c.pieces == brute, c.key
