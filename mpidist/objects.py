"""Object collectives and object point-to-point: picklable Python objects between ranks.

Same names, arguments and semantics as torch.distributed's ``broadcast_object_list``,
``all_gather_object``, ``gather_object``, ``scatter_object_list``, ``send_object_list``
and ``recv_object_list``; output lists are filled in place.

.. warning::
   Objects are pickled. Unpickling data runs arbitrary code chosen by whoever produced
   it, so call these functions only with peers you trust, exactly as torch warns.

Transport: :mod:`mpi4py.util.pkl5` on the group's communicator (numpy buffers out of
band, messages over 2 GiB). Each rank pickles before the step communicates and sends an
envelope, the pickle or the pickling error, so a failed step fails alike on every rank
(docs/reliability.md, section 9). Collectives run in the group's op order; pkl5's
gather/scatter/allgather use a private duplicate of the group's communicator. Object p2p
uses the reserved tag MPI_TAG_UB (:data:`mpidist._core.tags.OBJECT_TAG`), which array p2p
never accepts: a duplicate communicator is not possible there (MPI_Comm_dup is collective).
"""

from __future__ import annotations

import pickle
from typing import Any, NoReturn, Optional, cast

import numpy as np
from mpi4py import MPI
from mpi4py.util import pkl5

from mpidist._core.group import ProcessGroup
from mpidist._core.tags import OBJECT_TAG
from mpidist._dispatch.dispatch import launch, member, p2p_call, peer_rank, root_rank, unusable
from mpidist.errors import prefix

__all__ = [
    "broadcast_object_list",
    "all_gather_object",
    "gather_object",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
]


def _check_list(obj: Any, op: str, arg: str, size: Optional[int] = None, at_least: int = 0) -> list[Any]:
    """``obj`` must be a list, of exactly ``size`` items if given, else of at least ``at_least``."""
    if not isinstance(obj, list):
        raise TypeError(f"{prefix(op)} {arg} must be a list, got {type(obj).__name__}")
    if size is not None and len(obj) != size:
        raise ValueError(f"{prefix(op)} {arg} must have one item per group member ({size}), got {len(obj)}")
    if len(obj) < at_least:
        raise ValueError(f"{prefix(op)} {arg} must hold at least {at_least} item, got an empty list")
    return obj


def _fill(object_list: list[Any], got: list[Any], op: str, sender: int) -> None:
    """Copy a received list into ``object_list`` in place; the lengths must match."""
    if len(got) != len(object_list):
        raise ValueError(
            f"{prefix(op)} received {len(got)} objects from rank {sender}, expected "
            f"len(object_list) = {len(object_list)}; every rank must pass a list of "
            f"the same length"
        )
    object_list[:] = got


# -- envelopes (docs/reliability.md, section 9) -------------------------------------------------
# An envelope is ``(pickle, *buffers)`` (protocol 5; pkl5 sends buffers out of band from
# 256 KiB up), or a str: the pickling failure, for every receiver to raise.


class _Unusable(Exception):
    """A received envelope that cannot become an object: its text (no prefix), its cause."""


def _pack(obj: Any, rank: int, what: str) -> tuple[Any, Optional[BaseException]]:
    """``(envelope, None)``, or ``(failure text, exception)`` when ``obj`` cannot be pickled."""
    bufs: list[pickle.PickleBuffer] = []
    try:
        data = pickle.dumps(obj, protocol=5, buffer_callback=bufs.append)
    except Exception as exc:  # noqa: BLE001  (anything __reduce__ raises: reported to every rank)
        return f"rank {rank} could not pickle its {what}: {type(exc).__name__}: {exc}", exc
    return (pickle.PickleBuffer(data), *bufs), None


def _unpack(envelope: Any, what: str, sender: int, reader: int) -> Any:
    """The object in ``envelope`` (from global rank ``sender``); raises :class:`_Unusable`
    with the sender's pickling failure, or with this rank's unpickling failure."""
    if type(envelope) is str:
        raise _Unusable(envelope)
    try:
        return pickle.loads(envelope[0], buffers=envelope[1:])
    except Exception as exc:  # noqa: BLE001  (a class missing here, a failing __setstate__, ...)
        raise _Unusable(
            f"rank {reader} could not unpickle the {what} of rank {sender}: {type(exc).__name__}: {exc}"
        ) from exc


