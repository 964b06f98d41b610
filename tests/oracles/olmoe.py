"""Oracle for two MoE GPT families whose q/k RMSNorm spans ALL heads at once (weight [heads * head_dim], not
[head_dim]): OLMoE (Megatron-Bridge 0.6.2's ``OlMoEBridge``: olmoe_layer_spec, OLMoESelfAttention; transformers'
``OlmoeForCausalLM``) and MiniMax-M2 (Bridge's ``MiniMaxM2Bridge``: minimax_m2_layer_spec, FullDimQNorm /
FullDimKNorm; transformers' ``MiniMaxM2ForCausalLM``), on megatron-core 0.19.2. Which family: HF_DIR/config.json's
model_type. Runs in the second runtime (.venv-mcore19, Python 3.12); imports megatron-core, Megatron-Bridge,
transformers; never dist_convert.

  oracles/olmoe.py make HF_DIR --family olmoe|minimax_m2 [--seed S]
      a tiny random model made by transformers' own classes, fp32, save_pretrained (safetensors) + a 300-token
      WordLevel tokenizer: hidden 64, 4 heads, head_dim 16, vocab 300, 2 layers, every layer MoE with 4 experts of
      ffn 48, top-2, untied lm_head, rope_theta 50000. OLMoE: 4 kv heads (= heads, as released and as Bridge's
      k_layernorm of width heads * head_dim requires), softmax router, norm_topk_prob False, clip_qkv None.
      MiniMax-M2: 2 kv heads, sigmoid router + e_score_correction_bias, partial RoPE: rope_parameters
      partial_rotary_factor 0.5 (transformers) and rotary_dim 8 (what Bridge reads; both in config.json).
      Every tensor random with distinct values, seeded per name: norm weights in [0.5, 1.5] but never 1, router
      2 * randn / sqrt(64), e_score_correction_bias +-[0.15, 0.45] (it changes which experts are chosen: the
      judge counts the tokens). Prints layer 0's on-disk tensors (expert 0's) and config.json.
  oracles/olmoe.py bridge-import HF_DIR OUT_DIR [--pp P] [--ep E]
      Bridge's own import (AutoBridge.from_hf_pretrained, to_megatron_provider(load_weights=True),
      provide_distributed_model on the CPU, save_megatron_model with the HF tokenizer): torch_dist +
      run_config.yaml at TP = world size / (PP * EP)
  oracles/olmoe.py judge MEGATRON_DIR --truth BRIDGE_DIR --hf HF_DIR [--tp N] [--pp N] [--ep E] [--expect-ep E]
      [--atol 1e-4] [--allow-vocab-padding]
      builds Bridge's model for HF_DIR at EP E, TP = world size / E, loads MEGATRON_DIR with megatron-core's
      dist_checkpointing.load (StrictHandling.RAISE_ALL; resharding allowed), TE's check of each _extra_state,
      module.load_state_dict; asserts
        * every loaded tensor == Bridge's own in-memory import of HF_DIR at this layout, bit for bit
        * every stored tensor == BRIDGE_DIR's (load_plain_tensors, global shapes), bit for bit; same objects
        * --tp / --pp / --expect-ep: what the checkpoint records (Megatron-LM args, else run_config.yaml)
        * Megatron logits on fixed ids [2, 12] == transformers' (eager attention, eager experts, fp32) within
          --atol; ``hf_router``: per layer the tokens per expert, the smallest top-k margin (no near-tie) and
          (MiniMax-M2) the tokens whose top-k the expert bias changes
      one JSON line on rank 0 (ok, loaded_tensors, logits_max_abs_diff_vs_hf, stored_tp, stored_pp, stored_ep...);
      exit 1 on any problem. OLMoE runs at TP 1 only (EP 1 or 2): OLMoESelfAttention builds q/k_layernorm of
      width heads * head_dim with no TP all-reduce, so at TP 2 the local [.., 2 * 16] query meets a [64] weight
      (forward fails). MiniMax-M2 runs at TP 1 and 2 (_FullDimRMSNorm all-reduces the sum of squares).
  oracles/olmoe.py load CKPT_DIR --hf HF_DIR [--ep E] [--atol 1e-4]
      a Bridge checkpoint as a Bridge user loads it, by its run_config.yaml alone: Bridge's load_megatron_model
      (load_model_config: instantiate() of the YAML's model: section, its provider class and every field, layer spec
      too) at mp_overrides TP = world size / E, EP = E, expert TP = TP, PP 1 (the YAML's sizes overridden, as when
      resuming at another layout); the weights strictly (dist_ckpt_strictness="raise_all"; load_state_dict's missing
      keys but the _extra_state Bridge deletes, and unexpected ones: Bridge's strict mode only prints them). Asserts:
      the build called the YAML's layer-spec function; MATH_FIELDS == Bridge's provider for HF_DIR (callables by
      qualified name); loaded tensors == Bridge's in-memory import (vocab gathered over TP, vocab_size rows compared,
      the rest zero); logits (gathered over TP) == transformers' within --atol. No run_config.yaml: refused.
  oracles/olmoe.py mutate SRC DST --hf HF_DIR --kind value|swap_qk_norm
      value: one element of layer 1's q_layernorm weight += 1e-3; swap_qk_norm: layer 0's q and k norm weights
      exchanged where shapes allow (OLMoE [64] / [64]), else k norm reversed (MiniMax-M2 [64] / [32]); saved as
      Bridge saves at TP = world size: the judge must fail on DST
  oracles/olmoe.py layout HF_DIR [--ckpt DIR] [--out JSON] [--ep E]
      state_dict names / shapes, sharded_state_dict (keys, global shapes, offsets, replica ids, ShardedObjects),
      layer-0 module classes, the provider's MoE / rope fields, run_config.yaml fields that differ from
      GPTModelProvider's defaults; with --ckpt the stored keys (.metadata), common state, run_config.yaml model

The CPU stand-ins (Transformer Engine has no CPU build). Both Bridge specs are megatron-core's
get_gpt_layer_with_transformer_engine_spec(num_experts=4, moe_grouped_gemm=True, qk_layernorm=True), which asks
gpt_layer_specs.TESpecProvider for every leaf: while a model is built, oracles.te_vl.gpt_build_patches puts in
te_vl's CPU TESpecProvider (TELayerNormColumnParallelLinear linear_qkv with the input RMSNorm fused as
``layer_norm_weight``; TEDotProductAttention -> megatron-core's local DotProductAttention; TERowParallelLinear
linear_proj; TENorm (te RMSNorm op, ``weight``) for pre_mlp_layernorm, OLMoE's q/k_layernorm and the final
layernorm; megatron-core's TEGroupedMLP over TEColumn/RowParallelGroupedLinear stand-ins ``weight0..N-1``), the
same parameter names, _extra_state, sharded_state_dict and class names (Bridge's AutoMapping picks TP splits by
them) as oracles/qwen3_vl.py documents; all compute TE's math in fp32. MiniMax-M2's q/k norms are Bridge's own
_FullDimRMSNorm (plain torch). Router, dispatcher, MoELayer, TEGroupedMLP, SelfAttention and OLMoESelfAttention are
the libraries' own code. Provider switches needing CUDA/TE, changed for the CPU build and put back before every save
(run_config.yaml records Bridge's values; qwen3_vl.MOE_CPU_SWITCHES): moe_token_dispatcher_type alltoall ->
allgather, moe_permute_fusion True -> False, sequence_parallel -> False. One mapping shim: Bridge's
_FullDimQKNormMapping.hf_to_megatron (MiniMax-M2, TP > 1) puts the HF weight on torch.device("cuda", ...) before
its TP broadcast; here its own source with torch.device("cpu") (same broadcast, same slice). Other CPU shims:
oracles.te_cpu.apply_bridge_cpu_shims. ``load`` builds under the same patches, MOE_CPU_SWITCHES put on the config the
YAML gives (its values reported: yaml_cpu_switches).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import sys
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the oracles package, helpers

from oracles import te_vl  # noqa: E402
from oracles.common import (  # noqa: E402
    bridge_import,
    bridge_oracle_parser,
    bridge_provider,
    check_recorded,
    compare,
    describe_checkpoint,
    describe_sharded,
    describe_state,
    emit_layout,
    finish_judge,
    hf_file_tensors,
    init_dist,
    is_legacy,
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
    tensor_state,
    unwrap,
)
from oracles.qwen3_vl import MOE_CPU_SWITCHES, stored_ep  # noqa: E402
from oracles.te_cpu import against_bridge_import, apply_bridge_cpu_shims, load_to_mutate  # noqa: E402

VOCAB = 300
SEQ = 12
COMMON = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 48, "num_hidden_layers": 2,
          "num_attention_heads": 4, "max_position_embeddings": 64, "tie_word_embeddings": False,
          "num_experts_per_tok": 2, "hidden_act": "silu", "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2}
FAMILIES = {
    "olmoe": {"arch": "OlmoeForCausalLM", "config": "OlmoeConfig",
              "kw": {"num_key_value_heads": 4, "num_experts": 4, "norm_topk_prob": False, "clip_qkv": None,
                     "rms_norm_eps": 1e-5, "rope_parameters": {"rope_type": "default", "rope_theta": 50000.0}}},
    "minimax_m2": {"arch": "MiniMaxM2ForCausalLM", "config": "MiniMaxM2Config",
                   "kw": {"num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 4, "rms_norm_eps": 1e-6,
                          "rotary_dim": 8, "rope_parameters": {"rope_type": "default", "rope_theta": 50000.0,
                                                               "partial_rotary_factor": 0.5}}},
}
MUTATIONS = ("value", "swap_qk_norm")
_BRIDGE_SETTINGS: dict[int, dict] = {}  # id(provider) -> Bridge's values of what the CPU build changed


def family(hf_dir: str) -> str:
    mt = json.loads((Path(hf_dir) / "config.json").read_text()).get("model_type")
    if mt not in FAMILIES:
        raise SystemExit(f"{hf_dir}: model_type {mt!r}, not one of {sorted(FAMILIES)}")
    return mt


# ----------------------------------------------------------------------------- the model


def cpu_fulldim_mapping() -> None:
    """Bridge's _FullDimQKNormMapping.hf_to_megatron, its own source with the HF weight on the CPU instead of
    torch.device("cuda", current_device()) (the broadcast to the TP ranks and the slice unchanged)."""
    import inspect
    import textwrap

    from megatron.bridge.models.minimax_m2 import minimax_m2_bridge as mb

    cls = mb._FullDimQKNormMapping
    if getattr(cls, "_oracle_cpu", False):
        return
    src = textwrap.dedent(inspect.getsource(cls.hf_to_megatron))
    old = 'torch.device("cuda", torch.cuda.current_device())'
    assert src.count(old) == 1, "Bridge's _FullDimQKNormMapping.hf_to_megatron changed; update the shim"
    scope = dict(vars(mb))
    exec(compile(src.replace(old, 'torch.device("cpu")'), inspect.getsourcefile(cls), "exec"), scope)
    cls.hf_to_megatron, cls._oracle_cpu = scope["hf_to_megatron"], True


def moe_provider(hf: str, load_weights: bool, tp: int, pp: int = 1, ep: int = 1, vocab_rows: int | None = None,
                 parallel_output: bool = True):
    """Bridge's provider for ``hf`` on the CPU at TP/PP/EP; MOE_CPU_SWITCHES applied (Bridge's values kept in
    _BRIDGE_SETTINGS, put back by save_as_bridge); ``vocab_rows`` sizes the embedding like a stored one."""
    cpu_fulldim_mapping()
    bridge, provider = bridge_provider(hf, load_weights)
    fam = family(hf)
    assert type(bridge._model_bridge).__name__ == {"olmoe": "OlMoEBridge", "minimax_m2": "MiniMaxM2Bridge"}[fam]
    assert not provider.use_te_activation_func and not provider.moe_shared_expert_intermediate_size
    assert provider.moe_grouped_gemm and provider.qk_layernorm
    provider.tensor_model_parallel_size, provider.pipeline_model_parallel_size = tp, pp
    provider.expert_model_parallel_size = ep
    provider.parallel_output = parallel_output
    size_vocab(provider, vocab_rows)
    saved = {k: getattr(provider, k) for k in ("moe_token_dispatcher_type", "moe_permute_fusion")}
    for k in saved:
        setattr(provider, k, MOE_CPU_SWITCHES[k])
    provider.finalize()
    saved["sequence_parallel"] = provider.sequence_parallel
    provider.sequence_parallel = MOE_CPU_SWITCHES["sequence_parallel"]
    _BRIDGE_SETTINGS[id(provider)] = saved
    return bridge, provider


def build(provider):
    with te_vl.gpt_build_patches(te_vl.cpu_backend("OLMoE/MiniMax-M2")):
        model = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)
    for m in model:
        m.eval()
    return model


def save_as_bridge(bridge, provider, model, out_dir: str, hf: str) -> None:
    """save_megatron_model with Bridge's own provider settings in place (run_config.yaml records them)."""
    saved = _BRIDGE_SETTINGS.get(id(provider), {})
    cpu = {k: getattr(provider, k) for k in saved}
    for k, v in saved.items():
        setattr(provider, k, v)
    try:
        bridge.save_megatron_model(model, out_dir, hf_tokenizer_path=hf)
    finally:
        for k, v in cpu.items():
            setattr(provider, k, v)


