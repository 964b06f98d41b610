"""Pure: a Llama-like GPT shape (GQA, SwiGLU, RMSNorm, RoPE, untied embeddings, vocab 32000) whose
weights take about a requested number of bytes, and its Megatron-LM args / oracle config."""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from functools import reduce

import torch

from ..errors import ConvertError

VOCAB = 32000
DIVISIBLE_BY = 128  # Megatron-LM's default make_vocab_size_divisible_by
TOLERANCE = 0.02  # shapes within 2% of the size compete on Llama-likeness


@dataclass(frozen=True, kw_only=True)
class LlamaShape:
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    vocab_size: int = VOCAB

    @property
    def kv_channels(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def layer_params(self) -> int:
        h, hd = self.hidden_size, self.kv_channels
        qkv = (self.num_attention_heads + 2 * self.num_query_groups) * hd * h
        proj = h * self.num_attention_heads * hd
        mlp = 3 * self.ffn_hidden_size * h  # fc1 [gate; up] and fc2
        return qkv + proj + mlp + 2 * h  # two RMSNorm weights

    @property
    def params(self) -> int:
        """Logical (unpadded) parameters: untied embedding and output layer, layers, final norm."""
        return 2 * self.vocab_size * self.hidden_size + self.num_layers * self.layer_params + self.hidden_size

    def nbytes(self, itemsize: int) -> int:
        return self.params * itemsize

    def config(self) -> dict:
        """Megatron-LM argparse names (what ``tests/oracles/mcore.py --config`` reads)."""
        return {"num_layers": self.num_layers, "hidden_size": self.hidden_size,
                "ffn_hidden_size": self.ffn_hidden_size, "num_attention_heads": self.num_attention_heads,
                "num_query_groups": self.num_query_groups, "kv_channels": self.kv_channels,
                "group_query_attention": self.num_query_groups < self.num_attention_heads,
                "swiglu": True, "normalization": "RMSNorm", "add_bias_linear": False, "add_qkv_bias": False,
                "untie_embeddings_and_output_weights": True, "vocab_size": self.vocab_size,
                "make_vocab_size_divisible_by": DIVISIBLE_BY, "position_embedding_type": "rope",
                "max_position_embeddings": 4096, "seq_length": 4096, "qk_layernorm": False,
                "norm_epsilon": 1e-5, "rotary_base": 10000}

    def __str__(self) -> str:
        return (f"{self.num_layers} layers, hidden {self.hidden_size}, heads {self.num_attention_heads}/"
                f"{self.num_query_groups} (GQA), SwiGLU {self.ffn_hidden_size}, vocab {self.vocab_size}")


def lcm(values: list[int]) -> int:
    return reduce(lambda a, b: a * b // math.gcd(a, b), values, 1)


def _round_up(n: float, multiple: int) -> int:
    return int(-(-n // multiple) * multiple)


def shape_for_hidden(hidden: int, tp_multiple: int) -> LlamaShape | None:
    """The Llama-like shape at this hidden size with 0 layers, or None when the heads do not divide it.

    Query groups: a multiple of every TP involved (4 from hidden 4096 on, as Llama-3 uses 8); 4 query
    heads per group from hidden 1024 on, else 2; SwiGLU width ~8/3 hidden, rounded up as Llama does."""
    groups = lcm([tp_multiple, 8 if hidden >= 4096 else 4])
    heads = groups * (4 if hidden >= 1024 else 2)
    if hidden % heads or (hidden // heads) % 2:
        return None
    ffn = _round_up(8 * hidden / 3, lcm([256 if hidden >= 1024 else 32, tp_multiple]))
    return LlamaShape(num_layers=0, hidden_size=hidden, ffn_hidden_size=ffn, num_attention_heads=heads,
                      num_query_groups=groups)


def hidden_sizes(limit: int = 32768) -> list[int]:
    """Candidate hidden sizes: steps of 16 below 512, 64 below 2048, then 128 (head dims of 8k)."""
    return list(range(16, 512, 16)) + list(range(512, 2048, 64)) + list(range(2048, limit + 1, 128))


def choose_shape(nbytes: int, itemsize: int, tp_multiple: int = 4, pp_multiple: int = 2) -> LlamaShape:
    """A shape of about ``nbytes`` bytes of weights. Layers are a multiple of ``pp_multiple`` and the
    heads, groups and SwiGLU width of ``tp_multiple`` (pass the lcm of every TP / PP in use). Among
    shapes within 2% of the size, the one closest to Llama's aspect (layers ~ hidden / 128) wins."""
    target = nbytes / itemsize
    candidates: list[tuple[float, float, LlamaShape]] = []
    for hidden in hidden_sizes():
        base = shape_for_hidden(hidden, tp_multiple)
        if base is None:
            continue
        fixed = base.params  # embeddings + final norm
        if fixed > target * (1 + TOLERANCE) and candidates:
            break
        layers = max(pp_multiple, round((target - fixed) / base.layer_params / pp_multiple) * pp_multiple)
        shape = LlamaShape(num_layers=layers, hidden_size=hidden, ffn_hidden_size=base.ffn_hidden_size,
                           num_attention_heads=base.num_attention_heads, num_query_groups=base.num_query_groups)
        err = abs(shape.params - target) / target
        candidates.append((err, abs(math.log(layers / (hidden / 128))), shape))
    if not candidates:
        raise ConvertError(f"no Llama-like shape fits {nbytes} bytes", "pass a larger --size")
    close = [c for c in candidates if c[0] <= TOLERANCE]
    best = min(close, key=lambda c: (c[1], c[0])) if close else min(candidates, key=lambda c: c[0])
    return best[2]


def make_args(shape: LlamaShape, dtype: torch.dtype, iteration: int) -> argparse.Namespace:
    """Megatron-LM ``args`` of the checkpoint (the layout fields are set by ``mlm_args.args_for_target``)."""
    return argparse.Namespace(**shape.config(), transformer_impl="local", params_dtype=dtype,
                              bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, iteration=iteration,
                              use_rotary_position_embeddings=True, hidden_dropout=0.0, attention_dropout=0.0)
