"""The MLP (gated or not, its activation and GLU variants) and Mixture of Experts (experts, shared experts, which
layers, and the router's maths)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from .base import LAYOUT, MODEL, NUMERICS, SIZE, Feature, MegatronArg, as_tuple, get, setting

if TYPE_CHECKING:
    from ..config import ModelConfig
    from ..layout.topology import Layout


@dataclass(frozen=True, kw_only=True)
class MLP(Feature):
    attr: ClassVar[str] = "mlp"
    essential: ClassVar[tuple[str, ...] | None] = ("gated",)

    gated: bool = setting(True, arg=("swiglu", "quick_geglu"), config="gated_linear_unit",
                          what="gated MLP (GLU: act(gate) * up)", mlm=MegatronArg("LB", MODEL, False))
    activation: str = setting("silu", arg=("glu_activation", "squared_relu", "openai_gelu"),
                              config="activation_func",
                              what="the MLP activation: silu, gelu, gelu_tanh, quick_gelu or squared_relu",
                              mlm=(None, MegatronArg("LB", "", False)))
    glu_linear_offset: float = setting(0.0, arg="glu_linear_offset", what="the offset added to the GLU's up part")
    clamp: float | None = setting(None, arg="activation_func_clamp_value", what="the clamp of the GLU's inputs")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> MLP:
        a = vars(args)
        if get(a, "quick_geglu", default=False):
            gated, act = True, "quick_gelu"
        elif get(a, "swiglu", default=False):
            gated, act = True, str(get(a, "glu_activation", default="silu"))
        elif get(a, "squared_relu", default=False):
            gated, act = False, "squared_relu"
        else:
            gated, act = False, "gelu_tanh" if get(a, "openai_gelu", default=False) else "gelu"
        clamp = get(a, "activation_func_clamp_value")
        return cls(gated=gated, activation=act, glu_linear_offset=float(get(a, "glu_linear_offset", default=0.0)),
                   clamp=None if clamp is None else float(clamp))

    def to_args(self) -> dict[str, Any]:
        # Megatron-LM's --swiglu and --quick-geglu are exclusive ways of saying "gated"; glu_activation is
        # dist_convert's own name for a GLU's other activations (GeGLU)
        return {"swiglu": self.gated and self.activation != "quick_gelu",
                "quick_geglu": self.gated and self.activation == "quick_gelu",
                "glu_activation": self.activation if self.gated and self.activation != "quick_gelu" else "silu",
                "squared_relu": not self.gated and self.activation == "squared_relu",
                "openai_gelu": not self.gated and self.activation == "gelu_tanh",
                "glu_linear_offset": self.glu_linear_offset, "activation_func_clamp_value": self.clamp}


@dataclass(frozen=True, kw_only=True)
class MoE(Feature):
    attr: ClassVar[str] = "moe"
    what: ClassVar[str] = "Mixture-of-Experts layers"

    # (the plain record, never a model's, holds as many experts as it routes each token to)
    num_experts: int = setting(2, kind=SIZE, arg="num_experts", config="num_moe_experts", what="routed experts",
                               low=1, mlm=MegatronArg("LB", MODEL, None))
    ffn: int = setting(0, kind=SIZE, arg="moe_ffn_hidden_size", what="each routed expert's FFN size",
                       mlm=MegatronArg("LB", MODEL, None))
    layer_pattern: tuple[int, ...] | None = setting(None, arg="moe_layer_freq",
                                                    what="dense layers between the MoE layers (1: MoE, 0: dense)",
                                                    mlm=MegatronArg("LB", MODEL, 1))
    shared_size: int | None = setting(None, arg="moe_shared_expert_intermediate_size",
                                      what="the shared experts' FFN size (None: none)", mlm=MegatronArg("LB", MODEL))
    shared_gate: bool = setting(False, arg="moe_shared_expert_gate", what="sigmoid gate on the shared experts",
                                mlm=MegatronArg("B", MODEL))
    expert_bias: bool = setting(False, arg="moe_router_enable_expert_bias",
                                what="router expert bias for the choice (DeepSeek's e_score_correction_bias)",
                                mlm=MegatronArg("LB", MODEL))
    topk: int = setting(2, kind=SIZE, arg="moe_router_topk", what="experts per token", low=1, high="num_experts",
                        mlm=MegatronArg("LB"))
    score_function: str = setting("softmax", arg="moe_router_score_function", what="router scores: softmax or sigmoid",
                                  mlm=MegatronArg("LB"))
    pre_softmax: bool = setting(False, arg="moe_router_pre_softmax",
                                what="softmax before top-k, a router that never renormalises the top-k",
                                mlm=MegatronArg("LB"))
    topk_scaling_factor: float | None = setting(None, arg="moe_router_topk_scaling_factor",
                                                what="the routed weights' scale", mlm=MegatronArg("LB"))
    num_groups: int | None = setting(None, arg="moe_router_num_groups", what="expert groups of group-limited routing",
                                     mlm=MegatronArg("LB"))
    group_topk: int | None = setting(None, arg="moe_router_group_topk", what="groups chosen per token", low=1,
                                     high="num_groups", mlm=MegatronArg("LB"))
    capacity_factor: float | None = setting(None, arg="moe_expert_capacity_factor",
                                            what="an expert capacity (tokens over it are dropped)")
    apply_probs_on_input: bool = setting(False, arg="moe_apply_probs_on_input",
                                         what="routing weights applied to the experts' input")
    topk_limited_devices: int | None = setting(None, arg="moe_router_topk_limited_devices",
                                               what="device-limited routing")
    force_load_balancing: bool = setting(False, arg="moe_router_force_load_balancing",
                                         what="random routing (benchmarking only)")
    force_biased: float | None = setting(None, arg="moe_router_force_biased",
                                         what="a random bias on the router logits")
    rank_capacity_factor: float | None = setting(None, arg="moe_expert_rank_capacity_factor",
                                                 what="a per-rank token budget (tokens over it are dropped)")
    router_dtype: str | None = setting(None, kind=NUMERICS, arg="moe_router_dtype",
                                       what="the dtype the router computes in", mlm=MegatronArg("LB"))
    grouped: bool = setting(False, kind=LAYOUT, arg=(),
                            what="legacy rank files name experts as TEGroupedMLP does (linear_fc1.weight{i})")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> MoE | None:
        a = vars(args)
        if not int(get(a, "num_experts", default=0) or 0):
            return None
        v = cls.args_values(args)
        # megatron-core treats a scaling factor of 1 as none, and group routing over one group (or none) as plain top-k
        groups = (v["num_groups"] or 0) > 1
        return cls(**{**v, "ffn": int(v["ffn"] or get(a, "ffn_hidden_size") or 4 * int(a["hidden_size"])),
                      "layer_pattern": moe_layer_pattern(get(a, "moe_layer_freq", default=1), int(a["num_layers"])),
                      "shared_size": v["shared_size"] or None,
                      # megatron-core reads it for softmax routing only (Megatron-Bridge's GLM-5 sets it with sigmoid)
                      "pre_softmax": v["pre_softmax"] and v["score_function"] == "softmax",
                      "topk_scaling_factor": None if v["topk_scaling_factor"] == 1.0 else v["topk_scaling_factor"],
                      "num_groups": v["num_groups"] if groups else None,
                      "group_topk": v["group_topk"] if groups else None})

    def to_args(self) -> dict[str, Any]:  # every layer MoE: Megatron-LM's frequency 1
        return {**super().to_args(), "moe_layer_freq": 1 if self.layer_pattern is None else list(self.layer_pattern)}

    def check_layout(self, cfg: ModelConfig, layout: Layout, what: str) -> None:
        """Experts spread evenly over EP, split over ETP by whole rows; linear biases only at ETP 1."""
        from ..errors import ConvertError

        layout.validate_experts(cfg.num_experts, cfg.expert_ffn, self.shared_size, what)
        if cfg.add_bias_linear and layout.expert_tp != 1:  # TransformerConfig.__post_init__ asserts it
            raise ConvertError(f"{what} ETP={layout.expert_tp}: megatron-core takes linear biases in MoE layers "
                               "(gpt-oss's experts and router) only with expert tensor parallelism 1",
                               "pass --target-etp 1")

    @staticmethod
    def absent_args() -> dict[str, Any]:
        """A dense model's args (Megatron-LM: no num_experts means no MoE, and no expert FFN size)."""
        return {"num_experts": None, "moe_ffn_hidden_size": None}

    def is_moe_layer(self, layer: int) -> bool:
        return self.layer_pattern is None or bool(self.layer_pattern[layer])


