"""Shared-memory all-reduce vs MPI and the ring, against the memory-bandwidth reference.

Run as ``mpiexec -n N python benchmarks/bench_shm.py [--min-bytes 4K --max-bytes 64M
--factor 4 --quick --out benchmarks/results]``.

Variants, float32 SUM, every size S in the same job, measurements interleaved:

* ``raw``      mpi4py ``comm.Allreduce(MPI.IN_PLACE, buf, MPI.SUM)`` on a Dup of COMM_WORLD;
* ``shm``      :class:`mpidist.algorithms.ShmAllReduce` (MPI-3 shared-memory window);
* ``ring``     :func:`mpidist.algorithms.ring_all_reduce` on a Dup;
* ``copy``     ``np.copyto`` of S bytes by rank 0 alone, the other ranks asleep: the
               single-core copy bandwidth the targets are stated against;
* ``copy-all`` every rank copies its own S bytes at the same time: what the node's
               memory system gives all ranks at once. An all-reduce reads its input and
               writes its output on every rank, so its time is at least this copy's.
* ``work``     every rank at once does the copies and folds that ``shm`` does on it, chunk
               by chunk, in private memory, with no peer and no barrier (2 ranks: copy the
               chunk, fold it with the copy; more: copy n-1 slices, fold one slice over n,
               copy n slices back): the time the algorithm's own data movement takes, so
               ``shm``'s time over it is what synchronization and the cores' cache traffic
               cost, and ``work``'s bandwidth is what no tuning of that part can beat.

Timing, validation (``#wrong``: wrong elements over all ranks, must be 0) and the
nccl-tests bandwidths (algbw = S / t, busbw = algbw * 2(n-1)/n) are those of
``bench_allreduce.py`` (both use the helpers in ``_bench_common.py``). Ratios: ``busbw / copy bw``
per collective, ``shm/raw`` = raw's time / shm's time (> 1: shm is faster).

Output (rank 0): tables on stdout, ``shm_np{N}.md`` / ``.csv`` in ``--out``; the last
lines are the crossovers (the smallest size from which on shm beats MPI, resp. the
ring, at every larger measured size), e.g. ``crossover shm>mpi at >= 4 KiB``, then
the headline ratios at 16 and 64 MiB.
"""

from __future__ import annotations

import _bench_common as bc  # noqa: I001  (first: sets the thread variables before numpy)

# isort: split

import argparse  # noqa: E402
import csv  # noqa: E402
import datetime  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from functools import partial  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Optional  # noqa: E402

import mpi4py  # noqa: E402
import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import mpidist  # noqa: E402
from mpidist._arrays.reduce_op import ReduceOp  # noqa: E402
from mpidist.algorithms import ShmAllReduce, ring_all_reduce  # noqa: E402
from mpidist.algorithms.shm import DEFAULT_SLOT_BYTES  # noqa: E402

COLLECTIVES = ("raw", "shm", "ring")
LABELS = {
    "raw": "raw mpi4py Allreduce",
    "shm": "ShmAllReduce (mpidist.algorithms.shm)",
    "ring": "mpidist.algorithms.ring_all_reduce",
    "copy": "np.copyto, rank 0 alone",
    "copy-all": "np.copyto, every rank at once",
    "work": "shm's copies and folds in private memory, every rank at once, no peer",
}
COPIES = ("copy", "copy-all", "work")  # the references: bandwidth S / t, not validated


def parse_args(argv: Optional[list] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--min-bytes", type=bc.parse_bytes, default=bc.parse_bytes("4K"))
    p.add_argument("--max-bytes", type=bc.parse_bytes, default=bc.parse_bytes("64M"))
    p.add_argument("--factor", type=int, default=4)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="3 measurements of ~20 ms instead of 5 of ~75 ms")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args(argv)
    if args.factor < 2 or args.min_bytes < 4 or args.max_bytes < args.min_bytes:
        p.error("need --factor >= 2 and 4 <= --min-bytes <= --max-bytes")
    args.iters = None  # _bench_common.calibrate's choice
    args.reps, args.target_s = (3, 0.020) if args.quick else (5, 0.075)
    return args


