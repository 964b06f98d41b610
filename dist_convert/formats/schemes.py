"""The quantization schemes of Hugging Face releases (``formats/quant.py``), by their ``--quantize`` name: the hf
reader tries each in this order."""
from __future__ import annotations

from ..datamodel import Quantized
from . import fp8, int4, mxfp4, nvfp4
from .quant import Scheme

SCHEMES: dict[str, Scheme] = {s.name: s for s in (fp8.SCHEME, mxfp4.SCHEME, int4.SCHEME, fp8.FLOAT_QUANTIZED,
                                                  nvfp4.SCHEME)}


def scheme_of(q: Quantized) -> Scheme:
    return SCHEMES[q.scheme]
