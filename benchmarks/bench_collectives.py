"""Every mpidist collective against raw mpi4py and torch.distributed gloo, in nccl-tests' layout.

Run as ``mpiexec -n N python benchmarks/bench_collectives.py [--min-bytes 8 --max-bytes 64M
--factor 4 --ops all_reduce,broadcast --quick --no-torch --out benchmarks/results]``.

Collectives (float32; SUM where there is a reduction; root 0 where there is a root), and
the variants timed: torch's API decides which exist. ``in-place`` is nccl-tests' in-place
column, i.e. torch's aliasing form where torch has one:

==========================  ===================================  =========================
collective                  out-of-place                         in-place
==========================  ===================================  =========================
all_reduce                  -- (torch: in place only)            ``tensor`` reduced in place
broadcast                   -- (in place only)                   ``tensor`` in place
reduce                      -- (in place only)                   ``tensor`` in place on root
all_gather_into_tensor      separate ``input_tensor``            input = own block of output
all_gather (list form)      separate ``tensor``                  tensor = ``tensor_list[rank]``
reduce_scatter_tensor       separate ``output``                  output = own block of input
all_to_all_single           separate ``output`` and ``input``    -- (no in-place form)
gather                      separate ``tensor``                  root: tensor = gather_list[0]
scatter                     separate ``tensor``                  root: tensor = scatter_list[0]
==========================  ===================================  =========================

Implementations, all in the same job and interleaved per size (drift hits them alike):

* ``mpidist``: the mpidist function (default algorithm);
* ``raw``: the MPI call it wraps, straight through mpi4py on a Dup of COMM_WORLD, with
  ``[array, MPI.FLOAT]`` buffer specs built once -- the ceiling for any wrapper of MPI:
  ``Allreduce``, ``Bcast``, ``Reduce``, ``Allgather``, ``Reduce_scatter_block``,
  ``Alltoall``, ``Gather``, ``Scatter`` (``MPI.IN_PLACE`` for the in-place variants;
  MPI's in-place reduce-scatter leaves the result in the FIRST block, not the rank's own);
* ``ring`` (and any other non-"mpi" value of ``mpidist.collectives.ALGORITHMS``):
  ``mpidist.all_reduce(x, algorithm=...)``, all_reduce only;
* ``gloo``: the same torch.distributed function on ``torch.from_numpy`` views of the same
  buffers, in a gloo group started on the same ranks (``tcp://127.0.0.1:PORT``, the port
  picked by rank 0 and broadcast over MPI; world size and rank from MPI;
  ``torch.set_num_threads(1)``); skipped when torch does not import (``pip install
  -e '.[bench]'`` brings the CPU torch);
* ``copy``: ``np.copyto`` of S bytes on rank 0 alone while the others sleep: single-core
  memory-copy bandwidth S / t, the physical reference for ``busbw / copy bw``.

Sizes, as nccl-tests (``size`` = max(send, receive) bytes of one rank, ``count`` = the
count argument of the NCCL call): S = ``--min-bytes``, every power of ``--factor`` above,
``--max-bytes`` (8 B, 16 B, 64 B, ... 64 MiB). all_reduce, broadcast and reduce move
``count = S / 4`` elements. all_gather*, reduce_scatter_tensor, all_to_all_single,
gather and scatter work on n blocks of ``count = max(1, S / 4 / n)`` elements (the block
per rank, per peer for all_to_all), so S is rounded to ``4 n count`` (at -n 4 the 8 B row
is 16 B).

Bandwidths (nccl-tests doc/PERFORMANCE.md): algbw = S / t; busbw = algbw * factor with
factor 2(n-1)/n for all_reduce; (n-1)/n for reduce_scatter, all_gather and all_to_all;
1 for broadcast and reduce; and (n-1)/n for gather and scatter (nccl-tests' gather.cu /
scatter.cu: the root's link carries the (n-1)/n of S that is not its own).

Correctness (``#wrong``): before timing, each implementation and variant runs once on
inputs that every rank can regenerate (element i of the global array is
``i % 65521 + 1``; reductions scale rank r's copy by r + 1, so the SUM is an exact integer
in float32), and every element of the result is compared with the value computed
independently in numpy; ``#wrong`` is the number of wrong elements summed over ranks
(root only for reduce and gather). The script exits 1 when any is non-zero, after
writing its results. Timed calls run on zeroed buffers, so repeated sums stay finite.

Timing: per case, up to 5 untimed warm-up calls (fewer when a call is slow), then
``iters`` calibrated so that one measurement lasts ``--target-ms`` +- 1/3 (default 40 ms;
10 ms with ``--quick``; at least one call). One measurement = barrier, ``iters`` calls,
the MAX over ranks of each rank's mean time per call. Reported time = median of
``--reps`` measurements (5; 3 with ``--quick``), taken round-robin over all the cases of
one collective and size (the order rotated by one case each pass). Ratios between
implementations (``time(peer) / time(mpidist)`` columns, headline) are the median over
those passes of the per-pass ratio, so a slow spell of the machine, which hits every
case of a pass, cancels out. gloo is slow at large sizes: its measurements are capped
at ``--gloo-max-iters`` calls.

Output (rank 0): the tables on stdout and in ``--out``: ``collectives_np{N}.md`` and
``.csv``, ``collectives_np{N}_latency.png`` and ``_busbw.png`` (one subplot per
collective, one line per implementation). The last lines printed are the headline
ratios for all_reduce and whether each target is met.
"""

