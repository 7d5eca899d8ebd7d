"""The machinery under :mod:`mpidist._backends.device.nccl`: dtype and op tables, device-array
validation, the per-group NCCL communicators, stream ordering, completion and Work.

Streams and completion follow torch's ProcessGroupNCCL (since torch 2.8, pytorch#150398): a
sync op is enqueued on the caller's current stream itself (its arrays need no keeping alive)
and its done event is polled by the next op on the communicator (:meth:`NcclComm.retire`)
or by the completion thread's backstop (:class:`_Reaper`, every 50 ms); an async op runs on
the communicator's stream, ordered after the caller's, and the completion thread polls it,
completes its futures and releases its arrays. In flight, an op's recorder entry is watched
by mpidist's timeout watchdog. docs/device.md, "Per-call cost of a device call"; docs/nccl.md,
"Streams, completion and Work".
"""

from __future__ import annotations

import collections
import contextlib
import math
import os
import threading
import time
from collections.abc import Sequence
from typing import Any, Callable, NamedTuple, Optional, cast

import numpy as np
from mpi4py import MPI

from mpidist._arrays.buffers import value_kind
from mpidist._arrays.namespace import is_device_array
from mpidist._arrays.reduce_op import PremulSum, ReduceOp, check_op_dtype
from mpidist._backends.device import nccl_shim
from mpidist._core import recorder as R
from mpidist._core.group import ProcessGroup
from mpidist.errors import DistBackendError, DistError, prefix
from mpidist.work import Work, _seconds, poll_until

__all__ = [
    "Dev",
    "device_array",
    "Plan",
    "reduction",
    "mover",
    "NcclComm",
    "NcclGroupState",
    "state",
    "overlaps",
    "nccl_failure",
    "AVG_MIN_VERSION",
    "NcclWork",
    "REAPER",
    "Lane",
    "launch",
]

# ncclDataType_t and ncclRedOp_t values (nccl.h); stable ABI constants.
_INT8, _UINT8, _INT32, _UINT32, _INT64, _UINT64, _FLOAT16, _FLOAT32, _FLOAT64, _BFLOAT16 = range(10)
_SUM, _PROD, _MAX, _MIN, _AVG = range(5)
#: ncclAvg needs NCCL 2.10 (version code 21000); below it AVG is a SUM, then a division.
AVG_MIN_VERSION = 21000

# dtype name -> (ncclDataType_t, NCCL elements per array element). bool travels as uint8 and
# complex as pairs of reals (torch: view_as_real), so SUM/AVG/PREMUL_SUM work part by part.
_TYPES = {
    "int8": (_INT8, 1),
    "uint8": (_UINT8, 1),
    "int32": (_INT32, 1),
    "uint32": (_UINT32, 1),
    "int64": (_INT64, 1),
    "uint64": (_UINT64, 1),
    "float16": (_FLOAT16, 1),
    "float32": (_FLOAT32, 1),
    "float64": (_FLOAT64, 1),
    "bfloat16": (_BFLOAT16, 1),
    "bool": (_UINT8, 1),
    "complex64": (_FLOAT32, 2),
    "complex128": (_FLOAT64, 2),
}
_REDUCIBLE = ", ".join(_TYPES)
_OPS = {ReduceOp.SUM: _SUM, ReduceOp.PRODUCT: _PROD, ReduceOp.MAX: _MAX, ReduceOp.MIN: _MIN, ReduceOp.AVG: _AVG}
# torch maps bool reductions so that uint8 gives logical results: SUM -> MAX, PRODUCT -> MIN.
_BOOL_OPS = {ReduceOp.SUM: _MAX, ReduceOp.PRODUCT: _MIN, ReduceOp.MAX: _MAX, ReduceOp.MIN: _MIN}
_BITWISE = (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)


# -- device arrays ------------------------------------------------------------------------------


