"""Mismatched collectives never give wrong data silently, by default (issue 14, item 1).

Every member compares a call's signature (op, count, dtype, root, reduction, sizes) the
first time its group uses it (mpidist._check.mismatch): disagreeing members all raise one clear
ValueError naming the op and each rank's call, and the group stays usable. A member whose
call was agreed on before runs it at once; if another member's call is new there, the
latter asks the former's watchdog, raises, and the former's op ends as a timeout does
(subprocess jobs below). The shared-memory all-reduce compares every call (a header in
its window). MPIDIST_DEBUG=DETAIL (alias TORCH_DISTRIBUTED_DEBUG) compares every call on
every path. torch's debug-level API: DebugLevel, get/set_debug_level, set_debug_level_from_env.

In-process tests run on a fresh group, whose members have agreed on nothing yet.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import launcher_free_env
from mpi4py import MPI

import mpidist
from mpidist import DebugLevel, ReduceOp
from mpidist._check import mismatch
from mpidist.algorithms import ShmAllReduce
from mpidist.algorithms.shm import ShmMismatch
from mpidist.work import _NO_RUN

pytestmark = pytest.mark.launches  # starts MPI jobs or processes of its own: make test-mpis runs it on every MPI

MPIEXEC = str(Path(sys.executable).with_name("mpiexec"))


# -- helpers --------------------------------------------------------------------------------
@pytest.fixture
def fresh(dist):
    """A new group of every rank (nothing agreed on yet); destroyed after the test."""
    g = dist.new_group()
    yield g
    dist.destroy_process_group(g)


def split(size: int) -> tuple[list, list]:
    """The ranks that pass the usual arguments, and the one (the last) that does not."""
    return list(range(size - 1)), [size - 1]


def message(rank: int, size: int, op: str, g, differ: str, parts: list, tail: str = "") -> str:
    calls = "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {c}" for r, c in parts)
    return (
        f"[rank {rank}/{size}] {op}: the members of group {g.group_name!r} called mismatched collectives "
        f"(they differ in {differ}): {calls}{tail}"
    )


def raises_everywhere(call) -> str:
    with pytest.raises(ValueError) as info:
        call()
    return str(info.value)


def usable(dist, g, size: int, n: int = 3, **kw) -> None:
    x = np.ones(n)
    dist.all_reduce(x, group=g, **kw)
    np.testing.assert_array_equal(x, np.full(n, float(size)))


# -- the cases, every rank raising ----------------------------------------------------
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algorithm", [None, "mpi", "ring", "shm"])
@pytest.mark.parametrize("dtype", ["float64", "float16"])
def test_length_65536_against_another_every_algorithm(dist, world, fresh, algorithm, dtype):
    """65,536 elements on most ranks, 1,000 on the last: with algorithm=None the two sizes
    would even pick different algorithms (shared memory against MPI or the ring)."""
    if algorithm == "mpi" and dtype == "float16":
        pytest.skip("MPI cannot reduce float16 (algorithm='mpi' refuses it)")
    rank, size = world
    good, odd = split(size)
    x = np.ones(65536 if rank in good else 1000, dtype)
    text = raises_everywhere(lambda: dist.all_reduce(x, group=fresh, algorithm=algorithm))
    assert text == message(
        rank,
        size,
        "all_reduce",
        fresh,
        "count",
        [
            (good, f"all_reduce(seq=0, count=65536, dtype={dtype}, op=SUM)"),
            (odd, f"all_reduce(seq=0, count=1000, dtype={dtype}, op=SUM)"),
        ],
    )
    np.testing.assert_array_equal(x, 1)  # nobody ran the op
    usable(dist, fresh, size, 65536, algorithm=algorithm)


@pytest.mark.mpi(min_size=2)
def test_4_elements_against_another(dist, world, fresh):
    """Before: MPICH printed a raw 'Message truncated' stack and the job exited 142."""
    rank, size = world
    good, odd = split(size)
    text = raises_everywhere(lambda: dist.all_reduce(np.ones(4 if rank in good else 6), group=fresh))
    assert text == message(
        rank,
        size,
        "all_reduce",
        fresh,
        "count",
        [
            (good, "all_reduce(seq=0, count=4, dtype=float64, op=SUM)"),
            (odd, "all_reduce(seq=0, count=6, dtype=float64, op=SUM)"),
        ],
    )
    usable(dist, fresh, size, 4)


# (op, call(dist, group, x, odd), x's fill, what differs, the usual ranks' call, the last rank's call)
CASES = {
    "sum-against-max": (
        "all_reduce",
        lambda d, g, x, odd: d.all_reduce(x, ReduceOp.MAX if odd else ReduceOp.SUM, g),
        np.float64,
        "reduce op",
        "all_reduce(seq=0, count=8, dtype=float64, op=SUM)",
        "all_reduce(seq=0, count=8, dtype=float64, op=MAX)",
    ),
    "broadcast-src": (
        "broadcast",
        lambda d, g, x, odd: d.broadcast(x, src=d.get_world_size() - 1 if odd else 0, group=g),
        np.float64,
        "root",
        "broadcast(seq=0, count=8, dtype=float64, root=0)",
        "broadcast(seq=0, count=8, dtype=float64, root={last})",
    ),
    "dtype": (
        "all_reduce",
        lambda d, g, x, odd: d.all_reduce(x, group=g),
        None,
        "dtype",
        "all_reduce(seq=0, count=8, dtype=float64, op=SUM)",
        "all_reduce(seq=0, count=8, dtype=float32, op=SUM)",
    ),
}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("case", list(CASES))
def test_reduce_op_root_and_dtype_mismatches(dist, world, fresh, case):
    """SUM against MAX, broadcast with different src, float32 against float64: nobody runs
    the op (the arrays keep their values)."""
    rank, size = world
    good, odd = split(size)
    op, call, dtype, differ, usual, other = CASES[case]
    x = np.full(8, float(rank), dtype or (np.float32 if rank in odd else np.float64))
    text = raises_everywhere(lambda: call(dist, fresh, x, rank in odd))
    assert text == message(rank, size, op, fresh, differ, [(good, usual), (odd, other.format(last=size - 1))])
    np.testing.assert_array_equal(x, float(rank))
    usable(dist, fresh, size)


@pytest.mark.mpi(min_size=2)
def test_async_mismatch_raises_from_wait(dist, world, fresh):
    rank, size = world
    good, odd = split(size)
    work = dist.all_reduce(np.ones(3 if rank in good else 9), group=fresh, async_op=True)
    with pytest.raises(ValueError, match=re.escape("(they differ in count)")):
        work.wait()
    usable(dist, fresh, size)


# -- every op ------------------------------------------------------------------------------
def _op_cases(dist, g, rank: int, size: int) -> dict:
    """op -> (call with the last rank mismatching, what differs)."""
    odd = rank == size - 1
    n = size
    f64 = np.float64
    return {
        "reduce": (lambda: dist.reduce(np.ones(2), dst=size - 1 if odd else 0, group=g), "root"),
        "all_gather": (
            lambda: dist.all_gather(
                [np.zeros(3 if odd and i == 0 else 2) if i != rank else np.zeros(2) for i in range(n)],
                np.ones(2),
                group=g,
            ),
            "count, sizes",
        ),
        "all_gather_into_tensor": (
            lambda: dist.all_gather_into_tensor(np.zeros(n * (3 if odd else 2)), np.ones(3 if odd else 2), group=g),
            "count",
        ),
        "gather": (
            lambda: dist.gather(
                np.ones(2),
                [np.zeros(2) for _ in range(n)] if rank == (size - 1 if odd else 0) else None,
                dst=size - 1 if odd else 0,
                group=g,
            ),
            "root",
        ),
        "scatter": (
            lambda: dist.scatter(
                np.zeros(2, np.float32 if odd else f64),
                [np.ones(2) for _ in range(n)] if rank == 0 else None,
                src=0,
                group=g,
            ),
            "dtype",
        ),
        "reduce_scatter": (
            lambda: dist.reduce_scatter(
                np.zeros(3 if odd else 2), [np.ones(3 if odd else 2) for _ in range(n)], group=g
            ),
            "count",
        ),
        "reduce_scatter_tensor": (
            lambda: dist.reduce_scatter_tensor(
                np.zeros(2), np.ones(2 * n), ReduceOp.MIN if odd else ReduceOp.SUM, group=g
            ),
            "reduce op",
        ),
        "all_to_all_single": (
            lambda: dist.all_to_all_single(
                np.zeros(n, np.int32 if odd else np.int64), np.ones(n, np.int32 if odd else np.int64), group=g
            ),
            "dtype",
        ),
        "all_reduce_multigpu": (
            lambda: dist.all_reduce_multigpu([np.ones(2) for _ in range(2 if odd else 1)], group=g),
            "sizes",
        ),
        "reduce_multigpu": (
            lambda: dist.reduce_multigpu([np.ones(2, np.float32 if odd else f64)], dst=0, group=g),
            "dtype",
        ),
        "broadcast_multigpu": (lambda: dist.broadcast_multigpu([np.ones(4 if odd else 2)], src=0, group=g), "count"),
        "all_gather_multigpu": (
            lambda: dist.all_gather_multigpu(
                [[np.zeros(2) for _ in range(n * (2 if odd else 1))] for _ in range(2 if odd else 1)],
                [np.ones(2)] * (2 if odd else 1),
                group=g,
            ),
            "count, sizes",
        ),
        "broadcast_object_list": (
            lambda: dist.broadcast_object_list([None] * (3 if odd else 2), src=0, group=g),
            "count",
        ),
        "gather_object": (
            lambda: dist.gather_object(
                rank, [None] * n if rank == (size - 1 if odd else 0) else None, dst=size - 1 if odd else 0, group=g
            ),
            "root",
        ),
        "scatter_object_list": (
            lambda: dist.scatter_object_list(
                [None],
                list(range(n)) if rank == (size - 1 if odd else 0) else None,
                src=size - 1 if odd else 0,
                group=g,
            ),
            "root",
        ),
    }


OPS = [
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "gather",
    "scatter",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "all_reduce_multigpu",
    "reduce_multigpu",
    "broadcast_multigpu",
    "all_gather_multigpu",
    "broadcast_object_list",
    "gather_object",
    "scatter_object_list",
]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("op", OPS)
def test_every_op_is_checked(dist, world, fresh, op):
    rank, size = world
    call, differ = _op_cases(dist, fresh, rank, size)[op]
    text = raises_everywhere(call)
    assert text.startswith(
        f"[rank {rank}/{size}] {op}: the members of group {fresh.group_name!r} called "
        f"mismatched collectives (they differ in {differ}): "
    ), text
    assert text.count(f"{op}(seq=0") == 2, text  # both sides
    usable(dist, fresh, size)


@pytest.mark.mpi(min_size=2)
def test_different_ops_at_one_sequence_number(dist, world, fresh):
    rank, size = world
    good, odd = split(size)
    text = raises_everywhere(
        lambda: dist.all_gather_object([None] * size, rank, group=fresh) if rank in odd else dist.barrier(group=fresh)
    )
    assert text == message(
        rank,
        size,
        "all_gather_object" if rank in odd else "barrier",
        fresh,
        "op",
        [(good, "barrier(seq=0)"), (odd, "all_gather_object(seq=0)")],
    )
    usable(dist, fresh, size)


@pytest.mark.mpi(min_size=2)
def test_sizes_that_may_differ_are_checked_against_the_root_and_the_peers(dist, world, fresh):
    """gather, scatter and all_to_all: counts differ between ranks legitimately, but each
    must be what the root (or the peer) expects; checked when the call is new."""
    rank, size = world
    last = size - 1
    # gather: dst 0 expects 2 elements from everybody, the last rank sends 3
    text = raises_everywhere(
        lambda: dist.gather(
            np.ones(3 if rank == last else 2),
            [np.zeros(2) for _ in range(size)] if rank == 0 else None,
            dst=0,
            group=fresh,
        )
    )
    assert text == (
        f"[rank {rank}/{size}] gather: the members of group {fresh.group_name!r} called "
        f"gather(seq=0, dtype=float64, root=0) with sizes that do not match: rank {last}'s tensor "
        f"holds 3 elements, dst rank 0's gather_list[{last}] holds 2"
    )
    # scatter: src 0 sends 2 elements to everybody, the last rank's output holds 4
    text = raises_everywhere(
        lambda: dist.scatter(
            np.zeros(4 if rank == last else 2),
            [np.ones(2) for _ in range(size)] if rank == 0 else None,
            src=0,
            group=fresh,
        )
    )
    assert text.endswith(
        f"with sizes that do not match: rank {last}'s tensor holds 4 elements, src rank 0's "
        f"scatter_list[{last}] holds 2"
    ), text
    # all_to_all_single: the last rank sends 2 rows to rank 0, which expects 1
    ins = [2] + [1] * (size - 1) if rank == last else [1] * size
    text = raises_everywhere(
        lambda: dist.all_to_all_single(np.zeros(size), np.ones(sum(ins)), input_split_sizes=ins, group=fresh)
    )
    assert text == (
        f"[rank {rank}/{size}] all_to_all_single: the members of group {fresh.group_name!r} called "
        f"all_to_all_single(seq=2, dtype=float64) with sizes that do not match: rank {last} sends 2 "
        f"elements to rank 0, which expects 1"
    )
    usable(dist, fresh, size)


@pytest.mark.mpi
def test_counts_that_may_differ_are_not_flagged(dist, world, fresh):
    """Uneven all_gather lists, gather/scatter lists and all_to_all splits that agree."""
    rank, size = world
    for _ in range(2):  # new, then agreed
        outs = [np.zeros(i + 1) for i in range(size)]
        dist.all_gather(outs, np.full(rank + 1, float(rank)), group=fresh)
        assert [o.tolist() for o in outs] == [[float(i)] * (i + 1) for i in range(size)]
        got = [np.zeros(i + 1) for i in range(size)] if rank == 0 else None
        dist.gather(np.full(rank + 1, float(rank)), got, dst=0, group=fresh)
        if rank == 0:
            assert [o.tolist() for o in got] == [[float(i)] * (i + 1) for i in range(size)]
        mine = np.zeros(rank + 2)
        dist.scatter(mine, [np.full(i + 2, float(i)) for i in range(size)] if rank == 0 else None, src=0, group=fresh)
        assert mine.tolist() == [float(rank)] * (rank + 2)
        # rank r sends r + 1 rows to everybody: receives s + 1 rows from rank s
        out = np.zeros(sum(s + 1 for s in range(size)))
        dist.all_to_all_single(
            out, np.full((rank + 1) * size, float(rank)), [s + 1 for s in range(size)], [rank + 1] * size, group=fresh
        )
        assert out.tolist() == [float(s) for s in range(size) for _ in range(s + 1)]


@pytest.mark.mpi
def test_agreed_calls_are_not_exchanged_again(dist, world, fresh):
    """The cost: after the first call of a signature, no exchange (the 8-byte path included)
    but the periodic comparison at the multiples of PERIOD."""
    rank, size = world
    state = None
    for n in (1, 2, 1000, 65536):
        x = np.ones(n)
        dist.all_reduce(x, group=fresh)
        state = fresh.resource("check", mismatch.GroupCheck) if size > 1 else None
        before = list(state.exchanged) if state is not None else []
        for _ in range(20):
            x = np.ones(n)
            dist.all_reduce(x, group=fresh)
            np.testing.assert_array_equal(x, float(size))
        if state is not None:
            new = [s for s in state.exchanged if s not in before]
            assert new and all(s % mismatch.PERIOD == 0 for s in new) or not new, (before, list(state.exchanged))
            assert state.decided == fresh.engine.seq - 1  # decided up to the last call


@pytest.mark.mpi(min_size=2)
def test_runs_record_what_recording_each_call_would(dist, world, fresh):
    """A repeated call records only how far the rank decided (the group's open run); the
    run's calls reach the running hash and the kept keys when it closes, as if each call had
    been recorded, on every path (the 8-byte all_reduce, launch's inline and queued paths,
    another op between runs), and a peer asking about a call in the open run is told its key."""
    rank, size = world
    small, big = np.zeros(2, np.float32), np.zeros(5000)
    calls = {
        "A": lambda: dist.all_reduce(small, group=fresh),  # the 8-byte path
        "B": lambda: dist.all_reduce(big, group=fresh, async_op=True).wait(),  # launch, queued
        "C": lambda: dist.broadcast(np.zeros(3), src=0, group=fresh),  # launch, inline
    }
    made = []
    for label in "AAAAABBBACCAABBB":
        made.append((fresh.engine.seq, label))
        calls[label]()
    chk = fresh.resource("check", mismatch.GroupCheck)
    keys = {
        "A": ("all_reduce", 2, np.dtype(np.float32), -1, "sum", None),
        "B": ("all_reduce", 5000, np.dtype(float), -1, "sum", None),
        "C": next(k for k in chk.agreed if k[0] == "broadcast"),
    }
    assert chk.run is not None and chk.run[1] == keys["B"] and chk.lkey == keys["B"]  # open: B's run
    assert chk.decided == made[-1][0]
    for seq, label in made:  # what a peer's question is answered with, the open run included
        assert mismatch._recent(chk, chk.decided, seq) == keys[label], (seq, label)
    mismatch._close(chk)
    assert chk.run is None and chk.lkey is None
    for seq, label in made:
        assert chk.keys[seq & mismatch.KEYS_MASK] == keys[label], (seq, label)
    assert made[-1][0] < mismatch.PERIOD  # (below it, the hash is the plain sum: no reduction)
    assert chk.h == sum(chk.agreed[keys[label]] * (seq % mismatch.PERIOD) for seq, label in made)
    calls["A"]()  # the group goes on: the next call opens a run again, the members agree
    assert chk.run is not None and chk.run[1] == keys["A"]
    dist.check_collectives(group=fresh)  # the final comparison: equal on every member
    calls["A"]()
    lat = fresh.engine.lat
    assert lat[2] is chk and chk.lkey is lat[3]  # the 8-byte path's note: its call's run is open
    calls["C"]()
    assert fresh.engine.lat is _NO_RUN and chk.run[1] == keys["C"]  # another call closed it
    calls["A"]()
    calls["A"]()
    assert fresh.engine.lat[2] is chk and chk.decided == fresh.engine.seq - 1
    mismatch._forget()  # (a level change, a broken group, a freed one): every note is dropped
    assert fresh.engine.lat is _NO_RUN and chk.lkey is None
    calls["A"]()
    assert fresh.engine.lat[2] is chk


@pytest.mark.mpi(min_size=2)
def test_calls_made_with_checks_off_never_join_a_run(dist, world, fresh):
    """The benchmarks' switch (mismatch._set_checks) between repeated calls: the calls made with
    checks off are in neither the running hash nor the kept keys (the 8-byte path still notes
    how far the rank got on the group's engine meanwhile)."""
    x = np.zeros(2, np.float32)
    key = ("all_reduce", 2, np.dtype(np.float32), -1, "sum", None)
    checked = []
    for _ in range(4):
        checked.append(fresh.engine.seq)
        dist.all_reduce(x, group=fresh)
    chk = fresh.resource("check", mismatch.GroupCheck)
    try:
        mismatch._set_checks(False)
        unchecked = []
        for _ in range(5):
            unchecked.append(fresh.engine.seq)
            dist.all_reduce(x, group=fresh)
    finally:
        mismatch._set_checks(True)
    for _ in range(3):
        checked.append(fresh.engine.seq)
        dist.all_reduce(x, group=fresh)
    mismatch._close(chk)
    kh = chk.agreed[key]
    assert chk.h == sum(kh * (s % mismatch.PERIOD) for s in checked)
    assert all(chk.keys[s & mismatch.KEYS_MASK] == key for s in checked)
    assert all(chk.keys[s & mismatch.KEYS_MASK] is None for s in unchecked)
    dist.check_collectives(group=fresh)


@pytest.mark.mpi(min_size=2)
def test_a_full_cache_is_cleared_on_every_member_alike(dist, world, fresh, monkeypatch):
    rank, size = world
    monkeypatch.setattr(mismatch, "_MAX_AGREED", 3)
    for _round in range(3):
        for n in range(1, 8):
            x = np.ones(n)
            dist.all_reduce(x, group=fresh)
            np.testing.assert_array_equal(x, float(size))
    chk = fresh.resource("check", mismatch.GroupCheck)
    assert len(chk.agreed) <= 3 and chk.lkey in chk.agreed  # the repeated-call shortcut: a key agreed on
    # A key agreed on before the clear, and the last one found, is compared again after it.
    for n in (1, 2, 1, 3):  # 1 and 2 agreed (1 found last), then 3 fills the cache and clears it
        dist.all_reduce(np.ones(n), group=fresh)
    monkeypatch.setattr(mismatch, "_MAX_AGREED", 1)
    dist.all_reduce(np.ones(4), group=fresh)  # cleared: only 4 agreed
    assert list(chk.agreed) == [("all_reduce", 4, np.dtype(float), -1, "sum", None)]
    seq = fresh.engine.seq
    dist.all_reduce(np.ones(4), group=fresh)
    dist.all_reduce(np.ones(1), group=fresh)
    assert seq not in chk.exchanged and seq + 1 in chk.exchanged
    good, odd = split(size)
    text = raises_everywhere(lambda: dist.all_reduce(np.ones(9 if rank in good else 10), group=fresh))
    assert "(they differ in count)" in text


# -- the shared-memory algorithm compares every call ----------------------------------------
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algorithm", ["shm", None])
def test_shm_catches_agreed_calls_made_out_of_step(dist, world, fresh, algorithm):
    """Two sizes (and two ops) agreed on before, then called out of step: no member exchanges,
    the shared-memory header check catches it on every rank, and the window stays usable."""
    rank, size = world
    good, odd = split(size)
    a, b = 8192, 12288  # 64 KiB, 96 KiB of float64: shared memory for every group size here
    for n in (a, b):
        for op in (ReduceOp.SUM, ReduceOp.MAX):
            x = np.ones(n)
            dist.all_reduce(x, op, group=fresh, algorithm=algorithm)
    seq = fresh.engine.seq
    x = np.ones(a if rank in good else b)
    text = raises_everywhere(lambda: dist.all_reduce(x, group=fresh, algorithm=algorithm))
    tail = " (found by the shared-memory algorithm's check, which compares every call)"
    assert text == message(
        rank,
        size,
        "all_reduce",
        fresh,
        "count",
        [
            (good, f"all_reduce(seq={seq}, count={a}, dtype=float64, op=SUM)"),
            (odd, f"all_reduce(seq={seq}, count={b}, dtype=float64, op=SUM)"),
        ],
        tail,
    )
    np.testing.assert_array_equal(x, 1)
    text = raises_everywhere(
        lambda: dist.all_reduce(np.ones(a), ReduceOp.MAX if rank in odd else ReduceOp.SUM, fresh, algorithm=algorithm)
    )
    assert "(they differ in reduce op)" in text and text.endswith(tail)
    usable(dist, fresh, size, a, algorithm=algorithm)
    usable(dist, fresh, size, b, algorithm=algorithm)


@pytest.mark.mpi(min_size=2)
def test_shm_all_reduce_compares_every_call(world):
    rank, size = world
    comm = MPI.COMM_WORLD
    calls = [(5, "float64", "sum")] * (size - 1) + [(7, "float64", "sum")]
    text = "; ".join(f"rank {r}: count={c}, dtype={d}, op={o.upper()}" for r, (c, d, o) in enumerate(calls))
    with ShmAllReduce(comm, 1024) as s:
        for _ in range(3):  # repeatedly, at either header parity
            x = np.ones(7 if rank == size - 1 else 5)
            with pytest.raises(ShmMismatch) as info:
                s(x, ReduceOp.SUM)
            assert (
                str(info.value) == f"[rank {rank}/{size}] shm_all_reduce: the ranks called mismatched "
                f"all-reduces: {text}"
            )
            assert info.value.calls == calls
            np.testing.assert_array_equal(x, 1)
            y = np.ones(3000)  # several chunks of a 1 KiB slot
            s(y, ReduceOp.SUM)
            np.testing.assert_array_equal(y, float(size))
        with pytest.raises(ShmMismatch, match="op=MAX"):
            s(np.ones(4), ReduceOp.MAX if rank == 0 else ReduceOp.SUM)
        with pytest.raises(ShmMismatch, match="dtype=float32"):
            s(np.ones(4, np.float32 if rank == 0 else np.float64), ReduceOp.SUM)
        with pytest.raises(ShmMismatch, match="count=0"):  # an empty array on one rank
            s(np.ones(0 if rank == 0 else 4), ReduceOp.SUM)
        y = np.ones(4)
        s(y, ReduceOp.SUM)
        np.testing.assert_array_equal(y, float(size))


# -- DETAIL compares every call -------------------------------------------------------------
@pytest.mark.mpi(min_size=2)
def test_detail_checks_every_call(dist, world, fresh):
    """Two agreed sizes out of step on the MPI path: only DETAIL sees it (by default it is
    not detected: docs/reliability.md)."""
    rank, size = world
    good, odd = split(size)
    for n in (4, 5):
        dist.all_reduce(np.ones(n), group=fresh)
    dist.set_debug_level(DebugLevel.DETAIL)
    try:
        seq = fresh.engine.seq
        text = raises_everywhere(lambda: dist.all_reduce(np.ones(4 if rank in good else 5), group=fresh))
        assert text == message(
            rank,
            size,
            "all_reduce",
            fresh,
            "count",
            [
                (good, f"all_reduce(seq={seq}, count=4, dtype=float64, op=SUM)"),
                (odd, f"all_reduce(seq={seq}, count=5, dtype=float64, op=SUM)"),
            ],
        )
        usable(dist, fresh, size, 4)
    finally:
        dist.set_debug_level(DebugLevel.OFF)


# -- the debug-level API (torch 2.x names) --------------------------------------------------
def test_debug_level_api(monkeypatch):
    assert {"DebugLevel", "get_debug_level", "set_debug_level", "set_debug_level_from_env"} <= set(mpidist.__all__)
    assert [(m.name, m.value, int(m)) for m in DebugLevel] == [("OFF", 0, 0), ("INFO", 1, 1), ("DETAIL", 2, 2)]
    for bad in ("DETAIL", 2, None):
        with pytest.raises(TypeError, match=r"^set_debug_level: level must be a DebugLevel"):
            mpidist.set_debug_level(bad)
    try:
        for var in ("MPIDIST_DEBUG", "TORCH_DISTRIBUTED_DEBUG"):
            monkeypatch.delenv(var, raising=False)
        mpidist.set_debug_level(DebugLevel.DETAIL)
        mpidist.set_debug_level_from_env()  # neither set: OFF, as torch
        assert mpidist.get_debug_level() is DebugLevel.OFF
        monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "detail")
        mpidist.set_debug_level_from_env()
        assert mpidist.get_debug_level() is DebugLevel.DETAIL and mismatch.DETAIL
        monkeypatch.setenv("MPIDIST_DEBUG", " Info ")  # MPIDIST_DEBUG takes precedence
        mpidist.set_debug_level_from_env()
        assert mpidist.get_debug_level() is DebugLevel.INFO and not mismatch.DETAIL
        monkeypatch.setenv("MPIDIST_DEBUG", "")  # empty: unset
        mpidist.set_debug_level_from_env()
        assert mpidist.get_debug_level() is DebugLevel.DETAIL
        monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "LOUD")
        with pytest.raises(
            ValueError,
            match=r"^TORCH_DISTRIBUTED_DEBUG must be one of OFF, INFO, DETAIL, "
            r"got 'LOUD'$",
        ):
            mpidist.set_debug_level_from_env()
    finally:
        mpidist.set_debug_level(DebugLevel.OFF)


