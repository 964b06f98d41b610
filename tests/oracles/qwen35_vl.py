"""Oracle for Qwen3.5 with images, dense and MoE: Megatron-Bridge 0.6.2's ``Qwen35VLBridge`` /
``Qwen35VLModelProvider`` and ``Qwen35VLMoEBridge`` / ``Qwen35VLMoEModelProvider`` (both build Bridge's
``Qwen3VLModel``: the Qwen3-VL vision tower WITHOUT deepstack under ``vision_model.``, a GPT language model under
``language_model.`` whose block is megatron-core's experimental-attention-variant spec: Gated DeltaNet layers and
gated full attention with an output gate (Bridge's Qwen3VLSelfAttention, interleaved MRoPE on a partial rotary),
q/k norm, zero-centred RMSNorm; the MoE one with routed experts and a gated shared expert in every layer) on
megatron-core 0.19.2 is the Megatron side; transformers' ``Qwen3_5ForConditionalGeneration`` /
``Qwen3_5MoeForConditionalGeneration`` the HF side (which one: HF_DIR/config.json's ``architectures``). Runs in
the second runtime (.venv-mcore19, Python 3.12); imports megatron-core, Megatron-Bridge, transformers; never
dist_convert. Most of it is oracles/qwen3_vl.py's (inputs, forward, fair GELU, stored checks, layout summary) and
oracles/qwen3_next.py's (the GDN kernel stand-ins), imported.

  oracles/qwen35_vl.py make HF_DIR [--moe] [--seed S]
      a tiny random model by transformers' own classes (Qwen3_5Config: Qwen3_5TextConfig + Qwen3_5VisionConfig;
      --moe: Qwen3_5MoeConfig), fp32, save_pretrained. Text: hidden 64, 4 heads, 2 kv heads, head_dim 32,
      partial_rotary_factor 0.5 (16 rotary dims), mrope_section [2, 3, 3], interleaved; 4 layers [linear, linear,
      linear, full] (at PP 2 each stage has a GDN layer, the second the full-attention one); GDN 2 key heads, 4
      value heads, key/value head dim 16, conv kernel 4; vocab 300, untied; dense ffn 128; --moe: 4 experts of 48,
      top-2, shared expert 72 with its sigmoid gate. Vision: depth 2, hidden 32, 2 heads, ffn 64, patch 4,
      temporal patch 2, merge 2, out_hidden 64, 36 position embeddings, gelu_pytorch_tanh; image / video / vision
      start / end tokens 290..293. Every tensor random, seeded per name: zero-centred text norms (x*(1+w)) w =
      +-[0.1, 0.5]; the GDN gated norm (plain x*w) in [0.5, 2]; A = exp(A_log) in [0.5, 4]; dt_bias randn; vision
      norm weights in [0.5, 1.5] never 1, biases nonzero; fused experts randn/sqrt(fan-in), router 2*randn/sqrt(H).
      A 300-token WordLevel tokenizer.
  oracles/qwen35_vl.py bridge-import HF_DIR OUT_DIR [--pp P] [--ep E]
      Bridge's own import and save_megatron_model: torch_dist at PP P, EP E (MoE), TP = world / (P * E).
  oracles/qwen35_vl.py judge MEGATRON_DIR --truth BRIDGE_DIR --hf HF_DIR [--tp N] [--pp N] [--ep E]
      [--expect-ep E] [--atol 1e-4] [--allow-vocab-padding]
      as oracles/qwen3_vl.py's judge: Bridge's model at TP = world / E, PP 1 (MoE: EP E), MEGATRON_DIR loaded
      strictly (dist_checkpointing.load RAISE_ALL, TE's check of each _extra_state, load_state_dict); loaded
      tensors == Bridge's in-memory import at this layout, bit for bit; stored tensors == BRIDGE_DIR's (global,
      bit for bit) with the same _extra_state objects; recorded TP / PP (/ EP) == the flags; logits WITH IMAGES
      (25 tokens, two images of grids [1, 4, 4] and [1, 4, 6]) vs transformers' model (eager, fp32; MoE: the eager
      expert loop, ``hf_router`` as qwen3_vl's) within --atol after making Bridge's merger GELU exact
      (``logits_max_abs_diff_vs_hf_raw``: Bridge's tanh GELU merger as built; ``logits_max_abs_diff_vs_hf``: the
      fair one). One JSON line (rank 0); exit 1 on any problem.
  oracles/qwen35_vl.py mutate SRC DST --hf HF_DIR --kind KIND
      SRC with one defect, saved by Bridge at TP = world size (the judge must fail on DST). value: vision layer 1
      linear_qkv.weight[5, 7] += 1e-3; swap_qkv_heads: vision layer 0's q and k rows exchanged in every head
      (weight and bias); pos_embed_transpose: the 6 x 6 position grid transposed; lm_value: language layer 3 (full
      attention) linear_qkv.weight[3, 11] += 1e-3; swap_q_gate: layer 3's q and output-gate rows exchanged in every
      query group; gdn_value: layer 2 in_proj z row += 1e-3; swap_b_a: layer 0 in_proj beta / alpha sections
      exchanged; swap_z_v: layer 1 in_proj v / z sections exchanged; out_norm_plus_one: layer 0's GDN out_norm
      stored as HF's w (the -1 forgotten); drop_object: no vision merger.linear_fc2._extra_state. MoE only:
      expert_swap_fc1 (layer 1 experts 1 and 2), router_swap (layer 0 experts 0 and 1), shared_gate_value (layer 2
      mlp.shared_experts.gate_weight[0, 5] += 1e-3).
  oracles/qwen35_vl.py layout HF_DIR [--ckpt DIR] [--out JSON] [--ep E]
      as qwen3_vl's: per rank state_dict / sharded_state_dict (the GDN's ShardedTensorFactory pieces under the keys
      they store: ``in_proj.weight.query`` ..), the module classes, Bridge's mapping table, the provider's and
      vision config's fields, ``summary`` (every torch_dist key with global shape, stacking and split axes, each
      rank's pieces; every ShardedObject and its writer; with --ckpt whether the checkpoint holds exactly these),
      and with --ckpt the stored keys, common state and run_config.yaml's model section.

What Bridge writes (layout --ckpt; run_config.yaml ``_target_`` Qwen35VL(MoE)ModelProvider, the HF vision config
as ``vision_config`` (a Qwen3_5(Moe)VisionConfig), no text config (hf_text_config is no dataclass field), token ids
290..293 as image/video/vision_start/vision_end_token_id, mrope_section [2, 3, 3], rotary_percent 0.5,
transformer_layer_spec get_transformer_block_with_experimental_attention_variant_spec, linear_attention_freq
[1, 1, 1, 0]). hetereogenous_dist_checkpoint: language keys per layer (``language_model.decoder.layers.<l>.``..),
the vision tower's stacked on a layer axis (``vision_model.decoder.layers.self_attention.linear_qkv.weight``
[2, 96, 32]). A GDN layer stores ``self_attention.in_proj.weight.{query,key,value,z,beta,alpha}`` ([32|32|64|64|4|4,
64], each its own TP-split key: megatron-core's _split_tensor_factory), ``conv1d.weight.{query,key,value}``
([32|32|64, 1, 4]), ``in_proj.layer_norm_weight``, ``A_log``, ``dt_bias`` (TP axis 0), ``out_norm.weight`` [16]
(zero-centred: HF w - 1), ``out_proj.weight``; objects in_proj / out_norm / out_proj ``._extra_state/shard_0_1``.
No deepstack key (deepstack_visual_indexes []). MoE: transformers 5.12.1 saves qwen3_5_moe experts per expert
(``mlp.experts.<i>.{gate,up,down}_proj.weight``; Bridge maps them with GatedMLPMapping / AutoMapping); stored
``language_model.decoder.layers.<l>.mlp.experts.experts.linear_fc{1,2}.weight`` [E, 2F, H] / [E, H, F] (expert
axis 0), ``mlp.router.weight``, ``mlp.shared_experts.{linear_fc1,linear_fc2,gate_weight}``, ``pre_mlp_layernorm``.

The CPU stand-ins (no TE, no fla, no causal_conv1d here). Bridge builds Qwen3.5-VL only from TE modules:
  * vision tower and merger: Qwen3VLModel.__init__ (modelling_qwen3_vl/model.py) builds them exactly as for
    Qwen3-VL: oracles/qwen3_vl.py's cpu_build_patches (te_vl's leaves; each swapped slot asserted to hold the
    expected TE class; restored afterwards), which also puts te_vl's CPU TESpecProvider in gpt_layer_specs (the
    full-attention layers' spec: get_gpt_layer_with_transformer_engine_spec) and transformer_block.LayerNormImpl;
  * the language block: megatron-core's experimental_attention_variant_module_specs._get_backend_spec_provider
    (TESpecProvider; it asserts transformer_impl "transformer_engine") -> te_vl.cpu_backend for the build only:
    GDN in_proj = TELayerNormColumnParallelLinear stand-in (input norm fused), out_norm = TENorm's RMSNorm stand-in,
    out_proj = TERowParallelLinear stand-in; dense MLP fused-norm linear_fc1 / row linear_fc2; MoE: megatron-core's
    TEGroupedMLP over te_vl's grouped linears (Bridge's moe_grouped_gemm True), shared expert's TEColumn/Row
    stand-ins, a separate pre_mlp_layernorm (TENorm); the block's final layernorm (TENorm);
  * the GDN kernels (oracles/qwen3_next.py's apply_shims, the same math in plain torch, everything else
    megatron-core's own code): fla's chunk_gated_delta_rule -> megatron-core's own torch_chunk_gated_delta_rule
    (the kernel call alone), fla's l2norm, fla's causal_conv1d (silu of a depthwise F.conv1d), HAVE_FLA True,
    @jit_fuser off;
  * MoE (as qwen3_vl's, Bridge's values put back before every save so run_config.yaml records them):
    moe_token_dispatcher_type alltoall -> allgather, moe_permute_fusion -> False, sequence_parallel -> False.
No stand-in changes a parameter, a name, a shape, a checkpoint key or a replica id.
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

from oracles import qwen3_vl as q3vl  # noqa: E402
from oracles import te_vl  # noqa: E402
from oracles.common import (  # noqa: E402
    bridge_import,
    bridge_oracle_parser,
    bridge_provider,
    check_recorded,
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
    make_on_rank0,
    object_replicas,
    run_program,
    save_word_tokenizer,
    size_vocab,
    stored_detail,
    stored_parallel,
    unwrap,
)
from oracles.qwen3_next import apply_shims  # noqa: E402
from oracles.qwen3_vl import (  # noqa: E402
    EMB,
    GRIDS,
    IMAGE,
    MOE_CPU_SWITCHES,
    OUT,
    VEND,
    VIDEO,
    VOCAB,
    VSTART,
    exact_gelu_mergers,
    judge_inputs,
    mapping_table,
    megatron_logits,
    save_as_bridge,
    stored_ep,
    stored_summary,
)
from oracles.te_cpu import against_bridge_import, load_to_mutate  # noqa: E402

TEXT = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 128,
        "rms_norm_eps": 1e-6, "hidden_act": "silu", "attention_bias": False, "pad_token_id": 0, "bos_token_id": 2,
        "eos_token_id": 1, "tie_word_embeddings": False, "partial_rotary_factor": 0.5,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 50000.0, "partial_rotary_factor": 0.5,
                            "mrope_section": [2, 3, 3], "mrope_interleaved": True}}
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
       "shared_expert_intermediate_size": 72}
VISION = {"depth": 2, "hidden_size": 32, "hidden_act": "gelu_pytorch_tanh", "intermediate_size": 64, "num_heads": 2,
          "in_channels": 3, "patch_size": 4, "spatial_merge_size": 2, "temporal_patch_size": 2,
          "out_hidden_size": 64, "num_position_embeddings": 36}
DENSE_ARCH, MOE_ARCH = "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration"
MUTATIONS = ("value", "swap_qkv_heads", "pos_embed_transpose", "lm_value", "swap_q_gate", "gdn_value", "swap_b_a",
             "swap_z_v", "out_norm_plus_one", "drop_object")
MOE_MUTATIONS = ("expert_swap_fc1", "router_swap", "shared_gate_value")
# qwen3_vl.judge_inputs builds its pixel values from its own VISION: the same patch geometry as here
assert all(q3vl.VISION[k] == VISION[k] for k in ("in_channels", "patch_size", "temporal_patch_size",
                                                   "spatial_merge_size"))


def hf_arch(hf_dir: str) -> str:
    archs = json.loads((Path(hf_dir) / "config.json").read_text()).get("architectures") or []
    for arch in (MOE_ARCH, DENSE_ARCH):
        if arch in archs:
            return arch
    raise SystemExit(f"{hf_dir}: architectures {archs}: neither {DENSE_ARCH} nor {MOE_ARCH}")


def is_moe(hf_dir: str) -> bool:
    return hf_arch(hf_dir) == MOE_ARCH


# ----------------------------------------------------------------------------- the model on the CPU


@contextlib.contextmanager
def cpu_build_patches(moe: bool):
    """qwen3_vl's (vision tower, mergers, GPT layer spec backend, final layernorm) plus the experimental-attention
    block spec's backend (GDN, full attention, MLP / MoE of the language layers) -> te_vl's CPU backend."""
    from megatron.core.models.gpt import experimental_attention_variant_module_specs as eav

    backend = te_vl.cpu_backend("Qwen3.5-VL", experts=moe)
    saved = eav._get_backend_spec_provider
    eav._get_backend_spec_provider = lambda config: backend
    try:
        with q3vl.cpu_build_patches():
            yield
    finally:
        eav._get_backend_spec_provider = saved


def vl_provider(hf: str, load_weights: bool, tp: int, pp: int = 1, vocab_rows: int | None = None, ep: int = 1):
    """Bridge's Qwen35VL(MoE)ModelProvider for ``hf`` on the CPU (MoE: EP ``ep``, MOE_CPU_SWITCHES with Bridge's
    values kept in qwen3_vl._BRIDGE_SETTINGS for save_as_bridge)."""
    bridge, provider = bridge_provider(hf, load_weights)
    moe = is_moe(hf)
    want = "Qwen35VLMoEModelProvider" if moe else "Qwen35VLModelProvider"
    assert type(provider).__name__ == want, (type(provider).__name__, want)
    assert ep == 1 or moe, "--ep needs the MoE model"
    provider.tensor_model_parallel_size, provider.pipeline_model_parallel_size = tp, pp
    size_vocab(provider, vocab_rows)
    saved = {}
    if moe:
        assert provider.moe_grouped_gemm and not provider.use_te_activation_func
        provider.expert_model_parallel_size = ep
        saved = {k: getattr(provider, k) for k in ("moe_token_dispatcher_type", "moe_permute_fusion")}
        for k in saved:
            setattr(provider, k, MOE_CPU_SWITCHES[k])
    provider.finalize()
    if moe:
        saved["sequence_parallel"] = provider.sequence_parallel
        provider.sequence_parallel = MOE_CPU_SWITCHES["sequence_parallel"]
    q3vl._BRIDGE_SETTINGS[id(provider)] = saved
    return bridge, provider


def build(provider):
    """The model chunks with the CPU stand-ins; eval mode."""
    with cpu_build_patches(bool(getattr(provider, "num_moe_experts", None))):
        model = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)
    for m in model:
        m.eval()
    return model


# ----------------------------------------------------------------------------- make


def hf_config(moe: bool):
    import transformers

    cls = transformers.Qwen3_5MoeConfig if moe else transformers.Qwen3_5Config
    text = {**TEXT, **MOE} if moe else dict(TEXT)
    return cls(text_config=text, vision_config=dict(VISION), image_token_id=IMAGE, video_token_id=VIDEO,
               vision_start_token_id=VSTART, vision_end_token_id=VEND, tie_word_embeddings=False, dtype="float32",
               architectures=[MOE_ARCH if moe else DENSE_ARCH])


def make(a) -> int:
    import torch
    import transformers

    t0 = time.time()
    out = Path(a.hf_dir)
    config = hf_config(a.moe)
    torch.manual_seed(a.seed)
    model = getattr(transformers, MOE_ARCH if a.moe else DENSE_ARCH)(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            g = torch.Generator().manual_seed(zlib.crc32(f"{a.seed}|{name}".encode()))
            if name.endswith("linear_attn.norm.weight"):  # the GDN gated norm, plain x*w: [0.5, 2]
                p.copy_(0.5 + 1.5 * torch.rand(p.shape, generator=g))
            elif name.endswith("A_log"):  # decay rate A = exp(A_log) in [0.5, 4]
                p.copy_(torch.log(0.5 + 3.5 * torch.rand(p.shape, generator=g)))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif "visual" not in name and "norm" in name:  # zero-centred x*(1+w): |w| in [0.1, 0.5], either sign
                mag = 0.1 + 0.4 * torch.rand(p.shape, generator=g)
                p.copy_(torch.where(torch.rand(p.shape, generator=g) < 0.5, -mag, mag))
            elif "norm" in name and name.endswith("weight"):  # vision LayerNorms: [0.5, 1.5], never exactly 1
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
                p.masked_fill_(p == 1.0, 1.25)
            elif name.endswith("bias"):  # vision norm and linear biases: nonzero
                mag = 0.05 + 0.2 * torch.rand(p.shape, generator=g)
                p.copy_(torch.where(torch.rand(p.shape, generator=g) < 0.5, -mag, mag))
            elif name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):  # [E, 2F, H] / [E, H, F]
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
            elif name.endswith(".mlp.gate.weight"):  # the router [E, H]: decisive top-k
                p.copy_(2.0 * torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
            elif "embed_tokens" in name or name.endswith("pos_embed.weight"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif p.dim() >= 2:  # linears [out, in], conv1d [C, 1, K], the Conv3d patch embedding
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p[0].numel()))
            else:
                raise SystemExit(f"make: no rule for {name} {tuple(p.shape)}")
    model.save_pretrained(out)
    save_word_tokenizer(out, VOCAB)
    saved = hf_file_tensors(out)
    tc = config.text_config
    print(json.dumps({"made": str(out), "architecture": config.architectures[0], "layer_types": tc.layer_types,
                      "rope_parameters": tc.rope_parameters, "files": sorted(p.name for p in out.iterdir()),
                      "saved": saved, "seconds": round(time.time() - t0, 2)}))
    return 0


# ----------------------------------------------------------------------------- bridge-import


def cmd_bridge_import(a, serving=False) -> int:
    apply_shims()

    def save(tp):
        bridge, provider = vl_provider(a.hf_dir, load_weights=True, tp=tp, pp=a.pp, ep=a.ep)
        save_as_bridge(bridge, build(provider), a.out_dir, a.hf_dir, provider)
        return {"model": hf_arch(a.hf_dir)}

    return bridge_import(a, serving, save, a.ep)


# ----------------------------------------------------------------------------- judge


def hf_logits(hf: str, inputs, router: dict | None = None):
    """transformers' logits (eager attention, the torch GDN path; MoE: the eager expert loop and, into ``router``,
    per layer the tokens each expert gets and the smallest gap between the k-th and (k+1)-th routing probability)."""
    import torch
    import transformers

    moe = is_moe(hf)
    cls = getattr(transformers, hf_arch(hf))
    kw = {"experts_implementation": "eager"} if moe else {}
    model, info = cls.from_pretrained(hf, dtype=torch.float32, attn_implementation="eager", output_loading_info=True,
                                      **kw)
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if bad:
        raise RuntimeError(f"transformers' load of {hf} is not clean: {bad}")
    ids, pv, thw, mm = inputs
    with torch.no_grad():
        out = model.eval()(input_ids=ids, pixel_values=pv, image_grid_thw=thw, mm_token_type_ids=mm, use_cache=False,
                           **({"output_router_logits": True} if moe else {}))
    if moe and router is not None:
        k = model.config.text_config.num_experts_per_tok
        counts, margins = [], []
        for logits in out.router_logits:
            probs = torch.softmax(logits.float(), dim=-1).sort(dim=-1, descending=True).values
            counts.append(torch.bincount(logits.topk(k, dim=-1).indices.flatten(), minlength=logits.shape[-1]).tolist())
            margins.append((probs[:, k - 1] - probs[:, k]).min().item())
        router.update(tokens_per_expert=counts, min_topk_prob_gap=min(margins))
    return out.logits.float()


def cmd_judge(a, serving=False) -> int:
    t0 = time.time()
    apply_shims()
    from oracles.common import is_legacy, resolve_iter_dir

    iter_dir, truth_dir = Path(resolve_iter_dir(a.megatron_dir)), Path(resolve_iter_dir(a.truth))
    moe = is_moe(a.hf)
    if a.ep > 1 and not moe:
        raise SystemExit("judge --ep: the MoE model only")
    rank, world = init_dist(1, a.ep)
    tp = world // a.ep
    problems: list[str] = []
    info: dict = {"judged": str(iter_dir), "truth": str(truth_dir), "model": hf_arch(a.hf), "load_tp": tp}
    if moe:
        info["load_ep"] = a.ep
    try:
        if is_legacy(iter_dir):
            raise RuntimeError("a legacy (mp_rank_*) checkpoint: this judge reads torch_dist only")
        info["stored_tp"], info["stored_pp"] = stored_parallel(iter_dir)
        wants = {"tp": a.tp, "pp": a.pp}
        if moe:
            info["stored_ep"] = stored_ep(iter_dir)
            wants["ep"] = a.expect_ep
        check_recorded(info, problems, wants)
        rows = judge_stored(iter_dir, truth_dir, info, problems, a.allow_vocab_padding, (EMB, OUT))
        model, ref, _ = against_bridge_import(
            lambda load: vl_provider(a.hf, load_weights=load, tp=tp, vocab_rows=rows, ep=a.ep), build, iter_dir,
            info, problems)
        inputs = judge_inputs()
        info["input"] = {"tokens": inputs[0].shape[1], "image_grid_thw": GRIDS,
                         "pixel_values": list(inputs[1].shape), "image_tokens": int(inputs[3].sum())}
        router: dict = {}
        hlog = hf_logits(a.hf, inputs, router)
        if moe:
            info["hf_router"] = router
        raw = megatron_logits(model, inputs)[..., :VOCAB]
        info["logits_max_abs_diff_vs_hf_raw"] = (raw - hlog).abs().max().item()
        info["exact_gelu_modules"] = exact_gelu_mergers(model)
        exact_gelu_mergers(ref)
        judge_logits(info, problems, megatron_logits(model, inputs)[..., :VOCAB],
                     megatron_logits(ref, inputs)[..., :VOCAB], hlog, a.atol, "; merger GELU made exact")
    except Exception as e:  # noqa: BLE001 - a refused load is a verdict, not a crash
        problems.append(judge_error(e))
    return finish_judge(info, problems, world, rank, serving, t0)


# ----------------------------------------------------------------------------- mutate


def _swap_rows(w, a0, b0, n):
    x, y = w[a0:a0 + n].clone(), w[b0:b0 + n].clone()
    w[a0:a0 + n], w[b0:b0 + n] = y, x


def _in_proj(gdn):
    """A GDN's in_proj weight and its sections by name: {name: (first row, rows)} (this rank's rows)."""
    secs, names = list(gdn.in_proj_split_sections), list(gdn.in_proj_split_names)
    return gdn.in_proj.weight, {n: (sum(secs[:i]), secs[i]) for i, n in enumerate(names)}


def cmd_mutate(a, serving=False) -> int:
    """A copy of a checkpoint with one defect, saved the way Bridge saves (see the module docstring)."""
    apply_shims()
    import torch

    from oracles.common import end_parallel

    if a.kind in MOE_MUTATIONS and not is_moe(a.hf):
        raise SystemExit(f"mutate --kind {a.kind}: the MoE model only")
    rank, world = init_dist()
    try:
        bridge, provider = vl_provider(a.hf, load_weights=False, tp=world)
        model = build(provider)
        m = load_to_mutate(model, a.src)
        vis, lm = m.vision_model, m.language_model.decoder.layers
        with torch.no_grad():
            if a.kind == "value":
                vis.decoder.layers[1].self_attention.linear_qkv.weight[5, 7] += 1e-3
            elif a.kind == "swap_qkv_heads":  # rows per head: [q, k, v] (num_query_groups = num_heads)
                qkv = vis.decoder.layers[0].self_attention.linear_qkv
                d = vis.config.kv_channels
                for t in (qkv.weight, qkv.bias):
                    g = t.view(-1, 3 * d, *t.shape[1:])
                    q, k = g[:, :d].clone(), g[:, d:2 * d].clone()
                    g[:, :d], g[:, d:2 * d] = k, q
            elif a.kind == "pos_embed_transpose":
                w = vis.pos_embed.weight
                side = int(math.isqrt(w.shape[0]))
                w.copy_(w.view(side, side, -1).transpose(0, 1).reshape(w.shape).clone())
            elif a.kind == "lm_value":
                lm[3].self_attention.linear_qkv.weight[3, 11] += 1e-3
            elif a.kind == "swap_q_gate":  # per query group: [q (npg heads), gate (npg heads), k, v]
                w = lm[3].self_attention.linear_qkv.weight
                hd, npg = provider.kv_channels, provider.num_attention_heads // provider.num_query_groups
                for blk in w.view(-1, (2 * npg + 2) * hd, w.shape[-1]):
                    _swap_rows(blk, 0, npg * hd, npg * hd)
            elif a.kind in ("gdn_value", "swap_b_a", "swap_z_v"):
                w, sec = _in_proj(lm[{"gdn_value": 2, "swap_b_a": 0, "swap_z_v": 1}[a.kind]].self_attention)
                if a.kind == "gdn_value":
                    w[sec["z"][0] + 1, 3] += 1e-3
                else:
                    x, y = ("beta", "alpha") if a.kind == "swap_b_a" else ("value", "z")
                    assert sec[x][1] == sec[y][1]
                    _swap_rows(w, sec[x][0], sec[y][0], sec[x][1])
            elif a.kind == "out_norm_plus_one":
                lm[0].self_attention.out_norm.weight += 1.0
            elif a.kind == "expert_swap_fc1":  # layer 1: experts 1 and 2 exchange linear_fc1 (EP 1: all local)
                fc1 = lm[1].mlp.experts.linear_fc1
                tmp = fc1.weight1.clone()
                fc1.weight1.copy_(fc1.weight2)
                fc1.weight2.copy_(tmp)
            elif a.kind == "router_swap":
                r = lm[0].mlp.router.weight
                r.copy_(r[[1, 0, *range(2, r.shape[0])]].clone())
            elif a.kind == "shared_gate_value":
                lm[2].mlp.shared_experts.gate_weight[0, 5] += 1e-3
        if a.kind == "drop_object":
            key = "vision_model.merger.linear_fc2._extra_state"
            assert key in m.sharded_state_dict(), key
            drop_objects(m, lambda k: k == key)
        save_as_bridge(bridge, model, a.dst, a.hf, provider)
    finally:
        end_parallel(serving)
    if rank == 0:
        print(json.dumps({"mutated": str(a.dst), "kind": a.kind}))
    return 0


# ----------------------------------------------------------------------------- layout


def described(m) -> dict:
    """describe_sharded of ``m``'s sharded_state_dict with every ShardedTensorFactory replaced by the ShardedTensors
    it builds, under the keys they are stored at (GDN in_proj.weight.<section>, conv1d.weight.<q|k|v>; the SwiGLU
    linear_fc1 halves under its own key), so qwen3_vl's stored_summary sees the stored keys; objects with their
    replica ids."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    flat = {}
    for k, v in m.sharded_state_dict().items():
        if isinstance(v, ShardedTensorFactory):
            built = v.build_fn(v.key, v.data, v.replica_id, getattr(v, "flattened_range", None))
            parts = built.values() if isinstance(built, dict) else built if isinstance(built, list) else [built]
            flat.update({f"{k}#{i}": p for i, p in enumerate(parts)})
        else:
            flat[k] = v
    out = describe_sharded(flat)
    return object_replicas(m, out)


