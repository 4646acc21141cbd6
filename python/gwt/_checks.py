"""The tensors gwt's C++ kernels can take, checked where a Python caller hands them over.

The kernels read and write through ``data_ptr()``. A tensor subclass that handles its own dispatch
(``__torch_dispatch__``: FSDP2's DTensor parameters, ...) has no storage of its own, so the kernels
would write into memory that is not the tensor's (FSDP2 parameters crashed the process); a meta
tensor has no data at all; other devices have no kernels. The C++ library refuses them too, but
only Python knows which group and position a tensor is at, and says so here, before anything
changes.
"""

from __future__ import annotations

import torch

# Optimizer hints: what a user with such a parameter can do instead.
OPTIMIZER_HINT = ("use torch.nn.parallel.DistributedDataParallel for data parallelism (FSDP2's "
                  "fully_shard is not supported yet), or give gwt plain tensors (a DTensor's local "
                  "shard: DTensor.to_local())")
TRANSFORM_HINT = "pass a plain torch.Tensor (a DTensor's local shard: DTensor.to_local())"

_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def _dispatches_itself(t: torch.Tensor) -> bool:
    return type(t).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__


def is_plain(t: torch.Tensor) -> bool:
    """The fast check (a step makes it for every parameter and gradient): a torch.Tensor or
    Parameter, not a subclass, on the CPU or a CUDA device. A tensor that fails it may still pass
    check_plain (a subclass that leaves dispatch to torch)."""
    return type(t) in _PLAIN_TYPES and (t.is_cpu or t.is_cuda)


def check_plain(t: torch.Tensor, what: str, hint: str) -> None:
    """Raises unless ``t`` (described by ``what``, e.g. "gwt.WaveletAdam: parameter 0 of group 1")
    is a tensor the kernels can address: TypeError for a tensor subclass with its own dispatch,
    ValueError for a tensor on a device other than cpu and cuda (meta included)."""
    if is_plain(t):
        return
    shape = list(t.shape)
    if _dispatches_itself(t):
        raise TypeError(
            f"{what} (shape {shape}) is a {type(t).__name__}, a tensor subclass with its own "
            f"__torch_dispatch__ (as FSDP2's DTensor parameters are), whose data gwt's C++ kernels "
            f"cannot address: {hint}")
    if t.is_meta:
        raise ValueError(
            f"{what} (shape {shape}) is on meta; gwt runs on cpu and cuda tensors: materialize it "
            "first (a model built on the meta device: model.to_empty(device=...), then initialise "
            "its parameters)")
    if not (t.is_cpu or t.is_cuda):
        raise ValueError(
            f"{what} (shape {shape}) is on {t.device}; gwt runs on cpu and cuda tensors: move it "
            "to one (.to('cpu') or .to('cuda'))")