def _fail(op: str, text: str, cause: Optional[BaseException]) -> NoReturn:
    """Raise the TypeError every rank of a failed object op raises (``cause`` chained)."""
    raise TypeError(f"{prefix(op)} {text}") from cause


def _received(
    op: str, envelope: Any, what: str, sender: int, reader: int, cause: Optional[BaseException] = None
) -> Any:
    """:func:`_unpack`, or the op's TypeError (:func:`_fail`; ``cause``, else the unpickling
    error, chained) when the envelope cannot become an object."""
    try:
        return _unpack(envelope, what, sender, reader)
    except _Unusable as bad:
        _fail(op, str(bad), cause or bad.__cause__)


def _failures(envelopes: list[Any]) -> str:
    """The failure texts among ``envelopes`` (in group-rank order, joined), or ""."""
    return "; ".join(e for e in envelopes if type(e) is str)


def _bcast_text(comm: MPI.Intracomm, text: str, root: int) -> str:
    """``text`` from group rank ``root``, on every rank: one 8-byte MPI_Bcast when it is empty."""
    data = text.encode()
    size = np.array([len(data)], dtype=np.int64)
    comm.Bcast([size, MPI.INT64_T], root)
    if size[0] == 0:
        return ""
    buf = bytearray(data) if comm.Get_rank() == root else bytearray(int(size[0]))
    comm.Bcast([buf, MPI.BYTE], root)
    return buf.decode()


def _bcast(g: ProcessGroup, object_list: list[Any], root: int) -> None:
    op = "broadcast_object_list"
    comm = pkl5.Intracomm(g.comm)
    src = g.ranks[root]
    if g.rank() == root:
        envelope, exc = _pack(object_list, src, "object_list")
        comm.bcast(envelope, root)
        if exc is not None:
            _fail(op, envelope, exc)
        return
    _fill(object_list, _received(op, comm.bcast(None, root), "object_list", src, g.ranks[g.rank()]), op, src)


def _allgather(g: ProcessGroup, object_list: list[Any], obj: Any) -> None:
    op = "all_gather_object"
    me = g.ranks[g.rank()]
    envelope, exc = _pack(obj, me, "obj")
    envelopes = pkl5.Intracomm(g.comm).allgather(envelope)
    failed = _failures(envelopes)
    if failed:  # every rank got every envelope: each raises the same error
        _fail(op, failed, exc)
    object_list[:] = [_received(op, e, "obj", g.ranks[i], me) for i, e in enumerate(envelopes)]


def _gather(g: ProcessGroup, object_gather_list: Optional[list[Any]], obj: Any, root: int) -> None:
    op = "gather_object"
    me = g.ranks[g.rank()]
    envelope, cause = _pack(obj, me, "obj")
    envelopes = pkl5.Intracomm(g.comm).gather(envelope, root)
    failed, got = "", None
    if envelopes is not None:  # dst: it alone knows whether the step worked
        failed = _failures(envelopes)
        if not failed:
            try:
                got = [_unpack(e, "obj", g.ranks[i], me) for i, e in enumerate(envelopes)]
            except _Unusable as bad:
                failed, cause = str(bad), bad.__cause__
    # dst tells every rank: each raises the same error (g.comm: a member's, an intracommunicator)
    failed = _bcast_text(cast(MPI.Intracomm, g.comm), failed, root)
    if failed:
        _fail(op, failed, cause)
    if object_gather_list is not None:
        object_gather_list[:] = cast("list[Any]", got)  # (dst, where nothing failed: got is its list)


def _scatter(g: ProcessGroup, output: list[Any], inputs: Optional[list[Any]], root: int) -> None:
    op = "scatter_object_list"
    me = g.ranks[g.rank()]
    envelopes, exc = None, None
    if inputs is not None:  # src: pickle every item before sending any
        envelopes = []
        for i, item in enumerate(inputs):
            envelope, exc = _pack(item, me, f"scatter_object_input_list[{i}]")
            if exc is not None:
                envelopes = [envelope] * len(inputs)  # every rank gets the failure
                break
            envelopes.append(envelope)
    output[0] = _received(
        op, pkl5.Intracomm(g.comm).scatter(envelopes, root), "scatter_object_input_list item", g.ranks[root], me, exc
    )


