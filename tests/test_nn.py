"""mpidist.nn: gradients vs finite differences, loss values, hooks, state dicts, devices,
manual_seed, Dropout, LogSoftmax, NLLLoss, MSELoss and torch's ``.data`` habit."""

import sys
import warnings

import numpy as np
import pytest

from mpidist.nn import (
    CrossEntropyLoss,
    Dropout,
    Linear,
    LogSoftmax,
    Module,
    MSELoss,
    NLLLoss,
    Parameter,
    ReLU,
    Sequential,
    consume_prefix_in_state_dict_if_present,
    initial_seed,
    manual_seed,
)


def numeric_grad(f, arr, eps=1e-6):
    """Central finite differences of scalar f() w.r.t. arr (perturbed in place)."""
    grad = np.zeros_like(arr)
    for idx in np.ndindex(arr.shape):
        old = arr[idx]
        arr[idx] = old + eps
        hi = f()
        arr[idx] = old - eps
        lo = f()
        arr[idx] = old
        grad[idx] = (hi - lo) / (2 * eps)
    return grad


def mlp(rng=0, dtype=np.float64):
    return Sequential(Linear(5, 7, rng=rng, dtype=dtype), ReLU(), Linear(7, 3, rng=rng + 1, dtype=dtype))


# -- gradients ---------------------------------------------------------------
def test_linear_forward_matches_formula_and_init():
    lin = Linear(4, 3, rng=np.random.default_rng(1), dtype=np.float64)
    x = np.random.default_rng(2).normal(size=(6, 4))
    np.testing.assert_allclose(lin(x), x @ lin.weight.data.T + lin.bias.data, rtol=1e-12)
    assert lin.weight.shape == (3, 4) and lin.bias.shape == (3,)
    big = Linear(16, 200, rng=0)
    assert big.weight.dtype == np.float32 and big.bias.dtype == np.float32
    bound = 1 / np.sqrt(16)
    for p in (big.weight, big.bias):
        assert np.abs(p.data).max() <= bound and np.abs(p.data).max() > 0.9 * bound
    again = Linear(16, 200, rng=0)
    np.testing.assert_array_equal(big.weight.data, again.weight.data)
    assert Linear(3, 2, bias=False).bias is None and len(Linear(3, 2, bias=False).parameters()) == 1


@pytest.mark.parametrize("bias", [True, False])
def test_linear_gradients_finite_difference(bias):
    rng = np.random.default_rng(3)
    lin = Linear(4, 3, bias=bias, rng=rng, dtype=np.float64)
    x = rng.normal(size=(5, 4))
    w = rng.normal(size=(5, 3))  # loss = sum(w * y)
    loss = lambda: float((w * lin(x)).sum())  # noqa: E731
    lin(x)
    gx = lin.backward(w.copy())
    np.testing.assert_allclose(gx, numeric_grad(loss, x), rtol=1e-6, atol=1e-8)
    for p in lin.parameters():
        np.testing.assert_allclose(p.grad, numeric_grad(loss, p.data), rtol=1e-6, atol=1e-8)


