"""Faults, each in a real job under mpiexec and bounded in time: a rank that raises, a rank
killed with SIGKILL, mismatched collectives under MPIDIST_DEBUG=DETAIL, a rank that never
arrives (timeout and flight recorder), SIGTERM while stuck in MPI.

(SIGTERM to the main job flushing a checkpoint is tests/test_train_job.py.)
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import KILLED_STATUS, launcher_free_env

from mpidist.tools import trace

pytestmark = pytest.mark.launches  # starts MPI jobs or processes of its own: make test-mpis runs it on every MPI

MPIEXEC = str(Path(sys.executable).with_name("mpiexec"))

# A small data-parallel training loop: every rank computes a gradient of a least-squares
# model on its shard, all_reduce averages it, every rank steps.
TRAIN = """
import os, sys, time
import numpy as np
import mpidist

mpidist.init_process_group()
rank, world = mpidist.get_rank(), mpidist.get_world_size()
out = sys.argv[1]
open(os.path.join(out, f"pid{rank}"), "w").write(str(os.getpid()))
rng = np.random.default_rng(rank)
x, w_true = rng.normal(size=(64, 1000)), np.arange(1000.0)
y = x @ w_true
w = np.zeros(1000)
for step in range(10**9):
    grad = x.T @ (x @ w - y) / len(x)
    mpidist.all_reduce(grad, op=mpidist.ReduceOp.AVG)
    w -= 1e-3 * grad
    if step == 20:
        open(os.path.join(out, f"training{rank}"), "w").close()
    if step == int(os.environ.get("FAIL_AT", -1)) and rank == int(os.environ.get("FAIL_RANK", -1)):
        raise RuntimeError(f"injected fault at step {step}")
    if step == int(os.environ.get("STOP_AT", -1)):
        break
"""


def start(n: int, script: Path, *args: str, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [MPIEXEC, "-n", str(n), sys.executable, "-m", "mpidist", str(script), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=launcher_free_env(OMP_NUM_THREADS="1", **env),
    )


def finish(job: subprocess.Popen, limit: float) -> tuple[int, str, str, float]:
    """Wait at most ``limit`` s for the job (kill it if it overruns): (rc, out, err, seconds)."""
    t0 = time.monotonic()
    try:
        out, err = job.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        job.kill()
        out, err = job.communicate()
        raise AssertionError(f"the job did not end within {limit} s:\n{out}\n{err}") from None
    return job.returncode, out, err, time.monotonic() - t0


def wait_for(path: Path, limit: float = 60) -> None:
    deadline = time.monotonic() + limit
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear within {limit} s"
        time.sleep(0.05)


def test_rank_raising_mid_training_aborts_the_job_within_10_s(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    trace_dir = tmp_path / "trace"
    t0 = time.monotonic()
    job = start(3, script, str(tmp_path), FAIL_AT="30", FAIL_RANK="1", MPIDIST_TRACE_DIR=str(trace_dir))
    rc, _, err, _ = finish(job, 60)
    assert rc != 0
    assert time.monotonic() - t0 < 10, "job start to abort took 10 s or more"
    lines = err.splitlines()
    assert "[rank 1] Traceback (most recent call last):" in lines
    assert "[rank 1] RuntimeError: injected fault at step 30" in lines
    assert any(re.fullmatch(r'\[rank 1\]   File ".*train\.py", line \d+, in <module>', line) for line in lines)
    # every rank wrote its flight recorder before the abort: the others are inside all_reduce
    docs = trace.load(str(trace_dir))
    assert set(docs) == {0, 1, 2}
    assert docs[1]["reason"] == "abort: RuntimeError: injected fault at step 30"
    for r in (0, 2):
        assert docs[r]["entries"][-1]["op"] == "all_reduce" and docs[r]["entries"][-1]["state"] == "started"


def test_sigkill_mid_all_reduce_ends_the_job_within_30_s(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    job = start(2, script, str(tmp_path))
    try:
        wait_for(tmp_path / "training1")
        os.kill(int((tmp_path / "pid1").read_text()), signal.SIGKILL)
    except BaseException:
        job.kill()
        raise
    rc, _, err, took = finish(job, 30)
    assert took < 30
    assert rc == KILLED_STATUS, (rc, err)  # each launcher reports the killed rank its own way


MISMATCH = """
import os, sys, numpy as np, mpidist
mpidist.init_process_group()
rank = mpidist.get_rank()
log = open(os.path.join(sys.argv[1], f"rank{rank}.txt"), "w")
cases = {
    "count": lambda: mpidist.all_reduce(np.ones(4 + rank)),
    "op": lambda: mpidist.all_reduce(np.ones(4)) if rank == 0 else mpidist.broadcast(np.ones(4), 0),
    "reduce op": lambda: mpidist.all_reduce(np.ones(4), op=mpidist.ReduceOp.MAX if rank else mpidist.ReduceOp.SUM),
    "root": lambda: mpidist.broadcast(np.ones(4), src=rank),
}
for name, call in cases.items():
    try:
        call()
        print(f"rank {rank} {name}: no error", file=log)
    except ValueError as exc:
        print(f"rank {rank} {name}: {exc}", file=log)
