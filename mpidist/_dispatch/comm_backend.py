"""The one interface every communication backend implements: run one op of the public API,
its arguments validated as far as the public function goes, on one group.

Implementations, one per way an array can travel:

* the MPI backend (:data:`mpidist._backends.mpi.MPI`): host arrays, with its algorithms (ring,
  shared memory) for all_reduce; also what the two device backends below end in;
* MPI on device memory (:data:`mpidist._backends.device.cuda_aware.CUDA_AWARE`): the device arrays
  themselves handed to a CUDA-aware MPI, through the MPI backend's bodies;
* host staging (:data:`mpidist._backends.device.staging.STAGING`): device arrays copied to pinned host
  buffers, the MPI backend's body, the results copied back;
* NCCL (the module :mod:`mpidist._backends.device.nccl`, whose :func:`~mpidist._backends.device.nccl.run` is
  the method): device arrays on a group whose backend names NCCL.

The router (:mod:`mpidist._backends.device.route`) picks one for each call on device arrays from the
group's backend, the MPI's CUDA-awareness and the call (:func:`mpidist._backends.device.paths.choose`);
the public functions call the MPI backend's bodies directly for host arrays (one call, no
table lookup: the 8-byte all_reduce keeps its speed, benchmarks/results/latency_layers.md).
Every backend lives below the public functions and the router and never calls them
(docs/architecture.md).
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
