"""The error family and the message format every mpidist error follows.

Caller mistakes raise :class:`TypeError` or :class:`ValueError`; failures of
communication raise :class:`DistError`. Every message starts with
``[rank r/n] op:`` so a log line from a many-rank job says who failed where.
"""

from __future__ import annotations

from mpidist._core import current

__all__ = ["DistError", "DistBackendError", "DistNetworkError", "DistStoreError", "prefix", "from_mpi"]


class DistError(RuntimeError):
    """A communication failure: an MPI error, a timeout, a peer that went away."""


class DistBackendError(DistError):
    """An error reported by the backend (MPI or NCCL) itself."""


class DistNetworkError(DistError):
    """A process the operation needed failed or became unreachable (torch: a network
    error). MPI reports it with the error classes of process-fault tolerance
    (MPI_ERR_PROC_FAILED, MPI_ERR_PROC_FAILED_PENDING, MPI_ERR_REVOKED; MPI-5.0 §9.5):
    :func:`from_mpi` maps those here. Most MPI libraries abort the job on a failed process
    before any rank sees such an error."""


class DistStoreError(DistError):
    """torch's error for a key-value store failure. mpidist has no store (ranks come from
    MPI), so it never raises it; the class exists so that ``except DistStoreError`` in a
    ported program keeps working."""


def _network_classes() -> frozenset[int]:
    from mpi4py import MPI  # noqa: PLC0415

    names = ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED")
    # mpi4py gives a class the MPI library lacks the value of MPI_ERR_UNKNOWN (MPICH 5.0 lacks
    # these three): never map that one
    return frozenset(getattr(MPI, n) for n in names if getattr(MPI, n, MPI.ERR_UNKNOWN) != MPI.ERR_UNKNOWN)


def prefix(op: str) -> str:
    """``"[rank r/n] op:"`` for the calling process, usable before init."""
    state = current.state
    if state is None:
        return f"[rank ?/?] {op}:"
    return f"[rank {state.rank}/{state.world_size}] {op}:"


def from_mpi(op: str, exc: Exception) -> Exception:
    """The mpidist error for an ``MPI.Exception`` raised inside ``op``.

    A truncated receive (MPI_ERR_TRUNCATE) is a caller mistake, ValueError; a failed
    process (MPI_ERR_PROC_FAILED, ..._PENDING, MPI_ERR_REVOKED) a :class:`DistNetworkError`;
    anything else is a :class:`DistBackendError` carrying MPI's own error string.
    """
    from mpi4py import MPI  # noqa: PLC0415

    if isinstance(exc, MPI.Exception):
        cls = exc.Get_error_class()
        if cls == MPI.ERR_TRUNCATE:
            return ValueError(
                f"{prefix(op)} the incoming message is larger than the receive buffer; "
                f"sender and receiver must use the same shape and dtype"
            )
        if cls in _network_classes():
            return DistNetworkError(
                f"{prefix(op)} a process this operation needs has failed (MPI error: {exc.Get_error_string()})"
            )
        return DistBackendError(f"{prefix(op)} MPI error: {exc.Get_error_string()}")
    return exc
