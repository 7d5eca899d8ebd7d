"""torch's coalesced collectives, all_reduce_coalesced and all_gather_coalesced: several
arrays in one collective (one MPI collective and one Work per call). torch 2.13 says they
"will be deprecated": the public ``mpidist.all_reduce_coalesced`` /
``mpidist.all_gather_coalesced`` warn as torch's do (:mod:`mpidist._deprecated`); these do
not. Bodies: :mod:`mpidist._backends.mpi.coalesced` (routing: :mod:`mpidist._public_op`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import numpy as np

from mpidist._arrays.reduce_op import ReduceOp
from mpidist._backends.mpi import coalesced as H
from mpidist._backends.mpi.collectives import Op
from mpidist._core.group import ProcessGroup
from mpidist._public_op import public_op
from mpidist.work import Work

__all__ = ["all_reduce_coalesced", "all_gather_coalesced"]


@public_op(H.all_reduce_coalesced)
def _all_reduce_coalesced(
    tensors: Sequence[Any], op: Op, group: Optional[ProcessGroup], async_op: bool
) -> Optional[Work]:
    """all_reduce_coalesced on a list (:mod:`mpidist._public_op`)."""


def all_reduce_coalesced(
    tensors: Any, op: Op = ReduceOp.SUM, group: Optional[ProcessGroup] = None, async_op: bool = False
) -> Optional[Work]:
    """all_reduce of every array of ``tensors`` in one collective (torch.distributed.all_reduce_coalesced).

    Args:
        tensors: a list of C-contiguous, writable arrays of one dtype (shapes may differ),
            or one array; the same list (lengths, shapes, dtype) on every rank (not
            checked across ranks, as torch warns). Each is overwritten on every member
            with its reduction, bitwise identical everywhere.
        op: a :class:`ReduceOp` or ``make_premul_sum(factor)``, as all_reduce's.
        group: the process group (default: all ranks); non-members return None.
        async_op: return a :class:`Work` (torch's code returns the work's future, though
            its docstring promises the work handle; ``Work.get_future()`` gives one).

    The arrays are packed into one buffer and all-reduced by all_reduce's own body, then
    unpacked: one MPI collective, one extra copy of the data each way. Device arrays:
    staged through host memory on MPI backends; NCCL groups raise ValueError (use
    all_reduce per array there).

    Raises:
        TypeError: not arrays, or dtypes differ.
        ValueError: an empty list, an op the dtype does not support, a read-only or
            non-contiguous array.
    """
    if not isinstance(tensors, (list, tuple)):
        tensors = [tensors]
    return _all_reduce_coalesced(tensors, op, group, async_op)


@public_op(H.all_gather_coalesced)
def all_gather_coalesced(
    output_tensor_lists: Sequence[Sequence[np.ndarray]],
    input_tensor_list: Sequence[np.ndarray],
    group: Optional[ProcessGroup] = None,
    async_op: bool = False,
) -> Optional[Work]:
    """all_gather of several arrays per rank in one collective (torch.distributed.all_gather_coalesced).

    Args:
        output_tensor_lists: one list per group rank ``k``, each of
            ``len(input_tensor_list)`` C-contiguous, writable arrays:
            ``output_tensor_lists[k][j]`` receives group rank ``k``'s
            ``input_tensor_list[j]`` (same number of elements; this rank's own row must
            have its inputs' shapes). Overwritten on every member.
        input_tensor_list: this rank's arrays, one dtype (the outputs' too), any shapes;
            the same count on every rank. Read only.
        group: the process group (default: all ranks); non-members return None.
        async_op: return a :class:`Work` (torch's code returns the work's future).

    One MPI_Allgather(v) of each rank's packed inputs (the body of all_gather_multigpu).
    Device arrays: staged through host memory on MPI backends; NCCL groups raise
    ValueError.

    Raises:
        TypeError: not lists or arrays, or dtypes differ.
        ValueError: list lengths other than the group size and ``len(input_tensor_list)``,
            own-row shapes that differ from the inputs', read-only or non-contiguous
            outputs.
    """
