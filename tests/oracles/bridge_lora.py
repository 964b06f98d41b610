"""Oracle: Megatron-Bridge 0.6.2's own LoRA code on CPU makes, exports and loads Megatron-Bridge LoRA PEFT
checkpoints of a tiny Llama. Runs in the second runtime (Python 3.12, megatron-core 0.19.2, Megatron-Bridge
0.6.2, transformers, peft); never imports dist_convert.

  oracles/bridge_lora.py make --hf HF_DIR --out DIR [--dim 4] [--alpha 8] [--seed 3] [--canonical]
                             [--iteration 5]                                               (1 process)
      AutoBridge import of HF_DIR (fp32, local layer spec), Bridge's ``LoRA`` (``CanonicalLoRA`` with
      --canonical) applied as a fine-tuning run applies it (the PEFT pre-wrap hook: ``peft(model,
      training=True)`` + ``set_params_to_save``, training/setup.py ``_apply_peft_transformation``), every
      adapter parameter (linear_in and linear_out) then set to seeded random non-zero values. Writes
        DIR/peft_ckpt/  Bridge's own ``save_checkpoint`` with a ConfigContainer whose ``peft`` is the LoRA
                        (built as ``save_megatron_model`` builds its ConfigContainer, plus ``peft`` and
                        ``checkpoint.pretrained_checkpoint``; no optimizer, no RNG, no train config):
                        tracker, iter_NNNNNNN/ torch_dist with the adapter tensors only, run_config.yaml,
                        train_state.pt, tokenizer/
        DIR/hf_adapter/ ``AutoBridge.save_hf_adapter`` of the same model (adapter_config.json +
                        adapter_model.safetensors)
        DIR/merged/     ``AutoBridge.save_hf_pretrained(merge_adapter_weights=True)``: Bridge's merge
      and prints the stored torch_dist keys with global shapes and dtypes, and the run_config ``peft:``.
  oracles/bridge_lora.py export --ckpt PEFT_CKPT --hf HF_DIR --out ADIR [--ref-adapter ADIR0]   (1 process)
      ``AutoBridge.export_adapter_ckpt`` of PEFT_CKPT (a checkpoint root or an iteration dir): Bridge reads
      run_config.yaml's ``peft:``, builds the fp32 model with the LoRA, loads the adapters and writes the HF
      peft dir ADIR. --ref-adapter: ADIR's tensors must equal ADIR0's bit-exactly (names, shapes, dtypes)
      and the adapter configs must agree.
  oracles/bridge_lora.py load --ckpt PEFT_CKPT --hf HF_DIR --tp T --ref-adapter ADIR [--no-logits | --logits-only]
                                                                                  (T processes, gloo)
      The model at TP=T with the PEFT transform of run_config.yaml's ``peft:`` (instantiated from its
      ``_target_``), every adapter parameter first set to NaN, then Bridge's ``load_peft_adapter_checkpoint``.
      FAIL on an adapter parameter still NaN (a key the checkpoint lacks) or a checkpoint tensor the model
      does not ask for. Then the adapter as Bridge exports it (``export_adapter_weights`` +
      ``convert_adapter_weights_to_peft_state``, what ``save_hf_adapter`` writes) must equal ADIR's
      tensors bit-exactly (not with --logits-only: ADIR is structured otherwise, e.g. peft's own per-projection
      adapter), and (unless --no-logits) Bridge's TP=T forward with the adapters must match
      transformers + peft (``PeftModel.from_pretrained(HF_DIR, ADIR)``) on fixed tokens (fp32, 1e-4).
      Prints how every adapter tensor of layer 0 is split over TP (offsets / fragmentation per rank).

Prints ``ORACLE OK ...`` or ``ORACLE FAIL ...`` (rank 0); exit 0 only when everything matched.

What Bridge writes and reads (seen with this oracle, tiny Llama: 2 layers, hidden 64, 4 heads / 2 groups,
ffn 96, LoRA dim 4):
  * torch_dist keys are stacked over layers, no prefix, fp32 here (the params' dtype):
    decoder.layers.self_attention.linear_qkv.adapter.linear_in.weight   [L, r, hidden]
    decoder.layers.self_attention.linear_qkv.adapter.linear_out.weight  [L, qkv_rows, r] (megatron-core row order)
    decoder.layers.self_attention.linear_proj.adapter.linear_{in,out}.weight  [L, r, hidden] / [L, hidden, r]
    decoder.layers.mlp.linear_fc1.adapter.linear_in.weight              [L, r, hidden]
    decoder.layers.mlp.linear_fc1.adapter.linear_out.weight             [L, 2*ffn, r] ([gate; up])
    decoder.layers.mlp.linear_fc2.adapter.linear_{in,out}.weight        [L, r, ffn] / [L, hidden, r]
    CanonicalLoRA: ...linear_qkv.adapter.adapter_{q,k,v}.linear_{in,out}.weight and
    ...linear_fc1.adapter.adapter_{gate,up}.linear_{in,out}.weight instead of the fused ones.
  * TP split: linear_in of linear_qkv / linear_fc1 on r (axis 1 of the stacked key), of linear_proj /
    linear_fc2 on its input features (axis 2); every linear_out on its rows (axis 1); fc1's linear_out
    by the SwiGLU factory (each rank: its slice of gate and its slice of up). CanonicalLoRA's
    adapter_gate / adapter_up linear_out also get the SwiGLU factory although each is one half: a TP=1
    checkpoint loaded at TP=2 gets their rows permuted (Bridge's own export and forward disagree with the
    TP=1 truth) - a Bridge reshard quirk, TP=1 only.
  * export_adapter_ckpt always builds LoRA (or VLMLoRA): for a CanonicalLoRA checkpoint it exports only
    o_proj / down_proj and drops q/k/v/gate/up silently; a missing adapter key raises KeyError.

CPU shims: tests/oracles/bridge.py ``install_shims`` (TE-less import of peft/lora_layers.py, CUDA no-ops);
``torch.cuda.get_rng_state`` answers the CPU RNG state during a save (save_checkpoint collects the RNG
state even with save_rng=False); every provider gets megatron-core's local layer spec and no fused
kernels (``export_adapter_ckpt`` builds its own provider: ``to_megatron_provider`` of that bridge is
wrapped to do the same).
"""
from __future__ import annotations

