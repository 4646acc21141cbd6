"""gwt.nn: delta adapters (gwt::nn::DeltaLinear) as a torch.nn.Module."""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import nn

from . import _C

__all__ = ["DeltaLinear"]

_ADAPTER = ("U", "V", "reflections", "core")


class DeltaLinear(nn.Module):
    r"""A frozen linear layer adapted by Householder reflections on its input side (HRA) and a
    low-rank delta with an optional orthogonal core (LoRA when the core is the identity): gwt's C++
    ``gwt::nn::DeltaLinear``,

    .. math:: y = x (W H_1 \cdots H_r)^T + \frac{\alpha}{k} x (U Q V^T)^T + b

    with :math:`H_i = I - 2 u_i u_i^T / (u_i^T u_i)` (:math:`u_i` = column i of ``reflections``
    ``[in, r]``), :math:`Q` the product of the reflections in the columns of ``core`` ``[k, k]``
    (or :math:`I`), ``U`` ``[out, k]`` (zero at the start: the layer starts equal to its base),
    ``V`` ``[in, k]``. The base's ``weight`` and ``bias`` are shared with ``base`` (not copied) and
    frozen unless ``train_base``.

    The forward, merge() and the rest run in C++ on this module's own parameters, so optimizers,
    ``state_dict()`` and ``.to()`` work on them as on any module's.
    """

    def __init__(self, base: nn.Linear, rank: int = 0, reflections: int = 0,
                 orthogonal_core: bool = False, alpha: float = 0.0, gram_schmidt: bool = False,
                 train_base: bool = False) -> None:
        super().__init__()
        if not isinstance(base, nn.Linear):
            raise TypeError(f"gwt.nn.DeltaLinear adapts a torch.nn.Linear, got {type(base).__name__}")
        self.in_features, self.out_features = base.in_features, base.out_features
        self._impl = _C._DeltaLinear(base.weight, base.bias, int(rank), int(reflections),
                                     bool(orthogonal_core), float(alpha), bool(gram_schmidt),
                                     bool(train_base))
        self.weight = base.weight
        self.bias = base.bias
        self._adopt()

    def _adopt(self) -> None:
        """Registers the C++ module's adapter tensors that this module does not hold yet."""
        _, _, *adapter = self._impl.tensors()
        for name, tensor in zip(_ADAPTER, adapter):
            if tensor is None:
                if name not in self._parameters:
                    self.register_parameter(name, None)
            elif getattr(self, name, None) is None:
                self.register_parameter(name, nn.Parameter(tensor))

    def _push(self) -> None:
        """Hands this module's parameters to the C++ module (whose members they then are)."""
        self._impl.set(self.weight, self.bias, self.U, self.V, self.reflections, self.core)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._push()
        return self._impl.forward(x)

    def merge(self) -> nn.Linear:
        """A plain torch.nn.Linear with ``W H_1 ... H_r + (alpha / k0) U Q V^T`` as its weight (in
        the base's dtype) and the base's bias: the same output to rounding."""
        self._push()
        weight, bias = self._impl.merge()
        merged = nn.Linear(self.in_features, self.out_features, bias=bias is not None,
                           device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            merged.weight.copy_(weight)
            if bias is not None:
                merged.bias.copy_(bias)
        return merged

    def delta_weight(self) -> torch.Tensor:
        """The dense ``[out, in]`` change merge() adds to ``W H`` (zeros without a delta)."""
        self._push()
        return self._impl.delta_weight()

    def orthogonality_error(self) -> Tuple[float, float]:
        """``||P^T P - I||_F`` of the reflection product and of the core (0 when absent)."""
        self._push()
        return tuple(self._impl.orthogonality_error())

    def orthogonality_penalty(self, lambda_: float) -> torch.Tensor:
        """HRA's regulariser ``lambda * ||I - N^T N||_F^2`` (N: the unit reflection vectors), to
        add to the loss."""
        self._push()
        return self._impl.orthogonality_penalty(float(lambda_))

    def resize_rank(self, k: int) -> float:
        """Changes the delta's rank to ``k``; returns the relative reconstruction error (0 when
        growing). The parameters keep their identity (resized in place), so an optimizer still
        holds them, but its state for them no longer fits: rebuild or reset it."""
        self._push()
        error = self._impl.resize_rank(int(k))
        self._adopt()
        return error

    @property
    def rank(self) -> int:
        return self._impl.rank()

    @property
    def scaling(self) -> float:
        """alpha / k0, fixed at construction."""
        return self._impl.scaling()

    def extra_repr(self) -> str:
        r = 0 if self.reflections is None else self.reflections.shape[1]
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"rank={self.rank}, reflections={r}, orthogonal_core={self.core is not None}")
