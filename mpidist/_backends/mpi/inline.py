"""The compiled all_reduce latency path (``_ext/_inline_c.c``), set up for the MPI that mpi4py loaded.

:func:`compiled_all_reduce` returns its ``all_reduce(tensor, op, g, async_op, algorithm) ->
bool``, which :func:`mpidist.all_reduce` tries before the Python path: True when it ran the call
(a continuation of the group's open run of identical calls; the C file says which), False when
it changed nothing and the Python path must run. None where the extension was not built
(``setup.py`` builds it optionally) or mpi4py's MPI cannot be reached by address: then the
Python path, which does the same, runs every call. docs/performance.md, "The compiled latency path".
"""

from __future__ import annotations

import ctypes
from typing import Any, Callable, Optional

import numpy as np
from mpi4py import MPI

from mpidist._arrays.reduce_op import ReduceOp
from mpidist._check import mismatch
from mpidist._core import recorder as R

try:
    from mpidist._backends.mpi._ext._inline_c import all_reduce as _c_all_reduce, setup as _c_setup
except ImportError:  # not compiled: no C compiler at install
    _c_all_reduce = _c_setup = None  # type: ignore[assignment]

__all__ = ["compiled_all_reduce"]


def compiled_all_reduce(
    collectives: dict[str, Any], failed: Callable[[list, int], None]
) -> Optional[Callable[..., bool]]:
    """The compiled latency path set up, or None (see the module).

    Args:
        collectives: the globals of :mod:`mpidist._backends.mpi.collectives` (it reads ``_last``,
            the last call's dtype, op, algorithm and plan).
        failed: ``failed(rec, ierr)``: marks the recorder entry failed; raises the MPI error
            ``ierr`` when nonzero.
    """
    if _c_setup is None:
        return None
    sizes = {MPI._sizeof(t) for t in (MPI.Comm, MPI.Datatype, MPI.Op)}
    try:  # the MPI_Allreduce that mpi4py's module links, and its MPI_IN_PLACE
        address = ctypes.cast(ctypes.CDLL(MPI.__file__).MPI_Allreduce, ctypes.c_void_p).value
        in_place = int(MPI.IN_PLACE)
        comm_get = MPI.__pyx_capi__["PyMPIComm_Get"]  # mpi4py's C API
    except (OSError, AttributeError, TypeError, KeyError):
        return None
    if len(sizes) != 1 or not address:
        return None
    _c_setup(
        address,
        in_place,
        sizes.pop(),
        comm_get,
        np.ndarray,
        collectives,
        vars(R),
        vars(mismatch),
        mismatch._UNCHECKED,
        failed,
        ReduceOp.AVG,
        mismatch.PERIOD_MASK,
        R.T_END,
        R.STATE,
    )
    return _c_all_reduce
