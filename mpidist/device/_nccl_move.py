"""NCCL data movement: all_gather, all_gather_into_tensor, gather, scatter, all_to_all,
all_to_all_single (see :mod:`mpidist.device.nccl` for the mapping onto NCCL)."""
from __future__ import annotations

from typing import Any, Optional, Sequence

from mpidist._buffers import split_sizes
from mpidist._dispatch import group_root, root_list
from mpidist.device import _nccl_shim
from mpidist.device._nccl_core import Dev, NcclComm, device_array, mover, overlaps
from mpidist.device._nccl_util import (
    Group, arrays, back_to_back, collective, copy_of, holds, new_buffer, p2p_group_body, pair, rows, same_shape,
)
from mpidist.device._nccl_work import NcclWork
from mpidist.errors import prefix
from mpidist._group import ProcessGroup

__all__ = ["all_gather", "all_gather_into_tensor", "gather", "scatter", "all_to_all", "all_to_all_single"]


# -- gathers --------------------------------------------------------------------------------------

def all_gather_into_tensor(g: ProcessGroup, output_tensor: Any, input_tensor: Any,
                           async_op: bool = False) -> Optional[NcclWork]:
    """ncclAllGather of every member's ``input_tensor`` into ``output_tensor`` (group-rank
    order; ``W * input.size`` elements). In place when ``input_tensor`` is this rank's slot."""
    name = "all_gather_into_tensor"
    _, out, inp = pair(name, output_tensor, input_tensor, "output_tensor", "input_tensor")
    holds(name, out, "output_tensor", inp, "input_tensor", g.size())
    return collective(g, name, [out, inp], ["output_tensor", "input_tensor"], _all_gather_body, (inp, out.ptr),
                       (output_tensor, input_tensor), (output_tensor,), async_op, inp.shape)


def _all_gather_body(comm: NcclComm, inp: Dev, out_ptr: int) -> Any:
    """ncclAllGather of ``inp`` into the block at ``out_ptr`` (W * inp.nbytes bytes)."""
    kind, mult = mover(inp.dtype)
    temp, send = None, inp.ptr
    own = out_ptr + comm.rank * inp.nbytes
    block = Dev(None, out_ptr, (comm.size * inp.size,), inp.dtype, comm.device)
    if send != own and overlaps(inp, block):  # NCCL's in-place form is the own slot only
        temp, send = copy_of(comm, inp)
    comm.nccl.allGather(send, out_ptr, inp.size * mult, kind, comm.stream.ptr)
    return temp


def _broadcasts_body(comm: NcclComm, inp: Dev, outs: Sequence[Dev]) -> Any:
    """all_gather as one NCCL group of broadcasts, one per rank, each into its own output."""
    kind, mult = mover(inp.dtype)
    temp, send = None, inp.ptr
    if any(overlaps(inp, o) for r, o in enumerate(outs) if r != comm.rank):
        temp, send = copy_of(comm, inp)
    with Group(comm.shim):
        for r, o in enumerate(outs):
            comm.nccl.broadcast(send if r == comm.rank else o.ptr, o.ptr, o.size * mult, kind, r, comm.stream.ptr)
    return temp


def all_gather(g: ProcessGroup, tensor_list: Any, tensor: Any, async_op: bool = False) -> Optional[NcclWork]:
    """Every member's ``tensor`` into ``tensor_list[group rank]`` on every member."""
    name = "all_gather"
    shim = _nccl_shim.get()
    inp = device_array(tensor, name, "tensor", False, shim)
    outs = arrays(tensor_list, name, "tensor_list", g.size(), True, shim, inp, "tensor")
    me = g.rank()
    same_shape(outs[me], inp, name, f"tensor_list[{me}]", "tensor", " (it receives this rank's own tensor)")
    if back_to_back(outs) and all(o.size == inp.size for o in outs):
        body, bargs = _all_gather_body, (inp, outs[0].ptr)
    else:
        body, bargs = _broadcasts_body, (inp, outs)
    return collective(g, name, [inp, *outs], ["tensor"] + [f"tensor_list[{i}]" for i in range(len(outs))], body,
                       bargs, (tensor, tuple(tensor_list)), tuple(tensor_list), async_op, inp.shape)


def gather(g: ProcessGroup, tensor: Any, gather_list: Any = None, dst: int = 0,
           async_op: bool = False) -> Optional[NcclWork]:
    """Every member's ``tensor`` into ``gather_list[group rank]`` on global rank ``dst``
    (grouped send/recv; ``gather_list`` only on ``dst``, as torch)."""
    return _rooted(g, "gather", tensor, gather_list, "dst", dst, async_op)


def scatter(g: ProcessGroup, tensor: Any, scatter_list: Any = None, src: int = 0,
            async_op: bool = False) -> Optional[NcclWork]:
    """``scatter_list[i]`` of global rank ``src`` into group rank i's ``tensor`` (grouped
    send/recv; ``scatter_list`` only on ``src``, as torch)."""
    return _rooted(g, "scatter", tensor, scatter_list, "src", src, async_op)


