"""Reduction operators: the torch.distributed names and their MPI and numpy forms.

AVG is SUM then a division by the group size; PREMUL_SUM is spelled
:func:`make_premul_sum(factor) <make_premul_sum>`; dtypes MPI cannot reduce get a cached,
commutative user-defined ``MPI.Op`` applying the op's numpy ufunc. See docs/api.md,
"ReduceOp and dtypes", and docs/architecture.md, "Datatypes and reductions".
"""

from __future__ import annotations

import enum
import numbers
from functools import cache
from typing import Any, Optional, Union, final

import numpy as np
from mpi4py import MPI

from mpidist._arrays.buffers import dtype_of, mpi_reducible, value_kind
from mpidist._arrays.namespace import array_module

__all__ = [
    "ReduceOp",
    "PremulSum",
    "make_premul_sum",
    "to_mpi_op",
    "local_reduce",
    "check_op_dtype",
    "scaled",
    "reduce_op",
]


class ReduceOp(enum.Enum):
    """Element-wise reduction applied by all_reduce, reduce and reduce_scatter.

    Same members as ``torch.distributed.ReduceOp``. PREMUL_SUM needs its factor: pass
    :func:`make_premul_sum` ``(factor)``; the bare member is refused with ValueError.
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


class _DeprecatedReduceOp:
    """``reduce_op``: torch.distributed's deprecated alias of :class:`ReduceOp`.

    ``reduce_op.SUM is ReduceOp.SUM``; every attribute read warns (FutureWarning), as
    torch's ``torch.distributed.reduce_op`` does. Use :class:`ReduceOp`.
    """

    def __getattr__(self, name: str) -> Any:
        import warnings  # noqa: PLC0415  (only on the deprecated path)

        warnings.warn(
            "`mpidist.reduce_op` is deprecated, please use `mpidist.ReduceOp` instead (as torch.distributed.reduce_op)",
            FutureWarning,
            stacklevel=2,
        )
        if name == "__members__":
            return ReduceOp.__members__
        try:
            return ReduceOp[name]
        except KeyError:
            raise AttributeError(f"reduce_op has no member {name!r}; members: {list(ReduceOp.__members__)}") from None

    def __repr__(self) -> str:
        return "<mpidist.reduce_op: deprecated alias of mpidist.ReduceOp>"


#: torch's deprecated alias of :class:`ReduceOp` (warns on use).
reduce_op = _DeprecatedReduceOp()


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


@final  # ops test ``type(op) is PremulSum``: a subclass would not be one (and mypy narrows on it)
class PremulSum:
    """``ReduceOp.PREMUL_SUM`` with its factor: the op is ``sum_i(factor * x_i)``.

    Made by :func:`make_premul_sum`; accepted as ``op`` by every reducing collective.
    ``factor`` is read when the op runs (a 0-d array may change until then, as a
    torch tensor factor may) and cast to the reduced array's dtype.
    """

    __slots__ = ("factor",)
    op = ReduceOp.PREMUL_SUM

    def __init__(self, factor: Any) -> None:
        self.factor = factor

    def __repr__(self) -> str:
        return f"make_premul_sum({self.factor!r})"


def make_premul_sum(factor: Union[numbers.Number, np.ndarray]) -> PremulSum:
    """The PREMUL_SUM op with ``factor``: every rank's input is multiplied by ``factor``
    before the sum (``torch.distributed._make_nccl_premul_sum``).

    Args:
        factor: a Python or numpy int, float or complex scalar, or a 0-d numeric array.
            Cast to the dtype of the arrays it is applied to; an integer dtype needs an
            integral factor, a real dtype a real one (checked by the collective).

    Raises:
        TypeError: ``factor`` is not a number or 0-d numeric array (bool included).
    """
    if isinstance(factor, np.ndarray):
        if factor.ndim != 0 or factor.dtype.kind not in "iufc":
            raise TypeError(
                f"make_premul_sum: factor must be a number or a 0-d numeric array, got an "
                f"array of shape {factor.shape} and dtype {factor.dtype}"
            )
    elif isinstance(factor, (bool, np.bool_)) or not isinstance(factor, (numbers.Number, np.number)):
        raise TypeError(f"make_premul_sum: factor must be a number or a 0-d numeric array, got {type(factor).__name__}")
    return PremulSum(factor)


def _premul_factor(op: PremulSum, dtype: np.dtype) -> np.ndarray:
    """The factor as a 0-d array of ``dtype`` (as NCCL casts the scalar to the datatype)."""
    return np.asarray(op.factor).astype(dtype)


def scaled(
    op: Union[ReduceOp, PremulSum], src: np.ndarray, out: Optional[np.ndarray] = None
) -> tuple[ReduceOp, np.ndarray]:
    """Apply a PREMUL_SUM factor: ``(ReduceOp.SUM, factor * src)``, else ``(op, src)``.

    The product goes to ``out`` (may be ``src``; allocated when None). Every rank
    multiplies the same way, so the sum that follows is what MPI or the ring computes
    for SUM. Any other op returns ``src`` itself, untouched, and allocates nothing.
    """
    if type(op) is not PremulSum:
        return op, src
    if out is None:
        out = np.empty_like(src)
    np.multiply(src, _premul_factor(op, src.dtype), out=out)
    return ReduceOp.SUM, out


@cache
def _user_op(op: ReduceOp) -> MPI.Op:
    """A commutative user-defined MPI op applying ``op``'s numpy ufunc (created once)."""
    ufunc = getattr(np, _UFUNCS[op])

    def apply(invec: Any, inoutvec: Any, datatype: MPI.Datatype) -> None:
        dtype = dtype_of(datatype)
        ufunc(np.frombuffer(invec, dtype), np.frombuffer(inoutvec, dtype), out=np.frombuffer(inoutvec, dtype))

    return MPI.Op.Create(apply, commute=True)