def test_relu_gradient_finite_difference_away_from_zero():
    rng = np.random.default_rng(4)
    x = rng.normal(size=(4, 6))
    x[np.abs(x) < 0.1] = 0.5
    w = rng.normal(size=x.shape)
    relu = ReLU()
    np.testing.assert_array_equal(relu(x), np.where(x > 0, x, 0))
    gx = relu.backward(w)
    np.testing.assert_allclose(gx, numeric_grad(lambda: float((w * relu(x)).sum()), x), rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_mlp_cross_entropy_finite_difference(reduction):
    rng = np.random.default_rng(5)
    model, crit = mlp(), CrossEntropyLoss(reduction)
    x = rng.normal(size=(8, 5))
    t = rng.integers(0, 3, size=8)
    loss = lambda: crit(model(x), t)  # noqa: E731
    loss()
    gx = model.backward(crit.backward())
    np.testing.assert_allclose(gx, numeric_grad(loss, x), rtol=1e-5, atol=1e-8)
    for name, p in model.named_parameters():
        np.testing.assert_allclose(p.grad, numeric_grad(loss, p.data), rtol=1e-5, atol=1e-8, err_msg=name)


# -- cross entropy ------------------------------------------------------------
def test_cross_entropy_value_and_gradient_formula():
    rng = np.random.default_rng(6)
    logits = rng.normal(size=(10, 4)) * 3
    t = rng.integers(0, 4, size=10)
    p = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    per = -np.log(p[np.arange(10), t])
    mean, total = CrossEntropyLoss(), CrossEntropyLoss("sum")
    assert isinstance(mean(logits, t), float)
    assert mean(logits, t) == pytest.approx(per.mean(), rel=1e-12)
    assert total(logits, t) == pytest.approx(per.sum(), rel=1e-12)
    onehot = np.eye(4)[t]
    np.testing.assert_allclose(mean.backward(), (p - onehot) / 10, rtol=1e-10, atol=1e-15)
    np.testing.assert_allclose(total.backward(2.0), 2 * (p - onehot), rtol=1e-10, atol=1e-15)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_cross_entropy_stable_for_huge_logits(dtype):
    logits = np.array([[1e4, 0.0, -1e4], [0.0, 1e4, 1e4]], dtype=dtype)
    crit = CrossEntropyLoss("sum")
    loss = crit(logits, np.array([2, 1]))
    assert np.isfinite(loss) and loss == pytest.approx(2e4 + np.log(2), rel=1e-6)
    grad = crit.backward()
    assert grad.dtype == dtype and np.isfinite(grad).all()
    np.testing.assert_allclose(grad, [[1, 0, -1], [0, -0.5, 0.5]], atol=1e-6)


def test_cross_entropy_bad_inputs():
    crit = CrossEntropyLoss()
    logits = np.zeros((3, 4))
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        crit(logits, np.array([0, 4, 1]))
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        crit(logits, np.array([0, -1, 1]))
    with pytest.raises(ValueError, match=r"shape \(3,\)"):
        crit(logits, np.array([0, 1]))
    with pytest.raises(TypeError, match="integer"):
        crit(logits, np.array([0.0, 1.0, 2.0]))
    with pytest.raises(ValueError, match=r"\(N, C\)"):
        crit(np.zeros(4), np.array([0]))
    with pytest.raises(ValueError, match="reduction"):
        CrossEntropyLoss("none")
    with pytest.raises(RuntimeError):
        CrossEntropyLoss().backward()


# -- hooks and accumulation ---------------------------------------------------
def test_hooks_fire_once_in_reverse_layer_order_with_final_grad():
    rng = np.random.default_rng(7)
    model, crit = mlp(), CrossEntropyLoss()
    seen = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda q: seen.append((q.name, q.grad.copy())))
    x, t = rng.normal(size=(4, 5)), rng.integers(0, 3, size=4)
    crit(model(x), t)
    model.backward(crit.backward())
    assert [n for n, _ in seen] == ["2.weight", "2.bias", "0.weight", "0.bias"]
    params = dict(model.named_parameters())
    for name, g in seen:
        np.testing.assert_array_equal(g, params[name].grad)
    # second backward accumulates; the hook sees the accumulated (final) grad
    first = {n: p.grad.copy() for n, p in params.items()}
    seen.clear()
    crit(model(x), t)
    model.backward(crit.backward())
    assert [n for n, _ in seen] == ["2.weight", "2.bias", "0.weight", "0.bias"]
    for name, g in seen:
        np.testing.assert_allclose(g, 2 * first[name], rtol=1e-12)
        np.testing.assert_array_equal(g, params[name].grad)


def test_hook_handle_remove_and_grad_accumulation():
    lin = Linear(3, 2, rng=0, dtype=np.float64)
    calls = []
    handle = lin.weight.register_post_accumulate_grad_hook(lambda p: calls.append("a"))
    lin.weight.register_post_accumulate_grad_hook(lambda p: calls.append("b"))
    x, g = np.ones((2, 3)), np.ones((2, 2))
    lin(x)
    lin.backward(g)
    assert calls == ["a", "b"]
    handle.remove()
    handle.remove()  # idempotent
    lin.backward(g)
    assert calls == ["a", "b", "b"]
    np.testing.assert_allclose(lin.weight.grad, 2 * (g.T @ x))
    np.testing.assert_allclose(lin.bias.grad, 2 * g.sum(0))
    lin.zero_grad(set_to_none=False)
    assert lin.weight.grad is not None and not lin.weight.grad.any()
    lin.zero_grad()
    assert lin.weight.grad is None and lin.bias.grad is None
    with pytest.raises(TypeError):
        lin.weight.register_post_accumulate_grad_hook(None)