def make_cases(comm: MPI.Comm, rank: int) -> tuple:
    """The variants (_bench_common.Case) and the objects to free afterwards."""
    raw, ring_comm = comm.Dup(), comm.Dup()
    shm = ShmAllReduce(comm)
    dst = np.empty(0, np.float32)

    def copy(buf: np.ndarray) -> None:
        nonlocal dst
        if dst.size != buf.size:
            dst = bc.aligned_zeros(buf.size, np.float32)
        np.copyto(dst, buf)

    cases = [
        bc.Case("raw", lambda x: raw.Allreduce(MPI.IN_PLACE, x, MPI.SUM)),
        bc.Case("shm", partial(shm, op=ReduceOp.SUM)),
        bc.Case("ring", partial(ring_all_reduce, ring_comm, op=ReduceOp.SUM)),
        bc.Case("copy", copy, active=rank == 0),
        bc.Case("copy-all", copy),
        bc.Case("work", partial(own_work, shm.size, shm.rank, shm.part_bytes // 4)),
    ]
    return cases, (shm, raw, ring_comm)


def own_work(n: int, r: int, q: int, buf: np.ndarray) -> None:
    """The copies and folds ShmAllReduce makes rank ``r`` of ``n`` do on float32 ``buf``
    (SUM), chunk by chunk (``q`` elements a region of its window), on a private scratch
    window, with no peer and no barrier. ``buf`` is zeros, so it stays zeros."""
    regions = 2 if n == 2 else n
    scratch = _SCRATCH.get((regions, q))
    if scratch is None:
        scratch = _SCRATCH[(regions, q)] = bc.aligned_zeros(regions * q, np.float32).reshape(regions, q)
    if n == 2:  # copy the chunk into the half-slot, fold it with the peer's copy (here: its own)
        for k, start in enumerate(range(0, buf.size, q)):
            chunk, part = buf[start : start + q], scratch[k & 1]
            np.copyto(part[: chunk.size], chunk)
            np.add(chunk, part[: chunk.size], out=chunk)
        return
    for start in range(0, buf.size, n * q):  # slice j of each chunk is region j's
        chunk = buf[start : start + n * q]
        part = -(-chunk.size // n)
        cut = [(min(j * part, chunk.size), min((j + 1) * part, chunk.size)) for j in range(n)]
        for j, (a, b) in enumerate(cut):
            if j != r:
                np.copyto(scratch[j, : b - a], chunk[a:b])
        a, b = cut[r]
        out, peers = scratch[r, : b - a], [scratch[k, : b - a] for k in range(n) if k != r]
        np.add(chunk[a:b], peers[0], out=out)
        for x in peers[1:]:
            np.add(out, x, out=out)
        for j, (a, b) in enumerate(cut):
            np.copyto(chunk[a:b], scratch[j, : b - a])


_SCRATCH: dict[tuple[int, int], np.ndarray] = {}


# ---------------------------------------------------------------- reporting


def busbw(r: bc.Result, n: int) -> float:
    """nccl-tests' busbw for the collectives; plain S / t for the copies."""
    return bc.algbw(r) * (2 * (n - 1) / n if r.name in COLLECTIVES else 1.0)


def crossover(results: list, a: str, b: str) -> Optional[int]:
    """Smallest measured size from which on ``a`` is faster than ``b`` at every size."""
    found = None
    for res in reversed(results):
        if res[a].time_s >= res[b].time_s:
            break
        found = res[a].nbytes
    return found


def crossover_text(results: list, a: str, b: str, label: str) -> str:
    size = crossover(results, a, b)
    if size is None:
        return f"crossover {label} at >= none (never faster at {bc.human_bytes(results[-1]['raw'].nbytes)})"
    suffix = " (the smallest size measured)" if size == results[0]["raw"].nbytes else ""
    return f"crossover {label} at >= {bc.human_bytes(size)}{suffix}"


def nccl_table(rows: list, n: int) -> list:
    lines = [
        "| size(B) | count | type | redop | time(us) | algbw(GB/s) | busbw(GB/s) | #wrong |",
        "|---:|---:|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        collective = r.name in COLLECTIVES
        lines.append(
            f"| {r.nbytes} | {r.nbytes // 4} | float | {'sum' if collective else 'copy'} | "
            f"{r.time_s * 1e6:.2f} | {bc.algbw(r):.2f} | {busbw(r, n):.2f} | "
            f"{r.wrong if collective else '-'} |"
        )
    return lines


def ratio_table(results: list, n: int) -> list:
    cols = (
        ["size", "copy bw(GB/s)", "copy-all bw(GB/s)", "work bw(GB/s)", "shm/raw", "shm/ring", "shm/work"]
        + [f"{c} busbw/copy bw" for c in COLLECTIVES]
        + ["shm busbw/copy-all bw"]
    )
    lines = ["| " + " | ".join(cols) + " |", "|---" + "|---:" * (len(cols) - 1) + "|"]
    for res in results:
        copy, copy_all, shm = bc.algbw(res["copy"]), bc.algbw(res["copy-all"]), busbw(res["shm"], n)
        vals = [
            bc.human_bytes(res["raw"].nbytes),
            f"{copy:.2f}",
            f"{copy_all:.2f}",
            f"{bc.algbw(res['work']):.2f}",
            f"{bc.ratio(res['raw'].time_s, res['shm'].time_s):.2f}",
            f"{bc.ratio(res['ring'].time_s, res['shm'].time_s):.2f}",
            f"{bc.ratio(res['work'].time_s, res['shm'].time_s):.2f}",
        ]
        vals += [f"{bc.ratio(busbw(res[c], n), copy):.3f}" for c in COLLECTIVES] + [f"{bc.ratio(shm, copy_all):.3f}"]
        lines.append("| " + " | ".join(vals) + " |")
    return lines


def headlines(results: list, n: int) -> list:
    lines = [crossover_text(results, "shm", "raw", "shm>mpi"), crossover_text(results, "shm", "ring", "shm>ring")]
    by_size = {res["raw"].nbytes: res for res in results}
    for size in (16 << 20, 64 << 20):
        if size in by_size:
            res = by_size[size]
            shm, copy = busbw(res["shm"], n), bc.algbw(res["copy"])
            lines.append(
                f"headline: {bc.human_bytes(size)} shm busbw/copy bw = {bc.ratio(shm, copy):.3f} "
                f"({shm:.2f} vs {copy:.2f} GB/s; target >= 1.0, issue 44), "
                f"raw {bc.ratio(busbw(res['raw'], n), copy):.3f}, "
                f"shm/copy-all {bc.ratio(shm, bc.algbw(res['copy-all'])):.3f}, "
                f"shm/work {bc.ratio(res['work'].time_s, res['shm'].time_s):.3f} "
                f"(work alone: {bc.ratio(busbw(res['work'], n), copy):.3f} of the copy)"
            )
    return lines


def header(n: int, args: argparse.Namespace) -> list:
    cores = os.cpu_count()
    lines = [
        f"# Shared-memory all-reduce benchmark, {n} ranks, float32 SUM",
        "",
        f"- date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
        f"- machine: {platform.platform()}, {bc.cpu_model()}, os.cpu_count() = {cores}, "
        f"1-min load average at start {args.load_at_start:.2f}",
        f"- MPI: {MPI.Get_library_version().splitlines()[0].strip()}; python {platform.python_version()}, "
        f"numpy {np.__version__}, mpi4py {mpi4py.__version__}, mpidist {mpidist.__version__}; "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}",
        f"- shm: window of {bc.human_bytes(DEFAULT_SLOT_BYTES)} per rank (DEFAULT_SLOT_BYTES); "
        + (
            "2 ranks: pairwise (each rank folds whole chunks of half a slot, one barrier per chunk)"
            if n == 2
            else "reduce-scatter + all-gather in shared memory (two barriers per chunk of one slot)"
        ),
        f"- timing: median of {args.reps} measurements of "
        f"{args.target_s * 2e3 / 3:.0f}-{args.target_s * 4e3 / 3:.0f} ms "
        f"(>= {bc.MIN_ITERS} calls), each the max over ranks of the mean time per call; {args.warmup} warm-up calls; "
        f"variants interleaved",
        "- algbw = S / t, busbw = algbw * 2(n-1)/n (nccl-tests doc/PERFORMANCE.md); copies: S / t. "
        "shm/raw and shm/ring: time ratios (> 1: shm faster)",
    ]
    if cores and n > cores:
        lines.append(
            f"- **oversubscribed**: {n} ranks on {cores} cores; timings are noisy and the "
            f"shm barrier yields the core at every check"
        )
    return lines


def analysis(results: list, n: int) -> list:
    """What limits shm at the large sizes, in this run's own numbers."""
    lines = ["", "## What limits it", ""]
    for res in results:
        if res["raw"].nbytes < 16 << 20:
            continue
        size = bc.human_bytes(res["raw"].nbytes)
        shm, copy, copy_all = busbw(res["shm"], n), bc.algbw(res["copy"]), bc.algbw(res["copy-all"])
        bound = bc.algbw(res["work"]) * 2 * (n - 1) / n  # shm's busbw if it took work's time
        shared = bc.ratio(copy_all, copy)
        lines.append(
            f"- {size}: shm busbw {shm:.2f} GB/s = {bc.ratio(shm, copy):.2f} x the single-core copy "
            f"({copy:.2f} GB/s alone) and {bc.ratio(shm, copy_all):.2f} x the copy bandwidth each rank "
            f"gets when all {n} ranks copy their own buffer at once ({copy_all:.2f} GB/s). Its own copies "
            f"and folds alone (`work`) would give {bound:.2f} GB/s = {bc.ratio(bound, copy):.2f} x the copy: "
            f"shm reaches {bc.ratio(shm, bound):.2f} of that; the rest is its synchronization and the "
            f"cache lines that move between the cores. "
            + (
                f"The ranks hardly compete for memory at this size (copy-all = {shared:.2f} x copy): "
                "each core's own work is the limit."
                if shared >= 0.9
                else f"The ranks share the memory bandwidth (copy-all = {shared:.2f} x copy)."
            )
        )
    chunk = bc.human_bytes(DEFAULT_SLOT_BYTES // 2 if n == 2 else DEFAULT_SLOT_BYTES)
    lines += [
        f"- Work per rank (chunks of {chunk}; the class docstring): with 2 ranks every rank copies the "
        "whole buffer into the window and folds the whole buffer (reads 2 S, writes S); with n > 2 it "
        "copies (n-1)/n S in, folds S/n over n inputs and copies S out. That is more than a copy's "
        "traffic on every rank, so the single-core copy is beyond reach where the copy runs at the "
        "speed of the chunks, i.e. where the buffers stay in the last-level cache (`work` well under "
        "`copy`); where the reference copy streams from DRAM while the chunks stay in cache, "
        "the work can beat it. The buffer itself is read and written once, the rest stays in "
        "cache-resident chunks.",
        "- Fixed costs, measured while developing (2 ranks, quiet machine): one flag barrier (Win_sync, a "
        "counter per rank in the window, Win_sync) costs about 0.8 us against 3.4 us for MPI_Barrier; each "
        "chunk costs two numpy calls and one barrier; a 4 KiB call costs about 5 us in all.",
        "- The machine is shared: other processes running during the sweep show as outliers (see "
        "time_min_us / time_max_us in the CSV); the 1-min load average at start is in the header.",
        "- Slow periods, seen in about half of the 2-rank sweeps while developing (the 64 MiB point most "
        "often, sometimes 16 MiB too; never reproducible on demand): shm at 64 MiB takes 30-35 ms instead of "
        "7 ms. Instrumented, 27-29 ms of it is the copy of each chunk INTO this rank's window slot (4.4 ms "
        "otherwise), the fold 3 ms (1.8), the barriers under 3 ms: writing cache lines that the other core "
        "has just read became about 6x slower. One core reading 1 MiB that the other had just written "
        "also dropped from about 43 to 17-24 GB/s in such a period. That is the cost of cache-coherence "
        "traffic between the two vCPUs, which depends on where the hypervisor runs them (cores that share "
        "no L3 would explain it; this VM cannot tell). MPI's own large-message path (its copies go through "
        "shared cells too) takes about 30 ms at 64 MiB in every run here. A run whose shm rows at 16/64 MiB "
        "are far below `copy-all` ran in such a period.",
    ]
    if os.cpu_count() and n > os.cpu_count():
        lines.append(
            f"- {n} ranks on {os.cpu_count()} cores: the ranks take turns on the cores, so every "
            f"synchronization waits for a descheduled rank (shm's barrier then yields the core at "
            f"once); these timings measure the scheduler more than the algorithms."
        )
    return lines


def report(results: list, n: int, args: argparse.Namespace) -> list:
    lines = header(n, args)
    for name in (*COLLECTIVES, *COPIES):
        lines += ["", f"## {name}: `{LABELS[name]}`", ""] + nccl_table([res[name] for res in results], n)
    lines += ["", "## Ratios", ""] + ratio_table(results, n)
    wrong = sum(res[c].wrong for res in results for c in COLLECTIVES)
    lines += ["", f"Out of bounds values: {wrong} {'OK' if wrong == 0 else 'FAILED'}"]
    lines += analysis(results, n)
    lines += ["", "## Headlines", ""] + [f"- {h}" for h in headlines(results, n)]
    return lines


def write_csv(path: Path, results: list, n: int) -> None:
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
                        r.nbytes // 4,
                        "float",
                        "sum" if r.name in COLLECTIVES else "copy",
                        f"{r.time_s * 1e6:.6g}",
                        f"{bc.algbw(r):.6g}",
                        f"{busbw(r, n):.6g}",
                        r.wrong,
                        r.iters,
                        f"{min(r.samples) * 1e6:.6g}",
                        f"{max(r.samples) * 1e6:.6g}",
                    ]
                )


def main(argv: Optional[list] = None) -> int:
    args = parse_args(argv)
    args.load_at_start = os.getloadavg()[0]
    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    sizes = bc.sweep(args.min_bytes, args.max_bytes, args.factor, 4)
    with bc.thread_limit():
        cases, owned = make_cases(comm, rank)
        t0, results = time.perf_counter(), []
        for nbytes in sizes:
            results.append(bc.bench_size(comm, cases, nbytes, args, COLLECTIVES))
            if rank == 0:
                print(f"# {bc.human_bytes(nbytes):>8}: done at {time.perf_counter() - t0:6.1f} s", flush=True)
        owned[0].free()
        for c in owned[1:]:
            c.Free()
    if rank != 0:
        return 0
    lines = report(results, n, args)
    print("\n".join(lines))
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"shm_np{n}"
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    write_csv(stem.with_suffix(".csv"), results, n)
    print(f"# wrote {stem}.md, {stem}.csv")
    print("\n".join(headlines(results, n)), flush=True)
    return 0 if all(res[c].wrong == 0 for res in results for c in COLLECTIVES) else 1


if __name__ == "__main__":
    sys.exit(main())
