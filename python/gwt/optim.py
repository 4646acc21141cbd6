"""gwt's optimizers as ``torch.optim.Optimizer`` subclasses.

The state lives where torch keeps it (``optimizer.state[param]``: a dict of tensors and ints;
``optimizer.param_groups``: the options), so ``state_dict()``, ``torch.save`` and
``torch.optim.lr_scheduler`` work as with any torch optimizer. ``step()`` hands the groups and the
state to the C++ library, whose ``gwt::WaveletAdam::step`` (``gwt::GaLoreAdam::step``) updates the
parameters and the moments in place with its kernels (CPU and CUDA), on the same tensors.

The C++ optimizer is kept across steps (a session of ``_C``) while the parameters stay the same;
the step counts and norms it keeps (on the device, for CUDA parameters) come back into
``optimizer.state`` when Python code reads it, so a step never waits for the GPU and can be
captured in a CUDA graph (``torch.cuda.graph``; docs/performance.md says how).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Dict, Iterable, Optional, Tuple

import torch
from torch.optim import Optimizer

from . import _C
from ._checks import OPTIMIZER_HINT, check_plain, is_plain

__all__ = ["WaveletAdam", "GaLoreAdam", "FoamAdam"]


class _Keep:
    """Hides a state tensor from torch.optim.Optimizer.load_state_dict, which would cast it to its
    parameter's dtype (bfloat16 moments, float32 moments of a bfloat16 parameter, the limiter's
    float32 norm must keep their dtype)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def _hide_tensors(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return _Keep(value)
    if isinstance(value, dict):
        return {k: _hide_tensors(v) for k, v in value.items()}
    return value


def _unhide(value: Any) -> Any:
    if isinstance(value, _Keep):
        return value.value
    if isinstance(value, dict):
        return {k: _unhide(v) for k, v in value.items()}
    return value


class _CppOptimizer(Optimizer):
    """What WaveletAdam and GaLoreAdam share: the bridge to their C++ optimizer."""

    _prefix = ""  # the _C functions' prefix
    _counter_names: Tuple[str, ...] = ("skipped_steps",)
    _state_tensors: Tuple[str, ...] = ()  # the state entries state_bytes() counts

    def __init__(self, params: Iterable, defaults: Dict[str, Any]) -> None:
        self._counters = {name: 0 for name in self._counter_names}
        self._session = None  # the C++ optimizer kept across steps
        self._state_current = True  # whether self.__dict__["state"] holds the session's state
        super().__init__(params, defaults)

    # -- the state, current when read -------------------------------------------------------
    @property
    def state(self):  # type: ignore[override]
        """torch's per-parameter state (a dict keyed by parameter), with what the C++ optimizer
        keeps between steps (step counts, limiter norms; on the device for CUDA parameters)
        written into it first: reading it after a step of CUDA parameters waits for the device."""
        self._sync_state()
        return self.__dict__["state"]

    @state.setter
    def state(self, value) -> None:
        self.__dict__["state"] = value
        self._session = None
        self._state_current = True

    def _sync_state(self) -> None:
        """Writes the session's state and counters into Python's, once after each step."""
        session = self.__dict__.get("_session")
        if session is None or self._state_current:
            return
        counters = session.sync(self.__dict__["state"])
        for name in self._counter_names:
            self._counters[name] += counters[name] - self._session_counters[name]
        self._session_counters = {name: counters[name] for name in self._counter_names}
        self._state_current = True

    def _end_session(self) -> None:
        """Python's state made current, and the next step makes a new C++ optimizer from it."""
        self._sync_state()
        self._session = None

    # -- groups ------------------------------------------------------------------------------
    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Adds a group (its own options, the defaults for the rest) after the C++ optimizer has
        checked it: options in range, parameters float64/float32/float16/bfloat16 leaf tensors on
        the CPU or a CUDA device, in no other group. A ValueError (TypeError for an option of the
        wrong type, or a tensor subclass such as FSDP2's DTensor parameters) leaves the optimizer as
        it was."""
        super().add_param_group(param_group)
        try:
            self._check_tensors(len(self.param_groups) - 1, grads=False)
            getattr(_C, self._prefix + "_check_group")(self.param_groups[-1])
        except BaseException:
            self.param_groups.pop()
            raise

    # -- the step ----------------------------------------------------------------------------
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One step of the C++ optimizer on every parameter that has a gradient. ``closure``
        (optional) recomputes the loss with autograd on and returns it; step returns it.

        A step whose gradients hold a NaN or an infinity changes nothing and counts in
        ``skipped_steps()`` (with ``nonfinite="skip_param"``, only that parameter is skipped).
        Errors (bad options, a gradient of another shape or a tensor subclass, state that does not
        fit) raise before any parameter or state changes."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for i in range(len(self.param_groups)):
            self._check_tensors(i, grads=True)
        session = self._session
        if session is not None and not (
            session.matches(self.param_groups)
            and (not self._state_current or session.state_unchanged(self.__dict__["state"]))
        ):
            self._end_session()  # other parameters, or state changed from Python
            session = None
        if session is None:
            session = getattr(_C, "_" + self._prefix + "_session")(self.param_groups,
                                                                    self.__dict__["state"])
            self._session = session
            self._session_counters = {name: 0 for name in self._counter_names}
        self._state_current = False
        try:
            session.step(self.param_groups)
        except BaseException:
            # A step that failed partway (out of memory, say, after some parameters were updated)
            # has moved those parameters' moments in place: their step counts and norms go back to
            # Python too, as the C++ optimizer keeps them. (An error found by the checks before
            # any update leaves the state as it was.)
            self._end_session()
            raise
        return loss

    def _check_tensors(self, i: int, grads: bool) -> None:
        """Raises unless group i's parameters (and, with ``grads``, their gradients) are tensors
        the kernels can address (see _checks)."""
        for j, p in enumerate(self.param_groups[i]["params"]):
            grad = p.grad if grads else None
            if is_plain(p) and (grad is None or is_plain(grad)):
                continue
            name, where = type(self).__name__, f"parameter {j} of group {i}"
            check_plain(p, f"gwt.{name}: {where}", OPTIMIZER_HINT)
            if grad is not None:
                check_plain(grad, f"gwt.{name}.step: the gradient of {where}", OPTIMIZER_HINT)

    # -- checkpoints -------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """torch's format (``state``: per parameter index a dict of tensors and ints;
        ``param_groups``: the options), plus the counters (``skipped_steps``, ...)."""
        state_dict = super().state_dict()
        for name, value in self._counters.items():
            state_dict[name] = value
        return state_dict

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Loads what state_dict() returned (also through torch.save/torch.load). The state keeps its
        dtypes (torch's own load would cast the moments to the parameters' dtype; the options'
        state_dtype decides) and moves to the parameters' devices, each tensor copied once (the
        optimizer never updates the state_dict's own tensors). The C++ library checks all of it
        first, as its own checkpoint loader does (shapes for the options, finite moments, second
        moments >= 0, dtypes), and a state_dict that does not fit raises with the optimizer
        unchanged."""
        self._end_session()
        counters = {}
        for name in self._counter_names:
            value = state_dict.get(name, 0)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"gwt: the state_dict's {name} must be an int >= 0, got {value!r}")
            counters[name] = value
        hidden = dict(state_dict)
        hidden["state"] = {k: _hide_tensors(v) for k, v in state_dict["state"].items()}
        before = (self.state, self.param_groups, dict(self._counters))
        try:
            super().load_state_dict(hidden)
            state = {p: _unhide(s) for p, s in self.state.items()}
            # Checked and converted on the tensors where they are, as the C++ checkpoint loader
            # checks and converts a checkpoint's (no archive written and read back).
            self._adopt(getattr(_C, self._prefix + "_load_state")(self.param_groups, state,
                                                                   counters))
            # Entries torch keeps that belong to no parameter.
            for key, value in state.items():
                if not isinstance(key, torch.Tensor):
                    self.state[key] = value
        except BaseException:
            self.state, self.param_groups, self._counters = before
            raise

    def save_archive(self, path: str) -> None:
        """Writes the C++ optimizer's checkpoint: the file ``torch::save(optimizer, path)`` writes
        in C++, which ``torch::load`` reads into a ``gwt::WaveletAdam`` (``gwt::GaLoreAdam``) over
        the same parameters in the same groups."""
        self._sync_state()
        getattr(_C, self._prefix + "_save")(self.param_groups, self.state, dict(self._counters),
                                           str(path))

    def load_archive(self, path: str) -> None:
        """Reads a C++ checkpoint (``torch::save(optimizer, path)`` from C++, or save_archive):
        options, state and counters, checked by the C++ loader before anything changes."""
        self._end_session()
        self._adopt(getattr(_C, self._prefix + "_load")(self.param_groups, str(path)))

    def _adopt(self, loaded) -> None:
        options, states, counters = loaded
        for group, group_options in zip(self.param_groups, options):
            group.update(group_options)
        params = [p for group in self.param_groups for p in group["params"]]
        new_state: Dict[Any, Dict[str, Any]] = defaultdict(dict)
        for p, s in zip(params, states):
            if s is not None:
                new_state[p] = s
        self.state = new_state
        self._counters = {name: int(counters[name]) for name in self._counter_names}

    def __getstate__(self) -> Dict[str, Any]:
        self._sync_state()
        state = super().__getstate__()
        state["_counters"] = dict(self._counters)
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("_counters", {name: 0 for name in self._counter_names})
        self._session = None
        self._state_current = True

    # -- reports -----------------------------------------------------------------------------
    def state_bytes(self, param: Optional[torch.Tensor] = None) -> int:
        """Bytes of optimizer state (tensors only) of every parameter, or of one (0 before its first
        step)."""
        entries = [self.state.get(param, {})] if param is not None else list(self.state.values())
        total = 0
        for entry in entries:
            if not isinstance(entry, dict):
                continue
            for key in self._state_tensors:
                t = entry.get(key)
                if isinstance(t, torch.Tensor):
                    total += t.numel() * t.element_size()
        return total

    def skipped_steps(self) -> int:
        """Steps skipped because a gradient was not finite."""
        self._sync_state()
        return self._counters["skipped_steps"]


