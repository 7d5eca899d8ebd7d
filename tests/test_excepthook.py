"""An unhandled exception on one rank ends the whole job, without ``python -m mpidist``
(issue 14 item 2): init_process_group's sys.excepthook prints the rank-prefixed traceback
first, has every rank write its flight recorder, and calls MPI_Abort;
MPIDIST_ABORT_ON_EXCEPTION=0 restores the old behaviour (the peers wait for the timeout)."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import SINGLETON_LEFT, launcher_free_env

from mpidist._launch import abort
from mpidist.tools import trace

pytestmark = pytest.mark.launches  # starts MPI jobs or processes of its own: make test-mpis runs it on every MPI

MPIEXEC = str(Path(sys.executable).with_name("mpiexec"))

# rank 1 of n fails at its 20th step of a loop of all_reduces; the others wait in the 21st
FAIL = """
import os, sys, numpy as np, mpidist
mpidist.init_process_group()
rank = mpidist.get_rank()
for step in range(10**9):
    mpidist.all_reduce(np.ones(4))
    if step == 20 and rank == 1:
        raise {exc}("injected fault at step 20")
"""


def job(n: int, code: str, *args: str, limit: float = 60, runner: tuple = (), **env: str):
    t0 = time.monotonic()
    out = subprocess.run(
        [MPIEXEC, "-n", str(n), sys.executable, *runner, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=limit,
        env=launcher_free_env(OMP_NUM_THREADS="1", **env),
    )
    return out, time.monotonic() - t0


@pytest.mark.parametrize("exc, code", [("RuntimeError", 1), ("KeyboardInterrupt", 130)])
def test_an_exception_on_one_rank_ends_the_job_within_10_s(tmp_path, exc, code):
    trace_dir = tmp_path / "trace"
    out, took = job(3, FAIL.format(exc=exc), MPIDIST_TIMEOUT="60", MPIDIST_TRACE_DIR=str(trace_dir))
    assert took < 10, f"the job took {took:.1f} s:\n{out.stderr}"
    assert out.returncode == code, out.stderr
    lines = out.stderr.splitlines()
    assert lines[:2] == [
        "[rank 1] Traceback (most recent call last):",
        '[rank 1]   File "<string>", line 8, in <module>',
    ]
    assert f"[rank 1] {exc}: injected fault at step 20" in lines
    assert (
        f"[rank 1] flight recorder written to {trace_dir}/rank1.json (and by every rank that answered); run "
        f"`python -m mpidist.tools.trace {trace_dir}`; this rank's full traceback: {trace_dir}/rank1.traceback.txt"
    ) in lines
    assert (trace_dir / "rank1.traceback.txt").read_text().endswith(f"{exc}: injected fault at step 20\n")
    assert f"[rank 1] aborting the MPI job (MPI_Abort, exit code {code})" in lines
    assert sum("Traceback" in line for line in lines) == 1  # reported once
    docs = trace.load(str(trace_dir))
    assert set(docs) == {0, 1, 2}
    assert docs[1]["reason"] == f"abort: {exc}: injected fault at step 20"
    for r in (0, 2):  # the others were waiting in the next all_reduce
        assert (docs[r]["entries"][-1]["op"], docs[r]["entries"][-1]["state"]) == ("all_reduce", "started")
    assert stat.S_IMODE(trace_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE((trace_dir / "rank0.json").stat().st_mode) == 0o600


def test_opt_out_leaves_the_peers_to_the_timeout(tmp_path):
    out, took = job(
        2,
        FAIL.format(exc="RuntimeError"),
        MPIDIST_ABORT_ON_EXCEPTION="0",
        MPIDIST_TIMEOUT="3",
        MPIDIST_TRACE_DIR=str(tmp_path),
    )
    assert out.returncode != 0
    assert "Traceback (most recent call last):" in out.stderr.splitlines()  # Python's own, unprefixed
    assert "[rank 1] aborting the MPI job" not in out.stderr
    assert "[rank 0] mpidist.errors.DistError: [rank 0/2] all_reduce: timed out after 3 s" in out.stderr
    assert took > 3


def test_a_raise_before_init_ends_the_job_within_15_s(tmp_path):
    """Issue 41: plain mpiexec, the default 30-minute timeout; rank 1 raises before
    init_process_group while rank 0 waits in it: the exit handler aborts the job."""
    code = "import os, mpidist\nif os.environ['RANK'] == '1':\n    raise ValueError('bad config')\n"
    code += "mpidist.init_process_group()"
    out, took = job(2, code, limit=60, MPIDIST_TRACE_DIR=str(tmp_path))
    assert out.returncode == 1 and took < 15, f"{took:.1f} s:\n{out.stderr}"
    assert "ValueError: bad config" in out.stderr.splitlines()
    assert "[rank 1] the unhandled exception above ended this rank, whose peers may wait for it" in out.stderr


def test_python_m_mpidist_reports_once(tmp_path):
    """Under the runner the exception is its to report: the hook stays quiet."""
    out, took = job(
        2,
        FAIL.format(exc="RuntimeError"),
        runner=("-m", "mpidist"),
        MPIDIST_TIMEOUT="60",
        MPIDIST_TRACE_DIR=str(tmp_path),
    )
    assert out.returncode == 1 and took < 10, out.stderr
    assert sum("Traceback" in line for line in out.stderr.splitlines()) == 1
    assert out.stderr.count("aborting the MPI job") == 1


def test_one_process_exits_with_the_prefixed_traceback_and_writes_nothing(tmp_path):
    code = "import mpidist\nmpidist.init_process_group()\nraise ValueError('bad value 7')\n"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env=launcher_free_env(TMPDIR=str(tmp_path)),
    )
    assert out.returncode == 1
    assert out.stderr.splitlines()[0] == "[rank 0] Traceback (most recent call last):"
    assert out.stderr.splitlines()[-1] == "[rank 0] ValueError: bad value 7"
    assert set(os.listdir(tmp_path)) <= SINGLETON_LEFT


def test_an_exception_in_another_thread_does_not_end_the_job(tmp_path):
    """Python ends only that thread; the program may join it and go on (so does the job)."""
    code = (
        "import sys, threading, numpy as np, mpidist\nmpidist.init_process_group()\n"
        "t = threading.Thread(target=lambda: 1 / 0)\nt.start(); t.join()\n"
        "x = np.ones(2)\nmpidist.all_reduce(x)\n"
        "open(f'{sys.argv[1]}/done{mpidist.get_rank()}', 'w').write(str(x[0]))\n"
    )
    out, _ = job(2, code, str(tmp_path), MPIDIST_TIMEOUT="30")
    assert out.returncode == 0, out.stderr
    assert [(tmp_path / f"done{r}").read_text() for r in (0, 1)] == ["2.0", "2.0"]
    assert "ZeroDivisionError" in out.stderr


@pytest.mark.mpi
def test_init_installs_the_hook_and_destroy_removes_it(dist):
    dist.destroy_process_group()
    try:
        before = sys.excepthook
        dist.init_process_group()
        assert abort.excepthook_installed() and sys.excepthook is not before
        dist.destroy_process_group()
        assert sys.excepthook is before and not abort.excepthook_installed()
    finally:
        if not dist.is_initialized():
            dist.init_process_group()


@pytest.mark.mpi
def test_a_hook_installed_before_formats_the_traceback(dist, monkeypatch, capsys):
    """The hook keeps the previous hook's formatting (prefixed), and a rank-less run returns."""

    def previous(exc_type, exc, tb):
        sys.stderr.write(f"custom: {exc_type.__name__}: {exc}\n")

    monkeypatch.setattr(sys, "excepthook", previous)
    hook = abort._Hook(3, 1, lambda reason, text: "", False)  # one rank: prints, then returns
    try:
        raise ValueError("x")
    except ValueError as e:
        hook(type(e), e, e.__traceback__)
    assert capsys.readouterr().err == "[rank 3] custom: ValueError: x\n"
    hook.active = False
    hook(ValueError, ValueError("y"), None)
    assert capsys.readouterr().err == "custom: ValueError: y\n"