# ----------------------------------------------------------------------------- make


def make(a) -> int:
    import torch
    import transformers

    t0 = time.time()
    fam = FAMILIES[a.family]
    rope = fam["kw"]["rope_parameters"]
    if "rotary_dim" in fam["kw"]:  # Bridge reads rotary_dim, transformers partial_rotary_factor: they must agree
        assert fam["kw"]["rotary_dim"] == fam["kw"]["head_dim"] * rope["partial_rotary_factor"], fam["kw"]
    out = Path(a.hf_dir)
    config = getattr(transformers, fam["config"])(**COMMON, **fam["kw"], dtype="float32",
                                                  architectures=[fam["arch"]])
    torch.manual_seed(a.seed)
    model = getattr(transformers, fam["arch"])(config).float()
    persistent = set(model.state_dict())
    with torch.no_grad():
        tensors = [*model.named_parameters(), *((n, b) for n, b in model.named_buffers() if n in persistent)]
        for name, p in tensors:
            g = torch.Generator().manual_seed(zlib.crc32(f"{a.seed}|{name}".encode()))
            if name.endswith("e_score_correction_bias"):  # +-[0.15, 0.45]: sigmoid scores are in (0, 1)
                mag = 0.15 + 0.3 * torch.rand(p.shape, generator=g)
                p.copy_(torch.where(torch.rand(p.shape, generator=g) < 0.5, -mag, mag))
            elif name.endswith(".mlp.gate.weight"):  # the router [E, H]: decisive top-k
                p.copy_(2.0 * torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
            elif "norm" in name and name.endswith("weight"):  # [0.5, 1.5], never exactly 1
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
                p.masked_fill_(p == 1.0, 1.25)
            elif "embed_tokens" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif p.dim() >= 2:  # linears [out, in]; fused experts [E, 2F, H] / [E, H, F]: fan-in last
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
            else:
                raise SystemExit(f"make: no rule for {name} {tuple(p.shape)}")
    model.save_pretrained(out)
    save_word_tokenizer(out, VOCAB)
    saved = hf_file_tensors(out)
    cfg = json.loads((out / "config.json").read_text())
    layer0 = {k: v["shape"] for k, v in saved.items() if ".layers.0." in k and ".experts.1" not in k
              and ".experts.2" not in k and ".experts.3" not in k}
    print(json.dumps({"made": str(out), "family": a.family, "architecture": fam["arch"], "n_tensors": len(saved),
                      "layer0_tensors": layer0, "config_json": cfg, "files": sorted(p.name for p in out.iterdir()),
                      "seconds": round(time.time() - t0, 2)}))
    return 0


# ----------------------------------------------------------------------------- bridge-import


def cmd_bridge_import(a, serving=False) -> int:
    apply_bridge_cpu_shims()

    def save(tp):
        bridge, provider = moe_provider(a.hf_dir, load_weights=True, tp=tp, pp=a.pp, ep=a.ep)
        save_as_bridge(bridge, provider, build(provider), a.out_dir, a.hf_dir)
        return {"family": family(a.hf_dir)}

    return bridge_import(a, serving, save, a.ep)


# ----------------------------------------------------------------------------- judge


def judge_ids():
    import torch

    return torch.randint(3, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1234))


