"""The paper's parameter grouping for torch.nn modules: the rule of gwt::paper_param_groups
(src/optim/param_groups.cpp), applied to Python modules."""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, NamedTuple, Sequence

import torch

__all__ = ["HEAD_NAMES", "ParamAssignment", "assign_param_groups", "paper_param_groups",
           "foam_param_groups"]

#: Names of output-head linear layers kept dense (the last component of the module's name).
HEAD_NAMES = ("lm_head", "head", "output", "classifier")


class ParamAssignment(NamedTuple):
    name: str
    param: torch.nn.Parameter
    wavelet: bool


def _contains_any(name: str, patterns: Iterable[str]) -> bool:
    return any(p and p in name for p in patterns)


def assign_param_groups(
    model: torch.nn.Module,
    head_names: Sequence[str] = HEAD_NAMES,
    force_dense: Sequence[str] = (),
    force_wavelet: Sequence[str] = (),
) -> List[ParamAssignment]:
    """Sorts every parameter of ``model`` that requires grad, in ``named_parameters()`` order.

    The rule (the GWT/GaLore recipe, as gwt::assign_param_groups): the 2-D ``weight`` of every
    ``torch.nn.Linear`` (subclasses included) goes to the wavelet group, except linear layers whose
    own name (the last component of the module's name) is one of ``head_names``; everything else
    (embeddings, norms, biases, convolutions, other tensors) is dense. Overrides match substrings of
    the full parameter name; ``force_dense`` wins over ``force_wavelet``. A weight shared by a head
    and a non-head linear layer is a wavelet parameter, as in C++.
    """
    if isinstance(head_names, str) or isinstance(force_dense, str) or isinstance(force_wavelet, str):
        raise TypeError("gwt: head_names, force_dense and force_wavelet are sequences of names")
    linear_weights = set()
    for name, module in model.named_modules(remove_duplicate=False):
        if not isinstance(module, torch.nn.Linear):
            continue
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor):
            continue
        if name.rsplit(".", 1)[-1] not in head_names:
            linear_weights.add(id(weight))
    out = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if isinstance(param, torch.nn.parameter.UninitializedParameter):
            raise ValueError(f"gwt: parameter '{name}' is not initialized yet (a lazy module): run "
                             "a forward pass before building the optimizer")
        wavelet = param.dim() == 2 and id(param) in linear_weights
        if _contains_any(name, force_wavelet):
            wavelet = True
        if _contains_any(name, force_dense):
            wavelet = False
        out.append(ParamAssignment(name, param, wavelet))
    return out


def paper_param_groups(
    model: torch.nn.Module,
    head_names: Sequence[str] = HEAD_NAMES,
    force_dense: Sequence[str] = (),
    force_wavelet: Sequence[str] = (),
    **options: Any,
) -> List[Dict[str, Any]]:
    """Up to two parameter groups for :class:`gwt.WaveletAdam`: first the wavelet group, then the
    dense group (``level=0``); empty groups are left out. ``options`` (``lr=...``,
    ``weight_decay=...``) go into both groups; the optimizer's defaults fill the rest::

        opt = gwt.WaveletAdam(gwt.paper_param_groups(model), lr=3e-3, scale=0.25)
    """
    wavelet, dense = [], []
    for a in assign_param_groups(model, head_names, force_dense, force_wavelet):
        (wavelet if a.wavelet else dense).append(a.param)
    groups = []
    if wavelet:
        groups.append({"params": wavelet, **options})
    if dense:
        groups.append({"params": dense, **options, "level": 0})
    return groups


def foam_param_groups(
    model: torch.nn.Module,
    head_names: Sequence[str] = HEAD_NAMES,
    force_dense: Sequence[str] = (),
    force_wavelet: Sequence[str] = (),
    **options: Any,
) -> List[Dict[str, Any]]:
    """The FOAM authors' groups for :class:`gwt.FoamAdam`, the same rule as
    :func:`paper_param_groups`: linear layers' weights folded (not the head), everything else in
    a ``level=0`` (dense) group::

        opt = gwt.FoamAdam(gwt.foam_param_groups(model), lr=3e-3, scale=0.25)
    """
    return paper_param_groups(model, head_names, force_dense, force_wavelet, **options)
