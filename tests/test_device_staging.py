"""Device arrays through host staging (MPI not CUDA-aware): every op on FakeDeviceArray
equals the host op on numpy, sync and async; no pointer reaches MPI; the warning; the pool."""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest
from fake_device import FakeDeviceArray, FakeRuntime, assert_same, op_cases, to_device

import mpidist
from mpidist._backends.device import staging
from mpidist.device import detect, runtime

pytestmark = pytest.mark.mpi


@pytest.fixture
def rt(dist, monkeypatch):
    """A FakeRuntime registered, and the MPI's CUDA-awareness as MPIDIST_CUDA_AWARE=0 says."""
    fake = FakeRuntime()
    runtime.register(fake)
    monkeypatch.setenv("MPIDIST_CUDA_AWARE", "0")
    monkeypatch.setattr(detect, "_detected", detect.detect())
    monkeypatch.setattr(staging, "_warned", True)  # the warning has its own test
    yield fake
    runtime.unregister(fake)


def _run(dist, name, args, g, async_op):
    fn = getattr(dist, name)
    out = fn(**args, group=g, async_op=True) if async_op else fn(**args, group=g)
    if async_op and out is not None:
        assert out.wait() is True
    return out


@pytest.mark.parametrize("async_op", [False, True])
def test_every_op_staged_equals_host(dist, rt, any_group, async_op):
    g, members = any_group
    rank = dist.get_rank()
    for name, args in op_cases(members, rank):
        dev_args, pairs = to_device(args)
        host_out = _run(dist, name, args, g, async_op)
        views = rt.views
        dev_out = _run(dist, name, dev_args, g, async_op)
        assert rt.views == views, f"{name}: a device pointer was handed to a non-CUDA-aware MPI"
        if rank not in members:
            assert host_out is None and dev_out is None
            assert all(d.pending is not None for d, _ in pairs), f"{name} touched a non-member's arrays"
            continue
        assert_same(pairs)
        if async_op:
            assert all(isinstance(a, FakeDeviceArray) for a in dev_out.result()), name
            assert len(dev_out.result()) == len(host_out.result())
    if rank in members:
        assert rt.down > 0 and rt.up > 0
    assert staging.pool_for(rt).in_use == 0


def test_p2p_staged(dist, rt, any_group):
    g, members = any_group
    rank = dist.get_rank()
    if rank not in members:  # NON_GROUP_MEMBER: nothing happens, as on the host
        x = FakeDeviceArray.from_host(np.ones(2))
        assert dist.send(x, members[0], group=g) is None
        assert dist.recv(x, members[0], group=g) == -1
        assert x.syncs == 0
        return
    if len(members) < 2:
        return
    i = members.index(rank)
    right, left = members[(i + 1) % len(members)], members[(i - 1) % len(members)]
    send = FakeDeviceArray.from_host(np.full(4, rank, np.int32))
    recv = FakeDeviceArray((4,), np.int32)
    if i % 2 == 0:
        dist.send(send, right, group=g)
        assert dist.recv(recv, left, group=g) == left
    else:
        assert dist.recv(recv, left, group=g) == left
        dist.send(send, right, group=g)
    np.testing.assert_array_equal(recv.host, np.full(4, left, np.int32))
    recv2 = FakeDeviceArray((4,), np.int32)
    works = [dist.isend(send, right, group=g, tag=3), dist.irecv(recv2, None, group=g, tag=3)]
    for w in works:
        w.wait()
    assert works[1].source_rank() == left
    np.testing.assert_array_equal(recv2.host, np.full(4, left, np.int32))
    recv3 = FakeDeviceArray((4,), np.int32)
    send.enqueue(np.full(4, 10 * rank, np.int32))  # still "running": the batch must synchronize first
    ops = [dist.P2POp(dist.irecv, recv3, left, g, 5), dist.P2POp(dist.isend, send, right, g, 5)]
    works = dist.batch_isend_irecv(ops)
    assert len(works) == 2
    assert works[0].is_completed() in (True, False)
    for w in works:
        w.wait()
    np.testing.assert_array_equal(recv3.host, np.full(4, 10 * left, np.int32))
    assert works[0].result()[0] is recv3
    assert staging.pool_for(rt).in_use == 0


