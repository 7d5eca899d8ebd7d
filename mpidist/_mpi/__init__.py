"""The MPI backend: the bodies of the public ops on host arrays (validation of the arrays,
the group, the launch on the group's communicator, inline or on its engine) and
all_reduce's algorithms. :data:`OPS` maps each op routed by device to its body; :data:`MPI`
is the backend (:class:`mpidist._comm_backend.CommBackend`) the device backends end in.
"""
from __future__ import annotations

from typing import Any

from mpidist._group import ProcessGroup
from mpidist._mpi import coalesced, collectives, gather_scatter, p2p, reductions

__all__ = ["MPI", "MpiBackend", "OPS"]

#: op name -> the MPI backend's body (every op a device array may reach)
OPS = {name: getattr(m, name) for m in (collectives, reductions, gather_scatter, p2p, coalesced)
       for name in m.__all__ if callable(getattr(m, name))}


class MpiBackend:
    """MPI on the arrays given (a :class:`~mpidist._comm_backend.CommBackend`): host arrays,
    or device arrays under :func:`mpidist.device.arrays.passthrough` (the CUDA-aware path).
    The body checks ``g`` as a host call's ``group``; batch_isend_irecv's ops name theirs."""

    def run(self, op: str, g: ProcessGroup, args: dict) -> Any:
        return OPS[op](**args) if op == "batch_isend_irecv" else OPS[op](group=g, **args)


MPI = MpiBackend()
