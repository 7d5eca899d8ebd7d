"""The watcher of MPI_Init (mpidist._launch.init_watcher): a job that ends while its ranks are still in
MPI_Init leaves no MPICH segment in /dev/shm, and the watcher removes nothing else and outlives
nothing. Issue 27: the chaos tests (SIGKILL at start-up) and this package's own test of a rank
stopped before MPI_Init (tests/test_mpi_init.py) each left a segment."""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import MPI_VENDOR, launcher_free_env

from mpidist._launch import init_watcher as W

MPIEXEC = str(Path(sys.executable).with_name("mpiexec"))
SHM = Path("/dev/shm")
pytestmark = [
    pytest.mark.launches,
    pytest.mark.skipif(not SHM.is_dir() or not Path("/proc/self/maps").exists(), reason="Linux only"),
]


def segments() -> set[str]:
    """The names of MPI_Init's segments in /dev/shm (MPICH's and Intel MPI's: W.is_segment)."""
    return {p.name for p in SHM.iterdir() if W.is_segment(str(p))}


def wait_for(check, limit: float = 10.0) -> bool:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.01)
    return check()


def fake_segment(name: str | None = None) -> tuple[Path, mmap.mmap]:
    """A file named as MPICH names its segment, mapped by this process (as MPI_Init maps it)."""
    path = SHM / (name or f"mpich_shm_{secrets.token_hex(4)}_0")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.ftruncate(fd, 4096)
        return path, mmap.mmap(fd, 4096)
    finally:
        os.close(fd)


@pytest.fixture
def launched(monkeypatch):
    """This process as the node's first rank of a launched job."""
    for k in ("PMIX_RANK", "SLURM_LOCALID", W.ENV):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("PMI_RANK", "0")
    monkeypatch.setenv("MPI_LOCALRANKID", "0")


def test_is_segment():
    assert W.is_segment("/dev/shm/mpich_shm_a0aeb8de_0")
    assert W.is_segment("/dev/shm/mpich_shm_3afd_12")
    assert W.is_segment("/dev/shm/Intel_MPI_k7ACwU")
    for path in (
        "/dev/shm/mpich_shm_a0aeb8de_0 (deleted)",
        "/dev/shm/mpich_shm_A0_0",
        "/dev/shm/mpich_shm__0",
        "/dev/shm/mpich_shm_a0_",
        "/dev/shm/mpich_shm_a0_0_1",
        "/dev/shm/mpich_shm_a0/../x_0",
        "/tmp/mpich_shm_a0_0",
        "/dev/shm/sem.mpich_shm_a0_0",
        "/dev/shm/Intel_MPI_k7ACw",
        "/dev/shm/Intel_MPI_k7AC.U",
        "/dev/shm/sm_segment.vm.0.cce60000.0",  # Open MPI's: its launcher removes it
    ):
        assert not W.is_segment(path), path


