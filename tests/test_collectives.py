"""Collectives on numpy arrays against values computed without mpidist."""
from __future__ import annotations

import time

import numpy as np
import pytest
from mpi4py import MPI

from mpidist import ReduceOp

pytestmark = pytest.mark.mpi

OPS = [ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX]
DTYPES = [np.float32, np.float64, np.int32, np.int64]


def rank_input(rank: int, shape, dtype) -> np.ndarray:
    """Rank ``rank``'s input: small integer values, so sums and products are exact in every dtype."""
    rng = np.random.default_rng([7, rank])
    return rng.integers(1, 4, size=shape).astype(dtype)


def expected(op: ReduceOp, size: int, shape, dtype) -> np.ndarray:
    stack = np.stack([rank_input(r, shape, dtype) for r in range(size)])
    if op is ReduceOp.SUM:
        return stack.sum(0, dtype=dtype)
    if op is ReduceOp.AVG:
        return (stack.sum(0, dtype=dtype) / dtype(size)).astype(dtype)
    if op is ReduceOp.PRODUCT:
        return stack.prod(0, dtype=dtype)
    return stack.min(0) if op is ReduceOp.MIN else stack.max(0)


def same_bytes_everywhere(arr: np.ndarray) -> bool:
    return len(set(MPI.COMM_WORLD.allgather(arr.tobytes()))) == 1


