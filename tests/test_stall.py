"""The stall inspector (issue 41; docs/reliability.md, section 2): an op that has waited
MPIDIST_STALL_WARNING seconds (default 60) gets one line on stderr naming the op, the group,
the sequence number, the ranks that have not arrived and what each is doing; where one of them
left the job, the job ends at once instead of at the 30-minute timeout. Plain ``mpiexec``, no
``python -m mpidist``."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import launcher_free_env

pytestmark = pytest.mark.launches  # starts MPI jobs of its own: make test-mpis runs it on every MPI

MPIEXEC = str(Path(sys.executable).with_name("mpiexec"))

# written for 2 ranks; at -n 3 rank 2 waits in recv for a sender that has finished
TWO_RANKS = """
import numpy as np, mpidist as dist
dist.init_process_group()
x = np.zeros(4)
if dist.get_rank() == 0:
    dist.send(x + 1, dst=1)
else:
    dist.recv(x, src=0)
dist.destroy_process_group()
"""

# rank 1 arrives 4 s late at an all_reduce: a stall, not a failure
LATE = """
import time, numpy as np, mpidist as dist
dist.init_process_group()
if dist.get_rank() == 1:
    time.sleep(4)
dist.all_reduce(np.ones(4))
dist.destroy_process_group()
"""

# rank 2 holds the GIL for 8 s (its watchdog cannot answer): the final comparison of ranks 0
# and 1 gives up past the 5 s timeout, they leave (their watchdogs say goodbye), and rank 2's
# receive from rank 0 then waits for a rank that is gone
GONE = """
import sys, time, numpy as np, mpidist as dist
dist.init_process_group()
dist.all_reduce(np.ones(1))  # (the group's first collective makes its check's communicators)
if dist.get_rank() == 2:
    sys.setswitchinterval(1000.0)
    t = time.monotonic()
    while time.monotonic() - t < 8:
        pass
    sys.setswitchinterval(0.005)
    dist.recv(np.zeros(4), src=0)
dist.destroy_process_group()
"""


def start(n: int, code: str, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [MPIEXEC, "-n", str(n), sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=launcher_free_env(OMP_NUM_THREADS="1", **env),
    )


def finish(job: subprocess.Popen, t0: float, limit: float) -> tuple[int, str, float]:
    try:
        _, err = job.communicate(timeout=max(1.0, limit - (time.monotonic() - t0)))
    except subprocess.TimeoutExpired:
        job.kill()
        _, err = job.communicate()
        pytest.fail(f"the job ran past {limit} s:\n{err}")
    return job.returncode, err, time.monotonic() - t0


def short_cases(tmp_path: Path) -> None:
    """A rank 4 s late (one line, the job succeeds; none with the warning off), and a peer
    that left after its final comparison gave up (its goodbye: the receive ends at once)."""
    rc, err, _ = finish(start(2, LATE, MPIDIST_STALL_WARNING="2"), time.monotonic(), 60)
    assert rc == 0, err
    [line] = [s for s in err.splitlines() if "stall inspector" in s]
    assert line.startswith(
        "[rank 0] mpidist stall inspector: [rank 0/2] all_reduce: has waited 2 s (MPIDIST_STALL_WARNING) on "
        "group 'default_pg' (ranks [0, 1]) at sequence number 0 (shape (4,), dtype float64); ranks that had not "
        "arrived: [1] (rank 1 has issued 0 collectives on this group; its latest op: "
    ), err

    rc, err, _ = finish(start(2, LATE, MPIDIST_STALL_WARNING="0"), time.monotonic(), 60)
    assert rc == 0 and "stall" not in err, err

    t1 = time.monotonic()
    rc, err, took = finish(
        start(3, GONE, MPIDIST_STALL_WARNING="2", MPIDIST_TIMEOUT="5", MPIDIST_TRACE_DIR=str(tmp_path / "gone")), t1, 60
    )
    assert rc != 0 and took < 30, err
    assert (
        "[rank 2] mpidist.errors.DistError: [rank 2/3] recv: has waited 2 s (MPIDIST_STALL_WARNING) for rank 0 "
        "(point-to-point op #0 on group 'default_pg', shape (4,), dtype float64); what the peer is doing: rank 0: "
        "did not answer; rank(s) [0] left the job and can never arrive." in err
    ), err


def test_stall_defaults_end_a_stalled_job_within_120_s(tmp_path):
    """The issue's case, with the default timeout (30 min) and warning (60 s): the job ends
    within 120 s. The short cases run meanwhile (the long job only waits). Left out on the
    other MPIs (make test-mpis: a minute each, of CI's 45; the short cases alone passed there
    when written, in 26 s on Open MPI)."""
    t0 = time.monotonic()
    default = start(3, TWO_RANKS, MPIDIST_TRACE_DIR=str(tmp_path / "default"))
    short_cases(tmp_path)
    rc, err, took = finish(default, t0, 120)
    assert rc != 0, err
    assert (
        "[rank 2] mpidist.errors.DistError: [rank 2/3] recv: has waited 60 s (MPIDIST_STALL_WARNING) for rank 0 "
        "(point-to-point op #0 on group 'default_pg', shape (4,), dtype float64); what the peer is doing: rank 0: "
        "destroy_process_group #0 on group 'default_pg' (started " in err
    ), err
    assert "leaving the job; rank(s) [0] left the job and can never arrive." in err
    assert "[rank 2] aborting the job" in err
