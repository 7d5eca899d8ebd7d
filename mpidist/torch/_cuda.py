"""CUDA tensors through mpidist's device router, in torch's stream order.

A CUDA tensor reaches an mpidist op as a :class:`CudaTensor` (a ``__cuda_array_interface__``
version 3 whose ``"stream"`` is torch's current stream at issue, its numpy/ml_dtypes dtype,
its DLPack device); the router (:mod:`mpidist._backends.device.route`) picks its path as for
any device array. :class:`TorchRuntime` does host staging with torch's own CUDA calls (no
CuPy; bfloat16 included); the NCCL and CUDA-aware paths need CuPy and run with CuPy's current
stream set to torch's (:func:`current_stream`). docs/torch.md, "CUDA tensors".
"""

from __future__ import annotations

import contextlib
from functools import cache
from typing import Any, Callable, Optional

import numpy as np
import torch

from mpidist._arrays.namespace import DEVICE_TYPES
from mpidist._backends.device.nccl_core import Dev
from mpidist.device import _streams, runtime as device_runtime
from mpidist.errors import prefix
from mpidist.torch._dtypes import REINTERPRET

__all__ = ["CudaTensor", "TorchRuntime", "device_array", "current_stream", "stream_of"]


#: torch's current raw CUDA stream handle of a device index (what inductor's generated code
#: asks: ~0.2 us, where ``torch.cuda.current_stream`` builds a Stream object in Python, ~3 us)
_raw_stream: Optional[Callable[[int], int]] = getattr(torch._C, "_cuda_getCurrentRawStream", None)
#: (device index, handle) -> the torch Stream object of that handle, made once (bounded)
_torch_streams: dict = {}


def _current_stream(device: Any = None) -> Any:
    """torch's current CUDA stream of ``device`` (a torch.device or index; None: the current
    device) on this thread: the same object for the same handle, made once."""
    index = device.index if isinstance(device, torch.device) else device
    if _raw_stream is None or index is None:
        return torch.cuda.current_stream(device)
    key = (index, _raw_stream(index))
    found = _torch_streams.get(key)
    if found is None:
        if len(_torch_streams) >= 256:  # a program making streams without end
            _torch_streams.clear()
        found = _torch_streams[key] = torch.cuda.current_stream(index)
    return found


#: How the stream a CUDA tensor is ready on is found: torch's current CUDA stream of the
#: tensor's device on this thread (tests replace it on machines without CUDA).
stream_of: Callable[..., Any] = _current_stream


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
    """A contiguous CUDA tensor as an mpidist device array: ``tensor`` (detached,
    C-contiguous), ``stream`` (the torch stream its data is ready on), ``dtype`` (numpy's or
    ml_dtypes'); exposes ``__cuda_array_interface__`` and ``__dlpack_device__``.
    """

    __slots__ = ("tensor", "stream", "dtype", "shape", "device", "__cuda_array_interface__")

    class _Flags:
        c_contiguous = True

    flags = _Flags()

    def __init__(self, tensor: torch.Tensor, stream: Any, dtype: np.dtype) -> None:
        self.tensor = tensor
        self.stream = stream
        self.dtype = dtype
        self.shape = shape = tuple(tensor.shape)
        self.device = tensor.device.index or 0  # the device index (what the NCCL path asks first)
        handle = int(getattr(stream, "cuda_stream", 0) or 0)
        self.__cuda_array_interface__ = {  # made once: each op reads it several times
            "shape": shape,
            "typestr": dtype.str,
            "version": 3,
            "strides": None,
            "data": (tensor.data_ptr() if tensor.numel() else 0, False),
            # CAI: 1 is the legacy default stream (torch's default stream reports 0)
            "stream": handle or 1,
        }

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def __dlpack_device__(self) -> tuple:
        return (2, self.device)  # kDLCUDA

    def __repr__(self) -> str:
        return f"CudaTensor(shape={self.shape}, dtype={self.dtype}, device={self.tensor.device})"


