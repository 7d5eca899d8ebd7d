"""Ops issued from a Work future's callback (issue 14, item 7).

A future's callbacks run on the thread running the group's ops; torch's PowerSGD hook
issues an all-reduce there and waits on it. Such an op runs at once on that thread,
sync or async, in both timeout modes (with MPIDIST_ABORT_ON_TIMEOUT=0 every sync op is
otherwise queued on the engine, which is the thread that would wait for it: a
deadlock before the fix). Past its timeout such an op aborts the job in every mode.
"""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import launcher_free_env
from test_comm_hooks import grads_after_step, same_on_every_rank

from mpidist import work
from mpidist._dispatch.dispatch import launch
from mpidist.parallel.comm_hooks import PowerSGDState, powerSGD_hook, then

pytestmark = pytest.mark.launches  # starts MPI jobs or processes of its own: make test-mpis runs it on every MPI

MPIEXEC = str(Path(sys.executable).with_name("mpiexec"))


@pytest.fixture(params=["abort", "no-abort"])
def timeout_mode(request, monkeypatch):
    """Both MPIDIST_ABORT_ON_TIMEOUT modes, as init_process_group sets them (work's flags)."""
    abort = request.param == "abort"
    monkeypatch.setattr(work, "ABORT_ON_TIMEOUT", abort)
    monkeypatch.setattr(work.Engine, "inline", abort)
    return request.param


@pytest.mark.mpi(min_size=2)
def test_a_callback_issues_and_waits_on_ops_of_its_own_group(dist, world, timeout_mode):
    rank, size = world
    x = np.full(4, rank + 1.0)
    seen = []

    def callback(done: concurrent.futures.Future) -> float:
        y = np.full(3, float(rank))
        dist.all_reduce(y)  # sync, on the engine thread
        z = np.ones(2)
        w = dist.all_reduce(z, async_op=True)  # async, then waited on: PowerSGD's pattern
        # on the thread running the group's ops it ran at once (else: the op had completed
        # before the callback was attached, and the callback runs on the attaching thread)
        assert w.is_completed() or not dist.group.WORLD.engine.on_runner()
        w.wait()
        seen.append((y.copy(), z.copy()))
        return float(done.result()[0][0])

    first = dist.all_reduce(x, async_op=True)
    chained = then(first.get_future(), callback)  # attached at once, as torch's hooks do
    later = dist.broadcast(np.arange(3.0) if rank == 0 else np.zeros(3), 0, async_op=True)  # queued behind
    assert chained.result(timeout=60) == size * (size + 1) / 2
    later.wait()
    y, z = seen[0]
    assert np.array_equal(y, np.full(3, size * (size - 1) / 2)) and np.array_equal(z, np.full(2, float(size)))
    after = np.ones(1)
    dist.all_reduce(after)  # the group is in step on every rank afterwards
    assert after[0] == size


@pytest.mark.mpi(min_size=2)
def test_powersgd_compressed_steps_run_in_both_timeout_modes(dist, world, timeout_mode):
    state = PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2)
    for step in range(4):  # two plain steps, then compressed ones
        grads = grads_after_step(powerSGD_hook, state, step=step)
    assert state.iter == 4
    assert same_on_every_rank(grads)


NESTED_STUCK = """
import numpy as np, mpidist
from mpidist.parallel.comm_hooks import then
mpidist.init_process_group()
x = np.ones(4)
if mpidist.get_rank() == 0:
    w = mpidist.all_reduce(x, async_op=True)
    then(w.get_future(), lambda f: mpidist.all_reduce(np.ones(2))).result()
else:
    mpidist.all_reduce(x)
    import time; time.sleep(60)  # never joins the callback's all_reduce
"""


