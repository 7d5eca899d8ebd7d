"""all_reduce, broadcast, barrier and monitored_barrier with torch.distributed's names,
arguments and semantics, on numpy (host) and cupy (device) arrays.

Bodies: :mod:`mpidist._backends.mpi.collectives` (routing: :mod:`mpidist._public_op`).
A rank that is not a member of ``group`` returns None and leaves its buffers alone.
src/dst are global ranks, as in torch.
"""

from __future__ import annotations

import datetime
from typing import Optional, Union

import numpy as np

from mpidist._arrays.reduce_op import ReduceOp
from mpidist._backends.mpi import collectives as H
from mpidist._backends.mpi.collectives import ALGORITHMS
from mpidist._core.group import ProcessGroup
from mpidist._public_op import public_op
from mpidist.work import Work

__all__ = ["all_reduce", "broadcast", "barrier", "monitored_barrier", "ALGORITHMS"]


@public_op(H.all_reduce, inline=H.INLINE)
def all_reduce(
    tensor: np.ndarray,
    op: ReduceOp = ReduceOp.SUM,
    group: Optional[ProcessGroup] = None,
    async_op: bool = False,
    *,
    algorithm: Optional[str] = None,
) -> Optional[Work]:
    """Reduce ``tensor`` across the group in place; every rank gets the bitwise-same result.

    Args:
        tensor: C-contiguous, writable numpy array, any shape; same shape and dtype on
            every rank. Overwritten on every member rank.
        op: a :class:`ReduceOp`, or :func:`mpidist.make_premul_sum` ``(factor)`` for
            PREMUL_SUM. AVG needs a float or complex dtype; MIN/MAX are not defined for
            complex; bitwise ops need integers or bool.
        group: the process group (default: all ranks).
        async_op: return a :class:`Work` instead of blocking.
        algorithm: mpidist extension. ``"mpi"`` (MPI_Allreduce), ``"ring"``
            (:func:`mpidist.algorithms.ring_all_reduce`), ``"shm"``
            (:class:`mpidist.algorithms.ShmAllReduce`; the group must be on one node),
            ``"hierarchical"`` (:class:`mpidist.algorithms.HierAllReduce`: shared memory in
            each node, MPI between one leader per node), or None: the fastest measured for
            the size, dtype and group (docs/architecture.md, "Choosing the all-reduce
            algorithm"; ``MPIDIST_SHM_MIN_BYTES`` overrides the shared-memory sizes).

    Returns:
        None, or a Work when ``async_op`` (None on non-members).

    Raises:
        TypeError / ValueError: bad array, op, or algorithm (see torch.distributed.all_reduce);
            ValueError for ``algorithm="shm"`` on a group that spans nodes (on every rank).
        DistBackendError: MPI reported an error.
    """


@public_op(H.broadcast)
def broadcast(
    tensor: np.ndarray,
    src: Optional[int] = None,
    group: Optional[ProcessGroup] = None,
    async_op: bool = False,
    group_src: Optional[int] = None,
) -> Optional[Work]:
    """Copy ``tensor`` from the source rank to every member of the group (MPI_Bcast).

    Args:
        tensor: C-contiguous, writable array, same shape and dtype on every rank;
            overwritten on every member but the source.
        src: the source as a global rank; or
        group_src: the source as a rank in ``group`` (torch 2.4+). Exactly one of
            ``src`` and ``group_src`` must be given.
        group, async_op: as in all_reduce.

    Raises:
        ValueError: both or neither of ``src``/``group_src``; a source that is not a member.
    """


@public_op(H.barrier)
def barrier(
    group: Optional[ProcessGroup] = None,
    async_op: bool = False,
    device_ids: Optional[list[int]] = None,
    timeout: Optional[datetime.timedelta] = None,
) -> Optional[Work]:
    """Block until every member of the group has entered the barrier (MPI_Barrier).

    ``device_ids`` is accepted for torch compatibility and ignored on host arrays.
    ``timeout`` (torch 2.13; a ``datetime.timedelta``, or seconds): how long this barrier
    may take instead of the group's timeout (init_process_group's, ``MPIDIST_TIMEOUT``);
    past it the watchdog acts as for any op that overruns its timeout: it names the
    ranks that did not arrive and aborts the job, or, with MPIDIST_ABORT_ON_TIMEOUT=0,
    raises :class:`DistError` (docs/reliability.md).

    Raises:
        TypeError / ValueError: ``timeout`` not a timedelta or number, or not positive.
    """


@public_op(H.monitored_barrier)
def monitored_barrier(
    group: Optional[ProcessGroup] = None,
    timeout: Union[datetime.timedelta, float, None] = None,
    wait_all_ranks: bool = False,
) -> None:
    """A barrier that names the ranks that did not arrive (torch.distributed.monitored_barrier).

    Group rank 0 waits up to ``timeout`` for every other member to check in (point-to-
    point on the group's communicator), then sends each of them its verdict. If all
    arrived, every rank returns None. Otherwise rank 0 raises :class:`DistError`
    ``"[rank 0/n] monitored_barrier: rank(s) [2] did not reach the barrier within 1.0 s"``
    naming every missing rank with ``wait_all_ranks=True``, else the first (lowest)
    one; the other ranks, late ones included, raise DistError quoting rank 0's verdict
    once they get it. A non-root rank waits at most ``timeout + min(timeout, 5 s)``
    for the verdict (the grace covers rank 0 entering later), then raises DistError.

    Args:
        group: the process group (default: all ranks); a non-member returns None.
        timeout: ``datetime.timedelta`` or seconds; default: init_process_group's timeout.
        wait_all_ranks: name all missing ranks, not only the first.

    Ranks are global ranks. Nothing is left hanging after a failure: messages that could
    not complete stay posted and are drained by later calls, each of which uses its own
    tag (MPI_TAG_UB - 4095 .. MPI_TAG_UB - 1 are reserved for this on the group's
    communicator; do not use them with send/recv on the same group).

    Raises:
        TypeError / ValueError: bad ``timeout`` (not a timedelta or number, not positive).
        DistError: a rank did not arrive in time (see above).
    """
