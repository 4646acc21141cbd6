"""Helpers of gwt's Python tests (imported by the test modules)."""

import os
import pathlib
import signal
import subprocess
import sys

import pytest
import torch

import gwt

# The golden data the C++ tests use (PyWavelets' output, the authors' optimizer's trajectories).
DATA_DIR = pathlib.Path(os.environ.get(
    "GWT_TEST_DATA_DIR", pathlib.Path(__file__).resolve().parents[2] / "tests" / "data"))

# Every device the tests can run on here: the CPU, and CUDA where torch sees a GPU and gwt was
# built with its CUDA kernels (otherwise CUDA tensors take the ATen reference, also tested).
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def read_records(name, start):
    """Records of a golden file: a line `<start> header...` opens one, each following line is
    `key v1 v2 ...` (floats); `#` lines are comments. Returns [(header words, {key: [floats]})]."""
    path = DATA_DIR / name
    if not path.exists():
        pytest.skip(f"golden data {path} not found (set GWT_TEST_DATA_DIR)")
    records = []
    with open(path) as f:
        for line in f:
            words = line.split()
            if not words or words[0].startswith("#"):
                continue
            if words[0] == start:
                records.append((words[1:], {}))
                continue
            assert records, f"data before the first record in {name}"
            records[-1][1][words[0]] = [float(w) for w in words[1:]]
    return records


def header_value(header, key):
    for word in header:
        if word.startswith(key + "="):
            return word[len(key) + 1:]
    raise KeyError(key)


def max_abs_diff(a, b):
    return (a.double() - b.double()).abs().max().item()


SHAPES = [(16, 64), (8, 24), (33,), (5, 3, 40), (12, 7)]


def make_grads(shapes, steps, dtype, device, nan_at=None):
    """Gradients that grow step by step (so that the norm-growth limiter acts); with nan_at =
    (step, index), that gradient holds a NaN."""
    grads = []
    for t in range(steps):
        step_grads = []
        for k, s in enumerate(shapes):
            g = torch.randn(s, dtype=torch.float64) * (1 + 2 * t)
            g = g.to(dtype=dtype, device=device)
            if nan_at == (t, k):
                g.view(-1)[3] = float("nan")
            step_grads.append(g)
        grads.append(step_grads)
    return grads


def run_python(cls, params0, grads, groups, **defaults):
    """`cls` over copies of params0, in groups of consecutive parameters: `groups` is a list of
    (count, options). Returns (params, optimizer)."""
    params = [p.clone().requires_grad_() for p in params0]
    param_groups, k = [], 0
    for count, options in groups:
        param_groups.append({"params": params[k:k + count], **options})
        k += count
    opt = cls(param_groups, **defaults)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = None if g is None else g.clone()
        opt.step()
    return params, opt


def run_cpp(prefix, opt, params0, grads, **paths):
    """The C++ optimizer (its own state across the steps, in C++) with opt's groups' options over
    copies of params0. Returns (params, states, counters)."""
    params = [p.clone().requires_grad_() for p in params0]
    groups, k = [], 0
    for group in opt.param_groups:
        n = len(group["params"])
        groups.append({**{key: v for key, v in group.items() if key != "params"},
                       "params": params[k:k + n]})
        k += n
    states, counters = getattr(gwt._C, "_run_cpp_" + prefix)(groups, grads, **paths)
    return params, states, counters


def assert_same(py_params, opt, cpp_params, cpp_states, keys):
    for k, (p, q) in enumerate(zip(py_params, cpp_params)):
        assert torch.equal(p.detach(), q.detach()), f"parameter {k}"
        py_state = opt.state.get(p)
        if cpp_states[k] is None:
            assert not py_state, f"parameter {k} has state in Python only"
            continue
        for key in keys:
            a, b = py_state.get(key), cpp_states[k].get(key)
            if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
                assert a is not None and b is not None, (k, key)
                assert a.dtype == b.dtype and torch.equal(a, b), (k, key)
            else:
                assert a == b, (k, key, a, b)


WAVELET_KEYS = ("step", "exp_avg", "exp_avg_sq", "norm", "skipped", "kept_details",
                "total_details")


def run_torchrun(script, nproc=2, timeout=120):
    """Runs `script` under torchrun with `nproc` ranks on this host (Gloo, CPU); returns its
    output, or fails the test if it does not finish in `timeout` seconds (then torchrun and every
    rank are killed) or exits non-zero."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if os.path.exists("/sys/class/net/lo"):  # Gloo would pick the interface of the host's name
        env["GLOO_SOCKET_IFNAME"] = "lo"
    # --standalone: torchrun's own rendezvous on a free local port (a port picked here could be
    # taken before torchrun binds it).
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
               str(nproc), str(script)]
    # A session of its own, so that a hang kills torchrun and every rank.
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"torchrun did not finish in {timeout} s:\n{output}")
    assert process.returncode == 0, output
    return output
