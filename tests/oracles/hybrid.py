"""Oracle for megatron-core's HybridModel (``megatron/core/models/hybrid``, megatron-core 0.19.2; the successor of
GPTModel): builds the model from a GPT config (``tests/oracles/mcore.py``'s JSON) and a hybrid layer pattern, loads a
checkpoint into it strictly and computes its logits the way ``mcore.py logits`` does for a GPTModel, so the two can
be compared. Runs in the second runtime (.venv-mcore19); imports megatron-core only (never dist_convert).

  torchrun --nproc_per_node=N tests/oracles/hybrid.py logits --config C.json [--pattern P] --tp T [--pp P] [--ep E] \
      --ckpt X --out F.pt
  torchrun --nproc_per_node=N tests/oracles/hybrid.py bridge --config C.json --tp T [--ep E] --ckpt X --out F.pt [--mtp]

``bridge``: a Megatron-Bridge checkpoint, built by Megatron-Bridge 0.6.2 from its own run_config.yaml
(``load_model_config``: its HybridModelProvider, whose ``provide`` builds the HybridModel; rank 0 prints ``ORACLE
PROVIDER``), loaded and run as ``logits`` does (``--mtp``: its MTP depths' losses, as ``logits --mtp``). Without
``--pattern`` the model is built from the pattern in the checkpoint's args, as Megatron-LM builds it under
``--use-checkpoint-args``. With ``--pp``, each rank builds its chunks as Megatron-LM's ``get_model`` does (one per
virtual stage: HybridModel(vp_stage=v); the '|' segments of the pattern place the layers, megatron-core's own
``select_pipeline_segment``), loads them strictly (``model0``, ``model1``, ... where VPP > 1) and runs one forward
through the stages in order (``pipeline_logits``); the last stage saves the logits (``ORACLE PIPELINE`` says the
segments and each chunk's layer count).

The HybridStack spec the checkpoint's args name (``spec``, imported as Megatron-LM's hybrid builder imports its
``--spec`` under ``--use-checkpoint-args``; megatron-core's own ``hybrid_stack_spec`` where none is named) builds the
model (rank 0 prints ``ORACLE SPEC module.name``), its Transformer Engine classes stood in by CPU modules
of the same names and state (``oracles.nemotron_h.cpu_hybrid_stack_spec``: each swapped slot must hold the expected
TE class; MoE layers: TEGroupedMLP over stand-in grouped linears; the q/k norms megatron-core 0.19's SelfAttention
builds from ``qk_layernorm`` where the spec names none: TENorm, stood in too). The TransformerConfig is mcore.py's
(``transformer_config``) with ``num_layers`` = the pattern's length.
The checkpoint is loaded with dist_checkpointing.load(StrictHandling.RAISE_ALL) (no missing, no unexpected key),
TE's check of each ``_extra_state`` and load_state_dict (``oracles.te_cpu.load_strict``); the model is randomised
first so nothing it lacks passes as loaded. Rank 0 saves {"tokens", "logits"} (the true vocabulary's columns,
gathered over TP) and prints ``ORACLE LOGITS <shape> -> F.pt``; a failed strict load exits 1 naming the problems.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the oracles package


def _mla_swaps(te_ext, c, sub, attn) -> list:
    """The TE leaves of an MLA / DSA layer (its input norm and MLA projections) and oracles.dsa's stand-ins."""
    return [(sub, "input_layernorm", te_ext.TENorm, c["norm"]),
            (attn, "linear_q_proj", te_ext.TEColumnParallelLinear, c["col"]),
            (attn, "linear_q_down_proj", te_ext.TELinear, c["linear"]),
            (attn, "linear_q_up_proj", te_ext.TEColumnParallelLinear, c["col"]),
            (attn, "linear_kv_down_proj", te_ext.TELinear, c["linear"]),
            (attn, "linear_kv_up_proj", te_ext.TEColumnParallelLinear, c["col"]),
            (attn, "linear_proj", te_ext.TERowParallelLinear, c["row"])]


