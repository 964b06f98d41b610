"""Names are declared once, on the setting (``features.base.setting``): the tables that restate them are derived,
and these tests pin what the derivation gives (pure)."""
from __future__ import annotations

import argparse
import dataclasses

from dist_convert.config import RECORDS, ModelConfig, read_names
from dist_convert.features import T5, Embedding, Norms
from dist_convert.features.base import SETTING
from dist_convert.features.expressed import ANY
from dist_convert.features.vision import Qwen3VLTower, Qwen25VLTower, SiglipTower
from dist_convert.formats.mcore_config import (
    BY_HAND,
    FIELDS,
    MLA_PROVIDER_EXPRESSES,
    PROVIDER_EXPRESSES,
    args_from_fields,
)
from dist_convert.mlm_args import ARGS, setting_rows

SIZES = {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4}
# read by hand in args_from_fields: the value is converted or set from others there
CONVERTED = {"normalization", "position_embedding_type", "rotary_base", "layernorm_epsilon", "norm_epsilon",
             "gated_linear_unit", "layernorm_zero_centered_gamma"}


def record_names():
    """(record.field, megatron-core name, its Megatron-LM args names) of every record setting with one."""
    for name, cls in RECORDS.items():
        for path, f in cls.leaf_fields():
            for c in f.metadata.get("config", ()):
                yield f"{name}.{path}", c, f.metadata["arg"]


def test_every_record_setting_is_read_from_its_megatron_core_name():
    """A TransformerConfig naming a record setting reaches the args name the record reads (the renamed ones through
    FIELDS, the others as they are named)."""
    for key, name, args_names in record_names():
        if name in BY_HAND or name in CONVERTED or name in SIZES:
            continue
        args = args_from_fields({**SIZES, name: "sentinel"}, "the test config", "")
        reached = FIELDS.get(name, name)
        assert reached in args_names and vars(args).get(reached) == "sentinel", (key, name, reached)
        assert name in read_names(), (key, name)


def test_fields_restate_no_setting_name():
    """FIELDS holds each record setting's megatron-core name that is not one of its args names (mapped to its first
    one), and otherwise only names no setting declares, the norm epsilon's older args name and the MoE layer list
    (kept a list): no row repeats what a setting says."""
    renamed = {c: f.metadata["arg"][0] for cls in RECORDS.values() for f in cls.all_fields()
               for c in f.metadata.get("config", ()) if c not in f.metadata["arg"]}
    assert {c: FIELDS.get(c) for c in renamed if c not in BY_HAND} == {c: a for c, a in renamed.items()
                                                                       if c not in BY_HAND}
    assert {"gated_linear_unit", "num_moe_experts", "rope_scaling", "seq_len_interpolation_factor"} <= set(renamed)
    restated = {k for k, v in FIELDS.items() if k in read_names() and k not in renamed}
    assert restated == {"layernorm_epsilon", "moe_layer_freq"}, restated


def test_the_provider_expresses_every_moe_and_dsa_setting_and_every_norm_but_sandwich_norms():
    """PROVIDER_EXPRESSES's MoE and norm rows (and MLA_PROVIDER_EXPRESSES's DSA rows) are the records' settings, so a
    setting added to one is expressed (or named an exception) without restating it."""
    for record, table, but in (("moe", PROVIDER_EXPRESSES, set()), ("norm", PROVIDER_EXPRESSES, {"post_norms"}),
                               ("dsa", MLA_PROVIDER_EXPRESSES, set())):
        settings = {f.name for f in RECORDS[record].all_fields() if f.metadata["kind"] == SETTING}
        assert {k.split(".", 1)[1] for k in table if k.startswith(f"{record}.")} == settings - but, record
        assert all(table[f"{record}.{name}"] is ANY for name in settings - but)
    assert {"moe.layer_pattern", "moe.rank_capacity_factor", "norm.residual_post_norm", "dsa.k_norm_eps"} <= set(
        MLA_PROVIDER_EXPRESSES)


def test_the_args_table_restates_no_setting_name():
    """mlm_args.ARGS's rows for the settings' args names come from the settings (``setting(mlm=...)``); no hand row
    names one of them again."""
    declared = {name for f in [*dataclasses.fields(ModelConfig), *(f for cls in RECORDS.values()
                                                                   for _, f in cls.leaf_fields())]
                for name in f.metadata.get("arg", ())}
    derived = setting_rows()
    assert {a.name for a in derived} <= declared and all(a in ARGS for a in derived)
    assert not {a.name for a in ARGS if a not in derived} & declared
    assert {"num_layers", "swiglu", "rotary_base", "hybrid_override_pattern", "moe_router_dtype"} <= {
        a.name for a in derived}


def test_records_read_and_write_their_args_by_the_names_they_declare():
    """The records whose args I/O is Feature's generic one (each field under each of its args names) read back what
    they write, away from every default, and an absent name means Megatron-LM's default."""
    for record in (Norms(kind="LayerNorm", eps=1e-6, zero_centered_gamma=True, post_norms=True,
                         residual_post_norm=True),
                   Embedding(multiplier=8.0, mup=True), T5(encoder_num_layers=3, relative_attention_num_buckets=8),
                   SiglipTower(depth=2, hidden=32, heads=2, ffn=64, image_size=32, head=True, mm_tokens=4,
                               image_token_id=5),
                   Qwen3VLTower(depth=2, hidden=32, heads=2, ffn=64, deepstack=(0, 1), merge=1, image_token_id=5),
                   Qwen25VLTower(depth=2, hidden=32, heads=2, ffn=64, window=112, full_layers=(1,),
                                 tokens_per_second=2, vision_token_id=6)):
        written = record.to_args()
        assert set(written) == {n for f in dataclasses.fields(record) for n in f.metadata["arg"]}
        assert type(record).from_args(argparse.Namespace(num_layers=4, **written)) == record
    assert Norms.from_args(argparse.Namespace()) == Norms(kind="LayerNorm")  # Megatron-LM's --normalization default