# -- in real jobs ---------------------------------------------------------------------------
def run_job(
    n: int, code: str, tmp_path: Path, limit: float = 60, runner: tuple = ("-m", "mpidist"), **env: str
) -> tuple[int, str, str, float]:
    script = tmp_path / "job.py"
    script.write_text(code)
    t0 = time.monotonic()
    out = subprocess.run(
        [MPIEXEC, "-n", str(n), sys.executable, *runner, str(script)],
        capture_output=True,
        text=True,
        timeout=limit,
        env=launcher_free_env(OMP_NUM_THREADS="1", MPIDIST_TIMEOUT="60", **env),
    )
    return out.returncode, out.stdout, out.stderr, time.monotonic() - t0


DIVERGE = """
import numpy as np, mpidist
mpidist.init_process_group()
rank = mpidist.get_rank()
x = np.ones({agreed})
mpidist.all_reduce(x)  # agreed: cached on both ranks
n = {agreed} if rank == {cached} else {new}
try:
    mpidist.all_reduce(np.ones(n))
except Exception as exc:
    print(f"rank {{rank}} raised {{type(exc).__name__}}: {{exc}}", flush=True)
    try:
        mpidist.all_reduce(x)
    except Exception as exc:
        print(f"rank {{rank}} then {{type(exc).__name__}}: {{exc}}", flush=True)
else:
    print(f"rank {{rank}} no error", flush=True)
"""


