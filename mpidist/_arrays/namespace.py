"""Array-module helpers shared by the model toolkit, DDP and the algorithms.

Code that must run on numpy today and cupy later asks :func:`array_module`
for the module of an array instead of importing numpy directly.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

__all__ = ["array_module", "is_device_array", "DLPACK_DEVICE_TYPES", "DEVICE_TYPES"]

#: DLPack device types (dlpack.h ``DLDeviceType``) whose memory only a GPU can read:
#: kDLCUDA (2) and kDLCUDAManaged (13). kDLCUDAHost (3), page-locked host memory, is
#: deliberately not among them: the CPU reads it directly, so such an array is host
#: memory for mpidist (wrap it with ``numpy.from_dlpack`` to pass it to an op).
DLPACK_DEVICE_TYPES = (2, 13)


#: Classes every instance of which is a device array (``cupy.ndarray``, added when the device
#: runtime loads CuPy; mpidist.torch's CudaTensor): :func:`is_device_array` answers them
#: without evaluating their ``__cuda_array_interface__`` (CuPy builds it on every access).
DEVICE_TYPES: set = set()


def is_device_array(x: Any) -> bool:
    """True for arrays that live in GPU memory.

    That is: anything with ``__cuda_array_interface__`` (cupy, numba, ...), or a
    DLPack producer whose ``__dlpack_device__()`` reports kDLCUDA or kDLCUDAManaged
    (torch, jax, ... CUDA tensors). numpy arrays (kDLCPU) and pinned host memory
    (kDLCUDAHost) are host arrays: False.
    """
    if type(x) in DEVICE_TYPES or hasattr(x, "__cuda_array_interface__"):
        return True
    dl = getattr(x, "__dlpack_device__", None)
    if dl is None or isinstance(x, np.ndarray):
        return False
    try:
        return int(dl()[0]) in DLPACK_DEVICE_TYPES
    except Exception:  # noqa: BLE001  (a broken producer is not a device array)
        return False


def array_module(x: Any) -> ModuleType:
    """Return ``cupy`` for a cupy array, else ``numpy``.

    Imports cupy lazily, so CPU-only installs never load it.
    """
    if type(x).__module__.split(".", 1)[0] == "cupy":
        import cupy  # noqa: PLC0415  (optional dependency)

        return cupy
    return np