def megatron_logits(model, ids):
    import torch

    pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    with torch.no_grad():
        return unwrap(model[0])(input_ids=ids, position_ids=pos, attention_mask=None).float()


def hf_logits(hf: str, ids, router: dict):
    """transformers' logits (eager attention, eager experts, fp32; its load must be clean), and in ``router`` per
    layer the tokens each expert gets, the smallest gap between the k-th and (k+1)-th choice score (softmax prob;
    MiniMax-M2: sigmoid + bias) and, MiniMax-M2, the tokens whose top-k the bias changes."""
    import torch
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32, attn_implementation="eager",
                                                       experts_implementation="eager", output_loading_info=True)
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if bad:
        raise RuntimeError(f"transformers' load of {hf} is not clean: {bad}")
    seen = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda mod, i, o: seen.append(o[0].detach()))
             for layer in model.model.layers]
    with torch.no_grad():
        logits = model.eval()(input_ids=ids, use_cache=False).logits.float()
    for h in hooks:
        h.remove()
    k = model.config.num_experts_per_tok
    counts, margins, changed = [], [], []
    for layer, rl in zip(model.model.layers, seen, strict=True):
        bias = getattr(layer.mlp, "e_score_correction_bias", None)
        scores = torch.sigmoid(rl.float()) if bias is not None else torch.softmax(rl.float(), -1)
        choice = scores + bias if bias is not None else scores
        top = choice.topk(k, -1).indices
        s = choice.sort(-1, descending=True).values
        counts.append(torch.bincount(top.flatten(), minlength=rl.shape[-1]).tolist())
        margins.append((s[:, k - 1] - s[:, k]).min().item())
        if bias is not None:
            plain = scores.topk(k, -1).indices
            changed.append(int((top.sort(-1).values != plain.sort(-1).values).any(-1).sum()))
    router.update(tokens_per_expert=counts, min_topk_margin=min(margins))
    if changed:
        router["tokens_rerouted_by_bias"] = changed
    return logits


