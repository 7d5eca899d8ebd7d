"""The NCCL path for device arrays: every public op, on CuPy's NCCL bindings.

Entry point: :func:`run` ``(op, g, args)``, called when a call's arrays live on a GPU and the
group's device backend is NCCL; src/dst/peer are global ranks. Each op maps onto NCCL as
torch's ProcessGroupNCCL does; the op and reduction/dtype tables are in docs/nccl.md
("Ops", "Reductions and dtypes").
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from typing import Any, Callable, Optional, cast

import numpy as np

from mpidist._arrays.buffers import holds, same_dtype, split_sizes
from mpidist._arrays.reduce_op import PremulSum, ReduceOp, _premul_factor
from mpidist._backends.device import nccl_shim
from mpidist._backends.device.nccl_core import (
    Dev,
    NcclComm,
    NcclWork,
    Plan,
    device_array,
    launch,
    mover,
    overlaps,
    reduction,
    state,
)
from mpidist._core import recorder as R
from mpidist._core.group import ProcessGroup
from mpidist._dispatch.dispatch import check_tag, group_root, peer_rank, root_list
from mpidist._dispatch.p2p_op import P2POp, is_receive
from mpidist._runtime import world as runtime
from mpidist.errors import prefix

__all__ = ["run", "NcclWork", "OPS"]


# -- pieces shared by the ops: argument checks, temporaries, device copies, PREMUL_SUM scaling and
# AVG division on the communicator's stream, NCCL groups, the common path of a collective ---------


@functools.cache
def version(shim: Any) -> int:
    """NCCL's runtime version code through ``shim`` (asked once per shim)."""
    return shim.version()


def pair(
    name: str,
    output: Any,
    input: Any,
    out_arg: str = "output",  # noqa: A002
    in_arg: str = "input",
) -> tuple[Any, Dev, Dev]:
    """The shim and an op's ``output`` (writable) and ``input`` device arrays, of one dtype."""
    shim = nccl_shim.get()
    out = device_array(output, name, out_arg, True, shim)
    inp = device_array(input, name, in_arg, False, shim)
    same_dtype(out, inp, name, out_arg, in_arg)  # type: ignore[arg-type]  # Dev duck-types the ndarray's dtype
    return shim, out, inp


def arrays(
    xs: Any,
    name: str,
    arg: str,
    n: int,
    writable: bool,
    shim: Any,
    ref: Optional[Dev] = None,
    ref_arg: str = "",
    per_rank: bool = False,
) -> list[Dev]:
    """Validate a list of ``n`` device arrays of ``ref``'s dtype (default: the first
    element's); ``per_rank`` words a wrong length as reduce_scatter does."""
    if not isinstance(xs, (list, tuple)):
        raise TypeError(f"{prefix(name)} {arg} must be a list of device arrays, got {type(xs).__name__}")
    if len(xs) != n:
        what = f"one array per group rank: expected {n}" if per_rank else f"the group size = {n} arrays"
        raise ValueError(f"{prefix(name)} {arg} must hold {what}, got {len(xs)}")
    devs = [device_array(x, name, f"{arg}[{i}]", writable, shim) for i, x in enumerate(xs)]
    ref, ref_arg = (ref, ref_arg) if ref is not None else (devs[0], f"{arg}[0]")
    for i, d in enumerate(devs):
        same_dtype(ref, d, name, ref_arg, f"{arg}[{i}]")  # type: ignore[arg-type]  # Dev duck-types the ndarray's dtype
    return devs


def same_shape(a: Dev, ref: Dev, name: str, arg: str, ref_arg: str, why: str = "") -> None:
    if a.shape != ref.shape:
        raise ValueError(f"{prefix(name)} {arg} must have the shape of {ref_arg}, {ref.shape}{why}, got {a.shape}")


