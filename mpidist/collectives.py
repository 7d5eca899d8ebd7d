"""all_reduce, broadcast, barrier and monitored_barrier with torch.distributed's names,
arguments and semantics, on numpy (host) and cupy (device) arrays.

A call on host arrays goes to the MPI backend's body of the same name
(:mod:`mpidist._mpi.collectives`: validation, the group, the algorithm, the launch); one on
device arrays to the router (:mod:`mpidist.device.route`), which picks the device backend.
A rank that is not a member of ``group`` returns None and leaves its buffers alone.
src/dst are global ranks, as in torch.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from mpidist._group import ProcessGroup
from mpidist._mpi import collectives as H
from mpidist._mpi.collectives import ALGORITHMS, barrier, monitored_barrier
from mpidist._reduce_op import ReduceOp
from mpidist.device.route import device_call, takes
from mpidist.work import Work

__all__ = ["all_reduce", "broadcast", "barrier", "monitored_barrier", "ALGORITHMS"]

_ndarray = np.ndarray  # module globals: an attribute lookup costs the 8-byte all_reduce ~20 ns
_all_reduce = H.all_reduce


def all_reduce(tensor: np.ndarray, op: ReduceOp = ReduceOp.SUM, group: Optional[ProcessGroup] = None,
               async_op: bool = False, *, algorithm: Optional[str] = None) -> Optional[Work]:
    """Reduce ``tensor`` across the group in place; every rank gets the bitwise-same result.

    Args:
        tensor: C-contiguous, writable numpy array, any shape; same shape and dtype on
            every rank. Overwritten on every member rank.
        op: a :class:`ReduceOp`, or :func:`mpidist.make_premul_sum` ``(factor)`` for
            PREMUL_SUM. AVG needs a float or complex dtype; MIN/MAX are not defined for
            complex; bitwise ops need integers or bool.
        group: the process group (default: all ranks).
        async_op: return a :class:`Work` instead of blocking.
        algorithm: mpidist extension. ``"mpi"`` (MPI_Allreduce), ``"ring"`` (mpidist's
            bandwidth-optimal ring, :func:`mpidist.algorithms.ring_all_reduce`), ``"shm"``
            (through an MPI-3 shared-memory window, :class:`mpidist.algorithms.ShmAllReduce`;
            every rank of the group must be on one node), or None to let mpidist choose
            the fastest measured for the size and the group: shared memory from the
            measured crossover size up when the group is on one node, below it
            MPI_Allreduce (or the ring where MPI cannot reduce the dtype, e.g. float16).
            See docs/architecture.md, "Choosing the all-reduce algorithm";
            ``MPIDIST_SHM_MIN_BYTES`` overrides the crossover (``off`` or 0: never shm).

    Returns:
        None, or a Work when ``async_op`` (None on non-members).

    Raises:
        TypeError / ValueError: bad array, op, or algorithm (see torch.distributed.all_reduce);
            ValueError for ``algorithm="shm"`` on a group that spans nodes (on every rank).
        DistBackendError: MPI reported an error.
    """
    if type(tensor) is not _ndarray and takes(tensor):  # device arrays: to the router
        return device_call("all_reduce", locals())
    return _all_reduce(tensor, op, group, async_op, algorithm)  # by position: the 8-byte path feels keywords


def broadcast(tensor: np.ndarray, src: Optional[int] = None, group: Optional[ProcessGroup] = None,
              async_op: bool = False, group_src: Optional[int] = None) -> Optional[Work]:
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
    if type(tensor) is not _ndarray and takes(tensor):  # device arrays: to the router
        return device_call("broadcast", locals())
    return H.broadcast(tensor, src, group, async_op, group_src)
