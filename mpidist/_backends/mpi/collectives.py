"""The MPI backend's all_reduce (its algorithms, their automatic choice and the 8-byte
latency path), broadcast, barrier and monitored_barrier: the bodies of the public functions
of :mod:`mpidist.collectives`, on host arrays, and on the device arrays of the CUDA-aware
path (:mod:`mpidist._backends.device.route`), which MPI reads and writes directly.

Each function validates its arguments (errors name rank, op and argument, expected
versus got), resolves the group, and either runs the op inline (``async_op=False``,
returns None) or hands it to the group's engine thread and returns a :class:`Work`.
A rank that is not a member of ``group`` returns None and leaves its buffers alone.
src/dst are global ranks, as in torch.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union, cast

import numpy as np
from mpi4py import MPI

from mpidist._arrays.buffers import host_array, mpi_datatype, mpi_has, mpi_reducible
from mpidist._arrays.reduce_op import PremulSum, ReduceOp, check_op_dtype, scaled, to_mpi_op
from mpidist._backends.mpi.inline import compiled_all_reduce
from mpidist._check import mismatch
from mpidist._core import recorder as R
from mpidist._core.group import ProcessGroup
from mpidist._core.tags import monitored_barrier_tag
from mpidist._dispatch.dispatch import launch, root_rank
from mpidist._launch.environment import SHM_MIN_BYTES_ENV, byte_setting
from mpidist._runtime import world as runtime
from mpidist.algorithms.hierarchical import HierAllReduce
from mpidist.algorithms.ring import ring_all_reduce
from mpidist.algorithms.shm import ShmAllReduce, ShmMismatch
from mpidist.errors import DistError, from_mpi, prefix
from mpidist.work import Work

__all__ = ["all_reduce", "broadcast", "barrier", "monitored_barrier", "ALGORITHMS", "ALL_REDUCE", "AllReduceAlgorithm"]

Op = Union[ReduceOp, PremulSum]
Plan = tuple[Callable[..., None], Any, Any, int]  # an all_reduce plan: see _PLANS
_NEVER = 1 << 62  # bytes: larger than any array
_ndarray = np.ndarray
_AVG = ReduceOp.AVG  # a module global: ``ReduceOp.AVG`` runs Enum's class lookup (~70 ns)
_now = R._now
_STARTED, _COMPLETED, _T_END, _STATE = R.STARTED, R.COMPLETED, R.T_END, R.STATE


def _mpi_all_reduce(g: ProcessGroup, arr: np.ndarray, op: Op) -> None:
    op, _ = scaled(op, arr, arr)
    g.comm.Allreduce(  # type: ignore[union-attr]  # a member's comm (None on non-members only)
        MPI.IN_PLACE, [arr, mpi_datatype(arr.dtype)], to_mpi_op(op, arr.dtype)
    )
    if op is _AVG:
        arr /= g.size()


def _ring(g: ProcessGroup, arr: np.ndarray, op: Op) -> None:
    op, _ = scaled(op, arr, arr)
    ring_all_reduce(g.ring_comm, arr, op)
    if op is _AVG:
        arr /= g.size()


def _shm(g: ProcessGroup, arr: np.ndarray, op: Op) -> None:
    """``algorithm="shm"``: the group's shared-memory window (made on first use)."""
    run = _group_shm(g).run if len(g.ranks) > 1 else None
    if run is None and len(g.ranks) > 1:
        raise ValueError(
            f"{prefix('all_reduce')} algorithm='shm' needs every rank of group {g.group_name!r} "
            f"on one node with MPI-3 shared memory; use 'hierarchical', 'mpi', 'ring' or None"
        )
    op, _ = scaled(op, arr, arr)
    if run is not None:
        try:
            run(arr, op)
        except ShmMismatch as exc:  # every member found it at the same step: the group's message
            rec = g.engine.current
            raise mismatch.shm_mismatch(g, exc.calls, rec[R.SEQ] if rec is not None else -1) from None
    if op is _AVG:
        arr /= g.size()


