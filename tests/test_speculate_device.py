"""``speculate`` on GPU nodes, decided without one: where a rank builds its model (the runtime's device), which
layer modules (TE or local), how the draft modules' random state is seeded (megatron-core's CUDA RNG tracker
on GPUs), which state-dict naming the base-key check accepts, where the draft is gathered (NCCL moves CUDA
tensors only), and what data-parallel replicas receive. Pure tests; the CPU build itself runs end to end in
tests/test_speculate.py and launch/gpu_check.sh."""
from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

import pytest
import torch

from dist_convert.config import ModelConfig
from dist_convert.datamodel import SourceChunk, numel
from dist_convert.errors import ConvertError
from dist_convert.layout.rank_files import rank_entries
from dist_convert.layout.rules import logical_tensors
from dist_convert.layout.topology import Layout
from dist_convert.plan import make_plan
from dist_convert.speculative import base_model
from dist_convert.speculative.base_model import (
    DEFAULT_SEED,
    choose_seed,
    init_seed,
    layer_spec,
    model_naming,
    on_device,
    placement,
    rank_files,
    seed_rngs,
)
from dist_convert.speculative.draft_export import backend_devices, gather_device

from flat_config import flat_config

ROOT = Path(__file__).resolve().parents[1]
CPU, GPU0, GPU3 = torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 3)
CFG = flat_config(num_layers=2, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4, num_query_groups=2,
                  kv_channels=8, swiglu=True, normalization="RMSNorm", add_bias_linear=False, add_qkv_bias=False,
                  untie_embeddings_and_output_weights=False, vocab_size=50, make_vocab_size_divisible_by=8,
                  position_embedding_type="rope", max_position_embeddings=16, qk_layernorm=False, spec="local")


@pytest.mark.parametrize("have_te,device,spec", [(True, GPU0, "te"), (True, CPU, "local"), (False, GPU3, "local"),
                                                 (False, CPU, "local")])
def test_layer_spec_is_te_only_with_te_on_a_gpu(have_te, device, spec):
    assert layer_spec(have_te, device) == spec


def test_placement_follows_the_runtime_device():
    gpu = placement(GPU3, have_te=True)  # --backend nccl, local rank 3
    assert gpu.device == GPU3 and not gpu.on_cpu and gpu.spec == "te"
    gloo_on_gpu_node = placement(CPU, have_te=True)  # --backend gloo where TE and GPUs exist: all on the CPU
    assert gloo_on_gpu_node.device == CPU and gloo_on_gpu_node.on_cpu and gloo_on_gpu_node.spec == "local"
    with pytest.raises(ConvertError, match="--backend"):
        placement(torch.device("meta"), have_te=False)
    with pytest.raises(ConvertError, match="--backend nccl"):
        placement(torch.device("cuda"), have_te=False)  # no index: which GPU is unknown


def test_transformer_config_initialises_where_the_model_lives():
    args = argparse.Namespace()
    for device, cpu_init in ((CPU, True), (GPU3, False)):
        config = base_model.transformer_config(CFG, args, Layout(), torch.float32, placement(device, False))
        assert config.use_cpu_initialization is cpu_init and config.perform_initialization is False


def test_seeds_follow_megatron_lm():
    assert choose_seed(None, argparse.Namespace(seed=42)) == 42  # the source's --seed
    assert choose_seed(7, argparse.Namespace(seed=42)) == 7
    assert choose_seed(None, argparse.Namespace()) == choose_seed(None, None) == DEFAULT_SEED
    assert choose_seed(None, argparse.Namespace(seed=0)) == DEFAULT_SEED  # Megatron-LM seeds are positive
    assert [init_seed(1234, p) for p in range(3)] == [1234, 1334, 1434]  # + 100 per pipeline stage
    with pytest.raises(ConvertError, match="--seed"):
        init_seed(0, 0)


def test_cpu_ranks_seed_torch_only(monkeypatch):
    from megatron.core import tensor_parallel

    def no_cuda(*a, **k):
        raise AssertionError("a CPU rank has no CUDA random state to seed")

    monkeypatch.setattr(tensor_parallel, "model_parallel_cuda_manual_seed", no_cuda)
    assert seed_rngs(placement(CPU, False), 1234, 1) == 1334
    drawn = torch.rand(4)
    torch.manual_seed(1334)
    assert torch.equal(drawn, torch.rand(4))


def test_gpu_ranks_seed_megatron_cores_cuda_rng_tracker_on_their_gpu(monkeypatch):
    """Without this, _initialize_affine_weight_gpu's ``get_cuda_rng_tracker().fork()`` raises "cuda rng state
    model-parallel-rng is not added" when ModelOpt adds the draft modules on a GPU."""
    from megatron.core import tensor_parallel

    calls: list[tuple] = []
    current: list[torch.device] = []

    class Device:  # torch.cuda.device without CUDA: records which GPU is current
        def __init__(self, device):
            self.device = device

        def __enter__(self):
            current.append(self.device)

        def __exit__(self, *exc):
            current.pop()

    monkeypatch.setattr(torch.cuda, "device", Device)
    monkeypatch.setattr(tensor_parallel, "model_parallel_cuda_manual_seed",
                        lambda seed, **k: calls.append((seed, current[-1] if current else None)))
    assert seed_rngs(placement(GPU3, False), 1234, 2) == 1434
    assert calls == [(1434, GPU3)]
    with on_device(placement(GPU3, False)):
        assert current == [GPU3]  # megatron-core and ModelOpt allocate on the current GPU


