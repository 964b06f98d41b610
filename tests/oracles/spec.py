"""Independent oracle for speculative checkpoints: megatron-core + ModelOpt only (never dist_convert).

  torchrun --nproc_per_node=TP*PP tests/oracles/spec.py check --config C.json --tp T --pp P \
      --algo eagle|medusa --ckpt SPECULATIVE_DIR --ref BASE_TORCH_DIST_DIR

In a process of its own (never the one that wrote CKPT), with megatron-core's model-parallel groups set up
for this check alone: builds the base GPTModel (megatron-core local spec), restores the ModelOpt
state saved in CKPT, loads CKPT strictly (every key of the speculative model, no unexpected ones),
and checks that
  * every base weight equals the base checkpoint REF loaded by megatron-core at the same layout;
  * the draft weights are real (finite, not all zero) and TP-replicated draft tensors agree;
  * (PP=1) a forward pass runs: base logits, a finite training loss with labels, and draft tokens
    from ModelOpt's pseudo speculative generation.
  * with --draft DIR (TP=1, PP=1): the exported draft equals the restored draft, as ModelOpt's own
    exporter writes it (EAGLE; its Hub template config is pointed at a local Llama config made from
    C.json) or, for Medusa (no exporter rules in ModelOpt 0.47), tensor by tensor by name.
The checkpoint may be restored at another TP/PP than it was saved at (megatron-core reshards).
With --nemo2, CKPT is a NeMo 2 checkpoint and is restored as NeMo's modelopt model_utils does it:
ModelOpt's restore_sharded_modelopt_state([model], CKPT/weights, prefix="module."), then the weights
under the same prefix (NeMo's MegatronParallel naming) from CKPT/weights.
Prints "SPEC ORACLE OK ..." on success and exits 0; prints MISMATCH lines and exits 1 otherwise.
"""
import argparse
import contextlib
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the oracles package, helpers

from oracles import mcore as mo  # noqa: E402
from oracles.common import run_program  # noqa: E402


def local_layers_without_te():
    """The substitutions ModelOpt's EAGLE plugin needs without Transformer Engine (FIELD_NOTES)."""
    try:
        import transformer_engine  # noqa: F401

        return
    except ImportError:
        pass
    from megatron.core import parallel_state
    from megatron.core.post_training.modelopt import layers
    from megatron.core.post_training.modelopt.gpt import model_specs
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from modelopt.torch.speculative.plugins import megatron_eagle

    class Replicated(layers.Linear):
        def __init__(self, input_size, output_size, *, parallel_mode, config, init_method, bias=True,
                     skip_bias_add=False, skip_weight_param_allocation=False, **_):
            super().__init__(input_size, output_size, config=config, init_method=init_method, bias=bias,
                             skip_bias_add=skip_bias_add, skip_weight_param_allocation=skip_weight_param_allocation,
                             tp_group=parallel_state.get_tensor_model_parallel_group())

    @contextlib.contextmanager
    def no_cp(*_a, **_k):
        yield

    megatron_eagle.TELinear = Replicated
    megatron_eagle.TENorm = WrappedTorchNorm
    megatron_eagle.te_dot_product_attention_with_cp = no_cp
    model_specs.Norm = WrappedTorchNorm
    model_specs.TEDotProductAttention = DotProductAttention


def hybrid_alias():
    """ModelOpt 0.47's exporter imports megatron.core.models.hybrid (megatron-core 0.16: mamba)."""
    import types

    try:
        import megatron.core.models.hybrid.hybrid_model  # noqa: F401
    except ImportError:
        from megatron.core.models.mamba import MambaModel

        pkg, mod = types.ModuleType("megatron.core.models.hybrid"), types.ModuleType("hybrid_model")
        mod.HybridModel, pkg.hybrid_model, pkg.__path__ = MambaModel, mod, []
        sys.modules["megatron.core.models.hybrid"] = pkg
        sys.modules["megatron.core.models.hybrid.hybrid_model"] = mod