@pytest.mark.parametrize("agreed, new, cached", [(65536, 1000, 0), (4, 6, 1)], ids=["shm-65536", "mpi-4"])
def test_agreed_call_on_one_rank_and_a_new_one_on_the_other_ends_the_job(tmp_path, agreed, new, cached):
    """The case a cache cannot decide alike: the rank with the new call asks the other's
    watchdog, raises the clear error, and the other rank's watchdog aborts the job (it was
    waiting in the op: shared memory for 65,536 elements, MPI_Allreduce for 4)."""
    rc, out, err, took = run_job(2, DIVERGE.format(agreed=agreed, new=new, cached=cached), tmp_path)
    other = 1 - cached
    calls = (
        f"the members of group 'default_pg' called mismatched collectives (they differ in count): rank {other}: "
        f"all_reduce(seq=1, count={new}, dtype=float64, op=SUM), a call new to the group, which its members "
        f"compare before running it; rank {cached}: all_reduce(seq=1, count={agreed}, dtype=float64, op=SUM), "
        f"a call the members agreed on before, run without comparing it"
    )
    assert rc != 0 and took < 30, (rc, took, err)
    assert f"rank {other} raised ValueError: [rank {other}/2] all_reduce: {calls}" in out, (out, err)
    assert (
        f"[rank {cached}] mpidist.errors.DistError: [rank {cached}/2] all_reduce: {calls} (found by rank "
        f"{other})" in err
    ), err
    assert "aborting the job" in err


