"""mpidist.nn: gradients vs finite differences, loss values, hooks, state dicts, devices."""
import sys

import numpy as np
import pytest

from mpidist.nn import CrossEntropyLoss, Linear, Module, Parameter, ReLU, Sequential


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
    names = ["scale", "body.0.weight", "body.0.bias", "body.2.0.weight", "body.2.0.bias",
             "head.weight", "head.bias"]
    assert [n for n, _ in net.named_parameters()] == names
    assert [p.name for p in net.parameters()] == names
    assert [id(p) for p in net.parameters()] == [id(p) for _, p in net.named_parameters()]
    assert [n for n, _ in net.named_buffers()] == ["count"] and net.buffers()[0] is net.count
    assert list(net.state_dict()) == ["scale", "count", "body.0.weight", "body.0.bias", "body.2.0.weight",
                                      "body.2.0.bias", "head.weight", "head.bias"]
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
    with pytest.raises(TypeError, match=r"Sequential.to: device must be a str \('cpu', 'cuda', 'cuda:N'\) or an "
                                        r"int, got float"):
        model.to(1.5)
    with pytest.raises(ValueError, match=r"Sequential.to: device index must be >= 0, got -1"):
        model.to(-1)
    with pytest.raises(ValueError, match=r"Sequential.cuda: device must be a CUDA device \(an int or 'cuda:N'\), "
                                        r"got 'cpu'"):
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