def test_warning_once_per_process(dist, rt, monkeypatch):
    monkeypatch.setattr(staging, "_warned", False)
    x = FakeDeviceArray.from_host(np.ones(3))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist.all_reduce(x)
        dist.broadcast(x, 0)
        dist.all_reduce(x, async_op=True).wait()
    ours = [w for w in caught if "staged through host memory" in str(w.message)]
    assert len(ours) == 1
    text = str(ours[0].message)
    assert "backend='cpu:mpi,cuda:nccl'" in text and "MPIDIST_CUDA_AWARE=1" in text
    assert "MPIDIST_CUDA_AWARE=0" in text  # the source of the decision
    assert ours[0].filename.endswith("test_device_staging.py")  # points at the caller's line


def test_pinned_buffers_reused_and_held_while_in_flight(dist, rt, world):
    _, size = world
    pool = staging.pool_for(rt)
    a = FakeDeviceArray.from_host(np.arange(1000, dtype=np.float64))
    dist.all_reduce(a)
    made = pool.allocated
    for _ in range(3):
        dist.all_reduce(a)
    assert pool.allocated == made and pool.in_use == 0
    assert pool.free_buffers() >= 1
    b = FakeDeviceArray.from_host(np.arange(1000, dtype=np.float64))
    work = dist.all_reduce(b, async_op=True)
    assert pool.in_use == 1  # b's buffer is in flight until the Work completes
    c = FakeDeviceArray.from_host(np.ones(1000))
    dist.all_reduce(c)  # must not get b's buffer
    work.wait()
    assert pool.in_use == 0
    np.testing.assert_array_equal(b.host, np.arange(1000) * size)
    np.testing.assert_array_equal(c.host, np.full(1000, float(size)))
    np.testing.assert_array_equal(a.host, np.arange(1000) * size**4)


def test_future_completes_after_copy_back(dist, rt, world):
    _, size = world
    x = FakeDeviceArray.from_host(np.full(5, 2.0))
    work = dist.all_reduce(x, async_op=True)
    fut = work.get_future()
    got = fut.result(timeout=60)
    assert got[0] is x
    np.testing.assert_array_equal(x.host, np.full(5, 2.0 * size))
    assert work.get_future_result().result(timeout=60) == 0  # WorkResult.SUCCESS
    y = FakeDeviceArray.from_host(np.full(5, 3.0))
    dist.all_reduce(y, async_op=True).synchronize()  # a host wait: the copy back is done when it returns
    np.testing.assert_array_equal(y.host, np.full(5, 3.0 * size))


def test_staged_error_gives_buffers_back(dist, rt, world):
    rank, size = world
    pool = staging.pool_for(rt)
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"[rank {rank}/{size}] all_to_all_single: input_split_sizes sums to {5 * size}, expected input.shape[0] = 3"
        ),
    ):
        dist.all_to_all_single(FakeDeviceArray((size,)), FakeDeviceArray((3,)), input_split_sizes=[5] * size)
    assert pool.in_use == 0


