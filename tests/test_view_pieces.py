"""Pure tests of pieces stored through a view (layout.boxes.View: transposed and/or strided storage), against
torch's own indexing: HF gpt-oss experts (``gate_up_proj`` [E, H, 2F] with gate and up interleaved on the last
axis, ``down_proj`` [E, F, H]) against megatron-core's per-expert fc1 [2F, H] = [gate; up] and fc2 [H, F], planned
and executed in memory both ways (every rank of a TP=2 EP=2 layout simulated in this process), and the view
algebra on its own (a step on a leading axis, three permuted axes, edge cases)."""
import itertools
import random
from collections import defaultdict

import pytest
import torch

import dist_convert.plan
from dist_convert.cuts import split_chunks
from dist_convert.datamodel import SourceChunk, TargetFile, TargetTensor
from dist_convert.exchange import Assembly, execute, pack, payload, unpack
from dist_convert.layout.boxes import (
    Box,
    Kind,
    Piece,
    View,
    local_pieces,
    logical_view,
    piece_box,
    piece_within,
    strided_slices,
    sub_piece,
    write_logical,
)
from dist_convert.plan import Plan, make_plan
from dist_convert.runtime import Runtime

E, H, F = 4, 6, 4  # experts, hidden, ffn (per half of fc1)
GATE_UP, DOWN = "model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"
FC1_VIEW = View(axes=(2, 1), steps=(1, 1, 2))  # fc1 rows along stored axis 2 (every other column), cols along 1
FC2_VIEW = View(axes=(2, 1), steps=(1, 1, 1))  # fc2 [H, F] stored [F, H]: transposed


def fc1(e: int) -> str:
    return f"decoder.layers.0.mlp.experts.local_experts.{e}.linear_fc1.weight"


def fc2(e: int) -> str:
    return f"decoder.layers.0.mlp.experts.local_experts.{e}.linear_fc2.weight"


LOGICAL_NUMEL = {**{fc1(e): 2 * F * H for e in range(E)}, **{fc2(e): H * F for e in range(E)}}


def gpt_oss_tensors() -> dict[str, tuple[tuple[int, ...], list[Piece]]]:
    """The stored gpt-oss expert tensors and their pieces: expert e's gate (fc1 rows 0..F-1) on the even
    columns of gate_up_proj[e], its up (rows F..2F-1) on the odd ones; fc2 transposed in down_proj[e]."""
    gate_up = [Piece(fc1(e), Box((half * F, 0), (F, H)), Box((e, 0, half), (1, H, 2 * F - 1)), view=FC1_VIEW)
               for e in range(E) for half in (0, 1)]
    down = [Piece(fc2(e), Box.full((H, F)), Box((e, 0, 0), (1, F, H)), view=FC2_VIEW) for e in range(E)]
    return {GATE_UP: ((E, H, 2 * F), gate_up), DOWN: ((E, F, H), down)}


def stored_model() -> dict[str, torch.Tensor]:
    """Distinct values everywhere, so that any misplaced element shows."""
    n = E * H * 2 * F
    vals = torch.randperm(n + E * F * H, generator=torch.Generator().manual_seed(0)).float()
    return {GATE_UP: vals[:n].reshape(E, H, 2 * F), DOWN: vals[n:].reshape(E, F, H)}