def test_grad_is_a_copy_and_accumulates_in_place_into_replaced_grad():
    p = Parameter(np.zeros(3))
    g = np.ones(3)
    p.accumulate_grad(g)
    g[:] = 5
    np.testing.assert_array_equal(p.grad, 1)
    bucket = np.zeros(6)
    p.grad = bucket[3:]
    p.accumulate_grad(np.ones(3))
    np.testing.assert_array_equal(bucket, [0, 0, 0, 1, 1, 1])
    with pytest.raises(ValueError, match=r"shape \(3,\)"):
        p.accumulate_grad(np.ones(4))


# -- module tree --------------------------------------------------------------
class Net(Module):
    def __init__(self):
        super().__init__()
        self.body = Sequential(Linear(2, 3, rng=0), ReLU(), Sequential(Linear(3, 3, rng=1)))
        self.scale = Parameter(np.ones(3, dtype=np.float32))
        self.register_buffer("count", np.zeros((), dtype=np.int64))
        self.head = Linear(3, 1, rng=2)


def test_parameter_order_names_and_buffers():
    net = Net()
    names = ["scale", "body.0.weight", "body.0.bias", "body.2.0.weight", "body.2.0.bias", "head.weight", "head.bias"]
    assert [n for n, _ in net.named_parameters()] == names
    assert [p.name for p in net.parameters()] == names
    assert [id(p) for p in net.parameters()] == [id(p) for _, p in net.named_parameters()]
    assert [n for n, _ in net.named_buffers()] == ["count"] and net.buffers()[0] is net.count
    assert list(net.state_dict()) == [
        "scale",
        "count",
        "body.0.weight",
        "body.0.bias",
        "body.2.0.weight",
        "body.2.0.bias",
        "head.weight",
        "head.bias",
    ]
    net.count = np.ones((), dtype=np.int64)  # reassignment keeps it a buffer
    assert net.state_dict()["count"] == 1
    net.head = net.body[0]  # shared parameters are listed once
    assert len(net.parameters()) == 5
    assert net.train(False) is net and not net.body[2][0].training
    assert net.train().body[1].training


def test_state_dict_round_trip_and_errors():
    src, dst = Net(), Net()
    for p in src.parameters():
        p.data += 1.0
    weight = dst.head.weight.data
    dst.load_state_dict({k: v.copy() for k, v in src.state_dict().items()})
    assert dst.head.weight.data is weight  # copied in place
    for (n, a), (_, b) in zip(src.state_dict().items(), dst.state_dict().items()):
        np.testing.assert_array_equal(a, b, err_msg=n)

    before = {k: v.copy() for k, v in dst.state_dict().items()}
    good = {k: v.copy() + 7 if v.dtype.kind == "f" else v.copy() for k, v in src.state_dict().items()}
    missing = dict(good)
    del missing["head.bias"]
    with pytest.raises(ValueError, match="missing.*head.bias"):
        dst.load_state_dict(missing)
    with pytest.raises(ValueError, match="unexpected.*extra"):
        dst.load_state_dict({**good, "extra": np.zeros(1)})
    bad_shape = {**good, "body.0.weight": np.zeros((2, 3), np.float32)}
    with pytest.raises(ValueError, match=r"body\.0\.weight.*\(3, 2\).*\(2, 3\)"):
        dst.load_state_dict(bad_shape)
    with pytest.raises(TypeError, match=r"scale.*float32.*float64"):
        dst.load_state_dict({**good, "scale": np.ones(3)})
    for k, v in dst.state_dict().items():  # failed loads changed nothing
        np.testing.assert_array_equal(v, before[k], err_msg=k)
    dst.load_state_dict(missing, strict=False)
    np.testing.assert_array_equal(dst.head.bias.data, before["head.bias"])
    np.testing.assert_array_equal(dst.head.weight.data, good["head.weight"])


