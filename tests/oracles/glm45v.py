"""Oracle for GLM-4.5V: Megatron-Bridge 0.6.2's ``GLM45VBridge`` / ``GLM45VModelProvider`` (its ``GLM45VModel``:
transformers' own GLM-4V vision tower ``Glm4vVisionModel`` kept whole as an HF module under ``visual.``, a
megatron-core GPT language model with MRoPE on a partial rotary, dense first layers then MoE layers with a sigmoid
router, an expert-score correction bias and a shared expert, under ``language_model.``) on megatron-core 0.19.2 is
the Megatron side; transformers' ``Glm4vMoeForConditionalGeneration`` is the HF side. Runs in the second runtime
(.venv-mcore19, Python 3.12); imports megatron-core, Megatron-Bridge, transformers; never dist_convert. Shared with
oracles/qwen3_vl.py (MoE switches, save, mapping table, layout summary) and oracles/qwen25_vl.py (input, MRoPE fix).

  oracles/glm45v.py make HF_DIR [--seed S]
      a tiny random Glm4vMoeForConditionalGeneration by transformers' own classes, fp32, save_pretrained. Text:
      hidden 64, 4 heads, 2 kv heads, head_dim 32, partial_rotary_factor 0.5 (16 rotary channels), rope_theta 50000,
      mrope_section [2, 3, 3], q/k/v biases, use_qk_norm False, 4 layers (not 3: Bridge refuses PP 2 on 3, "num_layers
      =3 should be divisible by config.pipeline_model_parallel_size=2"), first_k_dense_replace 1 (layer 0 a dense
      SwiGLU of 128; layers 1-3: 4 routed experts of 32, top-2, n_group = topk_group = 1, norm_topk_prob,
      routed_scaling_factor 1.5, one shared expert of 32), vocab 300, untied, no MTP (the class has no
      num_nextn_predict_layers). Token ids image 290, video 291, image start / end 292 / 293, video start / end
      294 / 295, at the top and (with head_dim, use_qk_norm) in text_config, as the releases' config.json: Bridge
      reads them all from text_config (missing ids: the releases' 151xxx). Vision: depth 2, hidden 32, 2 heads,
      attention_bias, silu, patch 4, temporal patch 2, merge 2, image_size 24 (a 6 x 6 position grid, resampled per
      image), out_hidden_size 64 (also the blocks' MLP width), intermediate_size 48 (the merger's). Tensors seeded
      per name: norm weights [0.5, 1.5] never 1, biases +-[0.05, 0.25], e_score_correction_bias +-[0.05, 0.3],
      routers 2*randn/sqrt(H); seed 5: on the judge's input every expert of every MoE layer gets 4..28 tokens and
      the bias changes 9..13 tokens' choice per layer. Experts are written per expert (mlp.experts.<e>.*_proj), as
      the releases: Bridge takes its per-expert mappings. A 300-token WordLevel tokenizer.
  oracles/glm45v.py bridge-import HF_DIR OUT_DIR [--pp P] [--ep E]
      Bridge's own import and save_megatron_model: torch_dist at PP P, EP E, TP = world / (P * E).
  oracles/glm45v.py judge MEGATRON_DIR --truth BRIDGE_DIR --hf HF_DIR [--tp N] [--pp N] [--ep E] [--expect-ep E]
      [--atol 1e-4] [--allow-vocab-padding]
      Bridge's model at TP = world / E, EP E, PP 1; MEGATRON_DIR loaded strictly (dist_checkpointing.load RAISE_ALL,
      TE's check of each _extra_state, load_state_dict); loaded tensors (expert_bias buffers too) == Bridge's
      in-memory import at this layout, bit for bit; stored tensors == BRIDGE_DIR's with the same _extra_state
      objects; TP / PP / EP recorded (Megatron-LM args, else run_config.yaml) == --tp / --pp / --expect-ep; logits
      WITH IMAGES vs transformers (eager attention, eager experts, fp32) within --atol, on qwen25_vl's input (31
      tokens, images of grids [1, 4, 8] and [1, 6, 4] between image start / end, pixel_values [56, 96]); both sides
      get mm_token_type_ids (Bridge's forward calls transformers' Glm4vModel.get_rope_index, which needs them).
      The JSON also has ``hf_router`` (per MoE layer: tokens per expert, the smallest 2nd-3rd biased score gap,
      tokens whose choice the bias changes) and ``image_embeds_max_abs_diff_vs_hf`` (the tower's merged output).
      The fair comparison. GLM45VBridge.provider_bridge never passes the HF mrope_section: the provider keeps its
      [8, 12, 12] (the release's, 64 rotary channels), which megatron-core's MultimodalRotaryEmbedding cannot split
      over 16: Bridge's model as built fails in forward (``logits_vs_hf_raw``: "split_with_sizes expects split_sizes
      to sum exactly to 16 ..."). The judge sets only the built language model's mrope_section to the HF config's
      and judges that (``logits_max_abs_diff_vs_hf`` 1.2e-5, logits up to 4.4; the tower, sdpa vs eager, 1.3e-6).
      Otherwise Bridge computes as transformers: rotary_percent 0.5, rotate-half on the first 16 channels, the same
      positions, sigmoid + expert_bias to choose, unbiased scores normalised times 1.5, the shared expert added.
      One JSON line (rank 0); exit 1 on any problem. torch_dist only.
  oracles/glm45v.py mutate SRC DST --hf HF_DIR --kind KIND
      SRC with one defect, saved by Bridge at TP = world (EP 1); the judge must fail on DST. Tower: value (blocks.1
      attn.qkv.weight[5, 7] += 1e-3), merger_gate_up (merger gate_proj / up_proj exchanged), pos_embed_transpose
      (the 6 x 6 grid, h <-> w). Language: lm_value (layer 2 linear_qkv.weight[3, 11] += 1e-3), dense_norm (layer
      0's linear_fc1.layer_norm_weight := its input norm), expert_bias_zero (layer 1's e_score_correction_bias
      lost), router_swap (layer 2 router rows 0, 1), expert_swap_fc1 (layer 1 experts 1, 2), expert_fc1_transpose
      (layer 2 expert 3's [2F, H] = [64, 64] fc1 transposed: same shape), shared_gate_up (layer 1 shared expert's
      gate / up halves), drop_object (no language layer 0 mlp.linear_fc2._extra_state).
  oracles/glm45v.py layout HF_DIR [--ckpt DIR] [--out JSON] [--ep E]
      as qwen3_vl's, at TP = world / E (per rank state / sharded state, modules, mapping table, row_sources of
      layers 0 and 1 vs the HF rows, vision keys vs HF names, provider fields, ``summary``; --ckpt: stored keys,
      common state, run_config.yaml's model section).

The layout (layout --ckpt at TP 1, TP 2, EP 2: 72 tensors, 44 objects). ``visual.`` + the HF name less ``model.``:
29 tensors (ReplicatedMapping visual.** <- model.visual.**), whole on every rank, written by rank 0, no objects.
``language_model.``: embedding.word_embeddings / output_layer [300, 64], decoder.final_layernorm, and per-layer
``decoder.layers.<global i>.*`` with no layer axis (moe_layer_freq is a list: non-homogeneous layers). Each layer:
self_attention.linear_qkv.{layer_norm_weight, weight [256, 64], bias}, linear_proj.weight; layer 0
mlp.linear_fc1.{layer_norm_weight (HF post_attention_layernorm), weight [256, 64]: gate, up}, mlp.linear_fc2;
layers 1-3 pre_mlp_layernorm (HF post_attention_layernorm), mlp.router.weight [4, 64], mlp.router.expert_bias [4],
mlp.experts.experts.linear_fc1.weight [E, 2F, H] = [4, 64, 64], linear_fc2.weight [4, 64, 32] (expert axis 0: EP
rank r writes experts 2r, 2r + 1; expert TP = TP), mlp.shared_experts.linear_fc1 [64, 64] / linear_fc2 [64, 32].
Objects: ``<key>/shard_0_1`` per TE module, the experts' ``<key>/shard_<e>_4``; none for the router or attention.
run_config.yaml's model: GLM45VModelProvider with vision_config (a Glm4vMoeVisionConfig), the token ids and the
text config only as provider fields (mrope_section Bridge's [8, 12, 12], not HF's).

The CPU stand-ins. GLM45VModelProvider.transformer_layer_spec is partial(get_gpt_decoder_block_spec,
use_transformer_engine=HAVE_TE), HAVE_TE fixed when Bridge is imported (False without TE: the local spec, other
names); the oracle makes it True (asserting Bridge's partial first), so run_config.yaml records what Bridge with TE
records. That spec asks megatron-core's TESpecProvider and gpt_layer_specs.TENorm (final layernorm): while
building, oracles/te_vl.py's CPU backend and TENorm stand-in (te_vl.gpt_build_patches plus gpt_layer_specs.TENorm;
restored after): TELayerNormColumnParallelLinear (linear_qkv, dense linear_fc1), TERowParallelLinear,
TEDotProductAttention, TENorm (RMSNorm op), TEColumnParallelLinear (shared experts' linear_fc1), the grouped experts
(as qwen3_vl's); check_spec asserts each slot. MoE settings switched for the CPU, Bridge's values back for each
save: qwen3_vl's MOE_CPU_SWITCHES (dispatcher allgather, no permute fusion, no sequence parallel) and
moe_shared_expert_overlap False (SharedExpertMLP makes a CUDA stream for it); none changes a parameter, name,
shape, key or replica id. The tower is plain torch (transformers' sdpa). Other shims: te_cpu.apply_bridge_cpu_shims.
"""
from __future__ import annotations

