"""Oracle: Megatron-Bridge 0.6.2 and Megatron-LM 0.19 (megatron-core 0.19.2's megatron.training) load a
Megatron-LM checkpoint (a dist_convert torch_dist target) by its stored ``args``. Runs in the second
runtime (Python 3.12); imports megatron-core, megatron.training, Megatron-Bridge, transformers; never
dist_convert.

  oracles/bridge.py make-hf --root DIR
      DIR/llama: a tiny Llama by transformers (tests/hf_models.py) with a 100-token WordLevel tokenizer, so a
      loader that builds the tokenizer the args name (Bridge does) finds one
  oracles/bridge.py import --hf HF_DIR --out DIR
      Megatron-Bridge's own HF -> Megatron import (AutoBridge.from_hf_pretrained, to_megatron_provider with
      the weights, provide_distributed_model on CPU with the local layer spec, save_megatron_model with the
      HF tokenizer): a Megatron-Bridge checkpoint as Bridge writes it
  oracles/bridge.py defaults --out JSON
      Megatron-LM's argparse defaults (``parse_args`` of an empty command line), JSON-able ones as they
      are, others by repr
  oracles/bridge.py load --ckpt DIR (--hf HF_DIR | --ref-dump PT) [--null-tokenizer]
      Bridge's own loader, ``model_load_save.load_megatron_model(iter_dir, model_type="gpt",
      use_cpu_init=True)``: for a Megatron-LM checkpoint it builds a TransformerConfig and a GPTModel from
      the args alone, for a Bridge checkpoint the model provider of its run_config.yaml, and loads the
      weights strictly. Then every weight is compared bit-exactly: --hf exports the
      loaded model to HF names with Bridge (``AutoBridge.export_hf_weights``) against the HF source's
      safetensors; --ref-dump against a state dict megatron-core loaded (tests/oracles/mcore.py dump;
      with --true-vocab V the vocab rows past V are padding: zero or the dump's).
      --null-tokenizer: the args name no tokenizer (a Megatron-LM run may pass it on the command line
      only), so Bridge gets a NullTokenizer of the args' vocab_size, as a user would supply it.
  oracles/bridge.py mlm --ckpt DIR --config JSON [--null-tokenizer]
      Megatron-LM: ``torch.load(weights_only=True)`` of the args under exactly megatron-core's
      SAFE_GLOBALS; ``parse_and_validate_args`` with ``--use-checkpoint-args`` (load_args_from_checkpoint,
      validate_args), ``check_checkpoint_args`` and ``core_transformer_config_from_args``, whose model
      fields must equal the oracle config (tests/oracles/mcore.py names).

Prints ``ORACLE OK ...`` or ``ORACLE FAIL ...`` lines; exit 0 only when everything matched.

CPU shims (no GPU, no Transformer Engine): Bridge's ``peft/lora_layers.py`` imports
``transformer_engine.pytorch`` unconditionally: that one module is executed with the import replaced by
an inert stand-in (megatron-core still sees no TE). ``torch.cuda.current_device/synchronize`` and
``Tensor.cuda`` are CPU no-ops, the CUDA RNG tracker's fork a null context (tests/oracles/mcore.py
apply_cpu_shims). Fused-kernel switches the args may ask for (CUDA-only kernels: not model properties)
are turned off for the load: CPU_KERNELS.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the oracles package, helpers
from oracles.common import end_parallel, report, resolve_iter_dir, run_program  # noqa: E402
from oracles.te_cpu import CPU_KERNELS, install_shims  # noqa: E402

# args -> value for the load on CPU: CUDA-kernel choices, none of which changes a weight's name or shape

# the same for a Megatron-LM run on CPU: its command-line switches (the run's, not the checkpoint's)
MLM_CPU_FLAGS = ("--no-rope-fusion", "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
                 "--no-bias-dropout-fusion", "--no-bias-swiglu-fusion", "--no-bias-gelu-fusion",
                 "--no-persist-layer-norm")










# ----------------------------------------------------------------------------- make-hf


def cmd_make_hf(a) -> int:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    from hf_models import make_hf_model

    out = make_hf_model(Path(a.root), "llama")
    tok = Tokenizer(WordLevel({f"t{i}": i for i in range(100)}, unk_token="t0"))
    tok.pre_tokenizer = WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t1", bos_token="t2").save_pretrained(out)
    return report([], f"made {out}")


def cmd_import(a) -> int:
    import torch
    import torch.distributed as dist

    install_shims()
    from megatron.bridge import AutoBridge
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    saved = torch.cuda.get_rng_state
    torch.cuda.get_rng_state = torch.get_rng_state  # the save records the CUDA RNG state
    if not dist.is_initialized():
        dist.init_process_group(backend="gloo")
    parallel_state.initialize_model_parallel(1, 1)
    try:
        bridge = AutoBridge.from_hf_pretrained(a.hf)
        provider = bridge.to_megatron_provider(load_weights=True)
        provider.transformer_layer_spec = get_gpt_layer_local_spec()
        provider.apply_rope_fusion = provider.persist_layer_norm = False
        provider.finalize()
        model = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)
        bridge.save_megatron_model(model, a.out, hf_tokenizer_path=a.hf)
    finally:
        torch.cuda.get_rng_state = saved
        end_parallel(True)
    return report([], f"Megatron-Bridge imported {a.hf} to {a.out}")


def cmd_defaults(a) -> int:
    from megatron.training import arguments

    saved_argv = sys.argv
    sys.argv = ["mlm"]
    try:
        defaults = vars(arguments.parse_args(ignore_unknown_args=False))
    finally:
        sys.argv = saved_argv

    def plain(v):
        try:
            json.dumps(v)
            return v
        except TypeError:
            return {"repr": repr(v)}

    Path(a.out).write_text(json.dumps({k: plain(v) for k, v in defaults.items()}))
    return report([], f"{len(defaults)} Megatron-LM defaults")


# ----------------------------------------------------------------------------- load (Megatron-Bridge)


def bridge_load(iter_dir: Path, null_tokenizer: bool):
    """Megatron-Bridge's loader on ``iter_dir``; returns (model chunks, the args it read)."""
    import torch.distributed as dist
    from megatron.bridge.training import model_load_save
    from megatron.bridge.training.mlm_compat import arguments as mlm_compat
    from megatron.core import parallel_state

    seen = {}
    original = mlm_compat._load_args_from_checkpoint

    def load_args(path: str) -> argparse.Namespace:
        args = original(path)
        seen["args"] = argparse.Namespace(**vars(args))  # what the checkpoint said, before the CPU switches
        for k, v in CPU_KERNELS.items():
            if hasattr(args, k):
                setattr(args, k, v)
        if null_tokenizer:
            assert getattr(args, "tokenizer_type", None) is None, args.tokenizer_type
            args.tokenizer_type = "NullTokenizer"
        return args

    if not dist.is_initialized():
        dist.init_process_group(backend="gloo")
    parallel_state.initialize_model_parallel(1, 1)
    mlm_compat._load_args_from_checkpoint = load_args
    try:
        model = model_load_save.load_megatron_model(str(iter_dir), model_type="gpt", use_cpu_init=True,
                                                    skip_temp_dist_context=True)
    finally:
        mlm_compat._load_args_from_checkpoint = original
    return model if isinstance(model, list) else [model], seen.get("args")  # None: read run_config.yaml


