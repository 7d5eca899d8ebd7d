"""Data-movement collectives against values each rank computes on its own.

Every rank can regenerate any rank's input from a seed (:func:`data`), so each rank
checks what it received without trusting mpidist. Sizes differ between ranks (uneven
all_gather/gather/scatter/all-to-all), outputs are either separate arrays or views back
to back in one buffer (mpidist's no-copy path), and every test runs on every kind of
group, checking that non-members get None and keep their buffers.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

pytestmark = pytest.mark.mpi

DTYPES = [np.float32, np.int64, np.bool_, np.float16, np.complex128]
# (layout of the list arguments, async_op)
MODES = [("separate", False), ("block", False), ("separate", True), ("block", True)]
PREFIX = r"\[rank \d+/\d+\] "


def data(dtype, shape, *key: int) -> np.ndarray:
    """Deterministic array for ``key`` (e.g. test salt, sender, receiver), exact in every dtype."""
    rng = np.random.default_rng([41, *key])
    x = rng.integers(-100, 100, size=shape)
    if np.dtype(dtype).kind == "c":
        x = x + 1j * rng.integers(-100, 100, size=shape)
    if dtype is np.bool_:
        x = x > 0
    return np.asarray(x).astype(dtype)


def shape_of(rank: int) -> tuple:
    """Rank ``rank``'s (uneven) tensor shape."""
    return (rank % 3 + 1, 2)


def pair_rows(sender: int, receiver: int) -> int:
    """Rows ``sender`` sends ``receiver`` in the all-to-all tests (uneven, and not symmetric)."""
    return (sender + 2 * receiver) % 3 + 1


def arrays(shapes, dtype, layout: str, fill=None) -> list:
    """Arrays of ``shapes`` (zeros, or copies of ``fill``): separate allocations, or views back
    to back in one buffer ("block"), the layout mpidist uses without a copy."""
    fill = fill if fill is not None else [np.zeros(s, dtype) for s in shapes]
    if layout == "separate":
        return [np.array(f, dtype=dtype) for f in fill]
    sizes = [int(np.prod(s)) for s in shapes]
    buf = np.zeros(sum(sizes), dtype)
    offsets = np.cumsum([0, *sizes])
    views = [buf[o : o + n].reshape(s) for o, n, s in zip(offsets, sizes, shapes)]
    for v, f in zip(views, fill):
        v[...] = f
    return views


def call(op, *args, member: bool, async_op: bool, **kwargs):
    """Run ``op``; check it returns what torch promises; return ``Work.result()`` or None."""
    work = op(*args, async_op=async_op, **kwargs)
    if not (member and async_op):
        assert work is None
        return None
    assert work.wait() is True
    assert work.is_completed() and work.is_success()
    return work.result()


def assert_same_list(got, want) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
        assert g.shape == w.shape and g.dtype == w.dtype


def assert_identity(result, arrays_) -> None:
    """``Work.result()`` hands back the caller's own arrays."""
    if result is not None:
        assert len(result) == len(arrays_) and all(r is a for r, a in zip(result, arrays_))


# -- all_gather -------------------------------------------------------------------------------


@pytest.mark.parametrize("layout,async_op", MODES)
def test_all_gather_uneven(dist, any_group, layout, async_op):
    g, members = any_group
    rank = dist.get_rank()
    is_member = rank in members
    for dtype in DTYPES:
        tensor = data(dtype, shape_of(rank), 1, rank)
        outs = arrays([shape_of(m) for m in members], dtype, layout)
        before = [o.copy() for o in outs]
        result = call(dist.all_gather, outs, tensor, group=g, member=is_member, async_op=async_op)
        np.testing.assert_array_equal(tensor, data(dtype, shape_of(rank), 1, rank))
        if is_member:
            assert_same_list(outs, [data(dtype, shape_of(m), 1, m) for m in members])
            assert_identity(result, outs)
        else:
            assert_same_list(outs, before)