import contextlib
import functools
import json
import math
import re
import sys
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the oracles package, helpers

from oracles import qwen3_vl as q3vl  # noqa: E402
from oracles import qwen25_vl as q25vl  # noqa: E402
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
    load_hf_tensors,
    make_on_rank0,
    matching_rows,
    object_replicas,
    run_program,
    save_word_tokenizer,
    size_vocab,
    stored_detail,
    stored_parallel,
    unwrap,
)
from oracles.qwen3_vl import mapping_table, save_as_bridge, stored_ep  # noqa: E402
from oracles.qwen25_vl import fair_mrope, hf_mrope_section, judge_inputs, vision_names  # noqa: E402
from oracles.te_cpu import against_bridge_import, apply_bridge_cpu_shims, load_to_mutate  # noqa: E402

VOCAB = 300
IMAGE, VIDEO, ISTART, IEND, VSTART, VEND = 290, 291, 292, 293, 294, 295
MROPE = [2, 3, 3]  # sums to 8: head_dim 32 * partial_rotary_factor 0.5 = 16 rotary channels, 8 frequencies
IDS = {"image_token_id": IMAGE, "video_token_id": VIDEO, "image_start_token_id": ISTART,
       "image_end_token_id": IEND, "video_start_token_id": VSTART, "video_end_token_id": VEND}
