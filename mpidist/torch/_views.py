"""Torch tensors as the arrays mpidist's ops take: zero-copy views where possible.

A contiguous CPU tensor becomes ``tensor.numpy()`` (same memory); bfloat16 and float8 a
reinterpreting ml_dtypes view of the same memory; a tensor that cannot be viewed
(non-contiguous, conj/neg bit) a contiguous temporary, copied back when the op completes
if the op writes it (:class:`Staged`). A CUDA tensor becomes a
:class:`mpidist.torch._cuda.CudaTensor`, for the device router, never the host path.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from mpidist.errors import prefix
from mpidist.torch._dtypes import REINTERPRET

__all__ = ["SparseTensor", "Staged", "array"]


class SparseTensor(TypeError):
    """A sparse tensor where an op takes dense ones (the ops that take sparse tensors
    catch it: ``allreduce``)."""


class Staged:
    """What one call needs around its op: ``backs`` (temporaries to copy back once the op
    completes), ``after`` (callables run after those: integer AVG's division) and ``stream``
    (:func:`mpidist.torch._cuda.current_stream`'s context for CUDA tensors, else None)."""

    __slots__ = ("backs", "after", "stream")

    def __init__(self) -> None:
        self.backs: list = []
        self.after: list = []
        self.stream: Optional[Any] = None

    def out(self, t: Any, op: str, arg: str) -> Any:
        """The array an op writes for tensor ``t`` (read too, for in-place ops)."""
        return self._array(t, True, op, arg)

    def inp(self, t: Any, op: str, arg: str) -> Any:
        """The array an op only reads for tensor ``t``."""
        return self._array(t, False, op, arg)

    def _array(self, t: Any, write: bool, op: str, arg: str) -> Any:
        a = direct(t)
        return a if a is not None else _slow(t, self, write, op, arg)

    def finish(self) -> None:
        """Copy the temporaries back into the caller's tensors, then run ``after`` (once the
        op completed)."""
        if self.backs or self.after:
            with torch.no_grad():
                for dst, src in self.backs:
                    dst.copy_(src)
                for step in self.after:
                    step()
            self.backs, self.after = [], []


def direct(t: Any) -> Optional[np.ndarray]:
    """The C-contiguous numpy view of CPU tensor ``t`` (zero-copy: the common case), or None
    where the op needs :class:`Staged`'s temporaries (CUDA, non-contiguous, needs grad,
    bfloat16, not a tensor, ...)."""
    if getattr(t, "is_cuda", False):  # before numpy(): its TypeError costs microseconds
        return None
    try:
        a = t.numpy()
    except (RuntimeError, TypeError, AttributeError):
        return None
    return a if a.flags.c_contiguous else None


def array(t: Any, op: str, arg: str) -> Any:
    """A read-only use of ``t`` outside any call's Staged (a PREMUL_SUM factor)."""
    return Staged().inp(t, op, arg)


def _check_tensor(t: Any, op: str, arg: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{prefix(op)} {arg} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout is torch.sparse_coo:
        raise SparseTensor(f"{prefix(op)} {arg} is a sparse COO tensor, which only all_reduce takes (as gloo)")
    if t.layout is not torch.strided:
        raise TypeError(f"{prefix(op)} {arg} must be a dense (strided) tensor, got layout {t.layout}")
    if t.is_quantized:
        raise TypeError(
            f"{prefix(op)} {arg} is a quantized tensor ({t.dtype}), which mpidist does not "
            f"communicate; dequantize it first"
        )


def _numpy_dtype(dtype: torch.dtype, op: str, arg: str) -> tuple[torch.dtype, np.dtype]:
    """(view dtype, numpy dtype) for a dtype ``tensor.numpy()`` refuses; TypeError if none."""
    entry = REINTERPRET.get(dtype)
    if entry is None:
        raise TypeError(
            f"{prefix(op)} {arg} has dtype {dtype}, which mpidist cannot communicate "
            f"(supported: bool, integer, float16/32/64, bfloat16, float8, complex64/128)"
        )
    try:
        import ml_dtypes  # noqa: PLC0415  (only for the dtypes numpy lacks)
    except ImportError:
        raise TypeError(
            f"{prefix(op)} {arg} has dtype {dtype}: install ml_dtypes (pip install "
            f"'mpidist[torch]') for mpidist to read it"
        ) from None
    return entry[0], np.dtype(getattr(ml_dtypes, entry[1]))


def _host_view(t: torch.Tensor, op: str, arg: str) -> Optional[np.ndarray]:
    """A zero-copy, C-contiguous numpy view of CPU tensor ``t``, or None if there is none."""
    if t.is_conj() or t.is_neg() or not t.is_contiguous():
        return None
    t = t.detach()
    if t.dtype is torch.complex32:
        return torch.view_as_real(t).numpy()
    try:
        return t.numpy()
    except TypeError:
        view_as, dtype = _numpy_dtype(t.dtype, op, arg)
        return t.view(view_as).numpy().view(dtype)


def _slow(t: Any, staged: Staged, write: bool, op: str, arg: str) -> Any:
    """``t`` as an array when ``tensor.numpy()`` did not give a contiguous view."""
    _check_tensor(t, op, arg)
    if t.is_cuda:
        from mpidist.torch import _cuda  # noqa: PLC0415  (CUDA tensors only)

        return _cuda.device_array(t, staged, write, op, arg)
    if t.device.type != "cpu":
        raise TypeError(f"{prefix(op)} {arg} is on device {t.device}; mpidist takes CPU and CUDA tensors")
    view = _host_view(t, op, arg)
    if view is not None:
        return view
    tmp = t.detach().clone(memory_format=torch.contiguous_format).resolve_conj().resolve_neg()
    if write:
        staged.backs.append((t.detach(), tmp))
    return _host_view(tmp, op, arg)