@pytest.mark.parametrize("layout,async_op", MODES + [("rows", False), ("rows", True), ("inner rows", False)])
def test_all_gather_equal_sizes(dist, any_group, layout, async_op):
    """Every rank sends the same count (the MPI_Allgather path), alternating with uneven calls so
    a cached layout of one call is never reused for the other; outputs separate, back to back,
    the rows of a 2-d array, or rows of a larger array (a block that is not its base)."""
    g, members = any_group
    rank = dist.get_rank()
    is_member = rank in members
    for dtype in DTYPES:
        for step in range(2):
            if layout == "rows":
                outs = list(np.zeros((len(members), 2, 2), dtype))
            elif layout == "inner rows":
                outs = list(np.zeros((len(members) + 2, 2, 2), dtype)[1:-1])
            else:
                outs = arrays([(2, 2)] * len(members), dtype, layout)
            tensor = data(dtype, (2, 2), 3, step, rank)
            result = call(dist.all_gather, outs, tensor, group=g, member=is_member, async_op=async_op)
            if is_member:
                assert_same_list(outs, [data(dtype, (2, 2), 3, step, m) for m in members])
                assert_identity(result, outs)
            else:
                assert_same_list(outs, [np.zeros((2, 2), dtype)] * len(members))
            uneven = arrays([shape_of(m) for m in members], dtype, "block")
            call(
                dist.all_gather, uneven, data(dtype, shape_of(rank), 4, rank), group=g, member=is_member, async_op=False
            )
            if is_member:
                assert_same_list(uneven, [data(dtype, shape_of(m), 4, m) for m in members])


def test_all_gather_input_inside_output(dist, world):
    """Input at its own slot (MPI_IN_PLACE), or overlapping another slot (sent as a copy)."""
    rank, size = world
    mine = data(np.float64, (3,), 2, rank)
    want = np.stack([data(np.float64, (3,), 2, r) for r in range(size)])
    for slot in {rank, (rank + 1) % size}:
        block = np.zeros((size, 3))
        block[slot] = mine
        dist.all_gather(list(block), block[slot])
        np.testing.assert_array_equal(block, want)
    # the caller's own slot passed as a separate list element that is the input itself
    outs = [np.zeros(3) for _ in range(size)]
    outs[rank][...] = mine
    dist.all_gather(outs, outs[rank])
    assert_same_list(outs, list(want))


@pytest.mark.parametrize("async_op", [False, True])
def test_all_gather_into_tensor_on_groups(dist, any_group, async_op):
    g, members = any_group
    rank = dist.get_rank()
    is_member = rank in members
    inp = data(np.int32, (2, 3), 3, rank)
    out = np.full((2 * len(members), 3), -1, dtype=np.int32)
    result = call(dist.all_gather_into_tensor, out, inp, group=g, member=is_member, async_op=async_op)
    if is_member:
        np.testing.assert_array_equal(out, np.concatenate([data(np.int32, (2, 3), 3, m) for m in members]))
        assert_identity(result, [out])
    else:
        np.testing.assert_array_equal(out, -1)


def test_all_gather_into_tensor_input_inside_output(dist, world):
    rank, size = world
    want = np.stack([data(np.int64, (2, 3), 4, r) for r in range(size)])
    for slot in {rank, (rank + 1) % size}:
        out = np.zeros((size, 2, 3), dtype=np.int64)
        out[slot] = want[rank]
        dist.all_gather_into_tensor(out, out[slot])
        np.testing.assert_array_equal(out, want)


# -- gather, scatter ------------------------------------------------------------------------


@pytest.mark.parametrize("layout,async_op", MODES)
def test_gather_to_every_dst(dist, any_group, layout, async_op):
    g, members = any_group
    rank = dist.get_rank()
    is_member = rank in members
    for dtype in DTYPES[:3]:
        for dst in members:
            tensor = data(dtype, shape_of(rank), 5, dst, rank)
            gather_list = arrays([shape_of(m) for m in members], dtype, layout)
            before = [o.copy() for o in gather_list]
            passed = gather_list if rank == dst or not is_member else None
            result = call(dist.gather, tensor, passed, dst=dst, group=g, member=is_member, async_op=async_op)
            np.testing.assert_array_equal(tensor, data(dtype, shape_of(rank), 5, dst, rank))
            if rank == dst:
                assert_same_list(gather_list, [data(dtype, shape_of(m), 5, dst, m) for m in members])
                assert_identity(result, gather_list)
            else:
                assert_same_list(gather_list, before)
                assert result in (None, [])


