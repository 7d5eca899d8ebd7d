"""The mismatch check: the members of a group compare each collective call's signature
(:mod:`mpidist._check.signature`) before running it, so that mismatched collectives never give
wrong data silently. Also torch's debug-level API (:class:`DebugLevel`).

Each group's :class:`GroupCheck` (made by :func:`prepare`) caches the keys its members agreed
on: a cached key runs at once; a new one is compared in one MPI_Iallgather on a duplicate of
the group's communicator, and on a difference every member raises the same ValueError. A
member stalled in an exchange asks its peers through the watchdog's channel (:func:`_wait`).
Every checked call extends the group's running hash (:func:`mpidist._check.signature.fold`),
compared every :data:`PERIOD` calls (:func:`_periodic`) and at the final comparison
(:func:`compare_final`). DETAIL compares every call. The design, what is not caught, and the
costs: docs/reliability.md, section 4; docs/architecture.md, "Mismatched calls".
"""

from __future__ import annotations

import collections
import enum
import os
import time
import weakref
from typing import Any, Callable, Optional, cast

import numpy as np
from mpi4py import MPI

from mpidist import work
from mpidist._check import signature as S
from mpidist._core import current, recorder as R
from mpidist._launch import abort, mpi_init
from mpidist.errors import prefix

__all__ = [
    "DebugLevel",
    "get_debug_level",
    "set_debug_level",
    "set_debug_level_from_env",
    "LEVELS",
    "DETAIL",
    "CHECK",
    "STATES",
    "NOTE",
    "GroupCheck",
    "check",
    "agreed",
    "broken",
    "probe_answer",
    "shm_mismatch",
    "env_level",
]


class DebugLevel(enum.Enum):
    """The debug level (``torch.distributed.DebugLevel``): OFF, INFO, DETAIL.

    OFF and INFO compare a collective's signature the first time the group uses it;
    DETAIL compares every call (:func:`set_debug_level`).
    """

    OFF = 0
    INFO = 1
    DETAIL = 2

    def __int__(self) -> int:
        return self.value


LEVELS = tuple(DebugLevel.__members__)
#: True at DETAIL (read by ``_dispatch.launch`` and the check on every op).
DETAIL = False
#: False only while a benchmark measures the unchecked ops (:func:`_set_checks`); never a user setting.
CHECK = True
_level = DebugLevel.OFF
_ENV = ("MPIDIST_DEBUG", "TORCH_DISTRIBUTED_DEBUG")  # the first that is set (not empty) wins
_MAX_AGREED = 4096  # keys per group; a full cache is cleared (at the same call on every member)
#: K: the members compare the running hash of their calls at sequence numbers K, 2K, ... (a
#: power of two). Why 4096: docs/reliability.md, section 4, "Cost".
PERIOD = 4096
PERIOD_MASK = PERIOD - 1
#: Calls whose keys are kept (two periods: a periodic exchange is verified at the next one).
KEYS_MASK = 2 * PERIOD - 1
#: The ops of the final comparison (:func:`compare_final`): the exchange is the op.
FINAL_OPS = frozenset({"destroy_process_group", "exit", "check_collectives"})

_SPINS = 200  # tests of the exchange before yielding between tests
_YIELD_S = 0.01  # s: then testing it and yielding the core in turn, before sleeping between tests
_yield = getattr(os, "sched_yield", lambda: time.sleep(0))
_FIRST_PROBE = 0.05  # s: first question to the peers about a stalled exchange; then doubling
_PROBE_MAX = 2.0  # s: longest interval between questions
_FINAL_SILENT = 10.0  # s: a final comparison that no peer answers for this long gives up
_ANSWER_WAIT = 0.2  # s: how long a stalled exchange waits for the peers' answers to one question


def get_debug_level() -> DebugLevel:
    """The current debug level (``torch.distributed.get_debug_level``)."""
    return _level


def set_debug_level(level: DebugLevel) -> None:
    """Set the debug level (``torch.distributed.set_debug_level``).

    ``OFF`` / ``INFO``: a collective's signature (op, count, dtype, root, reduction) is
    compared across the group the first time the group uses it; ``DETAIL``: before every
    call (one more collective each; the inline latency paths are off). Every rank must set
    the same level at the same point of its program (docs/reliability.md, section 4).

    Raises:
        TypeError: ``level`` is not a :class:`DebugLevel` (as torch).
    """
    if not isinstance(level, DebugLevel):
        raise TypeError(f"set_debug_level: level must be a DebugLevel (OFF, INFO, DETAIL), got {level!r}")
    _apply(level)


