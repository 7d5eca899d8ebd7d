"""The NCCL path for device arrays: every public op, on CuPy's NCCL bindings.

Entry point: :func:`run` ``(op, g, args)``, called by the public ops when a call's
arrays live on a GPU and the group's device backend is NCCL. ``args`` are the public
op's arguments by name (without ``group``: ``g`` is the resolved group, and the caller
is a member); src/dst/peer are global ranks. Sync ops return None (``recv``: the
sender's global rank, as the host ``recv``), ``async_op=True`` an
:class:`~mpidist.device._nccl_core.NcclWork`.

How each op maps onto NCCL (as torch's ProcessGroupNCCL does):

* all_reduce, broadcast, reduce, all_gather_into_tensor, reduce_scatter_tensor: the NCCL
  collective of the same name, in place where torch's is.
* all_gather: one ncclAllGather when the output arrays lie back to back in rank order
  and have equal sizes, else one grouped ncclBroadcast per rank (unequal sizes too).
* reduce_scatter: the inputs packed into one buffer (unless already back to back), then
  ncclReduceScatter.
* gather, scatter, all_to_all, all_to_all_single (split sizes too): ncclSend/ncclRecv
  grouped in one ncclGroupStart/ncclGroupEnd; a rank's own part is a device copy.
* send, recv, isend, irecv: ncclSend/ncclRecv on a 2-rank communicator per peer.
* batch_isend_irecv: every op in one NCCL group on the group's communicator (torch: if it
  is the group's first NCCL op, every member must call it).
* barrier: a 1-element all_reduce, then the host waits for it.
* the ``*_multigpu`` forms: one array per list (one GPU per process), else ValueError.

Reductions: SUM, PRODUCT, MAX, MIN, AVG (ncclAvg from NCCL 2.10, else SUM and a
division); ``make_premul_sum(factor)`` scales the input by the factor on the stream,
then SUMs; bool reduces as uint8 with SUM -> MAX and PRODUCT -> MIN, complex as pairs
of reals (SUM, AVG, PREMUL_SUM only); bitwise ops raise ValueError (NCCL has none).
See docs/nccl.md.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from mpidist import _recorder as R
from mpidist import _runtime
from mpidist.device import _nccl_shim
from mpidist.device._nccl_core import device_array, state
from mpidist.device._nccl_move import (
    all_gather, all_gather_into_tensor, all_to_all, all_to_all_single, gather, scatter,
)
from mpidist.device._nccl_reduce import all_reduce, barrier, broadcast, reduce, reduce_scatter, reduce_scatter_tensor
from mpidist.device._nccl_util import p2p_group_body, send_recv
from mpidist.device._nccl_work import NcclWork, launch
from mpidist.errors import prefix
from mpidist._group import ProcessGroup
from mpidist._reduce_op import ReduceOp
from mpidist._dispatch import check_tag, peer_rank
from mpidist._p2p_op import P2POp, is_receive

__all__ = ["run", "NcclWork", "OPS"]


# -- the seeds' multi-GPU forms: one array per list ---------------------------------------------------

def _one(xs: Any, name: str, arg: str, index_arg: str = "", index: Any = 0) -> Any:
    """The only element of a ``*_multigpu`` list: one process drives one GPU on this path.
    ``index_arg``: the op's index into the list (``index``, its value), an int and 0."""
    if not isinstance(xs, (list, tuple)):
        raise TypeError(f"{prefix(name)} {arg} must be a list of device arrays, got {type(xs).__name__}")
    if len(xs) != 1:
        raise ValueError(f"{prefix(name)} {arg} must hold exactly one array on the NCCL path (one GPU per "
                         f"process; torch removed the multi-GPU forms), got {len(xs)}")
    if not isinstance(index, (int, np.integer)) or isinstance(index, bool):
        raise TypeError(f"{prefix(name)} {index_arg} must be an int, got {type(index).__name__}")
    if index != 0:
        raise ValueError(f"{prefix(name)} {index_arg}={index} is out of range: the NCCL path takes one array per "
                         f"list, so {index_arg} must be 0")
    return xs[0]


