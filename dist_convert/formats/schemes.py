"""The quantization schemes of Hugging Face releases (``formats/quant.py``) by name: the hf reader tries each in
this order; ``WRITERS``: those ``--quantize`` writes."""
from __future__ import annotations

from ..datamodel import Quantized
from . import fp8, int4, mxfp4, nvfp4
from .quant import Scheme, Writer

SCHEMES: dict[str, Scheme] = {s.name: s for s in (fp8.SCHEME, mxfp4.SCHEME, int4.SCHEME, fp8.FLOAT_QUANTIZED,
                                                  nvfp4.SCHEME)}

WRITERS: dict[str, Writer] = {n: s for n, s in SCHEMES.items() if isinstance(s, Writer)}


def scheme_of(q: Quantized) -> Scheme:
    return SCHEMES[q.scheme]