def test_a_hook_that_wraps_ours_and_captures_stderr_does_not_swallow_the_traceback(capfd, monkeypatch):
    """torch's init_process_group wraps the hook it finds (ours, under mpidist.torch) and
    captures its output in a StringIO to prefix it; since ours aborts the job before that
    buffer is printed, ours writes to the real stderr."""
    import io

    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)  # not the one init installed in this process
    hook = abort._Hook(0, 1, lambda reason, text: "", False)

    def torch_like(*args):
        saved, sys.stderr = sys.stderr, io.StringIO()
        try:
            hook(*args)
        finally:
            sys.stderr = saved

    torch_like(ValueError, ValueError("z"), None)
    assert capfd.readouterr().err == "[rank 0] ValueError: z\n"


def test_opt_out_value_is_checked():
    out = subprocess.run(
        [sys.executable, "-c", "import mpidist; mpidist.init_process_group()"],
        capture_output=True,
        text=True,
        timeout=60,
        env=launcher_free_env(MPIDIST_ABORT_ON_EXCEPTION="no"),
    )
    assert out.returncode == 1
    assert re.search(
        r"ValueError: \[rank 0/1\] init_process_group: MPIDIST_ABORT_ON_EXCEPTION must be 0 or 1, "
        r"got 'no'",
        out.stderr,
    )