def _hierarchical(g: ProcessGroup, arr: np.ndarray, op: Op) -> None:
    """``algorithm="hierarchical"``: shared memory in each node, MPI (or the ring) between the
    nodes' leaders (:class:`HierAllReduce`, the group's resource ``"hier"``, made on first use)."""
    op, _ = scaled(op, arr, arr)
    if len(g.ranks) > 1:
        run = g.resource("hier", _make_hier)
        try:
            run(arr, op)
        except ShmMismatch as exc:  # the ranks of one node (node ranks in exc.calls) called differently
            raise ValueError(f"{prefix('all_reduce')} (algorithm='hierarchical', on this rank's node) {exc}") from None
    if op is _AVG:
        arr /= g.size()


def all_reduce_body(g: ProcessGroup, arr: np.ndarray, op: Op) -> None:
    """What ``all_reduce(arr, op, g)`` runs with ``algorithm=None`` (see :func:`_auto_choice`).
    Not public (not in ``__all__``): shared with the multi-array forms in
    :mod:`mpidist.reductions`, which call it on the engine."""
    _auto_choice(g, arr)(g, arr, op)


def all_reduce(tensor: np.ndarray, op: Op, g: ProcessGroup, async_op: bool, algorithm: Optional[str]) -> Optional[Work]:
    """The MPI backend's :func:`mpidist.all_reduce` (``algorithm`` may come by position here)."""
    global _last
    if type(tensor) is _ndarray and not async_op:
        last = _last
        if last[0] is tensor.dtype and last[1] is op and last[2] is algorithm:
            plan = last[3]
        elif type(op) is ReduceOp and (algorithm is None or type(algorithm) is str):
            plan = _PLANS.get((tensor.dtype, op._value_, algorithm))
            if plan is not None:
                _last = (tensor.dtype, op, algorithm, plan)
        else:
            plan = None
        if plan is not None:
            nbytes = tensor.nbytes
            flags = tensor.flags
            eng = g.engine
            # only with no op queued or running: otherwise another thread (the engine's, or
            # a callback's op on it) may be numbering one of the group's ops, which launch does
            # under the engine's lock
            ok: Optional[tuple]  # (a declaration: no code)
            if flags.c_contiguous and flags.writeable and eng.inline and eng.pending == 0:
                ok = eng.lat
                if ok[0] is plan and ok[1] == nbytes:
                    going = True  # the group's open run of calls is this call's
                else:
                    going = False
                    ok = mismatch.known
                    if not (ok[0] is plan and ok[1] == nbytes and ok[4] is g):
                        ok = mismatch.agree_all_reduce(g, plan, tensor, op)
            else:
                ok = None
            if ok is not None:
                # The inline path: MPI_Allreduce (below the plan's shared-memory sizes) or the
                # plan's body, with no thread hop, no closure, checks done once per (dtype, op),
                # and no function call that the 8-byte case can feel (each costs ~60 ns of a
                # ~1 us budget; benchmarks/results/latency_np2.md, targets.md). From the shared-
                # memory sizes up it spares launch's key tuple and comparison (~0.7 us, 1.2% of a
                # 64 KiB shared-memory call on the test VM: benchmarks/results/check_np2.md).
                # Recorded as launch would record it: R.begin's entry (sequence number, flight
                # recorder, timeout watchdog), built here; tests/test_recorder.py checks both
                # paths' entries are alike. The members agreed on this call before (``ok``: the
                # engine's note that the group's open run of calls is this all_reduce's, tested
                # by the plan's identity and the byte count; else the last agreed one; else
                # mpidist._check.mismatch.agreed); a new call takes launch's path, which compares it.
                # ``going``: it continues the group's open run (mpidist._check.mismatch.check, "Runs"),
                # so it records only how far this rank decided (what a peer's stalled check asks).
                seq = eng.seq
                eng.seq = seq + 1
                t = _now()
                rec = [
                    seq,
                    "all_reduce",
                    g,
                    tensor.shape,
                    tensor.dtype,
                    -1,
                    t,
                    t,
                    0.0,
                    _STARTED,
                    g.timeout_s or R.timeout,
                    None,
                ]
                R._append(rec)
                eng.current = rec
                try:
                    if going and seq & _PMASK:
                        eng.decided = seq
                    elif ok[2] is not _UNCHECKED:  # another run, or a multiple of the check's PERIOD
                        mismatch.check(g, rec, ok[3])  # (none on a group not checked)
                        if ok[2].lkey is ok[3]:  # a run of this call is open: the next one goes on with it
                            mismatch.note_run(eng, ok)
                    if nbytes < plan[3]:  # below the shared-memory sizes: MPI_Allreduce, no function between
                        g.comm.Allreduce(MPI.IN_PLACE, [tensor, plan[1]], plan[2])  # type: ignore[union-attr]  # a member's
                        if op is _AVG:
                            tensor /= len(g.ranks)
                    else:  # the plan's body (shared memory, the ring, the automatic choice): it averages itself
                        plan[0](g, tensor, op)
                except MPI.Exception as exc:
                    R.fail(rec)
                    raise from_mpi("all_reduce", exc) from exc
                except BaseException:
                    R.fail(rec)
                    raise
                rec[_T_END] = _now()
                rec[_STATE] = _COMPLETED
                return None
    arr = host_array(tensor, "all_reduce", "tensor", writable=True)
    return launch(
        g,
        "all_reduce",
        reduce_body(arr.dtype, op, algorithm),
        (g, arr, op),
        async_op,
        (tensor,),
        shapes=arr.shape,
        dtype=arr.dtype,
        count=arr.size,
        redop=op,
    )


