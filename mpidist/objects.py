"""Object collectives and object point-to-point: picklable Python objects between ranks.

Same names, arguments and semantics as torch.distributed's ``broadcast_object_list``,
``all_gather_object``, ``gather_object``, ``scatter_object_list``, ``send_object_list``
and ``recv_object_list``; output lists are filled in place.

.. warning::
   Objects are pickled. Unpickling data runs arbitrary code chosen by whoever produced
   it, so call these functions only with peers you trust, exactly as torch warns.

Transport: :mod:`mpi4py.util.pkl5` on the group's communicator. It pickles with
protocol 5 and sends large buffers (numpy arrays) out of band, without copying them
into the pickle, in messages whose byte count may exceed 2**31 - 1, so an object larger
than 2 GiB works (MPI's int counts would otherwise cap a message at 2 GiB).

Which messages can meet which:

* Collectives run in the group's op order (``_dispatch.launch``), behind any pending
  async op of the group. pkl5's bcast is MPI_Bcast on the group's communicator; its
  gather, scatter and allgather travel on a private duplicate that mpi4py attaches to
  that communicator (created collectively on first use, freed with it).
* ``send_object_list``/``recv_object_list`` use the group's communicator with the
  reserved tag MPI_TAG_UB (:data:`mpidist._tags.OBJECT_TAG`); array p2p accepts tags
  0 .. MPI_TAG_UB - 1 only, so object and array messages never match each other. A
  private duplicate communicator is not an option here: MPI_Comm_dup is collective,
  and a point-to-point call cannot make its peers join one.
"""
from __future__ import annotations

from typing import Any, Optional

from mpi4py import MPI
from mpi4py.util import pkl5

from mpidist._dispatch import group_root, launch, member, p2p_call
from mpidist.errors import prefix
from mpidist._group import ProcessGroup
from mpidist._tags import OBJECT_TAG
from mpidist.p2p import peer_rank

__all__ = ["broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
           "send_object_list", "recv_object_list"]


def _check_list(obj: Any, op: str, arg: str, size: Optional[int] = None, at_least: int = 0) -> list:
    """``obj`` must be a list, of exactly ``size`` items if given, else of at least ``at_least``."""
    if not isinstance(obj, list):
        raise TypeError(f"{prefix(op)} {arg} must be a list, got {type(obj).__name__}")
    if size is not None and len(obj) != size:
        raise ValueError(f"{prefix(op)} {arg} must have one item per group member ({size}), "
                         f"got {len(obj)}")
    if len(obj) < at_least:
        raise ValueError(f"{prefix(op)} {arg} must hold at least {at_least} item, got an empty list")
    return obj


def _fill(object_list: list, got: list, op: str, sender: int) -> None:
    """Copy a received list into ``object_list`` in place; the lengths must match."""
    if len(got) != len(object_list):
        raise ValueError(f"{prefix(op)} received {len(got)} objects from rank {sender}, expected "
                         f"len(object_list) = {len(object_list)}; every rank must pass a list of "
                         f"the same length")
    object_list[:] = got


def _bcast(g: ProcessGroup, object_list: list, root: int) -> None:
    if g.rank() == root:
        pkl5.Intracomm(g.comm).bcast(object_list, root)
    else:
        _fill(object_list, pkl5.Intracomm(g.comm).bcast(None, root), "broadcast_object_list", g.ranks[root])


def _allgather(g: ProcessGroup, object_list: list, obj: Any) -> None:
    object_list[:] = pkl5.Intracomm(g.comm).allgather(obj)


def _gather(g: ProcessGroup, object_gather_list: Optional[list], obj: Any, root: int) -> None:
    got = pkl5.Intracomm(g.comm).gather(obj, root)
    if object_gather_list is not None:
        object_gather_list[:] = got


def _scatter(g: ProcessGroup, output: list, inputs: Optional[list], root: int) -> None:
    output[0] = pkl5.Intracomm(g.comm).scatter(inputs, root)


def broadcast_object_list(object_list: list, src: int = 0, group: Optional[ProcessGroup] = None,
                          device: Any = None) -> None:
    """Broadcast the picklable objects of ``object_list`` from global rank ``src``.

    Every member passes a list of the same length; on ranks other than ``src`` its items
    are replaced in place by ``src``'s (torch.distributed.broadcast_object_list).
    ``device`` is accepted for torch compatibility and ignored: objects travel through
    host memory. Non-members return None and keep their list. Unpickles ``src``'s data:
    trust it.

    Raises:
        TypeError: ``object_list`` is not a list. ValueError: ``src`` is not a member, or
        the lengths differ (on every rank, before the broadcast: the members compare
        their calls, docs/reliability.md).
    """
    op = "broadcast_object_list"
    g = member(group)
    if g is None:
        return None
    _check_list(object_list, op, "object_list")
    root = group_root(g, src, op, "src")
    launch(g, op, _bcast, (g, object_list, root), False, root=src, count=len(object_list))
    return None


