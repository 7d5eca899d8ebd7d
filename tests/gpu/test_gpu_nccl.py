"""mpidist._backends.device.nccl on real GPUs with CuPy arrays, at world sizes 1 and 2.

Skipped (with the reason) where there is no CuPy, no GPU, or, at 2 ranks sharing one
GPU, where NCCL is older than 2.30 or NCCL_MULTI_RANK_GPU_ENABLE=1 is not set (NCCL
refuses two ranks of one communicator on one GPU otherwise). Each rank uses GPU
``local_rank % device_count``. Inputs are small integers, so every expected value is
exact; every rank checks its own result against numpy.

Run: ``mpiexec -n 2 python -m pytest --with-mpi tests/gpu/test_gpu_nccl.py`` (and -n 1).
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

cupy = pytest.importorskip("cupy", reason="no CuPy: the NCCL path needs cupy (pip install mpidist[gpu])")

import mpidist  # noqa: E402
from mpidist import ReduceOp, make_premul_sum  # noqa: E402
from mpidist._backends.device import nccl, nccl_shim  # noqa: E402
from mpidist._backends.device.nccl_core import shared_gpu_refused, state  # noqa: E402
from mpidist._runtime import world as _runtime  # noqa: E402
from mpidist.p2p import P2POp  # noqa: E402

pytestmark = pytest.mark.mpi
_SIZE = MPI.COMM_WORLD.Get_size()


def _gpu_skip_reason() -> str:
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001
        return f"no usable GPU: {exc}"
    if count == 0:
        return "no GPU"
    try:
        from cupy.cuda import nccl as cnccl  # noqa: PLC0415

        version = cnccl.get_version()
    except Exception as exc:  # noqa: BLE001
        return f"CuPy has no NCCL: {exc}"
    if _SIZE > 2:
        return "the GPU tests run at world sizes 1 and 2"
    local = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED).Get_size()
    return shared_gpu_refused(version) if local > count else ""


_REASON = MPI.COMM_WORLD.allreduce(_gpu_skip_reason(), op=MPI.MAX)  # every rank skips alike
if _REASON:
    pytest.skip(_REASON, allow_module_level=True)


@pytest.fixture
def gpu(dist):
    """Bind this rank to its GPU and use the real CuPy shim."""
    nccl_shim.use(None)
    cupy.cuda.Device(_runtime.state().local_rank % cupy.cuda.runtime.getDeviceCount()).use()
    yield _runtime.state().world


def data(dtype, shape, *key: int) -> np.ndarray:
    rng = np.random.default_rng([59, *key])
    x = rng.integers(1, 4, size=shape)
    if np.dtype(dtype).kind == "c":
        x = x + 1j * rng.integers(1, 4, size=shape)
    if dtype is np.bool_:
        x = x > 2
    return np.asarray(x).astype(dtype)


def total(name: str, dtype, shape, n: int, salt: int) -> np.ndarray:
    parts = [data(dtype, shape, salt, r) for r in range(n)]
    if np.dtype(dtype).kind == "b":
        fn = np.logical_or if name in ("SUM", "MAX") else np.logical_and
    else:
        fn = {"SUM": np.add, "AVG": np.add, "PRODUCT": np.multiply, "MIN": np.minimum, "MAX": np.maximum}[name]
    acc = parts[0].copy()
    for p in parts[1:]:
        fn(acc, p, out=acc)
    return (acc / n).astype(dtype) if name == "AVG" else acc


CASES = [
    ("SUM", np.float32),
    ("SUM", np.int64),
    ("SUM", np.float16),
    ("AVG", np.float64),
    ("PRODUCT", np.int32),
    ("MIN", np.uint8),
    ("MAX", np.float32),
    ("SUM", np.bool_),
    ("PRODUCT", np.bool_),
    ("SUM", np.complex64),
    ("AVG", np.complex128),
]


@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.parametrize("name,dtype", CASES)
def test_all_reduce(gpu, name, dtype, async_op):
    me, n = MPI.COMM_WORLD.Get_rank(), _SIZE
    x = cupy.asarray(data(dtype, (33, 7), 1, me))
    work = nccl.run("all_reduce", gpu, {"tensor": x, "op": getattr(ReduceOp, name), "async_op": async_op})
    if async_op:
        assert work.wait() is True
    np.testing.assert_allclose(cupy.asnumpy(x), total(name, dtype, (33, 7), n, 1), rtol=1e-6)


def test_premul_sum_and_large_all_reduce(gpu):
    me, n = MPI.COMM_WORLD.Get_rank(), _SIZE
    x = cupy.full(1 << 22, me + 1, cupy.float32)  # 16 MiB
    nccl.run("all_reduce", gpu, {"tensor": x, "op": make_premul_sum(0.5)})
    assert float(x[0]) == float(x[-1]) == 0.5 * n * (n + 1) / 2


def test_broadcast_reduce_and_gathers(gpu):
    me, n = MPI.COMM_WORLD.Get_rank(), _SIZE
    b = cupy.asarray(data(np.int16, 10, 2, me))  # int16 moves as bytes
    nccl.run("broadcast", gpu, {"tensor": b, "src": n - 1})
    np.testing.assert_array_equal(cupy.asnumpy(b), data(np.int16, 10, 2, n - 1))
    r = cupy.asarray(data(np.float32, 10, 3, me))
    nccl.run("reduce", gpu, {"tensor": r, "dst": 0})
    if me == 0:
        np.testing.assert_array_equal(cupy.asnumpy(r), total("SUM", np.float32, 10, n, 3))
    inp = cupy.asarray(data(np.float64, (2, 3), 4, me))
    out = cupy.zeros((n, 2, 3))
    nccl.run("all_gather_into_tensor", gpu, {"output_tensor": out, "input_tensor": inp})
    np.testing.assert_array_equal(cupy.asnumpy(out), np.stack([data(np.float64, (2, 3), 4, k) for k in range(n)]))
    lists = [list(cupy.zeros((n, 2, 3))), [cupy.zeros((k + 1, 3)) for k in range(n)]]
    for outs, shape in zip(lists, [lambda k: (2, 3), lambda k: (k + 1, 3)]):
        nccl.run("all_gather", gpu, {"tensor_list": outs, "tensor": cupy.asarray(data(np.float64, shape(me), 5, me))})
        for k in range(n):
            np.testing.assert_array_equal(cupy.asnumpy(outs[k]), data(np.float64, shape(k), 5, k))
    gl = [cupy.zeros(k + 1) for k in range(n)] if me == 0 else None
    nccl.run("gather", gpu, {"tensor": cupy.asarray(data(np.float64, me + 1, 6, me)), "gather_list": gl, "dst": 0})
    if me == 0:
        for k in range(n):
            np.testing.assert_array_equal(cupy.asnumpy(gl[k]), data(np.float64, k + 1, 6, k))
    sl = [cupy.asarray(data(np.int32, 4, 7, k)) for k in range(n)] if me == 0 else None
    got = cupy.zeros(4, cupy.int32)
    nccl.run("scatter", gpu, {"tensor": got, "scatter_list": sl, "src": 0})
    np.testing.assert_array_equal(cupy.asnumpy(got), data(np.int32, 4, 7, me))


def test_reduce_scatter_and_all_to_all(gpu):
    me, n = MPI.COMM_WORLD.Get_rank(), _SIZE
    inp = cupy.asarray(data(np.float32, (n, 5), 8, me))
    out = cupy.zeros(5, cupy.float32)
    nccl.run("reduce_scatter_tensor", gpu, {"output": out, "input": inp, "op": ReduceOp.AVG})
    want = sum(data(np.float32, (n, 5), 8, k)[me] for k in range(n)) / n
    np.testing.assert_allclose(cupy.asnumpy(out), want, rtol=1e-6)
    ins = [cupy.asarray(data(np.float32, 5, 9, me, k)) for k in range(n)]
    nccl.run("reduce_scatter", gpu, {"output": out, "input_list": ins})
    np.testing.assert_array_equal(cupy.asnumpy(out), sum(data(np.float32, 5, 9, k, me) for k in range(n)))
    a_in = [cupy.asarray(data(np.int64, k + me + 1, 10, me, k)) for k in range(n)]
    a_out = [cupy.zeros(me + k + 1, cupy.int64) for k in range(n)]
    nccl.run("all_to_all", gpu, {"output_tensor_list": a_out, "input_tensor_list": a_in})
    for k in range(n):
        np.testing.assert_array_equal(cupy.asnumpy(a_out[k]), data(np.int64, k + me + 1, 10, k, me))
    single = cupy.asarray(np.concatenate([data(np.int64, (2, 2), 11, me, k) for k in range(n)]))
    nccl.run("all_to_all_single", gpu, {"output": single, "input": single})  # overlapping: staged
    np.testing.assert_array_equal(
        cupy.asnumpy(single), np.concatenate([data(np.int64, (2, 2), 11, k, me) for k in range(n)])
    )


@pytest.mark.mpi(min_size=2)
def test_point_to_point(gpu):
    me = MPI.COMM_WORLD.Get_rank()
    other = 1 - me
    if me > 1:
        return
    mine, got = cupy.asarray(data(np.float32, 1000, 12, me)), cupy.zeros(1000, cupy.float32)
    if me == 0:
        nccl.run("send", gpu, {"tensor": mine, "dst": other})
        assert nccl.run("recv", gpu, {"tensor": got, "src": other}) == other
    else:
        nccl.run("recv", gpu, {"tensor": got, "src": other})
        nccl.run("send", gpu, {"tensor": mine, "dst": other})
    np.testing.assert_array_equal(cupy.asnumpy(got), data(np.float32, 1000, 12, other))
    got[...] = 0
    works = [
        nccl.run("irecv", gpu, {"tensor": got, "src": other}),
        nccl.run("isend", gpu, {"tensor": mine, "dst": other}),
    ]
    for w in works:
        w.wait()
    np.testing.assert_array_equal(cupy.asnumpy(got), data(np.float32, 1000, 12, other))
    got[...] = 0
    ops = []
    for op, t in ((mpidist.irecv, got), (mpidist.isend, mine)):
        p = P2POp.__new__(P2POp)
        p.op, p.tensor, p.peer, p.group, p.tag = op, t, other, None, 0
        ops.append(p)
    for w in nccl.run("batch_isend_irecv", gpu, {"p2p_op_list": ops}):
        w.wait()
    np.testing.assert_array_equal(cupy.asnumpy(got), data(np.float32, 1000, 12, other))
    assert set(state(gpu).pairs) == {other} and state(gpu).main is not None


def test_stream_ordering_and_work(gpu):
    """An op on a side stream sees what was enqueued before it there, and work enqueued after
    it on that stream (the Work waited on) sees its result; the host is not blocked."""
    n = _SIZE
    side = cupy.cuda.Stream(non_blocking=True)
    with side:
        x = cupy.zeros(1 << 20, cupy.float32)
        x += 1  # enqueued on `side` before the all_reduce
        work = nccl.run("all_reduce", gpu, {"tensor": x, "async_op": True})
        work.wait()  # `side` waits on the op
        y = x * 2
    future = work.get_future()
    assert future.result(timeout=60) == [x]
    side.synchronize()
    assert work.is_completed() and float(y[0]) == 2.0 * n
    nccl.run("barrier", gpu, {})  # host waits
    assert state(gpu).made >= 1


def test_bad_device(gpu):
    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs in this process's view")
    nccl.run("all_reduce", gpu, {"tensor": cupy.ones(1)})  # makes the communicator (and its device)
    dev = state(gpu).device
    with cupy.cuda.Device(1 - dev if dev < 2 else 0):
        x = cupy.zeros(3)
    with pytest.raises(ValueError, match="is on device"):
        nccl.run("all_reduce", gpu, {"tensor": x})


# -- the public API: the router sends device arrays on an NCCL group to NCCL --------------------


@pytest.fixture
def nccl_group(gpu):
    """A group of every rank with torch's mixed backend string; destroyed afterwards."""
    g = mpidist.new_group(list(range(_SIZE)), backend="cpu:mpi,cuda:nccl")
    yield g
    if not g.destroyed:
        mpidist.destroy_process_group(g)


