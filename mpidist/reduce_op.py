"""Reduction operators: the torch.distributed names and their MPI and numpy forms.

``ReduceOp.AVG`` has no MPI counterpart: it is a SUM followed by a division by the
group's size, done identically on every rank so results stay bitwise equal.
"""
from __future__ import annotations

import enum
from typing import Any

import numpy as np
from mpi4py import MPI

from mpidist._array import array_module

__all__ = ["ReduceOp", "to_mpi_op", "local_reduce", "check_op_dtype"]


class ReduceOp(enum.Enum):
    """Element-wise reduction applied by all_reduce, reduce and reduce_scatter.

    Same members as ``torch.distributed.ReduceOp``. PREMUL_SUM is reserved for the
    full-API work and raises ``ValueError`` for now.
    """

    SUM = "sum"
    AVG = "avg"
    PRODUCT = "product"
    MIN = "min"
    MAX = "max"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"
    PREMUL_SUM = "premul_sum"

    def __repr__(self) -> str:
        return f"ReduceOp.{self.name}"


_MPI_OPS = {
    ReduceOp.SUM: MPI.SUM,
    ReduceOp.AVG: MPI.SUM,  # then divided by the group size
    ReduceOp.PRODUCT: MPI.PROD,
    ReduceOp.MIN: MPI.MIN,
    ReduceOp.MAX: MPI.MAX,
    ReduceOp.BAND: MPI.BAND,
    ReduceOp.BOR: MPI.BOR,
    ReduceOp.BXOR: MPI.BXOR,
}

# numpy/cupy ufunc names, so the same table serves both array modules.
_UFUNCS = {
    ReduceOp.SUM: "add",
    ReduceOp.AVG: "add",
    ReduceOp.PRODUCT: "multiply",
    ReduceOp.MIN: "minimum",
    ReduceOp.MAX: "maximum",
    ReduceOp.BAND: "bitwise_and",
    ReduceOp.BOR: "bitwise_or",
    ReduceOp.BXOR: "bitwise_xor",
}
# bool arrays: torch reduces them as logical or/and; MPI only has logical ops for C bool.
_BOOL_OPS = {
    ReduceOp.SUM: (MPI.LOR, "logical_or"),
    ReduceOp.MAX: (MPI.LOR, "logical_or"),
    ReduceOp.BOR: (MPI.LOR, "logical_or"),
    ReduceOp.PRODUCT: (MPI.LAND, "logical_and"),
    ReduceOp.MIN: (MPI.LAND, "logical_and"),
    ReduceOp.BAND: (MPI.LAND, "logical_and"),
    ReduceOp.BXOR: (MPI.LXOR, "logical_xor"),
}


def to_mpi_op(op: ReduceOp, dtype: np.dtype) -> MPI.Op:
    """The predefined MPI operation that implements ``op`` on ``dtype`` (AVG maps to SUM)."""
    if dtype.kind == "b":
        return _BOOL_OPS[op][0]
    return _MPI_OPS[op]


def check_op_dtype(op: Any, dtype: np.dtype, where: str) -> ReduceOp:
    """Validate ``op`` for arrays of ``dtype``; return it as a :class:`ReduceOp`.

    Raises:
        TypeError: ``op`` is not a ReduceOp.
        ValueError: the dtype does not support the op (AVG on integers, MIN/MAX on
            complex, bitwise ops on floats), or PREMUL_SUM.
    """
    if not isinstance(op, ReduceOp):
        raise TypeError(f"{where} op must be a mpidist.ReduceOp, got {op!r}")
    kind = dtype.kind
    if op is ReduceOp.PREMUL_SUM:
        raise ValueError(f"{where} ReduceOp.PREMUL_SUM is not supported yet")
    if op is ReduceOp.AVG and kind not in "fc":
        raise ValueError(f"{where} ReduceOp.AVG needs a floating or complex dtype, got {dtype}")
    if op in (ReduceOp.MIN, ReduceOp.MAX) and kind == "c":
        raise ValueError(f"{where} {op!r} is not defined for complex dtype {dtype}")
    if op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR) and kind not in "iub":
        raise ValueError(f"{where} {op!r} needs an integer or bool dtype, got {dtype}")
    return op


def local_reduce(op: ReduceOp, acc: Any, other: Any) -> None:
    """``acc = op(acc, other)`` in place, element-wise, on numpy or cupy arrays.

    For AVG this is the SUM step only; the caller divides once at the end.
    """
    name = _BOOL_OPS[op][1] if acc.dtype.kind == "b" else _UFUNCS[op]
    getattr(array_module(acc), name)(acc, other, out=acc)
