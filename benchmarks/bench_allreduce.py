"""all_reduce sweep in nccl-tests' layout: raw mpi4py vs mpidist, float32 SUM.

Run as ``mpiexec -n N python benchmarks/bench_allreduce.py [--min-bytes 8 --max-bytes 64M
--factor 4 --iters auto --warmup 5 --out benchmarks/results]``.

What is measured, per message size S (``--min-bytes``, every power of ``--factor``
above it, and ``--max-bytes``: 8, 16, 64, 256, ... 64M by default), all in the same job
and interleaved so that drift in the machine's state hits every variant alike:

* ``raw``     mpi4py ``comm.Allreduce(MPI.IN_PLACE, buf, MPI.SUM)`` on a Dup of
              COMM_WORLD: the ceiling for any wrapper of MPI;
* ``mpidist`` ``mpidist.all_reduce(x)``: the default, automatic choice (argument checks +
              MPI_Allreduce below the measured crossover, shared memory above it on one
              node: docs/architecture.md, "Choosing the all-reduce algorithm");
* ``ring``    ``mpidist.all_reduce(x, algorithm="ring")``, mpidist's own ring;
* ``async``   ``mpidist.all_reduce(x, async_op=True).wait()`` (engine-thread hop);
* ``copy``    ``np.copyto`` of S bytes on rank 0 alone while the other ranks sleep:
              the memory-bandwidth reference.

How: ``--warmup`` untimed calls; then, unless ``--iters N``, the number of calls is
calibrated so that one measurement takes 50-100 ms (13-27 ms with ``--quick``),
and never fewer than 3 calls.
One measurement = barrier, ``iters`` back-to-back calls, time per call = the
MAX over ranks of each rank's mean (MPI_Allreduce MAX of the elapsed time). The
reported time is the median of 5 measurements (3 with ``--quick``), taken
round-robin over the variants. Timed buffers hold zeros so that the repeated sums
stay finite.

Correctness: before timing, each variant reduces a buffer holding
``(rank + 1) * (i % 251 + 1)`` at element i, whose sum over ranks is an exact small
integer in float32; ``#wrong`` is the number of wrong elements over all ranks and
must be 0 (the script exits 1 otherwise, after writing its results).

Bandwidths, as nccl-tests' doc/PERFORMANCE.md: algbw = S / t and, for all_reduce,
busbw = algbw * 2 (n - 1) / n. all_reduce is in place in torch's API, so only the
in-place columns of nccl-tests' table are reported. The copy's bandwidth is S / t
(bytes copied per second; its memory traffic is 2 S).

Output (rank 0): the tables on stdout, then ``allreduce_np{N}.md`` / ``.csv`` /
``.png`` in ``--out`` (the CSV also gives each median's fastest and slowest measurement);
the last lines printed are the headline ratios.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # before numpy is imported: no BLAS thread pools

import argparse  # noqa: E402
import csv  # noqa: E402
import datetime  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from functools import partial  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Optional  # noqa: E402

import mpi4py  # noqa: E402
import numpy as np  # noqa: E402
from _bench_common import (  # noqa: E402
    MIN_ITERS,
    Case,
    Result,
    algbw,
    aligned_zeros,
    cpu_model,
    human_bytes,
    parse_bytes,
    ratio,
    sweep,
    thread_limit,
)
from mpi4py import MPI  # noqa: E402

import mpidist  # noqa: E402

# isort: split
from _bench_common import bench_size as _bench_size  # noqa: E402

DTYPE = np.float32
LABELS = {
    "raw": "raw mpi4py Allreduce",
    "mpidist": "mpidist.all_reduce (automatic choice)",
    "ring": 'mpidist.all_reduce(algorithm="ring")',
    "async": "mpidist.all_reduce(async_op=True).wait()",
    "copy": "np.copyto, rank 0 alone",
}
COLLECTIVES = ("raw", "mpidist", "ring", "async")


# ---------------------------------------------------------------- configuration


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--min-bytes", type=parse_bytes, default=8)
    p.add_argument("--max-bytes", type=parse_bytes, default=parse_bytes("64M"))
    p.add_argument("--factor", type=int, default=4, help="sizes are the powers of FACTOR in range")
    p.add_argument("--iters", default="auto", help="calls per measurement, or 'auto' (50-100 ms each)")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls per variant and size")
    p.add_argument("--quick", action="store_true", help="3 measurements of ~20 ms instead of 5 of ~75 ms")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args(argv)
    if args.factor < 2 or args.min_bytes < 1 or args.max_bytes < args.min_bytes:
        p.error("need --factor >= 2 and 1 <= --min-bytes <= --max-bytes")
    if args.iters != "auto" and (not args.iters.isdigit() or int(args.iters) < 1):
        p.error("--iters must be a positive integer or 'auto'")
    args.iters = None if args.iters == "auto" else int(args.iters)
    args.reps, args.target_s = (3, 0.020) if args.quick else (5, 0.075)
    return args


def make_cases(comm: MPI.Comm, rank: int) -> list[Case]:
    """The five variants; ``raw`` gets its own Dup of ``comm``."""
    raw = comm.Dup()
    dst = np.empty(0, DTYPE)  # the copy's destination, reallocated when the size changes

    def copy(buf: np.ndarray) -> None:
        nonlocal dst
        if dst.size != buf.size:
            dst = aligned_zeros(buf.size, DTYPE)
        np.copyto(dst, buf)

    return [
        Case("raw", lambda x: raw.Allreduce(MPI.IN_PLACE, x, MPI.SUM)),
        Case("mpidist", mpidist.all_reduce),
        Case("ring", partial(mpidist.all_reduce, algorithm="ring")),
        Case("async", lambda x: mpidist.all_reduce(x, async_op=True).wait()),
        Case("copy", copy, active=rank == 0),
    ]


# ---------------------------------------------------------------- reporting


def busbw(r: Result, n: int) -> float:
    """nccl-tests' bus bandwidth for all_reduce; the copy's plain bandwidth S / t."""
    return algbw(r) * (2 * (n - 1) / n if r.name in COLLECTIVES else 1.0)


def header(n: int, args: argparse.Namespace) -> list[str]:
    cores = os.cpu_count()
    lines = [
        f"# all_reduce benchmark, {n} ranks, float32 SUM",
        "",
        f"- date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
        f"- machine: {platform.platform()}, {cpu_model()}, os.cpu_count() = {cores}, "
        f"1-min load average at start {args.load_at_start:.2f}",
        f"- MPI: {MPI.Get_library_version().splitlines()[0].strip()} "
        f"(thread level {MPI.Query_thread()}, MPI_THREAD_MULTIPLE = {MPI.THREAD_MULTIPLE})",
        f"- python {platform.python_version()}, numpy {np.__version__}, mpi4py {mpi4py.__version__}, "
        f"mpidist {mpidist.__version__}",
        f"- timing: median of {args.reps} measurements of "
        + (
            f"{args.iters} calls"
            if args.iters
            else f"{args.target_s * 2e3 / 3:.0f}-{args.target_s * 4e3 / 3:.0f} ms (>= {MIN_ITERS} calls)"
        )
        + f", each the max over ranks of the mean time per call; {args.warmup} warm-up calls",
        "- algbw = S / t, busbw = algbw * 2(n-1)/n (nccl-tests doc/PERFORMANCE.md). all_reduce is "
        "in place in torch's API: only nccl-tests' in-place columns are reported.",
    ]
    if cores and n > cores:
        lines.append(f"- **oversubscribed**: {n} ranks on {cores} cores; timings are noisy")
    return lines


def nccl_table(rows: list[Result], n: int) -> list[str]:
    """One variant in nccl-tests' layout (in-place columns only)."""
    lines = [
        "| size(B) | count | type | redop | root | time(us) | algbw(GB/s) | busbw(GB/s) | #wrong |",
        "|---:|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.nbytes} | {r.nbytes // np.dtype(DTYPE).itemsize} | float | sum | -1 | "
            f"{r.time_s * 1e6:.2f} | {algbw(r):.2f} | {busbw(r, n):.2f} | {r.wrong} |"
        )
    return lines


