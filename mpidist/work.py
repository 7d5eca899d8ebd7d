"""Work handles returned by ``async_op=True`` calls, and the per-group engine that runs them.

Three kinds of handle share one interface (``torch.distributed.Work``):

* :class:`RequestWork` wraps an MPI request (isend, irecv); MPI progresses it.
* :class:`FutureWork` wraps an op that the group's :class:`Engine` thread runs, so an
  async collective makes progress while the caller computes: the engine thread sits in
  the blocking MPI call (mpi4py releases the GIL there) while the caller's thread runs.
* :class:`CompletedWork` for ops that finished before returning (one-rank groups, or an
  MPI without ``MPI_THREAD_MULTIPLE``, where async ops run eagerly).
"""
from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
from typing import Any, Callable, Optional

from mpi4py import MPI

from mpidist.errors import DistError, from_mpi

__all__ = ["Work", "RequestWork", "FutureWork", "CompletedWork", "Engine"]


class Work:
    """Handle on an asynchronous operation (``torch.distributed.Work``).

    ``wait(timeout)`` blocks until the op is done and returns True, or raises
    :class:`DistError` after ``timeout`` seconds (a float or ``datetime.timedelta``)
    naming the op and rank; it re-raises the op's own error if it failed.
    """

    def __init__(self, op: str, where: str) -> None:
        self._op = op
        self._where = where  # "[rank r/n] op:" prefix for messages

    def wait(self, timeout: Any = None) -> bool:
        raise NotImplementedError

    def is_completed(self) -> bool:
        raise NotImplementedError

    def is_success(self) -> bool:
        """True once the op completed without an error."""
        return self.is_completed() and self.exception() is None

    def exception(self) -> Optional[BaseException]:
        """The error the op raised, or None."""
        return None

    def result(self) -> list:
        """The arrays the op wrote (after ``wait``), as a list, like torch."""
        self.wait()
        return list(self._outputs())

    def source_rank(self) -> int:
        """The global rank a receive got its message from (recv-type ops only)."""
        raise ValueError(f"{self._where} source_rank() is only defined for receive operations")

    def _outputs(self) -> tuple:
        return ()

    def _timeout_error(self, seconds: float) -> DistError:
        return DistError(f"{self._where} Work.wait timed out after {seconds:.3g} s; the op has not completed")

    def __repr__(self) -> str:
        state = "completed" if self.is_completed() else "pending"
        return f"<{type(self).__name__} {self._op} {state}>"


def _seconds(timeout: Any) -> Optional[float]:
    if timeout is None:
        return None
    if hasattr(timeout, "total_seconds"):
        return float(timeout.total_seconds())
    return float(timeout)


class CompletedWork(Work):
    """A Work whose op already finished (``outputs`` are the arrays it wrote)."""

    def __init__(self, op: str, where: str, outputs: tuple = (), source: Optional[int] = None) -> None:
        super().__init__(op, where)
        self._outs = outputs
        self._source = source

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def source_rank(self) -> int:
        if self._source is None:
            return super().source_rank()
        return self._source

    def _outputs(self) -> tuple:
        return self._outs


class RequestWork(Work):
    """A Work over an MPI request; ``finish(status)`` runs once when it completes."""

    def __init__(self, op: str, where: str, request: MPI.Request, outputs: tuple = (),
                 finish: Optional[Callable[[MPI.Status], Optional[int]]] = None) -> None:
        super().__init__(op, where)
        self._req = request
        self._outs = outputs
        self._finish = finish
        self._status = MPI.Status()
        self._done = False
        self._error: Optional[BaseException] = None
        self._source: Optional[int] = None

    def _complete(self) -> None:
        self._done = True
        if self._finish is not None:
            try:
                self._source = self._finish(self._status)
            except BaseException as exc:  # noqa: BLE001  (kept, re-raised by wait)
                self._error = exc

    def _test(self) -> bool:
        try:
            return self._req.Test(self._status)
        except MPI.Exception as exc:
            self._error = from_mpi(self._op, exc)
            self._done = True
            return False

    def is_completed(self) -> bool:
        if not self._done and self._test():
            self._complete()
        return self._done

    def wait(self, timeout: Any = None) -> bool:
        if not self._done:
            limit = _seconds(timeout)
            if limit is None:
                try:
                    self._req.Wait(self._status)
                    self._complete()
                except MPI.Exception as exc:
                    self._error = from_mpi(self._op, exc)
                    self._done = True
            else:
                deadline = time.monotonic() + limit
                while not self.is_completed():
                    if time.monotonic() > deadline:
                        raise self._timeout_error(limit)
                    time.sleep(50e-6)
        if self._error is not None:
            raise self._error
        return True

    def exception(self) -> Optional[BaseException]:
        return self._error

    def source_rank(self) -> int:
        self.wait()
        if self._source is None:
            return super().source_rank()
        return self._source

    def _outputs(self) -> tuple:
        return self._outs


class FutureWork(Work):
    """A Work over a ``concurrent.futures.Future`` completed by an :class:`Engine`."""

    def __init__(self, op: str, where: str, future: concurrent.futures.Future, outputs: tuple = ()) -> None:
        super().__init__(op, where)
        self._future = future
        self._outs = outputs

    def wait(self, timeout: Any = None) -> bool:
        limit = _seconds(timeout)
        try:
            self._future.result(limit)
        except concurrent.futures.TimeoutError:
            raise self._timeout_error(limit or 0.0) from None
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def exception(self) -> Optional[BaseException]:
        return self._future.exception() if self._future.done() else None

    def get_future(self) -> concurrent.futures.Future:
        """The underlying future; its result is the list of output arrays."""
        return self._future

    def _outputs(self) -> tuple:
        return self._outs


class Engine:
    """One worker thread per process group that runs its async ops in issue order.

    Collectives on a communicator must be issued in the same order on every rank, so
    a group's ops never run concurrently: ``run_sync`` runs inline when nothing is
    queued (no thread hop on the latency-critical path) and otherwise queues behind
    the pending ops and waits.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pending = 0
        self._thread: Optional[threading.Thread] = None

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, fn, args = item
            try:
                if future.set_running_or_notify_cancel():
                    future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001  (delivered through the future)
                future.set_exception(exc)
            finally:
                with self._lock:
                    self._pending -= 1

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        """Queue ``fn(*args)`` behind the group's earlier ops; return its future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=f"mpidist-{self._name}", daemon=True)
                self._thread.start()
            self._pending += 1
        self._queue.put((future, fn, args))
        return future

    def run_sync(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` after every op queued before it, and return its result."""
        if self._pending == 0:
            return fn(*args)
        return self.submit(fn, *args).result()

    def shutdown(self) -> None:
        """Finish queued ops and stop the thread."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join()
