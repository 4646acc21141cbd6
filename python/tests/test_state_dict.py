"""Checkpoints: state_dict() in torch's format, torch.save round trips that continue bit-identically
(bfloat16 state included), and the C++ optimizer's archive in both directions."""

import io
import os
import pathlib
import re
import subprocess
import sys

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


def snapshot(opt):
    """Everything load_state_dict may change: options, state (tensors cloned) and counters."""
    state = {id(p): {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
             for p, s in opt.state.items()}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return state, groups, dict(opt._counters)


def assert_same_snapshot(a, b):
    assert a[1] == b[1] and a[2] == b[2] and a[0].keys() == b[0].keys()
    for key in a[0]:
        assert a[0][key].keys() == b[0][key].keys()
        for name, v in a[0][key].items():
            w = b[0][key][name]
            if isinstance(v, torch.Tensor):
                assert v.dtype == w.dtype and torch.equal(v, w), name
            else:
                assert v == w, name


def trained(cls, **options):
    params = make_model(torch.float32)
    opt = cls(params, **options)
    train(opt, params, make_grads(SHAPES, 2, torch.float32, "cpu", nan_at=(1, 4)))
    return params, opt


OPTIMIZERS = {"WaveletAdam": (gwt.WaveletAdam, dict(nonfinite="skip_param")),
              "GaLoreAdam": (gwt.GaLoreAdam, dict(rank=3, update_proj_gap=1))}


@pytest.mark.parametrize("name", ["WaveletAdam", "GaLoreAdam"])
def test_load_state_dict_round_trips_bit_exactly_into_state_of_its_own(name):
    cls, options = OPTIMIZERS[name]
    params, opt = trained(cls, **options)
    sd = roundtrip(opt.state_dict())
    kept = roundtrip(sd)
    other = cls(params, **options)
    other.load_state_dict(sd)
    assert other._counters == opt._counters
    assert snapshot(other)[1] == snapshot(opt)[1]
    for p in params:
        a, b = opt.state[p], other.state[p]
        assert a.keys() == b.keys()
        for key, value in a.items():
            if isinstance(value, torch.Tensor):
                assert value.dtype == b[key].dtype and torch.equal(value, b[key]), key
                # The optimizer's own storage: its steps update the moments in place.
                for t in sd["state"].values():
                    assert not any(b[key].untyped_storage().data_ptr() ==
                                   s.untyped_storage().data_ptr()
                                   for s in t.values() if isinstance(s, torch.Tensor))
            else:
                assert value == b[key], key
    train(other, params, make_grads(SHAPES, 1, torch.float32, "cpu"))
    assert_same_snapshot((kept["state"], 0, 0), (sd["state"], 0, 0))


def test_load_state_dict_converts_the_moments_to_the_groups_state_dtype():
    params, opt = trained(gwt.WaveletAdam)
    sd = roundtrip(opt.state_dict())
    sd["param_groups"][0]["state_dtype"] = "bfloat16"
    other = gwt.WaveletAdam(params)
    other.load_state_dict(sd)
    loaded = other.state[params[0]]
    assert loaded["exp_avg"].dtype == torch.bfloat16 and loaded["norm"].dtype == torch.float32
    assert torch.equal(loaded["exp_avg"], sd["state"][0]["exp_avg"].bfloat16())


def corrupt(sd, index, key, value):
    sd["state"][index][key] = value


WAVELET_CORRUPTIONS = {
    "moment missing": (lambda sd: sd["state"][0].pop("exp_avg"), RuntimeError,
                       r"moments of shape \[\] but its group's options need \[16, 16\]"),
    "moment of another shape": (lambda sd: corrupt(sd, 1, "exp_avg", torch.zeros(8, 7)),
                                RuntimeError, r"has moments of shape \[8, 7\]"),
    "integer moment": (lambda sd: corrupt(sd, 0, "exp_avg_sq", torch.zeros(16, 16).long()),
                       RuntimeError, r"exp_avg_sq for parameter 0 of group 0 \(shape \[16, 64\]\) "
                                     r"is a Long tensor"),
    "negative step": (lambda sd: corrupt(sd, 2, "step", -1), RuntimeError,
                      "a saved step count is negative"),
    "step of another type": (lambda sd: corrupt(sd, 2, "step", 1.5), TypeError,
                             "state 'step' must be an int"),
    "negative skipped": (lambda sd: corrupt(sd, 3, "skipped", -2), RuntimeError,
                         r"skipped count for parameter 3 of group 0 .* is -2"),
    "negative norm": (lambda sd: corrupt(sd, 0, "norm", torch.tensor(-1.0)), RuntimeError,
                      r"limiter norm for parameter 0 of group 0 .* holds a negative value"),
    "infinite norm": (lambda sd: corrupt(sd, 0, "norm", torch.tensor(float("inf"))),
                      RuntimeError, "holds a NaN or an infinity"),
    "float64 moment overflowing float32": (
        lambda sd: corrupt(sd, 4, "exp_avg", torch.full((12, 2), 1e300, dtype=torch.float64)),
        RuntimeError, r"exp_avg for parameter 4 of group 0 .* holds a NaN or an infinity"),
    "moment on the meta device": (
        lambda sd: corrupt(sd, 1, "exp_avg", torch.zeros(8, 6, device="meta")),
        RuntimeError, r"exp_avg for parameter 1 of group 0 \(shape \[8, 24\]\) of shape \[8, 6\] "
                      r"is on meta"),
    "negative counter": (lambda sd: sd.update(skipped_steps=-1), ValueError,
                         "skipped_steps must be an int >= 0"),
    "lr out of range": (lambda sd: sd["param_groups"][0].update(lr=float("inf")), RuntimeError,
                        "invalid learning rate inf"),
}


GALORE_CORRUPTIONS = {
    # The shape checks are GaLoreAdam's own (galore_adam_detail::check_state), with its messages.
    "projector of another rank": (lambda sd: corrupt(sd, 0, "projector", torch.zeros(16, 2)),
                                  RuntimeError, r"a saved projector of shape \[16, 2\] does not "
                                  r"fit a parameter of shape \[16, 64\] at rank 3"),
    "projector from the other side": (lambda sd: corrupt(sd, 0, "right", True), RuntimeError,
                                      r"a saved projector of shape .* does not fit a parameter "
                                      r"of shape \[16, 64\] at rank 3"),
    "moments of another rank": (lambda sd: corrupt(sd, 1, "exp_avg", torch.zeros(2, 24)),
                                RuntimeError, r"the state of a parameter of shape \[8, 24\] has "
                                r"moments of shape \[2, 24\] but its group's options need "
                                r"\[3, 24\]"),
    "negative second moment": (lambda sd: sd["state"][1]["exp_avg_sq"].fill_(-1.0), RuntimeError,
                               "exp_avg_sq for parameter 1 of group 0 .* holds a negative value"),
    "projector not finite": (lambda sd: sd["state"][0]["projector"].fill_(float("nan")),
                             RuntimeError, "projector for parameter 0 of group 0 .* holds a NaN"),
    "negative step": (lambda sd: corrupt(sd, 2, "step", -3), RuntimeError,
                      r"step for parameter 2 of group 0 \(shape \[33\]\) is -3"),
}


CORRUPTIONS = {
    **{("WaveletAdam", case): value for case, value in WAVELET_CORRUPTIONS.items()},
    **{("GaLoreAdam", case): value for case, value in GALORE_CORRUPTIONS.items()},
}
@pytest.mark.parametrize("name, case", list(CORRUPTIONS))
def test_a_bad_state_dict_raises_and_changes_nothing(name, case):
    change, error, message = CORRUPTIONS[name, case]
    cls, options = OPTIMIZERS[name]
    params, opt = trained(cls, **options)
    sd = roundtrip(opt.state_dict())
    change(sd)
    before = snapshot(opt)
    with pytest.raises(error, match=message):
        opt.load_state_dict(sd)
    assert_same_snapshot(before, snapshot(opt))


def test_load_state_dict_peak_memory_is_one_copy_of_the_state():
    """The state is checked and converted where it is, not written to an archive and read back
    (which held about four copies of it at once)."""
    script = pathlib.Path(__file__).resolve().parents[2] / "benchmarks/python/load_state_memory.py"
    if not script.exists() or not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs the repository's benchmarks/python and Linux's /proc")
    out = subprocess.run([sys.executable, str(script), "--size", "2000"], check=True,
                         capture_output=True, text=True, timeout=300).stdout
    state = float(re.search(r"state: ([\d.]+) MiB", out).group(1))
    increase = float(re.search(r"peak RSS increase ([-\d.]+) MiB", out).group(1))
    assert increase < 1.5 * state, out
