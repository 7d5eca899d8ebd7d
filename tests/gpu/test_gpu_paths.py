"""Real cupy arrays through host staging and through CUDA-aware MPI: every op equals the
host op on numpy, sync and async, at world sizes 1 and 2 (several ranks may share a GPU:
staging and CUDA-aware MPI allow it; NCCL is tests/gpu/test_gpu_nccl.py)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from fake_device import op_cases

from mpidist._backends.device import staging
from mpidist.device import binding, detect, runtime

try:
    import cupy as cp
except ImportError:  # tests/gpu/conftest.py skips every test here, saying why
    cp = None

pytestmark = pytest.mark.mpi


def _to_cupy(args: dict) -> tuple[dict, list]:
    pairs = []

    def conv(x):
        if isinstance(x, np.ndarray):
            d = cp.asarray(x)
            pairs.append((d, x))
            return d
        if isinstance(x, list):
            return [conv(y) for y in x]
        return x

    return {k: conv(v) for k, v in args.items()}, pairs


def _check_every_op(dist, any_group, async_op):
    g, members = any_group
    rank = dist.get_rank()
    for name, args in op_cases(members, rank):
        dev_args, pairs = _to_cupy(args)
        fn = getattr(dist, name)
        host = fn(**args, group=g, async_op=async_op)
        dev = fn(**dev_args, group=g, async_op=async_op)
        if rank not in members:
            assert host is None and dev is None
            continue
        if async_op:
            host.wait()
            dev.wait()
            assert all(isinstance(a, cp.ndarray) for a in dev.result()), name
        for d, x in pairs:
            np.testing.assert_array_equal(cp.asnumpy(d), x, err_msg=name)


@pytest.fixture
def staged(dist, monkeypatch):
    monkeypatch.setattr(detect, "_detected", detect.Detection(False, "test: staging forced"))
    monkeypatch.setattr(staging, "_warned", True)


@pytest.fixture
def cuda_aware(dist):
    found = detect.detect()
    if not found.aware:
        pytest.skip(f"MPI is not CUDA-aware ({found.source}); set MPIDIST_CUDA_AWARE=1 only for an MPI that is")


@pytest.mark.parametrize("async_op", [False, True])
def test_staging_every_op(dist, staged, any_group, async_op):
    _check_every_op(dist, any_group, async_op)
    pool = staging.pool_for(runtime.runtime_for(cp.zeros(1), "test", "x"))
    assert pool.in_use == 0 and pool.allocated > 0


@pytest.mark.parametrize("async_op", [False, True])
def test_cuda_aware_every_op(dist, cuda_aware, any_group, async_op):
    _check_every_op(dist, any_group, async_op)


def test_p2p(dist, world):
    rank, size = world
    if size < 2:
        pytest.skip("needs two ranks")
    right, left = (rank + 1) % size, (rank - 1) % size
    send, recv = cp.full(5, rank, cp.int32), cp.zeros(5, cp.int32)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, right), dist.P2POp(dist.irecv, recv, left)])
    for w in works:
        w.wait()
    assert (cp.asnumpy(recv) == left).all()


def test_stream_is_synchronized_before_mpi(dist, world):
    _, size = world
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:  # the data are produced on a side stream, still running when all_reduce is called
        x = cp.ones(1 << 22, cp.float32)
        for _ in range(20):
            x *= 1.0
        dist.all_reduce(x)
    assert float(x[0]) == size and float(x[-1]) == size


def test_cai_only_object_is_a_zero_copy_view(dist, world, monkeypatch):
    _, size = world
    monkeypatch.setattr(staging, "_warned", True)
    base = cp.arange(6, dtype=cp.float64)

    class CAIOnly:
        __cuda_array_interface__ = base.__cuda_array_interface__

    dist.all_reduce(CAIOnly())
    np.testing.assert_array_equal(cp.asnumpy(base), np.arange(6) * size)


def test_bound_device(dist):
    count = cp.cuda.runtime.getDeviceCount()
    env = os.environ.get("MPIDIST_DEVICE", "").strip()
    assert binding.bound_device() == (int(env) if env else dist.get_node_local_rank() % count)
    assert cp.cuda.Device().id == binding.bound_device()
