"""Start a short-lived helper process beside a rank, sharing none of its descriptors.

mpidist's two watchers (:mod:`mpidist._launch.init_watcher` for ``MPI_Init``,
:mod:`mpidist._launch.finalize_watcher` for ``MPI_Finalize``) are programs that must outlive, or
act on, a rank that no code of its own can run in any more. Both start the same way:
``posix_spawn`` (no ``fork`` of a large rank, no Python in the child before ``exec``), with
the standard streams on ``/dev/null`` but the ones asked for, every other descriptor that a
child would inherit (the PMI socket, the program's files) closed, and SIGPIPE and SIGXFSZ,
which Python ignores and a child would inherit ignored, at their default actions.

Imports nothing of mpidist: the lowest layer.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Mapping
from typing import Optional

__all__ = ["spawn", "spawn_watcher", "reap", "kill", "CONTROL_FD"]

_DEFAULTS = (signal.SIGPIPE, signal.SIGXFSZ)  # Python ignores both; a child inherits that

#: The descriptor at which a watcher (:func:`spawn_watcher`) holds its pipe's read end.
CONTROL_FD = 3


def spawn(
    argv: list[str],
    env: Mapping[str, str],
    fds: Mapping[int, int] = {},  # noqa: B006  (read only)
    stderr: bool = False,
    setsid: bool = False,
) -> int:
    """Start ``argv[0]`` (a path) with ``argv`` and ``env``; returns its process id.

    ``fds`` maps a descriptor number in the child to the descriptor of this process it holds
    there (the same number: made inheritable here); with ``stderr`` the child also holds this
    process's standard error. Its standard input, output and (without ``stderr``) error are
    ``/dev/null``; it holds no other descriptor of this process. ``setsid``: the child leads a
    session of its own (out of reach of signals to the rank's process group). Raises OSError
    where the spawn fails."""
    sources = set(fds.values())
    streams = (0, 1) if stderr else (0, 1, 2)
    actions: list[tuple] = [(os.POSIX_SPAWN_OPEN, fd, os.devnull, os.O_RDWR, 0) for fd in streams]
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd not in sources:
            try:
                if os.get_inheritable(fd):
                    actions.append((os.POSIX_SPAWN_CLOSE, fd))
            except OSError:  # the descriptor listdir itself used, closed since
                pass
    for child, mine in fds.items():
        if child == mine:
            os.set_inheritable(mine, True)
        else:  # dup2 in the child; the copy there is inheritable, this process's stays as it is
            actions.append((os.POSIX_SPAWN_DUP2, mine, child))
    return os.posix_spawn(argv[0], argv, dict(env), file_actions=actions, setsid=setsid, setsigdef=_DEFAULTS)


def spawn_watcher(
    argv: list[str], env: Mapping[str, str], stderr: bool = False, setsid: bool = False
) -> Optional[tuple[int, int]]:
    """Start a watcher of this process as :func:`spawn` starts ``argv``, holding at
    :data:`CONTROL_FD` the read end of a new pipe whose write end only this process holds (not
    inheritable): the watcher reads end-of-file there once this process has closed it or exited.
    Returns (the watcher's process id, the write end), or None where the pipe or the spawn
    failed. Never raises OSError."""
    try:
        read_end, write_end = os.pipe()
    except OSError:  # out of descriptors
        return None
    try:
        pid = spawn(argv, env, {CONTROL_FD: read_end}, stderr, setsid)
    except OSError:
        os.close(write_end)
        return None
    finally:
        os.close(read_end)
    return pid, write_end


def reap(pid: int, limit: float) -> bool:
    """Wait up to ``limit`` s for child ``pid`` to exit and reap it; True if it did."""
    deadline, delay = time.monotonic() + limit, 0.0002
    while True:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return True
        if done:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(delay)
        delay = min(2 * delay, 0.01)


def kill(pid: int) -> None:
    """SIGKILL ``pid``; nothing if it is gone."""
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
