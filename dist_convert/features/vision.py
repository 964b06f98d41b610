"""The vision component of a vision-language model: a vision tower and its projectors beside the language model.

A multimodal model is a language model (any family's, every other record of ``ModelConfig``) plus this component,
with its own tensors under its own prefix (``layout/vision.py``: Megatron-Bridge's ``vision_model.`` beside its
``language_model.``). Each tower is a record type of its own (``TOWERS``), holding what that tower computes; the
``Vision`` base holds what every tower has: its sizes, activation, norm epsilon, and the token ids that mark images
in the text. A tower's own type says which it is (``tower``, written as the ``vision_tower`` arg and fixed by the
type, never set): code that differs per tower dispatches on the type (its own ``check_layout``, its table in
``layout/vision.py``), never on that name.

Megatron-LM has no arguments for these towers (Megatron-Bridge builds them from Hugging Face's vision config): the
record writes its own ``vision_*`` args, which only dist_convert reads, so a torch_dist target carries the whole
model; megatron-core's ``TransformerConfig`` has none of them (``config=()``). ``Vision.from_args`` builds the
record of the tower ``vision_tower`` names; a field absent from the args (a checkpoint written before it existed)
takes its default.
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from ..errors import ConvertError
from .base import SIZE, Feature, get, layout_flag, setting

if TYPE_CHECKING:
    from ..config import ModelConfig
    from ..layout.topology import Layout


def _size(what: str, default: int = 0) -> Any:
    return setting(default, kind=SIZE, arg=f"vision_{what.split()[0]}", config=(), what=f"the vision tower's {what}")


def _tower(name: str) -> Any:
    """The ``tower`` field of a tower's type: its name, fixed by the type (not an argument), written as
    ``vision_tower``."""
    declared = setting(name, arg="vision_tower", config=(), what="the vision tower's architecture")
    return dataclasses.field(default=name, init=False, metadata=declared.metadata)


@dataclass(frozen=True, kw_only=True)
class Vision(Feature):
    """What every tower has; a model's record is one of ``TOWERS``."""

    attr: ClassVar[str] = "vision"
    te2_spec: ClassVar[bool] = True
    what: ClassVar[str] = "a vision tower (vision-language model)"

    tower: str = _tower("")
    depth: int = _size("depth (layers)")
    hidden: int = _size("hidden size")
    heads: int = _size("heads (attention heads)")
    ffn: int = _size("ffn (MLP size)")
    out_hidden: int = setting(0, kind=SIZE, arg="vision_out_hidden", config=(),
                              what="the projector's output size (the language model's hidden size)")
    patch: int = _size("patch (patch size)", 16)
    in_channels: int = setting(3, kind=SIZE, arg="vision_in_channels", config=(), what="image channels")
    activation: str = setting("gelu_tanh", arg="vision_activation", config=(), what="the vision MLP's activation")
    eps: float = setting(1e-6, arg="vision_eps", config=(), what="the vision tower's norm epsilon")
    image_token_id: int | None = setting(None, arg="image_token_id", config=(), what="the image token id")
    vision_start_token_id: int | None = setting(None, arg="vision_start_token_id", config=(),
                                                what="the vision start token id")
    vision_end_token_id: int | None = setting(None, arg="vision_end_token_id", config=(),
                                              what="the vision end token id")

    def __post_init__(self) -> None:
        if type(self) not in TOWERS.values():
            raise TypeError(f"{type(self).__name__} is not a vision tower: build one of "
                            f"{', '.join(c.__name__ for c in TOWERS.values())}")
        super().__post_init__()

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @classmethod
    def variants(cls) -> tuple[type[Feature], ...]:
        """The record types a model's vision record is one of: each tower's."""
        return tuple(TOWERS.values())

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Vision | None:
        """The record of the tower ``vision_tower`` names (None without one), each of its fields from its args."""
        name = get(vars(args), "vision_tower")
        if name is None:
            return None
        kind = TOWERS.get(name)
        if kind is None or not issubclass(kind, cls):
            raise ConvertError(f"checkpoint args vision_tower={name!r} is not a vision tower dist_convert knows "
                               f"({', '.join(TOWERS)})", "convert a checkpoint dist_convert or Megatron-Bridge wrote")
        values = kind.args_values(args)
        values.pop("tower")  # the type's own
        return kind(**values)

    def check_layout(self, cfg: ModelConfig, layout: Layout, what: str) -> None:
        """Megatron-Bridge builds vision-language models with Transformer Engine's spec."""
        if cfg.spec != "te":
            raise ConvertError(f"{what}: Megatron-Bridge builds vision-language models with Transformer Engine's "
                               f"layer spec only, not {cfg.spec}", "drop --target-spec local")