class Dev:
    """What the NCCL path needs of one device array: pointer, shape, dtype, sizes, device,
    and ``stream``: the stream its ``__cuda_array_interface__`` (version 3) says its data is
    ready on (1: legacy default, 2: per-thread default, else a handle; None: no wait).
    Duck-types ``shape``, ``ndim``, ``dtype`` and ``size`` for the host helpers.
    """

    __slots__ = ("obj", "ptr", "shape", "dtype", "size", "nbytes", "device", "stream")

    def __init__(
        self, obj: Any, ptr: int, shape: tuple, dtype: np.dtype, device: int, stream: Optional[int] = None
    ) -> None:
        self.obj, self.ptr, self.shape, self.dtype, self.device = obj, ptr, shape, dtype, device
        self.stream = stream
        self.size = math.prod(shape)
        self.nbytes = self.size * dtype.itemsize

    @property
    def ndim(self) -> int:
        return len(self.shape)


def _c_contiguous(shape: tuple, strides: Optional[Sequence[int]], itemsize: int) -> bool:
    """numpy's rule: strides of extent-1 dimensions do not matter; empty arrays are contiguous."""
    if strides is None or 0 in shape:
        return True
    expected = itemsize
    for extent, stride in zip(reversed(shape), reversed(tuple(strides))):
        if extent != 1 and stride != expected:
            return False
        expected *= extent
    return True


def device_array(x: Any, op: str, arg: str, writable: bool, shim: Any) -> Dev:
    """Validate ``x`` as a C-contiguous device array (writable if asked) of a numeric dtype;
    a DLPack-only one (a JAX array) through a zero-copy ``shim.from_dlpack`` view.

    Raises:
        TypeError: ``x`` is not a device array (neither ``__cuda_array_interface__`` nor a
            CUDA DLPack device), or has a non-numeric dtype.
        ValueError: ``x`` is not C-contiguous, or read-only where it must be written.
    """
    if type(x) is Dev:  # validated by a front end that knows its arrays (mpidist.torch)
        return x
    cai = getattr(x, "__cuda_array_interface__", None)
    if cai is None and is_device_array(x):
        x = shim.from_dlpack(x)
        cai = getattr(x, "__cuda_array_interface__", None)
    if cai is None:
        raise TypeError(
            f"{prefix(op)} {arg} must be a device (GPU) array (cupy, or any object with "
            f"__cuda_array_interface__ or a CUDA __dlpack_device__) on the NCCL path, "
            f"got {type(x).__name__}"
        )
    shape = tuple(cai["shape"])
    try:  # the array's own dtype where it has one: bfloat16 reads as "<V2" in the interface
        dtype = np.dtype(x.dtype)
    except (AttributeError, TypeError):  # e.g. a torch tensor's torch.dtype is not numpy's
        dtype = np.dtype(cai["typestr"])
    ptr, readonly = cai["data"]
    strides = cai.get("strides")
    if strides is not None and not _c_contiguous(shape, strides, dtype.itemsize):
        raise ValueError(
            f"{prefix(op)} {arg} must be C-contiguous, got a non-contiguous array of shape "
            f"{shape} and strides {tuple(strides)}"
        )
    if writable and readonly:
        raise ValueError(f"{prefix(op)} {arg} must be writable, got a read-only array")
    if dtype.kind not in "biufc" and value_kind(dtype) not in "biufc":
        raise TypeError(
            f"{prefix(op)} {arg} has dtype {dtype}, which cannot be communicated; expected a numeric or bool dtype"
        )
    stream = cai.get("stream") if cai.get("version", 0) >= 3 else None
    return Dev(x, int(ptr or 0), shape, dtype, shim.device_of(x, ptr), None if stream is None else int(stream))


def overlaps(a: Dev, b: Dev) -> bool:
    """True if the memory of ``a`` and ``b`` intersects."""
    return a.nbytes > 0 and b.nbytes > 0 and a.ptr < b.ptr + b.nbytes and b.ptr < a.ptr + a.nbytes


# -- dtype and op tables ------------------------------------------------------------------------


class Plan(NamedTuple):
    """How NCCL reduces one dtype with one op: ``type`` (ncclDataType_t), ``mult`` (NCCL
    elements per array element), ``op`` (ncclRedOp_t), ``divide`` (AVG done as SUM plus a
    division: NCCL < 2.10), ``premul`` (the PremulSum whose factor scales the input first)."""

    type: int
    mult: int
    op: int
    divide: bool
    premul: Optional[PremulSum]


_PLANS: dict = {}


