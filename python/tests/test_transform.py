"""gwt's transforms through Python against PyWavelets: the golden files the C++ tests use
(tests/data, written by PyWavelets 1.1.1) and PyWavelets itself on random inputs.

Tolerances, float64 throughout: a coefficient after L levels is a sum of at most F products per
level (F <= 18 taps, coif3) of values of magnitude at most ~2^(L/2) max|x| (about 10 here), so the
two implementations, which may add in different orders, differ by at most about
L * F * 10 * 2.2e-16 (4e-13 for L = 5, F = 18). 1e-12 is above that and far below any wrong
filter, mode or coefficient order (errors of order 1).
"""

import zlib

import numpy as np
import pytest
import torch

import gwt
from gwt_test_util import max_abs_diff, read_records

pywt = pytest.importorskip("pywt")

# PyWavelets warns when a level leaves every coefficient touched by the boundary; those levels are
# tested on purpose.
pytestmark = pytest.mark.filterwarnings("ignore:Level value of:UserWarning")

TOL = 1e-12
MODES = ["zero", "periodization", "symmetric"]


def test_lists_match_pywavelets():
    assert "haar" in gwt.wavelets() and "coif3" in gwt.wavelets()
    assert sorted(gwt.modes()) == sorted(MODES)
    for name in gwt.wavelets():
        assert name in pywt.wavelist(kind="discrete"), name


@pytest.mark.parametrize("name", ["haar", "db1", "db2", "db4", "db8", "sym2", "sym5", "sym8",
                                  "coif1", "coif3"])
def test_filters_are_pywavelets_filters(name):
    # gwt's filter tables are PyWavelets' coefficients; both are the same float64 literals.
    w = pywt.Wavelet(name)
    dec_lo, dec_hi, rec_lo, rec_hi = gwt.wavelet_filters(name)
    for ours, theirs in [(dec_lo, w.dec_lo), (dec_hi, w.dec_hi), (rec_lo, w.rec_lo),
                         (rec_hi, w.rec_hi)]:
        np.testing.assert_array_equal(ours, theirs)


def test_wavedec_matches_the_pywavelets_golden_file():
    records = read_records("pywt_wavedec.txt", "case")
    assert len(records) > 300
    for header, rows in records:
        wavelet, mode, n, level = header[0], header[1], int(header[2]), int(header[3])
        x = torch.tensor(rows["x"], dtype=torch.float64)
        assert x.numel() == n
        coeffs = gwt.wavedec(x, wavelet, level, mode=mode)
        assert len(coeffs) == level + 1
        expected = [rows[f"a{level}"]] + [rows[f"d{k}"] for k in range(level, 0, -1)]
        for got, want in zip(coeffs, expected):
            want = torch.tensor(want, dtype=torch.float64)
            assert got.shape == want.shape, (header, got.shape, want.shape)
            assert max_abs_diff(got, want) <= TOL, header


def test_wavedec2_matches_the_pywavelets_golden_file():
    records = read_records("pywt_wavedec2.txt", "case")
    assert records
    for header, rows in records:
        wavelet, mode, level = header[0], header[1], int(header[-1])

        def matrix(key):
            r = rows[key]
            return torch.tensor(r[2:], dtype=torch.float64).view(int(r[0]), int(r[1]))

        x = matrix("x")
        coeffs = gwt.wavedec2(x, wavelet, level, mode=mode)
        assert max_abs_diff(coeffs[0], matrix("a")) <= TOL, header
        for k in range(level):
            for s, name in enumerate("hvd"):
                key = f"{name}{level - k}"
                assert max_abs_diff(coeffs[k + 1][s], matrix(key)) <= TOL, (header, key)


@pytest.mark.parametrize("wavelet", gwt.wavelets())
def test_wavedec_and_waverec_equal_pywavelets_on_random_inputs(wavelet):
    rng = np.random.default_rng(zlib.crc32(wavelet.encode()))
    for mode in MODES:
        for n in (1, 2, 7, 16, 33, 100):
            for level in (1, 2, 3, 5):
                x = rng.standard_normal((3, n))
                expected = pywt.wavedec(x, wavelet, mode=mode, level=level, axis=-1)
                got = gwt.wavedec(torch.from_numpy(x), wavelet, level, mode=mode)
                assert len(got) == len(expected)
                for g, e in zip(got, expected):
                    assert tuple(g.shape) == e.shape, (mode, n, level)
                    assert max_abs_diff(g, torch.from_numpy(e)) <= TOL, (mode, n, level)
                # Reconstruction from the same coefficients: the same samples as pywt.waverec
                # (which may be one longer for odd n) and, cropped, the input.
                back = gwt.waverec([torch.from_numpy(c) for c in expected], wavelet, mode=mode)
                pywt_back = pywt.waverec(expected, wavelet, mode=mode, axis=-1)
                assert tuple(back.shape) == pywt_back.shape, (mode, n, level)
                assert max_abs_diff(back, torch.from_numpy(pywt_back)) <= TOL, (mode, n, level)


