"""Oracle for Ministral 3 with images: Megatron-Bridge 0.6.2's ``Ministral3Bridge`` / ``Ministral3ModelProvider``
(its ``Ministral3Model``: transformers' own Pixtral vision tower ``vision_tower.`` and Mistral-3 multimodal projector
``multi_modal_projector.`` kept whole as HF modules, a megatron-core GPT language model with YaRN RoPE and
Bridge's ``MinistralTEDotProductAttention`` (Llama-4 query scaling) under ``language_model.``) on megatron-core
0.19.2 is the Megatron side; transformers' ``Mistral3ForConditionalGeneration`` (text ``Ministral3Config``) is the
HF side. Runs in the second runtime (.venv-mcore19, Python 3.12); imports megatron-core, Megatron-Bridge,
transformers; never dist_convert. Shared with oracles/qwen25_vl.py (CPU kernels, mapping table), oracles/qwen3_vl.py
(layout summary), oracles/te_vl.py (the TE stand-ins), oracles/common.py.

  oracles/ministral3.py make HF_DIR [--seed S]
      a tiny random Mistral3ForConditionalGeneration by transformers' own classes, fp32, save_pretrained. Text
      (Ministral3Config): hidden 64, 4 heads, 2 kv heads, head_dim 16, ffn 128 (SwiGLU), 4 layers, vocab 300,
      untied, rope_parameters {yarn, rope_theta 50000, factor 4, original_max_position_embeddings 8, beta_fast 32,
      beta_slow 1, mscale 1, mscale_all_dim 1, llama_4_scaling_beta 0.1} (the judge's 39 tokens cross 8, 16, 24,
      32: the Llama-4 scale 1 + 0.1 * log(1 + floor(pos / 8)) acts). Vision (PixtralVisionConfig): hidden 32, ffn
      64, 2 layers, 2 heads, patch 4, image_size 32, silu. Projector: Mistral3Config's defaults (spatial_merge_size
      2, gelu, no bias, vision_feature_layer -1). image_token_index 290 at the top (where Bridge reads it:
      getattr(hf_config, "image_token_index", 10)). Every tensor random, seeded per name (norm weights [0.5, 1.5]
      never 1). A 300-token WordLevel tokenizer.
  oracles/ministral3.py bridge-import HF_DIR OUT_DIR [--pp P]
      Bridge's own import (AutoBridge, to_megatron_provider(load_weights=True), provide_distributed_model,
      save_megatron_model): torch_dist at PP P, TP = world / P. NOT Bridge's provider untouched: its yarn_* fields
      are set from the HF config's rope_parameters first (``fair_yarn``): Ministral3Bridge.provider_bridge passes
      only rope_theta, the provider keeps its class defaults (factor 16, original max 16384, beta_fast 32,
      beta_slow 1, mscale 1, mscale_all_dim 1, correction_range_round_to_int False). No weight depends on them;
      run_config.yaml records the HF values. The JSON's ``yarn`` has both ("bridge" and "set").
  oracles/ministral3.py judge MEGATRON_DIR --truth BRIDGE_DIR --hf HF_DIR [--tp N] [--pp N] [--atol 1e-4]
      [--allow-vocab-padding]
      Bridge's model at TP = world, PP 1 (fair yarn fields); MEGATRON_DIR loaded strictly (dist_checkpointing.load
      RAISE_ALL, TE's check of each _extra_state, load_state_dict); loaded tensors == Bridge's in-memory import at
      this layout bit for bit; stored tensors == BRIDGE_DIR's with the same _extra_state objects; TP / PP recorded
      == --tp / --pp; logits WITH IMAGES vs transformers (eager attention, fp32) within --atol. Input: 39 tokens,
      two images of 16 x 24 and 24 x 16 pixels (pixel_values [2, 3, 24, 24], image_sizes [[16, 24], [24, 16]]: 4 x
      6 and 6 x 4 patches, 2 x 3 and 3 x 2 merged tokens, 6 image tokens each). Also in the JSON:
      ``logits_vs_hf_raw`` (the same weights in Bridge's model as Bridge's provider builds it: its default yarn
      fields), ``yarn`` (Bridge's and HF's), ``image_embeds_max_abs_diff_vs_hf`` (projector output),
      ``logits_vs_hf_fair_but_round_to_int_false`` (the fair fields but yarn_correction_range_round_to_int False,
      Bridge's default, where transformers' rope_parameters truncate defaults to True),
      ``llama4_scaling``: what beta 0 instead of the HF config's changes in the Megatron and the HF logits.
      One JSON line (rank 0); exit 1 on any problem. torch_dist only.
  oracles/ministral3.py mutate SRC DST --hf HF_DIR --kind KIND
      SRC with one defect, saved as Bridge saves (TP = world): value (tower:
      vision_tower.transformer.layers.1.attention.q_proj.weight[5, 7] += 1e-3), projector_value
      (multi_modal_projector.patch_merger.merging_layer.weight[3, 11] += 1e-3), lm_value (language layer 2
      linear_qkv.weight[3, 11] += 1e-3), lm_swap_gate_up (layer 1 linear_fc1 gate / up halves exchanged),
      drop_object (no language mlp.linear_fc2._extra_state: the stacked object of all layers; one layer's shard
      alone cannot be left out, megatron-core's save refuses the incomplete object). The judge must fail on DST.
  oracles/ministral3.py layout HF_DIR [--ckpt DIR] [--out JSON]
      per rank state / sharded state, modules, Bridge's mapping table, tower / projector keys vs HF names, provider
      fields (raw and fair yarn), ``summary`` (qwen3_vl's: every key with its global shape); --ckpt: stored keys,
      common state, run_config.yaml's model section.

The layout (layout --ckpt at TP 1; the same keys at TP 2, PP 2: 33 tensors, 17 objects). ``vision_tower.`` and
``multi_modal_projector.`` + the HF file's names (ReplicatedMapping, whole on every rank, no objects): 20 + 4.
``language_model.``: embedding.word_embeddings / output_layer [300, 64], decoder.final_layernorm.weight [64], and
stacked ``decoder.layers.*`` (layer axis 0 of 4): self_attention.linear_qkv.{layer_norm_weight [4, 64], weight
[4, 128, 64]}, linear_proj.weight [4, 64, 64], mlp.linear_fc1.{layer_norm_weight [4, 64], weight [4, 256, 64]},
linear_fc2.weight [4, 64, 128]. Objects: ``<key>/shard_<layer>_4`` of linear_qkv / linear_proj / linear_fc1 /
linear_fc2 _extra_state, final_layernorm._extra_state/shard_0_1; none for core_attention. run_config.yaml's model:
Ministral3ModelProvider with the whole hf_config (a Mistral3Config: text_config rope_parameters, vision_config),
transformer_layer_spec ministral_layer_spec, the yarn_* fields (what bridge-import set).

The CPU stand-ins. ministral_layer_spec = default_layer_spec (TE spec, megatron-core's TESpecProvider: te_vl's CPU
backend while building, its TENorm as the final layernorm) with core_attention := the module global
ministral3_provider.MinistralTEDotProductAttention, a subclass of TE's TEDotProductAttention. While building, that
global is a CPU class of the same name (``cpu_ministral_attention``): te_vl's TEDotProductAttention stand-in
(megatron-core's DotProductAttention, no state) with Bridge's __init__ (beta and original max from
hf_config.text_config.rope_parameters) and forward (queries times
1 + beta * log(1 + floor(arange(seq) / original max))), reimplemented: without TE, megatron-core's
TEDotProductAttention is a Mock and so is Bridge's subclass (no method of it can be called); the formula is
asserted to be in Bridge's source. Restored after.
Other shims: te_cpu.apply_bridge_cpu_shims, CPU_KERNELS (fusions off).
"""
from __future__ import annotations

