"""The exit watcher (mpidist._launch.finalize_watcher): past its bound it says why and ends the
process with SIGALRM; a process that exits in time leaves no line and no process; it never
signals a process that is not the one that started it. Issue 27: a chaos trial's job ended by
the bound on MPI_Finalize said nothing of a timeout (the job-level cases are in
tests/test_mpi_init.py)."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpidist._launch import finalize_watcher

pytestmark = [
    pytest.mark.launches,
    pytest.mark.skipif(
        not Path("/proc/self").is_dir() or not os.access(finalize_watcher.SHELL, os.X_OK), reason="Linux with /bin/sh"
    ),
]


def holders_of(token: str) -> list[int]:
    """The processes whose command line holds ``token`` (the watcher's holds its message)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                if token.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                    found.append(int(entry))
            except OSError:
                pass
    return found


def run(code: str, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    job = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=30)
    return job, time.monotonic() - t0


STARTS = """
import os, signal, sys, time
from mpidist._launch import finalize_watcher
signal.signal(signal.SIGALRM, signal.SIG_DFL)
held = finalize_watcher.start({seconds}, {message!r})
assert held is not None
"""


def test_past_the_bound_it_says_why_and_ends_the_process_with_sigalrm():
    token = secrets.token_hex(8)
    job, took = run(STARTS.format(seconds=0.5, message=f"watcher {token}: timed out") + "time.sleep(20)")
    assert job.returncode == -signal.SIGALRM, (job.returncode, job.stderr)
    assert job.stderr == f"watcher {token}: timed out\n"
    assert 0.5 <= took < 5, took


def test_a_stopped_process_is_ended_too():
    """A chaos trial: a rank stopped (SIGSTOP) in its exit, its peers finished, kept the job
    for ever: SIGALRM stays pending in a stopped process; the watcher continues it."""
    token = secrets.token_hex(8)
    job, took = run(STARTS.format(seconds=0.5, message=f"watcher {token}") + "os.kill(os.getpid(), signal.SIGSTOP)")
    assert job.returncode == -signal.SIGALRM, (job.returncode, job.stderr)
    assert 0.5 <= took < 5, took


def test_a_process_that_exits_in_time_leaves_no_line_and_no_process():
    token = secrets.token_hex(8)
    job, took = run(STARTS.format(seconds=2, message=f"watcher {token}") + "print(os.getpid())")
    assert job.returncode == 0 and job.stderr == "", job.stderr
    deadline = time.monotonic() + 5
    while holders_of(token) and time.monotonic() < deadline:  # end-of-file on the pipe: ms
        time.sleep(0.01)
    assert holders_of(token) == []
    time.sleep(max(0.0, 2.5 - took))  # past the bound: nothing was left to write or signal
    assert holders_of(token) == []


def test_it_never_signals_a_process_other_than_its_parent():
    """A forked child holds the pipe past the bound after the process that started the watcher
    exited: the watcher's parent is no longer that process, so it writes and signals nothing
    (the process number could be another's by then)."""
    token = secrets.token_hex(8)
    code = STARTS.format(seconds=0.5, message=f"watcher {token}") + (
        "if os.fork() == 0:\n"
        "    time.sleep(1.5)\n"  # holds the write end past the bound
        "    os._exit(7)\n"
    )
    job, _ = run(code)
    assert job.returncode == 0 and job.stderr == ""
    time.sleep(2)  # the child has exited; the watcher gave up at 0.5 s
    assert holders_of(token) == []


DESCRIPTORS = """
import json, os, sys, time
from mpidist._launch import finalize_watcher
token, kept_path = sys.argv[1:3]
first = finalize_watcher.start(5, "first " + token)
kept = os.open(kept_path, os.O_WRONLY | os.O_CREAT, 0o600)
os.set_inheritable(kept, True)  # a child would inherit it
second = finalize_watcher.start(5, "second " + token)

def target(pid, fd):
    try:
        return os.readlink(f"/proc/{pid}/fd/{fd}")
    except OSError:
        return None

mine = {name: target("self", fd) for name, fd in (("stderr", 2), ("first", first), ("second", second), ("kept", kept))}
time.sleep(0.3)
for pid in [int(e) for e in os.listdir("/proc") if e.isdigit()]:
    try:
        cmd = open(f"/proc/{pid}/cmdline", "rb").read()
    except OSError:
        continue
    if cmd.startswith(b"/bin/sh") and ("second " + token).encode() in cmd:
        print(json.dumps([mine, sorted({target(pid, fd) for fd in os.listdir(f"/proc/{pid}/fd")} - {None})]))
"""


def test_it_holds_no_descriptor_of_the_process_but_its_pipe_and_standard_error(tmp_path):
    """The watcher holds /dev/null, its own pipe's read end and the process's standard error
    (dash keeps copies of its standard streams at 10-12 while it runs timeout), nothing else:
    not a file the process opened inheritable, not an earlier watcher's pipe."""
    kept = tmp_path / "kept"
    job, _ = run(DESCRIPTORS, secrets.token_hex(8), str(kept))
    assert job.returncode == 0, job.stderr
    mine, held = json.loads(job.stdout)
    assert mine["first"] != mine["second"] and mine["kept"] == str(kept), mine
    assert set(held) == {os.devnull, mine["stderr"], mine["second"]}, (mine, held)


def test_without_a_shell_none_is_started(monkeypatch):
    monkeypatch.setattr(finalize_watcher, "SHELL", "/nonexistent/sh")
    assert finalize_watcher.start(1, "never") is None