def test_mixed_host_and_device_rejected(dist, rt, world):
    rank, size = world
    d = FakeDeviceArray((3,), device=0)
    h = np.zeros(3)
    cases = [
        (lambda: dist.all_gather([h] * size, d), "all_gather", "tensor", "tensor_list[0]"),
        (
            lambda: dist.all_gather([FakeDeviceArray((3,)) for _ in range(size)], h),
            "all_gather",
            "tensor_list[0]",
            "tensor",
        ),
        (lambda: dist.all_gather_into_tensor(d, h), "all_gather_into_tensor", "output_tensor", "input_tensor"),
        (
            lambda: dist.all_gather_into_tensor(np.zeros(3 * size), d),
            "all_gather_into_tensor",
            "input_tensor",
            "output_tensor",
        ),
        (lambda: dist.scatter(d, [h] * size, src=0), "scatter", "tensor", "scatter_list[0]"),
        (lambda: dist.reduce_scatter(h, [d] * size), "reduce_scatter", "input_list[0]", "output"),
        (
            lambda: dist.all_to_all([d] * size, [h] * size),
            "all_to_all",
            "output_tensor_list[0]",
            "input_tensor_list[0]",
        ),
        (lambda: dist.all_reduce_multigpu([d, h]), "all_reduce_multigpu", "tensor_list[0]", "tensor_list[1]"),
        (lambda: dist.all_reduce_multigpu([h, d]), "all_reduce_multigpu", "tensor_list[1]", "tensor_list[0]"),
        (
            lambda: dist.all_gather_multigpu([[h] * size], [d]),
            "all_gather_multigpu",
            "input_tensor_list[0]",
            "output_tensor_lists[0][0]",
        ),
    ]
    if size > 1:
        peer = (rank + 1) % size
        cases.append(
            (
                lambda: dist.batch_isend_irecv([dist.P2POp(dist.isend, d, peer), dist.P2POp(dist.irecv, h, peer)]),
                "batch_isend_irecv",
                "p2p_op_list[0].tensor",
                "p2p_op_list[1].tensor",
            )
        )
        cases.append(
            (
                lambda: dist.batch_isend_irecv([dist.P2POp(dist.isend, h, peer), dist.P2POp(dist.irecv, d, peer)]),
                "batch_isend_irecv",
                "p2p_op_list[1].tensor",
                "p2p_op_list[0].tensor",
            )
        )
    for call, op, dev, host in cases:
        msg = (
            f"[rank {rank}/{size}] {op}: {dev} is a device (cuda:0) array but {host} is a host numpy array; "
            f"every array of one call must be on the same side"
        )
        with pytest.raises(TypeError, match=re.escape(msg)):
            call()
    assert staging.pool_for(rt).in_use == 0


def test_device_arrays_on_two_devices_rejected(dist, rt, world):
    rank, size = world
    a, b = FakeDeviceArray((3,), device=0), FakeDeviceArray((3,), device=1)
    with pytest.raises(
        ValueError,
        match=rf"\[rank {rank}/{size}\] all_reduce_multigpu: tensor_list\[1\] is on "
        r"cuda:1 but tensor_list\[0\] is on cuda:0; all device arrays of one call "
        r"must be on one device",
    ):
        dist.all_reduce_multigpu([a, b])


def test_non_contiguous_device_array_rejected(dist, rt):
    base = np.zeros((4, 4), np.float32)
    x = FakeDeviceArray.wrap(base[:, 1])
    with pytest.raises(
        ValueError,
        match=r"all_reduce: tensor must be C-contiguous, got a non-contiguous array of "
        r"shape \(4,\) and strides \(16,\)",
    ):
        mpidist.all_reduce(x)
    with pytest.raises(ValueError, match=r"P2POp: tensor must be C-contiguous"):
        mpidist.P2POp(mpidist.isend, x, 0)


def test_group_ranks_on_the_staging_path(dist, rt, world):
    """group_src/group_dst (torch 2.4+) with device arrays staged through host memory."""
    rank, size = world
    root = size - 1
    x = FakeDeviceArray.from_host(np.full(3, float(rank)))
    dist.broadcast(x, group_src=root)
    np.testing.assert_array_equal(x.host, np.full(3, float(root)))
    y = FakeDeviceArray.from_host(np.ones(2))
    dist.reduce(y, group_dst=root, async_op=True).wait()
    np.testing.assert_array_equal(y.host, np.full(2, float(size if rank == root else 1)))
    if size > 1:
        right, left = (rank + 1) % size, (rank - 1) % size
        r = FakeDeviceArray.from_host(np.zeros(2))
        works = dist.batch_isend_irecv(
            [
                dist.P2POp(dist.irecv, r, group_peer=left),
                dist.P2POp(dist.isend, FakeDeviceArray.from_host(np.full(2, float(rank))), group_peer=right),
            ]
        )
        for w in works:
            w.wait()
        np.testing.assert_array_equal(r.host, np.full(2, float(left)))