def broadcast_object_list(
    object_list: list[Any],
    src: Optional[int] = None,
    group: Optional[ProcessGroup] = None,
    device: Any = None,
    group_src: Optional[int] = None,
) -> None:
    """Broadcast the picklable objects of ``object_list`` from global rank ``src``.

    Every member passes a list of the same length; on ranks other than ``src`` its items
    are replaced in place by ``src``'s (torch.distributed.broadcast_object_list).
    ``device`` is accepted for torch compatibility and ignored: objects travel through
    host memory. Non-members return None and keep their list. Unpickles ``src``'s data:
    trust it. ``group_src`` names the source by its rank in ``group`` instead (torch
    2.4+); at most one of the two; neither: global rank 0.

    Raises:
        TypeError: ``object_list`` is not a list; on every member: ``src`` could not
            pickle its list; on a rank that cannot unpickle it: that failure (module doc).
        ValueError: ``src`` is not a member, both ``src`` and ``group_src`` given, or the
            lengths differ (on every rank, before the broadcast: the members compare
            their calls, docs/reliability.md).
    """
    op = "broadcast_object_list"
    g = member(group)
    if g is None:
        return None
    _check_list(object_list, op, "object_list")
    root = root_rank(g, src, group_src, op, "src", "group_src", default=0)
    launch(g, op, _bcast, (g, object_list, root), False, root=g.ranks[root], count=len(object_list))
    return None


def all_gather_object(object_list: list[Any], obj: Any, group: Optional[ProcessGroup] = None) -> None:
    """Gather every member's picklable ``obj`` into ``object_list`` on every member.

    ``object_list`` must hold one item per group member; item i becomes group rank i's
    object (torch.distributed.all_gather_object). Non-members return None and keep
    their list. Unpickles every member's data: trust them.

    Raises:
        TypeError / ValueError: ``object_list`` is not a list of the group's size.
        TypeError: on every member if a member could not pickle its ``obj`` (the message
            names each such rank); on a rank that cannot unpickle an object, there only.
    """
    op = "all_gather_object"
    g = member(group)
    if g is None:
        return None
    _check_list(object_list, op, "object_list", g.size())
    launch(g, op, _allgather, (g, object_list, obj), False)
    return None


def gather_object(
    obj: Any,
    object_gather_list: Optional[list[Any]] = None,
    dst: Optional[int] = None,
    group: Optional[ProcessGroup] = None,
    group_dst: Optional[int] = None,
) -> None:
    """Gather every member's picklable ``obj`` into ``object_gather_list`` on global rank ``dst``.

    On ``dst``, ``object_gather_list`` holds one item per group member and item i becomes
    group rank i's object; elsewhere it must be None (torch.distributed.gather_object).
    Non-members return None. ``dst`` unpickles every member's data: trust them.
    ``group_dst`` names the destination by its rank in ``group`` instead (torch 2.4+); at
    most one of the two; neither: global rank 0.

    Raises:
        TypeError / ValueError: a bad list on ``dst``, a non-empty list elsewhere, a
            ``dst`` that is not a member, both ``dst`` and ``group_dst``.
        TypeError: on every member if a member could not pickle its ``obj``, or ``dst``
            could not unpickle one (module doc).
    """
    op = "gather_object"
    g = member(group)
    if g is None:
        return None
    root = root_rank(g, dst, group_dst, op, "dst", "group_dst", default=0)
    dst = g.ranks[root]
    if g.rank() == root:
        _check_list(object_gather_list, op, "object_gather_list", g.size())
    elif object_gather_list:
        raise ValueError(
            f"{prefix(op)} object_gather_list must be None on ranks other than dst={dst}, "
            f"got a list of {len(object_gather_list)} items"
        )
    else:
        object_gather_list = None
    launch(g, op, _gather, (g, object_gather_list, obj, root), False, root=dst)
    return None


