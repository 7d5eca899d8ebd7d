"""A failed job leaves nothing behind in /tmp or /dev/shm (mpidist._launch.launcher_files): MPICH's
shared-memory segment and hydra's topology file lose their names as soon as mpidist is
imported with MPI initialized, so neither MPI_Abort nor SIGKILL leaves them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import SINGLETON_LEFT, launcher_free_env, only_on
from mpi4py import MPI

from mpidist._core import recorder
from mpidist._launch import init_watcher, launcher_files

pytestmark = pytest.mark.launches  # starts MPI jobs or processes of its own: make test-mpis runs it on every MPI

MPIEXEC = str(Path(sys.executable).with_name("mpiexec"))


def entries() -> set[str]:
    """Every name in the directories an MPI job may leave files in (MPICH's mpich_shm_* and
    hydra_hwloc_xmlfile_*, Open MPI's sm_segment.* and ompi.*, Intel MPI's Intel_MPI_*, ...),
    but the directory of the flight-recorder dumps a failed job writes on purpose (and prints)."""
    return {
        os.path.join(d, e)
        for d in {"/tmp", tempfile.gettempdir(), "/dev/shm"}
        if os.path.isdir(d)
        for e in os.listdir(d)
        if e != os.path.basename(recorder.user_dir())
    }


@pytest.mark.mpi(min_size=2)
@only_on("MPICH", "MPICH's shared-memory segment (/dev/shm/mpich_shm_*) and hydra's files")
def test_no_mapped_segment_keeps_its_name_after_import():
    maps = Path("/proc/self/maps").read_text().splitlines()
    segments = [line for line in maps if "/dev/shm/mpich_shm_" in line]
    assert segments, "MPICH mapped no shared-memory segment on this node"
    assert all(line.endswith("(deleted)") for line in segments), segments
    parent = os.getppid()
    if Path(f"/proc/{parent}/comm").read_text().strip() == "hydra_pmi_proxy":
        held = [os.readlink(f"/proc/{parent}/fd/{fd}") for fd in os.listdir(f"/proc/{parent}/fd")]
        assert not [f for f in held if "hydra_hwloc_xmlfile_" in f and not f.endswith("(deleted)")], held
    MPI.COMM_WORLD.Barrier()  # the segment still works: a collective through it
    assert MPI.COMM_WORLD.allreduce(1) == MPI.COMM_WORLD.Get_size()


ENDINGS = {
    "MPI_Abort": "import mpidist\nmpidist.init_process_group()\nif mpidist.get_rank() == 1:\n"
    "    raise RuntimeError('fails')\nmpidist.barrier()\n",
    "SIGKILL": "import os, time, mpidist\nif os.environ['RANK'] == '1':\n    os.kill(os.getpid(), 9)\ntime.sleep(30)\n",
    "a normal end": "import mpidist\nmpidist.init_process_group()\nmpidist.barrier()\n"
    "mpidist.destroy_process_group()\n",
}


@pytest.mark.parametrize("ending", sorted(ENDINGS))
def test_a_job_leaves_no_segment_or_topology_file(tmp_path, ending):
    script = tmp_path / "job.py"
    script.write_text(ENDINGS[ending])
    before = entries()
    job = subprocess.run(
        ["timeout", "-k", "5", "60", MPIEXEC, "-n", "3", sys.executable, "-m", "mpidist", str(script)],
        capture_output=True,
        text=True,
        env=launcher_free_env(),
    )
    assert (job.returncode == 0) == (ending == "a normal end"), job.stderr
    assert job.returncode != 124, "the job hung"
    assert entries() - before == set()


def test_a_singleton_leaves_no_segment(tmp_path):
    """``python script.py``, no launcher: Open MPI 5's singleton left its 16 MiB
    /dev/shm/sm_segment.* at every exit, a clean one too (mpidist removes its name)."""
    script = tmp_path / "job.py"
    script.write_text(ENDINGS["a normal end"])
    before = entries()
    job = subprocess.run(
        ["timeout", "-k", "5", "60", sys.executable, str(script)],
        capture_output=True,
        text=True,
        env=launcher_free_env(),
    )
    assert job.returncode == 0, job.stderr
    assert entries() - before <= {os.path.join(tempfile.gettempdir(), name) for name in SINGLETON_LEFT}


IMPORT_IN_A_PLAIN_PYTHON = """
import atexit, importlib.util, json, os, signal
SIGNALS = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGALRM)
if importlib.util.find_spec("torch"):
    import torch  # (what torch itself does on import is not mpidist's)
