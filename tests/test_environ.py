"""RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE (issue 15 item 5): exported at
``import mpidist`` where MPI (or the launcher) can tell, again at init_process_group; the
user's own values kept for init's check; a child process of an mpidist rank is not
mistaken for a torchrun-style launch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import launcher_free_env

from mpidist._launch import environment as E

pytestmark = pytest.mark.launches  # starts MPI jobs or processes of its own: make test-mpis runs it on every MPI

MPIEXEC = str(Path(sys.executable).with_name("mpiexec"))
VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def fresh_env(**extra: str) -> dict:
    """A launcher-free environment as a new shell has it: none of the four, no marker."""
    env = {k: v for k, v in launcher_free_env().items() if k not in VARS and k != E.MARKER}
    env.update(extra)
    return env


SHOW = f"import os, mpidist; print(*[os.environ.get(k) for k in {VARS}])"


def per_rank(tmp_path: Path, n: int, code: str) -> list[str]:
    """Run ``code`` on ``n`` ranks; each rank's ``result`` (written to a file of its own:
    the launcher may interleave the ranks' stdout), in rank order."""
    script = tmp_path / "job.py"
    script.write_text(
        code
        + "\nfrom mpi4py import MPI\nopen(os.path.join(sys.argv[1], str(MPI.COMM_WORLD.rank)), 'w').write(result)\n"
    )
    out = subprocess.run(
        [MPIEXEC, "-n", str(n), sys.executable, str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=fresh_env(),
    )
    assert out.returncode == 0, out.stderr
    return [(tmp_path / str(r)).read_text() for r in range(n)]


def test_exported_at_import_under_mpiexec(tmp_path):
    """Before init_process_group: RANK/WORLD_SIZE from MPI, LOCAL_* from hydra's MPI_LOCALRANKID/NRANKS."""
    code = f"import os, sys, mpidist\nresult = ' '.join(str(os.environ.get(k)) for k in {VARS!r})"
    assert per_rank(tmp_path, 2, code) == ["0 2 0 2", "1 2 1 2"]


def test_exported_at_import_in_a_plain_process():
    out = subprocess.run([sys.executable, "-c", SHOW], capture_output=True, text=True, timeout=60, env=fresh_env())
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", "1", "0", "1"]


def test_a_torchrun_environment_is_left_alone_until_init_refuses_it():
    out = subprocess.run(
        [sys.executable, "-c", SHOW],
        capture_output=True,
        text=True,
        timeout=60,
        env=fresh_env(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1"),
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "2", "1", "None"]


CHILD = """
import os, subprocess, sys, mpidist
mpidist.init_process_group()
launcher = ("PMI_", "PMIX_", "HYDRA_", "MPI_LOCAL", "OMPI_", "PRTE_", "I_MPI_HYDRA_")  # docs/hpc.md, "Child processes"
env = {k: v for k, v in os.environ.items() if not k.startswith(launcher)}
code = "import mpidist; mpidist.init_process_group(); print(mpidist.get_world_size())"
a = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
b = subprocess.run([sys.executable, "-c", code], env={**env, "WORLD_SIZE": "3"}, capture_output=True, text=True,
                   timeout=60)
result = " ".join(map(str, (mpidist.get_rank(), os.environ["WORLD_SIZE"], a.returncode, a.stdout.strip(),
                             b.returncode, "mpiexec -n 3" in b.stderr)))
"""


def test_a_child_process_of_a_rank_is_its_own_world_of_one(tmp_path):
    """It inherits RANK/WORLD_SIZE=2 from its parent rank: mpidist's export, not a launcher's
    request for 2 processes; a WORLD_SIZE set on purpose is still checked."""
    assert per_rank(tmp_path, 2, CHILD) == ["0 2 0 1 1 True", "1 2 0 1 1 True"]


@pytest.mark.mpi
def test_init_exports_all_four_and_records_them(dist, world):
    import os

    rank, size = world
    local = dist.get_node_local_rank()
    assert [os.environ[k] for k in VARS] == [str(rank), str(size), str(local), str(dist.get_local_world_size())]
    assert (
        os.environ[E.MARKER] == f"RANK={rank} WORLD_SIZE={size} LOCAL_RANK={local} "
        f"LOCAL_WORLD_SIZE={dist.get_local_world_size()}"
    )


@pytest.mark.parametrize(
    "env, size, expected",
    [
        ({"MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}, 4, (1, 2)),  # MPICH hydra
        ({"OMPI_COMM_WORLD_LOCAL_RANK": "3", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, 8, (3, 4)),  # Open MPI
        (
            {
                "SLURM_STEP_NUM_TASKS": "6",
                "SLURM_LOCALID": "1",
                "SLURM_NODEID": "2",
                "SLURM_STEP_TASKS_PER_NODE": "2(x2),2",
            },
            6,
            (1, 2),
        ),  # srun started the ranks
        (
            {
                "SLURM_STEP_NUM_TASKS": "2",
                "SLURM_LOCALID": "0",
                "SLURM_NODEID": "0",
                "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
            },
            8,
            None,
        ),  # srun started hydra's proxies: not the ranks' values
        (
            {
                "SLURM_STEP_NUM_TASKS": "5",
                "SLURM_LOCALID": "0",
                "SLURM_NODEID": "1",
                "SLURM_STEP_TASKS_PER_NODE": "3,2",
            },
            5,
            (0, 2),
        ),
        ({"MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "2"}, 4, None),  # inconsistent
        ({}, 4, None),
        ({}, 1, (0, 1)),
    ],
)
def test_local_rank_from_the_launcher(env, size, expected):
    assert E.launcher_local(env, size) == expected


def test_user_values_tell_ours_from_the_launchers(monkeypatch):
    env: dict = {"RANK": "1", "WORLD_SIZE": "2", E.MARKER: "RANK=1 WORLD_SIZE=2"}  # inherited from an mpidist parent
    monkeypatch.setattr(E, "_exported", {})
    monkeypatch.setattr(E, "_at_import", {})
    E.export_at_import(0, 1, env)
    assert env["RANK"] == "0" and env["WORLD_SIZE"] == "1" and E.user_values(env) == {"RANK": None, "WORLD_SIZE": None}
    env["WORLD_SIZE"] = "4"  # set by the program after import: the user's
    assert E.user_values(env) == {"RANK": None, "WORLD_SIZE": 4}
    env = {"RANK": "3", "WORLD_SIZE": "4"}  # torchrun's
    monkeypatch.setattr(E, "_exported", {})
    E.export_at_import(0, 1, env)
    assert env == {"RANK": "3", "WORLD_SIZE": "4"} and E.user_values(env) == {"RANK": 3, "WORLD_SIZE": 4}


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"PMI_RANK": "1", "PMI_SIZE": "4"}, (1, 4)),  # hydra: MPICH, Intel MPI
        ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "3", "PMIX_RANK": "2"}, (2, 3)),  # Open MPI
        ({"SLURM_PROCID": "5", "SLURM_NTASKS": "8"}, (5, 8)),  # srun
        ({"RANK": "0", "WORLD_SIZE": "2"}, (0, 2)),  # torchrun, or an mpidist parent's export
        ({"PMI_RANK": "4", "PMI_SIZE": "4", "RANK": "1", "WORLD_SIZE": "2"}, (1, 2)),  # inconsistent: the next
        ({"PMIX_RANK": "0"}, None),  # no size
        ({}, None),
    ],
)
def test_launcher_rank(env, expected):
    assert E.launcher_rank(env) == expected


def test_without_launcher_keeps_the_users_settings():
    env = {
        "PMI_RANK": "0",
        "PMI_FD": "9",
        "HYDRA_BSTRAP_PGID": "0",
        "MPI_LOCALRANKID": "0",
        "I_MPI_HYDRA_UUID": "312e",
        "PMIX_RANK": "0",
        "PRTE_LAUNCHED": "1",
        "OMPI_COMM_WORLD_RANK": "0",
        "OMPI_MCA_num_procs": "2",
        "OMPI_ALLOW_RUN_AS_ROOT": "1",
        "OMPI_MCA_osc": "^ucx",
        "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe",
        "I_MPI_FABRICS": "shm",
        "PATH": "/bin",
    }
    assert E.without_launcher(env) == {
        "OMPI_ALLOW_RUN_AS_ROOT": "1",
        "OMPI_MCA_osc": "^ucx",
        "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe",
        "I_MPI_FABRICS": "shm",
        "PATH": "/bin",
    }


@pytest.mark.parametrize(
    "argv, env, expected",
    [
        (["python", "-m", "mpidist", "job.py"], {}, True),
        (["python", "-u", "-X", "dev", "-W", "error", "-m", "mpidist", "-m", "pytest"], {}, True),
        (["python", "-um", "mpidist"], {}, True),
        (["python", "-mmpidist"], {}, True),
        (["python", "job.py", "-m", "mpidist"], {}, False),  # the job's own arguments
        (["python", "-c", "import mpidist", "-m", "mpidist"], {}, False),
        (["python", "-m", "mpidist.examples.train_digits"], {}, False),
        (["python", "-"], {}, False),
        (["python", "job.py"], {"MPIDIST_SUPERVISE": "1"}, True),
        (["python", "-m", "mpidist", "job.py"], {"MPIDIST_SUPERVISE": "0"}, False),
        (["python", "-m", "mpidist", "job.py"], {"MPIDIST_SUPERVISE": ""}, True),
    ],
)
def test_supervised_only_where_mpidist_owns_the_launch(argv, env, expected):
    assert E.supervised(argv, env) is expected
