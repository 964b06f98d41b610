"""Pure: the distributed optimizer's bucket layout (worked by hand from megatron-core's _ParamAndGradBuffer
rules), the checks that refuse a layout the checkpoint contradicts, and the model-space optimizer tensors
and common state a torch_dist target gets. megatron-core's own parameter order is checked against
``module_order`` in test_rules_vs_mcore.py; real bucket-space checkpoints in test_optimizer.py."""
from __future__ import annotations

import argparse

import pytest
import torch

from dist_convert.config import ModelConfig
from dist_convert.datamodel import OptimizerState, Target
from dist_convert.errors import ConvertError
from dist_convert.formats.torch_dist import TorchDistFormat
from dist_convert.layout.rules import logical_tensors
from dist_convert.layout.topology import Layout
from dist_convert.optim.buckets import Slot, bucket_layout, check_boundaries, ddp_bucket_size, module_order
from dist_convert.optim.read import check_sizes, dp_group_idx, rank_buffers
from dist_convert.optim.state import is_optimizer, opt_name, optimizer_numel

from flat_config import flat_config


def test_bucket_layout_by_hand():
    """Reverse order, 64-element starts, a bucket closed once it reaches bucket_size, the shared embedding in a
    bucket of its own, bucket ends padded to lcm(DP, 128)."""
    lay = bucket_layout([64, 100, 3, 200], [True, False, False, False], bucket_size=150, dp=2)
    assert lay.slots == (Slot(bucket=2, start=0, numel=64), Slot(bucket=1, start=64, numel=100),
                         Slot(bucket=1, start=0, numel=3), Slot(bucket=0, start=0, numel=200))
    assert lay.unpadded == (200, 164, 64) and lay.padded == (256, 256, 128)
    assert lay.coalesced_start(lay.slots[0]) == 364  # legacy distrib_optim.pt: buckets concatenated unpadded
    # a shared embedding closes the bucket before it at its padded start
    lay = bucket_layout([10, 20], [True, False], bucket_size=None, dp=4)
    assert (lay.slots == (Slot(bucket=1, start=0, numel=10), Slot(bucket=0, start=0, numel=20))
            and lay.unpadded == (64, 10) and lay.padded == (128, 128))
    # one bucket, no shared embedding; NCCL padding to 2^16
    lay = bucket_layout([5, 7], [False, False], bucket_size=None, dp=3, pad_for_nccl=True)
    assert (lay.slots == (Slot(bucket=0, start=64, numel=5), Slot(bucket=0, start=0, numel=7))
            and lay.unpadded == (69,) and lay.padded == (3 * 2**16,))


def test_ddp_bucket_size_from_args():
    ns = argparse.Namespace
    assert ddp_bucket_size(ns(overlap_grad_reduce=False, ddp_bucket_size=1000), 2, True) is None
    assert ddp_bucket_size(ns(overlap_grad_reduce=True, ddp_bucket_size=1000), 2, True) == 1000
    assert ddp_bucket_size(ns(overlap_grad_reduce=True, ddp_bucket_size=None), 64, True) == 64_000_000
    assert ddp_bucket_size(ns(overlap_grad_reduce=True, ddp_bucket_size=1000), 2, False) is None  # PP rank > 0


def test_layout_mismatches_are_refused():
    lay = bucket_layout([64, 100], [False, False], bucket_size=None, dp=2)
    assert lay.slots == (Slot(bucket=0, start=128, numel=64), Slot(bucket=0, start=0, numel=100))
    check_boundaries("x", lay, 0, [(0, 100), (100, 28), (128, 64)])  # a padding gap is a chunk of its own
    with pytest.raises(ConvertError, match="do not delimit"):
        check_boundaries("x", lay, 0, [(0, 128), (128, 64)])
    with pytest.raises(ConvertError, match="unknown|no known module order"):
        module_order(["decoder.layers.0.mystery.weight"])


