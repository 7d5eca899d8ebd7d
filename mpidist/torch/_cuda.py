"""CUDA tensors through mpidist's device router, in torch's stream order.

A CUDA tensor reaches an mpidist op as a :class:`CudaTensor`: its memory (a
``__cuda_array_interface__`` version 3 whose ``"stream"`` is the torch stream that was
current when the op was issued, so every path waits for the kernels that produced the
data), its dtype as numpy / ml_dtypes spell it (bfloat16 included), and its DLPack
device. mpidist's router (:mod:`mpidist.device.route`) then picks the path it picks
for any device array: NCCL on a group whose backend names it, a CUDA-aware MPI where
one was detected (with CuPy), else host staging through pinned buffers. A device
pointer never reaches an MPI that is not CUDA-aware.

:class:`TorchRuntime` is mpidist's device runtime for these arrays (registered on
import): copies, pinned buffers and stream synchronization with torch's own CUDA
calls, so host staging needs no CuPy and handles bfloat16, which CuPy lacks. The NCCL
and CUDA-aware paths need CuPy, as for any device array; they run with CuPy's current
stream set to torch's current stream (:func:`current_stream`), so a sync op's results
are ordered before the kernels torch enqueues next, as torch's NCCL backend orders them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import cache
from typing import Any, Callable, Optional

import numpy as np
import torch

from mpidist.device import _streams, runtime as device_runtime
from mpidist.errors import prefix
from mpidist.torch._dtypes import REINTERPRET

__all__ = ["CudaTensor", "TorchRuntime", "device_array", "current_stream", "stream_of"]


#: How the stream a CUDA tensor is ready on is found: torch's current CUDA stream of the
#: tensor's device on this thread (tests replace it on machines without CUDA). Called with the
#: device: without one torch looks the current device up in Python on every call.
stream_of: Callable[..., Any] = torch.cuda.current_stream


@cache
def _dtype(dtype: torch.dtype) -> Optional[np.dtype]:
    entry = REINTERPRET.get(dtype)
    if entry is not None:
        import ml_dtypes  # noqa: PLC0415

        return np.dtype(getattr(ml_dtypes, entry[1]))
    try:
        return torch.empty(0, dtype=dtype).numpy().dtype
    except TypeError:
        return None


def _numpy_dtype(dtype: torch.dtype, op: str, arg: str) -> np.dtype:
    found = _dtype(dtype)
    if found is None:
        raise TypeError(f"{prefix(op)} {arg} has dtype {dtype}, which mpidist cannot communicate")
    return found


class CudaTensor:
    """A contiguous CUDA tensor as an mpidist device array.

    ``tensor`` (detached, C-contiguous), ``stream`` (the torch stream its data is ready
    on) and ``dtype`` (numpy's or ml_dtypes' dtype for ``tensor.dtype``). Exposes
    ``__cuda_array_interface__`` (version 3, with the stream), ``__dlpack_device__``,
    ``shape``, ``dtype``, ``nbytes`` and ``flags.c_contiguous``.
    """

    __slots__ = ("tensor", "stream", "dtype")

    class _Flags:
        c_contiguous = True

    flags = _Flags()

    def __init__(self, tensor: torch.Tensor, stream: Any, dtype: np.dtype) -> None:
        self.tensor = tensor
        self.stream = stream
        self.dtype = dtype

    @property
    def shape(self) -> tuple:
        return tuple(self.tensor.shape)

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    @property
    def __cuda_array_interface__(self) -> dict:
        handle = int(getattr(self.stream, "cuda_stream", 0) or 0)
        return {
            "shape": self.shape,
            "typestr": self.dtype.str,
            "version": 3,
            "strides": None,
            "data": (self.tensor.data_ptr() if self.tensor.numel() else 0, False),
            # CAI: 1 is the legacy default stream (torch's default stream reports 0)
            "stream": handle or 1,
        }

    def __dlpack_device__(self) -> tuple:
        return (2, self.tensor.device.index or 0)  # kDLCUDA

    def __repr__(self) -> str:
        return f"CudaTensor(shape={self.shape}, dtype={self.dtype}, device={self.tensor.device})"


def device_array(t: torch.Tensor, staged: Any, write: bool, op: str, arg: str) -> CudaTensor:
    """``t`` (a CUDA tensor) as a :class:`CudaTensor`; a non-contiguous (or conj/neg) one
    through a contiguous temporary, copied back when the op completes if ``write``
    (``staged``: the call's :class:`mpidist.torch._views.Staged`)."""
    dtype = _numpy_dtype(t.dtype, op, arg)
    base = t.detach()
    if base.is_contiguous() and not base.is_conj() and not base.is_neg():
        return CudaTensor(base, stream_of(base.device), dtype)
    tmp = base.clone(memory_format=torch.contiguous_format).resolve_conj().resolve_neg()
    if write:
        staged.backs.append((base, tmp))
    return CudaTensor(tmp, stream_of(base.device), dtype)


@contextlib.contextmanager
def current_stream(device: Any = None) -> Iterator[None]:
    """Make torch's current CUDA stream (of ``device``; None: the current device) CuPy's
    current stream for the block (the NCCL and CUDA-aware paths order their work after,
    and before, what runs on it); nothing without CuPy (host staging synchronizes the
    tensors' own streams)."""
    try:
        import cupy  # noqa: PLC0415
    except ImportError:
        yield
        return
    stream = stream_of(device) if device is not None else stream_of()
    index = stream.device.index
    with _streams.wrap(cupy, int(stream.cuda_stream), index if index is not None else -1):
        yield


class TorchRuntime(device_runtime.DeviceRuntime):
    """mpidist's :class:`~mpidist.device.runtime.DeviceRuntime` for :class:`CudaTensor`:
    torch's CUDA calls (no CuPy) for everything host staging needs."""

    name = "torch"

    def owns(self, x: Any) -> bool:
        return type(x) is CudaTensor

    def device_of(self, x: Any) -> int:
        return x.tensor.device.index or 0

    def shape_dtype(self, x: Any) -> tuple:
        return x.shape, x.dtype

    def c_contiguous(self, x: Any) -> bool:
        return True

    def strides(self, x: Any) -> Optional[tuple]:
        return None

    def span(self, x: Any) -> tuple:
        return x.tensor.data_ptr(), x.nbytes

    def synchronize(self, x: Any) -> None:
        if x.stream is not None:
            x.stream.synchronize()

    def compute_view(self, x: Any) -> Any:
        """A zero-copy CuPy array of ``x`` for the CUDA-aware path (bfloat16 and float8 as
        their bits: the path only moves them; it never reduces dtypes MPI lacks)."""
        import cupy  # noqa: PLC0415  (the CUDA-aware path works on CuPy arrays)

        entry = REINTERPRET.get(x.tensor.dtype)
        return cupy.from_dlpack(x.tensor if entry is None else x.tensor.view(entry[0]))

    def pinned(self, nbytes: int) -> np.ndarray:
        buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        return buf.numpy()[:nbytes]

    @staticmethod
    def _bytes(host: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(host.reshape(-1).view(np.uint8))

    def to_host(self, x: Any, out: np.ndarray) -> None:
        self._bytes(out).copy_(x.tensor.reshape(-1).view(torch.uint8))

    def to_device(self, src: np.ndarray, x: Any) -> None:
        x.tensor.reshape(-1).view(torch.uint8).copy_(self._bytes(src))
        if x.tensor.is_cuda:
            torch.cuda.current_stream(x.tensor.device).synchronize()  # src is a pooled buffer

    def device_count(self) -> int:
        return torch.cuda.device_count()


RUNTIME = TorchRuntime()
device_runtime.register(RUNTIME)
