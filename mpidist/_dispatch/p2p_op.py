"""P2POp, the description of one point-to-point operation for batch_isend_irecv.

Its own module, below the public point-to-point functions and the device paths that both
take it (:mod:`mpidist._backends.mpi.p2p`, :mod:`mpidist._backends.device.nccl`, :mod:`mpidist._backends.device.route`):
``P2POp.op`` is :func:`mpidist.isend` or :func:`mpidist.irecv`, told apart by
:func:`is_receive`.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from mpidist._arrays.buffers import host_array
from mpidist._arrays.namespace import is_device_array
from mpidist._core.group import ProcessGroup
from mpidist.device.op_args import IN, classify, is_receive, passing_through
from mpidist.errors import prefix

__all__ = ["P2POp", "is_receive", "with_tensor"]

#: the functions a P2POp may name, by (module, name): mpidist.isend and mpidist.irecv. By
#: name, not identity: this module sits below mpidist.p2p, which defines them and imports it.
_P2P_FUNCTIONS = {("mpidist.p2p", "isend"), ("mpidist.p2p", "irecv")}


class P2POp:
    """One point-to-point operation for :func:`batch_isend_irecv` (``torch.distributed.P2POp``).

    Args:
        op: :func:`mpidist.isend` or :func:`mpidist.irecv`.
        tensor: the array to send, or to receive into (writable for irecv).
        peer: the other side's global rank; or
        group: the process group (default: all ranks).
        tag: 0 .. ``mpidist._core.tags.USER_TAG_MAX``.
        group_peer: the other side's rank in ``group`` (torch 2.4+). One of ``peer``
            and ``group_peer``; neither on an irecv means any source (an mpidist
            extension: torch requires one).

    ``peer`` and ``group_peer`` are kept as given; :func:`batch_isend_irecv` checks them
    against the group (torch translates one into the other at construction).

    Raises:
        ValueError: ``op`` is neither isend nor irecv; both ``peer`` and ``group_peer``,
            or neither on an isend.
        TypeError / ValueError: a bad array.
    """

    __slots__ = ("op", "tensor", "peer", "group", "tag", "group_peer")

    def __init__(
        self,
        op: Any,
        tensor: np.ndarray,
        peer: Optional[int] = None,
        group: Optional[ProcessGroup] = None,
        tag: int = 0,
        group_peer: Optional[int] = None,
    ) -> None:
        if (getattr(op, "__module__", None), getattr(op, "__name__", None)) not in _P2P_FUNCTIONS:
            raise ValueError(
                f"{prefix('P2POp')} op must be mpidist.isend or mpidist.irecv, got {getattr(op, '__name__', repr(op))}"
            )
        if peer is not None and group_peer is not None:
            raise ValueError(
                f"{prefix('P2POp')} peer={peer} and group_peer={group_peer} both given; specify one "
                f"of them: peer is a global rank, group_peer a rank in the group"
            )
        if op.__name__ == "isend" and peer is None and group_peer is None:
            raise ValueError(
                f"{prefix('P2POp')} an isend needs its destination: peer (a global rank) or "
                f"group_peer (a rank in the group)"
            )
        if type(tensor) is not np.ndarray and is_device_array(tensor) and not passing_through():
            classify("P2POp", [("tensor", tensor, IN)])  # a device array: checked as the router will take it
        else:
            host_array(tensor, "P2POp", "tensor", writable=op.__name__ == "irecv")
        self.op, self.tensor, self.peer, self.group, self.tag = op, tensor, peer, group, tag
        self.group_peer = group_peer

    def __repr__(self) -> str:
        peer = f"peer={self.peer}" if self.group_peer is None else f"group_peer={self.group_peer}"
        return f"P2POp({self.op.__name__}, {peer}, tag={self.tag}, shape={self.tensor.shape})"


def with_tensor(p: P2POp, tensor: Any) -> P2POp:
    """P2POp ``p`` with ``tensor`` in place of its array (the device backends' host copies or views)."""
    return P2POp(p.op, tensor, p.peer, p.group, p.tag, p.group_peer)
