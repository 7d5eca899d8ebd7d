"""A watcher of ``MPI_Init``: a process outside the rank that removes the names of the
shared-memory segments ``MPI_Init`` makes when the job's ranks die before they are through it
(docs/reliability.md, section 12: a job killed or stopped at start-up left MPICH's
``/dev/shm/mpich_shm_*``, 2-4 MB each until reboot).

:func:`start`, called under supervision just before ``MPI_Init`` by the node's first two ranks
under hydra or srun (:data:`WATCHING`; not under Open MPI, whose launcher cleans up), runs this
file as a script in a fresh ``python -I -S`` (standard library only, a session of its own, no
descriptor of the rank's but a pipe's read end). It polls ``/dev/shm`` (:data:`POLL_S`, faster
for :data:`HOT_S` after a change) and records the segments (:func:`is_segment`) the rank and its
siblings (the other children of ``hydra_pmi_proxy`` or ``slurmstepd``) map or hold open. Once
``MPI_Init`` has returned, :func:`end` kills it; if the rank dies first, the pipe reaches
end-of-file and the watcher removes each recorded name still there (a regular file of this user:
:func:`remove`). The design of Python's ``multiprocessing.resource_tracker``, narrowed to the one
window no code of the rank can cover. Linux only; ``MPIDIST_REMOVE_LAUNCHER_FILES=0`` switches
it off. Imports nothing but the standard library's cheapest modules (each other one adds 5-20 ms
to the watcher's start).
"""

from __future__ import annotations

import os
import select
import stat
import sys
import time

TYPE_CHECKING = False  # (not typing's: the watcher imports no more than it needs)
if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = [
    "Watch",
    "start",
    "end",
    "enabled",
    "remove",
    "segments_of",
    "open_files",
    "comm_of",
    "is_segment",
    "ENV",
    "POLL_S",
    "EXIT_S",
]

ENV = "MPIDIST_REMOVE_LAUNCHER_FILES"
POLL_S = 0.002  # s between two looks at /dev/shm, for FAST_FOR_S
FAST_FOR_S = 10.0
HOT_S = 0.02  # s of readings every POLL_S (maps and descriptors) after /dev/shm changed
SLOW_S = 0.05  # s between readings otherwise
EXIT_S = 10.0  # s a rank waits at most for its watcher's exit
_PREFIX = "/dev/shm/mpich_shm_"
_UCX_PREFIX = "/dev/shm/ucx_shm_posix_"
_INTEL_PREFIX = "/dev/shm/Intel_MPI_"  # + mkstemp's 6 letters and digits
_ALNUM = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")
_LAUNCHED = ("PMI_RANK", "PMIX_RANK")
_LOCAL_RANK = ("MPI_LOCALRANKID", "SLURM_LOCALID")  # hydra's and Slurm's rank on the node
_OPEN_MPI = "OMPI_COMM_WORLD_SIZE"  # Open MPI's launcher: its MPI makes no MPICH segment
_HEX = frozenset("0123456789abcdef")
_LAUNCHERS = frozenset({"hydra_pmi_proxy", "slurmstepd"})  # /proc/<pid>/comm


def _hex(text: str) -> bool:
    return bool(text) and set(text) <= _HEX


def is_segment(path: str) -> bool:
    """Whether ``path`` names a segment that MPICH's ``MPI_Init`` makes: its own,
    ``/dev/shm/mpich_shm_<hex>_<decimal>``, UCX's (MPICH's ch4:ucx device),
    ``/dev/shm/ucx_shm_posix_<hex>``, which UCX itself unlinks 2-6 ms after making it, or Intel
    MPI's, ``/dev/shm/Intel_MPI_<6 letters or digits>`` (192 bytes; Intel MPI unlinks them by the
    end of its ``MPI_Init``)."""
    if path.startswith(_PREFIX):
        parts = path[len(_PREFIX) :].split("_")
        return len(parts) == 2 and _hex(parts[0]) and parts[1].isdigit() and parts[1].isascii()
    if path.startswith(_INTEL_PREFIX):
        tail = path[len(_INTEL_PREFIX) :]
        return len(tail) == 6 and set(tail) <= _ALNUM
    return path.startswith(_UCX_PREFIX) and _hex(path[len(_UCX_PREFIX) :])


def enabled() -> bool:
    """Whether mpidist removes the launcher's files and watches ``MPI_Init``: Linux (``/proc``),
    and ``MPIDIST_REMOVE_LAUNCHER_FILES`` not ``0``."""
    return os.environ.get(ENV, "1").strip() != "0" and os.path.isdir("/proc/self")


def segments_of(pid: int | str, match: Callable[[str], object] = is_segment) -> set[str]:
    """The segments (those ``match`` accepts: :func:`is_segment`) process ``pid`` (or ``"self"``)
    maps, by the name they still have (a removed one shows ``(deleted)`` and is left out); none
    if its maps cannot be read."""
    try:
        with open(f"/proc/{pid}/maps") as fh:
            text = fh.read()
    except OSError:
        return set()
    fields = (line.split(None, 5) for line in text.splitlines())  # address perms offset dev inode [path]
    return {f[5] for f in fields if len(f) == 6 and match(f[5])}


def open_files(pid: int) -> set[str]:
    """What process ``pid``'s descriptors point at (``/proc/<pid>/fd``); none if unreadable."""
    found: set[str] = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return found
    for fd in fds:
        try:
            found.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:  # closed since
            continue
    return found


def remove(path: str) -> bool:
    """Unlink ``path`` if it is a regular file of this user (``os.lstat``: a symbolic link is
    never followed or removed); True if this call removed it. Never raises."""
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            return False
        os.unlink(path)
    except OSError:  # gone already (another rank of the node was first), or not ours to remove
        return False
    return True


