"""The backend creator torch calls for every ``"mpidist"`` group.

torch calls :func:`create` (``extended_api=True``) on the group's members only, so a sub-group
is mpidist's members-only ``new_group(..., use_local_synchronization=True)``. The default group
runs on mpidist's default group: started by the rendezvous (:func:`start_runtime`) or, when
torch skipped it (a ``store`` given), by the creator, and then owned by the torch group; or
found running, then left running. docs/torch.md, "mpidist's own API in the same process".
"""

from __future__ import annotations

from typing import Any, Optional

import torch.distributed.distributed_c10d as c10d

import mpidist
from mpidist._core.group import ProcessGroup
from mpidist._runtime import world as runtime
from mpidist.torch._process_group import BACKEND_NAME, ProcessGroupMpidist

__all__ = ["create", "make", "start_runtime"]

#: The default group of the mpidist runtime that torch's rendezvous started (for torch's
#: default group to own), until the creator takes it.
_started: Optional[ProcessGroup] = None


def declare_self_recording(name: str) -> None:
    """Add backend ``name`` to torch's ``_FR_SELF_RECORDING_BACKENDS`` (torch >= 2.15), so
    that torch attaches no flight recorder of its own, which fails on a Python group
    (docs/torch.md, "Versions and the private torch APIs it relies on")."""
    names = getattr(c10d, "_FR_SELF_RECORDING_BACKENDS", None)
    if isinstance(names, set):
        names.add(name)


def _device_backend() -> str:
    """mpidist's backend for a runtime the torch backend starts: ``"cpu:mpi,cuda:nccl"``
    where CuPy has NCCL and NCCL can run this node's ranks (no more ranks than GPUs, or a
    shared GPU allowed), else ``"mpi"`` (docs/torch.md, "CUDA tensors"). Collective over
    MPI_COMM_WORLD when CuPy has NCCL (one ``Split_type``).
    """
    if not mpidist.is_nccl_available():
        return "mpi"
    import torch  # noqa: PLC0415
    from mpi4py import MPI  # noqa: PLC0415

    from mpidist._backends.device import nccl_core, nccl_shim  # noqa: PLC0415

    node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        ranks_on_node = node.Get_size()
    finally:
        node.Free()
    if ranks_on_node > torch.cuda.device_count() and nccl_core.shared_gpu_refused(nccl_shim.get().version()):
        return "mpi"
    return "cpu:mpi,cuda:nccl"


def start_runtime(timeout: Any, rank: int = -1, world_size: int = -1) -> None:
    """Initialize mpidist for torch's default group (collective over MPI_COMM_WORLD).

    ``rank``/``world_size``: torch's arguments (-1: not given), checked as for torch's MPI
    backend by ``mpidist.init_process_group`` (ValueError on every rank; docs/torch.md,
    "Launching").
    """
    global _started
    mpidist.init_process_group(_device_backend(), timeout=timeout, rank=rank, world_size=world_size)
    _started = runtime.state().world


def create(options: Any, backend_options: Any = None) -> ProcessGroupMpidist:
    """torch's creator for backend ``"mpidist"`` (``Backend.register_backend(..., extended_api=True)``).

    Raises:
        ValueError: the default group's rank or size (from the rendezvous, ``rank=`` /
            ``world_size=`` or a ``store``) contradicts MPI's.
        RuntimeError: a sub-group while mpidist is not initialized (the default group is
            another backend's and mpidist was never initialized).
    """
    return make(
        [int(r) for r in options.global_ranks_in_group],
        options.timeout,
        BACKEND_NAME,
        (int(options.group_rank), int(options.group_size)),
        f"torch:{options.group_id}",
    )


def make(
    ranks: list, timeout: Any, name: str, given: Optional[tuple] = None, desc: Optional[str] = None
) -> ProcessGroupMpidist:
    """The torch group over mpidist for global ``ranks`` (empty: the default group), called
    on its members only, for backend ``name`` ("mpidist" or "mpi").

    ``timeout``: the group's. ``given``: torch's (rank, size), checked against MPI's for the
    default group (None: not checked). ``desc``: the mpidist group's name until torch sets
    the group's description.
    """
    global _started
    if not ranks:  # the default group
        if not mpidist.is_initialized():  # "mpi", or a store was given: torch skipped the rendezvous
            start_runtime(timeout)
        st = runtime.state()
        owns, _started = _started is st.world, None
        if given is not None and given != (st.rank, st.world_size):
            if owns:
                mpidist.destroy_process_group()
            raise ValueError(
                f"[rank {st.rank}/{st.world_size}] init_process_group: backend {name!r} takes "
                f"ranks from MPI, which gave this process rank {st.rank} of {st.world_size}, but "
                f"torch was given rank {given[0]} of {given[1]}; drop rank=/world_size=/RANK/"
                f"WORLD_SIZE, or launch with mpiexec/srun so that they agree"
            )
        return ProcessGroupMpidist(st.world, st.rank, st.world_size, owns, name)
    if not mpidist.is_initialized():
        raise RuntimeError(
            f"new_group(backend={name!r}): mpidist is not initialized; initialize the default "
            f"group with backend {name!r} (or call mpidist.init_process_group() on every rank first)"
        )
    group = mpidist.new_group(ranks, timeout=timeout, use_local_synchronization=True, group_desc=desc)
    return ProcessGroupMpidist(group, group.rank(), group.size(), False, name)
