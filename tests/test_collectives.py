"""Collectives on numpy arrays against values computed without mpidist."""

from __future__ import annotations

import dataclasses
import os
import time

import numpy as np
import pytest
from mpi4py import MPI

from mpidist import ReduceOp
from mpidist._backends.mpi import collectives
from mpidist.algorithms import ShmAllReduce
from mpidist.algorithms.shm import DEFAULT_SLOT_BYTES

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


@pytest.mark.parametrize("algorithm", ["mpi", "ring", "shm", "hierarchical", None])
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


def test_all_reduce_float16_small_goes_through_shared_memory(dist, world, counted):
    """MPI cannot reduce float16: the ring or, where measured faster (small sizes), shared memory."""
    rank, size = world
    x = np.full(9, rank + 1, dtype=np.float16)
    dist.all_reduce(x)
    assert counted == ({"shm": 1} if size > 1 else {"ring": 1})
    np.testing.assert_array_equal(x, np.full(9, size * (size + 1) / 2, dtype=np.float16))
    with pytest.raises(TypeError, match=r"algorithm='mpi' cannot reduce dtype float16"):
        dist.all_reduce(x, algorithm="mpi")


@pytest.mark.parametrize("algorithm", ["mpi", "ring", "shm", "hierarchical", None])
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


def test_a_registered_algorithm_is_selectable_and_runs_at_every_size(dist, world, monkeypatch):
    """Adding an all_reduce algorithm is a body and one record (collectives.ALL_REDUCE):
    selectable by name at once, and its body runs at 8 bytes too (all_reduce's inline path
    calls MPI_Allreduce itself only below a record's own ``inline_below``, 0 by default)."""
    rank, size = world
    ran = []

    def body(g, arr, op):
        ran.append(arr.nbytes)
        collectives.ALL_REDUCE["ring"].body(g, arr, op)

    monkeypatch.setitem(collectives.ALL_REDUCE, "mine", collectives.AllReduceAlgorithm("mine", body))
    collectives._reset_choice()
    try:
        for n in (1, 4096):
            x = np.full(n, rank + 1.0)
            assert dist.all_reduce(x, algorithm="mine") is None
            assert np.all(x == size * (size + 1) / 2)
    finally:
        collectives._reset_choice()
    assert ran == [8, 32768]


# -- the automatic choice (algorithm=None) and the shared-memory algorithm --------------------
@pytest.fixture
def counted(monkeypatch):
    """How often each all_reduce body ran (the inline MPI path of small sync calls runs none)."""
    calls: dict = {}
    for name in ("mpi", "ring", "shm"):
        alg = collectives.ALL_REDUCE[name]

        def wrapper(*args, _body=alg.body, _name=name):
            calls[_name] = calls.get(_name, 0) + 1
            return _body(*args)

        monkeypatch.setitem(collectives.ALL_REDUCE, name, dataclasses.replace(alg, body=wrapper))
    collectives._reset_choice()  # plans cache bodies: rebuild them with the wrappers
    yield calls
    collectives._reset_choice()


@pytest.fixture
def shm_min(monkeypatch):
    """Set MPIDIST_SHM_MIN_BYTES (groups made afterwards use it); restored after the test."""

    def set_to(value: str) -> None:
        monkeypatch.setenv("MPIDIST_SHM_MIN_BYTES", value)
        collectives._reset_choice()

    yield set_to
    monkeypatch.delenv("MPIDIST_SHM_MIN_BYTES", raising=False)
    collectives._reset_choice()


def group_shm(dist, group) -> collectives._GroupShm:
    return dist._runtime.world.resolve_group(group)._resources["shm"]


def test_default_thresholds_are_the_measured_ones(dist, world):
    """Every rank agrees on the group's thresholds, which are the measured table's."""
    rank, size = world
    g = dist.new_group()
    x = np.ones(1 << 10, np.float32)
    dist.all_reduce(x, group=g, algorithm="shm")  # makes the group's resource
    assert np.all(x == size)
    if size == 1:  # a one-rank group never needs shared memory: it makes no window
        assert "shm" not in dist._runtime.world.resolve_group(g)._resources
    else:
        shm = group_shm(dist, g)
        over = size > (os.cpu_count() or 1)
        assert shm.ranges == (
            collectives._measured(collectives.SHM_OVER_RING, over, size),
            collectives._measured(collectives.SHM_OVER_MPI, over, size),
        )
        assert MPI.COMM_WORLD.allgather(shm.ranges) == [shm.ranges] * size
        assert shm.run is not None
    dist.destroy_process_group(g)


