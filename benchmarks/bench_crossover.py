"""Where shared memory beats MPI_Allreduce and the ring: the sweep behind all_reduce's automatic choice.

Run as ``mpiexec -n N python benchmarks/bench_crossover.py [--min-bytes 8 --max-bytes 64M
--factor 2 --out benchmarks/results]`` for each N of interest (2 and 4 here).

Per message size S (``--min-bytes``, every power of ``--factor`` between, ``--max-bytes``),
all variants interleaved in one job so that drift in the machine's state hits them alike:

* float32 SUM (dtypes MPI reduces itself): ``mpidist.all_reduce(x, algorithm=A)`` for
  A = ``"mpi"``, ``"ring"``, ``"shm"``, and ``None`` (``auto``: the choice all_reduce makes
  by default, with the thresholds then in mpidist._backends.mpi.collectives);
* float16 SUM (dtypes MPI cannot reduce, which go through the ring unless shared memory
  is chosen): ``"ring"``, ``"shm"`` and ``None``.

One measurement = barrier, ``iters`` back-to-back calls, the MAX over ranks of each rank's
mean time per call (``_bench_common.timed``); ``iters`` calibrated so that it lasts
``--target-ms``; the reported time is the median of ``--reps`` measurements taken round-robin
over the variants. Crossovers and the tables use the fastest of them (``time_min_us``):
on a shared machine interference only ever adds time, so the minimum is the steadier
estimate of what each algorithm costs (the CSV keeps the median as well). Before timing, every
variant reduces rank-dependent small integers and must get them exactly (``#wrong`` = 0).

Crossover: the range of sizes ``[lo, hi)`` where shm is faster than the alternative, as the
run of consecutive measured sizes with the most wins minus losses (so one noisy point moves
nothing; ``hi`` open when it reaches the largest size). Those are the numbers
``SHM_OVER_MPI`` / ``SHM_OVER_RING`` in mpidist/_backends/mpi/collectives.py quote.

Output (rank 0): ``allreduce_crossover.csv`` in ``--out`` keeps the rows of every rank
count measured (this run replaces those of N), and ``allreduce_crossover.md`` is rebuilt
from it; the crossovers are printed last.
"""

from __future__ import annotations

from _bench_common import (  # noqa: I001  (first: it pins the BLAS thread pools before numpy)
    # isort: split
    aligned_empty,
    calibrate,
    human_bytes,
    machine_lines,
    parse_bytes,
    sweep,
    thread_limit,
    timed,
    versions,
    warm_up,
)

import argparse
import csv
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Callable, Optional

import numpy as np
from mpi4py import MPI

import mpidist
from mpidist._backends.mpi import collectives

# (name, dtype, algorithm)
VARIANTS = [
    ("mpi", np.float32, "mpi"),
    ("ring", np.float32, "ring"),
    ("shm", np.float32, "shm"),
    ("auto", np.float32, None),
    ("ring16", np.float16, "ring"),
    ("shm16", np.float16, "shm"),
    ("auto16", np.float16, None),
]
FIELDS = [
    "ranks",
    "cores",
    "date",
    "load_at_start",
    "variant",
    "dtype",
    "size_bytes",
    "time_us",
    "time_min_us",
    "time_max_us",
    "iters",
    "wrong",
]


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--min-bytes", type=parse_bytes, default=8)
    p.add_argument("--max-bytes", type=parse_bytes, default=parse_bytes("64M"))
    p.add_argument("--factor", type=int, default=2)
    p.add_argument("--reps", type=int, default=5, help="measurements per variant and size (median)")
    p.add_argument("--target-ms", type=float, default=30.0, help="length of one measurement")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    return p.parse_args(argv)