import argparse
import json
import sys
import zlib
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the oracles package, helpers
from oracles.common import compare, end_parallel, init_dist, report, resolve_iter_dir, run_program  # noqa: E402
from oracles.te_cpu import install_shims  # noqa: E402

TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]


# ----------------------------------------------------------------------------- common


def te_off_for_peft() -> None:
    """Bridge's peft/utils.py and peft/module_matcher.py decide ``HAVE_TE`` by ``safe_import_from`` of
    megatron-core's TE extension, which without Transformer Engine still defines the names (MagicMock
    stand-ins, None for the grouped linears): HAVE_TE comes out True and ``isinstance(m, None)`` raises
    in ``get_adapter_attributes_from_linear``. TE is absent: the flags say so."""
    from megatron.bridge.peft import module_matcher, utils

    utils.HAVE_TE = False
    for k in ("HAVE_TE", "HAVE_TE_COL_LINEAR", "HAVE_TE_LN_COL_LINEAR", "HAVE_TE_ROW_LINEAR"):
        setattr(module_matcher, k, False)


def start_parallel(tp: int) -> None:
    """The gloo process group and megatron-core's groups at TP ``tp``, which must be the world size."""
    _, world = init_dist()
    if world != tp:
        raise SystemExit(f"TP={tp} needs {tp} processes, not {world}")


def rank0() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def say(*args) -> None:
    if rank0():
        print(*args, flush=True)


@contextmanager
def cpu_rng():
    """save_checkpoint's get_rng_state records torch.cuda.get_rng_state(): the CPU state instead."""
    import torch

    saved = torch.cuda.get_rng_state
    torch.cuda.get_rng_state = torch.get_rng_state
    try:
        yield
    finally:
        torch.cuda.get_rng_state = saved


def cpu_provider(provider, tp: int = 1):
    """The provider on CPU: megatron-core's local layer spec, no fused kernels, fp32, TP=tp."""
    import torch
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    provider.transformer_layer_spec = get_gpt_layer_local_spec()
    provider.apply_rope_fusion = provider.persist_layer_norm = False
    for k in ("gradient_accumulation_fusion", "masked_softmax_fusion", "bias_dropout_fusion",
              "bias_activation_fusion", "cross_entropy_loss_fusion"):
        if hasattr(provider, k):
            setattr(provider, k, False)
    provider.params_dtype = provider.pipeline_dtype = torch.float32
    provider.bf16 = provider.fp16 = False
    provider.tensor_model_parallel_size = tp
    return provider