def new_buffer(comm: NcclComm, count: int, dtype: np.dtype) -> tuple[Any, int]:
    """A new device buffer, allocated on the communicator's stream; (array, pointer)."""
    shim = comm.shim
    with shim.on_stream(comm.stream):
        arr = shim.empty(count, dtype)
    return arr, shim.pointer(arr)


def copy_of(comm: NcclComm, d: Dev) -> tuple[Any, int]:
    """A device copy of ``d`` made on the communicator's stream; (array, pointer)."""
    arr, ptr = new_buffer(comm, d.size, d.dtype)
    comm.shim.copy(ptr, d.ptr, d.nbytes, comm.stream)
    return arr, ptr


def scale(comm: NcclComm, src: Dev, dst_ptr: int, plan: Plan) -> None:
    """``dst = factor * src`` on the stream (PREMUL_SUM; ``dst`` may be ``src``)."""
    shim = comm.shim
    factor = _premul_factor(cast(PremulSum, plan.premul), src.dtype)[()]  # set: callers scale for PREMUL_SUM only
    with shim.on_stream(comm.stream):
        out = shim.view(dst_ptr, src.size, src.dtype, comm.device)
        shim.xp.multiply(shim.view(src.ptr, src.size, src.dtype, comm.device, src.obj), factor, out=out)


def divide(comm: NcclComm, d: Dev, n: int) -> None:
    """``d /= n`` on the stream (AVG where NCCL has no ncclAvg); complex part by part, as
    ncclAvg treats them (pairs of reals)."""
    shim = comm.shim
    dtype, count = d.dtype, d.size
    if dtype.kind == "c":
        dtype, count = np.dtype(f"f{dtype.itemsize // 2}"), 2 * count
    with shim.on_stream(comm.stream):
        view = shim.view(d.ptr, count, dtype, comm.device, d.obj)
        shim.xp.divide(view, n, out=view)


@contextlib.contextmanager
def nccl_group(shim: Any) -> Iterator[None]:
    """``with nccl_group(shim):`` brackets NCCL calls in ncclGroupStart/ncclGroupEnd."""
    shim.group_start()
    try:
        yield
    finally:
        shim.group_end()


def collective(
    g: ProcessGroup,
    name: str,
    devs: Sequence[Dev],
    args: Sequence[str],
    body: Any,
    bargs: tuple,
    refs: tuple,
    outputs: tuple,
    async_op: bool,
    shapes: Any,
    root: int = -1,
    device: Optional[int] = None,
    host_wait: bool = False,
    stream: Any = None,
) -> Optional[NcclWork]:
    """Get the group's communicator (device-checking ``devs``; ``device``: the one to make it
    on, barrier), record, and launch ``body`` (``host_wait``, ``stream``: see launch)."""
    comm = state(g).collective(name, devs, args, device)
    rec = R.begin(g, name, shapes, devs[0].dtype if devs else None, root, R.SCHEDULED)  # not the engine's current op
    rec[R.STATE] = R.STARTED
    works = launch(comm, g, name, body, bargs, refs, async_op, [(name, outputs, [rec], None)], host_wait, devs, stream)
    return works[0] if works else None


def back_to_back(devs: Sequence[Dev]) -> bool:
    """True if the arrays lie one after the other in memory, in list order."""
    return all(b.ptr == a.ptr + a.nbytes for a, b in zip(devs, devs[1:]))


def copy(comm: NcclComm, dst: Dev, src: Dev) -> Any:
    """``dst = src`` on the stream (nothing if they are the same memory; through a temporary,
    returned, if they overlap otherwise)."""
    if dst.ptr == src.ptr:
        return None
    temp, ptr = copy_of(comm, src) if overlaps(dst, src) else (None, src.ptr)
    comm.shim.copy(dst.ptr, ptr, src.nbytes, comm.stream)
    return temp