def test_ranks_agree_on_the_narrowest_range(dist, world, monkeypatch, counted):
    """Ranges that differ between ranks (they should not) still give one choice everywhere.
    The smallest lower bound of the tables (below which no rank even looks the group's
    choice up) must be equal everywhere: here the entry for 64 ranks."""
    rank, size = world
    table = {
        False: {**{m: (1024 + 64 * rank, 8192 - 64 * rank) for m in (1, 2)}, 64: (500, 600)},
        True: {**{m: (1024 + 64 * rank, 8192 - 64 * rank) for m in (3, 4)}, 64: (500, 600)},
    }
    monkeypatch.setattr(collectives, "SHM_OVER_MPI", table)
    collectives._reset_choice()
    g = dist.new_group()
    lo, hi = 1024 + 64 * (size - 1), 8192 - 64 * (size - 1)
    for nbytes, want in [(lo - 8, "mpi"), (lo, "shm"), (hi - 8, "shm"), (hi, "mpi"), (1 << 16, "mpi")]:
        counted.clear()
        x = np.full(nbytes // 8, float(rank))
        dist.all_reduce(x, group=g)
        np.testing.assert_array_equal(x, np.full(nbytes // 8, size * (size - 1) / 2))
        assert (set(counted) or {"mpi"}) == ({want} if size > 1 else {"mpi"}), nbytes
    if size > 1:
        assert group_shm(dist, g).ranges[1] == (lo, hi)
    dist.destroy_process_group(g)
    collectives._reset_choice()


def test_measured_nearest():
    table = {False: {2: 10}, True: {3: 30, 4: 40}}
    assert [collectives._measured(table, False, n) for n in (1, 2, 8)] == [10, 10, 10]
    assert [collectives._measured(table, True, n) for n in (2, 3, 4, 64)] == [30, 30, 40, 40]
    assert collectives._measured({False: {}, True: {4: 40}}, False, 2) == 40


@pytest.mark.parametrize("async_op", [False, True])
def test_auto_choice_switches_at_the_threshold(dist, world, shm_min, counted, async_op):
    """Below MPIDIST_SHM_MIN_BYTES MPI (or the ring), from it up shared memory; same on every rank."""
    rank, size = world
    shm_min("1K")
    g = dist.new_group()
    for count, dtype, want in [
        (255, np.float32, "mpi"),
        (256, np.float32, "shm"),
        (5000, np.int64, "shm"),
        (511, np.float16, "ring"),
        (512, np.float16, "shm"),
    ]:
        counted.clear()
        x = rank_input(rank, (count,), dtype)
        work = dist.all_reduce(x, group=g, async_op=async_op)
        if async_op:
            work.wait()
        np.testing.assert_array_equal(x, expected(ReduceOp.SUM, size, (count,), dtype))
        assert same_bytes_everywhere(x)
        ran = set(counted) or {"mpi"}  # the inline path runs no body
        assert ran == ({"mpi" if dtype != np.float16 else "ring"} if size == 1 else {want}), (count, dtype)
    dist.destroy_process_group(g)


@pytest.mark.parametrize("value", ["off", "0", "OFF"])
def test_shm_min_bytes_off_disables_shm(dist, world, shm_min, counted, value):
    rank, size = world
    shm_min(value)
    g = dist.new_group()
    x = np.full(1 << 18, float(rank + 1))  # 2 MiB
    dist.all_reduce(x, group=g)
    np.testing.assert_array_equal(x, np.full(1 << 18, size * (size + 1) / 2))
    assert "shm" not in counted
    assert "shm" not in dist._runtime.world.resolve_group(g)._resources  # no window was even made
    dist.all_reduce(x, group=g, algorithm="shm")  # the explicit choice still works
    assert counted["shm"] == 1
    dist.destroy_process_group(g)


def test_shm_min_bytes_bad_value(dist, shm_min):
    shm_min("lots")
    with pytest.raises(
        ValueError,
        match=PREFIX + r"all_reduce: MPIDIST_SHM_MIN_BYTES must be a byte count "
        r"\(65536, 64K, 1M\), 0 or off, got 'lots'$",
    ):
        dist.all_reduce(np.ones(4))


def test_reductions_multi_array_form_uses_the_choice(dist, world, shm_min, counted):
    rank, size = world
    shm_min("4K")
    g = dist.new_group()  # made after the variable was set: its range starts at 4 KiB
    xs = [np.full(2048, float(rank + i)) for i in range(2)]  # 16 KiB each
    dist.all_reduce_multigpu(xs, group=g)
    total = sum(r + i for r in range(size) for i in range(2))
    for x in xs:
        np.testing.assert_array_equal(x, np.full(2048, float(total)))
    assert counted == ({"shm": 1} if size > 1 else {"mpi": 1})
    dist.destroy_process_group(g)


@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX, "premul"])
def test_shm_on_every_group(dist, any_group, op):
    """algorithm="shm" on each test group; non-members return None and keep their buffers."""
    group, members = any_group
    rank = dist.get_rank()
    shape = (7, 301)
    inputs = {r: rank_input(r, shape, np.float64) for r in members}
    x = rank_input(rank, shape, np.float64)
    before = x.copy()
    rop = dist.make_premul_sum(3.0) if op == "premul" else op
    out = dist.all_reduce(x, rop, group=group, algorithm="shm")
    assert out is None
    if rank not in members:
        np.testing.assert_array_equal(x, before)
        return
    stack = np.stack([inputs[r] for r in members])
    want = {
        ReduceOp.SUM: stack.sum(0),
        ReduceOp.AVG: stack.sum(0) / len(members),
        ReduceOp.MAX: stack.max(0),
        "premul": (3.0 * stack).sum(0),
    }[op]
    np.testing.assert_array_equal(x, want)


def test_shm_random_floats_bitwise_equal_everywhere(dist, world):
    rank, _ = world
    x = np.random.default_rng([5, rank]).standard_normal(100_003).astype(np.float32)
    y = x.copy()
    dist.all_reduce(x, algorithm="shm")
    dist.all_reduce(y, algorithm="mpi")
    assert same_bytes_everywhere(x)
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)


