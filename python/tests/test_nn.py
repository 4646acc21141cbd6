"""gwt.nn.DeltaLinear: the C++ module on the Python module's parameters."""

import copy
import io
import threading

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
    # The new columns of U are zero: the same function, to rounding (products of another size).
    assert max_abs_diff(layer(x), y) <= 1e-12
    error = layer.resize_rank(2)
    assert 0 < error < 1 and layer.U is U and layer.U.shape == (16, 2)
    other = gwt.nn.DeltaLinear(base(), rank=2)
    other.load_state_dict(layer.state_dict())
    assert torch.equal(other(x), layer(x))
    # A rank-0 layer holds U and V with no columns (so that they keep their identity), and grows.
    plain = gwt.nn.DeltaLinear(base())
    U = plain.U
    assert plain.U.shape == (16, 0) and plain.V.shape == (24, 0) and plain.rank == 0
    plain.resize_rank(3)
    assert plain.U is U and plain.U.shape == (16, 3) and isinstance(plain.U, nn.Parameter)


def test_state_dict_keeps_the_scale_after_a_resize():
    # The scale alpha / k0 lived outside the state dict: built at rank 8 with alpha 16 (scale 2),
    # grown to 16 and loaded into a layer built at rank 16 (scale 1), the delta came back halved.
    for core in (False, True):
        layer = gwt.nn.DeltaLinear(base(), rank=8, alpha=16.0, orthogonal_core=core)
        layer.resize_rank(16)
        with torch.no_grad():
            for p in (layer.U, layer.V):
                p.copy_(torch.randn_like(p))
        x = torch.randn(5, 24, dtype=torch.float64)
        other = gwt.nn.DeltaLinear(base(), rank=16, alpha=16.0, orthogonal_core=core)
        other.load_state_dict(layer.state_dict())
        assert other.scaling == layer.scaling == 2.0
        assert torch.equal(other(x), layer(x))
        buffer = io.BytesIO()
        torch.save(layer.state_dict(), buffer)
        buffer.seek(0)
        again = gwt.nn.DeltaLinear(base(), rank=16, alpha=16.0, orthogonal_core=core)
        again.load_state_dict(torch.load(buffer))
        assert torch.equal(again(x), layer(x))


def test_state_dict_saved_at_another_rank_loads():
    # Torch's loader reported "size mismatch for U" where the C++ loader takes the saved rank.
    for core in (False, True):
        for k in (6, 2):
            layer = gwt.nn.DeltaLinear(base(), rank=4, alpha=8.0, orthogonal_core=core)
            layer.resize_rank(k)
            with torch.no_grad():
                for p in (layer.U, layer.V):
                    p.copy_(torch.randn_like(p))
            buffer = io.BytesIO()
            torch.save(layer.state_dict(), buffer)
            buffer.seek(0)
            other = gwt.nn.DeltaLinear(base(), rank=4, alpha=8.0, orthogonal_core=core)
            U = other.U
            other.load_state_dict(torch.load(buffer))
            assert other.rank == k and other.U is U and other.scaling == layer.scaling == 2.0
            x = torch.randn(5, 24, dtype=torch.float64)
            assert torch.equal(other(x), layer(x))


def expect_load_changes_nothing(layer, state, match):
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    x = torch.randn(5, 24, dtype=torch.float64)
    y, scale = layer(x), layer.scaling
    with pytest.raises(RuntimeError, match=match):
        layer.load_state_dict(state)
    after = layer.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert layer.scaling == scale and torch.equal(layer(x), y)