def cmd_judge(a, serving=False) -> int:
    t0 = time.time()
    apply_bridge_cpu_shims()
    from oracles.common import resolve_iter_dir

    iter_dir, truth_dir = Path(resolve_iter_dir(a.megatron_dir)), Path(resolve_iter_dir(a.truth))
    rank, world = init_dist(1, a.ep)
    tp = world // a.ep
    problems: list[str] = []
    info: dict = {"judged": str(iter_dir), "truth": str(truth_dir), "family": family(a.hf), "load_tp": tp,
                  "load_ep": a.ep}
    try:
        if is_legacy(iter_dir):
            raise RuntimeError("a legacy (mp_rank_*) checkpoint: this judge reads torch_dist only")
        info["stored_tp"], info["stored_pp"] = stored_parallel(iter_dir)
        info["stored_ep"] = stored_ep(iter_dir)
        check_recorded(info, problems, {"tp": a.tp, "pp": a.pp, "ep": a.expect_ep})
        rows = judge_stored(iter_dir, truth_dir, info, problems, a.allow_vocab_padding)
        model, ref, _ = against_bridge_import(
            lambda load: moe_provider(a.hf, load, tp, ep=a.ep, vocab_rows=rows, parallel_output=False), build,
            iter_dir, info, problems)
        if info["family"] == "olmoe" and tp > 1:  # the forward would fail on a shape mismatch
            raise RuntimeError(f"OLMoE at TP {tp}: Bridge's OLMoESelfAttention builds q/k_layernorm of width heads * "
                               "head_dim without a TP all-reduce; it runs at TP 1 only (use --ep for 2 ranks)")
        ids = judge_ids()
        router: dict = {}
        hlog = hf_logits(a.hf, ids, router)
        info["hf_router"] = router
        judge_logits(info, problems, megatron_logits(model, ids)[..., :VOCAB],
                     megatron_logits(ref, ids)[..., :VOCAB], hlog, a.atol)
    except Exception as e:  # noqa: BLE001 - a refused load is a verdict, not a crash
        problems.append(judge_error(e))
    return finish_judge(info, problems, world, rank, serving, t0)