def reduction(op: Any, dtype: np.dtype, name: str, version: int) -> Plan:
    """The :class:`Plan` for reducing ``dtype`` with ``op`` (cached for ReduceOp members).

    Raises:
        ValueError: a bitwise op (NCCL has none, as torch says), PRODUCT on complex, or a
            pair mpidist refuses on host arrays too (AVG on integers, MIN/MAX on complex, ...).
        TypeError: a dtype NCCL cannot reduce (int16, float8, ...), or ``op`` not a ReduceOp.
    """
    key = (dtype, id(op), version >= AVG_MIN_VERSION) if type(op) is ReduceOp else None  # (members: singletons)
    found = _PLANS.get(key)
    if found is not None:
        return found
    if op in _BITWISE:
        raise ValueError(
            f"{prefix(name)} {op!r} is not supported by NCCL (torch: 'Cannot use "
            f"ReduceOp.{op.name} with NCCL'); bitwise reductions need host arrays"
        )
    found = _TYPES.get(dtype.name) if dtype.isnative else None
    if found is None:
        raise TypeError(f"{prefix(name)} dtype {dtype} cannot be reduced by NCCL; expected one of {_REDUCIBLE}")
    op = check_op_dtype(op, dtype, prefix(name))
    premul = op if type(op) is PremulSum else None
    base = ReduceOp.SUM if premul is not None else op
    if dtype.kind == "c" and base not in (ReduceOp.SUM, ReduceOp.AVG):
        raise ValueError(
            f"{prefix(name)} {base!r} on complex dtype {dtype} is not supported by NCCL; "
            f"complex arrays reduce with SUM, AVG or PREMUL_SUM only (as torch)"
        )
    divide = base is ReduceOp.AVG and version < AVG_MIN_VERSION
    code = _BOOL_OPS[base] if dtype.kind == "b" else (_SUM if divide else _OPS[base])
    plan = Plan(found[0], found[1], code, divide, premul)
    if key is not None:
        _PLANS[key] = plan
    return plan


def mover(dtype: np.dtype) -> tuple[int, int]:
    """(ncclDataType_t, NCCL elements per element) for moving ``dtype`` without reducing it:
    its own type where NCCL has one, else bytes (int16, float8, ... move as uint8)."""
    found = _TYPES.get(dtype.name) if dtype.isnative else None
    return found if found is not None else (_UINT8, dtype.itemsize)


# -- communicators --------------------------------------------------------------------------------

#: NCCL's first version that lets ranks of one communicator share a GPU (NCCL 2.30), and
#: only with this variable set to 1; older NCCL fails such a communicator with "invalid usage".
MULTI_RANK_GPU_VERSION = 23000
MULTI_RANK_GPU_VAR = "NCCL_MULTI_RANK_GPU_ENABLE"


def version_text(code: int) -> str:
    """NCCL's version code as text (22809 -> '2.28.9'; 0 -> 'unknown')."""
    return f"{code // 10000}.{code // 100 % 100}.{code % 100}" if code else "unknown"


def version_code(version: Any) -> int:
    """NCCL's version code from a code (CuPy's ``get_version()``) or a tuple (torch's
    ``torch.cuda.nccl.version()``: (2, 28, 9) -> 22809)."""
    if isinstance(version, int):
        return version
    major, minor, patch = (tuple(version) + (0, 0, 0))[:3]
    return int(major) * 10000 + int(minor) * 100 + int(patch)


def shared_gpu_refused(version: Any) -> str:
    """'' when ranks of one communicator may share a GPU with this NCCL (a code or torch's
    tuple: :func:`version_code`), else why not."""
    version = version_code(version)
    if version >= MULTI_RANK_GPU_VERSION and os.environ.get(MULTI_RANK_GPU_VAR) == "1":
        return ""
    return (
        f"NCCL refuses ranks of one communicator on one GPU unless NCCL >= 2.30 (found "
        f"{version_text(version)}) and {MULTI_RANK_GPU_VAR}=1"
    )