def test_bad_arguments():
    lin = Linear(4, 2)
    with pytest.raises(ValueError, match=r"\(N, 4\).*\(3, 5\)"):
        lin(np.zeros((3, 5), np.float32))
    with pytest.raises(TypeError, match="float32"):
        lin(np.zeros((3, 4), np.float64))
    with pytest.raises(RuntimeError, match="before forward"):
        Linear(4, 2).backward(np.zeros((3, 2), np.float32))
    lin(np.zeros((3, 4), np.float32))
    with pytest.raises(ValueError, match=r"\(3, 2\)"):
        lin.backward(np.zeros((3, 3), np.float32))
    with pytest.raises(ValueError, match="in_features"):
        Linear(0, 2)
    with pytest.raises(TypeError, match="out_features"):
        Linear(2, 2.0)
    with pytest.raises(TypeError, match="dtype"):
        Linear(2, 2, dtype=np.int32)
    with pytest.raises(TypeError, match="argument 1"):
        Sequential(ReLU(), "relu")
    relu = ReLU()
    with pytest.raises(ValueError, match="more than once"):
        Sequential(relu, relu)
    with pytest.raises(TypeError, match="floating"):
        Parameter(np.arange(3))


def test_linear_accepts_leading_batch_dims():
    rng = np.random.default_rng(8)
    lin = Linear(3, 2, rng=rng, dtype=np.float64)
    x = rng.normal(size=(2, 4, 3))
    w = rng.normal(size=(2, 4, 2))
    lin(x)
    np.testing.assert_allclose(lin.backward(w), numeric_grad(lambda: float((w * lin(x)).sum()), x), rtol=1e-6)


# -- devices (the GPU side: tests/test_ddp_xp.py, tests/gpu/test_gpu_ddp.py) --------------
def test_to_rejects_unknown_devices():
    model = mlp()
    with pytest.raises(ValueError, match=r"Sequential.to: device must be 'cpu', 'cuda' or 'cuda:N', got 'tpu'"):
        model.to("tpu")
    with pytest.raises(
        TypeError,
        match=r"Sequential.to: device must be a str \('cpu', 'cuda', 'cuda:N'\) or an "
        r"int, got float",
    ):
        model.to(1.5)
    with pytest.raises(ValueError, match=r"Sequential.to: device index must be >= 0, got -1"):
        model.to(-1)
    with pytest.raises(
        ValueError,
        match=r"Sequential.cuda: device must be a CUDA device \(an int or 'cuda:N'\), "
        r"got 'cpu'",
    ):
        model.cuda("cpu")
    arrays = [p.data for p in model.parameters()]
    assert model.to("cpu") is model and model.cpu() is model
    assert all(p.data is a for p, a in zip(model.parameters(), arrays))  # already there: no copies


def test_cuda_without_cupy_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # "import cupy" raises ImportError
    params = [p.data for p in mlp().parameters()]
    model = mlp()
    with pytest.raises(RuntimeError, match=r"Sequential.to: device 'cuda' needs cupy, which is not installed"):
        model.to("cuda:0")
    assert all(type(p.data) is np.ndarray for p in model.parameters())
    assert [p.data.tobytes() for p in model.parameters()] == [p.tobytes() for p in params]


# -- manual_seed (torch.manual_seed) ---------------------------------------------------
def test_manual_seed_makes_initialization_and_dropout_masks_reproducible():
    def draw():
        model = Sequential(Linear(4, 5), ReLU(), Dropout(0.5), Linear(5, 2))
        x = np.ones((3, 4), dtype=np.float32)
        return [p.data.copy() for p in model.parameters()] + [model[2](x[:, :1].repeat(5, axis=1))]

    assert isinstance(manual_seed(1234), np.random.Generator) and initial_seed() == 1234
    first = draw()
    manual_seed(1234)
    again = draw()
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)
    manual_seed(1235)
    assert not np.array_equal(draw()[0], first[0])
    manual_seed(-1)  # torch takes negative seeds modulo 2**64
    assert initial_seed() == 2**64 - 1


def test_explicit_rng_is_independent_of_the_default_generator():
    manual_seed(7)
    Linear(3, 3)  # consumes the default generator
    a = Linear(3, 3, rng=5)  # its own generator: the same whatever came before
    manual_seed(8)
    b = Linear(3, 3, rng=5)
    np.testing.assert_array_equal(a.weight.data, b.weight.data)
    manual_seed(9)
    d = Dropout(0.5, rng=np.random.default_rng(3))
    mask_a = d(np.ones((4, 4)))
    manual_seed(10)
    mask_b = Dropout(0.5, rng=np.random.default_rng(3))(np.ones((4, 4)))
    np.testing.assert_array_equal(mask_a, mask_b)


