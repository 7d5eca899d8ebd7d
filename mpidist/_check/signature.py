"""A collective call's signature: what every member of a group must pass alike, as a key
(compared within a rank) and as fixed-size fingerprint words (compared across ranks).

A *key* is ``(op, count, dtype, root, redop, layout)``: the op's name; the element count
every member must pass (-1 where counts may differ: gather, scatter, the all-to-alls); a
numpy dtype or None; the root's global rank or -1; the reduction's name (``"premul_sum"``
whatever the factor) or None; a tuple of ints every member passes alike (all_gather's sizes,
the multi-array forms' array count) or None. Keys of calls that agree are equal on every
member (:mod:`mpidist._check.mismatch` caches them).

The fingerprint packs a key, the sequence number, the group size and ``own`` (this rank's
count in a gather or scatter, which may differ) into :data:`WORDS` int64; all but ``own``
must be equal on every member. Built from ints and bytes only, so it is the same in every
process (Python's ``hash`` of a tuple of ints is not salted). Imports nothing of mpidist.
"""

from __future__ import annotations

import functools
import hashlib
from typing import Any, Optional

import numpy as np

__all__ = [
    "OP",
    "COUNT",
    "DTYPE",
    "ROOT",
    "REDOP",
    "LAYOUT",
    "WORDS",
    "OWN",
    "SEQ",
    "KIND",
    "CALLS",
    "HASH",
    "CALL",
    "FINAL",
    "fingerprint",
    "mismatched",
    "differ",
    "differ_keys",
    "describe",
    "dtype_text",
    "key_hash",
    "fold",
    "decode",
    "same_point",
    "MASK",
]

OP, COUNT, DTYPE, ROOT, REDOP, LAYOUT = range(6)

# Fingerprint layout (int64 words). OWN: the word that may differ between ranks (this rank's own count).
_SEQ, _SIZE, _COUNT, _ROOT, _LAYOUT, OWN = range(6)
_OP_WORDS = slice(6, 10)  # op name, 32 bytes
_DTYPE_WORDS = slice(10, 12)  # dtype text, 16 bytes
_REDOP_WORDS = slice(12, 14)  # reduction name, 16 bytes
#: KIND: what the exchange is (CALL: before a call, FINAL: the comparison of destroy_process_group,
#: exit and check_collectives); CALLS: the group's sequence number of the exchange; HASH: the
#: running hash of every call on the group up to it (:func:`fold`).
KIND, CALLS, HASH = 14, 15, 16
SEQ = _SEQ
WORDS = 17
CALL, FINAL = 0, 1
#: The words every member must have alike (all but ``own``), with the name a message gives them.
_FIELDS = (
    ("op", _OP_WORDS),
    ("sequence number", _SEQ),
    ("count", _COUNT),
    ("dtype", _DTYPE_WORDS),
    ("root", _ROOT),
    ("reduce op", _REDOP_WORDS),
    ("sizes", _LAYOUT),
    ("group size", _SIZE),
    ("earlier calls", slice(HASH, HASH + 1)),
)
#: The words of the call itself (not the exchange's kind, point or history).
_CALL_WORDS = slice(0, KIND)
#: How :func:`describe` names a layout, per op.
_LAYOUT_NAMES = {"all_reduce_multigpu": "arrays", "reduce_multigpu": "arrays"}


@functools.cache
def dtype_text(dtype: Any) -> str:
    """``dtype``'s name as messages show it (``float64``; ``>f8`` for a non-native byte order)."""
    if isinstance(dtype, str):
        return dtype
    d = np.dtype(dtype)
    return d.name if d.isnative else d.str


def _pack(words: np.ndarray, where: slice, text: str) -> None:
    raw = text.encode()[: (where.stop - where.start) * 8]
    words[where].view(np.uint8)[: len(raw)] = np.frombuffer(raw, np.uint8)


def fingerprint(
    key: tuple, seq: int, size: int, own: int = -1, kind: int = CALL, calls: int = -1, h: int = 0
) -> np.ndarray:
    """The :data:`WORDS` int64 of call ``key``, number ``seq`` on a group of ``size``; ``kind``,
    ``calls`` (-1: ``seq``) and ``h``: the exchange it is sent in (:data:`KIND`)."""
    fp = np.zeros(WORDS, np.int64)
    fp[_SEQ], fp[_SIZE], fp[_COUNT], fp[_ROOT] = seq, size, key[COUNT], key[ROOT]
    fp[KIND], fp[CALLS], fp[HASH] = kind, seq if calls < 0 else calls, h
    fp[_LAYOUT] = 0 if key[LAYOUT] is None else hash(key[LAYOUT]) & ((1 << 63) - 1) | 1
    fp[OWN] = own
    _pack(fp, _OP_WORDS, key[OP])
    if key[DTYPE] is not None:
        _pack(fp, _DTYPE_WORDS, dtype_text(key[DTYPE]))
    if key[REDOP] is not None:
        _pack(fp, _REDOP_WORDS, key[REDOP])
    return fp


