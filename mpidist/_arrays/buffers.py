"""Array adapters: turn what the caller passed into a buffer MPI can use, or say why not.

Host arrays only, except while the CUDA-aware backend (:mod:`mpidist._backends.device.cuda_aware`)
runs the MPI body on a device array; anywhere else a device array is refused before its
pointer can reach an MPI that is not CUDA-aware (which would segfault). Dtypes with a
predefined MPI datatype travel as it; the others (float16, ``ml_dtypes``' types, non-native
byte order) as opaque byte runs, registered for :func:`dtype_of` (docs/architecture.md,
"Datatypes and reductions").
"""

from __future__ import annotations

from functools import cache
from typing import Any, Optional

import numpy as np
from mpi4py import MPI

from mpidist._arrays.namespace import is_device_array
from mpidist.errors import prefix

__all__ = [
    "host_array",
    "array_list",
    "mpi_datatype",
    "mpi_reducible",
    "mpi_has",
    "saturating_sums",
    "same_dtype",
    "group_blocks",
    "holds",
    "value_kind",
    "dtype_of",
    "split_sizes",
]

# Predefined MPI datatypes by (kind, itemsize): MPI's reduction ops are defined on these
# (MPI-4.1 §6.9.2), not on derived or duplicated types.
_NUMERIC_KINDS = "biufc"
_PREDEFINED = {
    ("b", 1): MPI.C_BOOL,
    ("i", 1): MPI.INT8_T,
    ("i", 2): MPI.INT16_T,
    ("i", 4): MPI.INT32_T,
    ("i", 8): MPI.INT64_T,
    ("u", 1): MPI.UINT8_T,
    ("u", 2): MPI.UINT16_T,
    ("u", 4): MPI.UINT32_T,
    ("u", 8): MPI.UINT64_T,
    ("f", 4): MPI.FLOAT,
    ("f", 8): MPI.DOUBLE,
    ("c", 8): MPI.C_FLOAT_COMPLEX,
    ("c", 16): MPI.C_DOUBLE_COMPLEX,
}
# C long double (x86-64: 80-bit extended in 16 bytes) where it differs from double.
if np.dtype(np.longdouble).itemsize > 8:
    _PREDEFINED["f", np.dtype(np.longdouble).itemsize] = MPI.LONG_DOUBLE
    _PREDEFINED["c", np.dtype(np.clongdouble).itemsize] = MPI.C_LONG_DOUBLE_COMPLEX
# Handle of each opaque datatype made by mpi_datatype -> the numpy dtype it carries.
_OPAQUE: dict = {}


@cache
def value_kind(dtype: np.dtype) -> str:
    """numpy's ``dtype.kind``, except that ml_dtypes' types report what they hold.

    bfloat16 and the float8 types (numpy kind ``"V"``) give ``"f"``, int4/uint4 give
    ``"i"``/``"u"``, complex32 ``"c"``; any other dtype keeps its kind (and
    :func:`host_array` refuses it unless that is bool/int/uint/float/complex).
    """
    if dtype.kind in _NUMERIC_KINDS or dtype.type.__module__.split(".", 1)[0] != "ml_dtypes":
        return dtype.kind
    import ml_dtypes  # noqa: PLC0415  (optional; only reached for one of its dtypes)

    if "complex" in dtype.name:
        return "c"
    for info, kind in ((ml_dtypes.finfo, "f"), (ml_dtypes.iinfo, "")):
        try:
            found = info(dtype)
        except Exception:  # noqa: BLE001, S112  (not of this family: try the next)
            continue
        return kind or ("i" if found.min < 0 else "u")
    return dtype.kind


def host_array(x: Any, op: str, arg: str, *, writable: bool) -> np.ndarray:
    """Validate ``x`` as a C-contiguous numpy array (writable if asked) and return it.

    A device array is accepted (and returned as is) only on the router's CUDA-aware path.

    Raises:
        TypeError: ``x`` is not a numpy array, is a device array outside the CUDA-aware
            path (mixed with host arrays), or has an object, string or structured dtype.
        ValueError: ``x`` is not C-contiguous, or is read-only where it must be written.
    """
    if type(x) is not np.ndarray:
        if is_device_array(x):
            return _device_array(x, op, arg)
        if not isinstance(x, np.ndarray):
            hint = (
                "; a numpy array's .data is its raw buffer, not an array as torch's tensor.data: pass the array itself"
                if isinstance(x, memoryview)
                else ""
            )
            raise TypeError(f"{prefix(op)} {arg} must be a numpy.ndarray, got {type(x).__name__}{hint}")
    if not x.flags.c_contiguous:
        raise ValueError(
            f"{prefix(op)} {arg} must be C-contiguous, got a non-contiguous array of "
            f"shape {x.shape} and strides {x.strides}"
        )
    if writable and not x.flags.writeable:
        raise ValueError(f"{prefix(op)} {arg} must be writable, got a read-only array")
    if x.dtype.kind not in _NUMERIC_KINDS and value_kind(x.dtype) not in _NUMERIC_KINDS:
        raise TypeError(
            f"{prefix(op)} {arg} has dtype {x.dtype}, which cannot be communicated; expected a numeric or bool dtype"
        )
    return x