def per_layer_axes(summary: dict) -> dict:
    """qwen3_vl's stored_summary takes every key under ``.layers.`` as stacked on a layer axis; the language model's
    keys here are per layer (hetereogenous_dist_checkpoint: ``language_model.decoder.layers.<l>.``..), their only
    stacking axis the experts' (axis 0). Those entries' stack_axes and experts_by_rank, corrected."""
    import re

    for key, t in summary["tensors"].items():
        if re.search(r"\.layers\.\d+\.", key):
            assert t["prepend_axes"] == (1 if ".experts." in key else 0), (key, t["prepend_axes"])
            t["stack_axes"] = {"expert": 0} if t["prepend_axes"] else {}
            t.pop("experts_by_rank", None)
            if t["prepend_axes"]:
                t["experts_by_rank"] = {r: sorted({p["offset"][0] for p in ps}) for r, ps in t["pieces"].items()}
    return summary


def cmd_layout(a, serving=False) -> int:
    apply_shims()
    import torch.distributed as dist
    from megatron.core import parallel_state

    from oracles.common import end_parallel, resolve_iter_dir

    moe = is_moe(a.hf_dir)
    rank, world = init_dist(1, a.ep)
    tp = world // a.ep
    try:
        bridge, provider = vl_provider(a.hf_dir, load_weights=True, tp=tp, ep=a.ep)
        m = unwrap(build(provider)[0])
        mine = {"tp_rank": parallel_state.get_tensor_model_parallel_rank(), "state_dict": describe_state(m),
                "sharded_state_dict": described(m)}
        if moe:
            mine["ep_rank"] = parallel_state.get_expert_model_parallel_rank()
        every = [None] * world
        dist.all_gather_object(every, mine)
        gdn = m.language_model.decoder.layers[0].self_attention
        out = {"model": hf_arch(a.hf_dir), "tp": tp, "pp": 1, **({"ep": a.ep} if moe else {}), "ranks": every,
               "modules": {n: type(mod).__name__ for n, mod in m.named_modules()
                           if not any(f".layers.{i}." in n + "." for i in range(1, 3))},
               "mappings": mapping_table(bridge, m),
               "gdn_in_proj_sections": dict(zip(gdn.in_proj_split_names, gdn.in_proj_split_sections, strict=True)),
               "vision_config": {k: repr(getattr(m.vision_model.config, k, None)) for k in (
                   "num_layers", "hidden_size", "num_attention_heads", "kv_channels", "ffn_hidden_size",
                   "normalization", "layernorm_epsilon", "add_bias_linear", "add_qkv_bias", "activation_func",
                   "deepstack_visual_indexes", "spatial_merge_size", "patch_size", "temporal_patch_size",
                   "num_position_embeddings", "out_hidden_size")},
               "language_config": {k: repr(getattr(provider, k, None))[:200] for k in (
                   "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
                   "ffn_hidden_size", "layernorm_zero_centered_gamma", "attention_output_gate",
                   "experimental_attention_variant", "linear_attention_freq", "linear_conv_kernel_dim",
                   "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads",
                   "qk_layernorm", "position_embedding_type", "mrope_section", "rotary_percent", "rotary_base",
                   "vocab_size", "should_pad_vocab", "share_embeddings_and_output_weights", "image_token_id",
                   "video_token_id", "vision_start_token_id", "vision_end_token_id", "hetereogenous_dist_checkpoint",
                   "mtp_num_layers", "sequence_parallel", "num_moe_experts", "moe_ffn_hidden_size", "moe_router_topk",
                   "moe_shared_expert_intermediate_size", "moe_shared_expert_gate", "moe_grouped_gemm",
                   "moe_token_dispatcher_type", "moe_permute_fusion", "moe_router_pre_softmax",
                   "moe_router_score_function", "moe_layer_freq", "expert_model_parallel_size")}}
        if moe:
            out["cpu_switches"] = {"bridge": q3vl._BRIDGE_SETTINGS.get(id(provider)), "cpu_build": MOE_CPU_SWITCHES}
        if a.ckpt:
            it = Path(resolve_iter_dir(a.ckpt))
            out["stored"] = dict(sorted(stored_detail(str(it)).items()))
            out.update(describe_checkpoint(it))
        out["summary"] = per_layer_axes(stored_summary(every, out.get("stored")))
    finally:
        end_parallel(serving)
    if rank == 0:
        emit_layout(out, a.out)
    return 0


# ----------------------------------------------------------------------------- main


def main(argv=None, serving=False) -> int:
    p, cmds = bridge_oracle_parser(__doc__, MUTATIONS + MOE_MUTATIONS,
                                   pp_help="pipeline stages (TP = world size / (PP * EP))")
    cmds["make"].add_argument("--seed", type=int, default=7)
    cmds["make"].add_argument("--moe", action="store_true", help="Qwen3_5MoeForConditionalGeneration instead")
    cmds["bridge-import"].add_argument("--ep", type=int, default=1, help="expert parallel (MoE model only)")
    cmds["judge"].add_argument("--ep", type=int, default=1, help="MoE: load at expert parallel N (TP = world size / N)")
    cmds["judge"].add_argument("--expect-ep", type=int, default=None, help="MoE: the EP the checkpoint must record")
    cmds["layout"].add_argument("--ep", type=int, default=1, help="MoE: expert parallel N (TP = world size / N)")
    a = p.parse_args(argv)
    if a.cmd == "make":
        return make_on_rank0(make, a)
    return {"bridge-import": cmd_bridge_import, "judge": cmd_judge, "layout": cmd_layout,
            "mutate": cmd_mutate}[a.cmd](a, serving)


if __name__ == "__main__":
    run_program(main)