def modelopt_export(model, cfg, out_dir):
    """ModelOpt's own EAGLE export (TP=1), offline: the Hub template id resolves to a local config."""
    import importlib

    import torch
    import transformers

    base = os.path.join(out_dir, "base")
    transformers.LlamaConfig(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], intermediate_size=cfg["ffn_hidden_size"],
        num_hidden_layers=cfg["num_layers"], num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_query_groups"], head_dim=cfg["kv_channels"],
        max_position_embeddings=cfg["max_position_embeddings"], rms_norm_eps=cfg["norm_epsilon"],
        rope_theta=cfg["rotary_base"], architectures=["LlamaForCausalLM"]).save_pretrained(base)
    saved = transformers.AutoConfig.from_pretrained
    original = saved.__func__
    transformers.AutoConfig.from_pretrained = classmethod(
        lambda cls, name, *a, **k: original(cls, base if name == "nvidia/Llama-3.1-8B-Instruct-FP8" else name, *a, **k))
    try:
        export = importlib.import_module("modelopt.torch.export.unified_export_megatron")
        export.export_mcore_gpt_to_hf(model, base, export_extra_modules=True, dtype=torch.float32,
                                      export_dir=os.path.join(out_dir, "draft"))
    finally:
        transformers.AutoConfig.from_pretrained = saved
    return os.path.join(out_dir, "draft")


def check_draft(model, cfg, algo, draft_dir, work):
    from safetensors.torch import load_file

    got = load_file(os.path.join(draft_dir, "model.safetensors"))
    if algo == "eagle":
        want = load_file(os.path.join(modelopt_export(model, cfg, work), "model.safetensors"))
    else:
        sd = model.state_dict()
        heads = sorted({k.split(".")[1] for k in sd if k.startswith("medusa_heads.")})
        want = {}
        for h in heads:
            layers = sorted({k.split(".")[3] for k in sd if k.startswith(f"medusa_heads.{h}.medusa_layers.")})
            for j in layers:
                for w in ("weight", "bias"):
                    want[f"medusa_heads.{h}.{j}.linear.{w}"] = sd[f"medusa_heads.{h}.medusa_layers.{j}.linear.{w}"]
            want[f"medusa_heads.{h}.{len(layers)}.weight"] = sd[f"medusa_heads.{h}.lm_head.weight"][: cfg["vocab_size"]]
    bad = [f"draft export: names {sorted(set(got) ^ set(want))}"] if set(got) != set(want) else []
    bad += [f"draft export: {k} differs" for k in sorted(set(got) & set(want))
            if not got[k].equal(want[k].to(got[k].dtype))]
    return bad, len(want)


