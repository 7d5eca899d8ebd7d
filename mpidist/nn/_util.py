"""Private helpers shared by :mod:`mpidist.nn` and :mod:`mpidist.optim`."""
from __future__ import annotations

from types import ModuleType
from typing import Any

from mpidist._array import is_device_array

__all__ = ["prefix", "check_array", "to_module"]


def prefix(op: str) -> str:
    """The mpidist error prefix ``"[rank r/n] op:"``; plain ``"op:"`` without a runtime."""
    try:
        from mpidist.errors import prefix as _prefix  # noqa: PLC0415

        return _prefix(op)
    except ImportError:  # the runtime module is optional for purely local code
        return f"{op}:"


def check_array(value: Any, what: str, op: str) -> None:
    """Raise TypeError unless ``value`` looks like a numpy/cupy array."""
    if not (hasattr(value, "shape") and hasattr(value, "dtype") and hasattr(value, "ndim")):
        raise TypeError(f"{prefix(op)} {what} must be a numpy or cupy array, got {type(value).__name__}")


def to_module(value: Any, xp: ModuleType) -> Any:
    """``value`` as an array of module ``xp`` (copies across host/device only when needed)."""
    if xp.__name__ == "numpy" and is_device_array(value):
        value = value.get()
    return xp.asarray(value)
