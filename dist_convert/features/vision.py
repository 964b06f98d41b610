"""The vision component of a vision-language model: a vision tower and its projectors beside the language model.

A multimodal model is a language model (any family's, every other record of ``ModelConfig``) plus this component,
with its own tensors under its own prefix (``layout/vision.py``: Megatron-Bridge's ``vision_model.`` beside its
``language_model.``). The record holds what the tower computes: its architecture, sizes, activation, norm epsilon,
the language-model layers its deepstack features feed, and the token ids that mark images in the text.

Megatron-LM has no arguments for these towers (Megatron-Bridge builds them from Hugging Face's vision config): the
record writes its own ``vision_*`` args, which only dist_convert reads, so a torch_dist target carries the whole
model; megatron-core's ``TransformerConfig`` has none of them (``config=()``).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from ..errors import ConvertError
from .base import SIZE, Feature, get, layout_flag, setting

if TYPE_CHECKING:
    from ..config import ModelConfig
    from ..layout.topology import Layout

# qwen3_vl: Megatron-Bridge's Megatron-native Qwen3-VL tower (Qwen3VLVisionModel, split over TP); qwen2_5_vl and
# siglip: the Hugging Face modules Bridge keeps replicated (Qwen2.5-VL's windowed ViT; Gemma 3's SigLIP encoder and
# its multimodal projector)
TOWERS = ("qwen3_vl", "qwen2_5_vl", "siglip")


def _size(what: str, default: int = 0) -> Any:
    return setting(default, kind=SIZE, arg=f"vision_{what.split()[0]}", config=(), what=f"the vision tower's {what}")


@dataclass(frozen=True, kw_only=True)
class Vision(Feature):
    attr: ClassVar[str] = "vision"
    what: ClassVar[str] = "a vision tower (vision-language model)"

    tower: str = setting("qwen3_vl", arg="vision_tower", config=(), what="the vision tower's architecture")
    depth: int = _size("depth (layers)")
    hidden: int = _size("hidden size")
    heads: int = _size("heads (attention heads)")
    ffn: int = _size("ffn (MLP size)")
    out_hidden: int = setting(0, kind=SIZE, arg="vision_out_hidden", config=(),
                              what="the projector's output size (the language model's hidden size)")
    patch: int = _size("patch (patch size)", 16)
    temporal_patch: int = setting(2, kind=SIZE, arg="vision_temporal_patch", config=(),
                                  what="the vision tower's temporal patch size")
    in_channels: int = setting(3, kind=SIZE, arg="vision_in_channels", config=(), what="image channels")
    merge: int = setting(2, kind=SIZE, arg="vision_merge", config=(),
                         what="the spatial merge size (patches merged per side into one token)")
    positions: int = setting(0, kind=SIZE, arg="vision_positions", config=(),
                             what="the vision tower's learned position embeddings")
    image_size: int = setting(0, kind=SIZE, arg="vision_image_size", config=(),
                              what="the image side the tower takes (SigLIP; 0: any)")
    deepstack: tuple[int, ...] = setting((), arg="vision_deepstack", config=(),
                                         what="the tower layers whose merged features feed the first language layers "
                                              "(deepstack)")
    activation: str = setting("gelu_tanh", arg="vision_activation", config=(), what="the vision MLP's activation")
    eps: float = setting(1e-6, arg="vision_eps", config=(), what="the vision tower's norm epsilon")
    window: int | None = setting(None, arg="vision_window", config=(),
                                 what="the window of the tower's windowed attention (Qwen2.5-VL; pixels)")
    full_layers: tuple[int, ...] = setting((), arg="vision_full_layers", config=(),
                                           what="the tower layers with full attention among windowed ones")
    tokens_per_second: int | None = setting(None, arg="vision_tokens_per_second", config=(),
                                            what="video frames' temporal MRoPE positions per second")
    head: bool = setting(False, kind=SIZE, arg="vision_head", config=(),
                         what="SigLIP's attention-pooling head (stored, unused by the language model)")
    mm_tokens: int | None = setting(None, arg="mm_tokens_per_image", config=(),
                                    what="image tokens per image after the projector's pooling (Gemma 3)")
    image_token_id: int | None = setting(None, arg="image_token_id", config=(), what="the image token id")
    video_token_id: int | None = setting(None, arg="video_token_id", config=(), what="the video token id")
    vision_start_token_id: int | None = setting(None, arg="vision_start_token_id", config=(),
                                                what="the vision start token id")
    vision_end_token_id: int | None = setting(None, arg="vision_end_token_id", config=(),
                                              what="the vision end token id")
    vision_token_id: int | None = setting(None, arg="vision_token_id", config=(), what="the vision token id")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def merged(self) -> int:
        """The width of a merged token: ``merge**2`` patches side by side."""
        return self.hidden * self.merge * self.merge

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Vision | None:
        return super().from_args(args) if get(vars(args), "vision_tower") is not None else None

    def check_layout(self, cfg: ModelConfig, layout: Layout, what: str) -> None:
        """Megatron-Bridge builds vision-language models with Transformer Engine's spec; its Qwen3-VL adds the deepstack
        features to the first language layers, on the first pipeline stage with the tower (Qwen3VLModel asserts it);
        that tower splits over TP by whole heads."""
        if cfg.spec != "te":
            raise ConvertError(f"{what}: Megatron-Bridge builds vision-language models with Transformer Engine's "
                               f"layer spec only, not {cfg.spec}", "drop --target-spec local")
        for name, n in (("heads", self.heads), ("MLP size", self.ffn)) if self.tower == "qwen3_vl" else ():
            if n % layout.tp:
                raise ConvertError(f"{what} TP={layout.tp} does not divide the vision tower's {name} {n}",
                                   f"choose {layout_flag(what)} among the divisors of {n}")
        first = next(n for p, v, _, n in layout.model_chunks(cfg.num_layers) if (p, v) == (0, 0))
        need = len(self.deepstack)
        if first < need:
            raise ConvertError(f"{what} {layout} puts {first} language layers on the first pipeline stage, and the "
                               f"vision tower's {need} deepstack features feed language layers 0-{need - 1} there",
                               f"put at least {need} layers on the first stage "
                               "(--target-num-layers-in-first-stage) or lower --target-pp")
