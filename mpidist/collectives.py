"""Collectives with torch.distributed's names, arguments and semantics, on numpy arrays.

Each function validates its arguments (errors name rank, op and argument, expected
versus got), resolves the group, and either runs the op inline (``async_op=False``,
returns None) or hands it to the group's engine thread and returns a :class:`Work`.
A rank that is not a member of ``group`` returns None and leaves its buffers alone.
src/dst are global ranks, as in torch.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np
from mpi4py import MPI

from mpidist import _runtime
from mpidist._buffers import host_array, mpi_datatype, mpi_reducible, same_dtype
from mpidist.algorithms.ring import ring_all_reduce
from mpidist.errors import from_mpi, prefix
from mpidist.group import ProcessGroup
from mpidist.reduce_op import ReduceOp, check_op_dtype, to_mpi_op
from mpidist.work import CompletedWork, FutureWork, Work

__all__ = ["all_reduce", "broadcast", "barrier", "all_gather_into_tensor", "ALGORITHMS", "launch"]

#: Values of all_reduce's ``algorithm`` argument.
ALGORITHMS = ("mpi", "ring")


def _guarded(op: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any) -> Any:
        try:
            return fn(*args)
        except MPI.Exception as exc:
            raise from_mpi(op, exc) from exc
    return run


def launch(group: ProcessGroup, op: str, fn: Callable[..., Any], args: tuple, async_op: bool,
           outputs: tuple = ()) -> Optional[Work]:
    """Run ``fn(*args)`` in the group's op order; return a Work when ``async_op``."""
    run = _guarded(op, fn)
    if not async_op:
        group.engine.run_sync(run, *args)
        return None
    if group.size() == 1 or not _runtime.state().thread_multiple:
        group.engine.run_sync(run, *args)
        return CompletedWork(op, prefix(op), outputs)
    return FutureWork(op, prefix(op), group.engine.submit(run, *args), outputs)


def _member(group: Optional[ProcessGroup]) -> Optional[ProcessGroup]:
    g = _runtime.resolve_group(group)
    return g if g.comm is not None else None


def _root(g: ProcessGroup, rank: Any, op: str, arg: str) -> int:
    if type(rank) is not int and not isinstance(rank, (int, np.integer)):
        raise TypeError(f"{prefix(op)} {arg} must be an int (a global rank), got {type(rank).__name__}")
    try:
        return g.group_rank(int(rank))
    except ValueError as exc:
        raise ValueError(f"{prefix(op)} {arg}={rank}: {exc}") from None


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
    g = _member(group)
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
    g = _member(group)
    if g is None:
        return None
    arr = host_array(tensor, "broadcast", "tensor", writable=True)
    root = _root(g, src, "broadcast", "src")
    return launch(g, "broadcast", g.comm.Bcast, ([arr, mpi_datatype(arr.dtype)], root), async_op, (tensor,))


def barrier(group: Optional[ProcessGroup] = None, async_op: bool = False,
            device_ids: Optional[list] = None) -> Optional[Work]:
    """Block until every member of the group has entered the barrier (MPI_Barrier).

    ``device_ids`` is accepted for torch compatibility and ignored on host arrays.
    """
    g = _member(group)
    if g is None:
        return None
    return launch(g, "barrier", g.comm.Barrier, (), async_op)


def all_gather_into_tensor(output_tensor: np.ndarray, input_tensor: np.ndarray,
                           group: Optional[ProcessGroup] = None, async_op: bool = False) -> Optional[Work]:
    """Gather every rank's ``input_tensor`` into ``output_tensor`` on every rank (MPI_Allgather).

    ``output_tensor`` holds ``world_size * input_tensor.size`` elements of the same
    dtype, in group-rank order: either concatenated along dim 0 (shape
    ``(W*d0, ...)``) or stacked (shape ``(W, *input.shape)``), as torch allows.
    Only ``output_tensor`` changes.

    Raises:
        TypeError: dtypes differ. ValueError: ``output_tensor`` has the wrong size.
    """
    g = _member(group)
    if g is None:
        return None
    op = "all_gather_into_tensor"
    out = host_array(output_tensor, op, "output_tensor", writable=True)
    inp = host_array(input_tensor, op, "input_tensor", writable=False)
    same_dtype(out, inp, op, "output_tensor", "input_tensor")
    if out.size != inp.size * g.size():
        raise ValueError(f"{prefix(op)} output_tensor must hold world_size * input_tensor.size = "
                         f"{g.size()} * {inp.size} = {g.size() * inp.size} elements, got {out.size} "
                         f"(shape {out.shape})")
    dt = mpi_datatype(inp.dtype)
    return launch(g, op, g.comm.Allgather, ([inp, dt], [out, dt]), async_op, (output_tensor,))