def build_lora_model(bridge, peft, tp: int, training: bool):
    """Bridge's model of the HF weights at TP=tp with ``peft`` applied by a pre-wrap hook (after the
    weights hook, as a fine-tuning run: base loaded, then the transform)."""
    from megatron.bridge.training.setup import _apply_peft_transformation

    provider = cpu_provider(bridge.to_megatron_provider(load_weights=True), tp)
    provider.finalize()
    if training:
        provider.register_pre_wrap_hook(lambda chunks: _apply_peft_transformation(peft, chunks))
    else:
        provider.register_pre_wrap_hook(lambda chunks: peft(chunks, training=False))
    return provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)


def adapter_params(model) -> dict:
    out = {}
    for m in model:
        for name, p in m.named_parameters():
            if ".adapter." in name:
                out[name] = p
    return out


def run_config_peft(iter_dir) -> dict | None:
    """The ``peft:`` section of the checkpoint's run_config.yaml (in the iteration dir, else its parent)."""
    import yaml

    cfg_file = Path(iter_dir) / "run_config.yaml"
    if not cfg_file.exists():
        cfg_file = Path(iter_dir).parent / "run_config.yaml"
    return (yaml.safe_load(cfg_file.read_text()) or {}).get("peft") if cfg_file.exists() else None


def peft_from_run_config(iter_dir: Path):
    """The PEFT object of the checkpoint's run_config.yaml ``peft:`` section, by its ``_target_``."""
    from megatron.training.config.instantiate_utils import instantiate

    section = run_config_peft(iter_dir)
    if not section:
        raise SystemExit(f"{iter_dir}: no run_config.yaml with a peft: section")
    # derived state Bridge serializes too: ``params_to_save`` (a set, init=False) and ``canonical_mapping``
    # (a defaultdict of sets rebuilt from target_modules; read back as a plain dict, CanonicalLoRA's
    # __post_init__ raises KeyError on it): left out, the dataclass rebuilds both
    section = {k: v for k, v in section.items() if k not in ("params_to_save", "canonical_mapping")}
    return instantiate(section), section


