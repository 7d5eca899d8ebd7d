"""The MPI backend's point-to-point: send, recv, isend, irecv and batch_isend_irecv, the
bodies of :mod:`mpidist.p2p`'s public functions, on host arrays (and on the device arrays of
the CUDA-aware path, :mod:`mpidist._backends.device.route`).

Tags: array messages take tags 0 .. ``mpidist._core.tags.USER_TAG_MAX``; the tags above are
reserved for mpidist's own messages on the group's communicator (object point-to-point,
monitored_barrier), so they never match a user's (see :mod:`mpidist._core.tags`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, Optional

import numpy as np
from mpi4py import MPI

from mpidist import work
from mpidist._arrays.buffers import host_array, mpi_datatype
from mpidist._core.group import ProcessGroup
from mpidist._core.recorder import begin_p2p, fail
from mpidist._dispatch.dispatch import check_tag, p2p_call, peer_rank, unusable
from mpidist._dispatch.p2p_op import P2POp, is_receive
from mpidist._runtime import world as runtime
from mpidist.errors import DistBackendError, from_mpi, prefix
from mpidist.work import CompletedWork, RequestWork, Work

__all__ = ["send", "recv", "isend", "irecv", "batch_isend_irecv"]


# -- receiving: a message of another size is an error, and never silently wrong data ---------
# MPI_Recv writes a shorter message into the start of the buffer, and the start of a longer
# one before it reports MPI_ERR_TRUNCATE. So ``recv`` learns the size first, with a matched
# probe (MPI_Mprobe/MPI_Improbe: the message is then this receive's, no other receive on any
# thread can take it), and receives into the buffer only a message of exactly its size; any
# other is received into a scratch buffer and dropped (consumed, so the next receive gets the
# next message), the receive raises ValueError and the buffer is unchanged (issue 14, item 6).
# An ``irecv`` probes too: a message already there is handled the same way. One that has not
# arrived when the irecv is posted cannot be probed for without giving up MPI's matching
# order (messages go to receives in the order they were posted) or its progress while the
# caller blocks elsewhere (irecv then send is deadlock-free in MPI): it is received into the
# array directly, as bytes (no copy on the hot path of pipelined receives), and ``wait()``
# raises ValueError, the array's contents then undefined, as MPI_Irecv's. The blocking
# ``recv`` under MPIDIST_ABORT_ON_TIMEOUT=0, which runs as an irecv, keeps its promise with a
# scratch buffer copied over on completion (``strict``).


def _mismatch(
    g: ProcessGroup, arr: Any, op: str, status: MPI.Status, datatype: MPI.Datatype, written: bool = False
) -> ValueError:
    """The error for a message (already consumed) whose size differs from ``arr``'s;
    ``written``: it was received into ``arr`` itself (an irecv posted before it arrived)."""
    nbytes = status.Get_count(MPI.BYTE)
    got = status.Get_count(datatype)
    what = (
        f"{got} elements of {arr.dtype}"
        if got != MPI.UNDEFINED
        else f"{nbytes} bytes (not a whole number of {arr.dtype} elements)"
    )
    state = (
        "the tensor's contents are undefined (the irecv was posted before the message came, so it "
        "was received in place)"
        if written
        else "the tensor left unchanged"
    )
    return ValueError(
        f"{prefix(op)} received {what} from rank {g.ranks[status.Get_source()]}, expected "
        f"{arr.size} (tensor shape {arr.shape}); the message was consumed and {state}; "
        f"sender and receiver must use the same shape and dtype"
    )


def _drop(message: MPI.Message, status: MPI.Status) -> None:
    """Receive a matched message into a scratch buffer of its size (``status``: its probe's)."""
    message.Recv([bytearray(max(status.Get_count(MPI.BYTE), 1)), MPI.BYTE])


def _finisher(g: ProcessGroup, arr: Any, op: str, scratch: Optional[np.ndarray] = None, in_place: bool = False):
    """After a receive completed: check the message's size; return the sender's global rank.

    ``scratch`` (bytes, one element more than ``arr``'s): the receive went there, as bytes
    (so a message that is not a whole number of elements is reported, not an MPI internal
    error), and is copied into ``arr`` only if it had exactly ``arr.size`` elements.
    ``in_place``: it went into ``arr`` itself (as bytes, for the same reason).
    """
    datatype = mpi_datatype(arr.dtype)

    def finish(status: MPI.Status) -> int:
        err = status.Get_error()  # (MPI_ERR_TRUNCATE, a message larger than the buffer, raises in Wait/Test)
        if err != MPI.SUCCESS:
            raise DistBackendError(f"{prefix(op)} MPI error: {MPI.Get_error_string(err)}")
        if status.Get_count(datatype) != arr.size:
            raise _mismatch(g, arr, op, status, datatype, in_place)
        if scratch is not None:
            arr.reshape(-1).view(np.uint8)[...] = scratch[: arr.nbytes]
        return g.ranks[status.Get_source()]

    return finish


class mpi_errors:  # noqa: N801  (used as a context manager: ``with mpi_errors(op):``)
    """Turn an ``MPI.Exception`` raised inside the block into mpidist's error."""

    def __init__(self, op: str) -> None:
        self.op = op

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> Literal[False]:
        if isinstance(exc, MPI.Exception):
            raise from_mpi(self.op, exc) from exc
        return False


def _prepare(
    op: str,
    tensor: Any,
    peer: Any,
    group: Optional[ProcessGroup],
    tag: Any,
    receive: bool,
    group_peer: Any = None,
    where: str = "",
):
    """Validate one p2p op: ``(group, array, peer's group rank, tag)``, or None on a non-member.

    ``peer`` (global) or ``group_peer`` (in ``group``) names the other side; neither on a
    receive means any source. ``where`` prefixes the argument names
    (``"p2p_op_list[2]."``) when the op comes from a batch.
    """
    g = runtime.resolve_group(group)
    arr = host_array(tensor, op, f"{where}tensor", writable=receive)
    tag = check_tag(tag, op, f"{where}tag")
    if g.comm is None:
        return None
    if g.engine.aborted:
        raise unusable(g, op)
    if receive and peer is None and group_peer is None:
        return g, arr, MPI.ANY_SOURCE, tag
    if where:
        arg, group_arg = f"{where}peer", f"{where}group_peer"
    else:
        arg, group_arg = ("src", "group_src") if receive else ("dst", "group_dst")
    return g, arr, peer_rank(g, peer, op, arg, group_peer, group_arg), tag


def _global(g: ProcessGroup, peer: int) -> int:
    """The global rank of group rank ``peer`` (-1 for MPI.ANY_SOURCE), for the recorder."""
    return g.ranks[peer] if peer >= 0 else -1


def _post_isend(g: ProcessGroup, arr: np.ndarray, peer: int, tag: int, op: str = "isend") -> Work:
    rec = begin_p2p(g, op, arr.shape, arr.dtype, _global(g, peer))
    with mpi_errors(op):
        req = g.comm.Isend([arr, mpi_datatype(arr.dtype)], peer, tag)  # type: ignore[union-attr]  # a member's comm (None on non-members only)
    return RequestWork(op, prefix(op), req, rec=rec)


def _post_irecv(g: ProcessGroup, arr: np.ndarray, peer: int, tag: int, op: str = "irecv", strict: bool = False) -> Work:
    """Post a receive into ``arr``: one that never writes a message of another size there if
    the message is already there, or if ``strict``; else one that receives in place (see the
    comment above :func:`_mismatch`)."""
    rec = begin_p2p(g, op, arr.shape, arr.dtype, _global(g, peer))
    datatype = mpi_datatype(arr.dtype)
    status = MPI.Status()
    with mpi_errors(op):
        message = g.comm.Improbe(peer, tag, status)  # type: ignore[union-attr]  # a member's comm (None on non-members only)
        if message is not None:  # it is here: its size is known before anything is written
            if status.Get_count(datatype) == arr.size:
                req = message.Irecv([arr, datatype])
            else:
                _drop(message, status)
                fail(rec)
                return CompletedWork(op, prefix(op), (arr,), error=_mismatch(g, arr, op, status, datatype))
            scratch, in_place = None, False
        elif type(arr) is not np.ndarray:  # a device array on the CUDA-aware path: in place
            scratch, in_place = None, True
            req = g.comm.Irecv([arr, datatype], peer, tag)  # type: ignore[union-attr]  # a member's comm (None on non-members only)
        elif strict:  # not yet: into a scratch buffer, copied on completion
            scratch, in_place = np.empty(arr.nbytes + arr.itemsize, dtype=np.uint8), False
            req = g.comm.Irecv([scratch, MPI.BYTE], peer, tag)  # type: ignore[union-attr]  # a member's comm (None on non-members only)
        else:  # not yet: in place, as bytes (a size that is no whole number of elements is reported)
            scratch, in_place = None, True
            req = g.comm.Irecv([arr.reshape(-1).view(np.uint8), MPI.BYTE], peer, tag)  # type: ignore[union-attr]  # a member's comm (None on non-members only)
    return RequestWork(op, prefix(op), req, (arr,), _finisher(g, arr, op, scratch, in_place), rec=rec)


def isend(
    tensor: np.ndarray,
    dst: Optional[int] = None,
    group: Optional[ProcessGroup] = None,
    tag: int = 0,
    group_dst: Optional[int] = None,
) -> Optional[Work]:
    """The MPI backend's :func:`mpidist.isend`."""
    args = _prepare("isend", tensor, dst, group, tag, False, group_dst)
    return None if args is None else _post_isend(*args)


def irecv(
    tensor: np.ndarray,
    src: Optional[int] = None,
    group: Optional[ProcessGroup] = None,
    tag: int = 0,
    group_src: Optional[int] = None,
) -> Optional[Work]:
    """The MPI backend's :func:`mpidist.irecv`."""
    args = _prepare("irecv", tensor, src, group, tag, True, group_src)
    return None if args is None else _post_irecv(*args)


def send(
    tensor: np.ndarray,
    dst: Optional[int] = None,
    group: Optional[ProcessGroup] = None,
    tag: int = 0,
    group_dst: Optional[int] = None,
) -> None:
    """The MPI backend's :func:`mpidist.send`."""
    args = _prepare("send", tensor, dst, group, tag, False, group_dst)
    if args is None:
        return None
    g, arr, peer, tag = args
    if not work.ABORT_ON_TIMEOUT:  # a wait that can raise DistError past the timeout
        _post_isend(g, arr, peer, tag, "send").wait()
        return None
    with p2p_call(g, "send", arr.shape, arr.dtype, _global(g, peer)):
        g.comm.Send([arr, mpi_datatype(arr.dtype)], peer, tag)
    return None


def recv(
    tensor: np.ndarray,
    src: Optional[int] = None,
    group: Optional[ProcessGroup] = None,
    tag: int = 0,
    group_src: Optional[int] = None,
) -> int:
    """The MPI backend's :func:`mpidist.recv`."""
    args = _prepare("recv", tensor, src, group, tag, True, group_src)
    if args is None:
        return -1
    g, arr, peer, tag = args
    if not work.ABORT_ON_TIMEOUT:  # a wait that can raise DistError past the timeout
        return _post_irecv(g, arr, peer, tag, "recv", strict=True).source_rank()
    status = MPI.Status()
    datatype = mpi_datatype(arr.dtype)
    with p2p_call(g, "recv", arr.shape, arr.dtype, _global(g, peer)):
        message = g.comm.Mprobe(peer, tag, status)  # matched: this receive's message, whatever other threads do
        if status.Get_count(datatype) == arr.size:
            message.Recv([arr, datatype])
            return g.ranks[status.Get_source()]
        _drop(message, status)
        raise _mismatch(g, arr, "recv", status, datatype)


def batch_isend_irecv(p2p_op_list: Sequence[P2POp]) -> list:
    """The MPI backend's :func:`mpidist.batch_isend_irecv`."""
    op = "batch_isend_irecv"
    posts = []
    for i, p in enumerate(p2p_op_list):
        receive = is_receive(p)
        args = _prepare(op, p.tensor, p.peer, p.group, p.tag, receive, p.group_peer, f"p2p_op_list[{i}].")
        if args is not None:
            posts.append((_post_irecv if receive else _post_isend, args))
    return [post(*args) for post, args in posts]
