"""A watcher of a rank's exit: the line that says why the bound on ``MPI_Finalize`` ended it.

:mod:`mpidist._launch.mpi_init` bounds what is left of a rank once its exit handlers run
(``MPI_Finalize`` above all, which waits for every rank of the job) with ``alarm()``: past the
bound the kernel ends the rank ("Alarm clock"). No code of the rank can say why at that moment:
mpi4py calls ``MPI_Finalize`` after Python's finalization, so no thread, signal handler or
faulthandler of its own is left. The launcher's report of the job's end did not say it either:
a chaos trial (issue 27; SIGSTOP to rank 1 of 4 after its ``destroy_process_group``) ended
within its bound, but hydra named the stopped rank's end by the SIGTERM of its own clean-up,
and nothing in the output said that a rank had timed out.

:func:`start`, called by that exit handler, starts a **watcher** (:mod:`mpidist._launch.helper_process`):
``/bin/sh`` running :data:`SCRIPT`, a child of the rank that holds a pipe's read end and the
rank's standard error, nothing else of it. ``timeout(1)`` runs ``cat`` on the pipe: when the
rank exits, the pipe reaches end-of-file and the three processes exit (in 1-3 ms). If the rank
is still there at the bound (the watcher's parent is still the rank: no other process that took
its number), the watcher writes the rank's message to its standard error and sends it SIGALRM,
whose default action :mod:`mpidist._launch.mpi_init` set: the rank ends as the alarm would have ended
it, after a line that says so. The rank's own ``alarm()`` stays, one second later, where the
watcher could not start (no ``/bin/sh`` or ``timeout``).

Cost: one ``posix_spawn`` per rank at exit and three short-lived processes (``sh``, ``timeout``,
``cat``: ~3 ms of CPU in all on the test machine; a Python interpreter would take ~20 ms).
Linux (``/proc``) only; elsewhere the alarm alone, as before.
"""

from __future__ import annotations

import os
from typing import Optional

from mpidist._launch import helper_process

__all__ = ["start", "SCRIPT", "SHELL"]

SHELL = "/bin/sh"

#: $1 the bound (s), $2 the rank's process id, $3 the message; descriptor 3 the pipe's read end
#: (:data:`mpidist._launch.helper_process.CONTROL_FD`).
#: timeout(1) exits 124 when it ended cat at the bound, 0 when the pipe reached end-of-file.
SCRIPT = r"""
timeout "$1" cat <&3 >/dev/null 2>&1
[ $? -eq 124 ] || exit 0
read -r _ _ _ parent _ </proc/$$/stat || exit 0
[ "$parent" = "$2" ] || exit 0
printf '%s\n' "$3" >&2
kill -s ALRM "$2"
"""


def start(seconds: float, message: str) -> Optional[int]:
    """Start this process's exit watcher: past ``seconds`` s it writes ``message`` (one line) to
    this process's standard error and sends it SIGALRM. Returns the write end of the watcher's
    pipe, which this process holds until it exits (never closed: its end is the watcher's), or
    None where none could be started (not Linux, no ``/bin/sh``). Never raises."""
    if not os.path.isdir("/proc/self") or not os.access(SHELL, os.X_OK):
        return None
    argv = [SHELL, "-c", SCRIPT, "mpidist-finalize-watcher", f"{seconds:.3f}", str(os.getpid()), message]
    started = helper_process.spawn_watcher(argv, {"PATH": os.environ.get("PATH") or "/usr/bin:/bin"}, stderr=True)
    return None if started is None else started[1]
