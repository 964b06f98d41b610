"""Oracle for Qwen2.5-VL: Megatron-Bridge 0.6.2's ``Qwen25VLBridge`` / ``Qwen25VLModelProvider`` (its
``Qwen25VLModel``: transformers' own Qwen2.5-VL vision transformer kept as an HF module under ``visual.``, a
megatron-core GPT language model with MRoPE under ``language_model.``) on megatron-core 0.19.2 is the Megatron-side
layout; transformers' ``Qwen2_5_VLForConditionalGeneration`` is the HF side. Runs in the second runtime
(.venv-mcore19, Python 3.12); imports megatron-core, Megatron-Bridge, transformers; never dist_convert.

  oracles/qwen25_vl.py make HF_DIR [--seed S]
      a tiny random Qwen2_5_VLForConditionalGeneration made by transformers' own classes (Qwen2_5_VLConfig with a
      text_config and a vision_config), fp32, save_pretrained (safetensors). Text: hidden 64, 4 heads, 2 kv heads
      (head_dim 16), ffn 128 (SwiGLU), 4 layers, vocab 300 (not a multiple of 128), q/k/v biases, untied lm_head,
      rope_theta 50000, mrope_section [2, 3, 3] (sums to head_dim / 2); image / video / vision start / vision end
      tokens 290..293. Vision: depth 3, hidden 32, 2 heads, ffn 64 (SwiGLU with biases, silu), patch 4, temporal
      patch 2, spatial merge 2, 3 channels, out_hidden_size 64, window_size 16 (windows of 2 x 2 merged tokens),
      fullatt_block_indexes [1] (blocks 0 and 2 windowed, block 1 full attention). Every tensor random with
      distinct values, seeded per tensor name (norm weights in [0.5, 1.5] but never 1, biases nonzero). A
      300-token WordLevel tokenizer (what save_megatron_model(hf_tokenizer_path=) loads with AutoTokenizer).
      Prints what save_pretrained wrote.
  oracles/qwen25_vl.py bridge-import HF_DIR OUT_DIR [--pp P]
      Megatron-Bridge's own import (AutoBridge.from_hf_pretrained, to_megatron_provider(load_weights=True),
      provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True), save_megatron_model): a
      torch_dist checkpoint at PP --pp (default 1), TP = world size / PP. The HF vision module lives on the first
      stage only (Qwen25VLModel builds ``visual`` where pre_process). Bridge's provider as Bridge makes it (so
      run_config.yaml records what Bridge records, including its mrope_section, see the judge).
  oracles/qwen25_vl.py judge MEGATRON_DIR --truth BRIDGE_DIR --hf HF_DIR [--tp N] [--pp N] [--atol 1e-4]
      builds Bridge's Qwen2.5-VL model from the HF config (TP = world size, PP 1), loads MEGATRON_DIR into it with
      megatron-core's dist_checkpointing.load (StrictHandling.RAISE_ALL: no missing, no unexpected key; resharding
      from any TP/PP), TE's check of each _extra_state value, then module.load_state_dict (every key but an unsaved
      _extra_state, as Megatron-LM's and Bridge's loaders allow); asserts
        * every loaded tensor == Bridge's own import of HF_DIR at this layout (in memory), bit for bit. A checkpoint
          whose vocab tensors have more rows than the vocab (padded) is loaded into a model of that many rows;
          Bridge 0.6.2 pads only the unprefixed embedding.word_embeddings / output_layer names on import, so it
          cannot import into ``language_model.*`` with padding: the comparison is then against Bridge's unpadded
          import, with the TP-gathered rows past the vocab required to be zero and cut off
        * every stored tensor == BRIDGE_DIR's (load_plain_tensors, global shapes), bit for bit, and the same
          _extra_state objects (names); with --allow-vocab-padding, stored embedding / output rows past the vocab
          must be zero and are cut off first
        * --tp N / --pp N: the TP / PP the checkpoint records (Megatron-LM args, else run_config.yaml) are N
        * the Megatron logits WITH IMAGES match transformers' Qwen2_5_VLForConditionalGeneration (eager, fp32)
          within --atol (1e-4). The input: one sequence of 31 tokens holding two images of different grids
          (image_grid_thw [[1, 4, 8], [1, 6, 4]] in patches: 8 and 6 image tokens between vision start / end
          tokens), pixel_values [32 + 24, 3 * 2 * 4 * 4] from a seeded generator. The first image is two windows of
          2 x 2 merged tokens, the second a full window and a partial one (the window padding and reordering, the
          windowed blocks 0 and 2 vs the full block 1, the 2 x 2 merge all matter); the language model gets the
          MRoPE positions of both images. Megatron gets input_ids, pixel_values, image_grid_thw (Qwen25VLModel
          computes its MRoPE positions itself with transformers' get_rope_index); transformers gets the same plus
          mm_token_type_ids (1 at image tokens), from which it computes its own.
      The fair comparison. Qwen25VLBridge.provider_bridge never reads the HF config's mrope_section: the provider
      keeps Qwen25VLModelProvider's default [16, 24, 24] (the released Qwen2.5-VL models' value, head_dim 128). On
      this head_dim-16 model megatron-core's MultimodalRotaryEmbedding cannot split a 16-channel embedding into
      [16, 24, 24] * 2: Bridge's model as Bridge builds it fails in forward. The judge records that outcome
      (``logits_vs_hf_raw``: the error, or the difference if it ran), then sets only the built language model's
      ``mrope_section`` (GPTModel.mrope_section, read in forward) to the HF config's, and judges that
      (``logits_max_abs_diff_vs_hf``) against --atol; both are in the JSON. No weight is touched; a checkpoint
      does not hold mrope_section.
      Prints one JSON line (rank 0); exit 1 on any problem. torch_dist checkpoints only.
  oracles/qwen25_vl.py mutate SRC DST --hf HF_DIR --kind value|swap_qkv_vision|swap_blocks|lm_value|lm_bias|
      swap_k_v|swap_gate_up|drop_object
      SRC with one defect, saved as Bridge saves (save_megatron_model at TP = world size): the judge must fail on
      DST. value: one element of visual.blocks.1.attn.qkv.weight += 1e-3; swap_qkv_vision: the q and k thirds of
      visual.blocks.0.attn.qkv (weight and bias) exchanged; swap_blocks: visual blocks 0 (windowed) and 1 (full
      attention) exchanged; lm_value: one element of language layer 2's linear_qkv.weight += 1e-3; lm_bias: one
      element of language layer 1's linear_qkv.bias += 1e-3; swap_k_v: language layer 0's k and v rows of every
      query group exchanged (weight and bias); swap_gate_up: language layer 1's fc1 gate / up halves exchanged;
      drop_object: no language_model.decoder.layers.mlp.linear_fc2._extra_state (the layers are stacked in the
      stored keys: the object of every layer, as a save cannot leave out one layer's shard of it)
  oracles/qwen25_vl.py layout HF_DIR [--ckpt DIR] [--out JSON]
      the layout itself, at TP = world size (run it under torchrun with 2 ranks for TP 2): per rank, the model's
      state_dict() (names, shapes, dtypes) and its sharded_state_dict() (keys, global shapes and offsets, TP axis,
      replica ids, ShardedObjects with their replica ids, incl. every _extra_state); the module classes; Bridge's
      mapping registry (Megatron name pattern -> HF names, mapping type, the TP split AutoMapping picks); which HF
      rows each local row of the language layer 0 linear_qkv (weight, bias) and linear_fc1 holds; the vision keys
      against the HF file's names; the provider's and the vision module's settings; and with --ckpt the
      checkpoint's stored keys (.metadata: shapes, dtypes; objects), its common state and run_config.yaml's model
      section.

The CPU stand-ins. Bridge's Qwen2.5-VL language model is GPTModelProvider.provide with Bridge's default_layer_spec,
i.e. megatron-core's get_gpt_layer_with_transformer_engine_spec (TESpecProvider: TELayerNormColumnParallelLinear for
linear_qkv and linear_fc1, TEDotProductAttention, TERowParallelLinear for linear_proj and linear_fc2), and the
block's final layernorm is transformer_block.LayerNormImpl (TENorm when TE is present); TE has no CPU build. While
the model is built (and only then: every patched name is restored afterwards), megatron-core's TESpecProvider is a
CPU backend giving plain-torch stand-ins with TE's parameter names, TE's _extra_state, megatron-core's TE wrappers'
sharded_state_dict (same make_sharded_tensors_for_checkpoint call, same TP axis map) and the class names of what they
stand for (Bridge's AutoMapping picks a weight's TP split by its module's class name):
  * CpuTELayerNormColumnParallelLinear: RMSNorm ``layer_norm_weight`` (replicated, config.layernorm_epsilon) fused
    before a column-parallel linear: ``weight`` and, for linear_qkv (add_qkv_bias), ``bias``, both TP axis 0; TE's
    return_bias = skip_bias_add and bias (linear_qkv: skip_bias_add False, the bias is added); _extra_state an empty
    uint8 tensor (TE's module without FP8)
  * CpuTERowParallelLinear (linear_proj, linear_fc2): ``weight`` TP axis 1, no bias (add_bias_linear False)
  * CpuTEDotProductAttention: megatron-core's local DotProductAttention (causal, fp32 softmax; no sharded state, as
    TEDotProductAttention.sharded_state_dict in 0.19.2 with softmax_type vanilla; legacy _extra_state an empty uint8
    tensor)
  * TENorm (only the final layernorm here; the per-layer norms are fused into the linears): oracles.te_cpu's RMSNorm
    stand-in (te.pytorch.RMSNorm, an op in TE 2.x: ``weight``, _extra_state the pickled empty dict, 5 bytes)
After each build every language layer must hold exactly these stand-ins in these slots, and IdentityOp (or nothing)
in its input / pre-MLP / q / k layernorm slots (a changed Bridge or megatron-core spec fails here instead of silently
building something else). The vision module is transformers' own Qwen2_5_VisionTransformerPretrainedModel, built by
Qwen25VLModel itself from the HF vision config: plain torch, no stand-in; its attention runs transformers' CPU path
for the _attn_implementation the HF config resolves to (sdpa here, per window / image chunk; the layout reports it;
the transformers reference runs eager). Other CPU shims: oracles.te_cpu.apply_bridge_cpu_shims
(TE stub for Bridge's lora_layers only; CUDA no-ops: torch.cuda.current_device -> "cpu" is where megatron-core's
MultimodalRotaryEmbedding allocates inv_freq; the causal mask megatron-core makes on "cuda" is made on the CPU; the
save's CUDA RNG state is the CPU one); fused kernels off (te_cpu.CPU_KERNELS: same weights, same names). The judge's
forward passes runtime_gather_output=True (the logits are otherwise vocab-split at TP > 1).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the oracles package, helpers

from oracles.common import (  # noqa: E402
    compare,
    compare_stored,
    describe_sharded,
    emit_layout,
    init_dist,
    model_objects,
    run_program,
    stored_metadata,
    stored_parallel,
    unwrap,
)
from oracles.te_cpu import apply_bridge_cpu_shims, load_strict  # noqa: E402

VOCAB = 300
IMAGE, VIDEO, VSTART, VEND = 290, 291, 292, 293
MROPE = [2, 3, 3]
TEXT = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128, "rms_norm_eps": 1e-6,
        "hidden_act": "silu", "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 1, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 50000.0, "mrope_section": MROPE}}
VISION = {"depth": 3, "hidden_size": 32, "hidden_act": "silu", "intermediate_size": 64, "num_heads": 2,
          "in_channels": 3, "patch_size": 4, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 16,
          "out_hidden_size": 64, "fullatt_block_indexes": [1], "tokens_per_second": 2}
GRIDS = [[1, 4, 8], [1, 6, 4]]  # the judge's two images (t, h, w in patches)
MUTATIONS = ("value", "swap_qkv_vision", "swap_blocks", "lm_value", "lm_bias", "swap_k_v", "swap_gate_up",
             "drop_object")
EMB, OUT = "language_model.embedding.word_embeddings.weight", "language_model.output_layer.weight"


# ----------------------------------------------------------------------------- CPU stand-ins for TE

_CLASSES = None


def cpu_classes():
    """The stand-in classes (built once, after megatron-core is importable); see the module docstring."""
    global _CLASSES
    if _CLASSES is not None:
        return _CLASSES
    import torch
    import torch.nn.functional as F
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        reduce_from_tensor_model_parallel_region,
    )
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

    from oracles import te_cpu

    ExtraState, new_param, tp_of = te_cpu.ExtraState, te_cpu.new_param, te_cpu.tp_of

    def sharded(module, prefix, axes, sharded_offsets, metadata):  # megatron-core's TE wrappers' sharded_state_dict
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        return make_sharded_tensors_for_checkpoint(module.state_dict(prefix="", keep_vars=True), prefix, axes,
                                                   sharded_offsets, tp_group=module._tp_group,
                                                   dp_cp_group=metadata["dp_cp_group"])

    def bias_out(module, out):  # TE's return_bias = skip_bias_add and bias (TELinear.__init__)
        if module.bias is None:
            return out, None
        return (out, module.bias) if module.skip_bias_add else (out + module.bias, None)

    class CpuTELayerNormColumnParallelLinear(ExtraState, torch.nn.Module):
        """TELayerNormColumnParallelLinear: RMSNorm (``layer_norm_weight``) fused before a column-parallel linear
        (``weight``, ``bias``: TP axis 0)."""

        def __init__(self, input_size, output_size, *, config, init_method, gather_output, bias, skip_bias_add,
                     is_expert, skip_weight_param_allocation=False, tp_comm_buffer_name=None, tp_group=None,
                     stride=1, name=None):
            super().__init__()
            assert not gather_output and not is_expert and not skip_weight_param_allocation
            assert config.normalization == "RMSNorm", config.normalization
            self.config, self._tp_group, self.skip_bias_add = config, tp_of(tp_group), skip_bias_add
            tp = self._tp_group.size()
            self.eps, self.zero_centered = config.layernorm_epsilon, config.layernorm_zero_centered_gamma
            self.layer_norm_weight = new_param((input_size,), config, value=0.0 if self.zero_centered else 1.0)
            self.weight = new_param((output_size // tp, input_size), config, init_method)
            set_tensor_model_parallel_attributes(self.weight, True, 0, stride)
            self.bias = new_param((output_size // tp,), config, value=0.0) if bias else None
            if self.bias is not None:
                set_tensor_model_parallel_attributes(self.bias, True, 0, stride)

        def forward(self, x):
            x = te_cpu.rms(x, self.layer_norm_weight, self.eps, self.zero_centered)
            x = copy_to_tensor_model_parallel_region(x, group=self._tp_group)
            return bias_out(self, F.linear(x, self.weight))

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            return sharded(self, prefix, {"weight": 0, "bias": 0}, sharded_offsets, metadata)

    class CpuTERowParallelLinear(ExtraState, torch.nn.Module):
        """TERowParallelLinear: ``weight`` TP axis 1, ``bias`` replicated, added after the all-reduce."""

        def __init__(self, input_size, output_size, *, config, init_method, bias, input_is_parallel, skip_bias_add,
                     is_expert, tp_comm_buffer_name=None, tp_group=None, name=None):
            super().__init__()
            assert input_is_parallel and not is_expert
            self.config, self._tp_group, self.skip_bias_add = config, tp_of(tp_group), skip_bias_add
            tp = self._tp_group.size()
            self.weight = new_param((output_size, input_size // tp), config, init_method)
            set_tensor_model_parallel_attributes(self.weight, True, 1, 1)
            self.bias = new_param((output_size,), config, value=0.0) if bias else None

        def forward(self, x):
            out = reduce_from_tensor_model_parallel_region(F.linear(x, self.weight), group=self._tp_group)
            return bias_out(self, out)

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            return sharded(self, prefix, {"weight": 1}, sharded_offsets, metadata)

    class CpuTEDotProductAttention(ExtraState, DotProductAttention):
        """TEDotProductAttention: megatron-core's local DotProductAttention (causal, unpacked input only)."""

        def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                     softmax_scale=None, k_channels=None, v_channels=None, cp_comm_type=None, pg_collection=None,
                     **kwargs):
            assert k_channels is None or k_channels == config.kv_channels, k_channels
            assert v_channels is None or v_channels == config.kv_channels, v_channels
            super().__init__(config, layer_number, attn_mask_type, attention_type, attention_dropout=attention_dropout,
                             softmax_scale=softmax_scale, cp_comm_type=cp_comm_type, pg_collection=pg_collection)

        def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None, **kwargs):
            assert packed_seq_params is None, "packed (THD) input: not used by this oracle"
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias, packed_seq_params=None)

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            return {}  # TEDotProductAttention.sharded_state_dict in 0.19.2, softmax_type "vanilla": nothing

    for cls, name in ((CpuTELayerNormColumnParallelLinear, "TELayerNormColumnParallelLinear"),
                      (CpuTERowParallelLinear, "TERowParallelLinear"),
                      (CpuTEDotProductAttention, "TEDotProductAttention")):
        cls.__name__ = cls.__qualname__ = name
    _CLASSES = {"norm": te_cpu.cpu_classes()["norm"], "ln_col": CpuTELayerNormColumnParallelLinear,
                "row": CpuTERowParallelLinear, "attn": CpuTEDotProductAttention}
    return _CLASSES


