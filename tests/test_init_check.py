"""init_process_group's argument check (issue 14 item 3, issue 15 item 1): every rank fails
with the same message or none does, never a hang; torch's rank/world_size rules for the MPI
backend names and for the others; gloo names accepted over MPI; RANK/WORLD_SIZE from a
torchrun-style environment that say a larger world than MPI launched."""

from __future__ import annotations

import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
from conftest import launcher_free_env
from mpi4py import MPI

from mpidist._check import init_args as C
from mpidist._runtime import world as runtime
from mpidist.device import binding

pytestmark = pytest.mark.launches  # starts MPI jobs or processes of its own: make test-mpis runs it on every MPI

MPIEXEC = str(Path(sys.executable).with_name("mpiexec"))


# -- the rule, on hand-made rows (one per rank) -------------------------------------------------


def rows(*ranks, sizes=None, mpi_name=True, env=None):
    """Rows as ranks 0..n-1 would send them: rank= / world_size= passed, an MPI backend name?"""
    n = len(ranks)
    sizes = sizes if sizes is not None else [-1] * n
    env = env if env is not None else [(None, None)] * n
    return np.array(
        [
            C.Mine(rank=r, world_size=w, backend="x", mpi_name=mpi_name, env_rank=e[0], env_size=e[1]).row()
            for r, w, e in zip(ranks, sizes, env)
        ]
    )


def test_mpi_backend_names_ignore_meaningless_values_with_torchs_warning():
    got = rows(0, 0, 0, 0, sizes=[0] * 4)  # the tutorial's init_process(0, 0, run, backend='mpi')
    assert C.verdict(got) is None
    assert C.mpi_warning(got, 2) == (
        "init_process_group: For MPI backend, world_size (0) and rank (0) are ignored "
        "since they are assigned by the MPI runtime: this process is rank 2 of 4"
    )
    assert C.mpi_warning(rows(0, 1, sizes=[2, 2]), 1) is None  # values that agree: nothing to say
    assert C.verdict(rows(0, 1, sizes=[4, 4])) is None  # a world size MPI did not launch: ignored too
    assert C.verdict(rows(5, 7)) is None  # not ranks of the job: meaningless, ignored


def test_mpi_backend_names_refuse_a_renumbering():
    for got in (rows(1, 0), rows(2, 0, 1), rows(1, -1), rows(-1, -1, 0)):
        cls, text = C.verdict(got)
        assert cls is ValueError and "mpidist cannot renumber them" in text, text
    assert C.verdict(rows(1, 0))[1] == (
        "init_process_group: rank= contradicts MPI, which numbers the processes itself: the process MPI made rank 0 "
        "passed rank=1, the process MPI made rank 1 passed rank=0; mpidist cannot renumber them: pass rank=-1 (or "
        "leave it out) and ask get_rank()"
    )


def test_other_backend_names_mean_their_values():
    cls, text = C.verdict(rows(0, 1, sizes=[4, 4], mpi_name=False))
    assert (cls, text) == (
        ValueError,
        "init_process_group: world_size=4 (passed on ranks [0, 1]) but MPI launched 2 "
        "processes: mpidist takes the world from the MPI launcher; start 4 processes "
        "with `mpiexec -n 4 python ...` or `srun -n 4 python ...` (or pass "
        "world_size=-1)",
    )
    assert C.verdict(rows(0, 0, sizes=[0, 0], mpi_name=False))[1].startswith(
        "init_process_group: world_size=0 (passed on ranks [0, 1]) must be -1 or the number of processes"
    )
    assert "the process MPI made rank 1 passed rank=0" in C.verdict(rows(0, 0, mpi_name=False))[1]
    assert C.verdict(rows(0, 1, sizes=[2, 2], mpi_name=False)) is None
    assert C.mpi_warning(rows(0, 0, mpi_name=False), 1) is None  # errors, not warnings, for these


def test_environment_that_says_a_larger_world():
    text = C.verdict(rows(-1, env=[(1, 2)]))[1]
    assert text == (
        "init_process_group: the environment says RANK=1, WORLD_SIZE=2 (on rank 0), a world of at least 2 "
        "processes, but MPI launched 1: mpidist takes ranks from the MPI launcher, not from RANK/WORLD_SIZE "
        "(torchrun's variables); start the job with `mpiexec -n 2 python ...` or `srun -n 2 python ...`, "
        "or unset RANK and WORLD_SIZE for a one-process run"
    )
    assert "RANK=3 (on rank 1)" in C.verdict(rows(-1, -1, env=[(None, None), (3, None)]))[1]
    assert C.verdict(rows(-1, -1, env=[(0, 2), (1, 2)])) is None  # agrees with MPI
    assert C.verdict(rows(-1, -1, env=[(0, 1), (0, 1)])) is None  # smaller: stale, overwritten