def _device_array(x: Any, op: str, arg: str) -> Any:
    """host_array for a device array: accepted (C-contiguous, numeric) only while the router
    runs the op on the CUDA-aware path; otherwise the call mixes host and device arrays
    (the op's primary argument, which routes device calls, was a host array)."""
    from mpidist.device import op_args  # noqa: PLC0415  (device package: loaded on demand)

    if not op_args.passing_through():
        primary = op_args.primary_name(op)
        if primary is None or primary == arg:
            raise TypeError(
                f"{prefix(op)} {arg} is a device ({op_args.device_label(x)}) array, which {op} "
                f"does not take; copy it to a numpy array first"
            )
        raise op_args.mixed_error(op, arg, x, primary)
    if not x.flags.c_contiguous:
        raise ValueError(
            f"{prefix(op)} {arg} must be C-contiguous, got a non-contiguous array of "
            f"shape {x.shape} and strides {x.strides}"
        )
    if x.dtype.kind not in _NUMERIC_KINDS and value_kind(x.dtype) not in _NUMERIC_KINDS:
        raise TypeError(
            f"{prefix(op)} {arg} has dtype {x.dtype}, which cannot be communicated; expected a numeric or bool dtype"
        )
    return x


@cache
def mpi_datatype(dtype: np.dtype) -> MPI.Datatype:
    """The MPI datatype matching a numpy dtype (cached).

    Predefined where one exists (MPI reduces those itself); otherwise a committed
    contiguous run of ``dtype.itemsize`` bytes, one per dtype, registered for
    :func:`dtype_of`.
    """
    if dtype.isnative and (dtype.kind, dtype.itemsize) in _PREDEFINED:
        return _PREDEFINED[dtype.kind, dtype.itemsize]
    datatype = MPI.BYTE.Create_contiguous(dtype.itemsize).Commit()
    _OPAQUE[datatype.handle] = dtype
    return datatype


def dtype_of(datatype: MPI.Datatype) -> np.dtype:
    """The numpy dtype of an opaque datatype made by :func:`mpi_datatype`, or of a predefined
    one (an integer type MPI's own sum would saturate: :func:`mpi_reducible`).

    For user-defined MPI reductions, which get the datatype of the buffers they combine.
    Raises KeyError for any other datatype.
    """
    found = _OPAQUE.get(datatype.handle)
    if found is None:  # a predefined one (INT8_T, or SIGNED_CHAR as mpi4py reads an int8 buffer): its typecode
        code = MPI._typecode(datatype)
        if code is None:
            raise KeyError(f"no numpy dtype for MPI datatype {datatype}")
        found = np.dtype(code)
    return found


#: (kind, itemsize) of the 8- and 16-bit integer types whose MPI_SUM saturates instead of
#: wrapping on this MPI (Open MPI: open-mpi/ompi#8045; docs/api.md, "ReduceOp and dtypes");
#: None until first needed (:func:`saturating_sums`)
_saturating: Optional[frozenset[tuple[str, int]]] = None


def saturating_sums() -> frozenset[tuple[str, int]]:
    """The (kind, itemsize) pairs of :data:`_saturating`, measured once, locally: MPI_SUM of
    the type's maximum with itself by ``MPI_Reduce_local`` (the same op code as the
    collectives'), at 8, 1024 and 4096 elements, against numpy's wrapping sum."""
    global _saturating
    if _saturating is None:
        found = set()
        for dtype in (np.dtype(np.int8), np.dtype(np.uint8), np.dtype(np.int16), np.dtype(np.uint16)):
            for n in (8, 1024, 4096):
                a = np.full(n, np.iinfo(dtype).max, dtype)
                b = a.copy()
                MPI.SUM.Reduce_local(a, b)
                if not np.array_equal(b, a + a):
                    found.add((dtype.kind, dtype.itemsize))
                    break
        _saturating = frozenset(found)
    return _saturating


def mpi_has(dtype: np.dtype) -> bool:
    """True if MPI has a predefined datatype for ``dtype`` (its own ops may still be unfit:
    :func:`mpi_reducible`)."""
    return dtype.isnative and (dtype.kind, dtype.itemsize) in _PREDEFINED


@cache
def mpi_reducible(dtype: np.dtype) -> bool:
    """True if MPI's predefined reduction ops work on ``dtype``: a type MPI has, except the
    integers whose MPI_SUM saturates here (:func:`saturating_sums`), which mpidist reduces
    itself so that overflow wraps everywhere."""
    if not mpi_has(dtype):
        return False
    return dtype.itemsize > 2 or dtype.kind not in "iu" or (dtype.kind, dtype.itemsize) not in saturating_sums()


