"""MPIDIST_DEBUG=DETAIL: every call is compared (not only calls new to the group, as by
default: tests/test_mismatch.py), so mismatched collectives (count, dtype, reduce op, root,
op) raise the same clear ValueError on every member instead of hanging or computing a wrong
answer; the group stays usable; matching calls give the usual results."""

from __future__ import annotations

import re

import numpy as np
import pytest

from mpidist import DebugLevel
from mpidist._check import mismatch
from mpidist._core import recorder
from mpidist.work import Engine


@pytest.fixture
def detail(dist):
    """DETAIL on every rank for the test (set at the same point everywhere), OFF after."""
    dist.set_debug_level(DebugLevel.DETAIL)
    yield dist
    dist.set_debug_level(DebugLevel.OFF)


def world_seq(dist) -> int:
    return dist._runtime.world.state().world.engine.seq


def calls(parts: list[tuple[list, str]]) -> str:
    return "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {c}" for r, c in parts)


def message(
    rank: int, size: int, op: str, differ: str, parts: list[tuple[list, str]], group: str = "default_pg"
) -> str:
    return (
        f"[rank {rank}/{size}] {op}: the members of group {group!r} called mismatched "
        f"collectives (they differ in {differ}): {calls(parts)}"
    )


def split(size: int) -> tuple[list, list]:
    """The ranks that pass the usual arguments, and the one (the last) that does not."""
    return list(range(size - 1)), [size - 1]


def still_usable(dist, size: int) -> None:
    x = np.ones(3)
    dist.all_reduce(x)
    np.testing.assert_array_equal(x, np.full(3, float(size)))


def test_off_by_default_and_levels(dist):
    assert dist.get_debug_level() is DebugLevel.OFF and not mismatch.DETAIL and Engine.inline
    dist.set_debug_level(DebugLevel.INFO)
    assert dist.get_debug_level() is DebugLevel.INFO and not mismatch.DETAIL and Engine.inline
    dist.set_debug_level(DebugLevel.DETAIL)
    assert mismatch.DETAIL and not Engine.inline
    dist.set_debug_level(DebugLevel.OFF)
    assert dist.get_debug_level() is DebugLevel.OFF and not mismatch.DETAIL and Engine.inline


@pytest.mark.mpi
def test_detail_turns_the_inline_latency_path_off(detail):
    assert not Engine.inline and not detail._runtime.world.state().world.engine.idle()


@pytest.mark.mpi(min_size=2)
def test_count_mismatch(detail, world):
    rank, size = world
    seq = world_seq(detail)
    good, odd = split(size)
    with pytest.raises(ValueError) as info:
        detail.all_reduce(np.ones(4 if rank in good else 5))
    assert str(info.value) == message(
        rank,
        size,
        "all_reduce",
        "count",
        [
            (good, f"all_reduce(seq={seq}, count=4, dtype=float64, op=SUM)"),
            (odd, f"all_reduce(seq={seq}, count=5, dtype=float64, op=SUM)"),
        ],
    )
    assert recorder.snapshot()[-1]["state"] == "failed"
    still_usable(detail, size)


@pytest.mark.mpi(min_size=2)
def test_dtype_and_reduce_op_mismatch(detail, world):
    rank, size = world
    good, odd = split(size)
    seq = world_seq(detail)
    with pytest.raises(ValueError) as info:
        detail.all_reduce(np.ones(2, np.float32 if rank in odd else np.float64))
    assert str(info.value) == message(
        rank,
        size,
        "all_reduce",
        "dtype",
        [
            (good, f"all_reduce(seq={seq}, count=2, dtype=float64, op=SUM)"),
            (odd, f"all_reduce(seq={seq}, count=2, dtype=float32, op=SUM)"),
        ],
    )
    with pytest.raises(ValueError) as info:
        detail.reduce(np.ones(2), dst=0, op=detail.ReduceOp.MAX if rank in odd else detail.ReduceOp.SUM)
    assert str(info.value) == message(
        rank,
        size,
        "reduce",
        "reduce op",
        [
            (good, f"reduce(seq={seq + 1}, count=2, dtype=float64, root=0, op=SUM)"),
            (odd, f"reduce(seq={seq + 1}, count=2, dtype=float64, root=0, op=MAX)"),
        ],
    )
    still_usable(detail, size)