def test_gather_input_inside_gather_list(dist, world):
    rank, size = world
    want = np.stack([data(np.float32, (4,), 6, r) for r in range(size)])
    for dst in range(size):
        block = np.zeros((size, 4), np.float32)
        block[rank] = want[rank]
        dist.gather(block[rank], list(block) if rank == dst else None, dst=dst)
        if rank == dst:
            np.testing.assert_array_equal(block, want)


@pytest.mark.parametrize("layout,async_op", MODES)
def test_scatter_from_every_src(dist, any_group, layout, async_op):
    g, members = any_group
    rank = dist.get_rank()
    is_member = rank in members
    for dtype in DTYPES[:3]:
        for src in members:
            tensor = np.zeros(shape_of(rank), dtype)
            parts = [data(dtype, shape_of(m), 7, src, m) for m in members]
            scatter_list = arrays([p.shape for p in parts], dtype, layout, fill=parts)
            passed = scatter_list if rank == src or not is_member else None
            result = call(dist.scatter, tensor, passed, src=src, group=g, member=is_member, async_op=async_op)
            assert_same_list(scatter_list, parts)  # the source's list is never written
            if is_member:
                np.testing.assert_array_equal(tensor, data(dtype, shape_of(rank), 7, src, rank))
                assert_identity(result, [tensor])
            else:
                np.testing.assert_array_equal(tensor, np.zeros(shape_of(rank), dtype))


def test_scatter_output_inside_scatter_list(dist, world):
    rank, size = world
    for src in range(size):
        block = np.stack([data(np.int16, (2, 2), 8, src, r) for r in range(size)])
        tensor = block[rank] if rank == src else np.zeros((2, 2), np.int16)
        dist.scatter(tensor, list(block) if rank == src else None, src=src)
        np.testing.assert_array_equal(tensor, data(np.int16, (2, 2), 8, src, rank))
        # src's tensor overlapping another part: the parts go out from a copy
        if rank == src and size > 1:
            other = (rank + 1) % size
            block = np.stack([data(np.int16, (2, 2), 8, src, r) for r in range(size)])
            dist.scatter(block[other], list(block), src=src)
            np.testing.assert_array_equal(block[other], data(np.int16, (2, 2), 8, src, rank))
        elif size > 1:
            tensor = np.zeros((2, 2), np.int16)
            dist.scatter(tensor, None, src=src)
            np.testing.assert_array_equal(tensor, data(np.int16, (2, 2), 8, src, rank))


# -- all-to-all -----------------------------------------------------------------------------


@pytest.mark.parametrize("layout,async_op", MODES)
def test_all_to_all_uneven(dist, any_group, layout, async_op):
    g, members = any_group
    rank = dist.get_rank()
    is_member = rank in members
    for dtype in DTYPES:
        sends = [data(dtype, (pair_rows(rank, m), 2), 9, rank, m) for m in members]
        inputs = arrays([s.shape for s in sends], dtype, layout, fill=sends)
        outs = arrays([(pair_rows(m, rank), 2) for m in members], dtype, layout)
        before = [o.copy() for o in outs]
        result = call(dist.all_to_all, outs, inputs, group=g, member=is_member, async_op=async_op)
        assert_same_list(inputs, sends)
        if is_member:
            assert_same_list(outs, [data(dtype, (pair_rows(m, rank), 2), 9, m, rank) for m in members])
            assert_identity(result, outs)
        else:
            assert_same_list(outs, before)


@pytest.mark.parametrize("row", [3, 50_000])  # large rows: MPI's rendezvous path, where aliasing shows
def test_all_to_all_inputs_aliasing_outputs(dist, world, row):
    rank, size = world
    want = np.stack([data(np.float64, (row,), 10, r, rank) for r in range(size)])
    for shift in (0, 1, -1):  # the same rows, or the outputs one row before / after the inputs
        buf = np.zeros((size + 1, row))
        ins = buf[max(shift, 0) : max(shift, 0) + size]
        outs = buf[max(-shift, 0) : max(-shift, 0) + size]
        ins[...] = np.stack([data(np.float64, (row,), 10, rank, r) for r in range(size)])
        dist.all_to_all(list(outs), list(ins))
        np.testing.assert_array_equal(outs, want)
    x = np.concatenate([data(np.float64, (row,), 10, rank, r) for r in range(size)])
    dist.all_to_all_single(x, x)
    np.testing.assert_array_equal(x, want.reshape(-1))


