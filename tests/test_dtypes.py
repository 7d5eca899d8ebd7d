"""all_reduce and reduce over every numpy numeric dtype, bool, complex, float16, bfloat16
(ml_dtypes) and non-native byte order: values against numpy, bitwise identity across ranks,
and the two routes (MPI's predefined reductions; mpidist's own where MPI has no datatype)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from mpi4py import MPI

from mpidist import ReduceOp, make_premul_sum
from mpidist._arrays.buffers import mpi_reducible, saturating_sums
from mpidist._arrays.reduce_op import to_mpi_op

pytestmark = pytest.mark.mpi

try:
    import ml_dtypes
except ImportError:  # the test extra installs it; without it bfloat16 cases skip
    ml_dtypes = None


def _numpy_dtypes() -> list:
    seen: list = []
    for char in "?" + np.typecodes["AllInteger"] + np.typecodes["Float"] + np.typecodes["Complex"]:
        if np.dtype(char) not in seen:
            seen.append(np.dtype(char))
    return seen + [np.dtype(">i4"), np.dtype(">f8")]  # non-native byte order: no MPI reduction


NO_BF16 = pytest.mark.skipif(ml_dtypes is None, reason="ml_dtypes not installed")
BF16 = pytest.param("bfloat16", marks=NO_BF16)
OPS = [
    ReduceOp.SUM,
    ReduceOp.AVG,
    ReduceOp.PRODUCT,
    ReduceOp.MIN,
    ReduceOp.MAX,
    ReduceOp.BAND,
    ReduceOp.BOR,
    ReduceOp.BXOR,
    "PREMUL",
]
_UFUNC = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVG: np.add,
    ReduceOp.PRODUCT: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.BAND: np.bitwise_and,
    ReduceOp.BOR: np.bitwise_or,
    ReduceOp.BXOR: np.bitwise_xor,
    "PREMUL": np.add,
}
_BOOL = {
    ReduceOp.SUM: np.logical_or,
    ReduceOp.MAX: np.logical_or,
    ReduceOp.BOR: np.logical_or,
    ReduceOp.PRODUCT: np.logical_and,
    ReduceOp.MIN: np.logical_and,
    ReduceOp.BAND: np.logical_and,
    ReduceOp.BXOR: np.logical_xor,
}


def as_dtype(dtype) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)


def kind(dtype) -> str:
    return "f" if dtype == "bfloat16" or getattr(dtype, "name", "") == "bfloat16" else np.dtype(dtype).kind


def supported(op, dtype) -> bool:
    k = kind(dtype)
    if op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR):
        return k in "biu"
    if op is ReduceOp.AVG:
        return k in "fc"
    if op in (ReduceOp.MIN, ReduceOp.MAX):
        return k != "c"
    if op == "PREMUL":
        return k != "b"
    return True


def _combos() -> list:
    """(op, dtype) pairs torch defines: every op on every dtype it applies to."""
    dtypes = [(d, d.str if not d.isnative else d.name, ()) for d in _numpy_dtypes()]
    dtypes.append(("bfloat16", "bfloat16", NO_BF16))
    return [
        pytest.param(op, d, id=f"{getattr(op, 'name', op)}-{name}", marks=marks)
        for d, name, marks in dtypes
        for op in OPS
        if supported(op, d)
    ]


COMBOS = _combos()


def factor(dtype: np.dtype):
    return 0.5 if kind(dtype) in "fc" else 3


def the_op(op, dtype: np.dtype):
    return make_premul_sum(factor(dtype)) if op == "PREMUL" else op


def rank_input(rank: int, op, dtype: np.dtype, n: int = 12) -> np.ndarray:
    """Small integers (products of up to 4 stay exact even in int8/float16/bfloat16)."""
    rng = np.random.default_rng([17, rank])
    if kind(dtype) == "b":
        return rng.integers(0, 2, n).astype(dtype)
    x = rng.integers(1, 3 if op is ReduceOp.PRODUCT else 4, n)
    if kind(dtype) == "c":
        x = x + 1j * rng.integers(0, 2, n)
    return x.astype(np.complex128 if kind(dtype) == "c" else np.float64).astype(dtype)


def reference(op, dtype: np.dtype, size: int) -> np.ndarray:
    inputs = [rank_input(r, op, dtype) for r in range(size)]
    if kind(dtype) == "b":
        return functools.reduce(_BOOL[op], inputs).astype(dtype)
    if op == "PREMUL":
        f = np.asarray(factor(dtype)).astype(dtype)
        inputs = [x * f for x in inputs]
    out = functools.reduce(_UFUNC[op], inputs).astype(dtype)
    return (out / size).astype(dtype) if op is ReduceOp.AVG else out


def value_bytes(arr: np.ndarray) -> bytes:
    """The bytes that hold the values: all of them, except for x87 80-bit long double,
    stored in 16 bytes whose 6 padding bytes arithmetic leaves undefined."""
    if (
        arr.dtype.kind in "fc"
        and arr.dtype.isnative
        and arr.dtype.itemsize in (16, 32)
        and np.finfo(arr.dtype).nmant == 63
    ):
        return arr.view(np.uint8).reshape(-1, 16)[:, :10].tobytes()
    return arr.tobytes()


def identical_everywhere(arr: np.ndarray) -> bool:
    """Bitwise equality of the values across ranks."""
    return len(set(MPI.COMM_WORLD.allgather(value_bytes(arr)))) == 1


@pytest.mark.parametrize(("op", "dtype"), COMBOS)
def test_all_reduce_every_dtype(dist, world, op, dtype):
    rank, size = world
    dtype = as_dtype(dtype)
    x = rank_input(rank, op, dtype)
    assert dist.all_reduce(x, op=the_op(op, dtype)) is None
    assert x.dtype == dtype
    assert value_bytes(x) == value_bytes(reference(op, dtype, size))
    assert identical_everywhere(x)


@pytest.mark.parametrize(("op", "dtype"), COMBOS)
def test_reduce_every_dtype(dist, world, op, dtype):
    rank, size = world
    dtype = as_dtype(dtype)
    dst = size - 1
    x = rank_input(rank, op, dtype)
    before = x.copy()
    assert dist.reduce(x, dst, op=the_op(op, dtype)) is None
    want = reference(op, dtype, size) if rank == dst else before
    assert x.dtype == dtype and value_bytes(x) == value_bytes(want)


@pytest.mark.parametrize("dtype", ["float16", BF16])
def test_rounding_dtypes_bitwise_identical_and_close(dist, world, dtype):
    """Inexact sums of random values: every rank holds the same bits (all_reduce), and the
    results of all_reduce, reduce and reduce_scatter_tensor are close to float64 sums."""
    rank, size = world
    dtype = as_dtype(dtype)
    n = 1000 * size

    def values(r):
        return np.random.default_rng([23, r]).standard_normal(n).astype(dtype)

    exact = sum(values(r).astype(np.float64) for r in range(size))
    tol = dict(rtol=0.05, atol=0.05 * size) if dtype.name == "bfloat16" else dict(rtol=5e-3, atol=5e-3 * size)
    x = values(rank)
    dist.all_reduce(x)
    assert identical_everywhere(x)
    np.testing.assert_allclose(x.astype(np.float64), exact, **tol)
    y = values(rank)
    dist.reduce(y, 0)
    if rank == 0:
        np.testing.assert_allclose(y.astype(np.float64), exact, **tol)
    out = np.empty(n // size, dtype)
    dist.reduce_scatter_tensor(out, values(rank), op=ReduceOp.MAX)
    want = np.max([values(r) for r in range(size)], axis=0).reshape(size, -1)[rank]
    assert out.tobytes() == want.tobytes()


def test_predefined_types_keep_mpis_own_ops():
    """The fast path: MPI's predefined reductions wherever MPI has the datatype (8- and 16-bit
    integers only where its sum wraps: tests/test_int_overflow.py); a user-defined op (one per
    ReduceOp, cached) only where it has none."""
    for d in [np.uint64, np.float32, np.float64, np.complex64, np.bool_, np.longdouble]:
        assert mpi_reducible(np.dtype(d))
    assert mpi_reducible(np.dtype(np.int8)) == (("i", 1) not in saturating_sums())
    assert to_mpi_op(ReduceOp.SUM, np.dtype(np.float32)) == MPI.SUM
    assert to_mpi_op(ReduceOp.MAX, np.dtype(np.bool_)) == MPI.LOR
    for d in [np.float16, ">f8"] + ([ml_dtypes.bfloat16] if ml_dtypes else []):
        assert not mpi_reducible(np.dtype(d))
        op = to_mpi_op(ReduceOp.MIN, np.dtype(d))
        assert not op.is_predefined and op.Is_commutative()
        assert to_mpi_op(ReduceOp.MIN, np.dtype(np.float16)) is op  # created once, cached


def test_unsupported_dtypes_rejected(dist):
    with pytest.raises(
        TypeError,
        match=r"\[rank \d+/\d+\] reduce: tensor has dtype <U1, which cannot be "
        r"communicated; expected a numeric or bool dtype",
    ):
        dist.reduce(np.array(["a"]), 0)
    with pytest.raises(TypeError, match=r"all_reduce: tensor has dtype \[\('a', '<i4'\)\], which cannot"):
        dist.all_reduce(np.zeros(2, dtype=[("a", "<i4")]))
    with pytest.raises(ValueError, match=r"reduce: ReduceOp.MIN is not defined for complex dtype complex128"):
        dist.reduce(np.ones(2, np.complex128), 0, op=ReduceOp.MIN)
    with pytest.raises(ValueError, match=r"all_reduce: ReduceOp.BAND needs an integer or bool dtype, got float16"):
        dist.all_reduce(np.ones(2, np.float16), op=ReduceOp.BAND)