def stored_tensors(iter_dir) -> dict:
    """{key: (global shape, dtype)} of every tensor the torch_dist checkpoint stores, and the other items."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = FileSystemReader(str(iter_dir)).read_metadata()
    tensors, other = {}, []
    for k, v in md.state_dict_metadata.items():
        if isinstance(v, TensorStorageMetadata):
            tensors[k] = (tuple(v.size), v.properties.dtype)
        else:
            other.append(k)
    return tensors, sorted(other)


def read_adapter(adir) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    adir = Path(adir)
    return load_file(adir / "adapter_model.safetensors"), json.loads((adir / "adapter_config.json").read_text())


def compare_configs(got: dict, want: dict, what: str) -> list[str]:
    problems = []
    for k in sorted(set(got) | set(want)):
        g, w = got.get(k, "<absent>"), want.get(k, "<absent>")
        if isinstance(g, list) and isinstance(w, list):
            g, w = sorted(map(str, g)), sorted(map(str, w))
        if g != w:
            if k == "base_model_name_or_path":
                say(f"NOTE {what}: base_model_name_or_path {got.get(k)!r} vs {want.get(k)!r}")
            else:
                problems.append(f"{what}: adapter_config {k} {got.get(k)!r} vs {want.get(k)!r}")
    return problems


def describe_adapter(state: dict, cfg: dict) -> None:
    say("hf adapter_config.json: " + json.dumps(cfg, sort_keys=True))
    for k in sorted(state):
        t = state[k]
        say(f"  HF {k} {list(t.shape)} {t.dtype}")
    # q/k/v (gate/up) of one layer: the same lora_A?
    import torch

    for layer_mod, parts in (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj"))):
        names = [f"base_model.model.model.layers.0.{layer_mod}.{p}.lora_A.weight" for p in parts]
        if all(n in state for n in names):
            same = all(torch.equal(state[names[0]], state[n]) for n in names[1:])
            say(f"  layer 0 {'/'.join(parts)} lora_A identical: {same}")


# ----------------------------------------------------------------------------- make


def randomize_adapters(model, seed: int) -> int:
    import torch

    n = 0
    with torch.no_grad():
        for name, p in adapter_params(model).items():
            g = torch.Generator().manual_seed(zlib.crc32(f"{seed}|{name}".encode()))
            r = torch.randn(p.shape, generator=g, dtype=torch.float32)
            r = torch.where(r == 0, torch.full_like(r, 0.5), r)  # non-zero, every element
            p.copy_((0.2 * r).to(p.dtype))
            n += 1
    return n


def save_peft_checkpoint(model, lora, out: Path, hf: str, iteration: int) -> None:
    """Bridge's save_checkpoint with cfg.peft = lora: the ConfigContainer save_megatron_model builds
    (training/model_load_save.py), plus ``peft`` and ``checkpoint.pretrained_checkpoint``."""
    from megatron.bridge.training.checkpointing import get_checkpoint_name, save_checkpoint, save_tokenizer_assets
    from megatron.bridge.training.config import CheckpointConfig, ConfigContainer, LoggerConfig, OptimizerConfig
    from megatron.bridge.training.state import GlobalState
    from megatron.bridge.training.tokenizers.config import TokenizerConfig
    from megatron.bridge.training.tokenizers.tokenizer import build_tokenizer
    from megatron.core.utils import get_model_config

    tokenizer_config = TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(hf),
                                       hf_tokenizer_kwargs={})
    state = GlobalState()
    state.cfg = ConfigContainer(
        model=get_model_config(model[0]), train=None, optimizer=OptimizerConfig(use_distributed_optimizer=False),
        ddp=None, scheduler=None, dataset=None, logger=LoggerConfig(), tokenizer=tokenizer_config,
        checkpoint=CheckpointConfig(async_save=False, save=str(out), save_optim=False, save_rng=False,
                                    ckpt_format="torch_dist", dist_ckpt_optim_fully_reshardable=True,
                                    pretrained_checkpoint=str(hf)),
        dist=None, peft=lora)
    state.train_state.step = iteration
    with cpu_rng():
        save_checkpoint(state=state, model=model, optimizer=None, opt_param_scheduler=None,
                        num_floating_point_operations_so_far=0, callback_manager=None)
    if rank0():  # as save_megatron_model does after its save (a training run: cfg.dataset's tokenizer)
        save_tokenizer_assets(build_tokenizer(tokenizer_config), tokenizer_config,
                              get_checkpoint_name(str(out), iteration, release=False))


def cmd_make(a) -> int:
    import torch
    from megatron.bridge import AutoBridge
    from safetensors.torch import load_file

    start_parallel(1)
    out = Path(a.out)
    problems = []
    try:
        if a.canonical:
            from megatron.bridge.peft.canonical_lora import CanonicalLoRA

            lora = CanonicalLoRA(dim=a.dim, alpha=a.alpha)
        else:
            from megatron.bridge.peft.lora import LoRA

            lora = LoRA(target_modules=list(TARGETS), dim=a.dim, alpha=a.alpha)
        bridge = AutoBridge.from_hf_pretrained(a.hf)
        model = build_lora_model(bridge, lora, 1, training=True)
        n = randomize_adapters(model, a.seed)
        say(f"{type(lora).__name__}(dim={a.dim}, alpha={a.alpha}): {n} adapter parameters randomized; "
            f"params_to_save: {len(lora.params_to_save)}")
        for name, p in adapter_params(model).items():
            if ".layers.0." in name:
                say(f"  param {name} {list(p.shape)} {p.dtype} requires_grad={p.requires_grad}")

        save_peft_checkpoint(model, lora, out / "peft_ckpt", a.hf, a.iteration)
        iter_dir = Path(resolve_iter_dir(str(out / "peft_ckpt")))
        tensors, other = stored_tensors(iter_dir)
        say(f"peft_ckpt: {iter_dir.name}, files {sorted(p.name for p in iter_dir.iterdir())}")
        for k, (shape, dtype) in sorted(tensors.items()):
            say(f"  TORCH_DIST {k} {list(shape)} {dtype}")
        say(f"  non-tensor items: {other}")
        problems += [f"peft_ckpt stores a non-adapter tensor {k}" for k in tensors if ".adapter." not in k]
        if not tensors:
            problems.append("peft_ckpt stores no tensor")
        run_cfg = (iter_dir / "run_config.yaml").read_text()
        peft_yaml = run_cfg[run_cfg.index("\npeft:") + 1:] if "\npeft:" in run_cfg else None
        if peft_yaml is None:
            problems.append("run_config.yaml has no peft: section")
        else:
            lines = peft_yaml.splitlines()
            end = next((i for i, ln in enumerate(lines[1:], 1) if ln and not ln.startswith((" ", "-"))), len(lines))
            say("run_config.yaml peft section:\n" + "\n".join(lines[:end]))

        bridge.save_hf_adapter(model, out / "hf_adapter", peft_config=lora, base_model_name_or_path=str(a.hf),
                               show_progress=False)
        state, cfg = read_adapter(out / "hf_adapter")
        describe_adapter(state, cfg)

        bridge.save_hf_pretrained(model, out / "merged", show_progress=False, merge_adapter_weights=True)
        merged = {}
        for f in sorted((out / "merged").glob("*.safetensors")):
            merged.update(load_file(f))
        base = {}
        for f in sorted(Path(a.hf).glob("*.safetensors")):
            base.update(load_file(f))
        # the merge against the adapter's own math: W + (alpha / r) * B @ A, per HF module
        scale = cfg["lora_alpha"] / cfg["r"]
        worst, changed, adapted = 0.0, 0, set()
        for k in state:
            if k.endswith(".lora_A.weight"):
                mod = k[len("base_model.model."):-len(".lora_A.weight")]
                w = mod + ".weight"
                adapted.add(w)
                want = base[w].double() + scale * (state[k.replace("lora_A", "lora_B")].double() @ state[k].double())
                worst = max(worst, (merged[w].double() - want).abs().max().item())
                changed += int(not torch.equal(merged[w], base[w]))
        unchanged = [k for k in base if k not in adapted and not torch.equal(merged.get(k, base[k]), base[k])]
        say(f"merged: {len(merged)} tensors {sorted({str(t.dtype) for t in merged.values()})}, {changed}/"
            f"{len(adapted)} adapted weights changed, max |merged - (W + s*B@A)| = {worst:.3g}")
        problems += [f"merged: non-adapted tensor {k} differs from the base" for k in unchanged]
        problems += [f"merged: missing {k}" for k in sorted(set(base) - set(merged))]
        if changed != len(adapted) or worst > 1e-5:
            problems.append(f"merged: {changed}/{len(adapted)} adapted weights changed, max diff {worst:.3g}")
        rc = report(problems, f"Megatron-Bridge LoRA PEFT checkpoint, HF adapter and merged model in {out}")
    finally:
        end_parallel(a.serving)
    return rc


# ----------------------------------------------------------------------------- export


def local_spec_bridge(hf):
    """AutoBridge of ``hf`` whose providers build on CPU (``export_adapter_ckpt`` makes its own)."""
    from megatron.bridge import AutoBridge

    bridge = AutoBridge.from_hf_pretrained(hf)
    original = bridge.to_megatron_provider

    def to_megatron_provider(*args, **kw):
        return cpu_provider(original(*args, **kw))

    bridge.to_megatron_provider = to_megatron_provider
    return bridge


def cmd_export(a) -> int:
    from torch.distributed.checkpoint.api import CheckpointException

    start_parallel(1)
    problems = []
    try:
        iter_dir = Path(resolve_iter_dir(a.ckpt))
        target = str((run_config_peft(iter_dir) or {}).get("_target_", "<no peft: section>"))
        if not target.endswith((".LoRA", ".VLMLoRA")):
            say(f"NOTE export_adapter_ckpt builds LoRA / VLMLoRA, the checkpoint says {target}: only the "
                "adapters LoRA's own module names match are exported, the rest are left out silently")
        bridge = local_spec_bridge(a.hf)
        try:
            bridge.export_adapter_ckpt(str(iter_dir), a.out, show_progress=False)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - Bridge refused the checkpoint
            import traceback  # (a missing key: torch DCP's CheckpointException, a BaseException, of a KeyError)

            traceback.print_exc()
            return report([f"export_adapter_ckpt raised {type(e).__name__}: {str(e)[:1500]}"],
                          f"Megatron-Bridge export_adapter_ckpt of {iter_dir}")
        state, cfg = read_adapter(a.out)
        describe_adapter(state, cfg)
        what = f"Megatron-Bridge export_adapter_ckpt of {iter_dir}: {len(state)} adapter tensors"
        if a.ref_adapter:
            ref_state, ref_cfg = read_adapter(a.ref_adapter)
            problems += compare(state, ref_state, "adapter")
            problems += compare_configs(cfg, ref_cfg, "adapter")
            what += f" == {a.ref_adapter}"
        rc = report(problems, what)
    finally:
        end_parallel(a.serving)
    return rc


# ----------------------------------------------------------------------------- load (TP)


def sharded_tensors(v) -> list:
    """The ShardedTensors of a sharded state dict value (a ShardedTensorFactory built first)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    if isinstance(v, ShardedTensorFactory):
        v = v.build()
    if isinstance(v, ShardedTensor):
        return [v]
    if isinstance(v, dict):
        v = list(v.values())
    if isinstance(v, (list, tuple)):
        return [t for x in v for t in sharded_tensors(x)]
    return []


