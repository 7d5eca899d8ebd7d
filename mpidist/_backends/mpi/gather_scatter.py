"""The MPI backend's data-movement collectives: all_gather, gather, scatter, all-to-all and
broadcast_multigpu, the bodies of :mod:`mpidist.gather_scatter`'s public functions, on host
arrays (and on the device arrays of the CUDA-aware path, :mod:`mpidist._backends.device.route`).

Every function here moves arrays without reducing them. Lists of arrays travel in one
vector collective (MPI_Allgatherv, MPI_Gatherv, MPI_Scatterv, MPI_Alltoallv): the
counts are the arrays' element counts and the displacements their running sums
(:func:`_layout`, cached per layout). all_gather uses MPI_Allgather with one count
when every rank's count is the same: its output list gives every rank's count, the
same on every member, so all members choose the same collective. gather, scatter and
the all-to-alls stay on the v-forms, because there a rank sees only its own counts
(a non-root in gather or scatter, or one row of the all-to-all matrix) and cannot
know that the others chose the plain form too (mixing the two would hang). When the arrays of a list already
lie back to back in memory, in
list order (e.g. ``list(out)`` for a stacked ``out``), MPI reads or writes them in
place (:func:`_block`); otherwise mpidist packs them into, or unpacks them from, one
contiguous staging buffer. Where a rank's own input lies in its own output slot MPI
runs with ``MPI_IN_PLACE``; any other overlap between input and output is resolved
by sending a copy of the input.

The shared rules (global src/dst, non-members, Work results, sizes): :mod:`mpidist.gather_scatter`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache
from itertools import accumulate
from typing import Any, Callable, Optional

import numpy as np
from mpi4py import MPI

from mpidist._arrays.buffers import array_list, group_blocks, host_array, mpi_datatype, same_dtype, split_sizes
from mpidist._core import recorder as R
from mpidist._core.group import ProcessGroup
from mpidist._dispatch.dispatch import _guarded, launch, root_list, root_rank, signature
from mpidist.errors import prefix
from mpidist.work import Work

__all__ = [
    "all_gather",
    "all_gather_into_tensor",
    "gather",
    "scatter",
    "all_to_all",
    "all_to_all_single",
    "broadcast_multigpu",
    "all_gather_multigpu",
]


# -- buffer layout --------------------------------------------------------------------------


@lru_cache(maxsize=256)
def _layout(counts: tuple[int, ...]) -> tuple[list[int], int, bool]:
    """Displacements (running sums of ``counts``, starting at 0), the total, and whether every
    count is the same (then the plain collective replaces the v-form), for a v-collective.

    Cached by ``counts`` (a tuple): a program repeats the same few layouts. Callers must
    not modify the returned list.
    """
    displs = [0, *accumulate(counts)]
    return displs[:-1], displs[-1], counts.count(counts[0]) == len(counts)


_get_address = MPI.Get_address


def _address(a: np.ndarray) -> int:
    """Address of ``a``'s first element (MPI_Get_address: ~10x cheaper than ``__array_interface__``)."""
    try:
        return _get_address(a)
    except (BufferError, TypeError, ValueError):  # a dtype the buffer protocol cannot export
        return a.__array_interface__["data"][0]


def _block(arrays: Sequence[np.ndarray], writable: bool) -> Optional[np.ndarray]:
    """A flat array over the memory of ``arrays`` if they lie back to back in list order, else None.

    No copy: the result aliases the arrays (which must be C-contiguous, of one dtype).
    """
    first = arrays[0]
    start = end = _address(first)
    for a in arrays:
        if _address(a) != end:
            return None
        end += a.nbytes
    if end == start:
        return np.empty(0, first.dtype)
    base = first.base
    if (
        type(base) is np.ndarray
        and base.nbytes == end - start
        and base.dtype == first.dtype
        and base.flags.c_contiguous
        and _address(base) == start
    ):
        # e.g. list(out.reshape(n, k)): the rows' common base is the block (a writable
        # view's base is writable too)
        return base.reshape(-1)
    return np.frombuffer(MPI.buffer.fromaddress(start, end - start, readonly=not writable), first.dtype)  # type: ignore[call-overload]  # numpy's stubs omit buffer-protocol objects (MPI.buffer)