import contextlib
import json
import math
import re
import sys
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the oracles package, helpers

from oracles import qwen3_vl as q3vl  # noqa: E402
from oracles import te_cpu, te_vl  # noqa: E402
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
    object_replicas,
    run_program,
    save_word_tokenizer,
    size_vocab,
    stored_detail,
    stored_parallel,
    unwrap,
)
from oracles.qwen25_vl import mapping_table  # noqa: E402
from oracles.te_cpu import against_bridge_import, apply_bridge_cpu_shims, load_to_mutate  # noqa: E402

VOCAB = 300
IMAGE, IMG_BREAK, IMG_END = 290, 291, 292
ROPE = {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0, "original_max_position_embeddings": 8,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1}
TEXT = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 32,
        "rms_norm_eps": 1e-5, "hidden_act": "silu", "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 1,
        "tie_word_embeddings": False, "rope_parameters": ROPE}
VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
          "num_channels": 3, "image_size": 32, "patch_size": 4, "hidden_act": "silu",
          "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
IMAGE_SIZES = [[16, 24], [24, 16]]  # the judge's two images (h, w in pixels)
MUTATIONS = ("value", "projector_value", "lm_value", "lm_swap_gate_up", "drop_object")
EMB, OUT = "language_model.embedding.word_embeddings.weight", "language_model.output_layer.weight"
ARCH = "Mistral3ForConditionalGeneration"
DROP = r"language_model\.decoder\.layers\.\d+\.mlp\.linear_fc2\._extra_state"
# provider field <- HF rope_parameters key (truncate: transformers' default True)
YARN = {"yarn_rotary_scaling_factor": "factor", "yarn_original_max_position_embeddings":
        "original_max_position_embeddings", "yarn_beta_fast": "beta_fast", "yarn_beta_slow": "beta_slow",
        "yarn_mscale": "mscale", "yarn_mscale_all_dim": "mscale_all_dim",
        "yarn_correction_range_round_to_int": "truncate"}