def set_debug_level_from_env() -> None:
    """Set the level from ``MPIDIST_DEBUG``, else ``TORCH_DISTRIBUTED_DEBUG``
    (``torch.distributed.set_debug_level_from_env``): OFF, INFO or DETAIL, any case; OFF
    when neither is set (an empty value counts as unset).

    Raises:
        ValueError: the deciding variable holds another value.
    """
    _apply(env_level("") or DebugLevel.OFF)


def env_level(where: str) -> Optional[DebugLevel]:
    """The level the environment asks for, None when neither variable is set; ValueError
    (its message starting with ``where``) for a bad value."""
    for var in _ENV:
        text = os.environ.get(var, "")
        if text.strip():
            name = text.strip().upper()
            if name not in LEVELS:
                raise ValueError(f"{where}{' ' if where else ''}{var} must be one of {', '.join(LEVELS)}, got {text!r}")
            return DebugLevel[name]
    return None


def _apply(level: DebugLevel) -> None:
    global DETAIL, _level
    _level = level
    DETAIL = level is DebugLevel.DETAIL
    work.Engine.inline = work.ABORT_ON_TIMEOUT and not DETAIL
    _forget()


def _set_checks(on: bool) -> None:
    """Benchmarks only: ``False`` skips every check (the unchecked baseline); every rank
    switches at the same point, between ops, on the thread that runs them. The open runs
    close here (calls made while checks are off must not join a run). ShmAllReduce's header
    check has its own switch (``verify``)."""
    global CHECK
    for chk in list(STATES.values()):
        _close(chk)
    CHECK = bool(on)
    _forget()


def _forget() -> None:
    """Every repeated-call test fails once (any thread): each group's next call comes to
    :func:`check`, which closes the open run."""
    global known
    for chk in list(STATES.values()):
        chk.lkey = None
    known = work._NO_RUN  # the 8-byte all_reduce path's notes (see agree_all_reduce)
    for ref in list(_NOTED.values()):  # (atomic: another thread may note a run meanwhile)
        eng = ref()
        if eng is not None:
            eng.lat = work._NO_RUN


#: Runs a final comparison as an op of the group (``_dispatch.compare_final`` registers here).
FINAL_RUN: list[Callable[[Any, str], None]] = []


def compare_final(g: Any, what: str) -> None:
    """The final comparison of the calls made on ``g`` (collective over its members; ``what``:
    one of :data:`FINAL_OPS`). Raises the mismatch ValueError on every member when they differ."""
    for run in FINAL_RUN:
        run(g, what)


try:  # as torch reads TORCH_DISTRIBUTED_DEBUG on import; a bad value is reported by init_process_group
    _level = env_level("") or DebugLevel.OFF
    DETAIL = _level is DebugLevel.DETAIL
except ValueError:
    pass


# -- the per-group state -------------------------------------------------------------------
#: group -> its GroupCheck until the group is freed (never rebound: ``_dispatch`` keeps its ``get``)
STATES: dict[Any, GroupCheck] = {}
#: The key of an op that is not compared (monitored_barrier): the check only notes it.
NOTE = ("(not compared)",)
_ABANDONED: list = []  # exchanges given up on (requests with their buffers): kept for the process's life


class GroupCheck:
    """A group's resource ``"check"`` (made with the group by :func:`prepare`, or by its first
    checked collective; freed with it): the exchanges' communicators, the agreed keys, the
    running hash, and what this rank decided last (for the peers' questions)."""

    __slots__ = (
        "group",
        "eng",
        "comm",
        "final_comm",
        "report_comm",
        "agreed",
        "fps",
        "exchanging",
        "exchanged",
        "h",
        "base",
        "keys",
        "pending",
        "stale",
        "run",
        "lkey",
    )

    def __init__(self, g: Any) -> None:
        self.group = g
        self.eng = g.engine
        self.comm: Optional[MPI.Comm] = g.comm.Dup()
        #: the final comparison's own duplicate, and the one that names a periodic difference
        self.final_comm: Optional[MPI.Comm] = g.comm.Dup()
        self.report_comm: Optional[MPI.Comm] = g.comm.Dup()
        #: the periodic comparison posted last, verified at the next (or any exchange before):
        #: (request, own row, rows, sequence number, key)
        self.pending: Optional[tuple] = None
        #: an exchange on its communicators was given up on (they are never freed then)
        self.stale = False
        #: key -> its hash (mpidist._check.signature.key_hash), for the keys the members agreed on
        self.agreed: dict = {}
        #: the open run (:func:`check`): ``(first sequence number, key, its hash)``, up to
        #: ``decided``; None when closed. Written only by the thread running the group's ops;
        #: replaced whole, so a reader sees one or the other.
        self.run: Optional[tuple] = None
        #: the open run's key, for the op paths' repeated-call tests (a call equal to it records
        #: only ``decided``); None where every call must come to :func:`check`
        self.lkey: Optional[tuple] = None
        #: key -> its fingerprint template, for the periodic exchanges of agreed keys
        self.fps: dict = {}
        #: the running hash of the calls checked on the group, but the open run's (signature.fold)
        self.h = 0
        #: the sequence number of the last exchange in which the members agreed
        self.base = -1
        #: the key of call ``seq`` at ``keys[seq % (2 PERIOD)]`` (None: not compared, or refused),
        #: for naming the first call that differs; the open run's are written when it closes
        self.keys: list = [None] * (KEYS_MASK + 1)
        #: (sequence number, key) of this rank's last exchange of a call
        self.exchanging: tuple = (-1, None)
        #: the sequence numbers of its last exchanges (a peer may be one exchange ahead)
        self.exchanged: collections.deque = collections.deque(maxlen=4)
        STATES[g] = self

    @property
    def decided(self) -> int:
        """The sequence number of the last call this rank checked (kept on the group's engine,
        ``Engine.decided``, where the op paths store it)."""
        return cast(int, self.eng.decided)

    @decided.setter
    def decided(self, seq: int) -> None:
        self.eng.decided = seq

    def free(self) -> None:
        STATES.pop(self.group, None)
        _forget()
        comms = (self.comm, self.final_comm, self.report_comm)
        self.comm = self.final_comm = self.report_comm = None
        if self.pending is not None and not self.pending[0].Test():
            self.stale = True
        if self.pending is not None:
            _ABANDONED.append(self.pending)
            self.pending = None
        if self.stale or self.group.engine.broken is not None:
            # An exchange is pending on them: freeing a communicator under a pending nonblocking
            # collective corrupted the heap (MPICH 5.0.2, torch's barrier-timeout tests). Kept.
            _ABANDONED.append(comms)
            return
        for comm in comms:
            if comm is not None:
                comm.Free()


