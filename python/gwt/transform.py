"""Wavelet transforms: gwt's C++ implementation of PyWavelets' ``wavedec``/``waverec`` on tensors.

Every function follows PyWavelets exactly (filters, boundary modes, coefficient order and
lengths), runs on cpu and cuda tensors of every floating-point dtype (float64 and float32
compute in their own precision; float16 and bfloat16 compute in float32 and return their own
dtype), and treats every dimension but ``dim`` as a batch dimension. ATen computes them, so autograd
flows through them. Tensor subclasses with their own dispatch (DTensor, ...) are refused with a
TypeError, tensors on other devices (meta included) with a ValueError, naming the argument.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import torch

from . import _C
from ._checks import TRANSFORM_HINT, check_plain

__all__ = [
    "wavelets",
    "modes",
    "wavelet_filters",
    "dwt_max_level",
    "dwt",
    "idwt",
    "wavedec",
    "waverec",
    "wavedec2",
    "waverec2",
    "threshold",
]


def _checked(function: str, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor):  # anything else is the binding's TypeError
            check_plain(t, f"gwt.{function}: {name}", TRANSFORM_HINT)


def _checked_coeffs(function: str, coeffs: Sequence) -> None:
    for k, c in enumerate(coeffs):
        if isinstance(c, (list, tuple)):
            _checked(function, **{f"coeffs[{k}][{m}]": d for m, d in enumerate(c)})
        else:
            _checked(function, **{f"coeffs[{k}]": c})


def wavelets() -> List[str]:
    """Every wavelet name gwt knows: haar, db1-db8, sym2-sym8, coif1-coif3 (PyWavelets' filters)."""
    return list(_C.wavelets())


def modes() -> List[str]:
    """Every boundary mode gwt knows (PyWavelets' names): zero, periodization, symmetric."""
    return list(_C.modes())


def wavelet_filters(name: str) -> Tuple[List[float], List[float], List[float], List[float]]:
    """``(dec_lo, dec_hi, rec_lo, rec_hi)`` of a wavelet, bit-identical to ``pywt.Wavelet(name)``."""
    return tuple(list(f) for f in _C.wavelet_filters(name))


def dwt_max_level(n: int, wavelet: str) -> int:
    """PyWavelets' ``dwt_max_level``: the deepest useful level for ``n`` samples."""
    filter_len = len(wavelet_filters(wavelet)[0])
    if n < filter_len - 1:
        return 0
    return int(math.floor(math.log2(n / (filter_len - 1))))


def dwt(x: torch.Tensor, wavelet: str = "haar", dim: int = -1, mode: str = "zero"):
    """One level: ``pywt.dwt(x, wavelet, mode, axis=dim)``; returns ``(approx, detail)``."""
    _checked("dwt", x=x)
    return tuple(_C.dwt(x, wavelet, dim, mode))


def idwt(approx: torch.Tensor, detail: torch.Tensor, wavelet: str = "haar", dim: int = -1,
         mode: str = "zero") -> torch.Tensor:
    """One inverse level: ``pywt.idwt(approx, detail, wavelet, mode, axis=dim)``."""
    _checked("idwt", approx=approx, detail=detail)
    return _C.idwt(approx, detail, wavelet, dim, mode)


def wavedec(x: torch.Tensor, wavelet: str = "haar", level: Optional[int] = None, dim: int = -1,
            mode: str = "zero") -> List[torch.Tensor]:
    """``pywt.wavedec(x, wavelet, mode, level, axis=dim)``: ``[cA_L, cD_L, ..., cD_1]``.

    ``level=None`` decomposes to :func:`dwt_max_level` as PyWavelets does. Note the argument order
    (and the default mode, ``"zero"``, the optimizer's) differ from PyWavelets'.
    """
    _checked("wavedec", x=x)
    if level is None:
        level = dwt_max_level(x.shape[dim], wavelet)
    return list(_C.wavedec(x, wavelet, level, dim, mode))


def waverec(coeffs: Sequence[torch.Tensor], wavelet: str = "haar", dim: int = -1,
            mode: str = "zero", length: Optional[int] = None) -> torch.Tensor:
    """``pywt.waverec(coeffs, wavelet, mode, axis=dim)``, cropped to ``length`` when given."""
    coeffs = list(coeffs)
    _checked_coeffs("waverec", coeffs)
    return _C.waverec(coeffs, wavelet, dim, mode, length)


def wavedec2(x: torch.Tensor, wavelet: str = "haar", level: int = 1, mode: str = "zero"):
    """``pywt.wavedec2(x, wavelet, mode, level)`` over the last two dimensions:
    ``[cA_L, (cH_L, cV_L, cD_L), ..., (cH_1, cV_1, cD_1)]``."""
    _checked("wavedec2", x=x)
    approx, details = _C.wavedec2(x, wavelet, level, mode)
    return [approx] + [tuple(d) for d in details]


def waverec2(coeffs, wavelet: str = "haar", mode: str = "zero") -> torch.Tensor:
    """``pywt.waverec2(coeffs, wavelet, mode)``."""
    if len(coeffs) == 0:
        raise ValueError("gwt: waverec2 needs at least the approximation")
    _checked_coeffs("waverec2", coeffs)
    details = []
    for level in coeffs[1:]:
        if len(level) != 3:
            raise ValueError("gwt: waverec2 needs three detail subbands (cH, cV, cD) per level")
        details.append(list(level))
    return _C.waverec2(coeffs[0], details, wavelet, mode)


def threshold(x: torch.Tensor, value: float, mode: str = "soft") -> torch.Tensor:
    """``pywt.threshold(x, value, mode)`` for ``"soft"`` or ``"hard"`` (soft keeps a 0 at value 0,
    where PyWavelets computes NaN)."""
    _checked("threshold", x=x)
    return _C.threshold(x, float(value), mode)
