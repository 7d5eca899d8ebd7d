"""jobs/train_digits.sbatch run with plain ``bash`` outside a Slurm allocation.

A newcomer's machine may have ``srun`` on PATH (a Slurm client package) but no reachable
controller: ``srun`` then only fails with "srun: fatal: ...". Without SLURM_JOB_ID the script
is not inside an allocation, so it says so and runs the job locally with mpiexec. The fake
``srun`` here fails exactly like Slurm's and records that it was called. No real Slurm is
involved (tests/slurm/run.sh covers the script inside an allocation, where it is unchanged).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import STOP_SIGNAL, launcher_free_env
from test_train_job import EPOCHS, JOB, RESUME_N, check_stopped, stop_after_epoch

from mpidist.checkpoint import load_checkpoint

pytestmark = pytest.mark.launches  # starts MPI jobs or processes of its own: make test-mpis runs it on every MPI

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "jobs" / "train_digits.sbatch"
VENV = Path(sys.executable).parent.parent


def fake_srun(bindir: Path, marker: Path) -> None:
    bindir.mkdir()
    srun = bindir / "srun"
    srun.write_text(
        f"#!/bin/sh\necho called >> {marker}\n"
        "echo 'srun: fatal: Could not establish a configuration source' >&2\nexit 1\n"
    )
    srun.chmod(0o700)


def run_script(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in launcher_free_env().items() if not k.startswith("SLURM_")}
    base.update(
        PATH=f"{tmp_path / 'bin'}:{os.environ.get('PATH', '')}",
        MPIDIST_VENV=str(VENV),
        OUT=str(tmp_path / "out"),
        OMP_NUM_THREADS="1",
        **env,
    )
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=300, env=base)


def test_outside_an_allocation_the_sbatch_script_runs_locally_with_mpiexec(tmp_path):
    marker = tmp_path / "srun-called"
    fake_srun(tmp_path / "bin", marker)
    job = run_script(tmp_path, "--epochs", "1", SLURM_NTASKS="2")
    assert job.returncode == 0, job.stdout + job.stderr
    assert (
        "train_digits.sbatch: not inside a Slurm allocation (SLURM_JOB_ID is not set): running the job here "
        "with mpiexec -n 2 instead of srun. To run it under Slurm, submit it: sbatch jobs/train_digits.sbatch"
    ) in job.stderr
    assert not marker.exists(), "srun was called outside an allocation"
    assert "srun: fatal" not in job.stderr
    assert "mpidist: 2 ranks" in job.stdout and "final test accuracy" in job.stdout
    assert int(load_checkpoint(tmp_path / "out" / "checkpoint.npz")["epoch"]) == 1


def test_outside_an_allocation_srun_can_still_be_forced(tmp_path):
    """MPIDIST_LAUNCHER=srun is taken as asked: the fake srun's own error is what shows."""
    marker = tmp_path / "srun-called"
    fake_srun(tmp_path / "bin", marker)
    job = run_script(tmp_path, "--epochs", "1", MPIDIST_LAUNCHER="srun")
    assert job.returncode == 1 and marker.exists()
    assert "srun: fatal: Could not establish a configuration source" in job.stderr
    assert "not inside a Slurm allocation" not in job.stderr


def test_a_stop_signal_to_mpirun_sh_stops_the_main_job_cleanly(tmp_path):
    """SIGTERM to jobs/mpirun.sh (Ctrl-C, a batch system's stop): every rank checkpoints at the
    same step and the job exits 0; the script says so and exits 143. hydra passes SIGTERM on to the
    ranks; Open MPI's mpirun kills the job on SIGTERM, so there the script sends it SIGUSR1."""
    out = tmp_path / "out"
    cmd = ["bash", str(ROOT / "jobs" / "mpirun.sh"), "-n", str(RESUME_N), "--"]
    job = subprocess.Popen(
        [*cmd, *JOB, "--out", str(out), "--epochs", str(EPOCHS)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=launcher_free_env(MPIDIST_VENV=str(VENV), OMP_NUM_THREADS="1"),
    )
    stdout, stderr = stop_after_epoch(job, 3, lambda j: j.send_signal(signal.SIGTERM), out, STOP_SIGNAL)
    assert job.returncode == 143, stdout + stderr
    assert "mpirun.sh: got SIGTERM, stopped the job (its exit code: 0)" in stderr, stderr
    check_stopped(out, 0, stdout, stderr, n=RESUME_N, signame=STOP_SIGNAL.name)
