"""Checkpoints: state_dict() in torch's format, torch.save round trips that continue bit-identically
(bfloat16 state included), and the C++ optimizer's archive in both directions."""

import io

import pytest
import torch

import gwt
from gwt_test_util import SHAPES, WAVELET_KEYS, assert_same, make_grads, run_cpp

CASES = {
    "float32": (torch.float32, dict()),
    "bfloat16 state": (torch.float32, dict(state_dtype="bfloat16", wavelet="db2")),
    "bfloat16 parameters": (torch.bfloat16, dict(lr=0.01)),
    "float64 skip_param": (torch.float64, dict(nonfinite="skip_param", level=1)),
}


def make_model(dtype):
    torch.manual_seed(3)
    return [torch.randn(s, dtype=torch.float64).to(dtype).requires_grad_() for s in SHAPES]


def train(opt, params, grads):
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()


def roundtrip(obj, weights_only=True):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=weights_only)


@pytest.mark.parametrize("case", list(CASES))
def test_torch_save_round_trip_continues_bit_identically(case):
    dtype, options = CASES[case]
    grads = make_grads(SHAPES, 8, dtype, "cpu", nan_at=(2, 1))
    # Uninterrupted.
    params = make_model(dtype)
    opt = gwt.WaveletAdam(params, **options)
    train(opt, params, grads)
    # Saved after 4 steps (model and optimizer), loaded into fresh ones, 4 more.
    params_a = make_model(dtype)
    opt_a = gwt.WaveletAdam(params_a, **options)
    train(opt_a, params_a, grads[:4])
    saved_params = roundtrip([p.detach().clone() for p in params_a])
    saved = roundtrip(opt_a.state_dict())
    assert set(saved) == {"state", "param_groups", "skipped_steps"}
    assert saved["skipped_steps"] == opt_a.skipped_steps() == 1
    entry = saved["state"][0]
    moment_dtype = torch.bfloat16 if "bfloat16 state" in case else (
        torch.float64 if dtype == torch.float64 else torch.float32)
    assert entry["exp_avg"].dtype == moment_dtype and entry["exp_avg_sq"].dtype == moment_dtype
    assert entry["norm"].dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert saved["param_groups"][0]["wavelet"] == options.get("wavelet", "haar")

    params_b = [p.clone().requires_grad_() for p in saved_params]
    opt_b = gwt.WaveletAdam(params_b)  # default options: the checkpoint's replace them
    opt_b.load_state_dict(saved)
    assert opt_b.param_groups[0]["state_dtype"] == options.get("state_dtype", "auto")
    assert opt_b.state[params_b[0]]["exp_avg"].dtype == moment_dtype
    train(opt_b, params_b, grads[4:])
    for p, q in zip(params, params_b):
        assert torch.equal(p, q)
    for p, q in zip(params, params_b):
        for key in WAVELET_KEYS:
            a, b = opt.state[p].get(key), opt_b.state[q].get(key)
            if isinstance(a, torch.Tensor):
                assert a.dtype == b.dtype and torch.equal(a, b), key
            else:
                assert a == b, key
    assert opt_b.skipped_steps() == opt.skipped_steps()


def test_state_dict_is_torch_format_and_load_does_not_alias():
    params = make_model(torch.float32)
    opt = gwt.WaveletAdam(params, lr=0.01)
    train(opt, params, make_grads(SHAPES, 2, torch.float32, "cpu"))
    sd = opt.state_dict()
    assert sorted(sd["state"]) == list(range(len(SHAPES)))
    assert sd["param_groups"][0]["params"] == list(range(len(SHAPES)))
    assert sd["param_groups"][0]["lr"] == 0.01
    assert sd["state"][0]["step"] == 2 and sd["state"][0]["exp_avg"].shape == (16, 16)
    other = gwt.WaveletAdam(params, lr=0.01)
    other.load_state_dict(sd)
    # The loaded state is the optimizer's own, not the dict's tensors.
    assert other.state[params[0]]["exp_avg"] is not sd["state"][0]["exp_avg"]
    assert torch.equal(other.state[params[0]]["exp_avg"], sd["state"][0]["exp_avg"])


