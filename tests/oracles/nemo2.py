"""Oracle for NeMo 2 checkpoints: NVIDIA NeMo 2 (nemo_toolkit 2.6.0, installed by launch/setup_nemo.sh) and
megatron-core 0.16.1 only; never dist_convert. Runs in .venv (NeMo does not import with megatron-core 0.19).

A NeMo 2 checkpoint CKPT is CKPT/weights/ (a megatron-core torch_dist directory whose ShardedTensor keys carry
the prefix ``module.``: NeMo's MegatronParallel wraps the megatron-core GPTModel) and CKPT/context/ (NeMo's
``io_dump`` of the trainer context: io.json, model.yaml unless NeMo 2.0, tokenizer artifacts).

  torchrun --nproc_per_node=T*P tests/oracles/nemo2.py make --config C.json --tp T --pp P --seed S --out CKPT \
      [--tokenizer HF_DIR] [--no-model-yaml]
      The weights are those of ``tests/oracles/mcore.py make`` with the same config, seed and TP (its
      build_model and randomize), written the way NeMo's import (``ModelConnector.nemo_setup`` + ``nemo_save``)
      writes them: the megatron-core model is the ``module`` of an ``llm.GPTModel`` whose ``GPTConfig``
      describes it (nemo_fields), on ``nl.Trainer(devices=1, accelerator="cpu", strategy=MegatronStrategy(
      tensor_model_parallel_size=T, pipeline_model_parallel_size=P, ...))``; ``strategy.connect``,
      ``strategy.setup`` and ``trainer.save_checkpoint(CKPT)``, so Lightning's checkpoint dict (epoch,
      global_step, loops, callbacks, ...), NeMo's ``content_metadata`` and MegatronCheckpointIO's
      ``dist_checkpointing.save`` are NeMo's own. Rank 0 then writes CKPT/context with
      ``TrainerContext.from_trainer(trainer).io_dump(CKPT/"context", yaml_attrs=["model"])``.
      GPTConfig.vocab_size stays null (as NeMo leaves it): the tokenizer gives the vocab. --tokenizer: the
      tokenizer assets of HF_DIR saved the way NeMo's HF import does (``save_hf_tokenizer_assets``: a
      ``nemo_tokenizer`` directory) and ``AutoTokenizer`` of them, whose vocab_size must be the config's;
      its files land in CKPT/context/nemo_tokenizer/. Without it the context has no tokenizer.
      --no-model-yaml deletes context/model.yaml afterwards (a NeMo 2.0 checkpoint has io.json only).
  torchrun --nproc_per_node=T*P tests/oracles/nemo2.py load --ckpt CKPT --ref-dump DIR --tp T --pp P \
      [--expect-tokenizer] [--vocab-size V]
      Judges CKPT with NeMo: ``load_context(CKPT/"context", subpath="model")`` must build the model; its
      config's tensor/pipeline_model_parallel_size must be T/P; --expect-tokenizer: the model must have a
      tokenizer (its artifacts found) with a vocab_size. Then, as NeMo does, ``config.configure_model(
      tokenizer)`` at T/P (megatron-core's parallel state set up first) and a strict (RAISE_ALL)
      ``dist_checkpointing.load`` of ``sharded_state_dict(prefix="module.", metadata=<the checkpoint's
      content_metadata>)`` from NeMo's weights directory (``ckpt_to_weights_subdir``); the stored vocab rows
      must equal what configure_model pads to (megatron-core loads other row counts silently). --vocab-size:
      the true vocab a user would bring as the tokenizer, used only where the context has no tokenizer (NeMo
      cannot configure a model whose context names neither a tokenizer nor config.vocab_size: refused).
      DIR is ``tests/oracles/mcore.py dump --tp T --pp P`` output (ref_{t}_{p}.pt, at the same layout): each
      rank loads its file strictly into a second model of the same NeMo config (the vocab rows the dump
      has), and both models are gathered to full logical tensors by megatron-core's own sharded state dict
      (main replicas placed at their global offsets; decoder layers stacked) and compared bit-exactly.
      Vocab rows: with the true vocab known (tokenizer or --vocab-size), those rows bit-exactly and the
      padding rows past it zero or the reference's (padding is no model weight: a re-padding converter
      writes zeros); otherwise same size, every row.
      Prints one MISMATCH line per problem and ``ORACLE OK <n> tensors (NeMo load_context + configure_model,
      megatron-core load)`` or ``ORACLE FAIL ...``; exits 0 only when everything matched.
  python tests/oracles/nemo2.py make-tokenizer --out DIR [--vocab 100]
      A tiny Hugging Face tokenizer (WordLevel t0..t{N-1}) in DIR, made with ``tokenizers`` the way
      tests/oracles/bridge.py make-hf makes its one, for --tokenizer.

Config JSON: tests/oracles/mcore.py's (Megatron-LM names); every field that changes the model maps to a
GPTConfig field (NEMO_FIELDS) or it is refused (ORACLE FAIL); moe_layer_freq other than 1 is refused (NeMo's
GPT layer spec makes every layer MoE). use_rope_scaling picks Llama31Config (its RoPE scaling with
scale_factor = rope_scaling_factor and megatron-core's other constants). GPTConfig.seq_length gets
max_position_embeddings (NeMo sizes the position table by it; the JSON's seq_length is a run's), dropouts 0 as
tests/oracles/mcore.py builds. Layouts: even PP stages, no VPP, EP 1 (the world is T*P).

NeMo 2.6.0 on this stack (shims, applied in the process, never to NeMo's files):
  * tests/oracles/mcore.py apply_cpu_shims (CUDA calls of megatron-core's save/load made CPU no-ops).
  * nemo/lightning/io/registry.py registers NeMo's AutoTokenizer for io (its artifacts) only after importing
    LlamaTokenizerFast from a module transformers 5 removed, so under transformers 5 it silently registers
    nothing: an AutoTokenizer would be dumped without its files and loaded from a relative path.
    track_tokenizer_io makes the same ``track_io`` call with the same artifacts, if it has not been made.
  * MegatronStrategy(ckpt_async_save=False): NeMo's async checkpoint wrapper imports megatron-core's
    tensorstore strategy, which 0.16.1 no longer has; the synchronous MegatronCheckpointIO it wraps writes
    the same files. ckpt_save_optimizer=False (no optimizer: NeMo's import passes it too),
    pipeline_dtype=float32 (megatron-core needs one with PP > 1; the oracle's weights are float32).
  * CUDA-only kernel switches (CPU_SWITCHES) off in GPTConfig (make) and before configure_model (load);
    use_cpu_initialization on; no Transformer Engine, so NeMo's default_layer_spec is megatron-core's local
    spec, as tests/oracles/mcore.py builds. None of these changes a weight's name, shape or value.
"""
from __future__ import annotations