class _SkipsPerParam(_CppOptimizer):
    """Optimizers with ``nonfinite="skip_param"``: a parameter skipped alone counts in its state."""

    def skipped_steps(self, param: Optional[torch.Tensor] = None) -> int:
        """Steps skipped because a gradient was not finite (with "skip_param" groups: steps in
        which at least one parameter was skipped); with ``param``, the steps it skipped alone."""
        if param is None:
            return super().skipped_steps()
        entry = self.state.get(param)
        return int(entry.get("skipped", 0)) if entry else 0


class WaveletAdam(_SkipsPerParam):
    r"""Adam with its moments kept only on the wavelet approximation subband of each eligible
    gradient (GWT, arXiv 2501.07237): gwt's C++ ``gwt::WaveletAdam``. It takes the place of
    ``torch.optim.AdamW`` in a training loop (param groups, ``state_dict``, LR schedulers), but its
    defaults are not AdamW's: ``weight_decay=0`` (AdamW: 0.01), ``eps=1e-6`` (AdamW: 1e-8) and the
    norm-growth limiter on (``norm_growth_limit=1.01``; AdamW has none, 0 turns it off). Pass
    ``weight_decay`` and ``eps`` to match an AdamW setup. The update differs in two details as
    well: the bias correction is folded into the step size, so eps is added to the uncorrected
    ``sqrt(v)`` (AdamW adds it to the corrected one), and the decoupled decay follows the update
    (AdamW's precedes it).

    A parameter takes the wavelet path when ``level > 0``, it has at least two dimensions and at
    least ``2**level`` elements along ``dim`` (and, with ``min_size``, both of its last two
    dimensions are at least that); every other parameter is dense Adam with the same folded bias
    correction, eps and decoupled weight decay. :func:`gwt.paper_param_groups` builds the paper's
    groups (linear layers' weights wavelet, everything else dense).

    Args (each also a per-group option, as in torch.optim):
        params: parameters or parameter groups (dicts).
        lr: learning rate (finite, >= 0).
        betas: moment decay rates, each in [0, 1).
        eps: added to sqrt(v), not bias-corrected (>= the smallest normal float32).
        weight_decay: decoupled, ``p -= lr * weight_decay * p`` after the update.
        wavelet: haar, db1-db8, sym2-sym8, coif1-coif3 (PyWavelets' filters).
        level: decomposition levels; 0 is dense Adam.
        boundary: "zero", "periodization" or "symmetric".
        scale: multiplies the reconstructed update (the authors use 0.25).
        norm_growth_limit: the step's norm may grow by at most this factor per step; 0 disables.
        correct_bias: folds sqrt(1 - b2^t) / (1 - b1^t) into the step size.
        dim: the dimension the transform runs along; the others are batch dimensions.
        fused: use the fused kernels where they apply (False: the readable ATen reference).
        state_dtype: "auto" (float32, float64 for float64 parameters) or "bfloat16".
        transform: "1d" or "2d" (over the last two dimensions, moments on LL).
        threshold, threshold_mode: threshold the details first (PyWavelets' semantics); 0 is off.
        min_size: parameters with fewer elements than this along either of their last two
            dimensions stay dense.
        nonfinite: "skip_step" (a NaN/Inf gradient skips the whole step) or "skip_param" (only
            that parameter).

    State per parameter (``optimizer.state[p]``): ``step`` (int), ``exp_avg`` and ``exp_avg_sq``
    (the approximation subband's shape for wavelet parameters), ``norm`` (the limiter's 0-dim
    norm, after the first wavelet step), ``skipped`` (steps this parameter skipped alone).
    """

    _prefix = "wavelet_adam"
    _counter_names = ("skipped_steps",)
    _state_tensors = ("exp_avg", "exp_avg_sq", "norm")

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        wavelet: str = "haar",
        level: int = 2,
        boundary: str = "zero",
        scale: float = 1.0,
        norm_growth_limit: float = 1.01,
        correct_bias: bool = True,
        dim: int = -1,
        fused: bool = True,
        state_dtype: str = "auto",
        transform: str = "1d",
        threshold: float = 0.0,
        threshold_mode: str = "soft",
        min_size: int = 0,
        nonfinite: str = "skip_step",
    ) -> None:
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, wavelet=wavelet, level=level,
            boundary=boundary, scale=scale, norm_growth_limit=norm_growth_limit,
            correct_bias=correct_bias, dim=dim, fused=fused, state_dtype=state_dtype,
            transform=transform, threshold=threshold, threshold_mode=threshold_mode,
            min_size=min_size, nonfinite=nonfinite)
        super().__init__(params, defaults)

    def is_wavelet_param(self, param: torch.Tensor) -> bool:
        """Whether ``param`` takes the wavelet path under its group's options."""
        return _C.wavelet_adam_param_info(self.param_groups, param)[0]

    def is_fused_param(self, param: torch.Tensor) -> bool:
        """Whether ``param``'s step runs in a fused kernel (else the ATen reference)."""
        return _C.wavelet_adam_param_info(self.param_groups, param)[1]

    def kept_details(self) -> Tuple[int, int]:
        """With thresholding: detail coefficients kept and in all at the last step."""
        kept = total = 0
        for entry in self.state.values():
            if isinstance(entry, dict) and "total_details" in entry:
                kept += entry["kept_details"]
                total += entry["total_details"]
        return kept, total


