"""The toolkit, SGD, DDP (buckets, comm hooks, join), the ring and checkpoints on *another array module*.

There is no GPU here, so cupy is stood in for by ``fakecp``, a module whose arrays
(:class:`XArray`, a numpy subclass in host memory) refuse numpy the way cupy arrays
refuse host code:

* any ``numpy.<function>`` or ufunc called on an XArray directly raises
  :class:`StrayNumpy` (a stray ``np.`` call where ``xp.`` was meant);
* giving a plain numpy array to an XArray operator, method or ``fakecp`` function
  raises TypeError (cupy refuses host/device mixing), so a buffer allocated with
  ``np.empty`` instead of ``xp.empty`` fails as soon as it meets device data;
* ``fakecp.cuda`` counts stream synchronizations and device contexts entered.

Every ``mpidist`` module's ``array_module`` (and ``cupy_module``) is patched to return
``fakecp`` for an XArray, so the code under test takes its device path. Because the
memory is host memory, MPI reads it directly (the collectives take their host path,
as they would hand a cupy array to a CUDA-aware MPI). The results must be bitwise
those of the numpy model, since the same numpy kernels run underneath.

What it cannot catch: numpy converts a subclass silently in ``np.asarray(x)`` and in
scalar constructors (``np.float32(x)``). Arrays made that way are plain numpy, so
they are caught when they meet an XArray, and the tests check that every array the
code keeps (parameters, grads, buckets, optimizer and hook state) is an XArray.
What only a GPU shows (streams, several devices, cupy's own kernels and QR) is in
tests/gpu/test_gpu_ddp.py.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import sys
import threading
import types

import numpy as np
import pytest
from fake_device import FakeDeviceArray
from mpi4py import MPI

import mpidist
import mpidist._arrays.namespace
import mpidist.nn._util
import mpidist.parallel.comm_hooks
import mpidist.parallel.reducer
from mpidist._arrays.buffers import mpi_reducible
from mpidist._arrays.reduce_op import ReduceOp
from mpidist.algorithms import ring_all_reduce
from mpidist.checkpoint import load_checkpoint, save_checkpoint
from mpidist.device import detect
from mpidist.nn import CrossEntropyLoss, Linear, Module, ReLU, Sequential
from mpidist.nn._util import HOST_TYPES
from mpidist.optim import SGD
from mpidist.parallel import DistributedDataParallel
from mpidist.parallel.comm_hooks import PowerSGDState, allreduce_hook, fp16_compress_hook, powerSGD_hook

pytestmark = pytest.mark.mpi


# -- the stand-in array module -----------------------------------------------------------
class StrayNumpy(AssertionError):
    """numpy was called directly on a device array."""


_tls = threading.local()


@contextlib.contextmanager
def _inside():
    """Mark a call through fakecp or an XArray method; yields True at the outermost one."""
    depth = getattr(_tls, "depth", 0)
    _tls.depth = depth + 1
    try:
        yield depth == 0
    finally:
        _tls.depth = depth


def _refuse_host(values, what: str) -> None:
    for v in values:
        if isinstance(v, (list, tuple)):
            _refuse_host(v, what)
        elif isinstance(v, np.ndarray) and not isinstance(v, XArray):
            raise TypeError(f"fakecp: {what} got a host numpy array (cupy refuses host/device mixing)")


def _wrap(x):
    """Results as device arrays: ndarrays as XArray views, numpy scalars as 0-d XArrays (as cupy)."""
    if isinstance(x, XArray):
        return x
    if isinstance(x, np.ndarray):
        return x.view(XArray)
    if isinstance(x, np.generic):
        return np.asarray(x).view(XArray)
    if isinstance(x, tuple):
        return tuple(_wrap(v) for v in x)
    return x


class _Device:
    """``cupy.cuda.Device``: one device, id 0; entering it is counted."""

    entered = 0

    def __init__(self, device=None):
        if device not in (None, 0):
            raise RuntimeError(f"fakecp: no device {device}")
        self.id = 0

    def __enter__(self):
        _Device.entered += 1
        return self

    def __exit__(self, *exc):
        return False


class XArray(np.ndarray):
    """A "device" array: host memory, but numpy may not compute on it directly."""

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if not getattr(_tls, "depth", 0):
            name = ufunc.__name__ + ("" if method == "__call__" else f".{method}")
            raise StrayNumpy(f"numpy.{name} called directly on a device array (use the array's module)")
        args = [x.view(np.ndarray) if isinstance(x, XArray) else x for x in inputs]
        out = kwargs.get("out")
        if out:
            kwargs["out"] = tuple(o.view(np.ndarray) if isinstance(o, XArray) else o for o in out)
        result = getattr(ufunc, method)(*args, **kwargs)
        if out:
            return out[0] if len(out) == 1 else out
        return _wrap(result)

    def __array_function__(self, func, types, args, kwargs):
        if not getattr(_tls, "depth", 0):
            raise StrayNumpy(f"numpy.{func.__name__} called directly on a device array (use the array's module)")
        return _wrap(super().__array_function__(func, types, args, kwargs))

    @property
    def device(self):
        return _Device(0)

    def get(self):
        return np.array(self.view(np.ndarray))


def _method(name):
    base = getattr(np.ndarray, name)

    def call(self, *args, **kwargs):
        with _inside() as outermost:
            if outermost:
                _refuse_host(list(args) + list(kwargs.values()), f"ndarray.{name}")
            return _wrap(base(self, *args, **kwargs))

    call.__name__ = name
    return call


_NOT_WRAPPED = {
    "__new__",
    "__init__",
    "__init_subclass__",
    "__subclasshook__",
    "__class__",
    "__getattribute__",
    "__setattr__",
    "__delattr__",
    "__dir__",
    "__reduce__",
    "__reduce_ex__",
    "__setstate__",
    "__getstate__",
    "__sizeof__",
    "__class_getitem__",
    "__buffer__",
    "__release_buffer__",
    "view",
}  # view: metadata only, and how the stand-in itself unwraps
for _name in dir(np.ndarray):
    _attr = getattr(np.ndarray, _name)
    if (
        callable(_attr)
        and not isinstance(_attr, type)
        and _name not in _NOT_WRAPPED
        and not _name.startswith(("__array", "__dlpack"))
        and _name not in XArray.__dict__
    ):
        setattr(XArray, _name, _method(_name))


def _function(fn, name):
    def call(*args, **kwargs):
        with _inside() as outermost:
            if outermost:
                _refuse_host(list(args) + list(kwargs.values()), f"fakecp.{name}")
            return _wrap(fn(*args, **kwargs))

    return call


class _Namespace:
    def __init__(self, module, name):
        self._module, self._name = module, name

    def __getattr__(self, name):
        return _function(getattr(self._module, name), f"{self._name}.{name}")


class _Stream:
    def __init__(self, owner):
        self._owner = owner

    def synchronize(self):
        with self._owner.lock:
            self._owner.syncs += 1


class FakeCupy(types.ModuleType):
    """numpy's namespace, computing on XArrays; ``asarray``/``asnumpy`` move host <-> "device"."""

    ndarray = XArray

    def __init__(self):
        super().__init__("fakecp")
        self.syncs = 0
        self.lock = threading.Lock()
        self.linalg = _Namespace(np.linalg, "linalg")
        self.cuda = types.SimpleNamespace(Device=_Device, get_current_stream=lambda: _Stream(self))

    def __getattr__(self, name):
        obj = getattr(np, name)
        if isinstance(obj, type) or not callable(obj):
            return obj
        return _function(obj, name)

    def asarray(self, a, dtype=None):
        if isinstance(a, XArray):
            return a if dtype is None or a.dtype == np.dtype(dtype) else a.astype(dtype)
        return np.array(a, dtype=dtype).view(XArray)  # host -> device: a copy

    def array(self, a, dtype=None):
        return np.array(a.get() if isinstance(a, XArray) else a, dtype=dtype).view(XArray)

    def asnumpy(self, a):
        return a.get() if isinstance(a, XArray) else np.asarray(a)