def all_gather_object(object_list: list, obj: Any, group: Optional[ProcessGroup] = None) -> None:
    """Gather every member's picklable ``obj`` into ``object_list`` on every member.

    ``object_list`` must hold one item per group member; item i becomes group rank i's
    object (torch.distributed.all_gather_object). Non-members return None and keep
    their list. Unpickles every member's data: trust them.

    Raises:
        TypeError / ValueError: ``object_list`` is not a list of the group's size.
    """
    op = "all_gather_object"
    g = member(group)
    if g is None:
        return None
    _check_list(object_list, op, "object_list", g.size())
    launch(g, op, _allgather, (g, object_list, obj), False)
    return None


def gather_object(obj: Any, object_gather_list: Optional[list] = None, dst: int = 0,
                  group: Optional[ProcessGroup] = None) -> None:
    """Gather every member's picklable ``obj`` into ``object_gather_list`` on global rank ``dst``.

    On ``dst``, ``object_gather_list`` holds one item per group member and item i becomes
    group rank i's object; elsewhere it must be None (torch.distributed.gather_object).
    Non-members return None. ``dst`` unpickles every member's data: trust them.

    Raises:
        TypeError / ValueError: a bad list on ``dst``, a non-empty list elsewhere, or a
        ``dst`` that is not a member.
    """
    op = "gather_object"
    g = member(group)
    if g is None:
        return None
    root = group_root(g, dst, op, "dst")
    if g.rank() == root:
        _check_list(object_gather_list, op, "object_gather_list", g.size())
    elif object_gather_list:
        raise ValueError(f"{prefix(op)} object_gather_list must be None on ranks other than dst={dst}, "
                         f"got a list of {len(object_gather_list)} items")
    else:
        object_gather_list = None
    launch(g, op, _gather, (g, object_gather_list, obj, root), False, root=dst)
    return None


def scatter_object_list(scatter_object_output_list: list, scatter_object_input_list: Optional[list] = None,
                        src: int = 0, group: Optional[ProcessGroup] = None) -> None:
    """Send item i of ``scatter_object_input_list`` on global rank ``src`` to group rank i.

    Each member's object lands in ``scatter_object_output_list[0]`` (a list of at least
    one item; the rest are kept), as torch.distributed.scatter_object_list. On ``src``
    the input list holds one picklable object per group member; elsewhere it is ignored.
    Non-members return None. Unpickles ``src``'s data: trust it.

    Raises:
        TypeError / ValueError: an output list that is not a non-empty list, an input
        list on ``src`` that is not a list of the group's size, a ``src`` not a member.
    """
    op = "scatter_object_list"
    g = member(group)
    if g is None:
        return None
    _check_list(scatter_object_output_list, op, "scatter_object_output_list", at_least=1)
    root = group_root(g, src, op, "src")
    inputs = None
    if g.rank() == root:
        inputs = _check_list(scatter_object_input_list, op, "scatter_object_input_list", g.size())
    launch(g, op, _scatter, (g, scatter_object_output_list, inputs, root), False, root=src)
    return None


def send_object_list(object_list: list, dst: int, group: Optional[ProcessGroup] = None,
                     device: Any = None) -> None:
    """Send the picklable objects of ``object_list`` to global rank ``dst`` (blocking).

    The receiver's :func:`recv_object_list` needs a list of the same length. Travels on
    the group's communicator with the reserved tag MPI_TAG_UB, so it never matches an
    array ``recv``. ``device`` is ignored (host memory). Non-members return None.

    Raises:
        TypeError: ``object_list`` is not a list. ValueError: ``dst`` is not another
        member of the group. DistBackendError: MPI reported an error.
    """
    op = "send_object_list"
    g = member(group)
    if g is None:
        return None
    _check_list(object_list, op, "object_list")
    peer = peer_rank(g, dst, op, "dst")
    with p2p_call(g, op, None, None, int(dst)):
        pkl5.Intracomm(g.comm).send(object_list, peer, OBJECT_TAG)
    return None


def recv_object_list(object_list: list, src: Optional[int] = None, group: Optional[ProcessGroup] = None,
                     device: Any = None) -> int:
    """Receive a :func:`send_object_list` from global rank ``src`` (any source if None).

    ``object_list`` must have as many items as the sender's list; they are replaced in
    place. Returns the sender's global rank (-1 on a non-member, as torch). Unpickles the
    sender's data: trust it. ``device`` is ignored.

    Raises:
        TypeError: ``object_list`` is not a list. ValueError: ``src`` is not another
        member, or the sender's list has another length (the message is consumed).
    """
    op = "recv_object_list"
    g = member(group)
    if g is None:
        return -1
    _check_list(object_list, op, "object_list")
    peer = MPI.ANY_SOURCE if src is None else peer_rank(g, src, op, "src")
    status = MPI.Status()
    with p2p_call(g, op, None, None, -1 if src is None else int(src)):
        got = pkl5.Intracomm(g.comm).recv(None, peer, OBJECT_TAG, status)
    sender = g.ranks[status.Get_source()]
    _fill(object_list, got, op, sender)
    return sender
