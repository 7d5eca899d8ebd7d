"""Backend name ``"mpi"`` on torch wheels, which are built without MPI.

:func:`install` (run by ``import mpidist.torch``) fills torch's slot for its MPI backend:
``distributed_c10d._MPI_AVAILABLE`` becomes True and ``distributed_c10d.ProcessGroupMPI`` is
:class:`ProcessGroupMPI`, whose ``create(ranks)`` torch calls for the default group and each
``new_group``. The rest is torch's own MPI path, with its semantics (docs/torch.md, "Which
name to use when"); every op runs through
:class:`~mpidist.torch._process_group.ProcessGroupMpidist`. A torch with its own MPI backend
is left alone; one whose internals differ keeps ``"mpi"`` unavailable, with one warning.
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