def cpu_backend():
    """TESpecProvider's choices (megatron-core 0.19.2 extensions/transformer_engine_spec_provider.py) for a dense
    GPT layer, with the CPU leaves; whatever Qwen2.5-VL's dense layer does not use raises."""
    from megatron.core.models.backends import BackendSpecProvider

    c = cpu_classes()

    class CpuTESpecProvider(BackendSpecProvider):
        def linear(self):
            raise NotImplementedError("TELinear: not used by Qwen2.5-VL")

        def column_parallel_linear(self):
            raise NotImplementedError("TEColumnParallelLinear: not used by Qwen2.5-VL's language model")

        def row_parallel_linear(self):
            return c["row"]

        def fuse_layernorm_and_linear(self):
            return True

        def column_parallel_layer_norm_linear(self):
            return c["ln_col"]

        def layer_norm(self, rms_norm=False, for_qk=False, has_residual=False):
            return c["norm"]  # asked for q/k layernorms, which Qwen2.5-VL leaves IdentityOp (check_spec)

        def core_attention(self):
            return c["attn"]

        def grouped_mlp_modules(self, moe_use_grouped_gemm):
            raise NotImplementedError("Qwen2.5-VL has no experts")

        def activation_func(self):
            return None

    return CpuTESpecProvider()