def send_recv(comm: NcclComm, d: Dev, peer: int, receive: bool = False) -> None:
    """ncclSend of ``d`` to ``peer`` (a rank of ``comm``), or ncclRecv into it, on the stream."""
    kind, mult = mover(d.dtype)
    (comm.nccl.recv if receive else comm.nccl.send)(d.ptr, d.size * mult, kind, peer, comm.stream.ptr)


def p2p_group_body(
    comm: NcclComm,
    sends: Sequence[tuple[int, Dev]],
    recvs: Sequence[tuple[int, Dev]],
    before: Optional[tuple[Dev, Dev]] = None,
    after: Optional[tuple[Dev, Dev]] = None,
) -> Any:
    """Grouped ncclSend/ncclRecv ((group rank, array) pairs), with a device copy (dst, src)
    of this rank's own part ``before`` the group (gather: its input may be overwritten by a
    receive) or ``after`` it (scatter: its output may overlap a part being sent)."""
    temps = [copy(comm, *before)] if before is not None else []
    with nccl_group(comm.shim):
        for peer, d in sends:
            send_recv(comm, d, peer)
        for peer, d in recvs:
            send_recv(comm, d, peer, True)
    if after is not None:
        temps.append(copy(comm, *after))
    return temps


def rows(base: Dev, rows: list[int]) -> list[Dev]:
    """``base`` cut along dim 0 into parts of ``rows`` rows each (flat Devs)."""
    per_row = base.size // base.shape[0] if base.shape and base.shape[0] else 0
    parts, at = [], base.ptr
    for r in rows:
        count = r * per_row
        parts.append(Dev(None, at, (count,), base.dtype, base.device))
        at += count * base.dtype.itemsize
    return parts


# -- all_reduce, broadcast, reduce, barrier -------------------------------------------------------


def _reduce_body(comm: NcclComm, t: Dev, plan: Plan, root: Optional[int] = None) -> Any:
    """ncclAllReduce in place on ``t`` (``root`` None), or ncclReduce into rank ``root``'s ``t``."""
    own = root is None or comm.rank == root
    temp, send = None, t.ptr
    if plan.premul is not None:
        if not own:  # scale a copy: the others' tensors are left unchanged
            temp, send = new_buffer(comm, t.size, t.dtype)
        scale(comm, t, send, plan)
    if root is None:
        comm.nccl.allReduce(send, send, t.size * plan.mult, plan.type, plan.op, comm.stream.ptr)
    else:
        comm.nccl.reduce(send, send, t.size * plan.mult, plan.type, plan.op, root, comm.stream.ptr)
    if own and plan.divide:
        divide(comm, t, comm.size)
    return temp


def all_reduce(
    g: ProcessGroup,
    tensor: Any,
    op: Any = ReduceOp.SUM,
    async_op: bool = False,
    algorithm: Optional[str] = None,
    *,
    name: str = "all_reduce",
    stream: Any = None,
) -> Optional[NcclWork]:
    """ncclAllReduce in place on ``tensor`` (writable, C-contiguous; same shape and dtype on
    every member; or a :class:`Dev` a front end validated); every member's ``tensor`` gets
    the result. ``stream``: the caller's stream where it is not CuPy's current one."""
    if algorithm is not None:
        raise ValueError(
            f"{prefix(name)} algorithm={algorithm!r} selects a host algorithm; the NCCL path takes algorithm=None"
        )
    shim = nccl_shim.get()
    t = device_array(tensor, name, "tensor", True, shim)
    plan = reduction(op, t.dtype, name, version(shim))
    out = t.obj if tensor is t else tensor  # (a Dev: what it stands for)
    return collective(
        g, name, [t], ["tensor"], _reduce_body, (t, plan), (out,), (out,), async_op, t.shape, stream=stream
    )


