"""The process-wide state: MPI bootstrap, the default group, local rank, env export.

Rank and world size come from MPI_COMM_WORLD (mpi4py initializes MPI with
``MPI_THREAD_MULTIPLE`` when it is imported), so there is no rendezvous, no
MASTER_ADDR and no listening socket. The local rank is the rank in the
shared-memory split of MPI_COMM_WORLD (``MPI_COMM_TYPE_SHARED``).
"""
from __future__ import annotations

import datetime
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

from mpi4py import MPI

from mpidist.group import ProcessGroup

__all__ = [
    "Backend", "RuntimeState", "init_process_group", "destroy_process_group", "is_initialized",
    "is_mpi_available", "is_nccl_available", "get_backend", "get_rank", "get_world_size",
    "get_node_local_rank", "get_local_world_size", "state", "state_or_none", "resolve_group",
    "DEFAULT_TIMEOUT",
]

DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)
_NOT_INIT = ("Default process group has not been initialized, "
             "please make sure to call init_process_group.")


class Backend(str):
    """Backend names, as ``torch.distributed.Backend``: ``Backend("MPI") == "mpi"``."""

    MPI = "mpi"
    NCCL = "nccl"
    GLOO = "gloo"
    _SUPPORTED = ("mpi",)

    def __new__(cls, name: str) -> "Backend":
        if not isinstance(name, str):
            raise TypeError(f"Backend name must be a string, got {name!r}")
        return super().__new__(cls, name.lower())


@dataclass
class RuntimeState:
    """What init_process_group established; one per process."""

    backend: str
    world: ProcessGroup
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    timeout: datetime.timedelta
    thread_multiple: bool
    groups: list = field(default_factory=list)  # every group made by new_group, for destroy


_state: Optional[RuntimeState] = None


def state_or_none() -> Optional[RuntimeState]:
    return _state


def state() -> RuntimeState:
    """The runtime state; ValueError (as torch) when init_process_group was not called."""
    if _state is None:
        raise ValueError(_NOT_INIT)
    return _state


def is_initialized() -> bool:
    """True between init_process_group and destroy_process_group."""
    return _state is not None


def is_mpi_available() -> bool:
    """Always True: mpidist's transport is MPI."""
    return True


def is_nccl_available() -> bool:
    """True when CuPy with NCCL support can be imported."""
    try:
        from cupy.cuda import nccl  # noqa: F401, PLC0415
    except Exception:  # noqa: BLE001  (any import failure means unavailable)
        return False
    return True


def _parse_backend(backend: Optional[str]) -> str:
    if backend is None:
        return Backend.MPI
    name = Backend(backend)
    # torch's "cpu:mpi" device-to-backend form names the same backend
    if name in ("cpu:mpi",):
        return Backend.MPI
    if name not in Backend._SUPPORTED:
        raise ValueError(f"init_process_group: backend {backend!r} is not supported; expected 'mpi' "
                         f"(the only backend in this release)")
    return name


def _check_init_method(init_method: Optional[str]) -> None:
    if init_method is None or init_method.startswith("env://"):
        return
    if init_method.startswith(("tcp://", "file://")):
        warnings.warn(f"init_process_group: init_method {init_method!r} ignored: mpidist takes ranks "
                      f"from MPI and needs no rendezvous", stacklevel=3)
        return
    raise ValueError(f"init_process_group: init_method must be None, 'env://', 'tcp://...' or "
                     f"'file://...', got {init_method!r}")


def _local_split(world: MPI.Comm) -> tuple[int, int]:
    node = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
    try:
        return node.Get_rank(), node.Get_size()
    finally:
        node.Free()


