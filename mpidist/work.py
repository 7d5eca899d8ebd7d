"""Work handles returned by ``async_op=True`` calls, and the per-group engine that runs them.

Three kinds share ``torch.distributed.Work``'s interface: :class:`RequestWork` (an MPI
request: isend, irecv), :class:`FutureWork` (an op the group's :class:`Engine` thread runs,
progressing while the caller computes) and :class:`CompletedWork` (ops done before returning:
one-rank groups, or no ``MPI_THREAD_MULTIPLE``). ``get_future()``'s result is the list of
arrays the op wrote, or its exception the op's error. docs/architecture.md, "Async ops and
ordering".
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import enum
import threading
import time
from functools import cache
from typing import TYPE_CHECKING, Any, Callable, Optional, cast

from mpi4py import MPI

from mpidist._core import recorder as R
from mpidist.errors import DistError, from_mpi, prefix

__all__ = ["Work", "WorkResult", "RequestWork", "FutureWork", "CompletedWork", "Engine"]

if TYPE_CHECKING:  # an Engine queue item: (future, fn, args, rec)
    _Item = tuple[concurrent.futures.Future[Any], Callable[..., Any], tuple[Any, ...], Optional[list[Any]]]

_CREATE_LOCK = threading.Lock()  # makes get_future() hand out one future per Work
#: False when MPIDIST_ABORT_ON_TIMEOUT=0: a wait past the timeout raises DistError instead
#: of letting the watchdog abort the job (set by init_process_group).
ABORT_ON_TIMEOUT = True
_POLL_S = 0.02  # how often a bounded wait looks whether the watchdog declared a timeout
#: Point-to-point Works given up on after a timeout (MPIDIST_ABORT_ON_TIMEOUT=0): their
#: requests are still posted, so they and their buffers are kept for the process's life.
_ABANDONED: list[RequestWork] = []


def _timed_out(rec: Optional[list[Any]]) -> None:
    """Raise the watchdog's DistError if it declared ``rec`` timed out."""
    if _declared_timed_out(rec):
        raise DistError(cast("list[Any]", rec)[R.INFO])  # (declared timed out: rec is not None)


def bounded_result(future: concurrent.futures.Future[Any], rec: Optional[list[Any]]) -> Any:
    """``future.result()``, but raise the watchdog's DistError once it declares ``rec`` timed
    out (MPIDIST_ABORT_ON_TIMEOUT=0); with the default abort, simply ``future.result()``."""
    if ABORT_ON_TIMEOUT or rec is None:
        return future.result()
    while True:
        try:
            return future.result(_POLL_S)
        except concurrent.futures.TimeoutError:
            _timed_out(rec)


def poll_until(
    done: Callable[[], bool], recs: Any = (), limit: Optional[float] = None, pause: float = 50e-6, most: float = 50e-6
) -> bool:
    """Call ``done()`` until it is True (True), or ``limit`` seconds passed (False), sleeping
    ``pause`` between calls, doubled each time up to ``most``; raise the watchdog's DistError
    once it declares one of ``recs`` timed out (MPIDIST_ABORT_ON_TIMEOUT=0)."""
    start = time.monotonic()
    while not done():
        for rec in recs:
            _timed_out(rec)
        if limit is not None and time.monotonic() - start >= limit:
            return False
        time.sleep(pause)
        pause = min(2 * pause, most)
    return True


def _settle(future: concurrent.futures.Future[Any], error: Optional[BaseException], outputs: tuple[Any, ...]) -> None:
    """Complete ``future`` with ``list(outputs)`` or ``error``, unless another thread already did."""
    _put(future, list(outputs) if error is None else None, error)


def _put(future: concurrent.futures.Future[Any], value: Any, error: Optional[BaseException]) -> None:
    """Complete ``future`` with ``value``, or ``error`` if not None, unless it is done already
    (another thread completed it, or :meth:`Engine.abort` failed it)."""
    try:
        if error is None:
            future.set_result(value)
        else:
            future.set_exception(error)
    except concurrent.futures.InvalidStateError:
        pass


def _declared_timed_out(rec: Optional[list[Any]]) -> bool:
    """True once the watchdog declared ``rec`` timed out (MPIDIST_ABORT_ON_TIMEOUT=0)."""
    return rec is not None and rec[R.STATE] is R.TIMED_OUT and rec[R.INFO] is not None


