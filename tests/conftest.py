"""Shared fixtures, and the rule that keeps MPI test runs from hanging.

Under ``mpiexec -n N`` (N > 1) a test that fails on one rank would leave the other
ranks waiting in their next collective, so a failure prints its report and aborts
the whole job (MPI_Abort) at once. pytest-timeout bounds each test as a last resort.
"""
from __future__ import annotations

import os
import sys

import pytest
from mpi4py import MPI

import mpidist


_LAUNCHER_PREFIXES = ("PMI_", "PMIX_", "HYDRA_", "MPIR_", "OMPI_", "MPI_LOCAL")


def pytest_collection_modifyitems(config, items):
    """Under mpiexec -n N > 1, only tests marked ``mpi`` run: the rest belong to the serial pass."""
    if MPI.COMM_WORLD.Get_size() > 1:
        skip = pytest.mark.skip(reason="serial test: runs once, in the serial pass")
        for item in items:
            if "mpi" not in item.keywords:
                item.add_marker(skip)


def launcher_free_env(**extra: str) -> dict:
    """os.environ without the MPI launcher's variables, for a child that starts its own job."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_PREFIXES)}
    env.update(extra)
    return env


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and MPI.COMM_WORLD.Get_size() > 1:
        rank = MPI.COMM_WORLD.Get_rank()
        sys.stderr.write(f"\n[rank {rank}] FAILED {item.nodeid} ({report.when}):\n{report.longreprtext}\n"
                         f"[rank {rank}] aborting the MPI job so the other ranks do not hang\n")
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)


@pytest.fixture
def dist():
    """The default process group, initialized if needed; yields the mpidist module."""
    if not mpidist.is_initialized():
        mpidist.init_process_group("mpi")
    yield mpidist


@pytest.fixture
def world(dist):
    """(rank, world_size) of the default group."""
    return dist.get_rank(), dist.get_world_size()
