"""Bandwidth-optimal ring all-reduce over MPI point-to-point messages.

The classic two-phase ring (reduce-scatter, then all-gather) of Patarasuk & Yuan,
"Bandwidth optimal all-reduce algorithms for clusters of workstations",
J. Parallel Distrib. Comput. 69(2), 2009 -- the algorithm popularised for deep
learning by Baidu's allreduce and Horovod.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Callable, Optional

import numpy as np
from mpi4py import MPI

from mpidist._arrays.buffers import mpi_datatype
from mpidist._arrays.namespace import array_module, is_device_array
from mpidist._arrays.reduce_op import ReduceOp, check_op_dtype, local_reduce
from mpidist.device import detect

__all__ = ["ring_all_reduce", "ring_chunk_bounds"]


def ring_chunk_bounds(count: int, n: int) -> list[tuple[int, int]]:
    """Split ``range(count)`` into ``n`` contiguous ``(start, stop)`` chunks.

    Same boundaries as ``numpy.array_split``: the first ``count % n`` chunks hold
    one element more than the others, so sizes differ by at most one; when
    ``count < n`` the trailing chunks are empty.

    Raises:
        ValueError: ``count < 0`` or ``n < 1``.
    """
    if count < 0 or n < 1:
        raise ValueError(f"ring_chunk_bounds needs count >= 0 and n >= 1, got {count}, {n}")
    q, extra = divmod(count, n)
    starts = [i * q + min(i, extra) for i in range(n + 1)]  # chunk i: q elements, one more if i < extra
    return list(zip(starts, starts[1:]))


def ring_all_reduce(comm: MPI.Comm, buf: Any, op: ReduceOp) -> None:
    """All-reduce ``buf`` in place across ``comm`` with the bandwidth-optimal ring.

    Args:
        comm: a communicator reserved for this call (the caller ``Dup``s it), since
            messages use fixed tags. Every rank of ``comm`` must call collectively.
        buf: C-contiguous numpy or cupy array, any shape; same shape and dtype on
            every rank. Any dtype MPI and ``local_reduce`` support, bool included. A
            cupy array needs a CUDA-aware MPI (it reads the device memory directly;
            another MPI would dereference a device pointer and crash), as decided by
            :func:`mpidist.device.detect.cuda_aware_mpi`; otherwise it is refused.
            ``mpidist.all_reduce(x, algorithm="ring")`` stages device arrays through
            host memory instead.
        op: any :class:`ReduceOp` but PREMUL_SUM. AVG is reduced as SUM here:
            the caller divides by the group size afterwards.

    Only ``buf`` changes, on every rank, to the element-wise reduction of all
    ranks' inputs; one scratch buffer of the largest chunk's size is allocated, in
    ``buf``'s array module and on its device.

    Algorithm: the flat array is cut into ``n = comm.Get_size()`` chunks
    (:func:`ring_chunk_bounds`). Reduce-scatter, ``n - 1`` steps: at step ``s``
    rank ``r`` sends chunk ``(r - s) % n`` to ``r + 1`` and reduces chunk
    ``(r - s - 1) % n`` received from ``r - 1`` into its own copy; rank ``r`` then
    holds the complete chunk ``(r + 1) % n``. All-gather, ``n - 1`` steps: the
    complete chunks circulate around the ring and are received in place.
    Each rank sends and receives ``2 (n - 1) / n * S`` bytes for ``S = buf.nbytes``.

    On a cupy array the ring runs with ``buf``'s GPU as the current device; each local
    reduction is a kernel on the current stream, and that stream is synchronized before
    MPI reads what it produced (once before the first send, then after every reduction).

    Reduction order: chunk ``c`` is accumulated around the ring starting at rank
    ``c``, i.e. ``acc = x[c]`` then ``acc = x[c+k] op acc`` for ``k = 1 .. n-1``
    (ranks mod ``n``), and is computed once, on rank ``c - 1``, then copied. So
    results are bitwise identical on every rank, also for floating point.

    Raises:
        TypeError: ``op`` is not a ReduceOp; ``buf`` is a device array that is not a
            cupy array (mpidist cannot reduce it on the device); ``buf`` is a cupy
            array and MPI is not CUDA-aware.
        ValueError: unsupported op/dtype pair (see ``check_op_dtype``), or ``buf``
            is not C-contiguous or not writeable.
    """
    if not isinstance(op, ReduceOp):
        raise TypeError(f"ring_all_reduce: op must be a ReduceOp (apply a PremulSum's factor first), got {op!r}")
    xp = array_module(buf)
    if xp is np and is_device_array(buf):
        raise TypeError(
            f"ring_all_reduce: buf is a device array of type {type(buf).__name__}, which mpidist "
            f"cannot reduce on the device (only cupy arrays); copy it to the host first"
        )
    if xp is not np:
        aware = detect.detection()
        if not aware.aware:
            raise TypeError(
                f"ring_all_reduce: buf is a device array ({type(buf).__name__}) and MPI is not "
                f"CUDA-aware ({aware.source}): MPI would dereference a device pointer and crash. "
                f"Use mpidist.all_reduce(buf, algorithm='ring'), which stages it through host "
                f"memory, or set MPIDIST_CUDA_AWARE=1 if this MPI is CUDA-aware"
            )
    check_op_dtype(op, buf.dtype, "ring_all_reduce")
    if not buf.flags.c_contiguous or not getattr(buf.flags, "writeable", True):
        raise ValueError("ring_all_reduce needs a writeable C-contiguous buffer")
    if comm.Get_size() == 1 or buf.size == 0:
        return
    if xp is np:
        _ring(comm, buf, op, np, None)
    else:
        with buf.device:
            _ring(comm, buf, op, xp, xp.cuda.get_current_stream().synchronize)


def _ring(comm: MPI.Comm, buf: Any, op: ReduceOp, xp: ModuleType, sync: Optional[Callable[[], None]]) -> None:
    """The two phases of :func:`ring_all_reduce`; ``sync()`` (device arrays) waits for the
    stream's queued kernels before MPI reads their output."""
    n, rank = comm.Get_size(), comm.Get_rank()
    flat = buf.reshape(-1)
    datatype = mpi_datatype(buf.dtype)
    bounds = ring_chunk_bounds(flat.size, n)
    scratch = xp.empty(bounds[0][1] - bounds[0][0], dtype=buf.dtype)
    right, left = (rank + 1) % n, (rank - 1) % n
    if sync is not None:
        sync()

    for s in range(n - 1):  # reduce-scatter
        (a, b), (c, d) = bounds[(rank - s) % n], bounds[(rank - s - 1) % n]
        recv = scratch[: d - c]
        comm.Sendrecv([flat[a:b], datatype], right, 0, [recv, datatype], left, 0)
        local_reduce(op, flat[c:d], recv)
        if sync is not None:
            sync()

    for s in range(n - 1):  # all-gather
        (a, b), (c, d) = bounds[(rank + 1 - s) % n], bounds[(rank - s) % n]
        comm.Sendrecv([flat[a:b], datatype], right, 1, [flat[c:d], datatype], left, 1)