def describe_splits(model) -> list[str]:
    """How each layer-0 adapter tensor of this rank sits in the stored global tensor."""
    from megatron.bridge.training.checkpointing import _generate_model_state_dict
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    lines = []
    sd = _generate_model_state_dict(model, {})
    for name, v in sd["model"].items():
        if ".adapter." not in name or ".layers.0." not in name:
            continue
        kind = "factory" if isinstance(v, ShardedTensorFactory) else "tensor"
        for st in sharded_tensors(v):
            lines.append(f"{name} [{kind}] key={st.key} local={list(st.local_shape)} "
                         f"global={list(st.global_shape)} offset={list(st.global_offset)} "
                         f"fragments={list(st.axis_fragmentations)} replica={st.replica_id}")
    return lines


def report_all(problems: list[str], what: str) -> int:
    """Every rank's problems (deduplicated, in order) reported once, by rank 0; the same exit code on all."""
    import torch.distributed as dist

    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, problems)
    merged = list(dict.fromkeys(p for ps in gathered for p in ps))
    if rank0():
        return report(merged, what)
    return 1 if merged else 0


def tp_logits(model, tokens):
    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    b, s = tokens.shape
    position_ids = torch.arange(s).unsqueeze(0).expand(b, s)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1).view(1, 1, s, s).expand(b, 1, s, s)
    m = model[0]
    m.eval()
    with torch.no_grad():
        logits = m(tokens, position_ids, mask)
    if parallel_state.get_tensor_model_parallel_world_size() > 1 and getattr(m, "parallel_output", True):
        logits = gather_from_tensor_model_parallel_region(logits)  # vocab-parallel -> full vocab
    return logits


