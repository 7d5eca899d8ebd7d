"""torch profiler events for the backend's ops, as torch's own backends record theirs.

gloo records each collective as an event named ``"gloo:all_reduce"``, ``"gloo:broadcast"``
... with the op's input shapes, from the op's issue to its completion on gloo's worker
thread (so the profiler marks it ``is_async``). :func:`profiled` does the same for a
method of :class:`~mpidist.torch._process_group.ProcessGroupMpidist`: an event
``"mpidist:<op>"`` (``"mpi:<op>"`` for backend "mpi") whose inputs are the op's input tensors (``record_shapes=True``
shows their shapes), ended when the op completes, on the thread that completes it.

Only while a torch profiler is recording (``torch.autograd.profiler.profile``,
``torch.profiler.profile``); otherwise the op runs as it is, for the cost of one check.
While recording, an op called synchronously is issued asynchronously and the caller's
front end waits on its Work, as torch's front end does for every backend. An op issued
so (a group of more than one rank, with ``MPI_THREAD_MULTIPLE``) has its event ended
when its Work completes (before ``wait()`` returns or its future completes), off the
caller's thread: on the thread that completed it, or, where the caller's ``wait`` ran it
(mpidist's Work runs a queued op in the waiting thread), on one long-lived thread of this
module's; so the profiler marks it ``is_async``, as it marks gloo's. An op that runs
synchronously on the caller's thread (one rank, no ``MPI_THREAD_MULTIPLE``) ends there.
Before torch 2.13 every event ends on the caller's thread (:data:`OFF_THREAD`).
"""

from __future__ import annotations

import functools
import queue
import threading
from typing import Any, Callable, Optional

import torch
from torch._C._profiler import _RecordFunctionFast

from mpidist.work import CompletedWork

__all__ = ["profiled", "record", "recording"]

#: True while a torch profiler records (a C function: ~40 ns)
recording = torch._C._autograd._profiler_enabled
#: Whether this torch keeps an event ended on another thread than the one that began it:
#: torch 2.13 and 2.14 do; 2.7.1 drops it (measured: no event at all). Versions between are
#: not measured and treated as 2.7: there every event ends on the caller's thread, when the
#: call returns (a sync op's event spans the op; an async op's only its issue).
OFF_THREAD = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13)


def _flat(x: Any) -> list:
    """The tensors in ``x``: a tensor, or nested lists/tuples of tensors."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _flat(item)]
    return []


def profiled(title: str, inputs: Optional[int]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate a process-group op method so that, while a torch profiler records, it is
    recorded as event ``"<backend name>:<title>"`` with the tensors of its positional argument ``inputs``
    (None: none) as the event's inputs. (A wrapper's call costs ~0.1-0.3 us: allreduce,
    broadcast and reduce call :func:`record` themselves instead.)"""

    def wrap(method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def op(self: Any, *args: Any, **kwargs: Any) -> Any:
            if not recording():
                return method(self, *args, **kwargs)
            return record(title, inputs, method, self, args, kwargs)

        return op

    return wrap


class _Ender:
    """One long-lived thread that ends events for the callers' threads. (An event ended
    on a short-lived thread is not reliably marked ``is_async`` by the profiler: measured
    with torch 2.13, a fresh thread per event gave False for most events, one lasting
    thread True for every one.)"""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], threading.Event]] = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None

    def run(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` on the thread and wait for it."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="mpidist-profile", daemon=True)
                self._thread.start()
        done = threading.Event()
        self._jobs.put((fn, done))
        done.wait()

    def _loop(self) -> None:
        while True:
            fn, done = self._jobs.get()
            try:
                fn()
            finally:
                done.set()


_ENDER = _Ender()


def record(title: str, inputs: Optional[int], method: Callable[..., Any], pg: Any, args: tuple, kwargs: dict) -> Any:
    """``method(pg, *args, **kwargs)`` recorded as event ``"<pg's backend name>:<title>"``
    (``mpidist:all_reduce``; ``mpi:all_reduce`` for backend "mpi"; see the module); for
    the hot ops, which call it themselves when :func:`recording` (no wrapper's call on
    their path), with a keyword in ``kwargs`` that stops the recursion."""
    rec = _RecordFunctionFast(
        f"{pg.getBackendName()}:{title}", _flat(args[inputs]) if inputs is not None and len(args) > inputs else []
    )
    rec.__enter__()
    if not OFF_THREAD:
        try:
            return method(pg, *args, **kwargs)
        finally:
            rec.__exit__(None, None, None)
    # a synchronous call is issued asynchronously, so that the event ends where the op does
    opts: Any = next((a for a in (*args, *kwargs.values()) if hasattr(type(a), "asyncOp")), None)
    forced = opts is not None and not opts.asyncOp
    try:
        if forced:
            opts.asyncOp = True
        work = method(pg, *args, **kwargs)
    except BaseException:
        rec.__exit__(None, None, None)
        raise
    finally:
        if forced:
            opts.asyncOp = False
    end = functools.partial(rec.__exit__, None, None, None)
    if work is None or all(isinstance(w, CompletedWork) for w in work._works):
        end()  # it ran on the caller's thread, as a sync op (one rank, or no MPI_THREAD_MULTIPLE)
        return work
    caller, prior = threading.get_ident(), work._finish

    def finish() -> None:  # once, when the op has completed: before wait() returns or the future completes
        if prior is not None:
            prior()
        if threading.get_ident() != caller:
            end()  # on the thread that completed the op
            return
        # the caller's wait completed it (mpidist's Work runs a queued op in the waiting
        # thread): still an op issued asynchronously, ended off the caller's thread as gloo's
        _ENDER.run(end)

    work._finish = finish
    return work