def test_a_stuck_op_issued_from_a_callback_aborts_even_without_abort_on_timeout(tmp_path):
    script = tmp_path / "nested.py"
    script.write_text(NESTED_STUCK)
    t0 = time.monotonic()
    out = subprocess.run(
        [MPIEXEC, "-n", "2", sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        env=launcher_free_env(
            MPIDIST_TIMEOUT="1", MPIDIST_ABORT_ON_TIMEOUT="0", MPIDIST_TRACE_DIR=str(tmp_path / "trace")
        ),
    )
    assert out.returncode != 0
    assert time.monotonic() - t0 < 30
    assert (
        "[rank 0] mpidist.errors.DistError: [rank 0/2] all_reduce: timed out after 1 s, the timeout "
        "of group 'default_pg' "
        "(ranks [0, 1]) at sequence number 1"
    ) in out.stderr, out.stderr
    assert "aborting the job although MPIDIST_ABORT_ON_TIMEOUT=0: the op was issued from a callback" in out.stderr


@pytest.mark.mpi(min_size=2)
def test_a_callbacks_op_takes_its_place_in_the_sequence_numbers(dist, world):
    """On rank 0 the op is done before the callback is attached, so the callback runs on the
    attaching thread and its all_reduce is issued (and numbered) before the async op issued
    after the attach; on the other ranks the callback runs on the engine, after that async op
    was queued (and numbered). The callback's op runs first everywhere and takes the earlier
    sequence number everywhere: the members' check of every new call, which compares
    sequence numbers, agrees (before the renumbering: a mismatch error on every rank)."""
    rank, size = world
    g = dist.new_group()  # a fresh group: its calls are all new, so each one is compared
    x = np.ones(4)
    if rank == 0:
        time.sleep(0.3)  # the others attach their callback while their op still waits for this rank
    first = dist.all_reduce(x, group=g, async_op=True)
    if rank == 0:
        first.wait()
    y = np.full(2, float(rank))
    chained = then(first.get_future(), lambda f: dist.all_reduce(y, group=g))
    later = dist.all_reduce(np.ones(3), group=g, async_op=True)
    chained.result(timeout=60)
    later.wait()
    assert np.array_equal(y, np.full(2, size * (size - 1) / 2))
    key = dist._core.recorder.group_key(g)  # (unique, where names of earlier groups may repeat)
    seqs = {e["op"] + str(e["shapes"]): e["seq"] for e in dist._core.recorder.snapshot() if e["group_key"] == key}
    assert seqs == {"all_reduce[4]": 0, "all_reduce[2]": 1, "all_reduce[3]": 2}, seqs
    dist.destroy_process_group(g)


@pytest.mark.mpi(min_size=2)
def test_an_op_numbered_while_a_callbacks_op_runs_is_numbered_after_it(dist, world, monkeypatch):
    """The caller issues an async op while the callback of its previous op runs on the engine
    and issues an op of its own. Whichever of them is numbered first, the numbers must follow
    the order they run in (the callback's op runs first: the caller's is queued behind). Here
    the caller's op is held between being recorded and being queued until the callback has
    run (its op done): a full mpiexec -n 2 run of the suite once hit that window, and the callback's op was
    numbered after the caller's while it ran before it, on one rank only (a mismatch error)."""
    rank, size = world
    g = dist.new_group()
    gate, ran = threading.Event(), threading.Event()
    first = launch(
        dist._runtime.world.resolve_group(g), "barrier", gate.wait, (10,), True, checked=False
    )  # on the engine

    def callback(f: concurrent.futures.Future) -> None:
        dist.all_reduce(np.ones(2), group=g)  # issued on the engine thread
        ran.set()

    chained = then(first.get_future(), callback)
    submit = work.Engine.submit

    def held_submit(self, *args, **kwargs):
        if threading.current_thread() is threading.main_thread() and not ran.is_set():
            gate.set()  # the engine finishes `first` and runs the callback, while this op waits to be queued
            assert ran.wait(30)
        return submit(self, *args, **kwargs)

    monkeypatch.setattr(work.Engine, "submit", held_submit)
    later = dist.all_reduce(np.ones(3), group=g, async_op=True)
    monkeypatch.setattr(work.Engine, "submit", submit)
    chained.result(timeout=60)
    later.wait()
    key = dist._core.recorder.group_key(g)
    seqs = {e["op"] + str(e["shapes"]): e["seq"] for e in dist._core.recorder.snapshot() if e["group_key"] == key}
    assert seqs == {"barrierNone": 0, "all_reduce[2]": 1, "all_reduce[3]": 2}, seqs
    dist.destroy_process_group(g)