class WorkResult(enum.IntEnum):
    """The value of :meth:`Work.get_future_result`'s future: torch's ``c10d::WorkResult``
    (torch hands out the plain int; this IntEnum compares equal to it)."""

    SUCCESS = 0
    TIMEOUT = 1
    COMM_ERROR = 2
    UNKNOWN = 100


def _seconds(timeout: Any) -> Optional[float]:
    if timeout is None:
        return None
    if hasattr(timeout, "total_seconds"):
        return float(timeout.total_seconds())
    return float(timeout)


class Work:
    """Handle on an asynchronous operation (``torch.distributed.Work``).

    ``wait(timeout)`` blocks until the op is done and returns True, or raises
    :class:`DistError` after ``timeout`` seconds (a float or ``datetime.timedelta``)
    naming the op and rank; it re-raises the op's own error if it failed. With
    ``timeout=None`` the process group's timeout (init_process_group's, or
    MPIDIST_TIMEOUT, counted from the op's issue) bounds it: past it the watchdog
    aborts the job, or with MPIDIST_ABORT_ON_TIMEOUT=0 ``wait`` raises the watchdog's
    DistError (op, group, sequence number, ranks that had not arrived).
    """

    # the shared methods read what each kind sets:
    _result_future: Optional[concurrent.futures.Future[WorkResult]] = None  # get_future_result()'s, made on first call
    _future: Optional[concurrent.futures.Future[list[Any]]] = None  # get_future()'s, made on first call
    _outs: tuple[Any, ...] = ()  # the arrays the op wrote
    _source: Optional[int] = None  # a receive's source rank
    _error: Optional[BaseException] = None  # the op's error
    _rec: Optional[list[Any]] = None  # the op's flight-recorder entry
    _done = False  # (set by _finished)

    def __init__(self, op: str, where: str) -> None:
        self._op = op
        self._where = where  # "[rank r/n] op:" prefix for messages

    def wait(self, timeout: Any = None) -> bool:
        """Block until the op completes; True, or the op's error, or DistError on timeout."""
        raise NotImplementedError

    def synchronize(self) -> None:
        """Make the consumer of the op's outputs wait for the op (torch's
        ``Work.synchronize``). Host ops: block as ``wait()`` does (torch's CPU Work returns at
        once; the arrays are ready after mpidist's). NCCL ops: the caller's current stream
        waits on the op, the host does not block.
        """
        self.wait()

    def get_future_result(self) -> concurrent.futures.Future[WorkResult]:
        """A future completed with a :class:`WorkResult` once the op ends (torch's
        ``Work.get_future_result``): ``SUCCESS``; ``TIMEOUT`` once the watchdog declares the
        op timed out (only with MPIDIST_ABORT_ON_TIMEOUT=0; the op may still be running);
        ``COMM_ERROR`` if it failed otherwise (an MPI error, a message of the wrong size,
        :meth:`mpidist.ProcessGroup.abort`). Never an exception (that stays with ``wait()``).
        Done-callbacks run where ``get_future()``'s do (on mpidist's progress thread for a
        timeout). The same future on every call.
        """
        with _CREATE_LOCK:
            fut = self._result_future
            if fut is not None:
                return fut
            fut = self._result_future = concurrent.futures.Future()
        recs = self._watched_recs()

        def ended(f: concurrent.futures.Future[list[Any]]) -> None:
            error = f.exception()
            code = (
                WorkResult.SUCCESS
                if error is None
                else WorkResult.TIMEOUT
                if any(_declared_timed_out(r) for r in recs)
                else WorkResult.COMM_ERROR
            )
            _put(fut, code, None)

        self.get_future().add_done_callback(ended)
        if recs and not ABORT_ON_TIMEOUT and not fut.done():  # an op stuck in MPI never ends: watch for TIMEOUT
            _PROGRESS.watch(_TimeoutWatch(fut, recs))
        return fut

    def _watched_recs(self) -> tuple[list[Any], ...]:
        """The flight-recorder entries the watchdog may declare timed out for this op."""
        return () if self._rec is None else (self._rec,)

    def is_completed(self) -> bool:
        """True once the op finished (successfully or not); never blocks."""
        return self._done

    def is_success(self) -> bool:
        """True once the op completed without an error (False while pending)."""
        return self.is_completed() and self.exception() is None

    def exception(self) -> Optional[BaseException]:
        """The error the op raised, or None (also while it is pending)."""
        return self._error

    def result(self) -> list[Any]:
        """The arrays the op wrote, as a list, like torch; waits for the op first."""
        self.wait()
        return list(self._outputs())

    def source_rank(self) -> int:
        """The global rank a receive got its message from (recv-type ops only)."""
        if self._source is None:
            raise ValueError(f"{self._where} source_rank() is only defined for receive operations")
        return self._source

    def get_future(self) -> concurrent.futures.Future[list[Any]]:
        """A future completed with ``result()``'s list, or with the op's error."""
        with _CREATE_LOCK:
            if self._future is None:
                self._future = concurrent.futures.Future()
                if self._done:
                    _settle(self._future, self._error, self._outs)
            return self._future

    def _follow(
        self,
        source: Callable[[], concurrent.futures.Future[Any]],
        outcome: Callable[[concurrent.futures.Future[Any]], tuple[Optional[BaseException], tuple[Any, ...]]],
    ) -> concurrent.futures.Future[list[Any]]:
        """``get_future()`` of a Work whose future follows another: made on the first call, and
        settled with ``outcome(f)``'s ``(error, outputs)`` once ``source()``'s future ``f`` is done."""
        with _CREATE_LOCK:
            if self._future is not None:
                return self._future
            fut = self._future = concurrent.futures.Future()
        source().add_done_callback(lambda f: _settle(fut, *outcome(f)))
        return fut

    def _finished(self) -> None:
        """The op ended (``_error`` says how): ``is_completed()`` is True, the future settled."""
        with _CREATE_LOCK:
            self._done = True
            future = self._future
        if future is not None:
            _settle(future, self._error, self._outs)

    def _outputs(self) -> tuple[Any, ...]:
        return self._outs

    def _timeout_error(self, seconds: float) -> DistError:
        return DistError(f"{self._where} Work.wait timed out after {seconds:.3g} s; the op has not completed")

    def __repr__(self) -> str:
        state = "completed" if self.is_completed() else "pending"
        return f"<{type(self).__name__} {self._op} {state}>"


