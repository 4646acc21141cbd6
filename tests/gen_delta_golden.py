#!/usr/bin/env python3
"""Golden values for gwt::nn::DeltaLinear's HRA forward, computed with NumPy alone (no gwt, no
torch): the dense product W' = W H_1 ... H_r with H_i = I - 2 u_i u_i^T / (u_i^T u_i), or with
gram_schmidt the HRA form W (I - 2 Q Q^T) where Q holds u_1..u_r orthonormalised by classical
Gram-Schmidt in order (PEFT's HRA apply_GS), and y = x W'^T + b, in float64.

Inputs are written exactly (17 significant digits), so the C++ test rebuilds the same W, u_i, b and
x and compares its forward with y here. Run: python3 tests/gen_delta_golden.py > tests/data/delta_hra_golden.txt
"""
import numpy as np


def reflection_product(u):
    n, r = u.shape
    h = np.eye(n)
    for i in range(r):
        v = u[:, i:i + 1]
        h = h @ (np.eye(n) - 2.0 * (v @ v.T) / float((v.T @ v)[0, 0]))
    return h


def gram_schmidt_form(u):
    n, r = u.shape
    q = np.zeros((n, r))
    for i in range(r):
        v = u[:, i].copy()
        for j in range(i):
            v = v - (q[:, j] @ u[:, i]) * q[:, j]
        q[:, i] = v / np.linalg.norm(v)
    return np.eye(n) - 2.0 * q @ q.T


def row(name, a):
    return name + " " + " ".join(repr(float(v)) for v in np.asarray(a).ravel())


def main():
    rng = np.random.default_rng(20261203)
    print("# HRA forward golden values (tests/gen_delta_golden.py, NumPy " + np.__version__ + ")")
    print("# case: in out r batch gram_schmidt; rows W [out*in], b [out], u [in*r] (column i = u_i,")
    print("# row-major [in, r]), x [batch*in], y [batch*out], all row-major float64")
    for in_f, out_f, r, batch, gs in [(6, 5, 1, 3, 0), (6, 5, 2, 3, 0), (8, 4, 3, 2, 0),
                                      (8, 4, 4, 2, 0), (7, 3, 3, 4, 1), (7, 3, 4, 4, 1)]:
        w = rng.standard_normal((out_f, in_f))
        b = rng.standard_normal(out_f)
        u = rng.standard_normal((in_f, r))
        x = rng.standard_normal((batch, in_f))
        h = gram_schmidt_form(u) if gs else reflection_product(u)
        y = x @ (w @ h).T + b
        print(f"case {in_f} {out_f} {r} {batch} {gs}")
        for name, a in [("W", w), ("b", b), ("u", u), ("x", x), ("y", y)]:
            print(row(name, a))


if __name__ == "__main__":
    main()
