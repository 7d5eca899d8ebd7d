"""Point-to-point: send, recv, isend, irecv, batch_isend_irecv with torch.distributed semantics.

``dst``/``src``/``peer`` are global ranks even when ``group`` is given; torch 2.4+'s
``group_dst``/``group_src``/``group_peer`` name the same rank by its rank in ``group``
instead (one of the two, :func:`mpidist._dispatch.dispatch.root_rank`). Messages travel
on the group's private communicator, so they never match a user's own MPI traffic.
Tags: 0 .. ``mpidist._core.tags.USER_TAG_MAX`` (:mod:`mpidist._core.tags`). Bodies (and how
a message of another size is refused): :mod:`mpidist._backends.mpi.p2p` (routing:
:mod:`mpidist._public_op`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional, cast

import numpy as np

from mpidist._backends.device.route import batch_takes, device_call
from mpidist._backends.mpi import p2p as H
from mpidist._core.group import ProcessGroup
from mpidist._dispatch.p2p_op import P2POp
from mpidist._public_op import public_op
from mpidist.errors import prefix
from mpidist.work import Work

__all__ = ["send", "recv", "isend", "irecv", "P2POp", "batch_isend_irecv"]


@public_op(H.send)
def send(
    tensor: np.ndarray,
    dst: Optional[int] = None,
    group: Optional[ProcessGroup] = None,
    tag: int = 0,
    group_dst: Optional[int] = None,
) -> None:
    """Send ``tensor`` to global rank ``dst``, blocking until the buffer can be reused (MPI_Send).

    ``group_dst`` names the destination by its rank in ``group`` instead (torch 2.4+);
    exactly one of ``dst`` and ``group_dst``. Errors as :func:`isend`.
    """


@public_op(H.recv)
def recv(  # type: ignore[empty-body]  # a stub: public_op compiles the op from its signature, never runs it
    tensor: np.ndarray,
    src: Optional[int] = None,
    group: Optional[ProcessGroup] = None,
    tag: int = 0,
    group_src: Optional[int] = None,
) -> int:
    """Receive into ``tensor`` from global rank ``src`` (MPI_Recv).

    ``group_src`` names the source by its rank in ``group`` instead (torch 2.4+); at
    most one of the two; neither: any source. Returns the sender's global rank (-1 on a
    non-member), also when the source was given as ``group_src``. The message is probed
    first (MPI_Mprobe, then MPI_Mrecv of that very message): one of another size raises
    ValueError, is consumed, and ``tensor`` is left unchanged.
    """


@public_op(H.isend)
def isend(
    tensor: np.ndarray,
    dst: Optional[int] = None,
    group: Optional[ProcessGroup] = None,
    tag: int = 0,
    group_dst: Optional[int] = None,
) -> Optional[Work]:
    """Start sending ``tensor`` to global rank ``dst`` (MPI_Isend); returns a Work.

    ``tensor`` (C-contiguous numpy array, any numeric dtype) must stay unmodified until
    the Work completes. Returns None on a non-member. ``tag``: 0 .. ``mpidist._core.tags.USER_TAG_MAX``.
    ``group_dst`` names the destination by its rank in ``group`` instead (torch 2.4+);
    exactly one of ``dst`` and ``group_dst``.

    Raises:
        TypeError / ValueError: bad array, tag, or ``dst`` (not a member, or the
            caller); both or neither of ``dst``/``group_dst``.
    """


@public_op(H.irecv)
def irecv(
    tensor: np.ndarray,
    src: Optional[int] = None,
    group: Optional[ProcessGroup] = None,
    tag: int = 0,
    group_src: Optional[int] = None,
) -> Optional[Work]:
    """Start receiving into ``tensor`` from global rank ``src`` (MPI_Irecv).

    ``group_src`` names the source by its rank in ``group`` instead (torch 2.4+); at
    most one of the two; neither: any source. ``tensor`` (writable, C-contiguous) is
    overwritten when the Work completes; its ``source_rank()`` gives the sender's global
    rank. A message of another size makes ``wait()`` raise ValueError (the message is
    consumed); ``tensor`` is then unchanged if the message was there when the irecv was
    posted, else undefined, as with MPI_Irecv (docs/reliability.md, section 9). Returns
    None on a non-member.
    """


def batch_isend_irecv(p2p_op_list: Sequence[P2POp]) -> list[Work]:
    """Post every op of ``p2p_op_list`` (no wait in between) and return their Works, in order.

    Every op is validated before any is posted, so a bad op posts nothing. Ops on a
    group the caller is not in are skipped (no Work), as torch does. Wait on every
    returned Work before reusing the arrays.

    Raises:
        ValueError: the list is empty or holds something other than :class:`P2POp`.
        TypeError / ValueError: a bad array, peer or tag (the message names the op's
            index).
    """
    op = "batch_isend_irecv"
    if not isinstance(p2p_op_list, (list, tuple)) or not p2p_op_list:
        raise ValueError(f"{prefix(op)} p2p_op_list must be a non-empty list of P2POp, got {p2p_op_list!r:.80}")
    for i, p in enumerate(p2p_op_list):
        if not isinstance(p, P2POp):
            raise ValueError(f"{prefix(op)} p2p_op_list[{i}] must be a P2POp, got {type(p).__name__}")
    if batch_takes(p2p_op_list):  # device arrays: to the router
        return cast("list[Work]", device_call("batch_isend_irecv", None, {"p2p_op_list": p2p_op_list}))  # (its Works)
    return H.batch_isend_irecv(p2p_op_list)
