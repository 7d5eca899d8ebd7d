"""Shared-memory all-reduce (mpidist.algorithms.shm): against independently computed
folds, MPI's Allreduce, and itself across ranks; window reuse and release.

Every rank regenerates every rank's input from a seed, so each rank checks the whole
result itself. Both algorithms are covered: 2 ranks (pairwise) and 3-4 ranks (reduce-
scatter + all-gather); small slots force many chunks and short last chunks.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from mpi4py import MPI

from mpidist._arrays.buffers import mpi_reducible
from mpidist._arrays.reduce_op import ReduceOp, make_premul_sum, to_mpi_op
from mpidist._runtime import world as runtime
from mpidist.algorithms import ShmAllReduce, shm as shm_module, shm_all_reduce, shm_applicable, shm_release

try:
    import ml_dtypes
except ImportError:  # the test extra installs it; without it bfloat16 cases are left out
    ml_dtypes = None

pytestmark = pytest.mark.mpi

DTYPES = ["float32", "float64", "float16", "complex64", "int8", "int32", "int64", "uint8", "uint64", "bool", ">f8"] + (
    ["bfloat16"] if ml_dtypes is not None else []
)
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
# shapes as functions of the world size n; "chunks" spans several chunks of a 1 KiB slot
SHAPES = {
    "0": lambda n: (0,),
    "1": lambda n: (1,),
    "n-1": lambda n: (max(n - 1, 0),),
    "n": lambda n: (n,),
    "n+1": lambda n: (n + 1,),
    "2n+3": lambda n: (2 * n + 3,),
    "3x5x7": lambda n: (3, 5, 7),
    "2x0x3": lambda n: (2, 0, 3),
    "chunks": lambda n: (1000 * n + 7,),
}
SMALL_SLOT = 1024


def as_dtype(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def kind(dtype: np.dtype) -> str:
    return "f" if dtype.name == "bfloat16" else dtype.kind


def supported(op: ReduceOp, name: str) -> bool:
    k = kind(as_dtype(name))
    if op is ReduceOp.AVG:
        return k in "fc"
    if op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR):
        return k in "iub"
    if op in (ReduceOp.MIN, ReduceOp.MAX):
        return k != "c"
    return True


def make_input(seed: int, rank: int, shape: tuple, dtype: np.dtype, op: ReduceOp, exact: bool = True) -> np.ndarray:
    """Rank ``rank``'s input; any rank can regenerate any other rank's.

    ``exact`` floats are small integers, so every reduction order gives the same bits.
    """
    rng = np.random.default_rng([seed, rank])
    k = kind(dtype)
    if k == "b":
        return rng.random(shape) < (0.8 if op in (ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.BAND) else 0.3)
    if op is ReduceOp.PRODUCT:  # products of up to 4 small values stay exact everywhere
        return rng.integers(1 if k == "u" else -2, 3, shape).astype(dtype)
    if k in "fc":
        if exact:
            return rng.integers(-8, 8, shape).astype(dtype)
        return rng.standard_normal(shape).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)


def fold(op: ReduceOp, inputs: list) -> np.ndarray:
    """The documented order: acc = x0 op x1, then acc op x_k for k = 2 .. n-1."""
    ufunc = (REF_BOOL if inputs[0].dtype.kind == "b" else REF)[op]
    acc = functools.reduce(lambda acc, x: ufunc(acc, x), inputs[1:], inputs[0].copy())
    return acc.astype(inputs[0].dtype, copy=False)  # ufuncs answer non-native byte order natively


def assert_same_on_all_ranks(comm: MPI.Comm, buf: np.ndarray) -> None:
    blobs = comm.allgather(buf.tobytes())
    assert all(b == blobs[0] for b in blobs), "results differ between ranks"


@pytest.fixture
def comm():
    c = MPI.COMM_WORLD.Dup()
    yield c
    c.Free()


@pytest.fixture
def small(comm):
    """A ShmAllReduce whose 1 KiB slot makes a few thousand elements take many chunks."""
    with ShmAllReduce(comm, SMALL_SLOT) as s:
        yield s


def run_case(s: ShmAllReduce, comm: MPI.Comm, shape: tuple, name: str, op: ReduceOp, seed: int) -> None:
    n, rank = comm.Get_size(), comm.Get_rank()
    dtype = as_dtype(name)
    inputs = [make_input(seed, r, shape, dtype, op) for r in range(n)]
    buf = inputs[rank].copy()
    ptr = buf.__array_interface__["data"][0]
    s(buf, op)
    assert buf.shape == shape and buf.dtype == dtype
    assert buf.__array_interface__["data"][0] == ptr  # in place
    expected = fold(op, inputs)
    assert buf.tobytes() == expected.tobytes(), f"{name} {op} {shape}: wrong values"
    assert_same_on_all_ranks(comm, buf)
    if mpi_reducible(dtype):
        mpi = inputs[rank].copy()
        comm.Allreduce(MPI.IN_PLACE, mpi, op=to_mpi_op(op, dtype))
        np.testing.assert_array_equal(buf, mpi, strict=True)


@pytest.mark.parametrize(
    "op,name", [pytest.param(op, dt, id=f"{op.name}-{dt}") for op in OPS for dt in DTYPES if supported(op, dt)]
)
def test_ops_dtypes_shapes(small, comm, op, name):
    n = comm.Get_size()
    for i, shape_of in enumerate(SHAPES.values()):
        run_case(small, comm, shape_of(n), name, op, seed=1000 * i + OPS.index(op))


@pytest.mark.parametrize(
    "name,op", [("float32", ReduceOp.SUM), ("int64", ReduceOp.BXOR), ("bool", ReduceOp.MIN), ("float64", ReduceOp.MAX)]
)
def test_large_default_slot(comm, name, op):
    """Several chunks of the default 2 MiB slot, with a short last one."""
    with ShmAllReduce(comm) as s:
        run_case(s, comm, (1_500_007,), name, op, seed=5)


@pytest.mark.parametrize("slot", [SMALL_SLOT, 1 << 21])
@pytest.mark.parametrize("name", ["float32", "float64", "float16"])
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX])
def test_float_fold_order_bitwise(comm, slot, name, op):
    """Non-integer floats (with inf, nan, -0.0): bitwise the rank-0..n-1 fold on every
    rank, whatever the chunking, and close to MPI's sum."""
    n, rank = comm.Get_size(), comm.Get_rank()
    count = 20011
    inputs = [make_input(11, r, (count,), np.dtype(name), ReduceOp.SUM, exact=False) for r in range(n)]
    for r, x in enumerate(inputs):
        x[r::97] = [np.inf, -np.inf, np.nan, -0.0, 0.0][r % 5]
    buf = inputs[rank].copy()
    with ShmAllReduce(comm, slot) as s:
        s(buf, op)
    assert_same_on_all_ranks(comm, buf)
    with np.errstate(invalid="ignore", over="ignore"):
        expected = fold(op, inputs)
    np.testing.assert_array_equal(buf, expected, strict=True)
    assert np.array_equal(np.signbit(buf), np.signbit(expected))
    if op is ReduceOp.SUM and name != "float16":
        mpi = inputs[rank].copy()
        comm.Allreduce(MPI.IN_PLACE, mpi, op=MPI.SUM)
        np.testing.assert_allclose(buf, mpi, rtol=1e-4, atol=1e-4 * n)


