"""Oracle for Gemma 3 VL: Megatron-Bridge 0.6.2's ``Gemma3VLBridge`` / ``Gemma3VLModelProvider`` (its
``Gemma3VLModel``: transformers' SigLIP vision tower kept as is under ``vision_tower.``, Bridge's projector under
``multi_modal_projector.``, Bridge's Gemma 3 language model under ``language_model.``) on megatron-core 0.19.2 is the
Megatron-side layout; transformers' ``Gemma3ForConditionalGeneration`` is the HF side. Runs in the second runtime
(.venv-mcore19, Python 3.12); imports megatron-core, Megatron-Bridge, transformers; never dist_convert.

  oracles/gemma3_vl.py make HF_DIR [--layers N] [--seed S]
      a tiny random Gemma3ForConditionalGeneration made by transformers' own classes (Gemma3Config with a
      Gemma3TextConfig and a SiglipVisionConfig), fp32, ``save_pretrained`` (safetensors), and a 300-token WordLevel
      tokenizer (what save_megatron_model(hf_tokenizer_path=) reads; no processor is needed).
      Text: oracles/gemma3.py's TINY (hidden 64, 4 heads, 2 kv heads, head_dim 16, ffn 128, vocab 300, 7 layers: 1-5
      and 7 sliding, 6 full, query_pre_attn_scalar 24, linear rope scaling x4 on full layers, tied embeddings) but
      sliding_window 256 and max_position_embeddings 1024; boi / eoi / image tokens 297 / 298 / 299. --layers N
      (default 7; Bridge only knows the 5:1 pattern): an even N (e.g. 6) for a PP 2 import, as Bridge's provider wants
      the layers divisible by PP.
      Vision: SigLIP hidden 32, 2 heads, ffn 64, 2 layers, image 128, patch 2, layer_norm_eps 1e-6, no pooling head
      (vision_use_head False, as the releases and as Bridge forces); mm_tokens_per_image 256.
      Why these sizes. Bridge's Gemma3VLMultimodalProjectorConfig keeps image_size 896, patch_dim 14 and
      tokens_per_image 256 whatever the HF config says (provider_bridge copies only input_size and hidden_size), so
      its projector reshapes the tower's output to 64 x 64 patches and pools 4 x 4: any model with image_size /
      patch_size != 64 or mm_tokens_per_image != 256 fails in Bridge's forward (every Gemma 3 release has 896 / 14 and
      256). Hence 128 / 2 = 64 patches a side and 256 tokens an image. Bridge's local (sliding) layers see an image
      block only within the window (its local attention bias is the global one AND |i - j| <= window - 1);
      transformers ORs the whole image block into its sliding mask. The two agree when an image block fits in the
      window (every release: window 1024 or 512, 256 tokens an image), so sliding_window is 256 here: both sides
      compute the same mask, with no change to either. The projector's RMSNorm eps: Bridge fixes 1e-6, transformers
      takes vision_config.layer_norm_eps (1e-6 here, as released).
      Values: every tensor random with distinct values, seeded per tensor name; Gemma (1 + w) RMSNorm weights (language
      model, mm_soft_emb_norm) w with |w| in [0.2, 0.8] either sign; SigLIP LayerNorm weights 1 +- [0.1, 0.4],
      biases (LayerNorm, linear, patch conv) nonzero. Every value is bf16-representable (stored as fp32): Gemma3VLBridge
      forces bf16 (provider_bridge: bf16 True, params_dtype bfloat16), so Bridge's import rounds to bf16, and with
      bf16-exact values that loses nothing: the HF model and Bridge's hold the very same numbers.
  oracles/gemma3_vl.py bridge-import HF_DIR OUT_DIR [--pp P]
      Megatron-Bridge's own import (AutoBridge.from_hf_pretrained, to_megatron_provider(load_weights=True),
      provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True), save_megatron_model): a torch_dist
      checkpoint (bf16, as Bridge makes Gemma 3 VL) at PP --pp (default 1), TP = world size / PP. The vision tower
      and projector live on the first stage only (Gemma3VLModel: pre_process).
  oracles/gemma3_vl.py judge MEGATRON_DIR --truth BRIDGE_DIR --hf HF_DIR [--tp N] [--pp N] [--atol 1e-4]
      builds Bridge's Gemma 3 VL model from the HF config (TP = world size, PP 1, bf16 as Bridge builds it), loads
      MEGATRON_DIR into it with megatron-core's dist_checkpointing.load (StrictHandling.RAISE_ALL: no missing, no
      unexpected key; resharding from any TP/PP), TE's check of each _extra_state value, then module.load_state_dict
      (every key but an unsaved _extra_state, as Megatron-LM's and Bridge's loaders allow); asserts
        * every loaded tensor == Bridge's own import of HF_DIR at this layout (in memory), bit for bit
        * every stored tensor == BRIDGE_DIR's (load_plain_tensors, global shapes), bit for bit, and the same
          _extra_state objects (names)
        * --tp N / --pp N: the TP / PP the checkpoint records (Megatron-LM args, else run_config.yaml) are N
        * the Megatron logits WITH IMAGES match transformers' Gemma3ForConditionalGeneration (eager, fp32) within
          --atol (1e-4). Input: batch 2 of 538 tokens (> sliding_window 256): row 0 text, boi, 256 image tokens,
          eoi, text, boi, 256 image tokens, eoi, text; row 1 text only; pixel_values [2, 3, 128, 128] from a seeded
          generator (both images belong to row 0). Megatron gets input_ids, position_ids, pixel_values (Gemma3VLModel
          makes its (local, global) attention biases from input_ids: causal, bidirectional within each image);
          transformers gets input_ids, pixel_values and token_type_ids (1 at image tokens: without them it would
          keep image tokens causal), from which it makes the same masks (see make: the window holds an image).
          The comparison runs both Megatron models in fp32: after the bit-for-bit checks the loaded bf16 model is
          cast to fp32 (exact), since Bridge's bf16 forward (its Float16Module: bf16 activations) is 6e-2 off
          transformers' fp32 one here with the very same weights; the HF model holds them (bf16-exact) in fp32.
      The fair comparison. Bridge's TERowParallelLinearLayerNorm (linear_proj and linear_fc2 of every language layer)
      builds its post_layernorm as TENorm(config, size) without eps: TENorm's default 1e-5, where transformers'
      post_attention_layernorm / post_feedforward_layernorm use text_config.rms_norm_eps (1e-6 here, as in the
      releases). That is a flaw of Bridge's model, not of any checkpoint: it grows with the context (a long text-only
      row averages many values, the attention output gets small and eps matters: 7e-4 here, a few 1e-5 over the
      first 16 tokens).
      The judge measures the logits of Bridge's model as Bridge builds it (``logits_max_abs_diff_vs_hf_raw``, not
      judged), then sets exactly those 2 x layers modules' eps to rms_norm_eps (each must hold 1e-5 first) and
      judges that (``logits_max_abs_diff_vs_hf``, also per row) against --atol; both numbers are in the JSON.
      Prints one JSON line (rank 0); exit 1 on any problem. torch_dist checkpoints only. A checkpoint whose
      embedding has padded vocab rows (more than Bridge's, which does not pad) loads into a model built with that
      many rows (``vocab_rows``); Bridge's import refuses a padded embedding (a shape mismatch), so its reference
      model stays at its own vocab and the loaded embedding is compared on Bridge's rows (gathered over TP); the
      stored comparison fails on the extra rows unless --allow-vocab-padding, which accepts them if zero.
  oracles/gemma3_vl.py mutate SRC DST --hf HF_DIR --kind value|proj_untransposed|mm_norm_plus_one|swap_vision_q_k|
      lm_value|drop_object
      SRC with one defect, saved as Bridge saves (save_megatron_model at TP = world size): the judge must fail on DST.
      value: one element of multi_modal_projector.proj.weight += 1/16; proj_untransposed: proj.weight holds HF's
      mm_input_projection_weight [vision hidden, text hidden] bytes as they lie, read as [text hidden, vision hidden]
      (the permute forgotten: same shape, no error); mm_norm_plus_one: the projector's RMSNorm stored as 1 + w;
      swap_vision_q_k: vision layer 0's q_proj and k_proj (weights and biases) exchanged; lm_value: one element of
      language layer 3's linear_qkv.weight += 1/16; drop_object: no
      multi_modal_projector.mm_soft_embed_norm._extra_state
  oracles/gemma3_vl.py layout HF_DIR [--ckpt DIR] [--out JSON]
      the layout at TP = world size: the model's state_dict() (names, shapes, dtypes), its sharded_state_dict() (keys,
      global shapes, TP axis, replica ids, ShardedObjects incl. every _extra_state), the module classes, Bridge's
      mapping registry (Megatron pattern -> HF pattern, mapping type), the HF checkpoint's tensor names; with --ckpt
      the checkpoint's stored keys (.metadata), its common state and run_config.yaml's model section.

The CPU stand-ins. Transformer Engine has no CPU build; Bridge builds Gemma 3 VL from TE modules in two places:
  * the language model: Bridge's gemma3_layer_spec(config), the same leaves as the text model, swapped for the
    stand-ins of oracles.gemma3.cpu_gemma3_layer_spec / oracles.te_cpu.cpu_classes (CpuTENorm for te RMSNorm: weight,
    (1 + w) zero-centered, TE op's pickled-{} _extra_state; CpuTELayerNormColumnParallelLinear: layer_norm_weight
    replicated, weight TP axis 0, empty uint8 _extra_state; CpuTERowParallelLinearLayerNorm: weight TP axis 1 +
    post_layernorm CpuTENorm (TENorm's default eps 1e-5, as Bridge builds it)), each slot checked to hold the
    expected TE class, the class names of what they stand for (Bridge's AutoMapping picks a TP split by class name),
    megatron-core's TE wrappers' sharded_state_dict. Core attention differs from the text model: with
    is_vision_language Gemma3TEDotProductAttention drops the window on every layer and takes AttnMaskType.no_mask,
    and Gemma3SelfAttention hands it the local or global additive bias Gemma3VLModel computed; TE applies that as
    core_attention_bias_type "post_scale_bias": softmax(scale * q k^T + bias). CpuGemma3VLDotProductAttention
    (named Gemma3TEDotProductAttention) is megatron-core's local DotProductAttention (no sharded state, as
    TEDotProductAttention in 0.19.2; legacy _extra_state an empty uint8 tensor) with exactly that forward, in fp32
    (GQA by repeat_interleave as megatron-core's). The final layernorm: megatron-core builds TENorm there when TE is
    present (transformer_block.LayerNormImpl) -> CpuTENorm.
  * the projector: modeling_gemma3_vl.Gemma3VLMultimodalProjector builds ``mm_soft_embed_norm`` as TENorm(config,
    input_size, eps=1e-6) with the projector config's RMSNorm, layernorm_zero_centered_gamma True -> CpuTENorm (the
    module-level name TENorm in modeling_gemma3_vl is set only while the model is built). ``proj`` is megatron-core's
    own ColumnParallelLinear (gather_output True): no stand-in.
  * the vision tower is transformers' own SiglipVisionModel (AutoModel.from_config(vision_config); in transformers
    5.12.1 it has no ``vision_model`` wrapper, so Bridge's getattr(raw, "vision_model", raw) keeps it as is, with
    children embeddings / encoder / post_layernorm and sdpa attention): plain torch, no stand-in.
Other CPU shims: oracles.te_cpu.apply_bridge_cpu_shims (TE stub for Bridge's lora_layers only, CUDA no-ops, the masks
megatron-core allocates on "cuda" made on the CPU, the save's CUDA RNG state the CPU one); the provider is made and
set up for the CPU by oracles.gemma3.gemma3_provider with this layer spec (the NVTE_* attention selection variables a
provider sets cleared first) and saved by oracles.gemma3.save_as_bridge (run_config.yaml records Bridge's
gemma3_layer_spec).
"""
from __future__ import annotations