def test_local_errors_are_reported_on_every_rank():
    got = rows(-1, -1, -1)
    got[1, C.ERROR] = 1
    texts = [
        (None, None, "mpi"),
        ("ValueError", "init_process_group: device_id=3 but this node has 2", ""),
        (None, None, "mpi"),
    ]
    assert C.verdict(got, texts) == (ValueError, "init_process_group: on rank 1: device_id=3 but this node has 2")
    got[:, C.ERROR] = 1
    same = [("TypeError", "init_process_group: timeout must be a datetime.timedelta, got int", "")] * 3
    assert C.verdict(got, same) == (TypeError, same[0][1])


# -- in a job: the same error on every rank, at once --------------------------------------------


def raises_everywhere(dist, cls, **kwargs) -> str:
    """init_process_group(**kwargs) raises ``cls`` on every rank with one message (after the
    rank prefix); returns it."""
    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    with pytest.raises(cls) as info:
        dist.init_process_group(**kwargs)
    text = str(info.value)
    assert text.startswith(f"[rank {rank}/{size}] init_process_group: ")
    texts = MPI.COMM_WORLD.allgather(text.split(" ", 2)[2])
    assert texts == [texts[0]] * size, texts
    assert not dist.is_initialized()
    return texts[0]


@pytest.fixture
def fresh(dist):
    """The default group destroyed for the test, re-made as the other tests expect it after."""
    dist.destroy_process_group()
    yield dist
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group()


@pytest.mark.mpi
def test_an_error_on_one_rank_fails_every_rank(fresh, monkeypatch):
    dist = fresh
    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    last = size - 1
    text = raises_everywhere(dist, ValueError, rank=size + 5 if rank == last else -1)
    assert text == (
        f"init_process_group: rank= contradicts MPI, which numbers the processes itself: the process "
        f"MPI made rank {last} passed rank={size + 5}; mpidist cannot renumber them: pass rank=-1 (or "
        f"leave it out) and ask get_rank()"
    )
    monkeypatch.setattr(binding, "_device_count", lambda: 0)
    text = raises_everywhere(dist, ValueError, device_id=0 if rank == last else None)
    where = f"on rank {last}: " if size > 1 else ""  # (the same error on every rank is said as each would say it)
    assert text == (
        f"init_process_group: {where}device_id=0 was given but there is no CUDA device (or CuPy "
        f"is not installed: pip install 'mpidist[gpu]')"
    )
    text = raises_everywhere(dist, ValueError, world_size=size + 1)
    assert f"start {size + 1} processes with `mpiexec -n {size + 1} python ...`" in text
    assert (
        raises_everywhere(dist, TypeError, timeout=30)
        == "init_process_group: timeout must be a datetime.timedelta, got int"
    )
    assert raises_everywhere(dist, ValueError, init_method="http://x").startswith(
        "init_process_group: init_method must"
    )
    assert raises_everywhere(dist, ValueError, backend="ucc").startswith(
        "init_process_group: backend 'ucc' is not supported; expected 'mpi', 'gloo', 'nccl'"
    )
    if size > 1:
        text = raises_everywhere(dist, ValueError, backend="nccl" if rank == last else "mpi")
        assert text.startswith("init_process_group: the ranks passed different backends: 'mpi' on rank")
        text = raises_everywhere(dist, ValueError, backend="mpi", rank=last - rank, world_size=size)
        assert "mpidist cannot renumber them" in text
    dist.init_process_group()  # and the world still works after all that
    x = np.ones(2)
    dist.all_reduce(x)
    assert x[0] == size


@pytest.mark.mpi
def test_mpi_backend_names_warn_and_go_on(fresh):
    dist = fresh
    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    with pytest.warns(
        UserWarning,
        match=rf"init_process_group: For MPI backend, world_size \(0\) and rank \(0\) are "
        rf"ignored since they are assigned by the MPI runtime: this process is rank "
        rf"{rank} of {size}$",
    ):
        dist.init_process_group("mpi", rank=0, world_size=0)
    assert (dist.get_rank(), dist.get_world_size(), dist.get_backend()) == (rank, size, "mpi")
    dist.destroy_process_group()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # values that agree with MPI: no warning
        dist.init_process_group("MPI", world_size=size, rank=rank)
    dist.destroy_process_group()
    with pytest.warns(UserWarning, match="needs no rendezvous"):
        dist.init_process_group("mpi", init_method="tcp://10.0.0.1:23456", world_size=size, rank=rank)


