"""The error family and the message format every mpidist error follows.

Caller mistakes raise :class:`TypeError` or :class:`ValueError`; failures of
communication raise :class:`DistError`. Every message starts with
``[rank r/n] op:`` so a log line from a many-rank job says who failed where.
"""
from __future__ import annotations

__all__ = ["DistError", "DistBackendError", "prefix", "from_mpi"]


class DistError(RuntimeError):
    """A communication failure: an MPI error, a timeout, a peer that went away."""


class DistBackendError(DistError):
    """An error reported by the backend (MPI or NCCL) itself."""


def prefix(op: str) -> str:
    """``"[rank r/n] op:"`` for the calling process, usable before init."""
    from mpidist import _runtime  # noqa: PLC0415  (avoid an import cycle)

    state = _runtime.state_or_none()
    if state is None:
        return f"[rank ?/?] {op}:"
    return f"[rank {state.rank}/{state.world_size}] {op}:"


def from_mpi(op: str, exc: Exception) -> Exception:
    """The mpidist error for an ``MPI.Exception`` raised inside ``op``.

    A truncated receive (MPI_ERR_TRUNCATE) is a caller mistake, ValueError; anything
    else is a :class:`DistBackendError` carrying MPI's own error string.
    """
    from mpi4py import MPI  # noqa: PLC0415

    if isinstance(exc, MPI.Exception):
        if exc.Get_error_class() == MPI.ERR_TRUNCATE:
            return ValueError(f"{prefix(op)} the incoming message is larger than the receive buffer; "
                              f"sender and receiver must use the same shape and dtype")
        return DistBackendError(f"{prefix(op)} MPI error: {exc.Get_error_string()}")
    return exc
