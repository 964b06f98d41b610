"""Megatron-LM's own model builder, run on the args dist_convert writes, judges ``dist_convert.readers``.

For every language-model family (its transformers config class's defaults, plus a Llama 3.2 with RoPE factor 32 and
the suite's Gemma 3), the args a torch_dist target carries (``mlm_args.args_for_target``, what the writers store) go
to Megatron-LM's ``core_transformer_config_from_args`` + ``gpt_config_from_args`` (``hybrid_config_from_args`` for a
hybrid pattern) from megatron-core 0.19.2's wheel, in one oracle process. Where dist_convert warns about no reader,
Megatron-LM's config holds every field of the model as dist_convert's megatron-core description has it (the
description Megatron-Bridge's providers are judged with); where it warns, the builder does build otherwise.
"""
from __future__ import annotations

import json
import warnings

import pytest
import torch
import transformers
from test_gemma3 import GEMMA3

from dist_convert.features.expressed import unexpressed
from dist_convert.formats.mcore_config import ACTIVATION_TARGETS, transformer_fields
from dist_convert.layout.topology import Layout
from dist_convert.mlm_args import args_for_target
from dist_convert.models import FAMILIES, config_from_hf
from dist_convert.readers import MEGATRON_LM, reader_warnings

import hf_models as hm
from conftest import oracle

YARN = {"yarn_rotary_scaling_factor": "yarn_factor", "yarn_original_max_position_embeddings": "yarn_original_max",
        "yarn_beta_fast": "yarn_beta_fast", "yarn_beta_slow": "yarn_beta_slow", "yarn_mscale": "yarn_mscale",
        "yarn_mscale_all_dim": "yarn_mscale_all_dim", "yarn_correction_range_round_to_int": "yarn_round_to_int"}


def configs() -> dict[str, dict]:
    warnings.filterwarnings("ignore")
    out = {}
    for arch, fam in FAMILIES.items():
        if fam.architecture.endswith("ForConditionalGeneration"):
            continue  # vision-language: Megatron-LM's GPT builder makes no tower (its keys fail the load)
        out[arch] = {**type(transformers.AutoConfig.for_model(fam.model_type))().to_dict(), "architectures": [arch]}
    llama32 = transformers.LlamaConfig(**{**hm.BASE, **hm.FAMILIES["llama32"][1]})
    out["llama32_factor32"] = {**llama32.to_dict(), "architectures": ["LlamaForCausalLM"]}
    out["gemma3_suite"] = GEMMA3
    return out


def truth(cfg) -> dict:
    """The model's megatron-core description, in the builder's terms (the padded vocabulary; the RoPE factor only
    where scaling is on; YaRN's fields on a GPT config by Megatron-LM's names)."""
    t = transformer_fields(cfg)
    t["activation_func"] = ACTIVATION_TARGETS[cfg.mlp.activation]
    t["vocab_size"] = cfg.padded_vocab(1)
    if not t["rope_scaling"]:
        del t["rope_scaling_factor"]
    for record in (cfg.gdn, cfg.mamba):  # the layer variants' TransformerConfig fields; the hybrid pattern
        for k, v in (record.to_args() if record is not None else {}).items():
            t["hybrid_layer_pattern" if k == "hybrid_override_pattern" else k] = v
    if cfg.position.kind == "yarn" and cfg.mla is None:
        t["position_embedding_type"] = "yarn"
        t.update({name: getattr(cfg.position, field) for name, field in YARN.items()})
    return t


def differences(want: dict, got: dict) -> dict:
    def same(a, b):
        if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
            return float(a) == float(b)
        return (list(a) if isinstance(a, tuple) else a) == b

    skip = {"rope_scaling", "rope_scaling_factor"} if "rope_scaling" not in got else set()  # HybridModelConfig
    return {k: (v, got.get(k, "<absent>")) for k, v in want.items() if k not in skip and not same(v, got.get(k))}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("readers")
    cases, cfgs = {}, {}
    for name, hf in configs().items():
        cfg, args, _ = config_from_hf(hf, None)
        path = root / f"{name}.args"
        torch.save(args_for_target(args, cfg, Layout(tp=1, pp=1), torch.bfloat16, "torch_dist"), path)
        cases[name], cfgs[name] = str(path), cfg
    (root / "cases.json").write_text(json.dumps(cases))
    oracle("configs", 1, "--cases", str(root / "cases.json"), "--out", str(root / "out.json"), program="mlm_builder",
           runtime="mcore19")
    return cfgs, json.loads((root / "out.json").read_text())


@pytest.mark.parametrize("name", sorted(configs()))
def test_megatron_lm_builds_the_model_or_dist_convert_warns(name, built):
    cfgs, out = built
    cfg, result = cfgs[name], out[name]
    assert "error" not in result, result  # a builder that refused would be a loud failure: none is expected here
    diff = differences(truth(cfg), result["fields"])
    warned = reader_warnings(cfg, "torch_dist")
    if not warned:
        assert not diff, f"{name}: Megatron-LM builds another model from the args, and no warning says so: {diff}"
        return
    dropped = unexpressed(cfg, MEGATRON_LM.expresses)
    # every warning stands for a real difference: a field the builder sets otherwise, or a setting it has no field
    # for at all (Megatron-Bridge's own Gemma 3 fields)
    assert diff or any(s.arg not in result["fields"] for s in dropped), (name, warned)
    assert len(warned) == 1 and "\n" not in warned[0], warned


def test_rope_factor_32_is_named_with_what_megatron_lm_builds(built):
    cfgs, out = built
    assert out["llama32_factor32"]["fields"]["rope_scaling_factor"] == 8.0  # Megatron-LM's own builder
    assert reader_warnings(cfgs["llama32_factor32"], "torch_dist") == [
        "Megatron-LM's model builder (checkpoint args) ignores rope_scaling_factor=32.0 (builds factor 8); pass "
        "rope_scaling_factor to GPTModel in gpt_builders.py, or load with Megatron-Bridge, which reads it"]
    assert reader_warnings(cfgs["llama32_factor32"], "hf") == []


def test_a_run_says_the_warning_at_its_start_and_under_its_summary(tmp_path):
    """The line reaches the user in the run's output twice: before the conversion and under the summary table (which
    a long run's progress has scrolled the first one away from); an HF target, read by transformers, gets none."""
    from conftest import ok, run_cli

    src = hm.make_hf_model(tmp_path, "llama32")  # Llama-3 RoPE scaling, factor 32
    proc = ok(run_cli("reshard", str(src), str(tmp_path / "dst"), "--dst-format", "torch_dist"))
    lines = proc.stderr.splitlines()
    said = [i for i, line in enumerate(lines) if line.startswith("warning: Megatron-LM's model builder")]
    table = next(i for i, line in enumerate(lines) if f"wrote {tmp_path / 'dst'}" in line)
    assert len(said) == 2 and said[0] < table < said[1], proc.stderr[-3000:]
    assert "ignores rope_scaling_factor=32.0" in lines[said[1]] and lines[said[0]] == lines[said[1]]
    back = ok(run_cli("reshard", str(tmp_path / "dst"), str(tmp_path / "hf"), "--dst-format", "hf"))
    assert "warning:" not in back.stderr, back.stderr[-2000:]