import json
import math
import sys
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the oracles package, helpers

from oracles.common import (  # noqa: E402
    bridge_import,
    bridge_oracle_parser,
    check_recorded,
    compare,
    describe_checkpoint,
    describe_sharded,
    describe_state,
    drop_objects,
    emit_layout,
    finish_judge,
    hf_file_tensors,
    init_dist,
    judge_error,
    judge_stored,
    run_program,
    save_word_tokenizer,
    stored_detail,
    stored_parallel,
    tensor_state,
    tp_gathered,
    unwrap,
)
from oracles.gemma3 import TINY, cpu_gemma3_layer_spec, gemma3_provider, save_as_bridge  # noqa: E402
from oracles.te_cpu import ExtraState, apply_bridge_cpu_shims, cpu_classes, load_strict, load_to_mutate  # noqa: E402

VOCAB = TINY["vocab_size"]  # 300
BOI, EOI, IMAGE = 297, 298, 299  # begin / end of image, image token: inside the vocab
TEXT = {**TINY, "sliding_window": 256, "max_position_embeddings": 1024}
LAYERS = 7
VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
          "num_channels": 3, "image_size": 128, "patch_size": 2, "layer_norm_eps": 1e-6,
          "hidden_act": "gelu_pytorch_tanh", "attention_dropout": 0.0, "vision_use_head": False}