class _Unchecked:
    """A group's state where nothing is checked (one rank, or checks off)."""

    __slots__ = ()


_UNCHECKED = _Unchecked()


def prepare(g: Any) -> None:
    """Make ``g``'s check state (collective over ``g``) where the group is made, in the parent's
    op order: Open MPI deadlocks on communicators made on two threads at once (docs/hpc.md,
    "MPIs"). Not for the default group: its first op makes them, watched by the timeout."""
    if CHECK and len(g.ranks) > 1:
        g.resource("check", GroupCheck)


def agreed(g: Any, key: tuple) -> Any:
    """The group's state if its members agreed on ``key`` before (a stand-in where nothing is
    checked on ``g``), else None. For the 8-byte all_reduce path."""
    if not CHECK or len(g.ranks) == 1:
        return _UNCHECKED
    chk = STATES.get(g)  # (never made here: making it is collective, and this thread may not run the op)
    ok = chk is not None and key in chk.agreed and not DETAIL and g.engine.broken is None
    return chk if ok else None


# -- the 8-byte all_reduce path's notes (mpidist._backends.mpi.collectives.all_reduce) --------
#: The last all_reduce the latency path found agreed, ``(plan, nbytes, check state, key,
#: group)`` (:func:`agree_all_reduce`); forgotten by :func:`_forget`. The same tuple is the
#: group's ``Engine.lat`` while the open run is that all_reduce's (:func:`note_run`; dropped by
#: :func:`_close`; ``_NOTED``: id -> weak reference of every noted engine).
known: tuple = work._NO_RUN
_NOTED: dict = {}


def agree_all_reduce(g: Any, plan: tuple, tensor: np.ndarray, op: Any) -> Optional[tuple]:
    """The latency path's :data:`known` for this all_reduce if the members of ``g`` agreed on
    it before (or nothing is checked on ``g``), else None (launch's path will compare it)."""
    global known
    key = ("all_reduce", tensor.size, tensor.dtype, -1, op._value_, None)
    state = agreed(g, key)
    if state is None:
        return None
    known = ok = (plan, tensor.nbytes, state, key, g)
    if state is _UNCHECKED:  # nothing is checked: every call "goes on"
        note_run(g.engine, ok)
    return ok


def note_run(eng: Any, ok: tuple) -> None:
    """Note on the group's engine that its open run of calls is ``ok``'s all_reduce."""
    eng.lat = ok
    _NOTED[id(eng)] = weakref.ref(eng)


