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
stand for (Bridge's AutoMapping picks a weight's TP split by its module's class name). The stand-ins, that backend and
the patch are oracles/te_vl.py's, shared with oracles/qwen3_vl.py (whose docstring describes every stand-in, also what
this model does not use: LayerNorm, TEColumnParallelLinear, packed THD attention, grouped experts); here the backend
raises for TELinear, TEColumnParallelLinear and the grouped experts. What Qwen2.5-VL's language model uses of them:
  * CpuTELayerNormColumnParallelLinear: RMSNorm ``layer_norm_weight`` (replicated, config.layernorm_epsilon) fused
    before a column-parallel linear: ``weight`` and, for linear_qkv (add_qkv_bias), ``bias``, both TP axis 0; TE's
    return_bias = skip_bias_add and bias (linear_qkv: skip_bias_add False, the bias is added); _extra_state an empty
    uint8 tensor (TE's module without FP8)
  * CpuTERowParallelLinear (linear_proj, linear_fc2): ``weight`` TP axis 1, no bias (add_bias_linear False)
  * CpuTEDotProductAttention: megatron-core's local DotProductAttention (causal, fp32 softmax; no sharded state, as
    TEDotProductAttention.sharded_state_dict in 0.19.2 with softmax_type vanilla; legacy _extra_state an empty uint8
    tensor); the language model's input is unpacked, so the stand-in's packed (THD) path is not taken
  * TENorm (only the final layernorm here; the per-layer norms are fused into the linears): te_vl's TENorm stand-in,
    which for RMSNorm builds oracles.te_cpu's RMSNorm stand-in (te.pytorch.RMSNorm, an op in TE 2.x: ``weight``,
    _extra_state the pickled empty dict, 5 bytes)
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

import contextlib
import json
import math
import sys
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the oracles package, helpers

from oracles import te_cpu, te_vl  # noqa: E402
from oracles.common import (  # noqa: E402
    bridge_import,
    bridge_oracle_parser,
    bridge_provider,
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
    judge_logits,
    judge_stored,
    load_hf_tensors,
    make_on_rank0,
    matching_rows,
    object_replicas,
    run_program,
    save_word_tokenizer,
    size_vocab,
    stored_detail,
    stored_parallel,
    tensor_state,
    tp_gathered,
    unwrap,
)
from oracles.te_cpu import apply_bridge_cpu_shims, load_strict, load_to_mutate  # noqa: E402

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


def check_spec(model) -> None:
    """Every language layer holds the TE classes (stand-ins) in the slots the TE spec fills: a changed Bridge or
    megatron-core spec fails here."""
    c = te_vl.cpu_classes()
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
        assert type(lm.decoder.final_layernorm) is te_cpu.cpu_classes()["norm"], lm.decoder.final_layernorm


# ----------------------------------------------------------------------------- the model


def vl_provider(hf: str, load_weights: bool, tp: int, pp: int = 1, vocab_rows: int | None = None):
    """Bridge's Qwen25VLModelProvider for ``hf`` on the CPU; ``vocab_rows`` sizes the embedding like a stored one."""
    from oracles.te_cpu import CPU_KERNELS

    bridge, provider = bridge_provider(hf, load_weights)
    for k, v in CPU_KERNELS.items():  # fused kernels off (their weights and names are the same)
        if hasattr(provider, k):
            setattr(provider, k, v)
    provider.tensor_model_parallel_size, provider.pipeline_model_parallel_size = tp, pp
    size_vocab(provider, vocab_rows)
    provider.finalize()
    return bridge, provider


def build(provider):
    """The model chunks, built with the CPU stand-ins in place of TE's modules; eval mode."""
    with te_vl.gpt_build_patches(te_vl.cpu_backend("Qwen2.5-VL", column_linear=False, experts=False)):
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


def make(a) -> int:
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

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
    save_word_tokenizer(out, VOCAB)
    print(json.dumps({"made": str(out), "files": sorted(p.name for p in out.iterdir()), "saved": hf_file_tensors(out),
                      "seconds": round(time.time() - t0, 2)}))
    return 0


# ----------------------------------------------------------------------------- bridge-import


def cmd_bridge_import(a, serving=False) -> int:
    apply_bridge_cpu_shims()

    def save(tp):
        bridge, provider = vl_provider(a.hf_dir, load_weights=True, tp=tp, pp=a.pp)
        save_as_bridge(bridge, build(provider), a.out_dir, a.hf_dir)

    return bridge_import(a, serving, save)


