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

``FakeRuntime`` is mpidist's device runtime for these arrays (register it with
``mpidist.device.runtime.register``): copies with numpy, counts what it does, and
models an unfinished kernel: data given to :meth:`FakeDeviceArray.enqueue` lands in
the array only when a runtime synchronizes it, so a path that lets MPI read the
array before synchronizing its stream sends stale data and the test sees it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import numpy as np

__all__ = ["FakeDeviceArray", "FakeRuntime", "KDL_CUDA"]

#: DLPack device type of CUDA memory (dlpack.h: kDLCUDA).
KDL_CUDA = 2


class FakeDeviceArray:
    """A C-contiguous "device" array of ``shape`` and ``dtype`` on CUDA device ``device``.

    Build one from data with :meth:`from_host`; ``stream`` is what the interface
    reports as the stream the data is ready on (None: the legacy default stream, 1).
    ``syncs`` counts how often a runtime synchronized it (tests assert that MPI never
    touches it before).
    """

    def __init__(self, shape: Any, dtype: Any = np.float32, device: int = 0, stream: Optional[int] = 1) -> None:
        self._data = np.zeros(shape, dtype=dtype)
        self.device = device
        self.stream = stream
        self.syncs = 0
        self.pending: Optional[np.ndarray] = None

    @classmethod
    def wrap(cls, view: np.ndarray, device: int = 0, stream: Optional[int] = 1) -> FakeDeviceArray:
        """A fake device array over the memory of the numpy array ``view`` (shared, not
        copied: a slice of another fake's ``.host`` makes an overlapping one; a strided
        view a non-contiguous one)."""
        out = cls((0,), view.dtype, device, stream)
        out._data = view
        return out

    def enqueue(self, data: Any) -> None:
        """A kernel writing ``data`` into this array, not finished until synchronized."""
        self.pending = np.array(data, dtype=self.dtype).reshape(self.shape)  # a copy

    @classmethod
    def from_host(cls, data: Any, device: int = 0, stream: Optional[int] = 1) -> FakeDeviceArray:
        data = np.asarray(data)
        out = cls(data.shape, data.dtype, device, stream)
        out._data[...] = data
        return out

    # -- what a device array shows -------------------------------------------------------
    @property
    def __cuda_array_interface__(self) -> dict:
        strides = None if self._data.flags.c_contiguous else self._data.strides
        return {
            "shape": self._data.shape,
            "typestr": self._data.dtype.str,
            "data": (self._data.ctypes.data, False),
            "version": 3,
            "strides": strides,
            "stream": self.stream,
        }

    def __dlpack_device__(self) -> tuple[int, int]:
        return (KDL_CUDA, self.device)

    @property
    def shape(self) -> tuple:
        return self._data.shape

    @property
    def dtype(self) -> np.dtype:
        return self._data.dtype

    @property
    def flags(self) -> Any:
        """Contiguity flags, as cupy arrays have them."""
        return self._data.flags

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


def _DONE() -> None:  # noqa: N802  (a queue entry that ran)
    return None


class FakeRuntime:
    """mpidist's device runtime (``mpidist.device.runtime.DeviceRuntime``) for
    :class:`FakeDeviceArray`: numpy copies, counters, and the stream model above.

    Counters: ``syncs`` (synchronizations), ``down`` / ``up`` (device-to-host and
    host-to-device copies), ``pinned_allocs`` (pinned buffers made), ``views`` (compute
    views handed out: the CUDA-aware path, where MPI gets the pointer); ``log`` lists
    ("sync" | "down" | "up", array id) in order.
    """

    name = "fake"

    def __init__(self, devices: int = 2) -> None:
        self.devices = devices
        self.syncs = self.down = self.up = self.pinned_allocs = self.views = 0
        self.async_down = self.async_up = 0
        self.log: list = []
        self._copy_streams: dict = {}

    def owns(self, x: Any) -> bool:
        return isinstance(x, FakeDeviceArray)

    def device_of(self, x: FakeDeviceArray) -> int:
        return x.device

    def shape_dtype(self, x: FakeDeviceArray) -> tuple:
        return x.shape, x.dtype

    def c_contiguous(self, x: FakeDeviceArray) -> bool:
        return bool(x.host.flags.c_contiguous)

    def strides(self, x: FakeDeviceArray) -> tuple:
        return x.host.strides

    def span(self, x: FakeDeviceArray) -> tuple:
        return x.host.ctypes.data, x.nbytes

    def synchronize(self, x: FakeDeviceArray) -> None:
        if x.pending is not None:
            x.host[...] = x.pending
            x.pending = None
        x.syncs += 1
        self.syncs += 1
        self.log.append(("sync", id(x)))

    def compute_view(self, x: FakeDeviceArray) -> np.ndarray:
        self.views += 1
        return x.host

    def pinned(self, nbytes: int) -> np.ndarray:
        self.pinned_allocs += 1
        return np.empty(nbytes, np.uint8)

    def to_host(self, x: FakeDeviceArray, out: np.ndarray) -> None:
        assert x.pending is None, "copied down before the stream was synchronized"
        np.copyto(out, x.host)
        self.down += 1
        self.log.append(("down", id(x)))

    def to_device(self, src: np.ndarray, x: FakeDeviceArray) -> None:
        np.copyto(x.host, src)
        self.up += 1
        self.log.append(("up", id(x)))

    def device_count(self) -> int:
        return self.devices

    # asynchronous copies (pipelined staging): each stream a queue, run only when an event
    # recorded after them is waited on, so a host that reads a buffer before waiting for its
    # copy sees stale data, as it would on a GPU
    def on_device(self, device: int) -> Any:
        return contextlib.nullcontext()

    def copy_streams(self, device: int) -> tuple:
        return self._copy_streams.setdefault(device, ([], []))

    def copy_down(self, x: FakeDeviceArray, offset: int, out: np.ndarray, stream: list) -> None:
        assert x.pending is None, "copied down before the stream was synchronized"
        src = x.host.reshape(-1).view(np.uint8)[offset : offset + out.nbytes]
        stream.append(lambda: np.copyto(out, src))
        self.async_down += 1

    def copy_up(self, src: np.ndarray, x: FakeDeviceArray, offset: int, stream: list) -> None:
        dst = x.host.reshape(-1).view(np.uint8)[offset : offset + src.nbytes]
        data = src  # read when the copy runs, as the device would
        stream.append(lambda: np.copyto(dst, data))
        self.async_up += 1

    def record(self, stream: list) -> tuple:
        return (stream, len(stream))

    def wait(self, event: tuple) -> None:
        stream, upto = event
        # run what was enqueued up to the event (entries run once: replaced by no-ops)
        for i in range(upto):
            job, stream[i] = stream[i], _DONE
            job()