def _single_input(dtype, rank: int, members, key: int) -> np.ndarray:
    rows = sum(pair_rows(rank, m) for m in members)
    return data(dtype, (rows, 3), key, rank)


def _single_expected(dtype, rank: int, members, key: int) -> np.ndarray:
    """Rows each member sends ``rank`` (its uneven split), in group-rank order."""
    parts = []
    for m in members:
        offset = sum(pair_rows(m, r) for r in members[: members.index(rank)])
        parts.append(_single_input(dtype, m, members, key)[offset : offset + pair_rows(m, rank)])
    return np.concatenate(parts)


@pytest.mark.parametrize("async_op", [False, True])
def test_all_to_all_single(dist, any_group, async_op):
    g, members = any_group
    rank = dist.get_rank()
    is_member = rank in members
    n = len(members)
    for dtype in DTYPES:
        # equal splits (no split sizes): 2 rows of 3 elements per rank
        inp = data(dtype, (2 * n, 3), 11, rank)
        out = np.zeros((2 * n, 3), dtype)
        result = call(dist.all_to_all_single, out, inp, group=g, member=is_member, async_op=async_op)
        if is_member:
            me = members.index(rank)
            want = np.concatenate([data(dtype, (2 * n, 3), 11, m)[2 * me : 2 * me + 2] for m in members])
            np.testing.assert_array_equal(out, want)
            assert_identity(result, [out])
        else:
            np.testing.assert_array_equal(out, 0)
        # uneven splits, both given
        inp = _single_input(dtype, rank, members, 12)
        out = np.zeros((sum(pair_rows(m, rank) for m in members), 3), dtype)
        result = call(
            dist.all_to_all_single,
            out,
            inp,
            [pair_rows(m, rank) for m in members],
            [pair_rows(rank, m) for m in members],
            group=g,
            member=is_member,
            async_op=async_op,
        )
        if is_member:
            np.testing.assert_array_equal(out, _single_expected(dtype, rank, members, 12))
        else:
            np.testing.assert_array_equal(out, 0)


def test_all_to_all_single_split_forms(dist, world):
    """Only one side's splits given, empty split lists (= even, as torch), rows of other shapes."""
    rank, size = world
    members = list(range(size))
    inp = data(np.int32, (2 * size, 4), 13, rank)
    want = np.concatenate([data(np.int32, (2 * size, 4), 13, r)[2 * rank : 2 * rank + 2] for r in range(size)])
    for out_splits, in_splits in [(None, [2] * size), ([2] * size, None), ([], []), ([], [2] * size)]:
        out = np.zeros((2 * size, 4), np.int32)
        dist.all_to_all_single(out, inp, output_split_sizes=out_splits, input_split_sizes=in_splits)
        np.testing.assert_array_equal(out, want)
    # output rows of another shape: counts are split * row size on each side
    out = np.zeros((2 * size, 2, 2), np.int32)
    dist.all_to_all_single(out, inp)
    np.testing.assert_array_equal(out.reshape(2 * size, 4), want)
    # input and output the same array: the input travels from a copy
    x = _single_input(np.float64, rank, members, 14)
    if all(pair_rows(rank, m) == pair_rows(m, rank) for m in members):
        splits = [pair_rows(rank, m) for m in members]
        dist.all_to_all_single(x, x, splits, splits)
        np.testing.assert_array_equal(x, _single_expected(np.float64, rank, members, 14))
    y = data(np.float64, (2 * size, 3), 15, rank)
    dist.all_to_all_single(y, y)
    np.testing.assert_array_equal(
        y, np.concatenate([data(np.float64, (2 * size, 3), 15, r)[2 * rank : 2 * rank + 2] for r in range(size)])
    )


# -- several "devices" per process ----------------------------------------------------------


@pytest.mark.parametrize("async_op", [False, True])
def test_broadcast_multigpu_every_src_and_src_tensor(dist, any_group, async_op):
    g, members = any_group
    rank = dist.get_rank()
    is_member = rank in members
    shapes = [(4,), (2, 2), (4, 1)]  # same element count, as torch requires
    for dtype in DTYPES[:3]:
        for src in members:
            for src_tensor in range(len(shapes)):
                tensors = [data(dtype, s, 16, rank, j) for j, s in enumerate(shapes)]
                before = [t.copy() for t in tensors]
                result = call(
                    dist.broadcast_multigpu,
                    tensors,
                    src,
                    group=g,
                    src_tensor=src_tensor,
                    member=is_member,
                    async_op=async_op,
                )
                if is_member:
                    sent = data(dtype, shapes[src_tensor], 16, src, src_tensor).reshape(-1)
                    assert_same_list(tensors, [sent.reshape(s) for s in shapes])
                    assert_identity(result, tensors)
                else:
                    assert_same_list(tensors, before)


