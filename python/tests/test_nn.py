"""gwt.nn.DeltaLinear: the C++ module on the Python module's parameters."""

import pytest
import torch
from torch import nn

import gwt
from gwt_test_util import max_abs_diff, read_records


def base(in_features=24, out_features=16, dtype=torch.float64):
    torch.manual_seed(4)
    return nn.Linear(in_features, out_features).to(dtype)


def test_matches_the_numpy_hra_golden_values():
    # NumPy's float64 HRA forward (tests/gen_delta_golden.py). As in the C++ test: a handful of
    # products of O(1) matrices of size <= 64, whose rounding is ~1e-14; 1e-12 is ~1e4 ulps.
    records = read_records("delta_hra_golden.txt", "case")
    assert len(records) == 6
    for header, rows in records:
        n_in, n_out, r, batch = (int(v) for v in header[:4])
        linear = nn.Linear(n_in, n_out).double()
        with torch.no_grad():
            linear.weight.copy_(torch.tensor(rows["W"], dtype=torch.float64).view(n_out, n_in))
            linear.bias.copy_(torch.tensor(rows["b"], dtype=torch.float64))
        layer = gwt.nn.DeltaLinear(linear, reflections=r, gram_schmidt=header[4] == "1")
        with torch.no_grad():
            layer.reflections.copy_(torch.tensor(rows["u"], dtype=torch.float64).view(n_in, r))
        x = torch.tensor(rows["x"], dtype=torch.float64).view(batch, n_in)
        y = torch.tensor(rows["y"], dtype=torch.float64).view(batch, n_out)
        assert max_abs_diff(layer(x), y) <= 1e-12, header


def test_forward_is_the_formula_and_trains():
    linear = base()
    layer = gwt.nn.DeltaLinear(linear, rank=4, reflections=2, orthogonal_core=True, alpha=8.0)
    assert layer.weight is linear.weight and not layer.weight.requires_grad
    assert {n for n, p in layer.named_parameters() if p.requires_grad} == {
        "U", "V", "reflections", "core"}
    x = torch.randn(5, 24, dtype=torch.float64)
    # U starts at zero and the reflections in equal pairs (H H = I): the base's output, to rounding.
    assert max_abs_diff(layer(x), linear(x)) <= 1e-12

    with torch.no_grad():
        for p in (layer.U, layer.reflections, layer.core):
            p.add_(torch.randn_like(p) * 0.3)

    def householder(vectors):
        product = torch.eye(vectors.shape[0], dtype=vectors.dtype)
        for i in range(vectors.shape[1]):
            u = vectors[:, i:i + 1]
            product = product @ (torch.eye(vectors.shape[0], dtype=vectors.dtype)
                                 - 2 * u @ u.T / (u.T @ u))
        return product

    with torch.no_grad():
        w = linear.weight @ householder(layer.reflections)
        delta = layer.U @ householder(layer.core) @ layer.V.T * (8.0 / 4)
        expected = x @ (w + delta).T + linear.bias
    assert max_abs_diff(layer(x), expected) <= 1e-12
    assert max_abs_diff(layer.delta_weight(), delta) <= 1e-12
    merged = layer.merge()
    assert isinstance(merged, nn.Linear) and max_abs_diff(merged(x), expected) <= 1e-12
    assert layer.orthogonality_error()[0] < 1e-12

    # Gradients reach this module's parameters; an optimizer over them changes the output.
    opt = gwt.WaveletAdam([p for p in layer.parameters() if p.requires_grad], lr=1e-2)
    before = layer(x).detach()
    (layer(x).pow(2).sum() + layer.orthogonality_penalty(0.1)).backward()
    assert all(p.grad is not None for p in (layer.U, layer.V, layer.reflections, layer.core))
    opt.step()
    assert max_abs_diff(layer(x), before) > 1e-4


def test_resize_rank_keeps_the_parameters_and_state_dict_round_trips():
    layer = gwt.nn.DeltaLinear(base(), rank=4)
    U = layer.U
    with torch.no_grad():
        layer.U.copy_(torch.randn_like(layer.U))
    x = torch.randn(3, 24, dtype=torch.float64)
    y = layer(x).detach()
    assert layer.resize_rank(6) == 0.0
    assert layer.U is U and layer.U.shape == (16, 6) and layer.rank == 6
    assert torch.equal(layer(x), y)  # new columns of U are zero: bit-identical
    error = layer.resize_rank(2)
    assert 0 < error < 1 and layer.U is U and layer.U.shape == (16, 2)
    other = gwt.nn.DeltaLinear(base(), rank=2)
    other.load_state_dict(layer.state_dict())
    assert torch.equal(other(x), layer(x))
    # A rank-0 layer grows a delta.
    plain = gwt.nn.DeltaLinear(base())
    assert plain.U is None
    plain.resize_rank(3)
    assert plain.U.shape == (16, 3) and isinstance(plain.U, nn.Parameter)


def test_bad_arguments():
    with pytest.raises(ValueError, match="invalid rank 99"):
        gwt.nn.DeltaLinear(base(), rank=99)
    with pytest.raises(TypeError, match="adapts a torch.nn.Linear"):
        gwt.nn.DeltaLinear(nn.Conv1d(2, 2, 1))
    layer = gwt.nn.DeltaLinear(base(), rank=2)
    with pytest.raises(RuntimeError, match="the input's last dimension must be in_features = 24"):
        layer(torch.randn(3, 5, dtype=torch.float64))
