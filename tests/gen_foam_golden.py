#!/ usr / bin / env python3
"""Writes tests/data/foam_rule_golden.txt: trajectories of the FOAM rule (docs/algorithm.md#foam),
implemented here in float64 NumPy from the rule's text alone (not from gwt's C++), for the cases the
authors' two recorded trajectories (foam_trajectories.txt) do not cover: odd lengths, levels 1 to 4,
a block longer than the row, 3-D parameters, dim 0 and 1, a 1-D parameter, res_scale 0, 0.5 and 2,
beta2 0.95, eps 1e-6, no bias correction, weight decay, and a dense group.

    python3 tests/gen_foam_golden.py        # needs numpy; writes the file next to the tests

Records as in foam_trajectories.txt: `config key=value ...` (keys level, scale, res_scale, lr, wd,
eps, b2, shape, steps, and here also dim and bias = correct_bias 0/1; beta1 is 0.9), then `p0`,
and for each step t `g<t>` (the gradient given) and `p<t>` (the parameter after the step), every
tensor flattened row-major, values as Python's repr (they read back exactly)."""

import math
import pathlib

import numpy as np

BETA1 = 0.9


def blocks(x, level):
    """x [..., n] as [..., ceil(n / B), B], the last block padded with zeros (B = 2^level)."""
    b = 2 ** level
    n = x.shape[-1]
    nb = -(-n // b)
    padded = np.concatenate([x, np.zeros(x.shape[:-1] + (nb * b - n,))], axis=-1)
    return padded.reshape(x.shape[:-1] + (nb, b))


def unfold(x, level, n):
    """Each block's value repeated B times, the padding dropped: [..., nb] to [..., n]."""
    return np.repeat(x, 2 ** level, axis=-1)[..., :n]


def foam_step(p, g, state, c):
    """One step of the rule on p (float64), in place of state ({m, v, t})."""
    b2 = c["b2"]
    state["t"] += 1
    t = state["t"]
    if c["level"] == 0:  # a dense group: Adam
        state["m"] = BETA1 * state["m"] + (1 - BETA1) * g
        state["v"] = b2 * state["v"] + (1 - b2) * g * g
        u = state["m"] / (np.sqrt(state["v"]) + c["eps"])
    else:
        level, rho = c["level"], c["res_scale"]
        gl = np.moveaxis(g, c["dim"], -1)
        n = gl.shape[-1]
        a = blocks(gl, level).sum(axis=-1) / 2 ** level  # mean over B, padding included
        s = blocks(gl * gl, level).sum(axis=-1) / 2 ** level
        res = gl - unfold(a, level, n)
        state["m"] = BETA1 * state["m"] + (1 - BETA1) * a
        state["v"] = b2 * state["v"] + (1 - b2) * s
        big_m = unfold(state["m"], level, n) + rho * res
        big_v = unfold(state["v"], level, n) + rho * rho * res * res
        u = np.moveaxis(c["scale"] * big_m / (np.sqrt(big_v) + c["eps"]), -1, c["dim"])
    step = c["lr"]
    if c["bias"]:
        step = c["lr"] * math.sqrt(1 - b2 ** t) / (1 - BETA1 ** t)
    p = p - step * u
    if c["wd"] > 0:
        p = p - c["lr"] * c["wd"] * p
    return p


def moment_shape(shape, c):
    if c["level"] == 0:
        return shape
    dim = c["dim"] % len(shape)
    out = list(shape)
    out[dim] = -(-shape[dim] // 2 ** c["level"])
    return tuple(out)


BASE = dict(level=2, scale=1.0, res_scale=1.0, lr=0.01, wd=0.0, eps=1e-8, b2=0.999, dim=-1,
            bias=1, steps=8)
CASES = [
    dict(name="odd_n13_l2", shape=(3, 13), scale=0.25),
    dict(name="odd_n7_l3", shape=(4, 7), level=3),
    dict(name="l1_res_half_wd", shape=(5, 10), level=1, res_scale=0.5, wd=0.1, lr=0.003),
    dict(name="l4_res0_n37", shape=(2, 37), level=4, res_scale=0.0, scale=0.25),
    dict(name="l4_block_longer_than_row", shape=(3, 5), level=4),
    dict(name="l2_3d", shape=(2, 3, 9)),
    dict(name="l2_3d_dim1_res2", shape=(2, 9, 3), dim=1, res_scale=2.0, scale=0.5),
    dict(name="l3_b2_095_eps1e-6", shape=(3, 20), level=3, b2=0.95, eps=1e-6),
    dict(name="l2_no_bias_correction", shape=(4, 12), bias=0, lr=0.002),
    dict(name="l2_dim0", shape=(11, 5), dim=0, wd=0.02),
    dict(name="l2_1d", shape=(11,), scale=0.25),
    dict(name="dense_group", shape=(4, 6), level=0, wd=0.05),
]


def fmt(x):
    return " ".join(repr(float(v)) for v in np.asarray(x).reshape(-1))


def main():
    rng = np.random.default_rng(20260411)
    lines = ["# FOAM's rule (docs/algorithm.md#foam) in float64 NumPy, by tests/gen_foam_golden.py; "
             "beta1 0.9"]
    for case in CASES:
        c = dict(BASE, **case)
        shape = c["shape"]
        keys = ["name", "level", "scale", "res_scale", "lr", "wd", "eps", "b2", "dim", "bias"]
        header = " ".join(f"{k}={c[k]}" for k in keys)
        lines.append(f"config {header} shape={','.join(map(str, shape))} steps={c['steps']}")
        p = rng.standard_normal(shape)
        lines.append("p0 " + fmt(p))
        state = dict(m=np.zeros(moment_shape(shape, c)), v=np.zeros(moment_shape(shape, c)), t=0)
        if c["level"] > 0:
            state["m"] = np.moveaxis(state["m"], c["dim"], -1)
            state["v"] = np.moveaxis(state["v"], c["dim"], -1)
        for t in range(1, c["steps"] + 1):
            g = rng.standard_normal(shape) * (1 + 0.5 * t)
            p = foam_step(p, g, state, c)
            lines.append(f"g{t} " + fmt(g))
            lines.append(f"p{t} " + fmt(p))
    out = pathlib.Path(__file__).resolve().parent / "data" / "foam_rule_golden.txt"
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out} ({len(CASES)} configs)")


if __name__ == "__main__":
    main()