def test_a_checkpoint_that_does_not_fit_changes_nothing():
    params = make_model(torch.float32)
    opt = gwt.WaveletAdam(params)
    train(opt, params, make_grads(SHAPES, 2, torch.float32, "cpu"))
    good = opt.state_dict()
    before = {k: v.clone() for k, v in opt.state[params[0]].items() if isinstance(v, torch.Tensor)}

    bad = roundtrip(good)
    bad["state"][0]["exp_avg_sq"][0, 0] = -1.0
    with pytest.raises(RuntimeError, match="exp_avg_sq .* holds a negative value"):
        opt.load_state_dict(bad)
    bad = roundtrip(good)
    bad["state"][1]["exp_avg"][0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="holds a NaN or an infinity"):
        opt.load_state_dict(bad)
    bad = roundtrip(good)
    bad["param_groups"][0]["level"] = 1  # moments of level 2 do not fit level 1
    with pytest.raises(RuntimeError, match="were level, wavelet, boundary or dim changed"):
        opt.load_state_dict(bad)
    bad = roundtrip(good)
    bad["param_groups"][0]["lr"] = -1.0
    with pytest.raises(RuntimeError, match="invalid learning rate -1"):
        opt.load_state_dict(bad)

    assert opt.param_groups[0]["level"] == 2 and opt.param_groups[0]["lr"] == 1e-3
    for k, v in before.items():
        assert torch.equal(opt.state[params[0]][k], v)


@pytest.mark.parametrize("case", ["float32", "bfloat16 state"])
def test_cpp_archive_both_ways(case, tmp_path):
    dtype, options = CASES[case]
    grads = make_grads(SHAPES, 6, dtype, "cpu")
    # Python, 3 steps -> the C++ archive -> the C++ optimizer continues 3 steps ...
    params = make_model(dtype)
    opt = gwt.WaveletAdam(params, **options)
    train(opt, params, grads[:3])
    path = tmp_path / "python_to_cpp.pt"
    opt.save_archive(path)
    cpp_params, cpp_states, counters = run_cpp(
        "wavelet_adam", opt, [p.detach() for p in params], grads[3:], load_path=str(path))
    # ... as Python continues them.
    train(opt, params, grads[3:])
    assert_same(params, opt, cpp_params, cpp_states, WAVELET_KEYS)

    # C++, 3 steps -> its archive -> Python continues 3 steps, as C++ does.
    params = make_model(dtype)
    py = gwt.WaveletAdam(params, **options)
    path = tmp_path / "cpp_to_python.pt"
    cpp_params, _, _ = run_cpp("wavelet_adam", py, [p.detach() for p in params], grads[:3],
                               save_path=str(path))
    cpp_all, cpp_states, _ = run_cpp("wavelet_adam", py, [p.detach() for p in params], grads)
    with torch.no_grad():
        for p, q in zip(params, cpp_params):
            p.copy_(q)
    py.load_archive(path)
    assert py.state[params[0]]["step"] == 3
    train(py, params, grads[3:])
    assert_same(params, py, cpp_all, cpp_states, WAVELET_KEYS)


def test_galore_round_trip(tmp_path):
    grads = make_grads(SHAPES, 6, torch.float32, "cpu")
    params = make_model(torch.float32)
    opt = gwt.GaLoreAdam(params, rank=3, update_proj_gap=2)
    train(opt, params, grads)
    params_a = make_model(torch.float32)
    opt_a = gwt.GaLoreAdam(params_a, rank=3, update_proj_gap=2)
    train(opt_a, params_a, grads[:3])
    saved = roundtrip(opt_a.state_dict())
    assert set(saved) == {"state", "param_groups", "skipped_steps", "svd_fallbacks"}
    opt_b = gwt.GaLoreAdam(params_a, rank=3, update_proj_gap=2)
    opt_b.load_state_dict(saved)
    train(opt_b, params_a, grads[3:])
    for p, q in zip(params, params_a):
        assert torch.equal(p, q)
    path = tmp_path / "galore.pt"
    opt_b.save_archive(path)
    opt_c = gwt.GaLoreAdam(params_a, rank=3, update_proj_gap=2)
    opt_c.load_archive(path)
    assert torch.equal(opt_c.state[params_a[0]]["projector"], opt_b.state[params_a[0]]["projector"])


def test_pickling_the_optimizer_keeps_its_counters():
    params = make_model(torch.float32)
    opt = gwt.WaveletAdam(params)
    train(opt, params, make_grads(SHAPES, 2, torch.float32, "cpu", nan_at=(1, 0)))
    assert opt.skipped_steps() == 1
    copy = roundtrip(opt, weights_only=False)  # a whole object: trusted data
    assert copy.skipped_steps() == 1
