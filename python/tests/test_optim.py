"""gwt.WaveletAdam and gwt.GaLoreAdam against the C++ optimizers, bit for bit, and against the GWT
authors' optimizer (tests/data/official_gwt_trajectories.txt)."""

import math

import pytest
import torch

import gwt
from gwt_test_util import (DEVICES, SHAPES, WAVELET_KEYS, assert_same, header_value, make_grads,
                           read_records, run_cpp, run_python)

WAVELET_CASES = {
    "haar L2 float32 (fused Haar kernel)": (torch.float32, [(5, {})], {}),
    "db2 float64 decay scale (general kernel)": (
        torch.float64, [(5, {})], dict(wavelet="db2", weight_decay=0.1, scale=0.25, lr=0.02)),
    "sym3 symmetric dim 0 reference": (
        torch.float64, [(5, {})], dict(wavelet="sym3", boundary="symmetric", level=1, dim=0,
                                       fused=False)),
    "coif1 periodization L3": (torch.float32, [(5, {})], dict(wavelet="coif1", level=3,
                                                              boundary="periodization")),
    "bfloat16 parameters": (torch.bfloat16, [(5, {})], dict(lr=0.01)),
    "bfloat16 state": (torch.float32, [(5, {})], dict(state_dtype="bfloat16")),
    "groups: 2d threshold, dense, min_size": (
        torch.float32,
        [(2, dict(transform="2d", level=1, threshold=0.05, threshold_mode="hard")),
         (2, dict(level=0, lr=0.003)), (1, dict(min_size=8))],
        dict(norm_growth_limit=1.05, correct_bias=False)),
    "no limiter": (torch.float64, [(5, {})], dict(norm_growth_limit=0.0, level=3)),
}

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(WAVELET_CASES))
def test_wavelet_adam_equals_the_cpp_optimizer_bit_for_bit(case, device):
    dtype, groups, defaults = WAVELET_CASES[case]
    params0 = [torch.randn(s, dtype=torch.float64).to(dtype=dtype, device=device) for s in SHAPES]
    grads = make_grads(SHAPES, 6, dtype, device)
    # A parameter without a gradient at a step takes no step.
    grads[2][1] = None
    py_params, opt = run_python(gwt.WaveletAdam, params0, grads, groups, **defaults)
    cpp_params, cpp_states, counters = run_cpp("wavelet_adam", opt, params0, grads)
    assert counters["skipped_steps"] == opt.skipped_steps() == 0
    assert_same(py_params, opt, cpp_params, cpp_states, WAVELET_KEYS)
    assert opt.state[py_params[1]]["step"] == 5
    assert not torch.equal(py_params[0].detach(), params0[0])  # they moved


@pytest.mark.parametrize("nonfinite", ["skip_step", "skip_param"])
def test_non_finite_gradients_are_skipped_as_in_cpp(nonfinite):
    params0 = [torch.randn(s) for s in SHAPES]
    grads = make_grads(SHAPES, 5, torch.float32, "cpu", nan_at=(2, 3))
    py_params, opt = run_python(gwt.WaveletAdam, params0, grads, [(5, {})], nonfinite=nonfinite)
    cpp_params, cpp_states, counters = run_cpp("wavelet_adam", opt, params0, grads)
    assert_same(py_params, opt, cpp_params, cpp_states, WAVELET_KEYS)
    assert opt.skipped_steps() == counters["skipped_steps"] == 1
    if nonfinite == "skip_step":
        assert opt.state[py_params[0]]["step"] == 4
        assert opt.skipped_steps(py_params[3]) == 0
    else:
        assert opt.state[py_params[0]]["step"] == 5
        assert opt.state[py_params[3]]["step"] == 4
        assert opt.skipped_steps(py_params[3]) == 1


GALORE_CASES = {
    "exact std": dict(rank=4, update_proj_gap=2),
    "randomized left, decay": dict(rank=3, update_proj_gap=3, svd="randomized",
                                   proj_type="left", weight_decay=0.05),
    "reverse_std float64": dict(rank=2, proj_type="reverse_std", scale=1.0),
}


