"""Timeouts: init_process_group's timeout (default 30 min, MPIDIST_TIMEOUT overrides) bounds
blocking collectives, Work.wait and blocking point-to-point. Past it the rank raises a
DistError naming the op, group, sequence number and the ranks that had not arrived, then
aborts the job (tests/test_faults.py), or with MPIDIST_ABORT_ON_TIMEOUT=0 raises it in the
caller (here), even though the stuck MPI call never returns."""

from __future__ import annotations

import datetime
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import launcher_free_env

from mpidist._core import recorder

pytestmark = pytest.mark.launches  # starts MPI jobs or processes of its own: make test-mpis runs it on every MPI

MPIEXEC = str(Path(sys.executable).with_name("mpiexec"))


def job(n: int, script: Path, *args: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [MPIEXEC, "-n", str(n), sys.executable, "-m", "mpidist", str(script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=launcher_free_env(OMP_NUM_THREADS="1", **env),
    )


@pytest.mark.mpi
def test_default_timeout_is_30_minutes(dist):
    if "MPIDIST_TIMEOUT" in os.environ:
        pytest.skip("MPIDIST_TIMEOUT is set in this environment")
    assert dist._runtime.world.state().timeout == datetime.timedelta(minutes=30)
    assert recorder.timeout == 1800.0


@pytest.mark.mpi
def test_ops_carry_the_timeout_and_complete(dist, world):
    x = np.ones(2)
    dist.all_reduce(x)
    w = dist.all_reduce(x, async_op=True)
    assert w.wait() is True
    recent = recorder.snapshot()[-2:]
    assert [(e["op"], e["state"], e["timeout_s"]) for e in recent] == [
        ("all_reduce", "completed", recorder.timeout)
    ] * 2


def run_code(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=launcher_free_env(**env)
    )


def test_env_overrides_the_argument():
    code = (
        "import datetime, mpidist\nmpidist.init_process_group(timeout=datetime.timedelta(minutes=5))\n"
        "print(mpidist._runtime.world.state().timeout.total_seconds(), mpidist._core.recorder.timeout)"
    )
    out = run_code(code, MPIDIST_TIMEOUT="2.5")
    assert out.stdout == "2.5 2.5\n", out.stderr
    out = run_code(code)
    assert out.stdout == "300.0 300.0\n", out.stderr


@pytest.mark.mpi
def test_bad_timeout_argument(dist):
    dist.destroy_process_group()
    try:
        with pytest.raises(TypeError, match=r"init_process_group: timeout must be a datetime.timedelta, got int$"):
            dist.init_process_group(timeout=30)
        with pytest.raises(ValueError, match=r"init_process_group: timeout must be positive, got -1 day"):
            dist.init_process_group(timeout=datetime.timedelta(seconds=-5))
    finally:
        dist.init_process_group()


NO_ABORT = """
import os, sys, time, numpy as np, mpidist
from mpi4py import MPI
mpidist.init_process_group()
rank = mpidist.get_rank()
log = open(os.path.join(sys.argv[1], f"rank{rank}.txt"), "w")
x = np.ones(3)
mpidist.all_reduce(x)
if rank == 0:
    g = mpidist.new_group([0, 1])
    pending = []
    for name, call in [("sync", lambda: mpidist.all_reduce(x)),
                       ("after", lambda: mpidist.broadcast(x, 0)),
                       ("wait", lambda: mpidist.all_reduce(x, group=g, async_op=True).wait()),
                       ("recv", lambda: mpidist.recv(np.zeros(2), 1)),
                       ("irecv", lambda: pending.append(mpidist.irecv(np.zeros(2), 1)) or pending[0].wait())]:
        t = time.monotonic()
        try:
            call()
            print(f"{name}: no error", file=log)
        except mpidist.DistError as exc:
            print(f"{name} after {time.monotonic() - t:.1f} s: {exc}", file=log)
    log.flush()
    MPI.COMM_WORLD.Barrier()
    pending[0].wait(timeout=30)  # rank 1's second message (its first went to the recv given up on)
    MPI.COMM_WORLD.Barrier()
else:
    mpidist.new_group([0, 1])
    MPI.COMM_WORLD.Barrier()   # rank 0 is done with its timeouts
    mpidist.all_reduce(x)      # joins the two collectives rank 0 gave up on
    mpidist.all_reduce(x, group=mpidist._runtime.world.state().groups[0])
    mpidist.send(np.ones(2), 0)
    mpidist.send(np.ones(2), 0)
    MPI.COMM_WORLD.Barrier()
print("done", file=log)
"""


def test_no_abort_mode_raises_dist_error_in_the_caller(tmp_path):
    script = tmp_path / "noabort.py"
    script.write_text(NO_ABORT)
    trace_dir = tmp_path / "trace"
    t0 = time.monotonic()
    out = job(
        2, script, str(tmp_path), MPIDIST_TIMEOUT="1", MPIDIST_ABORT_ON_TIMEOUT="0", MPIDIST_TRACE_DIR=str(trace_dir)
    )
    assert out.returncode == 0, out.stderr
    assert time.monotonic() - t0 < 40
    lines = (tmp_path / "rank0.txt").read_text().splitlines()
    assert [line.split(" after ")[0] for line in lines] == ["sync", "after", "wait", "recv", "irecv", "done"]
    took = {name: float(t) for name, t in (re.match(r"(\w+) after ([\d.]+) s: ", line).groups() for line in lines[:5])}
    assert took["after"] < 0.5, took  # a group that timed out fails at once
    assert all(0.9 <= took[k] < 8 for k in ("sync", "wait", "recv", "irecv")), took  # timeout 1 s, then the probe
    errors = [line.split(" s: ", 1)[1] for line in lines[:5]]
    where = (
        f"flight recorder written to {trace_dir}/rank0.json (and by every rank that answered); "
        f"run `python -m mpidist.tools.trace {trace_dir}`"
    )
    assert errors[0] == (
        "[rank 0/2] all_reduce: timed out after 1 s, the timeout of group 'default_pg' (ranks [0, "
        "1]) at sequence number 1 "
        "(shape (3,), dtype float64); ranks that had not arrived: [1] (rank 1 has issued 1 collectives on this "
        f"group; its latest op: all_reduce #0 on group 'default_pg' (completed)). {where}"
    )
    assert errors[1] == (
        "[rank 0/2] broadcast: group 'default_pg' is unusable: all_reduce #1 timed out; destroy the group (or exit)"
    )
    assert re.fullmatch(
        r"\[rank 0/2\] all_reduce: timed out after 1 s, the timeout of group 'group1:\[0, 1\]' \(ranks "
        r"\[0, 1\]\) at sequence number 0 \(shape \(3,\), dtype float64\); ranks that had not "
        r"arrived: \[1\] \(rank 1 has issued 0 collectives on this group; its latest op: .*\)\. " + re.escape(where),
        errors[2],
    ), errors[2]
    for error, op in zip(errors[3:], ("recv", "irecv")):
        assert re.fullmatch(
            rf"\[rank 0/2\] {op}: timed out after 1 s waiting for rank 1 \(point-to-point op #\d "
            rf"on group 'default_pg', shape \(2,\), dtype float64\); what the peer is doing: "
            rf"rank 1: .*\. " + re.escape(where),
            error,
        ), error
    assert (tmp_path / "rank1.txt").read_text() == "done\n"


ABORT_WAIT = """
import time, numpy as np, mpidist
mpidist.init_process_group()
x = np.ones(4)
if mpidist.get_rank() == 0:
    work = mpidist.all_reduce(x, async_op=True)
    work.wait()
else:
    time.sleep(60)  # never joins
"""


def test_work_wait_past_the_timeout_aborts_the_job(tmp_path):
    script = tmp_path / "wait.py"
    script.write_text(ABORT_WAIT)
    t0 = time.monotonic()
    out = job(2, script, MPIDIST_TIMEOUT="1.5", MPIDIST_TRACE_DIR=str(tmp_path))
    assert out.returncode == 1
    assert time.monotonic() - t0 < 20
    assert (
        "[rank 0] mpidist.errors.DistError: [rank 0/2] all_reduce: timed out after 1.5 s, the timeout of group "
        "'default_pg' (ranks [0, 1]) at sequence number 0 (shape (4,), dtype float64); ranks that had not "
        "arrived: [1]"
    ) in out.stderr


def test_sigterm_handler_is_restored_by_destroy():
    code = (
        "import signal, mpidist\nmpidist.init_process_group()\n"
        "print(signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)\nmpidist.destroy_process_group()\n"
        "print(signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, signal.set_wakeup_fd(-1))\n"
        "h = lambda *a: None\nsignal.signal(signal.SIGTERM, h)\nmpidist.init_process_group()\n"
        "print(signal.getsignal(signal.SIGTERM) is h)\n"
    )
    out = run_code(code)
    assert out.stdout == "False\nTrue -1\nTrue\n", out.stderr