def cpu_attention_layers(stack, submodules) -> None:
    """Into ``submodules`` (a copy of a HybridStack's): the multi-latent attention (``+``) and DeepSeek-sparse-
    attention (``D``) layers and the MTP block of ``stack`` (None: megatron-core's hybrid_stack_spec), their TE leaves
    swapped for oracles.dsa's stand-ins (TELinear "duplicated", TE's k/v channels in the attention core, the
    indexer's linears and key norm; DSAttention and the indexer stay megatron-core's). Their q/kv norms are the
    spec's IdentityOp: megatron-core's resolver (mla_qk_norm_config) fuses them into linear_q_up_proj /
    linear_kv_up_proj (MLA) or makes standalone norms (DSA) from ``qk_layernorm``, taking the modules from the backend
    (``oracles.dsa.cpu_spec_backend`` while the model is built). The MTP layers' inner layers come from the pattern
    after ``/`` and the stack's own layer specs."""
    import copy

    from megatron.core.extensions import transformer_engine as te_ext
    from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec

    from oracles import dsa
    from oracles.nemotron_h import own, swap

    c = dsa.cpu_classes()
    source = copy.copy((stack or hybrid_stack_spec).submodules)
    mla_sub = own(source, "mla_layer", "submodules")
    mla = own(mla_sub, "self_attention", "submodules")
    swap("mla_layer", _mla_swaps(te_ext, c, mla_sub, mla) + [
        (mla, "core_attention", te_ext.TEDotProductAttention, c["attn"])])
    dsa_sub = own(source, "dsa_layer", "submodules")
    attn = own(dsa_sub, "self_attention", "submodules")
    indexer = own(attn, "core_attention", "submodules", "indexer", "submodules")
    swap("dsa_layer", _mla_swaps(te_ext, c, dsa_sub, attn) + [
        (indexer, "linear_wq_b", te_ext.TELinear, c["linear"]), (indexer, "linear_wk", te_ext.TELinear, c["linear"]),
        (indexer, "k_norm", te_ext.TENorm, c["norm"]), (indexer, "linear_weights_proj", te_ext.TELinear, c["linear"])])
    block = own(source, "mtp_block_spec", "submodules")
    layers = [copy.copy(layer) for layer in block.layer_specs]
    for layer in layers:
        sub = own(layer, "submodules")
        swap("mtp layer", [(sub, name, want, new) for name, want, new in (
            ("enorm", te_ext.TENorm, c["norm"]), ("hnorm", te_ext.TENorm, c["norm"]),
            ("eh_proj", te_ext.TEColumnParallelLinear, c["col"]), ("layer_norm", te_ext.TENorm, c["norm"]))])
    block.layer_specs = layers
    submodules.mla_layer, submodules.dsa_layer = source.mla_layer, source.dsa_layer
    submodules.mtp_block_spec = source.mtp_block_spec


def cpu_switches(config) -> None:
    """The CUDA-kernel switches of ``config`` turned off (none changes a weight or the math)."""
    from oracles import nemotron_h

    for k, v in nemotron_h.CPU_SWITCHES.items():
        if hasattr(config, k):
            setattr(config, k, v)


@contextlib.contextmanager
def on_cpu(config, pattern: str, stack=None):
    """The HybridStack spec ``stack`` (None: megatron-core's own) with its Transformer Engine classes stood in by CPU
    modules (see the module docstring), for a HybridModel of ``config`` and ``pattern`` built inside the block: the
    CUDA-kernel switches of ``config`` turned off, TENorm stood in where megatron-core's modules import it by name."""
    from megatron.core.models.hybrid import hybrid_block
    from megatron.core.transformer import attention

    from oracles import nemotron_h

    cpu_switches(config)
    # HybridStack's final norm, and the q/k norms SelfAttention builds from config.qk_layernorm where its spec names
    # none (TENorm, imported by name in each module; None without TE)
    spec = nemotron_h.cpu_hybrid_stack_spec(stack)
    mla = "+" in pattern or "D" in pattern
    if mla or "/" in pattern:
        from oracles import dsa

        dsa.apply_shims()  # (absorbed_)multi_latent_attention.TELinear: the stand-in (picks "duplicated" by it)
        cpu_attention_layers(stack, spec.submodules)
    saved = hybrid_block.TENorm, attention.TENorm
    hybrid_block.TENorm = attention.TENorm = nemotron_h.standins()["norm"]
    try:
        with (dsa.cpu_spec_backend() if mla else contextlib.nullcontext()):
            yield spec
    finally:
        hybrid_block.TENorm, attention.TENorm = saved