# ----------------------------------------------------------------------------- the model on the CPU

_ATTN = None
LLAMA4_SCALE = "scaling = 1 + beta * torch.log(1 + torch.floor(positions_ids / max_position_embeddings))"


def cpu_ministral_attention():
    """Bridge's MinistralTEDotProductAttention over te_vl's TEDotProductAttention stand-in (module docstring)."""
    global _ATTN
    if _ATTN is not None:
        return _ATTN
    from megatron.bridge.models.ministral3 import ministral3_provider as mp

    base = te_vl.cpu_classes()["attn"]
    # without TE, Bridge's class (a subclass of megatron-core's TEDotProductAttention, a Mock there) is a Mock:
    # its formula is checked in its source and computed here
    src = Path(mp.__file__).read_text()
    assert LLAMA4_SCALE in src and "query *= self._get_llama_4_attn_scale(positions_ids" in src, mp.__file__

    def llama4_scale(positions_ids, beta, max_position_embeddings, query_shape):  # Bridge's, verbatim
        import torch

        scaling = 1 + beta * torch.log(1 + torch.floor(positions_ids / max_position_embeddings))
        for _ in range(len(query_shape) - 1):
            scaling = scaling.unsqueeze(-1)
        return scaling

    class MinistralTEDotProductAttention(base):
        def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None, **kwargs):
            super().__init__(config=config, layer_number=layer_number, attn_mask_type=attn_mask_type,
                             attention_type=attention_type, attention_dropout=attention_dropout, **kwargs)
            if self.config.hf_config is not None:  # as Bridge's __init__
                self.beta = self.config.hf_config.text_config.rope_parameters["llama_4_scaling_beta"]
                self.max_position_embeddings = self.config.hf_config.text_config.rope_parameters[
                    "original_max_position_embeddings"]
            else:
                self.beta = 0
                self.max_position_embeddings = self.config.seq_length

        def forward(self, query, key, value, attention_mask, attn_mask_type, **kwargs):  # as Bridge's forward
            import torch

            positions_ids = torch.arange(query.shape[0], device=query.device)
            query *= llama4_scale(positions_ids, self.beta, self.max_position_embeddings,
                                                        query.shape).to(query.dtype)
            return super().forward(query, key, value, attention_mask, attn_mask_type, **kwargs)

    _ATTN = MinistralTEDotProductAttention
    return _ATTN


@contextlib.contextmanager
def cpu_build_patches():
    """While Bridge builds: te_vl's CPU TESpecProvider, its TENorm as the final layernorm, and the CPU
    MinistralTEDotProductAttention as ministral3_provider's global (what ministral_layer_spec puts in)."""
    from megatron.bridge.models.ministral3 import ministral3_provider as mp

    saved = mp.MinistralTEDotProductAttention
    mp.MinistralTEDotProductAttention = cpu_ministral_attention()
    try:
        with te_vl.gpt_build_patches(te_vl.cpu_backend("Ministral 3", column_linear=False, experts=False)):
            yield
    finally:
        mp.MinistralTEDotProductAttention = saved


