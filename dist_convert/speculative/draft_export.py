"""``--export-draft``: the EAGLE or Medusa draft for serving engines, offline: ``config.json`` plus
``model.safetensors`` in the names ModelOpt's own exporter uses for vLLM / TensorRT-LLM / SGLang
(``LlamaForCausalLMEagle3``: ``fc``, ``midlayer.*``, ``norm``; ``LlamaForCausalLMEagle``:
``layers.N.*``; Medusa: ``medusa_heads.H.L.linear`` and ``medusa_heads.H.<layers>`` for the head's
lm_head). ModelOpt 0.47's exporter cannot be used here: it needs the Hub, slices TP shards as if
they were whole tensors at TP > 1, and has no Medusa rules; the draft is gathered over TP here and
split with the q/k/v and gate/up parts every format takes from ``layout/fused.py``.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from ..config import ModelConfig
from ..durable import write_durable
from ..errors import ConvertError
from ..formats.safetensors_io import write_file
from ..layout.fused import fused_for, glu
from ..models import hf_from_config
from ..models.base import ATTENTION, GATED_MLP, PRE_MLP_NORM
from ..models.rows import names
from ..runtime import Runtime
from ..staging import stage

_LAYER = re.compile(r"^eagle_module\.decoder\.layers\.(\d+)\.(.+)$")
_MEDUSA = re.compile(r"^medusa_heads\.(\d+)\.(medusa_layers\.(\d+)\.linear\.(weight|bias)|lm_head\.weight)$")
# megatron-core suffix in a draft decoder layer -> [(HF suffix, part of the fused tensor)]: the hf
# format's table (a draft layer is a Llama layer; only its first input norm is named differently)
_LAYER_PARTS: dict[str, list[tuple[str, str | None]]] = {}
for _hf, _mcore, _part in names(ATTENTION + PRE_MLP_NORM + GATED_MLP):
    _LAYER_PARTS.setdefault(_mcore, []).append((_hf, _part))


def draft_base_config(cfg: ModelConfig, dtype: torch.dtype,
                      base: dict[str, Any] | None) -> dict[str, Any]:
    """The base model's HF config (``base``: the HF config.json it came from, its Origin's; refuses models no
    supported HF family expresses)."""
    try:
        return hf_from_config(cfg, dtype, base)
    except ConvertError as e:
        raise ConvertError(f"--export-draft needs an HF-expressible base model: {e.cause}",
                           "drop --export-draft (the speculative checkpoint itself is still written)") from None


def serving_names(name: str, eagle3: bool, layers: int) -> list[tuple[str, str | None]]:
    """Pure: the serving-format tensors (name, part of the fused tensor) of one draft tensor."""
    if name.startswith("medusa_heads."):
        m = _MEDUSA.match(name)
        if m is None:
            raise ConvertError(f"unexpected Medusa tensor {name}", "report this with the model config")
        head = m.group(1)
        if m.group(3) is not None:
            return [(f"medusa_heads.{head}.{m.group(3)}.linear.{m.group(4)}", None)]
        return [(f"medusa_heads.{head}.{layers}.weight", None)]
    deep = eagle3 and layers > 1
    if eagle3:
        top = {"eagle_module.enorm.weight":
               "midlayer.0.input_layernorm.weight" if deep else "midlayer.input_layernorm.weight"}
    else:
        top = {"eagle_module.enorm.weight": "enorm.weight", "eagle_module.hnorm.weight": "hnorm.weight"}
    top |= {"eagle_module.fc.weight": "fc.weight", "eagle_module.fc.bias": "fc.bias", "eagle_module.d2t": "d2t",
            "eagle_module.decoder.final_layernorm.weight": "norm.weight",
            "eagle_module.output_layer.weight": "lm_head.weight"}
    if name in top:
        return [(top[name], None)]
    m = _LAYER.match(name)
    if m is None:
        raise ConvertError(f"unexpected EAGLE tensor {name}", "report this with the model config")
    i, suffix = int(m.group(1)), m.group(2)
    prefix = (f"midlayer.{i}." if deep else "midlayer.") if eagle3 else f"layers.{i}."
    if suffix == "input_layernorm.weight" and eagle3:
        return [(prefix + "hidden_norm.weight", None)]
    if suffix not in _LAYER_PARTS:
        raise ConvertError(f"unexpected EAGLE tensor {name}", "report this with the model config")
    return [(prefix + hf, part) for hf, part in _LAYER_PARTS[suffix]]


def partition_dims(model: Any) -> dict[str, int]:
    """Parameter name -> the dim megatron-core splits it on over TP ranks (from the module types,
    not from parameter attributes, which megatron-core sets only when it initialises weights)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

    dims = {}
    for prefix, module in model.named_modules():
        if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
            dims.update({f"{prefix}.weight": 0, f"{prefix}.bias": 0})
        elif isinstance(module, RowParallelLinear):
            dims[f"{prefix}.weight"] = 1
    return dims


def backend_devices(config: str) -> set[str]:
    """Pure: the device types a process group moves tensors of, from its backend config
    (``dist.get_backend_config``: ``"cpu:gloo,cuda:gloo"``, ``"cuda:nccl"``, ``"cpu:gloo,cuda:nccl"``; a bare
    backend name as ``dist.BackendConfig`` expands it)."""
    if ":" not in config:
        config = str(dist.BackendConfig(dist.Backend(config)))
    return {part.split(":", 1)[0].strip() for part in config.split(",") if ":" in part}


