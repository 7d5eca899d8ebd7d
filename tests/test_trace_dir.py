"""Flight-recorder dumps are written safely (issue 14 item 4): a fresh private directory
with an unguessable name, made only when a dump happens; an existing or explicit
directory used only if it is a real directory of this user that nobody else can write;
files created without following links (O_EXCL|O_NOFOLLOW, 0600) and renamed into place.
By default the job directories are in one private per-user directory, which keeps the
newest MPIDIST_TRACE_KEEP of them (issue 41 item 4)."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import tempfile
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
    monkeypatch.setattr(R, "_root", None)
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
def test_the_job_directory_is_named_by_rank_0_and_not_created(dist, world):
    name = runtime._trace_name(runtime.state().world.comm)
    assert MPI.COMM_WORLD.allgather(name) == [name] * world[1]
    assert re.fullmatch(r"mpidist-trace-\d{8}-\d{6}-[0-9a-f]{16}", name) and re.fullmatch(R.JOB_DIR, name)
    assert not os.path.exists(os.path.join(R.user_dir(), name))


def default_dumps(monkeypatch, tmp_path, keep: int = R.DEFAULT_KEEP) -> Path:
    """Dumps configured as init_process_group does without MPIDIST_TRACE_DIR, in ``tmp_path``
    as the temporary directory; the per-user directory."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv("MPIDIST_TRACE_DIR", raising=False)
    for name in ("_dir", "_root", "_keep"):
        monkeypatch.setattr(R, name, getattr(R, name))
    R.configure(R.timeout, R._ring.maxlen, P.fresh_name(R.TRACE_PREFIX), keep)
    return tmp_path / f"mpidist-traces-{os.getuid()}"


def old_job(root: Path, day: int, files=("rank0.json", "rank1.traceback.txt")) -> Path:
    """A job directory of ``root`` dumped on 2020-01-<day> (its name and mtime)."""
    d = root / f"mpidist-trace-202001{day:02d}-120000-{day:016x}"
    d.mkdir(mode=0o700, parents=True)
    for name in files:
        (d / name).write_text("{}")
    os.utime(d, (day * 86400, day * 86400))
    return d


def test_by_default_a_dump_goes_to_a_private_per_user_directory(tmp_path, monkeypatch):
    root = default_dumps(monkeypatch, tmp_path)
    path = R.dump("test")
    assert path == str(root / os.path.basename(R.trace_dir()) / f"rank{MPI.COMM_WORLD.Get_rank()}.json")
    assert os.listdir(tmp_path) == [root.name] and mode(root) == 0o700 and mode(os.path.dirname(path)) == 0o700
    assert R.report(path).startswith(f"flight recorder written to {path} ")
    root.chmod(0o777)  # an unsafe one is refused, as any other
    assert R.dump("test") is None and R.last_error.startswith(f"{root} is writable by other users (mode 0777)")


@pytest.mark.parametrize("keep", [3, 0])
def test_a_new_job_directory_keeps_the_newest_trace_keep(tmp_path, monkeypatch, keep):
    root = default_dumps(monkeypatch, tmp_path, keep)
    old = [old_job(root, day) for day in range(5, 0, -1)]
    os.utime(old[-1], (86400 * 9, 86400 * 9))  # the oldest name, dumped into last: kept (by mtime)
    path = R.dump("test")
    kept = {os.path.dirname(path), str(old[-1]), str(old[0])} if keep else {os.path.dirname(path), *map(str, old)}
    assert {str(p) for p in root.iterdir()} == kept
    R.dump("again")  # no new directory: nothing more is removed
    assert {str(p) for p in root.iterdir()} == kept


def test_pruning_leaves_links_and_foreign_files_alone(tmp_path, monkeypatch):
    root = default_dumps(monkeypatch, tmp_path, 1)
    odd = old_job(root, 2, ("rank0.json", "notes.txt"))  # a job directory with a file of somebody else
    elsewhere = old_job(tmp_path / "elsewhere", 1)
    (root / elsewhere.name).symlink_to(elsewhere)  # a link named as a job directory
    writing = old_job(root, 3, ("rank0.json", ".rank1.json.7.abcd.tmp"))  # a dump being written
    other = old_job(root, 4)
    other.rename(root / "mine")  # not named as a job directory
    removed = old_job(root, 5)
    R.dump("test")
    assert not removed.exists() and len(os.listdir(root)) == 5
    assert sorted(os.listdir(elsewhere)) == ["rank0.json", "rank1.traceback.txt"]
    assert (root / elsewhere.name).is_symlink() and "notes.txt" in os.listdir(odd)
    assert len(os.listdir(writing)) == 2 and len(os.listdir(root / "mine")) == 2


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
    assert os.listdir(failed) == [f"mpidist-traces-{os.getuid()}"]
    mine = failed / f"mpidist-traces-{os.getuid()}"
    (made,) = os.listdir(mine)
    assert re.fullmatch(r"mpidist-trace-\d{8}-\d{6}-[0-9a-f]{16}", made)
    assert mode(mine) == 0o700 and mode(mine / made) == 0o700
    assert sorted(os.listdir(mine / made)) == ["rank0.json", "rank1.json"]
    assert f"flight recorder written to {mine / made}/rank0.json" in out.stderr


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