@pytest.mark.parametrize(
    "env, wanted",
    [
        ({"PMI_RANK": "0", "MPI_LOCALRANKID": "0"}, True),
        ({"PMI_RANK": "3"}, True),  # no rank on the node known: every rank watches
        ({"PMIX_RANK": "0", "SLURM_LOCALID": "0"}, True),
        ({"PMI_RANK": "1", "MPI_LOCALRANKID": "1"}, True),  # the node's second: if the first stops first
        ({"PMI_RANK": "2", "MPI_LOCALRANKID": "2"}, False),  # the first two watch for it
        ({"PMIX_RANK": "5", "SLURM_LOCALID": "2"}, False),
        ({}, False),  # no launcher: a singleton has no peer to wait for in MPI_Init
        ({"PMI_RANK": "0", W.ENV: "0"}, False),
        ({"PMIX_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}, False),  # Open MPI makes no MPICH segment
    ],
)
def test_who_starts_a_watcher(monkeypatch, env, wanted):
    for k in ("PMI_RANK", "PMIX_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID", "OMPI_COMM_WORLD_SIZE", W.ENV):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    watch = W.start()
    try:
        assert (watch is not None) is wanted
    finally:
        W.end(watch, through=True)


def test_the_watcher_holds_nothing_of_the_rank_but_its_pipe(launched):
    watch = W.start()
    assert watch is not None
    try:
        time.sleep(0.5)  # its interpreter has started (while it loads, it holds libraries and modules)
        fds = {}
        for fd in os.listdir(f"/proc/{watch.pid}/fd"):
            with contextlib.suppress(FileNotFoundError):  # one of its own scans, closed since
                fds[int(fd)] = os.readlink(f"/proc/{watch.pid}/fd/{fd}")
        assert {fds[fd] for fd in (0, 1, 2)} == {os.devnull}
        others = [target for fd, target in fds.items() if fd > 2]
        assert len([t for t in others if t.startswith("pipe:")]) == 1, fds  # the read end it watches
        assert all(t.startswith(("pipe:", "/proc/")) for t in others), fds  # /proc: its own scans
        environ = Path(f"/proc/{watch.pid}/environ").read_bytes().split(b"\0")
        assert not [v for v in environ if v.startswith((b"PMI", b"MPI_", b"SLURM"))], environ
        assert os.getsid(watch.pid) == watch.pid  # a session of its own: no signal to the job's group reaches it
    finally:
        W.end(watch, through=True)
    with pytest.raises(ChildProcessError):
        os.waitpid(watch.pid, os.WNOHANG)  # exited and reaped


def test_a_mapped_segment_is_removed_when_the_pipe_closes_and_nothing_else(launched):
    """MPI_Init failed in the rank (through=False): the watcher removes what the rank mapped."""
    watch = W.start()
    assert watch is not None
    mine, mapped = fake_segment()
    unmapped = SHM / f"mpich_shm_{secrets.token_hex(4)}_0"  # another job's: named, not mapped here
    unmapped.write_bytes(b"")
    other, other_map = fake_segment(f"mpich_zz_{secrets.token_hex(4)}_0")  # mapped, not MPICH's name
    try:
        time.sleep(0.3)  # > SLOW_S: the watcher has read the maps since
        W.end(watch, through=False)
        assert not mine.exists()
        assert unmapped.exists() and other.exists()
    finally:
        mapped.close()
        other_map.close()
        for p in (mine, unmapped, other):
            p.unlink(missing_ok=True)


def test_through_mpi_init_the_watcher_is_killed_and_removes_nothing(launched):
    """The rank removes the names itself once MPI_Init has returned (_launcher_files)."""
    watch = W.start()
    assert watch is not None
    mine, mapped = fake_segment()
    try:
        time.sleep(0.3)
        W.end(watch, through=True)
        assert mine.exists()
        with pytest.raises(ChildProcessError):
            os.waitpid(watch.pid, os.WNOHANG)  # ended and reaped
    finally:
        mapped.close()
        mine.unlink(missing_ok=True)


CHILD = """
import importlib.util, mmap, os, signal, sys
spec = importlib.util.spec_from_file_location("w", sys.argv[1])  # not the package: no MPI_Init
W = importlib.util.module_from_spec(spec)
spec.loader.exec_module(W)
watch = W.start()
fd = os.open(sys.argv[2], os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
os.ftruncate(fd, 4096)
seg = mmap.mmap(fd, 4096)
print(watch.pid, flush=True)
sys.stdin.readline()              # the test saw the watcher reading
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_rank_killed_in_mpi_init_leaves_no_segment(tmp_path):
    """A process that maps a segment and is killed (as a rank in MPI_Init): its watcher removes
    the name, then exits."""
    path = SHM / f"mpich_shm_{secrets.token_hex(4)}_0"
    env = launcher_free_env(PMI_RANK="0", MPI_LOCALRANKID="0")
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, W.__file__, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        watcher = int(child.stdout.readline())
        time.sleep(0.3)  # > SLOW_S
        assert path.exists()
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.wait(30) == -signal.SIGKILL
        assert wait_for(lambda: not path.exists()), "the watcher did not remove the segment"
        assert wait_for(lambda: not Path(f"/proc/{watcher}").exists() or _zombie_or_gone(watcher))
    finally:
        child.kill()
        path.unlink(missing_ok=True)


def _zombie_or_gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


# rank 1 waits until the job's segment exists (rank 0 made it in MPI_Init, where it then waits for
# rank 1), and kills itself before its own MPI_Init: hydra then ends rank 0 inside MPI_Init.
KILLED_BEFORE_INIT = """
import os, signal, sys, time
if os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK")) == "1":
    before = set(sys.argv[1].split(","))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if {e for e in os.listdir("/dev/shm") if e.startswith(("mpich_shm_", "Intel_MPI_"))} - before:
            break
        time.sleep(0.01)
    time.sleep(0.5)  # rank 0 waits in MPI_Init; its watcher has looked (2 ms) many times over
    os.kill(os.getpid(), signal.SIGKILL)
import mpidist
print("past MPI_Init", flush=True)
"""


def run_job_counting_segments(
    tmp_path: Path, code: str, limit: int, args: list[str], before: set, **env: str
) -> tuple[subprocess.CompletedProcess, set]:
    """Run ``code`` as a 2-rank job under ``timeout limit``, supervised (MPIDIST_SUPERVISE=1 from
    launcher_free_env: the watcher is supervision's; ``code`` runs before ``import mpidist``, which
    ``python -m mpidist`` would not allow); (the job, the segment names it left beside ``before``),
    those names removed."""
    script = tmp_path / "job.py"
    script.write_text(code)
    job = subprocess.run(
        ["timeout", "-k", "5", str(limit), MPIEXEC, "-n", "2", sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        env=launcher_free_env(**env),
    )
    left = segments() - before
    for name in left:
        (SHM / name).unlink(missing_ok=True)
    return job, left


#: the watcher is for hydra's MPIs; Open MPI's launcher removes its jobs' segments itself
hydra_only = pytest.mark.skipif(MPI_VENDOR == "Open MPI", reason="no watcher under Open MPI's launcher (it cleans up)")
#: MPICH's and Intel MPI's MPI_Init bounded (Intel MPI's hydra leaves rank 0 there when rank 1 dies)
BOUND = {"MPIDIST_TIMEOUT": "3", "MPIDIST_INIT_FINALIZE_GRACE": "1"}


@hydra_only
@pytest.mark.parametrize("watched", [True, False], ids=["watched", "control-switched-off"])
def test_a_job_killed_in_mpi_init_leaves_no_segment(tmp_path, watched):
    """The control (MPIDIST_REMOVE_LAUNCHER_FILES=0) shows the segment such a job left before."""
    before = segments()
    job, left = run_job_counting_segments(
        tmp_path,
        KILLED_BEFORE_INIT,
        90,
        [",".join(sorted(before)) or "-"],
        before,
        **BOUND,
        **({} if watched else {W.ENV: "0"}),
    )
    assert job.returncode not in (0, 124), (job.returncode, job.stdout, job.stderr)
    assert "past MPI_Init" not in job.stdout
    if watched:
        assert left == set(), left
    else:
        assert len(left) == 1, left  # what the watcher removes


# the node's first rank stops before it starts its watcher (before ``import mpidist``): rank 1 makes
# the segment in MPI_Init and waits there until its bound ends it; hydra then kills rank 0.
FIRST_STOPPED = """
import os, signal
if os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK")) == "0":
    os.kill(os.getpid(), signal.SIGSTOP)   # never continued
import mpidist
print("past MPI_Init", flush=True)
"""


@hydra_only
@pytest.mark.parametrize("watched", [True, False], ids=["watched", "control-switched-off"])
def test_the_first_rank_stopped_before_its_watcher_leaves_the_seconds(tmp_path, watched):
    """A chaos trial stopped local rank 0 at 0.12 s, before it started its watcher: rank 1 made
    the segment and it was left (MPICH: Intel MPI's rank 1 makes none alone). Rank 1 starts a
    watcher too. The control shows the segment."""
    job, left = run_job_counting_segments(
        tmp_path, FIRST_STOPPED, 60, [], segments(), **BOUND, **({} if watched else {W.ENV: "0"})
    )
    assert job.returncode not in (0, 124), (job.returncode, job.stdout, job.stderr)
    assert "Timeout (0:00:04)!" in job.stderr  # rank 1's bound on MPI_Init ended the job
    if watched:
        assert left == set(), left
    elif MPI_VENDOR == "MPICH":
        assert len(left) == 1, left  # what rank 1's watcher removes


FAMILY = """
import os, subprocess, sys
if sys.argv[1] == "launcher":
    with open("/proc/self/comm", "w") as fh:  # as hydra's proxy is named
        fh.write("hydra_pmi_proxy")
watched = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
sibling = subprocess.Popen([sys.executable, "-c", sys.argv[2], sys.argv[3]], stdout=subprocess.PIPE, text=True)
sibling.stdout.readline()                 # it maps the segment
print(watched.pid, flush=True)
sys.stdin.readline()
watched.kill()
sibling.kill()
"""
MAPPER = """
import mmap, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
os.ftruncate(fd, 4096)
seg = mmap.mmap(fd, 4096)
print("mapped", flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("parent", ["launcher", "other"])
def test_siblings_are_read_only_under_a_launcher(parent):
    """A segment a sibling rank maps counts only when the parent is hydra's proxy or slurmstepd
    (one job's ranks); under any other parent (an init that adopted other jobs' processes, a
    shell) only the rank's own."""
    path = SHM / f"mpich_shm_{secrets.token_hex(4)}_0"
    family = subprocess.Popen(
        [sys.executable, "-c", FAMILY, parent, MAPPER, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=launcher_free_env(),
    )
    try:
        watched = int(family.stdout.readline())
        found = W._job_segments(watched, family.pid, opened=True)
        assert found == ({str(path)} if parent == "launcher" else set())
        assert W.segments_of(watched) == set()
    finally:
        family.stdin.write("\n")
        family.stdin.flush()
        family.wait(30)
        path.unlink(missing_ok=True)


@pytest.mark.parametrize(
    "executable, ok",
    [
        ("/usr/bin/python3.11", True),
        ("/x/.venv/bin/python", True),
        ("/opt/pypy3/bin/pypy3", True),
        ("/opt/app/bin/myapp", False),
        ("", False),
        (None, False),
    ],
)
def test_the_watcher_runs_only_on_a_python_interpreter(executable, ok):
    assert W._python(executable) is ok
