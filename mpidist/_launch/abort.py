"""Ending the whole job when one rank fails, so that its peers do not wait for it.

Without this, an unhandled exception on one rank of an MPI job ends that rank while the
others wait in their next collective (until the timeout watchdog aborts them, 30 min by
default). Two entry points share :func:`end_job`:

* :func:`install_excepthook`, called by ``init_process_group`` (unless
  ``MPIDIST_ABORT_ON_EXCEPTION=0``): a ``sys.excepthook`` that prints the traceback with
  every line prefixed ``[rank r]``, asks every rank to write its flight recorder, and
  calls ``MPI_Abort`` (exit code 1; 130 for KeyboardInterrupt). ``destroy_process_group``
  removes it (:func:`remove_excepthook`).
* ``python -m mpidist`` (:mod:`mpidist.run`), which also covers ``sys.exit(code)`` and
  exceptions raised before ``init_process_group``.

Source: mpi4py's ``python -m mpi4py`` (``mpi4py.run``), which turns an unhandled
exception into ``MPI_Abort`` for the same reason; torch's ``init_process_group``
installs a ``sys.excepthook`` too (it only prefixes the traceback with the rank).

Only the main thread's unhandled exceptions end the job: an exception in another thread
ends that thread only (Python's rule, kept: the program may join the thread and handle
its failure), and if the main thread then waits for a peer forever, the timeout catches
it. Imports nothing of mpidist: callers pass what they need (the dump function).
"""

from __future__ import annotations

import contextlib
import io
import sys
import time
import traceback
from typing import Any, Callable, Optional

__all__ = ["write", "abort_job", "end_job", "install_excepthook", "remove_excepthook", "excepthook_installed"]


class _Capture(io.StringIO):
    """Where :class:`_Hook` collects the previous hook's output."""


def _stderr() -> Any:
    """``sys.stderr``, unless someone else's in-memory buffer stands in for it (torch's
    excepthook swaps one in to prefix the output of the hook it wraps, ours): then the
    process's real stderr, since a job that is being aborted would never print that buffer."""
    if isinstance(sys.stderr, io.StringIO) and not isinstance(sys.stderr, _Capture) and sys.__stderr__ is not None:
        return sys.__stderr__
    return sys.stderr


def write(rank: Optional[int], text: str) -> None:
    """Write ``text`` to stderr at once, each line prefixed ``[rank r] `` (none if rank is None)."""
    sys.stdout.flush()
    tag = f"[rank {rank}] " if rank is not None else ""
    stream = _stderr()
    stream.write("".join(f"{tag}{line}\n" for line in text.rstrip("\n").splitlines()))
    stream.flush()


def abort_job(code: int) -> None:
    """MPI_Abort(MPI_COMM_WORLD, code), a moment after this rank's last output was flushed,
    so that the launcher still forwards it before it kills the job."""
    from mpi4py import MPI  # noqa: PLC0415  (imported late: python -m mpidist imports this first)

    sys.stdout.flush()
    sys.stderr.flush()
    time.sleep(0.25)
    MPI.COMM_WORLD.Abort(code)


def end_job(rank: int, size: int, code: int, reason: str, dump: Optional[Callable[[str], str]] = None) -> None:
    """End a failing multi-rank job: ``dump("abort: " + reason)`` (every rank writes its
    flight recorder; it returns the line to print: where, or why not; None when mpidist is
    not initialized), then MPI_Abort(code).

    In a one-rank run (``size == 1``) nothing is written or aborted and this returns: the
    caller exits with ``code`` as a plain Python program would.
    """
    if size <= 1:
        return
    if dump is not None:
        with contextlib.suppress(Exception):  # the job must still end
            write(rank, dump(f"abort: {reason}"))
    write(rank, f"aborting the MPI job (MPI_Abort, exit code {code})")
    abort_job(code)


class _Hook:
    """The installed ``sys.excepthook``; ``previous`` formats the traceback."""

    def __init__(self, rank: int, size: int, dump: Callable[[str], str]) -> None:
        self.rank, self.size, self.dump = rank, size, dump
        self.previous = sys.excepthook
        self.active = True

    def _format(self, exc_type: type, exc: BaseException, tb: Any) -> str:
        """The traceback as the previous hook prints it (captured), or as Python prints it."""
        if self.previous is not sys.__excepthook__:
            saved, sys.stderr = sys.stderr, _Capture()
            try:
                self.previous(exc_type, exc, tb)
                text = sys.stderr.getvalue()
            except Exception:  # noqa: BLE001  (a broken hook must not hide the traceback)
                text = ""
            finally:
                sys.stderr = saved
            if text.strip():
                return text
        return "".join(traceback.format_exception(exc_type, exc, tb))

    def __call__(self, exc_type: type, exc: BaseException, tb: Any) -> None:
        if not self.active:
            self.previous(exc_type, exc, tb)
            return
        write(self.rank, self._format(exc_type, exc, tb))
        code = 130 if issubclass(exc_type, KeyboardInterrupt) else 1
        end_job(self.rank, self.size, code, f"{exc_type.__name__}: {exc}", self.dump)


_hook: Optional[_Hook] = None


def install_excepthook(rank: int, size: int, dump: Callable[[str], str]) -> None:
    """Make an unhandled exception on this rank print ``[rank r]``-prefixed and abort the job
    (``dump``: as :func:`end_job`'s)."""
    global _hook
    remove_excepthook()
    _hook = _Hook(rank, size, dump)
    sys.excepthook = _hook


def remove_excepthook() -> None:
    """Undo :func:`install_excepthook`: the previous hook is back (if another hook wrapped
    ours since, ours stays in the chain but only passes the exception on)."""
    global _hook
    hook, _hook = _hook, None
    if hook is None:
        return
    hook.active = False
    if sys.excepthook is hook:
        sys.excepthook = hook.previous


def excepthook_installed() -> bool:
    """True while init_process_group's hook is active."""
    return _hook is not None