# ----------------------------------------------------------------------------- load (run_config.yaml alone)

MATH_FIELDS = """num_layers hidden_size ffn_hidden_size moe_ffn_hidden_size num_attention_heads num_query_groups
kv_channels rotary_percent rotary_base rotary_interleaved position_embedding_type normalization layernorm_epsilon
layernorm_zero_centered_gamma qk_layernorm gated_linear_unit activation_func add_bias_linear add_qkv_bias
num_moe_experts moe_layer_freq moe_shared_expert_intermediate_size moe_router_topk moe_router_score_function
moe_router_pre_softmax moe_router_enable_expert_bias moe_router_topk_scaling_factor moe_router_num_groups
moe_router_group_topk share_embeddings_and_output_weights softmax_scale softmax_type window_size attention_output_gate
multi_latent_attention apply_residual_connection_post_layernorm params_dtype transformer_layer_spec""".split()


def named(v):
    """A callable (activation, layer spec, provider class) by its qualified name; anything else as it is."""
    return f"{v.__module__}.{v.__qualname__}" if callable(v) and hasattr(v, "__qualname__") else v


@contextlib.contextmanager
def yaml_loader_patches(seen: dict, problems: list[str]):
    """While Bridge's load_megatron_model runs (patches, the module docstring's ``load``): load_model_config's
    result in ``seen`` (cfg, spec, spec_called, yaml_cpu_switches); load_state_dict's missing / unexpected keys in
    ``problems``."""
    from megatron.bridge.training import checkpointing as ck
    from megatron.bridge.training import model_load_save as mls

    saved = mls.load_model_config, ck._load_model_weights_from_checkpoint, ck._load_model_state_dict

    def load_model_config(path):
        cfg, args = saved[0](path)
        seen.update(cfg=cfg, spec=cfg.transformer_layer_spec, spec_called=[],
                    yaml_cpu_switches={k: getattr(cfg, k) for k in MOE_CPU_SWITCHES})
        for k, v in MOE_CPU_SWITCHES.items():
            setattr(cfg, k, v)
        if callable(spec := seen["spec"]):
            @functools.wraps(spec)
            def called(*args, **kw):
                seen["spec_called"].append(named(spec))
                return spec(*args, **kw)

            cfg.transformer_layer_spec = called
        return cfg, args

    def state_dict_strict(module, state_dict, strict):
        res = module.load_state_dict(state_dict, strict=False)
        problems.extend(f"load_state_dict: missing {k}" for k in res.missing_keys if not k.endswith("._extra_state"))
        problems.extend(f"load_state_dict: unexpected {k}" for k in res.unexpected_keys)

    mls.load_model_config, ck._load_model_state_dict = load_model_config, state_dict_strict
    ck._load_model_weights_from_checkpoint = functools.partial(saved[1], dist_ckpt_strictness="raise_all")
    try:
        yield
    finally:
        mls.load_model_config, ck._load_model_weights_from_checkpoint, ck._load_model_state_dict = saved


