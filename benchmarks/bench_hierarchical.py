"""Hierarchical all-reduce vs flat MPI on a job that spans nodes.

Run as ``mpiexec -n N python benchmarks/bench_hierarchical.py [--min-bytes 4K --max-bytes 64M
--factor 4 --link TEXT --quick --out benchmarks/results]``, on ranks spread over two or more
nodes; ``make bench-hosts`` runs it on the two "hosts" of tests/slurm/two_hosts.sh (network
namespaces joined by a veth pair, its link shaped with tc-netem like a cluster's).

Variants, float32 SUM, every size S in the same job, measurements interleaved:

* ``raw``          mpi4py ``comm.Allreduce(MPI.IN_PLACE, buf, MPI.SUM)`` on a Dup of COMM_WORLD:
                   the flat MPI all-reduce (whatever MPI does across nodes itself);
* ``mpi``          ``mpidist.all_reduce(buf, algorithm="mpi")``;
* ``ring``         ``mpidist.all_reduce(buf, algorithm="ring")``: the ring over every rank;
* ``hierarchical`` ``mpidist.all_reduce(buf, algorithm="hierarchical")``;
* ``auto``         ``mpidist.all_reduce(buf)``: the automatic choice;

and the hierarchical algorithm's levels alone, for the cost model (docs/performance.md):

* ``node``         each node's ranks all-reduce through their shared-memory window
                   (:class:`mpidist.algorithms.ShmAllReduce`), every node at once;
* ``leaders``      ``MPI_Allreduce`` among one rank per node, the others idle in a sleeping
                   barrier;
* ``bcast``        ``MPI_Bcast`` from each node's first rank to the others, every node at once.

Timing, validation (``#wrong``, must be 0) and the nccl-tests bandwidths (algbw = S / t,
busbw = algbw * 2(n-1)/n) are those of ``bench_shm.py`` (``_bench_common.py``). Ratio
``hier/raw busbw`` > 1: the hierarchical algorithm is faster than flat MPI.

Output (rank 0): the table on stdout and in ``--out``/``hierarchical_np{N}.md`` and ``.csv``;
the last lines are the targets' verdicts (issue 44: >= 1.5x flat MPI's busbw from 16 MiB, no
slower below) and the size from which the hierarchical algorithm beats MPI at every larger
measured size (the automatic choice's threshold,
``mpidist._backends.mpi.collectives.HIER_OVER_MPI``).
"""

from __future__ import annotations

import _bench_common as bc  # noqa: I001  (first: sets the thread variables before numpy)

# isort: split

import argparse  # noqa: E402
import csv  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import mpidist  # noqa: E402
from mpidist import ReduceOp  # noqa: E402
from mpidist._backends.mpi.collectives import HIER_OVER_MPI  # noqa: E402
from mpidist.algorithms import ShmAllReduce  # noqa: E402

VARIANTS = ("raw", "mpi", "ring", "hierarchical", "auto")
LEVELS = ("node", "leaders", "bcast")
#: Calls whose bytes on the network are counted, per variant and size.
COUNTED_CALLS = 3


def host_tx_bytes() -> int:
    """Bytes this host (network namespace) has sent on its interfaces other than loopback."""
    net = Path("/sys/class/net")
    return sum(int((d / "statistics" / "tx_bytes").read_text()) for d in net.iterdir() if d.name != "lo")


