"""Device arrays through a CUDA-aware MPI (MPIDIST_CUDA_AWARE=1): every op on
FakeDeviceArray equals the host op on numpy, streams are synchronized before MPI reads,
and the ops this path cannot run on device memory are staged instead."""

from __future__ import annotations

import re

import numpy as np
import pytest
from fake_device import FakeDeviceArray, FakeRuntime, assert_same, op_cases, to_device

from mpidist._arrays.buffers import host_array
from mpidist._backends.device import route, staging
from mpidist.device import detect, runtime

pytestmark = pytest.mark.mpi

#: Indices into fake_device.op_cases() of the calls the CUDA-aware path takes; the rest
#: are staged (float16 and premul all_reduce, list-based and multi-array ops).
DIRECT = {
    0: "all_reduce f32 SUM",
    1: "all_reduce int64 MAX",
    4: "broadcast",
    5: "reduce",
    7: "all_gather_into_tensor",
    11: "reduce_scatter_tensor AVG",
}


@pytest.fixture
def rt(dist, monkeypatch):
    fake = FakeRuntime()
    runtime.register(fake)
    monkeypatch.setenv("MPIDIST_CUDA_AWARE", "1")
    monkeypatch.setattr(detect, "_detected", detect.detect())
    monkeypatch.setattr(staging, "_warned", True)
    yield fake
    runtime.unregister(fake)


@pytest.mark.parametrize("async_op", [False, True])
def test_every_op_equals_host_on_its_path(dist, rt, any_group, async_op):
    g, members = any_group
    rank = dist.get_rank()
    assert detect.detection().source == "MPIDIST_CUDA_AWARE=1"
    for i, (name, args) in enumerate(op_cases(members, rank)):
        dev_args, pairs = to_device(args)  # each input "still being written" until synchronized
        fn = getattr(dist, name)
        before = (rt.views, rt.down + rt.up)
        host = fn(**args, group=g, async_op=async_op)
        dev = fn(**dev_args, group=g, async_op=async_op)
        if rank not in members:
            assert host is None and dev is None and rt.views == before[0]
            continue
        if async_op:
            host.wait()
            dev.wait()
            assert [type(a) for a in dev.result()] == [FakeDeviceArray] * len(host.result())
        assert_same(pairs)  # equal values: MPI read each input after its stream was synchronized
        direct = (rt.views > before[0], rt.down + rt.up > before[1])  # (MPI got pointers, staged)
        assert direct == ((True, False) if i in DIRECT else (False, True)), (i, name)
    assert staging.pool_for(rt).in_use == 0


def test_p2p_direct(dist, rt, any_group):
    g, members = any_group
    rank = dist.get_rank()
    if rank not in members or len(members) < 2:
        return
    i = members.index(rank)
    right, left = members[(i + 1) % len(members)], members[(i - 1) % len(members)]
    send = FakeDeviceArray((3,), np.int64)
    send.enqueue(np.full(3, rank))
    recv = FakeDeviceArray((3,), np.int64)
    works = [dist.irecv(recv, left, group=g), dist.isend(send, right, group=g)]
    assert send.pending is None  # synchronized before the pointer went to MPI
    for w in works:
        w.wait()
    assert works[0].source_rank() == left and works[0].result() == [recv]
    np.testing.assert_array_equal(recv.host, np.full(3, left))
    send.enqueue(np.full(3, 7 * rank))
    if i % 2 == 0:
        dist.send(send, right, group=g)
        assert dist.recv(recv, left, group=g) == left
    else:
        assert dist.recv(recv, None, group=g) == left
        dist.send(send, right, group=g)
    np.testing.assert_array_equal(recv.host, np.full(3, 7 * left))
    send.enqueue(np.full(3, 9 * rank))
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, right, g), dist.P2POp(dist.irecv, recv, left, g)])
    for w in works:
        w.wait()
    np.testing.assert_array_equal(recv.host, np.full(3, 9 * left))
    assert rt.down == 0  # nothing staged


def test_in_place_all_gather_is_staged(dist, rt, world):
    rank, size = world
    out = FakeDeviceArray((size, 4), np.float32)
    mine = FakeDeviceArray.wrap(out.host[rank])  # overlaps out: MPI_IN_PLACE on the host
    mine.host[...] = rank + 1
    dist.all_gather_into_tensor(out, mine)
    np.testing.assert_array_equal(out.host, np.repeat(np.arange(1, size + 1, dtype=np.float32), 4).reshape(size, 4))
    assert rt.down >= 1 and rt.views == 0


def test_host_array_takes_device_arrays_only_on_this_path(dist, rt, world):
    rank, size = world
    x = FakeDeviceArray((2,))
    with pytest.raises(
        TypeError,
        match=re.escape(
            f"[rank {rank}/{size}] all_gather: tensor_list[1] is a device "
            f"(cuda:0) array but tensor is a host numpy array"
        ),
    ):
        host_array(x, "all_gather", "tensor_list[1]", writable=True)
    with pytest.raises(
        TypeError,
        match=re.escape(
            f"[rank {rank}/{size}] objects_op: obj is a device (cuda:0) array, which objects_op does not take"
        ),
    ):
        host_array(x, "objects_op", "obj", writable=False)
    with route.passthrough():
        assert host_array(x, "all_gather", "tensor_list[1]", writable=True) is x
        assert not route.takes(x)
    assert route.takes(x)


def test_all_reduce_ring_algorithm_on_device(dist, rt, world):
    _, size = world
    x = FakeDeviceArray.from_host(np.arange(6, dtype=np.float32))
    dist.all_reduce(x, algorithm="ring")
    np.testing.assert_array_equal(x.host, np.arange(6, dtype=np.float32) * size)
    assert rt.views == 1 and rt.down == 0


def test_staging_warning_under_a_cuda_aware_mpi_says_why_the_call_was_staged(dist, rt, monkeypatch):
    """With a CUDA-aware MPI, calls mpidist does not hand MPI (all_gather's list form here)
    are staged: the single warning must say so, not that MPI is not CUDA-aware."""
    import warnings

    monkeypatch.setattr(staging, "_warned", False)
    n = dist.get_world_size()
    out = [FakeDeviceArray.from_host(np.zeros(2)) for _ in range(n)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist.all_gather(out, FakeDeviceArray.from_host(np.full(2, dist.get_rank(), np.float64)))
        dist.all_gather(out, FakeDeviceArray.from_host(np.full(2, dist.get_rank(), np.float64)))
    ours = [str(w.message) for w in caught if "staged through host memory" in str(w.message)]
    assert len(ours) == 1, ours
    assert "MPI is CUDA-aware (MPIDIST_CUDA_AWARE=1)" in ours[0] and "all_gather here is not such a call" in ours[0]
    assert "not CUDA-aware" not in ours[0] and "set MPIDIST_CUDA_AWARE=1" not in ours[0]
    assert [o.host.tolist() for o in out] == [[float(r)] * 2 for r in range(n)]
