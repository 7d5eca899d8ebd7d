"""Everything the NCCL path needs from CuPy, behind one small object that tests replace.

:class:`CupyShim` is the only code of the NCCL path that touches cupy. :func:`get` returns the
shim in use (made on first use: importing mpidist never imports cupy); :func:`use` installs
another (``tests/fake_nccl.py``) and returns the previous. CuPy 13's unique id is a tuple of
128 ints, CuPy 14's ``bytes``: :meth:`CupyShim.communicator` converts it to the other form if
refused. ``commSplit`` is not used (docs/nccl.md, "Communicators").
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from typing import Any, Optional

import numpy as np

from mpidist._arrays.namespace import DEVICE_TYPES
from mpidist.device import _streams

__all__ = ["CupyShim", "get", "use"]

_MEMCPY_DEVICE_TO_DEVICE = 3  # cudaMemcpyDeviceToDevice


class CupyShim:
    """The CuPy implementation of the shim interface (the tests' fake has the same methods);
    ``stream.ptr`` is what NCCL is given."""

    def __init__(self) -> None:
        import cupy  # noqa: PLC0415  (optional dependency: only the NCCL path needs it)
        from cupy.cuda import nccl  # noqa: PLC0415

        self.cupy = cupy
        self.nccl = nccl
        DEVICE_TYPES.add(cupy.ndarray)
        #: The array module of :meth:`view` and :meth:`empty` (cupy here, numpy in the fake).
        self.xp = cupy
        #: What the nccl module raises when a call fails.
        self.error = getattr(nccl, "NcclError", RuntimeError)
        self._version: Optional[int] = None

    # -- versions, communicators ----------------------------------------------------------
    def version(self) -> int:
        """NCCL's runtime version code (2.10.3 -> 21003; 0 if unknown), asked once."""
        if self._version is None:
            try:
                self._version = int(self.nccl.get_version())
            except Exception:  # noqa: BLE001  (very old NCCL: no ncclGetVersion)
                self._version = 0
        return self._version

    def unique_id(self) -> Any:
        return self.nccl.get_unique_id()

    def communicator(self, size: int, uid: Any, rank: int, mpi_comm: Any) -> Any:
        """``NcclCommunicator(size, uid, rank)``; ``mpi_comm`` (the members' MPI communicator)
        is for fakes that run over MPI and is not used here."""
        try:
            return self.nccl.NcclCommunicator(size, uid, rank)
        except TypeError:  # the id in the other CuPy major's form
            other = (
                bytes(b & 0xFF for b in uid)
                if isinstance(uid, tuple)
                else tuple(int(b) - 256 if b > 127 else int(b) for b in uid)
            )
            return self.nccl.NcclCommunicator(size, other, rank)

    def group_start(self) -> None:
        self.nccl.groupStart()

    def group_end(self) -> None:
        self.nccl.groupEnd()

    # -- devices ----------------------------------------------------------------------------
    def current_device(self) -> int:
        return int(self.cupy.cuda.runtime.getDevice())

    def device(self, device: int) -> Any:
        """Context manager making ``device`` current."""
        return self.cupy.cuda.Device(device)

    def device_key(self, device: int) -> str:
        """What names GPU ``device`` among the machines of a job: host name and PCI bus id."""
        return f"{socket.gethostname()}:{self.cupy.cuda.Device(device).pci_bus_id}"

    def device_of(self, x: Any, ptr: int) -> int:
        """The CUDA device holding array ``x`` (data pointer ``ptr``)."""
        dev: Any = getattr(x, "device", None)
        if isinstance(dev, int):
            return dev
        if hasattr(dev, "id"):
            return int(dev.id)
        if hasattr(x, "__dlpack_device__"):
            return int(x.__dlpack_device__()[1])
        return int(self.cupy.cuda.runtime.pointerGetAttributes(ptr).device)

    def from_dlpack(self, x: Any) -> Any:
        """A zero-copy cupy view of DLPack device array ``x`` (``cupy.from_dlpack`` orders
        the producer's stream before cupy's current one)."""
        return self.cupy.from_dlpack(x)

    # -- streams and events ---------------------------------------------------------------
    def current_stream(self) -> Any:
        return self.cupy.cuda.get_current_stream()

    def external_stream(self, ptr: int) -> Any:
        """A stream object for raw handle ``ptr`` made elsewhere (a producer's stream)."""
        return _streams.wrap(self.cupy, ptr)

    def new_stream(self) -> Any:
        return self.cupy.cuda.Stream(non_blocking=True)

    def new_event(self) -> Any:
        return self.cupy.cuda.Event(block=False, disable_timing=True, interprocess=False)

    def record(self, event: Any, stream: Any) -> None:
        event.record(stream)

    def wait_event(self, stream: Any, event: Any) -> None:
        """Make ``stream`` wait (on the device, the host goes on) until ``event`` has happened."""
        stream.wait_event(event)

    def done(self, event: Any) -> bool:
        return bool(event.done)

    def synchronize(self, stream: Any) -> None:
        stream.synchronize()

    @contextlib.contextmanager
    def on_stream(self, stream: Any) -> Iterator[None]:
        """Kernels and allocations inside the block go to ``stream`` (CuPy's pool is per stream)."""
        with stream:
            yield

    # -- memory -----------------------------------------------------------------------------
    def view(self, ptr: int, count: int, dtype: np.dtype, device: int, owner: Any = None) -> Any:
        """A flat cupy array of ``count`` elements of ``dtype`` over the memory at ``ptr``."""
        cp = self.cupy
        mem = cp.cuda.UnownedMemory(ptr, count * dtype.itemsize, owner if owner is not None else self, device)
        return cp.ndarray((count,), dtype, cp.cuda.MemoryPointer(mem, 0))

    def empty(self, count: int, dtype: np.dtype) -> Any:
        """A new flat device array on the current device and stream (call inside :meth:`on_stream`)."""
        return self.cupy.empty(count, dtype)

    def pointer(self, arr: Any) -> int:
        """Data pointer of an array made by :meth:`empty`/:meth:`view`."""
        return int(arr.data.ptr)

    def copy(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        """Device-to-device copy of ``nbytes`` from ``src`` to ``dst``, enqueued on ``stream``."""
        if nbytes:
            self.cupy.cuda.runtime.memcpyAsync(dst, src, nbytes, _MEMCPY_DEVICE_TO_DEVICE, stream.ptr)


_SHIM: Optional[Any] = None


def get() -> Any:
    """The shim in use: the CuPy one, made on first use, unless :func:`use` installed another."""
    global _SHIM
    if _SHIM is None:
        _SHIM = CupyShim()
    return _SHIM


def use(shim: Optional[Any]) -> Optional[Any]:
    """Install ``shim`` (None: back to the CuPy one on next use); return the previous one."""
    global _SHIM
    previous, _SHIM = _SHIM, shim
    return previous
