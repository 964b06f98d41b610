"""Oracle: Hugging Face peft 0.21.2 (with transformers) makes, merges and judges LoRA adapters of an HF
causal LM. Runs in the second runtime (Python 3.12); imports peft, transformers, torch, safetensors; never
dist_convert. Every model is loaded in fp32 on CPU; the fixed tokens are
``torch.arange(2 * 16).reshape(2, 16) % vocab_size``.

  oracles/peft_lora.py make --hf HF_DIR --out ADIR [--variant plain|patterns|rslora|dora|bias|qv|ranks] [--seed N]
      peft's own adapter: ``LoraConfig(r=4, lora_alpha=8, target_modules=q/k/v/o/gate/up/down_proj,
      lora_dropout=0, task_type=CAUSAL_LM, init_lora_weights=False)``, ``get_peft_model``, then every adapter
      tensor (lora_A, lora_B, lora_B's bias, DoRA's magnitude) set from a generator seeded by
      ``crc32(f"{seed}|{name}")`` (all non-zero, none of them peft's no-op init), ``save_pretrained(ADIR)``
      (adapter_config.json + adapter_model.safetensors). Variants: plain; patterns (rank_pattern /
      alpha_pattern, PATTERNS: q/k/v of layer 0 and gate/up of layer 1 get different ranks and scalings;
      the per-module rank and alpha peft built are checked against PATTERN_EXPECT); rslora (use_rslora,
      scaling alpha / sqrt(r)); dora (use_dora: lora_magnitude_vector); bias (lora_bias: lora_B has a bias;
      the Llama projections have none, so peft cannot merge it); qv (q_proj and v_proj of layer 1 only,
      layers_to_transform=[1]); ranks (rank_pattern at one alpha: scales powers of two apart).
  oracles/peft_lora.py merge --hf HF_DIR --adapter ADIR --out MDIR [--atol 1e-5]
      The truth of merged weights: ``PeftModel.from_pretrained(base, ADIR)``, ``merge_and_unload
      (safe_merge=True)``, ``save_pretrained(MDIR)`` (safetensors, config; the HF directory's tokenizer and
      generation files copied). MDIR/logits.pt: the merged model's logits [2, 16, vocab] fp32 on the fixed
      tokens. Checked: merged vs un-merged PeftModel logits (max abs <= atol), merged weight names equal the
      base model's, and the adapter changes the logits.
  oracles/peft_lora.py check --hf HF_DIR --adapter ADIR --ref REF_ADIR [--atol 1e-6] [--logits-atol 1e-5] [--tensors]
      Judges ADIR (written by someone else) against REF_ADIR, peft being the judge: each is loaded with
      ``PeftModel.from_pretrained``; no missing or unexpected adapter keys (peft's ``load_result`` of
      ``set_peft_model_state_dict`` on the loaded model, its missing-key warning, and the file's keys against
      ``get_peft_model_state_dict`` of the loaded model); PeftModel logits ADIR vs REF (max abs <=
      logits-atol: the same deltas factored otherwise differ by ~3e-6 in fp32 logits); the effective change
      of each adapted module's weight (and bias) ADIR vs REF (max abs <= atol): peft's
      ``get_delta_weight("default")`` for plain LoRA (plus ``lora_B.bias * scaling`` for lora_bias), the
      merged minus the base weight (``LoraLayer.merge(safe_merge=True)``) for a variant (DoRA); a module
      adapted on one side only counts as a zero change on the other. So differently structured adapters
      (other ranks, alphas, rslora) pass when they mean the same weights.
      --tensors: also the same safetensors keys with bit-equal tensors (dtype included), and equal
      adapter_config.json r, lora_alpha, target_modules (as sets), rank_pattern, alpha_pattern, use_rslora,
      use_dora, lora_bias, layers_to_transform.

Prints ``MISMATCH ...`` lines, then ``ORACLE OK ...`` or ``ORACLE FAIL ...``; exit 0 only when everything
matched. ``main(argv, serving=True)`` (tests/job_worker.py) keeps no state between calls and leaves the global
torch RNG as it found it.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import shutil
import sys
import warnings
import zlib
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from peft.tuners.lora import LoraLayer
from peft.utils import load_peft_weights
from safetensors import safe_open
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the oracles package, helpers

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
R, ALPHA = 4, 8
ADAPTER = "default"
ADAPTER_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."  # PeftModel's name of the wrapped model
# peft matches each key as a regex against the end of a module name at a dot boundary (the first key that
# matches, in dict order, wins): a bare "down_proj" is every down_proj, a partial "layers.0.self_attn.v_proj" works
PATTERNS = {"rank_pattern": {"model.layers.0.self_attn.q_proj": 2, "layers.0.self_attn.v_proj": 6,
                             "down_proj": 8, "model.layers.1.mlp.up_proj": 2},
            "alpha_pattern": {"o_proj": 16, "model.layers.1.mlp.gate_proj": 4,
                              "model.layers.0.self_attn.k_proj": 12}}
# module -> (r, alpha) the patterns must give (written by hand; anything not listed: R, ALPHA)
PATTERN_EXPECT = {"model.layers.0.self_attn.q_proj": (2, ALPHA), "model.layers.0.self_attn.k_proj": (R, 12),
                  "model.layers.0.self_attn.v_proj": (6, ALPHA), "model.layers.0.self_attn.o_proj": (R, 16),
                  "model.layers.0.mlp.down_proj": (8, ALPHA), "model.layers.1.self_attn.o_proj": (R, 16),
                  "model.layers.1.mlp.gate_proj": (R, 4), "model.layers.1.mlp.up_proj": (2, ALPHA),
                  "model.layers.1.mlp.down_proj": (8, ALPHA)}
VARIANTS = {"plain": {}, "patterns": PATTERNS, "rslora": {"use_rslora": True}, "dora": {"use_dora": True},
            "bias": {"lora_bias": True}, "qv": {"target_modules": ["q_proj", "v_proj"], "layers_to_transform": [1]},
            # rank_pattern at one alpha: scales 1 (q), 4 (layer 1's down_proj), 2 (the rest), powers of two apart
            "ranks": {"rank_pattern": {"q_proj": 8, "model.layers.1.mlp.down_proj": 2}}}
CONFIG_FIELDS = ("r", "lora_alpha", "target_modules", "rank_pattern", "alpha_pattern", "use_rslora", "use_dora",
                 "lora_bias", "layers_to_transform")


# ----------------------------------------------------------------------------------------------- helpers

def report(problems: list[str], what: str) -> int:
    """One MISMATCH line per problem, then ORACLE OK/FAIL; the exit code (the oracles' shared verdict)."""
    for p in problems:
        print(f"MISMATCH {p}")
    print(f"ORACLE FAIL {len(problems)} problems ({what})" if problems else f"ORACLE OK {what}")
    sys.stdout.flush()
    return 1 if problems else 0


def load_base(hf_dir: Path) -> torch.nn.Module:
    """The HF model as its config.json's architecture (a vision-language model is no AutoModelForCausalLM)."""
    import transformers

    arch = (json.loads((Path(hf_dir) / "config.json").read_text()).get("architectures") or [""])[0]
    cls = getattr(transformers, arch, None) if arch.endswith("ForConditionalGeneration") else None
    return (cls or AutoModelForCausalLM).from_pretrained(hf_dir, dtype=torch.float32).eval()


def fixed_tokens(model: torch.nn.Module) -> torch.Tensor:
    vocab = model.config.get_text_config().vocab_size  # a vision-language model's language model's
    return torch.arange(2 * 16).reshape(2, 16) % vocab


def logits_of(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tokens).logits.float()


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


def file_tensors(adir: Path) -> dict[str, torch.Tensor]:
    with safe_open(adir / ADAPTER_FILE, "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def lora_layers(model: torch.nn.Module) -> dict[str, LoraLayer]:
    """HF module name (``model.layers.0.self_attn.q_proj``) -> peft's LoRA layer holding the adapter."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and ADAPTER in module.r:
            out[name.removeprefix(PREFIX)] = module
    return out


def seeded(seed: int, name: str, shape: torch.Size) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(f"{seed}|{name}".encode()))
    return torch.randn(shape, generator=g)


# -------------------------------------------------------------------------------------------------- make

def lora_config(variant: str) -> LoraConfig:
    kw = {"r": R, "lora_alpha": ALPHA, "target_modules": TARGETS, "lora_dropout": 0.0, "task_type": "CAUSAL_LM",
          "init_lora_weights": False}
    return LoraConfig(**copy.deepcopy({**kw, **VARIANTS[variant]}))  # peft must not share the module's dicts


def randomize_adapter(model: torch.nn.Module, seed: int) -> None:
    """Every adapter tensor from its own seeded generator (seeded by seed and module name, so the values do
    not depend on the order peft builds the layers): A ~ N(0, 1/in), B ~ N(0, 0.01/r) (B A: about 0.1 of the
    base weight's scale before scaling), B's bias ~ N(0, 0.0004), DoRA magnitude = the base weight's row
    norms * (1 + 0.1 N(0, 1)) (so m / ||W'|| != 1)."""
    with torch.no_grad():
        for mname, layer in lora_layers(model).items():
            a, b = layer.lora_A[ADAPTER], layer.lora_B[ADAPTER]
            a.weight.copy_(seeded(seed, f"{mname}.lora_A", a.weight.shape) / math.sqrt(a.weight.shape[1]))
            b.weight.copy_(seeded(seed, f"{mname}.lora_B", b.weight.shape) * 0.1 / math.sqrt(b.weight.shape[1]))
            if b.bias is not None:
                b.bias.copy_(0.02 * seeded(seed, f"{mname}.lora_B.bias", b.bias.shape))
            if ADAPTER in layer.lora_magnitude_vector:
                mag = layer.lora_magnitude_vector[ADAPTER].weight
                norm = layer.get_base_layer().weight.norm(dim=1)
                mag.copy_(norm * (1.0 + 0.1 * seeded(seed, f"{mname}.magnitude", mag.shape)))


def pattern_problems(model: torch.nn.Module) -> list[str]:
    """The rank / alpha / scaling peft built per module against PATTERN_EXPECT."""
    problems = []
    for mname, layer in lora_layers(model).items():
        r, alpha = PATTERN_EXPECT.get(mname, (R, ALPHA))
        got = (layer.r[ADAPTER], layer.lora_alpha[ADAPTER], layer.lora_A[ADAPTER].weight.shape[0])
        if got != (r, alpha, r) or not math.isclose(layer.scaling[ADAPTER], alpha / r):
            problems.append(f"{mname}: peft built r {got[0]} alpha {got[1]} (A rows {got[2]}, scaling "
                            f"{layer.scaling[ADAPTER]}), patterns mean r {r} alpha {alpha}")
        print(f"PATTERN {mname} r={layer.r[ADAPTER]} alpha={layer.lora_alpha[ADAPTER]} "
              f"scaling={layer.scaling[ADAPTER]:g}")
    return problems


def saved_problems(adir: Path, variant: str) -> list[str]:
    """Every saved tensor non-zero everywhere; for patterns, the config keeps the patterns and the lora_A
    shapes carry the ranks."""
    problems, tensors = [], file_tensors(adir)
    for k, t in sorted(tensors.items()):
        print(f"TENSOR {k} {list(t.shape)} {str(t.dtype).removeprefix('torch.')}")
        if not (t != 0).all():
            problems.append(f"{k}: {(t == 0).sum().item()} zero elements")
    cfg = json.loads((adir / "adapter_config.json").read_text())
    for key in ("rank_pattern", "alpha_pattern"):
        if variant == "patterns" and cfg.get(key) != PATTERNS[key]:
            problems.append(f"adapter_config.json {key} {cfg.get(key)} != {PATTERNS[key]}")
    for mname, (r, _) in PATTERN_EXPECT.items() if variant == "patterns" else ():
        shape = tensors.get(f"{PREFIX}{mname}.lora_A.weight", torch.empty(0)).shape
        if not shape or shape[0] != r:
            problems.append(f"{mname}.lora_A.weight shape {list(shape)}: want rank {r}")
    return problems


def cmd_make(a: argparse.Namespace) -> int:
    base = load_base(Path(a.hf))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = get_peft_model(base, lora_config(a.variant))
    for w in caught:
        if "lora_bias" in str(w.message):
            print(f"NOTE peft warns: {str(w.message).splitlines()[0]}")
            break
    randomize_adapter(model, a.seed)
    problems = pattern_problems(model) if a.variant == "patterns" else []
    out = Path(a.out)
    with warnings.catch_warnings():  # peft 0.21.2 takes a 1-D lora_B.bias for an unsharded ZeRO-3 / FSDP tensor
        warnings.filterwarnings("ignore", message=".*LoRA tensor.*have invalid shape")
        model.save_pretrained(out)
    problems += saved_problems(out, a.variant)
    cfg = json.loads((out / "adapter_config.json").read_text())
    print("CONFIG " + json.dumps({k: cfg.get(k) for k in CONFIG_FIELDS}, sort_keys=True))
    tensors = file_tensors(out)
    layer0 = ", ".join(f"{k.removeprefix(PREFIX + 'model.layers.0.')} {list(t.shape)}"
                       for k, t in sorted(tensors.items()) if k.startswith(PREFIX + "model.layers.0."))
    return report(problems, f"make {a.variant} seed {a.seed}: {len(tensors)} tensors, "
                            f"{len(lora_layers(model))} modules -> {out}; layer 0: {layer0 or 'none'}")


# ------------------------------------------------------------------------------------------------- merge

def copy_side_files(src: Path, dst: Path) -> None:
    """The HF directory's non-weight files (tokenizer, generation config) that save_pretrained did not write."""
    for f in src.iterdir():
        weights = f.name.endswith(".safetensors") or f.name.endswith(".index.json")
        if f.is_file() and not weights and not (dst / f.name).exists():
            shutil.copy2(f, dst / f.name)


def weight_names(d: Path) -> set[str]:
    names = set()
    for shard in sorted(d.glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            names.update(f.keys())
    return names


def cmd_merge(a: argparse.Namespace) -> int:
    hf, out = Path(a.hf), Path(a.out)
    model = PeftModel.from_pretrained(load_base(hf), a.adapter).eval()
    tokens = fixed_tokens(model)
    unmerged = logits_of(model, tokens)
    with model.disable_adapter():
        base = logits_of(model, tokens)
    try:
        merged_model = model.merge_and_unload(safe_merge=True)
    except (RuntimeError, ValueError) as e:  # lora_bias on a layer without bias: peft cannot merge
        return report([f"peft cannot merge {a.adapter}: {e}"], "merge")
    merged = logits_of(merged_model, tokens)
    merged_model.save_pretrained(out)
    copy_side_files(hf, out)
    torch.save(merged, out / "logits.pt")
    problems, diff, moved = [], max_diff(merged, unmerged), max_diff(merged, base)
    if diff > a.atol:
        problems.append(f"merged vs unmerged logits max abs {diff:.3g} > {a.atol:g}")
    if moved <= 1e-3:
        problems.append(f"the adapter leaves the logits as they were (max abs change {moved:.3g})")
    names, want = weight_names(out), weight_names(hf)
    if names != want:
        problems.append(f"merged weight names differ from the base's: extra {sorted(names - want)[:5]}, "
                        f"missing {sorted(want - names)[:5]}")
    return report(problems, f"merge {a.adapter} -> {out}: merged vs unmerged logits max abs {diff:.3g}, "
                            f"adapter moves logits by {moved:.3g}, logits.pt {list(merged.shape)}")


# ------------------------------------------------------------------------------------------------- check

def load_adapter_model(hf: Path, adir: Path) -> tuple[PeftModel, list[str]]:
    """PeftModel.from_pretrained of adir and the key problems peft sees: its missing-key warning; its
    load_result (missing adapter keys, unexpected keys) of loading the file again into the loaded model;
    the file's keys against get_peft_model_state_dict of the loaded model (what peft would save)."""
    problems = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = PeftModel.from_pretrained(load_base(hf), str(adir)).eval()
    problems += [f"{adir}: peft warns: {w.message}" for w in caught if "missing adapter keys" in str(w.message)]
    result = set_peft_model_state_dict(model, load_peft_weights(str(adir)), adapter_name=ADAPTER)
    missing = [k for k in result.missing_keys if "lora_" in k and f".{ADAPTER}" in k]
    if missing:
        problems.append(f"{adir}: peft load_result missing {len(missing)} adapter keys, e.g. {missing[:4]}")
    if result.unexpected_keys:
        problems.append(f"{adir}: peft load_result {len(result.unexpected_keys)} unexpected keys, "
                        f"e.g. {result.unexpected_keys[:4]}")
    with warnings.catch_warnings():  # peft 0.21.2 takes a 1-D lora_B.bias for an unsharded ZeRO-3 / FSDP tensor
        warnings.filterwarnings("ignore", message=".*LoRA tensor.*have invalid shape")
        saved = set(get_peft_model_state_dict(model))
    stored = set(file_tensors(adir))
    if saved - stored:
        problems.append(f"{adir}: keys the adapter model has but the file lacks: {sorted(saved - stored)[:4]} "
                        f"({len(saved - stored)})")
    if stored - saved:
        problems.append(f"{adir}: file keys the adapter model does not have: {sorted(stored - saved)[:4]} "
                        f"({len(stored - saved)})")
    return model, problems


def effective_deltas(model: PeftModel) -> dict[str, torch.Tensor]:
    """``module.weight`` / ``module.bias`` -> the change the adapter makes to it (see the module docstring).
    Merges variant (DoRA) layers in place: call after the logits."""
    out = {}
    with torch.no_grad():
        for mname, layer in lora_layers(model).items():
            if ADAPTER in layer.lora_variant:
                before = layer.get_base_layer().weight.detach().clone()
                layer.merge(safe_merge=True, adapter_names=[ADAPTER])
                out[f"{mname}.weight"] = layer.get_base_layer().weight.detach() - before
            else:
                out[f"{mname}.weight"] = layer.get_delta_weight(ADAPTER).detach().clone()
            bias = layer.lora_B[ADAPTER].bias
            if bias is not None:
                out[f"{mname}.bias"] = bias.detach() * layer.scaling[ADAPTER]
    return out


def delta_problems(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], atol: float) -> tuple[list[str], float]:
    problems, worst = [], 0.0
    for name in sorted(set(got) | set(ref)):
        g, r = got.get(name), ref.get(name)
        g = torch.zeros_like(r) if g is None else g
        r = torch.zeros_like(g) if r is None else r
        if g.shape != r.shape:
            problems.append(f"delta {name}: shape {list(g.shape)} != ref {list(r.shape)}")
            continue
        d = max_diff(g, r)
        worst = max(worst, d)
        if d > atol:
            side = "" if name in got and name in ref else (" (adapted only in ADIR)" if name in got
                                                             else " (adapted only in REF)")
            problems.append(f"delta {name}{side}: max abs {d:.3g} > {atol:g} (ref max abs {r.abs().max().item():.3g})")
    return problems, worst


def tensor_problems(adir: Path, ref: Path) -> list[str]:
    got, want = file_tensors(adir), file_tensors(ref)
    problems = [f"tensors: {k} only in ADIR" for k in sorted(set(got) - set(want))]
    problems += [f"tensors: {k} only in REF" for k in sorted(set(want) - set(got))]
    for k in sorted(set(got) & set(want)):
        g, w = got[k], want[k]
        if g.dtype != w.dtype or g.shape != w.shape:
            problems.append(f"tensors: {k} {g.dtype} {list(g.shape)} != REF {w.dtype} {list(w.shape)}")
        elif not torch.equal(g, w):
            problems.append(f"tensors: {k} values differ (max abs {max_diff(g, w):.3g})")
    cg, cw = (json.loads((d / "adapter_config.json").read_text()) for d in (adir, ref))
    for key in CONFIG_FIELDS:
        vg, vw = cg.get(key), cw.get(key)
        if key == "target_modules" and isinstance(vg, list) and isinstance(vw, list):
            vg, vw = set(vg), set(vw)
        if key in ("rank_pattern", "alpha_pattern"):
            vg, vw = vg or {}, vw or {}
        if vg != vw:
            problems.append(f"adapter_config.json {key}: {cg.get(key)!r} != REF {cw.get(key)!r}")
    return problems


def cmd_check(a: argparse.Namespace) -> int:
    hf, adir, ref = Path(a.hf), Path(a.adapter), Path(a.ref)
    problems = []
    try:
        got_model, p = load_adapter_model(hf, adir)
    except Exception as e:  # noqa: BLE001 - a shape mismatch or an unreadable adapter: peft's verdict
        return report([f"peft cannot load {adir}: {type(e).__name__}: {e}"], f"check {adir}")
    problems += p
    ref_model, p = load_adapter_model(hf, ref)
    problems += p
    tokens = fixed_tokens(ref_model)
    logit_diff = max_diff(logits_of(got_model, tokens), logits_of(ref_model, tokens))
    if logit_diff > a.logits_atol:
        problems.append(f"logits ADIR vs REF max abs {logit_diff:.3g} > {a.logits_atol:g}")
    p, delta_diff = delta_problems(effective_deltas(got_model), effective_deltas(ref_model), a.atol)
    problems += p
    if a.tensors:
        problems += tensor_problems(adir, ref)
    return report(problems, f"check {adir} vs {ref}: logits max abs {logit_diff:.3g}, deltas max abs "
                            f"{delta_diff:.3g}{', --tensors compared' if a.tensors else ''}")


# -------------------------------------------------------------------------------------------------- main

def main(argv: list[str] | None = None, serving: bool = False) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("make")
    sp.add_argument("--hf", required=True)
    sp.add_argument("--out", required=True)
    sp.add_argument("--variant", choices=sorted(VARIANTS), default="plain")
    sp.add_argument("--seed", type=int, default=1)
    sp = sub.add_parser("merge")
    sp.add_argument("--hf", required=True)
    sp.add_argument("--adapter", required=True)
    sp.add_argument("--out", required=True)
    sp.add_argument("--atol", type=float, default=1e-5, help="merged vs unmerged logits, max abs")
    sp = sub.add_parser("check")
    sp.add_argument("--hf", required=True)
    sp.add_argument("--adapter", required=True)
    sp.add_argument("--ref", required=True)
    sp.add_argument("--atol", type=float, default=1e-6, help="effective weight deltas, max abs")
    sp.add_argument("--logits-atol", type=float, default=1e-5,
                    help="logits, max abs (fp32: equal deltas factored otherwise give ~3e-6)")
    sp.add_argument("--tensors", action="store_true", help="also bit-equal tensors and equal config fields")
    a = p.parse_args(argv)
    with torch.random.fork_rng(devices=[]):  # model and adapter construction draw from the global CPU RNG
        return {"make": cmd_make, "merge": cmd_merge, "check": cmd_check}[a.cmd](a)


if __name__ == "__main__":
    import os

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
