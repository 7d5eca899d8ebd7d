"""torch on CUDA tensors: backend "mpidist" against torch's own NCCL, in the same job.

Run as ``mpiexec -n N python benchmarks/bench_torch_gpu.py [--max-bytes 256M] [--out
benchmarks/results]``; needs torch with CUDA (and CuPy, for mpidist's NCCL path). Without a
GPU it prints one SKIPPED line and exits 0.

Two phases, one after the other on the same ranks and GPU (``local_rank % device_count``):

* ``nccl``: ``init_process_group("nccl", init_method="mpi://")``: torch's own NCCL with ranks
  and store from MPI (``mpidist.torch``'s store over MPI; no MASTER_ADDR, no port). Where two
  ranks share a GPU and torch's NCCL is older than 2.30 or NCCL_MULTI_RANK_GPU_ENABLE=1 is
  unset, NCCL refuses: the phase is skipped with that reason.
* ``mpidist``: ``init_process_group("mpidist")``: CUDA tensors through mpidist's device router
  (NCCL through CuPy where it has it, else CUDA-aware MPI or host staging: the path taken is
  printed).

Each phase: ``dist.all_reduce`` (SUM, in place) of a float32 CUDA tensor of S bytes, 8 B ...
``--max-bytes`` (powers of 4); timing as ``bench_gpu.py`` (a barrier, back-to-back calls, the
device synchronized; the max over ranks of the mean per call; calls calibrated to ~20 ms; the
median of 3), each result checked (every element). Then one ``DistributedDataParallel`` step
(zero_grad, forward, cross-entropy, backward with DDP's bucketed all-reduce, SGD) of an MLP
(784 -> 1024 x 3 -> 10, 2.9 M parameters) on a fixed batch of 64 per rank, from the same start
in both phases: its parameters after 3 steps are compared between the phases (bitwise at 1 and
2 ranks, where each sum has at most two terms; else the largest difference is shown), then the
step is timed (7 measurements of ~200 ms). Columns as nccl-tests; ``mpidist/nccl`` = time
ratio (1.0 = as fast as torch's NCCL; the issue's target: mpidist's NCCL path >= 0.9 of raw
NCCL's busbw from 16 MiB, i.e. a time ratio <= 1.11).

Output (rank 0): ``--out``/``torch_gpu_np{N}.md``. Exit status 1 when an element is wrong or the
DDP parameters differ at 1 or 2 ranks.
"""

from __future__ import annotations

import _bench_common as bc  # noqa: I001  (first: sets the thread variables)

# isort: split
import argparse  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable  # noqa: E402

import bench_gpu as bg  # noqa: E402  (its timing: a barrier, back-to-back calls, synchronized)
from mpi4py import MPI  # noqa: E402

COMM = MPI.COMM_WORLD
DDP_TARGET_S = 0.2
DDP_REPS = 7
#: The device of the tensors and the baseline backend ("cpu" and gloo with --cpu).
DEV, BASE = "cuda", "nccl"


def skip_reason(torch: Any) -> str:
    """Why this job cannot run at all ('' if it can); the same on every rank."""
    if torch is None:
        reason = "no torch"
    else:
        reason = "" if DEV == "cpu" or torch.cuda.is_available() else "torch sees no CUDA device"
    return COMM.allreduce(reason, op=MPI.MAX)


def nccl_reason(torch: Any, n_local: int) -> str:
    """'' if torch's NCCL can run these ranks, else why not (ranks sharing a GPU:
    :func:`mpidist._backends.device.nccl_core.shared_gpu_refused`)."""
    from mpidist._backends.device.nccl_core import shared_gpu_refused  # noqa: PLC0415

    if not torch.distributed.is_nccl_available():
        return "this torch has no NCCL"
    if n_local > torch.cuda.device_count():
        return shared_gpu_refused(torch.cuda.nccl.version())
    return ""


def sweep(torch: Any, dist: Any, sizes: list[int]) -> dict:
    """{size: (seconds per call, #wrong)} of an in-place SUM all_reduce of float32."""
    n, me = COMM.Get_size(), COMM.Get_rank()
    out = {}
    for size in sizes:
        count = max(1, size // 4)
        x = torch.zeros(count, device=DEV)
        t = statistics.median(bg.measurements(lambda x=x: dist.all_reduce(x), sync(torch)))
        x.fill_(me + 1)
        dist.all_reduce(x)
        wrong = int((x != n * (n + 1) / 2).sum().item())
        out[size] = (t, COMM.allreduce(wrong))
    return out


def sync(torch: Any) -> Callable[[], None]:
    return torch.cuda.synchronize if DEV == "cuda" else (lambda: None)


def ddp(torch: Any, dist: Any) -> tuple[list, list[float]]:
    """(parameters after 3 steps, on the CPU; step times in s) of one DDP model."""
    nn = torch.nn
    torch.manual_seed(0)
    layers, width = [], 784
    for _ in range(3):
        layers += [nn.Linear(width, 1024), nn.ReLU()]
        width = 1024
    model = nn.Sequential(*layers, nn.Linear(width, 10)).to(DEV)
    net = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1 + COMM.Get_rank())
    x = torch.randn(64, 784, generator=gen).to(DEV)
    y = torch.randint(0, 10, (64,), generator=gen).to(DEV)

    def step() -> None:
        opt.zero_grad(set_to_none=False)
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()

    for _ in range(3):
        step()
    sync(torch)()
    params = [p.detach().cpu().clone() for p in model.parameters()]
    times = bg.measurements(step, sync(torch), DDP_TARGET_S, DDP_REPS)
    return params, times