def cmd_load(a, serving=False) -> int:
    t0 = time.time()
    apply_bridge_cpu_shims()
    import torch
    import yaml
    from megatron.bridge.training.model_load_save import load_megatron_model
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region as gather_last
    from torch.distributed.checkpoint.api import CheckpointException

    from oracles.common import resolve_iter_dir, tp_gathered

    iter_dir = Path(resolve_iter_dir(a.ckpt_dir))
    rank, world = init_dist(1, a.ep)
    tp, fam, seen, problems = world // a.ep, family(a.hf), {}, []
    vocab = json.loads((Path(a.hf) / "config.json").read_text())["vocab_size"]
    info: dict = {"loaded": str(iter_dir), "hf": a.hf, "family": fam, "load_tp": tp, "load_ep": a.ep, "load_pp": 1}
    try:
        if not (iter_dir / "run_config.yaml").is_file():
            raise RuntimeError(f"no run_config.yaml in {iter_dir}: not a Megatron-Bridge checkpoint (load judges "
                               "a Bridge checkpoint by its run_config.yaml alone)")
        target = yaml.safe_load((iter_dir / "run_config.yaml").read_text())["model"].get("transformer_layer_spec")
        target = target.get("_target_") if isinstance(target, dict) else target
        _, ref_provider = moe_provider(a.hf, True, tp, ep=a.ep, parallel_output=False)
        ref = build(ref_provider)  # Bridge's own import of HF_DIR at this layout, in memory
        over = {"tensor_model_parallel_size": tp, "expert_model_parallel_size": a.ep, "expert_tensor_parallel_size": tp}
        with te_vl.gpt_build_patches(te_vl.cpu_backend("OLMoE/MiniMax-M2")), yaml_loader_patches(seen, problems):
            model = load_megatron_model(str(iter_dir), use_cpu_init=True, skip_temp_dist_context=True,
                                        mp_overrides=over)
        if seen["spec_called"] != [target]:
            problems.append(f"run_config.yaml names the layer spec {target}; the build called {seen['spec_called']}")
        model = [m.eval() for m in (model if isinstance(model, list) else [model])]
        got, want = tensor_state(model), tensor_state(ref)
        info["loaded_tensors"] = len(got)
        for k in ("embedding.word_embeddings.weight", "output_layer.weight"):  # gathered over TP: every rank
            g, w = tp_gathered(got[k]), tp_gathered(want[k])  # the true vocab's rows; padding rows must be 0
            if g.shape[0] < vocab or torch.count_nonzero(g[vocab:]):
                problems.append(f"{k}: {g.shape[0]} rows, vocab {vocab}: too few, or padding rows not zero")
            got[k], want[k] = g[:vocab], w[:vocab]
        problems += compare(got, want, "loaded vs Bridge import")
        if fam == "olmoe" and tp > 1:
            raise RuntimeError(f"OLMoE at TP {tp}: Bridge's OLMoESelfAttention runs at TP 1 only (see judge)")
        ids, router = judge_ids(), {}
        hlog = hf_logits(a.hf, ids, router)
        info["hf_router"] = router
        with torch.no_grad():  # the YAML's parallel_output (True): the vocab split over TP, gathered
            mlog = gather_last(megatron_logits(model, ids))
        judge_logits(info, problems, mlog[..., :vocab], megatron_logits(ref, ids)[..., :vocab], hlog[..., :vocab],
                     a.atol)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - a refused load is a verdict, not a crash
        judge_error(e)  # its traceback; the message whole (which keys a strict load refused), on one line; DCP's
        # CheckpointException (a BaseException): the first failed rank's own exception
        r, (err, _) = next(iter(fails.items())) if (fails := getattr(e, "failures", None)) else (None, (e, None))
        where = f"CheckpointException (rank {r}): " if fails else ""
        problems.append(f"{where}{type(err).__name__}: {' '.join(str(err).split())}"[:500])
    if "cfg" in seen:  # the config verdict (first), also where the build or the load failed
        cfg, spec = seen["cfg"], seen["spec"]  # the layer-spec function before the call recorder
        info.update(provider_class=named(type(cfg)), yaml_cpu_switches=seen["yaml_cpu_switches"], yaml_vocab_size=
                    cfg.vocab_size, layer_spec={"run_config": target, "called": seen["spec_called"],
                                                "bridge": named(ref_provider.transformer_layer_spec)})
        info["config_mismatches"] = {f: {"run_config": repr(g), "bridge": repr(w)} for f in MATH_FIELDS if
                                     (g := named(spec if f == "transformer_layer_spec" else getattr(cfg, f, "-")))
                                     != (w := named(getattr(ref_provider, f, "-")))}
        problems[:0] = [f"config {k}: run_config.yaml {v['run_config']}, Bridge's provider for HF_DIR {v['bridge']}"
                        for k, v in info["config_mismatches"].items()]
    return finish_judge(info, problems, world, rank, serving, t0)


