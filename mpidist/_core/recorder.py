"""The flight recorder: per rank, a ring buffer of the last N ops, dumped as JSON on failure.

Every collective, the all_reduce latency path and every point-to-point op appends one entry
(a list: the indices below) to a ``collections.deque(maxlen=N)``; always on
(``MPIDIST_TRACE_BUFFER=0`` keeps no history; the watchdog watches the entries in flight, not
the ring). :func:`dump` writes ``<dir>/rank<r>.json`` through :func:`write`; :data:`last_error`
says why a dump failed. What is recorded, when it is dumped, where, and the cost:
docs/reliability.md, section 3.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import socket
import tempfile
import threading
import time
from typing import Any, Optional

from mpidist._core import current as _current
from mpidist._core.private_files import UnsafeDirectory, fresh_name, open_private_dir, remove_oldest, write_private_file
from mpidist._launch.environment import launcher_rank

__all__ = [
    "SEQ",
    "OP",
    "GROUP",
    "SHAPES",
    "DTYPE",
    "ROOT",
    "T_ISSUE",
    "T_START",
    "T_END",
    "STATE",
    "LIMIT",
    "INFO",
    "SCHEDULED",
    "STARTED",
    "COMPLETED",
    "FAILED",
    "TIMED_OUT",
    "P2P_OPS",
    "begin",
    "begin_p2p",
    "end",
    "fail",
    "watched",
    "unbounded",
    "configure",
    "snapshot",
    "dump",
    "trace_dir",
    "user_dir",
    "write",
    "group_key",
    "describe",
    "report",
    "last_error",
    "TRACE_PREFIX",
]

# Entry layout: indices into the list begin() returns.
SEQ, OP, GROUP, SHAPES, DTYPE, ROOT, T_ISSUE, T_START, T_END, STATE, LIMIT, INFO = range(12)
SCHEDULED, STARTED, COMPLETED, FAILED, TIMED_OUT = "scheduled", "started", "completed", "failed", "timed out"
#: Ops numbered by the per-group point-to-point counter (not lined up across ranks).
P2P_OPS = frozenset({"send", "recv", "isend", "irecv", "send_object_list", "recv_object_list"})

DEFAULT_BUFFER = 2048
_ring: collections.deque = collections.deque(maxlen=DEFAULT_BUFFER)
_append = _ring.append
_now = time.monotonic
#: Seconds an op may take before the watchdog trips (init_process_group sets it).
timeout: float = 1800.0
#: Entries a thread is blocked on outside any group engine (blocking p2p, Work.wait on a
#: request), by id; the watchdog checks them as it checks each engine's current op.
watched: dict = {}
#: Ids of entries running on a thread no caller can give up on (an op issued from a
#: callback, run on its group's runner thread): past the timeout the watchdog aborts the
#: job even with MPIDIST_ABORT_ON_TIMEOUT=0, since there is no waiter to raise in.
unbounded: set = set()
_dir: Optional[str] = None
#: The per-user directory holding ``_dir`` (None: MPIDIST_TRACE_DIR), and how many job
#: directories it keeps (MPIDIST_TRACE_KEEP; 0: all).
_root: Optional[str] = None
DEFAULT_KEEP = _keep = 10
#: Why the last dump failed ("" after a dump that worked).
last_error: str = ""
#: A job directory's name starts so (then the time and 16 random hex digits): regex JOB_DIR,
#: holding files named as regex DUMP_FILE.
TRACE_PREFIX = "mpidist-trace-"
JOB_DIR, DUMP_FILE = TRACE_PREFIX + r"\d{8}-\d{6}-[0-9a-f]{16}", r"rank\d+\.(?:json|traceback\.txt)"
_dump_lock = threading.RLock()  # a SIGTERM handler may dump while its thread is dumping


def configure(seconds: float, buffer: int, name: str, keep: int) -> None:
    """Set the timeout, the ring's length and where dumps go (init_process_group):
    MPIDIST_TRACE_DIR, else ``<user_dir()>/<name>``, keeping ``keep`` job directories there."""
    global timeout, _ring, _append, _dir, _root, _keep
    timeout = seconds
    if buffer != _ring.maxlen:
        _ring = collections.deque(_ring, maxlen=buffer)
        _append = _ring.append
    directory = os.environ.get("MPIDIST_TRACE_DIR")
    _root, _keep = (None, 0) if directory else (user_dir(), keep)
    _dir = directory or os.path.join(user_dir(), name)


def begin(g: Any, op: str, shapes: Any, dtype: Any, root: int = -1, state: str = STARTED, number: bool = True) -> list:
    """Record a collective issued on group ``g`` and return its entry.

    ``state=STARTED`` (it runs now, on this thread) also makes it ``g.engine.current``, which
    the watchdog watches; a queued op is SCHEDULED until the engine starts it.
    ``number=False``: the sequence number (-1 until then) is given under the engine's lock
    (:meth:`mpidist.work.Engine.submit`, :meth:`mpidist.work.Engine.run_before_queued`).
    """
    eng = g.engine
    if number:
        seq = eng.seq
        eng.seq = seq + 1
    else:
        seq = -1
    t = _now()
    rec = [seq, op, g, shapes, dtype, root, t, t, 0.0, state, g.timeout_s or timeout, None]
    _append(rec)
    if state is STARTED:
        eng.current = rec
    return rec


def begin_p2p(g: Any, op: str, shapes: Any, dtype: Any, peer: int) -> list:
    """Record a point-to-point op with ``peer`` (global rank, -1 for any source)."""
    eng = g.engine
    seq = eng.p2p_seq
    eng.p2p_seq = seq + 1
    t = _now()
    rec = [seq, op, g, shapes, dtype, peer, t, t, 0.0, STARTED, g.timeout_s or timeout, None]
    _append(rec)
    return rec


def end(rec: list) -> None:
    """Mark ``rec`` completed now."""
    rec[T_END] = _now()
    rec[STATE] = COMPLETED


def fail(rec: list) -> None:
    """Mark ``rec`` failed now (it raised)."""
    rec[T_END] = _now()
    rec[STATE] = FAILED


def group_key(g: Any) -> str:
    """A name for ``g`` that is the same on every member (groups are made in the same order
    on every rank): ``"world"``, or its global ranks and how many groups with those ranks
    this process made before it (``"[0, 1]#0"``; never reused). Cached on the group's engine.
    """
    key = g.engine.key
    if key is None:
        st = _current.state
        if st is None or g is st.world:
            key = "world"
        else:
            same = [h for h in st.groups if h.ranks == g.ranks]
            index = next((i for i, h in enumerate(same) if h is g), len(same))
            key = f"{list(g.ranks)}#{index}"
        g.engine.key = key
    return key


def _shapes(shapes: Any) -> Any:
    if isinstance(shapes, tuple):
        return list(shapes)
    if isinstance(shapes, list):
        return [list(s) if isinstance(s, tuple) else s for s in shapes]
    return shapes


def _entry_dict(rec: list, offset: float) -> dict:
    g = rec[GROUP]
    ended = rec[T_END]
    return {
        "seq": rec[SEQ],
        "op": rec[OP],
        "p2p": rec[OP] in P2P_OPS,
        "group": g.group_name,
        "group_key": group_key(g),
        "group_ranks": list(g.ranks),
        "shapes": _shapes(rec[SHAPES]),
        "dtype": None if rec[DTYPE] is None else str(rec[DTYPE]),
        ("peer" if rec[OP] in P2P_OPS else "root"): int(rec[ROOT]),
        "issued": rec[T_ISSUE] + offset,
        "started": rec[T_START] + offset,
        "ended": ended + offset if ended else None,
        "duration_s": (ended - rec[T_START]) if ended else None,
        "state": rec[STATE],
        "timeout_s": rec[LIMIT],
        "info": rec[INFO],
    }


def snapshot() -> list[dict]:
    """The ring's entries, oldest first, as JSON-ready dicts (times are wall-clock seconds)."""
    offset = time.time() - _now()
    return [_entry_dict(rec, offset) for rec in list(_ring)]