def check_gpus_distinct(shim: Any, mpi_comm: MPI.Comm, device: int, name: str, what: str) -> None:
    """Raise on every member when members of ``mpi_comm`` would share a GPU that NCCL does
    not let them share (collective over ``mpi_comm``: one allgather of (host, GPU) keys)."""
    keys = mpi_comm.allgather(shim.device_key(device))
    ranks: dict = {}
    for r, key in enumerate(keys):
        ranks.setdefault(key, []).append(r)
    shared = [(key, rs) for key, rs in ranks.items() if len(rs) > 1]
    why = shared_gpu_refused(shim.version()) if shared else ""
    if why:
        key, rs = shared[0]
        raise DistBackendError(
            f"{prefix(name)} could not make the NCCL communicator of {what}: its ranks "
            f"{rs} use the same GPU ({key}); {why}. Give each rank a GPU of its own "
            f"(device = local rank), or use host staging or a CUDA-aware MPI "
            f"(backend 'mpi')"
        )


def nccl_failure(name: str, what: str, exc: BaseException) -> DistBackendError:
    text = str(exc)
    hint = (
        (" (two ranks of one communicator on one GPU need NCCL >= 2.30 and NCCL_MULTI_RANK_GPU_ENABLE=1)")
        if "uplicate GPU" in text
        else ""
    )
    return DistBackendError(f"{prefix(name)} {what}: NCCL error: {text}{hint}")


class NcclComm:
    """One NCCL communicator over the ranks of ``mpi_comm``, its stream, and its events.

    The unique id is made by rank 0 of ``mpi_comm`` and broadcast over it (pickled, so
    CuPy 13's tuple and CuPy 14's bytes both travel). Collective over ``mpi_comm``.
    """

    def __init__(self, shim: Any, mpi_comm: MPI.Comm, device: int, name: str, what: str) -> None:
        self.shim = shim
        self.device = device
        self.size = mpi_comm.Get_size()
        self.rank = mpi_comm.Get_rank()
        self.spare: list = []  # done events of finished sync ops, for reuse
        self.scratch: Any = None  # barrier's 1-element buffer
        self.lanes: dict = {}  # caller stream handle -> Lane
        #: (done event, flight-recorder entries) of the sync ops in flight, oldest first
        self.inflight: collections.deque = collections.deque()
        self.lock = threading.Lock()  # inflight: this thread's ops and the completion thread
        self.watched = False  # REAPER polls inflight as a backstop
        check_gpus_distinct(shim, mpi_comm, device, name, what)
        uid = shim.unique_id() if self.rank == 0 else None
        uid = mpi_comm.bcast(uid, root=0)
        try:
            with shim.device(device):
                self.stream = shim.new_stream()
                self.ready = shim.new_event()
                self.nccl = shim.communicator(self.size, uid, self.rank, mpi_comm)
        except shim.error as exc:
            raise nccl_failure(name, f"could not make the NCCL communicator of {what}", exc) from exc

    def lane(self, stream: Any) -> Lane:
        """The communicator as a sync op on ``stream`` (the caller's) sees it."""
        lane = self.lanes.get(stream.ptr)
        if lane is None:
            if len(self.lanes) >= 64:  # streams come and go (torch's pool wraps around)
                self.lanes.clear()
            lane = self.lanes[stream.ptr] = Lane(self, stream)
        return lane

    def retire(self, done: Any, recs: list) -> None:
        """Track sync op ``recs`` until ``done`` has happened (:meth:`reap`); first end the
        oldest ops seen done, so the list stays as long as what the device has not run yet."""
        for rec in recs:
            R.watched[id(rec)] = rec
        with self.lock:
            self.inflight.append((done, recs))
            self._reap()
        if not self.watched:
            self.watched = True
            REAPER.watch(self)

    def reap(self) -> bool:
        """End the sync ops whose done event has happened, oldest first; True if none is left."""
        with self.lock:
            return self._reap()

    def _reap(self) -> bool:
        inflight, done = self.inflight, self.shim.done
        while inflight and done(inflight[0][0]):
            event, recs = inflight.popleft()
            for rec in recs:
                R.watched.pop(id(rec), None)
                R.end(rec)
            self.spare.append(event)
        return not inflight

    def free(self) -> None:
        """Wait for the ops in flight (the NCCL stream's and the sync ops' on callers'
        streams), then destroy the communicator."""
        REAPER.unwatch(self)
        with self.shim.device(self.device):
            self.shim.synchronize(self.stream)
            while not self.reap():
                time.sleep(1e-4)
            self.nccl.destroy()