def _cfg(**kw) -> ModelConfig:
    base = dict(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
                kv_channels=8, swiglu=True, normalization="RMSNorm", add_bias_linear=False, add_qkv_bias=False,
                untie_embeddings_and_output_weights=False, vocab_size=100, make_vocab_size_divisible_by=16,
                position_embedding_type="rope", max_position_embeddings=32, qk_layernorm=False, spec="local")
    return flat_config(**{**base, **kw})


def test_rank_buffers_check_recorded_sizes():
    """A rank's derived buffer sizes must equal the recorded per_bucket_numel_unpadded (else one-line refusal)."""
    from dist_convert.formats.megatron import rank_entries

    cfg, layout = _cfg(), Layout(tp=2, pp=1)
    args = argparse.Namespace(overlap_grad_reduce=False, data_parallel_size=2)
    buffers = rank_buffers(cfg, layout, rank_entries(cfg, layout, 0, 0, "local"), experts=None, pp_rank=0, dp=2,
                           args=args)
    sizes = [{(torch.float32, torch.float32): list(b.layout.unpadded)} for b in buffers]
    check_sizes("x", buffers, sizes, None)
    with pytest.raises(ConvertError, match="bucket sizes"):
        check_sizes("x", buffers, [{(torch.float32, torch.float32): [1]}], None)
    assert dp_group_idx(Layout(tp=2, pp=2), 1, 1) == 3
    assert dp_group_idx(Layout(tp=1, pp=2, ep=2), 0, 1, 1, expert=True) == 3


def test_torch_dist_target_gets_model_space_optimizer_state():
    """Every parameter chunk gets three fp32 chunks keyed optimizer.state.<state>.<model key> with its offsets;
    buffers (the router's expert bias) get none; the common state says fully_reshardable, per chained optimizer."""
    cfg = _cfg(num_experts=4, moe_ffn_hidden_size=16, moe_layer_pattern=(0, 1), moe_router_expert_bias=True)
    layout = Layout(tp=1, pp=1, ep=2)
    groups = ({"wd_mult": 1.0, "step": 2}, {"wd_mult": 0.0, "step": 2})
    state = OptimizerState(kind="dp_reshardable", groups=(groups,), scheduler={"num_steps": 4})
    dtypes = dict.fromkeys(logical_tensors(cfg), torch.bfloat16)
    target = Target(cfg=cfg, layout=layout, dtype=None, args=argparse.Namespace(), iteration=2,
                    optimizer=state.for_layout(cfg, layout))
    files = TorchDistFormat().target_files(target, dtypes)
    model = {(t.key, t.offsets) for f in files for t in f.tensors if not t.key.startswith("optimizer.")}
    opt = [t for f in files for t in f.tensors if t.key.startswith("optimizer.")]
    assert all(t.dtype == torch.float32 and all(is_optimizer(p.logical) for p in t.pieces) for t in opt)
    for s in ("param", "exp_avg", "exp_avg_sq"):
        keys = {(t.key.removeprefix(f"optimizer.state.{s}."), t.offsets) for t in opt
                if t.key.startswith(f"optimizer.state.{s}.")}
        assert keys == {k for k in model if "expert_bias" not in k[0]}
    covered = {p.logical for t in opt for p in t.pieces}
    assert covered == set(optimizer_numel(cfg)) and opt_name("exp_avg", "embedding.word_embeddings.weight") in covered
    common = TorchDistFormat().common_state(target)
    assert common["content_metadata"]["distrib_optim_sharding_type"] == "fully_reshardable"
    assert sorted(common["optimizer"]) == [0, 1]  # EP=2: the expert parameters' optimizer is chained second
    assert common["optimizer"][1]["optimizer"]["param_groups"][0]["is_expert_parallel"] is True
    single = state.for_layout(cfg, Layout(tp=1, pp=1, ep=1))
    assert len(single.groups) == 1