import argparse
import copy
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the oracles package, helpers
from oracles.common import apply_cpu_shims, end_parallel, report, run_program  # noqa: E402
from oracles.mcore import build_model, init_parallel, is_moe, load_config, padded_vocab, randomize  # noqa: E402

# GPTConfig switches for CUDA kernels (no model property): off on CPU
CPU_SWITCHES = {"apply_rope_fusion": False, "gradient_accumulation_fusion": False, "persist_layer_norm": False,
                "bias_activation_fusion": False, "bias_dropout_fusion": False, "masked_softmax_fusion": False,
                "cross_entropy_loss_fusion": False}
# config JSON keys (tests/oracles/mcore.py) -> GPTConfig field; None: handled by nemo_fields
NEMO_FIELDS = {
    "num_layers": "num_layers", "hidden_size": "hidden_size", "ffn_hidden_size": "ffn_hidden_size",
    "num_attention_heads": "num_attention_heads", "num_query_groups": "num_query_groups",
    "kv_channels": "kv_channels", "normalization": "normalization", "add_bias_linear": "add_bias_linear",
    "add_qkv_bias": "add_qkv_bias", "make_vocab_size_divisible_by": "make_vocab_size_divisible_by",
    "position_embedding_type": "position_embedding_type", "qk_layernorm": "qk_layernorm",
    "norm_epsilon": "layernorm_epsilon", "rotary_base": "rotary_base", "rotary_percent": "rotary_percent",
    "swiglu": None, "untie_embeddings_and_output_weights": None, "max_position_embeddings": None,
    "use_rope_scaling": None, "rope_scaling_factor": None,
    "num_experts": "num_moe_experts", "moe_ffn_hidden_size": "moe_ffn_hidden_size",
    "moe_shared_expert_intermediate_size": "moe_shared_expert_intermediate_size",
    "moe_shared_expert_gate": "moe_shared_expert_gate", "moe_layer_freq": "moe_layer_freq",
    "moe_router_topk": "moe_router_topk", "moe_router_enable_expert_bias": "moe_router_enable_expert_bias",
    "moe_router_score_function": "moe_router_score_function", "moe_router_pre_softmax": "moe_router_pre_softmax",
}
# keys that do not describe the weights NeMo's config builds: the vocab comes from the tokenizer, seq_length is
# a run's (GPTConfig.seq_length sizes the position table, so it gets max_position_embeddings)
NOT_MODEL = {"vocab_size", "seq_length", "group_query_attention"}
VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")
PREFIX = "module."