TEXT = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 128,
        "rms_norm_eps": 1e-5, "hidden_act": "silu", "attention_bias": True, "use_qk_norm": False,
        "partial_rotary_factor": 0.5, "moe_intermediate_size": 32, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "n_shared_experts": 1, "routed_scaling_factor": 1.5, "n_group": 1, "topk_group": 1,
        "first_k_dense_replace": 1, "norm_topk_prob": True, "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 1,
        "tie_word_embeddings": False, **IDS,
        "rope_parameters": {"rope_type": "default", "rope_theta": 50000.0, "partial_rotary_factor": 0.5,
                            "mrope_section": MROPE}}
VISION = {"depth": 2, "hidden_size": 32, "hidden_act": "silu", "attention_bias": True, "num_heads": 2,
          "in_channels": 3, "image_size": 24, "patch_size": 4, "rms_norm_eps": 1e-5, "spatial_merge_size": 2,
          "temporal_patch_size": 2, "out_hidden_size": 64, "intermediate_size": 48}
GRIDS = [[1, 4, 8], [1, 6, 4]]  # the judge's two images (t, h, w in patches)
MUTATIONS = ("value", "merger_gate_up", "pos_embed_transpose", "lm_value", "dense_norm", "expert_bias_zero",
             "router_swap", "expert_swap_fc1", "expert_fc1_transpose", "shared_gate_up", "drop_object")
EMB, OUT = "language_model.embedding.word_embeddings.weight", "language_model.output_layer.weight"
ARCH = "Glm4vMoeForConditionalGeneration"
# Bridge's settings that need CUDA or TE, changed for the CPU build; Bridge's values put back for every save
MOE_CPU_SWITCHES = {**q3vl.MOE_CPU_SWITCHES, "moe_shared_expert_overlap": False}
# qwen25_vl.judge_inputs is this oracle's input: the same tokens, grids and patch geometry (its vision start / end
# are this config's image start / end; it has no token 0, which Bridge's forward would take for padding)
assert (q25vl.IMAGE, q25vl.VSTART, q25vl.VEND, q25vl.GRIDS) == (IMAGE, ISTART, IEND, GRIDS)
assert all(q25vl.VISION[k] == VISION[k] for k in ("in_channels", "patch_size", "temporal_patch_size",
                                                    "spatial_merge_size"))


# ----------------------------------------------------------------------------- the model on the CPU


@contextlib.contextmanager
def cpu_build_patches():
    """While Bridge builds: te_vl's CPU TESpecProvider and TENorm stand-in, also as gpt_layer_specs.TENorm."""
    from megatron.core.models.gpt import gpt_layer_specs

    saved = gpt_layer_specs.TENorm
    gpt_layer_specs.TENorm = te_vl.cpu_classes()["norm"]
    try:
        with te_vl.gpt_build_patches(te_vl.cpu_backend("GLM-4.5V")):
            yield
    finally:
        gpt_layer_specs.TENorm = saved