def test_agreed_call_against_a_new_one_without_abort(tmp_path):
    """MPIDIST_ABORT_ON_TIMEOUT=0: the rank with the new call raises ValueError, the other
    DistError in its caller; the group is unusable on both (later ops raise at once)."""
    rc, out, err, took = run_job(
        2, DIVERGE.format(agreed=65536, new=1000, cached=0), tmp_path, MPIDIST_ABORT_ON_TIMEOUT="0"
    )
    assert took < 30, (took, err)
    lines = out.splitlines()
    assert any(
        line.startswith("rank 1 raised ValueError: [rank 1/2] all_reduce: the members of group") for line in lines
    ), (out, err)
    assert any(
        line.startswith("rank 0 raised DistError: [rank 0/2] all_reduce: the members of group")
        and line.endswith("(found by rank 1)")
        for line in lines
    ), (out, err)
    for r in (0, 1):
        assert any(
            line.startswith(
                f"rank {r} then DistError: [rank {r}/2] all_reduce: group 'default_pg' is "
                f"unusable: a mismatched collective at sequence number 1"
            )
            for line in lines
        ), out


ALIAS = """
import numpy as np, mpidist
mpidist.init_process_group()
rank = mpidist.get_rank()
print(f"rank {rank} level {mpidist.get_debug_level().name}", flush=True)
for n in (4, 5):
    mpidist.all_reduce(np.ones(n))
try:
    mpidist.all_reduce(np.ones(4 + rank))  # agreed sizes, out of step: only DETAIL sees it
except ValueError as exc:
    print(f"rank {rank} raised: {exc}", flush=True)
"""