@pytest.mark.parametrize("case", list(GALORE_CASES))
def test_galore_adam_equals_the_cpp_optimizer_bit_for_bit(case):
    dtype = torch.float64 if "float64" in case else torch.float32
    params0 = [torch.randn(s, dtype=dtype) for s in SHAPES]
    grads = make_grads(SHAPES, 5, dtype, "cpu")
    py_params, opt = run_python(gwt.GaLoreAdam, params0, grads, [(5, {})], **GALORE_CASES[case])
    cpp_params, cpp_states, counters = run_cpp("galore_adam", opt, params0, grads)
    assert_same(py_params, opt, cpp_params, cpp_states,
                ("step", "exp_avg", "exp_avg_sq", "projector", "right"))
    assert counters == {"skipped_steps": 0, "svd_fallbacks": 0}
    assert opt.is_projected_param(py_params[0]) and not opt.is_projected_param(py_params[2])


# The authors' WaveAdamW in float64 against gwt in float64. The rule reproduces it up to the order
# in which the transform and the limiter's norm add (docs/algorithm.md#the-update: 1e-14 observed
# after 12 steps); 1e-10 relative (floor 1e-3, so that values crossing zero do not blow up) leaves
# room for other vectorisations and FMA, and is far below any difference of rule (1e-3 and more).
# The C++ test uses the same bound.
@pytest.mark.parametrize("fused", [True, False])
def test_matches_the_authors_optimizer_trajectories(fused):
    records = read_records("official_gwt_trajectories.txt", "config")
    assert len(records) >= 2
    for header, rows in records:
        shape = [int(v) for v in header_value(header, "shape").split(",")]
        steps = int(header_value(header, "steps"))
        p = torch.tensor(rows["p0"], dtype=torch.float64).view(shape).requires_grad_()
        opt = gwt.WaveletAdam(
            [p], lr=float(header_value(header, "lr")), level=int(header_value(header, "level")),
            scale=float(header_value(header, "scale")),
            weight_decay=float(header_value(header, "wd")), betas=(0.9, 0.999), eps=1e-6,
            wavelet="haar", boundary="zero", fused=fused)
        assert opt.is_wavelet_param(p) and opt.is_fused_param(p) == fused
        for t in range(1, steps + 1):
            p.grad = torch.tensor(rows[f"g{t}"], dtype=torch.float64).view(shape)
            opt.step()
            expected = torch.tensor(rows[f"p{t}"], dtype=torch.float64).view(shape)
            rel = ((p.detach() - expected).abs() / expected.abs().clamp_min(1e-3)).max().item()
            assert rel <= 1e-10, (header, t, rel)


def test_steps_in_place_without_copies():
    p = torch.randn(64, 128, requires_grad=True)
    opt = gwt.WaveletAdam([p])
    p.grad = torch.randn_like(p)
    opt.step()
    state = opt.state[p]
    m, v = state["exp_avg"], state["exp_avg_sq"]
    pointers = (p.data_ptr(), m.data_ptr(), v.data_ptr())
    for _ in range(3):
        p.grad = torch.randn_like(p)
        opt.step()
    # The same tensor objects and the same memory: the C++ kernels wrote into them.
    assert opt.state[p]["exp_avg"] is m and opt.state[p]["exp_avg_sq"] is v
    assert (p.data_ptr(), m.data_ptr(), v.data_ptr()) == pointers
    assert m.shape == (64, 32) and opt.state[p]["step"] == 4
    # Moments: 2 x 64 x 32 float32 values, plus the limiter's float32 norm.
    assert opt.state_bytes() == opt.state_bytes(p) == 2 * 64 * 32 * 4 + 4


def test_group_options_are_used_as_given():
    a = torch.randn(8, 64, requires_grad=True)
    b = torch.randn(8, 64, requires_grad=True)
    opt = gwt.WaveletAdam([{"params": [a], "level": 3}, {"params": [b]}], level=1)
    a.grad, b.grad = torch.randn_like(a), torch.randn_like(b)
    opt.step()
    assert opt.state[a]["exp_avg"].shape == (8, 8)
    assert opt.state[b]["exp_avg"].shape == (8, 32)
    # A group added later, with its own options.
    c = torch.randn(4, 16, requires_grad=True)
    opt.add_param_group({"params": [c], "wavelet": "db2", "level": 2})
    c.grad = torch.randn_like(c)
    opt.step()
    assert opt.state[c]["exp_avg"].shape == (4, gwt._C.approx_len(16, "db2", 2, "zero"))
    assert opt.is_wavelet_param(c) and opt.is_fused_param(c)


