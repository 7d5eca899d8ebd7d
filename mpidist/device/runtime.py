"""The device runtime: everything mpidist does to a device array goes through one object.

:class:`DeviceRuntime` is the interface (which device an array is on, its shape and
dtype, synchronizing the stream it is ready on, pinned host buffers, copies between
device and host, and the "compute view" that the host ops and a CUDA-aware MPI take).
:class:`CupyRuntime` implements it with CuPy, imported lazily on the first device
array, so a CPU-only install never loads it. Tests register a stand-in for their own
array type with :func:`register` (``tests/fake_device.py``: ``FakeRuntime``).
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from mpidist._arrays.namespace import DEVICE_TYPES
from mpidist.device import _streams
from mpidist.errors import prefix

__all__ = ["DeviceRuntime", "CupyRuntime", "register", "unregister", "runtime_for"]

_HOST_TO_DEVICE, _DEVICE_TO_HOST = 1, 2  # cudaMemcpyKind


class DeviceRuntime:
    """What mpidist needs from a GPU array library. ``x`` is a device array as the caller
    passed it (a cupy array, or any ``__cuda_array_interface__`` / DLPack device object)."""

    def owns(self, x: Any) -> bool:
        """True if this runtime handles ``x``."""
        raise NotImplementedError

    def device_of(self, x: Any) -> int:
        """The CUDA device index ``x`` lives on."""
        raise NotImplementedError

    def shape_dtype(self, x: Any) -> tuple[tuple, np.dtype]:
        raise NotImplementedError

    def c_contiguous(self, x: Any) -> bool:
        raise NotImplementedError

    def strides(self, x: Any) -> Optional[tuple]:
        """Byte strides for error messages (None: C-contiguous)."""
        raise NotImplementedError

    def span(self, x: Any) -> tuple[int, int]:
        """(device address, bytes) of ``x``'s memory, to detect overlapping arguments."""
        raise NotImplementedError

    def synchronize(self, x: Any) -> None:
        """Block until the work producing ``x`` is done: its interface's stream, else the
        current stream. MPI may read or write ``x`` after this returns."""
        raise NotImplementedError

    def compute_view(self, x: Any) -> Any:
        """``x`` as an array the host ops and a CUDA-aware MPI accept (zero-copy)."""
        raise NotImplementedError

    def pinned(self, nbytes: int) -> np.ndarray:
        """A new page-locked host buffer: a uint8 numpy array of ``nbytes``."""
        raise NotImplementedError

    def to_host(self, x: Any, out: np.ndarray) -> None:
        """Copy ``x`` into the host array ``out`` (same shape and dtype); done on return."""
        raise NotImplementedError

    def to_device(self, src: np.ndarray, x: Any) -> None:
        """Copy host ``src`` into ``x``; done on return (``src`` may be reused at once)."""
        raise NotImplementedError

    # -- asynchronous copies, for pipelined staging (mpidist._backends.device.pipeline) ---------------
    # ``offset`` counts bytes into ``x``'s memory; host arrays are pinned uint8 buffers.
    # Called inside ``on_device(device)``, maybe from another thread than the caller's.

    def on_device(self, device: int) -> Any:
        """A context manager making ``device`` the current device of this thread."""
        raise NotImplementedError

    def copy_streams(self, device: int) -> tuple[Any, Any]:
        """Two streams of ``device`` that wait for no other (down, up), made once."""
        raise NotImplementedError

    def copy_down(self, x: Any, offset: int, out: np.ndarray, stream: Any) -> None:
        """Enqueue on ``stream`` the copy of ``out.nbytes`` bytes of ``x`` from ``offset`` into ``out``."""
        raise NotImplementedError

    def copy_up(self, src: np.ndarray, x: Any, offset: int, stream: Any) -> None:
        """Enqueue on ``stream`` the copy of ``src`` into ``x`` from byte ``offset``."""
        raise NotImplementedError

    def record(self, stream: Any) -> Any:
        """An event recorded on ``stream`` now."""
        raise NotImplementedError

    def wait(self, event: Any) -> None:
        """Block the host until ``event`` has happened."""
        raise NotImplementedError