class GaLoreAdam(_CppOptimizer):
    r"""Adam on a low-rank projection of each 2-D gradient (GaLore, arXiv 2403.03507): gwt's C++
    ``gwt::GaLoreAdam``. A parameter is projected when it is 2-D and ``1 <= rank < min(m, n)``;
    every other parameter is dense Adam (same folded bias correction, eps, decoupled weight decay).

    Args: ``lr``, ``betas``, ``eps``, ``weight_decay`` as WaveletAdam; ``rank`` (0: dense),
    ``update_proj_gap`` (steps between SVDs of the gradient), ``scale`` (multiplies the update
    projected back), ``proj_type`` ("std", "reverse_std", "left", "right"), ``svd`` ("exact" or
    "randomized", with ``oversample`` and ``power_iters``), ``correct_bias``.

    State per parameter: ``step``, ``exp_avg``, ``exp_avg_sq``, ``projector``, ``right``.
    """

    _prefix = "galore_adam"
    _counter_names = ("skipped_steps", "svd_fallbacks")
    _state_tensors = ("exp_avg", "exp_avg_sq", "projector")

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        rank: int = 128,
        update_proj_gap: int = 200,
        scale: float = 0.25,
        proj_type: str = "std",
        svd: str = "exact",
        oversample: int = 8,
        power_iters: int = 2,
        correct_bias: bool = True,
    ) -> None:
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, rank=rank,
            update_proj_gap=update_proj_gap, scale=scale, proj_type=proj_type, svd=svd,
            oversample=oversample, power_iters=power_iters, correct_bias=correct_bias)
        super().__init__(params, defaults)

    def svd_fallbacks(self) -> int:
        """Projector refreshes whose SVD failed (the previous projector was kept)."""
        self._sync_state()
        return self._counters["svd_fallbacks"]

    def is_projected_param(self, param: torch.Tensor) -> bool:
        """Whether ``param`` is projected under its group's options."""
        return _C.galore_adam_param_info(self.param_groups, param)