def te_block_spec(provider) -> None:
    """Bridge's block spec as Bridge makes it where TE is installed (see the module docstring)."""
    from megatron.bridge.models.glm_vl import glm_45v_provider as gp
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    spec = provider.transformer_layer_spec
    assert isinstance(spec, functools.partial) and spec.func is get_gpt_decoder_block_spec and \
        spec.keywords == {"use_transformer_engine": gp.HAVE_TE} and not spec.args, f"Bridge's spec: {spec!r}"
    provider.transformer_layer_spec = functools.partial(get_gpt_decoder_block_spec, use_transformer_engine=True)


def vl_provider(hf: str, load_weights: bool, tp: int, pp: int = 1, vocab_rows: int | None = None, ep: int = 1):
    """Bridge's GLM45VModelProvider for ``hf`` on the CPU: the TE block spec, PP ``pp``, EP ``ep``, TP ``tp``,
    MOE_CPU_SWITCHES (Bridge's values kept in qwen3_vl._BRIDGE_SETTINGS for save_as_bridge); ``vocab_rows`` sizes
    the embedding like a stored one."""
    bridge, provider = bridge_provider(hf, load_weights)
    assert type(provider).__name__ == "GLM45VModelProvider", type(provider).__name__
    assert provider.moe_grouped_gemm and not provider.use_te_activation_func and not provider.mtp_num_layers
    te_block_spec(provider)
    provider.tensor_model_parallel_size, provider.pipeline_model_parallel_size = tp, pp
    provider.expert_model_parallel_size = ep
    size_vocab(provider, vocab_rows)
    saved = {k: getattr(provider, k) for k in MOE_CPU_SWITCHES if k != "sequence_parallel"}
    for k in saved:
        setattr(provider, k, MOE_CPU_SWITCHES[k])
    provider.finalize()
    saved["sequence_parallel"] = provider.sequence_parallel  # finalize(): True at TP > 1
    provider.sequence_parallel = MOE_CPU_SWITCHES["sequence_parallel"]
    q3vl._BRIDGE_SETTINGS[id(provider)] = saved
    return bridge, provider


def check_spec(model) -> None:
    """Each language layer holds the stand-ins the TE spec puts there: dense layers (moe_layer_freq 0) the fused
    TELayerNormColumnParallelLinear linear_fc1 and no pre_mlp_layernorm; MoE layers a TENorm pre_mlp_layernorm, a
    MoELayer with TEGroupedMLP experts and a SharedExpertMLP of TEColumn/RowParallelLinear."""
    c = te_vl.cpu_classes()
    lm = unwrap(model[0]).language_model
    freq = lm.config.moe_layer_freq
    for layer in lm.decoder.layers:
        i = layer.layer_number - 1
        mods = dict(layer.named_modules())
        want = {"self_attention.linear_qkv": c["ln_col"], "self_attention.core_attention": c["attn"],
                "self_attention.linear_proj": c["row"]}
        if freq[i]:
            want.update({"mlp.shared_experts.linear_fc1": c["col"], "mlp.shared_experts.linear_fc2": c["row"],
                         "mlp.experts.linear_fc1": c["gcol"], "mlp.experts.linear_fc2": c["grow"]})
            assert type(mods["mlp"]).__name__ == "MoELayer" and type(mods["mlp.experts"]).__name__ == "TEGroupedMLP"
            assert type(layer.pre_mlp_layernorm).__name__ == "RMSNorm", layer.pre_mlp_layernorm
        else:
            want.update({"mlp.linear_fc1": c["ln_col"], "mlp.linear_fc2": c["row"]})
            assert type(layer.pre_mlp_layernorm).__name__ == "IdentityOp", layer.pre_mlp_layernorm
        for name, cls in want.items():
            assert type(mods.get(name)) is cls, f"language layer {i}: {name} is {type(mods.get(name))!r}"
        for name in ("input_layernorm", "self_attention.q_layernorm", "self_attention.k_layernorm"):
            mod = mods.get(name)
            assert mod is None or type(mod).__name__ == "IdentityOp", f"language layer {i}: {name} is {mod!r}"
    if lm.post_process:
        assert type(lm.decoder.final_layernorm).__name__ == "RMSNorm", lm.decoder.final_layernorm


def build(provider):
    """The model chunks, built with the CPU stand-ins in place of TE's modules; eval mode."""
    with cpu_build_patches():
        model = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)
    check_spec(model)
    for m in model:
        m.eval()
    return model


# ----------------------------------------------------------------------------- make


