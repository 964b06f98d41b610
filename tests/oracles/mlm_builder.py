"""The Megatron-LM builder oracle: the model Megatron-LM's own training code builds from a checkpoint's ``args``:
``parse_args``'s defaults, overlaid with the stored args (a run whose arguments are the checkpoint's, as
Megatron-Bridge's Megatron-LM-compat loader takes them), then the builder of that Megatron-LM release:

  * core_v0.19 (megatron-core 0.19.2's wheel ships ``megatron/training``, the core_v0.19.0 tag's code):
    ``core_transformer_config_from_args`` and ``gpt_config_from_args`` (the GPTModelConfig that ``GPTModelBuilder``
    hands to ``GPTModel``), or ``hybrid_config_from_args`` for args that carry a hybrid layer pattern;
  * core_v0.16 (``--megatron-lm TREE``: a Megatron-LM source tree at that tag, whose ``megatron/training``,
    ``gpt_builders.py`` and ``mamba_builders.py`` are imported beside the installed megatron-core 0.16.1; no
    ``gpt_config_from_args`` there): ``gpt_builders.gpt_builder`` (``pretrain_gpt.py``), or
    ``mamba_builders.mamba_builder`` (``pretrain_mamba.py``) for a hybrid pattern, run with ``GPTModel`` /
    ``MambaModel`` standing in as a recorder of the arguments the builder passes (its TransformerConfig among
    them; the class's own defaults for the rest), so nothing is built (nor does the class's own __init__ run: the
    failure of core_v0.16's GPTModel on a YaRN config without yarn_* shows here as those fields' absence).

  configs --cases CASES.json --out OUT.json [--megatron-lm TREE]
      CASES: {name: path of a torch.save'd args Namespace}; OUT: {name: {"model": "gpt"|"hybrid", "fields":
      {...}} or {"error": "..."}}. ``--megatron-lm`` runs in a process of its own (never a test worker's).

Fields are the TransformerConfig fields and the model config's RoPE / vocabulary / tying fields, as JSON values
(callables by their dotted name), and ``release``: the builder's (``core_v0.19`` or ``core_v0.16``). One process
judges every case.

CPU stand-ins for core_v0.16 on the default venv (no triton, no six; none is reached while building a config):
``megatron.core.transformer.custom_layers.batch_invariant_kernels`` (imported by initialize.py) and
``megatron.core.inference.contexts.attention_context.triton.tensor_ops`` (by mamba_mixer) as modules whose functions
raise if called, ``six`` (bert_tokenization) as ``PY3``. The run's own choices besides ``CPU_RUN``: the hybrid
builder's ``--spec`` where the args name none (core_v0.16's ``mamba_builder`` has no default; Megatron-LM's
examples/mamba scripts pass this one).
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import sys
import types

MODEL_FIELDS = ("position_embedding_type", "rotary_base", "rotary_percent", "rope_scaling", "rope_scaling_factor",
                "seq_len_interpolation_factor", "share_embeddings_and_output_weights", "vocab_size",
                "hybrid_layer_pattern")
# the run's own choices on a CPU box (kernels and fusions: the same function, audit.KERNEL), never the checkpoint's
CPU_RUN = {"apply_rope_fusion": False, "bias_gelu_fusion": False, "bias_swiglu_fusion": False,
           "masked_softmax_fusion": False, "gradient_accumulation_fusion": False, "transformer_impl": "local"}
MAMBA_SPEC = ["megatron.core.models.mamba.mamba_layer_specs", "mamba_stack_spec"]
ABSENT = {  # module -> the names it must offer (functions that raise), where its import needs what the CPU lacks
    "megatron.core.transformer.custom_layers.batch_invariant_kernels": (
        "set_batch_invariant_mode", "is_batch_invariant_mode_enabled", "disable_batch_invariant_mode",
        "enable_batch_invariant_mode"),
    "megatron.core.inference.contexts.attention_context.triton.tensor_ops": (
        "tensor_get_slice_after", "tensor_masked_update", "tensor_merge"),
}


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


def use_tree(tree: str) -> None:
    """Megatron-LM's code from ``tree`` (its root: gpt_builders.py, mamba_builders.py, megatron/training), beside the
    installed megatron-core (``megatron`` is a namespace package: the tree's megatron/core, if any, is never used)."""
    import importlib.util

    if not os.path.isfile(os.path.join(tree, "gpt_builders.py")):
        raise SystemExit(f"--megatron-lm {tree}: no gpt_builders.py there (a Megatron-LM source tree's root)")
    sys.path.insert(0, os.path.abspath(tree))
    for name, names in ABSENT.items():
        try:
            found = importlib.util.find_spec(name) is not None and importlib.import_module(name)
        except ImportError:
            found = False
        if not found:
            sys.modules[name] = stand_in(name, names)
    try:
        import six  # noqa: F401
    except ImportError:
        sys.modules["six"] = types.SimpleNamespace(PY2=False, PY3=True)


def stand_in(name: str, names: tuple[str, ...]) -> types.ModuleType:
    mod = types.ModuleType(name)

    def absent(*a, **k):
        raise RuntimeError(f"{name}: not available on this CPU machine (its import needs triton)")

    for n in names:
        setattr(mod, n, absent)
    return mod


class Recorded(Exception):
    """Raised by the model class standing in for ``GPTModel`` / ``MambaModel``: the arguments the builder passed."""

    def __init__(self, cls: type, kwargs: dict) -> None:
        super().__init__(cls.__name__)
        self.cls, self.kwargs = cls, kwargs


class Spec:
    """What a layer-spec function of the builder returns here: its name (the spec is not judged: the 0.19 oracle,
    whose GPTModelConfig chooses the spec inside GPTModelBuilder, judges none either; on the CPU the experimental
    attention variants' and MoE block specs want Transformer Engine and initialised parallel groups)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, *a, **k) -> Spec:
        return self

    def __getitem__(self, i) -> Spec:  # get_gpt_decoder_layer_specs(...)[-1]
        return self

    def __repr__(self) -> str:
        return self.name


def recorded(module, cls_name: str, call) -> tuple[object, dict]:
    """``call()`` (a Megatron-LM builder) with ``module.<cls_name>`` recording its arguments instead of building:
    the TransformerConfig it made, and every constructor argument (the class's own default where not passed). The
    module's ``get_*spec*`` functions stand in as ``Spec``."""
    cls = getattr(module, cls_name)

    def record(*a, **kwargs):
        assert not a, f"{cls_name} called with positional arguments"
        raise Recorded(cls, kwargs)

    saved = {n: getattr(module, n) for n in dir(module) if n.startswith("get_") and "spec" in n}
    for n in saved:
        setattr(module, n, Spec(n))
    setattr(module, cls_name, record)
    try:
        call()
    except Recorded as r:
        params = inspect.signature(r.cls.__init__).parameters.values()
        got = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
        got.update(r.kwargs)
        return got.pop("config"), got
    finally:
        for n, f in {**saved, cls_name: cls}.items():
            setattr(module, n, f)
    raise RuntimeError(f"the builder returned without calling {cls_name}")


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
    if hasattr(argument_utils, "gpt_config_from_args"):  # core_v0.19
        release = "core_v0.19"
        transformer = argument_utils.core_transformer_config_from_args(args)
        if hybrid:
            args.hybrid_layer_pattern = hybrid
            model = argument_utils.hybrid_config_from_args(args, transformer)
        else:
            model = argument_utils.gpt_config_from_args(args, transformer)
        model = {name: getattr(model, name) for name in MODEL_FIELDS if hasattr(model, name)}
    else:  # core_v0.16: the builders of pretrain_gpt.py / pretrain_mamba.py, at the tree's root
        from megatron.training import global_vars

        release = "core_v0.16"
        global_vars.set_args(args)  # _get_transformer_layer_spec reads get_args()
        if hybrid:
            import mamba_builders

            if args.spec is None:
                args.spec = MAMBA_SPEC
            transformer, model = recorded(mamba_builders, "MambaModel",
                                          lambda: mamba_builders.mamba_builder(args, True, True))
            model["hybrid_layer_pattern"] = model.pop("hybrid_override_pattern")
        else:
            import gpt_builders

            transformer, model = recorded(gpt_builders, "GPTModel", lambda: gpt_builders.gpt_builder(args, True, True))
        model = {"layer_spec": model.get("transformer_layer_spec")} | {n: model[n] for n in MODEL_FIELDS if n in model}
    fields = {f.name: plain(getattr(transformer, f.name)) for f in dataclasses.fields(transformer)}
    fields.update({name: plain(v) for name, v in vars(transformer).items() if name.startswith("yarn_")})  # set by
    # _apply_yarn_config_from_args on a GPT (not MLA) config, outside its dataclass fields
    fields.update({name: plain(v) for name, v in model.items()})
    fields["config_class"] = type(transformer).__name__
    fields["release"] = release
    return {"model": "hybrid" if hybrid else "gpt", "fields": fields}


def main(argv=None, serving=False) -> int:
    import torch

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("configs")
    sp.add_argument("--cases", required=True)
    sp.add_argument("--out", required=True)
    sp.add_argument("--megatron-lm", help="a Megatron-LM source tree (e.g. core_v0.16.1's) to build with")
    a = p.parse_args(argv)
    if a.megatron_lm:
        assert not serving, "--megatron-lm changes the process's imports: run it in a process of its own"
        use_tree(a.megatron_lm)
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
