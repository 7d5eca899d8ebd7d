"""mpidist.optim.SGD against an independent implementation of torch.optim.SGD's algorithm."""

import io

import numpy as np
import pytest

from mpidist.nn import Parameter
from mpidist.optim import SGD


def reference_sgd(p, grads, lr, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False):
    """torch.optim.SGD docs algorithm, written out step by step (t counts from 1)."""
    p, b = p.copy(), None
    for t, g in enumerate(grads, start=1):
        if weight_decay != 0:
            g = g + weight_decay * p
        if momentum != 0:
            b = g if t == 1 else momentum * b + (1 - dampening) * g
            g = g + momentum * b if nesterov else b
        p = p - lr * g
    return p


CONFIGS = [
    dict(lr=0.1),
    dict(lr=0.05, momentum=0.9),
    dict(lr=0.05, momentum=0.9, dampening=0.3),
    dict(lr=0.05, momentum=0.8, nesterov=True),
    dict(lr=0.02, weight_decay=0.1),
    dict(lr=0.03, momentum=0.7, dampening=0.2, weight_decay=0.05),
    dict(lr=0.03, momentum=0.7, weight_decay=0.05, nesterov=True),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_matches_reference(cfg):
    rng = np.random.default_rng(0)
    init = [rng.normal(size=(3, 4)), rng.normal(size=5)]
    grads = [[rng.normal(size=a.shape) for _ in range(5)] for a in init]
    params = [Parameter(a.copy()) for a in init]
    opt = SGD(params, **cfg)
    for step in range(5):
        for p, gs in zip(params, grads):
            p.grad = gs[step].copy()
        opt.step()
    for p, a, gs in zip(params, init, grads):
        np.testing.assert_allclose(p.data, reference_sgd(a, gs, **cfg), rtol=1e-12, atol=1e-14)


def test_hand_computed_values():
    # p=1, g=1 every step, lr=0.1, momentum=0.9, dampening=0.5:
    # step 1: buf = 1 (no dampening on the first step), p = 0.9
    # step 2: buf = 0.9*1 + 0.5*1 = 1.4, p = 0.9 - 0.14 = 0.76
    p = Parameter(np.ones(1))
    opt = SGD([p], lr=0.1, momentum=0.9, dampening=0.5)
    for expected in (0.9, 0.76):
        p.grad = np.ones(1)
        opt.step()
        assert p.data[0] == pytest.approx(expected, abs=1e-15)
    # nesterov: step 1 g = 1 + 0.9*1 = 1.9; step 2 buf = 1.9, g = 1 + 0.9*1.9 = 2.71
    p = Parameter(np.ones(1))
    opt = SGD([p], lr=0.1, momentum=0.9, nesterov=True)
    for expected in (1 - 0.19, 1 - 0.19 - 0.271):
        p.grad = np.ones(1)
        opt.step()
        assert p.data[0] == pytest.approx(expected, abs=1e-15)
    # weight decay: g = 1 + 0.5*1 = 1.5 -> p = 1 - 0.15
    p = Parameter(np.ones(1))
    p.grad = np.ones(1)
    SGD([p], lr=0.1, weight_decay=0.5).step()
    assert p.data[0] == pytest.approx(0.85, abs=1e-15)


def test_skips_params_without_grad_and_does_not_alias_grad():
    a, b = Parameter(np.ones(2)), Parameter(np.ones(2))
    opt = SGD([a, b], lr=0.5, momentum=0.9)
    a.grad = np.ones(2)
    opt.step()
    np.testing.assert_array_equal(b.data, 1)
    np.testing.assert_array_equal(a.data, 0.5)
    a.grad[:] = 100  # the momentum buffer must be a copy of the first grad
    assert opt.state_dict()["momentum_buffer.0"][0] == 1
    assert "momentum_buffer.1" not in opt.state_dict()
    opt.zero_grad(set_to_none=False)
    assert not a.grad.any() and b.grad is None
    opt.zero_grad()
    assert a.grad is None


def test_float32_stays_float32():
    p = Parameter(np.ones(3, np.float32))
    opt = SGD([p], lr=0.1, momentum=0.9, weight_decay=0.01)
    for _ in range(2):
        p.grad = np.ones(3, np.float32)
        opt.step()
    assert p.data.dtype == np.float32 and opt.state_dict()["momentum_buffer.0"].dtype == np.float32


def test_state_dict_round_trip_continues_identically():
    rng = np.random.default_rng(1)
    init = [rng.normal(size=(2, 3)), rng.normal(size=3)]
    grads = [[rng.normal(size=a.shape) for a in init] for _ in range(6)]
    cfg = dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01)

    def run(opt, params, steps):
        for gs in steps:
            for p, g in zip(params, gs):
                p.grad = g.copy()
            opt.step()

    ref_params = [Parameter(a.copy()) for a in init]
    ref = SGD(ref_params, **cfg)
    run(ref, ref_params, grads)

    params = [Parameter(a.copy()) for a in init]
    opt = SGD(params, **cfg)
    run(opt, params, grads[:3])
    buf = io.BytesIO()
    np.savez(buf, **opt.state_dict())
    buf.seek(0)
    with np.load(buf, allow_pickle=False) as f:
        state = dict(f)
    params2 = [Parameter(p.data.copy()) for p in params]
    opt2 = SGD(params2, lr=1.0)  # hyper-parameters come from the state
    opt2.load_state_dict(state)
    assert (opt2.lr, opt2.momentum, opt2.dampening, opt2.weight_decay, opt2.nesterov) == (0.05, 0.9, 0.1, 0.01, False)
    state["momentum_buffer.0"][...] = 123  # loaded buffers are copies
    run(opt2, params2, grads[3:])
    for p, r in zip(params2, ref_params):
        np.testing.assert_array_equal(p.data, r.data)