@pytest.mark.mpi
def test_gloo_names_run_over_mpi_with_one_warning(fresh, monkeypatch):
    dist = fresh
    size = MPI.COMM_WORLD.Get_size()
    monkeypatch.setattr(runtime, "_gloo_warned", False)
    with pytest.warns(
        UserWarning,
        match=r"init_process_group: mpidist runs the 'gloo' backend over MPI: 'gloo' is "
        r"accepted for programs written for torch \(get_backend\(\) says 'gloo'\)",
    ):
        dist.init_process_group("gloo", rank=MPI.COMM_WORLD.Get_rank(), world_size=size)
    assert dist.get_backend() == "gloo"
    x = np.ones(3)
    dist.all_reduce(x)
    np.testing.assert_array_equal(x, np.full(3, float(size)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process
        g = dist.new_group(backend="cuda:nccl,cpu:gloo")
    assert dist.get_backend(g) == "cpu:gloo,cuda:nccl"
    dist.destroy_process_group()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dist.init_process_group("cpu:gloo,cuda:nccl")
    assert dist.get_backend() == "cpu:gloo,cuda:nccl"


# -- in real jobs (each bounded) ----------------------------------------------------------------


def job(n: int, code: str, limit: float = 60, **env: str) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    out = subprocess.run(
        [MPIEXEC, "-n", str(n), sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=limit,
        env=launcher_free_env(OMP_NUM_THREADS="1", **env),
    )
    return out, time.monotonic() - t0


def test_one_rank_with_a_wrong_rank_fails_the_whole_job_at_once():
    """Rank 1 of 2 passes rank=5: both ranks raise the same ValueError (it used to raise on
    rank 1 only, and rank 0 waited in init forever). Each rank prints its error in one write:
    Python's own traceback writes the type and the message separately, and the two ranks'
    pieces then interleave in mpiexec's stderr."""
    code = (
        "import os, sys, mpidist\n"
        "try:\n"
        "    mpidist.init_process_group(rank=5 if os.environ['RANK'] == '1' else -1)\n"
        "except ValueError as exc:\n"
        "    sys.stderr.write(f'ValueError: {exc}\\n')\n"
        "    sys.exit(1)\n"
    )
    out, took = job(2, code, MPIDIST_TIMEOUT="60")
    assert out.returncode != 0
    assert took < 20
    for r in (0, 1):
        assert (
            f"ValueError: [rank {r}/2] init_process_group: rank= contradicts MPI, which numbers the processes "
            f"itself: the process MPI made rank 1 passed rank=5;"
        ) in out.stderr, out.stderr


def test_a_rank_that_never_calls_init_ends_the_job_after_the_timeout():
    code = (
        "import os, time, mpidist\nif os.environ['RANK'] == '1':\n    time.sleep(120)\nmpidist.init_process_group()\n"
    )
    out, took = job(2, code, MPIDIST_TIMEOUT="2")
    assert out.returncode != 0
    assert took < 20
    assert (
        "[rank 0] mpidist.errors.DistError: [rank 0/2] init_process_group: timed out after 2 s waiting for every "
        "rank to call init_process_group"
    ) in out.stderr, out.stderr


def test_torchrun_style_environment_fails_with_how_to_launch():
    """WORLD_SIZE=2 in the environment of a plain `python script.py` (world of 1)."""
    for extra, said in (({"WORLD_SIZE": "2", "RANK": "0"}, "RANK=0, WORLD_SIZE=2"), ({"RANK": "1"}, "RANK=1")):
        env = {
            k: v
            for k, v in launcher_free_env().items()  # a shell of its own, not a child of this process
            if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MPIDIST_ENV_EXPORTED")
        }
        env.update(extra)
        out = subprocess.run(
            [sys.executable, "-c", "import mpidist; mpidist.init_process_group('gloo')"],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
        assert out.returncode == 1
        assert f"ValueError: [rank 0/1] init_process_group: the environment says {said} (on rank 0)" in out.stderr
        assert "start the job with `mpiexec -n 2 python ...` or `srun -n 2 python ...`" in out.stderr
