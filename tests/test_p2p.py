"""Point-to-point on numpy arrays."""

from __future__ import annotations

import re

import numpy as np
import pytest

from mpidist._core.tags import USER_TAG_MAX

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


# A message of another size never touches the buffer (issue 14, item 6): (what rank 0 sends,
# how rank 1's error describes it) for a receive into a float64 array of shape (2, 2).
BAD = [
    (np.arange(3.0), "3 elements of float64"),
    (np.arange(5.0), "5 elements of float64"),
    (np.arange(40.0), "40 elements of float64"),
    (np.arange(12, dtype=np.uint8), r"12 bytes \(not a whole number of float64 elements\)"),
]


def mismatch(op: str, size: int, what: str, in_place: bool = False) -> str:
    state = (
        r"the tensor's contents are undefined \(the irecv was posted before the message came, so it was "
        r"received in place\)"
        if in_place
        else "the tensor left unchanged"
    )
    return (
        rf"^\[rank 1/{size}\] {op}: received {what} from rank 0, expected 4 \(tensor shape \(2, 2\)\); the "
        rf"message was consumed and {state}; sender and receiver must use the same shape and dtype$"
    )


def raises_untouched(buf: np.ndarray, pattern: str, call, *args) -> None:
    """``call(*args)`` raises ValueError matching ``pattern``, and ``buf`` still holds -1
    (checked first: the old code raised too, after writing into it)."""
    with pytest.raises(ValueError) as err:
        call(*args)
    np.testing.assert_array_equal(buf, np.full(buf.shape, -1.0), err_msg=str(err.value))
    assert re.search(pattern, str(err.value)), (pattern, str(err.value))


def test_recv_of_another_size_raises_before_writing(dist, world):
    """Before: a shorter message was written into the start of the buffer, then ValueError;
    a longer one, its first elements, then MPI_ERR_TRUNCATE."""
    rank, size = world
    if rank == 0:
        for i, (x, _) in enumerate(BAD):
            dist.send(x, 1, tag=i)
            dist.send(x, 1, tag=10)
        dist.send(np.full(4, 9.0), 1, tag=0)
    elif rank == 1:
        buf = np.full((2, 2), -1.0)
        for i, (_, what) in enumerate(BAD):
            raises_untouched(buf, mismatch("recv", size, what), dist.recv, buf, 0, None, i)
            # any source: the error names the sender
            raises_untouched(buf, mismatch("recv", size, what), dist.recv, buf, None, None, 10)
        assert dist.recv(buf, None, tag=0) == 0  # the bad messages were consumed
        np.testing.assert_array_equal(buf, np.full((2, 2), 9.0))
    dist.barrier()


def test_irecv_of_another_size_raises_before_writing(dist, world):
    """Both ways an irecv meets its message: already there when it is posted (probed,
    matched, received only if the size is right: the buffer is untouched), and posted
    first (received in place, as MPI_Irecv: the error says the contents are undefined);
    either way the message is consumed and the next receive gets the next message."""
    rank, size = world
    comm = dist._runtime.world.state().world.comm
    token = np.zeros(1)
    if rank == 0:
        for i, (x, _) in enumerate(BAD):
            dist.send(x, 1, tag=i)  # arrives first
            dist.recv(token, 1, tag=99)  # rank 1 posted its irecv: send now
            dist.send(x, 1, tag=20 + i)
        dist.recv(token, 1, tag=99)
        dist.send(np.full(4, 9.0), 1, tag=30)
    elif rank == 1:
        buf = np.full((2, 2), -1.0)
        for i, (_, what) in enumerate(BAD):
            comm.Probe(0, i)  # the message is here before the irecv is posted
            w = dist.irecv(buf, 0, tag=i)
            raises_untouched(buf, mismatch("irecv", size, what), w.wait)
            assert w.is_completed() and isinstance(w.exception(), ValueError) and not w.is_success()
            raises_untouched(buf, mismatch("irecv", size, what), w.get_future().result)
            w = dist.irecv(buf, None, tag=20 + i)  # posted before the message is sent
            dist.send(token, 0, tag=99)
            larger = i in (1, 2)  # MPI truncates a larger message
            with pytest.raises(ValueError) as err:
                w.wait()
            pattern = (
                r"irecv: the incoming message is larger than the receive buffer"
                if larger
                else mismatch("irecv", size, what, in_place=True)
            )
            assert re.search(pattern, str(err.value)), (pattern, str(err.value))
            buf[...] = -1.0
        w = dist.irecv(buf, 0, tag=30)
        dist.send(token, 0, tag=99)
        assert w.wait() and w.source_rank() == 0
        np.testing.assert_array_equal(buf, np.full((2, 2), 9.0))
    dist.barrier()


def test_batch_irecv_of_another_size_raises_before_writing(dist, world):
    rank, size = world
    if rank == 0:
        dist.batch_isend_irecv([dist.P2POp(dist.isend, np.arange(3.0), 1)])[0].wait()
        dist.send(np.full(4, 9.0), 1)
    elif rank == 1:
        buf = np.full((2, 2), -1.0)
        (w,) = dist.batch_isend_irecv([dist.P2POp(dist.irecv, buf, 0)])
        with pytest.raises(ValueError) as err:
            w.wait()
        # the message may have been there when the irecv was posted (probed: buf untouched)
        # or not (received in place): the error says which
        untouched = bool((buf == -1.0).all())
        assert re.search(mismatch("irecv", size, "3 elements of float64", in_place=not untouched), str(err.value))
        assert dist.recv(buf) == 0
        np.testing.assert_array_equal(buf, np.full((2, 2), 9.0))
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