def reduce_body(dtype: np.dtype, op: Op, algorithm: Optional[str]) -> Callable[[ProcessGroup, np.ndarray, Op], None]:
    """The body ``(g, arr, op)`` that all-reduces a host array of ``dtype`` with ``op`` and
    ``algorithm`` (None: the automatic choice for its size), after checking the pair.

    Raises:
        ValueError/TypeError: ``op`` does not apply to ``dtype``; an unknown ``algorithm``.
    """
    if type(op) is ReduceOp and (algorithm is None or type(algorithm) is str):
        return (_PLANS.get((dtype, op._value_, algorithm)) or _plan(dtype, op, algorithm))[0]
    check_op_dtype(op, dtype, prefix("all_reduce"))
    return _choose(dtype, algorithm).body


# (dtype, ReduceOp value, algorithm) -> (body, MPI datatype, MPI op, inline below): checked
# once, then reused (keyed on the enum's value: hashing an Enum member runs Python code).
# ``inline below``: sizes (bytes) under it call MPI_Allreduce itself on all_reduce's inline
# path; larger ones run the body there.
_PLANS: dict[tuple, Plan] = {}
#: The last plan used, ``(dtype, op, algorithm, plan)``: a repeated call finds it by three
#: identity tests instead of hashing a key (one tuple, so a reader never sees half an update).
_last: tuple = (None, None, None, None)
_PMASK = mismatch.PERIOD_MASK
_UNCHECKED = mismatch._UNCHECKED


def _inline_failed(rec: list, ierr: int) -> None:
    """The compiled latency path's failure: ``rec`` marked failed; MPI's error ``ierr`` raised."""
    R.fail(rec)
    if ierr:
        exc = MPI.Exception(ierr)
        raise from_mpi("all_reduce", exc) from exc


#: the latency path of :func:`all_reduce`'s continuing calls, compiled (mpidist._backends.mpi.inline),
#: or None: :func:`mpidist.all_reduce` tries it before this module's all_reduce
INLINE = compiled_all_reduce(globals(), _inline_failed)


@dataclass(frozen=True)
class AllReduceAlgorithm:
    """One value of all_reduce's ``algorithm`` argument, in one record: what it runs, on which
    dtypes, and how all_reduce's inline path treats it.

    Attributes:
        name: the argument's value (None: the automatic choice, :func:`_auto_choice`).
        body: ``body(g, arr, op)`` all-reduces the contiguous host array ``arr`` in place on
            group ``g`` with ``op`` (AVG included: it divides itself), on every member.
        mpi_only: it runs MPI_Allreduce, so only dtypes MPI reduces itself (:func:`mpi_has`);
            others are refused with a TypeError that names the algorithms that reduce them.
        inline_below: bytes below which all_reduce's inline (latency) path calls
            MPI_Allreduce itself instead of ``body``, for dtypes MPI reduces; 0: never (the
            body always runs). A function: read when a (dtype, op, algorithm) plan is made.
        source: where the algorithm comes from.
    """

    name: Optional[str]
    body: Callable[[ProcessGroup, np.ndarray, Op], None]
    mpi_only: bool = False
    inline_below: Callable[[], int] = lambda: 0
    source: str = ""