def broadcast(
    g: ProcessGroup, tensor: Any, src: int, async_op: bool = False, *, name: str = "broadcast"
) -> Optional[NcclWork]:
    """ncclBroadcast of global rank ``src``'s ``tensor`` into every member's ``tensor``."""
    shim = nccl_shim.get()
    root = group_root(g, src, name, "src")
    t = device_array(tensor, name, "tensor", True, shim)
    kind, mult = mover(t.dtype)

    def body(comm: NcclComm) -> None:
        comm.nccl.broadcast(t.ptr, t.ptr, t.size * mult, kind, root, comm.stream.ptr)

    return collective(g, name, [t], ["tensor"], body, (), (tensor,), (tensor,), async_op, t.shape, src)


def reduce(
    g: ProcessGroup, tensor: Any, dst: int, op: Any = ReduceOp.SUM, async_op: bool = False, *, name: str = "reduce"
) -> Optional[NcclWork]:
    """ncclReduce into global rank ``dst``'s ``tensor``; the others' are left unchanged."""
    shim = nccl_shim.get()
    root = group_root(g, dst, name, "dst")
    t = device_array(tensor, name, "tensor", g.rank() == root, shim)
    plan = reduction(op, t.dtype, name, version(shim))
    return collective(
        g, name, [t], ["tensor"], _reduce_body, (t, plan, root), (tensor,), (tensor,), async_op, t.shape, dst
    )


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
        device = st.device if st.device is not None else nccl_shim.get().current_device()
    elif (
        not isinstance(device_ids, (list, tuple))
        or len(device_ids) != 1
        or not isinstance(device_ids[0], (int, np.integer))
        or isinstance(device_ids[0], bool)
    ):
        raise ValueError(
            f"{prefix(name)} device_ids must be None or a list of one int (this process's "
            f"GPU) on the NCCL path, got {device_ids!r}"
        )
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


def reduce_scatter_tensor(
    g: ProcessGroup,
    output: Any,
    input: Any,
    op: Any = ReduceOp.SUM,  # noqa: A002
    async_op: bool = False,
) -> Optional[NcclWork]:
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
    return collective(
        g,
        name,
        [out, inp],
        ["output", "input"],
        _reduce_scatter_body,
        (out, inp if direct else None, parts, plan),
        (output, input),
        (output,),
        async_op,
        inp.shape,
    )


def reduce_scatter(
    g: ProcessGroup, output: Any, input_list: Any, op: Any = ReduceOp.SUM, async_op: bool = False
) -> Optional[NcclWork]:
    """``input_list[r]`` reduced over the members into group rank r's ``output`` (the
    inputs are packed into one buffer unless they already lie back to back)."""
    name = "reduce_scatter"
    shim = nccl_shim.get()
    out = device_array(output, name, "output", True, shim)
    n = g.size()
    ins = arrays(input_list, name, "input_list", n, False, shim, out, "output", per_rank=True)
    for i, d in enumerate(ins):
        if d.shape != out.shape:
            raise ValueError(
                f"{prefix(name)} input_list[{i}] has shape {d.shape}, expected the shape of output {out.shape}"
            )
    plan = reduction(op, out.dtype, name, version(shim))
    direct = plan.premul is None and back_to_back(ins) and not any(overlaps(out, d) for d in ins)
    return collective(
        g,
        name,
        [out, *ins],
        ["output"] + [f"input_list[{i}]" for i in range(n)],
        _reduce_scatter_body,
        (out, ins[0] if direct else None, ins, plan),
        (output, tuple(input_list)),
        (output,),
        async_op,
        out.shape,
    )


# -- gathers --------------------------------------------------------------------------------------


def all_gather_into_tensor(
    g: ProcessGroup, output_tensor: Any, input_tensor: Any, async_op: bool = False
) -> Optional[NcclWork]:
    """ncclAllGather of every member's ``input_tensor`` into ``output_tensor`` (group-rank
    order; ``W * input.size`` elements). In place when ``input_tensor`` is this rank's slot."""
    name = "all_gather_into_tensor"
    _, out, inp = pair(name, output_tensor, input_tensor, "output_tensor", "input_tensor")
    holds(name, out, "output_tensor", inp, "input_tensor", g.size())
    return collective(
        g,
        name,
        [out, inp],
        ["output_tensor", "input_tensor"],
        _all_gather_body,
        (inp, out.ptr),
        (output_tensor, input_tensor),
        (output_tensor,),
        async_op,
        inp.shape,
    )


