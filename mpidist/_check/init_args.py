"""init_process_group's collective argument check: every rank fails alike, or none does.

Each rank checks its own arguments without communicating and keeps the error (:class:`Mine`);
the ranks exchange one row of 7 int64 (:func:`exchange`, bounded by the init timeout), plus a
pickled allgather of the error texts when there are any, and every rank takes the same
decision from the same rows (:func:`verdict`). The rules for ``rank``/``world_size`` and
RANK/WORLD_SIZE: init_process_group's docstring, docs/api.md; docs/reliability.md, section 1a.
Imports nothing of mpidist.
"""

from __future__ import annotations

import time
import zlib
from collections import Counter
from dataclasses import dataclass
from typing import Optional, cast

import numpy as np
from mpi4py import MPI

__all__ = ["Mine", "InitTimeout", "exchange", "verdict", "mpi_warning", "agree"]

# the row each rank contributes (int64)
RANK_ARG, SIZE_ARG, ERROR, BACKEND, MPI_NAME, ENV_RANK, ENV_SIZE = range(7)
_WIDTH = 7
_OP = "init_process_group:"


@dataclass
class Mine:
    """This rank's view, checked locally: its arguments, its local error, its environment."""

    rank: int = -1
    world_size: int = -1
    backend: str = ""  # canonical form ("" if the backend itself is wrong)
    mpi_name: bool = False  # backend spelled as torch's MPI backend: rank/world_size ignored
    error: Optional[BaseException] = None
    env_rank: Optional[int] = None
    env_size: Optional[int] = None

    def row(self) -> list[int]:
        def clamp(v: Optional[int]) -> int:
            return -1 if v is None else max(-(1 << 62), min(int(v), 1 << 62))

        return [
            clamp(self.rank),
            clamp(self.world_size),
            int(self.error is not None),
            zlib.crc32(self.backend.encode()) if self.error is None else 0,
            int(self.mpi_name),
            clamp(self.env_rank),
            clamp(self.env_size),
        ]


class InitTimeout(Exception):
    """Not every rank reached init_process_group within the timeout."""


def exchange(comm: MPI.Comm, row: list[int], seconds: float) -> np.ndarray:
    """Every rank's ``row``, shape (n, 7) int64, through one MPI_Iallgather waited for at most
    ``seconds`` (spinning on MPI_Test, then sleeping up to 20 ms between tests).

    Raises:
        InitTimeout: a rank did not call it in time. The request stays posted (an MPI
            collective cannot be cancelled); the caller aborts the job or gives up on it.
    """
    send = np.array(row, dtype=np.int64)
    if comm.Get_size() == 1:
        return send.reshape(1, _WIDTH)
    recv = np.empty((comm.Get_size(), _WIDTH), dtype=np.int64)
    req = comm.Iallgather([send, MPI.INT64_T], [recv, MPI.INT64_T])
    deadline = time.monotonic() + seconds
    spins, nap = 0, 0.0
    while not req.Test():
        if time.monotonic() > deadline:
            _abandoned.append((req, send, recv))  # keep the buffers alive for MPI
            raise InitTimeout(
                f"{_OP} timed out after {seconds:g} s waiting for every rank to call "
                f"init_process_group: a rank failed or exited before calling it, or does not "
                f"call it (every rank must)"
            )
        spins += 1
        if spins > 1000:
            nap = min(0.02, nap * 2 or 0.0005)
            time.sleep(nap)
    return recv


_abandoned: list = []


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def _strip(message: str) -> str:
    return message[len(_OP) :].lstrip() if message.startswith(_OP) else message


def _local_errors(rows: np.ndarray, texts: list) -> tuple[type, str]:
    """The error(s) some ranks found in their own arguments, as one message."""
    by_text: dict = {}
    for r in np.flatnonzero(rows[:, ERROR]).tolist():
        by_text.setdefault((texts[r][0], texts[r][1]), []).append(r)
    kinds = {kind for kind, _ in by_text}
    cls = TypeError if kinds == {"TypeError"} else ValueError
    if len(by_text) == 1 and len(next(iter(by_text.values()))) == len(rows):
        return cls, next(iter(by_text))[1]  # the same error everywhere: say it as each rank would
    parts = [f"on {_ranks(ranks)}: {_strip(text)}" for (_, text), ranks in list(by_text.items())[:3]]
    more = f"; and {len(by_text) - 3} other errors" if len(by_text) > 3 else ""
    return cls, f"{_OP} {'; '.join(parts)}{more}"


def _renumbering(rows: np.ndarray) -> bool:
    """True if the ranks passed are all different, each a rank of the job, and not MPI's."""
    n = len(rows)
    passed = [(i, int(r)) for i, r in enumerate(rows[:, RANK_ARG]) if r != -1]
    values = [r for _, r in passed]
    return (
        bool(passed)
        and len(set(values)) == len(values)
        and all(0 <= r < n for r in values)
        and any(r != i for i, r in passed)
    )


