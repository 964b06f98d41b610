"""The Megatron-LM builder oracle: the model Megatron-LM's own training code builds from a checkpoint's ``args``
(megatron-core 0.19.2's wheel ships ``megatron/training``, Megatron-LM's core_v0.19 code): ``parse_args``'s
defaults, overlaid with the stored args (a run whose arguments are the checkpoint's, as Megatron-Bridge's
Megatron-LM-compat loader takes them), then ``core_transformer_config_from_args`` and ``gpt_config_from_args``
(the GPTModelConfig that ``GPTModelBuilder`` hands to ``GPTModel``), or ``hybrid_config_from_args`` for args that
carry a hybrid layer pattern.

  configs --cases CASES.json --out OUT.json   CASES: {name: path of a torch.save'd args Namespace}; OUT: {name:
                                               {"model": "gpt"|"hybrid", "fields": {...}} or {"error": "..."}}

Fields are the TransformerConfig fields and the model config's RoPE / vocabulary / tying fields, as JSON values
(callables by their dotted name). One process judges every case.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

MODEL_FIELDS = ("position_embedding_type", "rotary_base", "rotary_percent", "rope_scaling", "rope_scaling_factor",
                "seq_len_interpolation_factor", "share_embeddings_and_output_weights", "vocab_size",
                "hybrid_layer_pattern")
# the run's own choices on a CPU box (kernels and fusions: the same function, audit.KERNEL), never the checkpoint's
CPU_RUN = {"apply_rope_fusion": False, "bias_gelu_fusion": False, "bias_swiglu_fusion": False,
           "masked_softmax_fusion": False, "gradient_accumulation_fusion": False, "transformer_impl": "local"}


def plain(value):
    if callable(value) and hasattr(value, "__name__"):
        return f"{value.__module__}.{value.__name__}"
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def built(stored: argparse.Namespace) -> dict:
    from megatron.training import argument_utils, arguments

    argv, sys.argv = sys.argv, ["megatron-lm"]
    try:
        args = arguments.parse_args(ignore_unknown_args=True)
    finally:
        sys.argv = argv
    for name, value in vars(stored).items():
        setattr(args, name, value)
    for name, value in CPU_RUN.items():
        setattr(args, name, value)
    hybrid = getattr(args, "hybrid_layer_pattern", None) or getattr(args, "hybrid_override_pattern", None)
    transformer = argument_utils.core_transformer_config_from_args(args)
    if hybrid:
        args.hybrid_layer_pattern = hybrid
        model = argument_utils.hybrid_config_from_args(args, transformer)
    else:
        model = argument_utils.gpt_config_from_args(args, transformer)
    fields = {f.name: plain(getattr(transformer, f.name)) for f in dataclasses.fields(transformer)}
    fields.update({name: plain(v) for name, v in vars(transformer).items() if name.startswith("yarn_")})  # set by
    # _apply_yarn_config_from_args on a GPT (not MLA) config, outside its dataclass fields
    fields.update({name: plain(getattr(model, name)) for name in MODEL_FIELDS if hasattr(model, name)})
    fields["config_class"] = type(transformer).__name__
    return {"model": "hybrid" if hybrid else "gpt", "fields": fields}


def main(argv=None, serving=False) -> int:
    import torch

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("configs")
    sp.add_argument("--cases", required=True)
    sp.add_argument("--out", required=True)
    a = p.parse_args(argv)
    with open(a.cases) as f:
        cases = json.load(f)
    out = {}
    for name, path in cases.items():
        try:
            out[name] = built(torch.load(path, weights_only=False))
        except Exception as e:  # a reader that fails loudly: its error is the verdict
            out[name] = {"error": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"ORACLE BUILT {len(out)} configs", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import warnings

    warnings.filterwarnings("ignore")
    sys.exit(main())
