"""Object collectives in a real job: a source that cannot pickle its object, then a retry
(issue 14, item 5), bounded in time. The same cases over every kind of group, with their
exact messages, are in tests/test_objects.py (MPI-marked)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import launcher_free_env

pytestmark = pytest.mark.launches  # starts MPI jobs or processes of its own: make test-mpis runs it on every MPI

MPIEXEC = str(Path(sys.executable).with_name("mpiexec"))

JOB = """
import sys, threading
import mpidist as dist

dist.init_process_group()
rank, n = dist.get_rank(), dist.get_world_size()
log = open(f"{sys.argv[1]}/rank{rank}.txt", "w")
for attempt in range(2):  # the first try holds a lock: it cannot be pickled
    objs = [threading.Lock() if attempt == 0 else {"step": 7}] if rank == 0 else [None]
    try:
        dist.broadcast_object_list(objs, src=0)
    except TypeError as exc:
        print(f"{rank} attempt {attempt} raised: {exc}", file=log)
        continue
    print(f"{rank} attempt {attempt} got {objs}", file=log)
    break
out = [None] * n
dist.all_gather_object(out, rank)  # the group is still in step
print(f"{rank} then {out}", file=log)
log.close()
dist.destroy_process_group()
"""


def test_unpicklable_broadcast_then_retry_in_a_real_job(tmp_path):
    """Before the fix: rank 0 raised alone, and ranks 1 and 2 silently took its retry for
    their first broadcast (their attempt 0 "got" the retry's object; their op count was one
    behind rank 0's). A rank that waits forever ends the job within MPIDIST_TIMEOUT."""
    script = tmp_path / "job.py"
    script.write_text(JOB)
    t0 = time.monotonic()
    job = subprocess.run(
        [MPIEXEC, "-n", "3", sys.executable, "-m", "mpidist", str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=launcher_free_env(MPIDIST_TIMEOUT="10", OMP_NUM_THREADS="1"),
    )
    assert job.returncode == 0, job.stdout + job.stderr
    assert time.monotonic() - t0 < 60
    for r in range(3):
        assert (tmp_path / f"rank{r}.txt").read_text().splitlines() == [
            f"{r} attempt 0 raised: [rank {r}/3] broadcast_object_list: rank 0 could not pickle its object_list: "
            f"TypeError: cannot pickle '_thread.lock' object",
            f"{r} attempt 1 got [{{'step': 7}}]",
            f"{r} then [0, 1, 2]",
        ]
