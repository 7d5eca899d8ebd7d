"""A watcher of a rank's exit: the line that says why the bound on ``MPI_Finalize`` ended it.

No code of the rank can say it (mpi4py calls ``MPI_Finalize`` after Python's finalization),
so :func:`start` spawns ``/bin/sh`` running :data:`SCRIPT` (:mod:`mpidist._launch.helper_process`),
holding only a pipe's read end and the rank's stderr: when the rank exits the pipe reaches
end-of-file and the watcher exits (1-3 ms); if its parent is still the rank at the bound, it
writes the rank's line and sends it SIGALRM, then SIGCONT (a rank stopped by SIGSTOP takes
the SIGALRM only once continued: a chaos trial stopped one in its exit, after its peers had
finished, and the job hung). The rank's own ``alarm()``
(:mod:`mpidist._launch.mpi_init`), one second later, covers a watcher that could not start.
~3 ms of CPU per rank at exit (a Python interpreter would take ~20 ms). Linux (``/proc``)
only. Why and when: docs/reliability.md, section 11.
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
kill -s CONT "$2"
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