def check(g: Any, rec: list, key: tuple, parts: Optional[tuple] = None) -> None:
    """Check call ``key`` (recorded as ``rec``) against the other members of ``g``, right
    before the op, in the group's op order. Returns when they agree; raises the mismatch
    ValueError on every member otherwise.

    ``key`` :data:`NOTE`: not compared (monitored_barrier), only noted. ``parts``: for ops
    whose counts may differ between ranks, what a new key's exchange also checks:
    ``("gather" | "scatter", own count, root's counts or None)`` or ``("pairs", send counts,
    receive counts)``.

    Runs: a call equal to the last one (``lkey``), not at a multiple of PERIOD, records only
    ``decided`` on the op paths; the run is added to ``h`` and ``keys`` when it closes
    (:func:`_close`), as recording each call would have (docs/reliability.md, section 4).
    """
    seq = rec[R.SEQ]
    if key is NOTE:  # an op that is not compared (monitored_barrier): note how far this rank got
        chk = STATES.get(g)
        if chk is not None:
            _close(chk)
            chk.keys[seq & KEYS_MASK] = None
            chk.decided = seq
        return
    chk = g.resource("check", GroupCheck)
    i = seq & PERIOD_MASK
    run = chk.run
    if run is not None and key == chk.lkey:  # the open run goes on (a call from another path)
        if i:
            chk.lkey = key  # (the same key: the 8-byte path tests it by identity)
            chk.decided = seq
            return
        kh = run[2]
    else:
        kh = chk.agreed.get(key)
    _close(chk)
    if kh is not None and not DETAIL:
        if i:  # a key agreed on before: this call is recorded, and a run of it opens after it
            chk.h += kh * i  # mpidist._check.signature.fold
            chk.keys[seq & KEYS_MASK] = key
            chk.decided = seq
            _open(chk, seq, key, kh)
        else:
            _periodic(g, chk, rec, key, kh)
        return
    _exchange(g, chk, rec, key, parts, kh)


def _open(chk: GroupCheck, seq: int, key: tuple, kh: int) -> None:
    """Open a run of ``key`` after call ``seq`` (recorded already)."""
    chk.run = (seq + 1, key, kh)
    chk.lkey = key


def _close(chk: GroupCheck) -> None:
    """Add the open run's calls (up to ``decided``) to the running hash and the kept keys, then
    close it. Only on the thread running the group's ops; the keys are written before the run
    is dropped, so :func:`_recent` finds every call in one or the other."""
    run = chk.run
    if run is None:
        return
    chk.lkey = None
    first, key, kh = run
    last = chk.decided
    if last >= first:
        chk.h += kh * (_weights(last + 1) - _weights(first))
        keys, a, b = chk.keys, first & KEYS_MASK, last & KEYS_MASK
        if last - first >= KEYS_MASK:  # (never: a call at a multiple of PERIOD closes the run)
            keys[:] = [key] * len(keys)
        elif a <= b:
            keys[a : b + 1] = [key] * (b + 1 - a)
        else:
            keys[a:] = [key] * (len(keys) - a)
            keys[: b + 1] = [key] * (b + 1)
    chk.run = None
    if chk.eng.lat[2] is chk:  # the 8-byte all_reduce path's note no longer stands for the run
        chk.eng.lat = work._NO_RUN


