"""Ring all-reduce: against independent numpy references, MPI's Allreduce, and itself
across ranks.

Run under ``mpiexec -n N python -m pytest --with-mpi --only-mpi tests/test_ring.py``
(any N), or as a singleton with ``python -m pytest --with-mpi tests/test_ring.py``.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from mpi4py import MPI

from mpidist._arrays.reduce_op import ReduceOp, to_mpi_op
from mpidist.algorithms import ring_all_reduce, ring_chunk_bounds

DTYPES = ["float32", "float64", "int32", "int64", "uint8", "bool"]
OPS = [op for op in ReduceOp if op is not ReduceOp.PREMUL_SUM]
# element-wise references, written out independently of mpidist._arrays.reduce_op
REF = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVG: np.add,
    ReduceOp.PRODUCT: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.BAND: np.bitwise_and,
    ReduceOp.BOR: np.bitwise_or,
    ReduceOp.BXOR: np.bitwise_xor,
}
REF_BOOL = {
    ReduceOp.SUM: np.logical_or,
    ReduceOp.MAX: np.logical_or,
    ReduceOp.BOR: np.logical_or,
    ReduceOp.PRODUCT: np.logical_and,
    ReduceOp.MIN: np.logical_and,
    ReduceOp.BAND: np.logical_and,
    ReduceOp.BXOR: np.logical_xor,
}
# shapes as functions of the world size n
SHAPES = {
    "0": lambda n: (0,),
    "1": lambda n: (1,),
    "n-1": lambda n: (max(n - 1, 0),),
    "n": lambda n: (n,),
    "n+1": lambda n: (n + 1,),
    "2n+3": lambda n: (2 * n + 3,),
    "3x5x7": lambda n: (3, 5, 7),
    "2x0x3": lambda n: (2, 0, 3),
    "n+1x4": lambda n: (n + 1, 4),
}


def supported(op: ReduceOp, dtype: str) -> bool:
    kind = np.dtype(dtype).kind
    if op is ReduceOp.AVG:
        return kind == "f"
    if op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR):
        return kind in "iub"
    return True


@pytest.fixture
def comm():
    c = MPI.COMM_WORLD.Dup()
    yield c
    c.Free()


def make_input(seed: int, rank: int, shape: tuple, dtype: str, op: ReduceOp, exact: bool = True) -> np.ndarray:
    """Rank ``rank``'s input; any rank can regenerate any other rank's.

    ``exact`` floats are small integers, so every reduction order gives the same bits.
    """
    rng = np.random.default_rng([seed, rank])
    dt = np.dtype(dtype)
    if dt.kind == "b":
        return rng.random(shape) < (0.8 if op in (ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.BAND) else 0.3)
    if op is ReduceOp.PRODUCT:  # keep products small (and odd/nonzero often)
        lo, hi = (1, 4) if dt.kind == "u" else (-3, 4)
        return rng.integers(lo, hi, shape).astype(dt)
    if dt.kind == "f":
        if exact:
            return rng.integers(-1000, 1000, shape).astype(dt)
        return rng.standard_normal(shape).astype(dt)
    info = np.iinfo(dt)
    return rng.integers(info.min, info.max, shape, dtype=dt, endpoint=True)


def reference(op: ReduceOp, inputs: list[np.ndarray]) -> np.ndarray:
    ufunc = (REF_BOOL if inputs[0].dtype.kind == "b" else REF)[op]
    return functools.reduce(lambda acc, x: ufunc(acc, x), inputs[1:], inputs[0].copy())


def assert_same_on_all_ranks(comm: MPI.Comm, buf: np.ndarray) -> None:
    blobs = comm.allgather(buf.tobytes())
    assert all(b == blobs[0] for b in blobs), "results differ between ranks"


def run_case(comm, shape, dtype, op, seed):
    n, rank = comm.Get_size(), comm.Get_rank()
    inputs = [make_input(seed, r, shape, dtype, op) for r in range(n)]
    buf = inputs[rank].copy()
    ptr = buf.__array_interface__["data"][0]
    ring_all_reduce(comm, buf, op)
    assert buf.shape == shape and buf.dtype == np.dtype(dtype)
    assert buf.__array_interface__["data"][0] == ptr  # in place
    np.testing.assert_array_equal(buf, reference(op, inputs), strict=True)
    assert_same_on_all_ranks(comm, buf)
    mpi = inputs[rank].copy()
    comm.Allreduce(MPI.IN_PLACE, mpi, op=to_mpi_op(op, mpi.dtype))
    np.testing.assert_array_equal(buf, mpi, strict=True)


@pytest.mark.mpi
@pytest.mark.parametrize(
    "op,dtype", [pytest.param(op, dt, id=f"{op.name}-{dt}") for op in OPS for dt in DTYPES if supported(op, dt)]
)
def test_all_ops_dtypes_shapes(comm, op, dtype):
    n = comm.Get_size()
    for i, shape_of in enumerate(SHAPES.values()):
        run_case(comm, shape_of(n), dtype, op, seed=1000 * i + OPS.index(op))


@pytest.mark.mpi
@pytest.mark.parametrize(
    "dtype,op",
    [
        ("float32", ReduceOp.SUM),
        ("float64", ReduceOp.MAX),
        ("int64", ReduceOp.SUM),
        ("uint8", ReduceOp.BXOR),
        ("bool", ReduceOp.BOR),
    ],
)
def test_large_odd_length(comm, dtype, op):
    run_case(comm, (1000003,), dtype, op, seed=7)


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.AVG])
def test_float_reduction_order_and_allreduce(comm, dtype, op):
    """Non-integer floats: bitwise equal to the documented ring order, close to MPI."""
    n, rank = comm.Get_size(), comm.Get_rank()
    count = 10007
    inputs = [make_input(11, r, (count,), dtype, ReduceOp.SUM, exact=False) for r in range(n)]
    buf = inputs[rank].copy()
    ring_all_reduce(comm, buf, op)
    assert_same_on_all_ranks(comm, buf)

    # chunk c: acc = x[c]; acc = x[c+k] op acc for k = 1 .. n-1
    expected = np.empty_like(buf)
    ufunc = REF[op]
    for c, (a, b) in enumerate(ring_chunk_bounds(count, n)):
        acc = inputs[c][a:b].copy()
        for k in range(1, n):
            acc = ufunc(inputs[(c + k) % n][a:b], acc)
        expected[a:b] = acc
    np.testing.assert_array_equal(buf, expected, strict=True)

    mpi = inputs[rank].copy()
    comm.Allreduce(MPI.IN_PLACE, mpi, op=to_mpi_op(op, mpi.dtype))
    rtol = 1e-5 if dtype == "float32" else 1e-12
    np.testing.assert_allclose(buf, mpi, rtol=rtol, atol=rtol * n)


@pytest.mark.mpi
def test_avg_is_sum(comm):
    """AVG is reduced as SUM; the caller divides by the group size."""
    x = make_input(3, comm.Get_rank(), (5, 9), "float64", ReduceOp.SUM)
    a, s = x.copy(), x.copy()
    ring_all_reduce(comm, a, ReduceOp.AVG)
    ring_all_reduce(comm, s, ReduceOp.SUM)
    np.testing.assert_array_equal(a, s, strict=True)


@pytest.mark.mpi
def test_errors(comm):
    x = np.zeros((4, 6))
    with pytest.raises(ValueError, match="C-contiguous"):
        ring_all_reduce(comm, x[:, ::2], ReduceOp.SUM)
    with pytest.raises(ValueError, match="C-contiguous"):
        ring_all_reduce(comm, np.zeros((4, 6)).T, ReduceOp.SUM)
    ro = np.zeros(5)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="writeable"):
        ring_all_reduce(comm, ro, ReduceOp.SUM)
    with pytest.raises(ValueError, match="PREMUL_SUM"):
        ring_all_reduce(comm, x, ReduceOp.PREMUL_SUM)
    with pytest.raises(ValueError):
        ring_all_reduce(comm, np.zeros(3, np.int32), ReduceOp.AVG)
    with pytest.raises(ValueError):
        ring_all_reduce(comm, x, ReduceOp.BXOR)
    with pytest.raises(TypeError):
        ring_all_reduce(comm, x, "sum")
    assert not x.any()


@pytest.mark.parametrize("count", [0, 1, 2, 3, 4, 5, 7, 8, 100, 1000003])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 16])
def test_chunk_bounds(count, n):
    bounds = ring_chunk_bounds(count, n)
    assert len(bounds) == n
    assert bounds[0][0] == 0 and bounds[-1][1] == count
    assert all(a <= b for a, b in bounds)
    assert all(bounds[i][1] == bounds[i + 1][0] for i in range(n - 1))
    sizes = [b - a for a, b in bounds]
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # largest chunk first
    expected = np.array_split(np.arange(count), n)
    assert sizes == [len(e) for e in expected]


def test_chunk_bounds_errors():
    with pytest.raises(ValueError):
        ring_chunk_bounds(-1, 2)
    with pytest.raises(ValueError):
        ring_chunk_bounds(5, 0)
