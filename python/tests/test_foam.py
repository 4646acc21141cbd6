"""gwt.FoamAdam: FOAM's rule (docs/algorithm.md#foam) through the Python package, against the
authors' optimizer and the rule in NumPy, and with the same contract as gwt.WaveletAdam
(state_dict, C++ checkpoints, errors)."""

import copy

import pytest
import torch

import gwt
from gwt_test_util import SHAPES, assert_same, header_value, make_grads, read_records, run_cpp

FOAM_KEYS = ("step", "exp_avg", "exp_avg_sq", "skipped")


def optional(header, key, default):
    try:
        return header_value(header, key)
    except KeyError:
        return default


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("name", ["foam_trajectories.txt", "foam_rule_golden.txt"])
def test_follows_the_authors_optimizer_and_the_rule_in_numpy(name, fused):
    # foam_trajectories.txt: the FOAM authors' optimizer (foam_torch/foam_adam.py) in float64;
    # foam_rule_golden.txt: the rule written in NumPy (tests/gen_foam_golden.py: odd lengths,
    # levels 1 to 4, 3-D, dim, res_scale, beta2, eps, no bias correction, a dense group).
    # 1e-9 relative (with a 1e-3 floor on |p|): both sides are float64 with a few roundings per
    # element and step (a sum of 2^level values, a square root, a division), so they differ by
    # at most ~1e-15 relative per step over 12 steps; a wrong option or padding differs by 1e-3
    # or more (the C++ tests' mutations).
    records = read_records(name, "config")
    assert records
    for header, values in records:
        shape = [int(v) for v in header_value(header, "shape").split(",")]
        steps = int(header_value(header, "steps"))
        p = torch.tensor(values["p0"], dtype=torch.float64).reshape(shape).requires_grad_()
        opt = gwt.FoamAdam(
            [p], lr=float(header_value(header, "lr")),
            betas=(0.9, float(header_value(header, "b2"))),
            eps=float(header_value(header, "eps")),
            weight_decay=float(header_value(header, "wd")),
            level=int(header_value(header, "level")),
            scale=float(header_value(header, "scale")),
            res_scale=float(header_value(header, "res_scale")),
            dim=int(optional(header, "dim", -1)),
            correct_bias=optional(header, "bias", "1") == "1", fused=fused)
        # The fused kernels take blocks along the last dimension (and dense groups).
        dim = int(optional(header, "dim", -1))
        assert opt.is_fused_param(p) == (fused and dim in (-1, len(shape) - 1)
                                         or fused and int(header_value(header, "level")) == 0)
        for t in range(1, steps + 1):
            p.grad = torch.tensor(values[f"g{t}"], dtype=torch.float64).reshape(shape)
            opt.step()
            expected = torch.tensor(values[f"p{t}"], dtype=torch.float64).reshape(shape)
            error = ((p.detach() - expected).abs() / expected.abs().clamp_min(1e-3)).max().item()
            assert error <= 1e-9, (header, t, error)


@pytest.mark.parametrize("nonfinite", ["skip_step", "skip_param"])
def test_steps_as_the_cpp_optimizer_alone(nonfinite):
    params0 = [torch.randn(s, dtype=torch.float64) for s in SHAPES]
    grads = make_grads(SHAPES, 5, torch.float64, "cpu", nan_at=(2, 1))
    params = [p.clone().requires_grad_() for p in params0]
    opt = gwt.FoamAdam([{"params": params[:3]}, {"params": params[3:], "level": 0}], lr=1e-2,
                       scale=0.25, res_scale=0.5, weight_decay=0.1, nonfinite=nonfinite)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()
    cpp_params, cpp_states, counters = run_cpp("foam_adam", opt, params0, grads)
    assert_same(params, opt, cpp_params, cpp_states, FOAM_KEYS)
    assert counters["skipped_steps"] == opt.skipped_steps() == 1
    assert opt.skipped_steps(params[1]) == (1 if nonfinite == "skip_param" else 0)
    assert [opt.is_folded_param(p) for p in params] == [True, True, True, False, False]


def train(opt, params, grads):
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()


@pytest.mark.parametrize("state_dtype", ["auto", "bfloat16"])
def test_state_dict_and_cpp_archive_resume_bit_for_bit(tmp_path, state_dtype):
    params0 = [torch.randn(s) for s in SHAPES]
    grads = make_grads(SHAPES, 6, torch.float32, "cpu")
    options = dict(lr=1e-2, scale=0.25, state_dtype=state_dtype)
    params = [p.clone().requires_grad_() for p in params0]
    opt = gwt.FoamAdam(params, **options)
    train(opt, params, grads[:3])
    saved = copy.deepcopy(opt.state_dict())
    opt.save_archive(tmp_path / "foam.pt")
    mid = [p.detach().clone() for p in params]
    train(opt, params, grads[3:])
    for load in ("state_dict", "archive"):
        again = [p.clone().requires_grad_() for p in mid]
        other = gwt.FoamAdam(again, **options)
        if load == "state_dict":
            other.load_state_dict(saved)
        else:
            other.load_archive(tmp_path / "foam.pt")
        train(other, again, grads[3:])
        for k, (p, q) in enumerate(zip(params, again)):
            assert torch.equal(p, q), (load, k)
        assert all(other.state[q]["exp_avg"].dtype == opt.state[p]["exp_avg"].dtype
                   for p, q in zip(params, again))


def test_state_is_a_quarter_at_level_two_and_the_groups_are_the_authors():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 16), torch.nn.Linear(16, 32),
                                torch.nn.LayerNorm(32))
    groups = gwt.foam_param_groups(model, head_names=())
    assert [len(g["params"]) for g in groups] == [1, 4]  # Linear's weight; the rest dense
    assert groups[1]["level"] == 0
    p = torch.randn(8, 64, requires_grad=True)
    opt = gwt.FoamAdam([p])
    p.grad = torch.randn(8, 64)
    opt.step()
    assert opt.state_bytes() == 2 * 8 * 16 * 4
    assert tuple(opt.state[p]["exp_avg"].shape) == (8, 16)
    assert opt.is_fused_param(p) and opt.is_folded_param(p)
    assert not gwt.FoamAdam([p], fused=False).is_fused_param(p)
    assert not gwt.FoamAdam([p], dim=0).is_fused_param(p)  # blocks along a dimension not last


@pytest.mark.parametrize("options, message", [
    (dict(lr=-1.0), "learning rate"),
    (dict(level=-1), "level"),
    (dict(res_scale=float("nan")), "res_scale"),
    (dict(state_dtype="int8"), "state_dtype"),
    (dict(nonfinite="ignore"), "nonfinite"),
])
def test_bad_options_are_value_errors_with_nothing_added(options, message):
    p = torch.randn(4, 8, requires_grad=True)
    with pytest.raises(ValueError, match=message):
        gwt.FoamAdam([p], **options)
    opt = gwt.FoamAdam([p])
    q = torch.randn(4, 8, requires_grad=True)
    with pytest.raises(ValueError, match=message):
        opt.add_param_group({"params": [q], **options})
    assert len(opt.param_groups) == 1


def test_bad_option_type_is_a_type_error():
    with pytest.raises(TypeError, match="level"):
        gwt.FoamAdam([torch.randn(4, 8, requires_grad=True)], level=2.5)