def _multigpu_shape(rank: int, device: int) -> tuple:
    return (rank % 3 + 1, device + 1)


@pytest.mark.parametrize("layout,async_op", MODES)
def test_all_gather_multigpu(dist, any_group, layout, async_op):
    g, members = any_group
    rank = dist.get_rank()
    is_member = rank in members
    for dtype in (np.float64, np.int8):
        for n_dev in (1, 3):
            inputs = [data(dtype, _multigpu_shape(rank, j), 17, rank, j) for j in range(n_dev)]
            slots = [_multigpu_shape(k, j) for k in members for j in range(n_dev)]
            outputs = [arrays(slots, dtype, layout) for _ in range(n_dev)]
            before = [[o.copy() for o in lst] for lst in outputs]
            result = call(dist.all_gather_multigpu, outputs, inputs, group=g, member=is_member, async_op=async_op)
            if is_member:
                # input_tensor_list[j] of group rank k lands in output_tensor_lists[i][k * n_dev + j]
                want = [data(dtype, _multigpu_shape(k, j), 17, k, j) for k in members for j in range(n_dev)]
                for lst in outputs:
                    assert_same_list(lst, want)
                assert_identity(result, [o for lst in outputs for o in lst])
            else:
                for lst, b in zip(outputs, before):
                    assert_same_list(lst, b)


def test_all_gather_multigpu_inputs_inside_outputs(dist, world):
    """Inputs that are this rank's own slots of output_tensor_lists[0] (MPI_IN_PLACE)."""
    rank, size = world
    n_dev = 2
    block = np.zeros((size * n_dev, 3))
    first = list(block)
    for j in range(n_dev):
        first[rank * n_dev + j][...] = data(np.float64, (3,), 18, rank, j)
    second = [np.zeros(3) for _ in range(size * n_dev)]
    dist.all_gather_multigpu([first, second], first[rank * n_dev : (rank + 1) * n_dev])
    want = [data(np.float64, (3,), 18, k, j) for k in range(size) for j in range(n_dev)]
    assert_same_list(first, want)
    assert_same_list(second, want)


# -- bad input: every rank raises before any communication ----------------------------------


def raises(kind, message: str):
    return pytest.raises(kind, match=PREFIX + re.escape(message))


def test_all_gather_bad_input(dist, world):
    rank, size = world
    x = np.ones(2)
    good = [np.zeros(2) for _ in range(size)]
    with raises(TypeError, "all_gather: tensor_list must be a list of numpy arrays, got ndarray"):
        dist.all_gather(np.zeros((size, 2)), x)
    with raises(ValueError, f"all_gather: tensor_list must hold the group size = {size} arrays, got {size + 1}"):
        dist.all_gather(good + [np.zeros(2)], x)
    with raises(TypeError, "all_gather: tensor_list[0] dtype float32 does not match tensor dtype float64"):
        dist.all_gather([np.zeros(2, np.float32)] + good[1:], x)
    bad = list(good)
    bad[rank] = np.zeros(3)
    with raises(
        ValueError,
        f"all_gather: tensor_list[{rank}] must have the shape of tensor, (2,) (it receives "
        f"this rank's own tensor), got (3,)",
    ):
        dist.all_gather(bad, x)
    bad = list(good)
    bad[0] = np.zeros(4)[::2]
    with raises(ValueError, "all_gather: tensor_list[0] must be C-contiguous"):
        dist.all_gather(bad, x)
    bad = list(good)
    bad[-1] = np.zeros(2)
    bad[-1].flags.writeable = False
    with raises(ValueError, f"all_gather: tensor_list[{size - 1}] must be writable, got a read-only array"):
        dist.all_gather(bad, x)
    with raises(TypeError, "all_gather: tensor must be a numpy.ndarray, got list"):
        dist.all_gather(good, [1.0, 2.0])