# ----------------------------------------------------------------------------- mutate


def cmd_mutate(a, serving=False) -> int:
    """A copy of SRC with one defect (see the module docstring), saved as Bridge saves, at TP = world size."""
    apply_bridge_cpu_shims()
    import torch

    from oracles.common import end_parallel

    rank, world = init_dist()
    how = a.kind
    try:
        bridge, provider = moe_provider(a.hf, load_weights=False, tp=world)
        model = build(provider)
        layers = load_to_mutate(model, a.src).decoder.layers
        with torch.no_grad():
            if a.kind == "value":
                layers[1].self_attention.q_layernorm.weight[3] += 1e-3
            else:
                q, k = layers[0].self_attention.q_layernorm.weight, layers[0].self_attention.k_layernorm.weight
                if q.shape == k.shape:
                    tmp = q.clone()
                    q.copy_(k)
                    k.copy_(tmp)
                    how = f"q/k norm weights {list(q.shape)} exchanged"
                else:
                    k.copy_(k.flip(0))
                    how = f"k norm {list(k.shape)} reversed (q {list(q.shape)})"
        save_as_bridge(bridge, provider, model, a.dst, a.hf)
    finally:
        end_parallel(serving)
    if rank == 0:
        print(json.dumps({"mutated": str(a.dst), "kind": a.kind, "how": how}))
    return 0


# ----------------------------------------------------------------------------- layout


def gpt_default_diffs(model_cfg: dict) -> dict:
    """run_config.yaml model fields whose value differs from GPTModelProvider's dataclass default (scalars and
    strings only; _target_ and callables as recorded)."""
    from megatron.bridge.models.gpt_provider import GPTModelProvider

    out = {}
    for f in dataclasses.fields(GPTModelProvider):
        if f.name not in model_cfg:
            continue
        d = f.default if f.default is not dataclasses.MISSING else "<no default>"
        v = model_cfg[f.name]
        if isinstance(v, (dict, list)) or isinstance(d, (dict, list)):
            if repr(v) != repr(d):
                out[f.name] = {"run_config": repr(v)[:200], "gpt_default": repr(d)[:120]}
        elif v != d and not (callable(d) and isinstance(v, str)):
            out[f.name] = {"run_config": v, "gpt_default": repr(d)[:120]}
        elif callable(d):
            out[f.name] = {"run_config": repr(v)[:200], "gpt_default": getattr(d, "__name__", repr(d))}
    return out


