"""Paired before/after of issue 14 items 5 and 6, interleaved in one job.

    mpiexec -n 2 python benchmarks/ab_recv_objects.py [CALLS] [PASSES]

"old" re-implements, inline, the paths as they were before (MPI_Recv / MPI_Irecv straight
into the array, then the size check; pkl5 on the caller's objects); "new" is mpidist's
(probe first, scratch buffer for an irecv posted before its message; object envelopes).
Each case alternates with its counterpart every pass, so both see the same machine state;
the max over ranks of the mean time per round trip (receives) or per call (objects),
median and best of the passes. Prints to stdout only (a comparison, not a results file).
"""
import statistics
import sys
import time

import numpy as np
from mpi4py import MPI
from mpi4py.util import pkl5

import mpidist
from mpidist import p2p, work
from mpidist._buffers import mpi_datatype
from mpidist._dispatch import launch, p2p_call
from mpidist._recorder import begin_p2p
from mpidist._runtime import state
from mpidist.errors import prefix

mpidist.init_process_group()
rank, size = mpidist.get_rank(), mpidist.get_world_size()
comm = MPI.COMM_WORLD
g = state().world


def old_recv(tensor, src):
    g, arr, peer, tag = p2p._prepare("recv", tensor, src, None, 0, receive=True)
    status = MPI.Status()
    with p2p_call(g, "recv", arr.shape, arr.dtype, p2p._global(g, peer)):
        g.comm.Recv([arr, mpi_datatype(arr.dtype)], peer, tag, status)
    return p2p._finisher(g, arr, "recv")(status)

def old_irecv(tensor, src):
    g, arr, peer, tag = p2p._prepare("irecv", tensor, src, None, 0, receive=True)
    rec = begin_p2p(g, "irecv", arr.shape, arr.dtype, p2p._global(g, peer))
    req = g.comm.Irecv([arr, mpi_datatype(arr.dtype)], peer, tag)
    return work.RequestWork("irecv", prefix("irecv"), req, (arr,), p2p._finisher(g, arr, "irecv"), rec=rec)

def pingpong(recv, nbytes):
    out, inp = np.zeros(max(1, nbytes // 8)), np.empty(max(1, nbytes // 8))
    def run(calls):
        for _ in range(calls):
            if rank == 0:
                mpidist.send(out, 1); recv(inp, 1)
            else:
                recv(inp, 0); mpidist.send(out, 0)
    return run

def posted(irecv, nbytes):
    out, inp = np.zeros(nbytes // 8), np.empty(nbytes // 8)
    def run(calls):
        for _ in range(calls):
            w = irecv(inp, 1 - rank)
            if rank == 0:
                mpidist.send(out, 1); w.wait()
            else:
                w.wait(); mpidist.send(out, 0)
    return run

def old_bcast(objs, src=0):
    def body(g, objs, root):
        got = pkl5.Intracomm(g.comm).bcast(objs if g.rank() == root else None, root)
        if g.rank() != root:
            objs[:] = got
    launch(g, "broadcast_object_list", body, (g, objs, src), False, root=src)

def old_allgather(out, obj):
    def body(g, out, obj):
        out[:] = pkl5.Intracomm(g.comm).allgather(obj)
    launch(g, "all_gather_object", body, (g, out, obj), False)

def old_gather(obj, out, dst=0):
    def body(g, out, obj, root):
        got = pkl5.Intracomm(g.comm).gather(obj, root)
        if out is not None:
            out[:] = got
    launch(g, "gather_object", body, (g, out, obj, dst), False, root=dst)

cases = {"recv 8 B old": pingpong(old_recv, 8), "recv 8 B new": pingpong(mpidist.recv, 8)}
for nb in (8, 65536, 4 << 20):
    cases[f"irecv posted first {nb} B old"] = posted(old_irecv, nb)
    cases[f"irecv posted first {nb} B new"] = posted(mpidist.irecv, nb)
small = {"step": 3, "loss": 0.25, "name": "x" * 20}
big = {"w": np.arange(1 << 17, dtype=np.float64)}
for label, obj in (("small", small), ("1MiB", big)):
    for ver, bc, ag, ga in (("old", old_bcast, old_allgather, old_gather),
                            ("new", mpidist.broadcast_object_list, mpidist.all_gather_object, mpidist.gather_object)):
        def fb(c, bc=bc, obj=obj):
            for _ in range(c):
                bc([obj if rank == 0 else None], 0)
        def fa(c, ag=ag, obj=obj):
            out = [None] * size
            for _ in range(c):
                ag(out, obj)
        def fg(c, ga=ga, obj=obj):
            out = [None] * size if rank == 0 else None
            for _ in range(c):
                ga(obj, out, 0)
        cases[f"broadcast_object_list {label} {ver}"] = fb
        cases[f"all_gather_object {label} {ver}"] = fa
        cases[f"gather_object {label} {ver}"] = fg
calls = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
passes = int(sys.argv[2]) if len(sys.argv) > 2 else 9
for f in cases.values():
    f(20)
times = {k: [] for k in cases}
for _ in range(passes):
    for name, f in cases.items():
        c = max(1, calls // 20) if ("MiB" in name or "4194304" in name) else calls
        comm.Barrier()
        t0 = time.perf_counter()
        f(c)
        times[name].append(comm.allreduce((time.perf_counter() - t0) / c, op=MPI.MAX))
if rank == 0:
    for name, ts in times.items():
        print(f"{name:40s} median {statistics.median(ts) * 1e6:9.2f} us  best {min(ts) * 1e6:9.2f} us")
mpidist.destroy_process_group()