def unwrapped_state(model) -> dict:
    import torch

    m = model[0]
    while hasattr(m, "module"):
        m = m.module
    return {k: v for k, v in m.state_dict().items() if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}


def compare(got: dict, want: dict, what: str, true_vocab: int | None = None) -> list[str]:
    import torch

    problems = [f"{what}: missing {k}" for k in sorted(set(want) - set(got))]
    problems += [f"{what}: unexpected {k}" for k in sorted(set(got) - set(want))]
    for k in sorted(set(got) & set(want)):
        x, y = got[k], want[k]
        vocab = k.endswith(("word_embeddings.weight", "output_layer.weight"))
        if vocab and true_vocab and x.shape[1:] == y.shape[1:] and min(x.shape[0], y.shape[0]) >= true_vocab:
            # rows past the true vocab are padding, no model weight: a re-padding converter writes zeros
            pad = x[true_vocab:]
            if torch.count_nonzero(pad) and not (x.shape == y.shape and torch.equal(pad, y[true_vocab:])):
                problems.append(f"{what}: {k} padding rows {true_vocab}..{x.shape[0]} neither zero nor the reference's")
            x, y = x[:true_vocab], y[:true_vocab]
        elif x.dim() == 2 and x.shape[0] > y.shape[0] and x.shape[1:] == y.shape[1:]:  # vocab padding rows
            if torch.count_nonzero(x[y.shape[0]:]):
                problems.append(f"{what}: {k} has non-zero vocab padding rows {y.shape[0]}..{x.shape[0]}")
            x = x[:y.shape[0]]
        if x.shape != y.shape or x.dtype != y.dtype:
            problems.append(f"{what}: {k} {tuple(x.shape)} {x.dtype} vs {tuple(y.shape)} {y.dtype}")
        elif not torch.equal(x, y):
            problems.append(f"{what}: {k} max abs diff {(x.double() - y.double()).abs().max().item():.3g}")
    return problems


