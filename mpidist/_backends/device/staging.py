"""Host staging: device arrays copied to pooled pinned host buffers, the MPI backend's body
(:mod:`mpidist._backends.mpi`), the results copied back (:data:`STAGING`); and
:class:`DeviceWork`, the Work of an async device call. A buffer goes back to the pool only once
its op is complete (docs/device.md, "Host staging").
"""

from __future__ import annotations

import concurrent.futures
import math
import threading
import warnings
from typing import Any, Callable, Optional

import numpy as np

from mpidist._backends.device.paths import MPI_CUDA_OPS
from mpidist._backends.mpi import MPI
from mpidist._core.group import ProcessGroup
from mpidist._dispatch.p2p_op import with_tensor
from mpidist.device import op_args as A
from mpidist.device.detect import Detection, detection
from mpidist.device.runtime import DeviceRuntime
from mpidist.work import Work

__all__ = ["PinnedPool", "pool_for", "DeviceWork", "Staging", "STAGING", "warn_once", "POOL_LIMIT"]

#: Bytes of free pinned buffers a pool keeps for reuse (1 GiB).
POOL_LIMIT = 1 << 30
_MIN_BUFFER = 4096


class PinnedPool:
    """Free pinned host buffers of one runtime, by capacity (powers of two, >= 4 KiB; at
    most :data:`POOL_LIMIT` bytes kept, the largest dropped first). Thread-safe. Counters:
    ``allocated``, ``reused``, ``in_use``."""

    def __init__(self, runtime: DeviceRuntime) -> None:
        self.runtime = runtime
        self._free: dict[int, list] = {}
        self._free_bytes = 0
        self._lock = threading.Lock()
        self.allocated = self.reused = self.in_use = 0

    def acquire(self, nbytes: int) -> np.ndarray:
        """A uint8 buffer of at least ``nbytes`` that nobody else holds."""
        cap = max(_MIN_BUFFER, 1 << max(nbytes - 1, 0).bit_length())  # the power of two >= nbytes
        with self._lock:
            self.in_use += 1
            free = self._free.get(cap)
            if free:
                self._free_bytes -= cap
                self.reused += 1
                return free.pop()
            self.allocated += 1
        return self.runtime.pinned(cap)

    def release(self, buf: np.ndarray) -> None:
        """Give ``buf`` back (the op using it is complete)."""
        with self._lock:
            self.in_use -= 1
            self._free.setdefault(buf.nbytes, []).append(buf)
            self._free_bytes += buf.nbytes
            for cap in sorted(self._free, reverse=True):
                while self._free_bytes > POOL_LIMIT and self._free[cap]:
                    self._free[cap].pop()
                    self._free_bytes -= cap

    def free_buffers(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._free.values())


_pools: dict[int, PinnedPool] = {}
_pools_lock = threading.Lock()


def pool_for(runtime: DeviceRuntime) -> PinnedPool:
    """The process's pool for ``runtime`` (made on first use)."""
    with _pools_lock:
        if id(runtime) not in _pools:  # (the pool holds its runtime: the id is never reused)
            _pools[id(runtime)] = PinnedPool(runtime)
        return _pools[id(runtime)]


_warned = False


def warn_once(cuda: Detection, op: str) -> None:
    """Warn, once per process, that device arrays are staged and how to do better.

    ``cuda``: the CUDA-awareness decision. Where MPI is CUDA-aware, ``op`` is staged
    because mpidist does not hand MPI this call's device arrays (see
    :func:`mpidist._backends.device.paths.mpi_cuda_ok`)."""
    global _warned
    if _warned:
        return
    _warned = True
    if cuda.aware:
        why = (
            f"MPI is CUDA-aware ({cuda.source}), but mpidist hands it device arrays only for "
            f"{', '.join(sorted(MPI_CUDA_OPS))} on non-overlapping buffers, with a ReduceOp and an "
            f"MPI-reducible dtype where the op reduces; {op} here is not such a call). For a faster path "
            f"use init_process_group(backend='cpu:mpi,cuda:nccl')."
        )
    else:
        why = (
            f"the group's backend has no NCCL and MPI is not CUDA-aware: {cuda.source}). For a faster path use "
            f"init_process_group(backend='cpu:mpi,cuda:nccl'), or a CUDA-aware MPI (set "
            f"MPIDIST_CUDA_AWARE=1 if yours is one and detection missed it)."
        )
    warnings.warn("mpidist: device arrays are staged through host memory (" + why, UserWarning, stacklevel=5)