def test_torch_distributed_debug_is_an_alias_and_mpidist_debug_wins(tmp_path):
    rc, out, err, _ = run_job(2, ALIAS, tmp_path, TORCH_DISTRIBUTED_DEBUG="detail")
    assert rc == 0, err
    for r in (0, 1):
        assert f"rank {r} level DETAIL" in out
        assert (
            f"rank {r} raised: [rank {r}/2] all_reduce: the members of group 'default_pg' called mismatched "
            f"collectives (they differ in count): rank 0: all_reduce(seq=2, count=4, dtype=float64, op=SUM); "
            f"rank 1: all_reduce(seq=2, count=5, dtype=float64, op=SUM)"
        ) in out, out
    rc, out, err, _ = run_job(
        1,
        "import mpidist\nmpidist.init_process_group()\nprint(mpidist.get_debug_level().name)\n",
        tmp_path,
        MPIDIST_DEBUG="info",
        TORCH_DISTRIBUTED_DEBUG="DETAIL",
    )
    assert (rc, out) == (0, "INFO\n"), err
    rc, out, err, _ = run_job(
        1, "import mpidist\nmpidist.init_process_group()\n", tmp_path, TORCH_DISTRIBUTED_DEBUG="LOUD"
    )
    assert (
        rc != 0
        and (
            "ValueError: [rank 0/1] init_process_group: TORCH_DISTRIBUTED_DEBUG must be one of OFF, "
            "INFO, DETAIL, got 'LOUD'"
        )
        in err
    ), err


