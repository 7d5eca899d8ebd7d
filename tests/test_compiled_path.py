"""all_reduce's compiled latency path (mpidist/_backends/mpi/_ext/_inline_c.c) and its Python twin
(mpidist._backends.mpi.collectives.all_reduce's inline path): the tests marked with the ``path``
fixture run once on each, and must see the same results, recorder entries and errors. On the
compiled path the calls that continue a group's open run never reach the Python body.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig

import numpy as np
import pytest
from conftest import launcher_free_env
from mpi4py import MPI
from test_reductions import reference

from mpidist._backends.mpi import collectives
from mpidist._check import mismatch
from mpidist._core import recorder


@pytest.fixture
def fresh(dist):
    """A new group of every rank (nothing agreed on yet, its sequence numbers from 0)."""
    g = dist.new_group()
    yield g
    dist.destroy_process_group(g)


@pytest.fixture(params=["compiled", "python"])
def path(request, dist, monkeypatch):
    """("compiled" or "python", the list of the calls that reached the Python body)."""
    scope = dist.all_reduce.__globals__  # the public op's compiled scope (mpidist._public_op)
    if request.param == "python":
        monkeypatch.setitem(scope, "_inline", lambda *args: False)
    elif scope["_inline"] is None:
        pytest.skip("the compiled path is not built here")
    body, reached = scope["_body"], []

    def counted(*args):
        reached.append(args)
        return body(*args)

    monkeypatch.setitem(scope, "_body", counted)
    return request.param, reached


def test_the_compiled_path_is_built_where_a_compiler_is():
    """setup.py builds it optionally: on a machine with the C compiler Python was built with (CI's),
    a missing extension is a failed build, not a choice."""
    cc = (sysconfig.get_config_var("CC") or "").split()
    if not cc or shutil.which(cc[0]) is None:
        pytest.skip("no C compiler: the Python path alone")
    assert collectives.INLINE is not None


def test_without_the_extension_the_python_path_runs_alone():
    """An install without a C compiler has no _inline_c: the public op is made without the
    compiled path's line, and all_reduce runs (the Python path, which the ``path`` tests run too)."""
    code = (
        "import sys\n"
        "sys.modules['mpidist._backends.mpi._ext._inline_c'] = None  # its import fails, as where it was not built\n"
        "import numpy as np, mpidist\n"
        "from mpidist._backends.mpi import collectives\n"
        "mpidist.init_process_group()\n"
        "x = np.ones(2)\n"
        "for _ in range(5):\n"
        "    mpidist.all_reduce(x)\n"
        "print(collectives.INLINE, '_inline' in mpidist.all_reduce.__code__.co_names, x.tolist())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=launcher_free_env()
    )
    assert out.stdout == "None False [1.0, 1.0]\n", out.stderr


CASES = [
    ("float32", ["SUM", "AVG", "MAX", "MIN", "PRODUCT"]),
    ("float64", ["SUM", "AVG"]),
    ("complex128", ["SUM", "AVG"]),
    ("int32", ["SUM", "BAND", "BXOR", "MIN"]),
    ("int64", ["MAX", "BOR"]),
    ("uint8", ["SUM"]),
]


@pytest.mark.mpi
@pytest.mark.parametrize("dtype, ops", CASES)
def test_continuing_calls_give_the_same_results_on_both_paths(dist, world, fresh, path, dtype, ops):
    """Three calls of one (dtype, op) open the group's run; the next three continue it. Every
    result is the reduction of the ranks' inputs; on the compiled path the continuing calls that
    MPI_Allreduce runs leave the Python body alone."""
    kind, reached = path
    rank, size = world

    def base(r: int) -> np.ndarray:
        return (np.arange(2) + 3 * r + 1).astype(dtype)  # 2 elements: 2-16 bytes

    for name in ops:
        op = getattr(dist.ReduceOp, name)
        expected = reference(name, [base(r) for r in range(size)])
        x = base(rank)
        for i in range(6):
            if i == 3:
                reached.clear()
            x[...] = base(rank)
            dist.all_reduce(x, op, group=fresh)
            assert x.dtype == np.dtype(dtype) and x.tolist() == expected.astype(dtype).tolist(), (name, i)
        # (a plan below whose sizes the call is MPI_Allreduce: not for the integers whose MPI_SUM
        # saturates, which mpidist reduces itself (Open MPI's 8- and 16-bit ones), nor float16)
        inline = collectives._PLANS[(x.dtype, op._value_, None)][3] > x.nbytes
        assert inline or dtype not in ("float32", "float64"), name
        assert len(reached) == (0 if kind == "compiled" and inline else 3), name


@pytest.mark.mpi
def test_a_continuing_call_records_what_launch_records(dist, world, fresh, path, monkeypatch):
    """The entry a continuing call leaves in the flight recorder holds what recorder.begin/end
    make for the same op through _dispatch.launch (tests/test_recorder.py checks the Python
    path's first inline calls the same way)."""
    x = np.ones(2, dtype=np.float32)
    for _ in range(3):
        dist.all_reduce(x, group=fresh)
    before = fresh.engine.seq
    with monkeypatch.context() as m:
        m.setattr(collectives, "launch", None)  # (a call through launch raises TypeError)
        dist.all_reduce(x, group=fresh)
    inline = list(recorder._ring[-1])
    assert fresh.engine.current is recorder._ring[-1] and fresh.engine.decided == before
    dist.all_reduce(x, async_op=True, group=fresh).wait()  # through launch
    launched = list(recorder._ring[-1])
    assert fresh.engine.seq == before + 2 and (inline[recorder.SEQ], launched[recorder.SEQ]) == (before, before + 1)
    times = {recorder.T_ISSUE, recorder.T_START, recorder.T_END, recorder.SEQ}
    assert len(inline) == len(launched) == 12
    assert [v for i, v in enumerate(inline) if i not in times] == [v for i, v in enumerate(launched) if i not in times]
    assert inline[recorder.STATE] == recorder.COMPLETED
    assert inline[recorder.T_ISSUE] == inline[recorder.T_START] <= inline[recorder.T_END] <= launched[recorder.T_ISSUE]
    assert x.tolist() == [world[1] ** 5] * 2


@pytest.mark.mpi
def test_calls_that_break_the_run_take_the_python_path_and_its_errors(dist, world, fresh, path):
    """After a run of calls, every call the compiled path does not know to continue it goes to
    the Python body, which answers as it always does: a read-only or non-contiguous array is
    refused there, an async call returns a Work, another op or size runs."""
    kind, reached = path
    rank, size = world
    x = np.ones(2, dtype=np.float32)
    for _ in range(3):
        dist.all_reduce(x, group=fresh)
    reached.clear()
    ro = np.ones(2, dtype=np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match=r"all_reduce.*tensor.*writable"):
        dist.all_reduce(ro, group=fresh)
    with pytest.raises(ValueError, match=r"all_reduce.*tensor.*contiguous"):
        dist.all_reduce(np.ones(4, dtype=np.float32)[::2], group=fresh)
    x[...] = 1
    dist.all_reduce(x, group=fresh, async_op=True).wait()
    dist.all_reduce(x, dist.ReduceOp.MAX, group=fresh)
    y = np.ones(3, dtype=np.float32)
    dist.all_reduce(y, group=fresh)
    assert x.tolist() == [size] * 2 and y.tolist() == [size] * 3
    assert len(reached) == 5


@pytest.mark.mpi
def test_an_mpi_error_on_a_continuing_call_is_raised_and_recorded(dist, world, fresh, path, monkeypatch):
    """MPI's error (here MPI_COMM_NULL for the group's communicator, on every rank) comes back as
    DistBackendError naming rank and op, the entry marked failed; the group works afterwards."""
    rank, size = world
    x = np.ones(2, dtype=np.float32)
    for _ in range(3):
        dist.all_reduce(x, group=fresh)
    with monkeypatch.context() as m:
        m.setattr(fresh, "comm", MPI.COMM_NULL)
        with pytest.raises(
            dist.DistBackendError, match=rf"^\[rank {rank}/{size}\] all_reduce: MPI error: .*communicator"
        ):
            dist.all_reduce(x, group=fresh)
    assert recorder._ring[-1][recorder.STATE] == recorder.FAILED and fresh.engine.current is recorder._ring[-1]
    x[...] = 1
    dist.all_reduce(x, group=fresh)
    assert x.tolist() == [size] * 2


@pytest.mark.mpi
def test_the_check_exchanges_at_the_same_calls_on_both_paths(dist, world, fresh, path):
    """Every PERIOD-th call of a run is the mismatch check's exchange (the Python path's): the
    compiled path hands those back, so two periods of calls make two exchanges on both paths."""
    kind, reached = path
    if world[1] == 1:
        pytest.skip("a one-rank group is not checked")
    x = np.ones(1)
    dist.all_reduce(x, group=fresh)
    check = fresh.resource("check", mismatch.GroupCheck)
    before = set(check.exchanged)
    reached.clear()
    for _ in range(2 * mismatch.PERIOD):
        dist.all_reduce(x, group=fresh)
    assert len(set(check.exchanged) - before) == 2
    assert len(reached) == (2 * mismatch.PERIOD if kind == "python" else 3)
