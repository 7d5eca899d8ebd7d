"""torch.distributed's helpers around communication: breakpoint (debug one rank while the
others wait) and record_comm (a profiling name for the collectives of a block)."""

from __future__ import annotations

import contextlib
import datetime
import pdb
import sys
from collections.abc import Iterator
from typing import Optional

from mpidist._runtime import world as runtime
from mpidist.collectives import barrier
from mpidist.errors import prefix

__all__ = ["breakpoint", "record_comm"]

# call site (file, line) -> how many times it was reached, for ``skip``
_reached: dict = {}


class _Pdb(pdb.Pdb):
    """pdb reading the terminal (``/dev/stdin``) even where ``sys.stdin`` was replaced, as
    torch's _DistributedPdb does for processes started by multiprocessing."""

    def interaction(self, *args, **kwargs):  # noqa: ANN002, ANN003, D102
        saved = sys.stdin
        try:
            with open("/dev/stdin") as sys.stdin:
                pdb.Pdb.interaction(self, *args, **kwargs)
        finally:
            sys.stdin = saved


def breakpoint(rank: int = 0, skip: int = 0, timeout_s: Optional[float] = 3600) -> None:  # noqa: A001
    """Stop in pdb on global rank ``rank`` only; every other rank waits in a barrier until
    the debugger continues (torch.distributed.breakpoint). Collective over the default
    group.

    Args:
        rank: the global rank that stops.
        skip: return at once the first ``skip`` times this call site is reached (counted
            per call site; torch counts every call together).
        timeout_s: how long the other ranks wait (the barrier's ``timeout``; None: the
            default group's timeout). torch instead sets it as every group's timeout
            from then on.

    Under ``mpiexec``, only rank 0 usually gets the terminal's input (MPICH and Open MPI
    forward stdin to rank 0), so debug rank 0 or run the job so that the rank's stdin is
    a terminal.

    Raises:
        TypeError: ``rank`` or ``skip`` not an int. ValueError: ``rank`` not in the world,
            ``skip`` negative, ``timeout_s`` not positive (on the waiting ranks), or
            before init_process_group.
    """
    st = runtime.state()
    for arg, value in (("rank", rank), ("skip", skip)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{prefix('breakpoint')} {arg} must be an int, got {type(value).__name__}")
    if not 0 <= rank < st.world_size:
        raise ValueError(f"{prefix('breakpoint')} rank must be a global rank in [0, {st.world_size}), got {rank}")
    if skip < 0:
        raise ValueError(f"{prefix('breakpoint')} skip must be >= 0, got {skip}")
    timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    if timeout is not None and timeout.total_seconds() <= 0:
        raise ValueError(f"{prefix('breakpoint')} timeout_s must be positive or None, got {timeout_s}")
    if skip > 0:
        caller = sys._getframe(1)
        site = (caller.f_code.co_filename, caller.f_lineno)
        _reached[site] = _reached.get(site, 0) + 1
        if _reached[site] <= skip:
            return
    if st.rank == rank:
        debugger = _Pdb()
        debugger.message(
            f"\n!!! ATTENTION !!!\n\nType 'up' to get to the frame that called dist.breakpoint(rank={rank})\n"
        )
        debugger.set_trace(sys._getframe(0))
    barrier(timeout=timeout)


@contextlib.contextmanager
def record_comm(name: str) -> Iterator[None]:
    """torch's profiling name for the collectives issued inside the block. mpidist has no
    profiler integration: the block runs unchanged and ``name`` is not recorded (the
    flight recorder names each op by its function). Accepted so that programs using it run.

    Raises:
        TypeError: ``name`` is not a string.
    """
    if not isinstance(name, str):
        raise TypeError(f"{prefix('record_comm')} name must be a string, got {type(name).__name__}")
    yield
