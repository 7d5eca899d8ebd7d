"""torch 2.13's smaller public names: backend queries, the error classes, the renamed and
deprecated collectives, supports_complex, barrier(timeout=), breakpoint, record_comm."""

from __future__ import annotations

import datetime
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest
from conftest import launcher_free_env
from mpi4py import MPI
from test_timeout import job

import mpidist
from mpidist import errors
from mpidist._core import recorder
from mpidist.gather_scatter import all_gather_into_tensor
from mpidist.reductions import reduce_scatter_tensor

# -- backend queries ------------------------------------------------------------------------


def test_backend_queries(monkeypatch):
    assert mpidist.is_available() is True and mpidist.is_gloo_available() is True
    assert mpidist.is_ucc_available() is False and mpidist.is_xccl_available() is False
    nccl = mpidist.is_nccl_available()
    for name, want in [
        ("mpi", True),
        ("MPI", True),
        ("gloo", True),
        ("nccl", nccl),
        ("ucc", False),
        ("xccl", False),
        ("tcp", False),
        ("cpu:gloo", True),
        ("cpu:mpi,cuda:nccl", nccl),
        ("cpu:gloo,cuda:gloo", True),
        ("xpu:xccl", False),
        ("cpu:", False),
        ("cpu:mpi,cpu:mpi", False),
    ]:
        assert mpidist.is_backend_available(name) is want, name
    with pytest.raises(TypeError, match=r"is_backend_available: backend must be a string, got NoneType"):
        mpidist.is_backend_available(None)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert mpidist.is_torchelastic_launched() is False
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    assert mpidist.is_torchelastic_launched() is True


def test_default_backend_for_device():
    class Device:  # a torch.device stand-in
        type = "cuda"

    assert mpidist.get_default_backend_for_device("cpu") == "mpi"
    assert mpidist.get_default_backend_for_device("cuda:1") == "nccl"
    assert mpidist.get_default_backend_for_device(Device()) == "nccl"
    with pytest.raises(
        ValueError,
        match=r"get_default_backend_for_device: Default backend not registered for "
        r"device : 'meta'",
    ):
        mpidist.get_default_backend_for_device("meta")
    with pytest.raises(
        TypeError,
        match=r"device must be a string such as 'cpu' or 'cuda:0', or have a .type, "
        r"got int",
    ):
        mpidist.get_default_backend_for_device(0)


@pytest.mark.parametrize(
    "backend, expected",
    [
        ("mpi", {"cpu": "mpi", "cuda": "mpi"}),
        ("gloo", {"cpu": "gloo", "cuda": "gloo"}),
        ("nccl", {"cpu": "mpi", "cuda": "nccl"}),
        ("cuda:nccl", {"cpu": "mpi", "cuda": "nccl"}),
        ("cpu:gloo,cuda:nccl", {"cpu": "gloo", "cuda": "nccl"}),
        ("CUDA:NCCL,CPU:MPI", {"cpu": "mpi", "cuda": "nccl"}),
    ],
)
def test_backend_config(backend, expected):
    config = mpidist.BackendConfig(backend)
    assert config.get_device_backend_map() == expected
    assert str(config) == ",".join(f"{d}:{b}" for d, b in sorted(expected.items()))


def test_backend_config_errors():
    with pytest.raises(
        ValueError,
        match=r"BackendConfig: backend 'xpu:xccl' is not a backend name or a "
        r"'cpu:<backend>,cuda:<backend>' string",
    ):
        mpidist.BackendConfig("xpu:xccl")
    with pytest.raises(TypeError, match=r"BackendConfig: backend must be a string"):
        mpidist.BackendConfig(3)


@pytest.mark.mpi
def test_get_backend_config(dist):
    assert mpidist.get_backend_config() == "cpu:mpi,cuda:mpi"
    g = dist.new_group(backend="cpu:mpi,cuda:nccl")
    assert mpidist.get_backend_config(g) == "cpu:mpi,cuda:nccl"
    dist.destroy_process_group(g)


def test_default_pg_timeout():
    assert mpidist.default_pg_timeout == datetime.timedelta(minutes=30)


# -- errors ---------------------------------------------------------------------------------


def test_error_classes_as_torch():
    assert issubclass(mpidist.DistNetworkError, mpidist.DistError)
    assert issubclass(mpidist.DistStoreError, mpidist.DistError)
    assert not issubclass(mpidist.DistNetworkError, mpidist.DistBackendError)


def test_failed_process_errors_become_dist_network_error(monkeypatch):
    # this MPICH has no MPI_ERR_PROC_FAILED: mpi4py gives it MPI_ERR_UNKNOWN's value, never mapped
    assert MPI.ERR_UNKNOWN not in errors._network_classes()
    assert type(errors.from_mpi("send", MPI.Exception(MPI.ERR_UNKNOWN))) is mpidist.DistBackendError
    monkeypatch.setattr(errors, "_network_classes", lambda: frozenset({MPI.ERR_OTHER}))  # as an MPI with ULFM
    exc = errors.from_mpi("send", MPI.Exception(MPI.ERR_OTHER))
    assert type(exc) is mpidist.DistNetworkError
    assert "send: a process this operation needs has failed (MPI error: " in str(exc)


# -- renamed and deprecated collectives -----------------------------------------------------