def test_all_gather_into_tensor_bad_input(dist, world):
    _, size = world
    out = np.zeros(2 * size)
    out.flags.writeable = False
    with raises(ValueError, "all_gather_into_tensor: output_tensor must be writable, got a read-only array"):
        dist.all_gather_into_tensor(out, np.ones(2))
    with raises(ValueError, "all_gather_into_tensor: output_tensor must be C-contiguous"):
        dist.all_gather_into_tensor(np.zeros(4 * size)[::2], np.ones(2))


def test_gather_bad_input(dist, world):
    rank, size = world
    x = np.ones(2)
    good = [np.zeros(2) for _ in range(size)]
    if size > 1:
        with raises(
            ValueError,
            f"gather: gather_list must not be given on a rank other than dst={(rank + 1) % size} "
            f"(torch: 'must NOT be specified on non-destination ranks'); pass None",
        ):
            dist.gather(x, good, dst=(rank + 1) % size)
    for missing in (None, []):
        with raises(
            ValueError,
            f"gather: gather_list must be given on the destination rank dst={rank}: "
            f"a list of {size} arrays, got {missing!r}",
        ):
            dist.gather(x, missing, dst=rank)
    with raises(ValueError, f"gather: dst={size}: global rank {size} is not part of group"):
        dist.gather(x, good, dst=size)
    with raises(TypeError, "gather: dst must be an int (a global rank), got str"):
        dist.gather(x, good, dst="0")
    with raises(ValueError, f"gather: gather_list must hold the group size = {size} arrays, got {size + 1}"):
        dist.gather(x, good + good[:1], dst=rank)
    with raises(TypeError, "gather: gather_list[0] dtype int64 does not match tensor dtype float64"):
        dist.gather(x, [np.zeros(2, np.int64)] + good[1:], dst=rank)
    bad = list(good)
    bad[rank] = np.zeros((1, 2))
    with raises(
        ValueError,
        f"gather: gather_list[{rank}] must have the shape of tensor, (2,) (it receives dst's own tensor), got (1, 2)",
    ):
        dist.gather(x, bad, dst=rank)
    bad[rank] = np.zeros(2)
    bad[rank].flags.writeable = False
    with raises(ValueError, f"gather: gather_list[{rank}] must be writable"):
        dist.gather(x, bad, dst=rank)


def test_scatter_bad_input(dist, world):
    rank, size = world
    parts = [np.ones(2) for _ in range(size)]
    if size > 1:
        with raises(
            ValueError,
            f"scatter: scatter_list must not be given on a rank other than src={(rank + 1) % size} "
            f"(torch: 'must NOT be specified on non-source ranks'); pass None",
        ):
            dist.scatter(np.zeros(2), parts, src=(rank + 1) % size)
    with raises(
        ValueError,
        f"scatter: scatter_list must be given on the source rank src={rank}: a list of {size} arrays, got None",
    ):
        dist.scatter(np.zeros(2), None, src=rank)
    with raises(ValueError, "scatter: src=-1: global rank -1 is not part of group"):
        dist.scatter(np.zeros(2), parts, src=-1)
    with raises(ValueError, f"scatter: scatter_list must hold the group size = {size} arrays, got {size + 1}"):
        dist.scatter(np.zeros(2), parts + parts[:1], src=rank)
    with raises(TypeError, "scatter: scatter_list[0] dtype float64 does not match tensor dtype float32"):
        dist.scatter(np.zeros(2, np.float32), parts, src=rank)
    with raises(
        ValueError,
        f"scatter: scatter_list[{rank}] must have the shape of tensor, (3,) (it is src's own part), got (2,)",
    ):
        dist.scatter(np.zeros(3), parts, src=rank)
    ro = np.zeros(2)
    ro.flags.writeable = False
    with raises(ValueError, "scatter: tensor must be writable, got a read-only array"):
        dist.scatter(ro, parts, src=rank)
    with raises(ValueError, "scatter: tensor must be C-contiguous"):
        dist.scatter(np.zeros(4)[::2], parts, src=rank)


