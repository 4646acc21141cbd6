"""benchmarks/python/step_time.py: its pure-PyTorch GWT computes the rule gwt.WaveletAdam does (so the
benchmark compares like with like), and the command prints its table."""

import importlib.util
import pathlib

import pytest
import torch

import gwt
from gwt_test_util import max_abs_diff

# The benchmark is not part of the package: it is read from the repository this file is in.
_SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "python" / "step_time.py"
if not _SCRIPT.is_file():
    pytest.skip(f"no {_SCRIPT} (tests run outside the repository)", allow_module_level=True)
_spec = importlib.util.spec_from_file_location("gwt_step_time", _SCRIPT)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_pure_torch_haar_transform_is_pywavelets_haar():
    x = torch.randn(3, 64, dtype=torch.float64)
    ours = bench.haar_wavedec(x, 3)
    # A bound from the data, not an absolute ulp: a level-l coefficient is 2^l inputs summed
    # pairwise with a factor 2^(-1/2) per level, two roundings per level in either code, on terms
    # at most 2^(l/2) max|x| (l <= 3); so each side is within 2 * 3 * u * 2^(3/2) max|x|
    # (u = 2^-53), and the two within twice that. The synthesis back to x the same way, doubled.
    # (An absolute 1e-15 failed under ATEN_CPU_CAPABILITY=default: 1.1e-15 on values near 4.)
    u = 2.0 ** -53
    bound = 2 * (2 * 3 * u * 2 ** 1.5) * x.abs().max().item()
    for a, b in zip(ours, gwt.wavedec(x, "haar", 3)):
        assert max_abs_diff(a, b) <= bound
    assert max_abs_diff(bench.haar_waverec(ours), x) <= 4 * bound


def test_pure_torch_gwt_follows_the_same_rule():
    # float64, 6 steps with growing gradients (the limiter acts), decay and scale. gwt's fused
    # Haar kernel computes the same update in another order of operations (its closed form per
    # block), so the two differ by rounding: a few ulps of the update (<= 1e-2 here) per step,
    # far below 1e-12; a different rule would differ by 1e-3 or more. Each gradient has one sign
    # (drawn per tensor and step; magnitudes in [0.5, 1.5)): on random signs a block sum can
    # nearly cancel, the step divides by it, and the difference would rest on how each side rounds
    # that sum.
    shapes = [(8, 64), (16, 32), (4, 3, 16)]
    params0 = [torch.randn(s, dtype=torch.float64) for s in shapes]
    a = [p.clone().requires_grad_() for p in params0]
    b = [p.clone().requires_grad_() for p in params0]
    options = dict(lr=1e-2, level=2, scale=0.25, weight_decay=0.1)
    ours = gwt.WaveletAdam(a, wavelet="haar", **options)
    pure = bench.PureTorchGWT(b, **options)
    for t in range(6):
        for p, q, s in zip(a, b, shapes):
            sign = 1.0 if torch.rand(()).item() < 0.5 else -1.0
            g = sign * (torch.rand(s, dtype=torch.float64) + 0.5) * (1 + 3 * t)
            p.grad, q.grad = g, g.clone()
        ours.step()
        pure.step()
        for p, q in zip(a, b):
            assert max_abs_diff(p, q) <= 1e-12, t
    for p, q in zip(a, b):
        assert max_abs_diff(ours.state[p]["exp_avg_sq"], pure.state[q]["exp_avg_sq"]) <= 1e-12


def test_the_command_prints_its_table(capsys):
    assert bench.main(["--workload", "tiny", "--rounds", "2", "--warmup", "1"]) == 0
    out = capsys.readouterr().out
    assert "| gwt.WaveletAdam |" in out and "| pure PyTorch GWT |" in out
    assert "| torch.optim.Adam(fused=True) |" in out and "Machine:" in out