class Refused(Exception):
    """A problem found on every rank alike: reported as ORACLE FAIL, no traceback."""


def one_line(e: Exception) -> str:
    return f"{type(e).__name__}: " + " ".join(str(e).split())


def quiet_nemo() -> None:
    """NeMo and Lightning log at INFO on import and on every trainer; only their warnings stay."""
    import logging

    for name in ("nemo_logger", "lightning", "lightning.pytorch", "pytorch_lightning", "NeMo"):
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        from nemo.utils import logging as nemo_logging

        nemo_logging.setLevel(logging.WARNING)
    except ImportError:
        pass


def track_tokenizer_io() -> None:
    """The ``track_io`` call of nemo/lightning/io/registry.py for NeMo's AutoTokenizer (module docstring)."""
    from nemo.collections.common.tokenizers import AutoTokenizer
    from nemo.lightning.io import track_io
    from nemo.lightning.io.artifact import DirOrStringArtifact, FileArtifact

    if getattr(AutoTokenizer, "__io_artifacts__", None):
        return
    track_io(AutoTokenizer, artifacts=[FileArtifact("vocab_file", required=False),
                                       FileArtifact("merges_file", required=False),
                                       DirOrStringArtifact("pretrained_model_name", required=False)])


# ----------------------------------------------------------------------------- make


def nemo_fields(raw: dict, cfg: dict, tp: int, pp: int) -> tuple[bool, dict]:
    """(Llama-3 RoPE scaling?, GPTConfig keyword arguments) for the oracle config; Refused when a field that
    changes the model has no GPTConfig counterpart."""
    import torch
    import torch.nn.functional as F

    unknown = sorted(set(raw) - set(NEMO_FIELDS) - NOT_MODEL)
    if unknown:
        raise Refused(f"config fields with no GPTConfig counterpart: {unknown}")
    if is_moe(cfg) and cfg["moe_layer_freq"] != 1:
        raise Refused(f"moe_layer_freq {cfg['moe_layer_freq']!r}: NeMo's GPT layer spec makes every layer MoE")
    kw = {nemo: cfg[k] for k, nemo in NEMO_FIELDS.items() if nemo is not None and k in cfg}
    kw.update(
        gated_linear_unit=cfg["swiglu"],
        activation_func=F.silu if cfg["swiglu"] else F.gelu,
        share_embeddings_and_output_weights=not cfg["untie_embeddings_and_output_weights"],
        seq_length=cfg["max_position_embeddings"],
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32,
        params_dtype=torch.float32,
        **CPU_SWITCHES,
    )
    rope_scaling = bool(cfg.get("use_rope_scaling", False))
    if rope_scaling:  # megatron-core's _apply_scaling constants: low 1, high 4, original context 8192
        kw.update(scale_factor=float(cfg.get("rope_scaling_factor", 8.0)), low_freq_factor=1.0,
                  high_freq_factor=4.0, old_context_len=8192)
    return rope_scaling, kw