@dataclass(frozen=True, kw_only=True)
class QwenTower(Vision):
    """What the two Qwen towers share: video patches over time, and square groups of patches merged into one
    token."""

    temporal_patch: int = setting(2, kind=SIZE, arg="vision_temporal_patch", config=(),
                                  what="the vision tower's temporal patch size")
    merge: int = setting(2, kind=SIZE, arg="vision_merge", config=(),
                         what="the spatial merge size (patches merged per side into one token)")
    video_token_id: int | None = setting(None, arg="video_token_id", config=(), what="the video token id")

    @property
    def merged(self) -> int:
        """The width of a merged token: ``merge**2`` patches side by side."""
        return self.hidden * self.merge * self.merge


@dataclass(frozen=True, kw_only=True)
class Qwen3VLTower(QwenTower):
    """Megatron-Bridge's Megatron-native Qwen3-VL tower (``Qwen3VLVisionModel``, split over TP): learned position
    embeddings, and deepstack mergers feeding the first language layers."""

    tower: str = _tower("qwen3_vl")
    positions: int = setting(0, kind=SIZE, arg="vision_positions", config=(),
                             what="the vision tower's learned position embeddings")
    deepstack: tuple[int, ...] = setting((), arg="vision_deepstack", config=(),
                                         what="the tower layers whose merged features feed the first language layers "
                                              "(deepstack)")

    def check_layout(self, cfg: ModelConfig, layout: Layout, what: str) -> None:
        """The spec (``Vision``), then: the tower splits over TP by whole heads; the deepstack features feed the first
        language layers, on the first pipeline stage with the tower (Qwen3VLModel asserts it)."""
        super().check_layout(cfg, layout, what)
        for name, n in (("heads", self.heads), ("MLP size", self.ffn)):
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


@dataclass(frozen=True, kw_only=True)
class Qwen25VLTower(QwenTower):
    """transformers' Qwen2.5-VL vision transformer, which Megatron-Bridge keeps whole and replicated: windowed
    attention but on some full-attention layers, and video frames' temporal positions."""

    tower: str = _tower("qwen2_5_vl")
    window: int | None = setting(None, arg="vision_window", config=(),
                                 what="the window of the tower's windowed attention (Qwen2.5-VL; pixels)")
    full_layers: tuple[int, ...] = setting((), arg="vision_full_layers", config=(),
                                           what="the tower layers with full attention among windowed ones")
    tokens_per_second: int | None = setting(None, arg="vision_tokens_per_second", config=(),
                                            what="video frames' temporal MRoPE positions per second")
    vision_token_id: int | None = setting(None, arg="vision_token_id", config=(), what="the vision token id")


