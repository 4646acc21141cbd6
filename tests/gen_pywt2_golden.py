#!/usr/bin/env python3
"""Writes tests/data/pywt_wavedec2.txt and tests/data/pywt_threshold.txt with PyWavelets.

Run by hand (pip install PyWavelets numpy); the output is committed, so the tests need no Python.
The data comes from PyWavelets, an implementation independent of gwt.

pywt_wavedec2.txt records: `case <wavelet> <mode> <rows> <cols> <level>`, then `x`, `a`, and per
level from the coarsest `h<k>`, `v<k>`, `d<k>` (pywt's (cH, cV, cD)); each row is
`<name> <rows> <cols> <values row-major...>`.
pywt_threshold.txt records: `case <mode> <value>`, then `x` and `y` (pywt.threshold(x, value, mode)).
"""
import os
import numpy as np
import pywt

here = os.path.dirname(os.path.abspath(__file__))
rng = np.random.default_rng(2501)


def row(name, a):
    a = np.atleast_2d(np.asarray(a, dtype=np.float64))
    return "%s %d %d %s" % (name, a.shape[0], a.shape[1], " ".join("%.17g" % v for v in a.ravel()))


lines = ["# PyWavelets %s wavedec2; float64; repr with 17 significant digits" % pywt.__version__]
for wavelet in ["haar", "db2", "sym3", "coif1"]:
    for mode in ["zero", "periodization", "symmetric"]:
        for rows, cols in [(8, 8), (9, 13), (16, 12), (17, 10)]:
            for level in [1, 2]:
                x = rng.standard_normal((rows, cols))
                coeffs = pywt.wavedec2(x, wavelet, mode=mode, level=level)
                lines.append("case %s %s %d %d %d" % (wavelet, mode, rows, cols, level))
                lines.append(row("x", x))
                lines.append(row("a", coeffs[0]))
                for k, (h, v, d) in zip(range(level, 0, -1), coeffs[1:]):
                    lines += [row("h%d" % k, h), row("v%d" % k, v), row("d%d" % k, d)]
with open(os.path.join(here, "data", "pywt_wavedec2.txt"), "w") as f:
    f.write("\n".join(lines) + "\n")

lines = ["# PyWavelets %s threshold; float64; repr with 17 significant digits" % pywt.__version__]
for mode in ["soft", "hard"]:
    for value in [0.0, 0.1, 0.5, 1.0, 2.5]:
        x = rng.standard_normal(64) * 2
        x[:4] = [value, -value, 0.0, value * 1.0000001]  # the edges of the rule
        y = pywt.threshold(x, value, mode=mode)
        lines.append("case %s %.17g" % (mode, value))
        lines.append("x " + " ".join("%.17g" % v for v in x))
        lines.append("y " + " ".join("%.17g" % v for v in y))
with open(os.path.join(here, "data", "pywt_threshold.txt"), "w") as f:
    f.write("\n".join(lines) + "\n")
