"""Intra-node all-reduce through an MPI-3 shared-memory window.

The ranks of a communicator on one node map one ``MPI_Win_allocate_shared`` window and
reduce by reading each other's slots with numpy ufuncs: the "MPI+MPI" model of Hoefler et
al., "MPI+MPI: a new hybrid approach to parallel programming with MPI plus shared memory",
Computing 95(12), 2013. With ``n > 2`` ranks: Rabenseifner's reduce-scatter + all-gather
("Optimization of collective reduction operations", ICCS 2004) through the window; with 2,
each rank folds its peer's whole input (one synchronization per chunk instead of two).
Use by ``mpidist.all_reduce``, memory, crossovers: docs/architecture.md, "Choosing the
all-reduce algorithm".

Synchronization (MPI-3 unified memory model, MPI-4.1 §12.7): ``MPI_Win_lock_all`` once; a
phase ends with ``MPI_Win_sync``, a barrier on per-rank counters in the window (each alone
on its page), ``MPI_Win_sync``. A waiting rank spins, then yields, then sleeps (``_SPINS``,
``_YIELDS``, ``_SLEEP_MAX``), releasing the GIL and the core to e.g. DDP's backward. A
call's first barrier also compares the ranks' calls: a header (hash of count, dtype and
op) beside the counter, in two places alternating by barrier parity, so a fast rank never
overwrites one a slow rank still reads; a mismatch raises :class:`ShmMismatch` on every
rank before data changes, and the window stays usable.
"""

from __future__ import annotations

import os
import threading
import time
import zlib
from typing import Any, Optional, cast

import numpy as np
from mpi4py import MPI

from mpidist._arrays.buffers import host_array
from mpidist._arrays.reduce_op import _BOOL_OPS, _UFUNCS, ReduceOp, check_op_dtype
from mpidist._check.signature import dtype_text
from mpidist.errors import prefix

__all__ = ["ShmAllReduce", "ShmMismatch", "shm_all_reduce", "shm_applicable", "shm_release", "DEFAULT_SLOT_BYTES"]

#: Window bytes per rank (besides one page for its counter). A chunk of the buffer
#: occupies it: ``n * slot/n`` bytes with ``n > 2`` ranks, half of it with 2 ranks
#: (double buffered). Small enough that a chunk's working set stays in the caches
#: (here 1 MiB L2 per core, 32 MiB shared L3); large enough that the synchronizations
#: and numpy calls per chunk cost little (measured: benchmarks/results/shm_np2.md).
DEFAULT_SLOT_BYTES = 2 << 20

_LINE = 64  # cache line: slices start on one, so two writers never share a line
_HEADER = 4096  # each rank's counter sits alone on the first page of its segment
_CALL = (8, 24)  # offsets of the two call headers (2 int64 each; by barrier parity): in the counter's
# cache line, which the peers fetch anyway when they see the counter move
_SPINS = 1000  # counter checks (about 50 us) before yielding the core between checks
_YIELDS = 100  # sched_yield calls (about 100 us) before sleeping between checks
_SLEEP_MAX = 2e-4  # longest sleep between checks (s); sleeps double from 10 us. Was 1 ms: a peer
# descheduled briefly then cost up to 1 ms per 1 MiB chunk (slow 16 MiB spells)


class ShmMismatch(ValueError):
    """The ranks called :class:`ShmAllReduce` with different counts, dtypes or ops.

    ``calls[r]`` is rank r's call (of the object's communicator): ``(count, dtype name,
    ReduceOp value)``, the same list on every rank (each raises it at the same step).
    """

    def __init__(self, text: str, calls: list[tuple[int, str, str]]) -> None:
        super().__init__(text)
        self.calls = calls


class _Differ(Exception):
    """Raised by a call's first barrier when the ranks' headers differ (see ``_mismatch``)."""


def shm_applicable(comm: MPI.Comm) -> bool:
    """True when all ranks of ``comm`` share memory (one node), on every rank.

    Collective over ``comm``: splits it with ``MPI_COMM_TYPE_SHARED`` and compares the
    sizes. A communicator spanning nodes gives False on every rank.
    """
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        local = node.Get_size() == comm.Get_size()
    finally:
        node.Free()
    return bool(comm.allreduce(local, op=MPI.LAND))