#: all_reduce's algorithms by name: adding one is a body and a record here (selectable by
#: name at once; the automatic choice, :func:`_auto_choice`, picks among the measured ones).
ALL_REDUCE: dict[Optional[str], AllReduceAlgorithm] = {
    a.name: a
    for a in (
        AllReduceAlgorithm(
            None, all_reduce_body, inline_below=lambda: _shm_floor(True), source="the measured fastest: _auto_choice"
        ),
        AllReduceAlgorithm(
            "mpi", _mpi_all_reduce, mpi_only=True, inline_below=lambda: _NEVER, source="MPI_Allreduce (MPI 4.1, 6.9.6)"
        ),
        AllReduceAlgorithm("ring", _ring, source="Patarasuk and Yuan, J. Parallel Distrib. Comput. 69(2), 2009"),
        AllReduceAlgorithm("shm", _shm, source="MPI-3 shared memory (MPI 4.1, 12.2.3): mpidist.algorithms.shm"),
        AllReduceAlgorithm(
            "hierarchical",
            _hierarchical,
            source="Horovod's hierarchical all-reduce; Traff, HIPS 2003: mpidist.algorithms.hierarchical",
        ),
    )
}
#: Values of all_reduce's ``algorithm`` argument besides None.
ALGORITHMS = tuple(name for name in ALL_REDUCE if name is not None)


def _choose(dtype: np.dtype, algorithm: Optional[str]) -> AllReduceAlgorithm:
    """The all_reduce algorithm ``algorithm`` for ``dtype``; raises for a bad choice."""
    alg = ALL_REDUCE.get(algorithm) if algorithm is None or type(algorithm) is str else None
    if alg is None:
        raise ValueError(f"{prefix('all_reduce')} algorithm must be one of {ALGORITHMS} or None, got {algorithm!r}")
    if alg.mpi_only and not mpi_has(dtype):  # (a saturating small integer: MPI_Allreduce with mpidist's own op)
        others = ", ".join(repr(a.name) for a in ALL_REDUCE.values() if not a.mpi_only and a.name is not None)
        raise TypeError(
            f"{prefix('all_reduce')} algorithm={algorithm!r} cannot reduce dtype {dtype}; "
            f"use algorithm={others} or None"
        )
    return alg


def _plan(dtype: np.dtype, op: ReduceOp, algorithm: Optional[str]) -> Plan:
    check_op_dtype(op, dtype, prefix("all_reduce"))
    alg = _choose(dtype, algorithm)
    inline = alg.inline_below() if mpi_reducible(dtype) else 0  # (not reducible by MPI: the body, always)
    mpi = inline > 0
    plan = (alg.body, mpi_datatype(dtype) if mpi else None, to_mpi_op(op, dtype) if mpi else None, inline)
    _PLANS[(dtype, op._value_, algorithm)] = plan
    return plan


# -- the automatic choice (algorithm=None) ----------------------------------------------------
# The sizes (bytes, [lo, hi)) for which the shared-memory algorithm beats the alternative,
# by group size, on dedicated cores (False) and oversubscribed (True: more ranks on the
# node than cores), measured with benchmarks/bench_crossover.py:
# benchmarks/results/allreduce_crossover.md. Unmeasured configurations take the nearest
# measured group size of the same kind.
# Measured on the 2-core test VM (AMD EPYC, MPICH 5.0.2, 2026-11-21); 3 ranks were not
# measured and take 4 ranks' ranges.
#: against MPI_Allreduce (dtypes MPI reduces itself): shared memory wins from 16 KiB at
#: 2 ranks, from 32 KiB at 4 (oversubscribed), at every larger size up to 64 MiB
SHM_OVER_MPI = {False: {2: (16 << 10, _NEVER)}, True: {4: (32 << 10, _NEVER)}}
#: against the ring (dtypes MPI cannot reduce: float16, bfloat16, non-native byte order;
#: measured on float16): at 2 ranks shared memory wins below 8-32 KiB only (two runs;
#: within 10% between), since each rank folds the whole array there and numpy's float16
#: arithmetic is slow (the ring folds half); at 4 ranks it wins up to 4-8 MiB, and the two
#: are within noise above
SHM_OVER_RING = {False: {2: (0, 16 << 10)}, True: {4: (0, 4 << 20)}}
_settings: Optional[tuple] = None  # (env value or None, floor vs MPI, floor vs ring), read once