class FoamAdam(_SkipsPerParam):
    r"""Adam with its moments kept on block means of each gradient (FOAM, arXiv 2512.07112, the
    GWT authors' successor): gwt's C++ ``gwt::FoamAdam``. Along ``dim``, each block of
    ``2**level`` gradient values shares one first moment (of their mean) and one second moment (of
    the mean of their squares); the residual of each value about its block's mean enters both
    (``res_scale`` and its square). Every parameter of a group with ``level > 0`` is folded (a 1-D
    bias too, as the authors do; ``min_size`` keeps small ones dense); a ``level=0`` group is dense
    Adam. :func:`gwt.foam_param_groups` builds the authors' groups. The rule:
    docs/algorithm.md#foam.

    Args: ``lr``, ``betas``, ``weight_decay``, ``correct_bias``, ``dim``, ``state_dtype``,
    ``nonfinite``, ``min_size`` as WaveletAdam; ``eps`` (default 1e-8, as the authors), ``level``
    (blocks of ``2**level``; 0: dense), ``scale`` (multiplies the folded update; the authors use
    0.25), ``res_scale`` (rho), ``fused`` (the fused CPU kernels where they apply, see
    ``is_fused_param``; False: the readable ATen reference).

    State per parameter: ``step``, ``exp_avg``, ``exp_avg_sq`` (one value per block for folded
    parameters), ``skipped``.
    """

    _prefix = "foam_adam"
    _counter_names = ("skipped_steps",)
    _state_tensors = ("exp_avg", "exp_avg_sq")

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        level: int = 2,
        scale: float = 1.0,
        res_scale: float = 1.0,
        correct_bias: bool = True,
        dim: int = -1,
        fused: bool = True,
        state_dtype: str = "auto",
        nonfinite: str = "skip_step",
        min_size: int = 0,
    ) -> None:
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, level=level, scale=scale,
            res_scale=res_scale, correct_bias=correct_bias, dim=dim, fused=fused,
            state_dtype=state_dtype, nonfinite=nonfinite, min_size=min_size)
        super().__init__(params, defaults)

    def is_folded_param(self, param: torch.Tensor) -> bool:
        """Whether ``param`` takes the folded path under its group's options."""
        return _C.foam_adam_param_info(self.param_groups, param)[0]

    def is_fused_param(self, param: torch.Tensor) -> bool:
        """Whether ``param``'s step runs in a fused kernel (else the ATen reference)."""
        return _C.foam_adam_param_info(self.param_groups, param)[1]
