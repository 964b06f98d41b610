"""LoRA structures without processes: laying one adapter's modules into another structure (HF peft's per-projection
modules, Megatron-Bridge's fused ones) keeps every base tensor's ``scale * B @ A`` exactly; the merge epilogue
adds exactly that on any box; peft's own pattern rule; what is refused."""
from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from dist_convert.errors import ConvertError
from dist_convert.formats.bridge_lora import IN, OUT, adapter_tensors
from dist_convert.formats.hf import hf_tensors
from dist_convert.formats.peft import check_config, pattern_value, peft_config, peft_slots
from dist_convert.layout.boxes import Box, Kind, Piece
from dist_convert.layout.rules import logical_tensors
from dist_convert.lora.adapter import AdapterModule, identity_pieces, module_type
from dist_convert.lora.merge import Merger
from dist_convert.lora.structure import Slot, compose, lay_out, placements, with_rank
from dist_convert.models import config_from_hf

CFG = config_from_hf({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 100,
                      "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
                      "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "max_position_embeddings": 64,
                      "tie_word_embeddings": False, "rope_theta": 1e4}, None)[0]
LOGICAL = logical_tensors(CFG)
HF = hf_tensors(CFG)
PEFT_SLOTS = {s.name: s for s in peft_slots(HF)}


def bridge_slots() -> list[Slot]:
    return [Slot(name=n.removesuffix(".weight"), a=n.removesuffix(".weight") + IN, b=n.removesuffix(".weight") + OUT,
                 shape=t.shape, base=identity_pieces(n, t.shape)) for n, t in LOGICAL.items() if module_type(n)]


def module(slot: Slot, r: int, alpha: int = 8, **kw) -> AdapterModule:
    return AdapterModule(name=slot.name, a=slot.a, b=slot.b, r=r, alpha=Fraction(alpha), shape=slot.shape,
                         base=slot.base, **kw)


