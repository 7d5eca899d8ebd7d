"""mpidist: torch.distributed's programming model on numpy arrays, bootstrapped from MPI.

Launch with ``mpiexec -n N python script.py`` (or ``srun``); call
:func:`init_process_group` and use the same functions as ``torch.distributed``.
"""
from mpidist._runtime import (
    Backend,
    destroy_process_group,
    get_backend,
    get_local_world_size,
    get_node_local_rank,
    get_rank,
    get_world_size,
    init_process_group,
    is_initialized,
    is_mpi_available,
    is_nccl_available,
)
from mpidist.collectives import all_gather_into_tensor, all_reduce, barrier, broadcast
from mpidist.errors import DistBackendError, DistError
from mpidist.group import ProcessGroup
from mpidist.p2p import irecv, isend, recv, send
from mpidist.reduce_op import ReduceOp
from mpidist.work import Work

__version__ = "0.1.0"

__all__ = [
    "Backend", "DistBackendError", "DistError", "ProcessGroup", "ReduceOp", "Work",
    "all_gather_into_tensor", "all_reduce", "barrier", "broadcast", "destroy_process_group",
    "get_backend", "get_local_world_size", "get_node_local_rank", "get_rank", "get_world_size",
    "init_process_group", "irecv", "is_initialized", "is_mpi_available", "is_nccl_available",
    "isend", "recv", "send",
]