def cmd_load(a) -> int:
    import torch

    install_shims()
    iter_dir = resolve_iter_dir(a.ckpt)
    try:
        model, args = bridge_load(iter_dir, a.null_tokenizer)
        if a.hf:
            from megatron.bridge import AutoBridge
            from safetensors.torch import load_file

            bridge = AutoBridge.from_hf_pretrained(a.hf)
            got = {name: t.detach().cpu() for name, t in bridge.export_hf_weights(model, cpu=True,
                                                                                  show_progress=False)}
            want = {}
            for f in sorted(Path(a.hf).glob("*.safetensors")):
                want.update(load_file(f))
            problems, what = compare(got, want, "hf export"), f"{len(got)} HF tensors of Bridge's export"
        else:
            want = {k: v for k, v in torch.load(a.ref_dump, weights_only=True).items()
                    if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}
            got = unwrapped_state(model)
            problems = compare(got, want, "state dict", a.true_vocab)
            what = f"{len(got)} tensors vs megatron-core's load"
        how = "run_config.yaml" if args is None else f"{args.transformer_impl}, TP={args.tensor_model_parallel_size}"
        rc = report(problems, f"Megatron-Bridge load_megatron_model ({how}) {what}")
    finally:
        end_parallel(True)
    return rc


# ----------------------------------------------------------------------------- mlm (Megatron-LM)


def weights_only_args(iter_dir: Path) -> tuple[argparse.Namespace, list[str]]:
    """The args as Megatron-LM unpickles them: weights_only with exactly megatron-core's SAFE_GLOBALS."""
    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.safe_globals import SAFE_GLOBALS

    before = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    try:
        torch.serialization.add_safe_globals(list(SAFE_GLOBALS))
        common = dist_checkpointing.load_common_state_dict(str(iter_dir))
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)
    args = common.get("args")
    return args, [] if isinstance(args, argparse.Namespace) else [f"common state args is {type(args)}"]


