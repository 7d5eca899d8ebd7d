"""Bad input, one test per case, each with its exact error (item 7 of the reliability issue).

Every check runs before any communication, on every rank alike, so a bad call raises
on every rank and never hangs. Messages start with ``[rank r/n] op:`` and name the
argument, what was expected and what was got.
"""

from __future__ import annotations

import re

import numpy as np
import pytest


def exact(text: str) -> str:
    """A ``match=`` pattern for exactly ``text``."""
    return f"^{re.escape(text)}$"


@pytest.fixture
def where(world):
    rank, size = world
    return lambda op: f"[rank {rank}/{size}] {op}:"


def members(size: int) -> str:
    return str(list(range(size)))


# -- out-of-range or negative ranks -----------------------------------------------------------


@pytest.mark.mpi
@pytest.mark.parametrize("bad", [-1, "size"])
def test_root_out_of_range(dist, world, where, bad):
    _, size = world
    bad = size if bad == "size" else bad
    with pytest.raises(
        ValueError,
        match=exact(
            f"{where('broadcast')} src={bad}: global rank {bad} is not part "
            f"of group 'default_pg' (members: {members(size)})"
        ),
    ):
        dist.broadcast(np.ones(2), src=bad)
    with pytest.raises(
        ValueError,
        match=exact(
            f"{where('reduce')} dst={bad}: global rank {bad} is not part of "
            f"group 'default_pg' (members: {members(size)})"
        ),
    ):
        dist.reduce(np.ones(2), dst=bad)


@pytest.mark.mpi
def test_peer_out_of_range_or_self(dist, world, where):
    rank, size = world
    with pytest.raises(
        ValueError,
        match=exact(
            f"{where('send')} dst={size}: global rank {size} is not part of "
            f"group 'default_pg' (members: {members(size)})"
        ),
    ):
        dist.send(np.ones(2), size)
    with pytest.raises(
        ValueError,
        match=exact(
            f"{where('recv')} src=-3: global rank -3 is not part of group 'default_pg' (members: {members(size)})"
        ),
    ):
        dist.recv(np.ones(2), -3)
    with pytest.raises(
        ValueError,
        match=exact(f"{where('send')} dst={rank} is the calling rank itself; expected another member of the group"),
    ):
        dist.send(np.ones(2), rank)
    with pytest.raises(TypeError, match=exact(f"{where('broadcast')} src must be an int (a global rank), got str")):
        dist.broadcast(np.ones(2), src="0")


@pytest.mark.mpi
def test_new_group_rank_out_of_range(dist, world, where):
    _, size = world
    for bad in (-1, size):
        with pytest.raises(
            ValueError,
            match=exact(
                f"{where('new_group')} rank {bad} in ranks is out of range; expected 0 <= rank < world size {size}"
            ),
        ):
            dist.new_group([0, bad])


@pytest.mark.mpi
def test_group_rank_out_of_range(dist, world, where):
    _, size = world
    with pytest.raises(
        ValueError,
        match=exact(
            f"{where('get_global_rank')} group rank {size} is out of range for group 'default_pg' of size {size}"
        ),
    ):
        dist.get_global_rank(None, size)
    with pytest.raises(
        ValueError,
        match=exact(
            f"{where('get_group_rank')} global rank -1 is not part of group 'default_pg' (members: {members(size)})"
        ),
    ):
        dist.get_group_rank(None, -1)


# -- wrong list lengths --------------------------------------------------------------------------


@pytest.mark.mpi
def test_wrong_list_lengths(dist, world, where):
    rank, size = world
    n = size + 1
    with pytest.raises(
        ValueError, match=exact(f"{where('all_gather')} tensor_list must hold the group size = {size} arrays, got {n}")
    ):
        dist.all_gather([np.zeros(2) for _ in range(n)], np.ones(2))
    with pytest.raises(
        ValueError,
        match=exact(
            f"{where('reduce_scatter')} input_list must hold one array per group rank: expected {size}, got {n}"
        ),
    ):
        dist.reduce_scatter(np.zeros(2), [np.ones(2) for _ in range(n)])
    with pytest.raises(
        ValueError,
        match=exact(f"{where('all_gather_object')} object_list must have one item per group member ({size}), got {n}"),
    ):
        dist.all_gather_object([None] * n, rank)
    with pytest.raises(
        ValueError,
        match=exact(
            f"{where('all_to_all_single')} input_split_sizes must hold one "
            f"size per group member = {size} sizes, got {n}"
        ),
    ):
        dist.all_to_all_single(np.zeros(size), np.ones(n), None, [1] * n)


# -- dtype and shape mismatches --------------------------------------------------------------------


@pytest.mark.mpi
def test_dtype_mismatch(dist, world, where):
    _, size = world
    with pytest.raises(
        TypeError,
        match=exact(
            f"{where('all_gather_into_tensor')} input_tensor dtype float64 does not match output_tensor dtype float32"
        ),
    ):
        dist.all_gather_into_tensor(np.zeros(2 * size, np.float32), np.ones(2))
    with pytest.raises(
        TypeError,
        match=exact(f"{where('reduce_scatter')} input_list[0] dtype int32 does not match output dtype float64"),
    ):
        dist.reduce_scatter(np.zeros(2), [np.ones(2, np.int32) for _ in range(size)])


