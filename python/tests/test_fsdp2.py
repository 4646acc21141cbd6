"""Tensors gwt's kernels cannot address (FSDP2's DTensor parameters and other tensor subclasses
with their own dispatch, meta tensors) are refused with an error that names them, before anything
changes, by the optimizers and the transforms."""

import pathlib

import pytest
import torch
from torch.utils._pytree import tree_map

import gwt
from gwt_test_util import run_torchrun

HERE = pathlib.Path(__file__).resolve().parent


class Wrapper(torch.Tensor):
    """A wrapper tensor subclass with its own __torch_dispatch__ and no storage of its own, as
    DTensor is: every op runs on the wrapped tensor."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype,
                                                   device=inner.device,
                                                   requires_grad=inner.requires_grad)

    def __init__(self, inner):
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda t: t.inner if isinstance(t, Wrapper) else t  # noqa: E731
        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        return tree_map(lambda t: Wrapper(t) if isinstance(t, torch.Tensor) else t, out)


def plain(*shape):
    return torch.randn(*shape).requires_grad_()


@pytest.mark.parametrize("cls", [gwt.WaveletAdam, gwt.GaLoreAdam])
def test_a_tensor_subclass_parameter_is_refused_by_name(cls):
    sub = torch.nn.Parameter(Wrapper(torch.randn(4, 8)))
    with pytest.raises(TypeError) as info:
        cls([{"params": [plain(3, 5)]}, {"params": [plain(2, 2), sub]}])
    message = str(info.value)
    assert f"gwt.{cls.__name__}: parameter 1 of group 1 (shape [4, 8]) is a Wrapper" in message
    assert "__torch_dispatch__" in message and "DistributedDataParallel" in message


def test_add_param_group_refuses_a_subclass_and_changes_nothing():
    opt = gwt.WaveletAdam([plain(4, 8)])
    with pytest.raises(TypeError, match=r"parameter 0 of group 1 \(shape \[4, 8\]\) is a Wrapper"):
        opt.add_param_group({"params": [torch.nn.Parameter(Wrapper(torch.randn(4, 8)))]})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("cls", [gwt.WaveletAdam, gwt.GaLoreAdam])
def test_a_meta_parameter_is_refused_by_name(cls):
    with pytest.raises(ValueError) as info:
        cls([plain(4, 8), torch.nn.Parameter(torch.empty(6, 8, device="meta"))])
    message = str(info.value)
    assert f"gwt.{cls.__name__}: parameter 1 of group 0 (shape [6, 8]) is on meta" in message
    assert "to_empty" in message


def test_a_tensor_subclass_gradient_is_refused_at_step_and_changes_nothing():
    p, q = plain(8, 8), plain(4, 8)
    opt = gwt.WaveletAdam([p, q], lr=0.1)
    p.grad, q.grad = torch.randn(8, 8), torch.randn(4, 8)
    opt.step()
    before = (p.detach().clone(), q.detach().clone(),
              opt.state[p]["exp_avg"].clone(), opt.state[p]["step"])
    p.grad = torch.randn(8, 8)
    q.grad = Wrapper(torch.randn(4, 8))
    with pytest.raises(TypeError, match=r"gwt.WaveletAdam.step: the gradient of parameter 1 of "
                                        r"group 0 \(shape \[4, 8\]\) is a Wrapper"):
        opt.step()
    assert torch.equal(p, before[0]) and torch.equal(q, before[1])
    assert torch.equal(opt.state[p]["exp_avg"], before[2]) and opt.state[p]["step"] == before[3]


@pytest.mark.parametrize("call", [
    lambda x: gwt.dwt(x),
    lambda x: gwt.wavedec(x, level=1),
    lambda x: gwt.wavedec2(x),
    lambda x: gwt.threshold(x, 0.1),
    lambda x: gwt.idwt(torch.randn(4, 4), x[:, :4]),
    lambda x: gwt.waverec([torch.randn(4, 4), x[:, :4]]),
    lambda x: gwt.waverec2([torch.randn(2, 4), (torch.randn(2, 4), x[:2, :4], torch.randn(2, 4))]),
])
def test_the_transforms_refuse_subclasses_and_meta_tensors(call):
    with pytest.raises(TypeError, match=r"gwt\.\w+: \w+(\[\d\])*(\[\d\])? \(shape .*\) is a Wrapper"):
        call(Wrapper(torch.randn(4, 8)))
    with pytest.raises(ValueError, match=r"is on meta"):
        call(torch.empty(4, 8, device="meta"))


def has_fully_shard():
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        return False
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401  (FSDP2, torch >= 2.6)
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not has_fully_shard(), reason="needs torch.distributed with Gloo and FSDP2's "
                    "fully_shard")
def test_fsdp2_parameters_are_refused_on_every_rank():
    """The report's case, under torchrun: it crashed both ranks with SIGSEGV."""
    output = run_torchrun(HERE / "fsdp2_step.py")
    for rank in (0, 1):
        line = next((l for l in output.splitlines() if f"GWT_FSDP2_REFUSED rank={rank}:" in l), "")
        assert "TypeError: gwt.WaveletAdam: parameter 0 of group 0 (shape [32, 16]) is a DTensor" \
            in line, output
        assert "FSDP2" in line and "DistributedDataParallel" in line, output