def test_avg_is_sum(small, comm):
    """AVG is reduced as SUM; the caller divides by the group size."""
    x = make_input(3, comm.Get_rank(), (5, 99), np.dtype("float64"), ReduceOp.SUM, exact=False)
    a, s = x.copy(), x.copy()
    small(a, ReduceOp.AVG)
    small(s, ReduceOp.SUM)
    assert a.tobytes() == s.tobytes()


def test_reuse_across_calls(small, comm):
    """One window serves calls of any size and dtype in turn: no stale data between them."""
    win, mems = small.win, [m.address for m in small._mems]
    n = comm.Get_size()
    for i, (count, name) in enumerate(
        [
            (3001, "float32"),
            (7, "int8"),
            (4099, "float64"),
            (0, "int32"),
            (1, "complex64"),
            (2500, "uint8"),
            (3001, "float32"),
        ]
    ):
        run_case(small, comm, (count,), name, ReduceOp.SUM, seed=100 + i)
    assert small.win is win and [m.address for m in small._mems] == mems
    if n > 1:  # views made once per dtype; it synchronized, every rank as often
        assert set(small._views) == {np.dtype(d) for d in ("float32", "int8", "float64", "complex64", "uint8")}
        assert small._epoch > 0
    assert comm.allgather(small._epoch) == [small._epoch] * n