@dataclass(frozen=True, kw_only=True)
class SiglipTower(Vision):
    """Gemma 3's SigLIP encoder (kept whole and replicated by Megatron-Bridge) and its multimodal projector, which
    pools the patches of a fixed image side into ``mm_tokens`` tokens."""

    tower: str = _tower("siglip")
    image_size: int = setting(0, kind=SIZE, arg="vision_image_size", config=(),
                              what="the image side the tower takes (SigLIP, GLM-4V; 0: any)")
    head: bool = setting(False, kind=SIZE, arg="vision_head", config=(),
                         what="SigLIP's attention-pooling head (stored, unused by the language model)")
    mm_tokens: int | None = setting(None, arg="mm_tokens_per_image", config=(),
                                    what="image tokens per image after the projector's pooling (Gemma 3)")

    @property
    def positions(self) -> int:
        """The learned position embeddings: one per patch of the image."""
        return (self.image_size // self.patch) ** 2


@dataclass(frozen=True, kw_only=True)
class Glm4vTower(QwenTower):
    """transformers' GLM-4V vision transformer (GLM-4.5V's; Megatron-Bridge keeps it whole and replicated): RMSNorms,
    a SiLU-gated block MLP as wide as the output, learned positions over a fixed image side (interpolated), a
    convolution merging the patches, and a gated merger of width ``ffn``."""

    tower: str = _tower("glm4v")
    image_size: int = setting(0, kind=SIZE, arg="vision_image_size", config=(),
                              what="the image side the tower takes (SigLIP, GLM-4V; 0: any)")
    qkv_bias: bool = setting(False, kind=SIZE, arg="vision_qkv_bias", config=(),
                             what="q/k/v biases in the vision tower's attention (GLM-4V)")
    image_start_token_id: int | None = setting(None, arg="image_start_token_id", config=(),
                                               what="the image start token id")
    image_end_token_id: int | None = setting(None, arg="image_end_token_id", config=(),
                                             what="the image end token id")
    video_start_token_id: int | None = setting(None, arg="video_start_token_id", config=(),
                                               what="the video start token id")
    video_end_token_id: int | None = setting(None, arg="video_end_token_id", config=(),
                                             what="the video end token id")

    @property
    def positions(self) -> int:
        """The learned position embeddings: one per patch of the fixed image side."""
        return (self.image_size // self.patch) ** 2


@dataclass(frozen=True, kw_only=True)
class PixtralTower(Vision):
    """transformers' Pixtral vision encoder (Mistral 3's; Megatron-Bridge keeps it whole and replicated, with its
    multimodal projector): RMSNorms, separate unbiased q/k/v/o, a gated MLP, 2-D RoPE over the patch grid, and the
    projector merging ``merge x merge`` patches into one token before its two linears."""

    tower: str = _tower("pixtral")
    image_size: int = setting(0, kind=SIZE, arg="vision_image_size", config=(),
                              what="the image side the tower takes (SigLIP, GLM-4V; 0: any)")
    head_size: int = setting(0, kind=SIZE, arg="vision_head_size", config=(), what="the vision tower's head size")
    rope_base: float = setting(10000.0, arg="vision_rope_base", config=(), what="the vision tower's 2-D RoPE base")
    merge: int = setting(2, kind=SIZE, arg="vision_merge", config=(),
                         what="the spatial merge size (patches merged per side into one token)")
    projector_activation: str = setting("gelu", arg="vision_projector_activation", config=(),
                                        what="the multimodal projector's activation")
    projector_bias: bool = setting(False, kind=SIZE, arg="vision_projector_bias", config=(),
                                   what="biases on the multimodal projector's linears")


@dataclass(frozen=True, kw_only=True)
class MoonViTTower(Vision):
    """Kimi-K2.5's MoonViT (Megatron-Bridge keeps it whole and replicated, with its patch-merger projector, under
    the release's own names): LayerNorms, a fused biased q/k/v with 2-D axial RoPE over the patch grid, a GELU MLP,
    learned positions on a ``pos_height x pos_width`` grid (bicubically resampled to each image) plus a sinusoid over
    ``pos_time`` frames, then ``merge x merge`` patches pooled side by side into one token for the projector (a
    LayerNorm, a linear, exact GELU, a linear to the language model's width)."""

    tower: str = _tower("moonvit")
    pos_height: int = setting(64, kind=SIZE, arg="vision_pos_height", config=(),
                              what="rows of the vision tower's learned position grid (MoonViT)")
    pos_width: int = setting(64, kind=SIZE, arg="vision_pos_width", config=(),
                             what="columns of the vision tower's learned position grid (MoonViT)")
    pos_time: int = setting(4, kind=SIZE, arg="vision_pos_time", config=(),
                            what="frames of the vision tower's temporal sinusoid (MoonViT)")
    merge: int = setting(2, kind=SIZE, arg="vision_merge", config=(),
                         what="the spatial merge size (patches merged per side into one token)")
    rope_base: float = setting(10000.0, arg="vision_rope_base", config=(), what="the vision tower's 2-D RoPE base")
    projector_eps: float = setting(1e-5, arg="vision_projector_eps", config=(),
                                   what="the multimodal projector's LayerNorm epsilon (Kimi-K2.5)")
    video_token_id: int | None = setting(None, arg="video_token_id", config=(), what="the video token id")

    @property
    def merged(self) -> int:
        """The width of a merged token: ``merge**2`` patches side by side."""
        return self.hidden * self.merge * self.merge

    def check_layout(self, cfg: ModelConfig, layout: Layout, what: str) -> None:
        """Any spec: the tower and projector are Hugging Face modules whatever the language model's spec, and
        megatron-core's local GPTModel holds the language model (Megatron-Bridge builds Transformer Engine's, the
        default)."""


# each tower's record type by its name (the ``vision_tower`` arg)
TOWERS: dict[str, type[Vision]] = {c.tower: c for c in (Qwen3VLTower, Qwen25VLTower, SiglipTower, Glm4vTower,
                                                        PixtralTower, MoonViTTower)}
