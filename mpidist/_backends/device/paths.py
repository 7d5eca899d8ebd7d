"""Which path a call takes: a pure function of the call's arrays, the group's backend
and the MPI's CUDA-awareness, so it is tested as a table without a GPU.

* ``HOST``: numpy arrays; MPI on host memory (every backend: host arrays always go
  through MPI, also on a group whose backend is ``"nccl"``).
* ``NCCL``: device arrays on a group whose backend names NCCL for CUDA
  (``"nccl"``, ``"cuda:nccl"``, ``"cpu:mpi,cuda:nccl"``): :mod:`mpidist._backends.device.nccl`.
* ``MPI_CUDA``: device arrays handed to a CUDA-aware MPI (after their streams are
  synchronized), for the ops whose host bodies run unchanged on cupy arrays
  (:data:`MPI_CUDA_OPS`, below), on dtypes MPI reduces itself.
* ``STAGING``: everything else with device arrays: copied to pinned host buffers,
  the MPI backend's body, copied back. Never a device pointer to an MPI that is not CUDA-aware.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

__all__ = [
    "HOST",
    "MPI_CUDA",
    "NCCL",
    "STAGING",
    "MPI_CUDA_OPS",
    "REDUCING_OPS",
    "choose",
    "device_backend",
    "mpi_cuda_ok",
]

HOST, MPI_CUDA, NCCL, STAGING = "host", "mpi_cuda", "nccl", "staging"

#: Ops whose host bodies were audited to run on cupy arrays with a CUDA-aware MPI: they
#: pass the arrays to one MPI call (plus cupy-dispatched ufuncs / copies). The others
#: build host scratch buffers or read ``__array_interface__`` (all_gather, gather, scatter,
#: all_to_all[_single], reduce_scatter with a list, the *_multigpu forms, whose
#: all_reduce may pick a host-only algorithm) and are staged.
MPI_CUDA_OPS = frozenset(
    {
        "all_reduce",
        "broadcast",
        "reduce",
        "all_gather_into_tensor",
        "reduce_scatter_tensor",
        "send",
        "recv",
        "isend",
        "irecv",
        "batch_isend_irecv",
    }
)
#: Ops that reduce: on the CUDA-aware path only for ReduceOp (not a premul sum, whose
#: factor is a host array) on dtypes with a predefined MPI datatype (others are reduced by
#: a Python MPI op, which cannot read device memory).
REDUCING_OPS = frozenset({"all_reduce", "reduce", "reduce_scatter_tensor"})
#: all_reduce algorithms that run on device arrays (None is run as "mpi").
DEVICE_ALGORITHMS = (None, "mpi", "ring")


def device_backend(backend: str) -> str:
    """The backend a group uses for device arrays: ``"nccl"`` or ``"mpi"``."""
    return "nccl" if "nccl" in backend else "mpi"


def mpi_cuda_ok(op: str, dtype: Optional[np.dtype], redop: Any, algorithm: Any, overlap: bool) -> bool:
    """True if ``op`` may run on device arrays through a CUDA-aware MPI.

    ``dtype``: the arrays' dtype (None: not known); ``redop``: the reduction (None if
    the op does not reduce); ``algorithm``: all_reduce's; ``overlap``: two device arrays
    of the call share memory (in-place forms are staged).
    """
    from mpidist._arrays.buffers import mpi_reducible  # noqa: PLC0415
    from mpidist._arrays.reduce_op import ReduceOp  # noqa: PLC0415

    if op not in MPI_CUDA_OPS or overlap:
        return False
    return op not in REDUCING_OPS or (
        type(redop) is ReduceOp
        and dtype is not None
        and mpi_reducible(np.dtype(dtype))
        and (op != "all_reduce" or algorithm in DEVICE_ALGORITHMS)
    )


def choose(device: bool, backend: str, cuda_aware: bool, mpi_cuda_possible: bool) -> str:
    """The path of one call.

    Args:
        device: the call's arrays are device arrays (a mixed call is an error before this).
        backend: the group's device backend, ``"mpi"`` or ``"nccl"`` (:func:`device_backend`).
        cuda_aware: the MPI takes device pointers (:mod:`mpidist.device.detect`).
        mpi_cuda_possible: :func:`mpi_cuda_ok` for this call.
    """
    if not device:
        return HOST
    if backend == "nccl":
        return NCCL
    if cuda_aware and mpi_cuda_possible:
        return MPI_CUDA
    return STAGING