def ratio_table(results: list[dict[str, Result]], n: int) -> list[str]:
    cols = ["size(B)", "copy time(us)", "copy bw(GB/s)", "mpidist/raw time", "async/raw time", "ring/raw busbw"] + [
        f"{name} busbw/copy bw" for name in COLLECTIVES
    ]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---:|" * len(cols)]
    for res in results:
        raw, copy = res["raw"], res["copy"]
        vals = [
            f"{raw.nbytes}",
            f"{copy.time_s * 1e6:.2f}",
            f"{algbw(copy):.2f}",
            f"{ratio(res['mpidist'].time_s, raw.time_s):.3f}",
            f"{ratio(res['async'].time_s, raw.time_s):.3f}",
            f"{ratio(busbw(res['ring'], n), busbw(raw, n)):.3f}",
        ]
        vals += [f"{ratio(busbw(res[name], n), algbw(copy)):.3f}" for name in COLLECTIVES]
        lines.append("| " + " | ".join(vals) + " |")
    return lines


def report(results: list[dict[str, Result]], n: int, args: argparse.Namespace) -> list[str]:
    lines = header(n, args)
    for name in COLLECTIVES:
        lines += ["", f"## {name}: `{LABELS[name]}`", ""] + nccl_table([res[name] for res in results], n)
    lines += ["", f"## ratios, and the memory-bandwidth reference (`{LABELS['copy']}`, bw = S / t)", ""]
    lines += ratio_table(results, n)
    wrong = sum(res[name].wrong for res in results for name in COLLECTIVES)
    lines += ["", f"Out of bounds values: {wrong} {'OK' if wrong == 0 else 'FAILED'}"]
    return lines