@contextlib.contextmanager
def cpu_build_patches():
    """While Bridge builds Qwen2.5-VL: megatron-core's TESpecProvider and the block's LayerNormImpl are the CPU
    stand-ins (see the module docstring); restored on exit (other oracles share a test worker)."""
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer import transformer_block

    c = cpu_classes()
    saved = gpt_layer_specs.TESpecProvider, transformer_block.LayerNormImpl
    backend = cpu_backend()
    gpt_layer_specs.TESpecProvider = lambda: backend
    transformer_block.LayerNormImpl = c["norm"]
    try:
        yield
    finally:
        gpt_layer_specs.TESpecProvider, transformer_block.LayerNormImpl = saved


def check_spec(model) -> None:
    """Every language layer holds the TE classes (stand-ins) in the slots the TE spec fills: a changed Bridge or
    megatron-core spec fails here."""
    c = cpu_classes()
    lm = unwrap(model[0]).language_model
    want = {"self_attention.linear_qkv": c["ln_col"], "self_attention.core_attention": c["attn"],
            "self_attention.linear_proj": c["row"], "mlp.linear_fc1": c["ln_col"], "mlp.linear_fc2": c["row"]}
    for i, layer in enumerate(lm.decoder.layers):
        mods = dict(layer.named_modules())
        for name, cls in want.items():
            assert type(mods.get(name)) is cls, f"language layer {i}: {name} is {type(mods.get(name))!r}"
        for name in ("input_layernorm", "pre_mlp_layernorm", "self_attention.q_layernorm",
                     "self_attention.k_layernorm"):
            mod = mods.get(name)
            assert mod is None or type(mod).__name__ == "IdentityOp", f"language layer {i}: {name} is {mod!r}"
    if lm.post_process:  # the last pipeline stage
        assert type(lm.decoder.final_layernorm) is c["norm"], lm.decoder.final_layernorm


