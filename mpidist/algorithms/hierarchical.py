"""Hierarchical all-reduce for communicators that span nodes: shared memory inside each node,
one leader per node between nodes.

Three steps, as Horovod's hierarchical all-reduce (``HOROVOD_HIERARCHICAL_ALLREDUCE``:
intra-node reduce, inter-node all-reduce among one rank per node, intra-node broadcast) and
the SMP-aware collectives of Träff, "SMP-aware message passing programming" (HIPS 2003):

1. the ranks of each node all-reduce through their node's shared-memory window
   (:class:`mpidist.algorithms.shm.ShmAllReduce`), so each node's leader (its lowest rank)
   holds the node's reduction;
2. the leaders all-reduce among themselves: ``MPI_Allreduce`` on the leaders' communicator
   (the ring, :func:`mpidist.algorithms.ring.ring_all_reduce`, for dtypes MPI cannot reduce,
   or when asked);
3. each leader broadcasts the result to its node (``MPI_Bcast`` on the node's communicator,
   which MPI runs through shared memory).

Only the leaders talk across nodes, while the others wait in the window without polling.
An MPI library may already keep its own all-reduce's inter-node traffic to one transfer per
node pair (MPICH does: the measured link bytes are equal); the gain is then the shared-memory
step and the cores the waiting ranks leave to the network. Nodes are found by
``MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)``; they may hold different numbers of ranks.
Cost model and measurements: docs/performance.md, "Hierarchical all-reduce".
"""

from __future__ import annotations

from typing import Any, Optional, cast

import numpy as np
from mpi4py import MPI

from mpidist._arrays.buffers import host_array, mpi_datatype, mpi_reducible
from mpidist._arrays.reduce_op import ReduceOp, check_op_dtype, to_mpi_op
from mpidist.algorithms.ring import ring_all_reduce
from mpidist.algorithms.shm import ShmAllReduce
from mpidist.errors import prefix

__all__ = ["HierAllReduce"]

_OP = "hierarchical_all_reduce"


class HierAllReduce:
    """All-reduce over a communicator that spans nodes, in the three steps of the module
    docstring.

    ``HierAllReduce(comm)`` is collective over ``comm``: it splits ``comm`` into one
    communicator per node and one of the nodes' leaders (kept until :meth:`free`, collective)
    and, on each node of more than one rank, makes a :class:`ShmAllReduce` window
    (``4 KiB + 2 MiB`` per rank). Then ``obj(buf, op)`` (collective; same shape and dtype on
    every rank) reduces ``buf`` in place. Calls on one object must not overlap.

    Args:
        comm: the communicator (not modified; its splits are used).
        node_color: which node this rank counts as on (ranks with equal colors share a node;
            they must share memory). None: the node MPI reports (``MPI_COMM_TYPE_SHARED``).
            Tests use it to build several "nodes" on one machine.
        inter: the leaders' step: ``"mpi"`` (``MPI_Allreduce``; the ring for dtypes MPI
            cannot reduce) or ``"ring"``.

    Attributes:
        nodes: how many nodes ``comm`` spans (the same on every rank).
        local_size: the number of ranks on this rank's node.

    Raises:
        ValueError: ``inter`` is neither "mpi" nor "ring" (on every rank alike).
    """

    def __init__(self, comm: MPI.Comm, node_color: Optional[int] = None, inter: str = "mpi") -> None:
        if inter not in ("mpi", "ring"):
            raise ValueError(f"{prefix(_OP)} inter must be 'mpi' or 'ring', got {inter!r}")
        rank = comm.Get_rank()
        self.inter = inter
        self.node = cast(
            MPI.Intracomm,
            comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank) if node_color is None else comm.Split(node_color, rank),
        )
        self.local_size = self.node.Get_size()
        leader = self.node.Get_rank() == 0
        self.leaders: MPI.Comm = comm.Split(0 if leader else MPI.UNDEFINED, rank)
        self.nodes = int(comm.allreduce(1 if leader else 0))
        self.shm: Optional[ShmAllReduce] = ShmAllReduce(self.node) if self.local_size > 1 else None

    def __call__(self, buf: np.ndarray, op: ReduceOp) -> None:
        """All-reduce ``buf`` in place with ``op``: the arguments, the result and the errors of
        :meth:`ShmAllReduce.__call__` (bitwise identical on every rank: each node's leader
        computes it, the others receive it), over every node.

        The order of the reduction is by node, then across nodes: float sums may differ in the
        last bits from a flat all-reduce's, as between any two MPI algorithms. A mismatch among
        the ranks of one node (:class:`ShmMismatch`) is raised on that node's ranks; the peers on
        other nodes are then ended by the job's abort or the timeout.
        """
        host_array(buf, _OP, "buf", writable=True)
        if not isinstance(op, ReduceOp):
            raise TypeError(f"{prefix(_OP)} op must be a ReduceOp (apply a PremulSum's factor first), got {op!r}")
        check_op_dtype(op, buf.dtype, prefix(_OP))
        if self.node is None:
            raise ValueError(f"{prefix(_OP)} this HierAllReduce was freed")
        shm = self.shm
        if shm is not None:
            shm(buf, op)
        if self.nodes == 1:
            return
        leaders = self.leaders
        if leaders != MPI.COMM_NULL:
            if self.inter == "mpi" and mpi_reducible(buf.dtype):
                leaders.Allreduce(MPI.IN_PLACE, [buf, mpi_datatype(buf.dtype)], to_mpi_op(op, buf.dtype))
            else:
                ring_all_reduce(leaders, buf, op)
        if shm is not None:
            # The others wait for their leader in the window, not in MPI_Bcast, whose polling
            # would take the cores the leaders' network transfers need (measured: 16 MiB on two
            # hosts of 2 ranks, 44 ms polling in MPI_Bcast against 27 ms; docs/performance.md).
            shm.barrier()
            self.node.Bcast([buf, mpi_datatype(buf.dtype)], 0)

    def free(self) -> None:
        """Release the window and the communicators (collective; idempotent)."""
        if self.node is None:
            return
        if self.shm is not None:
            self.shm.free()
            self.shm = None
        if self.leaders != MPI.COMM_NULL:
            self.leaders.Free()
        self.node.Free()
        self.node = None  # type: ignore[assignment]  # freed: __call__ refuses

    def __enter__(self) -> HierAllReduce:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.free()