def _rooted(g: ProcessGroup, name: str, tensor: Any, xs: Any, root_arg: str, at: int,
            async_op: bool) -> Optional[NcclWork]:
    """gather (``root_arg`` dst: ``tensor`` to the root's list ``xs``) or scatter (src: the
    root's ``xs`` to ``tensor``): grouped send/recv, the root's own part a device copy."""
    gathering, arg = root_arg == "dst", f"{name}_list"
    shim = _nccl_shim.get()
    mine = device_array(tensor, name, "tensor", not gathering, shim)
    root = group_root(g, at, name, root_arg)
    root_list(xs, g.rank() == root, name, arg, root_arg, at, g.size())
    if g.rank() != root:
        part = [(root, mine)]
        return collective(g, name, [mine], ["tensor"], p2p_group_body, (part, []) if gathering else ([], part),
                           (tensor,), () if gathering else (tensor,), async_op, mine.shape, at)
    parts = arrays(xs, name, arg, g.size(), gathering, shim, mine, "tensor")
    same_shape(parts[root], mine, name, f"{arg}[{root}]", "tensor",
               " (it receives dst's own tensor)" if gathering else " (it is src's own part)")
    others = [(r, d) for r, d in enumerate(parts) if r != root]
    bargs = ([], others, (parts[root], mine)) if gathering else (others, [], None, (mine, parts[root]))
    return collective(g, name, [mine, *parts], ["tensor"] + [f"{arg}[{i}]" for i in range(len(parts))],
                       p2p_group_body, bargs, (tensor, tuple(xs)), tuple(xs) if gathering else (tensor,), async_op,
                       mine.shape, at)


# -- all-to-all ------------------------------------------------------------------------------------

def _check_own(name: str, me: int, sent: int, received: int) -> None:
    if sent != received:
        raise ValueError(f"{prefix(name)} this rank sends itself {sent} elements but expects {received} "
                         f"from itself; the part for rank {me} of the input and of the output must have "
                         f"the same size")


def _all_to_all_body(comm: NcclComm, ins: list, outs: list, stage: bool) -> Any:
    """Grouped send of ``ins[r]`` / recv of ``outs[r]`` for every r. ``stage``: an input
    overlaps an output, so the inputs are first copied, back to back, into a temporary."""
    temp = None
    if stage:
        temp, ptr = new_buffer(comm, sum(d.size for d in ins), ins[0].dtype)
        staged = []
        for d in ins:
            comm.shim.copy(ptr, d.ptr, d.nbytes, comm.stream)
            staged.append(Dev(None, ptr, d.shape, d.dtype, d.device))
            ptr += d.nbytes
        ins = staged
    p2p_group_body(comm, list(enumerate(ins)), list(enumerate(outs)))
    return temp


def all_to_all(g: ProcessGroup, output_tensor_list: Any, input_tensor_list: Any,
               async_op: bool = False) -> Optional[NcclWork]:
    """``input_tensor_list[i]`` to group rank i, rank i's into ``output_tensor_list[i]``."""
    name = "all_to_all"
    shim = _nccl_shim.get()
    n = g.size()
    ins = arrays(input_tensor_list, name, "input_tensor_list", n, False, shim)
    outs = arrays(output_tensor_list, name, "output_tensor_list", n, True, shim, ins[0], "input_tensor_list[0]")
    me = g.rank()
    _check_own(name, me, ins[me].size, outs[me].size)
    args = [f"input_tensor_list[{i}]" for i in range(n)] + [f"output_tensor_list[{i}]" for i in range(n)]
    stage = any(overlaps(a, b) for a in ins for b in outs)
    return collective(g, name, ins + outs, args, _all_to_all_body, (ins, outs, stage),
                       (tuple(input_tensor_list), tuple(output_tensor_list)), tuple(output_tensor_list), async_op,
                       [d.shape for d in ins])


def all_to_all_single(g: ProcessGroup, output: Any, input: Any, output_split_sizes: Any = None,  # noqa: A002
                      input_split_sizes: Any = None, async_op: bool = False) -> Optional[NcclWork]:
    """Rows ``input_split_sizes[i]`` of ``input`` to group rank i; rank i's rows land in
    ``output`` in rank order (equal splits when the sizes are None or empty)."""
    name = "all_to_all_single"
    _, out, inp = pair(name, output, input)
    n, me = g.size(), g.rank()
    out_rows = split_sizes(output_split_sizes, out, name, "output_split_sizes", "output", n)
    in_rows = split_sizes(input_split_sizes, inp, name, "input_split_sizes", "input", n)
    ins, outs = rows(inp, in_rows), rows(out, out_rows)
    _check_own(name, me, ins[me].size, outs[me].size)
    return collective(g, name, [out, inp], ["output", "input"], _all_to_all_body, (ins, outs, overlaps(inp, out)),
                       (output, input), (output,), async_op, inp.shape)
