"""Collectives with torch.distributed's names, arguments and semantics, on numpy arrays.

Each function validates its arguments (errors name rank, op and argument, expected
versus got), resolves the group, and either runs the op inline (``async_op=False``,
returns None) or hands it to the group's engine thread and returns a :class:`Work`.
A rank that is not a member of ``group`` returns None and leaves its buffers alone.
src/dst are global ranks, as in torch.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
from mpi4py import MPI

from mpidist._buffers import host_array, mpi_datatype, mpi_reducible
from mpidist._dispatch import group_root, launch, member
from mpidist.algorithms.ring import ring_all_reduce
from mpidist.errors import prefix
from mpidist.group import ProcessGroup
from mpidist.reduce_op import ReduceOp, check_op_dtype, to_mpi_op
from mpidist.work import Work

__all__ = ["all_reduce", "broadcast", "barrier", "ALGORITHMS"]

#: Values of all_reduce's ``algorithm`` argument.
ALGORITHMS = ("mpi", "ring")


def _mpi_all_reduce(comm: MPI.Comm, arr: np.ndarray, op: ReduceOp) -> None:
    comm.Allreduce(MPI.IN_PLACE, [arr, mpi_datatype(arr.dtype)], to_mpi_op(op, arr.dtype))
    if op is ReduceOp.AVG:
        arr /= comm.Get_size()


def _ring(g: ProcessGroup, arr: np.ndarray, op: ReduceOp) -> None:
    ring_all_reduce(g.ring_comm, arr, op)
    if op is ReduceOp.AVG:
        arr /= g.size()


def all_reduce(tensor: np.ndarray, op: ReduceOp = ReduceOp.SUM, group: Optional[ProcessGroup] = None,
               async_op: bool = False, *, algorithm: Optional[str] = None) -> Optional[Work]:
    """Reduce ``tensor`` across the group in place; every rank gets the bitwise-same result.

    Args:
        tensor: C-contiguous, writable numpy array, any shape; same shape and dtype on
            every rank. Overwritten on every member rank.
        op: a :class:`ReduceOp`. AVG needs a float or complex dtype; MIN/MAX are not
            defined for complex; bitwise ops need integers or bool.
        group: the process group (default: all ranks).
        async_op: return a :class:`Work` instead of blocking.
        algorithm: mpidist extension. ``"mpi"`` (MPI_Allreduce), ``"ring"`` (mpidist's
            bandwidth-optimal ring, :func:`mpidist.algorithms.ring_all_reduce`), or None
            to let mpidist choose (MPI, or the ring where MPI cannot reduce the dtype,
            e.g. float16).

    Returns:
        None, or a Work when ``async_op`` (None on non-members).

    Raises:
        TypeError / ValueError: bad array, op, or algorithm (see torch.distributed.all_reduce).
        DistBackendError: MPI reported an error.
    """
    g = member(group)
    if g is None:
        return None
    arr = host_array(tensor, "all_reduce", "tensor", writable=True)
    check_op_dtype(op, arr.dtype, prefix("all_reduce"))
    if algorithm is None:
        algorithm = "mpi" if mpi_reducible(arr.dtype) else "ring"
    if algorithm == "mpi":
        if not mpi_reducible(arr.dtype):
            raise TypeError(f"{prefix('all_reduce')} algorithm='mpi' cannot reduce dtype {arr.dtype}; "
                            f"use algorithm='ring' or None")
        return launch(g, "all_reduce", _mpi_all_reduce, (g.comm, arr, op), async_op, (tensor,))
    if algorithm == "ring":
        return launch(g, "all_reduce", _ring, (g, arr, op), async_op, (tensor,))
    raise ValueError(f"{prefix('all_reduce')} algorithm must be one of {ALGORITHMS} or None, got {algorithm!r}")


def broadcast(tensor: np.ndarray, src: int, group: Optional[ProcessGroup] = None,
              async_op: bool = False) -> Optional[Work]:
    """Copy ``tensor`` from global rank ``src`` to every member of the group (MPI_Bcast).

    ``tensor`` must have the same shape and dtype on every rank; it is overwritten on
    every rank but ``src``. Raises ValueError if ``src`` is not a member.
    """
    g = member(group)
    if g is None:
        return None
    arr = host_array(tensor, "broadcast", "tensor", writable=True)
    root = group_root(g, src, "broadcast", "src")
    return launch(g, "broadcast", g.comm.Bcast, ([arr, mpi_datatype(arr.dtype)], root), async_op, (tensor,))


def barrier(group: Optional[ProcessGroup] = None, async_op: bool = False,
            device_ids: Optional[list] = None) -> Optional[Work]:
    """Block until every member of the group has entered the barrier (MPI_Barrier).

    ``device_ids`` is accepted for torch compatibility and ignored on host arrays.
    """
    g = member(group)
    if g is None:
        return None
    return launch(g, "barrier", g.comm.Barrier, (), async_op)