def init_process_group(backend: Optional[str] = None, init_method: Optional[str] = None,
                       timeout: Optional[datetime.timedelta] = None, world_size: int = -1,
                       rank: int = -1, store: Any = None, group_name: str = "",
                       pg_options: Any = None, device_id: Any = None) -> None:
    """Create the default process group from MPI_COMM_WORLD (collective over it).

    Same signature as ``torch.distributed.init_process_group``. Differences: rank and
    world size come from MPI, so ``world_size``/``rank`` may be left at -1 and must
    match MPI if given; ``store`` is not used; ``tcp://`` and ``file://`` init methods
    are accepted with a warning and ignored. A plain ``python script.py`` is a world
    of size 1. Exports RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE.

    Raises:
        ValueError: already initialized ("trying to initialize the default process
            group twice!", as torch), an unsupported backend, or world_size/rank that
            contradict MPI.
    """
    global _state
    if _state is not None:
        raise ValueError(f"[rank {_state.rank}/{_state.world_size}] init_process_group: trying to "
                         f"initialize the default process group twice!")
    name = _parse_backend(backend)
    _check_init_method(init_method)
    world = MPI.COMM_WORLD
    mpi_rank, mpi_size = world.Get_rank(), world.Get_size()
    if world_size not in (-1, mpi_size):
        raise ValueError(f"[rank {mpi_rank}/{mpi_size}] init_process_group: world_size={world_size} "
                         f"contradicts MPI, which launched {mpi_size} processes")
    if rank not in (-1, mpi_rank):
        raise ValueError(f"[rank {mpi_rank}/{mpi_size}] init_process_group: rank={rank} contradicts "
                         f"MPI, which gave this process rank {mpi_rank}")
    if timeout is not None and not isinstance(timeout, datetime.timedelta):
        raise TypeError(f"[rank {mpi_rank}/{mpi_size}] init_process_group: timeout must be a "
                        f"datetime.timedelta, got {type(timeout).__name__}")
    local_rank, local_size = _local_split(world)
    group = ProcessGroup(world.Dup(), range(mpi_size), group_name or "default_pg", name)
    _state = RuntimeState(
        backend=name, world=group, rank=mpi_rank, world_size=mpi_size, local_rank=local_rank,
        local_world_size=local_size, timeout=timeout or DEFAULT_TIMEOUT,
        thread_multiple=MPI.Query_thread() >= MPI.THREAD_MULTIPLE,
    )
    os.environ.update(RANK=str(mpi_rank), WORLD_SIZE=str(mpi_size), LOCAL_RANK=str(local_rank),
                      LOCAL_WORLD_SIZE=str(local_size))


def destroy_process_group(group: Optional[ProcessGroup] = None) -> None:
    """Free the default group (with every other group and the runtime state), or only ``group``.

    Collective over the group's members. After destroying the default group,
    init_process_group may be called again; using a destroyed group raises ValueError.
    """
    global _state
    st = state()
    if group is None or group is st.world:
        for g in st.groups:
            g.free()
        st.world.free()
        _state = None
    else:
        pg = resolve_group(group)  # raises for a group destroyed already
        if pg.comm is not None:  # a non-member (NON_GROUP_MEMBER) has nothing to free
            pg.free()


def resolve_group(group: Optional[ProcessGroup]) -> ProcessGroup:
    """``group`` itself, or the default group for None."""
    if group is None:
        return state().world
    if not isinstance(group, ProcessGroup):
        raise TypeError(f"group must be a ProcessGroup or None, got {type(group).__name__}")
    if group.destroyed:
        raise ValueError(f"group {group.group_name!r} was destroyed by destroy_process_group")
    return group


def get_backend(group: Optional[ProcessGroup] = None) -> str:
    """The backend name of ``group`` (default: the default group), e.g. ``"mpi"``."""
    return resolve_group(group).backend


def get_rank(group: Optional[ProcessGroup] = None) -> int:
    """The caller's rank in ``group`` (global rank by default); -1 if not a member."""
    if group is None:
        return state().rank
    return resolve_group(group).rank()


def get_world_size(group: Optional[ProcessGroup] = None) -> int:
    """Number of ranks in ``group`` (all ranks by default); -1 if the caller is not a member."""
    if group is None:
        return state().world_size
    g = resolve_group(group)
    return g.size() if g.is_member() else -1


def get_node_local_rank(fallback_rank: Optional[int] = None) -> int:
    """The rank among the processes on this node (from MPI's shared-memory split).

    Before init it reads the LOCAL_RANK environment variable, then ``fallback_rank``,
    as torch does; raises RuntimeError if none is available.
    """
    if _state is not None:
        return _state.local_rank
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    if fallback_rank is not None:
        return int(fallback_rank)
    raise RuntimeError("get_node_local_rank: LOCAL_RANK is not set and no fallback_rank was given; "
                       "call init_process_group first")


def get_local_world_size() -> int:
    """Number of ranks on this node (mpidist addition; torch reads LOCAL_WORLD_SIZE)."""
    return state().local_world_size