def describe(rec: list, now: Optional[float] = None) -> str:
    """One line for an entry: ``all_reduce #5 on group 'default_pg' (started 2.0 s ago)``."""
    now = _now() if now is None else now
    kind = "p2p #" if rec[OP] in P2P_OPS else "#"
    when = f"started {now - rec[T_START]:.1f} s ago" if rec[STATE] in (STARTED, TIMED_OUT) else f"{rec[STATE]}"
    return f"{rec[OP]} {kind}{rec[SEQ]} on group {rec[GROUP].group_name!r} ({when})"


def user_dir() -> str:
    """The default dumps' per-user directory, ``<tmp>/mpidist-traces-<uid>``."""
    return os.path.join(tempfile.gettempdir(), f"mpidist-traces-{os.getuid()}")


def trace_dir() -> str:
    """Where :func:`dump` writes: MPIDIST_TRACE_DIR, else the job's directory in :func:`user_dir`
    (named at init_process_group; before it, a fresh name for this process)."""
    global _dir, _root
    if not _dir:
        _root, _dir = user_dir(), os.path.join(user_dir(), fresh_name(TRACE_PREFIX))
    return _dir


def write(name: str, data: bytes) -> str:
    """Write the file ``name`` of a dump into :func:`trace_dir` privately; return its path. In
    :func:`user_dir` (made private first), a new job directory removes all but the newest
    ``MPIDIST_TRACE_KEEP`` ones. Raises UnsafeDirectory or OSError."""
    directory = trace_dir()
    new = not os.path.isdir(directory)
    if _root:
        os.close(open_private_dir(_root))  # made 0700 before the job directory in it
    path = write_private_file(directory, name, data)
    if _root and new and _keep:
        remove_oldest(_root, _keep, JOB_DIR, DUMP_FILE)
    return path


