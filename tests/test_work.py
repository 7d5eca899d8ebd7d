"""Work: every method on every kind of handle, timeouts, errors, futures and their callbacks."""

from __future__ import annotations

import concurrent.futures
import datetime
import threading

import numpy as np
import pytest
from mpi4py import MPI

from mpidist import work as work_module
from mpidist._dispatch import dispatch
from mpidist.work import CompletedWork, FutureWork, RequestWork, WorkResult

pytestmark = pytest.mark.mpi

WAIT_S = 30  # generous bound on waits that must succeed (oversubscribed test machine)


def check_done_ok(w, outputs: list) -> None:
    """Every Work method on a Work that completed successfully with ``outputs``."""
    assert w.wait() is True and w.wait(timeout=0.0) is True
    assert w.is_completed() and w.is_success() and w.exception() is None
    res = w.result()
    assert len(res) == len(outputs) and all(a is b for a, b in zip(res, outputs))
    fut = w.get_future()
    assert fut is w.get_future()
    assert isinstance(fut, concurrent.futures.Future)
    got = fut.result(timeout=WAIT_S)
    assert isinstance(got, list) and len(got) == len(outputs) and all(a is b for a, b in zip(got, outputs))
    assert fut.exception(timeout=0) is None
    seen = []
    fut.add_done_callback(seen.append)  # already done: runs at once, here
    assert seen == [fut]
    assert "completed" in repr(w)
    assert w.synchronize() is None
    res_fut = w.get_future_result()
    assert res_fut is w.get_future_result() and isinstance(res_fut, concurrent.futures.Future)
    assert res_fut.result(timeout=WAIT_S) is WorkResult.SUCCESS and res_fut.result() == 0  # torch's int


def test_async_collective_work(dist, any_group):
    g, members = any_group
    rank = dist.get_rank()
    x = np.full(1000, float(rank))
    w = dist.all_reduce(x, group=g, async_op=True)
    if rank not in members:
        assert w is None
        return
    if len(members) > 1:
        assert isinstance(w, FutureWork)
    else:
        assert isinstance(w, CompletedWork)
    check_done_ok(w, [x])
    np.testing.assert_array_equal(x, np.full(1000, float(sum(members))))
    with pytest.raises(
        ValueError,
        match=rf"\[rank {rank}/\d+\] all_reduce: source_rank\(\) is only defined "
        rf"for receive operations",
    ):
        w.source_rank()


def test_completed_work_on_one_rank_group(dist, world):
    rank, size = world
    groups = [dist.new_group([r]) for r in range(size)]
    mine = groups[rank]
    try:
        x = np.arange(4)
        w = dist.broadcast(x, rank, group=mine, async_op=True)
        assert isinstance(w, CompletedWork)
        assert w.get_future().done()
        check_done_ok(w, [x])
        wb = dist.barrier(group=mine, async_op=True)
        check_done_ok(wb, [])
        with pytest.raises(ValueError, match=r"barrier: source_rank\(\) is only defined for receive operations"):
            wb.source_rank()
        assert CompletedWork("recv", "[rank 0/1] recv:", (x,), source=3).source_rank() == 3
    finally:
        dist.destroy_process_group(mine)


@pytest.mark.mpi(min_size=2)
def test_isend_irecv_work_and_future_completed_by_progress(dist, world):
    """The irecv's future completes, and runs its callback, without anyone calling wait()."""
    rank, size = world
    right, left = (rank + 1) % size, (rank - 1) % size
    got = np.zeros(64, np.int64)
    wr = dist.irecv(got, left, tag=3)
    assert isinstance(wr, RequestWork)
    fut = wr.get_future()
    assert not fut.done() and not wr.is_success() and wr.exception() is None  # nobody has sent yet
    assert "pending" in repr(wr)
    called = threading.Event()
    seen = {}

    def callback(f):
        # any Work method may be called from a callback
        seen.update(future=f, done=wr.is_completed(), source=wr.source_rank(), result=wr.result())
        called.set()

    fut.add_done_callback(callback)
    MPI.COMM_WORLD.Barrier()  # every irecv and its callback are in place before anyone sends
    out = np.arange(64, dtype=np.int64) * (rank + 1)
    ws = dist.isend(out, right, tag=3)
    assert called.wait(WAIT_S), "irecv's future did not complete without a wait()"
    assert seen["future"] is fut and seen["done"] and seen["source"] == left and seen["result"][0] is got
    np.testing.assert_array_equal(got, np.arange(64) * (left + 1))
    check_done_ok(wr, [got])
    assert wr.source_rank() == left
    check_done_ok(ws, [])
    with pytest.raises(ValueError, match=r"isend: source_rank\(\) is only defined for receive operations"):
        ws.source_rank()


