"""Megatron-LM's own model builder, run on the args dist_convert writes, judges ``dist_convert.readers``.

For every language-model family (its transformers config class's defaults, plus a Llama 3.2 with RoPE factor 32, the
suite's Gemma 3, a Llama with linear RoPE interpolation, a Mixtral with a random router bias, and Qwen3, Qwen3-Next,
DeepSeek-V3 and GLM-5 as megatron-core's HybridModel, ``--target-model hybrid``), the args a torch_dist
target carries (``mlm_args.args_for_target``, what the writers store) go to Megatron-LM's builder
(tests/oracles/mlm_builder.py), in one oracle process per release:

* core_v0.19: ``core_transformer_config_from_args`` + ``gpt_config_from_args`` (``hybrid_config_from_args`` for a
  hybrid pattern) from megatron-core 0.19.2's wheel, which ships ``megatron/training``;
* core_v0.16: ``gpt_builders.gpt_builder`` / ``mamba_builders.mamba_builder`` of Megatron-LM's core_v0.16.1 tag,
  beside the default venv's megatron-core 0.16.1. No package carries that code (megatron-core 0.16.1's wheel and
  sdist hold ``megatron/core`` only), so it comes from a Megatron-LM git repository holding the tag (its
  ``git archive``) or a source tree at the tag: ``$DIST_CONVERT_MEGATRON_LM``, else ``MIRROR`` where it exists; with
  neither, these tests are skipped, saying so.

Where dist_convert warns about no reader of that release, Megatron-LM's config holds every field of the model as
dist_convert's megatron-core description has it (the description Megatron-Bridge's providers are judged with); where
it warns, that builder does build otherwise.
"""
from __future__ import annotations

import dataclasses
import io
import json
import os
import subprocess
import sys
import tarfile
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from test_gemma3 import GEMMA3

from dist_convert.features.expressed import unexpressed
from dist_convert.formats.mcore_config import ACTIVATION_TARGETS, transformer_fields
from dist_convert.layout.topology import Layout
from dist_convert.mlm_args import args_for_target
from dist_convert.model_class import hybrid_of
from dist_convert.models import FAMILIES, config_from_hf
from dist_convert.readers import MEGATRON_LM, reader_warnings

import hf_models as hm
from conftest import ENV, ROOT, oracle

MLM_TAG = "core_v0.16.1"
MLM_ENV = "DIST_CONVERT_MEGATRON_LM"  # a Megatron-LM git repository holding MLM_TAG, or a source tree at it
MIRROR = Path("/work/.mirror/NVIDIA+Megatron-LM/repo")  # a bare clone, where a development machine has one
# what the oracle imports of Megatron-LM's tree (megatron/core is the installed megatron-core's)
MLM_PATHS = ("gpt_builders.py", "mamba_builders.py", "model_provider.py", "megatron/training", "megatron/legacy",
             "megatron/rl", "megatron/post_training")
RELEASES = ("core_v0.19", "core_v0.16")
YARN = {"yarn_rotary_scaling_factor": "factor", "yarn_original_max_position_embeddings": "original_max",
        "yarn_beta_fast": "beta_fast", "yarn_beta_slow": "beta_slow", "yarn_mscale": "mscale",
        "yarn_mscale_all_dim": "mscale_all_dim", "yarn_correction_range_round_to_int": "round_to_int"}


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


# models no HF config gives, made from one that does: (its HF case, a change of its ModelConfig)
VARIANTS = {"llama_interpolation2": ("LlamaForCausalLM", lambda cfg: dataclasses.replace(
                cfg, position=dataclasses.replace(cfg.position, seq_len_interpolation=2.0))),
            "mixtral_force_biased": ("MixtralForCausalLM", lambda cfg: dataclasses.replace(
                cfg, moe=dataclasses.replace(cfg.moe, force_biased=0.5))),
            # the same models as megatron-core's HybridModel (--target-model hybrid)
            **{f"{arch}_hybrid": (arch, hybrid_of) for arch in ("Qwen3ForCausalLM", "Qwen3NextForCausalLM",
                                                                  "DeepseekV3ForCausalLM", "GlmMoeDsaForCausalLM")}}
CASES = sorted([*configs(), *VARIANTS])


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
        t.update({name: getattr(cfg.position.scaling, field) for name, field in YARN.items()})
    return t


