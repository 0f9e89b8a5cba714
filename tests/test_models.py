"""Models, fused kernels and optimizers: gradients against finite differences, kernels
against reference formulas and across array backends, optimizers against hand-computed
steps, learning on toy problems, and bit-exact reproducibility."""

import json
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import needs_gpu

from hpcckpt.errors import ConfigError, DataError, IncompatibleCheckpointError
from hpcckpt.train.kernels import bias_activation, bias_activation_backward, softmax_cross_entropy
from hpcckpt.train.models import build_model
from hpcckpt.train.optim import build_optimizer


def model_cfg(kind, **overrides):
    fields = dict(kind=kind, hidden=(128, 64), activation="relu", conv_channels=(16, 32), kernel_size=5,
                  pool=2, dtype="float32")
    fields.update(overrides)
    return SimpleNamespace(**fields)


def opt_cfg(kind, **overrides):
    fields = dict(kind=kind, lr=0.05, momentum=0.9, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    fields.update(overrides)
    return SimpleNamespace(**fields)


# (model config, input_shape) pairs small enough for finite differences over every layer
GRADCHECK_CASES = {
    "mlp-relu": (model_cfg("mlp", hidden=(7, 5), dtype="float64"), (6,)),
    "mlp-tanh": (model_cfg("mlp", hidden=(7, 5), activation="tanh", dtype="float64"), (2, 3)),
    "conv-relu-same": (model_cfg("conv1d", hidden=(6,), conv_channels=(3, 4), kernel_size=3, dtype="float64"), (11,)),
    "conv-tanh-valid": (
        model_cfg("conv1d", hidden=(6, 5), activation="tanh", conv_channels=(3, 4), kernel_size=4, pool=3,
                  dtype="float64", padding="valid"),
        (2, 23),
    ),
    "conv-tanh-even-kernel-same": (
        model_cfg("conv1d", hidden=(5,), activation="tanh", conv_channels=(2,), kernel_size=4, dtype="float64"),
        (3, 9),
    ),
}


def loss_of(model, x, labels):
    loss, _ = softmax_cross_entropy(model.forward(x, train=False), labels)
    return loss


@pytest.mark.parametrize("case", sorted(GRADCHECK_CASES))
def test_every_layer_gradient_matches_central_differences(case):
    cfg, input_shape = GRADCHECK_CASES[case]
    n_classes, batch = 4, 5
    model = build_model(cfg, input_shape, n_classes, np, np.random.default_rng(1))
    data_rng = np.random.default_rng(2)
    x = data_rng.standard_normal((batch, *input_shape))
    labels = data_rng.integers(0, n_classes, batch)
    # Non-zero biases so ReLU units are not all sitting at the same kink.
    for name, param in model.parameters():
        if name.endswith(".bias"):
            param[...] = data_rng.normal(0, 0.1, param.shape)

    _, grad_logits = softmax_cross_entropy(model.forward(x), labels)
    grads = dict(model.backward(grad_logits))
    eps = 1e-6
    for name, param in model.parameters():
        flat = param.reshape(-1)  # a view: perturbing it perturbs the model
        sample = data_rng.choice(flat.size, size=min(flat.size, 12), replace=False)
        numeric = []
        for index in sample:
            saved = flat[index]
            flat[index] = saved + eps
            plus = loss_of(model, x, labels)
            flat[index] = saved - eps
            minus = loss_of(model, x, labels)
            flat[index] = saved
            numeric.append((plus - minus) / (2 * eps))
        numeric = np.array(numeric)
        analytic = grads[name].reshape(-1)[sample]
        scale = max(np.linalg.norm(numeric), np.linalg.norm(analytic), 1e-12)
        relative_error = np.linalg.norm(analytic - numeric) / scale
        assert relative_error < 1e-5, f"{case} {name}: relative error {relative_error:.2e}"
        assert np.linalg.norm(analytic) > 0, f"{case} {name}: sampled gradient is all zero"


@pytest.mark.parametrize("kind", ["mlp", "conv1d"])
def test_backward_yields_every_parameter_once_output_layer_first(kind):
    cfg = model_cfg(kind, hidden=(8, 6), conv_channels=(3, 4), kernel_size=3)
    model = build_model(cfg, (16,), 3, np, np.random.default_rng(0))
    x = np.random.default_rng(1).standard_normal((4, 16)).astype(np.float32)
    _, grad_logits = softmax_cross_entropy(model.forward(x), np.array([0, 1, 2, 0]))
    yielded = [name for name, _ in model.backward(grad_logits)]
    parameter_names = [name for name, _ in model.parameters()]
    assert sorted(yielded) == sorted(parameter_names)
    assert len(yielded) == len(set(yielded))
    layers_in_order = list(dict.fromkeys(name.split(".")[0] for name in parameter_names))
    yielded_layers = list(dict.fromkeys(name.split(".")[0] for name in yielded))
    assert yielded_layers == layers_in_order[::-1]
    assert yielded[:2] == ["dense2.weight", "dense2.bias"]  # hidden (8, 6): dense2 is the output layer


@pytest.mark.parametrize("kind", ["mlp", "conv1d"])
def test_parameters_are_the_same_objects_and_in_model_dtype(kind):
    model = build_model(model_cfg(kind, dtype="float64"), (20,), 3, np, np.random.default_rng(0))
    first, second = model.parameters(), model.parameters()
    assert [n for n, _ in first] == [n for n, _ in second]
    assert all(a is b for (_, a), (_, b) in zip(first, second))
    assert all(p.dtype == np.float64 for _, p in first)
    expected_prefix = ["conv0", "conv1", "dense0"] if kind == "conv1d" else ["dense0", "dense1", "dense2"]
    assert [n.split(".")[0] for n, _ in first][::2][:3] == expected_prefix


def test_updating_a_layer_in_place_as_soon_as_it_is_yielded_leaves_lower_gradients_intact():
    cfg = model_cfg("conv1d", hidden=(6,), conv_channels=(3, 4), kernel_size=3, dtype="float64")
    x = np.random.default_rng(1).standard_normal((4, 12))
    labels = np.array([0, 1, 2, 1])

    def gradients(update_early):
        model = build_model(cfg, (12,), 3, np, np.random.default_rng(0))
        params = dict(model.parameters())
        _, grad_logits = softmax_cross_entropy(model.forward(x), labels)
        grads = {}
        for name, grad in model.backward(grad_logits):
            grads[name] = grad.copy()
            if update_early:
                params[name] -= 10.0 * grad
        return grads

    plain, early = gradients(False), gradients(True)
    assert all(np.array_equal(plain[name], early[name]) for name in plain)


def test_conv_accepts_channels_first_input():
    cfg = model_cfg("conv1d", hidden=(5,), conv_channels=(3,), kernel_size=3)
    model = build_model(cfg, (2, 10), 3, np, np.random.default_rng(0))
    assert model.forward(np.zeros((4, 2, 10), dtype=np.float32)).shape == (4, 3)


def test_unknown_kind_and_bad_settings_are_config_errors():
    with pytest.raises(ConfigError, match=r"model\.kind = 'rnn'.*'mlp', 'conv1d'"):
        build_model(model_cfg("rnn"), (8,), 2, np, np.random.default_rng(0))
    with pytest.raises(ConfigError, match=r"model\.activation"):
        build_model(model_cfg("mlp", activation="gelu"), (8,), 2, np, np.random.default_rng(0))
    with pytest.raises(ConfigError, match=r"model\.dtype"):
        build_model(model_cfg("mlp", dtype="float16"), (8,), 2, np, np.random.default_rng(0))
    with pytest.raises(ConfigError, match="shrinks to nothing"):
        build_model(model_cfg("conv1d", pool=4), (8,), 2, np, np.random.default_rng(0))
    with pytest.raises(ConfigError, match=r"optimizer\.kind = 'lbfgs'"):
        build_optimizer(opt_cfg("lbfgs"), [], np)


# ----------------------------------------------------------------------------- kernels


def test_bias_activation_matches_reference_formulas():
    rng = np.random.default_rng(0)
    z = rng.standard_normal((4, 3, 5))
    bias = rng.standard_normal(5)
    assert np.array_equal(bias_activation(z, bias, "none"), z + bias)
    assert np.array_equal(bias_activation(z, bias, "relu"), np.where(z + bias > 0, z + bias, 0.0))
    assert np.allclose(bias_activation(z, bias, "tanh"), np.tanh(z + bias), rtol=0, atol=1e-15)
    channel_bias = rng.standard_normal(3)
    assert np.array_equal(bias_activation(z, channel_bias, "none", axis=1), z + channel_bias[None, :, None])
    with pytest.raises(ValueError, match="activation 'gelu'"):
        bias_activation(z, bias, "gelu")


def test_bias_activation_backward_matches_derivative_of_pre_activation():
    rng = np.random.default_rng(0)
    z = rng.standard_normal((6, 7))
    grad_out = rng.standard_normal((6, 7))
    zero_bias = np.zeros(7)
    relu_out = bias_activation(z, zero_bias, "relu")
    assert np.array_equal(bias_activation_backward(grad_out, relu_out, "relu"), grad_out * (z > 0))
    tanh_out = bias_activation(z, zero_bias, "tanh")
    expected = grad_out / np.cosh(z) ** 2
    assert np.allclose(bias_activation_backward(grad_out, tanh_out, "tanh"), expected, rtol=1e-12, atol=1e-14)
    assert bias_activation_backward(grad_out, z, "none") is grad_out


def test_softmax_cross_entropy_matches_reference_and_is_stable():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((8, 5)) * 3
    labels = rng.integers(0, 5, 8)
    probabilities = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    expected_loss = -np.mean(np.log(probabilities[np.arange(8), labels]))
    expected_grad = (probabilities - np.eye(5)[labels]) / 8
    loss, grad = softmax_cross_entropy(logits, labels)
    assert isinstance(loss, float)
    assert loss == pytest.approx(expected_loss, rel=1e-12)
    assert np.allclose(grad, expected_grad, rtol=1e-12, atol=1e-15)

    # Shifting all logits of a row changes nothing; huge logits must not overflow.
    shifted_loss, shifted_grad = softmax_cross_entropy(logits + 1000.0, labels)
    assert shifted_loss == pytest.approx(expected_loss, rel=1e-9)
    assert np.allclose(shifted_grad, expected_grad, atol=1e-12)
    big_loss, _ = softmax_cross_entropy(np.array([[1e4, 0.0], [0.0, 1e4]], dtype=np.float32), np.array([1, 1]))
    assert big_loss == pytest.approx(5e3)

    with pytest.raises(DataError, match="labels"):
        softmax_cross_entropy(logits, np.full(8, 5))


BACKENDS = [
    "numpy",
    pytest.param("cupy", marks=needs_gpu),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_kernels_agree_with_numpy_twins(backend, dtype):
    if backend == "cupy":
        import cupy as xp

        to_host = xp.asnumpy
    else:
        xp, to_host = np, np.asarray
    tolerance = 1e-6 if dtype == "float32" else 1e-12
    rng = np.random.default_rng(0)
    z = rng.standard_normal((9, 300)).astype(dtype)  # more classes than one thread block
    bias = rng.standard_normal(300).astype(dtype)
    grad_out = rng.standard_normal((9, 300)).astype(dtype)
    labels = rng.integers(0, 300, 9)
    channels_first = rng.standard_normal((2, 7, 4)).astype(dtype)
    channel_bias = rng.standard_normal(7).astype(dtype)

    for activation in ("relu", "tanh", "none"):
        out = bias_activation(xp.asarray(z), xp.asarray(bias), activation)
        expected_out = bias_activation(z, bias, activation)
        assert out.dtype == expected_out.dtype
        np.testing.assert_allclose(to_host(out), expected_out, rtol=tolerance, atol=tolerance)
        grad_z = bias_activation_backward(xp.asarray(grad_out), xp.asarray(expected_out), activation)
        np.testing.assert_allclose(
            to_host(grad_z), bias_activation_backward(grad_out, expected_out, activation),
            rtol=tolerance, atol=tolerance,
        )
        np.testing.assert_allclose(
            to_host(bias_activation(xp.asarray(channels_first), xp.asarray(channel_bias), activation, axis=1)),
            bias_activation(channels_first, channel_bias, activation, axis=1),
            rtol=tolerance, atol=tolerance,
        )

    loss, grad = softmax_cross_entropy(xp.asarray(z * 10), xp.asarray(labels))
    expected_loss, expected_grad = softmax_cross_entropy(z * 10, labels)
    assert loss == pytest.approx(expected_loss, rel=tolerance, abs=tolerance)
    assert grad.dtype == expected_grad.dtype
    np.testing.assert_allclose(to_host(grad), expected_grad, rtol=tolerance, atol=tolerance)


def test_numpy_twins_are_bit_reproducible():
    rng = np.random.default_rng(3)
    z = rng.standard_normal((64, 10)).astype(np.float32)
    labels = rng.integers(0, 10, 64)
    first = softmax_cross_entropy(z, labels)
    second = softmax_cross_entropy(z.copy(), labels.copy())
    assert first[0] == second[0] and np.array_equal(first[1], second[1])


# ----------------------------------------------------------------------------- optimizers


def _toy_parameters():
    rng = np.random.default_rng(0)
    return [("a.weight", rng.standard_normal((3, 2))), ("a.bias", rng.standard_normal(2))]


def test_sgd_step_matches_hand_formula():
    params = _toy_parameters()
    originals = {name: p.copy() for name, p in params}
    grads = {name: np.full(p.shape, 0.5) + np.arange(p.size).reshape(p.shape) for name, p in params}
    optimizer = build_optimizer(opt_cfg("sgd", lr=0.1, momentum=0.9, weight_decay=0.01), params, np)
    for name, param in params:
        optimizer.update(name, param, grads[name])
    for name, param in params:
        # first step: buffer = 0.9 * 0 + (g + wd * p)
        step1 = grads[name] + 0.01 * originals[name]
        expected1 = originals[name] - 0.1 * step1
        np.testing.assert_allclose(param, expected1, rtol=1e-14, atol=1e-15)
    for name, param in params:
        optimizer.update(name, param, grads[name])
    for name, param in params:
        step1 = grads[name] + 0.01 * originals[name]
        expected1 = originals[name] - 0.1 * step1
        buffer2 = 0.9 * step1 + grads[name] + 0.01 * expected1
        np.testing.assert_allclose(param, expected1 - 0.1 * buffer2, rtol=1e-14, atol=1e-15)
        np.testing.assert_allclose(dict(optimizer.state_arrays())[f"{name}/momentum"], buffer2, rtol=1e-14)


def test_sgd_without_momentum_has_no_state():
    params = _toy_parameters()
    before = params[0][1].copy()
    optimizer = build_optimizer(opt_cfg("sgd", lr=0.5, momentum=0.0), params, np)
    optimizer.update("a.weight", params[0][1], np.ones((3, 2)))
    assert optimizer.state_arrays() == []
    np.testing.assert_array_equal(params[0][1], before - 0.5)


def test_adam_steps_match_hand_formula_with_per_parameter_step_counts():
    params = _toy_parameters()
    weight, bias = params[0][1], params[1][1]
    expected_weight = weight.copy()
    optimizer = build_optimizer(opt_cfg("adam", lr=0.01, beta1=0.8, beta2=0.9, eps=1e-6), params, np)
    m = np.zeros_like(weight)
    v = np.zeros_like(weight)
    rng = np.random.default_rng(5)
    for t in range(1, 4):
        g = rng.standard_normal(weight.shape)
        m = 0.8 * m + 0.2 * g
        v = 0.9 * v + 0.1 * g * g
        m_hat, v_hat = m / (1 - 0.8**t), v / (1 - 0.9**t)
        expected_weight = expected_weight - 0.01 * m_hat / (np.sqrt(v_hat) + 1e-6)
        optimizer.update("a.weight", weight, g)
    np.testing.assert_allclose(weight, expected_weight, rtol=1e-13, atol=1e-15)
    state = dict(optimizer.state_arrays())
    np.testing.assert_allclose(state["a.weight/adam_m"], m, rtol=1e-13)
    np.testing.assert_allclose(state["a.weight/adam_v"], v, rtol=1e-13)

    # The bias was never updated: its first step is a bias-corrected first step, whose
    # size is lr * sign(g) whatever the other parameter's step count.
    bias_before = bias.copy()
    optimizer.update("a.bias", bias, np.array([2.0, -3.0]))
    np.testing.assert_allclose(bias, bias_before - 0.01 * np.array([1.0, -1.0]), rtol=1e-6)
    assert optimizer.scalar_state() == {"kind": "adam", "adam_steps": {"a.weight": 3, "a.bias": 1}}


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_state_arrays_are_stable_objects_and_scalar_state_round_trips(kind):
    params = _toy_parameters()
    optimizer = build_optimizer(opt_cfg(kind), params, np)
    first = optimizer.state_arrays()
    for name, param in params:
        optimizer.update(name, param, np.ones_like(param))
    second = optimizer.state_arrays()
    assert [n for n, _ in first] == [n for n, _ in second]
    assert all(a is b for (_, a), (_, b) in zip(first, second))
    assert all(array.any() for _, array in second)  # updated in place, not replaced
    suffixes = {"sgd": {"momentum"}, "adam": {"adam_m", "adam_v"}}[kind]
    assert {n.split("/")[1] for n, _ in second} == suffixes

    saved = json.loads(json.dumps(optimizer.scalar_state()))
    fresh = build_optimizer(opt_cfg(kind), _toy_parameters(), np)
    fresh.load_scalar_state(saved)
    assert fresh.scalar_state() == optimizer.scalar_state()
    other = "adam" if kind == "sgd" else "sgd"
    with pytest.raises(IncompatibleCheckpointError):
        build_optimizer(opt_cfg(other), _toy_parameters(), np).load_scalar_state(saved)


# ----------------------------------------------------------------------------- training


def _separable_problem(input_shape, n_classes, samples=128, seed=0):
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((n_classes, *input_shape)) * 1.5
    labels = np.arange(samples) % n_classes
    x = centres[labels] + 0.5 * rng.standard_normal((samples, *input_shape))
    return x.astype(np.float32), labels


def _train(kind, optimizer_kind, steps, seed=0):
    cfg = model_cfg(kind, hidden=(32,), conv_channels=(4, 8), kernel_size=3)
    input_shape, n_classes = (24,), 3
    model = build_model(cfg, input_shape, n_classes, np, np.random.default_rng(seed))
    optimizer = build_optimizer(opt_cfg(optimizer_kind, lr=0.05 if optimizer_kind == "sgd" else 0.01),
                                model.parameters(), np)
    params = dict(model.parameters())
    x, labels = _separable_problem(input_shape, n_classes)
    losses = []
    for step in range(steps):
        batch = slice((step * 32) % 128, (step * 32) % 128 + 32)
        loss, grad_logits = softmax_cross_entropy(model.forward(x[batch]), labels[batch])
        losses.append(loss)
        for name, grad in model.backward(grad_logits):
            optimizer.update(name, params[name], grad)
    full_loss, _ = softmax_cross_entropy(model.forward(x, train=False), labels)
    return losses[0], full_loss, model, optimizer


@pytest.mark.parametrize("kind", ["mlp", "conv1d"])
@pytest.mark.parametrize("optimizer_kind", ["sgd", "adam"])
def test_models_learn_a_separable_problem(kind, optimizer_kind):
    initial, final, _, _ = _train(kind, optimizer_kind, steps=200)
    assert final < 0.3 * initial, f"loss went from {initial:.3f} to {final:.3f}"


@pytest.mark.parametrize("kind", ["mlp", "conv1d"])
def test_same_seed_gives_bit_identical_parameters(kind):
    _, loss_a, model_a, opt_a = _train(kind, "adam", steps=20, seed=7)
    _, loss_b, model_b, opt_b = _train(kind, "adam", steps=20, seed=7)
    assert loss_a == loss_b
    for (name_a, a), (name_b, b) in zip(model_a.parameters() + opt_a.state_arrays(),
                                        model_b.parameters() + opt_b.state_arrays()):
        assert name_a == name_b
        assert a.tobytes() == b.tobytes(), name_a


def test_max_pool_routes_gradient_to_the_first_maximum_only():
    from hpcckpt.train.models import MaxPool1D

    pool = MaxPool1D(3, np)
    x = np.array([[[0.0], [0.0], [-1.0], [2.0], [5.0], [5.0], [9.0]]])  # last row: dropped tail
    out = pool.forward(x, train=True)
    np.testing.assert_array_equal(out, [[[0.0], [5.0]]])
    grad_input, grads = pool.backward(np.array([[[1.0], [2.0]]]))
    assert grads == []
    np.testing.assert_array_equal(grad_input[0, :, 0], [1.0, 0.0, 0.0, 0.0, 2.0, 0.0, 0.0])


def test_backward_without_a_training_forward_is_an_error():
    model = build_model(model_cfg("mlp", hidden=(4,)), (3,), 2, np, np.random.default_rng(0))
    model.forward(np.zeros((2, 3)), train=False)
    with pytest.raises(RuntimeError, match="forward"):
        next(model.backward(np.zeros((2, 2), dtype=np.float32)))