# ----------------------------------------------------------------------------- judge


def vocab_full(model) -> dict:
    """The language model's embedding and output weights gathered over TP (all vocab rows)."""
    sd = tensor_state(model)
    return {k: tp_gathered(sd[k]) for k in (EMB, OUT)}


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
            raise RuntimeError("a legacy (mp_rank_*) checkpoint: this judge reads torch_dist only")
        info["stored_tp"], info["stored_pp"] = stored_parallel(iter_dir)
        check_recorded(info, problems, {"tp": a.tp, "pp": a.pp})
        rows = judge_stored(iter_dir, truth_dir, info, problems, a.allow_vocab_padding, (EMB, OUT))
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
        judge_logits(info, problems, megatron_logits(model, inputs)[..., :VOCAB],
                     megatron_logits(ref, inputs)[..., :VOCAB], hlog, a.atol, "; HF mrope_section")
    except Exception as e:  # noqa: BLE001 - a refused load is a verdict, not a crash
        problems.append(judge_error(e))
    return finish_judge(info, problems, world, rank, serving, t0)


# ----------------------------------------------------------------------------- mutate


def cmd_mutate(a, serving=False) -> int:
    """A copy of a checkpoint with one defect, saved the way Bridge saves (see the module docstring)."""
    apply_bridge_cpu_shims()
    import torch

    from oracles.common import end_parallel

    rank, world = init_dist()
    try:
        bridge, provider = vl_provider(a.hf, load_weights=False, tp=world)
        model = build(provider)
        m = load_to_mutate(model, a.src)
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
            drop_objects(m, lambda k: k.startswith("language_model.") and k.endswith("mlp.linear_fc2._extra_state"))
        save_as_bridge(bridge, model, a.dst, a.hf)
    finally:
        end_parallel(serving)
    if rank == 0:
        print(json.dumps({"mutated": str(a.dst), "kind": a.kind}))
    return 0


# ----------------------------------------------------------------------------- layout


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


def row_sources(m, hf: dict) -> dict:
    """For the fused language tensors of this rank: which HF rows each local row holds (layer 0 linear_qkv weight
    and bias vs q_proj/k_proj/v_proj; linear_fc1 vs gate_proj/up_proj). Rows are named like q3 (q row 3 of the HF
    tensor), k0, v15, gate7, up2."""
    lm = next(p for p in ("model.language_model.layers.0", "model.layers.0") if f"{p}.mlp.up_proj.weight" in hf)
    layer = m.language_model.decoder.layers[0]
    qkv = layer.self_attention.linear_qkv
    return {
        "hf_prefix": lm,
        "linear_qkv_weight": matching_rows(qkv.weight, [(p, hf[f"{lm}.self_attn.{p}_proj.weight"]) for p in "qkv"]),
        "linear_qkv_bias": matching_rows(qkv.bias[:, None], [(p, hf[f"{lm}.self_attn.{p}_proj.bias"][:, None])
                                                             for p in "qkv"]),
        "linear_fc1_weight": matching_rows(layer.mlp.linear_fc1.weight,
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
    import torch.distributed as dist
    from megatron.core import parallel_state

    from oracles.common import end_parallel

    rank, world = init_dist()
    try:
        bridge, provider = vl_provider(a.hf_dir, load_weights=True, tp=world)
        m = unwrap(build(provider)[0])
        hf = load_hf_tensors(a.hf_dir)
        state = describe_state(m)
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
            from oracles.common import resolve_iter_dir

            it = Path(resolve_iter_dir(a.ckpt))
            out["stored"] = dict(sorted(stored_detail(str(it)).items()))
            out.update(describe_checkpoint(it))
    finally:
        end_parallel(serving)
    if rank == 0:
        emit_layout(out, a.out)
    return 0


# ----------------------------------------------------------------------------- main


def main(argv=None, serving=False) -> int:
    p, cmds = bridge_oracle_parser(__doc__, MUTATIONS)
    cmds["make"].add_argument("--seed", type=int, default=7)
    a = p.parse_args(argv)
    if a.cmd == "make":
        return make_on_rank0(make, a)
    return {"bridge-import": cmd_bridge_import, "judge": cmd_judge, "layout": cmd_layout,
            "mutate": cmd_mutate}[a.cmd](a, serving)


if __name__ == "__main__":
    run_program(main)
