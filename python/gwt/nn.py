"""gwt.nn: delta adapters (gwt::nn::DeltaLinear) as a torch.nn.Module."""

from __future__ import annotations

import math
from typing import Tuple

import torch
from torch import nn

from . import _C

__all__ = ["DeltaLinear"]

_ADAPTER = ("U", "V", "reflections", "core")
_BASE_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _math_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the adapter's parameters for a base of ``dtype`` (detail::math_dtype)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class DeltaLinear(nn.Module):
    r"""A frozen linear layer adapted by Householder reflections on its input side (HRA) and a
    low-rank delta with an optional orthogonal core (LoRA when the core is the identity): gwt's C++
    ``gwt::nn::DeltaLinear``,

    .. math:: y = x (W H_1 \cdots H_r)^T + \frac{\alpha}{k_0} x (U Q V^T)^T + b

    with :math:`H_i = I - 2 u_i u_i^T / (u_i^T u_i)` (:math:`u_i` = column i of ``reflections``
    ``[in, r]``), :math:`Q` the product of the reflections in the columns of ``core`` ``[k, k]``
    (or :math:`I`), ``U`` ``[out, k]`` (zero at the start: the layer starts equal to its base),
    ``V`` ``[in, k]`` (``[out, 0]`` and ``[in, 0]`` at rank 0, so that they keep their identity
    when the rank grows), and :math:`k_0` the rank the layer was built with, or the one it grew to
    on each growth from rank 0 (there is no delta to keep then: the scale is reset to
    :math:`\alpha / k_{new}`); any other resize keeps the scale. The base's ``weight`` and ``bias``
    are shared with ``base`` (not copied) and frozen unless ``train_base``.

    The module's state is its parameters and the scale, whose saved value is the ``delta_scale``
    buffer (float64): ``load_state_dict`` and ``resize_rank`` set it together with the host copy
    of the scale that the forward reads (writing the buffer directly does not change the
    forward). The math
    runs in gwt's stateless C++ functions (``gwt::nn::delta_linear_*``), so the module copies,
    pickles, averages (``AveragedModel``) and runs in several threads like any torch module, and
    ``state_dict()`` restores it exactly, rank changes included: a state dict saved at another
    rank loads (U, V and the core take the saved rank). As in C++, ``.to(dtype)`` converts the
    base only: U, V, the reflections and the core keep the base's math dtype (float32 for a
    bfloat16 or float16 base, else the base's) and ``delta_scale`` stays float64. Reflection
    vectors start at norm ~0.58 (PEFT's HRA at ~sqrt(2 in / (3 r))): divide a PEFT HRA learning
    rate by sqrt(2 in / r) for Adam (docs/adapters.md).
    """

    def __init__(self, base: nn.Linear, rank: int = 0, reflections: int = 0,
                 orthogonal_core: bool = False, alpha: float = 0.0, gram_schmidt: bool = False,
                 train_base: bool = False) -> None:
        super().__init__()
        if not isinstance(base, nn.Linear):
            raise TypeError(f"gwt.nn.DeltaLinear adapts a torch.nn.Linear, got {type(base).__name__}")
        self.in_features, self.out_features = base.in_features, base.out_features
        self.alpha, self.gram_schmidt = float(alpha), bool(gram_schmidt)
        U, V, refl, core, scaling = _C._delta_init(base.weight, base.bias, int(rank),
                                                   int(reflections), bool(orthogonal_core),
                                                   float(alpha), bool(gram_schmidt))
        self.weight = base.weight
        self.bias = base.bias
        self.weight.requires_grad_(bool(train_base))
        if self.bias is not None:
            self.bias.requires_grad_(bool(train_base))
        self.U = nn.Parameter(U)
        self.V = nn.Parameter(V)
        self.register_parameter("core", None if core is None else nn.Parameter(core))
        self.register_parameter("reflections", None if refl is None else nn.Parameter(refl))
        # The scale is read at every forward: a host float, so that reading it never waits for a
        # GPU. The buffer is its saved value (kept in float64 by _apply); load and resize_rank set
        # both.
        self._scaling = float(scaling)
        self.register_buffer("delta_scale",
                             torch.tensor(self._scaling, dtype=torch.float64,
                                          device=base.weight.device))

    def _state(self) -> tuple:
        return (self.weight, self.bias, self.U, self.V, self.reflections, self.core)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _C._delta_forward(x, *self._state(), self._scaling, self.gram_schmidt)

    def merge(self) -> nn.Linear:
        """A plain torch.nn.Linear with ``W H_1 ... H_r + (alpha / k0) U Q V^T`` as its weight (in
        the base's dtype) and a copy of the base's bias: the same output to rounding. Built on the
        meta device first, so that it allocates and draws nothing for an initialisation."""
        weight = _C._delta_merged_weight(*self._state(), self._scaling, self.gram_schmidt)
        merged = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                           device="meta")
        merged.weight = nn.Parameter(weight)
        if self.bias is not None:
            merged.bias = nn.Parameter(self.bias.detach().clone())
        return merged

    def delta_weight(self) -> torch.Tensor:
        """The dense ``[out, in]`` change merge() adds to ``W H`` (zeros without a delta)."""
        return _C._delta_weight(*self._state(), self._scaling)

    def orthogonality_error(self) -> Tuple[float, float]:
        """``||P^T P - I||_F`` of the reflection product and of the core (0 when absent)."""
        return tuple(_C._delta_orthogonality_error(*self._state(), self.gram_schmidt))

    def orthogonality_penalty(self, lambda_: float) -> torch.Tensor:
        """HRA's regulariser ``lambda * ||I - N^T N||_F^2`` (N: the unit reflection vectors), to
        add to the loss."""
        return _C._delta_orthogonality_penalty(*self._state(), float(lambda_))

    def resize_rank(self, k: int) -> float:
        """Changes the delta's rank to ``k``; returns the relative reconstruction error (0 when
        growing; the output is then unchanged to rounding). The parameters keep their identity
        (resized in place, from rank 0 too), so an optimizer still holds them, but its state for
        them no longer fits once it has some: rebuild or reset it."""
        U, V, core, scaling, error = _C._delta_resize_rank(*self._state(), self._scaling,
                                                           self.alpha, int(k))
        with torch.no_grad():
            for param, value in ((self.U, U), (self.V, V), (self.core, core)):
                if param is not None and param is not value:
                    param.data = value
                    param.grad = None
        if scaling != self._scaling:
            self._scaling = float(scaling)
            with torch.no_grad():
                self.delta_scale.fill_(self._scaling)
        return error

    @property
    def rank(self) -> int:
        return self.U.shape[1]

    @property
    def scaling(self) -> float:
        """alpha / k0, the scale the forward reads (``delta_scale`` holds its saved value)."""
        return self._scaling

    def _apply(self, fn, recurse=True):
        # As DeltaLinearImpl::to: the base takes fn's dtype, while U, V, the reflections and the
        # core (and their gradients) keep the math dtype of the base's new dtype and delta_scale
        # stays float64. Rounding them through bfloat16 and back would lose the adapter's values;
        # so where fn would change their dtype they only follow its device. Whatever else fn does
        # (a device move, share_memory_, to_empty) applies to them as to any tensor.
        def target(t: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                return fn(torch.empty(0, dtype=t.dtype, device=t.device))

        new_base = target(self.weight).dtype
        if new_base not in _BASE_DTYPES:
            raise ValueError(f"gwt.nn.DeltaLinear: cannot convert to {new_base}; valid dtypes "
                             "are float32, float64, float16, bfloat16")
        kept = [(self._buffers["delta_scale"], torch.float64)]
        for name in _ADAPTER:
            param = self._parameters.get(name)
            if param is not None:
                kept += [(t, _math_dtype(new_base)) for t in (param, param.grad)
                         if t is not None]

        def convert(t: torch.Tensor) -> torch.Tensor:
            for held, dtype in kept:
                if t is held:
                    moved = target(t)
                    if moved.dtype != t.dtype:
                        return t.to(device=moved.device, dtype=dtype)
                    break
            return fn(t)

        return super()._apply(convert, recurse)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # Everything is checked before anything changes: torch's loader copies each tensor that
        # fits and reports the others, which would leave a layer half loaded (U of one layer with
        # V of another, or a buffer that no longer matches the scale the forward reads).
        local = {name: t for name, t in (*self._parameters.items(), *self._buffers.items())
                 if t is not None and name not in self._non_persistent_buffers_set}
        problems = []
        saved = {}
        for name, current in local.items():
            if prefix + name not in state_dict:
                continue
            value = state_dict[prefix + name]
            if not isinstance(value, torch.Tensor):
                problems.append(f"gwt.nn.DeltaLinear: {prefix + name} in the state dict is a "
                                f"{type(value).__name__}, not a tensor")
            elif name not in ("U", "V", "core") and not (
                    value.shape == current.shape or
                    (current.dim() == 0 and tuple(value.shape) == (1,))):
                problems.append(f"gwt.nn.DeltaLinear: {prefix + name} has shape "
                                f"{list(value.shape)} in the state dict but {list(current.shape)} "
                                "in this layer")
            else:
                saved[name] = value
        scaling = None
        if "delta_scale" in saved:
            scaling = float(saved["delta_scale"].reshape(()))  # read once, at load time
            if not (math.isfinite(scaling) and scaling >= 0):
                problems.append(f"gwt.nn.DeltaLinear: invalid scale {scaling} in "
                                f"{prefix}delta_scale; it must be finite and >= 0")
        shapes = self._saved_rank(saved, prefix, problems)
        missing, unexpected = [], []
        if strict:
            missing = [prefix + name for name in local if prefix + name not in state_dict]
            unexpected = [key for key in state_dict if key.startswith(prefix) and
                          key[len(prefix):].split(".", 1)[0] not in (*local, *self._modules)]
        if problems or missing or unexpected:
            error_msgs.extend(problems)
            missing_keys.extend(missing)
            unexpected_keys.extend(unexpected)
            return
        previous = {}
        if shapes is not None:
            # Another rank: U, V and the core take the saved shapes (as the C++ loader's
            # set_parameter does), keeping their identity, and torch's loader copies into them.
            with torch.no_grad():
                for name, shape in shapes.items():
                    param = self._parameters[name]
                    previous[name] = (param.data, param.grad)
                    param.data = torch.empty(shape, dtype=param.dtype, device=param.device)
                    param.grad = None
        errors = len(error_msgs)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        if len(error_msgs) == errors:
            if scaling is not None:
                self._scaling = scaling
            return
        # A copy that failed after the checks: the rank and the buffer go back to what the forward
        # reads.
        with torch.no_grad():
            for name, (data, grad) in previous.items():
                self._parameters[name].data = data
                self._parameters[name].grad = grad
            self._buffers["delta_scale"].fill_(self._scaling)

    def _saved_rank(self, saved, prefix, problems):
        """The new shapes of U, V and the core when ``saved`` holds a delta of another rank (None
        when it holds the current rank or no delta); a delta that does not fit goes to
        ``problems``."""
        parts = [name for name in ("U", "V", "core") if name in saved]
        if not parts:
            return None
        out, n_in = self.out_features, self.in_features
        value = saved[parts[0]]
        k = value.shape[1] if value.dim() == 2 else -1
        wanted = {"U": (out, k), "V": (n_in, k)}
        if self.core is not None:
            wanted["core"] = (k, k)
        fits = 0 <= k <= min(out, n_in) and all(
            tuple(saved[name].shape) == wanted[name] for name in parts)
        # A delta of another rank must come whole: U of one rank with V of another cannot run.
        if fits and (k == self.rank or len(parts) == len(wanted)):
            return None if k == self.rank else wanted
        given = ", ".join(f"{name} {list(saved[name].shape)}" for name in parts)
        need = "U [out, k], V [in, k]" + (", core [k, k]" if self.core is not None else "")
        problems.append(f"gwt.nn.DeltaLinear: the state dict's {given} (under '{prefix}') are not "
                        f"a delta of this layer (in = {n_in}, out = {out}, rank {self.rank}): it "
                        f"needs {need} with k <= min(in, out) = {min(out, n_in)}, and all of "
                        "them when k is not the layer's rank")
        return None

    def extra_repr(self) -> str:
        r = 0 if self.reflections is None else self.reflections.shape[1]
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"rank={self.rank}, reflections={r}, orthogonal_core={self.core is not None}")
