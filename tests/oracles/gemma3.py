"""Oracle for Gemma 3 (text): Megatron-Bridge 0.6.2's ``Gemma3ModelProvider`` on megatron-core 0.19.2 is the
Megatron-side layout; transformers' ``Gemma3ForCausalLM`` is the HF side. Runs in the second runtime
(.venv-mcore19, Python 3.12); imports megatron-core, Megatron-Bridge, transformers; never dist_convert.

  oracles/gemma3.py make HF_DIR [--layers N] [--seed S]
      a tiny random Gemma3ForCausalLM made by transformers' own classes (Gemma3TextConfig): hidden 64, 4 heads,
      2 kv heads, head_dim 16, ffn 128, vocab 300 (not a multiple of 128), N layers (default 7: layers 1-5 and 7
      sliding, layer 6 full; Bridge only knows the 5:1 pattern), sliding_window 4, query_pre_attn_scalar 24
      (!= head_dim), rope_theta 50000 with linear scaling x4 on full layers, local rope_theta 10000, tied
      embeddings, fp32; every tensor random (norm weights w with |w| in [0.2, 0.8]: Gemma's RMSNorm scales by
      1 + w); a 300-token WordLevel tokenizer; ``save_pretrained`` (safetensors)
  oracles/gemma3.py bridge-import HF_DIR OUT_DIR [--pp P]
      Megatron-Bridge's own import (AutoBridge.from_hf_pretrained, to_megatron_provider(load_weights=True),
      provide_distributed_model, save_megatron_model): a torch_dist checkpoint at PP --pp (default 1), TP = world
      size / PP
  oracles/gemma3.py judge MEGATRON_DIR --truth BRIDGE_DIR --hf HF_DIR [--tp N] [--pp N]
      builds Bridge's Gemma 3 model from the HF config (TP = world size, PP 1), loads MEGATRON_DIR into it
      with megatron-core's dist_checkpointing.load (StrictHandling.RAISE_ALL: no missing, no unexpected key;
      resharding from any TP/PP), TE's check of each _extra_state value, then module.load_state_dict (every key
      but an unsaved _extra_state, as Megatron-LM's and Bridge's loaders allow); asserts
        * every loaded tensor == Bridge's own import of HF_DIR at this layout (in memory), bit for bit
        * every stored tensor == BRIDGE_DIR's (load_plain_tensors, global shapes), bit for bit, and the same
          _extra_state objects (names)
        * --tp N / --pp N: the TP / PP the checkpoint records (Megatron-LM args, else run_config.yaml) are N
        * the Megatron logits on fixed ids (longer than the sliding window) match transformers'
          Gemma3ForCausalLM (eager, fp32) within --atol (1e-4)
      prints one JSON line (rank 0); exit 1 on any problem. torch_dist, or a legacy (torch) checkpoint
      written at TP = world size, PP 1.
  oracles/gemma3.py mutate SRC DST --hf HF_DIR --kind value|norm_plus_one|swap_gate_up|swap_k_v|drop_object
      SRC with one defect, saved as Bridge saves: the judge must fail on DST (a test that cannot fail is none)
  oracles/gemma3.py layout HF_DIR [--ckpt DIR] [--out JSON]
      the layout itself: the model's state_dict() names/shapes/dtypes, its sharded_state_dict() (keys, global
      shapes, TP axis, replica ids, ShardedObjects), and with --ckpt the checkpoint's stored keys (.metadata),
      its common state and run_config.yaml's model section

The CPU stand-ins. Bridge's gemma3_layer_spec is built only from Transformer Engine modules
(TELayerNormColumnParallelLinear, TENorm, Gemma3TEDotProductAttention(TEDotProductAttention),
TERowParallelLinearLayerNorm(TERowParallelLinear) + TENorm post_layernorm); TE has no CPU build. The
oracle takes Bridge's own spec (gemma3_layer_spec(config)) and swaps exactly those leaves for plain-torch
stand-ins with TE's parameter names, TE's _extra_state (get_extra_state) and megatron-core's TE wrappers'
sharded_state_dict (same make_sharded_tensors_for_checkpoint call, same TP axis map), and the class names of
what they stand for (Bridge's AutoMapping picks a weight's TP split by its module's class name):
  * CpuTENorm (te.pytorch.RMSNorm, an op-based module in TE 2.x): ``weight``; y = x * rsqrt(mean(x^2) + eps)
    * (1 + w) with layernorm_zero_centered_gamma; eps as TENorm's caller gives it (TENorm's default 1e-5 for
    TERowParallelLinearLayerNorm's post_layernorm, which Bridge builds without eps); _extra_state the
    pickled empty dict TE's BasicOperation returns (5 bytes)
  * CpuTELayerNormColumnParallelLinear: ``layer_norm_weight`` (replicated), ``weight`` (TP axis 0);
    _extra_state an empty uint8 tensor (TE's module without FP8)
  * CpuTERowParallelLinearLayerNorm: ``weight`` (TP axis 1) + ``post_layernorm`` (CpuTENorm, replicated)
  * CpuGemma3DotProductAttention: megatron-core's local DotProductAttention with Gemma3TEDotProductAttention's
    per-layer window (local layers (window_size - 1, 0), global None); no sharded state (as
    TEDotProductAttention.sharded_state_dict in 0.19.2), legacy _extra_state an empty uint8 tensor
  * the final layernorm: megatron-core builds TENorm there when TE is present (transformer_block.LayerNormImpl)
    -> CpuTENorm
Other CPU shims: oracles.te_cpu.install_shims (TE stub for Bridge's lora_layers only, CUDA no-ops); the
sliding-window and causal masks megatron-core allocates on "cuda" are made on the CPU; the save's CUDA RNG
state is the CPU one.
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
    init_dist,
    is_legacy,
    judge_error,
    judge_logits,
    judge_stored,
    run_program,
    save_word_tokenizer,
    size_vocab,
    stored_metadata,
    stored_parallel,
    unwrap,
)
from oracles.te_cpu import against_bridge_import, apply_bridge_cpu_shims, cpu_classes, load_to_mutate  # noqa: E402

VOCAB = 300
TINY = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
        "sliding_window": 4, "query_pre_attn_scalar": 24, "tie_word_embeddings": True,
        "hidden_activation": "gelu_pytorch_tanh", "attention_bias": False, "final_logit_softcapping": None,
        "attn_logit_softcapping": None, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2,
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 50000.0}}}
SEQ = 12  # test input length: > sliding_window, so local layers really cut keys off


# ----------------------------------------------------------------------------- CPU stand-ins for TE


def cpu_gemma3_layer_spec(config):
    """Bridge's own gemma3_layer_spec(config) with its TE leaves swapped for the CPU stand-ins (each must be found:
    a changed Bridge spec fails here instead of silently building something else)."""
    from megatron.bridge.models.common import te_layers
    from megatron.bridge.models.gemma import gemma3_provider as g3

    c = cpu_classes()
    swap = {id(g3.TELayerNormColumnParallelLinear): c["qkv"], id(g3.TENorm): c["norm"],
            id(g3.Gemma3TEDotProductAttention): c["attn"], id(te_layers.TERowParallelLinearLayerNorm): c["row_ln"]}
    spec = g3.gemma3_layer_spec(config)
    attn, mlp = spec.submodules.self_attention.submodules, spec.submodules.mlp.submodules
    slots = [(attn, "linear_qkv"), (attn, "core_attention"), (attn, "q_layernorm"), (attn, "k_layernorm"),
             (attn, "linear_proj"), (mlp, "linear_fc1"), (mlp, "linear_fc2")]
    for holder, name in slots:
        cur = getattr(holder, name)
        assert id(cur) in swap, f"gemma3_layer_spec: unexpected {name}={cur!r}"
        setattr(holder, name, swap[id(cur)])
    return spec


# ----------------------------------------------------------------------------- the model


def gemma3_provider(hf: str, load_weights: bool, tp: int, vocab_rows: int | None = None, parallel_output=True,
                    pp: int = 1, layer_spec=cpu_gemma3_layer_spec):
    """Bridge's Gemma3ModelProvider for ``hf`` on the CPU (the NVTE_* variables cleared first, see
    oracles.common.bridge_provider); ``vocab_rows`` sizes the embedding like a stored one. Also Gemma 3 VL's
    provider (oracles/gemma3_vl.py), with its ``layer_spec``."""
    bridge, provider = bridge_provider(hf, load_weights)
    provider.transformer_layer_spec = layer_spec
    provider.apply_rope_fusion = provider.persist_layer_norm = False
    provider.gradient_accumulation_fusion = False
    provider.tensor_model_parallel_size, provider.pipeline_model_parallel_size = tp, pp
    provider.parallel_output = parallel_output
    size_vocab(provider, vocab_rows)
    provider.finalize()
    return bridge, provider


def build(provider):
    """The model chunks, built as with TE: the final layernorm TENorm (megatron-core's LayerNormImpl with TE;
    set only while this model is built, so other oracles in a test worker keep theirs)."""
    from megatron.core.transformer import transformer_block

    saved = transformer_block.LayerNormImpl
    transformer_block.LayerNormImpl = cpu_classes()["norm"]
    try:
        model = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)
    finally:
        transformer_block.LayerNormImpl = saved
    for m in model:
        m.eval()
    return model


def save_as_bridge(bridge, provider, model, out_dir: str, hf: str) -> None:
    """save_megatron_model, with run_config.yaml recording the layer spec Bridge records (gemma3_layer_spec), not
    the CPU build's (also Gemma 3 VL's save, oracles/gemma3_vl.py)."""
    from megatron.bridge.models.gemma.gemma3_provider import gemma3_layer_spec

    provider.transformer_layer_spec = gemma3_layer_spec
    bridge.save_megatron_model(model, out_dir, hf_tokenizer_path=hf)


# ----------------------------------------------------------------------------- make


def cmd_make(a) -> int:
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    t0 = time.time()
    out = Path(a.hf_dir)
    config = Gemma3TextConfig(**TINY, num_hidden_layers=a.layers, dtype="float32")
    torch.manual_seed(a.seed)
    model = Gemma3ForCausalLM(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            g = torch.Generator().manual_seed(zlib.crc32(f"{a.seed}|{name}".encode()))
            if "norm" in name:  # |w| in [0.2, 0.8], either sign: 1 + w far from 1 and from 0
                mag = 0.2 + 0.6 * torch.rand(p.shape, generator=g)
                sign = torch.where(torch.rand(p.shape, generator=g) < 0.5, -1.0, 1.0)
                p.copy_(sign * mag)
            elif "embed_tokens" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))  # x sqrt(64) at the input
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
    model.save_pretrained(out)
    save_word_tokenizer(out, VOCAB)
    types = config.layer_types
    print(json.dumps({"made": str(out), "layers": a.layers, "layer_types": types,
                      "files": sorted(p.name for p in out.iterdir()), "seconds": round(time.time() - t0, 2)}))
    return 0


# ----------------------------------------------------------------------------- bridge-import


def cmd_bridge_import(a, serving=False) -> int:
    apply_bridge_cpu_shims()

    def save(tp):
        bridge, provider = gemma3_provider(a.hf_dir, load_weights=True, tp=tp, pp=a.pp)
        save_as_bridge(bridge, provider, build(provider), a.out_dir, a.hf_dir)

    return bridge_import(a, serving, save)


# ----------------------------------------------------------------------------- judge


def hf_logits(hf: str, ids):
    import torch
    from transformers import Gemma3ForCausalLM

    model = Gemma3ForCausalLM.from_pretrained(hf, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits.float()


def megatron_logits(model, ids):
    import torch

    pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    with torch.no_grad():
        return unwrap(model[0])(input_ids=ids, position_ids=pos, attention_mask=None).float()


def judge_ids():
    import torch

    g = torch.Generator().manual_seed(1234)
    return torch.randint(3, VOCAB, (2, SEQ), generator=g)


def cmd_judge(a, serving=False) -> int:
    t0 = time.time()
    apply_bridge_cpu_shims()
    from oracles.common import resolve_iter_dir

    iter_dir, truth_dir = Path(resolve_iter_dir(a.megatron_dir)), Path(resolve_iter_dir(a.truth))
    rank, world = init_dist()
    problems: list[str] = []
    info: dict = {"judged": str(iter_dir), "truth": str(truth_dir), "load_tp": world}
    try:
        legacy = is_legacy(iter_dir)
        info["format"] = "legacy" if legacy else "torch_dist"
        info["stored_tp"], info["stored_pp"] = stored_parallel(iter_dir)
        check_recorded(info, problems, {"tp": a.tp, "pp": a.pp})
        rows = None
        if not legacy:
            rows = judge_stored(iter_dir, truth_dir, info, problems, a.allow_vocab_padding)
        model, ref, _ = against_bridge_import(
            lambda load: gemma3_provider(a.hf, load_weights=load, tp=world, vocab_rows=rows, parallel_output=False),
            build, iter_dir, info, problems)
        ids = judge_ids()
        mlog = megatron_logits(model, ids)[..., :VOCAB]
        rlog = megatron_logits(ref, ids)[..., :VOCAB]
        judge_logits(info, problems, mlog, rlog, hf_logits(a.hf, ids), a.atol)
    except Exception as e:  # noqa: BLE001 - a refused load is a verdict, not a crash
        problems.append(judge_error(e))
    return finish_judge(info, problems, world, rank, serving, t0)


# ----------------------------------------------------------------------------- mutate

MUTATIONS = ("value", "norm_plus_one", "swap_gate_up", "swap_k_v", "drop_object")


def cmd_mutate(a, serving=False) -> int:
    """A copy of a checkpoint with one defect, saved the way Bridge saves (to show the judge fails):
    value: one element of layer 3's linear_qkv.weight += 1e-3; norm_plus_one: layer 2's q_layernorm stored as
    1 + w (the zero-centered shift applied twice); swap_gate_up: layer 1's fc1 halves exchanged; swap_k_v:
    layer 0's k and v rows of every query group exchanged; drop_object: no linear_fc2._extra_state."""
    apply_bridge_cpu_shims()
    import torch

    from oracles.common import end_parallel

    rank, world = init_dist()
    try:
        bridge, provider = gemma3_provider(a.hf, load_weights=False, tp=world)
        model = build(provider)
        m = load_to_mutate(model, a.src)
        layers = m.decoder.layers
        with torch.no_grad():
            if a.kind == "value":
                layers[3].self_attention.linear_qkv.weight[5, 7] += 1e-3
            elif a.kind == "norm_plus_one":
                layers[2].self_attention.q_layernorm.weight += 1.0
            elif a.kind == "swap_gate_up":
                w = layers[1].mlp.linear_fc1.weight
                w.copy_(torch.cat(torch.chunk(w.clone(), 2, 0)[::-1]))
            elif a.kind == "swap_k_v":
                w = layers[0].self_attention.linear_qkv.weight
                c = provider.kv_channels
                g = w.view(-1, (provider.num_attention_heads // provider.num_query_groups + 2) * c, w.shape[-1])
                k, v = g[:, -2 * c:-c].clone(), g[:, -c:].clone()
                g[:, -2 * c:-c], g[:, -c:] = v, k
        if a.kind == "drop_object":
            drop_objects(m, lambda k: k.endswith("mlp.linear_fc2._extra_state"))
        save_as_bridge(bridge, provider, model, a.dst, a.hf)
    finally:
        end_parallel(serving)
    if rank == 0:
        print(json.dumps({"mutated": str(a.dst), "kind": a.kind}))
    return 0


# ----------------------------------------------------------------------------- layout


def provider_vs_llama(hf: str) -> dict:
    """The fields of the provider Bridge makes for ``hf`` (to_megatron_provider, not finalized, no CPU
    switches) that differ from the one it makes for a Llama of the same sizes (LlamaConfig with the HF
    config's dims, eps, tying): what makes the Megatron model Gemma 3."""
    import dataclasses

    from megatron.bridge import AutoBridge
    from transformers import AutoConfig, LlamaConfig

    g = AutoConfig.from_pretrained(hf)
    llama = LlamaConfig(vocab_size=g.vocab_size, hidden_size=g.hidden_size, intermediate_size=g.intermediate_size,
                        num_hidden_layers=g.num_hidden_layers, num_attention_heads=g.num_attention_heads,
                        num_key_value_heads=g.num_key_value_heads, head_dim=g.head_dim,
                        max_position_embeddings=g.max_position_embeddings, rms_norm_eps=g.rms_norm_eps,
                        tie_word_embeddings=g.tie_word_embeddings, dtype="float32", architectures=["LlamaForCausalLM"],
                        rope_parameters={"rope_type": "default", "rope_theta": 50000.0})
    other = AutoBridge.from_hf_config(llama).to_megatron_provider(load_weights=False)
    provider = AutoBridge.from_hf_pretrained(hf).to_megatron_provider(load_weights=False)  # as Bridge makes it
    out = {}
    for f in dataclasses.fields(provider):
        with contextlib.suppress(Exception):
            v, p = getattr(provider, f.name), getattr(other, f.name, "<absent>")
            if repr(v) != repr(p) and not f.name.startswith("_"):
                out[f.name] = {"gemma3": repr(v)[:160], "llama": repr(p)[:160]}
    return out


def cmd_layout(a, serving=False) -> int:
    apply_bridge_cpu_shims()
    from oracles.common import end_parallel

    rank, world = init_dist()
    try:
        _, provider = gemma3_provider(a.hf_dir, load_weights=True, tp=world)
        model = build(provider)
        m = unwrap(model[0])
        state = describe_state(m)
        modules = {n: type(mod).__name__ for n, mod in m.named_modules() if n.startswith(("decoder.layers.0.",
                   "decoder.layers.5.", "embedding", "output", "rotary", "decoder.final"))}
        base = provider_vs_llama(a.hf_dir)
        out = {"tp": world, "state_dict": state, "sharded_state_dict": describe_sharded(m.sharded_state_dict()),
               "modules": modules, "provider_vs_bridge_llama": base,
               "layer_windows": {i + 1: l.self_attention.core_attention.scale_mask_softmax.window_size
                                 for i, l in enumerate(m.decoder.layers)},
               "softmax_scale": m.decoder.layers[0].self_attention.core_attention.softmax_scale,
               "rope": {"global_inv_freq": m.rotary_pos_emb.inv_freq.tolist(),
                        "local_inv_freq": m.rotary_pos_emb.rope_local.inv_freq.tolist()}}
        if a.ckpt:
            from oracles.common import resolve_iter_dir

            it = Path(resolve_iter_dir(a.ckpt))
            out["stored"] = {k: (list(v) if v is not None else "object") for k, v in stored_metadata(str(it)).items()}
            out.update(describe_checkpoint(it))
    finally:
        end_parallel(serving)
    if rank == 0:
        emit_layout(out, a.out)
    return 0


# ----------------------------------------------------------------------------- main


def main(argv=None, serving=False) -> int:
    p, cmds = bridge_oracle_parser(__doc__, MUTATIONS)
    cmds["make"].add_argument("--layers", type=int, default=7)
    cmds["make"].add_argument("--seed", type=int, default=7)
    a = p.parse_args(argv)
    if a.cmd == "make":
        return cmd_make(a)
    return {"bridge-import": cmd_bridge_import, "judge": cmd_judge, "layout": cmd_layout,
            "mutate": cmd_mutate}[a.cmd](a, serving)


if __name__ == "__main__":
    run_program(main)
