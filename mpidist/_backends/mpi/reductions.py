"""The MPI backend's reducing collectives besides all_reduce: reduce, reduce_scatter,
reduce_scatter_tensor and the seeds' multi-array forms all_reduce_multigpu /
reduce_multigpu, the bodies of :mod:`mpidist.reductions`' public functions.

Same names, arguments and semantics as torch.distributed, on host arrays (and on the
device arrays of the CUDA-aware path, :mod:`mpidist._backends.device.route`). ``dst`` is
a global rank. A rank outside ``group`` returns None and touches nothing; sync calls
return None, ``async_op=True`` a :class:`~mpidist.Work`.

Dtypes: MPI's predefined reductions where MPI has the datatype (the fast path); for
float16, bfloat16 (ml_dtypes) and non-native byte order, a cached user-defined MPI op
over an opaque byte datatype applies the numpy ufunc (see :mod:`mpidist._arrays.reduce_op`).
AVG is a SUM followed by one division by the number of contributions on the ranks
that receive the result. ``make_premul_sum(factor)`` (PREMUL_SUM) multiplies each
input by ``factor`` on its own rank, then sums.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import numpy as np
from mpi4py import MPI

from mpidist._arrays.buffers import array_list, group_blocks, host_array, mpi_datatype
from mpidist._arrays.reduce_op import ReduceOp, check_op_dtype, local_reduce, scaled, to_mpi_op
from mpidist._backends.mpi.collectives import Op, all_reduce_body
from mpidist._core.group import ProcessGroup
from mpidist._dispatch.dispatch import launch, root_rank
from mpidist.errors import prefix
from mpidist.work import Work

__all__ = ["reduce", "reduce_scatter", "reduce_scatter_tensor", "all_reduce_multigpu", "reduce_multigpu"]


def _array_list(
    arrays: Any,
    op: str,
    arg: str,
    *,
    writable: bool,
    length: Optional[int] = None,
    ref: Optional[np.ndarray] = None,
    ref_arg: str = "",
    distinct: bool = False,
) -> list:
    """:func:`~mpidist._arrays.buffers.array_list` (of ``length`` if given, each with the dtype of
    ``ref``, default its first entry), plus: each with ``ref``'s shape, and with ``distinct``
    no array twice (the multi-array forms write each entry as its own "device")."""
    if isinstance(arrays, (list, tuple)) and length is not None and len(arrays) != length:
        raise ValueError(f"{prefix(op)} {arg} must hold one array per group rank: expected {length}, got {len(arrays)}")
    out = array_list(arrays, op, arg, None, writable, dtype_of=None if ref is None else (ref, ref_arg))
    if ref is None:
        ref, ref_arg = out[0], f"{arg}[0]"
    for i, x in enumerate(out):
        if x.shape != ref.shape:
            raise ValueError(
                f"{prefix(op)} {arg}[{i}] has shape {x.shape}, expected the shape of {ref_arg} {ref.shape}"
            )
    if distinct and len({id(x) for x in out}) != len(out):
        raise ValueError(
            f"{prefix(op)} {arg} holds the same array more than once; expected distinct arrays (one per device)"
        )
    return out


def _avg(arr: np.ndarray, op: Op, count: int) -> None:
    if op is ReduceOp.AVG:
        arr /= count


# -- reduce ----------------------------------------------------------------------------------
def _reduce(g: ProcessGroup, arr: np.ndarray, op: Op, root: int, contributions: int) -> None:
    """MPI_Reduce of ``arr`` to group rank ``root``, in place there (MPI_IN_PLACE)."""
    dt = mpi_datatype(arr.dtype)
    if g.rank() == root:
        op, _ = scaled(op, arr, arr)
        g.comm.Reduce(MPI.IN_PLACE, [arr, dt], to_mpi_op(op, arr.dtype), root)  # type: ignore[union-attr]  # a member's comm (None on non-members only)
        _avg(arr, op, contributions)
    else:
        op, send = scaled(op, arr)
        g.comm.Reduce([send, dt], None, to_mpi_op(op, arr.dtype), root)  # type: ignore[union-attr]  # a member's comm (None on non-members only)


def reduce(
    tensor: np.ndarray, dst: Optional[int], op: Op, g: ProcessGroup, async_op: bool, group_dst: Optional[int] = None
) -> Optional[Work]:
    """The MPI backend's :func:`mpidist.reduce`."""
    name = "reduce"
    root = root_rank(g, dst, group_dst, name, "dst", "group_dst")
    arr = host_array(tensor, name, "tensor", writable=g.rank() == root)
    op = check_op_dtype(op, arr.dtype, prefix(name))
    return launch(
        g,
        name,
        _reduce,
        (g, arr, op, root, g.size()),
        async_op,
        (tensor,),
        shapes=arr.shape,
        dtype=arr.dtype,
        root=g.ranks[root],
        count=arr.size,
        redop=op,
    )