def test_src_dst_outside_group_rejected(dist, world):
    rank, size = world
    if size == 1:
        pytest.skip("needs a rank outside the group")
    g = dist.new_group(list(range(size - 1)))
    if rank < size - 1:
        outside = size - 1
        with raises(ValueError, f"gather: dst={outside}: global rank {outside} is not part of group"):
            dist.gather(np.ones(2), None, dst=outside, group=g)
        with raises(ValueError, f"scatter: src={outside}: global rank {outside} is not part of group"):
            dist.scatter(np.ones(2), None, src=outside, group=g)
        with raises(ValueError, f"broadcast_multigpu: src={outside}: global rank {outside} is not part of group"):
            dist.broadcast_multigpu([np.ones(2)], outside, group=g)
        dist.destroy_process_group(g)


def test_all_to_all_bad_input(dist, world):
    rank, size = world
    ins = [np.ones(2) for _ in range(size)]
    outs = [np.zeros(2) for _ in range(size)]
    with raises(ValueError, f"all_to_all: input_tensor_list must hold the group size = {size} arrays, got 0"):
        dist.all_to_all(outs, [])
    with raises(ValueError, f"all_to_all: output_tensor_list must hold the group size = {size} arrays, got {size + 1}"):
        dist.all_to_all(outs + outs[:1], ins)
    if size > 1:
        with raises(
            TypeError,
            f"all_to_all: input_tensor_list[{size - 1}] dtype int32 does not match input_tensor_list[0] dtype float64",
        ):
            dist.all_to_all(outs, ins[:-1] + [np.ones(2, np.int32)])
    with raises(
        TypeError, "all_to_all: output_tensor_list[0] dtype float32 does not match input_tensor_list[0] dtype float64"
    ):
        dist.all_to_all([np.zeros(2, np.float32)] + outs[1:], ins)
    ro = [np.zeros(2) for _ in range(size)]
    ro[0].flags.writeable = False
    with raises(ValueError, "all_to_all: output_tensor_list[0] must be writable"):
        dist.all_to_all(ro, ins)
    bad = list(outs)
    bad[rank] = np.zeros(3)
    with raises(
        ValueError,
        f"all_to_all: this rank sends itself 2 elements but expects 3 from itself; the part "
        f"for rank {rank} of the input and of the output must have the same size",
    ):
        dist.all_to_all(bad, ins)


def test_all_to_all_single_bad_input(dist, world):
    rank, size = world
    x = np.ones((2 * size, 3))
    out = np.zeros((2 * size, 3))
    with raises(
        ValueError,
        "all_to_all_single: input must have at least one dimension (it is split along dim 0), got a 0-d array",
    ):
        dist.all_to_all_single(out, np.array(1.0))
    if size > 1:  # every dim 0 divides by 1
        with raises(
            ValueError,
            f"all_to_all_single: output.shape[0] = {2 * size + 1} is not divisible by the "
            f"group size {size}; pass output_split_sizes to split it unevenly",
        ):
            dist.all_to_all_single(np.zeros((2 * size + 1, 3)), x)
    with raises(
        ValueError,
        f"all_to_all_single: input_split_sizes must hold one size per group member = {size} sizes, got {size + 1}",
    ):
        dist.all_to_all_single(out, x, input_split_sizes=[2] * (size + 1))
    with raises(ValueError, "all_to_all_single: output_split_sizes[0] must be non-negative, got -1"):
        dist.all_to_all_single(out, x, output_split_sizes=[-1] + [2] * (size - 1))
    with raises(TypeError, "all_to_all_single: output_split_sizes[0] must be an int, got float"):
        dist.all_to_all_single(out, x, output_split_sizes=[2.0] * size)
    with raises(
        ValueError, f"all_to_all_single: input_split_sizes sums to {2 * size + 1}, expected input.shape[0] = {2 * size}"
    ):
        dist.all_to_all_single(out, x, input_split_sizes=[3] + [2] * (size - 1))
    with raises(TypeError, "all_to_all_single: input_split_sizes must be a list of ints or None, got int"):
        dist.all_to_all_single(out, x, input_split_sizes=2)
    with raises(TypeError, "all_to_all_single: input dtype int64 does not match output dtype float64"):
        dist.all_to_all_single(out, x.astype(np.int64))
    ro = np.zeros((2 * size, 3))
    ro.flags.writeable = False
    with raises(ValueError, "all_to_all_single: output must be writable, got a read-only array"):
        dist.all_to_all_single(ro, x)
    with raises(ValueError, "all_to_all_single: this rank sends itself 3 elements but expects 6 from itself"):
        dist.all_to_all_single(out, np.ones((size, 3)))


