"""Completion of NCCL ops: the completion thread, :class:`NcclWork`, and :func:`launch`,
which enqueues an op on its communicator's stream (the stream protocol is described in
:mod:`mpidist.device._nccl_core`)."""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional, Sequence

from mpidist import _recorder as R
from mpidist.device._nccl_core import Dev, NcclComm, nccl_failure
from mpidist.errors import DistError, prefix
from mpidist._group import ProcessGroup
from mpidist.work import Work, _seconds, poll_until

__all__ = ["NcclWork", "REAPER", "host_wait_for", "launch", "collective_rec"]


# -- completion -------------------------------------------------------------------------------------

class _Reaper:
    """The completion thread: polls the done events of ops in flight (see the module doc)."""

    def __init__(self) -> None:
        self._items: list = []  # (shim, event, recs, refs, works, comm or None)
        self._cv = threading.Condition()
        self._thread: Optional[threading.Thread] = None

    def track(self, shim: Any, event: Any, recs: list, refs: tuple, works: Optional[list],
              comm: Optional[NcclComm]) -> None:
        """Watch ``event``: once it happened, end ``recs``, complete ``works``, drop ``refs``,
        and give the event back to ``comm`` for reuse (sync ops: no Work holds it)."""
        for rec in recs:
            R.watched[id(rec)] = rec
        with self._cv:
            self._items.append((shim, event, recs, refs, works, comm))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="mpidist-nccl-completion", daemon=True)
                self._thread.start()
            self._cv.notify()

    def pending(self) -> int:
        return len(self._items)

    def drain(self, timeout: float = 10.0) -> bool:
        """Wait until every op tracked so far was seen complete (tests); False on timeout."""
        deadline = time.monotonic() + timeout
        while self._items:
            if time.monotonic() > deadline:
                return False
            time.sleep(1e-4)
        return True

    def _loop(self) -> None:
        pause = 1e-4
        while True:
            with self._cv:
                while not self._items:
                    self._cv.wait()
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
    def _finish(shim: Any, event: Any, recs: list, refs: tuple, works: Optional[list],
                comm: Optional[NcclComm]) -> None:
        for rec in recs:
            R.watched.pop(id(rec), None)
            R.end(rec)
        for work in works or ():
            work._finished()
        if comm is not None:
            comm.spare.append(event)


REAPER = _Reaper()


class NcclWork(Work):
    """The Work of an ``async_op=True`` NCCL op (torch's ``WorkNCCL`` semantics).

    * ``wait()`` makes the caller's current stream wait on the op's done event and
      returns True at once: the host is not blocked, work enqueued afterwards on that
      stream runs after the op (torch's default). ``wait(timeout)`` also blocks the host
      until the op completes, or raises :class:`DistError` after ``timeout`` seconds
      (torch blocks the host when given a timeout too). A barrier's Work always blocks
      the host, as torch's does. While the host blocks, the group's timeout applies
      (MPIDIST_ABORT_ON_TIMEOUT=0: DistError once the watchdog declares it).
    * ``is_completed()`` is True once the done event has happened (a non-blocking query).
    * ``get_future()``: a future completed by the completion thread once the op is done,
      with ``result()``'s list (the arrays the op wrote).
    * ``exception()`` is None: NCCL reports asynchronous failures through the watchdog's
      timeout, not through the Work.
    * ``synchronize()``: the caller's current stream waits on the op; the host never blocks
      (torch's ``WorkNCCL::synchronize``), a barrier's Work included.
      ``get_future_result()``: SUCCESS once done, or TIMEOUT (:class:`mpidist.work.Work`).

    The future, ``exception()`` and ``source_rank()`` are the host Work's
    (:class:`mpidist.work.Work`): the completion thread calls ``_finished()``.
    """

    def __init__(self, op: str, where: str, shim: Any, device: int, event: Any, outputs: tuple,
                 recs: list, source: Optional[int] = None, host_wait: bool = False) -> None:
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

def launch(comm: NcclComm, g: ProcessGroup, name: str, body: Callable[..., Any], args: tuple, refs: tuple,
           async_op: bool, handles: list, host_wait: bool = False, devs: Sequence[Dev] = ()) -> Optional[list]:
    """Enqueue ``body(comm, *args)`` on the communicator's stream, ordered after the caller's
    current stream. Sync: the caller's stream waits on the op; returns None. Async: returns
    one NcclWork per entry of ``handles``, all on the op's done event.

    ``body`` enqueues NCCL calls (and kernels) on ``comm.stream`` and may return temporaries
    to keep alive until the op is done; ``refs`` are the caller's arrays, kept likewise.
    ``handles``: ``(op name, outputs, flight-recorder entries, source rank or None)`` per
    Work (one, except for batch_isend_irecv). ``host_wait``: the host also waits for the
    op (barrier; its Works' ``wait()`` too). ``devs``: the caller's arrays as validated;
    the op is also ordered after each other stream they say their data is ready on
    (``Dev.stream``: an event recorded there, waited on by the NCCL stream, as the CUDA
    Array Interface asks of a consumer; a torch tensor reports its current stream there).
    """
    if g.engine.broken is not None:
        raise DistError(f"{prefix(name)} group {g.group_name!r} is unusable: {g.engine.broken}")
    recs = [rec for h in handles for rec in h[2]]
    shim = comm.shim
    with shim.device(comm.device):
        caller = shim.current_stream()
        shim.record(comm.ready, caller)
        shim.wait_event(comm.stream, comm.ready)
        for stream in producer_streams(shim, devs, caller):
            ready = shim.new_event()
            shim.record(ready, stream)
            shim.wait_event(comm.stream, ready)
        try:
            temps = body(comm, *args)
        except shim.error as exc:
            for rec in recs:
                R.fail(rec)
            raise nccl_failure(name, "the op failed", exc) from exc
        except BaseException:
            for rec in recs:
                R.fail(rec)
            raise
        done = None
        if not async_op:
            try:
                done = comm.spare.pop()
            except IndexError:
                pass
        if done is None:
            done = shim.new_event()
        shim.record(done, comm.stream)
        if not async_op:
            shim.wait_event(caller, done)
    works = [NcclWork(op, prefix(op), shim, comm.device, done, outs, rs, source, host_wait)
             for op, outs, rs, source in handles] if async_op else None
    REAPER.track(shim, done, recs, (refs, temps), works, None if async_op else comm)
    if host_wait and not async_op:
        host_wait_for(shim, done, recs, None)
    return works


def producer_streams(shim: Any, devs: Sequence[Dev], caller: Any) -> list:
    """The streams other than ``caller`` that ``devs`` name (``Dev.stream``), each once. The
    legacy default stream is 1 in the interface and 0 as the caller's (cupy's null stream):
    the same stream, so a cupy array on it costs no extra wait."""
    mine = int(caller.ptr) or 1
    found: dict = {}
    for d in devs:
        ptr = d.stream
        if ptr is not None and (ptr or 1) != mine and ptr not in found:
            found[ptr] = shim.external_stream(ptr)
    return list(found.values())


def collective_rec(g: ProcessGroup, name: str, shapes: Any, dtype: Any, root: int = -1) -> list:
    """A flight-recorder entry for a collective enqueued now (state: started)."""
    rec = R.begin(g, name, shapes, dtype, root, R.SCHEDULED)  # SCHEDULED: not the engine's current op
    rec[R.STATE] = R.STARTED
    return rec
