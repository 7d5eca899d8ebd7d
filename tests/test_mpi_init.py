"""MPI_Init and MPI_Finalize are bounded by MPIDIST_TIMEOUT (mpidist._launch.mpi_init): a rank
stopped before either must not leave the others waiting there for ever (the chaos tests
found both: SIGSTOP at start-up, or just before exit, hung the job)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import KILLED_STATUS, launcher_free_env

from mpidist._launch import mpi_init

pytestmark = pytest.mark.launches  # starts MPI jobs or processes of its own: make test-mpis runs it on every MPI

MPIEXEC = str(Path(sys.executable).with_name("mpiexec"))

STOPPED_BEFORE_INIT = """
import os, signal
if os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK")) == "1":
    os.kill(os.getpid(), signal.SIGSTOP)   # never continued
import mpidist                              # MPI_Init: waits for rank 1
print("past MPI_Init", flush=True)
"""

STOPPED_BEFORE_FINALIZE = """
import os, signal, mpidist
mpidist.init_process_group()
mpidist.barrier()
rank = mpidist.get_rank()
mpidist.destroy_process_group()
if rank == 1:
    os.kill(os.getpid(), signal.SIGSTOP)   # rank 0's MPI_Finalize waits for rank 1
print("exiting", flush=True)
"""


STOPPED_BEFORE_DESTROY = """
import os, signal, mpidist
mpidist.init_process_group()
mpidist.barrier()
if mpidist.get_rank() == 1:
    os.kill(os.getpid(), signal.SIGSTOP)   # never continued: rank 0's final comparison waits for it
mpidist.destroy_process_group()
print("exiting", flush=True)
"""


#: ``python -m mpidist``: the launch mpidist owns, where it supervises (the exit watcher's line,
#: SIGUSR1 recorded; MPIDIST_SUPERVISE unset). A job stopped before MPI_Init runs ``python job.py``
#: with MPIDIST_SUPERVISE=1 instead (its code runs before ``import mpidist``), whose watcher
#: removes the segment it leaves (the default of launcher_free_env).
SUPERVISED = ("-m", "mpidist")


def run(
    tmp_path: Path, code: str, limit: float, python: tuple[str, ...] = SUPERVISED, **env: str
) -> tuple[subprocess.CompletedProcess, float]:
    script = tmp_path / "job.py"
    script.write_text(code)
    t0 = time.monotonic()
    job = subprocess.run(
        ["timeout", "-k", "5", str(limit), MPIEXEC, "-n", "2", sys.executable, *python, str(script)],
        capture_output=True,
        text=True,
        env=launcher_free_env(**({"MPIDIST_SUPERVISE": ""} if python else {}), **env),
    )
    return job, time.monotonic() - t0


# MPIDIST_TIMEOUT 3 s plus a grace of 1 s (MPIDIST_INIT_FINALIZE_GRACE; 10 s by default): the bound is 4 s.
BOUND = {"MPIDIST_TIMEOUT": "3", "MPIDIST_INIT_FINALIZE_GRACE": "1"}


def test_a_rank_stopped_before_mpi_init_ends_the_job_at_the_timeout(tmp_path):
    job, took = run(tmp_path, STOPPED_BEFORE_INIT, 60, (), **BOUND)
    # rank 0 exits with 1; the launcher then kills the stopped rank 1 (SIGKILL): mpiexec reports
    # whichever it saw first (1 or KILLED_STATUS, both seen)
    assert job.returncode in (1, KILLED_STATUS), (job.returncode, job.stdout, job.stderr)
    assert took < 15
    assert "Timeout (0:00:04)!" in job.stderr  # MPIDIST_TIMEOUT + the grace
    assert "_mpi_init_waits_for_every_rank_for_at_most_MPIDIST_TIMEOUT" in job.stderr
    assert "past MPI_Init" not in job.stdout


def test_a_rank_stopped_before_mpi_finalize_ends_the_job_at_the_timeout(tmp_path):
    job, took = run(tmp_path, STOPPED_BEFORE_FINALIZE, 60, **BOUND)
    assert job.returncode not in (0, 124), (job.returncode, job.stdout, job.stderr)
    assert took < 15
    # rank 0's exit watcher says why (mpidist._launch.finalize_watcher): hydra's own report names the
    # first bad end it saw, rank 0's alarm ("Alarm clock") or, seen under load (a chaos trial,
    # where nothing else said a rank had timed out), the SIGTERM it then sends the stopped rank 1
    assert (
        "[rank 0/2] MPI_Finalize timed out: this rank was still exiting 4 s after its exit handlers began "
        "(bound: MPIDIST_TIMEOUT + MPIDIST_INIT_FINALIZE_GRACE), most likely waiting in MPI_Finalize for a rank "
        "that is stopped or dead; mpidist ends it (SIGALRM)\n"
    ) in job.stderr, job.stderr
    out = job.stdout + job.stderr
    assert "Alarm clock" in out or "signal 15" in out, out


def test_in_somebody_elses_program_the_alarm_alone_bounds_mpi_finalize(tmp_path):
    """``python job.py`` under mpiexec (not ``python -m mpidist``): no exit watcher, no line, but
    the kernel's alarm ends the rank at the bound (and one second later) all the same."""
    before = set(os.listdir("/dev/shm"))
    job, took = run(tmp_path, STOPPED_BEFORE_FINALIZE, 60, python=(), MPIDIST_SUPERVISE="", **BOUND)
    for name in set(os.listdir("/dev/shm")) - before:  # MPICH's segment: not removed there
        if name.startswith("mpich_shm_"):
            os.unlink(f"/dev/shm/{name}")
    assert job.returncode not in (0, 124), (job.returncode, job.stdout, job.stderr)
    assert took < 15
    assert "MPI_Finalize timed out" not in job.stderr, job.stderr
    out = job.stdout + job.stderr
    assert "Alarm clock" in out or "signal 15" in out, out


