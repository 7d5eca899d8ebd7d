"""What every public op does between validation and MPI: resolve the group, map ranks,
record the op (flight recorder, timeout watchdog), check that every member makes the same
call (:mod:`mpidist._check.mismatch`), run it inline or on the group's engine, and turn MPI errors
into mpidist's.
"""

from __future__ import annotations

from typing import Any, Callable, Literal, Optional

import numpy as np
from mpi4py import MPI

from mpidist import work
from mpidist._arrays.reduce_op import ReduceOp
from mpidist._check import mismatch
from mpidist._core import current as _current, recorder as R
from mpidist._core.group import ProcessGroup
from mpidist._core.tags import USER_TAG_MAX
from mpidist._runtime import world as runtime
from mpidist.errors import DistError, from_mpi, prefix
from mpidist.work import CompletedWork, FutureWork, Work, bounded_result

__all__ = [
    "launch",
    "member",
    "group_root",
    "root_rank",
    "root_list",
    "peer_rank",
    "check_tag",
    "p2p_call",
    "unusable",
    "signature",
]

_state_of = mismatch.STATES.get  # group -> its check state (mpidist._check.mismatch.GroupCheck), or None
_PMASK = mismatch.PERIOD_MASK


def signature(
    g: ProcessGroup,
    op: str,
    count: int = -1,
    dtype: Any = None,
    root: int = -1,
    redop: Any = None,
    layout: Optional[tuple] = None,
) -> Optional[tuple]:
    """The key :func:`mpidist._check.mismatch.check` compares for a call on ``g`` (see
    :mod:`mpidist._check.signature`), or None where nothing is checked (a one-rank group, or
    checks switched off by a benchmark)."""
    if not mismatch.CHECK or len(g.ranks) == 1:
        return None
    return (
        op,
        count,
        dtype,
        root,
        redop._value_ if type(redop) is ReduceOp else None if redop is None else "premul_sum",
        layout,
    )


def _guarded(
    g: ProcessGroup, op: str, fn: Callable[..., Any], rec: list, key: Optional[tuple], parts: Optional[tuple] = None
) -> Callable[..., Any]:
    """``fn`` wrapped to run as ``rec``: it becomes the group's op in flight, its end (or
    failure) is recorded, the check of its signature ``key`` (:func:`signature`; None: no
    check) runs first, MPI errors become mpidist's."""

    def run(*args: Any) -> Any:
        if rec[R.STATE] is R.SCHEDULED:  # it was queued on the engine: it starts now
            rec[R.T_START] = R._now()
            rec[R.STATE] = R.STARTED
        g.engine.current = rec
        try:
            if key is not None:
                chk = _state_of(g)
                seq = rec[0]
                if chk is not None and seq & _PMASK and key == chk.lkey:
                    # a repeated call, not at a multiple of PERIOD: the group's open run goes on
                    # (mpidist._check.mismatch.check, "Runs"; GroupCheck.decided); lkey is None at DETAIL
                    chk.eng.decided = seq
                else:
                    mismatch.check(g, rec, key, parts)
            out = fn(*args)
        except MPI.Exception as exc:
            R.fail(rec)
            raise from_mpi(op, exc) from exc
        except BaseException:
            R.fail(rec)
            raise
        R.end(rec)
        return out

    return run