def mpidist_path(mpidist: Any) -> str:
    """The backend of the mpidist runtime that torch's "mpidist" group started (says where CUDA
    tensors go: ``cpu:mpi,cuda:nccl`` = NCCL through CuPy; ``mpi`` = CUDA-aware MPI or staging)."""
    return f"mpidist's runtime backend {mpidist.get_backend()!r}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--min-bytes", default="8")
    parser.add_argument("--max-bytes", default="256M")
    parser.add_argument("--factor", type=int, default=4)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument(
        "--cpu",
        action="store_true",
        help="CPU tensors, gloo in place of NCCL: a check of this script where there is no GPU",
    )
    args = parser.parse_args()
    global DEV, BASE
    if args.cpu:
        DEV, BASE = "cpu", "gloo"
    try:
        import torch  # noqa: PLC0415
    except ImportError:
        torch = None
    reason = skip_reason(torch)
    if reason:
        if COMM.Get_rank() == 0:
            print(f"SKIPPED: torch GPU benchmark: {reason}")
        return 0
    import torch.distributed as dist  # noqa: PLC0415

    import mpidist  # noqa: PLC0415
    import mpidist.torch  # noqa: PLC0415, F401

    n, me = COMM.Get_size(), COMM.Get_rank()
    load = os.getloadavg()[0]
    local = COMM.Split_type(MPI.COMM_TYPE_SHARED)
    n_local, device = local.Get_size(), local.Get_rank() % max(1, torch.cuda.device_count())
    if DEV == "cuda":
        torch.cuda.set_device(device)
    sizes = bc.sweep(bc.parse_bytes(args.min_bytes), bc.parse_bytes(args.max_bytes), args.factor)
    results: dict = {}
    notes: dict = {}
    for name in (BASE, "mpidist"):
        why = COMM.allreduce(nccl_reason(torch, n_local) if name == "nccl" else "", op=MPI.MAX)
        if why:
            notes[name] = f"not measured: {why}"
            continue
        if name == BASE:
            dist.init_process_group(BASE, init_method="mpi://")
        else:
            dist.init_process_group("mpidist")
        try:
            sw = sweep(torch, dist, sizes)
            params, times = ddp(torch, dist)
            notes[name] = mpidist_path(mpidist) if name == "mpidist" else f"torch's own {BASE}, init_method mpi://"
            results[name] = (sw, params, times)
        finally:
            dist.destroy_process_group()
    failed = any(w for sw, _, _ in results.values() for _, w in sw.values())
    diff = float("nan")
    if len(results) == 2:
        a, b = results[BASE][1], results["mpidist"][1]
        diff = COMM.allreduce(max(float((x - y).abs().max()) for x, y in zip(a, b)), op=MPI.MAX)
        failed = failed or (n <= 2 and diff != 0.0)
    if me == 0:
        gpu = torch.cuda.get_device_properties(device).name if DEV == "cuda" else "none (--cpu)"
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if DEV == "cuda" else "-"
        lines = [
            f"# torch on {DEV}: mpidist vs torch's {BASE}, {n} rank(s), float32",
            "",
            *bc.machine_lines(n, load),
            f"- GPU: {gpu} (device {device} of rank 0; {n_local} rank(s) on this node)",
            f"- {bc.versions(torch=torch.__version__, mpidist=mpidist.__version__)}, torch's NCCL {nccl}",
            *[f"- {k}: {v}" for k, v in notes.items()],
            "- timing: median of 3 measurements of ~20 ms, each the max over ranks of the mean time per "
            "call (barrier, back-to-back calls, device synchronized); busbw = algbw * 2(n-1)/n",
            "",
        ]
        cols = "| size(B) | " + " | ".join(f"{k} time(us) | {k} busbw(GB/s) | {k} #wrong" for k in results)
        lines += [
            "## dist.all_reduce, float32, sum, in place",
            "",
            cols + (f" | mpidist/{BASE} time |" if len(results) == 2 else " |"),
            "|" + "---:|" * (1 + 3 * len(results) + (len(results) == 2)),
        ]
        for s in sizes:
            cells = [str(max(1, s // 4) * 4)]
            for sw, _, _ in results.values():
                t, w = sw[s]
                cells += [f"{t * 1e6:.2f}", f"{max(1, s // 4) * 4 / t / 1e9 * 2 * (n - 1) / n:.3f}", str(w)]
            if len(results) == 2:
                cells.append(f"{results['mpidist'][0][s][0] / results[BASE][0][s][0]:.3f}")
            lines.append("| " + " | ".join(cells) + " |")
        lines += [
            "",
            "## DDP step (MLP 784-1024x3-10, batch 64 per rank)",
            "",
            "| backend | step time(ms), median | min-max (ms) |",
            "|---|---:|---:|",
        ]
        for k, (_, _, times) in results.items():
            lines.append(
                f"| {k} | {statistics.median(times) * 1e3:.3f} | {min(times) * 1e3:.3f}-{max(times) * 1e3:.3f} |"
            )
        if len(results) == 2:
            ratio = statistics.median(results["mpidist"][2]) / statistics.median(results[BASE][2])
            lines += [
                "",
                f"- DDP step mpidist/{BASE} time: {ratio:.3f}",
                f"- parameters after 3 steps, largest |{BASE} - mpidist|: {diff!r}"
                f"{' (bitwise equal)' if diff == 0.0 else ''}",
            ]
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        name = f"torch_{'gpu' if DEV == 'cuda' else 'cpu_check'}_np{n}.md"
        (out / name).write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
        print(f"wrote {out / name}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
