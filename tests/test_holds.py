"""What each format's targets hold of a model's structural features, declared positively (``Format.holds``), and the
one refusal of the rest (``features.expressed.refuse_features``): pure, no processes."""
from __future__ import annotations

import pytest
import transformers

from dist_convert.config import OPTIONAL
from dist_convert.errors import ConvertError
from dist_convert.features.expressed import refuse_features, unheld
from dist_convert.formats import ADAPTER_FORMATS, FORMATS, format_class, formats_holding
from dist_convert.models import FAMILIES, config_from_hf


def _cfg(arch: str):
    """The model of the family's transformers defaults (the suite's Qwen3-VL for the tower: its defaults have no
    multimodal RoPE sections)."""
    if arch == "Qwen3VLForConditionalGeneration":
        from test_vision import QWEN3_VL

        return config_from_hf(QWEN3_VL, None)[0]
    fam = FAMILIES[arch]
    return config_from_hf({**type(transformers.AutoConfig.for_model(fam.model_type))().to_dict(),
                           "architectures": [arch]}, None)[0]


def test_every_format_declares_features_it_knows():
    for name in FORMATS:
        holds = format_class(name).holds
        assert holds and set(holds) <= set(OPTIONAL), (name, holds)


@pytest.mark.parametrize("arch,feature,refused_by", [
    ("MixtralForCausalLM", "moe", {"nemo"}),
    ("NemotronHForCausalLM", "mamba", {"fsdp_dtensor"}),
    ("Qwen3NextForCausalLM", "gdn", {"fsdp_dtensor"}),
    ("GlmMoeDsaForCausalLM", "dsa", {"fsdp_dtensor"}),  # NeMo's config writers then refuse its settings
    ("Qwen3VLForConditionalGeneration", "vision", {"megatron", "fsdp_dtensor", "nemo", "nemo2"}),
])
def test_a_feature_is_refused_by_the_formats_that_do_not_declare_it(arch, feature, refused_by):
    cfg = _cfg(arch)
    assert getattr(cfg, feature) is not None
    models = [n for n in FORMATS if n not in ADAPTER_FORMATS]
    refused = {n for n in models if any(s.key == feature for s in unheld(cfg, format_class(n).holds))}
    assert refused == refused_by, refused
    assert formats_holding(cfg) == [n for n in models if not unheld(cfg, format_class(n).holds)]
    name = sorted(refused_by)[0]
    with pytest.raises(ConvertError) as e:
        refuse_features(cfg, format_class(name).holds, f"a {name} target", "pass --dst-format torch_dist")
    assert f"a {name} target cannot hold the model's " in str(e.value) and "--dst-format" in str(e.value)


def test_a_feature_nobody_declares_is_refused_everywhere():
    """A structural feature added later (here: MoE, taken out of every declaration) is refused by each format until
    the format says it holds it: nothing is dropped by default."""
    cfg = _cfg("MixtralForCausalLM")
    for name in FORMATS:
        holds = tuple(f for f in format_class(name).holds if f != "moe")
        with pytest.raises(ConvertError, match="Mixture-of-Experts layers"):
            refuse_features(cfg, holds, f"a {name} target", "x")
    refuse_features(_cfg("LlamaForCausalLM"), (), "a target holding no feature", "x")  # a dense model: held