@pytest.mark.mpi(min_size=2)
def test_request_future_result_drives_without_progress_thread(dist, world, monkeypatch):
    """Even with no progress thread (an MPI without THREAD_MULTIPLE), future.result() cannot hang."""
    rank, size = world
    monkeypatch.setattr(work_module, "_thread_multiple", lambda: False)
    right, left = (rank + 1) % size, (rank - 1) % size
    got = np.zeros(5)
    fut = dist.irecv(got, left, tag=4).get_future()
    with pytest.raises(concurrent.futures.TimeoutError):
        fut.result(timeout=0.01)
    MPI.COMM_WORLD.Barrier()
    ws = dist.isend(np.full(5, float(rank)), right, tag=4)
    assert fut.result(timeout=WAIT_S)[0] is got
    np.testing.assert_array_equal(got, np.full(5, float(left)))
    assert ws.get_future().exception(timeout=WAIT_S) is None


@pytest.mark.mpi(min_size=2)
def test_wait_timeout_on_unmatched_irecv(dist, world):
    rank, size = world
    if rank == 0:
        buf = np.zeros(3)
        w = dist.irecv(buf, 1, tag=9)
        with pytest.raises(
            dist.DistError,
            match=rf"^\[rank 0/{size}\] irecv: Work.wait timed out after 0.05 s; "
            rf"the op has not completed$",
        ):
            w.wait(timeout=0.05)
        with pytest.raises(dist.DistError, match=r"irecv: Work.wait timed out after 0.02 s"):
            w.wait(timeout=datetime.timedelta(milliseconds=20))
        with pytest.raises(concurrent.futures.TimeoutError):
            w.get_future().result(timeout=0.01)
        assert not w.is_completed() and not w.is_success() and w.exception() is None
        np.testing.assert_array_equal(buf, np.zeros(3))
        dist.barrier()  # only now does rank 1 send: the request is satisfied, not left dangling
        assert w.wait(timeout=WAIT_S) is True
        np.testing.assert_array_equal(buf, np.full(3, 7.0))
        assert w.source_rank() == 1
    else:
        dist.barrier()
        if rank == 1:
            dist.send(np.full(3, 7.0), 0, tag=9)


@pytest.mark.mpi(min_size=2)
def test_wait_timeout_on_pending_collective(dist, world):
    """Rank 0's async all_reduce cannot finish until the others join, after its timeout."""
    rank, size = world
    x = np.full(10, float(rank))
    if rank == 0:
        w = dist.all_reduce(x, async_op=True)
        fut = w.get_future()
        with pytest.raises(
            dist.DistError,
            match=rf"^\[rank 0/{size}\] all_reduce: Work.wait timed out after "
            rf"0.05 s; the op has not completed$",
        ):
            w.wait(timeout=0.05)
        with pytest.raises(concurrent.futures.TimeoutError):
            fut.result(timeout=0.01)
        assert not w.is_completed() and not w.is_success() and w.exception() is None
        MPI.COMM_WORLD.Barrier()  # another communicator: the engine thread still sits in Allreduce
        assert fut.result(timeout=WAIT_S)[0] is x
        check_done_ok(w, [x])
    else:
        MPI.COMM_WORLD.Barrier()
        dist.all_reduce(x)
    np.testing.assert_array_equal(x, np.full(10, size * (size - 1) / 2))


def _boom():
    raise MPI.Exception(MPI.ERR_OTHER)


def test_error_of_async_op_propagates(dist, world):
    rank, size = world
    g = dist.group.WORLD
    pattern = rf"^\[rank {rank}/{size}\] boom: MPI error: "
    if size == 1:  # a one-rank group runs async ops eagerly: the error comes out of the call
        with pytest.raises(dist.DistBackendError, match=pattern):
            dispatch.launch(g, "boom", _boom, (), True)
        return
    w = dispatch.launch(g, "boom", _boom, (), True)
    assert isinstance(w, FutureWork)
    fut = w.get_future()
    with pytest.raises(dist.DistBackendError, match=pattern):
        w.wait()
    err = w.exception()
    assert isinstance(err, dist.DistBackendError)
    assert w.is_completed() and not w.is_success()
    assert fut.exception(timeout=WAIT_S) is err
    with pytest.raises(dist.DistBackendError, match=pattern):
        w.result()
    seen = []
    fut.add_done_callback(lambda f: seen.append(f.exception()))
    assert seen == [err]
    assert w.get_future_result().result(timeout=WAIT_S) is WorkResult.COMM_ERROR
    with pytest.raises(dist.DistBackendError, match=pattern):
        w.synchronize()
    # the group still works after a failed op
    x = np.ones(3)
    dist.all_reduce(x)
    np.testing.assert_array_equal(x, np.full(3, float(size)))


