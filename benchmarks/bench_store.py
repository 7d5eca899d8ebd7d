"""The store over MPI against torch's TCPStore, in the same job (issue 24, item 2).

    mpiexec -n N python benchmarks/bench_store.py [--ops 300] [--passes 5] [--inits 9] [--out DIR]

Two parts, every rank taking part, all on one machine:

* **latency** of ``set``, ``get`` (of a key that exists) and ``add``, per call, on every
  rank at once (the contended case: ranks 1..N-1 ask across processes, rank 0 asks its own
  server too): the mean per call over ``--ops`` calls, the max over ranks, the median over
  ``--passes`` interleaved passes, for :class:`mpidist.torch.MPIStore` and for a
  ``torch.distributed.TCPStore`` hosted by rank 0 on 127.0.0.1 at a port the OS picks
  (its port broadcast over MPI);
* **init** time of torch's own gloo backend, ``init_process_group("gloo")`` through to its
  first ``all_reduce``, over each store (``init_method="mpi://"``; ``store=TCPStore`` with
  MPI's ranks), the median of ``--inits`` alternated runs (which store goes first alternating
  too), max over ranks, after one unmeasured init over each (the process's first use of gloo,
  and of each store's code, is not charged to whichever happens to run first). torch's NCCL
  needs a GPU: its init over ``mpi://`` is measured by the GPU job when one is lent.

Writes ``store_np{N}.md`` to ``--out`` (default benchmarks/results) on rank 0.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

import mpidist.torch  # noqa: F401  (mpi://)
from mpidist.torch import MPIStore

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
TIMEOUT = datetime.timedelta(seconds=60)


def tcp_store() -> Any:
    if RANK == 0:
        store = dist.TCPStore("127.0.0.1", 0, SIZE, is_master=True, timeout=TIMEOUT, wait_for_workers=False)
        port = COMM.bcast(store.port, root=0)
    else:
        port = COMM.bcast(None, root=0)
        store = dist.TCPStore("127.0.0.1", port, SIZE, is_master=False, timeout=TIMEOUT)
    return store


def per_call(fn: Callable[[int], None], ops: int) -> float:
    """Seconds per call, the max over ranks."""
    COMM.Barrier()
    t0 = time.perf_counter()
    fn(ops)
    return _max((time.perf_counter() - t0) / ops)


def _max(x: float) -> float:
    """The max over ranks (a numpy MPI_Allreduce: mpi4py's object allreduce reduces with a
    Python op, which stalls rank 0's store thread while it runs; see MPIStore)."""
    buf = np.array([x])
    COMM.Allreduce(MPI.IN_PLACE, buf, MPI.MAX)
    return float(buf[0])


def latency(stores: dict, ops: int, passes: int) -> dict:
    results: dict = {}
    for store in stores.values():
        store.set(f"there/{RANK}", b"x" * 16)
    COMM.Barrier()
    for _ in range(passes):
        for name, store in stores.items():
            key = f"k/{RANK}"
            for op, fn in (
                ("set", lambda n, s=store, key=key: [s.set(key, b"v" * 16) for _ in range(n)]),
                ("get", lambda n, s=store: [s.get(f"there/{(RANK + 1) % SIZE}") for _ in range(n)]),
                ("add", lambda n, s=store: [s.add("counter", 1) for _ in range(n)]),
            ):
                results.setdefault((op, name), []).append(per_call(fn, ops))
    return {k: statistics.median(v) for k, v in results.items()}


def init_time(way: str) -> float:
    COMM.Barrier()
    t0 = time.perf_counter()
    if way == "mpi://":
        dist.init_process_group("gloo", init_method="mpi://", timeout=TIMEOUT)
    else:
        dist.init_process_group("gloo", store=tcp_store(), rank=RANK, world_size=SIZE, timeout=TIMEOUT)
    t = torch.ones(1)
    dist.all_reduce(t)
    took = time.perf_counter() - t0
    assert t.item() == SIZE
    dist.destroy_process_group()
    return _max(took)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=300)
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--inits", type=int, default=9)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()

    stores = {"MPIStore": MPIStore(TIMEOUT), "TCPStore": tcp_store()}
    lat = latency(stores, args.ops, args.passes)
    COMM.Barrier()
    stores["MPIStore"].close()
    inits: dict = {"mpi://": [], "TCPStore": []}
    ways = list(inits)
    for way in ways:  # warm-up, not measured
        init_time(way)
    for i in range(args.inits):
        for way in ways[i % 2 :] + ways[: i % 2]:
            inits[way].append(init_time(way))
    if RANK != 0:
        return
    lines = [
        f"# The store over MPI vs torch's TCPStore, {SIZE} ranks",
        "",
        f"`mpiexec -n {SIZE} python benchmarks/bench_store.py --ops {args.ops} --passes {args.passes} "
        f"--inits {args.inits}`; torch {torch.__version__}, {MPI.Get_library_version().splitlines()[0]}; "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        "",
        "Latency per call, every rank calling at once (max over ranks, median of the passes):",
        "",
        "| op | MPIStore (us) | TCPStore (us) | MPIStore / TCPStore |",
        "|---|---:|---:|---:|",
    ]
    for op in ("set", "get", "add"):
        m, t = lat[(op, "MPIStore")] * 1e6, lat[(op, "TCPStore")] * 1e6
        lines.append(f"| {op} | {m:.0f} | {t:.0f} | {m / t:.2f} |")
    m, t = statistics.median(inits["mpi://"]), statistics.median(inits["TCPStore"])
    lines += [
        "",
        f"torch's gloo: `init_process_group` through its first `all_reduce` (max over ranks, median of {args.inits}):",
        "",
        "| store | init (ms) | runs (ms) |",
        "|---|---:|---|",
        f'| MPIStore (`init_method="mpi://"`) | {m * 1e3:.1f} | '
        f"{', '.join(f'{x * 1e3:.1f}' for x in inits['mpi://'])} |",
        f"| TCPStore | {t * 1e3:.1f} | {', '.join(f'{x * 1e3:.1f}' for x in inits['TCPStore'])} |",
        "",
        f"Init over MPIStore / over TCPStore: {m / t:.2f}.",
    ]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"store_np{SIZE}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
