"""monitored_barrier: passes when every rank arrives; names the late ranks otherwise, on every
rank, within bounded time, and leaves nothing pending that could hang or confuse later calls."""

from __future__ import annotations

import datetime
import time

import numpy as np
import pytest

from mpidist import DistError
from mpidist._backends.mpi.collectives import _mb_drain
from mpidist.collectives import monitored_barrier

pytestmark = pytest.mark.mpi

PREFIX = r"\[rank \d+/\d+\] monitored_barrier: "


def drained() -> bool:
    """Messages left behind by a failed call complete once their peers catch up."""
    deadline = time.monotonic() + 10
    while _mb_drain() and time.monotonic() < deadline:
        time.sleep(0.01)
    return _mb_drain() == 0


def all_pass_afterwards(dist, group=None) -> None:
    """A failed barrier leaves the job usable: monitored_barrier and a collective still work."""
    assert monitored_barrier(group, timeout=30) is None
    x = np.ones(3)
    dist.all_reduce(x, group=group)
    assert monitored_barrier(group, timeout=30) is None
    assert drained()


@pytest.mark.parametrize("wait_all_ranks", [False, True])
def test_every_rank_arrives(dist, any_group, wait_all_ranks):
    g, members = any_group
    for timeout in (datetime.timedelta(seconds=30), 30.0, None):
        assert monitored_barrier(g, timeout=timeout, wait_all_ranks=wait_all_ranks) is None


def test_root_waits_for_a_slow_rank_within_the_timeout(dist, world):
    rank, size = world
    start = time.monotonic()
    if rank == size - 1:
        time.sleep(0.3)
    monitored_barrier(timeout=20)
    if rank == 0 and size > 1:
        assert time.monotonic() - start >= 0.25  # rank 0 really waited for the slow rank


@pytest.mark.parametrize("wait_all_ranks", [False, True])
def test_late_ranks_are_named_on_every_rank(dist, world, wait_all_ranks):
    rank, size = world
    if size < 2:
        pytest.skip("needs a second rank to be late")
    late = sorted({1, size - 1})  # one late rank at -n 2, two from -n 3 on
    shown = late if wait_all_ranks else late[:1]
    if rank in late:
        time.sleep(1.0)  # longer than the 0.4 s timeout
    start = time.monotonic()
    with pytest.raises(DistError) as info:
        monitored_barrier(timeout=0.4, wait_all_ranks=wait_all_ranks)
    who = "rank(s)" if rank == 0 else "rank 0 reports that rank(s)"
    assert str(info.value) == (
        f"[rank {rank}/{size}] monitored_barrier: {who} {shown} did not reach the barrier within 0.4 s"
    )
    assert time.monotonic() - start < 3.0  # bounded by the timeout (plus grace), not by the late ranks
    all_pass_afterwards(dist)


def test_root_message_exact(dist, world):
    """The message of group rank 0, exactly as documented."""
    rank, size = world
    if size < 2:
        pytest.skip("needs a second rank to be late")
    if rank == size - 1:
        time.sleep(0.6)
    if rank == 0:
        with pytest.raises(DistError) as info:
            monitored_barrier(timeout=0.3)
        assert str(info.value) == (
            f"[rank 0/{size}] monitored_barrier: rank(s) [{size - 1}] did not reach the barrier within 0.3 s"
        )
    else:
        with pytest.raises(DistError, match=PREFIX + rf"rank 0 reports that rank\(s\) \[{size - 1}\]"):
            monitored_barrier(timeout=0.3)
    all_pass_afterwards(dist)


def test_late_rank_on_a_group_is_named_by_global_rank(dist, world):
    rank, size = world
    if size < 3:
        pytest.skip("needs a group of two ranks besides rank 0")
    members = list(range(1, size))
    g = dist.new_group(members)
    if rank == 0:
        assert monitored_barrier(g, timeout=0.3) is None  # not a member
    else:
        if rank == size - 1:
            time.sleep(0.6)
        with pytest.raises(DistError) as info:
            monitored_barrier(g, timeout=0.3)
        who = "rank(s)" if rank == 1 else "rank 1 reports that rank(s)"
        assert str(info.value) == (
            f"[rank {rank}/{size}] monitored_barrier: {who} [{size - 1}] did not reach the barrier within 0.3 s"
        )
        all_pass_afterwards(dist, g)
    dist.barrier()
    if g is not dist.GroupMember.NON_GROUP_MEMBER:
        dist.destroy_process_group(g)


def test_other_ranks_give_up_when_rank_0_is_late(dist, world):
    """A non-root rank waits at most timeout + min(timeout, 5 s) for rank 0's verdict."""
    rank, size = world
    if size < 2:
        pytest.skip("needs a rank besides rank 0")
    if rank == 0:
        time.sleep(1.0)
        assert monitored_barrier(timeout=0.3) is None  # everyone had checked in
    else:
        start = time.monotonic()
        with pytest.raises(DistError) as info:
            monitored_barrier(timeout=0.3)
        assert 0.55 <= time.monotonic() - start < 3.0  # gave up near 0.6 s, did not wait for rank 0
        assert str(info.value) == (
            f"[rank {rank}/{size}] monitored_barrier: no word from rank 0 (group "
            f"rank 0) within 0.6 s: it has not reached the barrier"
        )
    all_pass_afterwards(dist)


def test_bad_timeout_rejected(dist):
    with pytest.raises(
        TypeError,
        match=PREFIX + r"timeout must be a datetime.timedelta, seconds, or None, "
        r"got str",
    ):
        monitored_barrier(timeout="1s")
    with pytest.raises(ValueError, match=PREFIX + r"timeout must be positive, got 0.0 s"):
        monitored_barrier(timeout=datetime.timedelta(0))


def test_user_messages_are_not_taken(dist, world):
    """The barrier's own tags never match a user's message pending on the same group."""
    rank, size = world
    if size < 2:
        pytest.skip("needs two ranks")
    if rank == 1:
        work = dist.isend(np.full(4, 7.0), 0, tag=0)
    monitored_barrier(timeout=30)
    if rank == 0:
        got = np.zeros(4)
        dist.recv(got, 1, tag=0)
        np.testing.assert_array_equal(got, np.full(4, 7.0))
    if rank == 1:
        work.wait()