@pytest.fixture
def fakecp(monkeypatch):
    """Patch every loaded mpidist module to see XArrays as arrays of ``fakecp``."""
    fake = FakeCupy()
    real_module, real_cupy = mpidist._arrays.namespace.array_module, mpidist.nn._util.cupy_module

    def array_module(x):
        return fake if isinstance(x, XArray) else real_module(x)

    # Host memory stands in for device memory, which MPI may read as a CUDA-aware MPI would.
    monkeypatch.setattr(detect, "_detected", detect.Detection(True, "fakecp: host memory as device memory"))
    for name, mod in list(sys.modules.items()):
        if name.startswith("mpidist"):
            if getattr(mod, "array_module", None) is real_module:
                monkeypatch.setattr(mod, "array_module", array_module)
            if getattr(mod, "cupy_module", None) is real_cupy:
                monkeypatch.setattr(mod, "cupy_module", lambda op: fake)
    return fake


# -- models and data ------------------------------------------------------------------------
D_IN, HIDDEN, CLASSES, BATCH, STEPS = 5, 9, 3, 4, 4


def mlp(seed: int) -> Sequential:
    rng = np.random.default_rng(seed)
    return Sequential(
        Linear(D_IN, HIDDEN, dtype=np.float32, rng=rng),
        ReLU(),
        Linear(HIDDEN, HIDDEN, dtype=np.float32, rng=rng),
        ReLU(),
        Linear(HIDDEN, CLASSES, dtype=np.float32, rng=rng),
    )