def count_wrong(comm: MPI.Comm, call: Callable[[np.ndarray], object], count: int, dtype: type) -> int:
    """Reduce small rank-dependent integers (exact in float16 for up to 4 ranks); wrong elements."""
    n, rank = comm.Get_size(), comm.Get_rank()
    pattern = np.arange(count) % 7 + 1
    buf = (pattern * (rank + 1)).astype(dtype)
    call(buf)
    return comm.allreduce(int(np.count_nonzero(buf != (pattern * (n * (n + 1) // 2)).astype(dtype))), op=MPI.SUM)


def bench_size(comm: MPI.Comm, nbytes: int, args: argparse.Namespace, stamp: dict) -> list[dict]:
    calls, wrong, iters = {}, {}, {}
    for name, dtype, algorithm in VARIANTS:
        count = max(1, nbytes // np.dtype(dtype).itemsize)
        call = partial(mpidist.all_reduce, algorithm=algorithm)
        wrong[name] = count_wrong(comm, call, count, dtype)
        buf = aligned_empty(count, dtype)
        buf[:] = 0  # repeated sums of zeros stay finite
        calls[name] = partial(call, buf)
        first = warm_up(comm, calls[name], args.warmup, 0.5)
        iters[name] = calibrate(comm, calls[name], args.target_ms / 1e3, guess_s=first)
    samples: dict = {name: [] for name in calls}
    for _ in range(args.reps):
        for name in calls:
            samples[name].append(timed(comm, calls[name], iters[name]))
    n, cores = comm.Get_size(), os.cpu_count() or 1
    return [
        {
            "ranks": n,
            "cores": cores,
            **stamp,
            "variant": name,
            "dtype": np.dtype(dtype).name,
            "size_bytes": nbytes,
            "time_us": statistics.median(samples[name]) * 1e6,
            "time_min_us": min(samples[name]) * 1e6,
            "time_max_us": max(samples[name]) * 1e6,
            "iters": iters[name],
            "wrong": wrong[name],
        }
        for name, dtype, _ in VARIANTS
    ]


# ---------------------------------------------------------------- reporting


def crossover(times: dict, shm: str, other: str) -> Optional[tuple[int, Optional[int]]]:
    """The size range ``[lo, hi)`` where ``shm`` beats ``other``: of all runs of consecutive
    measured sizes, the one with the most wins minus losses (so one noisy point moves
    nothing); ``hi`` is None when it reaches the largest size. None if shm never wins."""
    sizes = sorted(times)
    wins = [1 if times[s][shm] < times[s][other] else -1 for s in sizes]
    best, found = 0, None
    for i in range(len(sizes)):
        for j in range(i, len(sizes)):
            score = sum(wins[i : j + 1])
            if score > best:
                best, found = score, (sizes[i], sizes[j + 1] if j + 1 < len(sizes) else None)
    return found


def range_text(found: Optional[tuple[int, Optional[int]]]) -> str:
    if found is None:
        return "never"
    lo, hi = found
    return f"{human_bytes(lo)} up" if hi is None else f"{human_bytes(lo)} up to (not incl.) {human_bytes(hi)}"


def by_size(rows: list[dict], n: int) -> dict:
    times: dict = {}
    for r in rows:
        if int(r["ranks"]) == n:
            times.setdefault(int(r["size_bytes"]), {})[r["variant"]] = float(r["time_min_us"])
    return times


def section(rows: list[dict], n: int) -> list[str]:
    times = by_size(rows, n)
    cores = int(next(r["cores"] for r in rows if int(r["ranks"]) == n))
    wrong = sum(int(r["wrong"]) for r in rows if int(r["ranks"]) == n)
    x_mpi, x_ring = crossover(times, "shm", "mpi"), crossover(times, "shm16", "ring16")
    first = next(r for r in rows if int(r["ranks"]) == n)
    lines = [
        f"## {n} ranks on {cores} cores" + (" (oversubscribed)" if n > cores else ""),
        "",
        f"- measured {first['date']}, 1-min load average {first['load_at_start']} at start",
        f"- shm faster than MPI (float32): **{range_text(x_mpi)}**; shm faster than the ring (float16): "
        f"**{range_text(x_ring)}**",
        f"- wrong elements over all variants and sizes: {wrong}",
        "",
        "| size | mpi (us) | ring (us) | shm (us) | fastest | auto (us) | auto/fastest | ring16 (us) | "
        "shm16 (us) | fastest16 | auto16 (us) | auto16/fastest16 |",
        "|---:|---:|---:|---:|---|---:|---:|---:|---:|---|---:|---:|",
    ]
    for size in sorted(times):
        t = times[size]
        best = min(("mpi", "ring", "shm"), key=t.__getitem__)
        best16 = min(("ring16", "shm16"), key=t.__getitem__)
        lines.append(
            f"| {human_bytes(size)} | {t['mpi']:.2f} | {t['ring']:.2f} | {t['shm']:.2f} | {best} | "
            f"{t['auto']:.2f} | {t['auto'] / t[best]:.2f} | {t['ring16']:.2f} | {t['shm16']:.2f} | "
            f"{best16.removesuffix('16')} | {t['auto16']:.2f} | {t['auto16'] / t[best16]:.2f} |"
        )
    return lines


def write(out: Path, new_rows: list[dict], n: int, header: list[str]) -> tuple[Path, Path]:
    """Merge this run's rows into the CSV (replacing those of ``n`` ranks) and rebuild the report."""
    out.mkdir(parents=True, exist_ok=True)
    path_csv, path_md = out / "allreduce_crossover.csv", out / "allreduce_crossover.md"
    rows = []
    if path_csv.exists():
        with path_csv.open() as f:
            rows = [r for r in csv.DictReader(f) if int(r["ranks"]) != n]
    rows += new_rows
    rows.sort(key=lambda r: (int(r["ranks"]), int(r["size_bytes"]), [v[0] for v in VARIANTS].index(r["variant"])))
    with path_csv.open("w", newline="") as f:
        w = csv.DictWriter(f, FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{r[k]:.6g}" if isinstance(r[k], float) else r[k]) for k in FIELDS})
    doc = [
        "# all_reduce crossover: MPI_Allreduce vs the ring vs shared memory",
        "",
        "Made by `benchmarks/bench_crossover.py` (its docstring: method); the thresholds of "
        "all_reduce's automatic choice (`SHM_OVER_MPI`, `SHM_OVER_RING` in mpidist/_backends/mpi/collectives.py) "
        "quote this file. Times are per call, the fastest of the measurements (see the script's docstring); `auto` is "
        "`algorithm=None` with the thresholds in effect when it ran; `auto/fastest` near 1 means "
        "the choice was right.",
        "",
    ]
    doc += header
    for m in sorted({int(r["ranks"]) for r in rows}):
        doc += [""] + section(rows, m)
    path_md.write_text("\n".join(doc) + "\n")
    return path_csv, path_md


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    load = os.getloadavg()[0]
    mpidist.init_process_group("mpi")
    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    t0 = time.perf_counter()
    stamp = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "load_at_start": f"{load:.2f}"}
    rows = []
    with thread_limit():
        for nbytes in sweep(args.min_bytes, args.max_bytes, args.factor):
            rows += bench_size(comm, nbytes, args, stamp)
            if rank == 0:
                print(f"# {human_bytes(nbytes):>8}: done at {time.perf_counter() - t0:6.1f} s", flush=True)
    mpidist.destroy_process_group()
    if rank != 0:
        return 0
    header = (
        [f"Last run ({n} ranks):", ""]
        + machine_lines(n, load)
        + [
            f"- {versions(mpidist=mpidist.__version__)}; thresholds in effect: SHM_OVER_MPI = "
            f"{collectives.SHM_OVER_MPI}, SHM_OVER_RING = {collectives.SHM_OVER_RING}, "
            f"MPIDIST_SHM_MIN_BYTES = {os.environ.get('MPIDIST_SHM_MIN_BYTES', 'unset')}",
            f"- fastest of {args.reps} measurements of ~{args.target_ms:g} ms each, variants interleaved",
        ]
    )
    for path in write(args.out, rows, n, header):
        print(f"# wrote {path}")
    times = by_size(rows, n)
    print(
        f"crossover {n} ranks: shm beats mpi {range_text(crossover(times, 'shm', 'mpi'))}; "
        f"shm16 beats ring16 {range_text(crossover(times, 'shm16', 'ring16'))}"
    )
    return 0 if all(r["wrong"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