def _pack(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """``arrays`` as one flat array: a view when they are one block, else a concatenated copy."""
    block = _block(arrays, writable=False)
    return block if block is not None else np.concatenate([a.reshape(-1) for a in arrays])


def _recv_buffer(outs: Sequence[np.ndarray], total: int) -> tuple[np.ndarray, bool]:
    """Where MPI writes ``outs``: their own memory when they are one block, else a staging buffer.

    Returns (buffer, staged).
    """
    block = _block(outs, writable=True)
    if block is not None:
        return block, False
    return np.empty(total, outs[0].dtype), True


def _own_slot(own: np.ndarray, buf: np.ndarray, displ: int) -> Optional[bool]:
    """How ``own`` relates to ``buf``: None if disjoint, True if it is exactly the slot at ``displ``."""
    if not np.may_share_memory(own, buf):
        return None
    return _address(own) == _address(buf) + displ * buf.itemsize and own.size <= buf.size - displ


def _send_part(inp: np.ndarray, buf: np.ndarray, displ: int, dt: MPI.Datatype) -> Any:
    """The send argument for this rank's part ``inp`` of a gather into ``buf``.

    MPI_IN_PLACE when ``inp`` already sits in its slot, a copy when it overlaps ``buf``
    elsewhere (MPI forbids aliased send and receive buffers), else ``inp`` itself.
    """
    slot = _own_slot(inp, buf, displ)
    if slot is None:
        return [inp, dt]
    return MPI.IN_PLACE if slot else [inp.copy(), dt]


def _communicate(
    call: Any,
    args: tuple,
    staging: Optional[np.ndarray],
    outs: Sequence[np.ndarray],
    displs: Sequence[int],
    copies: Sequence[tuple[np.ndarray, np.ndarray]] = (),
) -> None:
    """Run the MPI ``call``; then unpack ``staging`` into ``outs`` and make the ``copies`` (dst, src)."""
    call(*args)
    if staging is not None:
        for out, d in zip(outs, displs):
            out.reshape(-1)[...] = staging[d : d + out.size]
    for dst, src in copies:
        dst.reshape(-1)[...] = src.reshape(-1)


def _body(
    call: Any,
    args: tuple,
    staging: Optional[np.ndarray],
    outs: Sequence[np.ndarray],
    displs: Sequence[int],
    copies: Sequence[tuple[np.ndarray, np.ndarray]] = (),
) -> tuple[Callable, tuple]:
    """(fn, args) running the MPI ``call`` as :func:`_communicate` does; the bare call when
    there is nothing to unpack or copy afterwards (one Python frame less per op)."""
    if staging is None and not copies:
        return call, args
    return _communicate, (call, args, staging, outs, displs, copies)


def _run(
    g: ProcessGroup,
    op: str,
    fn: Callable[..., Any],
    args: tuple,
    async_op: bool,
    outputs: tuple,
    shapes: Any,
    dtype: Any,
    root: int = -1,
    count: int = -1,
    layout: Optional[tuple] = None,
    parts: Optional[tuple] = None,
) -> Optional[Work]:
    """:func:`mpidist._dispatch.dispatch.launch`, with the sync latency path of ``all_reduce``: when the
    group's engine is idle (nothing queued, not DETAIL, no bounded wait) ``fn`` runs here
    at once, recorded and checked as launch records and checks it (sequence number, flight
    recorder, watchdog, the members' agreement on the call: ``layout``, ``parts`` as there)."""
    eng = g.engine
    if async_op or not eng.inline or eng.pending or eng.broken is not None:  # (as all_reduce's latency path)
        return launch(
            g,
            op,
            fn,
            args,
            async_op,
            outputs,
            shapes=shapes,
            dtype=dtype,
            root=root,
            count=count,
            layout=layout,
            parts=parts,
        )
    _guarded(g, op, fn, R.begin(g, op, shapes, dtype, root), signature(g, op, count, dtype, root, None, layout), parts)(
        *args
    )
    return None


# -- argument checks ------------------------------------------------------------------------


def _same_shape(a: np.ndarray, ref: np.ndarray, op: str, arg: str, ref_arg: str, why: str = "") -> None:
    if a.shape != ref.shape:
        raise ValueError(f"{prefix(op)} {arg} must have the shape of {ref_arg}, {ref.shape}{why}, got {a.shape}")


def _rooted(
    op: str,
    tensor: Any,
    xs: Any,
    g: ProcessGroup,
    rank: Any,
    group_rank: Any,
    arg: str,
    root_arg: str,
    gather: bool,
    why: str,
) -> tuple[np.ndarray, int, Optional[list[np.ndarray]], Any, Any]:
    """gather's/scatter's common start: ``tensor`` as a host array (read by gather, written by
    scatter), the root's group rank (:func:`root_rank`: ``root_arg`` or group_``root_arg``,
    default 0), list ``arg``, the MPI datatype and the communicator. The list: on the root,
    group-size arrays of ``tensor``'s dtype (:func:`~mpidist._arrays.buffers.array_list`;
    written by gather, read by scatter), entry root of ``tensor``'s shape; elsewhere None.
    ValueError when missing on the root or given elsewhere
    (:func:`mpidist._dispatch.dispatch.root_list`)."""
    arr = host_array(tensor, op, "tensor", writable=not gather)
    root = root_rank(g, rank, group_rank, op, root_arg, f"group_{root_arg}", default=0)
    root_list(xs, g.rank() == root, op, arg, root_arg, g.ranks[root], g.size())
    comm, arrs = g.comm, None
    assert comm is not None  # a member's (None on non-members only)
    if g.rank() == root:
        arrs = array_list(xs, op, arg, g.size(), gather, "the group size", dtype_of=(arr, "tensor"))
        if arrs[root].shape != arr.shape:
            _same_shape(arrs[root], arr, op, f"{arg}[{root}]", "tensor", why)
    return arr, root, arrs, mpi_datatype(arr.dtype), comm


# -- all-gather -----------------------------------------------------------------------------


def _all_gatherv(
    g: ProcessGroup,
    op: str,
    inp: np.ndarray,
    outs: Sequence[np.ndarray],
    rank_counts: tuple[int, ...],
    async_op: bool,
    results: tuple,
    copies: Sequence[tuple[np.ndarray, np.ndarray]] = (),
    slot_sizes: Optional[tuple[int, ...]] = None,
) -> Optional[Work]:
    """MPI_Allgatherv of each rank's flat ``inp`` (rank k sends ``rank_counts[k]`` elements) into
    the slots ``outs`` (in rank order; several consecutive slots, of ``slot_sizes`` elements,
    may belong to one rank; default: one slot per rank).

    When every rank sends the same count, MPI_Allgather with that one count instead: the
    counts are the caller's contract, the same on every member, so every member makes
    the same choice.
    """
    rank_displs, total, equal = _layout(rank_counts)
    slot_displs = rank_displs if slot_sizes is None else _layout(slot_sizes)[0]
    dt = mpi_datatype(outs[0].dtype)
    buf, staged = _recv_buffer(outs, total)
    send = _send_part(inp, buf, rank_displs[g.rank()], dt)
    if equal:
        call, args = g.comm.Allgather, (send, [buf, rank_counts[0], dt])  # type: ignore[union-attr]  # a member's comm (None on non-members only)
    else:
        call, args = g.comm.Allgatherv, (send, [buf, rank_counts, rank_displs, dt])  # type: ignore[union-attr]  # a member's comm (None on non-members only)
    fn, fn_args = _body(call, args, buf if staged else None, outs, slot_displs, copies)
    # every member passes the same list of sizes (else the ranks' slots disagree); equal
    # counts are given by the total
    layout = slot_sizes if slot_sizes is not None else None if equal else rank_counts
    return _run(g, op, fn, fn_args, async_op, results, inp.shape, inp.dtype, count=total, layout=layout)


def all_gather(tensor_list: list[np.ndarray], tensor: np.ndarray, g: ProcessGroup, async_op: bool) -> Optional[Work]:
    """The MPI backend's :func:`mpidist.all_gather`."""
    op = "all_gather"
    inp = host_array(tensor, op, "tensor", writable=False)
    outs = array_list(tensor_list, op, "tensor_list", g.size(), True, "the group size", dtype_of=(inp, "tensor"))
    me = g.rank()
    if outs[me].shape != inp.shape:  # (checked first: the argument's name is formatted only on error)
        _same_shape(outs[me], inp, op, f"tensor_list[{me}]", "tensor", " (it receives this rank's own tensor)")
    return _all_gatherv(g, op, inp, outs, tuple([o.size for o in outs]), async_op, tuple(tensor_list))


def all_gather_into_tensor(
    output_tensor: np.ndarray, input_tensor: np.ndarray, g: ProcessGroup, async_op: bool
) -> Optional[Work]:
    """The MPI backend's :func:`mpidist.all_gather_into_tensor`."""
    op = "all_gather_into_tensor"
    out = host_array(output_tensor, op, "output_tensor", writable=True)
    inp = host_array(input_tensor, op, "input_tensor", writable=False)
    group_blocks(out, inp, g.size(), op, "output_tensor", "input_tensor", gather=True)
    dt = mpi_datatype(inp.dtype)
    send = _send_part(inp, out, g.rank() * inp.size, dt)
    return _run(
        g,
        op,
        g.comm.Allgather,  # type: ignore[union-attr]  # a member's comm (None on non-members only)
        (send, [out, dt]),
        async_op,
        (output_tensor,),
        inp.shape,
        inp.dtype,
        count=out.size,
    )


def all_gather_multigpu(
    output_tensor_lists: list[list[np.ndarray]], input_tensor_list: list[np.ndarray], g: ProcessGroup, async_op: bool
) -> Optional[Work]:
    """The MPI backend's :func:`mpidist.all_gather_multigpu`."""
    op = "all_gather_multigpu"
    inps = array_list(input_tensor_list, op, "input_tensor_list", None, False)
    n_dev = len(inps)
    lists = output_lists(
        output_tensor_lists,
        op,
        inps,
        n_dev,
        "len(input_tensor_list)",
        g.size() * n_dev,
        "group size * len(input_tensor_list)",
        (0, g.rank() * n_dev),
    )
    first = lists[0]
    for i, lst in enumerate(lists[1:], 1):
        for s, (a, ref) in enumerate(zip(lst, first)):
            _same_shape(a, ref, op, f"output_tensor_lists[{i}][{s}]", f"output_tensor_lists[0][{s}]")
    copies = [(a, ref) for lst in lists[1:] for a, ref in zip(lst, first)]
    results = tuple(a for lst in output_tensor_lists for a in lst)
    return gather_slots(g, op, inps, first, async_op, results, copies)


def output_lists(
    xss: Any, op: str, inps: list, n: int, expected: str, row_n: int, row_expected: str, own: tuple[int, int]
) -> list[list[np.ndarray]]:
    """``output_tensor_lists``: ``n`` lists (``expected`` says why) of ``row_n`` writable arrays of
    the inputs' dtype (:func:`~mpidist._arrays.buffers.array_list`), list ``own[0]`` having input
    j's shape at ``own[1] + j``.
    TypeError for a non-list, ValueError for a wrong length or shape."""
    if not isinstance(xss, (list, tuple)):
        raise TypeError(
            f"{prefix(op)} output_tensor_lists must be a list of lists of numpy arrays, got {type(xss).__name__}"
        )
    if len(xss) != n:
        raise ValueError(f"{prefix(op)} output_tensor_lists must hold {expected} = {n} lists, got {len(xss)}")
    rows = [
        array_list(
            lst, op, f"output_tensor_lists[{i}]", row_n, True, row_expected, dtype_of=(inps[0], "input_tensor_list[0]")
        )
        for i, lst in enumerate(xss)
    ]
    i, start = own
    for j, inp in enumerate(inps):
        if rows[i][start + j].shape != inp.shape:
            _same_shape(
                rows[i][start + j],
                inp,
                op,
                f"output_tensor_lists[{i}][{start + j}]",
                f"input_tensor_list[{j}]",
                " (it receives that input)",
            )
    return rows


def gather_slots(
    g: ProcessGroup,
    op: str,
    inps: Sequence[np.ndarray],
    slots: Sequence[np.ndarray],
    async_op: bool,
    results: tuple,
    copies: Sequence[tuple[np.ndarray, np.ndarray]] = (),
) -> Optional[Work]:
    """All-gather of ``L = len(inps)`` arrays per rank: input ``j`` of group rank ``k`` lands
    in ``slots[k * L + j]``, by one MPI_Allgather(v) of each rank's packed inputs; then the
    ``copies`` (dst, src). Validated arrays only. Not public (not in ``__all__``): the body
    of all_gather_multigpu and all_gather_coalesced."""
    n = len(inps)
    sizes = tuple([a.size for a in slots])
    rank_counts = tuple([sum(sizes[k * n : (k + 1) * n]) for k in range(g.size())])
    return _all_gatherv(g, op, _pack(inps), slots, rank_counts, async_op, results, copies, sizes)


# -- gather, scatter ------------------------------------------------------------------------


def gather(
    tensor: np.ndarray,
    gather_list: Optional[list[np.ndarray]],
    dst: Optional[int],
    g: ProcessGroup,
    async_op: bool,
    group_dst: Optional[int] = None,
) -> Optional[Work]:
    """The MPI backend's :func:`mpidist.gather`."""
    op = "gather"
    inp, root, outs, dt, comm = _rooted(
        op, tensor, gather_list, g, dst, group_dst, "gather_list", "dst", True, " (it receives dst's own tensor)"
    )
    counts: Optional[tuple[int, ...]] = None
    fn, fn_args, outputs = comm.Gatherv, ([inp, dt], None, root), ()  # type: tuple[Callable[..., Any], tuple, tuple]
    if outs is not None:  # the root
        counts = tuple([o.size for o in outs])
        displs, total, _ = _layout(counts)
        buf, staged = _recv_buffer(outs, total)
        args = (_send_part(inp, buf, displs[root], dt), [buf, counts, displs, dt], root)
        fn, fn_args = _body(comm.Gatherv, args, buf if staged else None, outs, displs)
        outputs = tuple(gather_list)  # type: ignore[arg-type]  # not None where outs is not (_rooted)
    dst = g.ranks[root]
    return _run(g, op, fn, fn_args, async_op, outputs, inp.shape, inp.dtype, dst, parts=("gather", inp.size, counts))


def scatter(
    tensor: np.ndarray,
    scatter_list: Optional[list[np.ndarray]],
    src: Optional[int],
    g: ProcessGroup,
    async_op: bool,
    group_src: Optional[int] = None,
) -> Optional[Work]:
    """The MPI backend's :func:`mpidist.scatter`."""
    op = "scatter"
    out, root, inps, dt, comm = _rooted(
        op, tensor, scatter_list, g, src, group_src, "scatter_list", "src", False, " (it is src's own part)"
    )
    counts: Optional[tuple[int, ...]] = None
    args: tuple = (None, [out, dt], root)
    if inps is not None:  # the root
        counts = tuple([a.size for a in inps])
        displs = _layout(counts)[0]
        send = _pack(inps)
        slot = _own_slot(out, send, displs[root])
        if slot is False:
            send = np.concatenate([a.reshape(-1) for a in inps])
        args = ([send, counts, displs, dt], MPI.IN_PLACE if slot else [out, dt], root)
    src = g.ranks[root]
    return _run(
        g, op, comm.Scatterv, args, async_op, (tensor,), out.shape, out.dtype, src, parts=("scatter", out.size, counts)
    )


# -- all-to-all -----------------------------------------------------------------------------


def _all_to_allv(
    g: ProcessGroup,
    op: str,
    send: np.ndarray,
    send_counts: tuple[int, ...],
    outs: Sequence[np.ndarray],
    recv_counts: tuple[int, ...],
    async_op: bool,
    results: tuple,
) -> Optional[Work]:
    """MPI_Alltoallv from the flat ``send`` (``send_counts`` per rank) into ``outs`` (one array
    holding every rank's part, or one array per rank, ``recv_counts`` elements each).

    Always the v-form, even when this rank's counts are all equal: whether every rank's
    are is not known here, and members must call the same MPI collective.
    """
    me = g.rank()
    if send_counts[me] != recv_counts[me]:
        raise ValueError(
            f"{prefix(op)} this rank sends itself {send_counts[me]} elements but expects "
            f"{recv_counts[me]} from itself; the part for rank {me} of the input and of "
            f"the output must have the same size"
        )
    send_displs = _layout(send_counts)[0]
    recv_displs, total, _ = _layout(recv_counts)
    buf, staged = (outs[0], False) if len(outs) == 1 else _recv_buffer(outs, total)
    if np.may_share_memory(send, buf):
        send = send.copy()
    dt = mpi_datatype(buf.dtype)
    args = ([send, send_counts, send_displs, dt], [buf, recv_counts, recv_displs, dt])
    fn, fn_args = _body(g.comm.Alltoallv, args, buf if staged else None, outs, recv_displs)  # type: ignore[union-attr]  # a member's comm (None on non-members only)
    return _run(g, op, fn, fn_args, async_op, results, send.shape, buf.dtype, parts=("pairs", send_counts, recv_counts))


def all_to_all(
    output_tensor_list: list[np.ndarray], input_tensor_list: list[np.ndarray], g: ProcessGroup, async_op: bool
) -> Optional[Work]:
    """The MPI backend's :func:`mpidist.all_to_all`."""
    op = "all_to_all"
    inps = array_list(input_tensor_list, op, "input_tensor_list", g.size(), False, "the group size")
    outs = array_list(
        output_tensor_list,
        op,
        "output_tensor_list",
        g.size(),
        True,
        "the group size",
        dtype_of=(inps[0], "input_tensor_list[0]"),
    )
    return _all_to_allv(
        g,
        op,
        _pack(inps),
        tuple([a.size for a in inps]),
        outs,
        tuple([o.size for o in outs]),
        async_op,
        tuple(output_tensor_list),
    )


def all_to_all_single(
    output: np.ndarray,
    input: np.ndarray,
    output_split_sizes: Optional[list[int]],
    input_split_sizes: Optional[list[int]],
    g: ProcessGroup,
    async_op: bool,
) -> Optional[Work]:
    """The MPI backend's :func:`mpidist.all_to_all_single`."""
    op = "all_to_all_single"
    out = host_array(output, op, "output", writable=True)
    inp = host_array(input, op, "input", writable=False)
    same_dtype(out, inp, op, "output", "input")
    n = g.size()
    out_rows = split_sizes(output_split_sizes, out, op, "output_split_sizes", "output", n)
    in_rows = split_sizes(input_split_sizes, inp, op, "input_split_sizes", "input", n)
    out_row, in_row = math.prod(out.shape[1:]), math.prod(inp.shape[1:])
    return _all_to_allv(
        g,
        op,
        inp.reshape(-1),
        tuple([r * in_row for r in in_rows]),
        (out,),
        tuple([r * out_row for r in out_rows]),
        async_op,
        (output,),
    )


# -- broadcast, several "devices" per process -----------------------------------------------


def broadcast_multigpu(
    tensor_list: list[np.ndarray],
    src: Optional[int],
    g: ProcessGroup,
    async_op: bool,
    src_tensor: int,
    group_src: Optional[int] = None,
) -> Optional[Work]:
    """The MPI backend's :func:`mpidist.broadcast_multigpu`."""
    op = "broadcast_multigpu"
    arrs = array_list(tensor_list, op, "tensor_list", None, True)
    root = root_rank(g, src, group_src, op, "src", "group_src")
    src = g.ranks[root]
    if not isinstance(src_tensor, (int, np.integer)) or isinstance(src_tensor, bool):
        raise TypeError(f"{prefix(op)} src_tensor must be an int, got {type(src_tensor).__name__}")
    if not 0 <= src_tensor < len(arrs):
        raise ValueError(f"{prefix(op)} src_tensor must index tensor_list, in [0, {len(arrs)}), got {src_tensor}")
    for i, a in enumerate(arrs):
        if a.size != arrs[0].size:
            raise ValueError(
                f"{prefix(op)} tensor_list[{i}] must have as many elements as "
                f"tensor_list[0], {arrs[0].size}, got {a.size} (shape {a.shape})"
            )
    lead = arrs[src_tensor] if g.rank() == root else arrs[0]
    copies = [(a, lead) for a in arrs if a is not lead]
    fn, fn_args = _body(g.comm.Bcast, ([lead, mpi_datatype(lead.dtype)], root), None, (), (), copies)  # type: ignore[union-attr]  # a member's comm (None on non-members only)
    return _run(g, op, fn, fn_args, async_op, tuple(tensor_list), [a.shape for a in arrs], lead.dtype, src, lead.size)