def test_free(comm):
    s = ShmAllReduce(comm, SMALL_SLOT)
    x = np.ones(10)
    s(x, ReduceOp.SUM)
    np.testing.assert_array_equal(x, np.full(10, comm.Get_size(), float))
    s.free()
    assert s.win is None
    s.free()  # idempotent
    with pytest.raises(ValueError, match=r"^\[rank \S+\] shm_all_reduce: this ShmAllReduce was freed$"):
        s(x, ReduceOp.SUM)
    np.testing.assert_array_equal(x, np.full(10, comm.Get_size(), float))


def test_cached_per_communicator(comm):
    """shm_all_reduce keeps one window per communicator until shm_release."""
    n = comm.Get_size()
    x = np.arange(6, dtype=np.int64)
    shm_all_reduce(comm, x, ReduceOp.SUM)
    state = shm_module._CACHE[comm.handle]
    shm_all_reduce(comm, x, ReduceOp.SUM)
    assert shm_module._CACHE[comm.handle] is state
    np.testing.assert_array_equal(x, np.arange(6) * n * n)
    shm_release(comm)
    assert comm.handle not in shm_module._CACHE and state.win is None
    shm_release(comm)  # no-op
    shm_all_reduce(comm, x, ReduceOp.MAX)  # a fresh window
    np.testing.assert_array_equal(x, np.arange(6) * n * n)
    shm_release(comm)


def test_groups(any_group):
    """On each test group's communicator (sub-communicators included)."""
    group, members = any_group
    if group is not None and group.comm is None:  # not a member: nothing to do
        return
    comm = runtime.resolve_group(group).comm
    assert shm_applicable(comm)
    with ShmAllReduce(comm, SMALL_SLOT) as s:
        g = comm.Get_rank()
        inputs = [make_input(21, r, (777,), np.dtype("int32"), ReduceOp.SUM) for r in members]
        buf = inputs[g].copy()
        s(buf, ReduceOp.SUM)
        np.testing.assert_array_equal(buf, fold(ReduceOp.SUM, inputs), strict=True)


def test_applicable(comm):
    assert shm_applicable(comm) is True
    assert shm_applicable(MPI.COMM_SELF) is True


def test_errors(small, comm):
    x = np.zeros((4, 6))
    with pytest.raises(ValueError, match=r"shm_all_reduce: buf must be C-contiguous"):
        small(x[:, ::2], ReduceOp.SUM)
    ro = np.zeros(5)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match=r"shm_all_reduce: buf must be writable, got a read-only array"):
        small(ro, ReduceOp.SUM)
    with pytest.raises(TypeError, match=r"shm_all_reduce: buf must be a numpy.ndarray, got list"):
        small([1.0, 2.0], ReduceOp.SUM)
    with pytest.raises(
        TypeError,
        match=r"shm_all_reduce: op must be a ReduceOp \(apply a PremulSum's factor first\), "
        r"got 'sum'",
    ):
        small(x, "sum")
    with pytest.raises(TypeError, match=r"shm_all_reduce: op must be a ReduceOp"):
        small(x, make_premul_sum(2.0))
    with pytest.raises(ValueError, match=r"shm_all_reduce: ReduceOp.PREMUL_SUM needs a factor"):
        small(x, ReduceOp.PREMUL_SUM)
    with pytest.raises(ValueError, match=r"shm_all_reduce: ReduceOp.AVG needs a floating or complex dtype, got int32"):
        small(np.zeros(3, np.int32), ReduceOp.AVG)
    with pytest.raises(ValueError, match=r"shm_all_reduce: ReduceOp.BXOR needs an integer or bool dtype, got float64"):
        small(x, ReduceOp.BXOR)
    n = comm.Get_size()
    with pytest.raises(
        ValueError, match=rf"ShmAllReduce: slot_bytes must be >= 128 x the {n} ranks = {128 * n}, got 64$"
    ):
        ShmAllReduce(comm, 64)
    assert not x.any() and not ro.any()
    # every rank raised alike, so the window is still in step: it still reduces correctly
    y = np.ones(3)
    small(y, ReduceOp.SUM)
    np.testing.assert_array_equal(y, np.full(3, comm.Get_size(), float))