def array_list(
    xs: Any,
    op: str,
    arg: str,
    n: Optional[int],
    writable: bool,
    expected: str = "",
    dtype_of: Optional[tuple[np.ndarray, str]] = None,
) -> list[np.ndarray]:
    """Validate argument ``arg`` of ``op``: a list or tuple of ``n`` arrays (any length >= 1 if
    ``n`` is None), each a :func:`host_array` (writable if asked), of one dtype; returns them
    as a list.

    ``expected`` explains ``n`` in the message; ``dtype_of`` = (array, its argument name)
    whose dtype every element must have (default: the first element's).

    Raises:
        TypeError: not a list or tuple; an entry that is not a host array; dtypes differ.
        ValueError: the wrong length; an entry not C-contiguous, or read-only where written.
    """
    if (type(xs) is list or type(xs) is tuple) and xs and (n is None or len(xs) == n):
        # fast path: one cheap test per element; anything unusual takes the full checks below,
        # which raise the same errors in the same order
        ref_dtype = (
            dtype_of[0] if dtype_of is not None else host_array(xs[0], op, f"{arg}[0]", writable=writable)
        ).dtype
        for x in xs:
            if type(x) is not np.ndarray or x.dtype != ref_dtype:
                break
            flags = x.flags
            if not flags.c_contiguous or (writable and not flags.writeable):
                break
        else:
            return list(xs)
    if not isinstance(xs, (list, tuple)):
        raise TypeError(f"{prefix(op)} {arg} must be a list of numpy arrays, got {type(xs).__name__}")
    if n is not None and len(xs) != n:
        raise ValueError(f"{prefix(op)} {arg} must hold {expected} = {n} arrays, got {len(xs)}")
    if n is None and not xs:
        raise ValueError(f"{prefix(op)} {arg} must hold at least one array, got an empty list")
    arrs = [host_array(x, op, f"{arg}[{i}]", writable=writable) for i, x in enumerate(xs)]
    ref, ref_arg = dtype_of if dtype_of is not None else (arrs[0], f"{arg}[0]")
    for i, a in enumerate(arrs):
        same_dtype(ref, a, op, ref_arg, f"{arg}[{i}]")
    return arrs


def same_dtype(ref: np.ndarray, other: np.ndarray, op: str, ref_arg: str, other_arg: str) -> None:
    """Raise TypeError unless ``other`` has the dtype of ``ref``."""
    if ref.dtype != other.dtype:
        raise TypeError(f"{prefix(op)} {other_arg} dtype {other.dtype} does not match {ref_arg} dtype {ref.dtype}")


def group_blocks(out: Any, inp: Any, n: int, op: str, out_arg: str, in_arg: str, gather: bool) -> None:
    """TypeError unless ``out`` and ``inp`` share a dtype; ValueError unless the whole one (``out``
    when ``gather``, else ``inp``) holds ``n`` times the other's elements (one block per rank)."""
    same_dtype(out, inp, op, out_arg, in_arg)
    if gather:
        holds(op, out, out_arg, inp, in_arg, n)
    else:
        holds(op, inp, in_arg, out, out_arg, n)


def holds(op: str, whole: Any, whole_arg: str, part: Any, part_arg: str, n: int) -> None:
    """ValueError unless ``whole`` has ``n`` times ``part``'s elements (one block per group
    rank); both have ``.size`` and ``.shape`` (host arrays, or the NCCL path's descriptions)."""
    if whole.size != part.size * n:
        raise ValueError(
            f"{prefix(op)} {whole_arg} must hold world_size * {part_arg}.size = {n} * {part.size} = "
            f"{n * part.size} elements, got {whole.size} (shape {whole.shape})"
        )


def split_sizes(splits: Any, arr: np.ndarray, op: str, arg: str, name: str, n: int) -> list[int]:
    """Rows per rank along dim 0 of ``arr`` (argument ``name`` of ``op``): ``splits``
    (argument ``arg``, one int per rank of ``n``), or an even split when None or empty.
    TypeError / ValueError for sizes that are not ints, negative, of another count, or
    whose sum is not ``arr.shape[0]``."""
    if arr.ndim == 0:
        raise ValueError(
            f"{prefix(op)} {name} must have at least one dimension (it is split along dim 0), got a 0-d array"
        )
    rows = arr.shape[0]
    if splits is None or (hasattr(splits, "__len__") and len(splits) == 0):
        if rows % n:
            raise ValueError(
                f"{prefix(op)} {name}.shape[0] = {rows} is not divisible by the group size "
                f"{n}; pass {arg} to split it unevenly"
            )
        return [rows // n] * n
    if not isinstance(splits, (list, tuple, np.ndarray)):
        raise TypeError(f"{prefix(op)} {arg} must be a list of ints or None, got {type(splits).__name__}")
    if len(splits) != n:
        raise ValueError(f"{prefix(op)} {arg} must hold one size per group member = {n} sizes, got {len(splits)}")
    for i, s in enumerate(splits):
        if not isinstance(s, (int, np.integer)) or isinstance(s, bool):
            raise TypeError(f"{prefix(op)} {arg}[{i}] must be an int, got {type(s).__name__}")
        if s < 0:
            raise ValueError(f"{prefix(op)} {arg}[{i}] must be non-negative, got {s}")
    if sum(splits) != rows:
        raise ValueError(f"{prefix(op)} {arg} sums to {sum(splits)}, expected {name}.shape[0] = {rows}")
    return [int(s) for s in splits]
