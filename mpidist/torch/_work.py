"""torch's ``Work`` over mpidist's: what the backend returns for an async op.

:class:`TorchWork` subclasses ``torch.distributed._Work`` (torch calls its ``wait`` and
``get_future`` from C++ through its trampoline) and wraps one mpidist :class:`~mpidist.Work`,
or several for the coalesced and list forms. Its future completes on the thread running the
group's ops, so a ``then`` callback that issues and waits on a collective (PowerSGD) runs it
at once; on the NCCL path it is torch's CUDA future instead (docs/torch.md, "CUDA tensors").
Temporaries (non-contiguous tensors) are copied back before ``wait`` returns or the future
completes.
"""

from __future__ import annotations

import contextlib
import datetime
import threading
from collections.abc import Sequence
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

__all__ = ["TorchWork", "seconds"]


def seconds(timeout: Any) -> Optional[float]:
    """A Work/op timeout in seconds; None for none (None, or torch's ``timedelta(0)`` /
    negative "no timeout" values)."""
    if timeout is None:
        return None
    secs = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
    return secs if secs > 0 else None


class TorchWork(dist._Work):
    """A torch Work over mpidist Works ``works`` (in completion order) whose result is
    the tensors ``outputs``.

    ``finish`` (or None) runs once, after every Work completed and before ``wait`` returns
    or the future completes: it copies temporaries back into the caller's tensors.
    ``source`` maps mpidist's source rank (global) to the group rank torch reports
    (receives only). ``stream``: a context manager that puts the call in torch's
    current CUDA stream (CUDA tensors), else None.
    """

    def __init__(
        self,
        works: Sequence[Any],
        outputs: list,
        finish: Optional[Callable[[], None]] = None,
        source: Optional[Callable[[int], int]] = None,
        stream: Optional[Any] = None,
    ) -> None:
        super().__init__()
        self._works = list(works)
        self._outputs = outputs
        self._finish = finish
        self._source = source
        self._stream = stream
        self._lock = threading.Lock()
        self._future: Optional[torch.futures.Future] = None

    def _complete(self) -> None:
        """Run ``finish`` once (any thread that sees the op complete first)."""
        if self._finish is not None:
            with self._lock:
                finish, self._finish = self._finish, None
            if finish is not None:
                finish()

    def wait(self, timeout: Any = None) -> bool:
        """Block until the op completed (True), raise its error, or DistError past
        ``timeout`` (``timedelta`` or seconds; None or 0: the group's timeout)."""
        limit = seconds(timeout)
        with self._stream or contextlib.nullcontext():
            for w in self._works:
                w.wait(limit)
        self._complete()
        return True

    def is_completed(self) -> bool:
        if not all(w.is_completed() for w in self._works):
            return False
        if self.exception() is None:
            self._complete()
        return True

    def is_success(self) -> bool:
        return self.is_completed() and self.exception() is None

    def exception(self) -> Optional[BaseException]:
        for w in self._works:
            error = w.exception()
            if error is not None:
                return error
        return None

    def result(self) -> list:
        self.wait()
        return list(self._outputs)

    def synchronize(self) -> None:
        self.wait()

    def source_rank(self) -> int:
        """The group rank a receive got its message from (torch: ``Work.source_rank``)."""
        if self._source is None or not self._works:
            raise ValueError("source_rank() is only defined for receive operations")
        self.wait()
        return self._source(self._works[0].source_rank())

    _source_rank = source_rank

    def get_future(self) -> torch.futures.Future:
        """A torch Future completed with the output tensors (or the op's error)."""
        with self._lock:
            if self._future is not None:
                return self._future
            fut = self._future = self._stream_future()
            if fut is not None:
                return fut
            fut = self._future = torch.futures.Future()
        state = {"left": len(self._works), "settled": False}
        count_lock = threading.Lock()

        def done(f: Any) -> None:
            error = f.exception()
            with count_lock:
                state["left"] -= 1
                if state["settled"] or (error is None and state["left"] > 0):
                    return
                state["settled"] = True
            if error is None:
                try:
                    self._complete()
                except BaseException as exc:  # noqa: BLE001  (delivered through the future)
                    error = exc
            if error is None:
                fut.set_result(list(self._outputs))
            else:
                fut.set_exception(error)

        if not self._works:
            self._complete()
            fut.set_result(list(self._outputs))
        for w in self._works:
            w.get_future().add_done_callback(done)
        return fut

    def _stream_future(self) -> Optional[torch.futures.Future]:
        """torch's CUDA future for an op whose Works are all NCCL's (stream-ordered) on one
        device and that has nothing to copy back; None otherwise (the host-completed future)."""
        if not self._works or self._finish is not None or not torch.cuda.is_available():
            return None
        from mpidist._backends.device.nccl_core import NcclWork  # noqa: PLC0415  (CUDA tensors only)

        if not all(type(w) is NcclWork for w in self._works) or len({w._device for w in self._works}) != 1:
            return None
        device = self._works[0]._device
        shim = self._works[0]._shim
        side = _side_stream(device)
        with shim.device(device):
            waiting = shim.external_stream(int(side.cuda_stream))
            for w in self._works:
                shim.wait_event(waiting, w._event)
        fut: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future(devices=[torch.device("cuda", device)])
        with torch.cuda.stream(side):
            fut.set_result(list(self._outputs))  # torch records its events on ``side``, after the op
        return fut


_side_streams: dict = {}


def _side_stream(device: int) -> Any:
    """One torch stream per CUDA device on which the CUDA futures complete (kept for the process)."""
    stream = _side_streams.get(device)
    if stream is None:
        stream = _side_streams[device] = torch.cuda.Stream(device=device)
    return stream
