"""Pipelined host staging (mpidist._backends.device.pipeline): all_reduce, broadcast,
all_gather_into_tensor and reduce_scatter_tensor of device arrays of at least two chunks
move through host memory chunk by chunk. With FakeRuntime's copy streams (copies run only
when an event recorded after them is waited on) a step that read a chunk before its copy
down, or a call that returned before its copies up, gives wrong data here. Every result
equals the host op's; the call is one collective (one recorder entry, its check on the
whole call), sync and async; below two chunks, off, or with overlapping arrays the plain
path runs. Runs serially and under mpiexec -n 2, 3, 4.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from fake_device import FakeDeviceArray, FakeRuntime

import mpidist
from mpidist._backends.device import pipeline, staging
from mpidist._core import recorder as R
from mpidist.device import detect, runtime

pytestmark = pytest.mark.mpi

CHUNK = 64  # bytes: float32 arrays of 100 elements move in 7 chunks, the last one short


@pytest.fixture
def rt(dist, monkeypatch):
    """A FakeRuntime, staging (MPIDIST_CUDA_AWARE=0), and 64-byte chunks."""
    fake = FakeRuntime()
    runtime.register(fake)
    monkeypatch.setenv("MPIDIST_CUDA_AWARE", "0")
    monkeypatch.setenv(pipeline.CHUNK_VAR, str(CHUNK))
    monkeypatch.setattr(detect, "_detected", detect.detect())
    monkeypatch.setattr(staging, "_warned", True)
    yield fake
    runtime.unregister(fake)
    assert staging.pool_for(fake).in_use == 0


def data(seed: int, n: int, dtype=np.float32) -> np.ndarray:
    return np.random.default_rng(seed).integers(-50, 50, size=n).astype(dtype)


def finish(work, async_op: bool) -> None:
    if async_op:
        assert work.wait() is True
        assert all(isinstance(a, FakeDeviceArray) for a in work.result())
    else:
        assert work is None


@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.float64, np.complex64])
@pytest.mark.parametrize("algorithm", [None, "ring"])
def test_all_reduce(dist, rt, async_op, dtype, algorithm):
    r, n = dist.get_rank(), dist.get_world_size()
    host = data(r, 100, dtype)
    x = FakeDeviceArray.from_host(host)
    before = rt.async_down
    finish(dist.all_reduce(x, async_op=async_op, algorithm=algorithm), async_op)
    want = sum(data(q, 100, dtype) for q in range(n))
    np.testing.assert_array_equal(x.host, want.astype(dtype))
    assert rt.async_down - before == -(-100 * np.dtype(dtype).itemsize // CHUNK)  # one copy per chunk


def test_all_reduce_avg_and_premul(dist, rt):
    r, n = dist.get_rank(), dist.get_world_size()
    x = FakeDeviceArray.from_host(np.full(40, float(r + 1)))
    dist.all_reduce(x, op=mpidist.ReduceOp.AVG)
    np.testing.assert_allclose(x.host, np.full(40, (n + 1) / 2))
    y = FakeDeviceArray.from_host(np.full(40, float(r + 1)))
    dist.all_reduce(y, op=mpidist.make_premul_sum(2.0))
    np.testing.assert_allclose(y.host, np.full(40, float(n * (n + 1))))


@pytest.mark.parametrize("async_op", [False, True])
def test_broadcast_every_root(dist, rt, async_op):
    r, n = dist.get_rank(), dist.get_world_size()
    for root in range(n):
        x = FakeDeviceArray.from_host(data(100 + r, 50, np.float64))
        finish(dist.broadcast(x, src=root, async_op=async_op), async_op)
        np.testing.assert_array_equal(x.host, data(100 + root, 50, np.float64))


@pytest.mark.parametrize("async_op", [False, True])
def test_all_gather_into_tensor(dist, rt, async_op):
    r, n = dist.get_rank(), dist.get_world_size()
    out = FakeDeviceArray.from_host(np.zeros((n, 30), np.float32))
    inp = FakeDeviceArray.from_host(data(200 + r, 30).reshape(3, 10))
    finish(dist.all_gather_into_tensor(out, inp, async_op=async_op), async_op)
    np.testing.assert_array_equal(out.host, np.stack([data(200 + q, 30) for q in range(n)]))


@pytest.mark.parametrize("async_op", [False, True])
def test_reduce_scatter_tensor(dist, rt, async_op):
    r, n = dist.get_rank(), dist.get_world_size()
    inp = FakeDeviceArray.from_host(data(300 + r, 30 * n, np.int32))
    out = FakeDeviceArray.from_host(np.zeros(30, np.int32))
    finish(dist.reduce_scatter_tensor(out, inp, async_op=async_op), async_op)
    total = sum(data(300 + q, 30 * n, np.int32) for q in range(n))
    np.testing.assert_array_equal(out.host, total[30 * r : 30 * (r + 1)])


def test_one_collective_for_the_recorder(dist, rt):
    x = FakeDeviceArray.from_host(np.ones(100, np.float32))
    dist.all_reduce(x)
    last = R.snapshot()[-1]
    assert (last["op"], last["shapes"], last["state"]) == ("all_reduce", [100], "completed")


def test_small_off_and_overlapping_take_the_plain_path(dist, rt, monkeypatch):
    r, n = dist.get_rank(), dist.get_world_size()
    small = FakeDeviceArray.from_host(np.ones(CHUNK // 4, np.float32))  # one chunk
    before = (rt.async_down, rt.down)
    dist.all_reduce(small)
    assert rt.async_down == before[0] and rt.down > before[1] and small.host[0] == n
    monkeypatch.setenv(pipeline.CHUNK_VAR, "off")
    big = FakeDeviceArray.from_host(np.ones(100, np.float32))
    dist.all_reduce(big)
    assert rt.async_down == before[0] and big.host[0] == n
    monkeypatch.setenv(pipeline.CHUNK_VAR, str(CHUNK))
    out = FakeDeviceArray.from_host(np.zeros(30 * n, np.float32))  # in place: input is this rank's slot
    out.host[30 * r : 30 * (r + 1)] = r
    dist.all_gather_into_tensor(out, FakeDeviceArray.wrap(out.host[30 * r : 30 * (r + 1)]))
    assert rt.async_down == before[0]
    np.testing.assert_array_equal(out.host, np.repeat(np.arange(n, dtype=np.float32), 30))


def test_members_that_disagree_on_the_size_are_told_before_anything_moves(dist, rt):
    r, n = dist.get_rank(), dist.get_world_size()
    if n < 2:
        pytest.skip("needs two ranks")
    x = FakeDeviceArray.from_host(np.full(1000 + 16 * r, 1.0, np.float32))  # new sizes; the first chunks alike
    with pytest.raises(ValueError, match="all_reduce"):
        dist.all_reduce(x)
    assert x.host[0] == 1.0  # nothing came back


@pytest.mark.parametrize("value", ["x", "-1", "4Q"])
def test_bad_chunk_setting(dist, rt, monkeypatch, value):
    monkeypatch.setenv(pipeline.CHUNK_VAR, value)
    expected = f"all_reduce: {pipeline.CHUNK_VAR} must be a byte count (65536, 64K, 1M), 0 or off, got {value!r}"
    with pytest.raises(ValueError, match=re.escape(expected)):
        dist.all_reduce(FakeDeviceArray.from_host(np.ones(100, np.float32)))


def test_chunk_setting_forms(monkeypatch):
    for text, want in (("", pipeline.DEFAULT_CHUNK), ("0", 0), ("off", 0), ("1M", 1 << 20), ("4096", 4096)):
        monkeypatch.setenv(pipeline.CHUNK_VAR, text)
        assert pipeline.chunk_bytes() == want
