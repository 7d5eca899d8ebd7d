"""Bootstrap from MPI: ranks, local ranks, env export, init/destroy lifecycle."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import launcher_free_env
from mpi4py import MPI

import mpidist

pytestmark = pytest.mark.launches  # starts MPI jobs or processes of its own: make test-mpis runs it on every MPI


@pytest.mark.mpi
def test_ranks_come_from_mpi(dist):
    world = MPI.COMM_WORLD
    assert dist.is_initialized()
    assert dist.get_rank() == world.Get_rank()
    assert dist.get_world_size() == world.Get_size()
    assert dist.get_backend() == "mpi"


@pytest.mark.mpi
def test_local_rank_and_env_export(dist):
    world = MPI.COMM_WORLD
    # every rank of these runs shares one node: the shared-memory split is the world
    local = world.allgather(dist.get_node_local_rank())
    assert sorted(local) == list(range(world.Get_size()))
    assert dist.get_local_world_size() == world.Get_size()
    assert os.environ["RANK"] == str(world.Get_rank())
    assert os.environ["WORLD_SIZE"] == str(world.Get_size())
    assert os.environ["LOCAL_RANK"] == str(dist.get_node_local_rank())
    assert os.environ["LOCAL_WORLD_SIZE"] == str(world.Get_size())


@pytest.mark.mpi
def test_default_group_is_a_duplicate_of_world(dist):
    comm = mpidist._runtime.world.state().world.comm
    assert comm != MPI.COMM_WORLD
    assert MPI.Comm.Compare(comm, MPI.COMM_WORLD) == MPI.CONGRUENT


@pytest.mark.mpi
def test_second_init_raises(dist):
    with pytest.raises(ValueError, match=r"\[rank \d+/\d+\] init_process_group: .*twice"):
        dist.init_process_group("mpi")


@pytest.mark.mpi
def test_destroy_then_use_raises_then_reinit(dist):
    dist.destroy_process_group()
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="has not been initialized"):
        dist.get_rank()
    with pytest.raises(ValueError, match="has not been initialized"):
        dist.all_reduce(__import__("numpy").ones(3))
    dist.init_process_group(backend="mpi")
    assert dist.get_world_size() == MPI.COMM_WORLD.Get_size()


def test_use_before_init_raises_in_fresh_process():
    code = (
        "import mpidist, numpy\n"
        "for f in (mpidist.get_rank, mpidist.get_world_size, lambda: mpidist.broadcast(numpy.ones(2), 0)):\n"
        "    try: f()\n"
        "    except ValueError as e: assert 'init_process_group' in str(e), e\n"
        "    else: raise SystemExit('no error')\n"
        "print('ok')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=launcher_free_env()
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_plain_python_is_world_of_one():
    code = (
        "import os, mpidist\n"
        "mpidist.init_process_group()\n"
        "print(mpidist.get_rank(), mpidist.get_world_size(), mpidist.get_node_local_rank(),"
        " os.environ['WORLD_SIZE'])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=launcher_free_env()
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", "1", "0", "1"]