class CompletedWork(Work):
    """A Work whose op already finished (``outputs`` are the arrays it wrote), successfully,
    or with ``error``, which ``wait()`` (and ``source_rank()``) then raise.

    ``get_future()`` returns an already-completed future.
    """

    _done = True

    def __init__(
        self,
        op: str,
        where: str,
        outputs: tuple[Any, ...] = (),
        source: Optional[int] = None,
        error: Optional[BaseException] = None,
    ) -> None:
        super().__init__(op, where)
        self._outs = outputs
        self._source = source
        self._error = error

    def wait(self, timeout: Any = None) -> bool:
        if self._error is not None:
            raise self._error
        return True

    def source_rank(self) -> int:
        """Raises the op's error first (as ``wait()``)."""
        self.wait()
        return Work.source_rank(self)


class _RequestFuture(concurrent.futures.Future[list[Any]]):
    """The future of a :class:`RequestWork`: ``result()``/``exception()`` drive the request.

    So waiting on the future can never hang on a request nobody tests, even without
    the progress thread (an MPI without ``MPI_THREAD_MULTIPLE``).
    """

    def __init__(self, work: RequestWork) -> None:
        super().__init__()
        self._work = work

    def result(self, timeout: Any = None) -> Any:
        self._drive(timeout)
        return super().result(0)

    def exception(self, timeout: Any = None) -> Optional[BaseException]:
        self._drive(timeout)
        return super().exception(0)

    def _drive(self, timeout: Any) -> None:
        if not self.done() and self._work._progress(_seconds(timeout)):
            self._work._settle()


