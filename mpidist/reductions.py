"""Reducing collectives besides all_reduce: reduce, reduce_scatter, reduce_scatter_tensor
(and torch 2.13's reduce_scatter_single), the seeds' multi-array forms all_reduce_multigpu /
reduce_multigpu, make_premul_sum and supports_complex.

Same names, arguments and semantics as torch.distributed. ``dst`` is a global rank. A rank
outside ``group`` returns None and touches nothing; sync calls return None,
``async_op=True`` a :class:`~mpidist.Work`. Bodies (dtypes, AVG):
:mod:`mpidist._backends.mpi.reductions` (routing: :mod:`mpidist._public_op`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import numpy as np

from mpidist._arrays.reduce_op import ReduceOp, check_op_dtype, make_premul_sum
from mpidist._backends.mpi import reductions as H
from mpidist._backends.mpi.collectives import Op
from mpidist._core.group import ProcessGroup
from mpidist._public_op import public_op
from mpidist.errors import prefix
from mpidist.work import Work

__all__ = [
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "all_reduce_multigpu",
    "reduce_multigpu",
    "make_premul_sum",
    "supports_complex",
]


@public_op(H.reduce)
def reduce(
    tensor: np.ndarray,
    dst: Optional[int] = None,
    op: Op = ReduceOp.SUM,
    group: Optional[ProcessGroup] = None,
    async_op: bool = False,
    group_dst: Optional[int] = None,
) -> Optional[Work]:
    """Reduce ``tensor`` across the group into ``tensor`` on the destination (MPI_Reduce).

    Args:
        tensor: C-contiguous numpy array, same shape and dtype on every rank. Only
            ``dst``'s is overwritten (with the reduction; it must be writable); the
            others' are left unchanged, also for PREMUL_SUM and AVG.
        dst: global rank that receives the result; must be a member of ``group``.
        op: a :class:`ReduceOp` or ``make_premul_sum(factor)``; see all_reduce for which
            ops each dtype supports.
        group: the process group (default: all ranks).
        async_op: return a :class:`Work` instead of blocking.
        group_dst: the destination as a rank in ``group`` instead (torch 2.4+); exactly
            one of ``dst`` and ``group_dst`` must be given.

    Returns:
        None, or a Work when ``async_op`` (None on non-members).

    Raises:
        TypeError / ValueError: bad array, op/dtype pair, ``dst`` not an int member
            rank, both or neither of ``dst``/``group_dst``.
        DistBackendError: MPI reported an error.

    Source: torch.distributed.reduce; MPI-4.1 §6.9.1 (MPI_Reduce, MPI_IN_PLACE at root).
    """


@public_op(H.reduce_scatter)
def reduce_scatter(
    output: np.ndarray,
    input_list: Sequence[np.ndarray],
    op: Op = ReduceOp.SUM,
    group: Optional[ProcessGroup] = None,
    async_op: bool = False,
) -> Optional[Work]:
    """Reduce ``input_list[r]`` over all ranks into group rank ``r``'s ``output``.

    Args:
        output: C-contiguous, writable array; overwritten on every member rank with the
            reduction of every rank's ``input_list[group_rank]``.
        input_list: list of ``group size`` arrays, each with ``output``'s shape and dtype;
            left unchanged (they are copied into one contiguous send buffer).
        op: a :class:`ReduceOp` or ``make_premul_sum(factor)``.
        group, async_op: as in all_reduce.

    Raises:
        TypeError: ``input_list`` is not a list, or a dtype differs from ``output``'s.
        ValueError: wrong list length or shape; unsupported op/dtype pair.
        DistBackendError: MPI reported an error.

    Source: torch.distributed.reduce_scatter; MPI-4.1 §6.10.1 (MPI_Reduce_scatter_block).
    """


@public_op(H.reduce_scatter_tensor)
def reduce_scatter_tensor(
    output: np.ndarray,
    input: np.ndarray,
    op: Op = ReduceOp.SUM,  # noqa: A002
    group: Optional[ProcessGroup] = None,
    async_op: bool = False,
) -> Optional[Work]:
    """Reduce ``input`` over all ranks and scatter it: group rank ``r`` gets block ``r``.

    Args:
        output: C-contiguous, writable array of any shape; overwritten on every member.
        input: ``group size * output.size`` elements of ``output``'s dtype, the blocks in
            group-rank order: concatenated along dim 0 (shape ``(W*d0, ...)``) or stacked
            (shape ``(W, *output.shape)``), as torch allows. Left unchanged. ``output``
            may be a view of ``input`` (torch's in-place form): ``input`` is then copied.
        op: a :class:`ReduceOp` or ``make_premul_sum(factor)``.
        group, async_op: as in all_reduce.

    Raises:
        TypeError: dtypes differ.
        ValueError: ``input`` has the wrong size; unsupported op/dtype pair.
        DistBackendError: MPI reported an error.

    Source: torch.distributed.reduce_scatter_tensor; MPI-4.1 §6.10.1 (MPI_Reduce_scatter_block).
    """


@public_op(H.all_reduce_multigpu)
def all_reduce_multigpu(
    tensor_list: Sequence[np.ndarray],
    op: Op = ReduceOp.SUM,
    group: Optional[ProcessGroup] = None,
    async_op: bool = False,
) -> Optional[Work]:
    """All-reduce over every array of every rank's ``tensor_list``; each array gets the result.

    The seeds' multi-GPU form: in torch each array sits on its own GPU. Here a process
    may pass several host arrays, each standing for one "device": they are reduced
    locally in list order, then across ranks (as all_reduce), and the result, bitwise
    identical everywhere, is copied into every array of every rank's list. AVG divides
    by the number of arrays in the whole group (group size * len(tensor_list)).

    Args:
        tensor_list: non-empty list of distinct, writable, C-contiguous arrays of one
            shape and dtype; the same length, shape and dtype on every rank.
        op: a :class:`ReduceOp` or ``make_premul_sum(factor)``.
        group, async_op: as in all_reduce.

    Raises:
        TypeError: not a list, or dtypes differ.
        ValueError: empty list, shapes differ, an array repeated, unsupported op/dtype
            pair.
        DistBackendError: MPI error.

    Source: torch.distributed.all_reduce_multigpu (torch <= 2.1; removed since).
    """


@public_op(H.reduce_multigpu)
def reduce_multigpu(
    tensor_list: Sequence[np.ndarray],
    dst: Optional[int] = None,
    op: Op = ReduceOp.SUM,
    group: Optional[ProcessGroup] = None,
    async_op: bool = False,
    dst_tensor: int = 0,
    group_dst: Optional[int] = None,
) -> Optional[Work]:
    """Reduce every array of every rank's ``tensor_list`` into ``tensor_list[dst_tensor]``
    on global rank ``dst``.

    The seeds' multi-GPU form (see :func:`all_reduce_multigpu`: one process, several
    arrays = several "devices"). Only ``tensor_list[dst_tensor]`` on ``dst`` changes;
    every other array, on every rank, is left unchanged. AVG divides by group size *
    len(tensor_list).

    Args:
        tensor_list: non-empty list of distinct C-contiguous arrays of one shape and
            dtype; the same length, shape and dtype on every rank.
        dst: global rank that receives the result.
        op: a :class:`ReduceOp` or ``make_premul_sum(factor)``.
        group, async_op: as in reduce.
        dst_tensor: index in ``dst``'s ``tensor_list`` of the array that receives it.
        group_dst: the destination as a rank in ``group`` instead of ``dst`` (as torch
            2.4+'s reduce); exactly one of them.

    Raises:
        TypeError: not a list, dtypes differ, ``dst``/``dst_tensor`` not an int.
        ValueError: empty list, shapes differ, an array repeated, ``dst_tensor`` out of
            range, ``dst`` not a member, unsupported op/dtype pair.
        DistBackendError: MPI error.

    Source: torch.distributed.reduce_multigpu (torch <= 2.1; removed since).
    """


def reduce_scatter_single(
    output: np.ndarray,
    input: np.ndarray,
    op: Op = ReduceOp.SUM,  # noqa: A002
    group: Optional[ProcessGroup] = None,
    async_op: bool = False,
) -> Optional[Work]:
    """torch 2.13's name for :func:`reduce_scatter_tensor`, which torch 2.13 deprecates
    (``mpidist.reduce_scatter_tensor`` warns as torch's does; this module's does not):
    the same arguments, semantics and errors."""
    return reduce_scatter_tensor(output, input, op, group, async_op)


def supports_complex(reduceOp: Op) -> bool:  # noqa: N803  (torch's argument name)
    """Whether ``reduceOp`` reduces complex arrays here (torch.distributed.supports_complex):
    SUM, AVG, PRODUCT and PREMUL_SUM do; MIN, MAX and the bitwise ops do not. torch also
    says False for PRODUCT, which mpidist computes on complex values (MPI_PROD).

    Raises:
        TypeError: not a ReduceOp (or a premul sum).
    """
    try:
        check_op_dtype(reduceOp, np.dtype(np.complex64), prefix("supports_complex"))
    except ValueError:
        return False
    return True
