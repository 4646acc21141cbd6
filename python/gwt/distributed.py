"""A DistributedDataParallel communication hook that averages gradients in the wavelet domain: the
rule of gwt::distributed::all_reduce_gradients with GradSyncOptions{compression = "wavelet"}
(include/gwt/distributed.h), registered as PyTorch's PowerSGD hook is::

    state = gwt.distributed.WaveletHookState(level=2)
    model = DistributedDataParallel(model)
    model.register_comm_hook(state, gwt.distributed.wavelet_hook)

A gradient with at least two dimensions and at least 2^level values along its last one is
transformed (Haar along the last dimension, ``level`` levels, PyWavelets' "zero" mode). Its
approximation band (2^-level of the coefficients) is averaged exactly over the ranks; its detail
bands go as one sign bit per coefficient and one scale per row (the row's mean magnitude), which
every rank gathers and averages as scale * sign. What this rank's sketch missed is kept and added
to the next call's details of the same parameter (error feedback, as 1-bit SGD and PowerSGD), so
the details arrive late but in full. Other gradients are averaged exactly. At level 2 a rank sends
about 0.27x the bytes of the full all-reduce.

The hook waits for its collectives before it returns (its future is complete): it does not overlap
communication with the rest of the backward pass.
"""


import weakref
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .transform import wavedec, waverec

__all__ = ["WaveletHookState", "wavelet_hook"]

_SIGN_WEIGHTS = (1, 2, 4, 8, 16, 32, 64, 128)


class WaveletHookState:
    """What :func:`wavelet_hook` keeps between calls: its options, the error-feedback residual of
    each compressed parameter, and byte counts (``bytes_sent``: what this rank contributed to the
    collectives; ``bytes_full``: what the uncompressed all-reduce would have sent; both summed over
    calls until :meth:`reset_counts`)."""

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None, level: int = 2,
                 error_feedback: bool = True):
        if isinstance(level, bool) or not isinstance(level, int):
            raise TypeError(f"gwt.distributed: level must be an int, got {type(level).__name__}")
        if level < 1 or level > 30:
            raise ValueError(f"gwt.distributed: level must be in [1, 30], got {level}")
        if not isinstance(error_feedback, bool):
            raise TypeError("gwt.distributed: error_feedback must be a bool, got "
                            f"{type(error_feedback).__name__}")
        self.process_group = process_group
        self.level = level
        self.error_feedback = error_feedback
        # id(parameter) -> (a weak reference to it, its residual): tensors compare by value, so
        # they cannot be the keys of a dict of their own.
        self.residuals: Dict[int, Tuple[weakref.ref, torch.Tensor]] = {}
        self.bytes_sent = 0
        self.bytes_full = 0

    def reset_counts(self) -> None:
        self.bytes_sent = 0
        self.bytes_full = 0

    def reset_error_feedback(self) -> None:
        """Drops every residual (e.g. after loading a checkpoint)."""
        self.residuals = {}

    def residual(self, param: torch.Tensor) -> Optional[torch.Tensor]:
        """The error-feedback residual kept for ``param`` (its compressed rows' details), if any."""
        entry = self.residuals.get(id(param))
        return entry[1] if entry is not None and entry[0]() is param else None


def _compressible(grad: torch.Tensor, level: int) -> bool:
    return grad.dim() >= 2 and grad.size(-1) >= (1 << level) and grad.is_floating_point()