class RequestWork(Work):
    """A Work over an MPI request; ``finish(status)`` runs once when it completes.

    The request is tested under a lock (any thread may). ``get_future()`` completes as soon as
    ``wait()``, ``is_completed()``, the future's ``result()``/``exception()`` or, under
    ``MPI_THREAD_MULTIPLE``, mpidist's progress thread (every 20 us to 1 ms) sees the request
    complete; done-callbacks run on that thread, without the lock held.
    """

    def __init__(
        self,
        op: str,
        where: str,
        request: MPI.Request,
        outputs: tuple[Any, ...] = (),
        finish: Optional[Callable[[MPI.Status], Optional[int]]] = None,
        rec: Optional[list[Any]] = None,
    ) -> None:
        super().__init__(op, where)
        self._rec = rec  # the flight recorder's entry
        self._req = request
        self._outs = outputs
        self._finish = finish
        self._status = MPI.Status()
        self._lock = threading.Lock()

    def _advance(self, mpi_call: Callable[[MPI.Status], bool]) -> None:
        """Test or Wait on the request (lock held); on completion record source or error."""
        try:
            if not mpi_call(self._status):
                return
        except MPI.Exception as exc:
            self._error = from_mpi(self._op, exc)
        else:
            if self._finish is not None:
                try:
                    self._source = self._finish(self._status)
                except BaseException as exc:  # noqa: BLE001  (kept, re-raised by wait)
                    self._error = exc
        self._done = True
        if self._rec is not None:
            (R.end if self._error is None else R.fail)(self._rec)

    def _poll(self) -> bool:
        """Test the request once (skipped if another thread holds it); True when done."""
        if self._done:
            return True
        if self._lock.acquire(blocking=False):
            try:
                if not self._done:
                    self._advance(self._req.Test)
            finally:
                self._lock.release()
            if self._done:
                self._settle()
        return self._done

    def _progress(self, limit: Optional[float]) -> bool:
        """Drive the request for up to ``limit`` seconds (None: until done, or until the
        watchdog declares it timed out); True when done."""
        if limit is None:
            if not self._done:
                self._wait_watched()
            return True
        return poll_until(self._poll, (), limit)

    def _wait_watched(self) -> None:
        """Wait until done while the watchdog watches this request: it aborts the job past
        the timeout, or (MPIDIST_ABORT_ON_TIMEOUT=0) marks the entry, and this raises."""
        rec = self._rec
        if rec is not None:
            R.watched[id(rec)] = rec
        try:
            if ABORT_ON_TIMEOUT or rec is None:
                with self._lock:
                    if not self._done:
                        self._advance(self._req.Wait)
            else:
                try:
                    poll_until(self._poll, (rec,))
                except DistError:  # MPI may still write into the buffer later: keep request and buffer alive
                    _ABANDONED.append(self)
                    raise
        finally:
            if rec is not None:
                R.watched.pop(id(rec), None)
        self._settle()

    def _settle(self) -> None:
        future = self._future
        if future is not None and not future.done():
            _settle(future, self._error, self._outs)

    def is_completed(self) -> bool:
        return self._poll()

    def wait(self, timeout: Any = None) -> bool:
        limit = _seconds(timeout)
        if not self._progress(limit):
            raise self._timeout_error(limit or 0.0)
        if self._error is not None:
            raise self._error
        return True

    source_rank = CompletedWork.source_rank

    def get_future(self) -> concurrent.futures.Future[list[Any]]:
        with _CREATE_LOCK:
            fresh = self._future is None
            if fresh:
                self._future = _RequestFuture(self)
        if fresh:
            if self._done:
                self._settle()
            elif _thread_multiple():
                _PROGRESS.watch(self)
        return cast("concurrent.futures.Future[list[Any]]", self._future)  # (made above if it was None)


@cache
def _thread_multiple() -> bool:
    return MPI.Query_thread() >= MPI.THREAD_MULTIPLE


class _TimeoutWatch:
    """For :class:`_Progress`: completes a ``get_future_result()`` future with TIMEOUT once the
    watchdog declares one of ``recs`` timed out (an op stuck in MPI never ends by itself)."""

    def __init__(self, future: concurrent.futures.Future[WorkResult], recs: tuple[list[Any], ...]) -> None:
        self._future = future
        self._recs = recs

    def _poll(self) -> bool:
        if not self._future.done() and any(_declared_timed_out(r) for r in self._recs):
            _put(self._future, WorkResult.TIMEOUT, None)
        return self._future.done()