def children():
    me, out = str(os.getpid()), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1] == me:
                out.append(open(f"/proc/{pid}/cmdline").read().replace("\\0", " "))
        except (OSError, IndexError):
            pass
    return out
report = {}
atexit.register(lambda: print(json.dumps({**report, "at exit": children()}), flush=True))  # runs after mpidist's
before = {s.name: signal.getsignal(s) for s in SIGNALS}
{imports}
report["handlers"] = {s.name: str(getattr(signal.getsignal(s), "__qualname__", signal.getsignal(s)))
                      for s in SIGNALS if signal.getsignal(s) is not before[s.name]}
report["after import"] = children()
"""


def run_program(tmp_path: Path, imports: str, launch: list[str], **env: str) -> tuple[list[dict], set[str]]:
    """Each process's report of IMPORT_IN_A_PLAIN_PYTHON with ``imports``, started by ``launch``,
    and what it left in /tmp and /dev/shm (but an Open MPI singleton's own leftovers, removed)."""
    script = tmp_path / "program.py"
    script.write_text(IMPORT_IN_A_PLAIN_PYTHON.replace("{imports}", imports))
    before = entries()
    job = subprocess.run([*launch, str(script)], capture_output=True, text=True, env=launcher_free_env(**env))
    assert job.returncode == 0, job.stderr
    left = entries() - before
    for name in left - {os.path.join(tempfile.gettempdir(), n) for n in SINGLETON_LEFT}:
        if os.path.basename(name).startswith("sm_segment.") and "mpidist" not in imports:
            os.unlink(name)  # the control's own leftover (an Open MPI singleton's), removed here
            left.discard(name)
    return [json.loads(line) for line in job.stdout.splitlines() if line.startswith("{")], left


MINE = "import mpidist\nif importlib.util.find_spec('torch'):\n    import mpidist.torch"


@pytest.mark.parametrize("launcher", ["a plain Python", "mpiexec -n 2"])
def test_import_in_somebody_elses_program_starts_no_process_and_changes_no_handler(tmp_path, launcher):
    """``import mpidist`` (and ``mpidist.torch``) in somebody else's program, started by a plain
    Python or by mpiexec: no process started, at import or at exit (the MPI_Finalize watcher is
    ``python -m mpidist``'s), no signal handler changed but those a plain ``from mpi4py import
    MPI`` (the control) changes, and /dev/shm and /tmp as they were once it has exited (the
    control, not: an Open MPI singleton leaves its segment). Under mpiexec, supervision is the
    other control (MPIDIST_SUPERVISE=1: what ``python -m mpidist`` does, but with the program's
    first line before the import): SIGUSR1 recorded, the exit watcher started."""
    python = ["timeout", "-k", "5", "120", sys.executable]
    launch = python if launcher == "a plain Python" else ["timeout", "-k", "5", "120", MPIEXEC, "-n", "2", *python[4:]]
    allowed = {os.path.join(tempfile.gettempdir(), name) for name in SINGLETON_LEFT}
    control, _ = run_program(tmp_path, "from mpi4py import MPI", launch, MPIDIST_SUPERVISE="")
    ours, left = run_program(tmp_path, MINE, launch, MPIDIST_SUPERVISE="")
    assert len(ours) == len(control) == (1 if launcher == "a plain Python" else 2), (ours, control)
    for report in ours:
        assert report == {"handlers": control[0]["handlers"], "after import": [], "at exit": []}, (ours, control)
    assert left <= allowed
    if launcher != "a plain Python":
        supervised, left = run_program(tmp_path, MINE, launch, MPIDIST_SUPERVISE="1")
        for report in supervised:
            assert report["handlers"]["SIGUSR1"].endswith("_record"), supervised
            assert any("finalize" in child or "/bin/sh" in child for child in report["at exit"]), supervised
        assert left <= allowed


def test_only_regular_files_of_this_user_are_removed(tmp_path):
    mine = tmp_path / "f"
    mine.write_text("x")
    link = tmp_path / "l"
    link.symlink_to(mine)
    assert not init_watcher.remove(str(link)) and link.is_symlink() and mine.exists()
    assert not init_watcher.remove(str(tmp_path))  # a directory
    assert init_watcher.remove(str(mine)) and not mine.exists()
    assert not init_watcher.remove(str(mine))  # gone already: no error


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv(launcher_files.ENV, "0")
    assert launcher_files.remove_names() == []
