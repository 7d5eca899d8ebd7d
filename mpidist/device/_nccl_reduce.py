"""NCCL reductions and broadcast: all_reduce, broadcast, reduce, barrier, reduce_scatter,
reduce_scatter_tensor (see :mod:`mpidist.device.nccl` for the mapping onto NCCL)."""
from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from mpidist._dispatch import group_root
from mpidist.device import _nccl_shim
from mpidist.device._nccl_core import Dev, NcclComm, Plan, device_array, mover, overlaps, reduction, state
from mpidist.device._nccl_util import (
    arrays, back_to_back, collective, divide, holds, new_buffer, pair, rows, scale, scaled_input, version,
)
from mpidist.device._nccl_work import NcclWork
from mpidist.errors import prefix
from mpidist._group import ProcessGroup
from mpidist._reduce_op import ReduceOp

__all__ = ["all_reduce", "broadcast", "reduce", "barrier", "reduce_scatter", "reduce_scatter_tensor"]


# -- all_reduce, broadcast, reduce, barrier -------------------------------------------------------

def _all_reduce_body(comm: NcclComm, t: Dev, plan: Plan) -> None:
    if plan.premul is not None:
        scale(comm, t, t.ptr, plan)
    comm.nccl.allReduce(t.ptr, t.ptr, t.size * plan.mult, plan.type, plan.op, comm.stream.ptr)
    if plan.divide:
        divide(comm, t, comm.size)


def all_reduce(g: ProcessGroup, tensor: Any, op: Any = ReduceOp.SUM, async_op: bool = False,
               algorithm: Optional[str] = None, *, name: str = "all_reduce") -> Optional[NcclWork]:
    """ncclAllReduce in place on ``tensor`` (writable, C-contiguous; same shape and dtype on
    every member); every member's ``tensor`` gets the result."""
    if algorithm is not None:
        raise ValueError(f"{prefix(name)} algorithm={algorithm!r} selects a host algorithm; the NCCL path "
                         f"takes algorithm=None")
    shim = _nccl_shim.get()
    t = device_array(tensor, name, "tensor", True, shim)
    plan = reduction(op, t.dtype, name, version(shim))
    return collective(g, name, [t], ["tensor"], _all_reduce_body, (t, plan), (tensor,), (tensor,), async_op,
                       t.shape)


def broadcast(g: ProcessGroup, tensor: Any, src: int, async_op: bool = False, *,
              name: str = "broadcast") -> Optional[NcclWork]:
    """ncclBroadcast of global rank ``src``'s ``tensor`` into every member's ``tensor``."""
    shim = _nccl_shim.get()
    root = group_root(g, src, name, "src")
    t = device_array(tensor, name, "tensor", True, shim)
    kind, mult = mover(t.dtype)

    def body(comm: NcclComm) -> None:
        comm.nccl.broadcast(t.ptr, t.ptr, t.size * mult, kind, root, comm.stream.ptr)
    return collective(g, name, [t], ["tensor"], body, (), (tensor,), (tensor,), async_op, t.shape, src)


def _reduce_body(comm: NcclComm, t: Dev, plan: Plan, root: int) -> Any:
    own = comm.rank == root
    temp, send = (None, t.ptr) if own else scaled_input(comm, t, plan)
    if own and plan.premul is not None:
        scale(comm, t, t.ptr, plan)
    comm.nccl.reduce(send, t.ptr if own else send, t.size * plan.mult, plan.type, plan.op, root, comm.stream.ptr)
    if own and plan.divide:
        divide(comm, t, comm.size)
    return temp


def reduce(g: ProcessGroup, tensor: Any, dst: int, op: Any = ReduceOp.SUM, async_op: bool = False, *,
           name: str = "reduce") -> Optional[NcclWork]:
    """ncclReduce into global rank ``dst``'s ``tensor``; the others' are left unchanged."""
    shim = _nccl_shim.get()
    root = group_root(g, dst, name, "dst")
    t = device_array(tensor, name, "tensor", g.rank() == root, shim)
    plan = reduction(op, t.dtype, name, version(shim))
    return collective(g, name, [t], ["tensor"], _reduce_body, (t, plan, root), (tensor,), (tensor,), async_op,
                       t.shape, dst)


def _barrier_body(comm: NcclComm) -> None:
    if comm.scratch is None:
        comm.scratch = new_buffer(comm, 1, np.dtype(np.uint8))
    ptr = comm.scratch[1]
    comm.nccl.allReduce(ptr, ptr, 1, mover(np.dtype(np.uint8))[0], 0, comm.stream.ptr)


