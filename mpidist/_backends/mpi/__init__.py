"""The MPI backend: the bodies of the public ops on host arrays (validation of the arrays,
the group, the launch on the group's communicator, inline or on its engine) and
all_reduce's algorithms. :data:`OPS` maps each op routed by device to its body; :data:`MPI`
is the backend (:class:`mpidist._dispatch.comm_backend.CommBackend`) the device backends end in.
"""

from __future__ import annotations

from typing import Any

from mpidist._backends.mpi import coalesced, collectives, gather_scatter, p2p, reductions
from mpidist._core.group import ProcessGroup

__all__ = ["MPI", "MpiBackend", "OPS"]

#: op name -> the MPI backend's body (every op a device array may reach)
OPS = {
    name: getattr(m, name)
    for m in (collectives, reductions, gather_scatter, p2p, coalesced)
    for name in m.__all__
    if callable(getattr(m, name))
}

_P2P = frozenset(p2p.__all__)


class MpiBackend:
    """MPI on the arrays given (a :class:`~mpidist._dispatch.comm_backend.CommBackend`): host arrays,
    or device arrays under :func:`mpidist.device.op_args.passthrough` (the CUDA-aware path).
    A collective's body takes the resolved group as ``g``; a point-to-point body resolves
    its ``group`` itself (after checking its array, as torch); batch_isend_irecv's ops
    name theirs. A root comes from the router as a global rank, without ``group_src`` /
    ``group_dst`` (the bodies' only defaults, None)."""

    def run(self, op: str, g: ProcessGroup, args: dict) -> Any:
        if op == "batch_isend_irecv":
            return OPS[op](**args)
        return OPS[op](**args, group=g) if op in _P2P else OPS[op](**args, g=g)


MPI = MpiBackend()