def to_mpi_op(op: ReduceOp, dtype: np.dtype) -> MPI.Op:
    """The MPI operation that implements ``op`` on ``dtype`` (AVG maps to SUM).

    Predefined (MPI_SUM, MPI_LOR, ...) where MPI reduces ``dtype`` itself, the fast
    path; otherwise a cached user-defined op that needs ``mpi_datatype(dtype)`` as the
    buffers' datatype. ``op`` must not be a PremulSum: apply :func:`scaled` first.
    """
    if dtype.kind == "b":
        return _BOOL_OPS[op][0]
    if mpi_reducible(dtype):
        return _MPI_OPS[op]
    return _user_op(op)


def check_op_dtype(op: Any, dtype: np.dtype, where: str) -> Union[ReduceOp, PremulSum]:
    """Validate ``op`` for arrays of ``dtype``; return it.

    Raises:
        TypeError: ``op`` is neither a ReduceOp nor made by :func:`make_premul_sum`.
        ValueError: the dtype does not support the op (AVG on integers or bool, MIN/MAX
            on complex, bitwise ops on floats, a premul sum on bool, a fractional factor
            on integers, a complex factor on reals), or the bare ReduceOp.PREMUL_SUM.
    """
    kind: str = dtype.kind
    if kind == "V":  # ml_dtypes' bfloat16, float8_*: what they hold
        kind = value_kind(dtype)
    if type(op) is PremulSum:
        factor = np.asarray(op.factor)
        if kind not in "iufc":
            raise ValueError(f"{where} {op!r} needs a numeric dtype, got {dtype}")
        if kind in "iu" and (factor.dtype.kind == "c" or not float(factor).is_integer()):
            raise ValueError(f"{where} {op!r} on integer dtype {dtype} needs an integral factor, got {op.factor!r}")
        if kind != "c" and factor.dtype.kind == "c":
            raise ValueError(f"{where} {op!r} on real dtype {dtype} needs a real factor, got {op.factor!r}")
        return op
    if not isinstance(op, ReduceOp):
        raise TypeError(
            f"{where} op must be a mpidist.ReduceOp, got {op!r} (PREMUL_SUM is made by mpidist.make_premul_sum(factor))"
        )
    if op is ReduceOp.PREMUL_SUM:
        raise ValueError(f"{where} ReduceOp.PREMUL_SUM needs a factor: pass mpidist.make_premul_sum(factor)")
    if op is ReduceOp.AVG and kind not in "fc":
        raise ValueError(f"{where} ReduceOp.AVG needs a floating or complex dtype, got {dtype}")
    if op in (ReduceOp.MIN, ReduceOp.MAX) and kind == "c":
        raise ValueError(f"{where} {op!r} is not defined for complex dtype {dtype}")
    if op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR) and kind not in "iub":
        raise ValueError(f"{where} {op!r} needs an integer or bool dtype, got {dtype}")
    return op


def local_reduce(op: ReduceOp, acc: Any, other: Any) -> None:
    """``acc = op(acc, other)`` in place, element-wise, on numpy or cupy arrays.

    For AVG this is the SUM step only; the caller divides once at the end. A
    PremulSum is refused (ValueError): apply its factor with :func:`scaled` first.
    """
    if type(op) is PremulSum:
        raise ValueError(f"local_reduce: apply the factor of {op!r} with scaled() first, then reduce with ReduceOp.SUM")
    name = _BOOL_OPS[op][1] if acc.dtype.kind == "b" else _UFUNCS[op]
    getattr(array_module(acc), name)(acc, other, out=acc)