def truth(stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The logical (megatron-core) tensors of a stored gpt-oss model, by torch indexing alone."""
    x, y = stored[GATE_UP], stored[DOWN]
    out = {fc1(e): torch.cat([x[e][:, 0::2].T, x[e][:, 1::2].T]) for e in range(E)}
    return out | {fc2(e): y[e].T for e in range(E)}


def mcore_files(tp: int = 2, ep: int = 2) -> list[TargetFile]:
    """Megatron-core's per-expert tensors at TP x EP: file (ep, tp) holds the experts of its EP rank, fc1 as
    [gate_r; up_r] (GLU halves of rows) and fc2 as a column slice."""
    files, per = [], E // ep
    for ep_rank, tp_rank in itertools.product(range(ep), range(tp)):
        tensors = []
        for i in range(per):
            e = ep_rank * per + i
            for name, kind, shape in ((fc1(e), Kind.GLU, (2 * F, H)), (fc2(e), Kind.ROW, (H, F))):
                lshape, pieces = local_pieces(name, kind, shape, shape[0], tp_rank, tp)
                tensors.append(TargetTensor(key=f"local_experts.{i}.{name.split('.')[-2]}.weight", shape=lshape,
                                            dtype=torch.float32, pieces=pieces))
        files.append(TargetFile(id=len(files), name=f"ep{ep_rank}_tp{tp_rank}", tensors=tensors))
    return files


def stored_files(tensors: dict[str, tuple[tuple[int, ...], list[Piece]]]) -> list[TargetFile]:
    return [TargetFile(id=0, name="model.safetensors",
                       tensors=[TargetTensor(key=k, shape=s, dtype=torch.float32, pieces=p)
                                for k, (s, p) in tensors.items()])]


def chunks_of(files: list[TargetFile], sliceable: bool) -> list[SourceChunk]:
    """Source chunks that are the tensors of ``files`` (as if written by them), whole at offset 0."""
    return [SourceChunk(id=i, file=f.name, key=t.key, shape=t.shape, dtype=t.dtype, pieces=t.pieces,
                        offsets=(0,) * len(t.shape), sliceable=sliceable)
            for i, (f, t) in enumerate((f, t) for f in files for t in f.tensors)]


def reader(stored: dict[tuple[str, str], torch.Tensor], log: list | None = None):
    """A ReadFn over in-memory stored tensors that reads each chunk's box, noting (file, key, box) in ``log``."""
    def read(chunks: list[SourceChunk]) -> dict[int, torch.Tensor]:
        out = {}
        for c in chunks:
            box = Box(c.offsets or (0,) * len(c.shape), c.shape)
            if log is not None:
                log.append((c.file, c.key, box))
            out[c.id] = stored[(c.file, c.key)][box.slices()].clone()
        return out
    return read


def run_ranks(plan: Plan, files: list[TargetFile], chunks: list[SourceChunk], read) -> dict[tuple[int, int],
                                                                                            torch.Tensor]:
    """Execute ``plan`` for every rank in this process: local copies, then ``pack`` per sender and ``unpack``
    per receiver of the flat buffers an ``all_to_all_single`` would exchange. Returns each written tensor."""
    world, by_id = plan.world, {c.id: c for c in chunks}
    outs = [Assembly(files, plan, r) for r in range(world)]
    for wave in plan.waves:
        data = [read([by_id[c] for c in wave.reads.get(r, [])]) for r in range(world)]
        parts = []
        for r in range(world):
            send = defaultdict(list)
            for t in wave.transfers:
                if t.reader == r == t.writer:
                    outs[r].put(t, payload(data[r][t.chunk], t))
                elif t.reader == r:
                    send[t.writer].append(t)
            buf, sizes = pack(send, data[r], world)
            parts.append(buf.split(sizes))
        for r in range(world):
            recv = defaultdict(list)
            for t in wave.transfers:
                if t.writer == r != t.reader:
                    recv[t.reader].append(t)
            unpack(recv, torch.cat([parts[s][r] for s in range(world)]), world, outs[r])
    return {k: v for r in range(world) for k, v in outs[r].finish().items() if plan.writer_of[k[0]] == r}


def assert_covered_once(plan: Plan, files: list[TargetFile]) -> None:
    """Every element a target tensor's pieces hold gets exactly one transfer (strided boxes interleave, so
    elements are counted, not boxes)."""
    hits = {(f.id, j): torch.zeros(t.shape, dtype=torch.int32) for f in files for j, t in enumerate(f.tensors)}
    for w in plan.waves:
        for t in w.transfers:
            hits[(t.file, t.tensor)][strided_slices(t.dst_box, t.dst_view)] += 1
    for f in files:
        for j, t in enumerate(f.tensors):
            held = torch.zeros(t.shape, dtype=torch.int32)
            for p in t.pieces:
                held[strided_slices(p.sbox, p.view)] += 1
            assert torch.equal(hits[(f.id, j)], held), (f.name, t.key)


def mcore_stored(files: list[TargetFile], logical: dict[str, torch.Tensor]) -> dict[tuple[str, str], torch.Tensor]:
    """The data of megatron-core's local tensors, from the logical ones (plain pieces: reshape only)."""
    out = {}
    for f in files:
        for t in f.tensors:
            local = torch.zeros(t.shape)
            for p in t.pieces:
                local[p.sbox.slices()] = logical[p.logical][p.lbox.slices()].reshape(p.sbox.sizes)
            out[(f.name, t.key)] = local
    return out


def test_gpt_oss_views_extract_the_logical_experts():
    """(1) logical_view of each piece's covering box is torch's gate_up_proj[e].T as [gate; up] and
    down_proj[e].T, whole and for sub-boxes (a TP rank's rows, some columns)."""
    stored = stored_model()
    want = truth(stored)
    for key, (shape, pieces) in gpt_oss_tensors().items():
        assert tuple(stored[key].shape) == shape
        got = {p.logical: torch.full(want[p.logical].shape, -1.0) for p in pieces}
        for p in pieces:
            block = stored[key][p.sbox.slices()]
            got[p.logical][p.lbox.slices()] = logical_view(block, p.view)
            for inner in (Box((p.lbox.offsets[0] + 1, 2), (2, 3)), Box(p.lbox.offsets, (1, 1))):
                sub = sub_piece(p, inner)
                assert sub.sbox == piece_box(p, inner) and sub.view == p.view
                assert torch.equal(logical_view(stored[key][sub.sbox.slices()], p.view),
                                   want[p.logical][inner.slices()])
        for name, t in got.items():
            assert torch.equal(t, want[name]), name
    # the covering box of gate rows 0..F/2-1 of expert 2: its columns 0, 2, .., F-2 only
    gate2 = gpt_oss_tensors()[GATE_UP][1][4]
    assert gate2.lbox == Box((0, 0), (F, H)) and piece_box(gate2, Box((0, 0), (F // 2, H))) == Box((2, 0, 0), (1, H,
                                                                                                               F - 1))


@pytest.mark.parametrize("sliceable", [True, False])
def test_plan_from_gpt_oss_reads_only_each_ranks_experts_and_columns(sliceable):
    """(2) gpt-oss stored experts -> megatron-core TP=2 EP=2 files, planned, executed rank by rank (local copies
    and packed sends), every target equal to torch's ground truth; cut chunks read only what one rank needs."""
    stored = stored_model()
    files = mcore_files()
    chunks = chunks_of(stored_files(gpt_oss_tensors()), sliceable)
    if sliceable:
        chunks = split_chunks(chunks, files, 1 << 20)
    data = {("model.safetensors", k): v for k, v in stored.items()}
    want = mcore_stored(files, truth(stored))
    for world, writer_of in ((4, None), (4, {f.id: f.id % 2 for f in files}), (1, None)):
        plan = make_plan(chunks, files, world, 1 << 20, LOGICAL_NUMEL, writer_of=writer_of)
        assert_covered_once(plan, files)
        log: list = []
        out = run_ranks(plan, files, chunks, reader(data, log))
        for f in files:
            for j, t in enumerate(f.tensors):
                assert torch.equal(out[(f.id, j)], want[(f.name, t.key)]), (world, f.name, t.key)
        # each stored element is read once, and a read chunk holds nothing its transfers do not send
        by_id = {c.id: c for c in chunks}
        assert sum(b.numel for _, _, b in log) == sum(v.numel() for v in stored.values())
        sent = defaultdict(int)
        for w in plan.waves:
            for t in w.transfers:
                sent[t.chunk] += t.nbytes // 4
        assert all(sent[cid] == by_id[cid].nbytes // 4 for cid in plan.reader_of)
        if world == 4 and writer_of is None and sliceable:
            # home reads: the rank writing EP rank 1, TP rank 0 (experts 2, 3; gate rows 0..F/2-1 and up rows
            # F..F+F/2-1) reads its experts' columns 0..F-1 of gate_up_proj and fc2 rows 0..F/2-1 of down_proj
            rank = plan.writer_of[2]
            mine = {(c.key, Box(c.offsets, c.shape)) for c in chunks if plan.reader_of.get(c.id) == rank}
            assert mine == {*((GATE_UP, Box((e, 0, 0), (1, H, F))) for e in (2, 3)),
                            *((DOWN, Box((e, 0, 0), (1, F // 2, H))) for e in (2, 3))}
            assert all(t.reader == t.writer for w in plan.waves for t in w.transfers)
        if writer_of is not None:
            assert any(t.reader != t.writer for w in plan.waves for t in w.transfers)  # packed and sent


def test_mcore_to_gpt_oss_and_back_is_bit_exact():
    """(3) megatron-core TP=2 EP=2 -> gpt-oss (targets stored transposed and interleaved), then back."""
    stored = stored_model()
    mfiles = mcore_files()
    mdata = mcore_stored(mfiles, truth(stored))
    hf = stored_files(gpt_oss_tensors())
    chunks = chunks_of(mfiles, sliceable=False)
    for world in (1, 2, 4):
        plan = make_plan(chunks, hf, world, 1 << 20, LOGICAL_NUMEL)
        assert_covered_once(plan, hf)
        out = run_ranks(plan, hf, chunks, reader(mdata))
        assert torch.equal(out[(0, 0)], stored[GATE_UP]) and torch.equal(out[(0, 1)], stored[DOWN]), world
        # and back, the gpt-oss tensors just written read as sliceable sources
        back_chunks = split_chunks(chunks_of(hf, sliceable=True), mfiles, 256)
        back = make_plan(back_chunks, mfiles, world, 1 << 20, LOGICAL_NUMEL)
        got = run_ranks(back, mfiles, back_chunks, reader({("model.safetensors", GATE_UP): out[(0, 0)],
                                                          ("model.safetensors", DOWN): out[(0, 1)]}))
        for f in mfiles:
            for j, t in enumerate(f.tensors):
                assert torch.equal(got[(f.id, j)], mdata[(f.name, t.key)])


@pytest.mark.parametrize("block", [None, 3 * H * 4, 5 * H * 4])
def test_view_to_view_in_row_blocks(block, monkeypatch):
    """Both ends with views, through the real exchange at one rank: gpt-oss gate_up_proj -> per-expert fc1
    stored with gate and up interleaved on its ROWS (a step on the axis the writer's row blocks cut), handed
    over in blocks of 3 or 5 rows (cutting through the interleave) or whole."""
    monkeypatch.setattr(dist_convert.plan, "BLOCK_MIN", 0)
    stored = stored_model()
    want = truth(stored)
    rows = View(axes=(0, 1), steps=(2, 1))
    files = [TargetFile(id=e, name=f"expert{e}", tensors=[
        TargetTensor(key="fc1", shape=(2 * F, H), dtype=torch.float32, pieces=[
            Piece(fc1(e), Box((half * F, 0), (F, H)), Box((half, 0), (2 * F - 1, H)), view=rows) for half in (0, 1)])])
        for e in range(E)]
    numel = {k: v for k, v in LOGICAL_NUMEL.items() if "fc1" in k}
    tensors = {GATE_UP: gpt_oss_tensors()[GATE_UP]}
    chunks = split_chunks(chunks_of(stored_files(tensors), sliceable=True), files, 1 << 20)
    plan = make_plan(chunks, files, 1, 2 * H * F * 4, numel)
    assert_covered_once(plan, files)
    handed = defaultdict(dict)

    def done(fid, j, first_row, t):
        assert first_row not in handed[fid]
        handed[fid][first_row or 0] = t.clone()

    out = Assembly(files, plan, 0, done, block_bytes=block)
    execute(plan, Runtime(), {c.id: c for c in chunks}, reader({("model.safetensors", GATE_UP): stored[GATE_UP]}), out)
    out.finish()
    for e in range(E):
        parts = [handed[e][r] for r in sorted(handed[e])]
        assert (len(parts) == 1) == (block is None)  # whole, or in blocks of at most ``block`` bytes
        assert all(b.nbytes <= (block or b.nbytes) for b in parts)
        whole = torch.cat(parts)
        # interleaved rows: gate row i at 2i, up row i at 2i + 1
        assert torch.equal(whole[0::2], want[fc1(e)][:F]) and torch.equal(whole[1::2], want[fc1(e)][F:]), e


def test_step_on_a_leading_axis_and_three_permuted_axes():
    """(4) logical axis 0 along stored axis 2 (step 2), axis 1 along stored axis 0 (step 3, from an offset that
    is no multiple of it), axis 2 along stored axis 1: against torch's strided indexing and permute."""
    stored = torch.randperm(11 * 5 * 9, generator=torch.Generator().manual_seed(1)).float().reshape(11, 5, 9)
    v = View(axes=(2, 0, 1), steps=(3, 1, 2))
    n0, n1, n2 = 4, 3, 4
    p = Piece("x", Box((0, 0, 0), (n0, n1, n2)), Box((2, 1, 1), ((n1 - 1) * 3 + 1, n2, (n0 - 1) * 2 + 1)), view=v)
    want = stored[2::3, 1:1 + n2, 1::2][:n1, :, :n0].permute(2, 0, 1)  # [i, j, k] = stored[2 + 3j, 1 + k, 1 + 2i]
    assert want.shape == (n0, n1, n2)
    assert torch.equal(logical_view(stored[p.sbox.slices()], v), want)
    assert torch.equal(stored[strided_slices(p.sbox, v)].permute(2, 0, 1), want)
    for inner in (Box((1, 1, 0), (2, 2, 3)), Box((3, 0, 2), (1, 3, 1))):
        assert torch.equal(logical_view(stored[piece_box(p, inner).slices()], v), want[inner.slices()])
    # write_logical is the inverse: the strided places only, the ones between untouched
    target = torch.full_like(stored, -1.0)
    write_logical(target[p.sbox.slices()], v, want)
    assert torch.equal(target[strided_slices(p.sbox, v)], stored[strided_slices(p.sbox, v)])
    assert int((target != -1).sum()) == n0 * n1 * n2
    # piece_within against brute force over random stored boxes: the logical elements whose stored place is
    # in the box, and the smallest box covering those places
    rng = random.Random(0)
    where = {(i, j, k): (2 + 3 * j, 1 + k, 1 + 2 * i) for i in range(n0) for j in range(n1) for k in range(n2)}
    for _ in range(300):
        lo = [rng.randrange(s) for s in stored.shape]
        box = Box(tuple(lo), tuple(rng.randint(1, s - a) for s, a in zip(stored.shape, lo, strict=True)))
        inside = {ijk for ijk, s in where.items()
                  if all(o <= x < o + n for x, o, n in zip(s, box.offsets, box.sizes, strict=True))}
        part = piece_within(p, box)
        if not inside:
            assert part is None, box
            continue
        assert {ijk for ijk in itertools.product(*(range(o, o + n) for o, n in zip(
            part.lbox.offsets, part.lbox.sizes, strict=True)))} == inside
        places = [where[ijk] for ijk in inside]
        first = tuple(min(s[a] for s in places) for a in range(3))
        assert part.sbox == Box(first, tuple(max(s[a] for s in places) - first[a] + 1 for a in range(3)))
        assert torch.equal(logical_view(stored[part.sbox.slices()], v), want[part.lbox.slices()])


def test_edge_cases_and_refusals():
    """Empty intersections (a box between the strided elements, or off a size-1 stored axis), a step with an
    offset, plain pieces unchanged, and views that cannot be: refused where built."""
    v = View(axes=(1,), steps=(1, 3))
    p = Piece("x", Box((2,), (4,)), Box((5, 1), (1, 10)), view=v)  # logical 2..5 at stored (5, 1), (5, 4), .. (5, 10)
    assert piece_within(p, Box((5, 2), (1, 2))) is None  # columns 2, 3: between 1 and 4
    assert piece_within(p, Box((4, 0), (1, 11))) is None  # another row of the size-1 stored axis
    assert piece_within(p, Box((5, 11), (1, 5))) is None  # past the last element (10)
    part = piece_within(p, Box((0, 3), (6, 5)))  # columns 3..7: elements at 4 and 7
    assert part == Piece("x", Box((3,), (2,)), Box((5, 4), (1, 4)), view=v)
    assert piece_within(p, Box((0, 0), (6, 11))) == p
    # a plain piece (no view) behaves as before: leading size-1 axes, no strides
    plain = Piece("y", Box((4, 0), (4, 8)), Box((2, 0, 0), (1, 4, 8)))
    assert piece_box(plain, Box((5, 2), (2, 3))) == Box((2, 1, 2), (1, 2, 3))
    assert piece_within(plain, Box((2, 1, 2), (1, 2, 3))) == Piece("y", Box((5, 2), (2, 3)), Box((2, 1, 2), (1, 2, 3)))
    assert piece_within(plain, Box((1, 0, 0), (1, 4, 8))) is None
    assert View.plain(3, 2) == View(axes=(1, 2), steps=(1, 1, 1))
    with pytest.raises(ValueError, match="distinct"):
        View(axes=(1, 1), steps=(1, 1))
    with pytest.raises(ValueError, match="at least 1"):
        View(axes=(0,), steps=(0,))
    with pytest.raises(ValueError, match="does not cover"):
        Piece("x", Box((0,), (4,)), Box((0, 0), (1, 4)), view=v)  # 4 elements 3 apart span 10, not 4
    with pytest.raises(ValueError, match="does not cover"):
        Piece("x", Box((0,), (4,)), Box((0, 0), (2, 10)), view=v)  # the size-1 stored axis is 2 long
    with pytest.raises(TypeError):
        Piece("x", Box((0,), (4,)), Box((0, 0), (1, 10)), v)  # the view is keyword only
