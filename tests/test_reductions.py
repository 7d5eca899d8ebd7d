"""reduce, reduce_scatter, reduce_scatter_tensor, all_reduce_multigpu, reduce_multigpu:
every op (PREMUL_SUM included) x dtypes x groups, against numpy on inputs every rank can
regenerate; async forms; bad input."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from mpi4py import MPI

from mpidist import ReduceOp, make_premul_sum

pytestmark = pytest.mark.mpi

PREFIX = r"\[rank \d+/\d+\] "
SHAPE = (2, 3)
#: op name -> op; the premul sums are made fresh per use of the table below.
OPS = {
    "SUM": ReduceOp.SUM,
    "AVG": ReduceOp.AVG,
    "PRODUCT": ReduceOp.PRODUCT,
    "MIN": ReduceOp.MIN,
    "MAX": ReduceOp.MAX,
    "BAND": ReduceOp.BAND,
    "BOR": ReduceOp.BOR,
    "BXOR": ReduceOp.BXOR,
    "PREMUL2": make_premul_sum(2),
    "PREMUL_HALF": make_premul_sum(np.array(0.5)),
}
DTYPES = [np.float32, np.int32, np.float16, np.uint8, np.complex64, np.bool_]
# Which ops each kind of dtype supports (torch's rules; independent of mpidist's tables).
SUPPORTED = {
    "b": {"SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"},
    "i": {"SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL2"},
    "u": {"SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL2"},
    "f": {"SUM", "AVG", "PRODUCT", "MIN", "MAX", "PREMUL2", "PREMUL_HALF"},
    "c": {"SUM", "AVG", "PRODUCT", "PREMUL2", "PREMUL_HALF"},
}
_UFUNC = {
    "SUM": np.add,
    "AVG": np.add,
    "PRODUCT": np.multiply,
    "MIN": np.minimum,
    "MAX": np.maximum,
    "BAND": np.bitwise_and,
    "BOR": np.bitwise_or,
    "BXOR": np.bitwise_xor,
    "PREMUL2": np.add,
    "PREMUL_HALF": np.add,
}
_BOOL_UFUNC = {
    "SUM": np.logical_or,
    "MAX": np.logical_or,
    "BOR": np.logical_or,
    "PRODUCT": np.logical_and,
    "MIN": np.logical_and,
    "BAND": np.logical_and,
    "BXOR": np.logical_xor,
}
_FACTOR = {"PREMUL2": 2, "PREMUL_HALF": 0.5}


def combos(dtypes=DTYPES):
    return [(name, dt) for dt in dtypes for name in OPS if name in SUPPORTED[np.dtype(dt).kind]]


def rank_input(rank: int, name: str, dtype, k: int = 0, shape=SHAPE) -> np.ndarray:
    """Input ``k`` of ``rank``: small integers, so every sum/product below is exact."""
    rng = np.random.default_rng([5, rank, k])
    dtype = np.dtype(dtype)
    if dtype.kind == "b":
        return rng.integers(0, 2, size=shape).astype(dtype)
    x = rng.integers(1, 3 if name == "PRODUCT" else 4, size=shape)
    if dtype.kind == "c":
        return (x + 1j * rng.integers(0, 2, size=shape)).astype(dtype)
    return x.astype(dtype)


def reference(name: str, inputs: list) -> np.ndarray:
    """The reduction of ``inputs`` (in contribution order) computed with numpy alone."""
    dtype = inputs[0].dtype
    if dtype.kind == "b":
        return functools.reduce(_BOOL_UFUNC[name], inputs).astype(dtype)
    if name in _FACTOR:
        inputs = [x * np.asarray(_FACTOR[name]).astype(dtype) for x in inputs]
    out = functools.reduce(_UFUNC[name], inputs).astype(dtype)
    if name == "AVG":
        out = out / len(inputs)
    return out.astype(dtype)


def same_bytes(arr: np.ndarray, comm: MPI.Comm = MPI.COMM_WORLD) -> bool:
    return len(set(comm.allgather(arr.tobytes()))) == 1


# -- reduce -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(OPS))
def test_reduce_every_op_dtype_and_group(dist, any_group, name):
    g, members = any_group
    rank = dist.get_rank()
    for _, dtype in [c for c in combos() if c[0] == name]:
        for dst in members:
            x = rank_input(rank, name, dtype)
            before = x.copy()
            assert dist.reduce(x, dst, op=OPS[name], group=g) is None
            if rank == dst:
                want = reference(name, [rank_input(r, name, dtype) for r in members])
                np.testing.assert_array_equal(x, want, err_msg=f"{name} {np.dtype(dtype)} dst={dst}")
            else:  # non-members, and members other than dst: unchanged
                np.testing.assert_array_equal(x, before)
            assert x.dtype == dtype and x.shape == SHAPE


def test_async_reduce(dist, world):
    rank, size = world
    x = np.full(1000, float(rank))
    work = dist.reduce(x, size - 1, async_op=True)
    assert work.wait() is True and work.is_completed() and work.is_success()
    assert work.result()[0] is x
    want = size * (size - 1) / 2 if rank == size - 1 else float(rank)
    np.testing.assert_array_equal(x, np.full(1000, want))


def test_reduce_read_only_input_off_dst(dist, world):
    rank, size = world
    x = np.full(4, rank + 1, dtype=np.int64)
    x.flags.writeable = rank == 0
    dist.reduce(x, 0)
    np.testing.assert_array_equal(x, np.full(4, size * (size + 1) // 2 if rank == 0 else rank + 1))


# -- reduce_scatter / reduce_scatter_tensor ------------------------------------------------------
@pytest.mark.parametrize("name", list(OPS))
def test_reduce_scatter_every_op_dtype_and_group(dist, any_group, name):
    g, members = any_group
    rank = dist.get_rank()
    n = len(members)
    for _, dtype in [c for c in combos() if c[0] == name]:
        inputs = [rank_input(rank, name, dtype, k=i) for i in range(n)]
        kept = [x.copy() for x in inputs]
        out = np.zeros(SHAPE, dtype)
        assert dist.reduce_scatter(out, inputs, op=OPS[name], group=g) is None
        for x, y in zip(inputs, kept):
            np.testing.assert_array_equal(x, y)
        if rank in members:
            me = members.index(rank)
            want = reference(name, [rank_input(r, name, dtype, k=me) for r in members])
            np.testing.assert_array_equal(out, want, err_msg=f"{name} {np.dtype(dtype)}")
        else:
            np.testing.assert_array_equal(out, np.zeros(SHAPE, dtype))


@pytest.mark.parametrize("stacked", [False, True])
@pytest.mark.parametrize("name", list(OPS))
def test_reduce_scatter_tensor_every_op_dtype_and_group(dist, any_group, name, stacked):
    g, members = any_group
    rank = dist.get_rank()
    n = len(members)
    for _, dtype in [c for c in combos() if c[0] == name]:
        blocks = [rank_input(rank, name, dtype, k=i) for i in range(n)]
        inp = np.stack(blocks) if stacked else np.concatenate(blocks)
        kept = inp.copy()
        out = np.zeros(SHAPE, dtype)
        assert dist.reduce_scatter_tensor(out, inp, op=OPS[name], group=g) is None
        np.testing.assert_array_equal(inp, kept)
        if rank in members:
            me = members.index(rank)
            want = reference(name, [rank_input(r, name, dtype, k=me) for r in members])
            np.testing.assert_array_equal(out, want, err_msg=f"{name} {np.dtype(dtype)}")
        else:
            np.testing.assert_array_equal(out, np.zeros(SHAPE, dtype))


def test_reduce_scatter_tensor_in_place_view(dist, world):
    """torch's in-place form: output is this rank's block of input."""
    rank, size = world
    inp = np.stack([np.full(5, rank + 10 * i, dtype=np.float64) for i in range(size)])
    out = inp[rank]
    dist.reduce_scatter_tensor(out, inp, op=ReduceOp.MAX)
    np.testing.assert_array_equal(out, np.full(5, size - 1 + 10 * rank))


def test_async_reduce_scatter_forms(dist, world):
    rank, size = world
    out1, out2 = np.empty(100), np.empty(100)
    w1 = dist.reduce_scatter(out1, [np.full(100, float(rank + i)) for i in range(size)], async_op=True)
    w2 = dist.reduce_scatter_tensor(out2, np.full(100 * size, float(rank)), op=ReduceOp.AVG, async_op=True)
    assert w1.wait() and w2.wait()
    assert w1.result()[0] is out1 and w2.result()[0] is out2
    np.testing.assert_array_equal(out1, np.full(100, size * (size - 1) / 2 + size * rank))
    np.testing.assert_array_equal(out2, np.full(100, (size * (size - 1) / 2) / size))


# -- multi-array forms --------------------------------------------------------------------------
MULTI_DTYPES = [np.float32, np.int32, np.float16, np.bool_, np.complex128]
LISTLEN = 2


@pytest.mark.parametrize("name", list(OPS))
def test_all_reduce_multigpu_every_op_dtype_and_group(dist, any_group, name):
    g, members = any_group
    rank = dist.get_rank()
    for _, dtype in [c for c in combos(MULTI_DTYPES) if c[0] == name]:
        arrays = [rank_input(rank, name, dtype, k=i) for i in range(LISTLEN)]
        before = [x.copy() for x in arrays]
        assert dist.all_reduce_multigpu(arrays, op=OPS[name], group=g) is None
        if rank in members:
            want = reference(name, [rank_input(r, name, dtype, k=i) for r in members for i in range(LISTLEN)])
            for x in arrays:
                np.testing.assert_array_equal(x, want, err_msg=f"{name} {np.dtype(dtype)}")
        else:
            for x, y in zip(arrays, before):
                np.testing.assert_array_equal(x, y)
    if g is None:  # bitwise identical everywhere, also where rounding happens
        x = [np.random.default_rng([3, rank, i]).standard_normal(257).astype(np.float32) for i in range(3)]
        dist.all_reduce_multigpu(x, op=OPS[name] if name in SUPPORTED["f"] else ReduceOp.SUM)
        assert all(np.array_equal(x[0], y) for y in x[1:]) and same_bytes(x[0])


@pytest.mark.parametrize("name", list(OPS))
def test_reduce_multigpu_every_op_dtype_and_group(dist, any_group, name):
    g, members = any_group
    rank = dist.get_rank()
    for _, dtype in [c for c in combos(MULTI_DTYPES) if c[0] == name]:
        for dst, dst_tensor in [(members[0], 0), (members[-1], LISTLEN - 1)]:
            arrays = [rank_input(rank, name, dtype, k=i) for i in range(LISTLEN)]
            before = [x.copy() for x in arrays]
            assert dist.reduce_multigpu(arrays, dst, op=OPS[name], group=g, dst_tensor=dst_tensor) is None
            for i, (x, y) in enumerate(zip(arrays, before)):
                if rank == dst and i == dst_tensor:
                    want = reference(name, [rank_input(r, name, dtype, k=j) for r in members for j in range(LISTLEN)])
                    np.testing.assert_array_equal(x, want, err_msg=f"{name} {np.dtype(dtype)}")
                else:
                    np.testing.assert_array_equal(x, y)


def test_multigpu_single_array_and_async(dist, world):
    rank, size = world
    a = [np.full(10, rank + 1.0)]
    work = dist.all_reduce_multigpu(a, async_op=True)
    assert work.wait() and work.result()[0] is a[0]
    np.testing.assert_array_equal(a[0], np.full(10, size * (size + 1) / 2))
    b = [np.full(10, rank + 1.0), np.full(10, 1.0), np.full(10, 2.0)]
    work = dist.reduce_multigpu(b, 0, op=ReduceOp.AVG, async_op=True, dst_tensor=2)
    assert work.wait() and len(work.result()) == 3
    if rank == 0:
        np.testing.assert_array_equal(b[2], np.full(10, (size * (size + 1) / 2 + 3 * size) / (3 * size)))
    else:
        np.testing.assert_array_equal(b[2], np.full(10, 2.0))


# -- PREMUL_SUM ----------------------------------------------------------------------------------
def test_premul_sum_factor_forms_and_bitwise_identity(dist, world):
    rank, size = world
    rng = np.random.default_rng([9, rank])
    for factor in (0.1, np.float32(1 / 3), np.array(-2.5), 3):
        x = rng.standard_normal(1001).astype(np.float32)
        want = sum(np.random.default_rng([9, r]).standard_normal(1001).astype(np.float32) for r in range(size))
        y = x.copy()
        dist.all_reduce(y, op=make_premul_sum(factor))
        assert same_bytes(y)
        np.testing.assert_allclose(y, np.float32(factor) * want, rtol=1e-5, atol=1e-5)
        rng = np.random.default_rng([9, rank])
    z = np.full(7, rank + 1, dtype=np.complex64)
    dist.all_reduce(z, op=make_premul_sum(1j))
    np.testing.assert_array_equal(z, np.full(7, 1j * size * (size + 1) / 2, dtype=np.complex64))


def test_premul_sum_factor_is_read_when_the_op_runs(dist, world):
    rank, size = world
    factor = np.array(1.0)
    op = make_premul_sum(factor)
    factor[()] = 4.0
    x = np.full(3, float(rank))
    dist.reduce(x, 0, op=op)
    if rank == 0:
        np.testing.assert_array_equal(x, np.full(3, 4.0 * size * (size - 1) / 2))
    assert repr(op) == "make_premul_sum(array(4.))"


# -- bad input: each message names rank, op, argument, expected and got ------------------------
def test_bad_lists_rejected(dist, world):
    _, size = world
    out = np.zeros(3)
    with pytest.raises(
        ValueError,
        match=PREFIX + rf"reduce_scatter: input_list must hold one array per "
        rf"group rank: expected {size}, got {size + 1}",
    ):
        dist.reduce_scatter(out, [np.ones(3)] * (size + 1))
    with pytest.raises(
        TypeError,
        match=PREFIX + r"reduce_scatter: input_list must be a list of numpy "
        r"arrays, got ndarray",
    ):
        dist.reduce_scatter(out, np.ones((size, 3)))
    bad = [np.ones(3) for _ in range(size)]
    bad[-1] = np.ones(3, dtype=np.float32)
    with pytest.raises(
        TypeError,
        match=PREFIX + rf"reduce_scatter: input_list\[{size - 1}\] dtype float32 "
        r"does not match output dtype float64",
    ):
        dist.reduce_scatter(out, bad)
    bad[-1] = np.ones(4)
    with pytest.raises(
        ValueError,
        match=PREFIX + rf"reduce_scatter: input_list\[{size - 1}\] has shape "
        r"\(4,\), expected the shape of output \(3,\)",
    ):
        dist.reduce_scatter(out, bad)
    with pytest.raises(
        ValueError,
        match=PREFIX + r"all_reduce_multigpu: tensor_list must hold at least "
        r"one array, got an empty list",
    ):
        dist.all_reduce_multigpu([])
    with pytest.raises(
        ValueError,
        match=PREFIX + r"all_reduce_multigpu: tensor_list\[1\] has shape "
        r"\(2,\), expected the shape of tensor_list\[0\] \(3,\)",
    ):
        dist.all_reduce_multigpu([np.ones(3), np.ones(2)])
    with pytest.raises(
        TypeError,
        match=PREFIX + r"reduce_multigpu: tensor_list\[1\] dtype int64 does "
        r"not match tensor_list\[0\] dtype float64",
    ):
        dist.reduce_multigpu([np.ones(3), np.ones(3, dtype=np.int64)], 0)
    a = np.ones(3)
    with pytest.raises(
        ValueError,
        match=PREFIX + r"all_reduce_multigpu: tensor_list holds the same array "
        r"more than once",
    ):
        dist.all_reduce_multigpu([a, a])
    with pytest.raises(
        ValueError,
        match=PREFIX + r"reduce_multigpu: dst_tensor=2 is out of range for "
        r"tensor_list of length 2",
    ):
        dist.reduce_multigpu([np.ones(3), np.ones(3)], 0, dst_tensor=2)


def test_bad_sizes_and_ranks_rejected(dist, world):
    rank, size = world
    with pytest.raises(
        ValueError,
        match=PREFIX + rf"reduce_scatter_tensor: input must hold world_size \* "
        rf"output.size = {size} \* 3 = {3 * size} elements, got "
        rf"{3 * size + 1} \(shape \({3 * size + 1},\)\)",
    ):
        dist.reduce_scatter_tensor(np.zeros(3), np.ones(3 * size + 1))
    with pytest.raises(
        TypeError,
        match=PREFIX + r"reduce_scatter_tensor: input dtype int32 does not match "
        r"output dtype float64",
    ):
        dist.reduce_scatter_tensor(np.zeros(3), np.ones(3 * size, dtype=np.int32))
    with pytest.raises(ValueError, match=PREFIX + rf"reduce: dst={size}: global rank {size} is not part"):
        dist.reduce(np.ones(2), size)
    with pytest.raises(TypeError, match=PREFIX + r"reduce: dst must be an int \(a global rank\), got str"):
        dist.reduce(np.ones(2), "0")
    x = np.ones(2)
    x.flags.writeable = False
    with pytest.raises(ValueError, match=PREFIX + r"reduce: tensor must be writable"):
        dist.reduce(x, rank)  # the dst's own array must be writable
    with pytest.raises(ValueError, match=PREFIX + r"reduce_scatter: output must be C-contiguous"):
        dist.reduce_scatter(np.zeros((3, 4))[:, ::2], [np.ones((3, 2))] * size)


def test_bad_ops_rejected(dist, world):
    with pytest.raises(
        ValueError,
        match=PREFIX + r"reduce: ReduceOp.PREMUL_SUM needs a factor: pass "
        r"mpidist.make_premul_sum\(factor\)",
    ):
        dist.reduce(np.ones(2), 0, op=ReduceOp.PREMUL_SUM)
    with pytest.raises(
        ValueError,
        match=PREFIX + r"reduce_scatter_tensor: make_premul_sum\(0.5\) on integer "
        r"dtype int32 needs an integral factor, got 0.5",
    ):
        dist.reduce_scatter_tensor(np.zeros(1, np.int32), np.ones(world[1], np.int32), op=make_premul_sum(0.5))
    with pytest.raises(
        ValueError,
        match=PREFIX + r"all_reduce: make_premul_sum\(2\) needs a numeric dtype, "
        r"got bool",
    ):
        dist.all_reduce(np.ones(2, bool), op=make_premul_sum(2))
    with pytest.raises(
        ValueError,
        match=PREFIX + r"all_reduce_multigpu: make_premul_sum\(1j\) on real "
        r"dtype float64 needs a real factor, got 1j",
    ):
        dist.all_reduce_multigpu([np.ones(2)], op=make_premul_sum(1j))
    with pytest.raises(
        ValueError,
        match=PREFIX + r"reduce_multigpu: ReduceOp.BXOR needs an integer or bool "
        r"dtype, got float32",
    ):
        dist.reduce_multigpu([np.ones(2, np.float32)], 0, op=ReduceOp.BXOR)
    with pytest.raises(
        ValueError,
        match=PREFIX + r"reduce: ReduceOp.AVG needs a floating or complex dtype, "
        r"got bool",
    ):
        dist.reduce(np.ones(2, bool), 0, op=ReduceOp.AVG)
    with pytest.raises(TypeError, match=PREFIX + r"reduce_scatter: op must be a mpidist.ReduceOp, got 'max'"):
        dist.reduce_scatter(np.zeros(1), [np.ones(1)] * world[1], op="max")


@pytest.mark.parametrize("factor", [True, "2", [2.0], np.ones(2), np.array("x")])
def test_make_premul_sum_rejects_non_numbers(factor):
    with pytest.raises(TypeError, match=r"make_premul_sum: factor must be a number or a 0-d numeric array"):
        make_premul_sum(factor)


def test_non_members_return_none_untouched(dist, world):
    rank, size = world
    g = dist.new_group([size - 1])
    x = np.full(3, 7.0)
    lst = [np.full(3, 7.0), np.full(3, 8.0)]
    results = [
        dist.reduce(x, size - 1, group=g),
        dist.reduce_scatter(x, [x.copy()], group=g),
        dist.reduce_scatter_tensor(x, x.copy(), group=g),
        dist.all_reduce_multigpu(lst, group=g),
        dist.reduce_multigpu(lst, size - 1, group=g, dst_tensor=1),
    ]
    assert results == [None] * 5
    np.testing.assert_array_equal(x, np.full(3, 7.0))  # one-rank group: every op leaves 7
    np.testing.assert_array_equal(lst[0], np.full(3, 15.0) if rank == size - 1 else np.full(3, 7.0))
    if g is not dist.GroupMember.NON_GROUP_MEMBER:
        dist.destroy_process_group(g)