# ----------------------------------------------------------------------------- the model


def vl_provider(hf: str, load_weights: bool, tp: int, pp: int = 1, vocab_rows: int | None = None):
    """Bridge's Qwen25VLModelProvider for ``hf`` on the CPU; ``vocab_rows`` sizes the embedding like a stored one."""
    from megatron.bridge import AutoBridge

    from oracles.te_cpu import CPU_KERNELS

    # a provider's attention backend sets NVTE_* selection variables; a shared worker's earlier job may leave them
    for name in [k for k in os.environ if k.startswith(("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"))]:
        del os.environ[name]
    bridge = AutoBridge.from_hf_pretrained(hf)
    provider = bridge.to_megatron_provider(load_weights=load_weights)
    for k, v in CPU_KERNELS.items():  # fused kernels off (their weights and names are the same)
        if hasattr(provider, k):
            setattr(provider, k, v)
    provider.tensor_model_parallel_size, provider.pipeline_model_parallel_size = tp, pp
    if vocab_rows is not None and vocab_rows != provider.vocab_size:  # a checkpoint with padded vocab rows
        provider.should_pad_vocab = False
        provider.vocab_size = vocab_rows
    provider.finalize()
    return bridge, provider


def build(provider):
    """The model chunks, built with the CPU stand-ins in place of TE's modules; eval mode."""
    with cpu_build_patches():
        model = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)
    check_spec(model)
    for m in model:
        m.eval()
    return model


def save_as_bridge(bridge, model, out_dir: str, hf: str) -> None:
    bridge.save_megatron_model(model, out_dir, hf_tokenizer_path=hf)


# ----------------------------------------------------------------------------- make


def hf_config():
    from transformers import Qwen2_5_VLConfig

    return Qwen2_5_VLConfig(text_config=json.loads(json.dumps(TEXT)), vision_config=dict(VISION),
                            image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VSTART,
                            vision_end_token_id=VEND, tie_word_embeddings=False, dtype="float32",
                            architectures=["Qwen2_5_VLForConditionalGeneration"])


def cmd_make(a) -> int:
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:  # a served worker of several ranks: rank 0 makes it
        try:
            return make(a) if dist.get_rank() == 0 else 0
        finally:
            dist.barrier()
    return make(a)


