"""MPIDIST_DEBUG=DETAIL: before each collective the members check they are calling the same one.

Off by default (``MPIDIST_DEBUG`` unset, ``OFF`` or ``INFO``): then ``_dispatch.launch``
pays one global lookup per op and the all_reduce latency path is untouched.

With ``DETAIL`` every collective first runs one MPI_Allgather of a fixed-size
fingerprint (11 int64) on the group's own communicator, right before the op itself
and in the same op order, so the fingerprints of the k-th collective of every member
meet: the group's sequence number, op name, element count (where every member must
pass the same one: ``count=-1`` otherwise), dtype, root (global rank) and reduction.
If they differ, every member raises the same ValueError naming which ranks passed
what, instead of hanging or computing a wrong answer, and no member runs the op
(every member took part in the fingerprint exchange, so the group stays usable).
Calling collectives on *different groups* cannot be caught this way (the
fingerprint exchanges themselves do not meet): that hang is what the timeout, the
flight recorder and ``python -m mpidist.tools.trace`` diagnose.

torch's TORCH_DISTRIBUTED_DEBUG=DETAIL does the same with a store-based check of
op type, shapes and dtypes.
"""
from __future__ import annotations

import enum
from typing import Any, Callable, Optional

import numpy as np
from mpi4py import MPI

from mpidist import work
from mpidist.errors import prefix

__all__ = ["LEVELS", "DETAIL", "set_level", "level", "checker"]

LEVELS = ("OFF", "INFO", "DETAIL")
#: True when MPIDIST_DEBUG=DETAIL (read by ``_dispatch.launch`` on every op).
DETAIL = False
_level = "OFF"

# Fingerprint layout (int64 words).
_SEQ, _COUNT, _ROOT, _REDOP, _SIZE = range(5)
_OP_WORDS = slice(5, 9)      # op name, 32 bytes
_DTYPE_WORDS = slice(9, 11)  # dtype name, 16 bytes
_WORDS = 11
_FIELDS = (("sequence number", _SEQ), ("count", _COUNT), ("root", _ROOT), ("reduce op", _REDOP),
           ("group size", _SIZE))


def set_level(name: Optional[str]) -> None:
    """Set the debug level: None, ``"OFF"``, ``"INFO"`` or ``"DETAIL"`` (case-insensitive).

    Every rank must set the same level at the same point of its program (DETAIL adds a
    collective to every collective). Raises ValueError for any other value.
    """
    global DETAIL, _level
    value = (name or "OFF").strip().upper()
    if value not in LEVELS:
        raise ValueError(f"MPIDIST_DEBUG must be one of {', '.join(LEVELS)}, got {name!r}")
    _level = value
    DETAIL = value == "DETAIL"
    work.Engine.inline = work.ABORT_ON_TIMEOUT and not DETAIL


def level() -> str:
    """The current debug level."""
    return _level


def _redop_code(redop: Any) -> int:
    if redop is None:
        return -1
    if isinstance(redop, enum.Enum):
        return list(type(redop)).index(redop)
    return 100  # a PremulSum (its factor may differ between ranks, as in torch)


def _redop_name(code: int) -> str:
    from mpidist._reduce_op import ReduceOp  # noqa: PLC0415

    if code == 100:
        return "PREMUL_SUM"
    return list(ReduceOp)[code].name if 0 <= code < len(ReduceOp) else str(code)


def _pack(words: np.ndarray, where: slice, text: str) -> None:
    raw = text.encode()[: (where.stop - where.start) * 8]
    words[where].view(np.uint8)[: len(raw)] = np.frombuffer(raw, np.uint8)


def _unpack(words: np.ndarray, where: slice) -> str:
    return words[where].tobytes().rstrip(b"\0").decode(errors="replace")


def _describe(fp: np.ndarray) -> str:
    parts = [f"seq={int(fp[_SEQ])}"]
    if fp[_COUNT] >= 0:
        parts.append(f"count={int(fp[_COUNT])}")
    dtype = _unpack(fp, _DTYPE_WORDS)
    if dtype:
        parts.append(f"dtype={dtype}")
    if fp[_ROOT] >= 0:
        parts.append(f"root={int(fp[_ROOT])}")
    if fp[_REDOP] >= 0:
        parts.append(f"op={_redop_name(int(fp[_REDOP]))}")
    return f"{_unpack(fp, _OP_WORDS)}({', '.join(parts)})"


def _mismatch(g: Any, op: str, rows: np.ndarray) -> str:
    by_print: dict = {}
    for r, row in enumerate(rows):
        by_print.setdefault(row.tobytes(), (row, []))[1].append(g.ranks[r])
    differ = [name for name, i in _FIELDS if len(set(rows[:, i])) > 1]
    for name, where in (("op", _OP_WORDS), ("dtype", _DTYPE_WORDS)):
        if len({r[where].tobytes() for r in rows}) > 1:
            differ.insert(0, name)
    calls = "; ".join(f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {_describe(row)}"
                      for row, ranks in by_print.values())
    return (f"{prefix(op)} MPIDIST_DEBUG=DETAIL: the members of group {g.group_name!r} called mismatched "
            f"collectives (they differ in {', '.join(differ)}): {calls}")


def checker(g: Any, op: str, rec: list, count: int, dtype: Any, root: int, redop: Any
            ) -> Optional[Callable[[], None]]:
    """The DETAIL check of one call, to run right before it (None on a one-rank group, and
    for monitored_barrier, whose point is to report ranks that never arrive)."""
    if g.size() == 1 or op == "monitored_barrier":
        return None
    fp = np.zeros(_WORDS, np.int64)
    fp[_SEQ], fp[_COUNT], fp[_ROOT], fp[_REDOP], fp[_SIZE] = rec[0], count, root, _redop_code(redop), g.size()
    _pack(fp, _OP_WORDS, op)
    _pack(fp, _DTYPE_WORDS, "" if dtype is None else str(dtype))

    def check() -> None:
        rows = np.empty((g.size(), _WORDS), np.int64)
        g.comm.Allgather([fp, MPI.INT64_T], [rows, MPI.INT64_T])
        if not (rows == fp).all():
            raise ValueError(_mismatch(g, op, rows))
    return check
