"""The typed name-table rows (``models/rows.py``): what each row expands into, prefixes, wildcards; and the one
registration of the families (``models/__init__.py``). Pure."""
from __future__ import annotations

import dataclasses

import pytest

from dist_convert.models import FAMILIES, PREFERENCE, REGISTERED
from dist_convert.models.base import ATTENTION, EXPERT_FC1, expert_names
from dist_convert.models.rows import (
    GLU,
    QKV,
    TRANSPOSED,
    GatedQKV,
    GDNFused,
    GDNSplit,
    Plain,
    StackedQKV,
    Transposed,
    each,
    names,
    under,
)

QKV_ROW = QKV(logical="self_attention.linear_qkv.weight", q="q_proj.weight", k="k_proj.weight", v="v_proj.weight")


def test_each_row_expands_to_its_parts_in_hf_order():
    lg = "x"
    assert Plain(hf="a", logical=lg).names() == [("a", lg, None)]
    assert Transposed(hf="a", logical=lg).names() == [("a", lg, TRANSPOSED)]
    assert QKV_ROW.names() == [("q_proj.weight", QKV_ROW.logical, "q"), ("k_proj.weight", QKV_ROW.logical, "k"),
                               ("v_proj.weight", QKV_ROW.logical, "v")]
    assert GatedQKV(logical=lg, q="q", k="k", v="v").names() == [("q", lg, "q_gate"), ("k", lg, "k"), ("v", lg, "v")]
    assert StackedQKV(hf="qkv", logical=lg).names() == [("qkv", lg, "vision_qkv")]
    assert GLU(logical=lg, gate="g", up="u").names() == [("g", lg, "gate"), ("u", lg, "up")]
    assert GDNFused(logical=lg, qkvz="f", ba="s").names() == [("f", lg, "gdn_qkvz"), ("s", lg, "gdn_ba")]
    assert [p for _, _, p in GDNSplit(logical=lg, qkv="1", z="2", b="3", a="4").names()] == \
        ["gdn_qkv", "gdn_z", "gdn_b", "gdn_a"]
    assert QKV_ROW.hf_names() == ["q_proj.weight", "k_proj.weight", "v_proj.weight"]


def test_rows_are_frozen_and_keyword_only():
    with pytest.raises(TypeError):
        Plain("a", "b")  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        QKV_ROW.q = "other"  # type: ignore[misc]
    assert QKV_ROW == QKV(logical=QKV_ROW.logical, q="q_proj.weight", k="k_proj.weight", v="v_proj.weight")


def test_under_prefixes_logical_and_hf_names():
    row = QKV_ROW.under("decoder.layers.3.", "model.layers.3.self_attn.")
    assert row.names()[0] == ("model.layers.3.self_attn.q_proj.weight", "decoder.layers.3.self_attention.linear_qkv"
                              ".weight", "q")
    assert QKV_ROW.under("p.").hf_names() == QKV_ROW.hf_names()  # the per-layer tables keep HF suffixes
    assert names([QKV_ROW], "p.") == [(h, "p." + lg, part) for h, lg, part in QKV_ROW.names()]
    assert under([QKV_ROW], "p.") == [QKV_ROW.under("p.")]


def test_wildcards_fill_in_index_major():
    rows = (GLU(logical=EXPERT_FC1, gate="experts.{e}.w1", up="experts.{e}.w3"),
            Plain(hf="experts.{e}.w2", logical="fc2.{e}"))
    got = names(each(rows, e=range(2)))
    assert got == [("experts.0.w1", EXPERT_FC1.format(e=0), "gate"), ("experts.0.w3", EXPERT_FC1.format(e=0), "up"),
                   ("experts.0.w2", "fc2.0", None), ("experts.1.w1", EXPERT_FC1.format(e=1), "gate"),
                   ("experts.1.w3", EXPERT_FC1.format(e=1), "up"), ("experts.1.w2", "fc2.1", None)]
    assert Plain(hf="b.{i}.{j}", logical="l.{j}").at(i=1, j=2).names() == [("b.1.2", "l.2", None)]
    assert names(expert_names("mlp", 1)) == [
        ("mlp.experts.0.gate_proj.weight", EXPERT_FC1.format(e=0), "gate"),
        ("mlp.experts.0.up_proj.weight", EXPERT_FC1.format(e=0), "up"),
        ("mlp.experts.0.down_proj.weight", "mlp.experts.local_experts.0.linear_fc2.weight", None)]


def test_llama_rows_and_their_triples():
    assert [h for h, _, _ in names(ATTENTION)] == [
        "input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
        "self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias", "self_attn.q_norm.weight",
        "self_attn.k_norm.weight", "self_attn.o_proj.weight"]


def test_one_registration_in_the_order_of_preference():
    archs = [f.architecture for f in REGISTERED]
    assert len(archs) == len(set(archs)), "one registration per family"
    assert list(PREFERENCE) == archs == list(FAMILIES)
    assert all(FAMILIES[f.architecture] is f for f in REGISTERED)
    assert PREFERENCE[:6] == ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM",
                              "Gemma3ForCausalLM", "MixtralForCausalLM")