def hf_tokenizer(hf_dir: str, work: Path):
    """NeMo's AutoTokenizer of HF_DIR's tokenizer assets, saved as NeMo's HF import saves them."""
    from nemo.collections.common.tokenizers import AutoTokenizer
    from transformers import AutoTokenizer as HfAutoTokenizer

    track_tokenizer_io()
    assets = work / "nemo_tokenizer"
    HfAutoTokenizer.from_pretrained(hf_dir, trust_remote_code=True).save_pretrained(assets)
    return AutoTokenizer(str(assets))


def cmd_make(a, raw: dict, cfg: dict) -> int:
    import torch
    import torch.distributed as dist
    from lightning.pytorch.trainer.states import TrainerFn
    from nemo import lightning as nl
    from nemo.collections import llm
    from nemo.collections.llm.gpt.model.llama import Llama31Config
    from nemo.lightning.io.pl import TrainerContext

    rope_scaling, kw = nemo_fields(raw, cfg, a.tp, a.pp)
    rank = dist.get_rank()
    out = Path(a.out)
    work = Path(tempfile.mkdtemp(prefix="nemo2_oracle_"))
    try:
        tokenizer = hf_tokenizer(a.tokenizer, work) if a.tokenizer else None  # every rank: a refusal is collective
        if tokenizer is not None and tokenizer.vocab_size != cfg["vocab_size"]:
            raise Refused(f"--tokenizer vocab_size {tokenizer.vocab_size} != config vocab_size {cfg['vocab_size']}")
        config = (Llama31Config if rope_scaling else llm.GPTConfig)(**kw)
        model = llm.GPTModel(config, tokenizer=tokenizer)
        strategy = nl.MegatronStrategy(tensor_model_parallel_size=a.tp, pipeline_model_parallel_size=a.pp,
                                       pipeline_dtype=torch.float32, ckpt_save_optimizer=False,
                                       ckpt_async_save=False)
        trainer = nl.Trainer(devices=1, accelerator="cpu", strategy=strategy)
        # ModelConnector.nemo_setup: fitting state (for the save), connect (parallel sizes into the config and
        # its io record); the megatron-core model of tests/oracles/mcore.py make instead of configure_model
        trainer.state.fn = TrainerFn.FITTING
        strategy.connect(model)
        model.module = build_model(cfg, a.tp, a.pp)
        randomize(model.module, cfg, a.seed)
        # ModelConnector.nemo_save (megatron-core's parallel state is already set up)
        strategy._setup_optimizers = False
        strategy._init_model_parallel = False
        strategy.setup(trainer)
        if rank == 0:
            out.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        trainer.save_checkpoint(out)
        if rank == 0:
            TrainerContext.from_trainer(trainer).io_dump(out / "context", yaml_attrs=["model"])
            if a.no_model_yaml:
                (out / "context" / "model.yaml").unlink()
        dist.barrier()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if rank == 0:
        tok = f"AutoTokenizer vocab_size={tokenizer.vocab_size}" if tokenizer is not None else "none"
        print(f"ORACLE MADE nemo2 tp={a.tp} pp={a.pp} padded_vocab={padded_vocab(cfg, a.tp)} tokenizer={tok}"
              f"{' (no model.yaml)' if a.no_model_yaml else ''}", flush=True)
    return 0


# ----------------------------------------------------------------------------- load