def report(path: Optional[str]) -> str:
    """What to print after a dump that returned ``path``: where it is and how to read it, or
    why it could not be written."""
    if path:
        return (
            f"flight recorder written to {path} (and by every rank that answered); "
            f"run `python -m mpidist.tools.trace {os.path.dirname(path)}`"
        )
    text = f"this rank's flight recorder could not be written ({last_error or 'unknown error'})"
    written = False
    with contextlib.suppress(OSError):
        written = bool(_dir) and any(name.startswith("rank") for name in os.listdir(_dir))
    if written:  # the other ranks that answered wrote theirs
        text += f"; the ranks that answered wrote theirs to {_dir}; run `python -m mpidist.tools.trace {_dir}`"
    return text


def dump(reason: str, groups: Optional[list] = None) -> Optional[str]:
    """Write this rank's ring to ``<trace_dir()>/rank<r>.json``; return the path (None on error).

    ``groups``: the live groups, for their sequence numbers and ops in flight. Never
    raises: it runs while a job is failing.
    """
    global last_error
    st = _current.state
    rank = st.rank if st is not None else (launcher_rank() or (0, 1))[0]
    with _dump_lock:
        try:
            offset = time.time() - _now()
            live = groups if groups is not None else _current.live_groups()
            doc = {
                "rank": rank,
                "world_size": st.world_size if st is not None else None,
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "reason": reason,
                "time": time.time(),
                "timeout_s": timeout,
                "buffer": _ring.maxlen,
                "groups": [
                    {
                        "key": group_key(g),
                        "name": g.group_name,
                        "ranks": list(g.ranks),
                        "issued": g.engine.seq,
                        "current": _entry_dict(g.engine.current, offset) if g.engine.current else None,
                    }
                    for g in live
                ],
                "entries": [_entry_dict(rec, offset) for rec in list(_ring)],
            }
            data = json.dumps(doc, indent=1, default=str).encode()
            path = write(f"rank{rank}.json", data)
            last_error = ""
            return path
        except Exception as exc:  # noqa: BLE001  (a failing job must still abort)
            last_error = (
                f"{exc}; set MPIDIST_TRACE_DIR to a directory of your own"
                if isinstance(exc, UnsafeDirectory)
                else f"{type(exc).__name__}: {exc}"
            )
            return None