def launch(
    group: ProcessGroup,
    op: str,
    fn: Callable[..., Any],
    args: tuple,
    async_op: bool,
    outputs: tuple = (),
    *,
    shapes: Any = None,
    dtype: Any = None,
    root: int = -1,
    count: int = -1,
    redop: Any = None,
    layout: Optional[tuple] = None,
    parts: Optional[tuple] = None,
    limit: Optional[float] = None,
    checked: bool = True,
) -> Optional[Work]:
    """Run ``fn(*args)`` in the group's op order; return a Work when ``async_op``.

    Sync: inline when nothing is queued, else behind the queued ops; returns None.
    Async: queued on the group's engine thread (``FutureWork``); on a one-rank group,
    or an MPI without MPI_THREAD_MULTIPLE, run at once (``CompletedWork``).

    The keyword arguments describe the call for the flight recorder and the check that
    every member makes the same call (:mod:`mpidist._check.mismatch`): ``shapes`` (a shape, or a
    list of shapes), ``dtype``, ``root`` (global rank, -1 if none), ``count`` (the element
    count every member must pass, -1 if it may differ between ranks), ``redop`` (the
    reduction), ``layout`` (ints every member must pass alike, e.g. all_gather's sizes),
    ``parts`` (counts that may differ, checked against the root's or peers', see
    :func:`mpidist._check.mismatch.check`), ``limit`` (a timeout in seconds other than the
    group's, for ops with their own, e.g. monitored_barrier), ``checked=False`` for an op
    that is not checked (monitored_barrier: its point is to report ranks that never come).

    With MPIDIST_ABORT_ON_TIMEOUT=0 a sync op runs on the engine thread and the caller
    waits at most the timeout (then DistError), since a stuck MPI call cannot be
    interrupted on the caller's own thread.

    An op issued on the thread running the group's ops (from a done-callback of one of
    them: torch's PowerSGD hook issues and waits on all-reduces there) runs at once on
    that thread, sync or async (then its Work is complete): queued, it would wait behind
    the callback that waits for it. It runs before the ops queued behind the op whose
    callback issued it, on every rank alike, and takes their place in the sequence
    numbers (``Engine.run_before_queued``). No caller can give up on it, so past its
    timeout the watchdog aborts the job even with MPIDIST_ABORT_ON_TIMEOUT=0.
    """
    eng = group.engine
    if eng.broken is not None:
        raise unusable(group, op)
    nested = eng.on_runner()
    eager = async_op and (nested or group.size() == 1 or not runtime.state().thread_multiple)
    queued = not nested and ((async_op and not eager) or not work.ABORT_ON_TIMEOUT or not eng.runs_inline())
    # Numbered now only when no other thread can number one of this group's ops meanwhile
    # (no op queued or running); else under the engine's lock as it is queued or put
    # before the queued ones (a callback's), so that numbers follow the order ops run in.
    rec = R.begin(group, op, shapes, dtype, root, R.SCHEDULED if queued else R.STARTED, number=not (queued or nested))
    if nested:
        eng.run_before_queued(rec)
    if limit is not None:
        rec[R.LIMIT] = limit
    key: Optional[tuple]  # (a declaration: no code)
    if not mismatch.CHECK or len(group.ranks) == 1:  # signature(), inline: every op pays for it
        key = None
    elif not checked:
        key = mismatch.NOTE  # not compared; the check only notes that this rank got here
    else:
        key = (
            op,
            count,
            dtype,
            root,
            redop._value_ if type(redop) is ReduceOp else None if redop is None else "premul_sum",
            layout,
        )
    run = _guarded(group, op, fn, rec, key, parts)
    if async_op and not eager:
        return FutureWork(op, prefix(op), eng.submit(run, *args, rec=rec), outputs, rec)
    if nested and not work.ABORT_ON_TIMEOUT:
        R.unbounded.add(id(rec))
        try:
            run(*args)
        finally:
            R.unbounded.discard(id(rec))
    elif work.ABORT_ON_TIMEOUT or not runtime.state().thread_multiple:
        eng.run_sync(run, *args, rec=rec)
    else:
        bounded_result(eng.submit(run, *args, rec=rec), rec)
    return CompletedWork(op, prefix(op), outputs) if async_op else None


def _nothing() -> None:
    return None


def compare_final(group: ProcessGroup, what: str) -> None:
    """:func:`mpidist._check.mismatch.compare_final` as an op of ``group`` (``what`` its name: recorded,
    numbered, run after the ops queued before it, watched by the timeout watchdog). Nothing
    on a group that is destroyed, broken (a mismatch was found already), of one rank, or
    where the caller is not a member."""
    if (
        group.comm is None
        or group.destroyed
        or group.engine.broken is not None
        or not mismatch.CHECK
        or len(group.ranks) == 1
        or not group.is_member()
    ):
        return
    launch(group, what, _nothing, (), False, limit=_UNWATCHED)


#: The final comparison's op is not ended by the watchdog: it gives up by itself (see
#: mpidist._check.mismatch._wait) when a peer cannot come, rather than abort the job.
_UNWATCHED = float(1 << 40)


mismatch.FINAL_RUN.append(compare_final)


class p2p_call:  # noqa: N801  (a context manager: ``with p2p_call(g, "send", ...):``)
    """Record a blocking point-to-point call, let the watchdog watch it while it blocks,
    and turn an ``MPI.Exception`` raised inside the block into mpidist's error.

    ``peer`` is the other side's global rank (-1: any source).
    """

    __slots__ = ("op", "rec")

    def __init__(self, g: ProcessGroup, op: str, shapes: Any, dtype: Any, peer: int) -> None:
        self.op = op
        self.rec = R.begin_p2p(g, op, shapes, dtype, peer)

    def __enter__(self) -> list:
        R.watched[id(self.rec)] = self.rec
        return self.rec

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> Literal[False]:
        R.watched.pop(id(self.rec), None)
        if exc is None:
            R.end(self.rec)
            return False
        R.fail(self.rec)
        if isinstance(exc, MPI.Exception):
            raise from_mpi(self.op, exc) from exc
        return False


def unusable(g: ProcessGroup, op: str) -> DistError:
    """The error of an op on a group that cannot be used: after ProcessGroup.abort() (every
    op), or after one of its collectives timed out (MPIDIST_ABORT_ON_TIMEOUT=0; collectives)."""
    return DistError(f"{prefix(op)} group {g.group_name!r} is unusable: {g.engine.broken}")


def member(group: Optional[ProcessGroup]) -> Optional[ProcessGroup]:
    """The resolved group if the caller is a member, else None (the op is a no-op)."""
    if group is None:  # the common case: two attribute lookups, no call (state() raises if uninitialized)
        st = _current.state
        return (st if st is not None else runtime.state()).world
    g = runtime.resolve_group(group)
    return g if g.comm is not None else None


