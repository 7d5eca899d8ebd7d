"""Backend name ``"mpi"`` on torch wheels, which are built without MPI.

torch's own MPI backend exists only in source builds: on a wheel
``torch.distributed.is_mpi_available()`` is False and ``init_process_group("mpi")``
fails with "Distributed package doesn't have MPI built in". Yet ``"mpi"`` is the name
the tutorials use (``init_process(0, 0, run, backend="mpi")`` under ``mpirun -n 4``),
and the one Accelerate picks on its own for multi-process CPU runs when
``is_mpi_available()`` is True (transformers' ``ddp_backend`` offers it too).

:func:`install` (run by ``import mpidist.torch``) fills torch's slot for its MPI backend
with mpidist: ``distributed_c10d._MPI_AVAILABLE`` becomes True and
``distributed_c10d.ProcessGroupMPI`` is :class:`ProcessGroupMPI`, whose ``create(ranks)``
torch calls for the default group and each ``new_group`` (torch 2.13's
``_new_process_group_helper``). The rest is torch's own MPI path, so its semantics are
torch's MPI backend's: no rendezvous and no store (ranks from MPI; no MASTER_ADDR, RANK or
WORLD_SIZE), ``rank=``/``world_size=`` ignored with torch's warning, ``get_backend()``
gives ``"mpi"``, ``new_group(use_local_synchronization=True)`` refused by torch, and
``TORCH_DIST_INIT_BARRIER=1`` is a ``barrier()``. Every op runs through mpidist's group
(:class:`~mpidist.torch._process_group.ProcessGroupMpidist`), as for ``"mpidist"``.

A torch that has its own MPI backend is left alone. A torch whose internals differ from
what this relies on (the two names above, and ``_new_process_group_helper`` calling
``ProcessGroupMPI``) keeps ``"mpi"`` unavailable and says so in one warning;
``"mpidist"`` works either way.
"""

from __future__ import annotations

import sys
import warnings
from types import FrameType
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from mpidist.torch import _backend
from mpidist.torch._process_group import ProcessGroupMpidist

__all__ = ["NAME", "ProcessGroupMPI", "install", "installed"]

NAME = "mpi"


def _helper_timeout() -> Any:
    """The ``timeout`` local of torch's ``_new_process_group_helper`` on this thread's stack
    (the group's timeout: torch passes none to ``ProcessGroupMPI.create``), or None."""
    frame: Optional[FrameType] = sys._getframe(1)
    while frame is not None:
        if frame.f_code is c10d._new_process_group_helper.__code__:
            return frame.f_locals.get("timeout")
        frame = frame.f_back
    return None


class ProcessGroupMPI:
    """What torch's MPI path calls: ``ProcessGroupMPI.create(global_ranks_in_group)``."""

    @staticmethod
    def create(ranks: Optional[list] = None) -> ProcessGroupMpidist:
        """The group over mpidist for global ``ranks`` (empty: the default group, which
        starts mpidist's runtime when it is not running, collectively over
        MPI_COMM_WORLD). torch calls it on the group's members only."""
        return _backend.make([int(r) for r in ranks or ()], _helper_timeout(), NAME)


def _torch_fits() -> bool:
    # who calls ProcessGroupMPI.create: _new_process_group_helper itself (torch <= 2.13), or the
    # creator torch 2.14 registers for "mpi" (_create_mpi_process_group, which the helper calls)
    callers = [getattr(c10d, name, None) for name in ("_new_process_group_helper", "_create_mpi_process_group")]
    return (
        hasattr(c10d, "_MPI_AVAILABLE")
        and any(f is not None and "ProcessGroupMPI" in f.__code__.co_names for f in callers)
        and getattr(dist.Backend, "MPI", None) == NAME
    )


def installed() -> bool:
    """True when ``"mpi"`` runs over mpidist (:func:`install` filled torch's slot)."""
    return getattr(c10d, "ProcessGroupMPI", None) is ProcessGroupMPI


def install() -> None:
    """Make ``"mpi"`` mpidist on a torch without MPI (idempotent; see the module)."""
    if installed() or getattr(c10d, "_MPI_AVAILABLE", False):
        return  # done already, or torch's own MPI backend
    if not _torch_fits():
        warnings.warn(
            f"mpidist: backend 'mpi' stays unavailable: torch {torch.__version__}'s internals "
            f"differ from what mpidist.torch needs for it (distributed_c10d._MPI_AVAILABLE, "
            f"ProcessGroupMPI); use backend 'mpidist'",
            RuntimeWarning,
            stacklevel=3,
        )
        return
    c10d.ProcessGroupMPI = ProcessGroupMPI  # type: ignore[misc,assignment]  # fills torch's ProcessGroupMPI slot
    c10d._MPI_AVAILABLE = True
    _backend.declare_self_recording("mpi")