# -- reduce_scatter ----------------------------------------------------------------------------
def _reduce_scatter_block(g: ProcessGroup, send: np.ndarray, out: np.ndarray, op: ReduceOp) -> None:
    """MPI_Reduce_scatter_block: block r of ``send`` (reduced over ranks) lands in rank r's
    ``out``. ``op`` is a ReduceOp (a premul factor was applied to ``send`` already)."""
    dt = mpi_datatype(out.dtype)
    g.comm.Reduce_scatter_block([send, dt], [out, dt], to_mpi_op(op, out.dtype))  # type: ignore[union-attr]  # a member's comm (None on non-members only)
    _avg(out, op, g.size())


def _reduce_scatter_list(g: ProcessGroup, out: np.ndarray, inputs: list, op: Op) -> None:
    send = np.empty((len(inputs), out.size), out.dtype)
    base = op
    for block, x in zip(send, inputs):  # one copy into the send buffer, scaled on the way
        base, src = scaled(op, x.reshape(-1), block)
        if src is not block:
            block[...] = src
    _reduce_scatter_block(g, send, out, base)  # type: ignore[arg-type]  # from scaled: inputs holds g.size() >= 1 arrays


def _reduce_scatter_tensor(g: ProcessGroup, out: np.ndarray, inp: np.ndarray, op: Op) -> None:
    base, send = scaled(op, inp)  # a premul sum scales into a new array, never the caller's
    if send is inp and np.may_share_memory(out, inp):
        # MPI forbids overlapping send and receive buffers; torch allows ``output`` to be
        # a view of ``input`` (the in-place form).
        send = inp.copy()
    _reduce_scatter_block(g, send, out, base)


def reduce_scatter(
    output: np.ndarray, input_list: Sequence[np.ndarray], op: Op, g: ProcessGroup, async_op: bool
) -> Optional[Work]:
    """The MPI backend's :func:`mpidist.reduce_scatter`."""
    name = "reduce_scatter"
    out = host_array(output, name, "output", writable=True)
    inputs = _array_list(input_list, name, "input_list", writable=False, length=g.size(), ref=out, ref_arg="output")
    op = check_op_dtype(op, out.dtype, prefix(name))
    return launch(
        g,
        name,
        _reduce_scatter_list,
        (g, out, inputs, op),
        async_op,
        (output,),
        shapes=out.shape,
        dtype=out.dtype,
        count=out.size,
        redop=op,
    )


def reduce_scatter_tensor(
    output: np.ndarray,
    input: np.ndarray,
    op: Op,
    g: ProcessGroup,  # noqa: A002
    async_op: bool,
) -> Optional[Work]:
    """The MPI backend's :func:`mpidist.reduce_scatter_tensor`."""
    name = "reduce_scatter_tensor"
    out = host_array(output, name, "output", writable=True)
    inp = host_array(input, name, "input", writable=False)
    group_blocks(out, inp, g.size(), name, "output", "input", gather=False)
    op = check_op_dtype(op, out.dtype, prefix(name))
    return launch(
        g,
        name,
        _reduce_scatter_tensor,
        (g, out, inp, op),
        async_op,
        (output,),
        shapes=inp.shape,
        dtype=out.dtype,
        count=out.size,
        redop=op,
    )


