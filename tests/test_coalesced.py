"""all_reduce_coalesced and all_gather_coalesced (torch 2.13: "will be deprecated"): several
arrays in one collective, equal to the per-array ops; torch's FutureWarning."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from fake_device import FakeDeviceArray
from test_device_staging import rt  # noqa: F401  (the fixture: a stand-in device runtime, staging)

import mpidist
from mpidist import ReduceOp, make_premul_sum
from mpidist._coalesced import all_gather_coalesced, all_reduce_coalesced

pytestmark = pytest.mark.mpi


def _inputs(rank: int) -> list:
    return [np.arange(6, dtype=np.float64).reshape(2, 3) + rank, np.full(1, rank + 0.5), np.arange(4.0) * rank]


@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX, make_premul_sum(2.0)])
@pytest.mark.parametrize("async_op", [False, True])
def test_all_reduce_coalesced_equals_all_reduce(dist, any_group, op, async_op):
    g, members = any_group
    rank = dist.get_rank()
    got, want = _inputs(rank), _inputs(rank)
    out = all_reduce_coalesced(got, op, g, async_op)
    for x in want:
        dist.all_reduce(x, op, g)
    if rank not in members:
        assert out is None
    elif async_op:
        assert out.wait() is True and all(a is b for a, b in zip(out.result(), got))
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def test_all_reduce_coalesced_one_array_and_float16(dist, world):
    rank, size = world
    x = np.full(5, rank, np.int32)
    all_reduce_coalesced(x, ReduceOp.SUM)  # one array, as torch accepts a Tensor
    assert (x == sum(range(size))).all()
    h = [np.ones(3, np.float16), np.full(2, 2.0, np.float16)]
    all_reduce_coalesced(h)  # a dtype MPI cannot reduce: all_reduce's body picks the ring
    assert h[0].tolist() == [size] * 3 and h[1].tolist() == [2.0 * size] * 2


def test_all_gather_coalesced_equals_all_gather(dist, any_group):
    g, members = any_group
    rank = dist.get_rank()
    inp = _inputs(rank)
    n = len(members)
    outs = [[np.zeros_like(x) for x in inp] for _ in range(n)]
    w = all_gather_coalesced(outs, inp, g, async_op=True)
    if rank not in members:
        assert w is None and all((a == 0).all() for row in outs for a in row)
        return
    assert w.wait() is True and len(w.result()) == n * len(inp)
    for k, m in enumerate(members):
        for a, b in zip(outs[k], _inputs(m)):
            np.testing.assert_array_equal(a, b)


def test_coalesced_errors(dist, world):
    rank, size = world
    with pytest.raises(
        TypeError,
        match=r"all_reduce_coalesced: tensors\[1\] dtype int64 does not match "
        r"tensors\[0\] dtype float64",
    ):
        all_reduce_coalesced([np.ones(2), np.ones(2, np.int64)])
    with pytest.raises(ValueError, match=r"all_reduce_coalesced: tensors must hold at least one array"):
        all_reduce_coalesced([])
    with pytest.raises(ValueError, match=r"all_reduce_coalesced: ReduceOp.AVG needs a floating"):
        all_reduce_coalesced([np.ones(2, np.int64)], ReduceOp.AVG)
    inp = [np.ones(2), np.ones(3)]
    with pytest.raises(
        ValueError,
        match=rf"all_gather_coalesced: output_tensor_lists must hold one list per group "
        rf"rank = {size} lists, got {size + 1}",
    ):
        all_gather_coalesced([[np.ones(2), np.ones(3)]] * (size + 1), inp)
    with pytest.raises(
        ValueError,
        match=r"all_gather_coalesced: output_tensor_lists\[0\] must hold "
        r"len\(input_tensor_list\) = 2 arrays, got 1",
    ):
        all_gather_coalesced([[np.ones(2)]] * size, inp)
    with pytest.raises(
        ValueError,
        match=rf"all_gather_coalesced: output_tensor_lists\[{rank}\]\[1\] must have the "
        rf"shape of input_tensor_list\[1\], \(3,\) \(it receives that input\)",
    ):
        all_gather_coalesced([[np.ones(2), np.ones((3, 1))] for _ in range(size)], inp)
    with pytest.raises(TypeError, match=r"all_gather_coalesced: output_tensor_lists must be a list of lists"):
        all_gather_coalesced(np.ones(2), inp)


def test_public_names_warn_as_torch(dist):
    x = [np.ones(2)]
    with pytest.warns(FutureWarning, match=r"`mpidist.all_reduce_coalesced` will be deprecated") as got:
        mpidist.all_reduce_coalesced(x)
    assert got[0].filename == __file__  # points at the caller
    outs = [[np.zeros(2)] for _ in range(dist.get_world_size())]
    with pytest.warns(FutureWarning, match=r"`mpidist.all_gather_coalesced` will be deprecated"):
        mpidist.all_gather_coalesced(outs, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        all_reduce_coalesced(x)  # the implementation itself does not warn


def test_device_arrays_are_staged(dist, world, rt):  # noqa: F811  (pytest passes the fixture imported above)
    rank, size = world
    xs = [FakeDeviceArray.from_host(a) for a in _inputs(rank)]
    w = all_reduce_coalesced(xs, async_op=True)
    w.wait()
    for i, x in enumerate(xs):
        np.testing.assert_array_equal(x.host, sum(_inputs(r)[i] for r in range(size)))
    inp = [FakeDeviceArray.from_host(a) for a in _inputs(rank)]
    outs = [[FakeDeviceArray.from_host(np.zeros_like(a)) for a in _inputs(0)] for _ in range(size)]
    all_gather_coalesced(outs, inp)
    for k in range(size):
        for a, b in zip(outs[k], _inputs(k)):
            np.testing.assert_array_equal(a.host, b)