class _Views:
    """A dtype's views of the window: ``slots[k][j]`` is the j-th of rank k's ``parts``
    equal regions, ``q`` elements each."""

    __slots__ = ("q", "align", "slots")

    # mems: the window's MPI.buffer per rank (Any: numpy's frombuffer stub takes mpi4py's buffer only from 3.12)
    def __init__(self, mems: list[Any], parts: int, part_bytes: int, dtype: np.dtype) -> None:
        self.q = part_bytes // dtype.itemsize
        self.align = max(1, _LINE // dtype.itemsize)
        self.slots = [
            [np.frombuffer(m, dtype, count=self.q, offset=_HEADER + j * part_bytes) for j in range(parts)] for m in mems
        ]


class ShmAllReduce:
    """All-reduce over a shared-memory window, for a communicator confined to one node.

    ``ShmAllReduce(comm)`` is collective over ``comm`` (all ranks on one node: see
    :func:`shm_applicable`); it duplicates ``comm`` and allocates a window of
    ``4 KiB + slot_bytes`` per rank, kept until :meth:`free` (collective). Then
    ``obj(buf, op)`` (collective; same shape and dtype on every rank) reduces ``buf`` in
    place. Calls on one object must not overlap (one thread at a time).

    Algorithm: ``buf`` is processed in chunks that fit the window (pipelined, so memory
    stays bounded whatever the size). Every element's result is the left fold over
    ranks 0..n-1, ``acc = x_0 op x_1``, then ``acc = acc op x_k`` for ``k = 2 .. n-1``
    (``x_k``: rank k's input), whatever the chunking.

    * ``n > 2``, per chunk of ``slot_bytes`` cut into ``n`` slices (slice ``j`` owned by
      rank ``j``): (1) each rank copies the slices it does not own into its slot;
      barrier; (2) each rank folds its slice from its own buffer and the peers' slots
      into its slot; barrier; (3) each rank copies every folded slice from its owner's
      slot into ``buf`` (during step 1 of the next chunk). Each result is computed once
      and copied, so it is bitwise identical everywhere. Traffic per rank and chunk of
      ``C`` bytes: ``(n-1)/n C`` copied in, ``C`` read and ``C/n`` written by the fold,
      ``C`` copied out.
    * ``n == 2``, per chunk of ``slot_bytes / 2`` (the two halves of the slot alternate,
      double buffering): each rank copies the chunk into its half-slot; barrier; each
      rank computes ``buf = x_0 op x_1`` reading its peer's half-slot. Both ranks run the
      same ufunc on the same operands in the same order, so the results are bitwise
      identical. Traffic per rank and chunk: ``C`` copied in, ``2 C`` read and ``C``
      written by the fold; one barrier.

    The input is read from and the output written to ``buf`` once; the rest of the
    traffic stays in the caches. Memory: ``n (slot_bytes + 4 KiB)`` shared bytes on the
    node, plus a few numpy views per dtype used.

    Args:
        comm: intra-node communicator (not modified; a Dup is used).
        slot_bytes: window bytes per rank, rounded down to a multiple of ``64 n``.

    Raises:
        ValueError: ``comm`` spans more than one node, or ``slot_bytes < 128 n``
            (raised on every rank alike).
    """

    #: Compare the ranks' calls (count, dtype, op) on every call (module docstring). Every
    #: rank must use the same value; only benchmarks turn it off, to measure its cost.
    verify = True

    def __init__(self, comm: MPI.Comm, slot_bytes: int = DEFAULT_SLOT_BYTES) -> None:
        n = comm.Get_size()
        if slot_bytes < 2 * _LINE * n:
            raise ValueError(
                f"{prefix('ShmAllReduce')} slot_bytes must be >= 128 x the {n} ranks = "
                f"{2 * _LINE * n}, got {slot_bytes}"
            )
        if not shm_applicable(comm):
            raise ValueError(
                f"{prefix('ShmAllReduce')} the ranks of comm do not all share memory (more than "
                f"one node); use another all-reduce algorithm"
            )
        self.comm = cast(MPI.Intracomm, comm.Dup())  # ranks that share memory: an intra-communicator
        self.size, self.rank = n, self.comm.Get_rank()
        self.parts = 2 if n == 2 else n  # regions per slot: halves, or one per slice
        self.part_bytes = slot_bytes // self.parts // _LINE * _LINE
        self.slot_bytes = self.part_bytes * self.parts
        info = MPI.Info.Create()
        info.Set("alloc_shared_noncontig", "true")  # each rank's segment page-aligned
        try:
            self.win: Optional[MPI.Win] = MPI.Win.Allocate_shared(_HEADER + self.slot_bytes, 1, info, self.comm)
        finally:
            info.Free()
        self._mems = [self.win.Shared_query(k)[0] for k in range(n)]
        # (mpi4py's buffer has the buffer protocol; its stub declares __buffer__ only for Python >= 3.12)
        self._flags = [memoryview(m)[:8].cast("q") for m in self._mems]  # type: ignore[arg-type]
        self._calls = [[memoryview(m)[at : at + 16].cast("q") for at in _CALL] for m in self._mems]  # type: ignore[arg-type]
        self._peer_calls = [heads for k, heads in enumerate(self._calls) if k != self.rank]
        self._views: dict[np.dtype, _Views] = {}
        # (dtype, op) pairs validated already -> their header code
        self._checked: dict[tuple[np.dtype, ReduceOp], int] = {}
        self._epoch = 0
        self._half = 0  # n == 2: the half-slot the next chunk uses
        self._spins = 0 if n > (os.cpu_count() or 1) else _SPINS
        self.win.Lock_all(MPI.MODE_NOCHECK)
        self._flags[self.rank][0] = 0
        self.win.Sync()
        self.comm.Barrier()

    # -- synchronization ----------------------------------------------------------------
    def _barrier(self, count: int = 0, code: int = -1) -> None:
        """Every rank's stores so far visible to every rank: Win_sync, counters, Win_sync.

        With ``code >= 0`` (a call's first barrier) also compare the calls' headers (hash of
        ``count`` and ``code``); raises :class:`_Differ`, then on every rank alike."""
        win: MPI.Win  # not None: only __call__ (after its freed check) reaches here
        win, flags, e = self.win, self._flags, self._epoch + 1  # type: ignore[assignment]  # (see above)
        self._epoch = e
        if code >= 0:
            word = hash((count, code))  # (ints: the same in every process)
            self._calls[self.rank][e & 1][0] = word
        win.Sync()
        flags[self.rank][0] = e
        for flag in flags:
            if flag[0] < e:
                self._wait(flag, e)
        win.Sync()
        if code >= 0:
            parity = e & 1
            for heads in self._peer_calls:
                if heads[parity][0] != word:
                    raise _Differ

    def barrier(self) -> None:
        """Wait until every rank of the communicator calls it (collective): through the window's
        counters, spinning briefly, then yielding the core, then sleeping, so that a rank that
        waits long (while its node's leader talks to other nodes) leaves the core to the others,
        where ``MPI_Barrier`` would poll.

        Raises:
            ValueError: the object was freed.
        """
        if self.win is None:
            raise ValueError(f"{prefix('shm_all_reduce')} this ShmAllReduce was freed")
        self._barrier()

    def _wait(self, flag: memoryview, e: int) -> None:
        """Until ``flag`` reaches ``e``: spin, then yield the core, then sleep (both release
        the GIL), so a rank that waits long (its peer computes) leaves the core to others."""
        for _ in range(self._spins):
            if flag[0] >= e:
                return
        for _ in range(_YIELDS):
            if flag[0] >= e:
                return
            os.sched_yield()
        pause = 1e-5
        while flag[0] < e:
            time.sleep(pause)
            pause = min(2 * pause, _SLEEP_MAX)

    # -- the collective -----------------------------------------------------------------
    def __call__(self, buf: np.ndarray, op: ReduceOp) -> None:
        """All-reduce ``buf`` in place with ``op`` (AVG reduced as SUM: the caller divides).

        Args:
            buf: C-contiguous writeable numpy array, any shape and numeric dtype (bool,
                float16, ml_dtypes' types included); same shape and dtype on every rank.
            op: a :class:`ReduceOp` other than PREMUL_SUM.

        Only ``buf`` changes, on every rank, to the element-wise reduction of all ranks'
        inputs, bitwise identical everywhere.

        Raises:
            TypeError: ``buf`` is not a numpy array of a numeric dtype; ``op`` is not a
                ReduceOp.
            ValueError: unsupported op/dtype pair (``check_op_dtype``), ``buf`` not
                C-contiguous or read-only, or the object was freed.
            ShmMismatch (a ValueError): the ranks passed different counts, dtypes or ops
                (on every rank, before ``buf`` changes).
        """
        host_array(buf, "shm_all_reduce", "buf", writable=True)
        code = self._checked.get((buf.dtype, op)) if type(op) is ReduceOp else None
        if code is None:
            code = self._check_op(buf.dtype, op)
        if self.win is None:
            raise ValueError(f"{prefix('shm_all_reduce')} this ShmAllReduce was freed")
        if self.size == 1:
            return
        if not self.verify:
            code = -1
        try:
            if buf.size == 0:
                if code >= 0:  # nothing to reduce, but the others must learn that this rank has nothing
                    self._barrier(0, code)
                return
            views = self._views.get(buf.dtype)
            if views is None:
                views = self._views[buf.dtype] = _Views(self._mems, self.parts, self.part_bytes, buf.dtype)
            ufunc = getattr(np, _BOOL_OPS[op][1] if buf.dtype.kind == "b" else _UFUNCS[op])  # as local_reduce's
            run = self._pairwise if self.size == 2 else self._scatter_gather
            run(buf.reshape(-1), views, ufunc, code)
        except _Differ:
            self._mismatch(buf.size, buf.dtype, op)

    def _check_op(self, dtype: np.dtype, op: Any) -> int:
        """Validate ``op`` on ``dtype``; their code in call headers: one int64, the same in every
        process (the dtype's text, hashed), kept in ``_checked``."""
        if not isinstance(op, ReduceOp):
            raise TypeError(
                f"{prefix('shm_all_reduce')} op must be a ReduceOp (apply a PremulSum's factor first), got {op!r}"
            )
        check_op_dtype(op, dtype, prefix("shm_all_reduce"))
        code = self._checked[(dtype, op)] = (zlib.crc32(dtype_text(dtype).encode()) << 8) | list(ReduceOp).index(op)
        return code

    def _mismatch(self, count: int, dtype: np.dtype, op: ReduceOp) -> None:
        """A call's first barrier found the headers differ: every rank saw the same ones, so
        every rank is here. Tell each other the calls, raise ShmMismatch."""
        calls = self.comm.allgather((count, dtype_text(dtype), op.value))
        text = "; ".join(f"rank {r}: count={c}, dtype={d}, op={o.upper()}" for r, (c, d, o) in enumerate(calls))
        raise ShmMismatch(f"{prefix('shm_all_reduce')} the ranks called mismatched all-reduces: {text}", calls)

    def _pairwise(self, flat: np.ndarray, views: _Views, ufunc: np.ufunc, code: int) -> None:
        """n == 2: copy a chunk in, barrier, fold the whole chunk from the peer's copy. The
        first barrier compares the calls (``code``; -1: not compared)."""
        mine, peer, first = views.slots[self.rank], views.slots[1 - self.rank], self.rank == 0
        half = self._half
        for start in range(0, flat.size, views.q):
            chunk = flat[start : start + views.q]
            m = chunk.size
            np.copyto(mine[half][:m], chunk)
            self._barrier(flat.size, code)
            code = -1
            other = peer[half][:m]
            if first:
                ufunc(chunk, other, out=chunk)
            else:
                ufunc(other, chunk, out=chunk)
            half ^= 1
        self._half = half

    def _scatter_gather(self, flat: np.ndarray, views: _Views, ufunc: np.ufunc, code: int) -> None:
        """n > 2: per chunk, deposit / barrier / fold own slice / barrier, then gather. The
        first barrier compares the calls (``code``; -1: not compared)."""
        n = self.size
        full = [(j * views.q, (j + 1) * views.q) for j in range(n)]
        pending = None
        for start in range(0, flat.size, n * views.q):
            chunk = flat[start : start + n * views.q]
            bounds = full if chunk.size == n * views.q else self._tail_bounds(chunk.size, views.align)
            if pending is not None:
                self._gather(views, *pending)
            self._deposit(views, chunk, bounds)
            self._barrier(flat.size, code)
            code = -1
            self._fold(views, chunk, bounds, ufunc)
            self._barrier()
            pending = chunk, bounds
        self._gather(views, *pending)  # type: ignore[misc]  # set: __call__ returns early for an empty buffer

    def _tail_bounds(self, m: int, align: int) -> list[tuple[int, int]]:
        """Slices of a last chunk of ``m`` elements: cache-line multiples (``align`` elements),
        the last ones shorter or empty. Slice j still lives in region j of each slot."""
        n = self.size
        part = -(-m // n)  # ceil(m / n) elements, rounded up to a cache-line multiple:
        part = -(-part // align) * align
        return [(min(j * part, m), min((j + 1) * part, m)) for j in range(n)]

    def _deposit(self, views: _Views, chunk: np.ndarray, bounds: list[tuple[int, int]]) -> None:
        """Step 1: copy the slices of ``chunk`` that other ranks own into this rank's slot."""
        mine, r = views.slots[self.rank], self.rank
        for j, (a, b) in enumerate(bounds):
            if j != r and b > a:
                np.copyto(mine[j][: b - a], chunk[a:b])

    def _fold(self, views: _Views, chunk: np.ndarray, bounds: list[tuple[int, int]], ufunc: np.ufunc) -> None:
        """Step 2: fold this rank's slice over ranks 0..n-1 into its own slot."""
        r = self.rank
        a, b = bounds[r]
        if b == a:
            return
        xs = [chunk[a:b] if k == r else views.slots[k][r][: b - a] for k in range(self.size)]
        out = views.slots[r][r][: b - a]
        ufunc(xs[0], xs[1], out=out)
        for x in xs[2:]:
            ufunc(out, x, out=out)

    @staticmethod
    def _gather(views: _Views, chunk: np.ndarray, bounds: list[tuple[int, int]]) -> None:
        """Step 3: copy every folded slice of ``chunk`` from its owner's slot."""
        for j, (a, b) in enumerate(bounds):
            if b > a:
                np.copyto(chunk[a:b], views.slots[j][j][: b - a])

    # -- lifetime ---------------------------------------------------------------------------
    def free(self) -> None:
        """Release the window and the duplicated communicator (collective; idempotent)."""
        if self.win is None:
            return
        self._views.clear()
        for view in self._flags + [v for heads in self._calls for v in heads]:
            view.release()
        self._flags, self._calls, self._peer_calls, self._mems = [], [], [], []
        self.win.Unlock_all()
        self.win.Free()
        self.win = None
        self.comm.Free()

    def __enter__(self) -> ShmAllReduce:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.free()


# -- one cached ShmAllReduce per communicator ------------------------------------------------
_CACHE: dict[int, ShmAllReduce] = {}
_CACHE_LOCK = threading.Lock()


def shm_all_reduce(comm: MPI.Comm, buf: np.ndarray, op: ReduceOp) -> None:
    """All-reduce ``buf`` in place over the intra-node ``comm`` through shared memory.

    Same contract as ``ShmAllReduce(comm)(buf, op)``: collective; ``buf`` changes on
    every rank to the bitwise-identical reduction (AVG as SUM: the caller divides). The
    first call on ``comm`` creates its window (collectively) and keeps it for later
    calls, until :func:`shm_release` ``(comm)``, which must come before ``comm`` is
    freed (the cache is keyed by the communicator's handle).

    Raises: as :class:`ShmAllReduce` (ValueError when ``comm`` spans nodes).
    """
    state = _CACHE.get(comm.handle)
    if state is None:
        state = ShmAllReduce(comm)
        with _CACHE_LOCK:
            _CACHE[comm.handle] = state
    state(buf, op)


def shm_release(comm: MPI.Comm) -> None:
    """Free the window :func:`shm_all_reduce` cached for ``comm`` (collective; no-op if none)."""
    with _CACHE_LOCK:
        state = _CACHE.pop(comm.handle, None)
    if state is not None:
        state.free()