def check_spec(model) -> None:
    """Each language layer holds the stand-ins the TE spec (and ministral_layer_spec) puts there."""
    c = te_vl.cpu_classes()
    lm = unwrap(model[0]).language_model
    want = {"self_attention.linear_qkv": c["ln_col"], "self_attention.core_attention": cpu_ministral_attention(),
            "self_attention.linear_proj": c["row"], "mlp.linear_fc1": c["ln_col"], "mlp.linear_fc2": c["row"]}
    for i, layer in enumerate(lm.decoder.layers):
        mods = dict(layer.named_modules())
        for name, cls in want.items():
            assert type(mods.get(name)) is cls, f"language layer {i}: {name} is {type(mods.get(name))!r}"
        for name in ("input_layernorm", "pre_mlp_layernorm", "self_attention.q_layernorm",
                     "self_attention.k_layernorm"):
            mod = mods.get(name)
            assert mod is None or type(mod).__name__ == "IdentityOp", f"language layer {i}: {name} is {mod!r}"
    if lm.post_process:
        assert type(lm.decoder.final_layernorm) is te_cpu.cpu_classes()["norm"], lm.decoder.final_layernorm


def hf_rope(hf: str) -> dict:
    from transformers import AutoConfig

    return dict(AutoConfig.from_pretrained(hf).text_config.rope_parameters)


def yarn_fields(provider) -> dict:
    return {k: getattr(provider, k) for k in (*YARN, "rotary_base", "position_embedding_type")}


def fair_yarn(provider, hf: str) -> dict:
    """The provider's yarn_* fields set from the HF config's rope_parameters (Bridge passes only rope_theta);
    returns the fields as Bridge had them."""
    before = yarn_fields(provider)
    rope = hf_rope(hf)
    for field, key in YARN.items():
        value = rope.get(key, True) if key == "truncate" else rope[key]
        setattr(provider, field, type(before[field])(value) if before[field] is not None else value)
    return before


def vl_provider(hf: str, load_weights: bool, tp: int, pp: int = 1, vocab_rows: int | None = None,
                fair: bool = True):
    """Bridge's Ministral3ModelProvider for ``hf`` on the CPU (fusions off), PP ``pp``, TP ``tp``; ``fair``: its
    yarn fields from the HF config (``provider._bridge_yarn``: Bridge's own)."""
    from megatron.bridge.models.ministral3 import ministral3_provider as mp

    from oracles.te_cpu import CPU_KERNELS

    bridge, provider = bridge_provider(hf, load_weights)
    assert type(provider) is mp.Ministral3ModelProvider, type(provider)
    assert provider.transformer_layer_spec is mp.ministral_layer_spec, provider.transformer_layer_spec
    assert not provider.use_transformer_engine_full_layer_spec
    for k, v in CPU_KERNELS.items():
        if hasattr(provider, k):
            setattr(provider, k, v)
    provider._bridge_yarn = fair_yarn(provider, hf) if fair else yarn_fields(provider)
    provider.tensor_model_parallel_size, provider.pipeline_model_parallel_size = tp, pp
    size_vocab(provider, vocab_rows)
    provider.finalize()
    return bridge, provider


def build(provider):
    with cpu_build_patches():
        model = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)
    check_spec(model)
    for m in model:
        m.eval()
    return model


def save_as_bridge(bridge, model, out_dir: str, hf: str) -> None:
    bridge.save_megatron_model(model, out_dir, hf_tokenizer_path=hf)


# ----------------------------------------------------------------------------- make