def sharded_sd(model, prefix=""):
    from megatron.core import parallel_state

    return model.sharded_state_dict(
        prefix=prefix, metadata={"dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)})


def restore(cfg, a):
    import modelopt.torch.opt as mto
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    iterdir = os.path.join(a.ckpt, "weights") if a.nemo2 else mo.resolve_iter_dir(a.ckpt)
    model = mo.build_model(cfg, a.tp, a.pp, parallel_output=True)
    mo.randomize(model, cfg, 4_000_037)
    state = dist_checkpointing.load_common_state_dict(os.path.join(iterdir, "modelopt_state"))
    modes = [m for m, _ in state["modelopt_state_dict"]]
    if a.nemo2:
        from modelopt.torch.opt.plugins import restore_sharded_modelopt_state

        restore_sharded_modelopt_state([model], iterdir, prefix="module.")
    else:
        model = mto.restore_from_modelopt_state(model, state)
    mo.randomize(model, cfg, 5_000_011)  # draft modules too: an unloaded tensor cannot pass below
    entry, prefix = ("sharded_state_dict", "module.") if a.nemo2 else ("model", "")
    loaded = dist_checkpointing.load({entry: sharded_sd(model, prefix)}, iterdir, strict=StrictHandling.RAISE_ALL)
    res = model.load_state_dict({k.removeprefix(prefix): v for k, v in loaded[entry].items()}, strict=False)
    missing = [k for k in res.missing_keys if not k.endswith("_extra_state")]
    return model, modes, missing + list(res.unexpected_keys)


def cmd_check(a, cfg):
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    model, modes, load_problems = restore(cfg, a)
    base = mo.build_model(cfg, a.tp, a.pp)
    mo.randomize(base, cfg, 6_000_001)
    mo.load_into(base, a.ref, "auto", a.pp)
    bad = [f"load: {p}" for p in load_problems]
    if modes != [a.algo]:
        bad.append(f"modelopt modes {modes}, expected [{a.algo}]")
    sd = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}
    ref = {k: v for k, v in base.state_dict().items() if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}
    nrows = mo.vocab_rows(cfg, a.tp, parallel_state.get_tensor_model_parallel_rank())
    for k, y in ref.items():
        x = sd.get(k)
        if x is None:
            bad.append(f"{k}: base weight missing from the speculative model")
            continue
        if k.endswith(("word_embeddings.weight", "output_layer.weight")):
            x, y = x[:nrows], y[:nrows]
        if x.dtype != y.dtype or not torch.equal(x, y):
            bad.append(f"{k}: base weight differs from the source")
    draft = {k: v for k, v in sd.items() if k not in ref}  # with PP, only some stages hold draft modules
    for k, v in draft.items():  # initialised by ModelOpt (std ~0.02), not left as uninitialised memory
        if v.is_floating_point() and v.dim() >= 2 and not (torch.isfinite(v).all() and 1e-4 < v.float().std() < 1):
            bad.append(f"{k}: draft weight is not initialised (std {v.float().std().item():.3g})")
    tp_group = parallel_state.get_tensor_model_parallel_group()
    for name, p in model.named_parameters():
        if name in draft and not getattr(p, "tensor_model_parallel", False) and a.tp > 1:
            copies = [torch.empty_like(p) for _ in range(a.tp)]
            dist.all_gather(copies, p.detach().contiguous(), group=tp_group)
            if not all(torch.equal(c, copies[0]) for c in copies):
                bad.append(f"{name}: replicated draft weight differs across TP ranks")
    forward = ""
    if a.pp == 1:
        g = torch.Generator().manual_seed(7)
        b, s = 2, 12
        ids = torch.randint(0, cfg["vocab_size"], (b, s), generator=g)
        pos = torch.arange(s).unsqueeze(0).expand(b, s).contiguous()
        mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1).view(1, 1, s, s).expand(b, 1, s, s).contiguous()
        model.eval()
        with torch.no_grad():
            logits = model(ids, pos, mask)
            loss = model(ids, pos, mask, labels=torch.roll(ids, -1, dims=1))
            if a.algo == "medusa":
                _, draft_tokens = model.pseudo_speculative_generate(ids, pos, mask)
            else:
                _, draft_tokens = model.pseudo_speculative_generate(ids, steps=3)
        if not torch.isfinite(loss).all() or logits.shape[:2] != (b, s) or draft_tokens.numel() == 0:
            bad.append(f"forward: logits {tuple(logits.shape)} loss finite {bool(torch.isfinite(loss).all())} "
                       f"draft tokens {tuple(draft_tokens.shape)}")
        forward = f"; forward: loss {loss.float().mean().item():.4f}, draft tokens {tuple(draft_tokens.shape)}"
    if a.draft:
        if (a.tp, a.pp) != (1, 1):
            raise SystemExit("--draft needs --tp 1 --pp 1")
        problems, n = check_draft(model, cfg, a.algo, a.draft, os.path.join(a.ckpt + ".oracle_export"))
        bad += problems
        forward += f"; exported draft: {n} tensors equal"
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (bad, len(ref), len(draft)))
    if dist.get_rank() == 0:
        lines = [f"MISMATCH rank{r} {x}" for r, (bs, _, _) in enumerate(gathered) for x in bs]
        if not any(g[2] for g in gathered):
            lines.append("MISMATCH the checkpoint has no draft weights")
        for line in lines:
            print(line)
        nb, nd = sum(g[1] for g in gathered), sum(g[2] for g in gathered)
        print(f"SPEC ORACLE {'FAIL' if lines else 'OK'} {a.algo}: {nb} base tensors equal, {nd} draft tensors"
              f"{forward}", flush=True)
    return 1 if any(g[0] for g in gathered) or not any(g[2] for g in gathered) else 0


def main(argv=None, serving=False):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cmd", choices=["check"])
    p.add_argument("--config", required=True)
    p.add_argument("--tp", type=int, required=True)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--algo", choices=["eagle", "medusa"], required=True)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--ref", required=True)
    p.add_argument("--draft", default=None, help="an exported draft directory to check (TP=1, PP=1)")
    p.add_argument("--nemo2", action="store_true", help="CKPT is a NeMo 2 checkpoint (weights/ + context/)")
    a = p.parse_args(argv)
    mo.apply_cpu_shims()
    hybrid_alias()
    import torch.distributed as dist

    cfg = mo.load_config(a.config)
    mo.init_parallel(a.tp, a.pp)
    try:
        local_layers_without_te()
        rc = cmd_check(a, cfg)
        dist.barrier()
    finally:
        mo.end_parallel(serving)
    return rc


if __name__ == "__main__":
    run_program(main)