def peft_logits(hf, adir, tokens):
    """transformers + peft: the HF base with the HF peft adapter ADIR, fp32; and the adapter's tensors
    peft actually loaded (name -> tensor, adapter name stripped)."""
    import torch
    import transformers
    from peft import PeftModel

    base = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adir).eval()
    loaded = {n.replace(".default.", "."): p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    with torch.no_grad():
        out = model(input_ids=tokens).logits
        with model.disable_adapter():
            plain = model(input_ids=tokens).logits
    return out, plain, loaded


def cmd_load(a) -> int:
    import torch
    import torch.distributed as dist
    from megatron.bridge.models.conversion.model_bridge import HFWeightTuple
    from megatron.bridge.models.conversion.peft_bridge import convert_adapter_weights_to_peft_state
    from megatron.bridge.peft.utils import load_peft_adapter_checkpoint
    from megatron.bridge.training.checkpointing import (
        _generate_model_state_dict,
        apply_peft_adapter_filter_to_state_dict,
    )
    start_parallel(a.tp)
    problems = []
    try:
        iter_dir = Path(resolve_iter_dir(a.ckpt))
        peft, section = peft_from_run_config(iter_dir)
        say(f"run_config peft: {type(peft).__name__}(dim={peft.dim}, alpha={peft.alpha}, "
            f"target_modules={peft.target_modules})")
        bridge = local_spec_bridge(a.hf)
        model = build_lora_model(bridge, peft, a.tp, training=True)
        params = adapter_params(model)
        with torch.no_grad():
            for p in params.values():
                p.fill_(float("nan"))
        # the tensor keys this model asks for against what the checkpoint stores
        sd = apply_peft_adapter_filter_to_state_dict(_generate_model_state_dict(model, {}), peft)
        asked = set()
        for v in sd["model"].values():
            asked.update(st.key for st in sharded_tensors(v))
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, sorted(asked))
        asked = set().union(*map(set, gathered))
        tensors, _ = stored_tensors(iter_dir)
        stored = {k for k in tensors if not k.startswith(("optimizer", "rng_state", "rerun_state"))}
        problems += [f"checkpoint lacks adapter tensor {k}" for k in sorted(asked - stored)]
        problems += [f"checkpoint tensor {k} is not asked for by the TP{a.tp} {type(peft).__name__} model"
                     for k in sorted(stored - asked)]
        if problems:  # the same verdict on every rank (both sets are global); the load would raise
            return report_all(problems, f"adapter keys of {iter_dir} vs the TP{a.tp} {type(peft).__name__} model")

        load_peft_adapter_checkpoint(model, iter_dir, peft, strict=False)
        nan = [n for n, p in params.items() if torch.isnan(p).any()]
        problems += [f"rank {dist.get_rank()}: adapter parameter {n} not loaded (NaN)" for n in nan]

        splits = describe_splits(model)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, splits)
        for r, lines in enumerate(gathered):
            for ln in lines:
                say(f"  TP rank {r}: {ln}")

        raw = [(w.param_name, w.weight.detach().clone())
               for w in bridge.export_adapter_weights(model, cpu=True, show_progress=False)]
        state, _, _ = convert_adapter_weights_to_peft_state([HFWeightTuple(n, t) for n, t in raw])
        ref_state, ref_cfg = read_adapter(a.ref_adapter)
        what = f"Megatron-Bridge load_peft_adapter_checkpoint at TP={a.tp}: {len(params)} local adapter params"
        if not a.logits_only:  # --logits-only: the ref is structured otherwise (e.g. per-projection A): its forward
            problems += compare(state, ref_state, f"TP{a.tp} export vs {a.ref_adapter}")
            what += f", {len(state)} exported adapter tensors == ref"

        if not a.no_logits:
            g = torch.Generator().manual_seed(11)
            tokens = torch.randint(0, 100, (2, 12), generator=g)
            got = tp_logits(model, tokens)[..., :100].float()
            if rank0():
                want, plain, loaded = peft_logits(a.hf, a.ref_adapter, tokens)
                problems += compare({k: v for k, v in loaded.items()}, ref_state, "peft's loaded adapter")
                diff = (got - want).abs().max().item()
                effect = (want - plain).abs().max().item()
                say(f"logits: Bridge TP{a.tp} LoRA forward vs transformers+peft: max |diff| {diff:.3g} "
                    f"(adapter effect on logits {effect:.3g})")
                if not diff <= 1e-4:
                    problems.append(f"logits: Bridge TP{a.tp} LoRA forward vs peft max diff {diff:.3g}")
                if not effect > 1e-2:
                    problems.append(f"logits: the adapter barely changes the logits ({effect:.3g})")
            what += ", logits == transformers+peft"
        rc = report_all(problems, what)
    finally:
        end_parallel(a.serving)
    return rc