def make(a) -> int:
    import torch
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    t0 = time.time()
    out = Path(a.hf_dir)
    text = json.loads(json.dumps(TEXT))
    text["model_type"] = "ministral3"
    config = Mistral3Config(text_config=text, vision_config={**json.loads(json.dumps(VISION)),
                                                             "model_type": "pixtral"},
                            image_token_index=IMAGE, spatial_merge_size=2, projector_hidden_act="gelu",
                            vision_feature_layer=-1, multimodal_projector_bias=False, tie_word_embeddings=False,
                            dtype="float32", architectures=[ARCH])
    assert type(config.text_config).__name__ == "Ministral3Config", type(config.text_config)
    assert type(config.vision_config).__name__ == "PixtralVisionConfig", type(config.vision_config)
    torch.manual_seed(a.seed)
    model = Mistral3ForConditionalGeneration(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            g = torch.Generator().manual_seed(zlib.crc32(f"{a.seed}|{name}".encode()))
            if "norm" in name or "ln_pre" in name:  # RMSNorm weights: [0.5, 1.5], never 1
                assert name.endswith("weight"), name
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
                p.masked_fill_(p == 1.0, 1.25)
            elif name.endswith("bias"):
                mag = 0.05 + 0.2 * torch.rand(p.shape, generator=g)
                p.copy_(torch.where(torch.rand(p.shape, generator=g) < 0.5, -mag, mag))
            elif "embed_tokens" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif p.dim() >= 2:  # linears [out, in], the Conv2d patch embedding
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p[0].numel()))
            else:
                raise SystemExit(f"make: no rule for {name} {tuple(p.shape)}")
    model.save_pretrained(out)
    save_word_tokenizer(out, VOCAB)
    cfg = json.loads((out / "config.json").read_text())
    print(json.dumps({"made": str(out), "architecture": ARCH, "files": sorted(p.name for p in out.iterdir()),
                      "image_token_index": cfg.get("image_token_index"),
                      "text_rope_parameters": cfg["text_config"].get("rope_parameters"),
                      "saved": hf_file_tensors(out), "seconds": round(time.time() - t0, 2)}))
    return 0


# ----------------------------------------------------------------------------- bridge-import


def cmd_bridge_import(a, serving=False) -> int:
    apply_bridge_cpu_shims()

    def save(tp):
        bridge, provider = vl_provider(a.hf_dir, load_weights=True, tp=tp, pp=a.pp)
        save_as_bridge(bridge, build(provider), a.out_dir, a.hf_dir)
        return {"yarn": {"bridge": provider._bridge_yarn, "set": yarn_fields(provider),
                         "note": "yarn_* fields set from the HF rope_parameters before building (Bridge passes only "
                                 "rope_theta); no weight depends on them; run_config.yaml records the set values"}}

    return bridge_import(a, serving, save)


# ----------------------------------------------------------------------------- judge