def headlines(results: list[dict[str, Result]], n: int) -> list[str]:
    """The figures bench-quick ends with: wrapper overhead small and at 1 MiB, ring at the top."""
    by_size = {res["raw"].nbytes: res for res in results}
    lines = []
    for size in dict.fromkeys((min(by_size), 1 << 20)):
        if size in by_size:
            raw, md = by_size[size]["raw"], by_size[size]["mpidist"]
            lines.append(
                f"headline: {human_bytes(size)} mpidist/raw time = {ratio(md.time_s, raw.time_s):.3f} "
                f"({md.time_s * 1e6:.2f} us vs {raw.time_s * 1e6:.2f} us)"
            )
    top = by_size[max(by_size)]
    ring, raw = busbw(top["ring"], n), busbw(top["raw"], n)
    lines.append(
        f"headline: {human_bytes(max(by_size))} ring/raw busbw = {ratio(ring, raw):.3f} "
        f"({ring:.2f} GB/s vs {raw:.2f} GB/s)"
    )
    return lines


def write_csv(path: Path, results: list[dict[str, Result]], n: int) -> None:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(
            [
                "ranks",
                "impl",
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
            ]
        )
        for res in results:
            for r in res.values():
                w.writerow(
                    [
                        n,
                        r.name,
                        r.nbytes,
                        r.nbytes // np.dtype(DTYPE).itemsize,
                        "float",
                        "sum" if r.name in COLLECTIVES else "copy",
                        -1,
                        f"{r.time_s * 1e6:.6g}",
                        f"{algbw(r):.6g}",
                        f"{busbw(r, n):.6g}",
                        r.wrong,
                        r.iters,
                        f"{min(r.samples) * 1e6:.6g}",
                        f"{max(r.samples) * 1e6:.6g}",
                    ]
                )


def plot(path: Path, results: list[dict[str, Result]], n: int) -> None:
    import matplotlib  # noqa: PLC0415  (rank 0 only, after timing)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    from matplotlib.ticker import FuncFormatter  # noqa: PLC0415

    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(12, 4.8))
    sizes = [res["raw"].nbytes for res in results]
    for name in (*COLLECTIVES, "copy"):
        style = {"linestyle": "--", "color": "grey"} if name == "copy" else {}
        ax_t.plot(sizes, [res[name].time_s * 1e6 for res in results], marker="o", label=name, **style)
        ax_b.plot(sizes, [busbw(res[name], n) for res in results], marker="o", label=name, **style)
    ax_t.set(ylabel="time per call (us)", title="latency")
    ax_b.set(ylabel="busbw (GB/s); copy: S / t", title="bus bandwidth")
    for ax in (ax_t, ax_b):
        ax.set_xscale("log", base=2)
        ax.set(yscale="log", xlabel="message size")
        ax.set_xticks(sizes)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: human_bytes(int(x)).replace(" ", "")))
        ax.tick_params(axis="x", labelrotation=45)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"all_reduce float32 sum, {n} ranks, {cpu_model()}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def save(results: list[dict[str, Result]], n: int, args: argparse.Namespace, lines: list[str]) -> list[Path]:
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"allreduce_np{n}"
    paths = [stem.with_suffix(ext) for ext in (".md", ".csv", ".png")]
    paths[0].write_text("\n".join(lines) + "\n")
    write_csv(paths[1], results, n)
    plot(paths[2], results, n)
    return paths


# ---------------------------------------------------------------- main


def run_sweep(comm: MPI.Comm, rank: int, args: argparse.Namespace) -> list[dict[str, Result]]:
    cases = make_cases(comm, rank)
    t0 = time.perf_counter()
    results = []
    for nbytes in sweep(args.min_bytes, args.max_bytes, args.factor, np.dtype(DTYPE).itemsize):
        results.append(_bench_size(comm, cases, nbytes, args, COLLECTIVES, DTYPE))
        if rank == 0:
            print(f"# {human_bytes(nbytes):>8}: done at {time.perf_counter() - t0:6.1f} s", flush=True)
    return results


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    args.load_at_start = os.getloadavg()[0]  # other jobs on the machine make timings noisy
    mpidist.init_process_group("mpi")
    rank, n = mpidist.get_rank(), mpidist.get_world_size()
    with thread_limit():
        results = run_sweep(MPI.COMM_WORLD, rank, args)
    mpidist.destroy_process_group()
    if rank != 0:
        return 0
    lines = report(results, n, args)
    print("\n".join(lines))
    for path in save(results, n, args, lines):
        print(f"# wrote {path}")
    print("\n".join(headlines(results, n)), flush=True)
    return 0 if all(r.wrong == 0 for res in results for r in res.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
