"""Point-to-point on numpy arrays."""
from __future__ import annotations

import numpy as np
import pytest

from mpidist._tags import USER_TAG_MAX

pytestmark = pytest.mark.mpi(min_size=2)


def test_send_recv_ring(dist, world):
    rank, size = world
    right, left = (rank + 1) % size, (rank - 1) % size
    out = np.arange(5, dtype=np.float64) + rank
    got = np.empty(5)
    # even ranks send first, odd ranks receive first: no deadlock without buffering
    if rank % 2 == 0:
        dist.send(out, right)
        src = dist.recv(got, left)
    else:
        src = dist.recv(got, left)
        dist.send(out, right)
    assert src == left
    np.testing.assert_array_equal(got, np.arange(5) + left)


def test_isend_irecv_and_tags(dist, world):
    rank, size = world
    right, left = (rank + 1) % size, (rank - 1) % size
    a, b = np.full(3, rank, dtype=np.int32), np.full(3, 100 + rank, dtype=np.int32)
    ra, rb = np.empty(3, dtype=np.int32), np.empty(3, dtype=np.int32)
    # receives posted in the opposite tag order from the sends: tags must match them up
    recvs = [dist.irecv(rb, left, tag=2), dist.irecv(ra, left, tag=1)]
    sends = [dist.isend(a, right, tag=1), dist.isend(b, right, tag=2)]
    for w in sends + recvs:
        assert w.wait() is True and w.is_completed()
    np.testing.assert_array_equal(ra, np.full(3, left))
    np.testing.assert_array_equal(rb, np.full(3, 100 + left))
    assert recvs[0].source_rank() == left
    assert recvs[1].result()[0] is ra


def test_recv_from_any_source_returns_sender(dist, world):
    rank, size = world
    if rank == 0:
        senders = set()
        buf = np.empty(1, dtype=np.int64)
        for _ in range(size - 1):
            src = dist.recv(buf)
            assert buf[0] == src * 7
            senders.add(src)
        assert senders == set(range(1, size))
    else:
        dist.send(np.array([rank * 7], dtype=np.int64), 0)


def test_size_mismatch_is_an_error_not_corruption(dist, world):
    rank, _ = world
    if rank == 0:
        dist.send(np.ones(3), 1, tag=5)
        dist.send(np.ones(8), 1, tag=6)
    elif rank == 1:
        with pytest.raises(ValueError, match=r"\[rank 1/\d+\] recv: received 3 elements of float64 from rank 0, expected 4"):
            dist.recv(np.empty(4), 0, tag=5)
        with pytest.raises(ValueError, match=r"recv: the incoming message is larger than the receive buffer"):
            dist.recv(np.empty(4), 0, tag=6)
    dist.barrier()


def test_bad_peers_and_tags_rejected(dist, world):
    rank, size = world
    x = np.ones(2)
    with pytest.raises(ValueError, match=rf"\[rank {rank}/{size}\] send: dst={size}: global rank {size} is not part"):
        dist.send(x, size)
    with pytest.raises(ValueError, match=rf"isend: dst={rank} is the calling rank itself"):
        dist.isend(x, rank)
    with pytest.raises(ValueError, match=r"recv: src=-3"):
        dist.recv(x, -3)
    with pytest.raises(ValueError, match=rf"send: tag must be in \[0, {USER_TAG_MAX}\] \(tags above are reserved"):
        dist.send(x, (rank + 1) % size, tag=-1)
    with pytest.raises(ValueError, match=rf"isend: tag must be in \[0, {USER_TAG_MAX}\]"):
        dist.isend(x, (rank + 1) % size, tag=USER_TAG_MAX + 1)
    with pytest.raises(TypeError, match=r"irecv: tag must be an int, got str"):
        dist.irecv(x, (rank + 1) % size, tag="a")
    y = np.zeros(2)
    y.flags.writeable = False
    with pytest.raises(ValueError, match=r"recv: tensor must be writable"):
        dist.recv(y, (rank + 1) % size)