class Lane:
    """A communicator as a sync op sees it: the same NCCL communicator, shim, device and
    ranks, with ``stream`` the caller's stream (the op's bodies enqueue on ``comm.stream``
    and take either). Anything else is read from the communicator."""

    __slots__ = ("comm", "shim", "nccl", "device", "rank", "size", "stream")

    def __init__(self, comm: NcclComm, stream: Any) -> None:
        self.comm, self.shim, self.nccl, self.device = comm, comm.shim, comm.nccl, comm.device
        self.rank, self.size, self.stream = comm.rank, comm.size, stream

    def __getattr__(self, name: str) -> Any:
        return getattr(self.comm, name)


class NcclGroupState:
    """A group's NCCL resources (``ProcessGroup.resource("nccl")``): the group's communicator
    (made by the first collective) and one 2-rank communicator per peer for point-to-point,
    all on the device of the first op's arrays (docs/nccl.md, "Communicators")."""

    def __init__(self, g: ProcessGroup) -> None:
        self.g = g
        self.device: Optional[int] = None
        self.main: Optional[NcclComm] = None
        self.pairs: dict[int, NcclComm] = {}
        self.made = 0  # communicators made (tests: one per group)

    def _check_device(self, device: int, name: str, devs: Sequence[Dev], args: Sequence[str]) -> None:
        for d, arg in zip(devs, args):
            if d.device != device:
                raise ValueError(
                    f"{prefix(name)} {arg} is on device {d.device}, expected device {device} "
                    f"(where group {self.g.group_name!r} communicates through NCCL)"
                )

    def collective(self, name: str, devs: Sequence[Dev], args: Sequence[str], device: Optional[int] = None) -> NcclComm:
        """The group's communicator (made now if needed: collective over the group)."""
        if device is None:
            device = self.device if self.device is not None else devs[0].device
        self._check_device(self.device if self.device is not None else device, name, devs, args)
        comm = self.main
        if comm is None:
            g = self.g
            comm = self.main = g.engine.run_sync(
                NcclComm, nccl_shim.get(), g.comm, device, name, f"group {g.group_name!r}"
            )
            self.device = device
            self.made += 1
        return comm

    def pair(self, name: str, peer: int, devs: Sequence[Dev], args: Sequence[str]) -> NcclComm:
        """The 2-rank communicator with group rank ``peer`` (made now if needed: both take part)."""
        self._check_device(self.device if self.device is not None else devs[0].device, name, devs, args)
        comm = self.pairs.get(peer)
        if comm is None:
            comm = self.pairs[peer] = self.g.engine.run_sync(self._make_pair, name, peer, devs[0].device)
            self.device = devs[0].device
            self.made += 1
        return comm

    def _make_pair(self, name: str, peer: int, device: int) -> NcclComm:
        """MPI_Comm_create_group over the two ranks (collective over them only; its tag never
        meets point-to-point traffic) carries the unique id; then it is freed."""
        g = self.g
        lo, hi = sorted((g.rank(), peer))
        parent = cast(MPI.Intracomm, g.comm)  # a member's communicator: an intra-communicator, never None
        whole = parent.Get_group()
        two = whole.Incl([lo, hi])
        mpi_pair = parent.Create_group(two, (lo * g.size() + hi) % 32768)
        two.Free()
        whole.Free()
        try:
            return NcclComm(
                nccl_shim.get(),
                mpi_pair,
                device,
                name,
                f"ranks {g.ranks[lo]} and {g.ranks[hi]} of group {g.group_name!r}",
            )
        finally:
            mpi_pair.Free()

    def free(self) -> None:
        """Destroy every communicator: the group's, then the pairs' in peer order (the same
        order on every rank, in case a fake's destruction is collective)."""
        comms = ([self.main] if self.main is not None else []) + [self.pairs[p] for p in sorted(self.pairs)]
        self.main, self.pairs = None, {}
        for comm in comms:
            comm.free()


def state(g: ProcessGroup) -> NcclGroupState:
    """The group's :class:`NcclGroupState` (made on first use; making it is local)."""
    return g.resource("nccl", NcclGroupState)