def test_shm_window_freed_with_the_group(dist, world):
    """The window lives as long as its group: destroy_process_group frees it, on every rank."""
    _, size = world
    g = dist.new_group()
    dist.all_reduce(np.ones(10), group=g, algorithm="shm")
    if size == 1:
        return dist.destroy_process_group(g)
    run = group_shm(dist, g).run
    assert isinstance(run, ShmAllReduce) and run.win is not None
    assert run.slot_bytes <= DEFAULT_SLOT_BYTES  # bounded: one slot per rank, whatever the array
    dist.destroy_process_group(g)
    assert run.win is None


def test_default_group_window_freed_by_destroy(dist, world):
    _, size = world
    if size == 1:
        return
    dist.all_reduce(np.ones(10), algorithm="shm")
    run = group_shm(dist, None).run
    dist.destroy_process_group()
    assert run.win is None
    dist.init_process_group("mpi")  # for the tests that follow


def test_shm_refused_where_ranks_do_not_share_memory(dist, world, monkeypatch, counted):
    """As on a group that spans nodes (every rank finds it out together): algorithm="shm"
    raises on every rank, the automatic choice keeps to MPI."""
    rank, size = world
    monkeypatch.setattr(collectives, "_node_color", lambda r: r)  # each rank a node of its own
    g = dist.new_group()
    x = np.full(1 << 18, float(rank))
    if size > 1:
        with pytest.raises(
            ValueError,
            match=PREFIX + r"all_reduce: algorithm='shm' needs every rank of group "
            r"'[^']+' on one node with MPI-3 shared memory; use 'hierarchical', "
            r"'mpi', 'ring' or None$",
        ):
            dist.all_reduce(x, group=g, algorithm="shm")
        np.testing.assert_array_equal(x, np.full(1 << 18, float(rank)))  # untouched
    counted.clear()
    dist.all_reduce(x, group=g)
    np.testing.assert_array_equal(x, np.full(1 << 18, size * (size - 1) / 2))
    assert "shm" not in counted
    dist.destroy_process_group(g)


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
    with pytest.raises(
        ValueError,
        match=PREFIX + r"all_reduce: algorithm must be one of \('mpi', 'ring', 'shm', 'hierarchical'\) or "
        r"None, got 'tree'$",
    ):
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
