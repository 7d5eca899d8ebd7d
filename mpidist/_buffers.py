"""Array adapters: turn what the caller passed into a buffer MPI can use, or say why not.

Host arrays only in this release; a device array (``__cuda_array_interface__``) is
refused with a clear error here, before any pointer can reach an MPI that is not
CUDA-aware (which would dereference it and segfault).
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy as np
from mpi4py import MPI
from mpi4py.util.dtlib import from_numpy_dtype

from mpidist._array import is_device_array
from mpidist.errors import prefix

__all__ = ["host_array", "mpi_datatype", "mpi_reducible", "same_dtype"]

# Predefined MPI datatypes by (kind, itemsize): MPI's reduction ops are defined on these
# (MPI-4.1 §6.9.2), not on derived or duplicated types. Other dtypes (float16, bfloat16,
# non-native byte order) travel as derived types and are reduced by mpidist itself.
_PREDEFINED = {
    ("b", 1): MPI.C_BOOL,
    ("i", 1): MPI.INT8_T, ("i", 2): MPI.INT16_T, ("i", 4): MPI.INT32_T, ("i", 8): MPI.INT64_T,
    ("u", 1): MPI.UINT8_T, ("u", 2): MPI.UINT16_T, ("u", 4): MPI.UINT32_T, ("u", 8): MPI.UINT64_T,
    ("f", 4): MPI.FLOAT, ("f", 8): MPI.DOUBLE,
    ("c", 8): MPI.C_FLOAT_COMPLEX, ("c", 16): MPI.C_DOUBLE_COMPLEX,
}


def host_array(x: Any, op: str, arg: str, *, writable: bool) -> np.ndarray:
    """Validate ``x`` as a C-contiguous numpy array (writable if asked) and return it.

    Raises:
        TypeError: ``x`` is not a numpy array, is a device array, or has an object,
            string or structured dtype.
        ValueError: ``x`` is not C-contiguous, or is read-only where it must be written.
    """
    if type(x) is not np.ndarray:
        if is_device_array(x):
            raise TypeError(f"{prefix(op)} {arg} is a device (GPU) array; this release moves host "
                            f"arrays only, copy it to a numpy array first")
        if not isinstance(x, np.ndarray):
            raise TypeError(f"{prefix(op)} {arg} must be a numpy.ndarray, got {type(x).__name__}")
    if not x.flags.c_contiguous:
        raise ValueError(f"{prefix(op)} {arg} must be C-contiguous, got a non-contiguous array of "
                         f"shape {x.shape} and strides {x.strides}")
    if writable and not x.flags.writeable:
        raise ValueError(f"{prefix(op)} {arg} must be writable, got a read-only array")
    if x.dtype.kind in "OSUVMm":
        raise TypeError(f"{prefix(op)} {arg} has dtype {x.dtype}, which cannot be communicated; "
                        f"expected a numeric or bool dtype")
    return x


@lru_cache(maxsize=None)
def mpi_datatype(dtype: np.dtype) -> MPI.Datatype:
    """The MPI datatype matching a numpy dtype (cached): predefined where one exists."""
    if dtype.isnative and (dtype.kind, dtype.itemsize) in _PREDEFINED:
        return _PREDEFINED[dtype.kind, dtype.itemsize]
    return from_numpy_dtype(dtype).Commit()


@lru_cache(maxsize=None)
def mpi_reducible(dtype: np.dtype) -> bool:
    """True if MPI's predefined reduction ops work on ``dtype``."""
    return dtype.isnative and (dtype.kind, dtype.itemsize) in _PREDEFINED


def same_dtype(ref: np.ndarray, other: np.ndarray, op: str, ref_arg: str, other_arg: str) -> None:
    """Raise TypeError unless ``other`` has the dtype of ``ref``."""
    if ref.dtype != other.dtype:
        raise TypeError(f"{prefix(op)} {other_arg} dtype {other.dtype} does not match {ref_arg} "
                        f"dtype {ref.dtype}")
