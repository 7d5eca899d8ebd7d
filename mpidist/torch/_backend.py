"""The backend creator torch calls for every ``"mpidist"`` group.

torch calls :func:`create` (registered with ``extended_api=True``) with a
``_DistributedBackendOptions``: the group's rank and size, its timeout, and
``global_ranks_in_group`` (empty for the default group). It calls it on the group's
members only, so a sub-group is made with mpidist's members-only
``new_group(ranks, use_local_synchronization=True)`` (``MPI_Comm_create_group``).

The default group runs on mpidist's default group. If mpidist is not initialized yet,
the creator initializes it (``mpidist.init_process_group`` with torch's timeout), and
the torch group *owns* that runtime: destroying it destroys mpidist's runtime too
(:meth:`ProcessGroupMpidist.shutdown`), so a later ``init_process_group`` starts afresh. If mpidist was initialized before (by
``mpidist.init_process_group``, e.g. to choose its backend for CUDA tensors), the torch
group uses it and leaves it running when torch destroys its groups; its timeout is the
one mpidist was initialized with.
"""
from __future__ import annotations

from typing import Any

import mpidist
from mpidist import _runtime
from mpidist.torch._process_group import ProcessGroupMpidist

__all__ = ["create"]


def _device_backend() -> str:
    """mpidist's backend for a runtime the torch backend starts: CUDA tensors through NCCL
    where CuPy has it (loaded only when a CUDA tensor first needs it), else MPI (CUDA-aware
    where detected, host staging otherwise)."""
    return "cpu:mpi,cuda:nccl" if mpidist.is_nccl_available() else "mpi"


def create(options: Any, backend_options: Any = None) -> ProcessGroupMpidist:
    """torch's creator for backend ``"mpidist"`` (``Backend.register_backend(..., extended_api=True)``).

    Raises:
        ValueError: the default group's rank or size (from the rendezvous, ``rank=`` /
            ``world_size=`` or a ``store``) contradicts MPI's.
        RuntimeError: a sub-group while mpidist is not initialized (the default group is
            another backend's and mpidist was never initialized).
    """
    ranks = [int(r) for r in options.global_ranks_in_group]
    rank, size = int(options.group_rank), int(options.group_size)
    if not ranks:  # the default group
        owns = not mpidist.is_initialized()
        if owns:
            mpidist.init_process_group(_device_backend(), timeout=options.timeout)
        st = _runtime.state()
        if (rank, size) != (st.rank, st.world_size):
            if owns:
                mpidist.destroy_process_group()
            raise ValueError(f"[rank {st.rank}/{st.world_size}] init_process_group: backend 'mpidist' takes "
                             f"ranks from MPI, which gave this process rank {st.rank} of {st.world_size}, but "
                             f"torch was given rank {rank} of {size}; drop rank=/world_size=/RANK/WORLD_SIZE, "
                             f"or launch with mpiexec/srun so that they agree")
        return ProcessGroupMpidist(st.world, rank, size, owns)
    if not mpidist.is_initialized():
        raise RuntimeError("new_group(backend='mpidist'): mpidist is not initialized; initialize the default "
                           "group with backend 'mpidist' (or call mpidist.init_process_group() on every rank first)")
    group = mpidist.new_group(ranks, use_local_synchronization=True, group_desc=f"torch:{options.group_id}")
    return ProcessGroupMpidist(group, rank, size, False)
