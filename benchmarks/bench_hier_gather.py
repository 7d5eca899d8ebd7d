"""Does a hierarchical all_gather or reduce_scatter pay across nodes? Flat MPI against the
two-level forms.

Run as ``mpiexec -n N python benchmarks/bench_hier_gather.py [--link TEXT --out benchmarks/results]``
on ranks spread over two or more nodes, each node's ranks consecutive in the world (as
``mpirun --hostfile`` and Slurm's block distribution place them); ``make bench-hosts`` runs it on
the two "hosts" of tests/slurm/two_hosts.sh with the link shaped like a cluster's.

Issue 44 asks for hierarchical reduce_scatter/all_gather "where it pays". Output S bytes of float32,
k = S / 4 / N elements per rank, every size in the same job, measurements interleaved:

* ``all_gather flat``  ``Allgather`` on a Dup of COMM_WORLD;
* ``all_gather hier``  ``Gather`` of the node's blocks to its first rank (straight into their place
                       in the output), ``Allgatherv`` of the node blocks among one rank per node,
                       ``Bcast`` of the whole output in the node;
* ``reduce_scatter flat``  ``Reduce_scatter_block``;
* ``reduce_scatter hier``  the node's shared-memory all-reduce of the whole input
                           (:class:`mpidist.algorithms.ShmAllReduce`, on a copy), ``Reduce_scatter`` of
                           the node shares among the first ranks (the others wait in the window),
                           ``Scatter`` of the share in the node.

The two-level forms send fewer bytes between the nodes: one copy of each node's block (all_gather) or
share (reduce_scatter) per other node, where the flat ring sends each block across every node boundary it
passes. The bytes are counted (each host's interfaces, ``bench_hierarchical.host_tx_bytes``). Every
result is checked before timing. Times: the median of ``--reps`` measurements, each the MAX over ranks
of the mean time per call. Output (rank 0): the table on stdout and in ``--out``/``hier_gather_np{N}.md``.
"""

from __future__ import annotations

import _bench_common as bc  # noqa: I001  (first: sets the thread variables before numpy)

# isort: split

import argparse  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
from bench_hierarchical import host_tx_bytes  # noqa: E402
from mpi4py import MPI  # noqa: E402