def differences(want: dict, got: dict) -> dict:
    def same(a, b):
        if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
            return float(a) == float(b)
        return (list(a) if isinstance(a, tuple) else a) == b

    skip = {"rope_scaling", "rope_scaling_factor"} if "rope_scaling" not in got else set()  # HybridModelConfig
    return {k: (v, got.get(k, "<absent>")) for k, v in want.items() if k not in skip and not same(v, got.get(k))}


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """The args a torch_dist target of each case carries, saved; {name: ModelConfig}; the cases file."""
    root = tmp_path_factory.mktemp("readers")
    paths, cfgs = {}, {}
    hfs = configs()
    for name in CASES:
        base, change = VARIANTS.get(name, (name, None))
        cfg, args, _ = config_from_hf(hfs[base], None)
        cfg = change(cfg) if change else cfg
        path = root / f"{name}.args"
        torch.save(args_for_target(args, cfg, Layout(tp=1, pp=1), torch.bfloat16, "torch_dist"), path)
        paths[name], cfgs[name] = str(path), cfg
    (root / "cases.json").write_text(json.dumps(paths))
    return cfgs, root / "cases.json"


def megatron_lm_tree(root: Path) -> Path:
    """Megatron-LM's code at MLM_TAG: the source tree ``$DIST_CONVERT_MEGATRON_LM`` names, or MLM_PATHS of the tag
    taken from the git repository it (else MIRROR) names into ``root``; a skip saying what is missing."""
    from importlib.metadata import version

    if not version("megatron-core").startswith("0.16."):
        pytest.skip(f"core_v0.16 is judged beside megatron-core 0.16 (the default venv's); this is "
                    f"{version('megatron-core')}")
    src = os.environ.get(MLM_ENV) or (str(MIRROR) if MIRROR.is_dir() else "")
    if not src:
        pytest.skip(f"no Megatron-LM source for {MLM_TAG} (no package ships its megatron/training): set {MLM_ENV} "
                    f"to a Megatron-LM git repository holding the tag, or to a source tree at it")
    if (Path(src) / "gpt_builders.py").is_file():
        return Path(src)
    archive = subprocess.run(["git", "-C", src, "archive", MLM_TAG, *MLM_PATHS], capture_output=True, timeout=300)
    if archive.returncode:
        pytest.skip(f"{src}: no Megatron-LM {MLM_TAG} there ({MLM_ENV}): "
                    f"{archive.stderr.decode(errors='replace').strip()[:200]}")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(root / "megatron-lm", filter="data")
    return root / "megatron-lm"


@pytest.fixture(scope="module", params=RELEASES)
def built(request, cases):
    """(the release, {name: ModelConfig}, what that release of Megatron-LM's builder made of each case's args)."""
    cfgs, cases_json = cases
    root, release = cases_json.parent, request.param
    out = root / f"out_{release}.json"
    if release == "core_v0.19":
        oracle("configs", 1, "--cases", str(cases_json), "--out", str(out), program="mlm_builder", runtime="mcore19")
    else:  # a process of its own: the oracle puts Megatron-LM's tree on its path
        tree = megatron_lm_tree(root)
        proc = subprocess.run([sys.executable, str(ROOT / "tests" / "oracles" / "mlm_builder.py"), "configs",
                               "--cases", str(cases_json), "--out", str(out), "--megatron-lm", str(tree)],
                              env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return release, cfgs, json.loads(out.read_text())


@pytest.mark.parametrize("name", CASES)
def test_megatron_lm_builds_the_model_or_dist_convert_warns(name, built):
    release, cfgs, out = built
    cfg, result = cfgs[name], out[name]
    assert "error" not in result, result  # a builder that refused would be a loud failure: none is expected here
    assert result["fields"]["release"] == release
    diff = differences(truth(cfg), result["fields"])
    warned = reader_warnings(cfg, "torch_dist", release)
    if not warned:
        assert not diff, f"{name}: Megatron-LM builds another model from the args, and no warning says so: {diff}"
        return
    dropped = unexpressed(cfg, {**MEGATRON_LM.expresses, **{k: a for r in MEGATRON_LM.releases if r.name == release
                                                            for k, (a, _) in r.narrows.items()}})
    # every warning stands for a real difference: a field the builder sets otherwise, or a setting it has no field
    # for at all (Megatron-Bridge's own Gemma 3 fields)
    assert diff or any(s.arg not in result["fields"] for s in dropped), (name, warned)
    assert len(warned) == 1 and "\n" not in warned[0], warned


def test_rope_factor_32_is_named_with_what_megatron_lm_builds(built):
    _, cfgs, out = built
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