MM_TOKENS = 256  # Bridge's projector: 64 x 64 patches pooled 4 x 4 (see the docstring)
EMB = "language_model.embedding.word_embeddings.weight"


# ----------------------------------------------------------------------------- CPU stand-ins

_ATTN = None


def cpu_vl_attention():
    """Gemma3TEDotProductAttention as Gemma 3 VL builds it (is_vision_language): no window, no mask type, the
    additive bias of Gemma3VLModel applied after the scale (TE's post_scale_bias)."""
    global _ATTN
    if _ATTN is not None:
        return _ATTN
    import copy

    import torch
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    class CpuGemma3VLDotProductAttention(ExtraState, DotProductAttention):
        def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                     softmax_scale=None, cp_comm_type=None, pg_collection=None, **kwargs):
            config = copy.deepcopy(config)
            assert config.is_vision_language
            config.window_size = None  # as Gemma3TEDotProductAttention with is_vision_language: the bias holds it
            config.window_attn_skip_freq = None
            super().__init__(config, layer_number, AttnMaskType.no_mask, attention_type,
                             attention_dropout=attention_dropout, softmax_scale=softmax_scale,
                             cp_comm_type=cp_comm_type, pg_collection=pg_collection)

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            assert packed_seq_params is None and attention_mask is None
            rep = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
            if rep > 1:  # [s, b, ng, hn] -> [s, b, np, hn], as megatron-core's DotProductAttention
                key, value = key.repeat_interleave(rep, dim=2), value.repeat_interleave(rep, dim=2)
            q, k, v = (t.permute(1, 2, 0, 3).float() for t in (query, key, value))  # [b, np, s, hn]
            scores = torch.matmul(q, k.transpose(-1, -2)) * self.softmax_scale
            if attention_bias is not None:
                scores = scores + attention_bias.float()
            probs = torch.softmax(scores, dim=-1)
            ctx = torch.matmul(probs, v).to(query.dtype)  # [b, np, sq, hn]
            ctx = ctx.permute(2, 0, 1, 3).contiguous()
            return ctx.view(*ctx.shape[:2], self.hidden_size_per_partition)

    CpuGemma3VLDotProductAttention.__name__ = CpuGemma3VLDotProductAttention.__qualname__ = \
        "Gemma3TEDotProductAttention"
    _ATTN = CpuGemma3VLDotProductAttention
    return _ATTN


