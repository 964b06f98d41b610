"""A config.json key that is absent is read as transformers reads it: judged by transformers' own config classes.

For every architecture dist_convert reads and every key its config class has (and ``rope_theta`` inside
``rope_parameters``), a config.json without the key is read either as the same model as that config with the key at
the value transformers' class gives it when absent, or refused in one line. The defaults table
(``dist_convert/models/hf_defaults.py``) is the one generated from transformers 5.14.1 (this runtime) and 5.12.1 (the
megatron-core 0.19.2 runtime) by ``tests/hf_defaults_gen.py``.
"""
from __future__ import annotations

import json
import subprocess
import warnings

import hf_defaults_gen as gen
import pytest
import transformers

from dist_convert.errors import ConvertError
from dist_convert.models import FAMILIES, import_config
from dist_convert.models.hf_defaults import ALIASES, DEFAULTS

from conftest import ENV, ROOT
from workers import runtime_python

TEXT = [a for a, fam in FAMILIES.items() if not fam.architecture.endswith("ForConditionalGeneration")]


def reading(hf: dict):
    try:
        return import_config(hf, None).cfg
    except ConvertError as e:
        assert "\n" not in str(e).strip(), e
        return "refused"


def misread_absent_keys(cls, full: dict, whole, prefix: str = "") -> list[str]:
    """Each key of config ``full`` (of config class ``cls``; ``whole`` makes the config.json read from it) that, left
    out, is read otherwise than with the value transformers gives it then (a config transformers refuses without the
    key, and a reading dist_convert refuses, are not misreadings)."""
    keys = list(full) + (["rope.rope_theta"] if "rope_theta" in (full.get("rope_parameters") or {}) else [])
    wrong = []
    for key in keys:
        try:
            default = gen._absent(cls, full, key)
        except Exception:  # noqa: BLE001 - transformers itself refuses a config without it
            continue
        minus = gen._without(full, key)
        got = reading(whole(minus))
        if got != "refused" and got != reading(whole(gen._with(minus, key, default))):
            wrong.append(f"{prefix}{key} (transformers: {default!r})")
    return wrong


@pytest.mark.parametrize("arch", TEXT)
def test_absent_key_reads_as_transformers_reads_it(arch):
    warnings.filterwarnings("ignore")
    cls = type(transformers.AutoConfig.for_model(FAMILIES[arch].model_type))
    full = {k: v for k, v in cls().to_dict().items() if k not in gen.BOOKKEEPING}
    assert reading({**full, "architectures": [arch]}) != "refused", arch
    wrong = misread_absent_keys(cls, full, lambda config: {**config, "architectures": [arch]})
    assert not wrong, f"{arch}: an absent key read otherwise than transformers reads it: {wrong}"


VISION_LANGUAGE = [a for a in FAMILIES if a not in TEXT]


def vision_language(arch: str) -> dict:
    """transformers' default config of ``arch``, made readable: the family's own text config (Mistral 3's default is
    Mistral's), a whole head size, multimodal RoPE sections covering half the rotated part of the head (the classes'
    defaults have none) and, for Gemma 3, a tower whose patches pool into its 256 tokens."""
    fam = FAMILIES[arch]
    hf = {**type(transformers.AutoConfig.for_model(fam.model_type))().to_dict(), "architectures": [arch]}
    if gen.text_class(type(transformers.AutoConfig.for_model(fam.model_type)), fam) is not type(
            transformers.AutoConfig.for_model(hf["text_config"]["model_type"])):  # Mistral 3's default: Mistral
        hf["text_config"] = type(transformers.AutoConfig.for_model(fam.text.model_type))().to_dict()
    text = hf["text_config"]
    if FAMILIES[arch].model_type == "gemma3":
        hf["vision_config"].update(image_size=896, patch_size=14)
    elif "position.mrope_section" in fam.vision_expresses():
        if text.get("head_dim") is None and text["hidden_size"] % text["num_attention_heads"]:
            text["head_dim"] = 128  # GLM-4.5V's class: 4096 / 96 heads is no whole head; its releases state 128
        share = (text.get("rope_parameters") or {}).get("partial_rotary_factor") or 1.0
        half = round((text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]) * share) // 2
        text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": [half - 2 * (half * 5 // 16),
                                                                                half * 5 // 16, half * 5 // 16]}
    return hf