def make(a) -> int:
    import torch
    from transformers import Glm4vMoeConfig, Glm4vMoeForConditionalGeneration

    t0 = time.time()
    out = Path(a.hf_dir)
    config = Glm4vMoeConfig(text_config=json.loads(json.dumps(TEXT)), vision_config=dict(VISION), **IDS,
                            tie_word_embeddings=False, dtype="float32", architectures=[ARCH])
    torch.manual_seed(a.seed)
    model = Glm4vMoeForConditionalGeneration(config).float()
    tensors = dict(model.named_parameters())
    tensors.update({n: b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")})
    with torch.no_grad():
        for name, p in tensors.items():
            g = torch.Generator().manual_seed(zlib.crc32(f"{a.seed}|{name}".encode()))
            if name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):  # [E, 2F, H] / [E, H, F]
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
            elif name.endswith(".mlp.gate.weight"):  # the router [E, H]
                p.copy_(2.0 * torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
            elif "norm" in name and name.endswith("weight"):  # RMSNorm / LayerNorm weights: [0.5, 1.5], never 1
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
                p.masked_fill_(p == 1.0, 1.25)
            elif name.endswith("bias"):  # nonzero: +-[0.05, 0.25]; e_score_correction_bias +-[0.05, 0.3]
                mag = 0.05 + (0.25 if "e_score" in name else 0.2) * torch.rand(p.shape, generator=g)
                p.copy_(torch.where(torch.rand(p.shape, generator=g) < 0.5, -mag, mag))
            elif "embed_tokens" in name or "position_embedding" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif p.dim() >= 2:  # linears [out, in], Conv3d patch embedding, Conv2d downsample
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p[0].numel()))
            else:
                raise SystemExit(f"make: no rule for {name} {tuple(p.shape)}")
    model.save_pretrained(out)
    save_word_tokenizer(out, VOCAB)
    print(json.dumps({"made": str(out), "architecture": ARCH, "files": sorted(p.name for p in out.iterdir()),
                      "saved": hf_file_tensors(out), "seconds": round(time.time() - t0, 2)}))
    return 0


# ----------------------------------------------------------------------------- bridge-import


def cmd_bridge_import(a, serving=False) -> int:
    apply_bridge_cpu_shims()

    def save(tp):
        bridge, provider = vl_provider(a.hf_dir, load_weights=True, tp=tp, pp=a.pp, ep=a.ep)
        save_as_bridge(bridge, build(provider), a.out_dir, a.hf_dir, provider)

    return bridge_import(a, serving, save, a.ep)


# ----------------------------------------------------------------------------- judge


def megatron_logits(model, inputs, seen: dict | None = None):
    """Bridge's model's logits; with ``seen``, its tower's merged image embeddings there (``image_embeds``)."""
    import torch

    ids, pv, thw, mm = inputs
    m = unwrap(model[0])
    hook = m.visual.register_forward_hook(lambda mod, i, o: seen.__setitem__("image_embeds", o.pooler_output)) \
        if seen is not None else None
    try:
        with torch.no_grad():
            return m(input_ids=ids, position_ids=None, attention_mask=None, pixel_values=pv, image_grid_thw=thw,
                     mm_token_type_ids=mm, runtime_gather_output=True).float()
    finally:
        if hook is not None:
            hook.remove()