@pytest.mark.parametrize("runner, n", [(("-m", "mpidist"), 2), ((), 2), ((), 4)])
def test_4_elements_against_another_in_a_job(tmp_path, runner, n):
    """Before: MPICH printed 'Message truncated' and the job exited 142 (or returned garbage).
    Then: 51 lines at -n 2, a whole traceback per rank (issue 41). Now one report of at most 12
    lines (the MPI library's own abort lines aside), by rank 0, under the runner or not; each
    rank's whole traceback is in the trace directory."""
    code = (
        "import numpy as np, mpidist\nmpidist.init_process_group()\n"
        "mpidist.all_reduce(np.ones(4 + mpidist.get_rank()))\n"
    )
    rc, out, err, took = run_job(n, code, tmp_path, runner=runner, MPIDIST_TRACE_DIR=str(tmp_path / "t"))
    assert rc == 1 and took < 30, (rc, err)
    assert "Message truncated" not in err
    ours = [line for line in err.splitlines() if line.startswith("[rank ")]
    assert len(ours) <= 12 and all(line.startswith("[rank 0] ") for line in ours), err
    assert (
        "[rank 0] ValueError: [rank 0/2] all_reduce: the members of group 'default_pg' called "
        "mismatched collectives (they differ in count): rank 0: all_reduce(seq=0, count=4, dtype=float64, "
        "op=SUM); rank 1: all_reduce(seq=0, count=5, dtype=float64, op=SUM)"
    ).replace("/2]", f"/{n}]") in ours or n > 2, err
    assert ours[1:3] == [
        f'[rank 0]   File "{tmp_path / "job.py"}", line 3, in <module>',
        "[rank 0]     mpidist.all_reduce(np.ones(4 + mpidist.get_rank()))",
    ], err
    assert "_dispatch" in (tmp_path / "t" / "rank1.traceback.txt").read_text()  # the whole one