# -- completion -------------------------------------------------------------------------------------


class _Reaper:
    """The completion thread: polls the done events of ops in flight (see the module doc)."""

    #: seconds between the backstop polls of the communicators' sync ops in flight
    LAZY_POLL = 0.05

    def __init__(self) -> None:
        self._items: list = []  # (shim, event, recs, refs, works, comm or None)
        self._cv = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        self._comms: set = set()  # communicators whose sync ops the thread polls as a backstop

    def _start(self) -> None:
        """Start the thread (under ``_cv``) if it is not running."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="mpidist-nccl-completion", daemon=True)
            self._thread.start()

    def watch(self, comm: NcclComm) -> None:
        """Poll ``comm``'s sync ops every :attr:`LAZY_POLL` s (no hand-off per op)."""
        if comm not in self._comms:
            with self._cv:
                self._comms.add(comm)
                self._start()
                self._cv.notify()

    def unwatch(self, comm: NcclComm) -> None:
        with self._cv:
            self._comms.discard(comm)

    def track(
        self, shim: Any, event: Any, recs: list, refs: tuple, works: Optional[list], comm: Optional[NcclComm]
    ) -> None:
        """Watch ``event``: once it happened, end ``recs``, complete ``works``, drop ``refs``,
        and give the event back to ``comm`` for reuse (sync ops: no Work holds it)."""
        for rec in recs:
            R.watched[id(rec)] = rec
        with self._cv:
            self._items.append((shim, event, recs, refs, works, comm))
            self._start()
            self._cv.notify()

    def drain(self, timeout: float = 10.0) -> bool:
        """Wait until every op tracked so far was seen complete (tests); False on timeout."""
        deadline = time.monotonic() + timeout
        while self._items or not all(c.reap() for c in list(self._comms)):
            if time.monotonic() > deadline:
                return False
            time.sleep(1e-4)
        return True

    def _loop(self) -> None:
        pause = 1e-4
        while True:
            with self._cv:
                while not self._items:
                    comms = list(self._comms)
                    for comm in comms:
                        comm.reap()
                    self._cv.wait(self.LAZY_POLL if comms else None)
                    pause = 1e-4
                items = list(self._items)
            finished = [it for it in items if it[0].done(it[1])]
            if not finished:
                time.sleep(pause)
                pause = min(2 * pause, 5e-3)
                continue
            gone = {id(it) for it in finished}
            with self._cv:
                self._items = [it for it in self._items if id(it) not in gone]
            for it in finished:
                self._finish(*it)
            pause = 1e-4

    @staticmethod
    def _finish(
        shim: Any, event: Any, recs: list, refs: tuple, works: Optional[list], comm: Optional[NcclComm]
    ) -> None:
        for rec in recs:
            R.watched.pop(id(rec), None)
            R.end(rec)
        for work in works or ():
            work._finished()
        if comm is not None:
            comm.spare.append(event)


REAPER = _Reaper()


class NcclWork(Work):
    """The Work of an ``async_op=True`` NCCL op (torch's ``WorkNCCL`` semantics; the table
    in docs/nccl.md, "Streams, completion and Work").

    ``wait()`` makes the caller's current stream wait on the done event; ``wait(timeout)``
    and a barrier's Work also block the host (DistError past ``timeout``). ``synchronize()``
    never blocks the host (torch's ``WorkNCCL::synchronize``), a barrier's Work included. The
    future, ``exception()`` (None) and ``source_rank()`` are :class:`mpidist.work.Work`'s;
    the completion thread calls ``_finished()``.
    """

    def __init__(
        self,
        op: str,
        where: str,
        shim: Any,
        device: int,
        event: Any,
        outputs: tuple,
        recs: list,
        source: Optional[int] = None,
        host_wait: bool = False,
    ) -> None:
        super().__init__(op, where)
        self._shim, self._device, self._event = shim, device, event
        self._outs, self._recs, self._source, self._host_wait = outputs, recs, source, host_wait

    def wait(self, timeout: Any = None) -> bool:
        limit = _seconds(timeout)
        if self._host_wait or limit is not None:
            self._block(limit)
        self.synchronize()
        return True

    def synchronize(self) -> None:
        shim = self._shim
        with shim.device(self._device):
            shim.wait_event(shim.current_stream(), self._event)

    def _watched_recs(self) -> tuple:
        return tuple(self._recs)

    def _block(self, limit: Optional[float]) -> None:
        if not host_wait_for(self._shim, self._event, self._recs, limit):
            raise self._timeout_error(limit or 0.0)

    def is_completed(self) -> bool:
        return self._done or self._shim.done(self._event)