def _children_of(pid: int) -> set[int]:
    """The children of ``pid`` (``/proc/<pid>/task/<tid>/children``; none where the kernel has
    no such file)."""
    found: set[int] = set()
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as fh:
                found.update(int(c) for c in fh.read().split())
    except (OSError, ValueError):
        pass
    return found


def comm_of(pid: int) -> str:
    """Process ``pid``'s command name (``/proc/<pid>/comm``); "" if unreadable."""
    try:
        with open(f"/proc/{pid}/comm") as fh:
            return fh.read().strip()
    except OSError:
        return ""


def _job_segments(pid: int, parent: int | None, opened: bool) -> set[str]:
    """The segments mapped (and, with ``opened``, held open) by ``pid`` and, when ``parent`` is
    a launcher that serves one job on this node (hydra's proxy, for MPICH and Intel MPI, or the
    step's slurmstepd), by its siblings: that job's ranks here, any of which may be the one that
    makes the segment."""
    found: set[str] = set()
    for proc in {pid} | (_children_of(parent) if parent and comm_of(parent) in _LAUNCHERS else set()):
        found |= segments_of(proc)
        if opened:  # made, not mapped yet
            found |= {path for path in open_files(proc) if is_segment(path)}
    return found


def _shm_mtime() -> int:
    try:
        return os.stat("/dev/shm").st_mtime_ns
    except OSError:
        return 0


def _watch(pid: int, parent: int, control: int) -> int:
    """The watcher (see the module docstring): record the segments that ``pid`` and its siblings
    (the other children of ``parent``) map or hold open until ``control`` reads end-of-file, look
    once more, then remove those still named."""
    mtime = _shm_mtime()
    seen = _job_segments(pid, parent, opened=True)
    t0 = last = time.monotonic()
    hot_until = 0.0
    while True:
        period = POLL_S if time.monotonic() - t0 < FAST_FOR_S else SLOW_S
        if select.select([control], [], [], period)[0]:
            try:
                if not os.read(control, 64):
                    break  # end-of-file: the rank is gone, or MPI_Init failed in it
            except OSError:
                break
            continue
        now, changed = time.monotonic(), _shm_mtime()
        if changed != mtime:  # a name made or removed in /dev/shm: read the processes for a while
            mtime, hot_until = changed, now + HOT_S
        hot = now < hot_until
        if hot or now - last >= SLOW_S:
            seen |= _job_segments(pid, parent, opened=hot)
            last = now
    seen |= _job_segments(pid, parent, opened=True)  # the siblings hydra has not ended yet
    for path in sorted(seen):
        remove(path)
    return 0


class Watch:
    """A rank's handle on its watcher: its process id and the write end of its pipe."""

    def __init__(self, pid: int, control: int) -> None:
        self.pid, self.control = pid, control


#: The node's first ranks that start a watcher (by rank on the node): two, so that one stopped
#: or killed before it started its own leaves the other's (a chaos trial stopped local rank 0 at
#: 0.12 s, before its watcher, and rank 1 made the segment and left it); the cost, one more
#: short-lived interpreter per node, stays the same at any number of ranks per node.
WATCHING = ("0", "1")


def _wanted() -> bool:
    env = os.environ
    if not enabled() or not any(k in env for k in _LAUNCHED) or _OPEN_MPI in env:
        return False
    return next((env[k] for k in _LOCAL_RANK if k in env), "0").strip() in WATCHING


def _python(executable: str | None) -> bool:
    """Whether ``executable`` is a Python interpreter to run the watcher with (not an
    application that embeds Python, or a frozen one, which would start itself again)."""
    name = os.path.basename(executable or "")
    return name.startswith(("python", "pypy")) and not getattr(sys, "frozen", False)


def start() -> Watch | None:
    """Start this rank's watcher of ``MPI_Init`` (see the module docstring); None where none is
    wanted (no launcher, not the node's first rank, switched off, not Linux) or it could not be
    started. Call just before ``MPI_Init``, then :func:`end`. Never raises."""
    if not _wanted() or not os.path.isfile(os.path.abspath(__file__)) or not _python(sys.executable):
        return None
    from mpidist._launch import helper_process as H  # noqa: PLC0415  (not at the top: this file also runs as the watcher, where mpidist is not importable)

    env = {k: os.environ[k] for k in ("PATH", "LD_LIBRARY_PATH") if k in os.environ}
    me = [str(os.getpid()), str(os.getppid()), str(H.CONTROL_FD)]
    started = H.spawn_watcher([sys.executable, "-I", "-S", os.path.abspath(__file__), *me], env, setsid=True)
    return None if started is None else Watch(*started)


def end(watch: Watch | None, through: bool) -> None:
    """End the watcher and reap it. ``through``: ``MPI_Init`` has returned and this rank has
    removed the names itself (:func:`mpidist._launch.launcher_files.remove_names`), so the watcher is
    killed; otherwise (``MPI_Init`` failed) its pipe is closed, and it removes the names it
    recorded that are still there, then exits (killed after :data:`EXIT_S` s). Never raises."""
    if watch is None:
        return
    from mpidist._launch.helper_process import kill, reap  # noqa: PLC0415  (see start)

    if through:  # killed before its pipe closes: end-of-file would have it remove names
        kill(watch.pid)
    try:
        os.close(watch.control)
    except OSError:
        pass
    if not reap(watch.pid, EXIT_S):
        kill(watch.pid)
        reap(watch.pid, EXIT_S)


if __name__ == "__main__":  # the watcher: python -I -S init_watcher.py PID PARENT_PID CONTROL_FD
    os._exit(_watch(*(int(a) for a in sys.argv[1:4])))  # no interpreter shutdown: nothing to flush
