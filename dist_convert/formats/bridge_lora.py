"""Megatron-Bridge LoRA PEFT checkpoints: what Bridge's ``save_checkpoint`` writes for a fine-tuning run with
``cfg.peft`` = ``LoRA``: Megatron-LM's layout with a torch_dist save holding only the adapters, and
``run_config.yaml`` with the model and the ``peft:`` section (``dim``, ``alpha``, ``target_modules``).

Bridge wraps a module ``M`` (``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2`` of every layer) and
keys its adapter ``M.adapter.linear_in.weight`` (A, [dim, in]) and ``M.adapter.linear_out.weight`` (B, [out, dim]),
stacked over layers like the base weights. Their tensor-parallel splits: A of a column-parallel base splits its
rank (``dim % TP == 0``), A of a row-parallel base its columns; B splits its rows as a column-parallel base does
(fused QKV's group-major rows, SwiGLU's [gate; up] halves), and as a plain column-parallel linear under a
row-parallel base. The scale is ``alpha / dim`` for every module.
"""
from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

import torch

from ..config import config_from_args
from ..datamodel import ORIGIN_KEY, SourceIndex, Target, TargetFile
from ..errors import ConvertError
from ..layout.boxes import Kind
from ..layout.rules import LogicalTensor, logical_tensors
from ..layout.topology import Layout
from ..lora.adapter import AdapterModule, AdapterSpec, as_fraction, identity_pieces, module_type
from ..lora.structure import Laid, Slot, compose, lay_out, placements, with_rank
from ..runtime import Runtime
from .base import KeyPolicy, on_rank0, read_origin
from .bridge import BridgeFormat, _looks_like_bridge, bridge_args, bridge_origin, read_run_config
from .dist_keys import DistGroup, dist_groups
from .torch_dist import TRAINING_STATE, open_weights, training_state_note

LORA = "megatron.bridge.peft.lora.LoRA"
IN, OUT = ".adapter.linear_in.weight", ".adapter.linear_out.weight"


def peft_section(iter_dir: Path) -> dict[str, Any] | None:
    """run_config.yaml's ``peft:`` section (None: a whole model's checkpoint)."""
    try:
        peft = read_run_config(iter_dir).get("peft")
    except ConvertError:
        return None
    return peft if isinstance(peft, dict) else None


def _looks_like_lora(path: Path) -> bool:
    return _looks_like_bridge(path) and peft_section(path) is not None


def adapter_tensors(cfg, types: set[str], dim: int) -> dict[str, tuple[LogicalTensor, LogicalTensor, LogicalTensor]]:
    """Module -> (its A, its B, its base weight) as logical tensors in megatron-core's placement (layer axis,
    TP kind), for every module of the ``types`` Bridge wraps."""
    out = {}
    for t in logical_tensors(cfg).values():
        if module_type(t.name) not in types:
            continue
        stem = t.name.removesuffix(".weight")
        key = (t.dist_suffix or t.te_name or t.suffix).removesuffix(".weight")
        col = t.kind in (Kind.COL, Kind.GLU)
        plain = dict(aliases=(), sections=(), section_names=())
        a = dataclasses.replace(t, name=stem + IN, shape=(dim, t.shape[1]), kind=Kind.COL if col else Kind.ROW,
                                dist_suffix=key + IN, **plain)
        b = dataclasses.replace(t, name=stem + OUT, shape=(t.shape[0], dim), kind=t.kind if col else Kind.COL,
                                dist_suffix=key + OUT, **plain)
        out[stem] = (a, b, t)
    return out


