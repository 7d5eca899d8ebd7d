"""``python -m mpidist.info``: what mpidist finds, serially and under mpiexec (docs/hpc.md: the
first thing to run on a new cluster)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import MPI_VENDOR, launcher_free_env

from mpidist.info import launcher

pytestmark = pytest.mark.launches  # starts MPI jobs or processes of its own: make test-mpis runs it on every MPI

MPIEXEC = str(Path(sys.executable).with_name("mpiexec"))
#: what each MPI's own mpiexec is reported as
LAUNCHER = {
    "MPICH": "hydra (MPICH's mpiexec)",
    "Intel MPI": "hydra (Intel MPI's mpiexec)",
    "Open MPI": "Open MPI's mpirun",
}


def info(n: int, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "mpidist.info", *args]
    if n:
        cmd = [MPIEXEC, "-n", str(n), *cmd]
    return subprocess.run(
        ["timeout", "-k", "5", "120", *cmd], capture_output=True, text=True, env=launcher_free_env(OMP_NUM_THREADS="1")
    )


def test_serial_json():
    run = info(0, "--json")
    assert run.returncode == 0, run.stderr
    doc = json.loads(run.stdout)
    assert doc["world_size"] == 1 and doc["launcher"].startswith("none")
    assert doc["mpi"]["library"] and doc["mpi"]["thread_level"].startswith("MPI_THREAD_")
    assert isinstance(doc["cuda_aware_mpi"]["aware"], bool) and doc["cuda_aware_mpi"]["decided_by"]
    assert doc["world"]["all_reduce"] == 1.0 and doc["world"]["all_reduce_ok"] is True
    assert doc["shared_memory"]["window"] is True
    if doc["torch"]["torch"] is not None:
        assert "mpidist" in doc["torch"]["backends"]


def test_under_mpiexec_every_rank_reports_its_host_and_local_rank():
    run = info(3, "--json")
    assert run.returncode == 0, run.stderr
    doc = json.loads(run.stdout)  # rank 0 alone prints
    assert doc["world_size"] == 3 and doc["launcher"] == LAUNCHER[MPI_VENDOR]
    assert doc["world"]["all_reduce"] == 3.0 and doc["world"]["nodes"] == 1
    assert [(r["rank"], r["local_rank"]) for r in doc["world"]["ranks"]] == [(0, 0), (1, 1), (2, 2)]
    assert doc["variables"]["OMPI_COMM_WORLD_SIZE" if MPI_VENDOR == "Open MPI" else "PMI_SIZE"] == "3"


def test_text_names_each_rank():
    run = info(2)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith("mpidist ")
    assert any(line.startswith("world: 2 rank(s) on 1 node(s); init_process_group ok") for line in lines)
    assert sum(line.startswith("  rank ") and ", local rank " in line for line in lines) == 2


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"HYDI_CONTROL_FD": "7", "PMI_FD": "9", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0"}, "hydra (MPICH's mpiexec)"),
        ({"PMI_FD": "9"}, "hydra (MPICH's mpiexec)"),
        ({"PMI_FD": "9", "I_MPI_HYDRA_UUID": "312e0000-4c27"}, "hydra (Intel MPI's mpiexec)"),
        ({"OMPI_COMM_WORLD_SIZE": "2"}, "Open MPI's mpirun"),
        ({"SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "PMI_FD": "4"}, "Slurm's srun"),
        ({"PMIX_RANK": "0"}, "a PMIx launcher"),
        ({}, "none (a singleton: python without a launcher)"),
    ],
)
def test_launcher_from_the_variables(env, expected):
    assert launcher(env) == expected