def _rank_error(rows: np.ndarray) -> str:
    bad = [(i, int(r)) for i, r in enumerate(rows[:, RANK_ARG]) if r not in (-1, i)]
    shown = ", ".join(f"the process MPI made rank {i} passed rank={r}" for i, r in bad[:4])
    more = f" (and {len(bad) - 4} more)" if len(bad) > 4 else ""
    return (
        f"{_OP} rank= contradicts MPI, which numbers the processes itself: {shown}{more}; mpidist cannot "
        f"renumber them: pass rank=-1 (or leave it out) and ask get_rank()"
    )


def _size_error(rows: np.ndarray) -> Optional[str]:
    n = len(rows)
    bad = [(i, int(w)) for i, w in enumerate(rows[:, SIZE_ARG]) if w not in (-1, n)]
    if not bad:
        return None
    want = Counter(w for _, w in bad).most_common(1)[0][0]
    where = _ranks([i for i, w in bad if w == want])
    launched = f"MPI launched {n} process{'es' if n > 1 else ''}"
    if want <= 0:
        return f"{_OP} world_size={want} (passed on {where}) must be -1 or the number of processes: {launched}"
    return (
        f"{_OP} world_size={want} (passed on {where}) but {launched}: mpidist takes the world from the "
        f"MPI launcher; start {want} processes with `mpiexec -n {want} python ...` or "
        f"`srun -n {want} python ...` (or pass world_size=-1)"
    )


def _env_error(rows: np.ndarray) -> Optional[str]:
    n = len(rows)
    bad = [i for i in range(n) if rows[i, ENV_SIZE] > n or rows[i, ENV_RANK] >= n]
    if not bad:
        return None
    want = int(max(max(rows[i, ENV_SIZE], rows[i, ENV_RANK] + 1) for i in bad))
    first = rows[bad[0]]
    said = ", ".join(
        f"{name}={int(first[col])}" for name, col in (("RANK", ENV_RANK), ("WORLD_SIZE", ENV_SIZE)) if first[col] >= 0
    )
    return (
        f"{_OP} the environment says {said} (on {_ranks(bad)}), a world of at least {want} processes, but "
        f"MPI launched {n}: mpidist takes ranks from the MPI launcher, not from RANK/WORLD_SIZE (torchrun's "
        f"variables); start the job with `mpiexec -n {want} python ...` or `srun -n {want} python ...`, "
        f"or unset RANK and WORLD_SIZE for a one-process run"
    )


def verdict(rows: np.ndarray, texts: Optional[list] = None) -> Optional[tuple[type, str]]:
    """The error every rank raises, from every rank's row (and, if some rank had a local
    error or the backends differ, every rank's ``(error type name, message, backend)``):
    (exception class, message starting ``init_process_group:``), or None."""
    if rows[:, ERROR].any():
        return _local_errors(rows, cast(list, texts))  # (given when some rank had a local error)
    if len(set(rows[:, BACKEND].tolist())) > 1:
        by_name: dict = {}
        for r, (_, _, name) in enumerate(cast(list, texts)):  # (given when the backends differ)
            by_name.setdefault(name, []).append(r)
        names = "; ".join(f"{name!r} on {_ranks(ranks)}" for name, ranks in by_name.items())
        return ValueError, f"{_OP} the ranks passed different backends: {names} (every rank must pass the same)"
    if rows[:, MPI_NAME].all():
        if _renumbering(rows):
            return ValueError, _rank_error(rows)
    else:
        text = _size_error(rows)
        if text is not None:
            return ValueError, text
        if any(r not in (-1, i) for i, r in enumerate(rows[:, RANK_ARG])):
            return ValueError, _rank_error(rows)
    text = _env_error(rows)
    return (ValueError, text) if text is not None else None


def mpi_warning(rows: np.ndarray, me: int) -> Optional[str]:
    """torch's warning for an MPI backend given a rank/world_size it ignores (None if this
    rank's values agree with MPI)."""
    n = len(rows)
    rank, size = int(rows[me, RANK_ARG]), int(rows[me, SIZE_ARG])
    if not rows[me, MPI_NAME] or (rank in (-1, me) and size in (-1, n)):
        return None
    return (
        f"{_OP} For MPI backend, world_size ({size}) and rank ({rank}) are ignored since they are "
        f"assigned by the MPI runtime: this process is rank {me} of {n}"
    )


def agree(comm: MPI.Comm, mine: Mine, seconds: float) -> tuple[Optional[tuple[type, str]], Optional[str]]:
    """Collective over ``comm``: (the error every rank raises or None, this rank's warning or None).

    Raises:
        InitTimeout: see :func:`exchange`.
    """
    rows = exchange(comm, mine.row(), seconds)
    texts = None
    if rows[:, ERROR].any() or len(set(rows[:, BACKEND].tolist())) > 1:
        error = mine.error
        texts = comm.allgather(
            (type(error).__name__, str(error), mine.backend) if error is not None else (None, None, mine.backend)
        )
    return verdict(rows, texts), mpi_warning(rows, comm.Get_rank())