class _Vocab:
    """What configure_model reads of a tokenizer: the vocab size a user's tokenizer would have."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size


def nemo_context(ckpt: Path, tp: int, pp: int, expect_tokenizer: bool):
    """NeMo's load_context of CKPT/context (the model); Refused on what NeMo or the layout rejects."""
    from nemo.lightning.io import load_context

    track_tokenizer_io()
    try:
        model = load_context(ckpt / "context", subpath="model")
    except Exception as e:  # NeMo's own verdict on the context
        raise Refused(f"NeMo load_context(context, subpath='model'): {one_line(e)}") from e
    config = model.config
    problems = [f"context config.{k}={getattr(config, k, None)!r}, expected {v}"
                for k, v in (("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp))
                if getattr(config, k, None) != v]
    if getattr(config, "virtual_pipeline_model_parallel_size", None):
        problems.append("context config has a virtual pipeline: not supported by this oracle")
    tokenizer = getattr(model, "tokenizer", None)
    if expect_tokenizer and not isinstance(getattr(tokenizer, "vocab_size", None), int):
        problems.append(f"context model has no tokenizer with a vocab_size (tokenizer {type(tokenizer).__name__})")
    if problems:
        raise Refused("; ".join(problems))
    return model


def configure(config, tokenizer):
    """NeMo's ``config.configure_model(tokenizer)`` on CPU (module docstring)."""
    from nemo.collections.llm.gpt.model import base

    for k, v in {**CPU_SWITCHES, "use_cpu_initialization": True}.items():
        setattr(config, k, v)
    if config.transformer_layer_spec in (base.transformer_engine_layer_spec, base.transformer_engine_full_layer_spec):
        config.transformer_layer_spec = base.local_layer_spec  # the same weights, without Transformer Engine
    return config.configure_model(tokenizer)


def logical_tensors(model) -> list[tuple[str, tuple, tuple, object]]:
    """This rank's main-replica pieces of megatron-core's sharded state dict: (key, global shape, global
    offset, local data)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    ssd = model.sharded_state_dict()
    apply_factories(ssd)
    pieces = []
    for v in nested_values(ssd):
        if isinstance(v, ShardedTensor) and not any(v.replica_id if isinstance(v.replica_id, tuple)
                                                    else (v.replica_id,)):
            pieces.append((v.key, tuple(v.global_shape), tuple(v.global_offset), v.data.detach().clone()))
    return pieces


def assemble(gathered: list[list]) -> tuple[dict, list[str]]:
    """Full logical tensors from every rank's pieces; problems where pieces disagree or leave holes."""
    import torch

    full, filled, problems = {}, {}, []
    for pieces in gathered:
        for key, shape, offset, data in pieces:
            if key not in full:
                full[key] = torch.zeros(shape, dtype=data.dtype)
                filled[key] = 0
            elif tuple(full[key].shape) != shape:
                problems.append(f"{key}: global shape {shape} vs {tuple(full[key].shape)} on another rank")
                continue
            lead = len(shape) - data.dim()  # stacked layers: leading dims of size 1 not in the local data
            index = tuple(slice(o, o + 1) for o in offset[:lead]) + tuple(
                slice(o, o + n) for o, n in zip(offset[lead:], data.shape, strict=True))
            full[key][index] = data.reshape(full[key][index].shape)
            filled[key] += data.numel()
    problems += [f"{k}: main replicas cover {filled[k]} of {full[k].numel()} elements"
                 for k in full if filled[k] != full[k].numel()]
    return full, problems


def compare(got: dict, want: dict, true_vocab: int | None) -> list[str]:
    import torch

    problems = [f"missing {k} (in the reference)" for k in sorted(set(want) - set(got))]
    problems += [f"unexpected {k} (not in the reference)" for k in sorted(set(got) - set(want))]
    for k in sorted(set(got) & set(want)):
        x, y = got[k], want[k]
        if (k in VOCAB_KEYS and true_vocab is not None and x.shape[1:] == y.shape[1:]
                and min(x.shape[0], y.shape[0]) >= true_vocab):
            # rows past the true vocab are padding, not model weights: a converter that re-pads writes zeros
            pad = x[true_vocab:]
            if torch.count_nonzero(pad) and not (x.shape == y.shape and torch.equal(pad, y[true_vocab:])):
                problems.append(f"{k}: vocab padding rows {true_vocab}..{x.shape[0]} are neither zero nor the "
                                "reference's")
            x, y = x[:true_vocab], y[:true_vocab]
        elif k in VOCAB_KEYS and x.shape[0] != y.shape[0] and x.shape[1:] == y.shape[1:]:
            rows = min(x.shape[0], y.shape[0])
            if true_vocab is None or rows < true_vocab:
                problems.append(f"{k}: {x.shape[0]} vocab rows vs the reference's {y.shape[0]} "
                                f"(true vocab {true_vocab if true_vocab is not None else 'unknown'})")
                continue
            if torch.count_nonzero(x[rows:]):
                problems.append(f"{k} has non-zero vocab padding rows {rows}..{x.shape[0]}")
            x, y = x[:rows], y[:rows]
        if x.shape != y.shape or x.dtype != y.dtype:
            problems.append(f"{k}: {tuple(x.shape)} {x.dtype} vs reference {tuple(y.shape)} {y.dtype}")
        elif not torch.equal(x, y):
            problems.append(f"{k}: max abs diff {(x.double() - y.double()).abs().max().item():.3g}")
    return problems


def stored_vocab_problems(weights: Path, model) -> list[str]:
    """The checkpoint's vocab rows against the model's (megatron-core loads other row counts silently)."""
    from megatron.core import dist_checkpointing, parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    mine = {}
    if model.pre_process:
        mine["embedding.word_embeddings.weight"] = model.embedding.word_embeddings.weight
    if model.post_process and not model.share_embeddings_and_output_weights:
        mine["output_layer.weight"] = model.output_layer.weight
    md = dist_checkpointing.load_tensors_metadata(str(weights))
    problems = []
    for k, w in mine.items():
        stored = md.get(PREFIX + k)
        if stored is None:
            problems.append(f"{PREFIX}{k} absent from {weights}")
        elif stored.global_shape[0] != w.shape[0] * tp:
            problems.append(f"{PREFIX}{k} stored with {stored.global_shape[0]} vocab rows, NeMo's configure_model "
                            f"pads the vocab to {w.shape[0] * tp}")
    return problems


def cmd_load(a) -> int:
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.validation import StrictHandling
    from nemo.lightning.io.pl import ckpt_to_weights_subdir

    ckpt = Path(a.ckpt)
    rank = dist.get_rank()
    nemo = nemo_context(ckpt, a.tp, a.pp, a.expect_tokenizer)
    config, tokenizer = nemo.config, nemo.tokenizer
    if tokenizer is not None:
        true_vocab, source = tokenizer.vocab_size, f"{type(tokenizer).__name__} vocab_size={tokenizer.vocab_size}"
    elif a.vocab_size is not None:
        true_vocab, source, tokenizer = a.vocab_size, f"--vocab-size {a.vocab_size}", _Vocab(a.vocab_size)
    else:
        true_vocab, source = None, "no tokenizer"
    if config.vocab_size is not None:
        source += f", config.vocab_size={config.vocab_size}"
    elif tokenizer is None:
        raise Refused("the context names neither a tokenizer nor config.vocab_size: NeMo cannot configure the "
                      "model (pass --vocab-size, the vocab a user's tokenizer would have)")

    t, p = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()
    ref_dir = Path(a.ref_dump)
    files = sorted(f.name for f in ref_dir.glob("ref_*_*.pt"))
    want_files = sorted(f"ref_{i}_{j}.pt" for i in range(a.tp) for j in range(a.pp))
    if files != want_files:
        raise Refused(f"--ref-dump {ref_dir}: files {files}, expected {want_files} (a dump at --tp {a.tp} "
                      f"--pp {a.pp})")
    ref_sd = torch.load(ref_dir / f"ref_{t}_{p}.pt", weights_only=False)
    local_rows = [ref_sd[k].shape[0] for k in VOCAB_KEYS if isinstance(ref_sd.get(k), torch.Tensor)]
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, local_rows[0] * a.tp if local_rows else None)
    ref_vocab = max(r for r in rows if r is not None)

    model = configure(config, tokenizer)
    weights = Path(ckpt_to_weights_subdir(ckpt, is_saving=False))
    problems = stored_vocab_problems(weights, model)
    metadata = dist_checkpointing.load_content_metadata(str(weights))
    try:
        # as MegatronStrategy.load_checkpoint: the model's sharded state dict under "state_dict"; the common
        # state (Lightning's keys) comes back beside it
        request = {"state_dict": model.sharded_state_dict(prefix=PREFIX, metadata=metadata)}
        loaded = dist_checkpointing.load(request, str(weights), strict=StrictHandling.RAISE_ALL)
        model.load_state_dict({k.removeprefix(PREFIX): v for k, v in loaded["state_dict"].items()}, strict=True)
    except Exception as e:  # a key, shape or strictness failure of megatron-core's load
        problems.append(f"megatron-core load of {weights}: {one_line(e)}")

    # the reference: the same NeMo config with the dump's vocab rows, loaded strictly from this rank's file
    ref_config = copy.copy(config)
    ref_config.vocab_size = ref_vocab
    ref_model = configure(ref_config, None)
    try:
        ref_model.load_state_dict(ref_sd, strict=True)
    except Exception as e:
        problems.append(f"reference dump {ref_dir} does not fit NeMo's config: {one_line(e)}")

    mine = (problems, logical_tensors(model), logical_tensors(ref_model))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if rank != 0:
        return 1 if any(g[0] for g in gathered) else 0
    lines = [f"rank={r} {q}" for r, g in enumerate(gathered) for q in g[0]]
    got, bad_got = assemble([g[1] for g in gathered])
    want, bad_want = assemble([g[2] for g in gathered])
    lines += [f"ckpt {q}" for q in bad_got] + [f"reference {q}" for q in bad_want]
    lines += compare(got, want, true_vocab)
    return report(lines, f"{len(got)} tensors (NeMo load_context + configure_model, megatron-core load; "
                         f"{type(nemo).__name__}/{type(config).__name__} TP={a.tp} PP={a.pp}, vocab: {source})")


# ----------------------------------------------------------------------------- make-tokenizer


def cmd_make_tokenizer(a) -> int:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(WordLevel({f"t{i}": i for i in range(a.vocab)}, unk_token="t0"))
    tok.pre_tokenizer = WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t1", bos_token="t2").save_pretrained(
        a.out)
    return report([], f"tokenizer of {a.vocab} tokens in {a.out}")