def test_cpu_stand_ins_follow_the_device_not_cuda_availability(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU node under --backend gloo
    saved = torch.Tensor.cuda, torch.cuda.current_device, torch.cuda.synchronize
    t = torch.zeros(2)
    with on_device(placement(CPU, True)):
        assert t.cuda() is t and torch.cuda.current_device() == "cpu"
    assert (torch.Tensor.cuda, torch.cuda.current_device, torch.cuda.synchronize) == saved


def test_base_key_check_accepts_local_and_te_names():
    layout = Layout(tp=2, pp=1)
    expected = {spec: set(rank_entries(CFG, layout, 1, 0, spec)) for spec in ("local", "te")}
    assert "decoder.layers.0.input_layernorm.weight" in expected["local"]
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in expected["te"]
    assert "decoder.layers.1.mlp.linear_fc1.layer_norm_weight" in expected["te"]
    assert model_naming(expected["local"], expected) == "local"
    assert model_naming(expected["te"], expected) == "te"
    mixed = expected["local"] - {"decoder.layers.0.input_layernorm.weight"} | {
        "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"}
    assert model_naming(mixed, expected) is None
    assert model_naming(expected["local"] - {"decoder.final_layernorm.weight"}, expected) is None
    # the files of that naming hold the same pieces in the same order under the other names
    local, te = (rank_files(CFG, layout, [(0, 0), (1, 0)], torch.float32, spec)[1] for spec in ("local", "te"))
    assert [(t.shape, t.pieces) for t in local.tensors] == [(t.shape, t.pieces) for t in te.tensors]
    assert {t.key for t in te.tensors} == expected["te"]


@pytest.mark.parametrize("config,devices", [("gloo", {"cpu", "cuda"}), ("nccl", {"cuda"}),
                                            ("cpu:gloo,cuda:nccl", {"cpu", "cuda"}), ("cuda:nccl", {"cuda"})])
def test_backend_devices(config, devices):
    assert backend_devices(config) == devices


def test_draft_is_gathered_where_the_groups_backend_moves_tensors():
    assert gather_device("cuda:nccl", CPU, GPU3) == GPU3  # NCCL: a CPU tensor goes to this rank's GPU
    assert gather_device("cuda:nccl", GPU3, GPU3) == GPU3
    assert gather_device("cpu:gloo,cuda:nccl", GPU0, GPU0) == GPU0  # the runtime's mixed group: NCCL for CUDA
    assert gather_device("cpu:gloo,cuda:gloo", CPU, CPU) == CPU  # gloo: the CPU path as it was
    assert gather_device("cpu:gloo,cuda:nccl", CPU, CPU) == CPU
    with pytest.raises(ConvertError, match="--backend"):
        gather_device("cuda:nccl", CPU, CPU)  # NCCL but no GPU for this rank


def legacy_source(cfg: ModelConfig, layout: Layout) -> list[SourceChunk]:
    chunks = []
    for p in range(layout.pp):
        for t in range(layout.tp):
            for key, (shape, pieces) in rank_entries(cfg, layout, t, p, "local").items():
                chunks.append(SourceChunk(id=len(chunks), file=f"mp_rank_{t:02d}_{p:03d}", key=key, shape=shape,
                                          dtype=torch.float32, pieces=pieces))
    return chunks


def test_data_parallel_replicas_each_receive_their_shard_once():
    """Every replica's parameters must hold its whole shard; the plan reads each source byte once, whatever the
    replicas, and each rank gets each byte of its shard once (a broadcast over the data-parallel group would
    move the same bytes into each replica)."""
    src, target = Layout(tp=2, pp=2), Layout(tp=2, pp=1)
    chunks = legacy_source(CFG, src)
    lnumel = {n: numel(t.shape) for n, t in logical_tensors(CFG).items()}
    plans, files = {}, {}
    for dp in (1, 2):
        coords = [(t, 0) for _ in range(dp) for t in range(target.tp)]
        files[dp] = rank_files(CFG, target, coords, torch.float32)
        plans[dp] = make_plan(chunks, files[dp], len(coords), 1 << 20, lnumel,
                              writer_of={f.id: f.id for f in files[dp]})
    assert plans[1].reader_of.keys() == plans[2].reader_of.keys()  # the same chunks, each read by one rank
    assert sum(plans[1].read_bytes) == sum(plans[2].read_bytes) == sum(c.nbytes for c in chunks
                                                                       if c.id in plans[2].reader_of)
    assert plans[2].moved_bytes == 2 * plans[1].moved_bytes
    for dp, plan in plans.items():
        boxes = Counter((t.file, t.tensor, t.dst_box) for w in plan.waves for t in w.transfers)
        assert max(boxes.values()) == 1  # no byte of a rank's shard arrives twice
        got = Counter()
        for w in plan.waves:
            for t in w.transfers:
                got[t.writer] += t.nbytes
        for f in files[dp]:  # each rank gets its shard (less the vocabulary padding, which stays zero)
            want = sum(numel(pc.sbox.sizes) * 4 for t in f.tensors for pc in t.pieces)
            assert got[f.id] == want
    assert [got[r] for r in (0, 1)] == [got[r] for r in (2, 3)]  # replicas get the same bytes