# -- point-to-point -----------------------------------------------------------------------------------

def _p2p(g: ProcessGroup, name: str, tensor: Any, peer: Any, tag: Any, receive: bool, async_op: bool,
         arg: str) -> Optional[NcclWork]:
    """One ncclSend/ncclRecv on the 2-rank communicator with ``peer`` (a global rank)."""
    shim = _nccl_shim.get()
    d = device_array(tensor, name, "tensor", receive, shim)
    check_tag(tag, name)
    if receive and peer is None:
        raise ValueError(f"{prefix(name)} {arg}=None (any source) is not supported by NCCL; pass the "
                         f"sender's global rank")
    other = peer_rank(g, peer, name, arg)
    comm = state(g).pair(name, other, [d], ["tensor"])
    rec = R.begin_p2p(g, name, d.shape, d.dtype, int(peer))
    side = 1 - comm.rank
    handle = (name, (tensor,) if receive else (), [rec], int(peer) if receive else None)
    works = launch(comm, g, name, send_recv, (d, side, receive), (tensor,), async_op, [handle], devs=[d])
    return works[0] if works else None


def send(g: ProcessGroup, tensor: Any, dst: int, tag: int = 0) -> None:
    """ncclSend of ``tensor`` to global rank ``dst``, ordered on the caller's stream (the host
    does not wait, as torch). ``tag`` is checked and otherwise ignored: NCCL has no tags."""
    _p2p(g, "send", tensor, dst, tag, False, False, "dst")


def recv(g: ProcessGroup, tensor: Any, src: Optional[int] = None, tag: int = 0) -> int:
    """ncclRecv into ``tensor`` from global rank ``src`` (required: NCCL has no any-source
    receive); returns ``src``."""
    _p2p(g, "recv", tensor, src, tag, True, False, "src")
    return int(src)  # type: ignore[arg-type]  (checked by _p2p)


def isend(g: ProcessGroup, tensor: Any, dst: int, tag: int = 0) -> NcclWork:
    """Async :func:`send`: returns its NcclWork."""
    return _p2p(g, "isend", tensor, dst, tag, False, True, "dst")


def irecv(g: ProcessGroup, tensor: Any, src: Optional[int] = None, tag: int = 0) -> NcclWork:
    """Async :func:`recv`: returns its NcclWork (``source_rank()`` is ``src``)."""
    return _p2p(g, "irecv", tensor, src, tag, True, True, "src")


def batch_isend_irecv(g: ProcessGroup, p2p_op_list: Any) -> list:
    """Every op of ``p2p_op_list`` in one NCCL group on ``g``'s communicator; one NcclWork per
    op, in order (they complete together). Every op must use group ``g``; if this is the
    group's first NCCL collective, every member must call it (torch's rule)."""
    name = "batch_isend_irecv"
    shim = _nccl_shim.get()
    if not isinstance(p2p_op_list, (list, tuple)) or not p2p_op_list:
        raise ValueError(f"{prefix(name)} p2p_op_list must be a non-empty list of P2POp, got {p2p_op_list!r:.80}")
    for i, p in enumerate(p2p_op_list):
        if not isinstance(p, P2POp):
            raise ValueError(f"{prefix(name)} p2p_op_list[{i}] must be a P2POp, got {type(p).__name__}")
        if _runtime.resolve_group(p.group) is not g:
            raise ValueError(f"{prefix(name)} p2p_op_list[{i}] is on another group than the batch's first op; "
                             f"the NCCL path batches the ops of one group")
    plan = []
    for i, p in enumerate(p2p_op_list):
        receive = is_receive(p)
        where = f"p2p_op_list[{i}]."
        d = device_array(p.tensor, name, f"{where}tensor", receive, shim)
        check_tag(p.tag, name, f"{where}tag")
        if p.peer is None:
            raise ValueError(f"{prefix(name)} {where}peer=None (any source) is not supported by NCCL; pass the "
                             f"sender's global rank")
        plan.append((receive, peer_rank(g, p.peer, name, f"{where}peer"), d, p))
    devs = [d for _, _, d, _ in plan]
    comm = state(g).collective(name, devs, [f"p2p_op_list[{i}].tensor" for i in range(len(plan))])
    recs = [R.begin_p2p(g, "irecv" if rcv else "isend", d.shape, d.dtype, int(p.peer)) for rcv, _, d, p in plan]
    sends = [(peer, d) for rcv, peer, d, _ in plan if not rcv]
    recvs = [(peer, d) for rcv, peer, d, _ in plan if rcv]
    handles = [("irecv", (p.tensor,), [rec], int(p.peer)) if rcv else ("isend", (), [rec], None)
               for (rcv, _, _, p), rec in zip(plan, recs)]
    return launch(comm, g, name, p2p_group_body, (sends, recvs), tuple(p.tensor for p in p2p_op_list), True,
                  handles, devs=devs)