def gather_device(config: str, held: torch.device, rank_device: torch.device) -> torch.device:
    """Pure: where a tensor ``held`` on one device is gathered over a group of backend ``config``: where it is,
    when the group moves tensors there (gloo: CPU; NCCL: a GPU); else on this rank's device (the runtime's:
    its GPU under NCCL, where a CPU tensor goes); else on the CPU."""
    devices = backend_devices(config)
    if held.type in devices:
        return held
    if rank_device.type in devices:
        return rank_device
    if "cpu" in devices:
        return torch.device("cpu")
    err = ConvertError(f"the tensor-parallel group ({config}) moves {'/'.join(sorted(devices))} tensors only, and "
                       f"this rank runs on {rank_device}",
                       "launch with --backend nccl and one GPU per rank, or with --backend gloo")
    err.local = True  # only the last pipeline stage gathers: those ranks say it
    raise err


def gather_full(model: Any, gated: bool, device: torch.device) -> dict[str, torch.Tensor]:
    """Collective over the TP group: every draft tensor of this rank's model, whole, on the CPU. Gathered on the
    device the group's backend needs (``device``: this rank's, the runtime's): NCCL gathers CUDA tensors only."""
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    group = parallel_state.get_tensor_model_parallel_group()
    config = dist.get_backend_config(group) if tp > 1 else ""
    dims = partition_dims(model)
    out = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if not name.startswith(("eagle_module.", "medusa_heads.")) or "_extra_state" in name:
            continue
        t = t.detach()
        if tp > 1 and name in dims:
            t = t.to(gather_device(config, t.device, device)).contiguous()
            parts = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(parts, t, group=group)
            if gated and name.endswith("linear_fc1.weight"):  # each rank holds [gate_r; up_r]
                t = glu(tp * t.shape[0]).unshard(parts)
            else:
                t = torch.cat(parts, dim=dims[name])
        out[name] = t.cpu().contiguous()
    return out


def draft_tensors(full: dict[str, torch.Tensor], draft_cfg: Any, eagle3: bool, layers: int,
                  vocab: int) -> list[tuple[str, torch.Tensor]]:
    """Pure: serving-format tensors from whole draft tensors (Medusa lm_heads stripped to the vocabulary)."""
    out = []
    for name in sorted(full):
        t = full[name]
        if name.startswith("medusa_heads.") and name.endswith("lm_head.weight"):
            t = t[:vocab]
        parts: dict[str, torch.Tensor] = {}  # t cut into q/k/v or gate/up
        for hf_name, part in serving_names(name, eagle3, layers):
            if part is None:
                out.append((hf_name, t.contiguous()))
                continue
            parts = parts or fused_for(part, draft_cfg, t.shape[0]).split(t)
            out.append((hf_name, parts[part]))
    return sorted(out)


def draft_config(base: dict[str, Any], algo: str, spec_cfg: dict[str, Any], model: Any) -> dict[str, Any]:
    cfg = dict(base)
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        cfg[k] = None
    if algo == "medusa":
        cfg["medusa"] = {"num_medusa_heads": spec_cfg["medusa_num_heads"],
                         "num_medusa_layers": spec_cfg["medusa_num_layers"]}
        return cfg
    ec, arch = model.eagle_config, spec_cfg["eagle_architecture_config"]
    eagle3 = bool(arch.get("use_aux_hidden_state"))
    cfg.update({
        "architectures": [("LlamaForCausalLMEagle3Deep" if ec.num_layers > 1 else "LlamaForCausalLMEagle3")
                          if eagle3 else "LlamaForCausalLMEagle"],
        "num_hidden_layers": ec.num_layers, "intermediate_size": ec.ffn_hidden_size,
        "num_attention_heads": ec.num_attention_heads, "num_key_value_heads": ec.num_query_groups,
        "head_dim": ec.kv_channels, "draft_vocab_size": min(ec.draft_vocab_size, base["vocab_size"]),
        "eagle_config": {k: getattr(ec, k) for k in (
            "use_input_layernorm_in_first_layer", "use_last_layernorm", "use_mtp_layernorm", "use_aux_hidden_state",
            "eagle_aux_hidden_state_layer_ids", "parallel_draft_step", "parallel_draft_heads_num_layers")}
        | {"next_layer_regular": True},
    })
    return cfg


def export_draft(model: Any, algo: str, spec_cfg: dict[str, Any], cfg: ModelConfig,
                 dtype: torch.dtype, out: Path, rt: Runtime, overwrite: bool = False,
                 hf_config: dict[str, Any] | None = None) -> None:
    """Collective. The last pipeline stage gathers the draft over TP; its first TP rank of data-parallel
    replica 0 writes it; the directory appears atomically. ``hf_config``: the base model's HF config.json
    (its Origin's), the draft config's base."""
    from megatron.core import parallel_state

    staging = stage(out, rt, overwrite=overwrite)
    tmp = staging.tmp
    with staging.guard():
        if parallel_state.is_pipeline_last_stage():
            full = gather_full(model, cfg.mlp.gated, rt.device)
            if (parallel_state.get_tensor_model_parallel_rank() == 0
                    and parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0):
                base = draft_base_config(cfg, dtype, hf_config)
                if algo == "medusa":
                    layers, eagle3, draft_cfg = spec_cfg["medusa_num_layers"], False, None
                else:
                    ec = model.eagle_config
                    layers, eagle3 = ec.num_layers, bool(ec.use_aux_hidden_state)
                    draft_cfg = SimpleNamespace(kv_channels=ec.kv_channels, num_query_groups=ec.num_query_groups,
                                                num_attention_heads=ec.num_attention_heads,
                                                ffn_hidden_size=ec.ffn_hidden_size,
                                                attention=SimpleNamespace(output_gate=False))
                write_file(tmp / "model.safetensors", draft_tensors(full, draft_cfg, eagle3, layers, cfg.vocab_size))
                write_durable(tmp / "config.json", json.dumps(draft_config(base, algo, spec_cfg, model), indent=2))
        rt.barrier()
        staging.complete()
    staging.commit()