x = np.ones(2)
mpidist.all_reduce(x)  # the group is still usable
print(f"rank {rank} after: {x.tolist()}", file=log)
"""


def test_mismatched_collectives_are_caught_under_detail(tmp_path):
    script = tmp_path / "mismatch.py"
    script.write_text(MISMATCH)
    rc, out, err, _ = finish(start(2, script, str(tmp_path), MPIDIST_DEBUG="DETAIL"), 60)
    assert rc == 0, err
    for r in (0, 1):
        assert (tmp_path / f"rank{r}.txt").read_text().splitlines() == [
            f"rank {r} count: [rank {r}/2] all_reduce: the members of group 'default_pg' "
            f"called mismatched collectives (they differ in count): rank 0: all_reduce(seq=0, count=4, "
            f"dtype=float64, op=SUM); rank 1: all_reduce(seq=0, count=5, dtype=float64, op=SUM)",
            f"rank {r} op: [rank {r}/2] {'all_reduce' if r == 0 else 'broadcast'}: the "
            f"members of group 'default_pg' called mismatched collectives (they differ in op, root, reduce op): "
            f"rank 0: all_reduce(seq=1, count=4, dtype=float64, op=SUM); rank 1: broadcast(seq=1, count=4, "
            f"dtype=float64, root=0)",
            f"rank {r} reduce op: [rank {r}/2] all_reduce: the members of group "
            f"'default_pg' called mismatched collectives (they differ in reduce op): rank 0: all_reduce(seq=2, "
            f"count=4, dtype=float64, op=SUM); rank 1: all_reduce(seq=2, count=4, dtype=float64, op=MAX)",
            f"rank {r} root: [rank {r}/2] broadcast: the members of group 'default_pg' "
            f"called mismatched collectives (they differ in root): rank 0: broadcast(seq=3, count=4, "
            f"dtype=float64, root=0); rank 1: broadcast(seq=3, count=4, dtype=float64, root=1)",
            f"rank {r} after: [2.0, 2.0]",
        ]


NEVER_ARRIVES = """
import time, numpy as np, mpidist
mpidist.init_process_group()
g = mpidist.new_group([0, 1, 2])
x = np.ones(3)
for _ in range(3):
    mpidist.all_reduce(x)
mpidist.broadcast(x, 0, group=g)
if mpidist.get_rank() == 1:
    time.sleep(120)  # never arrives