class DeviceWork(Work):
    """The Work of an async call on device arrays: wraps the MPI backend's Work.

    ``finish(ok)`` runs once, when the inner op completed (staging: copy the outputs back,
    unless ``ok`` is False, and return the buffers), so after ``wait()``, a True
    ``is_completed()`` or the future's completion the device outputs hold the result.
    ``result()`` lists the caller's device arrays (``outmap``: host array id -> device array).
    """

    def __init__(self, inner: Work, finish: Optional[Callable[[bool], None]], outmap: dict) -> None:
        super().__init__(inner._op, inner._where)
        self._inner = inner
        self._finish = finish
        self._outmap = outmap
        self._lock = threading.Lock()

    def _complete(self, ok: bool) -> None:
        with self._lock:
            finish, self._finish = self._finish, None
        if finish is not None:
            finish(ok)

    def wait(self, timeout: Any = None) -> bool:
        try:
            self._inner.wait(timeout)
        except Exception:
            if self._inner.is_completed():
                self._complete(False)
            raise
        self._complete(True)
        return True

    def is_completed(self) -> bool:
        if not self._inner.is_completed():
            return False
        self._complete(self._inner.exception() is None)
        return True

    def exception(self) -> Optional[BaseException]:
        return self._inner.exception()

    def source_rank(self) -> int:
        return self._inner.source_rank()

    def _watched_recs(self) -> tuple:
        return self._inner._watched_recs()

    def _outputs(self) -> tuple:
        return tuple(self._outmap.get(id(h), h) for h in self._inner._outputs())

    def get_future(self) -> concurrent.futures.Future:
        return self._follow(self._inner.get_future, self._done_inner)

    def _done_inner(self, f: concurrent.futures.Future) -> tuple:
        """The inner op's future ``f`` is done: finish, and say how (``get_future()``'s outcome)."""
        error = f.exception()
        try:
            self._complete(error is None)
        except BaseException as exc:  # noqa: BLE001  (delivered through the future)
            error = error or exc
        return error, self._outputs()


class _Staged:
    """The host side of one staged call: a host array per device array (one per distinct
    object, so aliasing by identity survives), copied down if read, up if written."""

    def __init__(self, rt: DeviceRuntime) -> None:
        self.rt = rt
        self.pool = pool_for(rt)
        self.host: dict[int, tuple] = {}  # id(device array) -> (device array, host view, buffer)
        self.down: set = set()  # ids copied down already
        self.uploads: dict[int, tuple] = {}  # id -> (host view, device array)
        self.left = 1  # Works still to finish (a batch has one per op)
        self._lock = threading.Lock()

    def convert(self, x: Any, role: int) -> Any:
        """The host array standing for ``x`` (``x`` itself unless it is a device array)."""
        if isinstance(x, np.ndarray) or not A.is_device_array(x):
            return x
        entry = self.host.get(id(x))
        if entry is None:
            shape, dtype = self.rt.shape_dtype(x)
            nbytes = math.prod(shape) * dtype.itemsize
            buf = self.pool.acquire(nbytes)
            entry = self.host[id(x)] = (x, buf[:nbytes].view(dtype).reshape(shape), buf)
            self.rt.synchronize(x)  # work producing x, or still using it, is done
        if role & A.IN and id(x) not in self.down:
            self.down.add(id(x))
            self.rt.to_host(x, entry[1])
        if role & A.OUT:
            self.uploads[id(x)] = (entry[1], x)
        return entry[1]

    def outmap(self) -> dict:
        return {id(view): x for x, view, _ in self.host.values()}

    def finish(self, ok: bool, only: Any = None) -> None:
        """One Work of the call completed (``ok``: without error): copy its outputs up
        (``only``: just that device array, for one op of a batch; None: all), and give
        every buffer back once the call's last Work completed."""
        try:
            if ok:
                for key, (view, x) in self.uploads.items():
                    if only is None or key == id(only):
                        self.rt.to_device(view, x)
        finally:
            with self._lock:
                self.left -= 1
                last = self.left == 0
            if last:
                for _, _, buf in self.host.values():
                    self.pool.release(buf)


class Staging:
    """Host staging: the MPI backend's body on host copies of the call's device arrays; the
    written ones are copied back at once (sync) or when the returned Work completes
    (async). Warns once per process (:func:`warn_once`)."""

    def run(self, op: str, g: ProcessGroup, args: dict, runtime: Optional[DeviceRuntime] = None) -> Any:
        """As :meth:`CommBackend.run`; ``runtime``: the arrays' device runtime when the caller
        (the router) found it already, else looked up here."""
        runtime = runtime or A.runtime_of(op, args)
        warn_once(detection(), op)
        staged = _Staged(runtime)
        try:
            result = MPI.run(op, g, A.replace(op, args, staged.convert, with_tensor))
        except BaseException:
            staged.finish(False)
            raise
        if op == "batch_isend_irecv":
            ops = args["p2p_op_list"]
            staged.left = len(result)
            outmap = staged.outmap()
            return [
                DeviceWork(w, lambda ok, x=p.tensor: staged.finish(ok, x), outmap)  # type: ignore[misc]  # mypy cannot infer a lambda with a defaulted extra parameter
                for w, p in zip(result, ops)
            ]
        if isinstance(result, Work):
            return DeviceWork(result, staged.finish, staged.outmap())
        staged.finish(True)
        return result


STAGING = Staging()