def test_a_bad_state_dict_changes_nothing():
    # A rejected scale was still copied into delta_scale, and with another key's error the buffer
    # took the saved scale while the forward kept the old one.
    layer = trained_layer()
    saved = gwt.nn.DeltaLinear(base(), rank=4, reflections=2, orthogonal_core=True, alpha=4.0)
    for bad in (-1.0, float("nan")):
        state = saved.state_dict()
        state["delta_scale"] = torch.tensor(bad, dtype=torch.float64)
        expect_load_changes_nothing(layer, state, "invalid scale")
    state = saved.state_dict()  # a valid scale of its own, and a weight of another shape
    state["weight"] = torch.zeros(16, 23, dtype=torch.float64)
    expect_load_changes_nothing(layer, state, "weight has shape \\[16, 23\\]")
    state = saved.state_dict()  # U and V of another rank each
    state["U"] = torch.zeros(16, 3, dtype=torch.float64)
    expect_load_changes_nothing(layer, state, "not a delta of this layer")
    state = saved.state_dict()  # another rank, beyond min(in, out)
    state["U"], state["V"], state["core"] = (torch.zeros(16, 20, dtype=torch.float64),
                                             torch.zeros(24, 20, dtype=torch.float64),
                                             torch.zeros(20, 20, dtype=torch.float64))
    expect_load_changes_nothing(layer, state, "k <= min\\(in, out\\) = 16")
    # A delta of another rank without its core: U and V would not fit the layer's core.
    grown = copy.deepcopy(saved)
    grown.resize_rank(6)
    state = {k: v for k, v in grown.state_dict().items() if k != "core"}
    with pytest.raises(RuntimeError, match="not a delta of this layer"):
        layer.load_state_dict(state, strict=False)
    expect_load_changes_nothing(layer, state, "not a delta of this layer")
    # Saved with a core, loaded strictly into a layer without one: torch copied U and V, then
    # reported the unexpected key.
    plain = gwt.nn.DeltaLinear(base(), rank=4, reflections=2, alpha=8.0)
    with torch.no_grad():
        plain.U.add_(1.0)
    expect_load_changes_nothing(plain, saved.state_dict(), "Unexpected key\\(s\\).*\"core\"")
    state = saved.state_dict()
    del state["bias"]
    expect_load_changes_nothing(layer, state, "Missing key\\(s\\).*\"bias\"")


def test_to_bfloat16_keeps_the_adapter_in_its_math_dtype():
    # The adapter became bfloat16 (C++ keeps it float32), and resize_rank then made U float32
    # under the module's feet.
    for dtype in (torch.float32, torch.float64):
        layer = gwt.nn.DeltaLinear(base(dtype=dtype), rank=4, reflections=2, orthogonal_core=True,
                                   alpha=8.0)
        with torch.no_grad():
            for p in (layer.U, layer.V, layer.reflections, layer.core):
                p.add_(torch.randn_like(p) * 0.3)
        x = torch.randn(5, 24, dtype=dtype)
        layer(x).sum().backward()
        adapter = [layer.U, layer.V, layer.reflections, layer.core]
        values = [p.detach().clone() for p in adapter]
        layer.to(torch.bfloat16)
        assert layer.weight.dtype == layer.bias.dtype == torch.bfloat16
        assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in adapter)
        assert all(a is b for a, b in zip(adapter, (layer.U, layer.V, layer.reflections,
                                                    layer.core)))
        # Not rounded through bfloat16 (float64 values are rounded to float32 once).
        assert all(torch.equal(p, v.float()) for p, v in zip(adapter, values))
        assert layer.delta_scale.dtype == torch.float64
        y = layer(x.to(torch.bfloat16))
        assert y.dtype == torch.bfloat16
        layer.resize_rank(6)
        assert layer.U is adapter[0] and layer.rank == 6
        assert all(p.dtype == torch.float32 for p in (layer.U, layer.V, layer.core))
        layer.to(torch.float64)
        assert all(p.dtype == torch.float64 for p in adapter)
        assert layer(x.double()).dtype == torch.float64
    with pytest.raises(ValueError, match="cannot convert to torch.float8_e4m3fn"):
        layer.to(torch.float8_e4m3fn)
    assert layer.weight.dtype == torch.float64


def trained_layer():
    layer = gwt.nn.DeltaLinear(base(), rank=4, reflections=2, orthogonal_core=True, alpha=8.0)
    with torch.no_grad():
        for p in (layer.U, layer.V, layer.reflections, layer.core):
            p.add_(torch.randn_like(p) * 0.3)
    return layer


