"""ProcessGroup.abort() and ProcessGroup.shutdown() (torch's; issue 15): pending ops end
with an error, the group refuses later ops; shutdown finishes them first. Also a timed-out
op's get_future_result() (MPIDIST_ABORT_ON_TIMEOUT=0, in a job of its own)."""

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

from mpidist._core import recorder as R
from mpidist._runtime import world as runtime
from mpidist.work import WorkResult

pytestmark = pytest.mark.launches  # starts MPI jobs or processes of its own: make test-mpis runs it on every MPI

MPIEXEC = str(Path(sys.executable).with_name("mpiexec"))
WAIT_S = 30


def unusable(dist, op: str, name: str) -> str:
    return (
        rf"^\[rank {dist.get_rank()}/{dist.get_world_size()}\] {op}: group {re.escape(repr(name))} is "
        rf"unusable: aborted by ProcessGroup\.abort\(\)$"
    )


def every_op_refused(dist, group, name: str) -> None:
    """Every kind of op on an aborted group raises DistError at once, before communicating."""
    rank, size = dist.get_rank(), dist.get_world_size()
    x = np.ones(2)
    peer = (rank + 1) % size
    calls = [
        ("all_reduce", lambda: dist.all_reduce(x, group=group)),  # the 8-byte inline path
        ("all_reduce", lambda: dist.all_reduce(np.ones(1 << 16), group=group)),
        ("all_reduce", lambda: dist.all_reduce(x, group=group, async_op=True)),
        ("broadcast", lambda: dist.broadcast(x, rank, group=group)),
        ("all_gather_into_tensor", lambda: dist.all_gather_into_tensor(np.empty(2 * size), x, group=group)),
        ("barrier", lambda: dist.barrier(group=group)),
        ("broadcast_object_list", lambda: dist.broadcast_object_list([1], rank, group=group)),
    ]
    if size > 1:
        calls += [
            ("send", lambda: dist.send(x, peer, group=group)),
            ("recv", lambda: dist.recv(x, peer, group=group)),
            ("isend", lambda: dist.isend(x, peer, group=group)),
            ("irecv", lambda: dist.irecv(x, None, group=group)),
            ("batch_isend_irecv", lambda: dist.batch_isend_irecv([dist.P2POp(dist.irecv, x, peer, group)])),
            ("send_object_list", lambda: dist.send_object_list([1], peer, group=group)),
            ("recv_object_list", lambda: dist.recv_object_list([None], group=group)),
        ]
    for op, call in calls:
        with pytest.raises(dist.DistError, match=unusable(dist, op, name)):
            call()


@pytest.mark.mpi
def test_abort_refuses_every_later_op_and_destroy_forgets_the_group(dist, world):
    """Every rank aborts: nothing was pending. destroy_process_group frees nothing after an
    abort (nothing collective), and the other groups go on."""
    rank, size = world
    group = dist.new_group()
    g = runtime.resolve_group(group)
    x = np.ones(3)
    dist.all_reduce(x, group=group)
    assert g.abort() is None and g.abort() is None  # idempotent
    every_op_refused(dist, group, g.group_name)
    dist.destroy_process_group(group)
    assert g.destroyed
    with pytest.raises(ValueError, match="was destroyed"):
        dist.all_reduce(x, group=group)
    dist.all_reduce(x)
    np.testing.assert_array_equal(x, np.full(3, float(size * size)))


def wait_started(rec: list) -> None:
    deadline = time.monotonic() + WAIT_S
    while rec[R.STATE] is not R.STARTED:
        assert time.monotonic() < deadline, "the op never started"
        time.sleep(1e-3)


@pytest.mark.mpi(min_size=2)
def test_abort_ends_pending_ops_with_an_error(dist, world):
    """Rank 0 queues three all_reduces on a group its peers do not join yet: the first is
    inside MPI, the others queued. abort(): all three end with DistError at once (the
    first goes on inside MPI until the peers join it), and later ops are refused."""
    rank, size = world
    group = dist.new_group()
    g = runtime.resolve_group(group)
    name = g.group_name
    if rank == 0:
        xs = [np.full(4, 1.0 + i) for i in range(3)]
        works = [dist.all_reduce(x, group=group, async_op=True) for x in xs]
        results = [w.get_future_result() for w in works]
        wait_started(works[0]._rec)
        assert not any(w.is_completed() for w in works)
        g.abort()
        where = rf"^\[rank 0/{size}\] all_reduce: group {re.escape(repr(name))} was aborted by ProcessGroup\.abort\(\) "
        for i, w in enumerate(works):
            when = (
                ("while this op was in progress; MPI cannot interrupt it, so its output arrays may still be written")
                if i == 0
                else "before this op started"
            )
            with pytest.raises(dist.DistError, match=where + re.escape(when) + "$"):
                w.wait()
            assert w.is_completed() and not w.is_success() and isinstance(w.exception(), dist.DistError)
            assert results[i].result(timeout=WAIT_S) is WorkResult.COMM_ERROR
            with pytest.raises(dist.DistError):
                w.get_future().result(timeout=WAIT_S)
            assert w._rec[R.STATE] == R.FAILED  # the watchdog no longer watches it
        every_op_refused(dist, group, name)
        np.testing.assert_array_equal(xs[1], np.full(4, 2.0))  # the queued ones never ran
        np.testing.assert_array_equal(xs[2], np.full(4, 3.0))
    MPI.COMM_WORLD.Barrier()
    if rank != 0:  # join the one rank 0 had started, so that its MPI call returns
        x = np.full(4, 1.0)
        dist.all_reduce(x, group=group)
        np.testing.assert_array_equal(x, np.full(4, float(size)))
    else:
        deadline = time.monotonic() + WAIT_S
        while works[0]._rec[R.STATE] is not R.COMPLETED:  # it ended in the background
            assert time.monotonic() < deadline
            time.sleep(1e-3)
        np.testing.assert_array_equal(xs[0], np.full(4, float(size)))  # ... and wrote its output
    dist.destroy_process_group(group)
    x = np.ones(1)
    dist.all_reduce(x)
    assert x[0] == size