class _Progress:
    """One daemon thread that tests the requests of RequestWorks whose future was taken
    (and watches ``get_future_result()`` futures for a timeout: :class:`_TimeoutWatch`).

    It polls (20 us, doubling to 1 ms while nothing completes) only while such a
    request is pending, and stops at interpreter exit, before mpi4py finalizes MPI.
    """

    _MIN_PAUSE, _MAX_PAUSE = 20e-6, 1e-3

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._works: list[Any] = []
        self._thread: Optional[threading.Thread] = None
        self._stopped = False

    def watch(self, work: Any) -> None:
        """Poll ``work._poll()`` (True when done) until it is done."""
        with self._cond:
            if self._stopped:
                return
            self._works.append(work)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="mpidist-progress", daemon=True)
                self._thread.start()
                atexit.register(self.stop)
            self._cond.notify()

    def _loop(self) -> None:
        pause = self._MIN_PAUSE
        while True:
            with self._cond:
                while not self._works and not self._stopped:
                    self._cond.wait()
                    pause = self._MIN_PAUSE
                if self._stopped:
                    return
                works = list(self._works)
            done = {id(w) for w in works if w._poll()}
            if done:
                with self._cond:
                    self._works = [w for w in self._works if id(w) not in done]
                pause = self._MIN_PAUSE
            else:
                pause = min(2 * pause, self._MAX_PAUSE)
            time.sleep(pause)

    def stop(self) -> None:
        """Stop polling and join the thread (registered with atexit)."""
        with self._cond:
            self._stopped = True
            self._cond.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()


_PROGRESS = _Progress()


class FutureWork(Work):
    """A Work over a ``concurrent.futures.Future`` completed by an :class:`Engine`.

    ``get_future()``'s callbacks run on the thread running the group's ops, in op order
    (or at once on the attaching thread if the op was done). A callback may issue ops on the
    same group and wait on them (torch's PowerSGD hook does): they run at once, before the
    ops queued behind (:meth:`Engine.run_before_queued`). Every rank runs them in the same
    order provided callbacks are attached right after issuing, as torch's hooks do.
    """

    def __init__(
        self,
        op: str,
        where: str,
        future: concurrent.futures.Future[Any],
        outputs: tuple[Any, ...] = (),
        rec: Optional[list[Any]] = None,
    ) -> None:
        super().__init__(op, where)
        self._ran = future  # the engine's (get_future()'s is derived from it)
        self._outs = outputs
        self._rec = rec  # the flight recorder's entry, watched by the timeout watchdog

    def wait(self, timeout: Any = None) -> bool:
        """Block until done. ``timeout=None``: the group's timeout (init_process_group's,
        counted from the op's issue) applies: past it the watchdog aborts the job, or with
        MPIDIST_ABORT_ON_TIMEOUT=0 this raises its DistError."""
        limit = _seconds(timeout)
        if limit is None:
            bounded_result(self._ran, self._rec)
            return True
        try:
            self._ran.result(limit)
        except concurrent.futures.TimeoutError:
            raise self._timeout_error(limit or 0.0) from None
        return True

    def is_completed(self) -> bool:
        return self._ran.done()

    def exception(self) -> Optional[BaseException]:
        return self._ran.exception() if self._ran.done() else None

    def get_future(self) -> concurrent.futures.Future[list[Any]]:
        return self._follow(lambda: self._ran, lambda f: (f.exception(), self._outs))


class _EngineFuture(concurrent.futures.Future[Any]):
    """The future of an op queued on an :class:`Engine`. ``result()`` with no timeout runs the
    op on the waiting thread if it has not started (:meth:`Engine.run_queued`: saves two
    thread wake-ups, tens of us each on a loaded machine); not with a timeout or
    MPIDIST_ABORT_ON_TIMEOUT=0, where the wait must be one that can be given up on.
    """

    def __init__(self, engine: Engine) -> None:
        super().__init__()
        self._engine = engine

    def result(self, timeout: Any = None) -> Any:
        if timeout is None and ABORT_ON_TIMEOUT and not self.done():
            self._engine.run_queued(self)
        return super().result(timeout)


#: Called at the start of each engine thread: device binding (:mod:`mpidist.device.binding`)
#: sets the rank's GPU there (CUDA's current device is per thread).
THREAD_START: list[Callable[[], Any]] = []


#: ``Engine.lat`` where no run is noted.
_NO_RUN: tuple[Any, ...] = (None, -1, None, None, None)


