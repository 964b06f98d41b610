"""Streamed Hugging Face shards (``formats/hf_shards.py``): a shard written as its tensors and their row blocks arrive,
in any order, is byte for byte the file ``safetensors_io.write_file`` writes front to back from the whole tensors (and,
with ``--quantize``, from the scheme's own output), safetensors reads it back, and the writer lets every tensor go once
its bytes are written, before the shard is complete. In-process, no ranks: about a second."""
from __future__ import annotations

import gc
import hashlib
import random
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dist_convert.datamodel import TargetFile, TargetTensor, row_axis
from dist_convert.formats.hf_shards import ShardWriter, units
from dist_convert.formats.safetensors_io import write_file
from dist_convert.formats.schemes import WRITERS

PLAIN = [  # (name, shape, dtype): an empty tensor, a scalar, a [1, rows, ...] stack, odd sizes
    ("model.embed_tokens.weight", (300, 64), torch.bfloat16),
    ("model.layers.0.input_layernorm.weight", (64,), torch.float32),
    ("model.layers.0.mlp.gate_proj.weight", (128, 64), torch.bfloat16),
    ("model.layers.0.mlp.up_proj.weight", (128, 64), torch.bfloat16),
    ("model.layers.0.mlp.down_proj.weight", (64, 128), torch.bfloat16),
    ("stacked", (1, 37, 5), torch.float16),
    ("scalar", (), torch.float32),
    ("empty", (0, 8), torch.bfloat16),
    ("lm_head.weight", (300, 64), torch.bfloat16),
]
EXPERTS = [  # gpt-oss's expert weights (mxfp4) and compressed-tensors' expert linears (int4)
    ("model.layers.0.mlp.experts.gate_up_proj", (2, 64, 128), torch.bfloat16),
    ("model.layers.0.mlp.experts.down_proj", (2, 64, 64), torch.bfloat16),
    ("model.layers.0.mlp.experts.3.gate_proj.weight", (64, 64), torch.bfloat16),
    ("model.embed_tokens.weight", (300, 64), torch.bfloat16),
]


def values(spec: list[tuple[str, tuple[int, ...], torch.dtype]], seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(dtype) for _, shape, dtype in spec]


def pieces(x: torch.Tensor, rng: random.Random) -> list[tuple[int, torch.Tensor]]:
    """A tensor as (first row, block) pieces along its row axis, in a shuffled order (whole when it has no rows)."""
    d = row_axis(tuple(x.shape))
    if d is None or x.shape[d] < 3:
        return [(0, x)]
    cuts = sorted({0, x.shape[d], *rng.sample(range(1, x.shape[d]), 2)})
    out = [(a, x.narrow(d, a, b - a).clone()) for a, b in zip(cuts, cuts[1:], strict=False)]
    rng.shuffle(out)
    return out


def stream(path: Path, spec, xs, scheme=None, seed: int = 1) -> tuple[str, ShardWriter]:
    """The shard of these tensors written by ShardWriter, tensors and blocks interleaved in a random order."""
    f = TargetFile(id=0, name=path.name, tensors=[TargetTensor(key=n, shape=s, dtype=d, pieces=[]) for n, s, d in spec])
    w = ShardWriter(path.parent, [f], scheme, lambda f: {"n": len(f.tensors)})
    rng = random.Random(seed)
    todo = [(j, first, b) for j, x in enumerate(xs) for first, b in pieces(x, rng)]
    rng.shuffle(todo)
    written = []
    for j, first, b in todo:
        written += w.put_rows(f, j, first, b) if first or b.shape != xs[j].shape else w.put(f, j, b)
    written += w.close()
    assert len(written) == 1 and written[0].record == {"n": len(spec)}
    return written[0].sha256, w


def front_to_back(path: Path, spec, xs, scheme=None) -> str:
    """What a shard holds, written whole by write_file: each tensor, or each unit's quantized parts, in file order."""
    stored = []
    tensors = [TargetTensor(key=n, shape=s, dtype=d, pieces=[]) for n, s, d in spec]
    for key, js in units(tensors, scheme).items():
        items = [(spec[j][0], xs[j]) for j in js]
        stored += scheme.quantize_together(items) if key.startswith("\0") else items
    return write_file(path, stored)


CASES = [(None, PLAIN), ("fp8-block", PLAIN), ("fp8-channel", PLAIN), ("nvfp4", PLAIN), ("mxfp4", EXPERTS),
         ("int4", EXPERTS)]


@pytest.mark.parametrize("quantize,spec", CASES, ids=[c[0] or "plain" for c in CASES])
def test_a_streamed_shard_is_the_file_written_front_to_back(tmp_path, quantize, spec):
    scheme = WRITERS[quantize] if quantize else None
    assert scheme is None or any(scheme.quantizable(n, s) for n, s, _ in spec)
    xs = values(spec)
    got, _ = stream(tmp_path / "streamed.safetensors", spec, xs, scheme)
    want = front_to_back(tmp_path / "whole.safetensors", spec, xs, scheme)
    a, b = (tmp_path / "streamed.safetensors").read_bytes(), (tmp_path / "whole.safetensors").read_bytes()
    assert a == b and got == want == hashlib.sha256(a).hexdigest()
    if scheme is None:  # safetensors reads every tensor back
        back = load_file(tmp_path / "streamed.safetensors")
        assert list(back) == [n for n, _, _ in spec]
        assert all(torch.equal(back[n], x) for (n, _, _), x in zip(spec, xs, strict=True))


def test_each_tensor_is_let_go_once_written_before_the_shard_is_complete(tmp_path):
    spec = PLAIN[:5]
    xs = values(spec)
    f = TargetFile(id=0, name="model.safetensors",
                   tensors=[TargetTensor(key=n, shape=s, dtype=d, pieces=[]) for n, s, d in spec])
    w = ShardWriter(tmp_path, [f], None, lambda f: {})
    refs = []
    for j in range(len(spec) - 1):  # all but the last tensor: the shard stays open
        for first, block in pieces(xs[j], random.Random(j)):
            refs.append(weakref.ref(block))
            assert w.put_rows(f, j, first, block) == []
            del block
    w.open[0].file.fh.digest.settle()  # the hashing thread is done with what it was handed
    gc.collect()
    assert refs and all(r() is None for r in refs)  # nothing of the shard is held in memory
    assert len(w.put(f, len(spec) - 1, xs[-1])) == 1 and w.close() == []


def test_quantized_units_are_held_only_until_complete(tmp_path):
    """nvfp4 quantizes gate and up together (one per-tensor scale): gate's blocks wait for up, then both go."""
    spec = PLAIN[2:5]
    xs = values(spec)
    f = TargetFile(id=0, name="model.safetensors",
                   tensors=[TargetTensor(key=n, shape=s, dtype=d, pieces=[]) for n, s, d in spec])
    w = ShardWriter(tmp_path, [f], WRITERS["nvfp4"], lambda f: {})
    for first, block in pieces(xs[0], random.Random(0)):  # gate: gathered, waiting for up
        w.put_rows(f, 0, first, block)
    assert set(w.open[0].gathered) == {0}
    w.put(f, 1, xs[1])  # up completes the unit: quantized, written, let go
    assert not w.open[0].gathered and not w.open[0].filling
    assert len(w.put(f, 2, xs[2])) == 1