from __future__ import annotations

import _bench_common as bc  # noqa: I001  (first: sets the thread variables before numpy)

# isort: split

import argparse
import csv
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from functools import lru_cache, partial
from pathlib import Path
from typing import Callable, Optional

import numpy as np
from mpi4py import MPI

import mpidist
from mpidist.collectives import ALGORITHMS

DTYPE = np.float32
ITEM = np.dtype(DTYPE).itemsize
PERIOD = 65521  # input values i % PERIOD + 1: exact in float32, even summed
FT = MPI.FLOAT
OOP, IP = "out-of-place", "in-place"
EXTRA_ALGORITHMS = tuple(a for a in ALGORITHMS if a != "mpi")  # ("ring",) today
IMPLS = ("mpidist", "raw", *EXTRA_ALGORITHMS, "gloo")
HEADLINE_SIZES = (8, 4 << 10, 1 << 20, 16 << 20, 64 << 20)
GLOO_DOC = "torch.distributed gloo on the same ranks (tcp://127.0.0.1), torch.set_num_threads(1)"


@lru_cache(maxsize=6)
def values(start: int, count: int) -> np.ndarray:
    """Elements ``start .. start+count-1`` of the global input array: ``i % PERIOD + 1``
    (read-only, cached: the checks of every implementation reuse it)."""
    out = (np.arange(start, start + count, dtype=np.int64) % PERIOD + 1).astype(DTYPE)
    out.flags.writeable = False
    return out


@dataclass
class Env:
    """What every collective's cases need: the raw communicator and the gloo group."""

    comm: MPI.Comm  # a Dup of COMM_WORLD for the raw calls
    rank: int
    n: int
    gloo: bc.Gloo

    def t(self, a: np.ndarray):
        """A torch tensor sharing ``a``'s memory."""
        return self.gloo.torch.from_numpy(a)


# ---------------------------------------------------------------- the collectives


class Collective:
    """One collective at one size: its buffers, how to fill and check them, its calls.

    Subclasses set the class attributes and implement ``_buffers``, ``fill``, ``wrong``
    and ``calls``. ``count`` is nccl-tests' count: the whole array for all_reduce,
    broadcast and reduce, the block per rank for the others (``chunked``).
    """

    name = ""
    redop = "sum"
    root = -1
    chunked = False
    variants: tuple[str, ...] = (IP,)
    busbw_doc = ""
    api = ""

    def __init__(self, env: Env, count: int) -> None:
        self.env, self.count = env, count
        self.total = count * env.n if self.chunked else count
        self.bufs = {v: self._buffers(v) for v in self.variants}

    @property
    def nbytes(self) -> int:
        return self.total * ITEM

    @classmethod
    def factor(cls, n: int) -> float:
        return (n - 1) / n

    @classmethod
    def primary(cls) -> str:
        """The variant the comparison tables and plots use: torch's usual form."""
        return OOP if OOP in cls.variants else IP

    def _buffers(self, variant: str) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def fill(self, b: dict) -> None:
        """Write the validation inputs (and -1 in the outputs) on this rank."""
        raise NotImplementedError

    def wrong(self, b: dict, impl: str) -> int:
        """Wrong elements of this rank's result after one call of ``impl``."""
        raise NotImplementedError

    def calls(self, b: dict, variant: str) -> dict[str, Callable[[], object]]:
        """impl -> a zero-argument call running the collective once on ``b``."""
        raise NotImplementedError

    def zero(self) -> None:
        """Zero every buffer (the timed calls run on zeros: repeated sums stay finite)."""
        for b in self.bufs.values():
            for a in b.values():
                if isinstance(a, np.ndarray):
                    a[...] = 0

    def sum_factor(self) -> int:
        """Rank r contributes (r + 1) x the values: the SUM is n (n + 1) / 2 x the values."""
        return self.env.n * (self.env.n + 1) // 2


def _ip_slot(out: np.ndarray, rank: int, c: int) -> np.ndarray:
    return out[rank * c : (rank + 1) * c]


class AllReduce(Collective):
    name = "all_reduce"
    busbw_doc = "2(n-1)/n"
    api = (
        "`all_reduce(x)` (in place only); raw `Allreduce(IN_PLACE, x, SUM)`; "
        'ring `all_reduce(x, algorithm="ring")`; gloo `dist.all_reduce(t)`'
    )

    @classmethod
    def factor(cls, n: int) -> float:
        return 2 * (n - 1) / n

    def _buffers(self, variant: str) -> dict:
        return {"x": bc.aligned_empty(self.count, DTYPE)}

    def fill(self, b: dict) -> None:
        b["x"][:] = values(0, self.count) * (self.env.rank + 1)

    def wrong(self, b: dict, impl: str) -> int:
        return int(np.count_nonzero(b["x"] != values(0, self.count) * self.sum_factor()))

    def calls(self, b: dict, variant: str) -> dict:
        e, x = self.env, b["x"]
        out = {
            "mpidist": partial(mpidist.all_reduce, x),
            "raw": partial(e.comm.Allreduce, MPI.IN_PLACE, [x, FT], MPI.SUM),
        }
        out.update({alg: partial(mpidist.all_reduce, x, algorithm=alg) for alg in EXTRA_ALGORITHMS})
        if e.gloo.ok:
            out["gloo"] = partial(e.gloo.dist.all_reduce, e.t(x))
        return out


