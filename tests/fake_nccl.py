"""A fake of CuPy's NCCL bindings and CUDA streams, for testing mpidist._backends.device.nccl without a GPU.

:class:`FakeShim` has the methods of :class:`mpidist._backends.device.nccl_shim.CupyShim`. Its
:class:`FakeComm` behaves like ``cupy.cuda.nccl.NcclCommunicator`` (same methods, same
arguments: raw pointers, counts, ncclDataType_t / ncclRedOp_t codes, a stream pointer)
but runs over MPI on a duplicate of the members' communicator, on host memory: the
pointers of ``tests/fake_device.py``'s FakeDeviceArray are host memory, read and written
through numpy views made from pointer + count + dtype with ctypes. Reductions gather every
rank's contribution and combine them in rank order, so every rank gets the same bits.
Inside ``groupStart()``/``groupEnd()`` calls are deferred; ``groupEnd()`` posts the sends
and receives as nonblocking MPI and waits for all of them (as NCCL launches a group).

Streams and events are fakes too. A collective's effect happens when it is enqueued; a
send or receive is posted as a nonblocking MPI request that stays pending on its stream.
An event recorded on a stream covers the requests pending there: it is done once they
completed, and a stream that waits on it (``wait_event``, emulating the device-side
dependency) completes them first, blocking the host. With :attr:`FakeShim.hold` set,
events recorded meanwhile stay pending until :meth:`FakeShim.release`.
:attr:`FakeShim.log` records what was enqueued where, so tests can check the stream
protocol.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import threading
from collections.abc import Iterator
from typing import Any, Optional

import numpy as np
from fake_device import FakeDeviceArray
from mpi4py import MPI

try:
    import ml_dtypes

    _BF16: Optional[np.dtype] = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover
    _BF16 = None

__all__ = [
    "FakeShim",
    "FakeComm",
    "FakeNcclError",
    "FakeStream",
    "FakeEvent",
    "StridedFake",
    "ReadOnlyFake",
    "host_view",
    "NCCL_DTYPES",
]

#: ncclDataType_t code -> numpy dtype.
NCCL_DTYPES = {
    0: np.dtype(np.int8),
    1: np.dtype(np.uint8),
    2: np.dtype(np.int32),
    3: np.dtype(np.uint32),
    4: np.dtype(np.int64),
    5: np.dtype(np.uint64),
    6: np.dtype(np.float16),
    7: np.dtype(np.float32),
    8: np.dtype(np.float64),
    9: _BF16,
}
_UFUNCS = {0: np.add, 1: np.multiply, 2: np.maximum, 3: np.minimum, 4: np.add}
_ids = itertools.count(1)


class FakeNcclError(RuntimeError):
    """What the fake raises where cupy raises ``NcclError``."""


def host_view(ptr: int, count: int, dtype: np.dtype) -> np.ndarray:
    """A numpy array over ``count`` elements of ``dtype`` at host address ``ptr`` (no copy)."""
    if count == 0:
        return np.empty(0, dtype)
    raw = (ctypes.c_uint8 * (count * dtype.itemsize)).from_address(ptr)
    return np.frombuffer(raw, np.uint8).view(dtype)


class FakeStream:
    def __init__(self, name: str) -> None:
        self.ptr = next(_ids) * 0x1000
        self.name = name
        self.pending: list = []  # MPI requests of sends/receives enqueued here

    def __repr__(self) -> str:
        return f"FakeStream({self.name})"


class FakeEvent:
    def __init__(self) -> None:
        self.id = next(_ids)
        self.recorded = False
        self.is_done = False  # False while held
        self.reqs: list = []  # the requests pending on the stream when it was recorded


class FakeComm:
    """``NcclCommunicator(ndev, commId, rank)`` over an MPI communicator (a duplicate, its own)."""

    def __init__(self, shim: FakeShim, ndev: int, uid: Any, rank: int, mpi_comm: MPI.Comm) -> None:
        self.shim = shim
        self.mpi = mpi_comm.Dup()
        if (self.mpi.Get_size(), self.mpi.Get_rank()) != (ndev, rank):
            raise FakeNcclError(f"NCCL_ERROR_INVALID_ARGUMENT: ndev/rank {ndev}/{rank} do not match the members")
        if len({repr(u) for u in self.mpi.allgather(uid)}) != 1:
            raise FakeNcclError("NCCL_ERROR_INVALID_USAGE: the ranks passed different unique ids")
        self.uid = uid
        self.destroyed = False
        shim.comms.append(self)

    # -- helpers -------------------------------------------------------------------------------
    def _call(self, name: str, stream: int, fn: Any, p2p: Optional[tuple] = None) -> None:
        """Run ``fn`` now, or defer it to groupEnd inside a group (``p2p``: (buffer, peer) of a
        send/recv, which groupEnd posts nonblocking)."""
        if self.destroyed:
            raise FakeNcclError("NCCL_ERROR_INVALID_USAGE: communicator destroyed")
        self.shim.log.append(("nccl", name, stream))
        if self.shim.fail_next:
            self.shim.fail_next = False
            raise FakeNcclError("NCCL_ERROR_SYSTEM_ERROR: injected failure")
        if self.shim.depth:
            self.shim.deferred.append((self, name, None if p2p else fn, p2p, stream))
        elif p2p is not None:
            self.shim.post(self, name, p2p, stream)
        else:
            fn()

    def _gather(self, data: np.ndarray) -> np.ndarray:
        """Every rank's ``data`` stacked in rank order (as bytes over MPI)."""
        out = np.empty((self.mpi.Get_size(), data.nbytes), np.uint8)
        self.mpi.Allgather(np.ascontiguousarray(data).view(np.uint8), out)
        return out.view(data.dtype).reshape(self.mpi.Get_size(), -1)

    @staticmethod
    def _reduce(stack: np.ndarray, op: int) -> np.ndarray:
        acc = stack[0].copy()
        for part in stack[1:]:
            _UFUNCS[op](acc, part, out=acc)
        if op == 4:
            acc = (acc / stack.shape[0]).astype(stack.dtype)
        return acc

    # -- collectives ------------------------------------------------------------------------------
    def allReduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int, stream: int) -> None:
        def go() -> None:
            dt = NCCL_DTYPES[datatype]
            host_view(recvbuf, count, dt)[...] = self._reduce(self._gather(host_view(sendbuf, count, dt)), op)

        self._call("allReduce", stream, go)

    def reduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int, root: int, stream: int) -> None:
        def go() -> None:
            dt = NCCL_DTYPES[datatype]
            result = self._reduce(self._gather(host_view(sendbuf, count, dt)), op)
            if self.mpi.Get_rank() == root:
                host_view(recvbuf, count, dt)[...] = result

        self._call("reduce", stream, go)

    def broadcast(self, sendbuf: int, recvbuf: int, count: int, datatype: int, root: int, stream: int) -> None:
        def go() -> None:
            dt = NCCL_DTYPES[datatype]
            out = host_view(recvbuf, count, dt)
            if self.mpi.Get_rank() == root and sendbuf != recvbuf:
                out[...] = host_view(sendbuf, count, dt).copy()
            self.mpi.Bcast(out.view(np.uint8), root)

        self._call("broadcast", stream, go)

    def reduceScatter(self, sendbuf: int, recvbuf: int, recvcount: int, datatype: int, op: int, stream: int) -> None:
        def go() -> None:
            dt = NCCL_DTYPES[datatype]
            n, me = self.mpi.Get_size(), self.mpi.Get_rank()
            result = self._reduce(self._gather(host_view(sendbuf, n * recvcount, dt)), op)
            host_view(recvbuf, recvcount, dt)[...] = result[me * recvcount : (me + 1) * recvcount]

        self._call("reduceScatter", stream, go)

    def allGather(self, sendbuf: int, recvbuf: int, count: int, datatype: int, stream: int) -> None:
        def go() -> None:
            dt = NCCL_DTYPES[datatype]
            n = self.mpi.Get_size()
            mine = host_view(sendbuf, count, dt).copy()
            host_view(recvbuf, n * count, dt)[...] = self._gather(mine).reshape(-1)

        self._call("allGather", stream, go)

    # -- point-to-point ----------------------------------------------------------------------------------
    def send(self, sendbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        buf = host_view(sendbuf, count, NCCL_DTYPES[datatype]).view(np.uint8)
        self._p2p("send", stream, buf, peer)

    def recv(self, recvbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        buf = host_view(recvbuf, count, NCCL_DTYPES[datatype]).view(np.uint8)
        self._p2p("recv", stream, buf, peer)

    def _p2p(self, name: str, stream: int, buf: np.ndarray, peer: int) -> None:
        if not 0 <= peer < self.mpi.Get_size():
            raise FakeNcclError(f"NCCL_ERROR_INVALID_ARGUMENT: peer {peer}")
        self._call(name, stream, None, (buf, peer))

    def destroy(self) -> None:
        if not self.destroyed:
            self.destroyed = True
            self.shim.destroyed += 1
            self.mpi.Free()


class FakeShim:
    """The shim interface (see mpidist._backends.device.nccl_shim.CupyShim) over host memory and MPI."""

    xp = np
    error = FakeNcclError

    def __init__(self, version: int = 22304, tuple_ids: bool = False) -> None:
        self.version_code = version
        self.tuple_ids = tuple_ids  # CuPy 13's form of the unique id
        self.log: list = []
        self.comms: list[FakeComm] = []
        self.destroyed = 0
        self.depth = 0
        self.deferred: list = []
        self.hold = False
        self.held: list[FakeEvent] = []
        self.fail_next = False
        self.shared_gpu = False
        self.device_now = 0
        self.streams: dict[int, FakeStream] = {}
        self.by_ptr: dict[int, FakeStream] = {}
        self.on: list[FakeStream] = []
        self.lock = threading.Lock()

    # versions, communicators
    def version(self) -> int:
        return self.version_code

    def unique_id(self) -> Any:
        raw = os.urandom(128)
        return tuple(b - 256 if b > 127 else b for b in raw) if self.tuple_ids else raw

    def communicator(self, size: int, uid: Any, rank: int, mpi_comm: MPI.Comm) -> FakeComm:
        want = tuple if self.tuple_ids else bytes
        if not isinstance(uid, want):
            raise TypeError(f"commId must be {want.__name__}")
        return FakeComm(self, size, uid, rank, mpi_comm)

    def from_dlpack(self, x: Any) -> FakeDeviceArray:
        self.log.append(("from_dlpack", type(x).__name__))
        return x.inner

    def group_start(self) -> None:
        self.depth += 1

    def group_end(self) -> None:
        self.depth -= 1
        if self.depth:
            return
        calls, self.deferred = self.deferred, []
        for comm, name, fn, p2p, stream in calls:
            if fn is None:
                self.post(comm, name, p2p, stream)
        for _comm, _name, fn, _p2p, _stream in calls:
            if fn is not None:
                fn()

    def post(self, comm: FakeComm, name: str, p2p: tuple, stream: int) -> None:
        """Post a send/receive as a nonblocking MPI request pending on ``stream``."""
        buf, peer = p2p
        req = comm.mpi.Isend(buf, peer, 0) if name == "send" else comm.mpi.Irecv(buf, peer, 0)
        with self.lock:
            self.by_ptr[stream].pending.append(req)

    # devices
    def current_device(self) -> int:
        return self.device_now

    @contextlib.contextmanager
    def device(self, device: int) -> Iterator[None]:
        before, self.device_now = self.device_now, device
        try:
            yield
        finally:
            self.device_now = before

    def device_of(self, x: Any, ptr: int) -> int:
        return int(getattr(x, "device", 0))

    def device_key(self, device: int) -> str:
        """Each rank its own GPU, unless :attr:`shared_gpu` (every rank on one GPU)."""
        return f"fake-gpu-{device}" if self.shared_gpu else f"fake-rank-{MPI.COMM_WORLD.Get_rank()}:{device}"

    # streams and events
    def current_stream(self) -> FakeStream:
        """The caller's stream on the current device (one per device: 'user<d>')."""
        if self.device_now not in self.streams:
            self.streams[self.device_now] = self._stream(f"user{self.device_now}")
        return self.streams[self.device_now]

    def external_stream(self, ptr: int) -> FakeStream:
        """A producer's stream, by its handle (the same object for the same handle)."""
        stream = self.by_ptr.get(ptr)
        if stream is None:
            stream = FakeStream(f"external{ptr}")
            stream.ptr = ptr
            self.by_ptr[ptr] = stream
        return stream

    def _stream(self, name: str) -> FakeStream:
        stream = FakeStream(name)
        self.by_ptr[stream.ptr] = stream
        return stream

    def new_stream(self) -> FakeStream:
        return self._stream("nccl")

    def new_event(self) -> FakeEvent:
        return FakeEvent()

    def record(self, event: FakeEvent, stream: FakeStream) -> None:
        self.log.append(("record", event.id, stream.ptr))
        event.recorded = True
        with self.lock:
            stream.pending = [r for r in stream.pending if r != MPI.REQUEST_NULL]
            event.reqs = list(stream.pending)
            event.is_done = not self.hold
            if self.hold:
                self.held.append(event)

    def wait_event(self, stream: FakeStream, event: FakeEvent) -> None:
        """The device-side wait, emulated: complete what the event covers (blocks the host)."""
        self.log.append(("wait", stream.ptr, event.id))
        with self.lock:
            MPI.Request.Waitall(event.reqs)

    def done(self, event: FakeEvent) -> bool:
        with self.lock:
            return event.is_done and MPI.Request.Testall(event.reqs)

    def synchronize(self, stream: FakeStream) -> None:
        self.log.append(("synchronize", stream.ptr))
        with self.lock:
            MPI.Request.Waitall(stream.pending)

    def release(self) -> None:
        """Complete every event recorded while :attr:`hold` was set, and stop holding."""
        with self.lock:
            self.hold = False
            for ev in self.held:
                ev.is_done = True
            self.held = []

    @contextlib.contextmanager
    def on_stream(self, stream: FakeStream) -> Iterator[None]:
        self.on.append(stream)
        try:
            yield
        finally:
            self.on.pop()

    # memory
    def view(self, ptr: int, count: int, dtype: np.dtype, device: int, owner: Any = None) -> np.ndarray:
        self.log.append(("kernel", self.on[-1].ptr if self.on else None))
        return host_view(ptr, count, dtype)

    def empty(self, count: int, dtype: np.dtype) -> np.ndarray:
        self.log.append(("alloc", self.on[-1].ptr if self.on else None))
        return np.empty(count, dtype)

    def pointer(self, arr: np.ndarray) -> int:
        return arr.ctypes.data

    def copy(self, dst: int, src: int, nbytes: int, stream: FakeStream) -> None:
        self.log.append(("copy", stream.ptr))
        if nbytes:
            ctypes.memmove(dst, src, nbytes)

    # for tests
    def nccl_streams(self, since: int = 0) -> set:
        """Streams the NCCL calls logged since index ``since`` ran on."""
        return {entry[2] for entry in self.log[since:] if entry[0] == "nccl"}


class StridedFake(FakeDeviceArray):
    """A FakeDeviceArray that reports non-C-contiguous strides (a transposed view)."""

    @property
    def __cuda_array_interface__(self) -> dict:
        cai = dict(super().__cuda_array_interface__)
        cai["strides"] = tuple(reversed(self._data.strides))
        return cai


class DLPackOnly:
    """A device array that speaks DLPack only (like a JAX array): ``__dlpack__`` and a CUDA
    ``__dlpack_device__``, no ``__cuda_array_interface__``. Wraps a FakeDeviceArray, which
    :meth:`FakeShim.from_dlpack` hands out as the zero-copy view (same memory)."""

    def __init__(self, inner: FakeDeviceArray) -> None:
        self.inner = inner

    def __dlpack__(self, stream: Any = None) -> Any:
        raise NotImplementedError("the fake shim's from_dlpack unwraps it instead")

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.inner.__dlpack_device__()


class ReadOnlyFake(FakeDeviceArray):
    """A FakeDeviceArray whose interface says read-only."""

    @property
    def __cuda_array_interface__(self) -> dict:
        cai = dict(super().__cuda_array_interface__)
        cai["data"] = (cai["data"][0], True)
        return cai
