"""Array-module helpers shared by the model toolkit, DDP and the algorithms.

Code that must run on numpy today and cupy later asks :func:`array_module`
for the module of an array instead of importing numpy directly.
"""
from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

__all__ = ["array_module", "is_device_array"]


def is_device_array(x: Any) -> bool:
    """True for arrays that live in GPU memory (cupy or ``__cuda_array_interface__``)."""
    return hasattr(x, "__cuda_array_interface__")


def array_module(x: Any) -> ModuleType:
    """Return ``cupy`` for a cupy array, else ``numpy``.

    Imports cupy lazily, so CPU-only installs never load it.
    """
    if type(x).__module__.split(".", 1)[0] == "cupy":
        import cupy  # noqa: PLC0415  (optional dependency)

        return cupy
    return np