def build(config, pattern: str, stack=None, parallel_output: bool = False, **model_args):
    """megatron-core's HybridModel of TransformerConfig ``config`` with ``pattern`` and the HybridStack spec ``stack``
    (None: megatron-core's own), on the CPU (``on_cpu``); ``model_args``: HybridModel's own."""
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    config.num_layers = len(pattern.split("/")[0].replace("|", ""))
    with on_cpu(config, pattern, stack) as spec:
        return HybridModel(config=config, hybrid_stack_spec=spec, hybrid_layer_pattern=pattern,
                           parallel_output=parallel_output, **model_args)


def model_args(cfg, tp: int) -> dict:
    """HybridModel's own arguments for GPT config ``cfg`` (mcore.py's JSON) at TP ``tp``, as Megatron-LM's hybrid
    builder passes them."""
    from oracles import mcore

    return dict(vocab_size=mcore.padded_vocab(cfg, tp), max_sequence_length=cfg["max_position_embeddings"],
                share_embeddings_and_output_weights=not cfg["untie_embeddings_and_output_weights"],
                position_embedding_type=cfg["position_embedding_type"],
                rotary_percent=cfg.get("rotary_percent", 1.0), rotary_base=cfg.get("rotary_base", 10000))


def from_checkpoint(cfg, tp: int, ep: int, iter_dir: Path, **model_kw):
    """The HybridModel Megatron-LM builds for the checkpoint ``iter_dir`` under ``--use-checkpoint-args``: the
    pattern and layer spec its args name (PP 1)."""
    from oracles import mcore, nemotron_h

    nemotron_h.apply_shims()
    _, stack = named_spec(iter_dir)
    return build(mcore.transformer_config(cfg, tp, 1, ep=ep), stored_pattern(iter_dir), stack,
                 **model_args(cfg, tp), **model_kw)


def load_judged(model, iter_dir: Path) -> list[str]:
    """Strict load of ``iter_dir`` into ``model`` (a model, or the rank's chunks: one per virtual pipeline stage;
    randomised first, so nothing they lack passes as loaded); every rank's problems, on every rank."""
    import torch
    import torch.distributed as dist

    from oracles.te_cpu import load_strict

    chunks = model if isinstance(model, list) else [model]
    with torch.no_grad():
        for m in chunks:
            for p in m.parameters():
                p.uniform_(-3.0, 3.0)
    problems: list[str] = []
    load_strict(chunks, iter_dir, problems)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, problems)
    for m in chunks:
        m.eval()
    return [f"rank {r}: {p}" for r, ps in enumerate(every) for p in ps]


def stored_pattern(iter_dir: Path) -> str:
    """The pattern Megatron-LM builds from the checkpoint's args (``--use-checkpoint-args``): 0.19's
    ``hybrid_layer_pattern``, else the deprecated ``hybrid_override_pattern``."""
    from oracles.common import stored_args

    args = stored_args(iter_dir)
    return getattr(args, "hybrid_layer_pattern", None) or args.hybrid_override_pattern