PROVIDER_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
                   "ffn_hidden_size", "moe_ffn_hidden_size", "normalization", "layernorm_epsilon", "qk_layernorm",
                   "rotary_percent", "rotary_base", "position_embedding_type", "num_moe_experts", "moe_router_topk",
                   "moe_router_score_function", "moe_router_pre_softmax", "moe_router_enable_expert_bias",
                   "moe_router_topk_scaling_factor", "moe_router_dtype", "moe_grouped_gemm", "moe_layer_freq",
                   "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_token_dispatcher_type",
                   "moe_permute_fusion", "share_embeddings_and_output_weights", "vocab_size", "should_pad_vocab",
                   "gated_linear_unit", "activation_func", "add_bias_linear", "add_qkv_bias", "persist_layer_norm",
                   "sequence_parallel", "expert_model_parallel_size", "expert_tensor_parallel_size")


def cmd_layout(a, serving=False) -> int:
    apply_bridge_cpu_shims()
    import torch.distributed as dist

    from oracles.common import end_parallel, resolve_iter_dir

    rank, world = init_dist(1, a.ep)
    tp = world // a.ep
    try:
        _, provider = moe_provider(a.hf_dir, load_weights=True, tp=tp, ep=a.ep)
        m = unwrap(build(provider)[0])
        mine = {"state_dict": describe_state(m),
                "sharded_state_dict": object_replicas(m, describe_sharded(m.sharded_state_dict()), factories=True)}
        every = [None] * world
        dist.all_gather_object(every, mine)
        out = {"family": family(a.hf_dir), "tp": tp, "ep": a.ep, "ranks": every,
               "modules": {n: type(mod).__name__ for n, mod in m.named_modules() if ".layers.1." not in n + "."},
               "provider": {k: repr(getattr(provider, k, "<absent>"))[:120] for k in PROVIDER_FIELDS},
               "cpu_switches": {"bridge": _BRIDGE_SETTINGS.get(id(provider)), "cpu_build": MOE_CPU_SWITCHES}}
        if a.ckpt:
            it = Path(resolve_iter_dir(a.ckpt))
            out["stored"] = dict(sorted(stored_detail(str(it)).items()))
            out.update(describe_checkpoint(it))
            if out.get("run_config_model"):
                out["run_config_vs_gpt_defaults"] = gpt_default_diffs(out["run_config_model"])
    finally:
        end_parallel(serving)
    if rank == 0:
        emit_layout(out, a.out)
    return 0


# ----------------------------------------------------------------------------- main


def main(argv=None, serving=False) -> int:
    p, cmds = bridge_oracle_parser(__doc__, MUTATIONS, pp_help="pipeline stages (TP = world size / (PP * EP))")
    cmds["make"].add_argument("--family", choices=sorted(FAMILIES), required=True)
    cmds["make"].add_argument("--seed", type=int, default=7)
    cmds["bridge-import"].add_argument("--ep", type=int, default=1, help="expert parallel")
    cmds["judge"].add_argument("--ep", type=int, default=1, help="load at EP N (TP = world size / N)")
    cmds["judge"].add_argument("--expect-ep", type=int, default=None, help="the EP the checkpoint must record")
    cmds["layout"].add_argument("--ep", type=int, default=1, help="expert parallel N (TP = world size / N)")
    sub = next(x for x in p._actions if isinstance(x, argparse._SubParsersAction))
    sp = sub.add_parser("load", help="a Bridge checkpoint built from its run_config.yaml alone")
    sp.add_argument("ckpt_dir")
    sp.add_argument("--hf", required=True)
    sp.add_argument("--ep", type=int, default=1, help="load at EP N (TP = world size / N)")
    sp.add_argument("--atol", type=float, default=1e-4, help="logits vs transformers, max abs")
    a = p.parse_args(argv)
    if a.cmd == "make":
        return make_on_rank0(make, a)
    return {"bridge-import": cmd_bridge_import, "judge": cmd_judge, "layout": cmd_layout,
            "mutate": cmd_mutate, "load": cmd_load}[a.cmd](a, serving)


if __name__ == "__main__":
    run_program(main)