class WithSpare(Module):
    """An MLP plus a layer that never takes part in the loss (find_unused_parameters)."""

    def __init__(self, seed: int):
        super().__init__()
        self.body = mlp(seed)
        self.spare = Linear(2, 2, rng=seed)

    def forward(self, x):
        return self.body(x)

    def backward(self, g):
        return self.body.backward(g)


def batches(world_size: int, rank: int, steps: int = STEPS):
    rng = np.random.default_rng(77)
    x = rng.standard_normal((steps, world_size * BATCH, D_IN)).astype(np.float32)
    y = rng.integers(0, CLASSES, size=(steps, world_size * BATCH))
    mine = slice(rank * BATCH, (rank + 1) * BATCH)
    return x[:, mine], y[:, mine]


def host(a) -> np.ndarray:
    return a.get() if isinstance(a, XArray) else a


def assert_on_device(arrays, what: str) -> None:
    for i, a in enumerate(arrays):
        assert type(a) is XArray, f"{what}[{i}] is a {type(a).__name__}, not a device array"


def assert_bitwise(dev_model, ref_model) -> None:
    for (name, p), q in zip(dev_model.named_parameters(), ref_model.parameters()):
        assert host(p.data).tobytes() == q.data.tobytes(), name


def train_step(model, crit, opt, x, y, to_device) -> float:
    opt.zero_grad()
    loss = crit(model(to_device(x)), to_device(y))
    model.backward(crit.backward())
    opt.step()
    return loss


# -- the stand-in works -------------------------------------------------------------------
def test_the_stand_in_refuses_numpy_and_host_mixing(fakecp):
    a = fakecp.arange(6.0)
    with pytest.raises(StrayNumpy, match=r"numpy.divide called directly on a device array"):
        np.divide(a, 2, out=a)
    with pytest.raises(StrayNumpy, match=r"numpy.copyto called directly"):
        np.copyto(a, a)
    with pytest.raises(StrayNumpy, match=r"numpy.add.reduce called directly"):
        np.add.reduce(a)
    with pytest.raises(StrayNumpy, match=r"numpy.matmul called directly"):
        np.matmul(a.reshape(2, 3), a.reshape(3, 2))
    with pytest.raises(TypeError, match=r"ndarray.__add__ got a host numpy array"):
        a + np.ones(6)  # noqa: B018
    with pytest.raises(TypeError, match=r"ndarray.__setitem__ got a host numpy array"):
        a[...] = np.ones(6)
    with pytest.raises(TypeError, match=r"fakecp.add got a host numpy array"):
        fakecp.add(a, np.ones(6))
    b = fakecp.divide(a, 2)
    c = (a + 1).sum()
    assert type(b) is XArray and type(c) is XArray and c.ndim == 0 and float(c) == 21.0
    np.testing.assert_array_equal(fakecp.asnumpy(b), np.arange(6.0) / 2)
    assert type(fakecp.asnumpy(b)) is np.ndarray and type(fakecp.empty(3)) is XArray
    assert type(fakecp.linalg.qr(fakecp.ones((4, 3)))[0]) is XArray


