"""Pure: where megatron-core's distributed optimizer keeps each parameter's state in *bucket space*.

DDP (megatron-core ``_ParamAndGradBuffer``, the same in 0.14-0.20) lays out the trainable parameters of a
model chunk in one flat buffer per (param dtype, grad dtype), expert-parallel parameters in buffers of
their own: parameters in reverse ``named_parameters()`` order, each start padded to a multiple of 64
elements, a new bucket once a bucket holds ``bucket_size`` elements (none: one bucket) and around a shared
embedding, each bucket's end padded to a multiple of lcm(DP, 128) (and 2^16 with
``ddp_pad_buckets_for_high_nccl_busbw``). The optimizer state of a bucket is saved without that end padding.

``module_order`` gives megatron-core's ``named_parameters()`` order from the state-dict keys of a model
chunk; ``bucket_layout`` the buffer layout from it. Readers check the result against what the checkpoint
records (per-bucket sizes, DCP chunk boundaries) and refuse a mismatch: the layout is never guessed.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ..errors import ConvertError

# Child modules in megatron-core's registration order (GPTModel, TransformerBlock, TransformerLayer,
# SelfAttention / MLASelfAttention / CrossAttention, MLP / MoELayer, MultiTokenPredictionLayer). A module's
# own parameters come before its children's (torch's named_parameters); names are unique enough across
# parents that one order serves all of them.
CHILD_ORDER = (
    "embedding", "word_embeddings", "position_embeddings", "encoder", "decoder", "layers",
    "enorm", "hnorm", "eh_proj", "transformer_layer",
    "input_layernorm", "self_attention", "pre_cross_attn_layernorm", "cross_attention", "pre_mlp_layernorm", "mlp",
    "core_attention", "linear_proj", "linear_q_proj", "linear_q_down_proj", "linear_q_up_proj",
    "linear_kv_down_proj", "linear_kv_up_proj", "linear_qkv", "linear_q", "linear_kv",
    "q_layernorm", "k_layernorm", "kv_layernorm",
    "router", "experts", "local_experts", "shared_experts", "linear_fc1", "linear_fc2",
    "final_layernorm", "mtp", "output_layer", "lm_head",
)
# A module's own parameters in registration order (Transformer Engine's fused LayerNormLinear registers
# its norm first; TEGroupedLinear weight0..N, then bias0..N)
PARAM_ORDER = ("layer_norm_weight", "layer_norm_bias", "gate_weight", "weight", "bias")
_CHILD = {name: i for i, name in enumerate(CHILD_ORDER)}
_PARAM = {name: i for i, name in enumerate(PARAM_ORDER)}
_NUMBERED = re.compile(r"^(.*?)(\d+)$")


def _order_key(key: str) -> tuple[tuple[int, int, int], ...]:
    parts = key.split(".")
    out = []
    for i, part in enumerate(parts):
        if i == len(parts) - 1:
            m = _NUMBERED.match(part)
            base, n = (m.group(1), int(m.group(2))) if m and m.group(1) in _PARAM else (part, -1)
            if base not in _PARAM:
                raise ConvertError(f"no known parameter order for {key!r} (parameter {part!r})",
                                   "this model's optimizer state cannot be mapped out of bucket space; convert "
                                   "without --optimizer, or from a fully_reshardable save")
            out.append((0, _PARAM[base], n))
        elif part.isdigit():
            out.append((1, -1, int(part)))
        elif part in _CHILD:
            out.append((1, _CHILD[part], 0))
        else:
            raise ConvertError(f"no known module order for {key!r} (module {part!r})",
                               "this model's optimizer state cannot be mapped out of bucket space; convert without "
                               "--optimizer, or from a fully_reshardable save")
    return tuple(out)


def module_order(keys: list[str]) -> list[str]:
    """The state-dict keys of one model chunk's parameters in megatron-core's ``named_parameters()`` order."""
    return sorted(keys, key=_order_key)


@dataclass(frozen=True, kw_only=True)
class Slot:
    bucket: int
    start: int  # in the bucket's saved (unpadded) tensor
    numel: int


@dataclass(frozen=True, kw_only=True)
class BufferLayout:
    slots: tuple[Slot, ...]  # per parameter, in ``named_parameters()`` order
    unpadded: tuple[int, ...]  # per bucket: the saved size (megatron-core's per_bucket_numel_unpadded)
    padded: tuple[int, ...]  # per bucket: with the end padding (per_bucket_numel)

    def coalesced_start(self, slot: Slot) -> int:
        """Where ``slot`` lies in the buckets concatenated without end padding (legacy distrib_optim.pt)."""
        return sum(self.unpadded[:slot.bucket]) + slot.start


def _pad(n: int, divisor: int) -> int:
    return math.ceil(n / divisor) * divisor


def bucket_layout(numels: list[int], shared: list[bool], bucket_size: int | None, dp: int,
                  pad_for_nccl: bool = False) -> BufferLayout:
    """megatron-core's buffer layout of parameters with these sizes (``named_parameters()`` order);
    ``shared``: which are a shared embedding (a bucket of their own)."""
    divisor = math.lcm(dp, 128, 2**16) if pad_for_nccl else math.lcm(dp, 128)
    starts: dict[int, tuple[int, int]] = {}
    unpadded: list[int] = []
    padded: list[int] = []
    pos = bucket_start = 0
    in_bucket = 0

    def close(end: int) -> int:
        nonlocal bucket_start, in_bucket
        unpadded.append(end - bucket_start)
        padded_end = _pad(end, divisor)
        padded.append(padded_end - bucket_start)
        bucket_start, in_bucket = padded_end, 0
        return padded_end

    for i in reversed(range(len(numels))):
        pos = _pad(pos, 64)
        if shared[i] and in_bucket:
            pos = close(pos)
        starts[i] = (len(unpadded), pos - bucket_start)
        end = pos + numels[i]
        in_bucket += 1
        if (bucket_size is not None and end - bucket_start >= bucket_size) or shared[i]:
            pos = close(end)
        else:
            pos = end
    if in_bucket:
        close(pos)
    slots = tuple(Slot(bucket=starts[i][0], start=starts[i][1], numel=numels[i]) for i in range(len(numels)))
    return BufferLayout(slots=slots, unpadded=tuple(unpadded), padded=tuple(padded))


def ddp_bucket_size(args: object, dp: int, first_stage_chunk: bool) -> int | None:
    """The bucket size megatron-core's DDP uses from Megatron-LM's args: ``--ddp-bucket-size`` (default
    max(40M, 1M x DP)) when ``--overlap-grad-reduce``, else one bucket; always one bucket on pipeline
    stages after the first and on virtual chunks after the first."""
    if not getattr(args, "overlap_grad_reduce", False) or not first_stage_chunk:
        return None
    size = getattr(args, "ddp_bucket_size", None)
    return int(size) if size is not None else max(40_000_000, 1_000_000 * dp)


def check_boundaries(where: str, layout: BufferLayout, bucket: int, stored: list[tuple[int, int]]) -> None:
    """Every parameter of ``bucket`` starts and ends on a boundary of the stored DCP chunks of its saved
    tensor (megatron-core saves one chunk per parameter range and padding gap of each DP shard)."""
    cuts = {0}
    for offset, size in stored:
        cuts.update((offset, offset + size))
    for s in layout.slots:
        if s.bucket == bucket and not {s.start, s.start + s.numel} <= cuts:
            raise ConvertError(f"{where}: the bucket layout derived from the model and args puts a parameter at "
                               f"[{s.start}, {s.start + s.numel}), which the saved chunks do not delimit",
                               "the args do not describe how this optimizer state was laid out (e.g. DDP bucket "
                               "options); convert without --optimizer, or from a fully_reshardable save")
