"""Data-movement collectives: all_gather, gather, scatter, all-to-all (torch.distributed semantics)."""
from __future__ import annotations

from typing import Optional

import numpy as np

from mpidist._buffers import host_array, mpi_datatype, same_dtype
from mpidist._dispatch import launch, member
from mpidist.errors import prefix
from mpidist.group import ProcessGroup
from mpidist.work import Work

__all__ = ["all_gather_into_tensor"]


def all_gather_into_tensor(output_tensor: np.ndarray, input_tensor: np.ndarray,
                           group: Optional[ProcessGroup] = None, async_op: bool = False) -> Optional[Work]:
    """Gather every rank's ``input_tensor`` into ``output_tensor`` on every rank (MPI_Allgather).

    ``output_tensor`` holds ``world_size * input_tensor.size`` elements of the same
    dtype, in group-rank order: either concatenated along dim 0 (shape
    ``(W*d0, ...)``) or stacked (shape ``(W, *input.shape)``), as torch allows.
    Only ``output_tensor`` changes.

    Raises:
        TypeError: dtypes differ. ValueError: ``output_tensor`` has the wrong size.
    """
    g = member(group)
    if g is None:
        return None
    op = "all_gather_into_tensor"
    out = host_array(output_tensor, op, "output_tensor", writable=True)
    inp = host_array(input_tensor, op, "input_tensor", writable=False)
    same_dtype(out, inp, op, "output_tensor", "input_tensor")
    if out.size != inp.size * g.size():
        raise ValueError(f"{prefix(op)} output_tensor must hold world_size * input_tensor.size = "
                         f"{g.size()} * {inp.size} = {g.size() * inp.size} elements, got {out.size} "
                         f"(shape {out.shape})")
    dt = mpi_datatype(inp.dtype)
    return launch(g, op, g.comm.Allgather, ([inp, dt], [out, dt]), async_op, (output_tensor,))
