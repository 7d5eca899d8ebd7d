"""The one interface every communication backend implements: run one op of the public API,
its arguments validated as far as the public function goes, on one group.

Implementations: the MPI backend (:data:`mpidist._backends.mpi.MPI`, host arrays; what the
device backends end in), MPI on device memory
(:data:`mpidist._backends.device.cuda_aware.CUDA_AWARE`), host staging
(:data:`mpidist._backends.device.staging.STAGING`) and NCCL
(:func:`mpidist._backends.device.nccl.run`). The router (:mod:`mpidist._backends.device.route`)
picks one per device call; host arrays go straight to the MPI backend's bodies, with no table
lookup, so the 8-byte all_reduce keeps its speed (benchmarks/results/latency_layers.md).
docs/architecture.md, "The path of one all_reduce".
"""

from __future__ import annotations

from typing import Any, Protocol

from mpidist._core.group import ProcessGroup

__all__ = ["CommBackend"]


class CommBackend(Protocol):
    """A communication backend: :meth:`run` carries out public op ``op`` on a group."""

    def run(self, op: str, g: ProcessGroup, args: dict) -> Any:
        """Run public op ``op`` (its name, e.g. ``"all_reduce"``) on group ``g``.

        Args:
            op: a public op's name.
            g: the resolved group; the caller is a member.
            args: the public op's arguments by name but ``group``; a root (``src``/``dst``,
                a P2POp's ``peer``) as a global rank, without ``group_src``/``group_dst``.

        Returns what the public op returns: None, a Work (a list of them for
        batch_isend_irecv), recv's source rank.

        Raises:
            TypeError / ValueError: the op's argument errors; ValueError: an op this
            backend does not implement; DistBackendError: the transport failed.
        """
        ...