@pytest.mark.mpi
def test_shape_mismatch(dist, world, where):
    rank, size = world
    with pytest.raises(
        ValueError,
        match=exact(
            f"{where('reduce_scatter_tensor')} input must hold world_size * output.size = {size} * 2 = "
            f"{2 * size} elements, got {2 * size + 1} (shape ({2 * size + 1},))"
        ),
    ):
        dist.reduce_scatter_tensor(np.zeros(2), np.ones(2 * size + 1))
    outs = [np.zeros(3) for _ in range(size)]
    outs[rank] = np.zeros((3, 1))
    with pytest.raises(
        ValueError,
        match=exact(
            f"{where('all_gather')} tensor_list[{rank}] must have the shape of tensor, (3,) (it receives this "
            f"rank's own tensor), got (3, 1)"
        ),
    ):
        dist.all_gather(outs, np.ones(3))


# -- read-only output, non-contiguous arrays, not an array -----------------------------------------


@pytest.mark.mpi
def test_read_only_output(dist, where):
    x = np.ones(4)
    x.flags.writeable = False
    with pytest.raises(
        ValueError, match=exact(f"{where('all_reduce')} tensor must be writable, got a read-only array")
    ):
        dist.all_reduce(x)
    with pytest.raises(ValueError, match=exact(f"{where('broadcast')} tensor must be writable, got a read-only array")):
        dist.broadcast(x, 0)


@pytest.mark.mpi
def test_non_contiguous_arrays(dist, where):
    with pytest.raises(
        ValueError,
        match=exact(
            f"{where('all_reduce')} tensor must be C-contiguous, got a "
            f"non-contiguous array of shape (3,) and strides (16,)"
        ),
    ):
        dist.all_reduce(np.ones(6)[::2])
    with pytest.raises(
        ValueError,
        match=exact(
            f"{where('broadcast')} tensor must be C-contiguous, got a "
            f"non-contiguous array of shape (2, 3) and strides (8, 16)"
        ),
    ):
        dist.broadcast(np.ones((3, 2)).T, 0)


@pytest.mark.mpi
def test_not_an_array(dist, where):
    with pytest.raises(TypeError, match=exact(f"{where('all_reduce')} tensor must be a numpy.ndarray, got list")):
        dist.all_reduce([1.0, 2.0])
    with pytest.raises(
        TypeError,
        match=exact(
            f"{where('all_reduce')} tensor has dtype object, which cannot be "
            f"communicated; expected a numeric or bool dtype"
        ),
    ):
        dist.all_reduce(np.array([None, 1]))


# -- an op the dtype does not support ---------------------------------------------------------------


@pytest.mark.mpi
@pytest.mark.parametrize(
    "op, dtype, text",
    [
        ("AVG", np.int64, "ReduceOp.AVG needs a floating or complex dtype, got int64"),
        ("AVG", np.bool_, "ReduceOp.AVG needs a floating or complex dtype, got bool"),
        ("MAX", np.complex128, "ReduceOp.MAX is not defined for complex dtype complex128"),
        ("BAND", np.float32, "ReduceOp.BAND needs an integer or bool dtype, got float32"),
        ("PREMUL_SUM", np.float64, "ReduceOp.PREMUL_SUM needs a factor: pass mpidist.make_premul_sum(factor)"),
    ],
)
def test_op_not_supported_by_dtype(dist, where, op, dtype, text):
    with pytest.raises(ValueError, match=exact(f"{where('all_reduce')} {text}")):
        dist.all_reduce(np.ones(3, dtype), op=getattr(dist.ReduceOp, op))
    with pytest.raises(ValueError, match=exact(f"{where('reduce')} {text}")):
        dist.reduce(np.ones(3, dtype), dst=0, op=getattr(dist.ReduceOp, op))


# -- use after destroy -------------------------------------------------------------------------------


@pytest.mark.mpi
def test_use_after_destroy(dist, where):
    g = dist.new_group()
    name = g.group_name
    dist.destroy_process_group(g)
    with pytest.raises(
        ValueError,
        match=exact(
            f"{where('group')} group {name!r} was destroyed by destroy_process_group and cannot be used any more"
        ),
    ):
        dist.all_reduce(np.ones(2), group=g)
    with pytest.raises(
        ValueError,
        match=exact(
            f"{where('group')} group {name!r} was destroyed by destroy_process_group and cannot be used any more"
        ),
    ):
        dist.get_rank(g)
    dist.destroy_process_group()
    try:
        not_init = "Default process group has not been initialized, please make sure to call init_process_group."
        with pytest.raises(ValueError, match=exact(not_init)):
            dist.all_reduce(np.ones(2))
        with pytest.raises(ValueError, match=exact(not_init)):
            dist.barrier()
    finally:
        dist.init_process_group()


# -- new_group with duplicate ranks ------------------------------------------------------------------


@pytest.mark.mpi
def test_new_group_duplicate_ranks(dist, world, where):
    _, size = world
    with pytest.raises(
        ValueError, match=exact(f"{where('new_group')} ranks must not repeat, got duplicates [0] in [0, 0]")
    ):
        dist.new_group([0, 0])
    ranks = list(range(size)) + [size - 1]
    with pytest.raises(
        ValueError, match=exact(f"{where('new_group')} ranks must not repeat, got duplicates [{size - 1}] in {ranks}")
    ):
        dist.new_group(ranks)