def _env_min_bytes() -> Optional[int]:
    """MPIDIST_SHM_MIN_BYTES: None when unset (use the measured tables), _NEVER for ``off``
    or 0, else the byte count. Must be equal on every rank."""
    value = byte_setting(SHM_MIN_BYTES_ENV, prefix("all_reduce"))
    return value if value is None else value or _NEVER


def _shm_floor(vs_mpi: bool) -> int:
    """Size below which no group uses shared memory instead of MPI (``vs_mpi``) or the ring:
    such calls never look up the group's choice, so the 8-byte path pays nothing for it."""
    global _settings
    if _settings is None:
        env = _env_min_bytes()
        _settings = (
            env,
            *(
                min(lo for t in table.values() for lo, _ in t.values()) if env is None else env
                for table in (SHM_OVER_MPI, SHM_OVER_RING)
            ),
        )
    return _settings[1] if vs_mpi else _settings[2]


def _reset_choice() -> None:
    """Forget the cached plans and MPIDIST_SHM_MIN_BYTES (for tests that change it; groups
    made before keep the thresholds they agreed on)."""
    global _settings, _last
    _settings = None
    _PLANS.clear()
    _last = (None, None, None, None)


def _measured(table: dict, oversubscribed: bool, n: int) -> tuple[int, int]:
    """The range for ``n`` ranks: measured, else that of the nearest measured size of the
    same kind (or of the other kind where none is)."""
    sizes = table[oversubscribed] or table[not oversubscribed]
    return sizes[min(sizes, key=lambda m: (abs(m - n), m))]


#: Size (bytes) from which the hierarchical algorithm beats MPI_Allreduce on a group that
#: spans nodes with more than one rank on some node: measured with benchmarks/bench_hierarchical.py
#: on two hosts of 2 ranks (network namespaces, the link shaped to 10 Gbit/s; make bench-hosts):
#: benchmarks/results/hierarchical_np4.md (1.2-1.5x at 1 MiB in four runs; 0.94-1.08x at
#: 256 KiB, in the noise; 0.6-0.8x at 64 KiB). Measured on float32; dtypes MPI cannot reduce
#: (whose inter-node step is the ring, against the ring over every rank) take the same.
HIER_OVER_MPI = 1 << 20
#: Tests place ranks on pretend nodes: ``_node_color(global rank)`` -> node (None: MPI's split).
_node_color: Optional[Callable[[int], int]] = None


class _GroupShm:
    """A group's resource ``"shm"`` (:meth:`ProcessGroup.resource`, freed with the group):
    where its ranks are (one node, or several), which sizes use shared memory, and its
    window.

    Made collectively, once per group, by the first call that needs it (every rank makes
    the same calls, so every rank gets here at the same op): its members split by node
    (``MPI_COMM_TYPE_SHARED``) and the size ranges agreed (the narrowest over the ranks),
    in one all-reduce.
    """

    __slots__ = ("run", "ranges", "color", "spread")

    def __init__(self, g: ProcessGroup) -> None:
        n, cores = g.size(), os.cpu_count() or 1
        env = _env_min_bytes()
        mine = [_measured(t, n > cores, n) if env is None else (env, _NEVER) for t in (SHM_OVER_RING, SHM_OVER_MPI)]
        comm = cast(MPI.Comm, g.comm)  # made on a member only (comm is None on non-members)
        #: the node the tests pretend this rank is on (None: MPI's)
        self.color = None if _node_color is None else _node_color(g.ranks[g.rank()])
        rank = comm.Get_rank()
        node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank) if self.color is None else comm.Split(self.color, rank)
        local = node.Get_size()
        node.Free()
        # [lo, -hi] per range, then -(all on one node), the largest node: one MAX gives the
        # largest lo, the smallest hi, whether every rank is on one node, the largest node
        agreed = np.array([v for lo, hi in mine for v in (lo, -hi)] + [-(local == n), local], np.int64)
        comm.Allreduce(MPI.IN_PLACE, agreed, MPI.MAX)
        #: [lo, hi) byte ranges; index 1: against MPI, 0: against the ring (index = whether
        #: MPI reduces the dtype)
        self.ranges = ((int(agreed[0]), -int(agreed[1])), (int(agreed[2]), -int(agreed[3])))
        one_node = agreed[4] == -1
        self.run: Optional[ShmAllReduce] = ShmAllReduce(comm) if one_node else None
        #: the group spans nodes, some of which hold several of its ranks: the hierarchical
        #: algorithm pays
        self.spread = not one_node and int(agreed[5]) > 1

    def free(self) -> None:
        if self.run is not None:
            self.run.free()