def moe_layer_pattern(freq: Any, num_layers: int) -> tuple[int, ...] | None:
    """megatron-core's ``moe_layer_freq``: an int k (every k-th layer, from layer 0, is MoE; 1: all) or a list of 0/1
    per layer (Megatron-LM also takes its string form, e.g. "([0]+[1]*3)"). None when every layer is MoE."""
    from ..errors import ConvertError

    if isinstance(freq, str):  # Megatron-LM's --moe-layer-freq "([0]*1+[1]*3)": a Python list expression
        freq = _list_expression(freq)
    if freq is None or freq == 1:
        return None
    if isinstance(freq, int):
        if freq < 1:
            raise ConvertError(f"moe_layer_freq={freq} is not a positive layer frequency",
                               "the checkpoint args are damaged; fix moe_layer_freq")
        pattern = tuple(1 if i % freq == 0 else 0 for i in range(num_layers))
    else:
        pattern = tuple(int(x) for x in freq)
        if len(pattern) != num_layers or set(pattern) - {0, 1}:
            raise ConvertError(f"moe_layer_freq={list(pattern)} is not one 0/1 per layer ({num_layers} layers)",
                               "the checkpoint args are damaged; fix moe_layer_freq")
    return None if all(pattern) else pattern


def _list_expression(text: str) -> Any:
    """Megatron-LM's list expressions (``([0]*3+[1]*5)``): lists of ints joined by + and repeated by *."""
    import ast

    def ev(node: ast.AST) -> Any:
        if isinstance(node, ast.List):
            return [ev(e) for e in node.elts]
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = ev(node.left), ev(node.right)
            return left + right if isinstance(node.op, ast.Add) else left * right
        raise ValueError(text)

    return as_tuple(ev(ast.parse(text.strip(), mode="eval").body))