@pytest.mark.parametrize("mode", MODES)
def test_transform_dimension_and_single_levels(mode):
    x = np.random.default_rng(5).standard_normal((21, 4, 3))
    for dim in (0, 1, -1):
        expected = pywt.wavedec(x, "db3", mode=mode, level=2, axis=dim)
        got = gwt.wavedec(torch.from_numpy(x), "db3", 2, dim=dim, mode=mode)
        for g, e in zip(got, expected):
            assert max_abs_diff(g, torch.from_numpy(e)) <= TOL
    a, d = pywt.dwt(x, "sym4", mode=mode, axis=0)
    ga, gd = gwt.dwt(torch.from_numpy(x), "sym4", dim=0, mode=mode)
    assert max_abs_diff(ga, torch.from_numpy(a)) <= TOL
    assert max_abs_diff(gd, torch.from_numpy(d)) <= TOL
    back = gwt.idwt(ga, gd, "sym4", dim=0, mode=mode)
    assert max_abs_diff(back, torch.from_numpy(pywt.idwt(a, d, "sym4", mode=mode, axis=0))) <= TOL


@pytest.mark.parametrize("mode", MODES)
def test_wavedec2_and_waverec2_equal_pywavelets(mode):
    x = np.random.default_rng(9).standard_normal((2, 19, 24))
    for wavelet in ("haar", "db2", "coif1"):
        expected = pywt.wavedec2(x, wavelet, mode=mode, level=2)
        got = gwt.wavedec2(torch.from_numpy(x), wavelet, 2, mode=mode)
        assert max_abs_diff(got[0], torch.from_numpy(expected[0])) <= TOL
        for g, e in zip(got[1:], expected[1:]):
            for gs, es in zip(g, e):
                assert max_abs_diff(gs, torch.from_numpy(es)) <= TOL
        back = gwt.waverec2(got, wavelet, mode=mode)
        pywt_back = pywt.waverec2(expected, wavelet, mode=mode)
        assert tuple(back.shape) == pywt_back.shape
        assert max_abs_diff(back, torch.from_numpy(pywt_back)) <= TOL


def test_threshold_equals_pywavelets():
    x = np.random.default_rng(3).standard_normal(200)
    for mode in ("soft", "hard"):
        for value in (0.1, 0.5, 2.0):
            expected = pywt.threshold(x, value, mode=mode)
            # Both round a product or difference of x once or twice (x (1 - t/|x|) against
            # sign(x) (|x| - t)): element by element within 4 ulps of |x|, a bound from the data
            # (an absolute 1e-15 would be a coin toss for |x| > 2, whose ulp is 4.4e-16).
            got = gwt.threshold(torch.from_numpy(x), value, mode)
            diff = (got - torch.from_numpy(expected)).abs()
            assert bool((diff <= 4 * 2.0 ** -52 * torch.from_numpy(np.abs(x))).all())


def test_level_none_is_the_pywavelets_maximum():
    x = torch.randn(100, dtype=torch.float64)
    assert len(gwt.wavedec(x, "db2")) == pywt.dwt_max_level(100, "db2") + 1
    assert gwt.dwt_max_level(100, "db2") == pywt.dwt_max_level(100, "db2")


def test_float32_and_autograd():
    x32 = torch.randn(4, 64)
    assert all(c.dtype == torch.float32 for c in gwt.wavedec(x32, "db2", 2))
    # waverec(wavedec(x)) is the identity for an orthogonal wavelet: its gradient is all ones. In
    # float64, where the filters' orthogonality holds to a few ulps (each gradient value is a sum
    # of a few dozen products of taps below 1), so 1e-12 cannot fail by rounding.
    x = x32.double().requires_grad_(True)
    gwt.waverec(gwt.wavedec(x, "db2", 2), "db2", length=64).sum().backward()
    assert torch.allclose(x.grad, torch.ones_like(x), rtol=0, atol=1e-12)