class CupyRuntime(DeviceRuntime):
    """:class:`DeviceRuntime` on CuPy (13 or 14). Handles every device array: cupy arrays
    directly, other ``__cuda_array_interface__`` and DLPack objects as zero-copy cupy views."""

    def __init__(self) -> None:
        import cupy  # noqa: PLC0415  (optional dependency, loaded on the first device array)

        self.cp = cupy
        self._copy_streams: dict = {}
        DEVICE_TYPES.add(cupy.ndarray)

    def owns(self, x: Any) -> bool:
        return True

    def _array(self, x: Any) -> Any:
        cp = self.cp
        if isinstance(x, cp.ndarray):
            return x
        if hasattr(x, "__cuda_array_interface__"):
            return cp.asarray(x)
        return cp.from_dlpack(x)  # orders the producer's stream before cupy's current one

    def device_of(self, x: Any) -> int:
        if isinstance(x, self.cp.ndarray):
            return x.device.id
        dl = getattr(x, "__dlpack_device__", None)
        if dl is not None:
            return int(dl()[1])
        ptr = x.__cuda_array_interface__["data"][0]
        return int(self.cp.cuda.runtime.pointerGetAttributes(ptr).device)

    def shape_dtype(self, x: Any) -> tuple[tuple, np.dtype]:
        a = self._array(x)
        return a.shape, a.dtype

    def c_contiguous(self, x: Any) -> bool:
        return bool(self._array(x).flags.c_contiguous)

    def strides(self, x: Any) -> Optional[tuple]:
        return self._array(x).strides

    def span(self, x: Any) -> tuple[int, int]:
        a = self._array(x)
        return int(a.data.ptr), int(a.nbytes)

    def synchronize(self, x: Any) -> None:
        cp = self.cp
        cai = None if isinstance(x, cp.ndarray) else getattr(x, "__cuda_array_interface__", None)
        if cai is None:  # cupy array or DLPack object: ready on cupy's current stream
            self._array(x)
        stream = cai.get("stream", -1) if cai is not None and cai.get("version", 0) >= 3 else -1
        if stream == -1:  # no stream given: the current stream
            cp.cuda.get_current_stream().synchronize()
        elif stream is not None:  # None: the producer says no synchronization is needed
            # 1 = legacy default, 2 = per-thread default: valid handles themselves
            _streams.wrap(cp, int(stream)).synchronize()

    def compute_view(self, x: Any) -> Any:
        return self._array(x)

    def pinned(self, nbytes: int) -> np.ndarray:
        mem = self.cp.cuda.alloc_pinned_memory(max(nbytes, 1))
        return np.frombuffer(mem, np.uint8, nbytes)

    def to_host(self, x: Any, out: np.ndarray) -> None:
        a = self._array(x)
        with a.device:
            a.get(out=out)  # blocking on the current stream

    def to_device(self, src: np.ndarray, x: Any) -> None:
        a = self._array(x)
        with a.device:
            a.set(src)
            self.cp.cuda.get_current_stream().synchronize()  # src is a pooled buffer

    def on_device(self, device: int) -> Any:
        return self.cp.cuda.Device(device)

    def copy_streams(self, device: int) -> tuple[Any, Any]:
        found = self._copy_streams.get(device)
        if found is None:
            Stream = self.cp.cuda.Stream  # noqa: N806
            found = self._copy_streams[device] = (Stream(non_blocking=True), Stream(non_blocking=True))
        return found

    def copy_down(self, x: Any, offset: int, out: np.ndarray, stream: Any) -> None:
        ptr = int(self._array(x).data.ptr) + offset
        self.cp.cuda.runtime.memcpyAsync(out.ctypes.data, ptr, out.nbytes, _DEVICE_TO_HOST, stream.ptr)

    def copy_up(self, src: np.ndarray, x: Any, offset: int, stream: Any) -> None:
        ptr = int(self._array(x).data.ptr) + offset
        self.cp.cuda.runtime.memcpyAsync(ptr, src.ctypes.data, src.nbytes, _HOST_TO_DEVICE, stream.ptr)

    def record(self, stream: Any) -> Any:
        event = self.cp.cuda.Event(block=False, disable_timing=True)
        event.record(stream)
        return event

    def wait(self, event: Any) -> None:
        event.synchronize()


_registered: list = []
_cupy: Optional[CupyRuntime] = None


def register(runtime: DeviceRuntime) -> None:
    """Put ``runtime`` ahead of CuPy for the arrays it ``owns`` (tests; other libraries)."""
    if runtime not in _registered:
        _registered.insert(0, runtime)


def unregister(runtime: DeviceRuntime) -> None:
    if runtime in _registered:
        _registered.remove(runtime)


def runtime_for(x: Any, op: str, arg: str) -> DeviceRuntime:
    """The runtime for device array ``x`` (argument ``arg`` of ``op``).

    Raises:
        TypeError: no registered runtime owns ``x`` and CuPy cannot be imported.
    """
    global _cupy
    for rt in _registered:
        if rt.owns(x):
            return rt
    if _cupy is None:
        try:
            _cupy = CupyRuntime()
        except ImportError as exc:
            raise TypeError(
                f"{prefix(op)} {arg} is a device (GPU) array, and mpidist moves device arrays "
                f"with CuPy, which cannot be imported ({exc}); install it (pip install "
                f"'mpidist[gpu]') or copy the array to a numpy array first"
            ) from None
    return _cupy