def test_a_final_comparison_that_waited_the_timeout_leaves_mpi_finalize_the_grace_alone(tmp_path):
    """Rank 1 stopped just before destroy_process_group: rank 0's final comparison of the calls
    gives up at the group's timeout (3 s) and says so; MPI_Finalize is then bounded by the grace
    (1 s), not by the timeout plus the grace again (4 s). A chaos trial found the job held for
    the timeout twice plus the grace (28 s against its bound of 23)."""
    script = tmp_path / "job.py"
    script.write_text(STOPPED_BEFORE_DESTROY)
    job = subprocess.Popen(
        ["timeout", "-k", "5", "60", MPIEXEC, "-n", "2", sys.executable, *SUPERVISED, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=launcher_free_env(**BOUND),
    )
    assert job.stdout.readline() == "exiting\n"  # rank 0, after its final comparison gave up
    printed = time.monotonic()
    stdout, stderr = job.communicate(timeout=60)
    after = time.monotonic() - printed
    assert job.returncode not in (0, 124), (job.returncode, stdout, stderr)
    assert re.search(
        r"\[rank 0/2\] destroy_process_group: the final comparison of the calls on group '\w+' gave up after "
        r"\d+ s, past the group's timeout of 3 s: rank\(s\) \[1\] \(no answer to any question: stopped or "
        r"dead\?\) never came; MPI_Finalize is now bounded by 1 s \(MPIDIST_INIT_FINALIZE_GRACE\), not by the "
        r"timeout again",
        stderr,
    ), stderr
    assert after < 3.0, (after, stdout, stderr)  # the grace (1 s) and the teardown; 4 s + before the fix
    assert (
        "[rank 0/2] MPI_Finalize timed out: this rank was still exiting 1 s after its exit handlers began (bound: "
        "MPIDIST_INIT_FINALIZE_GRACE, the final comparison of the calls having waited the timeout already)"
    ) in stderr, stderr


def test_switched_off_the_job_waits(tmp_path):
    """The control: without the bounds the same job is still waiting when timeout(1) ends it."""
    job, took = run(tmp_path, STOPPED_BEFORE_INIT, 9, (), **BOUND, MPIDIST_BOUND_INIT_FINALIZE="0")
    assert job.returncode == 124 and took >= 9  # the bound would have ended it at 4 s


@pytest.mark.parametrize(
    "value, expected",
    [
        ("", 1800.0),
        ("8", 8.0),
        ("0.5", 0.5),
        ("0", 1800.0),
        ("-1", 1800.0),
        ("inf", 1800.0),
        ("nan", 1800.0),
        ("soon", 1800.0),
    ],
)
def test_the_bound_is_mpidist_timeout_or_30_minutes_plus_the_grace(monkeypatch, value, expected):
    monkeypatch.setenv("MPIDIST_TIMEOUT", value)
    monkeypatch.delenv("MPIDIST_INIT_FINALIZE_GRACE", raising=False)
    assert mpi_init.bound_seconds() == expected + mpi_init.GRACE


@pytest.mark.parametrize(
    "value, expected",
    [("", 10.0), ("0", 0.0), ("2.5", 2.5), ("-1", 10.0), ("inf", 10.0), ("nan", 10.0), ("later", 10.0)],
)
def test_the_grace_is_mpidist_init_finalize_grace_or_10_s(monkeypatch, value, expected):
    monkeypatch.setenv("MPIDIST_TIMEOUT", "8")
    monkeypatch.setenv("MPIDIST_INIT_FINALIZE_GRACE", value)
    assert mpi_init.bound_seconds() == 8 + expected


EARLY_SIGUSR1 = """
import os, signal, time
import mpidist                       # MPI_Init: MPICH's handler swallows a SIGUSR1 the process has none for
os.kill(os.getpid(), signal.SIGUSR1)   # Slurm's time-limit warning, before the job's handler
time.sleep(0.2)
from mpidist.examples._job import StopFlag
stop = StopFlag()
stop.install()
print(f"rank {os.environ['RANK']}: stop signal {stop.signum}", flush=True)
"""


def test_a_sigusr1_before_the_jobs_handler_is_not_lost(tmp_path):
    """A chaos trial found the main job running on past a SIGUSR1 sent while it imported torch."""
    job, _ = run(tmp_path, EARLY_SIGUSR1, 60)
    assert job.returncode == 0, job.stderr
    assert sorted(job.stdout.splitlines()) == [f"rank {r}: stop signal {int(signal.SIGUSR1)}" for r in (0, 1)]