def _pack_signs(x: torch.Tensor) -> torch.Tensor:
    """Byte j holds the signs of values 8j .. 8j+7 (bit b: value 8j+b >= 0)."""
    n = x.numel()
    bits = torch.zeros((n + 7) // 8 * 8, dtype=torch.int32, device=x.device)
    bits[:n] = x.reshape(-1).ge(0)
    weights = torch.tensor(_SIGN_WEIGHTS, dtype=torch.int32, device=x.device)
    return (bits.view(-1, 8) * weights).sum(1).to(torch.uint8)


def _unpack_signs(packed: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    shifts = torch.arange(8, dtype=torch.int32, device=packed.device)
    bits = packed.to(torch.int32).unsqueeze(1).bitwise_right_shift(shifts).bitwise_and(1)
    return bits.reshape(-1)[:n].to(dtype).mul(2).sub(1)


class _Sketch:
    """A compressed gradient: its rows of Haar coefficients [A | D_level ... D_1]."""

    def __init__(self, grad: torch.Tensor, level: int, math: torch.dtype):
        coeffs = wavedec(grad.to(math), "haar", level, dim=-1, mode="zero")
        self.lengths = [c.size(-1) for c in coeffs]
        rows_all = torch.cat(coeffs, dim=-1)
        self.rows = rows_all.numel() // rows_all.size(-1)
        flat = rows_all.reshape(self.rows, rows_all.size(-1))
        self.approx = flat[:, :self.lengths[0]].contiguous()
        self.detail = flat[:, self.lengths[0]:].contiguous()
        self.scale: Optional[torch.Tensor] = None
        self.packed: Optional[torch.Tensor] = None
        self.sent: Optional[torch.Tensor] = None

    def sketch(self) -> None:
        self.scale = self.detail.abs().mean(1)
        self.packed = _pack_signs(self.detail)
        self.sent = (_unpack_signs(self.packed, self.detail.numel(), self.detail.dtype)
                     .view_as(self.detail) * self.scale.unsqueeze(1))

    def reconstruct(self, approx: torch.Tensor, detail: torch.Tensor,
                    like: torch.Tensor) -> torch.Tensor:
        flat = torch.cat([approx, detail], dim=1)
        shape = list(like.shape[:-1]) + [flat.size(1)]
        parts, offset = [], 0
        full = flat.view(shape)
        for length in self.lengths:
            parts.append(full.narrow(-1, offset, length))
            offset += length
        return waverec(parts, "haar", dim=-1, mode="zero", length=like.size(-1))


def _math_dtype(grad: torch.Tensor) -> torch.dtype:
    return torch.float64 if grad.dtype == torch.float64 else torch.float32


def wavelet_hook(state: WaveletHookState,
                 bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: averages the bucket's gradients over the process group, compressed
    in the wavelet domain as :class:`WaveletHookState` describes. Returns the bucket's buffer."""
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    buffer = bucket.buffer()
    grads: List[torch.Tensor] = list(bucket.gradients())
    params: List[torch.Tensor] = list(bucket.parameters())
    exact: List[Tuple[int, torch.Tensor]] = []      # (index, payload) averaged exactly
    sketches: List[Tuple[int, _Sketch]] = []
    for i, g in enumerate(grads):
        math = _math_dtype(g)
        state.bytes_full += g.numel() * (torch.finfo(math).bits // 8)
        if _compressible(g, state.level):
            s = _Sketch(g, state.level, math)
            residual = state.residual(params[i]) if state.error_feedback else None
            if residual is not None and residual.shape == s.detail.shape and \
                    residual.dtype == s.detail.dtype:
                s.detail.add_(residual)
            s.sketch()
            sketches.append((i, s))
            exact.append((i, s.approx))
        else:
            exact.append((i, g.to(math).reshape(-1)))

    # One SUM all-reduce per math dtype of the exact payloads.
    averaged = {}
    for math in (torch.float32, torch.float64):
        chosen = [(i, t) for i, t in exact if t.dtype == math]
        if not chosen:
            continue
        flat = torch.cat([t.reshape(-1) for _, t in chosen])
        state.bytes_sent += flat.numel() * flat.element_size()
        dist.all_reduce(flat, group=group)
        flat.div_(world)
        offset = 0
        for i, t in chosen:
            averaged[i] = flat[offset:offset + t.numel()].view_as(t)
            offset += t.numel()

    # The sign sketches: one all-gather of every sketch's bits, one of their scales per dtype;
    # each sketch's detail average is the mean over the ranks of scale * sign.
    detail_mean = {}
    if sketches:
        bits = torch.cat([sk.packed for _, sk in sketches])
        state.bytes_sent += bits.numel()
        gathered_bits = [torch.empty_like(bits) for _ in range(world)]
        dist.all_gather(gathered_bits, bits, group=group)
        gathered_scales = {}
        for math in (torch.float32, torch.float64):
            chosen = [sk for _, sk in sketches if sk.detail.dtype == math]
            if chosen:
                scales = torch.cat([sk.scale for sk in chosen])
                state.bytes_sent += scales.numel() * scales.element_size()
                gathered_scales[math] = [torch.empty_like(scales) for _ in range(world)]
                dist.all_gather(gathered_scales[math], scales, group=group)
        bit_offset = 0
        scale_offset = {torch.float32: 0, torch.float64: 0}
        for i, sk in sketches:
            math, nbytes = sk.detail.dtype, sk.packed.numel()
            total = torch.zeros_like(sk.detail)
            for r in range(world):
                signs = _unpack_signs(gathered_bits[r][bit_offset:bit_offset + nbytes],
                                      sk.detail.numel(), math).view_as(sk.detail)
                scale = gathered_scales[math][r][scale_offset[math]:scale_offset[math] + sk.rows]
                total.add_(signs * scale.unsqueeze(1))
            detail_mean[i] = total.div_(world)
            bit_offset += nbytes
            scale_offset[math] += sk.rows

    # Write back; keep what this rank's sketch missed as the next call's error feedback.
    sketch_of = dict(sketches)
    for i, g in enumerate(grads):
        sk = sketch_of.get(i)
        if sk is None:
            g.copy_(averaged[i].view_as(g))
            continue
        g.copy_(sk.reconstruct(averaged[i], detail_mean[i], g))
        if state.error_feedback:
            residual = sk.detail - sk.sent
            # A non-finite gradient (its step will be skipped) must not poison later steps.
            if not torch.isfinite(residual).all():
                residual.zero_()
            state.residuals[id(params[i])] = (weakref.ref(params[i]), residual)
        else:
            state.residuals.pop(id(params[i]), None)
    # Parameters that are gone leave no residual behind.
    for key in [k for k, (ref, _) in state.residuals.items() if ref() is None]:
        del state.residuals[key]
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(buffer)
    return future