def _weights(n: int) -> int:
    """The sum of ``s % PERIOD`` over ``s`` in ``range(n)``: the weights of calls 0..n-1 in
    the running hash (a run's are ``_weights(last + 1) - _weights(first)``)."""
    q, r = divmod(n, PERIOD)
    return q * (PERIOD * (PERIOD - 1) // 2) + r * (r - 1) // 2


def _periodic(g: Any, chk: GroupCheck, rec: list, key: tuple, kh: int) -> None:
    """At a multiple of PERIOD, with an agreed call: verify the comparison posted last (long
    complete), post this one's without waiting, and open a run of ``key``."""
    _settle(g, chk, rec)
    seq = rec[R.SEQ]
    hb = chk.h & S.MASK
    tpl = chk.fps.get(key)
    if tpl is not None:
        fp = tpl.copy()
        fp[S.SEQ], fp[S.CALLS], fp[S.HASH] = seq, seq, hb
    else:
        fp = S.fingerprint(key, seq, g.size(), calls=seq, h=hb)
    rows = np.empty((g.size(), S.WORDS), np.int64)
    chk.exchanged.append(seq)  # (a peer waiting in an exchange at ``seq`` is matched by this one)
    chk.keys[seq & KEYS_MASK] = key
    chk.decided = seq
    comm = cast(MPI.Comm, chk.comm)  # None only after free(), when no op of the group runs
    chk.pending = (comm.Iallgather([fp, MPI.INT64_T], [rows, MPI.INT64_T]), fp, rows, seq, key)
    chk.h = hb  # (the call at a multiple of PERIOD weighs 0: compared word by word)
    _open(chk, seq, key, kh)


def _settle(g: Any, chk: GroupCheck, rec: list) -> None:
    """Verify the periodic comparison posted last, if any (raises the mismatch ValueError on
    every member, naming the first call that differs)."""
    pending, chk.pending = chk.pending, None
    if pending is None:
        return
    req, fp, rows, pseq, pkey = pending
    prec = list(rec)
    prec[R.SEQ] = pseq
    _wait(g, chk, prec, pkey, req, (fp, rows))
    if S.mismatched(rows):
        _mismatch(g, chk, pkey, pseq, rows, cast(MPI.Comm, chk.report_comm))  # (None only after free())
    chk.base = pseq


# -- the exchange --------------------------------------------------------------------------
def _exchange(g: Any, chk: GroupCheck, rec: list, key: tuple, parts: Optional[tuple], kh: Optional[int] = None) -> None:
    """Compare with the other members this call (``key``) and the running hash of the calls
    before it; for a final comparison (``key[OP]`` in :data:`FINAL_OPS`), the hash of every
    call and the last call. An agreed call opens a run after it, but at DETAIL."""
    _settle(g, chk, rec)
    seq, n = rec[R.SEQ], g.size()
    final = key[S.OP] in FINAL_OPS
    if final:  # the last call that ran (one refused as mismatched did not, on any member)
        last_seq, last_key = _last_call(chk, seq)
        if last_key is None:  # no call ran in the last PERIOD: the comparison itself stands for it
            last_seq, last_key = seq, key
        h = chk.h
        h &= S.MASK
        fp = S.fingerprint(last_key, last_seq, n, kind=S.FINAL, calls=seq, h=h)
    else:  # the hash of the calls before this one: this one's own words are compared beside it
        if kh is None:
            kh = S.key_hash(key)
        own = parts[1] if parts is not None and parts[0] != "pairs" else -1
        hb = chk.h & S.MASK
        tpl = chk.fps.get(key) if own == -1 else None
        if tpl is not None:  # an agreed key at a multiple of PERIOD
            fp = tpl.copy()
            fp[S.SEQ], fp[S.CALLS], fp[S.HASH] = seq, seq, hb
        else:
            fp = S.fingerprint(key, seq, n, own, calls=seq, h=hb)
        h = S.fold(hb, kh, seq, PERIOD)
    rows = np.empty((n, S.WORDS), np.int64)
    if not final:
        chk.keys[seq & KEYS_MASK] = None  # (the call's key once the members agreed on it)
    chk.exchanging = (seq, key)
    chk.exchanged.append(seq)  # (before ``decided``: a peer that reads ``decided`` finds it here)
    chk.decided = seq
    # The final comparison has a communicator of its own (docs/reliability.md, section 4).
    comm = cast(MPI.Comm, chk.final_comm if final else chk.comm)  # None only after free()
    if DETAIL and not final:
        comm.Allgather([fp, MPI.INT64_T], [rows, MPI.INT64_T])
    elif not _wait(g, chk, rec, key, comm.Iallgather([fp, MPI.INT64_T], [rows, MPI.INT64_T]), (fp, rows), final):
        return  # a final comparison that cannot happen (a peer left the group): no verdict
    if S.mismatched(rows):  # the same rows on every member: all of them get here
        _mismatch(g, chk, key, seq, rows, comm)  # raises
    chk.h, chk.base = h, seq
    if final:
        return
    chk.keys[seq & KEYS_MASK] = key
    if parts is not None:
        _check_parts(g, chk, key, seq, parts, rows)
    if len(chk.agreed) >= _MAX_AGREED:
        chk.agreed.clear()
        chk.fps.clear()
        _forget()
    chk.agreed[key] = kh
    if not DETAIL:
        _open(chk, seq, key, cast(int, kh))  # (set above: only a final comparison leaves it None, and it returned)
    if own == -1:
        chk.fps[key] = fp


def _mismatch(g: Any, chk: GroupCheck, key: tuple, seq: int, rows: np.ndarray, comm: MPI.Comm) -> None:
    """Raise the ValueError for the differing ``rows`` (the same on every member). Members at
    the same exchange run one more collective to name the calls; members at different points
    are described from the rows alone."""
    op, name = key[S.OP], g.group_name
    calls_differ = S.mismatched(
        np.concatenate([rows[:, : S.KIND], np.zeros((len(rows), S.WORDS - S.KIND), np.int64)], axis=1)
    )
    history_differs = bool((rows[:, S.HASH] != rows[0, S.HASH]).any())
    if not S.same_point(rows):
        broken(g, f"a mismatched collective before sequence number {seq}")
        text = f"{prefix(op)} {_mixed_text(g, rows)}"
    elif calls_differ and not (history_differs and key[S.OP] in FINAL_OPS):
        calls = comm.allgather(S.describe(key, seq) if key[S.OP] not in FINAL_OPS else S.decode(rows[g.rank()]))
        text = _mismatch_text(g, op, S.differ(rows), calls)
        if history_differs:
            broken(g, f"mismatched collectives before sequence number {seq}")
            text += f"; their calls before it differ too ({_first_text(g, chk, seq, comm)})"
    else:  # the same call (or final comparison) here, after calls that differed: find the first
        first = _first_text(g, chk, seq, comm)
        broken(g, f"mismatched collectives before sequence number {seq}")
        text = (
            f"{prefix(op)} the members of group {name!r} called mismatched collectives: {first} "
            f"(found at sequence number {seq}, where they compare the calls made so far: every "
            f"{PERIOD} calls, in destroy_process_group, at exit and in check_collectives)"
        )
    err = ValueError(text)
    setattr(err, abort.EVERY_MEMBER, min(g.ranks))  # every member raises it alike: the lowest reports it
    raise err


def _recent(chk: GroupCheck, seq: int, s: int) -> Optional[tuple]:
    """The key of call ``s`` when it is among the last kept before ``seq`` (else None);
    ``seq`` <= ``decided`` read before (safe while another thread runs the group's ops)."""
    if not (0 <= s and seq - KEYS_MASK <= s <= seq):
        return None
    run = chk.run
    if run is not None and run[0] <= s:  # in the open run (s <= seq <= decided)
        return cast(tuple, run[1])
    return chk.keys[s & KEYS_MASK]


def _last_call(chk: GroupCheck, seq: int) -> tuple:
    """(sequence number, key) of the last call before ``seq`` that ran; ``(seq, None)`` if none."""
    for s in range(seq - 1, max(-1, seq - KEYS_MASK - 1), -1):
        k = chk.keys[s & KEYS_MASK]
        if k is not None:
            return s, k
    return seq, None


def _first_text(g: Any, chk: GroupCheck, seq: int, comm: MPI.Comm) -> str:
    """The first call since the last agreement at which the members differ, with each
    member's call there (collective: the members exchange their histories)."""
    mine = [
        (s, S.key_hash(k), S.describe(k, s))
        for s in range(max(chk.base + 1, seq - KEYS_MASK), seq)
        if (k := _recent(chk, seq, s)) is not None
    ]
    hists = comm.allgather(mine)
    by_rank = [{s: (kh, text) for s, kh, text in h} for h in hists]
    for s in range(chk.base + 1, seq):
        seen = [by.get(s) for by in by_rank]
        if len({x[0] if x is not None else None for x in seen}) > 1:
            calls = [x[1] if x is not None else f"(no call at seq={s} in the last {PERIOD})" for x in seen]
            by_call: dict = {}
            for r, call in enumerate(calls):
                by_call.setdefault(call, []).append(g.ranks[r])
            return f"first at sequence number {s}: " + "; ".join(
                f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {call}" for call, rs in by_call.items()
            )
    return f"their calls between sequence numbers {chk.base + 1} and {seq - 1} differ"


def _mixed_text(g: Any, rows: np.ndarray) -> str:
    """The members compared at different points: each one's call there, from its row."""
    by_call: dict = {}
    for r, row in enumerate(rows):
        call = S.decode(row)
        if row[S.KIND] == S.FINAL:
            call = (
                f"{call}, its last call before its final comparison at seq={int(row[S.CALLS])} "
                f"(destroy_process_group, exit or check_collectives)"
            )
        by_call.setdefault(call, []).append(g.ranks[r])
    parts = "; ".join(
        f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {call}" for call, rs in by_call.items()
    )
    return f"the members of group {g.group_name!r} called mismatched collectives: {parts}"


def _mismatch_text(g: Any, op: str, differ: list, calls: list) -> str:
    by_call: dict = {}
    for r, call in enumerate(calls):
        by_call.setdefault(call, []).append(g.ranks[r])
    parts = "; ".join(
        f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {call}" for call, ranks in by_call.items()
    )
    return (
        f"{prefix(op)} the members of group {g.group_name!r} called mismatched collectives (they differ "
        f"in {', '.join(differ)}): {parts}"
    )


def _wait(g: Any, chk: GroupCheck, rec: list, key: tuple, req: MPI.Request, bufs: tuple, final: bool = False) -> bool:
    """Wait until the exchange ``req`` completes (True). While it stalls, ask the peers (after
    50 ms, then at doubling intervals) whether one ran this sequence number without an
    exchange: then raise the mismatch (:func:`_diverged`). Past the op's timeout the watchdog
    acts as for any op (with MPIDIST_ABORT_ON_TIMEOUT=0 this thread keeps waiting).

    A ``final`` comparison (not watched) gives up and returns False, leaving the exchange
    behind, when a peer has left the group, when no peer answered for :data:`_FINAL_SILENT`
    seconds, or past the group's timeout (docs/reliability.md, section 4)."""
    for _ in range(_SPINS):
        if req.Test():
            return True
    interval = _FIRST_PROBE
    start = time.monotonic()
    ask_at, heard = start + interval, start
    answered: set = set()  # (final) the peers that answered a question while this rank waited
    limit = rec[R.LIMIT] if not final else (g.timeout_s or R.timeout)
    pause = 1e-5
    yield_until = start + _YIELD_S
    while not req.Test():
        now = time.monotonic()
        if now >= ask_at:
            answers = _answers(g, rec[R.SEQ])
            skipped = _skipped(answers, rec[R.SEQ])
            if skipped and not req.Test():
                _ABANDONED.append((req, bufs))
                chk.stale = True
                _diverged(g, rec, key, skipped)
            if final:
                if answers:
                    heard = now
                    answered.update(answers)
                gone = any(not a.get("member", True) or a.get("left") for a in answers.values())
                past = bool(limit) and now - start > limit
                if (gone or now - heard > _FINAL_SILENT or past) and not req.Test():
                    _ABANDONED.append((req, bufs))
                    chk.stale = True
                    if current.watchdog is not None:  # a peer may still wait for this rank: it says goodbye
                        current.watchdog.gave_up = True
                    if past and not gone:
                        _final_timed_out(g, rec, answered, now - start, limit)
                    return False
            interval = min(2 * interval, _PROBE_MAX)
            ask_at = time.monotonic() + interval
        if now < yield_until:  # a late peer (the usual case, or one waiting for a core): no sleep,
            _yield()  # whose least is ~60 us, but let the peers run
        else:
            time.sleep(pause)
            pause = min(2 * pause, 1e-3)
    return True


def _final_timed_out(g: Any, rec: list, answered: set, waited: float, limit: float) -> None:
    """A final comparison gave up past its group's timeout: say so on stderr, naming the peers
    that never answered, and, for a group of every rank, bound MPI_Finalize by the grace alone
    (:func:`mpidist._launch.mpi_init.peers_had_their_timeout`; docs/reliability.md, section 11)."""
    st = current.state
    me = st.rank if st is not None else -1
    silent = [p for p in g.ranks if p != me and p not in answered]
    who = f"rank(s) {silent} (no answer to any question: stopped or dead?)" if silent else "a peer"
    # only for a group of every rank: after a sub-group's the process may go on for long
    bound = mpi_init.peers_had_their_timeout() if st is not None and len(g.ranks) == st.world_size else None
    after = (
        f"; MPI_Finalize is now bounded by {bound:g} s (MPIDIST_INIT_FINALIZE_GRACE), not by the timeout again"
        if bound is not None
        else ""
    )
    abort.write(
        None,  # (prefix names the rank)
        f"{prefix(rec[R.OP])} the final comparison of the calls on group {g.group_name!r} gave up after "
        f"{waited:.0f} s, past the group's timeout of {limit:g} s: {who} never came{after}",
    )


def _answers(g: Any, seq: int) -> dict:
    """What the other members that answered say about collective ``seq`` of ``g``, by global
    rank (a short wait: a live peer answers within milliseconds)."""
    wd = current.watchdog
    return wd.check_probe(g, seq, _ANSWER_WAIT) if wd is not None else {}


def _skipped(answers: dict, seq: int) -> dict:
    """The peers that passed collective ``seq`` without an exchange, with what they said
    (their call there, when known)."""
    return {
        p: info
        for p, info in answers.items()
        if info.get("member", True)
        and not info.get("left")
        and info.get("decided", -1) >= seq
        and seq not in info.get("exchanged", ())
    }


def broken(g: Any, why: str) -> None:
    """Mark ``g`` unusable (its ops raise DistError at once): a mismatch left an op or an
    exchange pending on some member. Any thread."""
    g.engine.broken = why
    _forget()


def probe_answer(g: Any, seq: int) -> dict:
    """What this rank tells a peer whose exchange at ``seq`` on ``g`` stalls (the watchdog
    thread calls it): how far it has decided, its recent exchanges, its call at ``seq``."""
    chk = STATES.get(g) if g is not None else None
    if chk is None:
        return {"decided": -1, "exchanged": []}
    last_seq = chk.decided
    at, key = chk.exchanging
    last_key = key if at == seq else _recent(chk, last_seq, seq)  # its call at ``seq``, if it ran one recently
    return {
        "decided": last_seq,
        "exchanged": list(chk.exchanged),
        "key": last_key,
        "left": g.engine.broken is not None or g.destroyed,
    }


def _diverged(g: Any, rec: list, key: tuple, skipped: dict) -> None:
    """Raise the mismatch found by asking: this rank's call at ``rec``'s sequence number is new
    while the peers ``skipped`` ran theirs (agreed before) without an exchange. Each of them is
    told, and ends its op with the same text."""
    seq, me = rec[R.SEQ], g.ranks[g.rank()]
    others, differ = [], set()
    for p, info in sorted(skipped.items()):
        theirs = info.get("key")
        if theirs is not None:
            differ.update(S.differ_keys(key, theirs))
            call = S.describe(theirs, seq)
        else:
            at = info.get("at_seq")
            call = f"{at[0]}(seq={seq})" if at else f"an op at seq={seq}"
        others.append(f"rank {p}: {call}")
    fields = [
        name
        for name in ("op", "count", "dtype", "root", "reduce op", "sizes")
        if name in differ and key[S.OP] not in FINAL_OPS
    ]
    mine = (
        f"its final comparison of the calls made ({key[S.OP]}, seq={seq})"
        if key[S.OP] in FINAL_OPS
        else f"{S.describe(key, seq)}, a call new to the group, which its members compare before running it"
    )
    body = (
        f"the members of group {g.group_name!r} called mismatched collectives"
        f"{' (they differ in ' + ', '.join(fields) + ')' if fields else ''}: rank {me}: "
        f"{mine}; {'; '.join(others)}, a call the members agreed on before, run without comparing it"
    )
    err = ValueError(f"{prefix(key[S.OP])} {body}")
    wd = current.watchdog
    if wd is not None:
        wd.notify_mismatch(g, sorted(skipped), seq, f"{body} (found by rank {me})")
        setattr(err, abort.EVERY_MEMBER, min(skipped))  # told, it reports the mismatch for the job
    broken(g, f"a mismatched collective at sequence number {seq}: {body}")
    raise err


# -- counts that may differ between ranks -------------------------------------------------
def _check_parts(g: Any, chk: GroupCheck, key: tuple, seq: int, parts: tuple, rows: np.ndarray) -> None:
    """The sizes of gather / scatter / the all-to-alls against what the root or the peers
    expect (every member is in the same op: the fingerprints agreed)."""
    n, op = g.size(), key[S.OP]
    comm = cast(MPI.Comm, chk.comm)  # None only after free(), when no op of the group runs
    bad: list = []
    if parts[0] == "pairs":  # all-to-all: what rank i sends me must be what I expect from i
        got = np.empty(n, np.int64)
        comm.Alltoall([np.asarray(parts[1], np.int64), MPI.INT64_T], [got, MPI.INT64_T])
        mine = [(g.ranks[i], int(got[i]), int(parts[2][i])) for i in range(n) if got[i] != parts[2][i]]
        for r, found in enumerate(comm.allgather(mine[:4])):
            bad += [
                f"rank {src} sends {sent} elements to rank {g.ranks[r]}, which expects {want}"
                for src, sent, want in found
            ]
    else:
        root = g.group_rank(key[S.ROOT])
        expected = np.asarray(parts[2] if g.rank() == root else np.zeros(n), np.int64)
        comm.Bcast([expected, MPI.INT64_T], root)
        own = rows[:, S.OWN]
        where = "dst" if parts[0] == "gather" else "src"
        lst = "gather_list" if parts[0] == "gather" else "scatter_list"
        bad = [
            f"rank {g.ranks[k]}'s tensor holds {int(own[k])} elements, {where} rank {key[S.ROOT]}'s "
            f"{lst}[{k}] holds {int(expected[k])}"
            for k in range(n)
            if own[k] != expected[k]
        ]
    if bad:
        more = f" (and {len(bad) - 4} more)" if len(bad) > 4 else ""
        raise ValueError(
            f"{prefix(op)} the members of group {g.group_name!r} called {S.describe(key, seq)} "
            f"with sizes that do not match: {'; '.join(bad[:4])}{more}"
        )


def shm_mismatch(g: Any, calls: list, seq: int) -> ValueError:
    """The mismatch ValueError for the shared-memory all-reduce's header check: ``calls[r]`` =
    (count, dtype text, reduction name) of group rank r. Nobody ran the call: it leaves the
    running hash."""
    chk = STATES.get(g)
    if chk is not None and chk.decided == seq:
        run = chk.run
        if run is not None and run[0] <= seq:  # in the open run: it closes before the call
            chk.decided = seq - 1
            _close(chk)
            chk.decided = seq
        else:
            key = chk.keys[seq & KEYS_MASK]
            if key is not None and key in chk.agreed:
                chk.h -= chk.agreed[key] * (seq & PERIOD_MASK)
        chk.keys[seq & KEYS_MASK] = None
    keys = [("all_reduce", count, dtype, -1, redop, None) for count, dtype, redop in calls]
    differ = [
        name
        for name in ("count", "dtype", "reduce op")
        if len({k[{"count": S.COUNT, "dtype": S.DTYPE, "reduce op": S.REDOP}[name]] for k in keys}) > 1
    ]
    text = _mismatch_text(g, "all_reduce", differ, [S.describe(k, seq) for k in keys])
    return ValueError(f"{text} (found by the shared-memory algorithm's check, which compares every call)")
