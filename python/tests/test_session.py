"""A Python optimizer keeps its C++ optimizer across steps (a session, python/gwt/optim.py): the
step counts and norms it keeps come back into ``optimizer.state`` only when Python code reads it,
so that a step of CUDA parameters never waits for the device (and can be captured in a CUDA
graph). These tests hold that reading or not reading the state, or changing it from Python, never
changes a result: every comparison is bit for bit, in float64 on the CPU, and with the device
path's kernels emulated on the host (``_C._emulate_device_steps_on_cpu``: the counts then live in
what stands for device memory, as on a GPU)."""

import copy
import pickle

import pytest
import torch

import gwt
from gwt_test_util import SHAPES, WAVELET_KEYS, assert_same, make_grads, run_cpp

STEPS = 6
OPTIONS = dict(lr=1e-2, weight_decay=0.1, scale=0.5)


@pytest.fixture(params=[False, True], ids=["host", "emulated_device"])
def emulated(request):
    gwt._C._emulate_device_steps_on_cpu(request.param)
    yield request.param
    gwt._C._emulate_device_steps_on_cpu(False)


def params_and_grads(nonfinite_at=(3, 1)):
    params0 = [torch.randn(s, dtype=torch.float64) for s in SHAPES]
    return params0, make_grads(SHAPES, STEPS, torch.float64, "cpu", nan_at=nonfinite_at)


def train(params0, grads, look, nonfinite="skip_step", cls=gwt.WaveletAdam, options=OPTIONS):
    """STEPS steps with an LR scheduler; after each, `look` does what Python code may do with the
    state: nothing, read it, or replace a moment (the next step must then start from Python's
    state)."""
    params = [p.clone().requires_grad_() for p in params0]
    opt = cls(params, **options, **({"nonfinite": nonfinite} if cls is gwt.WaveletAdam else {}))
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()
        scheduler.step()
        if look == "read":
            assert all(isinstance(s["step"], int) for s in opt.state.values())
        elif look == "replace":
            s = opt.state[params[0]]
            s["exp_avg"] = s["exp_avg"].clone()
    return params, opt


def assert_same_run(a, b):
    (pa, oa), (pb, ob) = a, b
    for k, (p, q) in enumerate(zip(pa, pb)):
        assert torch.equal(p, q), f"parameter {k}"
    sa, sb = oa.state_dict(), ob.state_dict()
    assert sa.keys() == sb.keys()
    assert sa["state"].keys() == sb["state"].keys()
    for index, entry in sa["state"].items():
        other = sb["state"][index]
        assert entry.keys() == other.keys(), index
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                assert value.dtype == other[key].dtype and torch.equal(value, other[key]), (index, key)
            else:
                assert value == other[key], (index, key)
    assert oa.skipped_steps() == ob.skipped_steps()


@pytest.mark.parametrize("nonfinite", ["skip_step", "skip_param"])
def test_reading_or_changing_the_state_changes_no_result(emulated, nonfinite):
    params0, grads = params_and_grads()
    unread = train(params0, grads, "nothing", nonfinite)
    assert_same_run(unread, train(params0, grads, "read", nonfinite))
    assert_same_run(unread, train(params0, grads, "replace", nonfinite))
    assert unread[1].skipped_steps() == 1
    assert all(s["step"] == (STEPS - 1 if nonfinite == "skip_step" or k == 1 else STEPS)
               for k, s in enumerate(unread[1].state[p] for p in unread[0]))


def test_a_session_steps_as_the_cpp_optimizer_alone(emulated):
    # The C++ optimizer keeping its state in C++ across the steps (no scheduler there).
    params0, grads = params_and_grads()
    params = [p.clone().requires_grad_() for p in params0]
    opt = gwt.WaveletAdam(params, **OPTIONS)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()
    cpp_params, cpp_states, counters = run_cpp("wavelet_adam", opt, params0, grads)
    assert_same(params, opt, cpp_params, cpp_states, WAVELET_KEYS)
    assert counters["skipped_steps"] == opt.skipped_steps() == 1


def test_the_state_is_written_when_read_not_at_each_step(emulated):
    params0, grads = params_and_grads(nonfinite_at=None)
    params, opt = train(params0, grads[:1], "nothing")
    session = opt._session
    assert opt.state[params[0]]["step"] == 1  # read once, after the first step
    raw = opt.__dict__["state"]
    for step_grads in grads[1:]:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()
    assert opt._session is session  # one C++ optimizer for every step
    assert raw[params[0]]["step"] == 1  # not written back since the first read
    assert opt.state[params[0]]["step"] == STEPS  # reading it brings it up to date
    assert opt._session is session  # reading changes nothing: the same C++ optimizer goes on