def scatter_object_list(
    scatter_object_output_list: list[Any],
    scatter_object_input_list: Optional[list[Any]] = None,
    src: Optional[int] = None,
    group: Optional[ProcessGroup] = None,
    group_src: Optional[int] = None,
) -> None:
    """Send item i of ``scatter_object_input_list`` on global rank ``src`` to group rank i.

    Each member's object lands in ``scatter_object_output_list[0]`` (a list of at least
    one item; the rest are kept), as torch.distributed.scatter_object_list. On ``src``
    the input list holds one picklable object per group member; elsewhere it is ignored.
    Non-members return None. Unpickles ``src``'s data: trust it. ``group_src`` names
    the source by its rank in ``group`` instead (torch 2.4+); at most one of the two;
    neither: global rank 0.

    Raises:
        TypeError / ValueError: an output list that is not a non-empty list, an input
            list on ``src`` that is not a list of the group's size, a ``src`` not a
            member, both ``src`` and ``group_src``.
        TypeError: on every member if ``src`` could not pickle an item (no item is
            sent); on a rank that cannot unpickle its item, there only.
    """
    op = "scatter_object_list"
    g = member(group)
    if g is None:
        return None
    _check_list(scatter_object_output_list, op, "scatter_object_output_list", at_least=1)
    root = root_rank(g, src, group_src, op, "src", "group_src", default=0)
    inputs = None
    if g.rank() == root:
        inputs = _check_list(scatter_object_input_list, op, "scatter_object_input_list", g.size())
    launch(g, op, _scatter, (g, scatter_object_output_list, inputs, root), False, root=g.ranks[root])
    return None


def send_object_list(
    object_list: list[Any],
    dst: Optional[int] = None,
    group: Optional[ProcessGroup] = None,
    device: Any = None,
    group_dst: Optional[int] = None,
    use_batch: bool = False,
) -> None:
    """Send the picklable objects of ``object_list`` to global rank ``dst`` (blocking).

    The receiver's :func:`recv_object_list` needs a list of the same length. Tag
    MPI_TAG_UB: never matches an array ``recv``. ``device`` is ignored. Non-members return None.
    ``group_dst`` names the destination by its rank in ``group`` instead (torch 2.4+);
    exactly one of the two. ``use_batch`` (torch: send through batch_isend_irecv) is
    accepted and changes nothing: one pickled message either way.

    Raises:
        TypeError: ``object_list`` is not a list; ``object_list`` could not be pickled
            (the receiver is sent the error and raises it too, so it never waits).
        ValueError: ``dst`` is not another member of the group; both or neither of
            ``dst``/``group_dst``.
        DistBackendError: MPI reported an error.
    """
    op = "send_object_list"
    g = member(group)
    if g is None:
        return None
    _check_list(object_list, op, "object_list")
    peer = peer_rank(g, dst, op, "dst", group_dst)
    if g.engine.aborted:
        raise unusable(g, op)
    envelope, exc = _pack(object_list, g.ranks[g.rank()], "object_list")
    with p2p_call(g, op, None, None, g.ranks[peer]):
        pkl5.Intracomm(g.comm).send(envelope, peer, OBJECT_TAG)
    if exc is not None:  # the receiver got the failure and raises it too
        _fail(op, envelope, exc)
    return None


def recv_object_list(
    object_list: list[Any],
    src: Optional[int] = None,
    group: Optional[ProcessGroup] = None,
    device: Any = None,
    group_src: Optional[int] = None,
    use_batch: bool = False,
) -> int:
    """Receive a :func:`send_object_list` from global rank ``src``.

    ``group_src`` names the source by its rank in ``group`` instead (torch 2.4+); at
    most one of the two; neither: any source (an mpidist extension: torch 2.13 requires
    one). ``object_list`` must have as many items as the sender's list; they are
    replaced in place. Returns the sender's global rank (-1 on a non-member, as torch).
    Unpickles the sender's data: trust it. ``device`` and ``use_batch`` are ignored.

    Raises:
        TypeError: ``object_list`` is not a list; the sender could not pickle its list,
            or this rank cannot unpickle it (the message is consumed).
        ValueError: ``src`` is not another member, both ``src`` and ``group_src`` given,
            or the sender's list has another length (the message is consumed).
    """
    op = "recv_object_list"
    g = member(group)
    if g is None:
        return -1
    _check_list(object_list, op, "object_list")
    anyone = src is None and group_src is None
    peer = MPI.ANY_SOURCE if anyone else peer_rank(g, src, op, "src", group_src)
    if g.engine.aborted:
        raise unusable(g, op)
    status = MPI.Status()
    with p2p_call(g, op, None, None, -1 if anyone else g.ranks[peer]):
        envelope = pkl5.Intracomm(g.comm).recv(None, peer, OBJECT_TAG, status)
    sender = g.ranks[status.Get_source()]
    _fill(object_list, _received(op, envelope, "object_list", sender, g.ranks[g.rank()]), op, sender)
    return sender
