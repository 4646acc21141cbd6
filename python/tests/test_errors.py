"""Bad inputs raise Python exceptions carrying the C++ library's messages, and change nothing."""

import pytest
import torch

import gwt


def param(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype).requires_grad_()


@pytest.mark.parametrize("options, message", [
    (dict(lr=-1.0), "gwt::WaveletAdam: invalid learning rate -1; it must be finite and >= 0"),
    (dict(lr=float("nan")), "invalid learning rate nan"),
    (dict(betas=(0.9, 1.0)), "invalid beta2 1; it must be in [0, 1)"),
    (dict(eps=0.0), "invalid eps 0"),
    (dict(weight_decay=-0.1), "invalid weight_decay -0.1"),
    (dict(wavelet="db99"), "gwt: unknown wavelet 'db99'; valid wavelets are haar, db1"),
    (dict(boundary="reflect"), "gwt: unknown boundary mode 'reflect'; valid modes are"),
    (dict(level=-1), "invalid level -1"),
    (dict(state_dtype="bf16"), "invalid state_dtype 'bf16'; valid values are auto, bfloat16"),
    (dict(transform="3d"), "invalid transform '3d'"),
    (dict(threshold_mode="medium"), "invalid threshold_mode 'medium'"),
    (dict(nonfinite="ignore"), "invalid nonfinite 'ignore'"),
    (dict(norm_growth_limit=1e-40), "invalid norm_growth_limit"),
    (dict(dim=2), "dim 2 is out of range for a parameter of shape [4, 8]"),
])
def test_bad_options_raise_value_error_with_the_cpp_message(options, message):
    with pytest.raises(ValueError) as info:
        gwt.WaveletAdam([param(4, 8)], **options)
    assert message in str(info.value)
    # The same message as the C++ library's c10::Error, without a C++ backtrace.
    assert "Exception raised from" not in str(info.value)


@pytest.mark.parametrize("options, message", [
    (dict(lr="fast"), "option 'lr' must be a float, got str"),
    (dict(level=2.0), "option 'level' must be an int, got float"),
    (dict(level=True), "option 'level' must be an int, got a bool"),
    (dict(fused=1), "option 'fused' must be a bool, got int"),
    (dict(betas=0.9), "option 'betas' must be a pair of floats"),
])
def test_options_of_the_wrong_type_raise_type_error(options, message):
    with pytest.raises(TypeError, match=message):
        gwt.WaveletAdam([param(4, 8)], **options)


def test_bad_parameters_and_groups():
    with pytest.raises(ValueError, match="parameters must be float64, float32, float16 or bfloat16"):
        gwt.WaveletAdam([torch.zeros(4, 8, dtype=torch.int64)])
    with pytest.raises(ValueError, match="empty parameter list"):
        gwt.WaveletAdam([])
    with pytest.raises(ValueError, match="non-leaf"):
        gwt.WaveletAdam([param(4, 8) * 2])
    with pytest.raises(ValueError, match="invalid rank -1"):
        gwt.GaLoreAdam([param(4, 8)], rank=-1)
    with pytest.raises(ValueError, match="unknown proj_type 'up'"):
        gwt.GaLoreAdam([param(4, 8)], proj_type="up")
    # A group that fails its check is not added.
    p = param(4, 8)
    opt = gwt.WaveletAdam([p])
    with pytest.raises(ValueError, match="invalid level 31"):
        opt.add_param_group({"params": [param(4, 8)], "level": 31})
    with pytest.raises(ValueError, match="some parameters appear in more than one"):
        opt.add_param_group({"params": [p]})
    assert len(opt.param_groups) == 1


def test_errors_at_step_change_nothing():
    p = param(8, 32)
    opt = gwt.WaveletAdam([p])
    p.grad = torch.randn_like(p)
    opt.step()
    before = p.detach().clone(), {k: v for k, v in opt.state[p].items()}
    m = opt.state[p]["exp_avg"].clone()
    # Options changed after training started: the moments no longer fit.
    opt.param_groups[0]["level"] = 1
    p.grad = torch.randn_like(p)
    with pytest.raises(RuntimeError, match=r"has moments of shape \[8, 8\] but its group's options "
                                           r"need \[8, 16\]"):
        opt.step()
    # An option made invalid after construction: the C++ step checks it too.
    opt.param_groups[0]["level"] = 2
    opt.param_groups[0]["lr"] = -0.5
    with pytest.raises(RuntimeError, match="invalid learning rate -0.5"):
        opt.step()
    opt.param_groups[0]["lr"] = "x"
    with pytest.raises(TypeError, match="option 'lr' must be a float"):
        opt.step()
    assert torch.equal(p, before[0]) and torch.equal(opt.state[p]["exp_avg"], m)
    assert opt.state[p]["step"] == 1
    # Moments moved to another dtype than the parameter's math type.
    opt.param_groups[0]["lr"] = 1e-3
    opt.state[p]["exp_avg"] = opt.state[p]["exp_avg"].double()
    with pytest.raises(RuntimeError, match="the moments of a Float parameter are Double"):
        opt.step()
    # Not a parameter of this optimizer.
    with pytest.raises(ValueError, match="not a parameter of this optimizer"):
        opt.is_wavelet_param(param(8, 32))


def test_float32_options_that_do_not_fit():
    p = param(8, 32)
    opt = gwt.WaveletAdam([p], lr=1e300)
    p.grad = torch.randn_like(p)
    with pytest.raises(RuntimeError, match="does not fit float32"):
        opt.step()
    assert opt.state.get(p) is None or not opt.state[p]


def test_transform_errors():
    with pytest.raises(ValueError, match="gwt: unknown wavelet 'morlet'; valid wavelets are"):
        gwt.wavedec(torch.randn(16), "morlet", 2)
    with pytest.raises(ValueError, match="gwt: unknown boundary mode 'smooth'"):
        gwt.wavedec(torch.randn(16), "haar", 2, mode="smooth")
    with pytest.raises(RuntimeError, match="gwt: wavelet transforms need a floating-point tensor"):
        gwt.wavedec(torch.arange(16), "haar", 2)
    with pytest.raises(RuntimeError, match="gwt: wavedec level must be >= 0, got -1"):
        gwt.wavedec(torch.randn(16), "haar", -1)
    coeffs = gwt.wavedec(torch.randn(16), "haar", 2)
    with pytest.raises(RuntimeError, match="gwt: waverec coefficient lengths do not fit"):
        gwt.waverec([coeffs[0], coeffs[2], coeffs[1]], "haar")
    with pytest.raises(ValueError, match="unknown threshold mode 'medium'"):
        gwt.threshold(torch.randn(4), 0.1, "medium")