def main(argv=None, serving=False) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("make")
    sp.add_argument("--config", required=True)
    sp.add_argument("--tp", type=int, required=True)
    sp.add_argument("--pp", type=int, default=1)
    sp.add_argument("--seed", type=int, required=True)
    sp.add_argument("--out", required=True)
    sp.add_argument("--tokenizer", default=None, help="a Hugging Face directory with a tokenizer")
    sp.add_argument("--no-model-yaml", action="store_true", help="io.json only, as NeMo 2.0 wrote")
    sp = sub.add_parser("load")
    sp.add_argument("--ckpt", required=True)
    sp.add_argument("--ref-dump", required=True, help="tests/oracles/mcore.py dump output at --tp/--pp")
    sp.add_argument("--tp", type=int, required=True)
    sp.add_argument("--pp", type=int, default=1)
    sp.add_argument("--expect-tokenizer", action="store_true")
    sp.add_argument("--vocab-size", type=int, default=None,
                    help="the true vocab, where the context names neither a tokenizer nor config.vocab_size")
    sp = sub.add_parser("make-tokenizer")
    sp.add_argument("--out", required=True)
    sp.add_argument("--vocab", type=int, default=100)
    a = p.parse_args(argv)
    if a.cmd == "make-tokenizer":
        return cmd_make_tokenizer(a)

    apply_cpu_shims()
    quiet_nemo()
    import torch.distributed as dist

    raw = cfg = None
    if a.cmd == "make":
        with open(a.config) as f:
            raw = json.load(f)
        cfg = load_config(a.config)
    init_parallel(a.tp, a.pp, cfg=cfg)
    try:
        try:
            rc = cmd_make(a, raw, cfg) if a.cmd == "make" else cmd_load(a)
        except Refused as e:
            if dist.get_rank() == 0:
                report([str(e)], f"{a.cmd} refused")
            rc = 1
        dist.barrier()
    finally:
        end_parallel(serving)
    return rc


if __name__ == "__main__":
    run_program(main)