def host_wait_for(shim: Any, event: Any, recs: list, limit: Optional[float]) -> bool:
    """Block the host until ``event`` happened (True), or ``limit`` seconds passed (False).

    Raises the watchdog's DistError once it declares one of ``recs`` timed out
    (MPIDIST_ABORT_ON_TIMEOUT=0; by default the watchdog aborts the job instead).
    """
    return poll_until(lambda: shim.done(event), recs, limit, 2e-5, 1e-3)


# -- enqueueing an op ----------------------------------------------------------------------------------


_SAME_DEVICE = contextlib.nullcontext()


def launch(
    comm: NcclComm,
    g: ProcessGroup,
    name: str,
    body: Callable[..., Any],
    args: tuple,
    refs: tuple,
    async_op: bool,
    handles: list,
    host_wait: bool = False,
    devs: Sequence[Dev] = (),
    stream: Any = None,
) -> Optional[list]:
    """Enqueue ``body(comm, *args)``. Sync: on the caller's current stream, ``body`` getting
    a :class:`Lane`; returns None. Async: on the communicator's stream, ordered after the
    caller's; returns one NcclWork per entry of ``handles``, all on the op's done event.

    ``body`` enqueues on ``comm.stream`` and may return temporaries to keep alive until the
    op is done; ``refs``: the caller's arrays, kept likewise. ``handles``: ``(op name,
    outputs, flight-recorder entries, source rank or None)`` per Work. ``host_wait``: run on
    the NCCL stream and block the host too (barrier). ``devs``: the validated arrays; the op
    is also ordered after each other stream their ``Dev.stream`` names (as the CUDA Array
    Interface asks of a consumer). ``stream``: the caller's stream, if not the shim's
    current one (mpidist.torch passes torch's).
    """
    if g.engine.broken is not None:
        raise DistError(f"{prefix(name)} group {g.group_name!r} is unusable: {g.engine.broken}")
    recs = [rec for h in handles for rec in h[2]]
    shim = comm.shim
    inline = not async_op and not host_wait
    with shim.device(comm.device) if shim.current_device() != comm.device else _SAME_DEVICE:
        caller = stream if stream is not None else shim.current_stream()
        if inline:
            on: Any = comm.lane(caller)
        else:
            on = comm
            shim.record(comm.ready, caller)
            shim.wait_event(comm.stream, comm.ready)
        stream = on.stream
        # Each other stream ``devs`` name, once. The legacy default stream is 1 in the interface
        # and 0 as the caller's (cupy's null stream): the same stream, so it costs no extra wait.
        mine, seen = int(caller.ptr) or 1, None
        for d in devs:
            ptr = d.stream
            if ptr is not None and (ptr or 1) != mine and (seen is None or ptr not in seen):
                seen = (seen or set()) | {ptr}
                ready = shim.new_event()
                shim.record(ready, shim.external_stream(ptr))
                shim.wait_event(stream, ready)
        try:
            temps = body(on, *args)
        except BaseException as exc:
            for rec in recs:
                R.fail(rec)
            if isinstance(exc, shim.error):
                raise nccl_failure(name, "the op failed", exc) from exc
            raise
        spare = comm.spare
        done = spare.pop() if spare and not async_op else shim.new_event()  # no Work holds a sync op's event
        shim.record(done, stream)
        if inline:
            comm.retire(done, recs)
            return None
        if not async_op:
            shim.wait_event(caller, done)
    works = (
        [
            NcclWork(op, prefix(op), shim, comm.device, done, outs, rs, source, host_wait)
            for op, outs, rs, source in handles
        ]
        if async_op
        else None
    )
    REAPER.track(shim, done, recs, (refs, temps), works, None if async_op else comm)
    if host_wait and not async_op:
        host_wait_for(shim, done, recs, None)
    return works