def random_tensors(modules: list[AdapterModule], seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for m in modules:
        out[m.a] = torch.randn(m.r, m.shape[1], generator=g)
        out[m.b] = torch.randn(m.shape[0], m.r, generator=g)
    return out


def assemble(laid, src: dict[str, torch.Tensor]) -> tuple[list[AdapterModule], dict[str, torch.Tensor]]:
    """The target modules' A and B filled from the sources through the placements (zeros elsewhere), as the
    engine fills target tensors from their composed pieces."""
    placed = placements(laid)
    out = {}
    for x in laid:
        m = x.module
        for name, shape in ((m.a, (m.r, m.shape[1])), (m.b, (m.shape[0], m.r))):
            t = torch.zeros(shape)
            for p in compose([Piece(name, Box.full(shape), Box.full(shape))], placed):
                t[p.sbox.slices()] = src[p.logical][p.lbox.slices()] * p.scale
            out[name] = t
    return [x.module for x in laid], out


def deltas(modules: list[AdapterModule], tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each logical base tensor's sum of scale * B @ A, placed through the modules' base pieces (dense)."""
    out = {}
    for m in modules:
        dw = tensors[m.b] @ tensors[m.a] * m.scale
        for p in m.base:
            t = out.setdefault(p.logical, torch.zeros(LOGICAL[p.logical].shape))
            t[p.lbox.slices()] += dw[p.sbox.slices()]
    return out


def test_peft_modules_become_one_block_structured_bridge_module_per_fused_tensor():
    # q of rank 2 with alpha 4 has k's and v's scale (8 / 4): one fused module of rank 2 + 4 + 4, alpha 2 * 10
    sources = [module(s, r=2, alpha=4) if s.name.endswith("q_proj") else module(s, r=4) for s in PEFT_SLOTS.values()]
    laid = lay_out(sources, bridge_slots())
    qkv = next(x for x in laid if x.module.name == "decoder.layers.0.self_attention.linear_qkv")
    assert (qkv.module.r, qkv.module.alpha) == (10, 20) and {p.scale for p in qkv.b} == {1.0}
    fc1 = next(x.module for x in laid if x.module.name == "decoder.layers.0.mlp.linear_fc1")
    assert (fc1.r, fc1.alpha) == (8, 16)


def test_scales_a_power_of_two_apart_are_folded_into_b_exactly():
    """peft's rank_pattern at one alpha: q of rank 2 (scale 4) beside k and v of rank 4 (scale 2). One fused module
    takes the common scale, q's B is stored times 2 (exact in binary), and every product stays peft's bit for bit;
    Bridge's one alpha for the whole adapter folds o_proj's alpha 16 (scale 4) likewise."""
    sources = [module(s, r=2) if s.name.endswith("q_proj") else module(s, r=4, alpha=16 if s.name.endswith("o_proj")
                                                                       else 8) for s in PEFT_SLOTS.values()]
    src = random_tensors(sources)
    laid = with_rank(lay_out(sources, bridge_slots(), keep_empty=True), 12)
    assert {x.module.alpha for x in laid} == {24}  # scale 2 x dim 12
    qkv = next(x for x in laid if x.module.name == "decoder.layers.0.self_attention.linear_qkv")
    q_rows = {p.scale for p in qkv.b if p.logical.endswith("q_proj.lora_B.weight")}
    assert q_rows == {2.0} and {p.scale for p in qkv.b} == {1.0, 2.0}
    proj = next(x for x in laid if x.module.name == "decoder.layers.0.self_attention.linear_proj")
    assert {p.scale for p in proj.b} == {2.0}
    mods, fused = assemble(laid, src)
    want = deltas(sources, src)
    for name, t in deltas(mods, fused).items():
        assert torch.equal(t, want[name]), name
    # scales 3 and 2 (alpha 12 on k): no power of two apart, refused
    with pytest.raises(ConvertError, match="no power of two"):
        lay_out([module(s, r=4, alpha=12) if s.name.endswith("k_proj") else module(s, r=4)
                 for s in PEFT_SLOTS.values()], bridge_slots())


def test_layout_round_trip_keeps_every_product_exactly():
    sources = [module(s, r=4) for s in PEFT_SLOTS.values()]
    src = random_tensors(sources)
    want = deltas(sources, src)
    mods, fused = assemble(lay_out(sources, bridge_slots(), multiple=4), src)
    assert {m.r for m in mods} == {4, 8, 12}  # fc2 and proj: one block; fc1: gate and up; qkv: three
    for name, t in deltas(mods, fused).items():
        torch.testing.assert_close(t, want[name], rtol=1e-6, atol=1e-6)
    back_mods, back = assemble(lay_out(mods, list(PEFT_SLOTS.values())), fused)
    for name, t in deltas(back_mods, back).items():
        torch.testing.assert_close(t, want[name], rtol=1e-6, atol=1e-6)


def test_fused_bridge_module_becomes_peft_modules_with_one_a():
    sources = [module(s, r=4) for s in bridge_slots()]
    src = random_tensors(sources)
    mods, out = assemble(lay_out(sources, list(PEFT_SLOTS.values())), src)
    q, k = "model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.k_proj"
    qkv = "decoder.layers.1.self_attention.linear_qkv"
    assert torch.equal(out[f"{q}.lora_A.weight"], src[qkv + IN]) and torch.equal(out[f"{k}.lora_A.weight"],
                                                                                  src[qkv + IN])
    # q rows of megatron-core's group-major fused B: per group its 2 heads of 16 rows, then k, then v
    b = src[qkv + OUT]
    torch.testing.assert_close(out[f"{q}.lora_B.weight"], torch.cat([b[0:32], b[64:96]]), rtol=0, atol=0)
    assert {m.r for m in mods} == {4}
    want = deltas(sources, src)
    for name, t in deltas(mods, out).items():
        torch.testing.assert_close(t, want[name], rtol=1e-6, atol=1e-6)
    # back to Bridge: q/k/v with one A (same_a) are one block again, not three
    twins = [m if not m.name.endswith(("k_proj", "v_proj", "up_proj")) else
             AdapterModule(**{**m.__dict__, "same_a": m.name.rsplit(".", 1)[0] + (
                 ".q_proj" if "self_attn" in m.name else ".gate_proj")}) for m in mods]
    again, _ = assemble(lay_out(twins, bridge_slots()), out)
    assert {m.r for m in again} == {4}


def test_merge_epilogue_adds_the_product_on_any_block():
    sources = [module(s, r=4) for s in PEFT_SLOTS.values()]
    src = random_tensors(sources)
    want = deltas(sources, src)

    class Reader:
        def box(self, logical: str, box: Box) -> torch.Tensor:
            return src[logical][box.slices()].clone()

    from dist_convert.lora.adapter import AdapterSpec
    merger = Merger(AdapterSpec(kind="peft", modules=tuple(sources)), Reader())
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    # a TP=2 shard's rows (a stacked [1, rows, cols] torch_dist chunk), in two row blocks
    rows = Box((0, 64, 0), (1, 64, 64))
    piece = Piece(name, Box((64, 0), (64, 64)), Box((0, 0, 0), (1, 64, 64)))
    from dist_convert.datamodel import TargetTensor
    t = TargetTensor(key="k", shape=(1, 64, 64), dtype=torch.bfloat16, pieces=[piece])
    merger.stored[(0, 0)] = torch.bfloat16
    base = torch.randn(1, 64, 64)
    top = merger.apply(0, 0, t, Box((0, 0, 0), (1, 40, 64)), base[:, :40].clone())
    bottom = merger.apply(0, 0, t, Box((0, 40, 0), (1, 24, 64)), base[:, 40:].clone())
    assert top.dtype == torch.bfloat16  # cast after the merge
    expect = (base[0] + want[name][rows.offsets[1]:rows.offsets[1] + 64]).bfloat16()
    torch.testing.assert_close(torch.cat([top, bottom], 1)[0], expect, rtol=0, atol=0)


def test_bridge_adapter_tensors_split_as_bridge_splits_them():
    t = adapter_tensors(CFG, {"linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"}, 8)
    a, b, _ = t["decoder.layers.0.self_attention.linear_qkv"]
    assert (a.kind, a.shape, b.kind, b.shape) == (Kind.COL, (8, 64), Kind.COL, (128, 8))
    a, b, _ = t["decoder.layers.0.self_attention.linear_proj"]
    assert (a.kind, b.kind) == (Kind.ROW, Kind.COL)
    a, b, _ = t["decoder.layers.1.mlp.linear_fc1"]
    assert (a.kind, b.kind, b.shape) == (Kind.COL, Kind.GLU, (192, 8))
    assert a.dist_suffix == "mlp.linear_fc1.adapter.linear_in.weight"


def test_peft_pattern_rule_and_config():
    patterns = {"q_proj": 2, "model.layers.1.mlp.down_proj": 8}
    assert pattern_value(patterns, "model.layers.0.self_attn.q_proj", 4) == 2
    assert pattern_value(patterns, "model.layers.1.mlp.down_proj", 4) == 8
    assert pattern_value(patterns, "model.layers.11.mlp.down_proj", 4) == 4
    assert pattern_value(patterns, "model.layers.0.self_attn.xq_proj", 4) == 4
    laid = lay_out([module(s, r=4) for s in bridge_slots()], list(PEFT_SLOTS.values()))
    cfg = peft_config(laid, "meta-llama/x", None)
    assert (cfg["r"], cfg["lora_alpha"], cfg["rank_pattern"], cfg["alpha_pattern"]) == (4, 8, {}, {})
    assert cfg["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


@pytest.mark.parametrize("config,needle", [
    ({"peft_type": "IA3"}, "not LoRA"), ({"use_dora": True}, "DoRA"), ({"lora_bias": True}, "biases"),
    ({"bias": "all"}, "trains biases"), ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"target_parameters": ["mlp.experts.gate_up_proj"]}, "3-D expert"),
])
def test_refused_adapter_configs(config, needle, tmp_path):
    with pytest.raises(ConvertError, match=needle):
        check_config({"peft_type": "LORA", **config}, tmp_path)
    check_config({"peft_type": "LORA", "use_dora": False, "megatron_core": "megatron.core", "modules_to_save": None},
                 tmp_path)


def test_expert_and_other_adapters_are_refused(tmp_path):
    from dist_convert.formats.bridge_lora import stored_types
    from dist_convert.lora.adapter import check_base_pieces

    assert stored_types(["decoder.layers.self_attention.linear_qkv" + IN, "decoder.layers.mlp.linear_fc2" + OUT],
                        tmp_path) == {"linear_qkv", "linear_fc2"}
    for key in ("decoder.layers.mlp.experts.experts.linear_fc1" + IN, "decoder.layers.mlp.shared_experts.linear_fc1" +
                OUT, "decoder.layers.mixer.in_proj" + IN):
        with pytest.raises(ConvertError, match="not the adapter of an attention"):
            stored_types([key], tmp_path)
    assert module_type("decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight") is None
    assert module_type("decoder.layers.1.self_attention.linear_q_proj.weight") is None  # MLA
    expert = Piece("decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight", Box((0, 0), (4, 4)),
                   Box((0, 0), (4, 4)))
    with pytest.raises(ConvertError, match="not supported"):
        check_base_pieces("model.layers.1.mlp.experts.0.gate_proj", [expert])