def pipeline_logits(chunks, pp: int, tokens, position_ids, mask):
    """One forward through the pipeline's stages in order (stage ``v * PP + p``: virtual stage ``v`` of PP rank
    ``p``), each chunk computing on its own rank and sending its hidden states to the next stage's rank (gloo
    send / recv): the schedule's forward, not its code. The last stage's output on its ranks, else None."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    rank, out = parallel_state.get_pipeline_model_parallel_rank(), None
    stages = pp * len(chunks)
    with torch.no_grad():
        for s in range(rank, stages, pp):
            chunk = chunks[s // pp]
            if s:
                first = next(chunk.parameters())
                hidden = torch.empty(tokens.shape[1], tokens.shape[0], chunk.config.hidden_size, dtype=first.dtype)
                dist.recv(hidden, src=parallel_state.get_pipeline_model_parallel_prev_rank())
                chunk.set_input_tensor(hidden)
            out = chunk(tokens, position_ids, mask)
            if s < stages - 1:
                dist.send(out.contiguous(), dst=parallel_state.get_pipeline_model_parallel_next_rank())
                out = None
    return out


def named_spec(iter_dir: Path):
    """The HybridStack spec the checkpoint's args name (Megatron-LM's ``--spec``), imported as Megatron-LM's hybrid
    builder imports it; (None, None) where they name none."""
    from megatron.core.transformer.spec_utils import import_module

    from oracles.common import stored_args

    spec = getattr(stored_args(iter_dir), "spec", None)
    return spec, (import_module(spec) if spec else None)


def cmd_logits(a) -> int:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.models.hybrid.hybrid_layer_allocation import get_hybrid_total_pipeline_segment_count

    from oracles import mcore, nemotron_h
    from oracles.common import end_parallel, resolve_iter_dir

    nemotron_h.apply_shims()
    cfg = mcore.load_config(a.config)
    iter_dir = Path(resolve_iter_dir(a.ckpt))
    spec, stack = named_spec(iter_dir)
    pattern = a.pattern or stored_pattern(iter_dir)
    segments = get_hybrid_total_pipeline_segment_count(pattern)  # Megatron-LM's VPP: the '|' segments / PP
    vpp = segments // a.pp if a.pp > 1 and segments > a.pp else None
    if a.mtp and a.pp > 1:
        raise SystemExit("--mtp needs --pp 1")
    mcore.init_parallel(a.tp, a.pp, vpp=vpp, ep=a.ep, cfg=cfg)
    try:
        config = mcore.transformer_config(cfg, a.tp, a.pp, vpp=vpp, ep=a.ep)
        chunks = [build(config, pattern, stack, parallel_output=a.mtp, **model_args(cfg, a.tp),
                        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=v),
                        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=v),
                        **({"vp_stage": v} if vpp else {}))
                  for v in range(vpp or 1)]
        problems = load_judged(chunks, iter_dir)
        if problems:
            if dist.get_rank() == 0:
                print(json.dumps({"ok": False, "problems": problems[:50]}), flush=True)
            return 1
        tokens, position_ids, mask = mcore.causal_inputs(cfg, a.seed)
        if a.mtp:  # the MTP depths' losses, as mcore.py mtp says them for a GPTModel
            return mcore.say_mtp_losses(chunks[0], cfg, tokens, position_ids, mask)
        out = pipeline_logits(chunks, a.pp, tokens, position_ids, mask)
        if parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0:
            print(f"ORACLE PIPELINE pattern={pattern} pp={a.pp} vpp={vpp} segments={segments} layers="
                  f"{[len(c.decoder.layers) for c in chunks]}", flush=True)
        if out is not None and parallel_state.get_tensor_model_parallel_rank() == 0:
            logits = out[..., : cfg["vocab_size"]].contiguous()
            os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
            torch.save({"tokens": tokens, "logits": logits}, a.out)
            print(f"ORACLE SPEC {'.'.join(spec) if spec else None}", flush=True)
            print(f"ORACLE LOGITS {tuple(logits.shape)} -> {a.out}", flush=True)
        return 0
    finally:
        end_parallel(a.serving)


def cmd_interop(a) -> int:
    """megatron-core's own load-time GPT -> HybridModel interop (``dist_checkpointing.gpt_checkpoint_interop``: the
    hybrid model's sharded state dict retargeted at the GPT checkpoint --gpt, then ``dist_checkpointing.load`` and
    ``load_state_dict``) against the same HybridModel loaded strictly from the offline target --ckpt: every tensor
    equal, bit for bit (the _extra_state objects are not read from the GPT checkpoint: tensors are judged). One JSON
    line (rank 0); exit 1 on a difference."""
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.gpt_checkpoint_interop import (
        gpt_compatible_layer_maps,
        retarget_sharded_state_dict_to_gpt_checkpoint,
    )
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedObject
    from megatron.core.dist_checkpointing.validation import StrictHandling

    from oracles import mcore, nemotron_h
    from oracles.common import compare, end_parallel, resolve_iter_dir, tensor_state

    nemotron_h.apply_shims()
    cfg = mcore.load_config(a.config)
    iter_dir = Path(resolve_iter_dir(a.ckpt))
    _, stack = named_spec(iter_dir)
    mcore.init_parallel(a.tp, 1, cfg=cfg)
    try:
        model = build(mcore.transformer_config(cfg, a.tp, 1), a.pattern, stack,
                      vocab_size=mcore.padded_vocab(cfg, a.tp), max_sequence_length=cfg["max_position_embeddings"],
                      share_embeddings_and_output_weights=not cfg["untie_embeddings_and_output_weights"],
                      position_embedding_type=cfg["position_embedding_type"],
                      rotary_percent=cfg.get("rotary_percent", 1.0), rotary_base=cfg.get("rotary_base", 10000))
        problems = load_judged(model, iter_dir)
        offline = {k: v.clone() for k, v in tensor_state([model]).items()}
        with torch.no_grad():
            for p in model.parameters():
                p.uniform_(-3.0, 3.0)
        sharded = model.sharded_state_dict()
        retarget_sharded_state_dict_to_gpt_checkpoint(sharded, gpt_compatible_layer_maps(a.pattern))
        # the tensors are judged; TE's _extra_state objects stay the model's own (a GPT checkpoint written for
        # Transformer Engine 1 has no norm _extra_state, which HybridModel's TE 2 norms ask for)
        dict_list_map_inplace(lambda e: LocalNonpersistentObject(e.data) if isinstance(e, ShardedObject)
                              and e.key.endswith("_extra_state") else e, sharded)
        loaded = dist_checkpointing.load(sharded, str(resolve_iter_dir(a.gpt)),
                                         strict=StrictHandling.ASSUME_OK_UNEXPECTED)
        res = model.load_state_dict(loaded, strict=False)
        problems += [f"interop: missing {k}" for k in res.missing_keys if not k.endswith("._extra_state")]
        interop = tensor_state([model])
        problems += compare(interop, offline, "interop vs offline")
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, (problems, len(offline)))
        problems = [f"rank {r}: {p}" for r, (ps, _) in enumerate(every) for p in ps]
        verdict = {"ok": not problems, "tensors": sum(n for _, n in every), "problems": problems[:50]}
        if dist.get_rank() == 0:
            print(json.dumps(verdict), flush=True)
        return 0 if not problems else 1
    finally:
        end_parallel(a.serving)


def bridge_built(iter_dir: Path):
    """(model, provider, the HybridStack spec it names) as Megatron-Bridge 0.6.2 builds them from a Bridge checkpoint's
    own run_config.yaml: ``load_model_config`` instantiates its provider, ``finalize`` derives the layer count from
    the pattern and runs megatron-core's deferred checks, ``provide`` builds the HybridModel (its spec resolved as
    ``provide`` resolves it, then stood in on the CPU: ``on_cpu``)."""
    from megatron.bridge.models.hybrid.hybrid_provider import DEFAULT_MAMBA_CHUNK_SIZE
    from megatron.bridge.training.model_load_save import load_model_config

    provider, mlm_args = load_model_config(str(iter_dir))
    assert mlm_args is None, f"{iter_dir} is not a Megatron-Bridge checkpoint (no run_config.yaml)"
    provider.use_cpu_initialization, provider.parallel_output = True, False  # the logits gathered over TP
    cpu_switches(provider)
    provider.finalize()
    # resolved at the default scan chunk size (Bridge configures another one in a deep copy of the spec, which the TE
    # mocks do not survive); provide() then copies the stood-in spec with the checkpoint's own chunk size
    chunk, provider.mamba_chunk_size = provider.mamba_chunk_size, DEFAULT_MAMBA_CHUNK_SIZE
    stack = provider._resolve_hybrid_stack_spec()
    provider.mamba_chunk_size = chunk
    with on_cpu(provider, provider.hybrid_layer_pattern, stack) as spec:
        provider.hybrid_stack_spec = spec
        model = provider.provide(pre_process=True, post_process=True)
    return model, provider, stack


def cmd_bridge(a) -> int:
    """A Megatron-Bridge HybridModel target as Megatron-Bridge 0.6.2 reads it: its own ``load_model_config``
    instantiates the provider of run_config.yaml (HybridModelProvider), ``finalize`` and ``provide`` build
    megatron-core's HybridModel from the provider's own fields (pattern, vocabulary padding, RoPE; its Transformer
    Engine HybridStack spec stood in on the CPU as ``build`` does), loaded strictly; the logits of ``mcore.py logits``'
    tokens saved as ``cmd_logits`` saves them."""
    import torch
    from megatron.core import parallel_state

    from oracles import mcore, nemotron_h
    from oracles.common import end_parallel, resolve_iter_dir

    nemotron_h.apply_shims()  # Bridge's import of Transformer Engine stood in first
    cfg = mcore.load_config(a.config)
    iter_dir = Path(resolve_iter_dir(a.ckpt))
    mcore.init_parallel(a.tp, 1, ep=a.ep, cfg=cfg)
    try:
        model, provider, stack = bridge_built(iter_dir)
        name = type(provider).__name__
        problems = load_judged(model, iter_dir)
        if problems:
            if torch.distributed.get_rank() == 0:
                print(json.dumps({"ok": False, "problems": problems[:50]}), flush=True)
            return 1
        tokens, position_ids, mask = mcore.causal_inputs(cfg, a.seed)
        if a.mtp:  # the MTP depths' losses, as mcore.py mtp says them for a GPTModel
            return mcore.say_mtp_losses(model, cfg, tokens, position_ids, mask)
        out = pipeline_logits([model], 1, tokens, position_ids, mask)
        if parallel_state.get_tensor_model_parallel_rank() == 0:
            from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec

            logits = out[..., : cfg["vocab_size"]].contiguous()
            os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
            torch.save({"tokens": tokens, "logits": logits}, a.out)
            print(f"ORACLE PROVIDER {name} pattern={provider.hybrid_layer_pattern} "
                  f"mcore_stack={stack is hybrid_stack_spec}", flush=True)
            print(f"ORACLE LOGITS {tuple(logits.shape)} -> {a.out}", flush=True)
        return 0
    finally:
        end_parallel(a.serving)


def cmd_hf(a) -> int:
    """An HF-sourced hybrid target: Megatron-Bridge 0.6.2's provider of the HF model (oracles.qwen3_next's for
    Qwen3-Next / Qwen3.5, oracles.dsa's GLM-5 one for a DeepSeek-sparse-attention model, each with its CPU
    stand-ins) is the TransformerConfig; the HybridModel's logits against transformers' on the same tokens (a DSA
    model: those ``oracles/dsa.py make`` saved, --logits)."""
    import torch

    from oracles import dsa, nemotron_h, qwen3_next
    from oracles.common import end_parallel, resolve_iter_dir

    nemotron_h.apply_shims()
    model_type = json.loads((Path(a.hf) / "config.json").read_text())["model_type"]
    sparse = model_type in ("glm_moe_dsa", "deepseek_v32")
    (dsa if sparse else qwen3_next).apply_shims()
    iter_dir = Path(resolve_iter_dir(a.ckpt))
    spec, stack = named_spec(iter_dir)
    rank, _ = qwen3_next.init_dist(a.tp, 1, a.ep, 1 if a.ep > 1 else None)
    view = None
    try:
        if a.from_run_config:  # a Bridge target: the model Bridge builds from its own run_config.yaml
            from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec

            model, config, named = bridge_built(iter_dir)
            spec = ("megatron.core.models.hybrid.hybrid_layer_specs", "hybrid_stack_spec") \
                if named is hybrid_stack_spec else ("another", "spec")
            if config.hybrid_layer_pattern != a.pattern:
                raise SystemExit(f"run_config.yaml builds pattern {config.hybrid_layer_pattern}, not {a.pattern}")
        else:
            if sparse:
                arch = "glm5" if model_type == "glm_moe_dsa" else "v32"
                hf_dir, view = dsa.glm_view(a.hf, arch)
                _, config = dsa.dsa_provider(hf_dir, arch, load_weights=False, tp=a.tp, ep=a.ep)
            else:
                _, config = qwen3_next.qwen_provider(a.hf, load_weights=False, tp=a.tp, ep=a.ep,
                                                     parallel_output=False)
            model = build(config, a.pattern, stack, vocab_size=config.vocab_size,
                          max_sequence_length=config.seq_length,
                          share_embeddings_and_output_weights=config.share_embeddings_and_output_weights,
                          position_embedding_type=config.position_embedding_type,
                          rotary_percent=config.rotary_percent, rotary_base=config.rotary_base)
        problems = load_judged(model, iter_dir)
        verdict: dict = {"ckpt": a.ckpt, "spec": ".".join(spec) if spec else None, "tp": a.tp, "ep": a.ep,
                         "position_embedding_type": config.position_embedding_type,
                         "provider": type(config).__name__}
        if not problems:
            made = torch.load(a.logits) if sparse else None
            ids = made["ids"] if sparse else nemotron_h.judge_ids()
            want = made["logits"] if sparse else qwen3_next.hf_logits(a.hf, ids)
            diff = (nemotron_h.megatron_logits(model, ids)[..., :config.vocab_size] - want).abs().max().item()
            verdict["logits_max_abs_diff_vs_hf"] = diff
            if not diff <= a.atol:
                problems.append(f"logits differ from transformers' by {diff:.3g} (atol {a.atol})")
        verdict.update(ok=not problems, problems=problems[:50])
        if rank == 0:
            print(json.dumps(verdict), flush=True)
        return 0 if not problems else 1
    finally:
        if view is not None:
            shutil.rmtree(view, ignore_errors=True)
        end_parallel(a.serving)


def main(argv=None, serving=False) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("logits")
    sp.add_argument("--config", required=True)
    sp.add_argument("--pattern", help="the hybrid layer pattern (M, *, -, E; default: the checkpoint args')")
    sp.add_argument("--tp", type=int, required=True)
    sp.add_argument("--pp", type=int, default=1, help="pipeline stages (world = TP * PP * DP): the pattern's '|' "
                    "segments are its stages, VPP = segments / PP, as Megatron-LM derives it")
    sp.add_argument("--ep", type=int, default=1, help="expert parallel (MoE configs; world = TP * DP)")
    sp.add_argument("--ckpt", required=True)
    sp.add_argument("--out", required=True)
    sp.add_argument("--seed", type=int, default=1234, help="the tokens' seed (mcore.py logits' default)")
    sp.add_argument("--mtp", action="store_true", help="the MTP depths' losses instead (as mcore.py mtp)")
    sp = sub.add_parser("bridge")
    sp.add_argument("--config", required=True, help="mcore.py's JSON of the source (the tokens and true vocabulary)")
    sp.add_argument("--tp", type=int, required=True)
    sp.add_argument("--ep", type=int, default=1)
    sp.add_argument("--ckpt", required=True, help="a Megatron-Bridge checkpoint of a HybridModel")
    sp.add_argument("--out", required=True)
    sp.add_argument("--seed", type=int, default=1234)
    sp.add_argument("--mtp", action="store_true", help="the MTP depths' losses instead (as mcore.py mtp)")
    sp = sub.add_parser("interop")
    sp.add_argument("--config", required=True)
    sp.add_argument("--pattern", required=True)
    sp.add_argument("--tp", type=int, required=True)
    sp.add_argument("--gpt", required=True, help="a GPTModel torch_dist checkpoint (Transformer Engine names)")
    sp.add_argument("--ckpt", required=True, help="the HybridModel target converted offline from it")
    sp = sub.add_parser("hf")
    sp.add_argument("--hf", required=True, help="the HF source (Qwen3-Next / Qwen3.5: oracles/qwen3_next.py make)")
    sp.add_argument("--pattern", required=True)
    sp.add_argument("--tp", type=int, required=True)
    sp.add_argument("--ep", type=int, default=1)
    sp.add_argument("--ckpt", required=True)
    sp.add_argument("--atol", type=float, default=1e-4)
    sp.add_argument("--logits", help="a DSA model: transformers' logits oracles/dsa.py make saved ({ids, logits})")
    sp.add_argument("--from-run-config", action="store_true", help="a Megatron-Bridge checkpoint: the model "
                    "Megatron-Bridge builds from its own run_config.yaml (bridge_built), not the HF model's provider")
    a = p.parse_args(argv)
    a.serving = serving
    return {"logits": cmd_logits, "bridge": cmd_bridge, "interop": cmd_interop, "hf": cmd_hf}[a.cmd](a)


if __name__ == "__main__":
    from oracles.common import run_program

    run_program(main)