def all_reduce_multigpu(g: ProcessGroup, tensor_list: Any, op: Any = ReduceOp.SUM,
                        async_op: bool = False) -> Optional[NcclWork]:
    name = "all_reduce_multigpu"
    return all_reduce(g, _one(tensor_list, name, "tensor_list"), op, async_op, name=name)


def reduce_multigpu(g: ProcessGroup, tensor_list: Any, dst: int, op: Any = ReduceOp.SUM, async_op: bool = False,
                    dst_tensor: int = 0) -> Optional[NcclWork]:
    name = "reduce_multigpu"
    return reduce(g, _one(tensor_list, name, "tensor_list", "dst_tensor", dst_tensor), dst, op, async_op, name=name)


def broadcast_multigpu(g: ProcessGroup, tensor_list: Any, src: int, async_op: bool = False,
                       src_tensor: int = 0) -> Optional[NcclWork]:
    name = "broadcast_multigpu"
    return broadcast(g, _one(tensor_list, name, "tensor_list", "src_tensor", src_tensor), src, async_op, name=name)


def all_gather_multigpu(g: ProcessGroup, output_tensor_lists: Any, input_tensor_list: Any,
                        async_op: bool = False) -> Optional[NcclWork]:
    name = "all_gather_multigpu"
    tensor = _one(input_tensor_list, name, "input_tensor_list")
    outs = _one(output_tensor_lists, name, "output_tensor_lists")
    return all_gather(g, outs, tensor, async_op)


#: Public op name -> its NCCL implementation (same arguments, ``group`` replaced by ``g``).
OPS = {f.__name__: f for f in (
    all_reduce, broadcast, reduce, barrier, all_gather, all_gather_into_tensor, gather, scatter, all_to_all,
    all_to_all_single, reduce_scatter, reduce_scatter_tensor, send, recv, isend, irecv, batch_isend_irecv,
    all_reduce_multigpu, reduce_multigpu, broadcast_multigpu, all_gather_multigpu,
)}


def run(op: str, g: ProcessGroup, args: dict) -> Any:
    """Run public op ``op`` on group ``g`` (the caller is a member) through NCCL.

    ``args``: the public op's arguments by name, without ``group``. Returns what the
    public op returns: None for sync ops, an NcclWork for ``async_op=True`` and
    isend/irecv, a list of them for batch_isend_irecv, the sender's rank for recv.

    Raises:
        ValueError: ``op`` has no NCCL implementation; otherwise what the op raises
        (TypeError/ValueError for bad arguments, DistBackendError for NCCL failures).
    """
    fn = OPS.get(op)
    if fn is None:
        raise ValueError(f"{prefix(op)} has no NCCL implementation; expected one of {sorted(OPS)}")
    return fn(g, **args)