def link_bytes(world: MPI.Comm, node_rank: int, case: bc.Case, count: int) -> float:
    """Bytes all hosts sent on their network interfaces per call of ``case`` (each node's first
    rank reads its host's counters around ``COUNTED_CALLS`` calls)."""
    buf = np.ones(count, np.float32)
    world.Barrier()
    before = host_tx_bytes() if node_rank == 0 else 0
    for _ in range(COUNTED_CALLS):
        case.call(buf)
    world.Barrier()
    sent = host_tx_bytes() - before if node_rank == 0 else 0
    return world.allreduce(sent) / COUNTED_CALLS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--min-bytes", type=bc.parse_bytes, default=4 << 10)
    ap.add_argument("--max-bytes", type=bc.parse_bytes, default=64 << 20)
    ap.add_argument("--factor", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=0, help="calls per measurement (0: calibrate)")
    ap.add_argument("--target-s", type=float, default=0.1, help="seconds per measurement when calibrating")
    ap.add_argument("--link", default="as is", help="how the inter-node link was shaped (for the report)")
    ap.add_argument("--quick", action="store_true", help="3 measurements of ~30 ms, sizes to 4 MiB")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    if args.quick:
        args.reps, args.target_s, args.max_bytes = 3, 0.03, min(args.max_bytes, 4 << 20)

    world = MPI.COMM_WORLD
    mpidist.init_process_group()
    n, rank = world.Get_size(), world.Get_rank()
    node = world.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    node_rank = node.Get_rank()
    per_node = world.allgather(node.Get_size() if node_rank == 0 else 0)
    leaders = world.Split(0 if node_rank == 0 else MPI.UNDEFINED, rank)
    shm = ShmAllReduce(node)
    nodes = [k for k in per_node if k]
    load = os.getloadavg()[0]
    raw_comm = world.Dup()
    cases = [
        bc.Case("raw", lambda b: raw_comm.Allreduce(MPI.IN_PLACE, b, MPI.SUM)),
        bc.Case("mpi", lambda b: mpidist.all_reduce(b, algorithm="mpi")),
        bc.Case("ring", lambda b: mpidist.all_reduce(b, algorithm="ring")),
        bc.Case("hierarchical", lambda b: mpidist.all_reduce(b, algorithm="hierarchical")),
        bc.Case("auto", lambda b: mpidist.all_reduce(b)),
        bc.Case("node", lambda b: shm(b, ReduceOp.SUM)),
        bc.Case("leaders", lambda b: leaders.Allreduce(MPI.IN_PLACE, b, MPI.SUM), active=node_rank == 0),
        bc.Case("bcast", lambda b: node.Bcast(b, 0)),
    ]
    t0 = time.monotonic()
    results = []
    wire: dict[int, dict[str, float]] = {}
    for nbytes in bc.sweep(args.min_bytes, args.max_bytes, args.factor, 4):
        results.append(bc.bench_size(world, cases, nbytes, args, VARIANTS))  # (LEVELS: not validated)
        wire[nbytes] = {
            c.name: link_bytes(world, node_rank, c, nbytes // 4) for c in cases if c.name in ("raw", "hierarchical")
        }
        if rank == 0:
            r = results[-1]
            print(
                f"# {bc.human_bytes(nbytes)}: "
                + ", ".join(f"{v} {r[v].time_s * 1e6:.0f} us" for v in VARIANTS)
                + f" ({time.monotonic() - t0:.0f} s)",
                flush=True,
            )
    raw_comm.Free()
    shm.free()
    if leaders != MPI.COMM_NULL:
        leaders.Free()
    node.Free()
    mpidist.destroy_process_group()
    if rank == 0:
        report(args, n, nodes, load, results, wire, time.monotonic() - t0)


def paired(base: bc.Result, other: bc.Result) -> float:
    """The median over the interleaved measurements of base's time / other's (> 1: other is faster)."""
    return statistics.median(b / o for b, o in zip(base.samples, other.samples))


def report(
    args: argparse.Namespace, n: int, nodes: list[int], load: float, results: list, wire: dict, wall: float
) -> None:
    def busbw(r: bc.Result) -> float:
        return bc.algbw(r) * 2 * (n - 1) / n

    header = "| size(B) | count | " + " | ".join(f"{v} time(us)" for v in VARIANTS)
    header += " | raw busbw(GB/s) | hierarchical busbw(GB/s) | hier/raw busbw | auto/raw busbw"
    header += " | raw link bytes / S | hierarchical link bytes / S | #wrong |"
    rows = [header, "|---:|---:|" + "---:|" * (len(VARIANTS) + 7)]
    for r in results:
        s = r["raw"].nbytes
        rows.append(
            f"| {s} | {s // 4} | "
            + " | ".join(bc.fmt(r[v].time_s * 1e6) for v in VARIANTS)
            + f" | {bc.fmt(busbw(r['raw']), 3)} | {bc.fmt(busbw(r['hierarchical']), 3)}"
            + f" | {bc.fmt(paired(r['raw'], r['hierarchical']), 3)}"
            + f" | {bc.fmt(paired(r['raw'], r['auto']), 3)}"
            + f" | {bc.fmt(wire[s]['raw'] / s)} | {bc.fmt(wire[s]['hierarchical'] / s)}"
            + f" | {sum(r[v].wrong for v in VARIANTS)} |"
        )
    rows += [
        "",
        "The hierarchical algorithm's levels alone (time in us; `sum` = node + leaders + bcast, against the "
        "whole algorithm, which also has one barrier in the window):",
        "",
        "| size(B) | " + " | ".join(f"{v} time(us)" for v in LEVELS) + " | sum | hierarchical time(us) |",
        "|---:|" + "---:|" * (len(LEVELS) + 2),
    ]
    for r in results:
        rows.append(
            f"| {r['raw'].nbytes} | "
            + " | ".join(bc.fmt(r[v].time_s * 1e6) for v in LEVELS)
            + f" | {bc.fmt(sum(r[v].time_s for v in LEVELS) * 1e6)} | {bc.fmt(r['hierarchical'].time_s * 1e6)} |"
        )
    by_size = {r["raw"].nbytes: r for r in results}
    sizes = sorted(by_size)

    def speedup(s: int) -> float:
        return paired(by_size[s]["raw"], by_size[s]["hierarchical"])

    def auto_speedup(s: int) -> float:
        return paired(by_size[s]["raw"], by_size[s]["auto"])

    small = [s for s in sizes if s < HIER_OVER_MPI]
    below = [paired(by_size[s]["auto"], by_size[s]["mpi"]) for s in small]
    noise = [paired(by_size[s]["mpi"], by_size[s]["raw"]) for s in small]
    wins = [s for s in sizes if speedup(s) > 1]
    cross = next((s for s in sizes if all(x in wins for x in sizes if x >= s)), None)
    lines = [
        bc.verdict(
            "hierarchical >= 1.5x flat MPI busbw at >= 16 MiB",
            [s for s in sizes if s >= 16 << 20],
            speedup,
            lambda x: x >= 1.5,
            min,
        ),
        bc.verdict(
            f"auto no slower than flat MPI (>= 0.95x) where it takes the hierarchical algorithm "
            f"(>= {bc.human_bytes(HIER_OVER_MPI)})",
            [s for s in sizes if s >= HIER_OVER_MPI],
            auto_speedup,
            lambda x: x >= 0.95,
            min,
        ),
        f"below {bc.human_bytes(HIER_OVER_MPI)} auto runs MPI_Allreduce, as algorithm='mpi': auto/mpi time "
        f"{min(below):.2f}-{max(below):.2f} over {len(below)} sizes, mpi/raw {min(noise):.2f}-{max(noise):.2f} "
        f"(the same MPI call: the spread is this link's noise)"
        if below
        else "auto: no size below the hierarchical threshold measured",
        f"crossover hierarchical>mpi at >= {bc.human_bytes(cross) if cross else 'never'}",
    ]
    name = f"hierarchical_np{n}"
    notes = [
        f"ranks per node: {' + '.join(map(str, nodes))} ({len(nodes)} nodes, by MPI_COMM_TYPE_SHARED)",
        f"inter-node link: {args.link}",
        f"timing: median of {args.reps} measurements of ~{args.target_s * 1e3:.0f} ms (>= {bc.MIN_ITERS} calls), "
        f"each the max over ranks of the mean time per call; {args.warmup} warm-up calls; variants interleaved; "
        f"wall time {wall:.0f} s",
        "busbw = algbw * 2(n-1)/n (nccl-tests doc/PERFORMANCE.md); hier/raw, auto/raw: the median over the "
        "interleaved measurements of raw's time / the variant's (> 1: faster than flat MPI)",
        f"link bytes / S: bytes all hosts sent on their network interfaces per call (TCP/IP headers included; "
        f"mean of {COUNTED_CALLS} calls), over the size S",
    ]
    out = Path(args.out)
    bc.write_report(
        out, name + ".md", f"Hierarchical all-reduce vs flat MPI, {n} ranks", n, load, notes, rows + [""] + lines
    )
    with open(out / (name + ".csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["variant", "size_bytes", "time_us", "busbw_GBps", "wrong"])
        for r in results:
            for v in VARIANTS + LEVELS:
                w.writerow([v, r[v].nbytes, f"{r[v].time_s * 1e6:.3f}", f"{busbw(r[v]):.4f}", r[v].wrong])
    for line in lines:
        print(line, flush=True)


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