def _all_gather_body(comm: NcclComm, inp: Dev, out_ptr: int) -> Any:
    """ncclAllGather of ``inp`` into the block at ``out_ptr`` (W * inp.nbytes bytes)."""
    kind, mult = mover(inp.dtype)
    block = Dev(None, out_ptr, (comm.size * inp.size,), inp.dtype, comm.device)
    in_place = inp.ptr == out_ptr + comm.rank * inp.nbytes  # NCCL's in-place form: the own slot only
    temp, send = copy_of(comm, inp) if not in_place and overlaps(inp, block) else (None, inp.ptr)
    comm.nccl.allGather(send, out_ptr, inp.size * mult, kind, comm.stream.ptr)
    return temp


def _broadcasts_body(comm: NcclComm, inp: Dev, outs: Sequence[Dev]) -> Any:
    """all_gather as one NCCL group of broadcasts, one per rank, each into its own output."""
    kind, mult = mover(inp.dtype)
    temp, send = None, inp.ptr
    if any(overlaps(inp, o) for r, o in enumerate(outs) if r != comm.rank):
        temp, send = copy_of(comm, inp)
    with nccl_group(comm.shim):
        for r, o in enumerate(outs):
            comm.nccl.broadcast(send if r == comm.rank else o.ptr, o.ptr, o.size * mult, kind, r, comm.stream.ptr)
    return temp


def all_gather(g: ProcessGroup, tensor_list: Any, tensor: Any, async_op: bool = False) -> Optional[NcclWork]:
    """Every member's ``tensor`` into ``tensor_list[group rank]`` on every member."""
    name = "all_gather"
    shim = nccl_shim.get()
    inp = device_array(tensor, name, "tensor", False, shim)
    outs = arrays(tensor_list, name, "tensor_list", g.size(), True, shim, inp, "tensor")
    me = g.rank()
    same_shape(outs[me], inp, name, f"tensor_list[{me}]", "tensor", " (it receives this rank's own tensor)")
    body: Callable[..., Any]
    bargs: tuple[Any, ...]
    if back_to_back(outs) and all(o.size == inp.size for o in outs):
        body, bargs = _all_gather_body, (inp, outs[0].ptr)
    else:
        body, bargs = _broadcasts_body, (inp, outs)
    return collective(
        g,
        name,
        [inp, *outs],
        ["tensor"] + [f"tensor_list[{i}]" for i in range(len(outs))],
        body,
        bargs,
        (tensor, tuple(tensor_list)),
        tuple(tensor_list),
        async_op,
        inp.shape,
    )


def gather(
    g: ProcessGroup, tensor: Any, gather_list: Any = None, dst: int = 0, async_op: bool = False
) -> Optional[NcclWork]:
    """Every member's ``tensor`` into ``gather_list[group rank]`` on global rank ``dst``
    (grouped send/recv; ``gather_list`` only on ``dst``, as torch)."""
    return _rooted(g, "gather", tensor, gather_list, "dst", dst, async_op)


def scatter(
    g: ProcessGroup, tensor: Any, scatter_list: Any = None, src: int = 0, async_op: bool = False
) -> Optional[NcclWork]:
    """``scatter_list[i]`` of global rank ``src`` into group rank i's ``tensor`` (grouped
    send/recv; ``scatter_list`` only on ``src``, as torch)."""
    return _rooted(g, "scatter", tensor, scatter_list, "src", src, async_op)


