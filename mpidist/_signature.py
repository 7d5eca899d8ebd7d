"""A collective call's signature: what every member of a group must pass alike, as a key
(compared within a rank) and as fixed-size fingerprint words (compared across ranks).

A *key* is the tuple ``(op, count, dtype, root, redop, layout)``:

* ``op``: the op's name (``"all_reduce"``);
* ``count``: the element count every member must pass, -1 where counts may differ
  between ranks (gather, scatter, the all-to-alls);
* ``dtype``: a numpy dtype, or None (object collectives, barrier);
* ``root``: the root's global rank, -1 if none;
* ``redop``: the reduction's name (``"sum"``; ``"premul_sum"`` whatever the factor,
  which may differ between ranks as in torch), or None;
* ``layout``: a tuple of ints every member must pass alike (all_gather's list of
  sizes, the number of arrays of the multi-array forms), or None.

Keys of calls that agree are equal on every member, so a group's members can cache the
keys they agreed on and all make the same decision the next time (:mod:`mpidist._debug`).

The fingerprint packs a key, the group's sequence number and size, and a count that may
legitimately differ between ranks (``own``: this rank's part in a gather or scatter)
into :data:`WORDS` int64; all but ``own`` must be equal on every member. It is built
from ints and bytes only, so it is the same in every process (Python's ``hash`` of a
tuple of ints is not salted).

Imports nothing of the package: a leaf that the check (``_debug``) and the watchdog use.
"""
from __future__ import annotations

import functools
from typing import Any, Optional

import numpy as np

__all__ = ["OP", "COUNT", "DTYPE", "ROOT", "REDOP", "LAYOUT", "WORDS", "OWN", "fingerprint", "mismatched", "differ",
           "differ_keys", "describe", "dtype_text"]

OP, COUNT, DTYPE, ROOT, REDOP, LAYOUT = range(6)

# Fingerprint layout (int64 words). OWN: the word that may differ between ranks (this rank's own count).
_SEQ, _SIZE, _COUNT, _ROOT, _LAYOUT, OWN = range(6)
_OP_WORDS = slice(6, 10)      # op name, 32 bytes
_DTYPE_WORDS = slice(10, 12)  # dtype text, 16 bytes
_REDOP_WORDS = slice(12, 14)  # reduction name, 16 bytes
WORDS = 14
#: The words every member must have alike (all but ``own``), with the name a message gives them.
_FIELDS = (("op", _OP_WORDS), ("sequence number", _SEQ), ("count", _COUNT), ("dtype", _DTYPE_WORDS),
           ("root", _ROOT), ("reduce op", _REDOP_WORDS), ("sizes", _LAYOUT), ("group size", _SIZE))
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


def fingerprint(key: tuple, seq: int, size: int, own: int = -1) -> np.ndarray:
    """The :data:`WORDS` int64 of call ``key``, number ``seq`` on a group of ``size``."""
    fp = np.zeros(WORDS, np.int64)
    fp[_SEQ], fp[_SIZE], fp[_COUNT], fp[_ROOT] = seq, size, key[COUNT], key[ROOT]
    fp[_LAYOUT] = 0 if key[LAYOUT] is None else hash(key[LAYOUT]) & ((1 << 63) - 1) | 1
    fp[OWN] = own
    _pack(fp, _OP_WORDS, key[OP])
    if key[DTYPE] is not None:
        _pack(fp, _DTYPE_WORDS, dtype_text(key[DTYPE]))
    if key[REDOP] is not None:
        _pack(fp, _REDOP_WORDS, key[REDOP])
    return fp


def mismatched(rows: np.ndarray) -> bool:
    """True when the fingerprints ``rows`` (one per member) differ in a word that must agree."""
    return bool((rows[:, :OWN] != rows[0, :OWN]).any() or (rows[:, OWN + 1:] != rows[0, OWN + 1:]).any())


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
