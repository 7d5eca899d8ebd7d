"""Point-to-point receive and object-collective costs (issue 14 items 5 and 6).

    mpiexec -n 2 python benchmarks/bench_p2p_objects.py [--calls 2000] [--passes 7] [--out DIR]

Ranks 0 and 1 play ping-pong; every value is the max over ranks of the mean time per
round trip (point-to-point) or per call (object collectives, all ranks), the median over
``--passes`` interleaved passes:

* ``raw Send/Recv 8 B``: ``comm.Send``/``comm.Recv`` of a float64[1] on a duplicate of the
  default group's communicator: the ceiling for any Python wrapper;
* ``send/recv 8 B``: ``mpidist.send``/``mpidist.recv`` (recv probes the message first:
  MPI_Mprobe + MPI_Mrecv, so a message of another size never touches the buffer);
* ``irecv posted first N``: each side posts ``mpidist.irecv`` before its peer sends, then
  sends/waits: the receive is usually posted before the message arrives, which is the case
  where mpidist cannot probe first and receives in place (as bytes), as MPI_Irecv;
* object rows: one call of each object collective (a small dict; ``1 MiB array``: a dict
  holding a float64 array of 1 MiB), and a send/recv_object_list round trip;
* ``envelope`` rows (rank 0 alone, no communication): what the failure envelope of
  :mod:`mpidist.objects` adds to pkl5's own pickling: pickle + unpickle with pkl5's pickler
  (``pkl5``) against the same with the envelope around it (``envelope``), best of 25.

Both the median and the best (min) pass are shown: on a shared machine the best is the
steadier figure for a before/after comparison.

Writes ``p2p_objects_np{N}.md`` to ``--out`` (default benchmarks/results) on rank 0.
"""

from __future__ import annotations

import _bench_common as bc  # first: sets the BLAS thread variables

# isort: split

import argparse  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Callable  # noqa: E402

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import mpidist  # noqa: E402