def _group_shm(g: ProcessGroup) -> _GroupShm:
    return g.resource("shm", _GroupShm)


def _make_hier(g: ProcessGroup) -> HierAllReduce:
    return HierAllReduce(cast(MPI.Comm, g.comm), node_color=_group_shm(g).color)


def _auto_choice(g: ProcessGroup, arr: np.ndarray) -> Callable:
    """The body ``algorithm=None`` runs for ``arr`` on ``g``: shared memory for sizes in the
    group's measured range, when all its ranks are on one node; the hierarchical algorithm
    from :data:`HIER_OVER_MPI` when they span nodes, some holding several; else
    MPI_Allreduce, or the ring where MPI cannot reduce the dtype. The same on every rank: it
    depends on the size, the dtype and the group's collectively agreed state only."""
    mpi = mpi_reducible(arr.dtype)
    nbytes = arr.nbytes
    if nbytes >= _shm_floor(mpi) and len(g.ranks) > 1:
        shm = _group_shm(g)
        lo, hi = shm.ranges[mpi]
        if shm.run is not None and lo <= nbytes < hi:
            return ALL_REDUCE["shm"].body
        if shm.spread and nbytes >= HIER_OVER_MPI:
            return ALL_REDUCE["hierarchical"].body
    return ALL_REDUCE["mpi" if mpi else "ring"].body


def broadcast(
    tensor: np.ndarray, src: Optional[int], g: ProcessGroup, async_op: bool, group_src: Optional[int] = None
) -> Optional[Work]:
    """The MPI backend's :func:`mpidist.broadcast`."""
    arr = host_array(tensor, "broadcast", "tensor", writable=True)
    root = root_rank(g, src, group_src, "broadcast", "src", "group_src")
    return launch(
        g,
        "broadcast",
        g.comm.Bcast,  # type: ignore[union-attr]  # a member's comm (None on non-members only)
        ([arr, mpi_datatype(arr.dtype)], root),
        async_op,
        (tensor,),
        shapes=arr.shape,
        dtype=arr.dtype,
        root=g.ranks[root],
        count=arr.size,
    )


def barrier(
    g: ProcessGroup, async_op: bool, device_ids: Optional[list], timeout: Optional[datetime.timedelta]
) -> Optional[Work]:
    """The MPI backend's :func:`mpidist.barrier`."""
    limit = None if timeout is None else _seconds(timeout, "barrier")
    return launch(g, "barrier", g.comm.Barrier, (), async_op, limit=limit)  # type: ignore[union-attr]  # a member's


# -- monitored_barrier ---------------------------------------------------------------------
# Point-to-point on the group's own communicator, with the reserved tags of mpidist._core.tags:
# call k of a group uses monitored_barrier_tag(k), so a message that a failed call left
# behind never matches a later call. Messages a failed call could not complete stay
# posted in _mb_orphans (with their buffers) and are drained by later calls.
_mb_calls: weakref.WeakKeyDictionary[ProcessGroup, int] = weakref.WeakKeyDictionary()
_mb_orphans: list = []
_mb_lock = threading.Lock()


def _mb_drain() -> int:
    """Complete what earlier failed calls left pending, where possible; how many remain."""
    with _mb_lock:
        _mb_orphans[:] = [(req, buf) for req, buf in _mb_orphans if not req.Test()]
        return len(_mb_orphans)


def _mb_tag(g: ProcessGroup) -> int:
    """This call's tag on ``g`` (every member counts its calls the same way)."""
    _mb_drain()
    with _mb_lock:
        seq = _mb_calls.get(g, 0)
        _mb_calls[g] = seq + 1
    return monitored_barrier_tag(seq)