@pytest.mark.mpi
def test_single_names_and_the_deprecated_ones(dist, world):
    rank, size = world
    out, inp = np.zeros(2 * size), np.full(2, float(rank))
    dist.all_gather_single(out, inp)
    assert out.tolist() == [float(r) for r in range(size) for _ in range(2)]
    red = np.zeros(2)
    dist.reduce_scatter_single(red, np.ones(2 * size))
    assert red.tolist() == [float(size)] * 2
    with pytest.warns(
        FutureWarning,
        match=r"`mpidist.all_gather_into_tensor` is deprecated. Please use "
        r"`mpidist.all_gather_single` instead.",
    ) as got:
        w = dist.all_gather_into_tensor(out, inp, async_op=True)
    assert got[0].filename == __file__ and w.wait() is True
    with pytest.warns(FutureWarning, match=r"`mpidist.reduce_scatter_tensor` is deprecated"):
        dist.reduce_scatter_tensor(red, np.ones(2 * size))
    assert dist.all_gather_into_tensor.__wrapped__ is all_gather_into_tensor
    assert dist.reduce_scatter_tensor.__wrapped__ is reduce_scatter_tensor
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the implementations (what mpidist itself calls) do not warn
        all_gather_into_tensor(out, inp)
        reduce_scatter_tensor(red, np.ones(2 * size))
        dist.all_gather_single(out, inp)


def test_supports_complex():
    R = mpidist.ReduceOp
    assert [mpidist.supports_complex(op) for op in (R.SUM, R.AVG, R.PRODUCT, R.MIN, R.MAX, R.BAND, R.BOR, R.BXOR)] == [
        True,
        True,
        True,
        False,
        False,
        False,
        False,
        False,
    ]
    assert mpidist.supports_complex(mpidist.make_premul_sum(2.0)) is True
    with pytest.raises(TypeError, match=r"supports_complex: op must be a mpidist.ReduceOp"):
        mpidist.supports_complex("sum")


# -- barrier(timeout=) ------------------------------------------------------------------------


@pytest.mark.mpi
def test_barrier_timeout_is_the_ops_limit(dist):
    dist.barrier(timeout=datetime.timedelta(seconds=7))
    assert recorder.snapshot()[-1]["timeout_s"] == 7.0
    dist.barrier(timeout=2.5, async_op=True).wait()
    assert recorder.snapshot()[-1]["timeout_s"] == 2.5
    dist.barrier()
    assert recorder.snapshot()[-1]["timeout_s"] == recorder.timeout
    with pytest.raises(ValueError, match=r"barrier: timeout must be positive, got -1.0 s"):
        dist.barrier(timeout=datetime.timedelta(seconds=-1))
    with pytest.raises(TypeError, match=r"barrier: timeout must be a datetime.timedelta, seconds, or None, got str"):
        dist.barrier(timeout="1")


LATE = """
import time, datetime, mpidist
mpidist.init_process_group()
if mpidist.get_rank() == 0:
    mpidist.barrier(timeout=datetime.timedelta(seconds=1.5))
else:
    time.sleep(60)  # never arrives
"""


def test_barrier_past_its_timeout_aborts_the_job(tmp_path):
    """The default timeout is 30 min: only barrier's own timeout ends this job quickly."""
    script = tmp_path / "late.py"
    script.write_text(LATE)
    t0 = time.monotonic()
    out = job(2, script, MPIDIST_TRACE_DIR=str(tmp_path))
    assert out.returncode == 1
    assert time.monotonic() - t0 < 30
    assert (
        "[rank 0] mpidist.errors.DistError: [rank 0/2] barrier: timed out after 1.5 s, the timeout "
        "of group 'default_pg' "
        "(ranks [0, 1]) at sequence number 0"
    ) in out.stderr, out.stderr


# -- breakpoint, record_comm ----------------------------------------------------------------


def test_breakpoint_stops_in_pdb_on_the_chosen_rank(tmp_path):
    """World of one: rank 0 stops in pdb (reading 'p 6 * 7' and 'c' from stdin), then the barrier."""
    code = (
        "import mpidist\nmpidist.init_process_group()\n"
        "for i in range(3):\n    mpidist.breakpoint(skip=2)\n"
        "print('after')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        input="p 6 * 7\nc\n",
        capture_output=True,
        text=True,
        timeout=60,
        env=launcher_free_env(),
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("ATTENTION") == 1  # skip=2: the first two calls returned at once
    assert "Type 'up' to get to the frame that called dist.breakpoint(rank=0)" in out.stdout
    assert "42" in out.stdout and out.stdout.rstrip().endswith("after")


@pytest.mark.mpi
def test_breakpoint_argument_errors(dist, world):
    _, size = world
    with pytest.raises(ValueError, match=rf"breakpoint: rank must be a global rank in \[0, {size}\), got {size}"):
        dist.breakpoint(rank=size)
    with pytest.raises(TypeError, match=r"breakpoint: skip must be an int, got float"):
        dist.breakpoint(skip=1.0)
    with pytest.raises(ValueError, match=r"breakpoint: timeout_s must be positive or None, got 0"):
        dist.breakpoint(timeout_s=0)


@pytest.mark.mpi
def test_record_comm_runs_the_block(dist, world):
    _, size = world
    x = np.ones(2)
    with dist.record_comm("FSDP::all_gather (layer1)"):
        dist.all_reduce(x)
    assert x.tolist() == [float(size)] * 2
    with pytest.raises(TypeError, match=r"record_comm: name must be a string, got int"):
        with dist.record_comm(3):
            pass