@pytest.mark.parametrize("arch", VISION_LANGUAGE)
def test_absent_text_config_key_reads_as_the_text_config_class_gives_it(arch):
    """A vision-language config.json's text_config without a key is the model its text config class builds (Qwen3-VL's
    text RoPE base is 5e5 where Qwen3's is 1e4), judged through the whole import of the vision-language model."""
    warnings.filterwarnings("ignore")
    hf = vision_language(arch)
    cls = gen.text_class(type(transformers.AutoConfig.for_model(FAMILIES[arch].model_type)), FAMILIES[arch])
    full = {k: v for k, v in hf["text_config"].items() if k not in gen.BOOKKEEPING}
    assert reading(hf) != "refused", arch
    wrong = misread_absent_keys(cls, full, lambda config: {**hf, "text_config": config}, "text_config.")
    assert not wrong, f"{arch}: an absent key read otherwise than transformers reads it: {wrong}"


def test_defaults_table_is_generated_from_the_runtimes_transformers(tmp_path):
    """The committed table equals the one generated now from both runtimes' transformers releases."""
    here = {"release": transformers.__version__, "table": gen.table()}
    other = tmp_path / "other.json"
    subprocess.run([str(runtime_python("mcore19")), str(ROOT / "tests" / "hf_defaults_gen.py"), "--json", str(other)],
                   check=True, env=ENV, capture_output=True, timeout=300)
    theirs = json.loads(other.read_text())
    assert theirs["release"] != here["release"], "two transformers releases judge the table"
    tables = [here["table"], theirs["table"]]
    assert gen.merge_aliases(tables, DEFAULTS) == ALIASES, "regenerate: the config classes' aliases changed"
    assert gen.merge(tables) == DEFAULTS, \
        "regenerate: python tests/hf_defaults_gen.py --json A.json under each runtime, then --write A.json B.json"


def test_releases_that_disagree_refuse_the_absent_key():
    hf = {**transformers.DeepseekV3Config().to_dict(), "architectures": ["DeepseekV3ForCausalLM"]}
    del hf["num_nextn_predict_layers"]
    with pytest.raises(ConvertError, match="num_nextn_predict_layers"):
        import_config(hf, None)
    hf["num_nextn_predict_layers"] = 0
    assert import_config(hf, None).cfg.mtp is None


def test_mixtral_without_rope_theta_gets_its_classes_base():
    """The bug this table fixes: a Mixtral config.json without rope_theta is a 1e6 RoPE base in transformers (its
    class's default), not 1e4."""
    hf = {k: v for k, v in transformers.MixtralConfig(num_hidden_layers=2).to_dict().items()
          if k not in ("rope_parameters", "rope_theta")}
    assert import_config({**hf, "architectures": ["MixtralForCausalLM"]}, None).cfg.position.base == 1e6


@pytest.mark.parametrize("arch", ["Qwen3MoeForCausalLM", "MixtralForCausalLM", "GptOssForCausalLM"])
def test_a_key_under_its_other_name_is_not_defaulted(arch):
    """config.json's ``num_experts`` is the class's ``num_local_experts`` (its attribute_map): a config that says 64
    experts that way has 64, not the default the absent canonical key would get."""
    warnings.filterwarnings("ignore")
    cls = type(transformers.AutoConfig.for_model(FAMILIES[arch].model_type))
    hf = {k: v for k, v in cls(num_hidden_layers=2).to_dict().items() if k != "num_local_experts"}
    hf.update(num_experts=64, architectures=[arch])
    assert import_config(hf, None).cfg.num_experts == 64
