"""Ending the whole job when one rank fails, so that its peers do not wait for it.

Two entry points share :func:`report`: :func:`install_excepthook` (init_process_group's
``sys.excepthook``) and ``python -m mpidist`` (:mod:`mpidist.run`): the traceback prefixed
``[rank r]``, short (:func:`short_traceback`; whole with ``MPIDIST_DEBUG``), every rank's flight
recorder and this rank's whole traceback written, then ``MPI_Abort`` with 1, or 130 for
KeyboardInterrupt; of an error that every member of a group raises alike, only one rank
reports (:data:`EVERY_MEMBER`). Only the main thread's unhandled exceptions end the job
(Python's rule). Source: mpi4py's ``python -m mpi4py`` (``mpi4py.run``). docs/reliability.md,
section 1.
Imports nothing of mpidist: callers pass what they need (the dump function).
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import time
import traceback
from typing import Any, Callable, Optional

__all__ = [
    "write",
    "abort_job",
    "end_job",
    "short_traceback",
    "report",
    "install_excepthook",
    "remove_excepthook",
    "excepthook_installed",
    "EVERY_MEMBER",
]

#: The attribute of an exception that every member of a group raises alike (a mismatch): the
#: global rank that reports it; the others write their traceback and wait for its MPI_Abort.
EVERY_MEMBER = "mpidist_reported_by"
_LEAD_WAIT = 5.0  # s a member waits for the reporting rank's MPI_Abort before reporting itself
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_TORCH = f"{os.sep}torch{os.sep}distributed{os.sep}"


def _ours(path: str) -> bool:
    """A frame the short traceback leaves out: mpidist's (not its examples') or torch.distributed's."""
    return path.startswith((_PACKAGE, "<mpidist ")) and not path.startswith(f"{_PACKAGE}examples") or _TORCH in path


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


def abort_job(code: int) -> None:
    """MPI_Abort(MPI_COMM_WORLD, code), a moment after this rank's last output was flushed, so
    that the launcher still forwards it before it kills the job."""
    from mpi4py import MPI  # noqa: PLC0415  (imported late: python -m mpidist imports this first)

    sys.stdout.flush()
    sys.stderr.flush()
    time.sleep(0.25)
    MPI.COMM_WORLD.Abort(code)


def short_traceback(exc_type: type, exc: BaseException, tb: Any) -> str:
    """Python's traceback of ``exc`` without the frames inside mpidist (but its examples) and
    torch.distributed, nor the exceptions it was raised from; all of it where it would leave out
    no frame, or every frame."""
    every = traceback.extract_tb(tb)
    frames = [f for f in every if not _ours(f.filename)]
    if not frames or len(frames) == len(every):
        return "".join(traceback.format_exception(exc_type, exc, tb))
    return (
        "Traceback (most recent call last; frames of mpidist and torch.distributed left out):\n"
        + "".join(traceback.format_list(frames))
        + "".join(traceback.format_exception_only(exc_type, exc))
    )


def end_job(
    rank: int, size: int, code: int, reason: str, dump: Optional[Callable[..., str]] = None, full: str = ""
) -> None:
    """End a failing multi-rank job: ``dump("abort: " + reason, full)`` (every rank's flight
    recorder, and this rank's traceback ``full``; returns the line to print; ``dump`` None when
    mpidist is not initialized), then MPI_Abort(code). With ``size == 1`` nothing is done: the
    caller exits with ``code``."""
    if size <= 1:
        return
    if dump is not None:
        with contextlib.suppress(Exception):  # the job must still end
            write(rank, dump(f"abort: {reason}", full))
    write(rank, f"aborting the MPI job (MPI_Abort, exit code {code})")
    abort_job(code)


def report(
    rank: int, size: int, exc: BaseException, tb: Any, text: str, full: bool, dump: Optional[Callable[..., str]]
) -> int:
    """Report the unhandled ``exc`` (``text``: its whole traceback, printed if ``full``, else the
    short one) and end the job as :func:`end_job` does; the exit code, for a one-rank run.
    Where every member raised it alike (:data:`EVERY_MEMBER` names another rank), this rank only
    writes its recorder and traceback and waits for that rank's abort: one report per job."""
    code, reason = 130 if isinstance(exc, KeyboardInterrupt) else 1, f"{type(exc).__name__}: {exc}"
    if getattr(exc, EVERY_MEMBER, rank) != rank and size > 1:
        with contextlib.suppress(Exception):  # the reporting rank's abort ends this process meanwhile
            if dump is not None:
                dump(f"abort: {reason}", text)
            time.sleep(_LEAD_WAIT)
    write(rank, text if full else short_traceback(type(exc), exc, tb))
    end_job(rank, size, code, reason, dump, text)
    return code


class _Hook:
    """The installed ``sys.excepthook``; ``previous`` formats the traceback."""

    def __init__(self, rank: int, size: int, dump: Callable[..., str], full: bool) -> None:
        self.rank, self.size, self.dump, self.full = rank, size, dump, full
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
        whole = self.full or self.previous is not sys.__excepthook__
        report(self.rank, self.size, exc, tb, self._format(exc_type, exc, tb), whole, self.dump)


_hook: Optional[_Hook] = None


def install_excepthook(rank: int, size: int, dump: Callable[..., str], full: bool = False) -> None:
    """Make an unhandled exception on this rank print ``[rank r]``-prefixed and abort the job
    (``dump``: as :func:`end_job`'s; ``full``: print the whole traceback, not the short one)."""
    global _hook
    remove_excepthook()
    _hook = _Hook(rank, size, dump, full)
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
