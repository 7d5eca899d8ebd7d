"""A Chrome-trace timeline of DistributedDataParallel steps, after Horovod's Timeline.

``MPIDIST_TIMELINE=PATH`` (set before constructing :class:`DistributedDataParallel`) makes
each rank write a Chrome Trace Event file, :func:`timeline_path`; unset or empty: off, no
timeline object. ``pid`` is the global rank, ``ts``/``dur`` microseconds since the Unix
epoch. One file per process (every DDP of the process writes to it), valid JSON after every
:meth:`Timeline.flush`. Events and rows: docs/ddp.md, "Timeline (``MPIDIST_TIMELINE``)".
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Optional

__all__ = ["Timeline", "ENV_VAR", "timeline_from_env", "timeline_path"]

ENV_VAR = "MPIDIST_TIMELINE"
_TAIL = b"\n]}\n"
_OPEN: dict[str, Timeline] = {}
_OPEN_LOCK = threading.Lock()


def timeline_path(template: str, rank: int) -> str:
    """The file rank ``rank`` writes for ``MPIDIST_TIMELINE=template``."""
    return template.replace("{rank}", str(rank)) if "{rank}" in template else f"{template}.rank{rank}.json"


def timeline_from_env(rank: int) -> Optional[Timeline]:
    """The process's timeline when ``MPIDIST_TIMELINE`` is set, else None (one per path)."""
    template = os.environ.get(ENV_VAR, "")
    if not template:
        return None
    path = os.path.abspath(timeline_path(template, rank))
    with _OPEN_LOCK:
        tl = _OPEN.get(path)
        if tl is None or tl.closed:
            tl = _OPEN[path] = Timeline(path, rank)
        return tl


class Timeline:
    """Collects trace events in memory and appends them to ``path`` on :meth:`flush`.

    Thread-safe: the reductions' completion events are recorded on mpidist's engine
    thread. Times come from ``time.perf_counter_ns`` anchored to the wall clock once, so
    durations are monotonic and the ranks' traces line up on one machine.
    """

    _TIDS = {"step": 0, "layers": 1}

    def __init__(self, path: str, rank: int) -> None:
        self.path = path
        self.rank = rank
        self.closed = False
        self._lock = threading.Lock()
        self._events: list[dict[str, Any]] = []
        self._named: set[str] = set()
        self._wall0_us = time.time_ns() / 1000.0
        self._perf0 = time.perf_counter_ns()
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "wb")  # noqa: SIM115  (closed by close())
        self._file.write(b'{"displayTimeUnit": "ms", "traceEvents": [\n')
        self._end = self._file.tell()  # where the event list ends, before the tail
        self._empty = True
        self._meta("process_name", 0, {"name": f"rank {rank}"})
        self.flush()
        atexit.register(self.close)

    # -- recording --------------------------------------------------------------------------
    def now(self) -> float:
        """Microseconds since the Unix epoch (monotonic within the process)."""
        return self._wall0_us + (time.perf_counter_ns() - self._perf0) / 1000.0

    def _tid(self, row: str) -> int:
        tid = self._TIDS.get(row)
        if tid is None:
            tid = 10 + int(row.split()[-1])  # "bucket <i>"
        if row not in self._named:
            self._named.add(row)
            self._meta("thread_name", tid, {"name": row})
            self._meta("thread_sort_index", tid, {"sort_index": tid})
        return tid

    def _meta(self, name: str, tid: int, args: dict[str, Any]) -> None:
        self._events.append({"name": name, "ph": "M", "pid": self.rank, "tid": tid, "args": args})

    def complete(
        self,
        name: str,
        row: str,
        start_us: float,
        end_us: Optional[float] = None,
        args: Optional[dict[str, Any]] = None,
    ) -> None:
        """A duration event ``name`` on ``row`` from ``start_us`` to ``end_us`` (default: now)."""
        end = self.now() if end_us is None else end_us
        with self._lock:
            event = {
                "name": name,
                "ph": "X",
                "pid": self.rank,
                "tid": self._tid(row),
                "ts": start_us,
                "dur": max(end - start_us, 0.0),
            }
            if args:
                event["args"] = args
            self._events.append(event)

    def instant(self, name: str, row: str, args: Optional[dict[str, Any]] = None) -> None:
        """An instant event ``name`` on ``row``, now."""
        ts = self.now()
        with self._lock:
            event = {"name": name, "ph": "i", "s": "t", "pid": self.rank, "tid": self._tid(row), "ts": ts}
            if args:
                event["args"] = args
            self._events.append(event)

    # -- output -----------------------------------------------------------------------------
    def flush(self) -> None:
        """Append the events recorded since the last flush; the file stays valid JSON."""
        with self._lock:
            if self.closed:
                return
            events, self._events = self._events, []
            self._file.seek(self._end)
            if events:
                text = ",\n".join(json.dumps(e, separators=(",", ":")) for e in events)
                self._file.write((("" if self._empty else ",\n") + text).encode())
                self._empty = False
                self._end = self._file.tell()
            self._file.write(_TAIL)
            self._file.truncate()
            self._file.flush()

    def close(self) -> None:
        """Flush and close the file (registered with atexit; idempotent)."""
        if self.closed:
            return
        self.flush()
        with self._lock:
            self.closed = True
            self._file.close()
