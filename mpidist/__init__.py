"""mpidist: torch.distributed's programming model on numpy arrays, bootstrapped from MPI.

Launch with ``mpiexec -n N python script.py`` (or ``srun``); call
:func:`init_process_group` and use the same functions as ``torch.distributed``.
"""

# MPI_Init first, bounded in time (mpidist._launch.mpi_init): every other module imports mpi4py.MPI,
# whose import is an unbounded MPI_Init. Hence E402 below (pyproject.toml).
from mpidist._launch import mpi_init as _mpi_init

_mpi_init.import_mpi()

# isort: split
from mpidist import _deprecated, gather_scatter, objects, reductions
from mpidist._arrays.reduce_op import ReduceOp, reduce_op
from mpidist._check.mismatch import DebugLevel, get_debug_level, set_debug_level, set_debug_level_from_env
from mpidist._core.group import ProcessGroup
from mpidist._runtime import backend_queries as _backend_queries
from mpidist._runtime.backend_queries import *  # noqa: F403  (exactly _backend_queries.__all__)
from mpidist._runtime.world import (
    DEFAULT_TIMEOUT as default_pg_timeout,
    Backend,
    check_collectives,
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
from mpidist._utilities import breakpoint, record_comm  # noqa: A004  (torch's name)
from mpidist.collectives import all_reduce, barrier, broadcast, monitored_barrier
from mpidist.device.detect import cuda_aware_mpi
from mpidist.errors import DistBackendError, DistError, DistNetworkError, DistStoreError
from mpidist.gather_scatter import *  # noqa: F403  (exactly gather_scatter.__all__)
from mpidist.groups import (
    GroupMember,
    get_global_rank,
    get_group_rank,
    get_pg_count,
    get_process_group_ranks,
    group,
    new_group,
    new_subgroups,
    new_subgroups_by_enumeration,
    split_group,
)
from mpidist.objects import *  # noqa: F403  (exactly objects.__all__)
from mpidist.p2p import P2POp, batch_isend_irecv, irecv, isend, recv, send
from mpidist.reductions import *  # noqa: F403  (exactly reductions.__all__)
from mpidist.work import Work

# isort: split
# torch 2.13's deprecated names, warning as torch's do (after the star imports they replace)
from mpidist._deprecated import *  # noqa: F403  (exactly _deprecated.__all__)
from mpidist.device_mesh import DeviceMesh, init_device_mesh

__version__ = "0.1.0"

__all__ = [
    "Backend",
    "DebugLevel",
    "DeviceMesh",
    "DistBackendError",
    "DistError",
    "DistNetworkError",
    "DistStoreError",
    "GroupMember",
    "P2POp",
    "ProcessGroup",
    "ReduceOp",
    "Work",
    "all_reduce",
    "barrier",
    "batch_isend_irecv",
    "breakpoint",
    "broadcast",
    "check_collectives",
    "cuda_aware_mpi",
    "default_pg_timeout",
    "destroy_process_group",
    "get_backend",
    "get_debug_level",
    "get_global_rank",
    "get_group_rank",
    "get_local_world_size",
    "get_node_local_rank",
    "get_pg_count",
    "get_process_group_ranks",
    "get_rank",
    "get_world_size",
    "group",
    "init_device_mesh",
    "init_process_group",
    "irecv",
    "is_initialized",
    "is_mpi_available",
    "is_nccl_available",
    "isend",
    "monitored_barrier",
    "new_group",
    "new_subgroups",
    "new_subgroups_by_enumeration",
    "recv",
    "record_comm",
    "reduce_op",
    "send",
    "set_debug_level",
    "set_debug_level_from_env",
    "split_group",
]
__all__ += (
    _backend_queries.__all__ + _deprecated.__all__ + gather_scatter.__all__ + objects.__all__ + reductions.__all__
)
__all__ = sorted(set(__all__))  # (torch 2.13's deprecated names are in two of them)
