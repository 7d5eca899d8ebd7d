"""Private helpers shared by :mod:`mpidist.nn`, :mod:`mpidist.optim` and :mod:`mpidist.parallel`.

Devices are named as torch names them: ``"cpu"`` (numpy arrays), ``"cuda"`` (cupy's current
device) and ``"cuda:N"``. Array code asks :func:`mpidist._arrays.namespace.array_module` for the module of
the arrays it works on; cupy is imported only when a device array or a ``"cuda"`` device is
actually met, so CPU-only installs never load it.
"""

from __future__ import annotations

import contextlib
import numbers
import re
from contextlib import AbstractContextManager
from types import ModuleType
from typing import Any, Callable, Optional, Union

import numpy as np

from mpidist._arrays.namespace import array_module, is_device_array
from mpidist.errors import prefix
from mpidist.nn._data import DataArray

__all__ = [
    "prefix",
    "check_array",
    "check_bool",
    "check_int",
    "cupy_module",
    "parse_device",
    "device_of",
    "on_device",
    "move",
    "to_host",
    "like",
    "like_checked",
    "copy_into",
    "check_device",
    "HOST_TYPES",
]

#: Exact types of the host arrays the toolkit handles (for ``type(x) in HOST_TYPES`` fast paths).
HOST_TYPES = (np.ndarray, DataArray)

_CUDA = re.compile(r"cuda(?::(\d+))?")


def check_array(value: Any, what: str, op: str, floating: bool = False) -> None:
    """Raise TypeError unless ``value`` looks like a numpy/cupy array (``floating``: of a floating dtype)."""
    if not (hasattr(value, "shape") and hasattr(value, "dtype") and hasattr(value, "ndim")):
        raise TypeError(f"{prefix(op)} {what} must be a numpy or cupy array, got {type(value).__name__}")
    if floating and value.dtype.kind != "f":
        raise TypeError(f"{prefix(op)} {what} must have a floating dtype, got {value.dtype}")


def check_bool(value: Any, what: str, op: str) -> None:
    """Raise TypeError unless ``value`` is a bool."""
    if not isinstance(value, bool):
        raise TypeError(f"{prefix(op)} {what} must be a bool, got {type(value).__name__}")


def check_int(value: Any, what: str, op: str, low: Optional[int] = None) -> None:
    """Raise TypeError unless ``value`` is an int (not a bool); ValueError if it is below ``low``."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise TypeError(f"{prefix(op)} {what} must be an int, got {type(value).__name__}")
    if low is not None and value < low:
        raise ValueError(f"{prefix(op)} {what} must be >= {low}, got {value}")


def cupy_module(op: str) -> ModuleType:
    """``import cupy``, or RuntimeError saying that a ``"cuda"`` device needs it."""
    try:
        import cupy  # noqa: PLC0415  (optional dependency)
    except ImportError as exc:
        raise RuntimeError(
            f"{prefix(op)} device 'cuda' needs cupy, which is not installed (pip install cupy-cuda12x)"
        ) from exc
    return cupy


def parse_device(device: Any, op: str) -> tuple[str, Optional[int]]:
    """``("cpu", None)``, ``("cuda", None)`` (the current GPU) or ``("cuda", N)``.

    Accepts ``"cpu"``, ``"cuda"``, ``"cuda:N"`` and an int ``N`` (torch: ``torch.device(N)``
    is ``cuda:N``). Raises TypeError (another type) or ValueError (another string, N < 0).
    """
    if isinstance(device, numbers.Integral) and not isinstance(device, bool):
        if device < 0:
            raise ValueError(f"{prefix(op)} device index must be >= 0, got {device}")
        return "cuda", int(device)
    if not isinstance(device, str):
        raise TypeError(
            f"{prefix(op)} device must be a str ('cpu', 'cuda', 'cuda:N') or an int, got {type(device).__name__}"
        )
    if device == "cpu":
        return "cpu", None
    match = _CUDA.fullmatch(device)
    if match is None:
        raise ValueError(f"{prefix(op)} device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    return "cuda", None if match.group(1) is None else int(match.group(1))


def device_of(x: Any) -> str:
    """``"cpu"`` for a host (numpy) array, ``"cuda:N"`` for a cupy array on GPU N."""
    return "cpu" if array_module(x) is np else f"cuda:{x.device.id}"


def on_device(x: Any) -> AbstractContextManager:
    """A context making ``x``'s GPU the current one (cupy's ``Device``); a no-op for host arrays.

    cupy launches kernels and allocates on the *current* device, which is per thread: code
    that may run on a process group's engine thread (comm-hook callbacks, the ring) enters it.
    """
    return contextlib.nullcontext() if array_module(x) is np else x.device


def move(x: Any, kind: str, index: Optional[int], op: str) -> Any:
    """``x`` on device ``(kind, index)`` (see :func:`parse_device`); ``x`` itself if it is there.

    Host -> GPU: ``cupy.asarray`` under that device; GPU -> host: ``cupy.asnumpy``; GPU -> other
    GPU: ``x.copy()`` under the target device (cupy copies to the current device).
    """
    xp = array_module(x)
    if kind == "cpu":
        return x if xp is np else xp.asnumpy(x)
    cp = cupy_module(op)
    with cp.cuda.Device(index) if index is not None else contextlib.nullcontext():
        if xp is np:
            return cp.asarray(np.asarray(x))  # a plain ndarray: cupy may read a subclass's .data
        return x if x.device.id == cp.cuda.Device().id else x.copy()


def to_host(value: Any) -> np.ndarray:
    """``value`` as a numpy array: copied from the GPU if needed, else ``numpy.asarray``."""
    xp = array_module(value)
    if xp is not np:
        return xp.asnumpy(value)
    if is_device_array(value):  # a device array of another library: its .get(), if any
        value = value.get()
    return np.asarray(value)


def like(value: Any, ref: Any, op: str) -> Any:
    """``value`` as an array on ``ref``'s device (copied only across host/GPUs)."""
    if array_module(ref) is np:
        return to_host(value)
    return move(value, "cuda", ref.device.id, op)


def like_checked(value: Any, ref: Any, key: str, op: str) -> Any:
    """:func:`like`, with ``ref``'s shape (else ValueError) and dtype (else TypeError); ``key`` names it."""
    src = like(value, ref, op)
    if tuple(src.shape) != tuple(ref.shape):
        raise ValueError(f"{prefix(op)} {key!r}: expected shape {tuple(ref.shape)}, got {tuple(src.shape)}")
    if src.dtype != ref.dtype:
        raise TypeError(f"{prefix(op)} {key!r}: expected dtype {ref.dtype}, got {src.dtype}")
    return src


def copy_into(dst: Any, src: Any, op: str) -> None:
    """Copy ``src`` (any device, ``dst``'s size) into ``dst`` in place (``xp.copyto``, same_kind casting)."""
    with on_device(dst):
        array_module(dst).copyto(dst, like(src, dst, op).reshape(dst.shape), casting="same_kind")


def check_device(value: Any, ref: Any, what: str, owner: Union[str, Callable[[], str]], op: str) -> None:
    """TypeError unless array ``value`` is on the device of ``ref``; ``owner`` (or ``owner()``,
    only called for the message) names ``ref``. Host arrays take a two-comparison fast path.
    """
    if type(value) in HOST_TYPES and type(ref) in HOST_TYPES:
        return
    got, want = device_of(value), device_of(ref)
    if got != want:
        owner = owner() if callable(owner) else owner
        raise TypeError(f"{prefix(op)} {what} must be on {want} (the device of {owner}), got a {got} array")
