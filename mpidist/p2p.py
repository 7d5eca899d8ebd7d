"""Point-to-point: send, recv, isend, irecv with torch.distributed semantics.

``dst``/``src`` are global ranks even when ``group`` is given. Messages travel on the
group's private communicator, so they never match a user's own MPI traffic.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np
from mpi4py import MPI

from mpidist import _runtime
from mpidist._buffers import host_array, mpi_datatype
from mpidist._dispatch import group_root
from mpidist.errors import DistBackendError, from_mpi, prefix
from mpidist.group import ProcessGroup
from mpidist.work import RequestWork, Work

__all__ = ["send", "recv", "isend", "irecv"]


def _check_tag(tag: Any, op: str) -> int:
    if not isinstance(tag, (int, np.integer)) or isinstance(tag, bool):
        raise TypeError(f"{prefix(op)} tag must be an int, got {type(tag).__name__}")
    upper = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
    if not 0 <= tag <= upper:
        raise ValueError(f"{prefix(op)} tag must be in [0, {upper}] (MPI_TAG_UB), got {tag}")
    return int(tag)


def _peer(g: ProcessGroup, peer: Any, op: str, arg: str) -> int:
    """Group rank of global rank ``peer``; it must be a member and not the caller."""
    peer_rank = group_root(g, peer, op, arg)
    if peer_rank == g.rank():
        raise ValueError(f"{prefix(op)} {arg}={peer} is the calling rank itself; "
                         f"expected another member of the group")
    return peer_rank


def _setup(op: str, tensor: Any, group: Optional[ProcessGroup], tag: Any, writable: bool):
    g = _runtime.resolve_group(group)
    arr = host_array(tensor, op, "tensor", writable=writable)
    return g, arr, _check_tag(tag, op)


def _finisher(g: ProcessGroup, arr: np.ndarray, op: str):
    """After a receive: check the message filled the buffer; return the sender's global rank."""
    datatype = mpi_datatype(arr.dtype)

    def finish(status: MPI.Status) -> int:
        err = status.Get_error()
        if err != MPI.SUCCESS:
            raise DistBackendError(f"{prefix(op)} MPI error: {MPI.Get_error_string(err)}")
        got = status.Get_count(datatype)
        if got != arr.size:
            raise ValueError(f"{prefix(op)} received {got} elements of {arr.dtype} from rank "
                             f"{g.ranks[status.Get_source()]}, expected {arr.size} (tensor shape "
                             f"{arr.shape}); sender and receiver must use the same shape and dtype")
        return g.ranks[status.Get_source()]
    return finish


class _mpi_errors:  # noqa: N801  (used as a context manager: ``with _mpi_errors(op):``)
    """Turn an ``MPI.Exception`` raised inside the block into mpidist's error."""

    def __init__(self, op: str) -> None:
        self.op = op

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> bool:
        if isinstance(exc, MPI.Exception):
            raise from_mpi(self.op, exc) from exc
        return False


def isend(tensor: np.ndarray, dst: int, group: Optional[ProcessGroup] = None, tag: int = 0) -> Optional[Work]:
    """Start sending ``tensor`` to global rank ``dst``; returns a Work (None for non-members).

    ``tensor`` must stay unmodified until the Work completes.
    """
    g, arr, tag = _setup("isend", tensor, group, tag, writable=False)
    if g.comm is None:
        return None
    peer = _peer(g, dst, "isend", "dst")
    with _mpi_errors("isend"):
        req = g.comm.Isend([arr, mpi_datatype(arr.dtype)], peer, tag)
    return RequestWork("isend", prefix("isend"), req)


def irecv(tensor: np.ndarray, src: Optional[int] = None, group: Optional[ProcessGroup] = None,
          tag: int = 0) -> Optional[Work]:
    """Start receiving into ``tensor`` from global rank ``src`` (any source if None).

    The returned Work's ``source_rank()`` gives the sender's global rank. On completion
    a message of another size raises ValueError from ``wait()``.
    """
    g, arr, tag = _setup("irecv", tensor, group, tag, writable=True)
    if g.comm is None:
        return None
    peer = MPI.ANY_SOURCE if src is None else _peer(g, src, "irecv", "src")
    with _mpi_errors("irecv"):
        req = g.comm.Irecv([arr, mpi_datatype(arr.dtype)], peer, tag)
    return RequestWork("irecv", prefix("irecv"), req, (tensor,), _finisher(g, arr, "irecv"))


def send(tensor: np.ndarray, dst: int, group: Optional[ProcessGroup] = None, tag: int = 0) -> None:
    """Send ``tensor`` to global rank ``dst``, blocking until the buffer can be reused."""
    g, arr, tag = _setup("send", tensor, group, tag, writable=False)
    if g.comm is None:
        return None
    peer = _peer(g, dst, "send", "dst")
    with _mpi_errors("send"):
        g.comm.Send([arr, mpi_datatype(arr.dtype)], peer, tag)
    return None


def recv(tensor: np.ndarray, src: Optional[int] = None, group: Optional[ProcessGroup] = None,
         tag: int = 0) -> int:
    """Receive into ``tensor`` from global rank ``src`` (any source if None).

    Returns the sender's global rank (-1 on a non-member). Raises ValueError if the
    message does not have exactly ``tensor.size`` elements.
    """
    g, arr, tag = _setup("recv", tensor, group, tag, writable=True)
    if g.comm is None:
        return -1
    peer = MPI.ANY_SOURCE if src is None else _peer(g, src, "recv", "src")
    status = MPI.Status()
    with _mpi_errors("recv"):
        g.comm.Recv([arr, mpi_datatype(arr.dtype)], peer, tag, status)
    return _finisher(g, arr, "recv")(status)

