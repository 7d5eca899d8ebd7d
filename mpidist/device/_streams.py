"""CuPy stream objects for raw CUDA stream handles made elsewhere (torch's current stream, a
``__cuda_array_interface__`` producer's), made once per (handle, device) and reused.

Making one per call cost microseconds on every op of the NCCL path, and CuPy 14 warns on
each ``cupy.cuda.ExternalStream`` (deprecated there for ``Stream.from_external``, which
takes an object with the CUDA stream protocol's ``__cuda_stream__``). A cached object
holds only the handle, so a handle that torch reuses for a new stream is the same stream
to CUDA. Handle 0 (the legacy default stream) is CuPy's null stream.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from typing import Any

__all__ = ["wrap"]

#: Handles kept at most (a program makes a few streams; one that makes many per step
#: starts afresh here rather than growing without bound).
LIMIT = 256

_cache: dict = {}
_lock = threading.Lock()


class _Handle:
    """A raw handle with the CUDA stream protocol (``(version 0, handle)``)."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def __cuda_stream__(self) -> tuple:
        return (0, self.ptr)


def wrap(cupy: Any, ptr: int, device: int = -1) -> Any:
    """The CuPy stream for raw handle ``ptr`` on CUDA device ``device`` (-1: the current one)."""
    key = (ptr, device)
    stream = _cache.get(key)
    if stream is not None:
        return stream
    if ptr == 0:
        stream = cupy.cuda.Stream.null
    else:
        with cupy.cuda.Device(device) if device >= 0 else contextlib.nullcontext():
            from_external = getattr(cupy.cuda.Stream, "from_external", None)
            if from_external is not None:
                stream = from_external(_Handle(ptr))
            else:  # CuPy < 14
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", DeprecationWarning)
                    stream = cupy.cuda.ExternalStream(ptr, device)
    with _lock:
        if len(_cache) >= LIMIT:
            _cache.clear()
        _cache[key] = stream
    return stream
