"""The public API end to end on device arrays with an NCCL group: the router (device.route)
sends the call to the NCCL path (device.nccl, over tests/fake_nccl.py), host arrays on the
same group still go through MPI, and freeing the group destroys its NCCL communicator.

The unit tests of each layer are test_device_paths / test_device_staging / test_device_nccl;
this file checks that the layers meet.
"""

from __future__ import annotations

import numpy as np
import pytest
from fake_device import FakeDeviceArray, FakeRuntime
from fake_nccl import FakeShim

import mpidist
from mpidist._backends.device import nccl_shim
from mpidist._backends.device.nccl_core import REAPER
from mpidist.device import detect, runtime

pytestmark = pytest.mark.mpi


@pytest.fixture
def nccl_group(dist, monkeypatch):
    """(group over every rank with backend "cpu:mpi,cuda:nccl", the fake shim, the fake runtime)."""
    rt = FakeRuntime()
    runtime.register(rt)
    monkeypatch.setenv("MPIDIST_CUDA_AWARE", "0")
    monkeypatch.setattr(detect, "_detected", detect.detect())
    shim = FakeShim()
    previous = nccl_shim.use(shim)
    g = dist.new_group(list(range(dist.get_world_size())), backend="cpu:mpi,cuda:nccl")
    yield g, shim, rt
    shim.release()
    assert REAPER.drain(), "NCCL ops still in flight after the test"
    if not g.destroyed:
        dist.destroy_process_group(g)
    nccl_shim.use(previous)
    runtime.unregister(rt)


def _nccl_calls(shim: FakeShim) -> list[str]:
    return [entry[1] for entry in shim.log if entry[0] == "nccl"]


def test_device_all_reduce_takes_the_nccl_path(dist, nccl_group):
    g, shim, rt = nccl_group
    n, rank = dist.get_world_size(), dist.get_rank()
    x = FakeDeviceArray.from_host(np.arange(6, dtype=np.float32) + rank)
    assert mpidist.all_reduce(x, group=g) is None
    shim.release()
    assert REAPER.drain()
    np.testing.assert_array_equal(x.host, n * np.arange(6, dtype=np.float32) + sum(range(n)))
    assert "allReduce" in _nccl_calls(shim)
    assert rt.down == 0 and rt.up == 0, "the NCCL path must not stage through the host"


def test_host_arrays_on_an_nccl_group_go_through_mpi(dist, nccl_group):
    g, shim, _ = nccl_group
    n = dist.get_world_size()
    y = np.full(3, dist.get_rank() + 1.0)
    mpidist.all_reduce(y, group=g)
    np.testing.assert_array_equal(y, np.full(3, n * (n + 1) / 2))
    assert _nccl_calls(shim) == []


def test_device_async_broadcast_and_all_gather(dist, nccl_group):
    g, shim, _ = nccl_group
    n, rank = dist.get_world_size(), dist.get_rank()
    b = FakeDeviceArray.from_host(np.full(4, rank, dtype=np.int64))
    w = mpidist.broadcast(b, src=n - 1, group=g, async_op=True)
    out = FakeDeviceArray((n, 2), np.float64)
    inp = FakeDeviceArray.from_host(np.full(2, rank, dtype=np.float64))
    w2 = mpidist.all_gather_into_tensor(out, inp, group=g, async_op=True)
    shim.release()
    assert w.wait() and w2.wait()
    assert REAPER.drain()
    np.testing.assert_array_equal(b.host, np.full(4, n - 1))
    np.testing.assert_array_equal(out.host, np.repeat(np.arange(n, dtype=np.float64), 2).reshape(n, 2))
    assert {"broadcast", "allGather"} <= set(_nccl_calls(shim))


@pytest.mark.mpi(min_size=2)
def test_device_batch_isend_irecv_ring(dist, nccl_group):
    g, shim, _ = nccl_group
    n, rank = dist.get_world_size(), dist.get_rank()
    send = FakeDeviceArray.from_host(np.full(5, rank, dtype=np.float32))
    recv = FakeDeviceArray((5,), np.float32)
    ops = [mpidist.P2POp(mpidist.isend, send, (rank + 1) % n, g), mpidist.P2POp(mpidist.irecv, recv, (rank - 1) % n, g)]
    works = mpidist.batch_isend_irecv(ops)
    shim.release()
    for w in works:
        w.wait()
    assert REAPER.drain()
    np.testing.assert_array_equal(recv.host, np.full(5, (rank - 1) % n))
    assert {"send", "recv"} <= set(_nccl_calls(shim))


def test_destroying_the_group_destroys_its_nccl_communicator(dist, nccl_group):
    g, shim, _ = nccl_group
    x = FakeDeviceArray.from_host(np.ones(2, dtype=np.float32))
    mpidist.all_reduce(x, group=g)
    shim.release()
    assert REAPER.drain()
    before = shim.destroyed
    dist.destroy_process_group(g)
    assert shim.destroyed == before + 1
