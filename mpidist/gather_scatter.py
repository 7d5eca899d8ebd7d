"""Data-movement collectives: all_gather, gather, scatter, all-to-all (torch.distributed semantics).

Shared rules, as in torch.distributed: src/dst are global ranks even with a group; a
rank not in ``group`` returns None and leaves every buffer alone; sync calls return
None and ``async_op=True`` returns a :class:`Work` whose ``result()`` lists the arrays
written on this rank. All arrays of one call must share one dtype. Sizes that depend
on other ranks (rank i's slot must match rank i's input) cannot be checked locally;
as in torch they are the caller's contract: a receive slot too small for what
arrives raises ValueError (MPI_ERR_TRUNCATE), one too large is left partly unwritten.
A call on host arrays goes to the MPI backend's body of the same name
(:mod:`mpidist._backends.mpi.gather_scatter`, which says how lists travel in one vector collective);
one on device arrays to the router (:mod:`mpidist._backends.device.route`).
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from mpidist._backends.mpi import gather_scatter as H
from mpidist._core.group import ProcessGroup
from mpidist._public_op import public_op
from mpidist.work import Work

__all__ = [
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "gather",
    "scatter",
    "all_to_all",
    "all_to_all_single",
    "broadcast_multigpu",
    "all_gather_multigpu",
]


@public_op(H.all_gather)
def all_gather(
    tensor_list: list[np.ndarray], tensor: np.ndarray, group: Optional[ProcessGroup] = None, async_op: bool = False
) -> Optional[Work]:
    """Gather every member's ``tensor`` into ``tensor_list`` on every member (MPI_Allgatherv).

    Args:
        tensor_list: ``group_size`` C-contiguous, writable arrays of ``tensor``'s dtype;
            ``tensor_list[i]`` receives group rank i's ``tensor`` and must hold exactly
            as many elements (sizes may differ between ranks, as torch allows; its shape
            is free, the data arrive in C order). ``tensor_list[my_group_rank]`` must
            have ``tensor``'s shape. Overwritten on every member; nothing else changes.
            If the arrays lie back to back in memory (e.g. ``list(out)`` of a stacked
            ``out``), MPI writes them directly, else through one staging buffer.
        tensor: this rank's input, any shape; read only (it may be ``tensor_list[rank]``).
        group: the process group (default: all ranks).
        async_op: return a :class:`Work` instead of blocking.

    Returns:
        None, or a Work (``result()`` is ``tensor_list``) when ``async_op``; None on non-members.

    Raises:
        TypeError: a non-array, or dtypes differ.
        ValueError: ``len(tensor_list)`` is not the group size, an output is
            non-contiguous or read-only, or ``tensor_list[my_group_rank]`` has another
            shape than ``tensor``.

    Source: torch.distributed.all_gather; MPI-4.1 §6.7 (MPI_Allgatherv).
    """


@public_op(H.all_gather_into_tensor)
def all_gather_into_tensor(
    output_tensor: np.ndarray, input_tensor: np.ndarray, group: Optional[ProcessGroup] = None, async_op: bool = False
) -> Optional[Work]:
    """Gather every rank's ``input_tensor`` into ``output_tensor`` on every rank (MPI_Allgather).

    ``output_tensor`` holds ``world_size * input_tensor.size`` elements of the same
    dtype, in group-rank order: either concatenated along dim 0 (shape
    ``(W*d0, ...)``) or stacked (shape ``(W, *input.shape)``), as torch allows.
    Only ``output_tensor`` changes. ``input_tensor`` may be this rank's own chunk of
    ``output_tensor`` (MPI_IN_PLACE); any other overlap is handled by sending a copy.

    Raises:
        TypeError: dtypes differ.
        ValueError: ``output_tensor`` has the wrong size.

    Source: torch.distributed.all_gather_into_tensor; MPI-4.1 §6.7 (MPI_Allgather).
    """


@public_op(H.gather)
def gather(
    tensor: np.ndarray,
    gather_list: Optional[list[np.ndarray]] = None,
    dst: Optional[int] = None,
    group: Optional[ProcessGroup] = None,
    async_op: bool = False,
    group_dst: Optional[int] = None,
) -> Optional[Work]:
    """Gather every member's ``tensor`` into ``gather_list`` on the destination (MPI_Gatherv).

    Args:
        tensor: this rank's input, any shape; read only. Sizes may differ between ranks.
        gather_list: on ``dst`` only: ``group_size`` C-contiguous, writable arrays of
            ``tensor``'s dtype; ``gather_list[i]`` receives group rank i's ``tensor``
            (same element count; ``gather_list[dst's group rank]`` must have
            ``tensor``'s shape). Must be None (or empty) on every other rank.
            Only ``dst``'s ``gather_list`` changes.
        dst: global rank of the destination, a member of ``group``.
        group: the process group (default: all ranks).
        async_op: return a :class:`Work` instead of blocking.
        group_dst: the destination as a rank in ``group`` instead (torch 2.4+). At most
            one of ``dst`` and ``group_dst``; neither means global rank 0, as torch.

    Returns:
        None, or a Work when ``async_op`` (``result()`` is ``gather_list`` on ``dst``,
        empty elsewhere); None on non-members.

    Raises:
        ValueError: ``dst`` not in the group, both ``dst`` and ``group_dst`` given;
            ``gather_list`` missing on ``dst`` or given on another rank (as torch); wrong
            length, shape, or a read-only or non-contiguous output.
        TypeError: non-arrays or differing dtypes.

    Source: torch.distributed.gather; MPI-4.1 §6.5 (MPI_Gatherv).
    """


@public_op(H.scatter)
def scatter(
    tensor: np.ndarray,
    scatter_list: Optional[list[np.ndarray]] = None,
    src: Optional[int] = None,
    group: Optional[ProcessGroup] = None,
    async_op: bool = False,
    group_src: Optional[int] = None,
) -> Optional[Work]:
    """Send ``scatter_list[i]`` from the source to group rank i's ``tensor`` (MPI_Scatterv).

    Args:
        tensor: C-contiguous, writable output, any shape; overwritten on every member
            (``src`` included) with its part. Sizes may differ between ranks.
        scatter_list: on ``src`` only: ``group_size`` arrays of ``tensor``'s dtype, read
            only; ``scatter_list[i]`` must have as many elements as group rank i's
            ``tensor``, and ``scatter_list[src's group rank]`` ``tensor``'s shape. Must be
            None (or empty) on every other rank.
        src: global rank of the source, a member of ``group``.
        group: the process group (default: all ranks).
        async_op: return a :class:`Work` instead of blocking.
        group_src: the source as a rank in ``group`` instead (torch 2.4+). At most one
            of ``src`` and ``group_src``; neither means global rank 0, as torch.

    Returns:
        None, or a Work (``result()`` is ``[tensor]``) when ``async_op``; None on non-members.

    Raises:
        ValueError: ``src`` not in the group, both ``src`` and ``group_src`` given;
            ``scatter_list`` missing on ``src`` or given on another rank (as torch); wrong
            length or shape; ``tensor`` read-only or non-contiguous.
        TypeError: non-arrays or differing dtypes.

    Source: torch.distributed.scatter; MPI-4.1 §6.6 (MPI_Scatterv).
    """


@public_op(H.all_to_all)
def all_to_all(
    output_tensor_list: list[np.ndarray],
    input_tensor_list: list[np.ndarray],
    group: Optional[ProcessGroup] = None,
    async_op: bool = False,
) -> Optional[Work]:
    """Send ``input_tensor_list[i]`` to group rank i; receive rank i's into ``output_tensor_list[i]``.

    Args:
        output_tensor_list: ``group_size`` C-contiguous, writable arrays; entry i must
            hold as many elements as group rank i sends this rank (sizes may differ, as
            torch allows). Overwritten on every member.
        input_tensor_list: ``group_size`` arrays of the same dtype, read only;
            ``input_tensor_list[my_rank]`` and ``output_tensor_list[my_rank]`` must have
            the same size.
        group: the process group (default: all ranks).
        async_op: return a :class:`Work` instead of blocking.

    One MPI_Alltoallv; lists already back to back in memory are used in place, others
    are packed into / unpacked from one staging buffer.

    Returns:
        None, or a Work (``result()`` is ``output_tensor_list``) when ``async_op``; None on
        non-members.

    Raises:
        TypeError: non-arrays or differing dtypes.
        ValueError: a list length is not the group size; an output is read-only or
            non-contiguous; this rank's own parts differ in size.

    Source: torch.distributed.all_to_all; MPI-4.1 §6.8 (MPI_Alltoallv).
    """


@public_op(H.all_to_all_single)
def all_to_all_single(
    output: np.ndarray,
    input: np.ndarray,
    output_split_sizes: Optional[list[int]] = None,
    input_split_sizes: Optional[list[int]] = None,
    group: Optional[ProcessGroup] = None,
    async_op: bool = False,
) -> Optional[Work]:
    """Split ``input`` along dim 0, send part i to group rank i, concatenate what arrives in ``output``.

    Args:
        output: C-contiguous, writable array of ``input``'s dtype, at least 1-d;
            overwritten on every member. Its rows ``output_split_sizes`` (or
            ``output.shape[0] / group_size`` each when None or empty) come from group
            ranks 0, 1, ... in order.
        input: array, at least 1-d, read only; rows ``input_split_sizes[i]`` (or
            ``input.shape[0] / group_size`` each) go to group rank i.
        output_split_sizes / input_split_sizes: ``group_size`` non-negative ints summing
            to ``output.shape[0]`` / ``input.shape[0]``; None or empty means equal splits,
            and then dim 0 must be divisible by the group size. Counts are
            ``split * row size`` (the product of the other dims), so the part for this
            rank must have the same element count in ``input`` and ``output``.
        group: the process group (default: all ranks).
        async_op: return a :class:`Work` instead of blocking.

    ``input`` may overlap ``output``: it is then copied before MPI_Alltoallv runs.

    Returns:
        None, or a Work (``result()`` is ``[output]``) when ``async_op``; None on non-members.

    Raises:
        TypeError: non-arrays, dtypes differ, split sizes not a list of ints.
        ValueError: 0-d arrays, dim 0 not divisible, split sizes of the wrong length,
            negative or not summing to dim 0, this rank's own parts of different sizes,
            ``output`` read-only or non-contiguous.

    Source: torch.distributed.all_to_all_single; MPI-4.1 §6.8 (MPI_Alltoallv).
    """


@public_op(H.broadcast_multigpu)
def broadcast_multigpu(
    tensor_list: list[np.ndarray],
    src: Optional[int] = None,
    group: Optional[ProcessGroup] = None,
    async_op: bool = False,
    src_tensor: int = 0,
    group_src: Optional[int] = None,
) -> Optional[Work]:
    """Broadcast ``tensor_list[src_tensor]`` of global rank ``src`` into every array of every member.

    Host-only reading of torch's (removed) ``broadcast_multigpu``: each array of
    ``tensor_list`` stands for one "device" of this process. On ``src``,
    ``tensor_list[src_tensor]`` is sent (MPI_Bcast) and copied into the other arrays
    of ``src``'s list; on every other member the data arrive in ``tensor_list[0]`` and
    are copied into the rest. All arrays, on every rank, have the same number of
    elements and one dtype; ``len(tensor_list)`` must be the same on every rank (as in
    torch). Every array changes except ``tensor_list[src_tensor]`` on ``src``.
    ``group_src`` names the source as a rank in ``group`` instead of ``src`` (as torch
    2.4+'s broadcast); exactly one of them.

    Raises:
        TypeError: non-arrays, differing dtypes, ``src``/``src_tensor`` not ints.
        ValueError: ``src`` not in the group, both or neither of ``src``/``group_src``,
            an empty list, ``src_tensor`` out of range, arrays of different sizes, a
            read-only or non-contiguous array.

    Source: torch.distributed.broadcast_multigpu (torch <= 2.1 docs); MPI-4.1 §6.4 (MPI_Bcast).
    """


@public_op(H.all_gather_multigpu)
def all_gather_multigpu(
    output_tensor_lists: list[list[np.ndarray]],
    input_tensor_list: list[np.ndarray],
    group: Optional[ProcessGroup] = None,
    async_op: bool = False,
) -> Optional[Work]:
    """all_gather where each process plays ``L = len(input_tensor_list)`` devices (seeds' form).

    Host-only reading of torch's (removed) ``all_gather_multigpu``: the process holds one
    input per "device", ``input_tensor_list[j]``, and one output list per device,
    ``output_tensor_lists[j]``; every device receives every device's input. With
    ``W`` the group size, each ``output_tensor_lists[i]`` holds ``W * L`` arrays and
    ``input_tensor_list[j]`` of group rank ``k`` lands in
    ``output_tensor_lists[i][k * L + j]`` for every ``i`` (devices are numbered rank-major,
    as NCCL numbered them; torch's docstring printed ``k * world_size + j``, which is
    the same only when ``L == W``). ``len(input_tensor_list)`` must be the same on
    every rank. All arrays share one dtype; slot ``s`` of every output list has the
    same shape, and slot ``my_rank * L + j`` has ``input_tensor_list[j]``'s shape.
    Every output array changes on every member; the inputs do not.

    One MPI_Allgatherv fills ``output_tensor_lists[0]``; the other lists are copies.

    Raises:
        TypeError: a non-list or non-array, dtypes differ.
        ValueError: wrong list lengths, shapes as above, non-contiguous or read-only
            outputs.

    Source: torch.distributed.all_gather_multigpu (torch <= 2.1 docs); MPI-4.1 §6.7.
    """


def all_gather_single(
    output_tensor: np.ndarray, input_tensor: np.ndarray, group: Optional[ProcessGroup] = None, async_op: bool = False
) -> Optional[Work]:
    """torch 2.13's name for :func:`all_gather_into_tensor`, which torch 2.13 deprecates
    (``mpidist.all_gather_into_tensor`` warns as torch's does; this module's does not):
    the same arguments, semantics and errors."""
    return all_gather_into_tensor(output_tensor, input_tensor, group, async_op)