# -- the seeds' multi-array ("multigpu") forms ------------------------------------------------
# One process holding several arrays stands for one process driving several devices:
# the arrays are reduced locally in list order, then across ranks.
def _local_reduce_list(op: Op, acc: np.ndarray, others: list) -> Op:
    """``acc = acc op others[0] op others[1] ...`` in place (each pre-multiplied for a
    premul sum); return the op for the cross-rank step. Only ``acc`` (and one scratch
    array, for a premul sum) is written."""
    base, _ = scaled(op, acc, acc)
    scratch = None
    for x in others:
        if base is not op:  # premul sum: add factor * x
            _, scratch = scaled(op, x, scratch)
            x = scratch
        local_reduce(base, acc, x)
    return base


def _all_reduce_multi(g: ProcessGroup, arrays: list, op: Op) -> None:
    acc, others = arrays[0], arrays[1:]
    base = _local_reduce_list(op, acc, others)
    all_reduce_body(g, acc, ReduceOp.SUM if base is ReduceOp.AVG else base)
    _avg(acc, base, g.size() * len(arrays))
    for x in others:
        np.copyto(x, acc)


def _reduce_multi(g: ProcessGroup, arrays: list, op: Op, root: int, dst_tensor: int) -> None:
    if g.rank() == root:
        acc = arrays[dst_tensor]
        others = arrays[:dst_tensor] + arrays[dst_tensor + 1 :]
    elif len(arrays) == 1:
        acc, others = arrays[0], []  # _reduce leaves a non-root's array unchanged
    else:
        acc, others = arrays[0].copy(), arrays[1:]
    base = _local_reduce_list(op, acc, others) if others else op
    _reduce(g, acc, base, root, g.size() * len(arrays))


def all_reduce_multigpu(tensor_list: Sequence[np.ndarray], op: Op, g: ProcessGroup, async_op: bool) -> Optional[Work]:
    """The MPI backend's :func:`mpidist.all_reduce_multigpu`."""
    name = "all_reduce_multigpu"
    arrays = _array_list(tensor_list, name, "tensor_list", writable=True, distinct=True)
    op = check_op_dtype(op, arrays[0].dtype, prefix(name))
    return launch(
        g,
        name,
        _all_reduce_multi,
        (g, arrays, op),
        async_op,
        tuple(tensor_list),
        shapes=[a.shape for a in arrays],
        dtype=arrays[0].dtype,
        count=arrays[0].size,
        redop=op,
        layout=(len(arrays),),
    )


def reduce_multigpu(
    tensor_list: Sequence[np.ndarray],
    dst: Optional[int],
    op: Op,
    g: ProcessGroup,
    async_op: bool,
    dst_tensor: int,
    group_dst: Optional[int] = None,
) -> Optional[Work]:
    """The MPI backend's :func:`mpidist.reduce_multigpu`."""
    name = "reduce_multigpu"
    root = root_rank(g, dst, group_dst, name, "dst", "group_dst")
    arrays = _array_list(tensor_list, name, "tensor_list", writable=False, distinct=True)
    if not isinstance(dst_tensor, (int, np.integer)) or isinstance(dst_tensor, bool):
        raise TypeError(f"{prefix(name)} dst_tensor must be an int, got {type(dst_tensor).__name__}")
    if not 0 <= dst_tensor < len(arrays):
        raise ValueError(
            f"{prefix(name)} dst_tensor={dst_tensor} is out of range for tensor_list of length {len(arrays)}"
        )
    if g.rank() == root:
        host_array(arrays[dst_tensor], name, f"tensor_list[{dst_tensor}]", writable=True)
    op = check_op_dtype(op, arrays[0].dtype, prefix(name))
    return launch(
        g,
        name,
        _reduce_multi,
        (g, arrays, op, root, int(dst_tensor)),
        async_op,
        tuple(tensor_list),
        shapes=[a.shape for a in arrays],
        dtype=arrays[0].dtype,
        root=g.ranks[root],
        count=arrays[0].size,
        redop=op,
        layout=(len(arrays),),
    )