# -- the toolkit and SGD -----------------------------------------------------------------------
def test_model_moves_to_the_device_and_trains_bitwise_like_numpy(fakecp, world):
    rank, size = world
    ref, dev = mlp(0), mlp(0)
    params = dev.parameters()
    assert dev.to("cuda") is dev and dev.parameters() == params  # same Parameter objects, moved in place
    assert_on_device([p.data for p in params], "parameters")
    ref_opt = SGD(ref.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3, nesterov=True)
    opt = SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-3, nesterov=True)
    crit, ref_crit = CrossEntropyLoss(), CrossEntropyLoss()
    x, y = batches(size, rank)
    for step in range(STEPS):
        want = train_step(ref, ref_crit, ref_opt, x[step], y[step], lambda a: a)
        got = train_step(dev, crit, opt, x[step], y[step], fakecp.asarray)
        assert got == want
        assert_bitwise(dev, ref)
    assert_on_device([p.grad for p in params], "grads")
    assert_on_device(opt._momentum_buffers, "momentum buffers")
    # back to the host, then to the device again: the optimizer state follows the parameters
    assert dev.cpu() is dev and all(type(p.data) is np.ndarray and type(p.grad) in HOST_TYPES for p in params)
    assert_bitwise(dev, ref)
    train_step(dev, crit, opt, x[0], y[0], lambda a: a)
    train_step(ref, ref_crit, ref_opt, x[0], y[0], lambda a: a)
    assert all(type(b) is np.ndarray for b in opt._momentum_buffers)
    dev.cuda()
    train_step(dev, crit, opt, x[1], y[1], fakecp.asarray)
    train_step(ref, ref_crit, ref_opt, x[1], y[1], lambda a: a)
    assert_on_device(opt._momentum_buffers, "momentum buffers")
    assert_bitwise(dev, ref)


def test_linear_device_argument_and_buffers_move(fakecp):
    lin = Linear(3, 2, rng=5, device="cuda:0")
    assert_on_device([lin.weight.data, lin.bias.data], "Linear(device='cuda:0')")
    assert host(lin.weight.data).tobytes() == Linear(3, 2, rng=5).weight.data.tobytes()
    lin.register_buffer("running", np.zeros(2, np.float32))
    lin.to("cuda")
    assert type(lin.running) is XArray and lin.state_dict()["running"] is lin.running
    lin.to("cpu")
    assert type(lin.running) is np.ndarray and lin.buffers()[0] is lin.running


def test_device_mismatches_raise_clear_type_errors(fakecp):
    model = mlp(0).to("cuda")
    x = np.ones((2, D_IN), np.float32)
    with pytest.raises(
        TypeError,
        match=r"Linear.forward: x must be on cuda:0 \(the device of parameter "
        r"'0.weight'\), got a cpu array",
    ):
        model(x)
    out = model(fakecp.asarray(x))
    with pytest.raises(
        TypeError,
        match=r"Linear.backward: grad_output must be on cuda:0 \(the device of "
        r"parameter '4.weight'\), got a cpu array",
    ):
        model.backward(np.ones(out.shape, np.float32))
    relu = ReLU()
    relu(fakecp.ones(3))
    with pytest.raises(
        TypeError,
        match=r"ReLU.backward: grad_output must be on cuda:0 \(the device of the "
        r"forward input\), got a cpu array",
    ):
        relu.backward(np.ones(3))
    p = model[0].bias
    with pytest.raises(
        TypeError,
        match=r"Parameter.accumulate_grad: grad for '0.bias' must be on cuda:0 "
        r"\(the device of the parameter\), got a cpu array",
    ):
        p.accumulate_grad(np.ones(p.shape, np.float32))
    p.grad = np.ones(p.shape, np.float32)
    with pytest.raises(
        TypeError,
        match=r"SGD.step: grad of '0.bias' must be on cuda:0 \(the device of its "
        r"parameter\), got a cpu array",
    ):
        SGD([p], lr=0.1).step()
    # the host model refuses device inputs the same way
    with pytest.raises(TypeError, match=r"x must be on cpu \(the device of parameter '0.weight'\), got a cuda:0"):
        mlp(0)(fakecp.asarray(x))


def test_checkpoint_round_trip_lands_on_the_modules_device(fakecp, tmp_path, world):
    rank, size = world
    model = mlp(3).to("cuda")
    opt = SGD(model.parameters(), lr=0.1, momentum=0.5)
    x, y = batches(size, rank)
    train_step(model, CrossEntropyLoss(), opt, x[0], y[0], fakecp.asarray)
    save_checkpoint(tmp_path / "m.npz", model.state_dict())
    save_checkpoint(tmp_path / "o.npz", opt.state_dict())
    files = {k: load_checkpoint(tmp_path / f"{k}.npz") for k in "mo"}
    assert all(type(a) is np.ndarray for d in files.values() for a in d.values())  # host copies
    again = mlp(4).to("cuda")
    again_opt = SGD(again.parameters(), lr=0.2)
    again.load_state_dict(files["m"])
    again_opt.load_state_dict(files["o"])
    assert_on_device([p.data for p in again.parameters()], "loaded parameters")
    assert_on_device([b for b in again_opt._momentum_buffers], "loaded momentum buffers")
    for p, q in zip(again.parameters(), model.parameters()):
        assert p.data is not q.data and p.data.get().tobytes() == q.data.get().tobytes()
    for a, b in zip(again_opt._momentum_buffers, opt._momentum_buffers):
        assert a is not b and a.get().tobytes() == b.get().tobytes()
    on_host = mlp(4)
    on_host.load_state_dict(model.state_dict())  # device arrays into a host model: copied down
    assert_bitwise(model, on_host)


