"""Integer sums that overflow their dtype wrap, as numpy, torch and C wrap them, on every MPI
and every algorithm: Open MPI's predefined MPI_SUM saturates 8- and 16-bit integers instead
(its AVX op component, from 1024 int8 and 8 int16 elements: open-mpi/ompi#8045), so where
the MPI saturates mpidist reduces those types with its own arithmetic
(``mpidist._arrays.buffers.saturating_sums``, measured once with MPI_Reduce_local). The forced case
checks that path on any MPI. Runs serially and under mpiexec -n 2, 3, 4.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from mpidist._arrays import buffers
from mpidist._arrays.reduce_op import ReduceOp, to_mpi_op
from mpidist._backends.mpi import collectives as C

pytestmark = pytest.mark.mpi

SMALL = [np.int8, np.uint8, np.int16, np.uint16]


def near_max(dtype, n: int, rank: int) -> np.ndarray:
    info = np.iinfo(dtype)
    return (np.full(n, info.max - rank, np.int64)).astype(dtype)


def wrapped(dtype, n: int, size: int, prod: bool = False) -> np.ndarray:
    """What numpy gives: the sum (product) of every rank's array, wrapping."""
    acc = near_max(dtype, n, 0)
    for r in range(1, size):
        acc = acc * near_max(dtype, n, r) if prod else acc + near_max(dtype, n, r)
    return acc


@pytest.mark.parametrize("dtype", SMALL)
@pytest.mark.parametrize("n", [8, 1024, 4096])
@pytest.mark.parametrize("algorithm", [None, "mpi", "ring"])
def test_all_reduce_sum_wraps(dist, dtype, n, algorithm):
    r, size = dist.get_rank(), dist.get_world_size()
    x = near_max(dtype, n, r)
    dist.all_reduce(x, algorithm=algorithm)
    np.testing.assert_array_equal(x, wrapped(dtype, n, size))


@pytest.mark.parametrize("dtype", SMALL)
def test_reduce_product_and_reduce_scatter_wrap(dist, dtype):
    r, size = dist.get_rank(), dist.get_world_size()
    x = near_max(dtype, 1024, r)
    dist.reduce(x, dst=0, op=ReduceOp.PRODUCT)
    if r == 0:
        np.testing.assert_array_equal(x, wrapped(dtype, 1024, size, prod=True))
    out = np.empty(1024, dtype)
    dist.reduce_scatter_tensor(out, np.concatenate([near_max(dtype, 1024, r)] * size))
    np.testing.assert_array_equal(out, wrapped(dtype, 1024, size))


@pytest.fixture
def saturating(monkeypatch):
    """This MPI's small-integer sums taken as saturating: mpidist's own op for int8 and uint16."""
    monkeypatch.setattr(buffers, "_saturating", frozenset({("i", 1), ("u", 2)}))
    buffers.mpi_reducible.cache_clear()
    monkeypatch.setattr(C, "_PLANS", {})
    monkeypatch.setattr(C, "_last", (None, None, None, None))
    yield
    buffers.mpi_reducible.cache_clear()


def test_saturating_types_take_mpidists_own_reduction(dist, saturating):
    r, size = dist.get_rank(), dist.get_world_size()
    int8, uint16, int16 = np.dtype(np.int8), np.dtype(np.uint16), np.dtype(np.int16)
    assert not buffers.mpi_reducible(int8) and not buffers.mpi_reducible(uint16) and buffers.mpi_reducible(int16)
    assert to_mpi_op(ReduceOp.SUM, int8) is not to_mpi_op(ReduceOp.SUM, int16)  # a user-defined op
    for dtype in (np.int8, np.uint16):
        for algorithm in (None, "mpi"):
            x = near_max(dtype, 1024, r)
            dist.all_reduce(x, algorithm=algorithm)
            np.testing.assert_array_equal(x, wrapped(dtype, 1024, size))
        x = near_max(dtype, 8, r)
        dist.reduce(x, dst=size - 1)
        if r == size - 1:
            np.testing.assert_array_equal(x, wrapped(dtype, 8, size))
        # the op on a bare numpy buffer, which mpi4py sends as SIGNED_CHAR / UNSIGNED_SHORT
        x = near_max(dtype, 1024, r)
        MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, x, op=to_mpi_op(ReduceOp.SUM, np.dtype(dtype)))
        np.testing.assert_array_equal(x, wrapped(dtype, 1024, size))


def test_the_measurement_is_cached_and_sane(dist):
    found = buffers.saturating_sums()
    assert found is buffers.saturating_sums() and found <= {("i", 1), ("u", 1), ("i", 2), ("u", 2)}