def test_closure_zero_grad_and_lr_schedulers():
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    x, y = torch.randn(64, 16), torch.randn(64, 4)
    opt = gwt.WaveletAdam(gwt.paper_param_groups(model), lr=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 0.5 ** t)

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    for t in range(4):
        with torch.no_grad():
            expected = torch.nn.functional.mse_loss(model(x), y)
        assert torch.equal(opt.step(closure), expected)  # computed before the update
        sched.step()
        assert opt.state[model[0].weight]["step"] == t + 1
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01 * 0.5 ** 4)
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())

    # The scheduler's lr is the one the C++ step uses: the same steps with the lr set by hand.
    torch.manual_seed(2)
    p0 = torch.randn(8, 32)
    grads = make_grads([(8, 32)], 4, torch.float32, "cpu")
    a = p0.clone().requires_grad_()
    b = p0.clone().requires_grad_()
    opt_a = gwt.WaveletAdam([a], lr=0.1, weight_decay=0.1)
    opt_b = gwt.WaveletAdam([b], lr=0.1, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt_a, step_size=1, gamma=0.3)
    for t, (g,) in enumerate(grads):
        a.grad, b.grad = g.clone(), g.clone()
        # The scheduler's lr (0.1 times 0.3 per step, multiplied up step by step) set by hand.
        assert math.isclose(opt_a.param_groups[0]["lr"], 0.1 * 0.3 ** t, rel_tol=1e-12)
        opt_b.param_groups[0]["lr"] = opt_a.param_groups[0]["lr"]
        opt_a.step()
        opt_b.step()
        sched.step()
        assert torch.equal(a, b)
    # lr 0: the moments move, the parameter does not (weight decay is lr x weight_decay).
    opt_a.param_groups[0]["lr"] = 0.0
    before, m_before = a.detach().clone(), opt_a.state[a]["exp_avg"].clone()
    a.grad = torch.randn_like(a)
    opt_a.step()
    assert torch.equal(a, before) and not torch.equal(opt_a.state[a]["exp_avg"], m_before)


def test_gradients_of_another_dtype_and_frozen_parameters():
    w = torch.randn(8, 16, dtype=torch.bfloat16, requires_grad=True)
    frozen = torch.randn(8, 16, requires_grad=True)
    opt = gwt.WaveletAdam([w, frozen])
    w.grad = torch.randn(8, 16, dtype=torch.bfloat16)
    opt.step()
    assert frozen not in opt.state and opt.state[w]["exp_avg"].dtype == torch.float32
    assert opt.state[w]["norm"].dtype == torch.float32


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_moments_stay_on_the_device():
    p = torch.randn(32, 64, device="cuda", requires_grad=True)
    opt = gwt.WaveletAdam([p])
    p.grad = torch.randn_like(p)
    opt.step()
    assert opt.state[p]["exp_avg"].is_cuda and opt.state[p]["norm"].is_cuda
    # The fused kernels where this build has them for this GPU (else the reference, with a warning).
    assert opt.is_fused_param(p) == gwt._C.cuda_kernels_run_on(p.device.index or 0)
    assert math.isfinite(p.sum().item())


def test_amp_grad_scaler_skips_overflowed_steps():
    p = torch.randn(8, 32, requires_grad=True)
    opt = gwt.WaveletAdam([p])
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    scaler.scale(p.sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert opt.state[p]["step"] == 1
    before = p.detach().clone()
    opt.zero_grad()
    scaler.scale(p.sum() * float("inf")).backward()
    scaler.step(opt)  # the scaler sees the infinity and does not call step
    scaler.update()
    assert torch.equal(p, before) and opt.state[p]["step"] == 1
    assert scaler.get_scale() < 2.0 ** 10


def test_thresholding_reports_kept_details():
    p = torch.randn(8, 64, requires_grad=True)
    q = torch.randn(8, 64, requires_grad=True)
    opt = gwt.WaveletAdam([p, q], threshold=0.5, threshold_mode="hard")
    p.grad, q.grad = torch.randn_like(p), torch.randn_like(q)
    opt.step()
    kept, total = opt.kept_details()
    assert total == 2 * 8 * (32 + 16) and 0 < kept < total
    q.grad = None  # q keeps its report from the step before, as in C++
    p.grad = torch.randn_like(p)
    opt.step()
    assert opt.kept_details()[1] == total