def device_array(t: torch.Tensor, staged: Any, write: bool, op: str, arg: str) -> CudaTensor:
    """``t`` (a CUDA tensor) as a :class:`CudaTensor`; a non-contiguous (or conj/neg) one
    through a temporary, copied back when the op completes if ``write``. Sets
    ``staged.stream`` (:class:`mpidist.torch._views.Staged`) to the first tensor's stream."""
    dtype = _numpy_dtype(t.dtype, op, arg)
    base = t.detach()
    stream = stream_of(base.device)
    if staged.stream is None:
        staged.stream = current_stream(stream)
    if base.is_contiguous() and not base.is_conj() and not base.is_neg():
        return CudaTensor(base, stream, dtype)
    tmp = base.clone(memory_format=torch.contiguous_format).resolve_conj().resolve_neg()
    if write:
        staged.backs.append((base, tmp))
    return CudaTensor(tmp, stream, dtype)


_NO_CUPY = contextlib.nullcontext()
_cupy: Any = None


def nccl_dev(t: torch.Tensor) -> Optional[tuple]:
    """(the NCCL path's array, the CuPy stream of torch's current stream) for CUDA tensor
    ``t`` that can go to the NCCL path as it is (dense, contiguous, a known dtype; needs
    CuPy), skipping the generic array layers (~15 us of a call on an H200 host); else None."""

    if t.layout is not torch.strided or t.is_quantized or not t.is_contiguous() or t.is_conj() or t.is_neg():
        return None
    dtype = _dtype(t.dtype)
    if dtype is None or _raw_stream is None:
        return None
    index = t.get_device()
    handle = _raw_stream(index)
    stream = current_stream(_torch_streams.get((index, handle)) or _current_stream(index))
    if stream is _NO_CUPY:
        return None
    return Dev(t, t.data_ptr(), tuple(t.shape), dtype, index, handle or 1), stream


def current_stream(stream: Any) -> Any:
    """A context manager that makes torch stream ``stream`` CuPy's current stream (one
    CuPy object per handle: :func:`mpidist.device._streams.wrap`); a no-op without CuPy."""
    global _cupy
    if _cupy is None:
        try:
            import cupy  # noqa: PLC0415
        except ImportError:
            _cupy = False
        else:
            _cupy = cupy
    if _cupy is False:
        return _NO_CUPY
    index = stream.device.index
    return _streams.wrap(_cupy, int(stream.cuda_stream), index if index is not None else -1)


class TorchRuntime(device_runtime.DeviceRuntime):
    """mpidist's :class:`~mpidist.device.runtime.DeviceRuntime` for :class:`CudaTensor`:
    torch's CUDA calls (no CuPy) for everything host staging needs."""

    name = "torch"

    def __init__(self) -> None:
        self._copy_streams: dict = {}

    def owns(self, x: Any) -> bool:
        return type(x) is CudaTensor

    def device_of(self, x: Any) -> int:
        return x.device

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

    def on_device(self, device: int) -> Any:
        return torch.cuda.device(device)

    def copy_streams(self, device: int) -> tuple[Any, Any]:
        found = self._copy_streams.get(device)
        if found is None:
            found = self._copy_streams[device] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        return found

    @staticmethod
    def _span(x: Any, offset: int, nbytes: int) -> torch.Tensor:
        return x.tensor.reshape(-1).view(torch.uint8)[offset : offset + nbytes]

    def copy_down(self, x: Any, offset: int, out: np.ndarray, stream: Any) -> None:
        with torch.cuda.stream(stream):
            self._bytes(out).copy_(self._span(x, offset, out.nbytes), non_blocking=True)

    def copy_up(self, src: np.ndarray, x: Any, offset: int, stream: Any) -> None:
        with torch.cuda.stream(stream):
            self._span(x, offset, src.nbytes).copy_(self._bytes(src), non_blocking=True)

    def record(self, stream: Any) -> Any:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait(self, event: Any) -> None:
        event.synchronize()


RUNTIME = TorchRuntime()
device_runtime.register(RUNTIME)
DEVICE_TYPES.add(CudaTensor)