class Broadcast(Collective):
    name = "broadcast"
    redop = "none"
    root = 0
    busbw_doc = "1"
    api = "`broadcast(x, src=0)` (in place only); raw `Bcast(x, 0)`; gloo `dist.broadcast(t, 0)`"

    @classmethod
    def factor(cls, n: int) -> float:
        return 1.0

    def _buffers(self, variant: str) -> dict:
        return {"x": bc.aligned_empty(self.count, DTYPE)}

    def fill(self, b: dict) -> None:
        b["x"][:] = values(0, self.count) if self.env.rank == 0 else -1

    def wrong(self, b: dict, impl: str) -> int:
        return int(np.count_nonzero(b["x"] != values(0, self.count)))

    def calls(self, b: dict, variant: str) -> dict:
        e, x = self.env, b["x"]
        out = {"mpidist": partial(mpidist.broadcast, x, 0), "raw": partial(e.comm.Bcast, [x, FT], 0)}
        if e.gloo.ok:
            out["gloo"] = partial(e.gloo.dist.broadcast, e.t(x), 0)
        return out


class Reduce(Collective):
    name = "reduce"
    root = 0
    busbw_doc = "1"
    api = (
        "`reduce(x, dst=0)` (in place only; result on the root, only the root's checked); "
        "raw `Reduce(IN_PLACE, x, SUM, 0)` on the root, `Reduce(x, None, SUM, 0)` elsewhere; "
        "gloo `dist.reduce(t, 0)`"
    )

    @classmethod
    def factor(cls, n: int) -> float:
        return 1.0

    _buffers = AllReduce._buffers
    fill = AllReduce.fill

    def wrong(self, b: dict, impl: str) -> int:
        return AllReduce.wrong(self, b, impl) if self.env.rank == 0 else 0

    def calls(self, b: dict, variant: str) -> dict:
        e, x = self.env, b["x"]
        send = MPI.IN_PLACE if e.rank == 0 else [x, FT]
        out = {
            "mpidist": partial(mpidist.reduce, x, 0),
            "raw": partial(e.comm.Reduce, send, [x, FT] if e.rank == 0 else None, MPI.SUM, 0),
        }
        if e.gloo.ok:
            out["gloo"] = partial(e.gloo.dist.reduce, e.t(x), 0)
        return out


class AllGatherIntoTensor(Collective):
    name = "all_gather_into_tensor"
    redop = "none"
    chunked = True
    variants = (OOP, IP)
    busbw_doc = "(n-1)/n"
    api = (
        "`all_gather_single(out, inp)` (torch 2.13's name of all_gather_into_tensor); raw `Allgather(inp, out)` / "
        "`Allgather(IN_PLACE, out)`; "
        "gloo `dist.all_gather_into_tensor(out, inp)` (torch 2.13 renamed it `all_gather_single`, "
        "used where present)"
    )

    def _buffers(self, variant: str) -> dict:
        out = bc.aligned_empty(self.total, DTYPE)
        inp = _ip_slot(out, self.env.rank, self.count) if variant == IP else bc.aligned_empty(self.count, DTYPE)
        return {"out": out, "inp": inp}

    def fill(self, b: dict) -> None:
        b["out"][:] = -1
        b["inp"][:] = values(self.env.rank * self.count, self.count)

    def wrong(self, b: dict, impl: str) -> int:
        return int(np.count_nonzero(b["out"] != values(0, self.total)))

    def calls(self, b: dict, variant: str) -> dict:
        e, out, inp = self.env, b["out"], b["inp"]
        send = MPI.IN_PLACE if variant == IP else [inp, FT]
        calls = {
            "mpidist": partial(mpidist.all_gather_single, out, inp),
            "raw": partial(e.comm.Allgather, send, [out, FT]),
        }
        if e.gloo.ok:
            d = e.gloo.dist
            calls["gloo"] = partial(
                getattr(d, "all_gather_single", None) or d.all_gather_into_tensor, e.t(out), e.t(inp)
            )
        return calls


class AllGather(AllGatherIntoTensor):
    name = "all_gather"
    api = (
        "`all_gather(list(out.reshape(n, count)), inp)` (the list's arrays back to back); "
        "raw `Allgather` as all_gather_into_tensor; gloo `dist.all_gather([t...], inp)`"
    )

    def _buffers(self, variant: str) -> dict:
        b = super()._buffers(variant)
        b["list"] = list(b["out"].reshape(self.env.n, self.count))
        return b

    def calls(self, b: dict, variant: str) -> dict:
        calls = super().calls(b, variant)
        calls["mpidist"] = partial(mpidist.all_gather, b["list"], b["inp"])
        if self.env.gloo.ok:
            calls["gloo"] = partial(
                self.env.gloo.dist.all_gather, [self.env.t(a) for a in b["list"]], self.env.t(b["inp"])
            )
        return calls


