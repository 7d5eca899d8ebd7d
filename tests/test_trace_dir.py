"""Flight-recorder dumps are written safely (issue 14 item 4): a fresh private directory
with an unguessable name, made only when a dump happens; an existing or explicit
directory used only if it is a real directory of this user that nobody else can write;
files created without following links (O_EXCL|O_NOFOLLOW, 0600) and renamed into place."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import launcher_free_env
from mpi4py import MPI

from mpidist._core import private_files as P, recorder as R
from mpidist._runtime import world as runtime

pytestmark = pytest.mark.launches  # starts MPI jobs or processes of its own: make test-mpis runs it on every MPI

MPIEXEC = str(Path(sys.executable).with_name("mpiexec"))


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_a_new_directory_is_private_and_so_is_the_file(tmp_path):
    d = tmp_path / "a" / "b" / "trace"  # missing parents too
    path = P.write_private_file(str(d), "rank0.json", b"{}")
    assert path == f"{d}/rank0.json" and Path(path).read_bytes() == b"{}"
    assert mode(d) == 0o700 and mode(path) == 0o600
    assert sorted(os.listdir(d)) == ["rank0.json"]  # the temporary file is gone
    P.write_private_file(str(d), "rank0.json", b"[1]")  # and it may be rewritten
    assert Path(path).read_bytes() == b"[1]"


def test_a_link_planted_at_the_file_name_is_replaced_not_followed(tmp_path):
    d = tmp_path / "trace"
    d.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (d / "rank0.json").symlink_to(victim)
    P.write_private_file(str(d), "rank0.json", b"{}")
    assert victim.read_text() == "precious"
    assert not (d / "rank0.json").is_symlink() and (d / "rank0.json").read_bytes() == b"{}"


@pytest.mark.parametrize("kind", ["world-writable", "link", "file", "other owner"])
def test_an_unsafe_directory_is_refused(tmp_path, kind):
    d = tmp_path / "trace"
    if kind == "world-writable":  # what another user could have made in /tmp for us
        d.mkdir()
        d.chmod(0o777)
        why = f"{d} is writable by other users (mode 0777)"
    elif kind == "link":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        d.symlink_to(tmp_path / "elsewhere")
        why = f"{d} is a symbolic link or not a directory"
    elif kind == "file":
        d.write_text("")
        why = f"{d} is a symbolic link or not a directory"
    else:
        if os.geteuid() != 0:
            pytest.skip("making a directory of another owner needs root (chown)")
        d.mkdir(mode=0o700)
        os.chown(d, 65534, 65534)
        why = f"{d} is owned by uid 65534, not by this user (uid 0)"
    with pytest.raises(P.UnsafeDirectory) as info:
        P.write_private_file(str(d), "rank0.json", b"{}")
    assert str(info.value) == why
    assert not (tmp_path / "elsewhere" / "rank0.json").exists()


def test_dump_into_an_unsafe_directory_writes_nothing_and_says_why(tmp_path, monkeypatch):
    d = tmp_path / "open"
    d.mkdir()
    d.chmod(0o777)
    monkeypatch.setattr(R, "_dir", str(d))
    assert R.dump("test") is None
    assert os.listdir(d) == []
    assert R.report(None) == (
        f"this rank's flight recorder could not be written ({d} is writable by other users (mode "
        f"0777); set MPIDIST_TRACE_DIR to a directory of your own)"
    )
    monkeypatch.setattr(R, "_dir", str(tmp_path / "mine"))
    path = R.dump("test")
    assert path == f"{tmp_path}/mine/rank{MPI.COMM_WORLD.Get_rank()}.json" and R.last_error == ""
    assert json.loads(Path(path).read_text())["reason"] == "test"


def test_fresh_names_are_unguessable():
    a, b = P.fresh_name("mpidist-trace-"), P.fresh_name("mpidist-trace-")
    assert re.fullmatch(r"mpidist-trace-\d{8}-\d{6}-[0-9a-f]{16}", a) and a != b


@pytest.mark.mpi
def test_the_job_directory_is_named_by_rank_0_and_not_created(dist, world, monkeypatch):
    import tempfile

    monkeypatch.delenv("MPIDIST_TRACE_DIR", raising=False)
    path = runtime._trace_dir(runtime.state().world.comm)
    assert MPI.COMM_WORLD.allgather(os.path.basename(path)) == [os.path.basename(path)] * world[1]
    assert os.path.dirname(path) == tempfile.gettempdir()
    assert re.fullmatch(r"mpidist-trace-\d{8}-\d{6}-[0-9a-f]{16}", os.path.basename(path))
    assert not os.path.exists(path)


def test_a_clean_job_leaves_nothing_and_a_failed_one_its_dump(tmp_path):
    """TMPDIR is the test's directory: a job that ends well writes nothing there; one that
    times out leaves one private directory with every rank's dump, and prints its path."""
    clean = tmp_path / "clean"
    clean.mkdir()
    code = "import numpy as np, mpidist\nmpidist.init_process_group()\nmpidist.all_reduce(np.ones(2))\n"
    out = subprocess.run(
        [MPIEXEC, "-n", "2", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env=launcher_free_env(TMPDIR=str(clean)),
    )
    assert out.returncode == 0, out.stderr
    assert os.listdir(clean) == []
    failed = tmp_path / "failed"
    failed.mkdir()
    code = (
        "import numpy as np, mpidist\nmpidist.init_process_group()\n"
        "if mpidist.get_rank() == 0:\n    mpidist.all_reduce(np.ones(2))\n"
        "else:\n    import time; time.sleep(60)\n"
    )
    out = subprocess.run(
        [MPIEXEC, "-n", "2", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env=launcher_free_env(TMPDIR=str(failed), MPIDIST_TIMEOUT="1"),
    )
    assert out.returncode != 0
    (made,) = os.listdir(failed)
    assert re.fullmatch(r"mpidist-trace-\d{8}-\d{6}-[0-9a-f]{16}", made)
    assert mode(failed / made) == 0o700
    assert sorted(os.listdir(failed / made)) == ["rank0.json", "rank1.json"]
    assert f"flight recorder written to {failed / made}/rank0.json" in out.stderr


def test_a_rank_that_cannot_dump_still_names_where_the_others_did(tmp_path, monkeypatch):
    """A full disk on the failing rank: its own dump fails, but the ranks that answered wrote
    theirs; the line it prints must say where (a chaos trial found the directory unnamed)."""
    monkeypatch.setattr(R, "_dir", str(tmp_path))
    monkeypatch.setattr(R, "last_error", "OSError: [Errno 27] File too large")
    assert R.report(None) == "this rank's flight recorder could not be written (OSError: [Errno 27] File too large)"
    (tmp_path / "rank1.json").write_text("{}")
    assert R.report(None) == (
        "this rank's flight recorder could not be written (OSError: [Errno 27] File too large)"
        f"; the ranks that answered wrote theirs to {tmp_path}; "
        f"run `python -m mpidist.tools.trace {tmp_path}`"
    )
