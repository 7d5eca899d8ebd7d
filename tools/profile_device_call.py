"""Where the host time of one small device collective goes: cProfile over many back-to-back
calls of (1) ``mpidist.all_reduce`` on a CuPy array through NCCL (``backend="cpu:mpi,cuda:nccl"``)
and through host staging (``backend="mpi"``, ``MPIDIST_CUDA_AWARE=0``), (2) torch's
``dist.all_reduce`` of a CUDA tensor over backend "mpidist", against raw CuPy NCCL and torch's
NCCL (``init_method="mpi://"``) timed alike. Prints, per path, the mean host time per call
(no stream synchronization inside the loop) and the functions with the most own time.

Run on a GPU machine, at one rank (NCCL's all_reduce is a no-op there, so the time is the
layers' own): ``mpiexec -n 1 python tools/profile_device_call.py [--calls 2000] [--top 25]``.
Used by tools/gpu_check.sh (docs/device.md, "Per-call cost").
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import time
from typing import Any, Callable

from mpi4py import MPI


def timed(name: str, call: Callable[[], Any], sync: Callable[[], Any], calls: int, top: int) -> None:
    for _ in range(200):
        call()
    sync()
    t = time.perf_counter()
    for _ in range(calls):
        call()
    host = (time.perf_counter() - t) / calls
    sync()
    total = (time.perf_counter() - t) / calls
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        call()
    sync()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    print(f"== {name}: {host * 1e6:.2f} us of host time per call, {total * 1e6:.2f} us with the final sync")
    print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[:6000])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    import cupy

    comm = MPI.COMM_WORLD
    cupy.cuda.Device(comm.Get_rank() % cupy.cuda.runtime.getDeviceCount()).use()
    x = cupy.ones(2, dtype=cupy.float32)
    sync = cupy.cuda.get_current_stream().synchronize

    from cupy.cuda import nccl

    uid = comm.bcast(nccl.get_unique_id() if comm.Get_rank() == 0 else None, root=0)
    raw = nccl.NcclCommunicator(comm.Get_size(), uid, comm.Get_rank())
    timed(
        "raw CuPy NCCL allReduce",
        lambda: raw.allReduce(
            x.data.ptr, x.data.ptr, 2, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, cupy.cuda.get_current_stream().ptr
        ),
        sync,
        args.calls,
        args.top,
    )
    import mpidist as dist

    for backend, env in (("cpu:mpi,cuda:nccl", {}), ("mpi", {"MPIDIST_CUDA_AWARE": "0"})):
        os.environ.update(env)
        dist.init_process_group(backend=backend)
        timed(f"mpidist.all_reduce, backend={backend!r}", lambda: dist.all_reduce(x), sync, args.calls, args.top)
        dist.destroy_process_group()
        for k in env:
            os.environ.pop(k)

    import torch
    import torch.distributed as tdist

    import mpidist.torch  # noqa: F401

    torch.cuda.set_device(comm.Get_rank() % torch.cuda.device_count())
    t = torch.ones(2, device="cuda")
    for backend in ("mpidist", "nccl"):
        if backend == "nccl":
            tdist.init_process_group("nccl", init_method="mpi://")
        else:
            tdist.init_process_group(backend)
        timed(
            f"torch dist.all_reduce (CUDA tensor) over {backend!r}",
            lambda: tdist.all_reduce(t),
            torch.cuda.synchronize,
            args.calls,
            args.top,
        )
        tdist.destroy_process_group()


if __name__ == "__main__":
    main()