@functools.lru_cache(maxsize=8192)
def key_hash(key: tuple) -> int:
    """A 30-bit hash of call ``key`` (never 0), the same in every process (blake2b of its
    fingerprint's call words: Python's ``hash`` of a str is salted per process)."""
    fp = fingerprint(key, 0, 0)
    fp[OWN] = 0
    return int.from_bytes(hashlib.blake2b(fp[:KIND].tobytes(), digest_size=4).digest(), "little") & 0x3FFFFFFF | 1


def fold(h: int, kh: int, seq: int, period: int) -> int:
    """The running hash ``h`` of a group's calls, extended by call number ``seq`` of hash
    ``kh``: ``h + kh * (seq % period)`` (swapped or skipped calls change it; inlined on the hot
    paths; reduced to 63 bits, :data:`MASK`, at each comparison). docs/reliability.md, section 4."""
    return h + kh * (seq % period)


MASK = (1 << 63) - 1


def same_point(rows: np.ndarray) -> bool:
    """True when every member sent its row from the same exchange (kind and sequence number):
    then all of them can take part in a further collective on the exchange's communicator."""
    return bool((rows[:, KIND] == rows[0, KIND]).all() and (rows[:, CALLS] == rows[0, CALLS]).all())


def _text(words: np.ndarray) -> str:
    return words.tobytes().rstrip(b"\0").decode(errors="replace")


def decode(row: np.ndarray) -> str:
    """A member's row as a call, for messages (the layout shows as a hash: ``sizes=#...``)."""
    parts = [f"seq={int(row[_SEQ])}"]
    if row[_COUNT] >= 0:
        parts.append(f"count={int(row[_COUNT])}")
    if row[_DTYPE_WORDS].any():
        parts.append(f"dtype={_text(row[_DTYPE_WORDS])}")
    if row[_ROOT] >= 0:
        parts.append(f"root={int(row[_ROOT])}")
    if row[_REDOP_WORDS].any():
        parts.append(f"op={_text(row[_REDOP_WORDS]).upper()}")
    if row[_LAYOUT]:
        parts.append(f"sizes=#{int(row[_LAYOUT]) & 0xFFFF:04x}")
    return f"{_text(row[_OP_WORDS])}({', '.join(parts)})"


def mismatched(rows: np.ndarray) -> bool:
    """True when the fingerprints ``rows`` (one per member) differ in a word that must agree
    (every word but ``own``; compared as bytes: a few numpy calls cost more than the exchange)."""
    own = rows[:, OWN].copy()
    rows[:, OWN] = 0
    raw = rows.tobytes()
    rows[:, OWN] = own
    width = len(raw) // len(rows)
    first = raw[:width]
    return any(raw[i : i + width] != first for i in range(width, len(raw), width))


def differ(rows: np.ndarray) -> list[str]:
    """The names of the fields in which the fingerprints ``rows`` differ."""
    return [name for name, where in _FIELDS if len({r[where].tobytes() for r in rows}) > 1]


def describe(key: tuple, seq: Optional[int] = None) -> str:
    """``all_reduce(seq=3, count=4, dtype=float64, op=SUM)``: a call, for messages."""
    parts = [] if seq is None else [f"seq={seq}"]
    if key[COUNT] >= 0:
        parts.append(f"count={key[COUNT]}")
    if key[DTYPE] is not None:
        parts.append(f"dtype={dtype_text(key[DTYPE])}")
    if key[ROOT] >= 0:
        parts.append(f"root={key[ROOT]}")
    if key[REDOP] is not None:
        parts.append(f"op={key[REDOP].upper()}")
    if key[LAYOUT] is not None:
        name = _LAYOUT_NAMES.get(key[OP], "sizes")
        parts.append(f"{name}={key[LAYOUT][0] if name == 'arrays' else list(key[LAYOUT])}")
    return f"{key[OP]}({', '.join(parts)})"


def differ_keys(a: tuple, b: tuple) -> list[str]:
    """The names of the fields in which keys ``a`` and ``b`` differ (as :func:`differ`)."""
    where = {"op": OP, "count": COUNT, "dtype": DTYPE, "root": ROOT, "reduce op": REDOP, "sizes": LAYOUT}
    return [name for name, _ in _FIELDS if name in where and a[where[name]] != b[where[name]]]