class Engine:
    """One worker thread per process group that runs its ops in issue order, one at a time
    (docs/architecture.md, "Async ops and ordering"). ``run_sync`` runs inline when nothing is
    queued or on the thread running the group's ops, else queues and waits. Queued ops run on
    the *runner*: the engine thread, or a waiter that runs them itself (:meth:`run_queued`).

    Also the group's reliability state: ``seq`` (the recorder's sequence number),
    ``p2p_seq``, ``current`` (the entry the watchdog watches), ``key``
    (:func:`mpidist._core.recorder.group_key`) and ``broken`` (why the group is unusable, else None).
    """

    #: False disables the ops' inline latency paths (``idle()``), so every op goes through
    #: ``_dispatch.launch`` (MPIDIST_DEBUG=DETAIL checks, MPIDIST_ABORT_ON_TIMEOUT=0 waits).
    inline = True

    def __init__(self, name: str) -> None:
        self._name = name
        self._cond = threading.Condition(threading.Lock())
        self._items: collections.deque[_Item] = collections.deque()  # (future, fn, args, rec) not started yet
        self.pending = 0  # ops queued or running (read by the ops' latency paths)
        self._runner: Optional[threading.Thread] = None  # the thread running a queued op now
        self._running: Optional[_Item] = None  # that op's queue item
        self._thread: Optional[threading.Thread] = None
        self._stopping = False
        self.seq = 0
        self.p2p_seq = 0
        self.current: Optional[list[Any]] = None
        #: the last collective this rank decided to run (the mismatch check's ``GroupCheck.decided``)
        self.decided = -1
        #: the 8-byte all_reduce path's note of the open run: ``(plan, nbytes, check state, key, group)``
        self.lat: tuple[Any, ...] = _NO_RUN
        self.key: Optional[str] = None
        self.broken: Optional[str] = None
        self.aborted = False  # abort() was called: point-to-point is refused too

    def _take(self) -> Optional[_Item]:
        """The next queued op, made this thread's to run (lock held); None when there is none,
        or another thread is running one."""
        if self._runner is not None or not self._items:
            return None
        self._runner = threading.current_thread()
        self._running = self._items.popleft()
        return self._running

    def _run(self, item: _Item) -> None:
        """Run a queued op taken with :meth:`_take`; its future's callbacks run here, on the runner.
        An op whose future :meth:`abort` failed before it started is not run."""
        future, fn, args, _ = item
        try:
            try:
                start = future.set_running_or_notify_cancel()
            except RuntimeError:  # failed by abort() between _take and here
                start = False
            if start:
                _put(future, fn(*args), None)
        except BaseException as exc:  # noqa: BLE001  (delivered through the future)
            _put(future, None, exc)
        finally:
            with self._cond:
                if self._running is item:  # (abort() took it out of the count already)
                    self.pending -= 1
                    self._running = None
                self._runner = None
                if self._items or self._stopping:
                    self._cond.notify()

    def _loop(self) -> None:
        for hook in THREAD_START:
            hook()
        while True:
            with self._cond:
                item = self._take()
                while item is None:
                    if self._stopping and not self._items:
                        return
                    self._cond.wait()
                    item = self._take()
            self._run(item)

    def submit(
        self, fn: Callable[..., Any], *args: Any, rec: Optional[list[Any]] = None
    ) -> concurrent.futures.Future[Any]:
        """Queue ``fn(*args)`` behind the group's earlier ops; return its future. ``rec``: the
        op's flight-recorder entry (marked failed if :meth:`abort` drops the op)."""
        future = _EngineFuture(self)
        with self._cond:
            if self.aborted:  # launch's check raced with abort()
                _put(future, None, self._aborted_error(rec, "before this op started"))
                return future
            if self._thread is None:
                self._stopping = False
                self._thread = threading.Thread(target=self._loop, name=f"mpidist-{self._name}", daemon=True)
                self._thread.start()
            self.pending += 1
            if rec is not None and rec[R.SEQ] < 0:
                self._number(rec)
            self._items.append((future, fn, args, rec))
            self._cond.notify()
        return future

    def run_queued(self, future: concurrent.futures.Future[Any]) -> None:
        """Run, on this thread, the queued ops up to ``future``'s, if it is still queued and no
        other thread runs one of the group's ops; else return at once. Order and the
        watchdog's view are kept; only the thread (and its callbacks' thread) changes."""
        while not future.done():
            with self._cond:
                if not any(item[0] is future for item in self._items):
                    return
                item = self._take()
            if item is None:
                return
            self._run(item)

    def idle(self) -> bool:
        """True when an op may take its inline latency path: nothing is queued (or this is
        the thread running the group's queued ops) and no debug or no-abort mode needs
        every op to go through ``_dispatch.launch``."""
        return self.inline and (self.pending == 0 or threading.current_thread() is self._runner)

    def on_runner(self) -> bool:
        """True on the thread running one of the group's queued ops now: the engine thread, or
        a waiter running queued ops itself. A future's done-callbacks run there, so an op
        issued from a callback is issued on the runner (and must run there, at once)."""
        return threading.current_thread() is self._runner

    def run_before_queued(self, rec: list[Any]) -> None:
        """``rec``, an op issued on the runner thread (a callback's), runs now, before the ops
        queued: it takes the first one's sequence number and theirs move one on, so that
        sequence numbers follow the run order, the same on every rank (the mismatch check
        compares them)."""
        with self._cond:
            queued = [item[3] for item in self._items if item[3] is not None]
            if queued:
                first = queued[0][R.SEQ]
                for entry in queued:
                    entry[R.SEQ] += 1
                rec[R.SEQ] = first
                self.seq += 1
            else:
                self._number(rec)

    def _number(self, rec: list[Any]) -> None:
        """Give ``rec`` the group's next sequence number (lock held: the op is being queued,
        or run by a callback, while another thread may be numbering one)."""
        rec[R.SEQ] = self.seq
        self.seq += 1

    def runs_inline(self) -> bool:
        """True when :meth:`run_sync` would run its op inline: nothing is queued, or this
        is the thread running the group's queued ops."""
        return self.pending == 0 or threading.current_thread() is self._runner

    def run_sync(self, fn: Callable[..., Any], *args: Any, rec: Optional[list[Any]] = None) -> Any:
        """Run ``fn(*args)`` after every op queued before it, and return its result.

        Inline when nothing is queued; else queued and waited for (bounded by the
        timeout of ``rec``, the op's recorder entry, when MPIDIST_ABORT_ON_TIMEOUT=0).
        """
        if self.runs_inline():
            if rec is not None and rec[R.SEQ] < 0:  # (queued when launch looked; the queue emptied since)
                with self._cond:
                    self._number(rec)
            return fn(*args)
        return bounded_result(self.submit(fn, *args, rec=rec), rec)

    def shutdown(self) -> None:
        """Finish queued ops and stop the thread (after :meth:`abort`: nothing to wait for)."""
        with self._cond:
            thread, self._thread = self._thread, None
            self._stopping = True
            self._cond.notify_all()
        if thread is not None:
            thread.join()

    def abort(self, reason: str) -> None:
        """Refuse every later op (``broken = reason``, no inline paths), fail the queued ops'
        futures with DistError without running them, and fail the future of the op in
        progress, if any (MPI cannot interrupt it: it goes on, unwatched, and may still write
        its outputs). Returns at once; the engine thread ends by itself. Idempotent."""
        with self._cond:
            self.broken = reason
            self.aborted = True
            self.inline = False
            dropped = list(self._items)
            self._items.clear()
            running, self._running = self._running, None
            self.pending -= len(dropped) + (running is not None)
            self._stopping = True
            self._thread = None  # not joined: it may be stuck in MPI
            self._cond.notify_all()
        for future, _, _, rec in dropped:
            if rec is not None:
                R.fail(rec)
            _put(future, None, self._aborted_error(rec, "before this op started"))
        if running is not None:
            future, _, _, rec = running
            if rec is not None and rec[R.STATE] is R.STARTED:
                R.fail(rec)
            _put(
                future,
                None,
                self._aborted_error(
                    rec,
                    "while this op was in progress; MPI cannot interrupt it, so its output arrays may still be written",
                ),
            )

    def _aborted_error(self, rec: Optional[list[Any]], when: str) -> DistError:
        op = rec[R.OP] if rec is not None else "op"
        return DistError(f"{prefix(op)} group {self._name!r} was {self.broken} {when}")