def test_load_state_dict_errors():
    p = Parameter(np.ones(3))
    opt = SGD([p], lr=0.1, momentum=0.9)
    p.grad = np.ones(3)
    opt.step()
    good = {k: np.array(v) for k, v in opt.state_dict().items()}
    with pytest.raises(ValueError, match="missing.*lr"):
        opt.load_state_dict({k: v for k, v in good.items() if k != "lr"})
    with pytest.raises(ValueError, match="unexpected.*bogus"):
        opt.load_state_dict({**good, "bogus": np.zeros(1)})
    with pytest.raises(ValueError, match="out of range"):
        opt.load_state_dict({**good, "momentum_buffer.1": np.zeros(3)})
    with pytest.raises(ValueError, match=r"momentum_buffer\.0.*\(3,\).*\(4,\)"):
        opt.load_state_dict({**good, "momentum_buffer.0": np.zeros(4)})
    with pytest.raises(ValueError, match="nesterov"):
        opt.load_state_dict({**good, "momentum": np.array(0.0), "nesterov": np.array(True)})
    with pytest.raises(ValueError, match="lr"):
        opt.load_state_dict({**good, "lr": np.array([0.1, 0.2])})
    assert opt.lr == 0.1 and opt.state_dict()["momentum_buffer.0"][0] == 1  # unchanged


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(lr=-0.1), ValueError, "lr"),
        (dict(lr=0.1, momentum=-0.5), ValueError, "momentum"),
        (dict(lr=0.1, weight_decay=-1.0), ValueError, "weight_decay"),
        (dict(lr=0.1, nesterov=True), ValueError, "nesterov"),
        (dict(lr=0.1, momentum=0.9, dampening=0.1, nesterov=True), ValueError, "nesterov"),
        (dict(lr="0.1"), TypeError, "lr"),
        (dict(lr=float("nan")), ValueError, "lr"),
        (dict(lr=0.1, nesterov=1), TypeError, "nesterov"),
    ],
)
def test_bad_hyper_parameters(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        SGD([Parameter(np.ones(1))], **kwargs)


def test_bad_params():
    p = Parameter(np.ones(1))
    with pytest.raises(ValueError, match="empty"):
        SGD([], lr=0.1)
    with pytest.raises(TypeError, match="iterable"):
        SGD(p, lr=0.1)
    with pytest.raises(TypeError, match=r"params\[1\]"):
        SGD([p, np.ones(1)], lr=0.1)
    with pytest.raises(ValueError, match="more than once"):
        SGD([p, p], lr=0.1)
    opt = SGD(iter([p]), lr=0.1)
    p.grad = np.ones(2)
    with pytest.raises(ValueError, match="shape"):
        opt.step()