def cpu_gemma3_vl_layer_spec(config):
    """oracles.gemma3's CPU version of Bridge's gemma3_layer_spec, with the VL core attention."""
    spec = cpu_gemma3_layer_spec(config)
    attn = spec.submodules.self_attention
    assert attn.params.get("attn_mask_type").name == "no_mask", attn.params  # Bridge's spec with is_vision_language
    assert attn.submodules.core_attention is cpu_classes()["attn"], attn.submodules.core_attention
    attn.submodules.core_attention = cpu_vl_attention()
    return spec


# ----------------------------------------------------------------------------- the model


def vl_provider(hf: str, load_weights: bool, tp: int, pp: int = 1, vocab_rows: int | None = None,
                parallel_output=True):
    """Bridge's Gemma3VLModelProvider for ``hf`` on the CPU, set up as oracles.gemma3.gemma3_provider sets up the
    text model's, with the VL layer spec; ``vocab_rows`` sizes the embedding like a stored one."""
    return gemma3_provider(hf, load_weights, tp, vocab_rows=vocab_rows, parallel_output=parallel_output, pp=pp,
                           layer_spec=cpu_gemma3_vl_layer_spec)


def build(provider):
    """The model chunks as built with TE: TENorm for the final layernorm (transformer_block.LayerNormImpl) and for
    the projector's norm (modeling_gemma3_vl.TENorm), both set only while the model is built."""
    from megatron.bridge.models.gemma_vl import modeling_gemma3_vl
    from megatron.core.transformer import transformer_block

    saved = transformer_block.LayerNormImpl, modeling_gemma3_vl.TENorm
    transformer_block.LayerNormImpl = modeling_gemma3_vl.TENorm = cpu_classes()["norm"]
    try:
        model = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)
    finally:
        transformer_block.LayerNormImpl, modeling_gemma3_vl.TENorm = saved
    for m in model:
        m.eval()
    return model