def cmd_mlm(a) -> int:
    import torch
    from megatron.training import arguments, checkpointing, global_vars

    iter_dir = resolve_iter_dir(a.ckpt)
    ckpt_args, problems = weights_only_args(iter_dir)
    cfg = json.loads(Path(a.config).read_text())
    argv = ["mlm", "--load", str(a.ckpt), "--use-checkpoint-args", "--micro-batch-size", "1",
            "--transformer-impl", ckpt_args.transformer_impl, "--no-load-optim", "--no-load-rng", *MLM_CPU_FLAGS]
    if a.null_tokenizer:  # the args name no tokenizer: the run names one, as Megatron-LM requires
        argv += ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(ckpt_args.vocab_size)]
    saved_argv, saved_tensor = sys.argv, torch.tensor
    sys.argv = argv
    # read_metadata all-reduces the tracker's iteration in a tensor made on "cuda" (when a process group
    # exists, as in a test worker): made on the CPU instead, for gloo
    torch.tensor = lambda *t, device=None, **k: saved_tensor(*t, device="cpu" if device == "cuda" else device, **k)
    try:
        args = arguments.parse_and_validate_args(ignore_unknown_args=False)  # also builds the tokenizer
        checkpointing.set_checkpoint_version(3.0)
        checkpointing.check_checkpoint_args(ckpt_args)  # asserts, as Megatron-LM's load_checkpoint does
        tc = arguments.core_transformer_config_from_args(args)
    finally:
        sys.argv, torch.tensor = saved_argv, saved_tensor
        global_vars.unset_global_variables()
    want = {"num_layers": cfg["num_layers"], "hidden_size": cfg["hidden_size"],
            "ffn_hidden_size": cfg["ffn_hidden_size"], "num_attention_heads": cfg["num_attention_heads"],
            "num_query_groups": cfg.get("num_query_groups") or cfg["num_attention_heads"],
            "kv_channels": cfg.get("kv_channels") or cfg["hidden_size"] // cfg["num_attention_heads"],
            "gated_linear_unit": cfg["swiglu"], "normalization": cfg["normalization"],
            "add_bias_linear": cfg["add_bias_linear"], "add_qkv_bias": cfg["add_qkv_bias"],
            "qk_layernorm": cfg.get("qk_layernorm", False), "params_dtype": torch.float32}
    problems += [f"TransformerConfig.{k}={getattr(tc, k)!r} expected {v!r}" for k, v in want.items()
                 if getattr(tc, k) != v]
    run = {"untie_embeddings_and_output_weights": cfg["untie_embeddings_and_output_weights"],
           "position_embedding_type": cfg["position_embedding_type"],
           "padded_vocab_size": ckpt_args.padded_vocab_size, "max_position_embeddings": cfg["max_position_embeddings"]}
    problems += [f"args.{k}={getattr(args, k)!r} expected {v!r}" for k, v in run.items() if getattr(args, k) != v]
    # load_args_from_checkpoint does not copy the norm epsilon (a run passes --norm-epsilon): the checkpoint has it
    eps = cfg.get("norm_epsilon", 1e-5)
    problems += [f"checkpoint args.{k}={getattr(ckpt_args, k, None)!r} expected {eps!r}"
                 for k in ("layernorm_epsilon", "norm_epsilon") if getattr(ckpt_args, k, None) != eps]
    return report(problems, "Megatron-LM weights_only args, --use-checkpoint-args, check_checkpoint_args, "
                            "core_transformer_config_from_args")


def main(argv=None, serving=False) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("make-hf")
    sp.add_argument("--root", required=True)
    sp = sub.add_parser("import")
    sp.add_argument("--hf", required=True)
    sp.add_argument("--out", required=True)
    sp = sub.add_parser("defaults")
    sp.add_argument("--out", required=True)
    sp = sub.add_parser("load")
    sp.add_argument("--ckpt", required=True)
    ref = sp.add_mutually_exclusive_group(required=True)
    ref.add_argument("--hf", default=None)
    ref.add_argument("--ref-dump", default=None)
    sp.add_argument("--null-tokenizer", action="store_true")
    sp.add_argument("--true-vocab", type=int, default=None,
                    help="--ref-dump: compare the rows of this true vocabulary; padding rows zero or the dump's")
    sp = sub.add_parser("mlm")
    sp.add_argument("--ckpt", required=True)
    sp.add_argument("--config", required=True)
    sp.add_argument("--null-tokenizer", action="store_true")
    a = p.parse_args(argv)
    cmds = {"make-hf": cmd_make_hf, "import": cmd_import, "defaults": cmd_defaults, "load": cmd_load, "mlm": cmd_mlm}
    return cmds[a.cmd](a)


if __name__ == "__main__":
    run_program(main)
