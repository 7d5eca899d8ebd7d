"""torch profiler events for the backend's ops, as gloo records its ``"gloo:<op>"`` events.

:func:`profiled` (and :func:`record`, which the hot ops call themselves) records a method of
:class:`~mpidist.torch._process_group.ProcessGroupMpidist` as event ``"mpidist:<op>"``
(``"mpi:<op>"`` for backend "mpi") with the op's input tensors, from issue to completion, only
while a torch profiler records (otherwise one check). While recording, a synchronous call is
issued asynchronously so that its event ends off the caller's thread, on the thread that
completes the op (or on this module's one long-lived thread), and the profiler marks it
``is_async`` as gloo's; before torch 2.13 events end on the caller's thread (:data:`OFF_THREAD`;
docs/torch.md, "Versions and the private torch APIs it relies on").
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
#: Whether this torch keeps an event ended on another thread than the one that began it
#: (2.13 and later; 2.7.1 drops it, 2.8-2.12 not measured: docs/torch.md)
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
    """One long-lived thread that ends events for the callers' threads (torch 2.13 marked
    most events ended on a fresh thread per event not ``is_async``; one lasting thread, all)."""

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
    """``method(pg, *args, **kwargs)`` recorded as event ``"<pg's backend name>:<title>"``;
    the hot ops call it themselves when :func:`recording`, with a keyword in ``kwargs`` that
    stops the recursion."""
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