def test_copies_pickles_and_averaged_models():
    # The module held a pybind object that neither copy nor pickle could handle.
    layer = trained_layer()
    x = torch.randn(5, 24, dtype=torch.float64)
    y = layer(x)
    twin = copy.deepcopy(layer)
    assert twin.U is not layer.U and torch.equal(twin(x), y)
    with torch.no_grad():
        twin.U.add_(1.0)
    assert torch.equal(layer(x), y)  # the copy is independent
    buffer = io.BytesIO()
    torch.save(nn.Sequential(layer), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)[0]
    assert isinstance(loaded, gwt.nn.DeltaLinear) and torch.equal(loaded(x), y)
    assert loaded.scaling == layer.scaling and loaded.rank == layer.rank
    averaged = torch.optim.swa_utils.AveragedModel(layer)
    averaged.update_parameters(layer)
    assert torch.equal(averaged(x), y)


def test_one_layer_and_its_shallow_copy_forward_in_three_threads():
    # The module's forward once went through state shared by every caller: two threads calling
    # the same layer, or a copy.copy twin (which shares what the layer holds) with its own U,
    # could compute with each other's tensors.
    layer = trained_layer()
    twin = copy.copy(layer)
    twin._parameters = dict(layer._parameters)  # a shallow copy shares the dict itself
    twin.U = nn.Parameter(layer.U.detach() * -2.0)
    x = torch.randn(64, 24, dtype=torch.float64)
    expected = {id(layer): layer(x), id(twin): twin(x)}
    assert not torch.equal(expected[id(layer)], expected[id(twin)])
    callers = [layer, layer, twin]
    results = [[None] * 50 for _ in callers]

    def run(i):
        for t in range(50):
            results[i][t] = callers[i](x)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(callers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    for caller, outputs in zip(callers, results):
        assert all(torch.equal(r, expected[id(caller)]) for r in outputs)


def test_a_grown_rank_zero_layer_trains_under_its_optimizer():
    # resize_rank registered new parameters on a rank-0 layer: an optimizer built before held none.
    layer = gwt.nn.DeltaLinear(base(), reflections=2)
    opt = torch.optim.AdamW([p for p in layer.parameters() if p.requires_grad], lr=1e-2)
    layer.resize_rank(4)
    x, target = torch.randn(8, 24, dtype=torch.float64), torch.randn(8, 16, dtype=torch.float64)
    for _ in range(3):
        opt.zero_grad()
        (layer(x) - target).pow(2).mean().backward()
        opt.step()
    assert layer.U.abs().max() > 0


def test_merge_draws_no_random_numbers_and_bfloat16_models_run():
    layer = trained_layer()
    state = torch.get_rng_state()
    merged = layer.merge()
    assert torch.equal(torch.get_rng_state(), state)
    x = torch.randn(5, 24, dtype=torch.float64)
    assert isinstance(merged, nn.Linear) and max_abs_diff(merged(x), layer(x)) <= 1e-12
    # model.to(bfloat16) made the adapter bfloat16 while its math ran in float32: a dtype error.
    scale = layer.scaling
    layer.to(torch.bfloat16)
    y = layer(x.to(torch.bfloat16))
    assert y.dtype == torch.bfloat16 and layer.scaling == scale
    assert layer.state_dict()["delta_scale"].dtype == torch.float64


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_forward_after_a_growth_does_not_synchronize():
    layer = trained_layer().cuda()
    layer.resize_rank(6)
    x = torch.randn(5, 24, dtype=torch.float64, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = layer(x)
        y.sum().backward()
        z = layer(x)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(y, z)


def test_bad_arguments():
    with pytest.raises(ValueError, match="invalid rank 99"):
        gwt.nn.DeltaLinear(base(), rank=99)
    with pytest.raises(TypeError, match="adapts a torch.nn.Linear"):
        gwt.nn.DeltaLinear(nn.Conv1d(2, 2, 1))
    layer = gwt.nn.DeltaLinear(base(), rank=2)
    with pytest.raises(RuntimeError, match="the input's last dimension must be in_features = 24"):
        layer(torch.randn(3, 5, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="the input of shape \\[3, 24\\] is on meta"):
        layer(torch.empty(3, 24, dtype=torch.float64, device="meta"))