# -- DDP -------------------------------------------------------------------------------------
def _host_avg_hook(group, bucket):
    """A hook that averages a host copy: DDP must copy its host result back onto the device."""
    buf = bucket.buffer()
    local = buf.get() if isinstance(buf, XArray) else buf.copy()
    local /= mpidist.get_world_size(group)
    mpidist.all_reduce(local, group=group)
    fut = concurrent.futures.Future()
    fut.set_result(local)
    return fut


CONFIGS = {
    "mpi": dict(bucket_cap_mb=0.0005),
    "ring-view": dict(algorithm="ring", gradient_as_bucket_view=True, bucket_cap_mb=0.0005),
    "unused": dict(find_unused_parameters=True, bucket_cap_mb=0.0005),
    "allreduce_hook": dict(hook=allreduce_hook),
    "fp16_hook": dict(hook=fp16_compress_hook),
    "host_hook": dict(hook=_host_avg_hook),
    "powersgd-gs": dict(hook=powerSGD_hook, psgd=dict(matrix_approximation_rank=1)),
    "powersgd-qr": dict(
        hook=powerSGD_hook, psgd=dict(matrix_approximation_rank=3, min_compression_rate=0.5, warm_start=False)
    ),
    "join": dict(join=True),
}


def spy_all_reduce(monkeypatch) -> list:
    """Record the type of every floating array DDP and its hooks all-reduce (from then on)."""
    seen: list = []
    real = mpidist.parallel.reducer.all_reduce

    def all_reduce(tensor, *args, **kwargs):
        if tensor.dtype.kind == "f":
            seen.append(type(tensor))
        if kwargs.get("algorithm") is None:
            # as the device router does: the automatic choice's host-only algorithm (shared
            # memory) never gets device memory (XArray is a numpy subclass, so the router
            # cannot see it is playing a device array); the host run takes the same
            # algorithm, so float16 sums round alike and the runs stay bitwise comparable
            kwargs["algorithm"] = "mpi" if mpi_reducible(tensor.dtype) else "ring"
        return real(tensor, *args, **kwargs)

    for mod in (mpidist.parallel.reducer, mpidist.parallel.comm_hooks):
        monkeypatch.setattr(mod, "all_reduce", all_reduce)
    return seen


@pytest.mark.parametrize("config", list(CONFIGS))
def test_ddp_on_the_device_equals_ddp_on_the_host_bitwise(fakecp, world, config, monkeypatch):
    rank, size = world
    opts = dict(CONFIGS[config])
    hook, psgd, join = opts.pop("hook", None), opts.pop("psgd", None), opts.pop("join", False)
    make = WithSpare if opts.get("find_unused_parameters") else mlp
    steps = STEPS - rank % 2 if join else STEPS  # uneven inputs: odd ranks run out first
    x, y = batches(size, rank)
    runs = []
    for on_gpu in (False, True):
        model = make(10 + rank)
        to_device = fakecp.asarray if on_gpu else (lambda a: a)
        if on_gpu:
            model.to("cuda")
        ddp = DistributedDataParallel(model, **opts)
        state = None
        if hook is not None:
            state = PowerSGDState(None, start_powerSGD_iter=2, **psgd) if psgd else None
            ddp.register_comm_hook(state, hook)
        runs.append((model, ddp, SGD(model.parameters(), lr=0.1, momentum=0.9), CrossEntropyLoss(), state, to_device))
    seen = spy_all_reduce(monkeypatch)
    for _model, ddp, opt, crit, _, to_device in runs:  # one model after the other: joins do not interleave
        seen.clear()
        with ddp.join() if join else contextlib.nullcontext():
            for step in range(steps):
                opt.zero_grad()
                crit(ddp(to_device(x[step])), to_device(y[step]))
                ddp.backward(crit.backward())
                opt.step()
    # the device model's gradients were all-reduced as device arrays (shadowing joined ranks included)
    assert set(seen) == (set() if config == "host_hook" else {XArray}), set(seen)
    (ref, ref_ddp, *_), (dev, ddp, opt, _, state, _) = runs
    assert_bitwise(dev, ref)
    mine = b"".join(host(p.data).tobytes() for p in dev.parameters())
    assert len(set(MPI.COMM_WORLD.allgather(mine))) == 1
    assert_on_device([b.flat for b in ddp.reducer.buckets], "buckets")
    assert_on_device([p.grad for p in dev.parameters() if p.grad is not None], "grads")
    assert_on_device(opt._momentum_buffers[:6], "momentum buffers")
    if config == "unused":
        assert dev.spare.weight.grad is None and ref.spare.weight.grad is None
    if psgd:
        assert_on_device(
            [*state.error_dict.values(), *state.p_memory_dict.values(), *state.q_memory_dict.values()], "PowerSGD state"
        )
        assert state.iter == STEPS