def stored_types(keys: list[str], where: Path) -> set[str]:
    """Bridge's target module names of the stored adapter keys (refusing keys of anything else)."""
    types = set()
    for k in keys:
        stem = k.removesuffix(IN).removesuffix(OUT)
        kind = next((t for t in ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2") if stem.endswith(
            ("self_attention." if t in ("linear_qkv", "linear_proj") else "mlp.") + t)), None)
        if stem == k or kind is None or ".experts." in k:
            raise ConvertError(f"{where} holds {k}, not the adapter of an attention qkv / output or dense MLP fc1 / "
                               "fc2 module", "convert LoRA adapters on linear_qkv, linear_proj, linear_fc1, linear_fc2 "
                               "(MoE expert, Mamba and canonical adapters are not read yet)")
        types.add(kind)
    return types


class BridgeLoraFormat(BridgeFormat):
    name = "bridge_lora"
    looks_like = staticmethod(_looks_like_lora)
    saves_objects = False  # Bridge's PEFT filter drops the _extra_state objects

    def index(self, path: Path, rt: Runtime, vocab_size: int | None) -> SourceIndex:
        return on_rank0(rt, lambda: self._index_lora(path, vocab_size))

    def _index_lora(self, path: Path, vocab_size: int | None) -> SourceIndex:
        found = self.find(path)
        if found is None:
            raise ConvertError(f"{path} is not a Megatron-Bridge LoRA checkpoint (no iter_*/ whose run_config.yaml "
                               "has a peft: section)", "point SRC at the PEFT checkpoint, or pass --src-format")
        iter_dir, iteration = found
        y = read_run_config(iter_dir)
        peft = y["peft"]
        target = str(peft.get("_target_", ""))
        if target != LORA:
            raise ConvertError(f"{iter_dir} holds a {target.rsplit('.', 1)[-1] or 'unnamed'} adapter ({target}); "
                               "dist_convert reads Megatron-Bridge's LoRA", "save the run with peft=LoRA (fused "
                               "adapters); CanonicalLoRA, DoRA and VLMLoRA are not read yet")
        md, common, style = open_weights(iter_dir, self.trust_pickle)
        args = bridge_args(iter_dir, y)
        tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
        pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
        cfg = config_from_args(args, vocab_size, None, tp)
        layout = Layout.from_args(args, tp, pp, experts=bool(cfg.num_experts))
        stored = {k: v for k, v in md.state_dict_metadata.items() if not k.startswith(tuple(TRAINING_STATE))
                  and hasattr(v, "chunks")}
        ins = [k for k in stored if k.endswith(IN)]
        if not ins:
            raise ConvertError(f"{iter_dir} holds no adapter tensors (*{IN})", "point SRC at a LoRA PEFT checkpoint")
        dim = int(stored[ins[0]].size[-2])
        tensors = adapter_tensors(cfg, stored_types(list(stored), iter_dir), dim)
        groups = dist_groups(cfg, [t for a, b, _ in tensors.values() for t in (a, b)])
        policy = KeyPolicy.of(self.options)
        chunks = self.group_chunks(iter_dir, stored, groups, policy, f"the adapter does not fit the model its "
                                   f"{iter_dir / 'run_config.yaml'} describes; check the checkpoint")
        alpha = as_fraction(peft.get("alpha", 32), f"{iter_dir / 'run_config.yaml'} peft.alpha",
                            "restore run_config.yaml as Megatron-Bridge saved it")
        modules = tuple(AdapterModule(name=stem, a=a.name, b=b.name, r=dim, alpha=alpha,
                                      shape=(base.shape[0], base.shape[1]), base=identity_pieces(base.name, base.shape))
                        for stem, (a, b, base) in tensors.items())
        origin, _ = read_origin(self.name, common.get(ORIGIN_KEY), argparse.Namespace())
        ref = (y.get("checkpoint") or {}).get("pretrained_checkpoint")
        spec = AdapterSpec(kind="bridge", modules=modules, base_ref=ref if isinstance(ref, str) else None,
                           config=peft)
        index = SourceIndex(format=self.name, iter_dir=iter_dir, iteration=iteration, args=args, cfg=cfg,
                            layout=layout, chunks=chunks, style=style, origin=bridge_origin(iter_dir, y, origin),
                            adapter=spec, notes=[f"LoRA adapter of {len(modules)} modules (dim {dim}, alpha "
                                                 f"{peft.get('alpha')})"])
        note = training_state_note(md.state_dict_metadata, common, loads="a fine-tuning run resumes from the target "
                                   "with checkpoint.load_optim and load_rng off")
        index.notes += [note] if note else []
        return policy.finish(index)

    # -- target --------------------------------------------------------------------------------------------
    def laid(self, target: Target) -> list[Laid]:
        """The target's modules: Bridge wraps every layer's module of each type the source adapts, one dim
        (the largest, a multiple of TP) and one alpha for all."""
        cfg, sources = target.cfg, target.adapter.modules
        types = {module_type(p.logical) for m in sources for p in m.base}
        base = {t.name: t for t in logical_tensors(cfg).values() if module_type(t.name) in types}
        slots = [Slot(name=n.removesuffix(".weight"), a=n.removesuffix(".weight") + IN,
                      b=n.removesuffix(".weight") + OUT, shape=(t.shape[0], t.shape[1]),
                      base=identity_pieces(n, t.shape)) for n, t in base.items()]
        laid = lay_out(sources, slots, keep_empty=True)
        need = max(x.module.r for x in laid)
        return with_rank(laid, -(-need // target.layout.tp) * target.layout.tp)

    def target_groups(self, target: Target) -> dict[str, DistGroup]:
        laid = self.laid(target)
        types = {module_type(x.module.base[0].logical) for x in laid}
        tensors = adapter_tensors(target.cfg, types, laid[0].module.r)
        return dist_groups(target.cfg, [t for a, b, _ in tensors.values() for t in (a, b)])

    def target_files(self, target: Target, dtypes: dict[str, torch.dtype]) -> list[TargetFile]:
        assert target.adapter is not None, "convert.adapter_target sends only adapter sources here"
        placed = placements(self.laid(target))
        common = next(iter(dtypes.values()), torch.float32)
        virtual = {name: dtypes.get(ps[0].logical, common) if ps else common for name, ps in placed.items()}
        files = super().target_files(target, {**dtypes, **virtual})
        return [dataclasses.replace(f, tensors=[dataclasses.replace(t, pieces=compose(t.pieces, placed))
                                                for t in f.tensors]) for f in files]

    def run_config_sections(self, target: Target, y: dict[str, Any]) -> None:
        """The ``peft:`` section (the source's when it was a Bridge adapter, with the target's dim and alpha) and
        the base the fine-tuning run starts from (``checkpoint.pretrained_checkpoint``)."""
        laid = self.laid(target)
        dim, alpha = laid[0].module.r, laid[0].module.alpha
        spec = target.adapter
        peft = dict(spec.config) if spec.kind == "bridge" else {
            "_target_": LORA, "target_modules": sorted({module_type(x.module.base[0].logical) for x in laid}),
            "exclude_modules": [], "dropout": 0.0, "dropout_position": "pre", "lora_A_init_method": "xavier",
            "lora_B_init_method": "zero", "a2a_experimental": False, "lora_dtype": None}
        peft.update(dim=dim, alpha=int(alpha) if alpha.denominator == 1 else float(alpha))
        y["peft"] = peft
        base = self.options.base if self.options.base is not None else spec.base_ref if spec.kind == "bridge" else None
        if base is not None and Path(base).exists() and megatron_checkpoint(Path(base)):  # Bridge loads it as one
            y["checkpoint"] = {**(y.get("checkpoint") or {}), "pretrained_checkpoint": str(Path(base).resolve())}


def megatron_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a checkpoint Megatron-Bridge starts a fine-tuning run from (not an HF model)."""
    from . import detect_format

    try:
        return detect_format(path).name in ("bridge", "torch_dist", "megatron")
    except ConvertError:
        return False

