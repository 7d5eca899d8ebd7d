"""Shared fixtures, and the rule that keeps MPI test runs from hanging.

Under ``mpiexec -n N`` (N > 1) a test that fails on one rank would leave the other
ranks waiting in their next collective, so a failure prints its report and aborts
the whole job (MPI_Abort) at once. pytest-timeout bounds each test as a last resort.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sys
import tempfile

import pytest
from mpi4py import MPI

import mpidist
from mpidist._launch.environment import without_launcher

#: The test session's temporary directory (TMPDIR of the tests and of every job they start),
#: removed at the session's end: the jobs the tests fail on purpose leave their flight-recorder
#: dumps (``mpidist-traces-<uid>/mpidist-trace-*``, the path printed) in TMPDIR, as a user's
#: would, and a run of the suite left ~20 of them in /tmp.
_session_tmp: str | None = None


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    """Under mpiexec only rank 0 prints pytest's report; other ranks' failures are printed
    by the abort hook below, so the job's output ends with rank 0's summary line. Every rank
    gets a temporary directory of its own for the session (see ``_session_tmp``)."""
    global _session_tmp
    if MPI.COMM_WORLD.Get_rank() > 0:
        reporter = config.pluginmanager.getplugin("terminalreporter")
        if reporter is not None:
            config.pluginmanager.unregister(reporter)
    _session_tmp = tempfile.mkdtemp(prefix="mpidist-tests-")
    os.environ["TMPDIR"] = _session_tmp
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again (pytest's tmp_path included)


def pytest_unconfigure(config):
    if _session_tmp is not None:
        shutil.rmtree(_session_tmp, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    """Under mpiexec -n N > 1, only tests marked ``mpi`` run: the rest belong to the serial pass."""
    if MPI.COMM_WORLD.Get_size() > 1:
        skip = pytest.mark.skip(reason="serial test: runs once, in the serial pass")
        for item in items:
            if item.get_closest_marker("mpi") is None:  # (not ``"mpi" in item.keywords``: a param id "mpi" is one)
                item.add_marker(skip)


#: the MPI under test (mpi4py's MPI.get_vendor(): "MPICH", "Open MPI", "Intel MPI", ...)
MPI_VENDOR = MPI.get_vendor()[0]


#: the signal that stops a job cleanly when sent to its launcher (docs/hpc.md, "MPIs"): hydra
#: (MPICH, Intel MPI) passes SIGTERM on to every rank; Open MPI's mpirun takes SIGTERM as "kill the
#: job" (the ranks get SIGTERM and are killed shortly after) and passes SIGUSR1 on
STOP_SIGNAL = signal.SIGUSR1 if MPI_VENDOR == "Open MPI" else signal.SIGTERM


#: the exit status of mpiexec for a job whose rank was killed by SIGKILL (docs/hpc.md, "MPIs"):
#: MPICH's hydra reports the signal, Intel MPI's hydra 255, Open MPI's mpirun 128 + the signal
KILLED_STATUS = {"MPICH": 9, "Intel MPI": 255, "Open MPI": 128 + 9}.get(MPI_VENDOR)


#: what an Open MPI 5 singleton (no launcher) leaves in TMPDIR however it ends: its session
#: directory (docs/hpc.md, "MPIs"); the other MPIs leave nothing there
SINGLETON_LEFT = {f"ompi.{socket.gethostname()}.{os.getuid()}"} if MPI_VENDOR == "Open MPI" else set()


def only_on(vendor: str, why: str) -> pytest.MarkDecorator:
    """Skip a test that is about one MPI's own behaviour elsewhere, saying why."""
    return pytest.mark.skipif(MPI_VENDOR != vendor, reason=f"{why}: {vendor} only (this MPI: {MPI_VENDOR})")


def launcher_free_env(**extra: str) -> dict:
    """os.environ without the MPI launcher's variables, for a child that starts its own job.

    Also without PYTHONUNBUFFERED: unbuffered, a child's ``print`` writes its text and the
    newline (and each argument) separately, and so does Python's traceback (the exception's
    type, then its message), so in a job's merged output one rank's pieces land between
    another's and a line the test looks for is split (two fresh-clone CI runs failed so).
    Buffered (stderr line-buffered, stdout flushed by the programs that need it at once),
    each line goes out in one write.

    Supervised (MPIDIST_SUPERVISE=1, as under ``python -m mpidist``): the suite owns its jobs'
    launches, whose failures must leave no MPICH segment behind; a test of somebody else's
    program passes ``MPIDIST_SUPERVISE=""`` (unset: supervised only under ``python -m mpidist``)."""
    env = {k: v for k, v in without_launcher(os.environ).items() if k != "PYTHONUNBUFFERED"}
    env.update({"MPIDIST_SUPERVISE": "1", **extra})
    return env


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and MPI.COMM_WORLD.Get_size() > 1:
        rank = MPI.COMM_WORLD.Get_rank()
        sys.stderr.write(
            f"\n[rank {rank}] FAILED {item.nodeid} ({report.when}):\n{report.longreprtext}\n"
            f"[rank {rank}] aborting the MPI job so the other ranks do not hang\n"
        )
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


GROUP_KINDS = ["world", "dup", "parity", "single"]


def make_group(dist, kind: str):
    """Build one of the test groups, collectively; return (group, its members' global ranks).

    world: the default group; dup: new_group() of every rank; parity: even ranks and odd
    ranks in two groups; single: a one-rank group of the last rank. Non-members get
    NON_GROUP_MEMBER back, and the members list they see is the group they are not in.
    """
    rank, size = dist.get_rank(), dist.get_world_size()
    if kind == "world":
        return None, list(range(size))
    if kind == "dup":
        return dist.new_group(), list(range(size))
    if kind == "parity":
        evens, odds = list(range(0, size, 2)), list(range(1, size, 2))
        g_even = dist.new_group(evens)
        g_odd = dist.new_group(odds) if odds else dist.GroupMember.NON_GROUP_MEMBER
        return (g_even, evens) if rank % 2 == 0 else (g_odd, odds)
    if kind == "single":
        return dist.new_group([size - 1]), [size - 1]
    raise ValueError(kind)


@pytest.fixture(params=GROUP_KINDS)
def any_group(request, dist):
    """(group, members) for each kind in GROUP_KINDS; destroyed after the test."""
    g, members = make_group(dist, request.param)
    yield g, members
    if g is not None and g is not dist.GroupMember.NON_GROUP_MEMBER:
        dist.destroy_process_group(g)