def judge_inputs():
    """(input_ids [1, 34], pixel_values [2, 3, 24, 24], image_sizes [[16, 24], [24, 16]])."""
    import torch

    per = [(h // 8) * (w // 8) for h, w in IMAGE_SIZES]  # patch 4, merge 2
    ids = [2, 5, 17, 42, 9]
    for k, n in enumerate(per):
        ids += [IMAGE] * n + [IMG_END] + [60 + 7 * k, 111 + k, 203 - k, 33, 150 + k]
    ids += [250, 9, 77, 18, 201, 66, 3, 120, 45, 88]
    g = torch.Generator().manual_seed(4321)
    side = max(max(s) for s in IMAGE_SIZES)
    pixel_values = torch.randn(len(IMAGE_SIZES), VISION["num_channels"], side, side, generator=g)
    return torch.tensor([ids]), pixel_values, torch.tensor(IMAGE_SIZES)


def megatron_logits(model, inputs, seen: dict | None = None):
    import torch

    ids, pv, sizes = inputs
    m = unwrap(model[0])
    hook = m.multi_modal_projector.register_forward_hook(
        lambda mod, i, o: seen.__setitem__("image_embeds", o)) if seen is not None else None
    try:
        with torch.no_grad():
            out = m(input_ids=ids, position_ids=None, attention_mask=None, pixel_values=pv, image_sizes=sizes,
                    runtime_gather_output=True)
    finally:
        if hook is not None:
            hook.remove()
    return (out[0] if isinstance(out, tuple) else out).float()


def hf_model(hf: str):
    import torch
    from transformers import Mistral3ForConditionalGeneration

    model, info = Mistral3ForConditionalGeneration.from_pretrained(
        hf, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if bad:
        raise RuntimeError(f"transformers' load of {hf} is not clean: {bad}")
    return model.eval()


def hf_logits(model, inputs, seen: dict | None = None):
    import torch

    ids, pv, sizes = inputs
    hook = model.model.multi_modal_projector.register_forward_hook(
        lambda mod, i, o: seen.__setitem__("image_embeds", o)) if seen is not None else None
    try:
        with torch.no_grad():
            out = model(input_ids=ids, pixel_values=pv, image_sizes=sizes, use_cache=False)
    finally:
        if hook is not None:
            hook.remove()
    return out.logits.float()


def set_beta(model, beta) -> None:
    for layer in unwrap(model[0]).language_model.decoder.layers:
        layer.self_attention.core_attention.beta = beta


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
        model, ref, provider = against_bridge_import(
            lambda load: vl_provider(a.hf, load_weights=load, tp=world, vocab_rows=rows), build, iter_dir, info,
            problems, ("vision_tower.", "multi_modal_projector."))
        inputs = judge_inputs()
        info["input"] = {"tokens": inputs[0].shape[1], "image_sizes": IMAGE_SIZES,
                         "pixel_values": list(inputs[1].shape), "image_tokens": int((inputs[0] == IMAGE).sum())}
        hf = hf_model(a.hf)
        hseen: dict = {}
        hlog = hf_logits(hf, inputs, hseen)
        info["yarn"] = {"bridge": provider._bridge_yarn, "fair": yarn_fields(provider), "hf": hf_rope(a.hf)}
        try:  # the same weights in Bridge's model as Bridge's provider builds it (its default yarn fields)
            _, raw_provider = vl_provider(a.hf, load_weights=False, tp=world, vocab_rows=rows, fair=False)
            raw = build(raw_provider)
            unwrap(raw[0]).load_state_dict(unwrap(model[0]).state_dict())
            info["logits_vs_hf_raw"] = (megatron_logits(raw, inputs)[..., :VOCAB] - hlog).abs().max().item()
            del raw
            # the fair fields but megatron-core's correction range unrounded (transformers' truncate is True)
            _, nt_provider = vl_provider(a.hf, load_weights=False, tp=world, vocab_rows=rows)
            nt_provider.yarn_correction_range_round_to_int = False
            nt = build(nt_provider)
            unwrap(nt[0]).load_state_dict(unwrap(model[0]).state_dict())
            info["logits_vs_hf_fair_but_round_to_int_false"] = (
                megatron_logits(nt, inputs)[..., :VOCAB] - hlog).abs().max().item()
            del nt
        except Exception as e:  # noqa: BLE001 - recorded
            info["logits_vs_hf_raw"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
        seen: dict = {}
        mlog = megatron_logits(model, inputs, seen)[..., :VOCAB]
        info["image_embeds_max_abs_diff_vs_hf"] = (seen["image_embeds"] - hseen["image_embeds"]).abs().max().item()
        judge_logits(info, problems, mlog, megatron_logits(ref, inputs)[..., :VOCAB], hlog, a.atol,
                     "; yarn fields from the HF config")
        # what the Llama-4 scaling does: beta 0 on both sides
        beta = hf.config.text_config.rope_parameters["llama_4_scaling_beta"]
        set_beta(model, 0.0)
        m0 = megatron_logits(model, inputs)[..., :VOCAB]
        set_beta(model, beta)
        hf.config.text_config.rope_parameters["llama_4_scaling_beta"] = 0.0
        h0 = hf_logits(hf, inputs)
        hf.config.text_config.rope_parameters["llama_4_scaling_beta"] = beta
        info["llama4_scaling"] = {
            "beta": beta, "megatron_beta": [lay.self_attention.core_attention.beta for lay in
                                            unwrap(model[0]).language_model.decoder.layers],
            "megatron_logits_beta0_vs_beta": (m0 - mlog).abs().max().item(),
            "hf_logits_beta0_vs_beta": (h0 - hlog).abs().max().item(),
            "megatron_beta0_vs_hf_beta0": (m0 - h0).abs().max().item()}
    except Exception as e:  # noqa: BLE001 - a refused load is a verdict, not a crash
        problems.append(judge_error(e))
    return finish_judge(info, problems, world, rank, serving, t0)


# ----------------------------------------------------------------------------- mutate


def cmd_mutate(a, serving=False) -> int:
    apply_bridge_cpu_shims()
    import torch

    from oracles.common import end_parallel

    rank, world = init_dist()
    try:
        bridge, provider = vl_provider(a.hf, load_weights=False, tp=world)
        model = build(provider)
        m = load_to_mutate(model, a.src)
        layers = m.language_model.decoder.layers
        with torch.no_grad():
            if a.kind == "value":
                m.vision_tower.transformer.layers[1].attention.q_proj.weight[5, 7] += 1e-3
            elif a.kind == "projector_value":
                m.multi_modal_projector.patch_merger.merging_layer.weight[3, 11] += 1e-3
            elif a.kind == "lm_value":
                layers[2].self_attention.linear_qkv.weight[3, 11] += 1e-3
            elif a.kind == "lm_swap_gate_up":  # per TP rank: [gate_r; up_r]
                w = layers[1].mlp.linear_fc1.weight
                w.copy_(torch.cat(torch.chunk(w.clone(), 2, 0)[::-1]))
        if a.kind == "drop_object":
            # the layers are stacked (one ShardedObject key, a shard per layer): every layer's, as one shard
            # missing is refused by the save itself
            keys = {k for k in m.sharded_state_dict() if re.fullmatch(DROP, k)}
            assert len(keys) == TEXT["num_hidden_layers"], keys
            drop_objects(m, lambda k: k in keys)
        save_as_bridge(bridge, model, a.dst, a.hf)
    finally:
        end_parallel(serving)
    if rank == 0:
        print(json.dumps({"mutated": str(a.dst), "kind": a.kind}))
    return 0


# ----------------------------------------------------------------------------- layout


def hf_names(m, hf: dict) -> dict:
    """The tower's and projector's state-dict keys against the HF file's names holding the same tensor."""
    import torch

    out = {}
    for k, v in m.state_dict().items():
        if not k.startswith(("vision_tower.", "multi_modal_projector.")) or not isinstance(v, torch.Tensor):
            continue
        out[k] = [n for n, t in hf.items() if t.shape == v.shape and torch.equal(t, v)]
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
        mine = {"tp_rank": parallel_state.get_tensor_model_parallel_rank(),
                "dp_rank": parallel_state.get_data_parallel_rank(),
                "state_dict": describe_state(m),
                "sharded_state_dict": object_replicas(m, describe_sharded(m.sharded_state_dict()), factories=True)}
        every = [None] * world
        dist.all_gather_object(every, mine)
        out = {"tp": world, "pp": 1, "ranks": every,
               "modules": {n: type(mod).__name__ for n, mod in m.named_modules()
                           if not any(f"layers.{i}." in n + "." for i in range(2, 10))},
               "mappings": mapping_table(bridge, m),
               "hf_names": hf_names(m, hf),
               "hf_file_keys": sorted(hf),
               "language_config": {k: repr(getattr(provider, k)) for k in (
                   "num_layers", "kv_channels", "num_query_groups", "position_embedding_type", "rotary_base",
                   "seq_length", "vocab_size", "should_pad_vocab", "image_token_id", "spatial_merge_size",
                   "vision_feature_layer", "transformer_layer_spec", *YARN)},
               "yarn": {"bridge": provider._bridge_yarn, "fair": yarn_fields(provider), "hf": hf_rope(a.hf_dir)}}
        if a.ckpt:
            from oracles.common import resolve_iter_dir

            it = Path(resolve_iter_dir(a.ckpt))
            out["stored"] = dict(sorted(stored_detail(str(it)).items()))
            out.update(describe_checkpoint(it))
        out["summary"] = q3vl.stored_summary(every, out.get("stored"))
    finally:
        end_parallel(serving)
    if rank == 0:
        emit_layout(out, a.out)
    return 0


# ----------------------------------------------------------------------------- main


def main(argv=None, serving=False) -> int:
    p, cmds = bridge_oracle_parser(__doc__, MUTATIONS)
    cmds["make"].add_argument("--seed", type=int, default=5)
    a = p.parse_args(argv)
    if a.cmd == "make":
        return make_on_rank0(make, a)
    return {"bridge-import": cmd_bridge_import, "judge": cmd_judge, "layout": cmd_layout,
            "mutate": cmd_mutate}[a.cmd](a, serving)


if __name__ == "__main__":
    run_program(main)