from mpidist import ReduceOp  # noqa: E402
from mpidist.algorithms import ShmAllReduce  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1M,4M,16M,64M", help="output bytes, comma-separated")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--link", default="as is", help="how the inter-node link was shaped (for the report)")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    world = MPI.COMM_WORLD.Dup()
    n, rank = world.Get_size(), world.Get_rank()
    node = world.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    first = node.Get_rank() == 0
    leaders = world.Split(0 if first else MPI.UNDEFINED, rank)
    sizes = node.bcast(leaders.allgather(node.Get_size()) if first else None)  # ranks per node, in node order
    starts = [sum(sizes[:i]) for i, s in enumerate(sizes) for _ in range(s)]  # each rank's node's first rank
    if world.allgather(rank - node.Get_rank()) != starts:
        raise SystemExit("bench_hier_gather: each node's ranks must be consecutive in COMM_WORLD")
    node_index = leaders.Get_rank() if first else -1
    shm = ShmAllReduce(node)
    load = os.getloadavg()[0]

    def ag_hier(send: np.ndarray, out: np.ndarray) -> None:
        k = send.size
        if first:
            at = sum(sizes[:node_index]) * k
            node.Gather(send, out[at : at + node.Get_size() * k], root=0)
            leaders.Allgatherv(MPI.IN_PLACE, [out, [s * k for s in sizes], MPI.FLOAT])
        else:
            node.Gather(send, None, root=0)
        node.Bcast(out, root=0)

    def rs_hier(send: np.ndarray, out: np.ndarray, whole: np.ndarray, share: np.ndarray) -> None:
        k = out.size
        whole[:] = send  # (MPI_Reduce to the first rank in the node: 2.3-2.8x slower at 1-64 MiB)
        shm(whole, ReduceOp.SUM)
        if first:
            leaders.Reduce_scatter(whole, share, [s * k for s in sizes], MPI.SUM)
        shm.barrier()  # (the others sleep while the first ranks talk)
        node.Scatter(share if first else None, out, root=0)

    def one_size(nbytes: int) -> tuple:
        """(median time per case, link bytes per case) at output size ``nbytes``."""
        k = nbytes // 4 // n
        send, out = np.full(k, rank + 1, np.float32), np.empty(k * n, np.float32)
        rsend, rout = np.full(k * n, rank + 1, np.float32), np.empty(k, np.float32)
        whole, share = np.empty(k * n, np.float32), np.empty(k * node.Get_size(), np.float32)
        cases = {
            "all_gather flat": lambda: world.Allgather(send, out),
            "all_gather hier": lambda: ag_hier(send, out),
            "reduce_scatter flat": lambda: world.Reduce_scatter_block(rsend, rout, MPI.SUM),
            "reduce_scatter hier": lambda: rs_hier(rsend, rout, whole, share),
        }
        want_ag, want_rs = np.repeat(np.arange(1, n + 1, dtype=np.float32), k), n * (n + 1) / 2
        for name, fn in cases.items():
            out.fill(0), rout.fill(0)
            fn()
            ok = np.array_equal(out, want_ag) if name.startswith("all_gather") else bool(np.all(rout == want_rs))
            if not world.allreduce(ok, MPI.LAND):
                raise SystemExit(f"bench_hier_gather: {name} at {bc.human_bytes(nbytes)} gave a wrong result")
        wire = {}
        for name, fn in cases.items():
            world.Barrier()
            before = host_tx_bytes() if first else 0
            fn()
            world.Barrier()
            wire[name] = world.allreduce(host_tx_bytes() - before if first else 0)
        iters = max(2, min(50, (200 << 20) // nbytes))
        times: dict[str, list[float]] = {c: [] for c in cases}
        for _ in range(args.reps):
            for name, fn in cases.items():
                times[name].append(bc.timed(world, fn, iters))
        med = {c: statistics.median(v) for c, v in times.items()}
        if rank == 0:
            print(f"# {bc.human_bytes(nbytes)}: " + ", ".join(f"{c} {t * 1e3:.2f} ms" for c, t in med.items()))
        return med, wire

    rows = [(b, *one_size(b)) for b in (bc.parse_bytes(s) for s in args.sizes.split(","))]
    if rank == 0:
        lines = [
            f"# Hierarchical all_gather / reduce_scatter against flat MPI, {n} ranks",
            "",
            *bc.machine_lines(n, load),
            f"- nodes: {len(sizes)} ({' + '.join(map(str, sizes))} ranks); inter-node link: {args.link}",
            f"- timing: median of {args.reps} measurements, each the max over ranks of the mean time per call; "
            "S = output bytes (all_gather) or input bytes (reduce_scatter) of float32; link = bytes all hosts "
            "sent on their interfaces per call, over S; flat/hier > 1: the two-level form is faster",
            "",
            "| op | size(B) | flat time(us) | hier time(us) | flat/hier time | flat link/S | hier link/S |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for op in ("all_gather", "reduce_scatter"):
            for nbytes, med, wire in rows:
                f, h = med[f"{op} flat"], med[f"{op} hier"]
                lines.append(
                    f"| {op} | {nbytes} | {f * 1e6:.0f} | {h * 1e6:.0f} | {f / h:.2f} | "
                    f"{wire[f'{op} flat'] / nbytes:.2f} | {wire[f'{op} hier'] / nbytes:.2f} |"
                )
        text = "\n".join(lines) + "\n"
        print(text)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"hier_gather_np{n}.md").write_text(text)
    shm.free()
    for c in (leaders, node, world):
        if c != MPI.COMM_NULL:
            c.Free()


if __name__ == "__main__":
    main()