def test_broadcast_multigpu_bad_input(dist, world):
    rank, size = world
    with raises(ValueError, "broadcast_multigpu: tensor_list must hold at least one array, got an empty list"):
        dist.broadcast_multigpu([], 0)
    with raises(TypeError, "broadcast_multigpu: tensor_list must be a list of numpy arrays, got ndarray"):
        dist.broadcast_multigpu(np.zeros(3), 0)
    with raises(ValueError, "broadcast_multigpu: src_tensor must index tensor_list, in [0, 2), got 2"):
        dist.broadcast_multigpu([np.zeros(3), np.zeros(3)], 0, src_tensor=2)
    with raises(TypeError, "broadcast_multigpu: src_tensor must be an int, got float"):
        dist.broadcast_multigpu([np.zeros(3)], 0, src_tensor=0.0)
    with raises(
        ValueError,
        "broadcast_multigpu: tensor_list[1] must have as many elements as tensor_list[0], 3, got 4 (shape (2, 2))",
    ):
        dist.broadcast_multigpu([np.zeros(3), np.zeros((2, 2))], 0)
    with raises(
        TypeError, "broadcast_multigpu: tensor_list[1] dtype int64 does not match tensor_list[0] dtype float64"
    ):
        dist.broadcast_multigpu([np.zeros(3), np.zeros(3, np.int64)], 0)
    with raises(ValueError, f"broadcast_multigpu: src={size}: global rank {size} is not part of group"):
        dist.broadcast_multigpu([np.zeros(3)], size)


def test_all_gather_multigpu_bad_input(dist, world):
    rank, size = world
    inputs = [np.ones(2), np.ones(2)]
    good = [[np.zeros(2) for _ in range(2 * size)] for _ in range(2)]
    with raises(ValueError, "all_gather_multigpu: input_tensor_list must hold at least one array, got an empty list"):
        dist.all_gather_multigpu(good, [])
    with raises(
        TypeError, "all_gather_multigpu: output_tensor_lists must be a list of lists of numpy arrays, got ndarray"
    ):
        dist.all_gather_multigpu(np.zeros((2, 2 * size, 2)), inputs)
    with raises(
        ValueError, "all_gather_multigpu: output_tensor_lists must hold len(input_tensor_list) = 2 lists, got 1"
    ):
        dist.all_gather_multigpu(good[:1], inputs)
    with raises(
        ValueError,
        f"all_gather_multigpu: output_tensor_lists[1] must hold group size * "
        f"len(input_tensor_list) = {2 * size} arrays, got {size}",
    ):
        dist.all_gather_multigpu([good[0], good[1][:size]], inputs)
    with raises(
        TypeError,
        "all_gather_multigpu: output_tensor_lists[0][0] dtype float32 does not match "
        "input_tensor_list[0] dtype float64",
    ):
        dist.all_gather_multigpu([[np.zeros(2, np.float32)] + good[0][1:], good[1]], inputs)
    first = list(good[0])
    first[2 * rank + 1] = np.zeros(3)
    with raises(
        ValueError,
        f"all_gather_multigpu: output_tensor_lists[0][{2 * rank + 1}] must have the shape of "
        f"input_tensor_list[1], (2,) (it receives that input), got (3,)",
    ):
        dist.all_gather_multigpu([first, good[1]], inputs)
    second = list(good[1])
    second[0] = np.zeros((1, 2))
    with raises(
        ValueError,
        "all_gather_multigpu: output_tensor_lists[1][0] must have the shape of "
        "output_tensor_lists[0][0], (2,), got (1, 2)",
    ):
        dist.all_gather_multigpu([good[0], second], inputs)
    second[0] = np.zeros(2)
    second[0].flags.writeable = False
    with raises(ValueError, "all_gather_multigpu: output_tensor_lists[1][0] must be writable"):
        dist.all_gather_multigpu([good[0], second], inputs)


def test_public_names():
    import mpidist
    from mpidist import gather_scatter

    for name in gather_scatter.__all__:
        public = getattr(mpidist, name)
        if name in mpidist._deprecated.__all__:  # torch 2.13 deprecates it: a warning over this module's
            public = public.__wrapped__
        assert public is getattr(gather_scatter, name)
        assert getattr(mpidist, name).__doc__