# -- one call of every op, for the device-path tests ------------------------------------------


def _data(seed: Any, shape: Any = (3,), dtype: Any = np.float32) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 5, size=shape).astype(dtype)


def op_cases(members: list, rank: int) -> list:
    """(op name, host kwargs) of one call of every collective for the caller ``rank`` of a
    group of global ``members``: inputs regenerable from (rank, seed), outputs zeroed."""
    n, root = len(members), members[-1]
    z = lambda *shape: np.zeros(shape or (3,), np.float32)  # noqa: E731
    mine = root == rank
    from mpidist import ReduceOp, make_premul_sum  # noqa: PLC0415

    return [
        ("all_reduce", dict(tensor=_data([1, rank]), op=ReduceOp.SUM)),
        ("all_reduce", dict(tensor=_data([2, rank], dtype=np.int64), op=ReduceOp.MAX)),
        ("all_reduce", dict(tensor=_data([3, rank], dtype=np.float16), op=ReduceOp.SUM)),
        ("all_reduce", dict(tensor=_data([4, rank], dtype=np.float64), op=make_premul_sum(2.0))),
        ("broadcast", dict(tensor=_data([5, rank]), src=root)),
        ("reduce", dict(tensor=_data([6, rank]), dst=root, op=ReduceOp.SUM)),
        ("all_gather", dict(tensor_list=[z() for _ in range(n)], tensor=_data([7, rank]))),
        ("all_gather_into_tensor", dict(output_tensor=z(n, 3), input_tensor=_data([8, rank]))),
        ("gather", dict(tensor=_data([9, rank]), gather_list=[z() for _ in range(n)] if mine else None, dst=root)),
        ("scatter", dict(tensor=z(), scatter_list=[_data([10, i]) for i in range(n)] if mine else None, src=root)),
        ("reduce_scatter", dict(output=z(), input_list=[_data([11, rank, i]) for i in range(n)])),
        ("reduce_scatter_tensor", dict(output=z(), input=_data([12, rank], (n * 3,)), op=ReduceOp.AVG)),
        (
            "all_to_all",
            dict(
                output_tensor_list=[z() for _ in range(n)], input_tensor_list=[_data([13, rank, i]) for i in range(n)]
            ),
        ),
        ("all_to_all_single", dict(output=z(2 * n), input=_data([14, rank], (2 * n,)))),
        ("all_reduce_multigpu", dict(tensor_list=[_data([15, rank]), _data([15, rank, 1])])),
        ("reduce_multigpu", dict(tensor_list=[_data([16, rank]), _data([16, rank, 1])], dst=root)),
        ("broadcast_multigpu", dict(tensor_list=[_data([17, rank]), _data([17, rank, 1])], src=root)),
        (
            "all_gather_multigpu",
            dict(
                output_tensor_lists=[[z() for _ in range(2 * n)] for _ in range(2)],
                input_tensor_list=[_data([18, rank]), _data([18, rank, 1])],
            ),
        ),
    ]


def to_device(args: dict, pending: bool = True) -> tuple[dict, list]:
    """``args`` with every numpy array replaced by a FakeDeviceArray, and the list of
    (fake, numpy) pairs. With ``pending`` each fake starts as garbage and gets its data
    through :meth:`FakeDeviceArray.enqueue`: only a synchronized read sees it."""
    pairs: list = []

    def conv(x: Any) -> Any:
        if isinstance(x, np.ndarray):
            if pending:
                d = FakeDeviceArray.from_host(np.full_like(x, 99))
                d.enqueue(x)
            else:
                d = FakeDeviceArray.from_host(x)
            pairs.append((d, x))
            return d
        if isinstance(x, list):
            return [conv(y) for y in x]
        return x

    return {k: conv(v) for k, v in args.items()}, pairs


def assert_same(pairs: list) -> None:
    """Every fake holds what its numpy twin holds (after the same op ran on each)."""
    for d, x in pairs:
        if d.pending is not None:  # never synchronized: the op did not touch it
            d.host[...] = d.pending
        np.testing.assert_array_equal(d.host, x)