def test_ddp_device_placement_arguments(fakecp, dist):
    model = mlp(0).to("cuda")
    ddp = DistributedDataParallel(model, device_ids=[0], output_device="cuda:0")
    assert (ddp.device, ddp.device_ids, ddp.output_device) == ("cuda:0", [0], 0)
    assert DistributedDataParallel(model).device_ids is None
    with pytest.raises(
        ValueError,
        match=r"device_ids must be None or \[0\] for a module on cuda:0 \(one device "
        r"per process\), got \[0, 1\]",
    ):
        DistributedDataParallel(model, device_ids=[0, 1])
    with pytest.raises(ValueError, match=r"output_device must be None or 0 for a module on cuda:0, got 'cuda:1'"):
        DistributedDataParallel(model, output_device="cuda:1")
    mixed = mlp(0)
    mixed[2].to("cuda")
    with pytest.raises(
        ValueError,
        match=r"all parameters of the module must be on one device, got cpu: "
        r"\['0.weight', '0.bias', '4.weight', '...'\]; cuda:0: \['2.weight', "
        r"'2.bias'\]; move the module with module.to\(device\) first",
    ):
        DistributedDataParallel(mixed)


# -- the ring ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "dtype, op",
    [("float32", ReduceOp.SUM), ("float64", ReduceOp.MAX), ("int32", ReduceOp.PRODUCT), ("bool", ReduceOp.SUM)],
)
def test_ring_on_the_device_equals_the_host_ring_and_syncs_each_step(fakecp, dtype, op):
    comm = MPI.COMM_WORLD.Dup()
    try:
        n, rank = comm.Get_size(), comm.Get_rank()
        data = np.random.default_rng(rank).standard_normal(2 * n + 3) * 3
        on_host = data.astype(dtype)
        on_device = fakecp.asarray(on_host)
        ring_all_reduce(comm, on_host, op)
        entered = _Device.entered
        ring_all_reduce(comm, on_device, op)
        assert type(on_device) is XArray and on_device.get().tobytes() == on_host.tobytes()
        # synchronized before the first send and after each of the n - 1 local reductions
        assert fakecp.syncs == (n if n > 1 else 0)
        assert _Device.entered - entered == (1 if n > 1 else 0)
    finally:
        comm.Free()


def test_ring_refuses_device_arrays_it_cannot_compute_on():
    buf = FakeDeviceArray.from_host(np.ones(4, np.float32))
    with pytest.raises(
        TypeError,
        match=r"ring_all_reduce: buf is a device array of type FakeDeviceArray, which "
        r"mpidist cannot reduce on the device \(only cupy arrays\)",
    ):
        ring_all_reduce(MPI.COMM_SELF, buf, ReduceOp.SUM)


def test_ring_refuses_device_arrays_when_mpi_is_not_cuda_aware(fakecp, monkeypatch):
    """Called directly (not through all_reduce, which stages), the ring must not hand a
    device pointer to an MPI that is not CUDA-aware: that would segfault."""
    monkeypatch.setattr(detect, "_detected", detect.Detection(False, "MPIDIST_CUDA_AWARE=0"))
    buf = fakecp.asarray(np.ones(4, np.float32))
    with pytest.raises(
        TypeError,
        match=r"ring_all_reduce: buf is a device array \(XArray\) and MPI is not "
        r"CUDA-aware \(MPIDIST_CUDA_AWARE=0\): MPI would dereference a device "
        r"pointer and crash. Use mpidist.all_reduce\(buf, algorithm='ring'\)",
    ):
        ring_all_reduce(MPI.COMM_SELF, buf, ReduceOp.SUM)