def barrier(g: ProcessGroup, async_op: bool = False, device_ids: Optional[list] = None) -> Optional[NcclWork]:
    """A 1-element ncclAllReduce, then the host waits for it (its Work's ``wait()`` too).

    ``device_ids``: None, or a list of one int, the device to use if the group has no
    NCCL communicator yet (default: the current device).
    """
    name = "barrier"
    st = state(g)
    if device_ids is None:
        device = st.device if st.device is not None else _nccl_shim.get().current_device()
    elif (not isinstance(device_ids, (list, tuple)) or len(device_ids) != 1
            or not isinstance(device_ids[0], (int, np.integer)) or isinstance(device_ids[0], bool)):
        raise ValueError(f"{prefix(name)} device_ids must be None or a list of one int (this process's "
                         f"GPU) on the NCCL path, got {device_ids!r}")
    else:
        device = int(device_ids[0])
    return collective(g, name, [], [], _barrier_body, (), (), (), async_op, None, device=device, host_wait=True)


# -- reduce_scatter ----------------------------------------------------------------------------------

def _reduce_scatter_body(comm: NcclComm, out: Dev, send: Optional[Dev], parts: Sequence[Dev], plan: Plan) -> Any:
    """ncclReduceScatter from ``send`` (W * out.size elements), or from ``parts`` packed (and
    scaled, for PREMUL_SUM) into a new buffer when ``send`` is None."""
    temp, ptr = None, send.ptr if send is not None else 0
    if send is None:
        temp, ptr = new_buffer(comm, out.size * len(parts), out.dtype)
        for i, p in enumerate(parts):
            slot = ptr + i * out.nbytes
            if plan.premul is not None:
                scale(comm, p, slot, plan)
            else:
                comm.shim.copy(slot, p.ptr, p.nbytes, comm.stream)
    comm.nccl.reduceScatter(ptr, out.ptr, out.size * plan.mult, plan.type, plan.op, comm.stream.ptr)
    if plan.divide:
        divide(comm, out, comm.size)
    return temp


def reduce_scatter_tensor(g: ProcessGroup, output: Any, input: Any, op: Any = ReduceOp.SUM,  # noqa: A002
                          async_op: bool = False) -> Optional[NcclWork]:
    """ncclReduceScatter: block r of ``input`` (``W * output.size`` elements), reduced over
    the members, into group rank r's ``output``. In place when ``output`` is this rank's block."""
    name = "reduce_scatter_tensor"
    shim, out, inp = pair(name, output, input)
    n = g.size()
    holds(name, inp, "input", out, "output", n)
    plan = reduction(op, out.dtype, name, version(shim))
    in_place = out.ptr == inp.ptr + g.rank() * out.nbytes
    direct = plan.premul is None and (in_place or not overlaps(out, inp))
    parts = rows(Dev(None, inp.ptr, (n, out.size), inp.dtype, inp.device), [1] * n)
    return collective(g, name, [out, inp], ["output", "input"], _reduce_scatter_body,
                       (out, inp if direct else None, parts, plan), (output, input), (output,), async_op, inp.shape)


def reduce_scatter(g: ProcessGroup, output: Any, input_list: Any, op: Any = ReduceOp.SUM,
                   async_op: bool = False) -> Optional[NcclWork]:
    """``input_list[r]`` reduced over the members into group rank r's ``output`` (the
    inputs are packed into one buffer unless they already lie back to back)."""
    name = "reduce_scatter"
    shim = _nccl_shim.get()
    out = device_array(output, name, "output", True, shim)
    n = g.size()
    ins = arrays(input_list, name, "input_list", n, False, shim, out, "output", per_rank=True)
    for i, d in enumerate(ins):
        if d.shape != out.shape:
            raise ValueError(f"{prefix(name)} input_list[{i}] has shape {d.shape}, expected the shape of output "
                             f"{out.shape}")
    plan = reduction(op, out.dtype, name, version(shim))
    direct = plan.premul is None and back_to_back(ins) and not any(overlaps(out, d) for d in ins)
    return collective(g, name, [out, *ins], ["output"] + [f"input_list[{i}]" for i in range(n)],
                       _reduce_scatter_body, (out, ins[0] if direct else None, ins, plan),
                       (output, tuple(input_list)), (output,), async_op, out.shape)