@pytest.mark.mpi(min_size=2)
def test_root_mismatch(detail, world):
    rank, size = world
    good, odd = split(size)
    seq = world_seq(detail)
    x = np.full(3, float(rank))
    with pytest.raises(ValueError) as info:
        detail.broadcast(x, src=size - 1 if rank in odd else 0)
    assert str(info.value) == message(
        rank,
        size,
        "broadcast",
        "root",
        [
            (good, f"broadcast(seq={seq}, count=3, dtype=float64, root=0)"),
            (odd, f"broadcast(seq={seq}, count=3, dtype=float64, root={size - 1})"),
        ],
    )
    np.testing.assert_array_equal(x, np.full(3, float(rank)))  # nobody ran the op
    with pytest.raises(ValueError, match=re.escape("(they differ in root)")):
        detail.scatter(
            np.zeros(1),
            [np.ones(1)] * size if rank == (size - 1 if rank in odd else 0) else None,
            src=size - 1 if rank in odd else 0,
        )
    still_usable(detail, size)


@pytest.mark.mpi(min_size=2)
def test_op_mismatch(detail, world):
    rank, size = world
    good, odd = split(size)
    seq = world_seq(detail)
    with pytest.raises(ValueError) as info:
        if rank in odd:
            detail.broadcast(np.ones(4), 0)
        else:
            detail.all_reduce(np.ones(4))
    assert str(info.value) == message(
        rank,
        size,
        "broadcast" if rank in odd else "all_reduce",
        "op, root, reduce op",
        [
            (good, f"all_reduce(seq={seq}, count=4, dtype=float64, op=SUM)"),
            (odd, f"broadcast(seq={seq}, count=4, dtype=float64, root=0)"),
        ],
    )
    with pytest.raises(ValueError) as info:
        if rank in odd:
            detail.all_gather_object([None] * size, rank)
        else:
            detail.barrier()
    assert str(info.value) == message(
        rank,
        size,
        "all_gather_object" if rank in odd else "barrier",
        "op",
        [(good, f"barrier(seq={seq + 1})"), (odd, f"all_gather_object(seq={seq + 1})")],
    )
    still_usable(detail, size)


@pytest.mark.mpi(min_size=2)
def test_async_mismatch_raises_from_wait(detail, world):
    rank, size = world
    good, odd = split(size)
    seq = world_seq(detail)
    work = detail.all_reduce(np.ones(3 if rank in good else 6), async_op=True)
    with pytest.raises(ValueError) as info:
        work.wait()
    assert str(info.value) == message(
        rank,
        size,
        "all_reduce",
        "count",
        [
            (good, f"all_reduce(seq={seq}, count=3, dtype=float64, op=SUM)"),
            (odd, f"all_reduce(seq={seq}, count=6, dtype=float64, op=SUM)"),
        ],
    )
    assert work.is_completed() and not work.is_success()
    still_usable(detail, size)


@pytest.mark.mpi(min_size=3)
def test_mismatch_in_a_subgroup_names_global_ranks(detail, world):
    rank, size = world
    members = [1, 2]
    g = detail.new_group(members)
    if rank in members:
        seq = g.engine.seq
        with pytest.raises(ValueError) as info:
            detail.all_reduce(np.ones(2 if rank == 1 else 7), group=g)
        assert str(info.value) == message(
            rank,
            size,
            "all_reduce",
            "count",
            [
                ([1], f"all_reduce(seq={seq}, count=2, dtype=float64, op=SUM)"),
                ([2], f"all_reduce(seq={seq}, count=7, dtype=float64, op=SUM)"),
            ],
            group=g.group_name,
        )
    detail.destroy_process_group(g)


@pytest.mark.mpi
def test_matching_calls_pass_with_the_usual_results(detail, any_group):
    g, members = any_group
    rank = detail.get_rank()
    if rank not in members:
        assert detail.all_reduce(np.ones(2), group=g) is None
        return
    n, root = len(members), members[-1]
    me = members.index(rank)
    x = np.full(3, float(rank))
    detail.all_reduce(x, group=g)
    np.testing.assert_array_equal(x, np.full(3, float(sum(members))))
    detail.broadcast(x, src=root, group=g)
    y = np.full(2, float(rank))
    detail.reduce(y, dst=root, op=detail.ReduceOp.MAX, group=g)
    if rank == root:
        np.testing.assert_array_equal(y, np.full(2, float(max(members))))
    out = np.zeros((n, 2))
    detail.all_gather_into_tensor(out, np.full(2, float(rank)), group=g)
    np.testing.assert_array_equal(out[:, 0], members)
    parts = [np.zeros(2) for _ in range(n)]
    detail.all_gather(parts, np.full(2, float(rank)), group=g)
    assert [p[0] for p in parts] == members
    got = np.zeros(1)
    detail.scatter(got, [np.full(1, float(i)) for i in range(n)] if rank == root else None, src=root, group=g)
    assert got[0] == me
    objs = [None] * n
    detail.all_gather_object(objs, {"rank": rank}, group=g)
    assert objs == [{"rank": r} for r in members]
    detail.barrier(group=g)
    assert detail.all_reduce(np.ones(2), group=g, async_op=True).wait()