def _rooted(
    g: ProcessGroup, name: str, tensor: Any, xs: Any, root_arg: str, at: int, async_op: bool
) -> Optional[NcclWork]:
    """gather (``root_arg`` dst: ``tensor`` to the root's list ``xs``) or scatter (src: the
    root's ``xs`` to ``tensor``): grouped send/recv, the root's own part a device copy."""
    gathering, arg = root_arg == "dst", f"{name}_list"
    shim = nccl_shim.get()
    mine = device_array(tensor, name, "tensor", not gathering, shim)
    root = group_root(g, at, name, root_arg)
    root_list(xs, g.rank() == root, name, arg, root_arg, at, g.size())
    if g.rank() != root:
        part = [(root, mine)]
        return collective(
            g,
            name,
            [mine],
            ["tensor"],
            p2p_group_body,
            (part, []) if gathering else ([], part),
            (tensor,),
            () if gathering else (tensor,),
            async_op,
            mine.shape,
            at,
        )
    parts = arrays(xs, name, arg, g.size(), gathering, shim, mine, "tensor")
    same_shape(
        parts[root],
        mine,
        name,
        f"{arg}[{root}]",
        "tensor",
        " (it receives dst's own tensor)" if gathering else " (it is src's own part)",
    )
    others = [(r, d) for r, d in enumerate(parts) if r != root]
    bargs = ([], others, (parts[root], mine)) if gathering else (others, [], None, (mine, parts[root]))
    return collective(
        g,
        name,
        [mine, *parts],
        ["tensor"] + [f"{arg}[{i}]" for i in range(len(parts))],
        p2p_group_body,
        bargs,
        (tensor, tuple(xs)),
        tuple(xs) if gathering else (tensor,),
        async_op,
        mine.shape,
        at,
    )


# -- all-to-all ------------------------------------------------------------------------------------


def _check_own(name: str, me: int, sent: int, received: int) -> None:
    if sent != received:
        raise ValueError(
            f"{prefix(name)} this rank sends itself {sent} elements but expects {received} "
            f"from itself; the part for rank {me} of the input and of the output must have "
            f"the same size"
        )


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


def all_to_all(
    g: ProcessGroup, output_tensor_list: Any, input_tensor_list: Any, async_op: bool = False
) -> Optional[NcclWork]:
    """``input_tensor_list[i]`` to group rank i, rank i's into ``output_tensor_list[i]``."""
    name = "all_to_all"
    shim = nccl_shim.get()
    n = g.size()
    ins = arrays(input_tensor_list, name, "input_tensor_list", n, False, shim)
    outs = arrays(output_tensor_list, name, "output_tensor_list", n, True, shim, ins[0], "input_tensor_list[0]")
    me = g.rank()
    _check_own(name, me, ins[me].size, outs[me].size)
    args = [f"input_tensor_list[{i}]" for i in range(n)] + [f"output_tensor_list[{i}]" for i in range(n)]
    stage = any(overlaps(a, b) for a in ins for b in outs)
    return collective(
        g,
        name,
        ins + outs,
        args,
        _all_to_all_body,
        (ins, outs, stage),
        (tuple(input_tensor_list), tuple(output_tensor_list)),
        tuple(output_tensor_list),
        async_op,
        [d.shape for d in ins],
    )


def all_to_all_single(
    g: ProcessGroup,
    output: Any,
    input: Any,
    output_split_sizes: Any = None,  # noqa: A002
    input_split_sizes: Any = None,
    async_op: bool = False,
) -> Optional[NcclWork]:
    """Rows ``input_split_sizes[i]`` of ``input`` to group rank i; rank i's rows land in
    ``output`` in rank order (equal splits when the sizes are None or empty)."""
    name = "all_to_all_single"
    _, out, inp = pair(name, output, input)
    n, me = g.size(), g.rank()
    # (Dev duck-types the ndarray's ndim and shape that split_sizes reads)
    out_rows = split_sizes(output_split_sizes, out, name, "output_split_sizes", "output", n)  # type: ignore[arg-type]
    in_rows = split_sizes(input_split_sizes, inp, name, "input_split_sizes", "input", n)  # type: ignore[arg-type]
    ins, outs = rows(inp, in_rows), rows(out, out_rows)
    _check_own(name, me, ins[me].size, outs[me].size)
    return collective(
        g,
        name,
        [out, inp],
        ["output", "input"],
        _all_to_all_body,
        (ins, outs, overlaps(inp, out)),
        (output, input),
        (output,),
        async_op,
        inp.shape,
    )