def test_manual_seed_and_rng_errors():
    with pytest.raises(TypeError, match=r"manual_seed: seed must be an int, got float"):
        manual_seed(1.5)
    with pytest.raises(ValueError, match=r"manual_seed: seed must be in \[-9223372036854775808, "):
        manual_seed(2**64)
    with pytest.raises(TypeError, match=r"Linear: rng must be a numpy.random.Generator, a seed or None, got str"):
        Linear(2, 2, rng="x")


# -- Dropout ------------------------------------------------------------------------------
def test_dropout_scales_kept_elements_and_backward_uses_the_same_mask():
    d = Dropout(0.25, rng=0)
    x = np.random.default_rng(1).normal(size=(200, 50)).astype(np.float32)
    y = d(x)
    kept = y != 0
    assert y.dtype == np.float32 and 0.70 < kept.mean() < 0.80
    np.testing.assert_array_equal(y[kept], x[kept] * (np.float32(1) / np.float32(0.75)))
    g = np.ones_like(x)
    np.testing.assert_array_equal(d.backward(g), np.where(kept, np.float32(1) / np.float32(0.75), 0))
    d.eval()
    assert d(x) is x and d.backward(g) is g  # eval: the identity
    d.train()
    assert Dropout(0.0)(x) is x
    np.testing.assert_array_equal(Dropout(1.0, rng=0)(x), 0)
    inplace = x.copy()
    out = Dropout(0.5, inplace=True, rng=0)(inplace)
    assert out is inplace and np.array_equal(out, Dropout(0.5, rng=0)(x))


def test_dropout_errors():
    with pytest.raises(ValueError, match=r"dropout probability has to be between 0 and 1, but got 1.5"):
        Dropout(1.5)
    with pytest.raises(TypeError, match=r"Dropout: inplace must be a bool, got int"):
        Dropout(0.5, 1)
    with pytest.raises(RuntimeError, match=r"Dropout.backward: called before forward"):
        Dropout().backward(np.ones(3))
    d = Dropout()
    d(np.ones((2, 3)))
    with pytest.raises(ValueError, match=r"grad_output must have shape \(2, 3\), got \(3,\)"):
        d.backward(np.ones(3))
    with pytest.raises(TypeError, match=r"x must have a floating dtype, got int64"):
        d(np.ones(3, dtype=np.int64))