def _seconds(timeout: Any, op: str, g: Optional[ProcessGroup] = None) -> float:
    if timeout is None:
        timeout = (g.timeout_s if g is not None else None) or runtime.state().timeout
    if isinstance(timeout, datetime.timedelta):
        secs = timeout.total_seconds()
    elif isinstance(timeout, (int, float, np.integer, np.floating)) and not isinstance(timeout, bool):
        secs = float(timeout)
    else:
        raise TypeError(
            f"{prefix(op)} timeout must be a datetime.timedelta, seconds, or None, got {type(timeout).__name__}"
        )
    if not secs > 0:
        raise ValueError(f"{prefix(op)} timeout must be positive, got {secs} s")
    return secs


def _wait_until(reqs: list, deadline: float) -> list:
    """Poll ``reqs`` until all complete or ``deadline``; which completed. Leaves the rest
    pending, parked in _mb_orphans with their buffers (given as ``(request, buffer)``)."""
    pending = dict(enumerate(reqs))
    pause = 1e-5
    while pending:
        pending = {i: rb for i, rb in pending.items() if not rb[0].Test()}
        if not pending or time.monotonic() >= deadline:
            break
        time.sleep(pause)
        pause = min(2 * pause, 1e-3)
    with _mb_lock:
        _mb_orphans.extend(pending.values())
    return [i not in pending for i in range(len(reqs))]


def _missing_text(missing: list, wait_all: bool) -> str:
    return str(missing if wait_all else missing[:1])


def _mb_root(g: ProcessGroup, tag: int, secs: float, wait_all: bool, op: str) -> None:
    """Group rank 0: wait for every check-in until the deadline, then send each other rank
    the verdict (one int8 per group rank: 1 = arrived in time)."""
    deadline = time.monotonic() + secs
    n = g.size()
    comm = cast(MPI.Comm, g.comm)  # a member's (comm is None on non-members only)
    tokens = np.zeros(n, np.int8)
    arrived = _wait_until([(comm.Irecv(tokens[r : r + 1], r, tag), tokens) for r in range(1, n)], deadline)
    verdict = np.array([1] + arrived, np.int8)
    _wait_until([(comm.Isend(verdict, r, tag), verdict) for r in range(1, n)], time.monotonic())
    missing = [g.ranks[r] for r in range(1, n) if not verdict[r]]
    if missing:
        raise DistError(
            f"{prefix(op)} rank(s) {_missing_text(missing, wait_all)} did not reach the barrier within {secs} s"
        )


def _mb_other(g: ProcessGroup, tag: int, secs: float, wait_all: bool, op: str) -> None:
    """Any other member: check in with group rank 0, then wait for its verdict."""
    limit = secs + min(secs, 5.0)  # grace: rank 0 may have entered a little later
    token, verdict = np.ones(1, np.int8), np.zeros(g.size(), np.int8)
    comm = cast(MPI.Comm, g.comm)  # a member's (comm is None on non-members only)
    _, got = _wait_until(
        [(comm.Isend(token, 0, tag), token), (comm.Irecv(verdict, 0, tag), verdict)], time.monotonic() + limit
    )
    if not got:
        raise DistError(
            f"{prefix(op)} no word from rank {g.ranks[0]} (group rank 0) within {limit} s: "
            f"it has not reached the barrier"
        )
    missing = [g.ranks[r] for r in range(1, g.size()) if not verdict[r]]
    if missing:
        raise DistError(
            f"{prefix(op)} rank {g.ranks[0]} reports that rank(s) "
            f"{_missing_text(missing, wait_all)} did not reach the barrier within {secs} s"
        )


def monitored_barrier(g: ProcessGroup, timeout: Union[datetime.timedelta, float, None], wait_all_ranks: bool) -> None:
    """The MPI backend's :func:`mpidist.monitored_barrier`."""
    op = "monitored_barrier"
    secs = _seconds(timeout, op, g)
    tag = _mb_tag(g)
    if g.size() == 1:
        return None
    body = _mb_root if g.rank() == 0 else _mb_other
    # its own timeout, plus the grace of _mb_other, bounds it: the watchdog stays out of its way
    launch(g, op, body, (g, tag, secs, bool(wait_all_ranks), op), False, limit=2 * secs + 10.0, checked=False)
    return None  # (launch returns None for a sync op)