def main(argv=None, serving=False) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("make")
    sp.add_argument("--hf", required=True)
    sp.add_argument("--out", required=True)
    sp.add_argument("--dim", type=int, default=4)
    sp.add_argument("--alpha", type=int, default=8)
    sp.add_argument("--seed", type=int, default=3)
    sp.add_argument("--canonical", action="store_true")
    sp.add_argument("--iteration", type=int, default=5)
    sp = sub.add_parser("export")
    sp.add_argument("--ckpt", required=True)
    sp.add_argument("--hf", required=True)
    sp.add_argument("--out", required=True)
    sp.add_argument("--ref-adapter", default=None)
    sp = sub.add_parser("load")
    sp.add_argument("--ckpt", required=True)
    sp.add_argument("--hf", required=True)
    sp.add_argument("--tp", type=int, required=True)
    sp.add_argument("--ref-adapter", required=True)
    sp.add_argument("--no-logits", action="store_true")
    sp.add_argument("--logits-only", action="store_true",
                    help="judge by the logits alone (the ref adapter is structured otherwise, e.g. peft's own)")
    a = p.parse_args(argv)
    a.serving = serving
    install_shims()  # before anything imports megatron.bridge (its peft/lora_layers.py imports TE)
    te_off_for_peft()
    return {"make": cmd_make, "export": cmd_export, "load": cmd_load}[a.cmd](a)


if __name__ == "__main__":
    run_program(main)