def test_a_new_cpp_optimizer_when_parameters_or_state_change():
    params0, grads = params_and_grads(nonfinite_at=None)
    params, opt = train(params0, grads[:2], "nothing")
    first = opt._session
    assert opt.state  # read, not changed
    opt.step()
    assert opt._session is first
    opt.state[params[1]]["step"] = 0  # the next step's bias correction is step 1's
    opt.step()
    assert opt._session is not first
    second = opt._session
    extra = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    extra.grad = torch.randn(4, 8, dtype=torch.float64)
    opt.add_param_group({"params": [extra]})
    opt.step()
    assert opt._session is not second
    assert opt.state[extra]["step"] == 1


def test_a_step_count_set_from_python_is_used():
    params0, grads = params_and_grads(nonfinite_at=None)
    params, opt = train(params0, grads[:2], "nothing")
    opt.state[params[0]]["step"] = 0
    saved = copy.deepcopy(opt.state_dict())
    fresh = [p.detach().clone().requires_grad_() for p in params]
    other = gwt.WaveletAdam(fresh, **OPTIONS)
    other.load_state_dict(saved)
    for p, q, g in zip(params, fresh, grads[2]):
        p.grad, q.grad = g.clone(), g.clone()
    opt.step()
    other.step()
    assert opt.state[params[0]]["step"] == 1
    assert_same_run((params, opt), (fresh, other))


def test_copies_and_pickles_hold_the_current_state(emulated):
    params0, grads = params_and_grads(nonfinite_at=None)
    params, opt = train(params0, grads, "nothing")
    for clone in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        states = list(clone.state.values())
        assert len(states) == len(params) and all(s["step"] == STEPS for s in states)


def test_a_failed_step_leaves_the_state_and_the_next_step_as_without_it(emulated):
    params0, grads = params_and_grads(nonfinite_at=None)
    runs = []
    for fail_at in (None, 3):
        params = [p.clone().requires_grad_() for p in params0]
        opt = gwt.WaveletAdam(params, **OPTIONS)
        for t, step_grads in enumerate(grads):
            for p, g in zip(params, step_grads):
                p.grad = g.clone()
            if t == fail_at:
                opt.param_groups[0]["lr"] = -1.0  # checked before any update
                with pytest.raises((ValueError, RuntimeError), match="learning rate"):
                    opt.step()
                opt.param_groups[0]["lr"] = OPTIONS["lr"]
            opt.step()
        runs.append((params, opt))
    assert_same_run(*runs)


def test_galore_reading_or_changing_the_state_changes_no_result():
    params0 = [torch.randn(16, 32, dtype=torch.float64), torch.randn(24, dtype=torch.float64)]
    grads = [[torch.randn_like(p) * (1 + t) for p in params0] for t in range(STEPS)]
    options = dict(lr=1e-2, rank=4, update_proj_gap=2)
    unread = train(params0, grads, "nothing", cls=gwt.GaLoreAdam, options=options)
    assert_same_run(unread, train(params0, grads, "read", cls=gwt.GaLoreAdam, options=options))
    assert_same_run(unread, train(params0, grads, "replace", cls=gwt.GaLoreAdam, options=options))
    assert unread[1].svd_fallbacks() == 0


@pytest.mark.skipif(not (torch.cuda.is_available() and gwt.built_with_cuda()),
                    reason="needs a GPU and gwt's CUDA kernels")
def test_a_captured_step_replays_as_eager_steps():
    # docs/performance.md#capturing-a-step-in-a-cuda-graph: warm up on a side stream, capture,
    # replay. A skipped step (an infinity in a gradient) is among the replays.
    torch.manual_seed(0)
    shapes = [(512, 512), (1376, 512), (512,)]
    grads = [[torch.randn(s, device="cuda") * (1 + t) for s in shapes] for t in range(8)]
    grads[6][1][3, 5] = float("inf")
    params0 = [torch.randn(s, device="cuda") for s in shapes]

    def eager():
        params = [p.clone().requires_grad_() for p in params0]
        opt = gwt.WaveletAdam(params, lr=1e-2)
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = g.clone()
            opt.step()
        return params, opt

    params = [p.clone().requires_grad_() for p in params0]
    for p in params:
        p.grad = torch.empty_like(p)
    opt = gwt.WaveletAdam(params, lr=1e-2)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for step_grads in grads[:3]:
            for p, g in zip(params, step_grads):
                p.grad.copy_(g)
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    for step_grads in grads[3:]:
        for p, g in zip(params, step_grads):
            p.grad.copy_(g)
        graph.replay()
    assert_same_run(eager(), (params, opt))
