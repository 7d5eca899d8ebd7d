"""The MPI backend's all_reduce_coalesced and all_gather_coalesced (:mod:`mpidist._coalesced`):
built on the bodies of all_reduce and all_gather_multigpu.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import numpy as np

from mpidist._arrays.buffers import array_list
from mpidist._arrays.reduce_op import check_op_dtype
from mpidist._backends.mpi.collectives import Op, all_reduce_body
from mpidist._backends.mpi.gather_scatter import gather_slots, output_lists
from mpidist._core.group import ProcessGroup
from mpidist._dispatch.dispatch import launch
from mpidist.errors import prefix
from mpidist.work import Work

__all__ = ["all_reduce_coalesced", "all_gather_coalesced"]


def _all_reduce_packed(g: ProcessGroup, arrays: list, op: Op) -> None:
    """all_reduce of several arrays as one: packed into one buffer, reduced by
    all_reduce's body (so with its algorithm choice for the total size), unpacked."""
    if len(arrays) == 1:
        all_reduce_body(g, arrays[0], op)
        return
    flat = np.concatenate([a.reshape(-1) for a in arrays])
    all_reduce_body(g, flat, op)
    start = 0
    for a in arrays:
        a.reshape(-1)[...] = flat[start : start + a.size]
        start += a.size


def all_reduce_coalesced(tensors: Any, op: Op, g: ProcessGroup, async_op: bool) -> Optional[Work]:
    """The MPI backend's :func:`mpidist.all_reduce_coalesced`."""
    name = "all_reduce_coalesced"
    arrays = array_list(tensors, name, "tensors", None, True)
    op = check_op_dtype(op, arrays[0].dtype, prefix(name))
    return launch(
        g,
        name,
        _all_reduce_packed,
        (g, arrays, op),
        async_op,
        tuple(tensors),
        shapes=[a.shape for a in arrays],
        dtype=arrays[0].dtype,
        count=sum(a.size for a in arrays),
        redop=op,
    )


def all_gather_coalesced(
    output_tensor_lists: Sequence[Sequence[np.ndarray]],
    input_tensor_list: Sequence[np.ndarray],
    g: ProcessGroup,
    async_op: bool,
) -> Optional[Work]:
    """The MPI backend's :func:`mpidist.all_gather_coalesced`."""
    name = "all_gather_coalesced"
    inps = array_list(input_tensor_list, name, "input_tensor_list", None, False)
    rows = output_lists(
        output_tensor_lists,
        name,
        inps,
        g.size(),
        "one list per group rank",
        len(inps),
        "len(input_tensor_list)",
        (g.rank(), 0),
    )
    results = tuple(a for lst in output_tensor_lists for a in lst)
    return gather_slots(g, name, inps, [a for row in rows for a in row], async_op, results)