@pytest.mark.parametrize("algorithm", ["mpi", "ring"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_all_reduce_matches_numpy(dist, world, op, dtype, algorithm):
    rank, size = world
    if op is ReduceOp.AVG and np.dtype(dtype).kind != "f":
        pytest.skip("AVG is for floating dtypes")
    shape = (3, 5)
    x = rank_input(rank, shape, dtype)
    assert dist.all_reduce(x, op=op, algorithm=algorithm) is None
    np.testing.assert_array_equal(x, expected(op, size, shape, dtype))
    assert x.dtype == dtype and x.shape == shape
    assert same_bytes_everywhere(x)


@pytest.mark.parametrize("n", [0, 1, 7, 1000, 65537])
def test_ring_equals_mpi_bitwise_on_floats(dist, world, n):
    rank, _ = world
    rng = np.random.default_rng([11, rank])
    a = rng.standard_normal(n).astype(np.float32)
    b = a.copy()
    dist.all_reduce(a, algorithm="mpi")
    dist.all_reduce(b, algorithm="ring")
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert same_bytes_everywhere(a) and same_bytes_everywhere(b)


def test_all_reduce_float16_goes_through_ring(dist, world):
    rank, size = world
    x = np.full(9, rank + 1, dtype=np.float16)
    dist.all_reduce(x)
    np.testing.assert_array_equal(x, np.full(9, size * (size + 1) / 2, dtype=np.float16))
    with pytest.raises(TypeError, match=r"algorithm='mpi' cannot reduce dtype float16"):
        dist.all_reduce(x, algorithm="mpi")


@pytest.mark.parametrize("algorithm", ["mpi", "ring"])
def test_async_all_reduce_returns_work(dist, world, algorithm):
    rank, size = world
    x = np.full(1000, float(rank))
    work = dist.all_reduce(x, async_op=True, algorithm=algorithm)
    assert work is not None
    assert work.wait() is True
    assert work.is_completed() and work.is_success() and work.exception() is None
    out = work.result()
    assert len(out) == 1 and out[0] is x
    np.testing.assert_array_equal(x, np.full(1000, size * (size - 1) / 2))


def test_async_ops_complete_in_issue_order(dist, world):
    rank, size = world
    xs = [np.full(50_000, float(rank + i)) for i in range(4)]
    works = [dist.all_reduce(x, async_op=True, algorithm=("ring" if i % 2 else "mpi")) for i, x in enumerate(xs)]
    y = np.full(3, float(rank))
    dist.all_reduce(y)  # a sync op issued behind pending async ones waits its turn
    for i, (w, x) in enumerate(zip(works, xs)):
        w.wait()
        np.testing.assert_array_equal(x, np.full(50_000, size * (size - 1) / 2 + size * i))
    np.testing.assert_array_equal(y, np.full(3, size * (size - 1) / 2))


def test_async_all_reduce_progresses_while_caller_computes(dist, world):
    """The caller never calls into MPI or wait(); the op still completes."""
    rank, size = world
    x = np.ones(4 * 2**20 // 4, dtype=np.float32)
    work = dist.all_reduce(x, async_op=True)
    m = np.random.default_rng(0).standard_normal((200, 200))
    deadline = time.monotonic() + 60
    while not work.is_completed() and time.monotonic() < deadline:
        m = np.tanh(m @ m.T / 200.0)
    assert work.is_completed(), "async all_reduce made no progress while the caller computed"
    work.wait()
    assert float(x[0]) == size and float(x[-1]) == size


@pytest.mark.parametrize("dtype", [np.float64, np.int16, np.uint8, np.bool_])
def test_broadcast_from_every_rank(dist, world, dtype):
    rank, size = world
    for src in range(size):
        x = (np.arange(6).reshape(2, 3) + 10 * rank).astype(dtype)
        dist.broadcast(x, src=src)
        np.testing.assert_array_equal(x, (np.arange(6).reshape(2, 3) + 10 * src).astype(dtype))


def test_async_broadcast(dist, world):
    rank, size = world
    src = size - 1
    x = np.full(100, rank, dtype=np.int64)
    work = dist.broadcast(x, src, async_op=True)
    work.wait()
    assert work.is_completed()
    np.testing.assert_array_equal(x, np.full(100, src))


def test_barrier_and_async_barrier(dist, world):
    assert dist.barrier() is None
    work = dist.barrier(async_op=True)
    assert work.wait() is True and work.is_completed()


@pytest.mark.parametrize("stacked", [False, True])
def test_all_gather_into_tensor(dist, world, stacked):
    rank, size = world
    inp = np.full((2, 3), rank, dtype=np.int32)
    out = np.empty((size, 2, 3) if stacked else (2 * size, 3), dtype=np.int32)
    dist.all_gather_into_tensor(out, inp)
    want = np.stack([np.full((2, 3), r, dtype=np.int32) for r in range(size)])
    np.testing.assert_array_equal(out.reshape(size, 2, 3), want)


# -- bad input: each case names rank, op and argument --------------------------------------
PREFIX = r"\[rank \d+/\d+\] "


def test_non_contiguous_tensor_rejected(dist):
    x = np.zeros((4, 4))[:, ::2]
    with pytest.raises(ValueError, match=PREFIX + r"all_reduce: tensor must be C-contiguous"):
        dist.all_reduce(x)
    with pytest.raises(ValueError, match=PREFIX + r"broadcast: tensor must be C-contiguous"):
        dist.broadcast(x, 0)


def test_read_only_tensor_rejected(dist):
    x = np.zeros(4)
    x.flags.writeable = False
    with pytest.raises(ValueError, match=PREFIX + r"all_reduce: tensor must be writable"):
        dist.all_reduce(x)


def test_not_an_array_rejected(dist):
    with pytest.raises(TypeError, match=PREFIX + r"all_reduce: tensor must be a numpy.ndarray, got list"):
        dist.all_reduce([1.0, 2.0])
    with pytest.raises(TypeError, match=r"has dtype object"):
        dist.all_reduce(np.array([object()]))


def test_bad_op_rejected(dist):
    with pytest.raises(TypeError, match=PREFIX + r"all_reduce: op must be a mpidist.ReduceOp, got 'sum'"):
        dist.all_reduce(np.ones(2), op="sum")
    with pytest.raises(ValueError, match=r"ReduceOp.AVG needs a floating or complex dtype, got int64"):
        dist.all_reduce(np.ones(2, dtype=np.int64), op=ReduceOp.AVG)
    with pytest.raises(ValueError, match=r"ReduceOp.MAX is not defined for complex"):
        dist.all_reduce(np.ones(2, dtype=np.complex64), op=ReduceOp.MAX)


def test_bad_algorithm_rejected(dist):
    with pytest.raises(ValueError, match=r"algorithm must be one of \('mpi', 'ring'\) or None, got 'tree'"):
        dist.all_reduce(np.ones(2), algorithm="tree")


def test_out_of_range_src_rejected(dist, world):
    _, size = world
    for bad in (size, -1):
        with pytest.raises(ValueError, match=PREFIX + rf"broadcast: src={bad}: global rank {bad} is not part"):
            dist.broadcast(np.ones(2), src=bad)
    with pytest.raises(TypeError, match=r"src must be an int"):
        dist.broadcast(np.ones(2), src="0")


def test_all_gather_into_tensor_mismatch_rejected(dist, world):
    _, size = world
    with pytest.raises(TypeError, match=r"input_tensor dtype float32 does not match output_tensor dtype float64"):
        dist.all_gather_into_tensor(np.empty(2 * size), np.ones(2, dtype=np.float32))
    with pytest.raises(ValueError, match=rf"output_tensor must hold world_size \* input_tensor.size = {size} \* 2"):
        dist.all_gather_into_tensor(np.empty(2 * size + 1), np.ones(2))


def test_device_array_refused_before_mpi(dist):
    class FakeDeviceArray:
        __cuda_array_interface__ = {"shape": (2,), "typestr": "<f4", "data": (0, False), "version": 3}

    with pytest.raises(TypeError, match=r"all_reduce: tensor is a device \(GPU\) array"):
        dist.all_reduce(FakeDeviceArray())