class ReduceScatterTensor(Collective):
    name = "reduce_scatter_tensor"
    chunked = True
    variants = (OOP, IP)
    busbw_doc = "(n-1)/n"
    api = (
        "`reduce_scatter_single(out, inp)` (torch 2.13's name of reduce_scatter_tensor; in place: out = inp's "
        "own block; mpidist then copies inp); "
        "raw `Reduce_scatter_block(inp, out, SUM)` / `Reduce_scatter_block(IN_PLACE, inp, SUM)` "
        "(result in inp's first block); gloo `dist.reduce_scatter_tensor(out, inp)` "
        "(torch 2.13: `reduce_scatter_single`, used where present)"
    )

    def _buffers(self, variant: str) -> dict:
        inp = bc.aligned_empty(self.total, DTYPE)
        out = _ip_slot(inp, self.env.rank, self.count) if variant == IP else bc.aligned_empty(self.count, DTYPE)
        return {"inp": inp, "out": out}

    def fill(self, b: dict) -> None:
        b["out"][:] = -1
        b["inp"][:] = values(0, self.total) * (self.env.rank + 1)

    def wrong(self, b: dict, impl: str) -> int:
        in_place = np.may_share_memory(b["out"], b["inp"])
        got = b["inp"][: self.count] if impl == "raw" and in_place else b["out"]  # MPI's in-place layout
        want = values(self.env.rank * self.count, self.count) * self.sum_factor()
        return int(np.count_nonzero(got != want))

    def calls(self, b: dict, variant: str) -> dict:
        e, out, inp = self.env, b["out"], b["inp"]
        raw = (MPI.IN_PLACE, [inp, FT]) if variant == IP else ([inp, FT], [out, FT])
        calls = {
            "mpidist": partial(mpidist.reduce_scatter_single, out, inp),
            "raw": partial(e.comm.Reduce_scatter_block, *raw, MPI.SUM),
        }
        if e.gloo.ok:
            d = e.gloo.dist
            calls["gloo"] = partial(
                getattr(d, "reduce_scatter_single", None) or d.reduce_scatter_tensor, e.t(out), e.t(inp)
            )
        return calls


class AllToAllSingle(Collective):
    name = "all_to_all_single"
    redop = "none"
    chunked = True
    variants = (OOP,)
    busbw_doc = "(n-1)/n"
    api = "`all_to_all_single(out, inp)` (no in-place form); raw `Alltoall(inp, out)`; gloo `dist.all_to_all_single`"

    def _buffers(self, variant: str) -> dict:
        return {"inp": bc.aligned_empty(self.total, DTYPE), "out": bc.aligned_empty(self.total, DTYPE)}

    def fill(self, b: dict) -> None:
        b["out"][:] = -1
        b["inp"][:] = values(self.env.rank * self.total, self.total)

    def wrong(self, b: dict, impl: str) -> int:
        r, c, t = self.env.rank, self.count, self.total
        want = np.concatenate([values(k * t + r * c, c) for k in range(self.env.n)])
        return int(np.count_nonzero(b["out"] != want))

    def calls(self, b: dict, variant: str) -> dict:
        e, out, inp = self.env, b["out"], b["inp"]
        calls = {
            "mpidist": partial(mpidist.all_to_all_single, out, inp),
            "raw": partial(e.comm.Alltoall, [inp, FT], [out, FT]),
        }
        if e.gloo.ok:
            calls["gloo"] = partial(e.gloo.dist.all_to_all_single, e.t(out), e.t(inp))
        return calls


class Gather(Collective):
    name = "gather"
    redop = "none"
    root = 0
    chunked = True
    variants = (OOP, IP)
    busbw_doc = "(n-1)/n"
    api = (
        "`gather(inp, list(out.reshape(n, count)) on the root, dst=0)` (in place: the root's inp is "
        "its slot of out); raw `Gather(inp, out, 0)` / `Gather(IN_PLACE, out, 0)` on the root; "
        "gloo `dist.gather(t, [t...], dst=0)`; only the root's result is checked"
    )

    def _buffers(self, variant: str) -> dict:
        out = bc.aligned_empty(self.total, DTYPE)
        ip = variant == IP and self.env.rank == 0
        inp = _ip_slot(out, 0, self.count) if ip else bc.aligned_empty(self.count, DTYPE)
        return {"out": out, "inp": inp}

    fill = AllGatherIntoTensor.fill

    def wrong(self, b: dict, impl: str) -> int:
        return AllGatherIntoTensor.wrong(self, b, impl) if self.env.rank == 0 else 0

    def calls(self, b: dict, variant: str) -> dict:
        e, out, inp = self.env, b["out"], b["inp"]
        root = e.rank == 0
        outs = list(out.reshape(e.n, self.count)) if root else None
        send = MPI.IN_PLACE if root and variant == IP else [inp, FT]
        calls = {
            "mpidist": partial(mpidist.gather, inp, outs, 0),
            "raw": partial(e.comm.Gather, send, [out, FT] if root else None, 0),
        }
        if e.gloo.ok:
            calls["gloo"] = partial(e.gloo.dist.gather, e.t(inp), [e.t(a) for a in outs] if root else None, dst=0)
        return calls


