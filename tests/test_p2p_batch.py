"""P2POp and batch_isend_irecv."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from mpidist.p2p import P2POp, batch_isend_irecv

pytestmark = pytest.mark.mpi


def payload(src: int, dst: int, n: int, dtype=np.float64) -> np.ndarray:
    """What rank ``src`` sends to rank ``dst``: regenerable on every rank."""
    return np.random.default_rng([9, src, dst]).integers(0, 1000, size=n).astype(dtype)


def test_batch_ring_exchange_in_any_group(dist, any_group):
    g, members = any_group
    rank = dist.get_rank()
    if rank not in members or len(members) < 2:
        return
    me = members.index(rank)
    right, left = members[(me + 1) % len(members)], members[(me - 1) % len(members)]
    out, got = payload(rank, right, 1000), np.empty(1000)
    # the receive is listed first: nothing waits until every op is posted
    works = batch_isend_irecv([P2POp(dist.irecv, got, left, g), P2POp(dist.isend, out, right, g)])
    assert len(works) == 2
    for w in works:
        assert w.wait() is True and w.is_completed() and w.is_success()
    np.testing.assert_array_equal(got, payload(left, rank, 1000))
    assert works[0].source_rank() == left
    assert works[0].result()[0] is got and works[1].result() == []


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("n", [1, 300_000])
def test_batch_all_to_all_with_tags_and_dtypes(dist, world, n):
    """Every rank sends two messages to every other rank; large ones need all posted first."""
    rank, size = world
    peers = [r for r in range(size) if r != rank]
    outs = {(p, t): payload(rank, p, n, dt) for p in peers for t, dt in ((1, np.float32), (2, np.int64))}
    ins = {(p, t): np.empty(n, dt) for p in peers for t, dt in ((1, np.float32), (2, np.int64))}
    ops = [P2POp(dist.isend, a, p, tag=t) for (p, t), a in outs.items()]
    ops += [P2POp(dist.irecv, a, p, tag=t) for (p, t), a in reversed(list(ins.items()))]
    works = batch_isend_irecv(ops)
    assert len(works) == len(ops)
    for w in works:
        w.wait()
    for (p, _t), a in ins.items():
        np.testing.assert_array_equal(a, payload(p, rank, n, a.dtype))


@pytest.mark.mpi(min_size=2)
def test_batch_irecv_from_any_source(dist, world):
    rank, size = world
    if rank == 0:
        bufs = [np.empty(3, np.int32) for _ in range(size - 1)]
        works = batch_isend_irecv([P2POp(dist.irecv, b, None, tag=4) for b in bufs])
        sources = []
        for w, b in zip(works, bufs):
            src = w.source_rank()
            np.testing.assert_array_equal(b, np.full(3, src * 11, np.int32))
            sources.append(src)
        assert sorted(sources) == list(range(1, size))
    else:
        batch_isend_irecv([P2POp(dist.isend, np.full(3, rank * 11, np.int32), 0, tag=4)])[0].wait()


def test_non_member_ops_are_skipped(dist, world):
    rank, size = world
    g = dist.new_group([size - 1])
    try:
        if rank != size - 1:
            x = np.ones(2)
            assert batch_isend_irecv([P2POp(dist.isend, x, size - 1, g), P2POp(dist.irecv, x, size - 1, g)]) == []
    finally:
        if g is not dist.GroupMember.NON_GROUP_MEMBER:
            dist.destroy_process_group(g)


def test_bad_ops_rejected(dist, world):
    rank, size = world
    p = rf"\[rank {rank}/{size}\]"
    x = np.ones(3)
    with pytest.raises(
        ValueError,
        match=rf"{p} batch_isend_irecv: p2p_op_list must be a non-empty list of "
        rf"P2POp, got \[\]",
    ):
        batch_isend_irecv([])
    with pytest.raises(ValueError, match=rf"{p} batch_isend_irecv: p2p_op_list must be a non-empty list of P2POp"):
        batch_isend_irecv(P2POp(dist.isend, x, 0))
    with pytest.raises(ValueError, match=rf"{p} batch_isend_irecv: p2p_op_list\[1\] must be a P2POp, got tuple"):
        batch_isend_irecv([P2POp(dist.isend, x, 0), (dist.isend, x, 0)])
    with pytest.raises(ValueError, match=rf"{p} P2POp: op must be mpidist.isend or mpidist.irecv, got send"):
        P2POp(dist.send, x, 0)
    ro = np.ones(3)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match=rf"{p} P2POp: tensor must be writable, got a read-only array"):
        P2POp(dist.irecv, ro, 0)
    P2POp(dist.isend, ro, 0)  # sending a read-only array is fine
    with pytest.raises(TypeError, match=rf"{p} P2POp: tensor must be a numpy.ndarray, got list"):
        P2POp(dist.isend, [1.0], 0)


@pytest.mark.mpi(min_size=2)
def test_bad_op_in_batch_posts_nothing(dist, world):
    rank, size = world
    right = (rank + 1) % size
    x = np.full(2, 5.0)
    good = P2POp(dist.isend, x, right, tag=31)
    with pytest.raises(
        ValueError,
        match=rf"batch_isend_irecv: p2p_op_list\[1\].peer={size}: global rank "
        rf"{size} is not part",
    ):
        batch_isend_irecv([good, P2POp(dist.irecv, x, size)])
    with pytest.raises(ValueError, match=r"batch_isend_irecv: p2p_op_list\[2\].tag must be in \[0, \d+\]"):
        batch_isend_irecv([good, good, P2POp(dist.isend, x, right, tag=-5)])
    with pytest.raises(TypeError, match=r"batch_isend_irecv: p2p_op_list\[0\].tag must be an int, got float"):
        batch_isend_irecv([P2POp(dist.isend, x, right, tag=1.0)])
    with pytest.raises(
        ValueError,
        match=rf"batch_isend_irecv: p2p_op_list\[1\].peer={rank} is the calling "
        rf"rank itself",
    ):
        batch_isend_irecv([good, P2POp(dist.isend, x, rank)])
    dist.barrier()
    # nothing from the rejected batches reached anyone
    assert not dist.group.WORLD.comm.Iprobe(MPI.ANY_SOURCE, 31)
    dist.barrier()
