"""A stand-in for a GPU array, for testing mpidist's device paths on a machine without one.

``FakeDeviceArray`` holds its data in host memory but looks like a device array from
outside: it exposes ``__cuda_array_interface__`` (version 3) and ``__dlpack_device__``
(kDLCUDA), and nothing numpy can read directly (no ``__array__``, no buffer protocol).
So any code path that would hand it to numpy or to a non-CUDA-aware MPI as if it were
host memory is caught by the tests, while a path that legitimately passes its pointer
to MPI (the CUDA-aware path) or copies it with the device runtime works, because the
pointer is really host memory.

Tests read and write its contents through ``.host`` (a numpy view of the same memory),
the way a GPU test would call ``cupy.asnumpy``.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

__all__ = ["FakeDeviceArray", "KDL_CUDA"]

#: DLPack device type of CUDA memory (dlpack.h: kDLCUDA).
KDL_CUDA = 2


class FakeDeviceArray:
    """A C-contiguous "device" array of ``shape`` and ``dtype`` on CUDA device ``device``.

    Build one from data with :meth:`from_host`; ``stream`` is what the interface
    reports as the stream the data is ready on (None: the legacy default stream, 1).
    ``syncs`` counts how often a runtime synchronized it (tests assert that MPI never
    touches it before).
    """

    def __init__(self, shape: Any, dtype: Any = np.float32, device: int = 0,
                 stream: Optional[int] = 1) -> None:
        self._data = np.zeros(shape, dtype=dtype)
        self.device = device
        self.stream = stream
        self.syncs = 0

    @classmethod
    def from_host(cls, data: Any, device: int = 0, stream: Optional[int] = 1) -> "FakeDeviceArray":
        data = np.asarray(data)
        out = cls(data.shape, data.dtype, device, stream)
        out._data[...] = data
        return out

    # -- what a device array shows -------------------------------------------------------
    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": self._data.shape, "typestr": self._data.dtype.str,
                "data": (self._data.ctypes.data, False), "version": 3, "strides": None,
                "stream": self.stream}

    def __dlpack_device__(self) -> tuple[int, int]:
        return (KDL_CUDA, self.device)

    @property
    def shape(self) -> tuple:
        return self._data.shape

    @property
    def dtype(self) -> np.dtype:
        return self._data.dtype

    @property
    def size(self) -> int:
        return self._data.size

    @property
    def nbytes(self) -> int:
        return self._data.nbytes

    @property
    def ndim(self) -> int:
        return self._data.ndim

    def __len__(self) -> int:
        return len(self._data)

    # -- for the tests -------------------------------------------------------------------
    @property
    def host(self) -> np.ndarray:
        """A numpy view of the same memory (what cupy.asnumpy would return, but shared)."""
        return self._data

    def __repr__(self) -> str:
        return f"FakeDeviceArray(shape={self.shape}, dtype={self.dtype}, device={self.device})"
