"""What every public op does between validation and MPI: resolve the group, map ranks,
run inline or on the group's engine, and turn MPI errors into mpidist's.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np
from mpi4py import MPI

from mpidist import _runtime
from mpidist.errors import from_mpi, prefix
from mpidist.group import ProcessGroup
from mpidist.work import CompletedWork, FutureWork, Work

__all__ = ["launch", "member", "group_root"]


def _guarded(op: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any) -> Any:
        try:
            return fn(*args)
        except MPI.Exception as exc:
            raise from_mpi(op, exc) from exc
    return run


def launch(group: ProcessGroup, op: str, fn: Callable[..., Any], args: tuple, async_op: bool,
           outputs: tuple = ()) -> Optional[Work]:
    """Run ``fn(*args)`` in the group's op order; return a Work when ``async_op``.

    Sync: inline when nothing is queued, else behind the queued ops; returns None.
    Async: queued on the group's engine thread (``FutureWork``); on a one-rank group,
    or an MPI without MPI_THREAD_MULTIPLE, run at once (``CompletedWork``).
    """
    run = _guarded(op, fn)
    if not async_op:
        group.engine.run_sync(run, *args)
        return None
    if group.size() == 1 or not _runtime.state().thread_multiple:
        group.engine.run_sync(run, *args)
        return CompletedWork(op, prefix(op), outputs)
    return FutureWork(op, prefix(op), group.engine.submit(run, *args), outputs)


def member(group: Optional[ProcessGroup]) -> Optional[ProcessGroup]:
    """The resolved group if the caller is a member, else None (the op is a no-op)."""
    if group is None:  # the common case, kept to one attribute lookup
        return _runtime.state().world
    g = _runtime.resolve_group(group)
    return g if g.comm is not None else None


def group_root(g: ProcessGroup, rank: Any, op: str, arg: str) -> int:
    """Group rank of global rank ``rank`` given as argument ``arg`` of ``op``."""
    if not isinstance(rank, (int, np.integer)) or isinstance(rank, bool):
        raise TypeError(f"{prefix(op)} {arg} must be an int (a global rank), got {type(rank).__name__}")
    try:
        return g.group_rank(int(rank))
    except ValueError as exc:
        raise ValueError(f"{prefix(op)} {arg}={rank}: {exc}") from None