@pytest.mark.mpi(min_size=2)
def test_error_of_irecv_propagates(dist, world):
    rank, size = world
    if rank == 0:
        dist.send(np.ones(3), 1, tag=21)
        dist.send(np.ones(1), 1, tag=22)
    elif rank == 1:
        # a message larger than the array: probed if it was there (received 3 elements ...),
        # else MPI truncates the receive in place
        cases = [
            (
                21,
                r"irecv: (received 3 elements of float64 from rank 0, expected 2|the incoming message is "
                r"larger than the receive buffer)",
            ),
            (22, r"irecv: received 1 elements of float64 from rank 0, expected 2"),
        ]
        for tag, pattern in cases:
            w = dist.irecv(np.empty(2), 0, tag=tag)
            fut = w.get_future()
            with pytest.raises(ValueError, match=rf"^\[rank 1/{size}\] {pattern}"):
                w.wait(timeout=WAIT_S)
            assert w.is_completed() and not w.is_success()
            assert isinstance(w.exception(), ValueError)
            assert fut.exception(timeout=WAIT_S) is w.exception()
            with pytest.raises(ValueError, match=pattern):
                fut.result()
            assert w.get_future_result().result(timeout=WAIT_S) is WorkResult.COMM_ERROR
            with pytest.raises(ValueError, match=pattern):
                w.synchronize()
    dist.barrier()


def test_future_callback_may_issue_ops_on_the_same_group(dist, world):
    """A callback running on the engine thread issues a sync all_reduce: no self-deadlock."""
    rank, size = world
    a, b, c = np.full(8, 1.0), np.full(8, float(rank)), np.full(8, 2.0)
    where = []

    def callback(f):
        where.append(threading.current_thread().name)
        dist.all_reduce(b)

    if rank == 0:  # rank 0's op is still pending when the callback is attached (when size > 1)
        wa = dist.all_reduce(a, async_op=True)
        wa.get_future().add_done_callback(callback)
        MPI.COMM_WORLD.Barrier()
    else:
        MPI.COMM_WORLD.Barrier()
        wa = dist.all_reduce(a, async_op=True)
        wa.get_future().add_done_callback(callback)
    wc = dist.all_reduce(c, async_op=True)
    assert wc.wait(timeout=WAIT_S) and wa.wait(timeout=WAIT_S)
    assert len(where) == 1
    if rank == 0 and size > 1:
        assert where[0].startswith("mpidist-")
    np.testing.assert_array_equal(a, np.full(8, float(size)))
    np.testing.assert_array_equal(b, np.full(8, size * (size - 1) / 2))
    np.testing.assert_array_equal(c, np.full(8, 2.0 * size))


def test_waiter_runs_queued_ops_in_order():
    """A thread waiting on a queued op that has not started runs it, and the ops queued before
    it, itself, in issue order; a wait with a timeout only waits. (An Engine whose thread is
    kept from starting, so the ops stay queued.)"""
    eng = work_module.Engine("steal-test")
    eng._thread = threading.current_thread()  # submit() starts no thread: nothing runs the queue
    order = []
    futures = [eng.submit(lambda i=i: order.append((i, threading.current_thread())) or i) for i in range(4)]
    assert not eng.runs_inline() and not eng.idle()
    with pytest.raises(concurrent.futures.TimeoutError):
        futures[1].result(timeout=0.01)
    assert order == []
    assert futures[1].result() == 1  # runs ops 0 and 1 here, in order; leaves 2 and 3 queued
    assert order == [(0, threading.current_thread()), (1, threading.current_thread())]
    assert not futures[2].done() and eng.pending == 2
    assert futures[3].result() == 3 and [i for i, _ in order] == [0, 1, 2, 3]
    assert eng.runs_inline() and eng._runner is None
    eng._thread = None


def test_engine_threads_run_the_start_hooks_before_any_op(monkeypatch):
    """THREAD_START (device binding puts the rank's GPU there: CUDA's current device is per
    thread) runs on each new engine thread, before the first op it runs."""
    seen = []
    monkeypatch.setattr(work_module, "THREAD_START", [lambda: seen.append(("hook", threading.current_thread()))])
    eng = work_module.Engine("hook-test")
    gate = threading.Event()
    future = eng.submit(lambda: gate.wait(5) and seen.append(("op", threading.current_thread())))
    gate.set()
    future.result(timeout=5)
    assert [what for what, _ in seen] == ["hook", "op"], seen
    assert seen[0][1] is seen[1][1] is eng._thread and eng._thread is not threading.current_thread()
    eng.shutdown()
