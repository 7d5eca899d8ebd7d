"""Backend name "mpi" on a torch wheel (built without MPI) after ``import mpidist.torch``
(mpidist/torch/_mpi_name.py): torch's own MPI path (no rendezvous, ranks from MPI,
torch's warnings and refusals) with mpidist's group doing the work.

In-process tests run serially (world size 1) and under mpiexec -n 2, 3, 4; the launch
tests (the tutorial's MPI recipe unchanged, a plain run) start their own jobs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from datetime import timedelta

import pytest

torch = pytest.importorskip("torch")
tdist = pytest.importorskip("torch.distributed")

import mpidist  # noqa: E402
import mpidist.torch  # noqa: E402,F401
from mpidist.torch import _mpi_name  # noqa: E402

pytestmark = [pytest.mark.launches, pytest.mark.mpi]


@pytest.fixture(scope="module")
def world():
    if tdist.is_initialized():
        pytest.skip("torch's default group is up already")
    started = not mpidist.is_initialized()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tdist.init_process_group("mpi", rank=0, world_size=0)  # the tutorial's init_process(0, 0, ...)
    assert any("For MPI backend, world_size (0) and rank (0) are ignored" in str(w.message) for w in caught)
    yield tdist.get_rank(), tdist.get_world_size()
    tdist.destroy_process_group()
    assert mpidist.is_initialized() is not started  # the torch world owned the runtime it started


def test_mpi_is_available_and_is_mpidist():
    assert tdist.is_mpi_available()
    assert _mpi_name.installed()


def test_ranks_from_mpi_and_backend_name(world):
    from mpi4py import MPI

    r, n = world
    assert (r, n) == (MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size())
    assert tdist.get_backend() == "mpi"
    t = torch.full((3,), float(r + 1))
    tdist.all_reduce(t)
    assert torch.equal(t, torch.full((3,), n * (n + 1) / 2))


def test_new_group_subsets_and_destroy(world):
    r, n = world
    evens = list(range(0, n, 2))
    group = tdist.new_group(evens, timeout=timedelta(seconds=20))
    if r in evens:
        assert tdist.get_backend(group) == "mpi"
        t = torch.tensor([float(r)])
        tdist.all_reduce(t, group=group)
        assert t.item() == float(sum(evens))
        assert group.mpidist_group.timeout_s == 20.0
        tdist.destroy_process_group(group)
    else:
        assert group == tdist.GroupMember.NON_GROUP_MEMBER


def test_local_synchronization_refused_as_torch_refuses_it_for_mpi(world):
    with pytest.raises(ValueError, match="MPI backend doesn't support use_local_synchronization=True"):
        tdist.new_group([0], use_local_synchronization=True)


def test_profiler_events_take_the_name(world):
    t = torch.ones(4)
    with torch.autograd.profiler.profile() as prof:
        tdist.all_reduce(t)
    assert [e.name for e in prof.function_events if e.name.endswith(":all_reduce")] == ["mpi:all_reduce"]


SEED = """
import os
import torch
import torch.distributed as dist
import mpidist.torch  # the one line added to the tutorial's program


def run(rank, size):
    tensor = torch.ones(1)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=dist.new_group(list(range(size))))
    print(f"Rank {rank} has data {tensor[0]} backend {dist.get_backend()} size {size}", flush=True)


def init_process(rank, size, fn, backend="gloo"):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = "29500"
    dist.init_process_group(backend, rank=rank, world_size=size)
    fn(dist.get_rank(), dist.get_world_size())


init_process(0, 0, run, backend="mpi")
"""


def _launch(tmp_path, n: int, *, barrier: bool = False):
    if mpidist.is_initialized() and mpidist.get_world_size() > 1:
        pytest.skip("starts its own job; runs in the serial pass")
    script = tmp_path / "seed.py"
    script.write_text(SEED)
    from conftest import launcher_free_env

    env = launcher_free_env(OMP_NUM_THREADS="1")
    if barrier:
        env["TORCH_DIST_INIT_BARRIER"] = "1"
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    cmd = ([mpiexec, "-n", str(n)] if n else []) + [sys.executable, str(script)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.parametrize("n", [0, 2, 3])
def test_the_tutorials_mpi_recipe_runs_unchanged(tmp_path, n):
    """The tutorial's ``init_process(0, 0, run, backend='mpi')`` under ``mpirun -n N`` (0:
    a plain ``python myscript.py``, a world of 1), with ``import mpidist.torch`` added."""
    proc = _launch(tmp_path, n)
    assert proc.returncode == 0, proc.stderr
    size = max(n, 1)
    for rank in range(size):
        assert f"Rank {rank} has data {float(size)} backend mpi size {size}" in proc.stdout, proc.stdout + proc.stderr


def test_init_barrier_env(tmp_path):
    proc = _launch(tmp_path, 2, barrier=True)
    assert proc.returncode == 0, proc.stderr
    assert "Rank 1 has data 2.0 backend mpi size 2" in proc.stdout