def hf_logits(hf: str, inputs, router: dict):
    """transformers' logits (eager attention, the eager expert loop); into ``router``, per MoE layer from the router
    logits: the tokens each expert gets, the smallest gap between the k-th and (k+1)-th biased score (sigmoid +
    e_score_correction_bias: how far the choice is from a tie) and how many tokens' expert choice the bias changes."""
    import torch
    from transformers import Glm4vMoeForConditionalGeneration

    model, info = Glm4vMoeForConditionalGeneration.from_pretrained(
        hf, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager", output_loading_info=True)
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if bad:
        raise RuntimeError(f"transformers' load of {hf} is not clean: {bad}")
    gates = {n: m for n, m in model.named_modules() if type(m).__name__ == "Glm4vMoeTextTopkRouter"}
    seen: dict = {}
    hooks = [m.register_forward_hook(lambda mod, i, o, n=n: seen.__setitem__(n, o)) for n, m in gates.items()]
    hooks.append(model.model.visual.register_forward_hook(lambda mod, i, o: router.__setitem__(
        "_image_embeds", o.pooler_output)))
    ids, pv, thw, mm = inputs
    try:
        with torch.no_grad():
            out = model.eval()(input_ids=ids, pixel_values=pv, image_grid_thw=thw, mm_token_type_ids=mm,
                               use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    k = model.config.text_config.num_experts_per_tok
    router["layers"] = {}
    for n, logits in seen.items():
        scores = logits.float().sigmoid()
        choice = scores + gates[n].e_score_correction_bias
        top = choice.topk(k, dim=-1).indices
        srt = choice.sort(dim=-1, descending=True).values
        plain = scores.topk(k, dim=-1).indices
        router["layers"][n.split(".mlp.")[0]] = {
            "tokens_per_expert": torch.bincount(top.flatten(), minlength=logits.shape[-1]).tolist(),
            "min_topk_gap": (srt[:, k - 1] - srt[:, k]).min().item(),
            "tokens_choice_changed_by_bias": int((plain.sort(-1).values != top.sort(-1).values).any(-1).sum())}
    return out.logits.float()


def cmd_judge(a, serving=False) -> int:
    t0 = time.time()
    apply_bridge_cpu_shims()
    from oracles.common import is_legacy, resolve_iter_dir

    iter_dir, truth_dir = Path(resolve_iter_dir(a.megatron_dir)), Path(resolve_iter_dir(a.truth))
    rank, world = init_dist(1, a.ep)
    tp = world // a.ep
    problems: list[str] = []
    info: dict = {"judged": str(iter_dir), "truth": str(truth_dir), "load_tp": tp, "load_ep": a.ep}
    try:
        if is_legacy(iter_dir):
            raise RuntimeError("a legacy (mp_rank_*) checkpoint: this judge reads torch_dist only")
        info["stored_tp"], info["stored_pp"] = stored_parallel(iter_dir)
        info["stored_ep"] = stored_ep(iter_dir)
        check_recorded(info, problems, {"tp": a.tp, "pp": a.pp, "ep": a.expect_ep})
        rows = judge_stored(iter_dir, truth_dir, info, problems, a.allow_vocab_padding, (EMB, OUT))
        model, ref, _ = against_bridge_import(
            lambda load: vl_provider(a.hf, load_weights=load, tp=tp, vocab_rows=rows, ep=a.ep), build, iter_dir,
            info, problems, ("visual.",))
        inputs = judge_inputs()
        info["input"] = {"tokens": inputs[0].shape[1], "image_grid_thw": GRIDS,
                         "pixel_values": list(inputs[1].shape), "image_tokens": int(inputs[3].sum())}
        router: dict = {}
        hlog = hf_logits(a.hf, inputs, router)
        hf_img = router.pop("_image_embeds")
        info["hf_router"] = router["layers"]
        try:  # Bridge's model as Bridge builds it (its mrope_section)
            raw = megatron_logits(model, inputs)[..., :VOCAB]
            info["logits_vs_hf_raw"] = (raw - hlog).abs().max().item()
        except Exception as e:  # noqa: BLE001 - recorded, see the module docstring
            info["logits_vs_hf_raw"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
        section = hf_mrope_section(a.hf)
        info["mrope_section"] = {"bridge": fair_mrope(model, section), "hf": section}
        fair_mrope(ref, section)
        seen: dict = {}
        mlog = megatron_logits(model, inputs, seen)[..., :VOCAB]
        info["image_embeds_max_abs_diff_vs_hf"] = (seen["image_embeds"] - hf_img).abs().max().item()
        judge_logits(info, problems, mlog,
                     megatron_logits(ref, inputs)[..., :VOCAB], hlog, a.atol, "; HF mrope_section")
    except Exception as e:  # noqa: BLE001 - a refused load is a verdict, not a crash
        problems.append(judge_error(e))
    return finish_judge(info, problems, world, rank, serving, t0)


# ----------------------------------------------------------------------------- mutate


def _swap(x, y) -> None:
    tmp = x.clone()
    x.copy_(y)
    y.copy_(tmp)


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
            elif a.kind == "merger_gate_up":
                _swap(vis.merger.gate_proj.weight, vis.merger.up_proj.weight)
            elif a.kind == "pos_embed_transpose":  # the 6 x 6 position grid, h <-> w
                w = vis.embeddings.position_embedding.weight
                side = math.isqrt(w.shape[0])
                w.copy_(w.view(side, side, -1).transpose(0, 1).reshape(w.shape).clone())
            elif a.kind == "lm_value":
                layers[2].self_attention.linear_qkv.weight[3, 11] += 1e-3
            elif a.kind == "dense_norm":  # the dense layer's post-attention norm taken from its input norm
                layers[0].mlp.linear_fc1.layer_norm_weight.copy_(layers[0].self_attention.linear_qkv.layer_norm_weight)
            elif a.kind == "expert_bias_zero":  # e_score_correction_bias not carried over
                layers[1].mlp.router.expert_bias.zero_()
            elif a.kind == "router_swap":
                r = layers[2].mlp.router.weight
                r.copy_(r[[1, 0, *range(2, r.shape[0])]].clone())
            elif a.kind == "expert_swap_fc1":
                fc1 = layers[1].mlp.experts.linear_fc1
                _swap(fc1.weight1, fc1.weight2)
            elif a.kind == "expert_fc1_transpose":  # [2F, H] = [64, 64]: the same shape transposed
                w = layers[2].mlp.experts.linear_fc1.weight3
                assert w.shape[0] == w.shape[1], w.shape
                w.copy_(w.t().clone())
            elif a.kind == "shared_gate_up":
                w = layers[1].mlp.shared_experts.linear_fc1.weight
                w.copy_(torch.cat(torch.chunk(w.clone(), 2, 0)[::-1]))
        if a.kind == "drop_object":
            key = "language_model.decoder.layers.0.mlp.linear_fc2._extra_state"
            assert key in m.sharded_state_dict(), key
            drop_objects(m, lambda k: k == key)
        save_as_bridge(bridge, model, a.dst, a.hf, provider)
    finally:
        end_parallel(serving)
    if rank == 0:
        print(json.dumps({"mutated": str(a.dst), "kind": a.kind}))
    return 0


# ----------------------------------------------------------------------------- layout


def row_sources(m, hf: dict) -> dict:
    """This rank's fused language tensors against the HF file's: which HF row each local row holds (q3, k0, gate7,
    up2, e2.gate7: row 7 of expert 2's gate_proj; router rows gate3; a linear_fc2's columns e2.down5). Layer 0 (dense):
    linear_qkv weight / bias, linear_fc1; layer 1 (MoE): the local experts' linear_fc1 / linear_fc2, the shared
    expert's linear_fc1, the router."""
    from megatron.core import parallel_state

    lm = "model.language_model.layers"
    l0, l1 = m.language_model.decoder.layers[0], m.language_model.decoder.layers[1].mlp
    qkv = l0.self_attention.linear_qkv
    n = l1.experts.num_local_experts
    first = parallel_state.get_expert_model_parallel_rank() * n
    E = TEXT["n_routed_experts"]
    out = {
        "layer0.linear_qkv.weight": matching_rows(qkv.weight, [(p, hf[f"{lm}.0.self_attn.{p}_proj.weight"])
                                                                for p in "qkv"]),
        "layer0.linear_qkv.bias": matching_rows(qkv.bias[:, None], [(p, hf[f"{lm}.0.self_attn.{p}_proj.bias"][:, None])
                                                                     for p in "qkv"]),
        "layer0.linear_fc1.weight": matching_rows(l0.mlp.linear_fc1.weight, [(p, hf[f"{lm}.0.mlp.{p}_proj.weight"])
                                                                              for p in ("gate", "up")]),
        "layer1.router.weight": matching_rows(l1.router.weight, [("gate", hf[f"{lm}.1.mlp.gate.weight"])]),
        "layer1.shared_experts.linear_fc1.weight": matching_rows(
            l1.shared_experts.linear_fc1.weight,
            [(p, hf[f"{lm}.1.mlp.shared_experts.{p}_proj.weight"]) for p in ("gate", "up")]),
        "layer1.local_experts": list(range(first, first + n))}
    fc1_parts = [(f"e{e}.{p}", hf[f"{lm}.1.mlp.experts.{e}.{p}_proj.weight"]) for e in range(E) for p in ("gate", "up")]
    down_parts = [(f"e{e}.down", hf[f"{lm}.1.mlp.experts.{e}.down_proj.weight"].t()) for e in range(E)]
    for i in range(n):
        out[f"layer1.experts.linear_fc1.weight{i}"] = matching_rows(getattr(l1.experts.linear_fc1, f"weight{i}"),
                                                                    fc1_parts)
        out[f"layer1.experts.linear_fc2.weight{i}_columns"] = matching_rows(
            getattr(l1.experts.linear_fc2, f"weight{i}").t(), down_parts)
    return out


def summary(every: list[dict], stored: dict | None) -> dict:
    """qwen3_vl's stored_summary, its stacking axes redone for this model's per-layer keys (moe_layer_freq is a
    list: megatron-core's TransformerBlock writes ``decoder.layers.<i>.*``, no layer axis; the routed experts'
    keys have the expert axis 0)."""
    out = q3vl.stored_summary(every, stored)
    for key, t in out["tensors"].items():
        if not re.search(r"\.layers\.\d+\.", key):
            continue
        names = ["expert"] if ".experts." in key else []
        names += ["stack"] * (t["prepend_axes"] - len(names))
        t["stack_axes"] = {n: i for i, n in enumerate(names)}
        t.pop("experts_by_rank", None)
        if names:
            t["experts_by_rank"] = {r: sorted({p["offset"][0] for p in ps}) for r, ps in t["pieces"].items()}
    return out


def cmd_layout(a, serving=False) -> int:
    apply_bridge_cpu_shims()
    import torch.distributed as dist
    from megatron.core import parallel_state

    from oracles.common import end_parallel

    rank, world = init_dist(1, a.ep)
    tp = world // a.ep
    try:
        bridge, provider = vl_provider(a.hf_dir, load_weights=True, tp=tp, ep=a.ep)
        m = unwrap(build(provider)[0])
        hf = load_hf_tensors(a.hf_dir)
        mine = {"tp_rank": parallel_state.get_tensor_model_parallel_rank(),
                "ep_rank": parallel_state.get_expert_model_parallel_rank(),
                "dp_rank": parallel_state.get_data_parallel_rank(),
                "expert_tp_rank": parallel_state.get_expert_tensor_parallel_rank(),
                "expert_dp_rank": parallel_state.get_expert_data_parallel_rank(),
                "state_dict": describe_state(m),
                "sharded_state_dict": object_replicas(m, describe_sharded(m.sharded_state_dict()), factories=True),
                "row_sources": row_sources(m, hf)}
        every = [None] * world
        dist.all_gather_object(every, mine)
        vc = m.visual.config
        out = {"tp": tp, "pp": 1, "ep": a.ep, "ranks": every,
               "modules": {n: type(mod).__name__ for n, mod in m.named_modules()
                           if not re.search(r"\.(layers\.[2-9]|blocks\.[1-9])\d*\.", n + ".")},
               "mappings": mapping_table(bridge, m),
               "vision_names": vision_names(m, hf),
               "hf_file_keys": sorted(hf),
               "vision_module": {"class": type(m.visual).__name__, "module": type(m.visual).__module__,
                                 "config_class": type(vc).__name__, "attn_implementation": vc._attn_implementation},
               "language_config": {k: repr(getattr(provider, k)) for k in (
                   "num_layers", "kv_channels", "add_qkv_bias", "qk_layernorm", "position_embedding_type",
                   "rotary_percent", "mrope_section", "rotary_base", "rotary_interleaved", "vocab_size",
                   "should_pad_vocab", "moe_layer_freq", "num_moe_experts", "moe_ffn_hidden_size",
                   "moe_shared_expert_intermediate_size", "moe_shared_expert_gate", "moe_router_topk",
                   "moe_router_score_function", "moe_router_topk_scaling_factor", "moe_router_enable_expert_bias",
                   "moe_router_num_groups", "moe_router_group_topk", "moe_router_dtype", "moe_grouped_gemm",
                   "expert_model_parallel_size", "expert_tensor_parallel_size", "mtp_num_layers",
                   "transformer_layer_spec", *IDS, "spatial_merge_size")},
               "cpu_switches": {"bridge": q3vl._BRIDGE_SETTINGS.get(id(provider)), "cpu_build": MOE_CPU_SWITCHES},
               "hf_mrope_section": hf_mrope_section(a.hf_dir)}
        if a.ckpt:
            from oracles.common import resolve_iter_dir

            it = Path(resolve_iter_dir(a.ckpt))
            out["stored"] = dict(sorted(stored_detail(str(it)).items()))
            out.update(describe_checkpoint(it))
        out["summary"] = summary(every, out.get("stored"))
    finally:
        end_parallel(serving)
    if rank == 0:
        emit_layout(out, a.out)
    return 0


# ----------------------------------------------------------------------------- main


def main(argv=None, serving=False) -> int:
    p, cmds = bridge_oracle_parser(__doc__, MUTATIONS, pp_help="pipeline stages (TP = world size / (PP * EP))")
    cmds["make"].add_argument("--seed", type=int, default=5)
    cmds["bridge-import"].add_argument("--ep", type=int, default=1, help="expert parallel")
    cmds["judge"].add_argument("--ep", type=int, default=1, help="load at expert parallel N (TP = world size / N)")
    cmds["judge"].add_argument("--expect-ep", type=int, default=None, help="the EP the checkpoint must record")
    cmds["layout"].add_argument("--ep", type=int, default=1, help="expert parallel N (TP = world size / N)")
    a = p.parse_args(argv)
    if a.cmd == "make":
        return make_on_rank0(make, a)
    return {"bridge-import": cmd_bridge_import, "judge": cmd_judge, "layout": cmd_layout,
            "mutate": cmd_mutate}[a.cmd](a, serving)


if __name__ == "__main__":
    run_program(main)