# -- the running hash: compared every PERIOD calls, in destroy_process_group and at exit ------------
R1 = """
import numpy as np, mpidist
mpidist.init_process_group()
rank = mpidist.get_rank()
x = np.zeros(4, np.float32)
mpidist.broadcast(x, src=0)  # agreed: cached on both ranks
mpidist.broadcast(x, src=1 if rank == 1 else 0)  # rank 0: cached, its eager send completes; rank 1: new
{end}
print(f"rank {{rank}} ended", flush=True)
"""
R1_TEXT = (
    "the members of group 'default_pg' called mismatched collectives (they differ in root): rank 1: "
    "broadcast(seq=1, count=4, dtype=float32, root=1), a call new to the group, which its members compare "
    "before running it; rank 0: broadcast(seq=1, count=4, dtype=float32, root=0), a call the members agreed "
    "on before, run without comparing it"
)


@pytest.mark.parametrize("end", ["mpidist.destroy_process_group()", "pass"])
def test_r1_broadcast_with_another_root_ends_on_both_ranks(tmp_path, end):
    """Rank 0's call is agreed (cached) and returns; rank 1's is new and waits in its exchange.
    Before: rank 0 reached destroy_process_group (or exit), its watchdog gone, and rank 1 waited
    for the whole timeout. Now rank 0 waits in its final comparison with its watchdog alive,
    rank 1 asks it, finds that it ran seq 1 without comparing, and both end with that text."""
    rc, out, err, took = run_job(2, R1.format(end=end), tmp_path)
    assert rc != 0 and took < 10, (rc, took, err)
    # rank 0, told by rank 1, reports it for the job; rank 1's ValueError waits for that abort
    assert f"[rank 0] mpidist.errors.DistError: [rank 0/2] broadcast: {R1_TEXT} (found by rank 1)" in err, err
    assert err.count(R1_TEXT) == 1, err


OUT_OF_STEP = """
import numpy as np, mpidist
from mpidist import ReduceOp
mpidist.init_process_group()
rank = mpidist.get_rank()
x = np.ones(4)
for op in (ReduceOp.SUM, ReduceOp.MAX):
    mpidist.all_reduce(x, op)  # both agreed
for i in range({calls}):  # then made out of step: rank 1 starts with MAX
    mpidist.all_reduce(x, ReduceOp.MAX if (i + rank) % 2 else ReduceOp.SUM)
print(f"rank {{rank}} loop done", flush=True)
{end}
"""