class Scatter(Collective):
    name = "scatter"
    redop = "none"
    root = 0
    chunked = True
    variants = (OOP, IP)
    busbw_doc = "(n-1)/n"
    api = (
        "`scatter(out, list(inp.reshape(n, count)) on the root, src=0)` (in place: the root's out is "
        "its slot of inp); raw `Scatter(inp, out, 0)` / `Scatter(inp, IN_PLACE, 0)` on the root; "
        "gloo `dist.scatter(t, [t...], src=0)`"
    )

    def _buffers(self, variant: str) -> dict:
        inp = bc.aligned_empty(self.total, DTYPE)
        ip = variant == IP and self.env.rank == 0
        out = _ip_slot(inp, 0, self.count) if ip else bc.aligned_empty(self.count, DTYPE)
        return {"inp": inp, "out": out}

    def fill(self, b: dict) -> None:
        b["inp"][:] = values(0, self.total) if self.env.rank == 0 else -2
        if not np.may_share_memory(b["out"], b["inp"]):
            b["out"][:] = -1

    def wrong(self, b: dict, impl: str) -> int:
        return int(np.count_nonzero(b["out"] != values(self.env.rank * self.count, self.count)))

    def calls(self, b: dict, variant: str) -> dict:
        e, out, inp = self.env, b["out"], b["inp"]
        root = e.rank == 0
        ins = list(inp.reshape(e.n, self.count)) if root else None
        recv = MPI.IN_PLACE if root and variant == IP else [out, FT]
        calls = {
            "mpidist": partial(mpidist.scatter, out, ins, 0),
            "raw": partial(e.comm.Scatter, [inp, FT] if root else None, recv, 0),
        }
        if e.gloo.ok:
            calls["gloo"] = partial(e.gloo.dist.scatter, e.t(out), [e.t(a) for a in ins] if root else None, src=0)
        return calls


COLLECTIVES: dict[str, type[Collective]] = {
    c.name: c
    for c in (
        AllReduce,
        Broadcast,
        Reduce,
        AllGatherIntoTensor,
        AllGather,
        ReduceScatterTensor,
        AllToAllSingle,
        Gather,
        Scatter,
    )
}


# ---------------------------------------------------------------- running


@dataclass
class Row:
    """One implementation and variant of one collective at one size."""

    op: str
    impl: str
    variant: str
    nominal: int  # the sweep's size; nbytes may differ for blocked collectives
    nbytes: int
    count: int
    m: bc.Measurement
    wrong: int

    @property
    def time_s(self) -> float:
        return self.m.time_s

    @property
    def algbw(self) -> float:
        return bc.ratio(self.nbytes, self.time_s) / 1e9

    def busbw(self, n: int) -> float:
        return self.algbw * COLLECTIVES[self.op].factor(n)


def paired(a: Optional[Row], b: Optional[Row]) -> float:
    """time(a) / time(b) as the median over rounds of the per-round ratio: measurement k of
    every case of one collective and size comes from the same round-robin pass, so a slow
    spell of the machine hits both sides of each ratio (NaN when either row is missing)."""
    if a is None or b is None:
        return math.nan
    return statistics.median(x / y for x, y in zip(a.m.samples, b.m.samples))


@dataclass
class Case:
    """One timed call: ``call()`` on every rank (or only where ``active``), at most ``cap``
    calls per measurement."""

    impl: str
    variant: str
    call: Callable[[], object]
    active: bool = True
    cap: Optional[int] = None


def validate(env: Env, coll: Collective, case: Case) -> int:
    """Fill, call once, count this collective's wrong elements over all ranks."""
    b = coll.bufs[case.variant]
    coll.fill(b)
    case.call()
    return env.comm.allreduce(coll.wrong(b, case.impl), op=MPI.SUM)


