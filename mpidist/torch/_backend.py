"""The backend creator torch calls for every ``"mpidist"`` group.

torch calls :func:`create` (registered with ``extended_api=True``) with a
``_DistributedBackendOptions``: the group's rank and size, its timeout, and
``global_ranks_in_group`` (empty for the default group). It calls it on the group's
members only, so a sub-group is made with mpidist's members-only
``new_group(ranks, use_local_synchronization=True)`` (``MPI_Comm_create_group``).

The default group runs on mpidist's default group. If mpidist is not initialized yet,
torch's rendezvous (:mod:`mpidist.torch.rendezvous`) initializes it through
:func:`start_runtime` (``mpidist.init_process_group`` with torch's timeout, ``rank`` and
``world_size``, so mpidist's collective argument check applies: the same error on every
rank), or, when torch was given a ``store`` and skips the rendezvous, the creator does;
and the torch group *owns* that runtime: destroying it destroys mpidist's runtime too
(:meth:`ProcessGroupMpidist.shutdown`), so a later ``init_process_group`` starts afresh.
If mpidist was initialized before (by ``mpidist.init_process_group``, e.g. to choose its
backend for CUDA tensors), the torch group uses it and leaves it running when torch
destroys its groups; its timeout is the one mpidist was initialized with.
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
    """Tell torch that backend ``name`` records its own ops (mpidist's flight recorder,
    :mod:`mpidist._core.recorder`), so that torch does not attach its own to the group.

    torch 2.15 attaches a flight-recorder hook to every group whose backend is not in
    ``distributed_c10d._FR_SELF_RECORDING_BACKENDS`` and reports device types
    (``_maybe_attach_flight_recorder``, 2.15.0 distributed_c10d.py:2893-2930); the hook reads
    the group's C++ backend, which a ProcessGroup made in Python (mpidist's) has not, and
    ``init_process_group`` fails ("Could not find the default backend type 0"). A torch
    without that set (before 2.15) needs nothing.
    """
    names = getattr(c10d, "_FR_SELF_RECORDING_BACKENDS", None)
    if isinstance(names, set):
        names.add(name)


def _device_backend() -> str:
    """mpidist's backend for a runtime the torch backend starts: CUDA tensors through NCCL
    where CuPy has it and NCCL can run this node's ranks, else MPI (CUDA-aware where
    detected, host staging otherwise).

    NCCL can run them when there are no more ranks on the node than GPUs torch sees (each
    rank on a GPU of its own), or when NCCL lets ranks share a GPU (>= 2.30 with
    NCCL_MULTI_RANK_GPU_ENABLE=1); an older NCCL fails every collective of ranks sharing a
    GPU (seen with NCCL 2.28.9, two ranks on one H200). Collective over MPI_COMM_WORLD (one
    ``Split_type`` to count the node's ranks, when CuPy has NCCL).
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

    ``rank``/``world_size`` are torch's arguments (-1: not given), checked by mpidist's
    rule for MPI backend names, as torch's own MPI backend treats them: values that differ
    from MPI's are ignored with torch's warning, a renumbering of the processes raises
    ValueError on every rank, and so do RANK/WORLD_SIZE in the environment that say a
    larger world than MPI launched (``mpidist.init_process_group``).
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
    on its members only, for backend ``name`` ("mpidist", or "mpi": :mod:`mpidist.torch._mpi_name`).

    ``timeout``: the group's (torch's ``timeout=``; the default group's starts mpidist's
    runtime when it is not running). ``given``: torch's (rank, size) for the group, checked
    against MPI's for the default group (None: MPI's, as torch's MPI backend takes them).
    ``desc``: the mpidist group's name until torch sets the group's description.
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