def p2p_cases(rank: int) -> dict[str, Callable[[int], None]]:
    comm = mpidist._runtime.world.state().world.comm.Dup()
    peer = 1 - rank
    small, got = np.zeros(1), np.empty(1)
    cases: dict[str, Callable[[int], None]] = {}

    def raw(calls: int) -> None:
        for _ in range(calls):
            if rank == 0:
                comm.Send([small, MPI.DOUBLE], 1, 0)
                comm.Recv([got, MPI.DOUBLE], 1, 0)
            else:
                comm.Recv([got, MPI.DOUBLE], 0, 0)
                comm.Send([small, MPI.DOUBLE], 0, 0)

    def blocking(calls: int) -> None:
        send, recv = mpidist.send, mpidist.recv
        for _ in range(calls):
            if rank == 0:
                send(small, 1)
                recv(got, 1)
            else:
                recv(got, 0)
                send(small, 0)

    cases["raw Send/Recv 8 B"] = raw
    cases["send/recv 8 B"] = blocking
    for nbytes in (8, 65536, 4 << 20):
        out, inp = np.zeros(nbytes // 8), np.empty(nbytes // 8)

        def posted_first(calls: int, out: np.ndarray = out, inp: np.ndarray = inp) -> None:
            for _ in range(calls):
                w = mpidist.irecv(inp, peer)
                if rank == 0:
                    mpidist.send(out, 1)
                    w.wait()
                else:
                    w.wait()
                    mpidist.send(out, 0)

        cases[f"irecv posted first {bc.human_bytes(nbytes)}"] = posted_first
    return cases


def object_cases(rank: int, size: int) -> dict[str, Callable[[int], None]]:
    small = {"step": 3, "loss": 0.25, "name": "x" * 20}
    big = {"w": np.arange(1 << 17, dtype=np.float64)}
    cases: dict[str, Callable[[int], None]] = {}
    for label, obj in (("small dict", small), ("1 MiB array", big)):

        def bcast(calls: int, obj: object = obj) -> None:
            for _ in range(calls):
                mpidist.broadcast_object_list([obj if rank == 0 else None], src=0)

        def allgather(calls: int, obj: object = obj) -> None:
            out = [None] * size
            for _ in range(calls):
                mpidist.all_gather_object(out, obj)

        def gather(calls: int, obj: object = obj) -> None:
            out = [None] * size if rank == 0 else None
            for _ in range(calls):
                mpidist.gather_object(obj, out, dst=0)

        def scatter(calls: int, obj: object = obj) -> None:
            out = [None]
            for _ in range(calls):
                mpidist.scatter_object_list(out, [obj] * size if rank == 0 else None, src=0)

        def pingpong(calls: int, obj: object = obj) -> None:
            got = [None]
            for _ in range(calls):
                if rank == 0:
                    mpidist.send_object_list([obj], 1)
                    mpidist.recv_object_list(got, 1)
                elif rank == 1:
                    mpidist.recv_object_list(got, 0)
                    mpidist.send_object_list([obj], 0)

        cases[f"broadcast_object_list {label}"] = bcast
        cases[f"all_gather_object {label}"] = allgather
        cases[f"gather_object {label}"] = gather
        cases[f"scatter_object_list {label}"] = scatter
        cases[f"send/recv_object_list round trip {label}"] = pingpong
    return cases


def envelope_rows() -> list[str]:
    """Single-process CPU cost of the object envelope (see the module doc)."""
    import timeit  # noqa: PLC0415

    from mpi4py.util import pkl5  # noqa: PLC0415

    from mpidist.objects import _pack, _unpack  # noqa: PLC0415

    pickler = pkl5.pickle
    rows = []
    for label, obj in (
        ("small dict", [{"step": 3, "loss": 0.25, "name": "x" * 20}]),
        ("1 MiB array", [{"w": np.arange(1 << 17, dtype=np.float64)}]),
    ):

        def plain(obj: object = obj) -> None:
            pickler.loads_oob(*pickler.dumps_oob(obj))

        def enveloped(obj: object = obj) -> None:
            _unpack(pickler.loads_oob(*pickler.dumps_oob(_pack(obj, 0, "x")[0])), "x", 0, 0)

        for name, fn in (("pkl5", plain), ("envelope", enveloped)):
            number = timeit.Timer(fn).autorange()[0]
            best = min(timeit.repeat(fn, number=number, repeat=25)) / number
            rows.append(f"| {name} pickle+unpickle {label} | {best * 1e6:.2f} | {best * 1e6:.2f} |")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--passes", type=int, default=7)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args()
    if args.calls < 1 or args.passes < 1:
        p.error("--calls and --passes must be >= 1")
    load = os.getloadavg()[0]
    mpidist.init_process_group("mpi")
    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    if n < 2:
        p.error("run under mpiexec -n 2 (or more: ranks above 1 only join the object collectives)")
    cases = object_cases(rank, n)
    if rank < 2:
        cases = {**p2p_cases(rank), **cases}
    names = comm.bcast(list(cases) if rank == 0 else None)
    for name in names:  # warm-up: MPI's connections, pkl5's private communicator
        comm.Barrier()
        if name in cases:
            cases[name](20)
    times: dict[str, list[float]] = {k: [] for k in names}
    for _ in range(args.passes):
        for name in names:
            calls = max(1, args.calls // 20) if "MiB" in name else args.calls
            comm.Barrier()
            t0 = time.perf_counter()
            if name in cases:
                cases[name](calls)
            mine = (time.perf_counter() - t0) / calls if name in cases else 0.0
            times[name].append(comm.allreduce(mine, op=MPI.MAX))
    if rank == 0:
        rows = ["| case | median (us) | best (us) |", "|---|---:|---:|"]
        rows += [f"| {name} | {statistics.median(ts) * 1e6:.2f} | {min(ts) * 1e6:.2f} |" for name, ts in times.items()]
        rows += envelope_rows()
        bc.write_report(
            args.out,
            f"p2p_objects_np{n}.md",
            f"Point-to-point receive and object collectives, {n} ranks",
            n,
            load,
            [
                f"{args.passes} passes of {args.calls} calls per case ({args.calls // 20} for the "
                f"MiB cases), interleaved; see benchmarks/bench_p2p_objects.py"
            ],
            rows,
        )
    mpidist.destroy_process_group()


if __name__ == "__main__":
    main()