mpidist.all_reduce(x)
"""


def test_rank_that_never_arrives_trips_the_timeout_and_the_recorder(tmp_path):
    script = tmp_path / "late.py"
    script.write_text(NEVER_ARRIVES)
    trace_dir = tmp_path / "trace"
    rc, _, err, took = finish(start(3, script, MPIDIST_TIMEOUT="2", MPIDIST_TRACE_DIR=str(trace_dir)), 60)
    assert rc != 0 and took < 20
    # rank 0 and rank 2 both time out; the first to do so names the op, group, sequence
    # number and rank 1, and aborts the job
    found = re.search(r"\[rank (\d)\] aborting the job", err)
    assert found, err
    first = int(found.group(1))
    assert first in (0, 2), err
    assert (
        f"[rank {first}] mpidist.errors.DistError: [rank {first}/3] all_reduce: timed out after 2 "
        f"s, the timeout of group "
        f"'default_pg' (ranks [0, 1, 2]) at sequence number 3 (shape (3,), dtype float64); ranks that had "
        f"not arrived: [1] (rank 1 has issued 3 collectives on this group; its latest op: broadcast #0 on "
        f"group 'group1:[0, 1, 2]' (completed)). flight recorder written to {trace_dir}/rank{first}.json "
        f"(and by every rank that answered); run `python -m mpidist.tools.trace {trace_dir}`"
    ) in err
    assert "aborting the job (set MPIDIST_ABORT_ON_TIMEOUT=0" in err
    docs = trace.load(str(trace_dir))
    assert set(docs) == {0, 1, 2}, "every rank dumps: the one that timed out asks the others to"
    assert docs[1]["entries"][-1]["op"] == "broadcast"
    found = trace.analyse(docs)
    assert [(f["kind"], f["ranks"], f["seq"], f["name"]) for f in found] == [("not arrived", [1], 3, "default_pg")]
    out = subprocess.run(
        [sys.executable, "-m", "mpidist.tools.trace", str(trace_dir)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 1
    assert out.stdout.splitlines()[-1] == (
        "verdict: rank(s) [1] diverged first, on group 'default_pg' at sequence number 3 (not arrived)"
    )


STUCK = """
import os, sys, numpy as np, mpidist
mpidist.init_process_group()
rank = mpidist.get_rank()
open(os.path.join(sys.argv[1], f"pid{rank}"), "w").write(str(os.getpid()))
x = np.ones(3)
mpidist.all_reduce(x)
if rank == 0:
    mpidist.all_reduce(x)  # rank 1 never joins: rank 0 is stuck inside MPI
else:
    import time; time.sleep(120)
"""


def test_sigterm_dumps_the_recorder_even_inside_mpi(tmp_path):
    script = tmp_path / "stuck.py"
    script.write_text(STUCK)
    trace_dir = tmp_path / "trace"
    job = start(2, script, str(tmp_path), MPIDIST_TRACE_DIR=str(trace_dir))
    try:
        wait_for(tmp_path / "pid0")
        wait_for(tmp_path / "pid1")
        time.sleep(1.0)  # rank 0 is in its second all_reduce
        job.send_signal(signal.SIGTERM)  # mpiexec passes it on to every rank
    except BaseException:
        job.kill()
        raise
    rc, _, _, took = finish(job, 30)
    assert rc != 0 and took < 30
    docs = trace.load(str(trace_dir))
    assert set(docs) == {0, 1} and {d["reason"] for d in docs.values()} == {"SIGTERM"}
    last = docs[0]["entries"][-1]
    assert (last["op"], last["seq"], last["state"]) == ("all_reduce", 1, "started")
    report = json.dumps(docs[1]["entries"][-1])
    assert '"seq": 0' in report and '"state": "completed"' in report


def test_sigterm_caught_by_the_program_dumps_only_if_the_rank_is_still_alive_after_the_grace(tmp_path):
    """The program's own SIGTERM handler (a clean stop's) stays; a rank stuck in MPI cannot run
    it, so the watchdog writes the recorder SIGTERM_GRACE s after the signal (3 s here, not 10:
    CI's time), and the timeout then ends the job as it would have."""
    script = tmp_path / "stuck.py"
    grace = "import mpidist._runtime.watchdog as W\nW.SIGTERM_GRACE = 3.0\n"
    script.write_text("import signal\nsignal.signal(signal.SIGTERM, lambda *a: None)\n" + grace + STUCK)
    trace_dir = tmp_path / "trace"
    job = start(2, script, str(tmp_path), MPIDIST_TRACE_DIR=str(trace_dir), MPIDIST_TIMEOUT="9")
    try:
        wait_for(tmp_path / "pid0")
        wait_for(tmp_path / "pid1")
        time.sleep(1.0)  # rank 0 is in its second all_reduce
        for r in (0, 1):  # to the ranks: Open MPI's mpirun would end the job on SIGTERM
            os.kill(int((tmp_path / f"pid{r}").read_text()), signal.SIGTERM)
        sent = time.monotonic()
        while not (trace_dir / "rank0.json").exists() and time.monotonic() < sent + 10:
            time.sleep(0.1)
        dumped = time.monotonic() - sent
        reason = json.loads((trace_dir / "rank0.json").read_text())["reason"]  # (the timeout's dump replaces it later)
    except BaseException:
        job.kill()
        raise
    rc, _, err, _ = finish(job, 60)
    assert 2.5 < dumped < 6, f"rank 0's recorder came {dumped:.1f} s after SIGTERM (grace 3 s)\n{err}"
    assert rc != 0 and "SIGTERM: flight recorder written" in err, err
    assert reason == "SIGTERM"
