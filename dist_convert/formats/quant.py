"""Quantized Hugging Face weights behind one protocol.

A scheme (``fp8.py``: DeepSeek's block-scaled FP8 and compressed-tensors' FP8; ``mxfp4.py``: gpt-oss's MXFP4;
``int4.py``: compressed-tensors' INT4; ``nvfp4.py``: ModelOpt's NVFP4) says, for the hf reader,
whether one HF tensor is stored its way and by which stored parts (``datamodel.Quantized``), which box of each part
a rank reads for a box of the tensor, and how those slices dequantize; for ``--quantize``, which tensors it stores
quantized (and which share a per-tensor scale), what the file holds for them, how many bytes that is, and the
``quantization_config`` of config.json (and any file beside it).
``formats/hf.py`` asks the schemes (``formats/schemes.py``) and holds no branch of its own.
"""
from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from ..datamodel import Quantized
from ..errors import ConvertError
from ..layout.boxes import Box
from ..nonfinite import nonfinite_counts

Found = Mapping[str, tuple[str, torch.dtype, tuple[int, ...]]]  # stored name -> (file, dtype, shape)


class Scheme(ABC):
    """A scheme the hf reader decodes (``Writer``: one ``--quantize`` writes too)."""

    name: ClassVar[str]  # its name (``--quantize``'s, for a writer)
    what: ClassVar[str]  # its name in a note
    companion_note: ClassVar[str] = ""  # what its ``companions`` are, said in a note when a release has them

    # -- reading ------------------------------------------------------------------------------------------
    @abstractmethod
    def stored(self, key: str, shape: tuple[int, ...], hf: dict[str, Any],
               found: Found) -> tuple[Quantized, tuple[int, ...]] | None:
        """When HF tensor ``key`` (of ``shape``, as config.json implies it) is stored this way in ``found``: its parts
        and the shape it dequantizes to; None when it is not; refused in one line when its parts are incomplete or
        disagree."""

    def companions(self, key: str) -> tuple[str, ...]:
        """Stored names beside ``key``'s parts that belong to it and are not read (e.g. a stored shape)."""
        return ()

    @abstractmethod
    def boxes(self, q: Quantized, box: Box) -> tuple[Box, ...]:
        """The box of each part a rank reads for ``box`` of the dequantized tensor."""

    @abstractmethod
    def dequantize(self, q: Quantized, parts: list[torch.Tensor], box: Box, dtype: torch.dtype) -> torch.Tensor:
        """``box`` of the tensor in ``dtype`` from the ``boxes`` slices of its parts."""


class Writer(Scheme):
    """A scheme ``--quantize`` also writes."""

    config: ClassVar[dict[str, Any]] = {}  # config.json's ``quantization_config`` (``quantization_config``'s default)

    @abstractmethod
    def quantizable(self, name: str, shape: tuple[int, ...]) -> bool:
        """Whether ``--quantize`` stores HF tensor ``name`` this way (the rest stays as it is)."""

    @abstractmethod
    def quantize(self, name: str, x: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """What the file holds for tensor ``name`` (a quantizable one)."""

    def shares(self, name: str) -> str:
        """The tensors that share a per-tensor scale have one key (their own name when none does); the hf writer
        keeps them in one file and hands them to ``quantize_together`` at once."""
        return name

    def quantize_together(self, items: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """What the file holds for quantizable tensors of one ``shares`` key."""
        return [kv for name, x in items for kv in self.quantize(name, x)]

    @abstractmethod
    def stored_sizes(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> list[tuple[str, int]]:
        """(stored name, bytes) of what ``quantize`` writes for a tensor of ``shape`` in ``dtype``."""

    def quantization_config(self, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
        """config.json's ``quantization_config`` for a checkpoint of these tensors written with ``--quantize``."""
        return copy.deepcopy(self.config)

    def side_files(self, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, str]:
        """Files the scheme's loaders read beside config.json (name -> text) for such a checkpoint."""
        return {}

    def check_target(self, shapes: Mapping[str, tuple[int, ...]], architecture: str) -> None:
        """Refuse (ConvertError) a target where the scheme would store nothing."""
        if not any(self.quantizable(n, s) for n, s in shapes.items()):
            raise ConvertError(f"--quantize {self.name} stores none of this {architecture}'s tensors",
                               f"drop --quantize {self.name} for this model")


DAMAGED_FIX = "the release is damaged or was not quantized correctly: re-download it, or convert its bf16 release"


def check_scale(q: Quantized, part: int, bad: torch.Tensor, why: str) -> None:
    """Refuse (one line naming the stored tensor and its file) a scale slice where ``bad`` (a mask over it) holds:
    a non-finite scale, or a zero one where the format forbids it, would make every value it scales NaN or 0."""
    if bool(bad.any()):
        f, key = q.parts[part]
        raise ConvertError(f"quantization scale {key} in {f} is {why} ({int(bad.sum())} of {bad.numel()} values "
                           "read)", DAMAGED_FIX)


def finite_scale(q: Quantized, part: int, scale: torch.Tensor, *, nonzero: bool = False) -> None:
    """``check_scale`` for a floating-point scale: NaN / Inf refused, and 0 too when ``nonzero``."""
    s = scale.to(torch.float32)
    check_scale(q, part, ~torch.isfinite(s), "NaN or infinite")
    if nonzero:
        check_scale(q, part, s == 0, "zero (the format's per-tensor scale is never 0)")


def refuse_nonfinite(scheme: str, name: str, x: torch.Tensor) -> None:
    """``--quantize``: a tensor with NaN or infinite values has no quantized form (its block's or row's scale would
    become NaN and take every value it scales with it): refused in one line naming it."""
    nan, inf = nonfinite_counts(x)
    if nan or inf:
        raise ConvertError(f"--quantize {scheme}: {name} holds {nan} NaN and {inf} infinite values, which have no "
                           f"quantized form", "repair the source's weights (verify SRC SRC counts them per tensor), "
                           "or drop --quantize")