# -- the seeds' multi-GPU forms: one array per list ---------------------------------------------------


def _one(xs: Any, name: str, arg: str, index_arg: str = "", index: Any = 0) -> Any:
    """The only element of a ``*_multigpu`` list: one process drives one GPU on this path.
    ``index_arg``: the op's index into the list (``index``, its value), an int and 0."""
    if not isinstance(xs, (list, tuple)):
        raise TypeError(f"{prefix(name)} {arg} must be a list of device arrays, got {type(xs).__name__}")
    if len(xs) != 1:
        raise ValueError(
            f"{prefix(name)} {arg} must hold exactly one array on the NCCL path (one GPU per "
            f"process; torch removed the multi-GPU forms), got {len(xs)}"
        )
    if not isinstance(index, (int, np.integer)) or isinstance(index, bool):
        raise TypeError(f"{prefix(name)} {index_arg} must be an int, got {type(index).__name__}")
    if index != 0:
        raise ValueError(
            f"{prefix(name)} {index_arg}={index} is out of range: the NCCL path takes one array per "
            f"list, so {index_arg} must be 0"
        )
    return xs[0]


# -- point-to-point -----------------------------------------------------------------------------------


def _p2p(
    g: ProcessGroup, name: str, tensor: Any, peer: Any, tag: Any, receive: bool, async_op: bool, arg: str
) -> Optional[NcclWork]:
    """One ncclSend/ncclRecv on the 2-rank communicator with ``peer`` (a global rank)."""
    shim = nccl_shim.get()
    d = device_array(tensor, name, "tensor", receive, shim)
    check_tag(tag, name)
    if receive and peer is None:
        raise ValueError(
            f"{prefix(name)} {arg}=None (any source) is not supported by NCCL; pass the sender's global rank"
        )
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
    return int(src)  # type: ignore[arg-type]  # not None: _p2p raised for None


def isend(g: ProcessGroup, tensor: Any, dst: int, tag: int = 0) -> NcclWork:
    """Async :func:`send`: returns its NcclWork."""
    return cast(NcclWork, _p2p(g, "isend", tensor, dst, tag, False, True, "dst"))  # async: a Work


def irecv(g: ProcessGroup, tensor: Any, src: Optional[int] = None, tag: int = 0) -> NcclWork:
    """Async :func:`recv`: returns its NcclWork (``source_rank()`` is ``src``)."""
    return cast(NcclWork, _p2p(g, "irecv", tensor, src, tag, True, True, "src"))  # async: a Work