@pytest.mark.parametrize(
    "calls,end",
    [
        (2 * mismatch.PERIOD + 50, "mpidist.destroy_process_group()"),
        (6, "mpidist.destroy_process_group()"),
        (6, "pass"),
    ],
)
def test_agreed_calls_made_out_of_step_are_caught(tmp_path, calls, end):
    """The blind spot of the cache: every call agreed on before, so none is exchanged. The
    running hash differs from the first swapped call: caught by the comparison posted at the
    first multiple of PERIOD, verified at the second (2 PERIOD + 50 calls), or by the final
    comparison (6 calls: in destroy_process_group, or at exit), naming the first call that
    differs; never exit status 0."""
    rc, out, err, took = run_job(2, OUT_OF_STEP.format(calls=calls, end=end), tmp_path)
    assert rc != 0 and took < 10, (rc, took, err)
    first = (
        "first at sequence number 2: rank 0: all_reduce(seq=2, count=4, dtype=float64, op=SUM); rank 1: "
        "all_reduce(seq=2, count=4, dtype=float64, op=MAX)"
    )
    assert err.count(first) == 1, err  # one report per job
    if calls > mismatch.PERIOD:
        assert "loop done" not in out
        assert f"all_reduce(seq={mismatch.PERIOD}, count=4" in err
    else:
        where = "destroy_process_group" if "destroy" in end else "exit"
        assert f"[rank 0/2] {where}: the members of group 'default_pg' called mismatched collectives: " in err, err


SKIP_ONE = """
import numpy as np, mpidist
mpidist.init_process_group()
rank = mpidist.get_rank()
x = np.ones(4)
for i in range(10 - rank):  # rank 1 skips one call
    mpidist.all_reduce(x)
mpidist.destroy_process_group()
"""


def test_a_rank_that_skips_a_call_is_caught(tmp_path):
    """Rank 0's extra call waits in MPI; rank 1's final comparison asks rank 0 and finds it
    ran a call there without comparing it: both end, with the same text."""
    rc, out, err, took = run_job(2, SKIP_ONE, tmp_path)
    assert rc != 0 and took < 10, (rc, took, err)
    text = (
        "the members of group 'default_pg' called mismatched collectives: rank 1: its final comparison of the "
        "calls made (destroy_process_group, seq=9); rank 0: all_reduce(seq=9, count=4, dtype=float64, "
        "op=SUM), a call the members agreed on before, run without comparing it"
    )
    assert f"[rank 0/2] all_reduce: {text} (found by rank 1)" in err and err.count(text) == 1, err


@pytest.mark.mpi(min_size=2)
def test_out_of_step_calls_caught_within_period_in_process(dist, world, fresh):
    """In one process per rank (the group stays unusable afterwards on every member): SUM and
    MAX out of step on the last rank, raising within two PERIODs, on every rank."""
    rank, size = world
    good, odd = split(size)
    x = np.ones(3)
    for op in (ReduceOp.SUM, ReduceOp.MAX):
        dist.all_reduce(x, op, group=fresh)
    with pytest.raises(ValueError) as info:
        for i in range(3 * mismatch.PERIOD):
            ops = (ReduceOp.SUM, ReduceOp.MAX) if rank in good else (ReduceOp.MAX, ReduceOp.SUM)
            dist.all_reduce(x, ops[i % 2], group=fresh)
    # posted at seq PERIOD, verified (and raised) at 2 PERIOD
    assert fresh.engine.seq == 2 * mismatch.PERIOD + 1
    text = str(info.value)
    assert "first at sequence number 2: " in text and "op=MAX" in text and "op=SUM" in text, text
    with pytest.raises(mpidist.DistError, match="unusable"):
        dist.all_reduce(x, group=fresh)


@pytest.mark.mpi(min_size=2)
def test_check_collectives_compares_on_demand(dist, world, fresh):
    """mpidist.check_collectives (before a checkpoint is written): agreed calls pass; calls
    agreed on before but made out of step raise on every member, naming the first."""
    rank, size = world
    x = np.ones(2)
    for op in (ReduceOp.SUM, ReduceOp.MAX):
        dist.all_reduce(x, op, group=fresh)
    mpidist.check_collectives(fresh)  # agreed: returns on every member
    for op in (ReduceOp.MAX, ReduceOp.SUM) if rank == size - 1 else (ReduceOp.SUM, ReduceOp.MAX):
        dist.all_reduce(x, op, group=fresh)
    with pytest.raises(ValueError) as info:
        mpidist.check_collectives(fresh)
    text = str(info.value)
    assert text.startswith(
        f"[rank {rank}/{size}] check_collectives: the members of group {fresh.group_name!r} "
        f"called mismatched collectives: first at sequence number 3: "
    ), text


@pytest.mark.mpi
def test_groups_not_checked_never_exchange(dist, world, fresh):
    """The 8-byte path's comparison at the multiples of PERIOD is the check's: a one-rank group,
    and checks switched off (the benchmarks' baseline), make none."""
    rank, size = world
    x = np.ones(1)
    if size == 1:
        for _ in range(3 * mismatch.PERIOD):
            dist.all_reduce(x)
        assert "check" not in _runtime_state().world._resources
        return
    dist.all_reduce(x, group=fresh)  # agreed; then every call on the latency path
    before = list(fresh.resource("check", mismatch.GroupCheck).exchanged)
    mismatch._set_checks(False)
    try:
        for _ in range(3 * mismatch.PERIOD):
            dist.all_reduce(x, group=fresh)
    finally:
        mismatch._set_checks(True)
    assert list(fresh.resource("check", mismatch.GroupCheck).exchanged) == before


def _runtime_state():
    from mpidist._runtime import world as runtime  # noqa: PLC0415

    return runtime.state()