# ----------------------------------------------------------------------------- make


def init_value(name: str, shape, g, torch):
    """A tensor's random value (see make), before the bf16 rounding."""
    def sign():
        return torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0)

    if ("language_model" in name and "norm" in name) or "mm_soft_emb_norm" in name:  # Gemma RMSNorm: x (1 + w)
        return sign() * (0.2 + 0.6 * torch.rand(shape, generator=g))
    if ("layer_norm" in name or "post_layernorm" in name) and name.endswith(".weight"):  # SigLIP LayerNorm
        return 1.0 + sign() * (0.1 + 0.3 * torch.rand(shape, generator=g))
    if name.endswith(".bias"):
        return sign() * (0.02 + 0.2 * torch.rand(shape, generator=g))
    if "embed_tokens" in name:
        return 0.05 * torch.randn(shape, generator=g)  # x sqrt(64) at the input
    if "position_embedding" in name:
        return 0.3 * torch.randn(shape, generator=g)
    fan_in = shape[0] if "mm_input_projection" in name else math.prod(shape[1:])  # HF keeps that one [in, out]
    return torch.randn(shape, generator=g) / math.sqrt(fan_in)


def hf_config(layers: int = LAYERS):
    from transformers import Gemma3Config, Gemma3TextConfig, SiglipVisionConfig

    return Gemma3Config(text_config=Gemma3TextConfig(**TEXT, num_hidden_layers=layers, dtype="float32"),
                        vision_config=SiglipVisionConfig(**VISION, dtype="float32"), mm_tokens_per_image=MM_TOKENS,
                        boi_token_index=BOI, eoi_token_index=EOI, image_token_index=IMAGE, tie_word_embeddings=True,
                        dtype="float32")