def batch_isend_irecv(g: ProcessGroup, p2p_op_list: Any) -> list:
    """Every op of ``p2p_op_list`` in one NCCL group on ``g``'s communicator; one NcclWork per
    op, in order (they complete together). Every op must use group ``g``; if this is the
    group's first NCCL collective, every member must call it (torch's rule)."""
    name = "batch_isend_irecv"
    shim = nccl_shim.get()
    if not isinstance(p2p_op_list, (list, tuple)) or not p2p_op_list:
        raise ValueError(f"{prefix(name)} p2p_op_list must be a non-empty list of P2POp, got {p2p_op_list!r:.80}")
    for i, p in enumerate(p2p_op_list):
        if not isinstance(p, P2POp):
            raise ValueError(f"{prefix(name)} p2p_op_list[{i}] must be a P2POp, got {type(p).__name__}")
        if runtime.resolve_group(p.group) is not g:
            raise ValueError(
                f"{prefix(name)} p2p_op_list[{i}] is on another group than the batch's first op; "
                f"the NCCL path batches the ops of one group"
            )
    plan = []
    for i, p in enumerate(p2p_op_list):
        receive = is_receive(p)
        where = f"p2p_op_list[{i}]."
        d = device_array(p.tensor, name, f"{where}tensor", receive, shim)
        check_tag(p.tag, name, f"{where}tag")
        if p.peer is None:
            raise ValueError(
                f"{prefix(name)} {where}peer=None (any source) is not supported by NCCL; pass the sender's global rank"
            )
        plan.append((receive, peer_rank(g, p.peer, name, f"{where}peer"), d, p))
    devs = [d for _, _, d, _ in plan]
    comm = state(g).collective(name, devs, [f"p2p_op_list[{i}].tensor" for i in range(len(plan))])
    recs = [R.begin_p2p(g, "irecv" if rcv else "isend", d.shape, d.dtype, int(p.peer)) for rcv, _, d, p in plan]
    sends = [(peer, d) for rcv, peer, d, _ in plan if not rcv]
    recvs = [(peer, d) for rcv, peer, d, _ in plan if rcv]
    handles = [
        ("irecv", (p.tensor,), [rec], int(p.peer)) if rcv else ("isend", (), [rec], None)
        for (rcv, _, _, p), rec in zip(plan, recs)
    ]
    return cast(  # async: one Work per op
        list,
        launch(
            comm,
            g,
            name,
            p2p_group_body,
            (sends, recvs),
            tuple(p.tensor for p in p2p_op_list),
            True,
            handles,
            devs=devs,
        ),
    )


def all_reduce_multigpu(
    g: ProcessGroup, tensor_list: Any, op: Any = ReduceOp.SUM, async_op: bool = False
) -> Optional[NcclWork]:
    name = "all_reduce_multigpu"
    return all_reduce(g, _one(tensor_list, name, "tensor_list"), op, async_op, name=name)


def reduce_multigpu(
    g: ProcessGroup, tensor_list: Any, dst: int, op: Any = ReduceOp.SUM, async_op: bool = False, dst_tensor: int = 0
) -> Optional[NcclWork]:
    name = "reduce_multigpu"
    return reduce(g, _one(tensor_list, name, "tensor_list", "dst_tensor", dst_tensor), dst, op, async_op, name=name)


def broadcast_multigpu(
    g: ProcessGroup, tensor_list: Any, src: int, async_op: bool = False, src_tensor: int = 0
) -> Optional[NcclWork]:
    name = "broadcast_multigpu"
    return broadcast(g, _one(tensor_list, name, "tensor_list", "src_tensor", src_tensor), src, async_op, name=name)


def all_gather_multigpu(
    g: ProcessGroup, output_tensor_lists: Any, input_tensor_list: Any, async_op: bool = False
) -> Optional[NcclWork]:
    name = "all_gather_multigpu"
    tensor = _one(input_tensor_list, name, "input_tensor_list")
    outs = _one(output_tensor_lists, name, "output_tensor_lists")
    return all_gather(g, outs, tensor, async_op)


#: Public op name -> its NCCL implementation (same arguments, ``group`` replaced by ``g``).
OPS = {
    f.__name__: f
    for f in (
        all_reduce,
        broadcast,
        reduce,
        barrier,
        all_gather,
        all_gather_into_tensor,
        gather,
        scatter,
        all_to_all,
        all_to_all_single,
        reduce_scatter,
        reduce_scatter_tensor,
        send,
        recv,
        isend,
        irecv,
        batch_isend_irecv,
        all_reduce_multigpu,
        reduce_multigpu,
        broadcast_multigpu,
        all_gather_multigpu,
    )
}


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