@pytest.mark.mpi(min_size=2)
def test_abort_fails_a_sync_op_waiting_behind_a_stuck_one(dist, world):
    """A sync op queued behind an async op stuck in MPI: abort() from another thread makes
    the waiting caller raise DistError."""
    rank, size = world
    group = dist.new_group()
    g = runtime.resolve_group(group)
    if rank == 0:
        first = dist.all_reduce(np.ones(2), group=group, async_op=True)
        wait_started(first._rec)
        t = __import__("threading").Timer(0.2, g.abort)
        t.start()
        with pytest.raises(
            dist.DistError,
            match=r"broadcast: group .* was aborted by ProcessGroup\.abort\(\) "
            r"before this op started$",
        ):
            dist.broadcast(np.ones(2), 0, group=group)
        t.join()
    MPI.COMM_WORLD.Barrier()
    if rank != 0:
        dist.all_reduce(np.ones(2), group=group)
    dist.destroy_process_group(group)


@pytest.mark.mpi
def test_shutdown_finishes_pending_ops_then_frees_the_group(dist, world):
    rank, size = world
    group = dist.new_group()
    g = runtime.resolve_group(group)
    xs = [np.full(1000, float(rank + i)) for i in range(4)]
    works = [dist.all_reduce(x, group=group, async_op=True) for x in xs]
    g.shutdown()
    assert g.destroyed and g.comm is None
    for i, (w, x) in enumerate(zip(works, xs)):
        assert w.is_completed() and w.wait()
        np.testing.assert_array_equal(x, np.full(1000, size * (size - 1) / 2 + size * i))
    with pytest.raises(ValueError, match="was destroyed"):
        dist.all_reduce(xs[0], group=group)
    g.shutdown()  # idempotent


@pytest.mark.mpi
def test_abort_then_shutdown_frees_nothing(dist, world):
    rank, size = world
    group = dist.new_group()
    g = runtime.resolve_group(group)
    dist.all_reduce(np.ones(4), group=group, algorithm="ring")  # a ring communicator to leave alone
    comms = (g.comm, g._ring_comm)
    g.abort()
    g.shutdown()
    assert g.destroyed and all(c != MPI.COMM_NULL for c in comms)  # not freed: left to the process's end
    for c in comms:
        c.Free()  # (the test frees them itself, collectively, to leave nothing behind)


JOB = """
import sys, time, numpy as np, mpidist
from mpi4py import MPI
from mpidist._core import recorder as R
mpidist.init_process_group()
rank = mpidist.get_rank()
if rank == 0:
    log = open(f"{sys.argv[1]}/rank0.txt", "w")
    work = mpidist.all_reduce(np.ones(2), async_op=True)  # rank 1 joins only at the end
    print(repr(work.get_future_result().result(timeout=60)), file=log)
    print(work.is_completed(), file=log)
    mpidist.group.WORLD.abort()  # ends the stuck op's Work
    try:
        work.wait()
    except mpidist.DistError as exc:
        print(type(exc).__name__, file=log)
    log.close()
MPI.COMM_WORLD.Barrier()
if rank == 1:
    mpidist.all_reduce(np.ones(2))  # lets rank 0's stuck MPI call return, so MPI can finalize
else:
    while work._rec[R.STATE] is not R.COMPLETED:
        time.sleep(0.01)
mpidist.destroy_process_group()
"""


def test_timed_out_op_gives_timeout_in_get_future_result(tmp_path):
    """MPIDIST_ABORT_ON_TIMEOUT=0: the watchdog declares the op timed out; the result
    future says TIMEOUT although the op never ends; abort() then fails its Work."""
    script = tmp_path / "job.py"
    script.write_text(JOB)
    t0 = time.monotonic()
    job = subprocess.run(
        [MPIEXEC, "-n", "2", sys.executable, str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=launcher_free_env(
            MPIDIST_TIMEOUT="1",
            MPIDIST_ABORT_ON_TIMEOUT="0",
            OMP_NUM_THREADS="1",
            MPIDIST_TRACE_DIR=str(tmp_path / "trace"),
        ),
    )
    assert job.returncode == 0, job.stdout + job.stderr
    assert time.monotonic() - t0 < 60
    assert (tmp_path / "rank0.txt").read_text().splitlines() == ["<WorkResult.TIMEOUT: 1>", "False", "DistError"]