def test_public_ops_on_an_nccl_group(nccl_group):
    g, rank = nccl_group, MPI.COMM_WORLD.Get_rank()
    x = cupy.asarray(data(np.float32, (4, 5), 21, rank))
    assert mpidist.all_reduce(x, group=g) is None
    np.testing.assert_array_equal(cupy.asnumpy(x), total("SUM", np.float32, (4, 5), _SIZE, 21))
    y = cupy.full(3, rank, cupy.int64)
    mpidist.broadcast(y, src=_SIZE - 1, group=g, async_op=True).wait()
    assert cupy.asnumpy(y).tolist() == [_SIZE - 1] * 3
    out = cupy.zeros((_SIZE, 2), cupy.int32)
    mpidist.all_gather_into_tensor(out, cupy.full(2, rank, cupy.int32), group=g)
    assert cupy.asnumpy(out).tolist() == [[r, r] for r in range(_SIZE)]
    host = np.full(2, rank + 1.0)  # a host array on the same group goes through MPI
    mpidist.all_reduce(host, group=g)
    assert host.tolist() == [_SIZE * (_SIZE + 1) / 2] * 2
    assert state(_runtime.resolve_group(g)).made >= 1


def test_ddp_over_nccl_matches_ddp_over_mpi_on_the_host(nccl_group):
    """DDP on cupy parameters with an NCCL process group (bucket all-reduces and the fp16
    hook's future callbacks complete on NCCL's side) trains like DDP on numpy over MPI."""
    from mpidist.nn import CrossEntropyLoss, Linear, ReLU, Sequential  # noqa: PLC0415
    from mpidist.optim import SGD  # noqa: PLC0415
    from mpidist.parallel import DistributedDataParallel  # noqa: PLC0415
    from mpidist.parallel.comm_hooks import fp16_compress_hook  # noqa: PLC0415

    rank = MPI.COMM_WORLD.Get_rank()
    rng = np.random.default_rng(3)
    xs = rng.standard_normal((4, 8 * _SIZE, 6)).astype(np.float32)[:, rank * 8 : (rank + 1) * 8]
    ys = rng.integers(0, 3, size=(4, 8 * _SIZE))[:, rank * 8 : (rank + 1) * 8]
    for hook, tol in ((None, 1e-5), (fp16_compress_hook, 2e-2)):
        runs = []
        for on_gpu in (False, True):
            r = np.random.default_rng(40 + rank)
            model = Sequential(Linear(6, 16, rng=r), ReLU(), Linear(16, 3, rng=r))
            if on_gpu:
                model.to("cuda")
            ddp = DistributedDataParallel(model, process_group=nccl_group if on_gpu else None, bucket_cap_mb=0.001)
            if hook is not None:
                ddp.register_comm_hook(None, hook)
            opt, crit = SGD(model.parameters(), lr=0.1, momentum=0.9), CrossEntropyLoss()
            to = cupy.asarray if on_gpu else np.asarray
            for x, y in zip(xs, ys):
                opt.zero_grad()
                crit(ddp(to(x)), to(y))
                ddp.backward(crit.backward())
                opt.step()
            runs.append(model)
        ref, dev = runs
        mine = b"".join(cupy.asnumpy(p.data).tobytes() for p in dev.parameters())
        assert len(set(MPI.COMM_WORLD.allgather(mine))) == 1, "ranks' GPU models differ"
        for (name, p), q in zip(dev.named_parameters(), ref.parameters()):
            np.testing.assert_allclose(cupy.asnumpy(p.data), q.data, rtol=tol, atol=tol, err_msg=name)
    assert state(_runtime.resolve_group(nccl_group)).made >= 1