class CopyRef:
    """``np.copyto`` of a size on rank 0 alone: the single-core memory-copy reference."""

    def __init__(self, rank: int) -> None:
        self.rank, self.done = rank, {}

    def case(self, nbytes: int) -> Optional[Case]:
        if nbytes in self.done:
            return None
        src, dst = bc.aligned_empty(nbytes // ITEM, DTYPE), bc.aligned_empty(nbytes // ITEM, DTYPE)
        src[:], dst[:] = 1, 0
        return Case("copy", "copy", partial(np.copyto, dst, src), active=self.rank == 0)

    def bw(self, nbytes: int) -> float:
        m = self.done.get(nbytes)
        return bc.ratio(nbytes, m.time_s) / 1e9 if m else math.nan


def run_collective(env: Env, coll: Collective, nominal: int, copy: CopyRef, args: argparse.Namespace) -> list[Row]:
    """Validate, warm up, calibrate and time every case of ``coll``, measurements interleaved."""
    cases = [
        Case(impl, v, call, cap=args.gloo_max_iters if impl == "gloo" else None)
        for v in coll.variants
        for impl, call in coll.calls(coll.bufs[v], v).items()
    ]
    wrong = {(c.impl, c.variant): validate(env, coll, c) for c in cases}
    coll.zero()
    ref = copy.case(coll.nbytes)
    if ref is not None:
        cases.append(ref)
    ms = {}
    for c in cases:
        first = bc.warm_up(env.comm, c.call, args.warmup, args.target_s, c.active)
        ms[c.impl, c.variant] = bc.Measurement(
            iters=bc.calibrate(env.comm, c.call, args.target_s, c.active, guess_s=first, max_iters=c.cap)
        )
    for k in range(args.reps):
        for c in cases[k % len(cases) :] + cases[: k % len(cases)]:  # rotated: no case always first
            m = ms[c.impl, c.variant]
            m.samples.append(bc.timed(env.comm, c.call, m.iters, c.active))
    if ref is not None:
        copy.done[coll.nbytes] = ms.pop(("copy", "copy"))
    return [Row(coll.name, impl, v, nominal, coll.nbytes, coll.count, m, wrong[impl, v]) for (impl, v), m in ms.items()]


def sizes_for(cls: type[Collective], nominal: int, n: int) -> int:
    """nccl-tests' count for a sweep size: elements, or elements per block."""
    count = max(1, nominal // ITEM)
    return max(1, count // n) if cls.chunked else count


def run_sweep(env: Env, ops: list[str], args: argparse.Namespace) -> tuple[list[Row], CopyRef]:
    """Every size of the sweep, every collective of ``ops`` at that size; a blocked
    collective whose rounded size repeats the previous one (8 B and 16 B at -n 4) runs once."""
    copy, rows, t0 = CopyRef(env.rank), [], time.perf_counter()
    last: dict[str, int] = {}
    for nominal in bc.sweep(args.min_bytes, args.max_bytes, args.factor):
        for name in ops:
            cls = COLLECTIVES[name]
            count = sizes_for(cls, nominal, env.n)
            if last.get(name) == count:
                continue
            last[name] = count
            rows += run_collective(env, cls(env, count), nominal, copy, args)
        if env.rank == 0:
            print(f"# {bc.human_bytes(nominal):>8}: done at {time.perf_counter() - t0:6.1f} s", flush=True)
    return rows, copy


# ---------------------------------------------------------------- reporting


def index(rows: list[Row]) -> dict:
    return {(r.op, r.impl, r.variant, r.nominal): r for r in rows}


def header(n: int, args: argparse.Namespace, gloo: bc.Gloo, ops: list[str]) -> list[str]:
    timing = (
        f"median of {args.reps} measurements of {args.target_s * 2e3 / 3:.0f}-{args.target_s * 4e3 / 3:.0f} ms "
        f"(>= 1 call; gloo <= {args.gloo_max_iters} calls), each the max over ranks of the mean time per "
        f"call; up to {args.warmup} warm-up calls; all cases of one collective and size interleaved, "
        f"the order rotated each pass"
    )
    return [
        f"# Collectives benchmark, {n} ranks, float32",
        "",
        *bc.machine_lines(n, args.load_at_start),
        f"- {bc.versions(torch=gloo.version, mpidist=mpidist.__version__)}",
        f"- gloo peer: {GLOO_DOC if gloo.ok else gloo.reason}",
        f"- timing: {timing}; wall time of the sweep {args.elapsed:.0f} s",
        "- columns as nccl-tests: size(B) = max(send, receive) bytes per rank, count = the call's "
        "count argument (per-rank block for blocked collectives); algbw = size / time; busbw = "
        "algbw * the collective's factor (nccl-tests doc/PERFORMANCE.md); #wrong = wrong elements "
        "over all ranks; `n/a` = torch's API has no such variant",
        "- ratio columns and headline ratios: time(peer) / time(mpidist), > 1 = mpidist faster, as the "
        "median over the round-robin passes of the per-pass ratio (robust to slow spells of the machine; "
        "the times shown are medians); copy bw = single-core "
        "`np.copyto` bandwidth S / t on rank 0 alone, same S",
        f"- collectives: {', '.join(ops)}",
    ]


def nccl_table(ix: dict, coll: type[Collective], impl: str, nominals: list[int], n: int) -> list[str]:
    lines = [
        "| size(B) | count | type | redop | root | out-of-place time(us) | algbw(GB/s) | busbw(GB/s) | "
        "#wrong | in-place time(us) | algbw(GB/s) | busbw(GB/s) | #wrong |",
        "|---:|---:|---|---|---:|" + "---:|" * 8,
    ]
    for s in nominals:
        rows = [ix.get((coll.name, impl, v, s)) for v in (OOP, IP)]
        ref = next((r for r in rows if r), None)
        if ref is None:
            continue
        cells = [str(ref.nbytes), str(ref.count), "float", coll.redop, str(coll.root)]
        for r in rows:
            cells += (
                ["n/a"] * 4
                if r is None
                else [f"{r.time_s * 1e6:.2f}", f"{r.algbw:.3f}", f"{r.busbw(n):.3f}", str(r.wrong)]
            )
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def compare_table(
    ix: dict, coll: type[Collective], impls: list[str], nominals: list[int], n: int, copy: CopyRef
) -> list[str]:
    v = coll.primary()
    peers = [i for i in impls if i != "mpidist"]
    cols = ["size(B)", "mpidist time(us)"] + [f"{p}/mpidist time" for p in peers] + ["copy bw(GB/s)"]
    cols += [f"{i} busbw/copy bw" for i in impls]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---:|" * len(cols)]
    for s in nominals:
        md = ix.get((coll.name, "mpidist", v, s))
        if md is None:
            continue
        cbw = copy.bw(md.nbytes)
        cells = [str(md.nbytes), f"{md.time_s * 1e6:.2f}"]
        cells += [bc.fmt(paired(ix.get((coll.name, p, v, s)), md), 3) for p in peers]
        cells.append(bc.fmt(cbw))
        cells += [bc.fmt(bc.ratio(ix[coll.name, i, v, s].busbw(n), cbw), 3) for i in impls]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def impls_of(ix: dict, name: str) -> list[str]:
    present = {k[1] for k in ix if k[0] == name}
    return [i for i in IMPLS if i in present]


def report(
    rows: list[Row], copy: CopyRef, n: int, args: argparse.Namespace, gloo: bc.Gloo, ops: list[str]
) -> list[str]:
    ix = index(rows)
    nominals = sorted({r.nominal for r in rows})
    lines = header(n, args, gloo, ops)
    for name in ops:
        cls = COLLECTIVES[name]
        impls = impls_of(ix, name)
        primary = cls.primary()
        lines += [
            "",
            f"## {name}",
            "",
            f"{cls.api}. Variants: {', '.join(cls.variants)}. busbw factor {cls.busbw_doc}.",
        ]
        for impl in impls:
            lines += ["", f"### {name}: {impl}", ""] + nccl_table(ix, cls, impl, nominals, n)
        lines += ["", f"### {name}: ratios ({primary}) and the copy reference", ""]
        lines += compare_table(ix, cls, impls, nominals, n, copy)
    wrong = sum(r.wrong for r in rows)
    lines += ["", f"Out of bounds values: {wrong} {'OK' if wrong == 0 else 'FAILED'}"]
    return lines


def headlines(rows: list[Row], n: int) -> list[str]:
    """all_reduce's ratios at the headline sizes and the verdict on each target."""
    ix = index(rows)
    got = sorted(s for (op, impl, v, s) in ix if op == "all_reduce" and impl == "mpidist")
    if not got:
        return ["headline: all_reduce was not measured (--ops)"]

    def t(impl: str, s: int) -> float:
        r = ix.get(("all_reduce", impl, IP, s))
        return r.time_s if r else math.nan

    def q(a: str, b: str, s: int) -> float:
        return paired(ix.get(("all_reduce", a, IP, s)), ix.get(("all_reduce", b, IP, s)))

    lines = []
    for s in HEADLINE_SIZES:
        if s not in got:
            lines.append(f"headline: all_reduce {bc.human_bytes(s)}: not measured")
            continue
        md, raw = t("mpidist", s), t("raw", s)
        lines.append(
            f"headline: all_reduce {bc.human_bytes(s):>7}: mpidist/raw time = "
            f"{bc.fmt(q('mpidist', 'raw', s), 3)} ({md * 1e6:.2f} us vs {raw * 1e6:.2f} us); "
            f"gloo/mpidist = {bc.fmt(q('gloo', 'mpidist', s), 2)}x ({bc.fmt(t('gloo', s) * 1e6)} us); "
            f"ring/raw busbw = {bc.fmt(q('raw', 'ring', s), 3)}"
        )

    verdict = bc.verdict
    ring = "ring" in EXTRA_ALGORITHMS
    lines += [
        verdict(
            "8 B mpidist within 1.5x raw",
            [s for s in got if s == 8],
            lambda s: q("mpidist", "raw", s),
            lambda x: x <= 1.5,
            max,
        ),
        verdict(
            ">= 1 MiB mpidist within 1.05x raw",
            [s for s in got if s >= 1 << 20],
            lambda s: q("mpidist", "raw", s),
            lambda x: x <= 1.05,
            max,
        ),
        verdict(
            "4 KiB..64 MiB mpidist >= 5x faster than gloo",
            [s for s in got if 4 << 10 <= s <= 64 << 20],
            lambda s: q("gloo", "mpidist", s),
            lambda x: x >= 5,
            min,
            "x",
        ),
        verdict(
            "ring busbw >= 0.8x MPI's at >= 4 MiB",
            [s for s in got if s >= 4 << 20 and ring],
            lambda s: q("raw", "ring", s),
            lambda x: x >= 0.8,
            min,
        ),
    ]
    return lines


def write_csv(path: Path, rows: list[Row], copy: CopyRef, n: int) -> None:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(
            [
                "ranks",
                "collective",
                "impl",
                "variant",
                "size_bytes",
                "count",
                "type",
                "redop",
                "root",
                "time_us",
                "algbw_GBps",
                "busbw_GBps",
                "wrong",
                "iters",
                "time_min_us",
                "time_max_us",
                "copy_bw_GBps",
                "busbw_over_copy_bw",
            ]
        )
        for r in rows:
            cls = COLLECTIVES[r.op]
            cbw = copy.bw(r.nbytes)
            w.writerow(
                [
                    n,
                    r.op,
                    r.impl,
                    r.variant,
                    r.nbytes,
                    r.count,
                    "float",
                    cls.redop,
                    cls.root,
                    f"{r.time_s * 1e6:.6g}",
                    f"{r.algbw:.6g}",
                    f"{r.busbw(n):.6g}",
                    r.wrong,
                    r.m.iters,
                    f"{min(r.m.samples) * 1e6:.6g}",
                    f"{max(r.m.samples) * 1e6:.6g}",
                    f"{cbw:.6g}",
                    f"{bc.ratio(r.busbw(n), cbw):.6g}",
                ]
            )
        for nbytes, m in sorted(copy.done.items()):
            w.writerow(
                [
                    n,
                    "copy",
                    "copy",
                    "rank 0 alone",
                    nbytes,
                    nbytes // ITEM,
                    "float",
                    "none",
                    -1,
                    f"{m.time_s * 1e6:.6g}",
                    f"{nbytes / m.time_s / 1e9:.6g}",
                    "",
                    0,
                    m.iters,
                    f"{min(m.samples) * 1e6:.6g}",
                    f"{max(m.samples) * 1e6:.6g}",
                    f"{nbytes / m.time_s / 1e9:.6g}",
                    "",
                ]
            )


def plot(path: Path, rows: list[Row], copy: CopyRef, n: int, ops: list[str], metric: str) -> None:
    """One subplot per collective, one line per implementation (its primary variant), log axes."""
    import matplotlib  # noqa: PLC0415  (rank 0 only, after timing)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    from matplotlib.ticker import FuncFormatter  # noqa: PLC0415

    ix = index(rows)
    cols = min(3, len(ops))
    nrows = -(-len(ops) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5.2 * cols, 4.2 * nrows), squeeze=False)
    for ax, name in zip(axes.flat, ops):
        primary = COLLECTIVES[name].primary()
        for impl in impls_of(ix, name):
            rs = sorted(
                (r for r in rows if r.op == name and r.impl == impl and r.variant == primary), key=lambda r: r.nbytes
            )
            ys = [r.time_s * 1e6 if metric == "latency" else r.busbw(n) for r in rs]
            ax.plot([r.nbytes for r in rs], ys, marker="o", markersize=3, label=impl)
        sizes = sorted({r.nbytes for r in rows if r.op == name})
        ref = [copy.done[s].time_s * 1e6 if metric == "latency" else copy.bw(s) for s in sizes]
        ax.plot(sizes, ref, linestyle="--", color="grey", label="copy (1 core)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(sizes)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: bc.human_bytes(int(x)).replace(" ", "")))
        ax.tick_params(axis="x", labelrotation=45, labelsize=7)
        ax.set(
            title=f"{name} ({primary})",
            xlabel="size (B)",
            ylabel="time per call (us)" if metric == "latency" else "busbw (GB/s); copy: S / t",
        )
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(ops) :]:
        ax.set_visible(False)
    fig.suptitle(f"{metric}, float32, {n} ranks, {bc.cpu_model()}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def save(rows: list[Row], copy: CopyRef, n: int, ops: list[str], lines: list[str], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"collectives_np{n}"
    md, csv_path = stem.with_suffix(".md"), stem.with_suffix(".csv")
    md.write_text("\n".join(lines) + "\n")
    write_csv(csv_path, rows, copy, n)
    pngs = [out / f"collectives_np{n}_{m}.png" for m in ("latency", "busbw")]
    for path, metric in zip(pngs, ("latency", "busbw")):
        plot(path, rows, copy, n, ops, metric)
    return [md, csv_path, *pngs]


# ---------------------------------------------------------------- main


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--min-bytes", type=bc.parse_bytes, default=8)
    p.add_argument("--max-bytes", type=bc.parse_bytes, default=bc.parse_bytes("64M"))
    p.add_argument("--factor", type=int, default=4, help="sizes are the powers of FACTOR in range")
    p.add_argument("--ops", default=",".join(COLLECTIVES), help=f"comma-separated subset of {','.join(COLLECTIVES)}")
    p.add_argument("--quick", action="store_true", help="3 measurements of ~10 ms instead of 5 of ~40 ms")
    p.add_argument("--target-ms", type=float, default=None, help="length of one measurement (default 40; 10 quick)")
    p.add_argument("--reps", type=int, default=None, help="measurements per case (default 5; 3 quick)")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls per case and size (fewer if slow)")
    p.add_argument("--gloo-max-iters", type=int, default=200, help="cap on gloo's calls per measurement")
    p.add_argument("--no-torch", action="store_true", help="skip the torch.distributed gloo peer")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args(argv)
    args.ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    unknown = [o for o in args.ops if o not in COLLECTIVES]
    if unknown or not args.ops:
        p.error(f"--ops: unknown {unknown}; choose from {', '.join(COLLECTIVES)}")
    if args.factor < 2 or args.min_bytes < 1 or args.max_bytes < args.min_bytes:
        p.error("need --factor >= 2 and 1 <= --min-bytes <= --max-bytes")
    args.reps = args.reps or (3 if args.quick else 5)
    args.target_s = (args.target_ms or (10.0 if args.quick else 40.0)) / 1e3
    if args.reps < 1 or args.target_s <= 0 or args.warmup < 1 or args.gloo_max_iters < 1:
        p.error("--reps, --target-ms, --warmup and --gloo-max-iters must be positive")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    args.load_at_start = os.getloadavg()[0]  # other jobs on the machine make timings noisy
    mpidist.init_process_group("mpi")
    world = MPI.COMM_WORLD
    raw = world.Dup()
    gloo = bc.start_gloo(world, wanted=not args.no_torch)
    env = Env(raw, world.Get_rank(), world.Get_size(), gloo)
    t0 = time.perf_counter()
    with bc.thread_limit():
        rows, copy = run_sweep(env, args.ops, args)
    args.elapsed = time.perf_counter() - t0
    gloo.close()
    raw.Free()
    mpidist.destroy_process_group()
    if env.rank != 0:
        return 0
    lines = report(rows, copy, env.n, args, gloo, args.ops)
    print("\n".join(lines))
    for path in save(rows, copy, env.n, args.ops, lines, args.out):
        print(f"# wrote {path}")
    print("\n".join(headlines(rows, env.n)), flush=True)
    return 0 if all(r.wrong == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