def group_root(g: ProcessGroup, rank: Any, op: str, arg: str) -> int:
    """Group rank of global rank ``rank`` given as argument ``arg`` of ``op``."""
    if not isinstance(rank, (int, np.integer)) or isinstance(rank, bool):
        raise TypeError(f"{prefix(op)} {arg} must be an int (a global rank), got {type(rank).__name__}")
    try:
        return g.group_rank(int(rank))
    except ValueError as exc:
        raise ValueError(f"{prefix(op)} {arg}={rank}: {exc}") from None


def root_rank(
    g: ProcessGroup, rank: Any, group_rank: Any, op: str, arg: str, group_arg: str, default: Optional[int] = None
) -> int:
    """Group rank of the rank an op names either as a global rank (``rank``, its argument
    ``arg``: ``src``, ``dst``, ``peer``) or as a rank in ``g`` (``group_rank``, its argument
    ``group_arg``: ``group_src``, ``group_dst``, ``group_peer``), exactly one of them.

    torch.distributed 2.4+'s rule (``_canonicalize_group_rank``); with the default group
    the two numberings coincide. ``default``: the global rank meant when neither is given
    (0 for gather, scatter and the object collectives, as torch); None: one is required.

    Raises:
        ValueError: both given, or neither without a default ("Can't specify both" /
            "Must specify" in torch); a global rank that is not a member; a group rank
            out of range.
        TypeError: a rank that is not an int.
    """
    if group_rank is None:
        if rank is None:
            if default is None:
                raise ValueError(
                    f"{prefix(op)} neither {arg} (a global rank) nor {group_arg} (a rank in the "
                    f"group) given; specify one of them"
                )
            rank = default
        return group_root(g, rank, op, arg)
    if rank is not None:
        raise ValueError(
            f"{prefix(op)} {arg}={rank} and {group_arg}={group_rank} both given; specify one of "
            f"them: {arg} is a global rank, {group_arg} a rank in the group"
        )
    if not isinstance(group_rank, (int, np.integer)) or isinstance(group_rank, bool):
        raise TypeError(
            f"{prefix(op)} {group_arg} must be an int (a rank in the group), got {type(group_rank).__name__}"
        )
    if not 0 <= group_rank < len(g.ranks):
        raise ValueError(
            f"{prefix(op)} {group_arg}={group_rank} is out of range for group {g.group_name!r} of "
            f"size {len(g.ranks)}; expected 0 <= {group_arg} < {len(g.ranks)}"
        )
    return int(group_rank)


def root_list(xs: Any, here: bool, op: str, arg: str, root_arg: str, root: int, n: int) -> None:
    """torch's rule for gather_list / scatter_list (``arg``): given on the root only (global
    rank ``root``, argument ``root_arg``: dst or src; ``here``: this rank is the root). None
    and an empty list mean 'not given'."""
    role = "destination" if root_arg == "dst" else "source"
    given = xs is not None and not (isinstance(xs, (list, tuple)) and len(xs) == 0)
    if given and not here:
        raise ValueError(
            f"{prefix(op)} {arg} must not be given on a rank other than {root_arg}={root} "
            f"(torch: 'must NOT be specified on non-{role} ranks'); pass None"
        )
    if here and not given:
        raise ValueError(
            f"{prefix(op)} {arg} must be given on the {role} rank {root_arg}={root}: a list of {n} arrays, got {xs!r}"
        )


def check_tag(tag: Any, op: str, arg: str = "tag") -> int:
    """``tag`` (argument ``arg`` of ``op``) as an int in 0 .. ``mpidist._core.tags.USER_TAG_MAX``
    (the tags above are mpidist's own); TypeError / ValueError otherwise."""
    if not isinstance(tag, (int, np.integer)) or isinstance(tag, bool):
        raise TypeError(f"{prefix(op)} {arg} must be an int, got {type(tag).__name__}")
    if not 0 <= tag <= USER_TAG_MAX:
        raise ValueError(
            f"{prefix(op)} {arg} must be in [0, {USER_TAG_MAX}] (tags above are reserved "
            f"for mpidist's own messages), got {tag}"
        )
    return int(tag)


def peer_rank(g: ProcessGroup, peer: Any, op: str, arg: str, group_peer: Any = None, group_arg: str = "") -> int:
    """Group rank of the other side, given as global rank ``peer`` (argument ``arg``) or
    as rank ``group_peer`` in ``g`` (argument ``group_arg``, default ``"group_" + arg``);
    it must be a member and not the caller."""
    group_arg = group_arg or f"group_{arg}"
    rank = root_rank(g, peer, group_peer, op, arg, group_arg)
    if rank == g.rank():
        given = f"{arg}={peer}" if group_peer is None else f"{group_arg}={group_peer}"
        raise ValueError(f"{prefix(op)} {given} is the calling rank itself; expected another member of the group")
    return rank