def cmd_make(a) -> int:
    import torch
    from transformers import Gemma3ForConditionalGeneration

    t0 = time.time()
    out = Path(a.hf_dir)
    config = hf_config(a.layers)
    torch.manual_seed(a.seed)
    model = Gemma3ForConditionalGeneration(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            g = torch.Generator().manual_seed(zlib.crc32(f"{a.seed}|{name}".encode()))
            p.copy_(init_value(name, p.shape, g, torch).to(torch.bfloat16).float())  # bf16-exact (see make)
    model.save_pretrained(out)
    save_word_tokenizer(out, VOCAB)
    stored = hf_file_tensors(out)
    print(json.dumps({"made": str(out), "layer_types": config.text_config.layer_types,
                      "files": sorted(p.name for p in out.iterdir()), "hf_tensors": len(stored),
                      "hf_tensor_names_sample": sorted(stored)[:4] + [k for k in sorted(stored) if "vision" in k][:2],
                      "seconds": round(time.time() - t0, 2)}))
    return 0


# ----------------------------------------------------------------------------- bridge-import


def cmd_bridge_import(a, serving=False) -> int:
    apply_bridge_cpu_shims()

    def save(tp):
        bridge, provider = vl_provider(a.hf_dir, load_weights=True, tp=tp, pp=a.pp)
        save_as_bridge(bridge, provider, build(provider), a.out_dir, a.hf_dir)

    return bridge_import(a, serving, save)


# ----------------------------------------------------------------------------- judge


def whole_embedding(model):
    """The language model's word embedding, gathered over TP (VocabParallelEmbedding splits the rows)."""
    return tp_gathered(unwrap(model[0]).language_model.embedding.word_embeddings.weight.detach())


def judge_inputs():
    """(input_ids [2, 538], pixel_values [2, 3, 128, 128]): row 0 holds both images, row 1 is text only."""
    import torch

    g = torch.Generator().manual_seed(1234)

    def text(n):
        return torch.randint(3, BOI, (n,), generator=g)

    image = torch.tensor([BOI] + [IMAGE] * MM_TOKENS + [EOI])
    row0 = torch.cat([text(6), image, text(8), image, text(8)])
    row1 = text(row0.numel())
    side = VISION["image_size"]
    pixels = torch.randn(2, VISION["num_channels"], side, side, generator=g)
    return torch.stack([row0, row1]), pixels


def megatron_logits(model, ids, pixels):
    import torch

    pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    with torch.no_grad():
        out, _ = unwrap(model[0])(input_ids=ids, position_ids=pos, attention_mask=None, pixel_values=pixels)
    return out.float()


def hf_logits(hf: str, ids, pixels):
    import torch
    from transformers import Gemma3ForConditionalGeneration

    model = Gemma3ForConditionalGeneration.from_pretrained(hf, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    with torch.no_grad():
        return model(input_ids=ids, pixel_values=pixels, token_type_ids=(ids == IMAGE).long(),
                     use_cache=False).logits.float()


BRIDGE_POST_NORM_EPS = 1e-5  # TENorm's default: Bridge's TERowParallelLinearLayerNorm builds post_layernorm without eps


def hf_post_norm_eps(hf: str) -> float:
    """The eps transformers' post_attention_layernorm / post_feedforward_layernorm use (text_config.rms_norm_eps)."""
    return float(json.loads((Path(hf) / "config.json").read_text())["text_config"]["rms_norm_eps"])


def post_norms_to(model, eps: float) -> int:
    """The fair comparison (see the docstring): the eps of the language model's post_layernorm modules (Bridge's
    TERowParallelLinearLayerNorm.post_layernorm: linear_proj's and linear_fc2's) set to ``eps``; each must hold
    Bridge's TENorm default first. Returns how many were set."""
    n = 0
    for name, mod in unwrap(model[0]).language_model.named_modules():
        if name.endswith(("linear_proj.post_layernorm", "linear_fc2.post_layernorm")):
            assert mod.eps == BRIDGE_POST_NORM_EPS, (name, mod.eps)
            mod.eps = eps
            n += 1
    return n


def cmd_judge(a, serving=False) -> int:
    t0 = time.time()
    apply_bridge_cpu_shims()
    from oracles.common import is_legacy, resolve_iter_dir

    iter_dir, truth_dir = Path(resolve_iter_dir(a.megatron_dir)), Path(resolve_iter_dir(a.truth))
    rank, world = init_dist()
    problems: list[str] = []
    info: dict = {"judged": str(iter_dir), "truth": str(truth_dir), "load_tp": world}
    try:
        if is_legacy(iter_dir):
            raise RuntimeError("a legacy (torch) checkpoint: Gemma 3 VL is judged in torch_dist only")
        info["stored_tp"], info["stored_pp"] = stored_parallel(iter_dir)
        check_recorded(info, problems, {"tp": a.tp, "pp": a.pp})
        rows = judge_stored(iter_dir, truth_dir, info, problems, a.allow_vocab_padding, (EMB,))
        _, provider = vl_provider(a.hf, load_weights=False, tp=world, vocab_rows=rows, parallel_output=False)
        model = build(provider)
        load_strict(model, iter_dir, problems)
        # Bridge's own import at this very layout, in memory: at Bridge's vocab (its import refuses a padded one)
        _, ref_provider = vl_provider(a.hf, load_weights=True, tp=world, parallel_output=False)
        ref = build(ref_provider)
        got, want = tensor_state(model), tensor_state(ref)
        if rows is not None and rows != ref_provider.vocab_size and EMB in got and EMB in want:
            # padded rows (zero or not: the stored comparison judges them): Bridge's rows of the whole embedding
            got[EMB] = whole_embedding(model)[:ref_provider.vocab_size]
            want[EMB] = whole_embedding(ref)
            info["vocab_rows"] = {"stored": rows, "bridge": ref_provider.vocab_size}
        info["loaded_tensors"] = len(got)
        info["loaded_dtypes"] = sorted({str(v.dtype) for v in got.values()})
        problems += compare(got, want, "loaded vs Bridge import")
        for m in (model, ref):  # bf16 -> fp32 (exact): the logits of the very weights, computed in fp32
            unwrap(m[0]).float()
        ids, pixels = judge_inputs()
        info["seq_len"], info["image_tokens"] = ids.shape[1], int((ids == IMAGE).sum())
        hlog = hf_logits(a.hf, ids, pixels)
        info["logits_scale"] = hlog.abs().max().item()
        raw = megatron_logits(model, ids, pixels)[..., :VOCAB]  # Bridge's model as Bridge builds it
        info["logits_max_abs_diff_vs_hf_raw"] = (raw - hlog).abs().max().item()
        eps = hf_post_norm_eps(a.hf)
        info["post_norms_eps_set"] = {"from": BRIDGE_POST_NORM_EPS, "to": eps,
                                      "modules": post_norms_to(model, eps) + post_norms_to(ref, eps)}
        mlog = megatron_logits(model, ids, pixels)[..., :VOCAB]
        rlog = megatron_logits(ref, ids, pixels)[..., :VOCAB]
        diff = (mlog - hlog).abs().max().item()
        info["logits_max_abs_diff_vs_hf"] = diff
        info["logits_max_abs_diff_vs_hf_image_row"] = (mlog[0] - hlog[0]).abs().max().item()
        info["logits_max_abs_diff_vs_hf_text_row"] = (mlog[1] - hlog[1]).abs().max().item()
        info["logits_max_abs_diff_vs_bridge_model"] = (mlog - rlog).abs().max().item()
        if not diff <= a.atol:
            problems.append(f"logits differ from transformers' by {diff:.3g} (atol {a.atol})")
        info["argmax_agreement"] = (mlog.argmax(-1) == hlog.argmax(-1)).float().mean().item()
    except Exception as e:  # noqa: BLE001 - a refused load is a verdict, not a crash
        problems.append(judge_error(e))
    return finish_judge(info, problems, world, rank, serving, t0)


# ----------------------------------------------------------------------------- mutate

MUTATIONS = ("value", "proj_untransposed", "mm_norm_plus_one", "swap_vision_q_k", "lm_value", "drop_object")


def hf_tensor(hf: str, suffix: str):
    """The HF checkpoint's tensor whose name ends with ``suffix``."""
    from safetensors import safe_open

    for f in sorted(Path(hf).glob("*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            for k in sf.keys():
                if k.endswith(suffix):
                    return sf.get_tensor(k)
    raise KeyError(suffix)


def cmd_mutate(a, serving=False) -> int:
    """A copy of a checkpoint with one defect (see the module docstring), saved the way Bridge saves."""
    apply_bridge_cpu_shims()
    import torch
    from megatron.core import parallel_state

    from oracles.common import end_parallel

    rank, world = init_dist()
    try:
        bridge, provider = vl_provider(a.hf, load_weights=False, tp=world)
        model = build(provider)
        m = load_to_mutate(model, a.src)
        proj = m.multi_modal_projector
        with torch.no_grad():
            if a.kind == "value":
                proj.proj.weight[3, 5] += 1 / 16
            elif a.kind == "proj_untransposed":
                w = hf_tensor(a.hf, "mm_input_projection_weight")  # [vision hidden, text hidden]
                full = w.to(proj.proj.weight.dtype).reshape(w.shape[1], w.shape[0])  # the bytes as they lie
                rows = proj.proj.weight.shape[0]
                r = parallel_state.get_tensor_model_parallel_rank()
                proj.proj.weight.copy_(full[r * rows:(r + 1) * rows])
            elif a.kind == "mm_norm_plus_one":
                proj.mm_soft_embed_norm.weight += 1.0
            elif a.kind == "swap_vision_q_k":
                att = m.vision_tower.encoder.layers[0].self_attn
                for what in ("weight", "bias"):
                    q, k = getattr(att.q_proj, what), getattr(att.k_proj, what)
                    tmp = q.clone()
                    q.copy_(k)
                    k.copy_(tmp)
            elif a.kind == "lm_value":
                m.language_model.decoder.layers[3].self_attention.linear_qkv.weight[5, 7] += 1 / 16
        if a.kind == "drop_object":
            drop_objects(m, lambda k: k == "multi_modal_projector.mm_soft_embed_norm._extra_state")
        save_as_bridge(bridge, provider, model, a.dst, a.hf)
    finally:
        end_parallel(serving)
    if rank == 0:
        print(json.dumps({"mutated": str(a.dst), "kind": a.kind}))
    return 0


# ----------------------------------------------------------------------------- layout


def mapping_table(bridge) -> list:
    """Bridge's mapping registry: Megatron pattern, HF pattern(s), mapping class."""
    out = []
    for mp in bridge._model_bridge.mapping_registry().mappings:
        out.append({"megatron": mp.megatron_param, "hf": mp.hf_param, "type": type(mp).__name__,
                    "permute_dims": getattr(mp, "permute_dims", None)})
    return out


def cmd_layout(a, serving=False) -> int:
    apply_bridge_cpu_shims()

    from oracles.common import end_parallel

    rank, world = init_dist()
    try:
        bridge, provider = vl_provider(a.hf_dir, load_weights=True, tp=world)
        model = build(provider)
        m = unwrap(model[0])
        state = describe_state(m)
        modules = {n: type(mod).__name__ for n, mod in m.named_modules() if n.count(".layers.") == 0 or
                   ".layers.0." in n or ".layers.5." in n}
        hf_names = {k: v["shape"] for k, v in hf_file_tensors(a.hf_dir).items()}
        out = {"tp": world, "wrapper": type(model[0]).__name__, "state_dict": state,
               "sharded_state_dict": describe_sharded(m.sharded_state_dict()), "modules": modules,
               "mapping_registry": mapping_table(bridge), "hf_tensors": hf_names,
               "projector": {"patches_per_side": m.multi_modal_projector.patches_per_side,
                             "avg_pool_kernel": m.multi_modal_projector.avg_pool.kernel_size,
                             "norm_eps": m.multi_modal_projector.mm_soft_embed_norm.eps},
               "provider": {k: repr(getattr(provider, k, None))[:200] for k in (
                   "vocab_size", "make_vocab_size_divisible_by", "should_pad_vocab", "params_dtype", "bf16",
                   "window_size", "interleaved_attn_pattern", "softmax_scale", "rotary_base", "rope_scaling_factor",
                   "image_token_id", "vision_start_token_id", "vision_end_token_id", "mm_tokens_per_image",
                   "attention_backend", "share_embeddings_and_output_weights", "layernorm_epsilon")}}
        if a.ckpt:
            from oracles.common import resolve_iter_dir

            it = Path(resolve_iter_dir(a.ckpt))
            out["stored"] = stored_detail(str(it))
            out.update(describe_checkpoint(it))
    finally:
        end_parallel(serving)
    if rank == 0:
        emit_layout(out, a.out)
    return 0


# ----------------------------------------------------------------------------- main


def main(argv=None, serving=False) -> int:
    p, cmds = bridge_oracle_parser(__doc__, MUTATIONS)
    cmds["make"].add_argument("--layers", type=int, default=LAYERS)
    cmds["make"].add_argument("--seed", type=int, default=7)
    a = p.parse_args(argv)
    if a.cmd == "make":
        return cmd_make(a)
    return {"bridge-import": cmd_bridge_import, "judge": cmd_judge, "layout": cmd_layout,
            "mutate": cmd_mutate}[a.cmd](a, serving)


if __name__ == "__main__":
    run_program(main)
