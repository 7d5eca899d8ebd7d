"""Ending the whole job when one rank fails, so that its peers do not wait for it.

Two entry points share :func:`end_job`: :func:`install_excepthook` (init_process_group's
``sys.excepthook``: the traceback prefixed ``[rank r]``, every rank's flight recorder, then
``MPI_Abort`` with 1, or 130 for KeyboardInterrupt) and ``python -m mpidist``
(:mod:`mpidist.run`). Only the main thread's unhandled exceptions end the job (Python's
rule). Source: mpi4py's ``python -m mpi4py`` (``mpi4py.run``). docs/reliability.md, section 1.
Imports nothing of mpidist: callers pass what they need (the dump function).
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
    """``sys.stderr``, or the real stderr where another hook's in-memory buffer stands in for
    it (torch's, wrapping ours): an aborted job would never print that buffer."""
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


#: monotonic s until which abort_job waits for peers told of this rank's error to abort with theirs
told_until = 0.0


def abort_job(code: int) -> None:
    """MPI_Abort(MPI_COMM_WORLD, code), a moment (or until :data:`told_until`) after this rank's
    last output was flushed, so that the launcher still forwards it before it kills the job."""
    from mpi4py import MPI  # noqa: PLC0415  (imported late: python -m mpidist imports this first)

    sys.stdout.flush()
    sys.stderr.flush()
    time.sleep(max(0.25, told_until - time.monotonic()))
    MPI.COMM_WORLD.Abort(code)


def end_job(rank: int, size: int, code: int, reason: str, dump: Optional[Callable[[str], str]] = None) -> None:
    """End a failing multi-rank job: ``dump("abort: " + reason)`` (every rank's flight recorder;
    returns the line to print; ``dump`` None when mpidist is not initialized), then
    MPI_Abort(code). With ``size == 1`` nothing is done: the caller exits with ``code``."""
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