def make(a) -> int:
    import torch
    from safetensors import safe_open
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast, Qwen2_5_VLForConditionalGeneration

    t0 = time.time()
    out = Path(a.hf_dir)
    config = hf_config()
    torch.manual_seed(a.seed)
    model = Qwen2_5_VLForConditionalGeneration(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            g = torch.Generator().manual_seed(zlib.crc32(f"{a.seed}|{name}".encode()))
            if "norm" in name or "ln_q" in name:  # RMSNorm weights: [0.5, 1.5], never exactly 1
                assert name.endswith("weight"), name
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
                p.masked_fill_(p == 1.0, 1.25)
            elif name.endswith("bias"):  # linear biases: nonzero
                mag = 0.05 + 0.2 * torch.rand(p.shape, generator=g)
                p.copy_(torch.where(torch.rand(p.shape, generator=g) < 0.5, -mag, mag))
            elif "embed_tokens" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif p.dim() >= 2:  # linears [out, in], the Conv3d patch embedding [out, C, T, P, P]
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p[0].numel()))
            else:
                raise SystemExit(f"make: no rule for {name} {tuple(p.shape)}")
    model.save_pretrained(out)
    tok = Tokenizer(WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t3"))
    tok.pre_tokenizer = WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t3", pad_token="t0", eos_token="t1",
                            bos_token="t2").save_pretrained(out)
    saved = {}
    for f in sorted(out.glob("*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            for k in sf.keys():
                t = sf.get_slice(k)
                saved[k] = {"shape": list(t.get_shape()), "dtype": t.get_dtype()}
    print(json.dumps({"made": str(out), "files": sorted(p.name for p in out.iterdir()), "saved": saved,
                      "seconds": round(time.time() - t0, 2)}))
    return 0


# ----------------------------------------------------------------------------- bridge-import


def cmd_bridge_import(a, serving=False) -> int:
    t0 = time.time()
    apply_bridge_cpu_shims()
    from oracles.common import end_parallel

    rank, world = init_dist(a.pp)
    try:
        bridge, provider = vl_provider(a.hf_dir, load_weights=True, tp=world // a.pp, pp=a.pp)
        model = build(provider)
        save_as_bridge(bridge, model, a.out_dir, a.hf_dir)
    finally:
        end_parallel(serving)
    if rank == 0:
        print(json.dumps({"bridge_import": str(a.out_dir), "tp": world // a.pp, "pp": a.pp,
                          "seconds": round(time.time() - t0, 2)}))
    return 0


# ----------------------------------------------------------------------------- judge


def tensor_state(model) -> dict:
    import torch

    return {k: v.detach() for k, v in unwrap(model[0]).state_dict().items() if isinstance(v, torch.Tensor)
            and not k.endswith("_extra_state")}


def vocab_full(model) -> dict:
    """The language model's embedding and output weights gathered over TP (all vocab rows)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    sd = tensor_state(model)
    out = {}
    for k in (EMB, OUT):
        parts = [torch.empty_like(sd[k]) for _ in range(group.size())]
        dist.all_gather(parts, sd[k].contiguous(), group=group)
        out[k] = torch.cat(parts)
    return out


def cut_vocab_padding(model, ref, got: dict, want: dict) -> list[str]:
    """A model loaded with more vocab rows than Bridge's import: the rows past the vocab must be zero; got / want
    then hold the whole (TP-gathered) vocab tensors, padding cut off."""
    import torch

    g, w = vocab_full(model), vocab_full(ref)
    problems = []
    for k in (EMB, OUT):
        n = w[k].shape[0]
        if g[k].shape[0] < n:
            problems.append(f"loaded: {k} has {g[k].shape[0]} rows, fewer than the vocab's {n}")
            continue
        if torch.count_nonzero(g[k][n:]):
            problems.append(f"loaded: {k} vocab padding rows {n}..{g[k].shape[0]} not zero")
        got[k], want[k] = g[k][:n], w[k]
    return problems


def judge_inputs():
    """(input_ids [1, S], pixel_values [sum t*h*w, C*T*P*P], image_grid_thw [2, 3], mm_token_type_ids [1, S])."""
    import torch

    merge = VISION["spatial_merge_size"] ** 2
    ids = [5, 17, 42]
    for k, (t, h, w) in enumerate(GRIDS):
        ids += [VSTART] + [IMAGE] * (t * h * w // merge) + [VEND] + [60 + 7 * k, 111 + k, 203 - k]
    ids += [250, 9, 77, 18]
    input_ids = torch.tensor([ids])
    g = torch.Generator().manual_seed(4321)
    patch = VISION["in_channels"] * VISION["temporal_patch_size"] * VISION["patch_size"] ** 2
    pixel_values = torch.randn(sum(t * h * w for t, h, w in GRIDS), patch, generator=g)
    return input_ids, pixel_values, torch.tensor(GRIDS), (input_ids == IMAGE).int()


def megatron_logits(model, inputs):
    import torch

    ids, pv, thw, _ = inputs
    with torch.no_grad():
        return unwrap(model[0])(input_ids=ids, position_ids=None, attention_mask=None, pixel_values=pv,
                                image_grid_thw=thw, runtime_gather_output=True).float()


def hf_logits(hf: str, inputs):
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    model, info = Qwen2_5_VLForConditionalGeneration.from_pretrained(hf, dtype=torch.float32,
                                                                     attn_implementation="eager",
                                                                     output_loading_info=True)
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if bad:
        raise RuntimeError(f"transformers' load of {hf} is not clean: {bad}")
    ids, pv, thw, mm = inputs
    with torch.no_grad():
        return model.eval()(input_ids=ids, pixel_values=pv, image_grid_thw=thw, mm_token_type_ids=mm,
                            use_cache=False).logits.float()


def hf_mrope_section(hf: str) -> list[int]:
    from transformers import AutoConfig

    return list(AutoConfig.from_pretrained(hf).text_config.rope_parameters["mrope_section"])


def fair_mrope(model, section: list[int]) -> list[int]:
    """The judge's one change to Bridge's model (see the module docstring): the language model's mrope_section set
    to the HF config's; returns Bridge's value."""
    lm = unwrap(model[0]).language_model
    before = list(lm.mrope_section)
    lm.mrope_section = list(section)
    return before


def compare_stored_padded(iter_dir: Path, truth_dir: Path) -> tuple[list[str], dict]:
    """oracles.common.compare_stored with this model's (prefixed) vocab tensors: stored rows past Bridge's must be
    zero and are cut off before the bit-for-bit comparison."""
    import torch
    from megatron.core import dist_checkpointing

    def plain(d):
        return {k: v for k, v in dist_checkpointing.load_plain_tensors(str(d)).items() if isinstance(v, torch.Tensor)}

    got, want = plain(iter_dir), plain(truth_dir)
    problems = []
    for k in (EMB, OUT):
        if k in got and k in want and got[k].shape[0] > want[k].shape[0] and got[k].shape[1:] == want[k].shape[1:]:
            n = want[k].shape[0]
            if torch.count_nonzero(got[k][n:]):
                problems.append(f"stored: {k} vocab padding rows {n}..{got[k].shape[0]} not zero")
            got[k] = got[k][:n]
    problems += compare(got, want, "stored vs Bridge import")
    mine, theirs = model_objects(stored_metadata(str(iter_dir))), model_objects(stored_metadata(str(truth_dir)))
    problems += [f"stored: _extra_state object missing: {k}" for k in sorted(theirs - mine)]
    problems += [f"stored: unexpected object: {k}" for k in sorted(mine - theirs)]
    return problems, {"stored_tensors": len(got), "stored_objects": len(mine)}


def cmd_judge(a, serving=False) -> int:
    t0 = time.time()
    apply_bridge_cpu_shims()
    import torch.distributed as dist

    from oracles.common import end_parallel, is_legacy, resolve_iter_dir

    iter_dir, truth_dir = Path(resolve_iter_dir(a.megatron_dir)), Path(resolve_iter_dir(a.truth))
    rank, world = init_dist()
    problems: list[str] = []
    info: dict = {"judged": str(iter_dir), "truth": str(truth_dir), "load_tp": world}
    try:
        if is_legacy(iter_dir):
            raise RuntimeError("a legacy (mp_rank_*) checkpoint: this judge reads torch_dist only")
        info["stored_tp"], info["stored_pp"] = stored_parallel(iter_dir)
        for what, want in (("tp", a.tp), ("pp", a.pp)):
            if want is not None and info[f"stored_{what}"] != want:
                problems.append(f"checkpoint records {what.upper()}={info[f'stored_{what}']}, expected {want}")
        meta = stored_metadata(str(iter_dir))
        rows = None
        if meta.get(EMB) is None:
            problems.append(f"stored: no {EMB}")
        else:
            rows = meta[EMB][0]
        sp, si = (compare_stored_padded(iter_dir, truth_dir) if a.allow_vocab_padding
                  else compare_stored(iter_dir, truth_dir, False))
        problems += sp
        info.update(si)
        _, provider = vl_provider(a.hf, load_weights=False, tp=world, vocab_rows=rows)
        model = build(provider)
        load_strict(model, iter_dir, problems)
        # Bridge's own import at this very layout, in memory; unpadded: Bridge 0.6.2 pads a vocab tensor only
        # under the unprefixed names (ColumnParallelMapping), so it cannot import into language_model.* with more
        # rows ("Shape mismatch"); the stored padding rows are checked to be zero and cut off instead
        _, ref_provider = vl_provider(a.hf, load_weights=True, tp=world)
        ref = build(ref_provider)
        got, want = tensor_state(model), tensor_state(ref)
        if rows is not None and rows != ref_provider.vocab_size:
            info["vocab_rows"] = {"stored": rows, "bridge": ref_provider.vocab_size}
            problems += cut_vocab_padding(model, ref, got, want)
        info["loaded_tensors"] = len(got)
        info["loaded_visual_tensors"] = sum(k.startswith("visual.") for k in got)
        problems += compare(got, want, "loaded vs Bridge import")
        inputs = judge_inputs()
        info["input"] = {"tokens": inputs[0].shape[1], "image_grid_thw": GRIDS,
                         "pixel_values": list(inputs[1].shape), "image_tokens": int(inputs[3].sum())}
        hlog = hf_logits(a.hf, inputs)
        try:  # Bridge's model as Bridge builds it (its mrope_section)
            raw = megatron_logits(model, inputs)[..., :VOCAB]
            info["logits_vs_hf_raw"] = (raw - hlog).abs().max().item()
        except Exception as e:  # noqa: BLE001 - recorded, see the module docstring
            info["logits_vs_hf_raw"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
        section = hf_mrope_section(a.hf)
        info["mrope_section"] = {"bridge": fair_mrope(model, section), "hf": section}
        fair_mrope(ref, section)
        mlog = megatron_logits(model, inputs)[..., :VOCAB]
        rlog = megatron_logits(ref, inputs)[..., :VOCAB]
        diff = (mlog - hlog).abs().max().item()
        info["logits_max_abs_diff_vs_hf"] = diff
        info["logits_max_abs_diff_vs_bridge_model"] = (mlog - rlog).abs().max().item()
        info["logits_scale"] = hlog.abs().max().item()
        if not diff <= a.atol:
            problems.append(f"logits differ from transformers' by {diff:.3g} (atol {a.atol}; HF mrope_section)")
        info["argmax_agreement"] = (mlog.argmax(-1) == hlog.argmax(-1)).float().mean().item()
    except Exception as e:  # noqa: BLE001 - a refused load is a verdict, not a crash
        import traceback

        traceback.print_exc()
        problems.append(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500])
    finally:
        every = [None] * world
        dist.all_gather_object(every, problems)  # every rank's verdict, reported by rank 0
        end_parallel(serving)
    problems = [p if r == 0 else f"rank {r}: {p}" for r, ps in enumerate(every) for p in ps]
    info.update(ok=not problems, problems=problems[:50], n_problems=len(problems), seconds=round(time.time() - t0, 2))
    if rank == 0:
        print(json.dumps(info), flush=True)
    return 0 if not problems else 1


# ----------------------------------------------------------------------------- mutate


def cmd_mutate(a, serving=False) -> int:
    """A copy of a checkpoint with one defect, saved the way Bridge saves (see the module docstring)."""
    apply_bridge_cpu_shims()
    import torch

    from oracles.common import end_parallel, resolve_iter_dir

    rank, world = init_dist()
    try:
        bridge, provider = vl_provider(a.hf, load_weights=False, tp=world)
        model = build(provider)
        problems: list[str] = []
        load_strict(model, Path(resolve_iter_dir(a.src)), problems)
        assert not problems, problems
        m = unwrap(model[0])
        vis, layers = m.visual, m.language_model.decoder.layers
        with torch.no_grad():
            if a.kind == "value":
                vis.blocks[1].attn.qkv.weight[5, 7] += 1e-3
            elif a.kind == "swap_qkv_vision":  # HF rows: [q; k; v], each hidden rows
                qkv, d = vis.blocks[0].attn.qkv, VISION["hidden_size"]
                for t in (qkv.weight, qkv.bias):
                    q, k = t[:d].clone(), t[d:2 * d].clone()
                    t[:d], t[d:2 * d] = k, q
            elif a.kind == "swap_blocks":
                x, y = vis.blocks[0], vis.blocks[1]
                for (_, p), (_, r) in zip(x.named_parameters(), y.named_parameters(), strict=True):
                    tmp = p.clone()
                    p.copy_(r)
                    r.copy_(tmp)
            elif a.kind == "lm_value":
                layers[2].self_attention.linear_qkv.weight[3, 11] += 1e-3
            elif a.kind == "lm_bias":
                layers[1].self_attention.linear_qkv.bias[0] += 1e-3
            elif a.kind == "swap_k_v":  # rows per query group: [q heads of the group, k, v]
                c = provider.kv_channels
                per = (provider.num_attention_heads // provider.num_query_groups + 2) * c
                qkv = layers[0].self_attention.linear_qkv
                for t in (qkv.weight, qkv.bias):
                    g = t.view(-1, per, *t.shape[1:])
                    k, v = g[:, -2 * c:-c].clone(), g[:, -c:].clone()
                    g[:, -2 * c:-c], g[:, -c:] = v, k
            elif a.kind == "swap_gate_up":
                w = layers[1].mlp.linear_fc1.weight
                w.copy_(torch.cat(torch.chunk(w.clone(), 2, 0)[::-1]))
        if a.kind == "drop_object":
            orig = m.sharded_state_dict

            def dropped(*args, **kw):
                sd = orig(*args, **kw)
                return {k: v for k, v in sd.items()
                        if not (k.startswith("language_model.") and k.endswith("mlp.linear_fc2._extra_state"))}

            m.sharded_state_dict = dropped
        save_as_bridge(bridge, model, a.dst, a.hf)
    finally:
        end_parallel(serving)
    if rank == 0:
        print(json.dumps({"mutated": str(a.dst), "kind": a.kind}))
    return 0


# ----------------------------------------------------------------------------- layout


def stored_detail(iter_dir: str) -> dict:
    """The checkpoint's .metadata: {key: {"shape", "dtype"}} for tensors, "object" for bytes items."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = FileSystemReader(iter_dir).read_metadata()
    return {k: ({"shape": list(v.size), "dtype": str(v.properties.dtype)} if isinstance(v, TensorStorageMetadata)
                else "object") for k, v in sorted(md.state_dict_metadata.items())}


def object_replicas(m, described: dict) -> dict:
    """describe_sharded's objects with their replica ids (which ranks write each _extra_state)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    for k, v in m.sharded_state_dict().items():
        if isinstance(v, ShardedObject):
            described[k]["replica_id"] = list(v.replica_id) if isinstance(v.replica_id, tuple) else v.replica_id
    return described


def mapping_table(bridge, m) -> list[dict]:
    """Bridge's mapping registry for this model: Megatron pattern -> HF names, mapping class, and for each concrete
    parameter the TP split AutoMapping picks from its module's class."""
    import re

    registry = bridge._model_bridge.mapping_registry()
    params = dict(m.named_parameters())
    modules = dict(m.named_modules())
    out = []
    for mp in registry.mappings if hasattr(registry, "mappings") else registry._mappings:
        row = {"megatron": mp.megatron_param, "hf": mp.hf_param, "mapping": type(mp).__name__, "params": {}}
        pattern = re.compile(re.escape(mp.megatron_param).replace(r"\*\*", ".+").replace(r"\*", r"\d+") + "$")
        for name in params:
            hit = registry.megatron_to_hf_lookup(name)
            if hit is None or type(hit) is not type(mp) or not pattern.match(name):
                continue
            owner = modules[name.rsplit(".", 1)[0]]
            kind = type(mp).__name__
            if kind == "AutoMapping":
                with contextlib.suppress(Exception):
                    kind = f"AutoMapping:{hit._detect_parallelism_type(owner)}"
            row["params"][name] = {"hf": hit.hf_param, "module": type(owner).__name__, "split": kind}
        out.append(row)
    return out


def hf_tensors(hf_dir: str) -> dict:
    from safetensors.torch import load_file

    hf = {}
    for f in sorted(Path(hf_dir).glob("*.safetensors")):
        hf.update(load_file(str(f)))
    return hf


def row_sources(m, hf: dict) -> dict:
    """For the fused language tensors of this rank: which HF rows each local row holds (layer 0 linear_qkv weight
    and bias vs q_proj/k_proj/v_proj; linear_fc1 vs gate_proj/up_proj). Rows are named like q3 (q row 3 of the HF
    tensor), k0, v15, gate7, up2."""
    import torch

    def sources(local, parts):
        out = []
        for row in local:
            hit = [f"{name}{i}" for name, t in parts for i in range(t.shape[0]) if torch.equal(t[i], row)]
            out.append(hit[0] if len(hit) == 1 else hit)
        return out

    lm = next(p for p in ("model.language_model.layers.0", "model.layers.0") if f"{p}.mlp.up_proj.weight" in hf)
    layer = m.language_model.decoder.layers[0]
    qkv = layer.self_attention.linear_qkv
    return {
        "hf_prefix": lm,
        "linear_qkv_weight": sources(qkv.weight, [(p, hf[f"{lm}.self_attn.{p}_proj.weight"]) for p in "qkv"]),
        "linear_qkv_bias": sources(qkv.bias[:, None], [(p, hf[f"{lm}.self_attn.{p}_proj.bias"][:, None])
                                                         for p in "qkv"]),
        "linear_fc1_weight": sources(layer.mlp.linear_fc1.weight,
                                     [(p, hf[f"{lm}.mlp.{p}_proj.weight"]) for p in ("gate", "up")]),
    }


def vision_names(m, hf: dict) -> dict:
    """The Megatron ``visual.*`` state-dict keys against the HF file's names: the HF name holding the same tensor
    (equal values), and whether the name is the Megatron key itself or ``model.`` + it."""
    import torch

    out = {}
    for k, v in m.state_dict().items():
        if not k.startswith("visual.") or not isinstance(v, torch.Tensor) or k.endswith("_extra_state"):
            continue
        same = [n for n, t in hf.items() if t.shape == v.shape and torch.equal(t, v)]
        out[k] = {"hf_equal": same, "hf_name_is_key": k in hf, "hf_name_is_model_prefix_key": f"model.{k}" in hf}
    return out


def cmd_layout(a, serving=False) -> int:
    apply_bridge_cpu_shims()
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from oracles.common import end_parallel

    rank, world = init_dist()
    try:
        bridge, provider = vl_provider(a.hf_dir, load_weights=True, tp=world)
        m = unwrap(build(provider)[0])
        hf = hf_tensors(a.hf_dir)
        state = {k: ({"shape": list(v.shape), "dtype": str(v.dtype)} if isinstance(v, torch.Tensor) else repr(v))
                 for k, v in m.state_dict().items()}
        mine = {"tp_rank": parallel_state.get_tensor_model_parallel_rank(), "state_dict": state,
                "sharded_state_dict": object_replicas(m, describe_sharded(m.sharded_state_dict())),
                "row_sources": row_sources(m, hf)}
        every = [None] * world
        dist.all_gather_object(every, mine)
        vc = m.visual.config
        out = {"tp": world, "pp": 1, "ranks": every,
               "modules": {n: type(mod).__name__ for n, mod in m.named_modules()
                           if not any(f".layers.{i}." in n + "." or f".blocks.{i}." in n + "." for i in range(1, 8))},
               "mappings": mapping_table(bridge, m),
               "vision_names": vision_names(m, hf),
               "hf_file_keys": sorted(hf),
               "vision_module": {"class": type(m.visual).__name__, "module": type(m.visual).__module__,
                                 "attn_implementation": vc._attn_implementation,
                                 **{k: repr(getattr(vc, k)) for k in (
                                     "depth", "hidden_size", "num_heads", "intermediate_size", "patch_size",
                                     "temporal_patch_size", "spatial_merge_size", "window_size",
                                     "fullatt_block_indexes", "out_hidden_size", "hidden_act")}},
               "language_config": {k: repr(getattr(provider, k)) for k in (
                   "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
                   "ffn_hidden_size", "normalization", "layernorm_epsilon", "add_qkv_bias", "add_bias_linear",
                   "gated_linear_unit", "qk_layernorm", "position_embedding_type", "mrope_section", "rotary_base",
                   "rotary_interleaved", "vocab_size", "should_pad_vocab", "make_vocab_size_divisible_by",
                   "share_embeddings_and_output_weights", "image_token_id", "video_token_id",
                   "vision_start_token_id", "vision_end_token_id")},
               "padded_vocab_rows": m.language_model.embedding.word_embeddings.weight.shape[0] * world,
               "hf_mrope_section": hf_mrope_section(a.hf_dir)}
        if a.ckpt:
            from megatron.core import dist_checkpointing

            from oracles.common import resolve_iter_dir

            it = Path(resolve_iter_dir(a.ckpt))
            out["stored"] = stored_detail(str(it))
            common = dist_checkpointing.load_common_state_dict(str(it))
            out["common_state"] = {k: repr(v)[:300] for k, v in common.items()}
            rc = it / "run_config.yaml"
            if rc.is_file():
                import yaml

                out["run_config_model"] = (yaml.safe_load(rc.read_text()) or {}).get("model")
            out["files"] = sorted(str(p.relative_to(it.parent)) for p in it.parent.rglob("*") if p.is_file())
    finally:
        end_parallel(serving)
    if rank == 0:
        emit_layout(out, a.out)
    return 0


# ----------------------------------------------------------------------------- main


def main(argv=None, serving=False) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("make")
    sp.add_argument("hf_dir")
    sp.add_argument("--seed", type=int, default=7)
    sp = sub.add_parser("bridge-import")
    sp.add_argument("hf_dir")
    sp.add_argument("out_dir")
    sp.add_argument("--pp", type=int, default=1, help="pipeline stages (TP = world size / PP)")
    sp = sub.add_parser("judge")
    sp.add_argument("megatron_dir")
    sp.add_argument("--truth", required=True, help="Bridge's own import of --hf (bridge-import)")
    sp.add_argument("--hf", required=True)
    sp.add_argument("--tp", type=int, default=None, help="the TP the checkpoint must record")
    sp.add_argument("--pp", type=int, default=None, help="the PP the checkpoint must record")
    sp.add_argument("--atol", type=float, default=1e-4, help="logits vs transformers, max abs")
    sp.add_argument("--allow-vocab-padding", action="store_true",
                    help="stored vocab rows past Bridge's (unpadded) vocab are accepted if zero")
    sp = sub.add_parser("mutate")
    sp.add_argument("src")
    sp.add_argument("dst")
    sp.add_argument("--hf", required=True)
    sp.add_argument("--kind", choices=MUTATIONS, required=True)
    sp = sub.add_parser("layout")
    sp.add_argument("hf_dir")
    sp.add_argument("--ckpt", default=None)
    sp.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if a.cmd == "make":
        return cmd_make(a)
    return {"bridge-import": cmd_bridge_import, "judge": cmd_judge, "layout": cmd_layout,
            "mutate": cmd_mutate}[a.cmd](a, serving)


if __name__ == "__main__":
    run_program(main)