# -- LogSoftmax, NLLLoss, MSELoss --------------------------------------------------------------
def test_log_softmax_values_gradient_and_implicit_dim():
    x = np.random.default_rng(3).normal(size=(4, 5)) * 10
    ls = LogSoftmax(dim=1)
    out = ls(x)
    np.testing.assert_allclose(out, x - np.log(np.exp(x).sum(axis=1, keepdims=True)), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(np.exp(out).sum(axis=1), 1, rtol=1e-12)
    w = np.random.default_rng(4).normal(size=(4, 5))
    loss = lambda: float((LogSoftmax(dim=1)(x) * w).sum())  # noqa: E731
    ls(x)
    np.testing.assert_allclose(ls.backward(w), numeric_grad(loss, x), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(LogSoftmax(dim=0)(x), x - np.log(np.exp(x).sum(axis=0)), rtol=1e-12, atol=1e-12)
    assert np.isfinite(LogSoftmax(1)(np.array([[1e4, 0.0]]))).all()
    with pytest.warns(UserWarning, match=r"Implicit dimension choice for log_softmax has been deprecated.*dim=1"):
        np.testing.assert_array_equal(LogSoftmax()(x), out)
    with pytest.raises(ValueError, match=r"dim must be in \[-2, 1\] for a 2-D input, got 2"):
        LogSoftmax(2)(x)


def test_nll_loss_of_log_softmax_equals_cross_entropy():
    rng = np.random.default_rng(5)
    logits, t = rng.normal(size=(6, 4)), rng.integers(0, 4, size=6)
    for reduction in ("mean", "sum"):
        ls, nll, ce = LogSoftmax(dim=1), NLLLoss(reduction=reduction), CrossEntropyLoss(reduction)
        loss = nll(ls(logits), t)
        np.testing.assert_allclose(loss, ce(logits, t), rtol=1e-12)
        np.testing.assert_allclose(ls.backward(nll.backward(2.0)), ce.backward(2.0), rtol=1e-12, atol=1e-15)
    assert isinstance(loss, float) and loss.item() == float(loss)  # torch's loss.item()


def test_nll_loss_weight_ignore_index_and_errors():
    logp = np.log(np.array([[0.5, 0.25, 0.25], [0.1, 0.8, 0.1], [0.2, 0.2, 0.6]]))
    t = np.array([0, -100, 2])
    crit = NLLLoss(weight=np.array([1.0, 2.0, 3.0]))
    np.testing.assert_allclose(crit(logp, t), -(np.log(0.5) + 3 * np.log(0.6)) / 4, rtol=1e-12)
    g = crit.backward()
    np.testing.assert_allclose(g, [[-0.25, 0, 0], [0, 0, 0], [0, 0, -0.75]], rtol=1e-12)
    assert np.isnan(NLLLoss()(logp, np.full(3, -100)))  # nothing counted: nan, as torch
    with pytest.raises(ValueError, match=r"targets must be in \[0, 3\), got min 0, max 3"):
        NLLLoss()(logp, np.array([0, 3, 1]))
    with pytest.raises(ValueError, match=r"weight must have shape \(3,\) for 3 classes"):
        NLLLoss(weight=np.ones(2))(logp, t)
    with pytest.raises(TypeError, match=r"ignore_index must be an int, got float"):
        NLLLoss(ignore_index=1.0)


def test_mse_loss_value_gradient_and_errors():
    rng = np.random.default_rng(6)
    x, y = rng.normal(size=(5, 3)).astype(np.float32), rng.normal(size=(5, 3))
    for reduction, div in (("mean", 15), ("sum", 1)):
        crit = MSELoss(reduction)
        loss = crit(x, y)
        diff = x - y.astype(np.float32)
        np.testing.assert_allclose(loss, float((diff.astype(np.float64) ** 2).sum()) / div, rtol=1e-6)
        g = crit.backward(3.0)
        assert g.dtype == np.float32
        np.testing.assert_allclose(g, 2 * diff * 3.0 / div, rtol=1e-6)
    assert loss.item() == float(loss)
    with pytest.raises(ValueError, match=r"MSELoss: target must have the input's shape \(5, 3\), got \(5,\)"):
        MSELoss()(x, y[:, 0])
    with pytest.raises(ValueError, match=r"reduction must be 'mean' or 'sum', got 'none'"):
        MSELoss("none")
    with pytest.raises(RuntimeError, match=r"MSELoss.backward: called before forward"):
        MSELoss().backward()


# -- torch's .data habit, state-dict prefixes ----------------------------------------------------
def test_grad_data_is_the_grad_itself_as_torch_tensor_data():
    lin = Linear(3, 2, rng=0, dtype=np.float64)
    lin(np.ones((4, 3)))
    lin.backward(np.ones((4, 2)))
    g = lin.weight.grad
    assert g.data is g and isinstance(g, np.ndarray)
    before = g.copy()
    lin.weight.grad.data /= 4  # the tutorial's average_gradients: in place
    np.testing.assert_array_equal(lin.weight.grad, before / 4)
    assert lin.weight.grad is g
    lin.weight.grad.data = np.zeros((2, 3))  # assigning .data copies into the grad
    assert lin.weight.grad is g and not g.any()
    lin.bias.grad = np.arange(2.0)  # a plain array: viewed, not copied
    assert lin.bias.grad.data is lin.bias.grad and lin.bias.grad.tolist() == [0.0, 1.0]


def test_consume_prefix_in_state_dict_if_present():
    state = {"module.0.weight": 1, "module.0.bias": 2, "other": 3}
    consume_prefix_in_state_dict_if_present(state, "module.")
    assert state == {"0.weight": 1, "0.bias": 2, "other": 3}
    consume_prefix_in_state_dict_if_present(state, "module.")  # nothing left to strip
    assert set(state) == {"0.weight", "0.bias", "other"}
    with pytest.raises(TypeError, match=r"state_dict must be a mutable mapping"):
        consume_prefix_in_state_dict_if_present([("a", 1)], "module.")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        consume_prefix_in_state_dict_if_present({}, "module.")
