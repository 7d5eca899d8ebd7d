"""GPU benchmark: all_reduce and all_gather_into_tensor on CuPy arrays through each device
path, against a device-to-device copy of the same size measured in the same run.

Paths (each through the public API, one init_process_group per path):

* ``nccl``: ``init_process_group(backend="cpu:mpi,cuda:nccl")`` (mpidist._backends.device.nccl).
* ``cuda-aware-mpi``: ``backend="mpi"`` with ``MPIDIST_CUDA_AWARE=1``, only where mpidist's
  own detection (``mpidist.device.detect``: MPIDIST_CUDA_AWARE from the caller,
  ``MPIX_Query_cuda_support`` on the loaded MPI library, the MPI-4.1 info key) says the MPI
  is CUDA-aware; otherwise one row says "not CUDA-aware" and why.
* ``host-staging``: ``backend="mpi"`` with ``MPIDIST_CUDA_AWARE=0`` (device -> host copy, MPI
  on host memory, host -> device copy).
* ``host-mpi``: ``backend="mpi"`` on pinned numpy arrays of the same sizes: MPI's part of
  host staging alone (no device copies).
* ``raw-nccl``: the baseline of the ``nccl`` path: CuPy's ``NcclCommunicator.allReduce`` /
  ``allGather`` called directly on the same buffers (a communicator made from a unique id
  broadcast over MPI), no mpidist in between.

Timing: a barrier, ``iters`` back-to-back calls, then the current stream synchronized;
the value is the max over ranks of the mean time per call, ``iters`` calibrated so a
measurement lasts about 20 ms, the median of 3 measurements. Columns as nccl-tests
(doc/PERFORMANCE.md): algbw = size / time, busbw = algbw * 2(n-1)/n (all_reduce) or
(n-1)/n (all_gather); size(B) is the all_reduce buffer / the all_gather output. ``copy
bw`` is ``cupy.copyto`` of ``size`` bytes (S / t), ``vs copy`` = busbw / copy bw. ``vs raw`` =
raw NCCL's time / the path's time (the same op and size; the issue's target: the nccl path
>= 0.9 from 16 MiB). ``host bw`` is the host-copy bound of staging, S / (t(device -> pinned
host) + t(pinned host -> device)) of the same size, and ``vs host`` = algbw / host bw (the
target for host-staging: >= 0.5).

Run: ``mpiexec -n N python benchmarks/bench_gpu.py [--max-bytes 256M] [--out benchmarks/results]``;
writes ``gpu_np{N}.md`` and ``.csv``. Without CuPy or a GPU it prints one SKIPPED line and
exits 0.
"""

from __future__ import annotations

import _bench_common as bc  # first: sets the BLAS thread variables

# isort: split

import argparse  # noqa: E402
import csv  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable, Optional  # noqa: E402

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

COMM = MPI.COMM_WORLD
TARGET_S = 0.02
REPEATS = 3
FIELDS = [
    "path",
    "op",
    "size",
    "count",
    "type",
    "redop",
    "root",
    "time_us",
    "algbw",
    "busbw",
    "wrong",
    "copy_gbps",
    "vs_copy",
    "vs_raw",
    "host_gbps",
    "vs_host",
    "note",
]


def skip_reason() -> str:
    """Why this machine cannot run the benchmark ('' if it can); the same on every rank."""
    try:
        import cupy  # noqa: PLC0415

        count = cupy.cuda.runtime.getDeviceCount()
        reason = "" if count > 0 else "no GPU"
    except Exception as exc:  # noqa: BLE001
        reason = f"no CuPy/GPU ({type(exc).__name__}: {exc})"
    return COMM.allreduce(reason, op=MPI.MAX)


def cuda_aware_mpi() -> tuple[bool, str]:
    """(CUDA-aware, how we know), decided as init_process_group decides it
    (:func:`mpidist.device.detect.detect`: MPIDIST_CUDA_AWARE from the caller, else
    MPIX_Query_cuda_support on the loaded MPI library or the MPI-4.1 info key)."""
    from mpidist.device import detect  # noqa: PLC0415

    found = detect.detect(comm=COMM)
    return found.aware, found.source


def nccl_ok(cupy: Any, n_local: int) -> str:
    """'' if NCCL can run here, else why not (ranks sharing a GPU:
    :func:`mpidist._backends.device.nccl_core.shared_gpu_refused`)."""
    from mpidist._backends.device.nccl_core import shared_gpu_refused  # noqa: PLC0415

    try:
        from cupy.cuda import nccl  # noqa: PLC0415

        version = nccl.get_version()
    except Exception as exc:  # noqa: BLE001
        return f"CuPy has no NCCL ({exc})"
    if n_local > cupy.cuda.runtime.getDeviceCount():
        return shared_gpu_refused(version)
    return ""


def timed(fn: Callable[[], Any], iters: int, sync: Callable[[], None]) -> float:
    """Barrier, ``iters`` calls, stream synchronized: max over ranks of seconds per call."""
    COMM.Barrier()
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    elapsed = time.perf_counter() - t0
    bc.idle_barrier(COMM)
    return COMM.allreduce(elapsed / iters, op=MPI.MAX)


def measurements(
    fn: Callable[[], Any], sync: Callable[[], None], target: float = TARGET_S, reps: int = REPEATS
) -> list[float]:
    """``reps`` measurements of ~``target`` seconds each (seconds per call), calls per
    measurement calibrated first (also used by bench_torch_gpu.py)."""
    fn()
    sync()
    iters = 1
    for _ in range(bc.CALIBRATION_ROUNDS):
        batch = timed(fn, iters, sync) * iters
        if batch >= target * 2 / 3:
            break
        iters = 2 * iters if batch < target / 8 else max(iters + 1, int(iters * target / batch))
    return [timed(fn, iters, sync) for _ in range(reps)]


def measure(fn: Callable[[], Any], sync: Callable[[], None]) -> float:
    """Median seconds per call over REPEATS measurements of ~TARGET_S each."""
    return statistics.median(measurements(fn, sync))


class DevicePath:
    """One device path: how to bring it up, and the two ops through it."""

    def __init__(self, name: str, backend: str, env: dict) -> None:
        self.name, self.backend, self.env = name, backend, env
        self.note = ""
        self.saved: dict = {}  # the caller's values of the keys of env, put back by stop()
        self.all_reduce: Optional[Callable[[Any], Any]] = None
        self.all_gather: Optional[Callable[[Any, Any], Any]] = None

    def start(self, dist: Any, cupy: Any) -> str:
        """init_process_group for the path and a probe call; '' or why it is unavailable."""
        self.saved = {key: os.environ.get(key) for key in self.env}
        os.environ.update(self.env)
        try:
            dist.init_process_group(backend=self.backend)
        except Exception as exc:  # noqa: BLE001
            reason = f"init_process_group(backend={self.backend!r}) failed: {exc}"
        else:
            self.all_reduce = lambda x: dist.all_reduce(x)
            self.all_gather = lambda out, x: dist.all_gather_single(out, x)
            try:
                self.all_reduce(self.zeros(2) if isinstance(self, HostMpi) else cupy.ones(2, cupy.float32))
                cupy.cuda.get_current_stream().synchronize()
                reason = ""
            except Exception as exc:  # noqa: BLE001
                reason = f"all_reduce on a cupy array failed: {exc}"
        return COMM.allreduce(reason, op=MPI.MAX)

    def stop(self, dist: Any) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        for key, value in self.saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class RawNccl(DevicePath):
    """CuPy's NCCL communicator called directly: the baseline of the nccl path."""

    def start(self, dist: Any, cupy: Any) -> str:
        try:
            from cupy.cuda import nccl  # noqa: PLC0415

            uid = COMM.bcast(nccl.get_unique_id() if COMM.Get_rank() == 0 else None, root=0)
            comm = nccl.NcclCommunicator(COMM.Get_size(), uid, COMM.Get_rank())
        except Exception as exc:  # noqa: BLE001
            return COMM.allreduce(f"NcclCommunicator failed: {exc}", op=MPI.MAX)
        stream = lambda: cupy.cuda.get_current_stream().ptr  # noqa: E731
        self.comm = comm
        self.all_reduce = lambda x: comm.allReduce(
            x.data.ptr, x.data.ptr, x.size, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, stream()
        )
        self.all_gather = lambda out, x: comm.allGather(x.data.ptr, out.data.ptr, x.size, nccl.NCCL_FLOAT32, stream())
        return COMM.allreduce("", op=MPI.MAX)

    def stop(self, dist: Any) -> None:
        comm = getattr(self, "comm", None)
        if comm is not None:
            comm.destroy()


class HostMpi(DevicePath):
    """MPI alone on pinned host buffers (``backend="mpi"``, numpy arrays): the middle part of
    host staging, with no device copy; staging's time is at least this plus the copies
    unless the two overlap."""

    def zeros(self, count: int) -> Any:
        import cupyx  # noqa: PLC0415

        return cupyx.zeros_pinned(count, np.float32)


def run_sizes(path: DevicePath, cupy: Any, sizes: list[int], copy_bw: dict, rows: list) -> None:
    n, me = COMM.Get_size(), COMM.Get_rank()
    host = isinstance(path, HostMpi)
    xp = np if host else cupy
    sync = (lambda: None) if host else cupy.cuda.get_current_stream().synchronize
    zeros = path.zeros if host else (lambda k: cupy.zeros(k, cupy.float32))
    for size in sizes:
        count = max(1, size // 4)
        x = zeros(count)
        t = measure(lambda x=x: path.all_reduce(x), sync)
        x[...] = me + 1
        path.all_reduce(x)
        wrong = int(xp.count_nonzero(x != n * (n + 1) / 2))
        rows.append(row(path, "all_reduce", count * 4, count, "sum", t, 2 * (n - 1) / n, wrong, copy_bw))
        per = max(1, size // (4 * n))
        inp, out = zeros(per), zeros(per * n)
        inp[...] = me + 1
        t = measure(lambda out=out, inp=inp: path.all_gather(out, inp), sync)
        want = xp.repeat(xp.arange(1, n + 1, dtype=xp.float32), per)
        wrong = int(xp.count_nonzero(out != want))
        rows.append(row(path, "all_gather", per * n * 4, per, "none", t, (n - 1) / n, wrong, copy_bw))


def row(
    path: DevicePath, op: str, size: int, count: int, redop: str, t: float, factor: float, wrong: int, copy_bw: dict
) -> dict:
    algbw = size / t / 1e9
    busbw = algbw * factor
    cbw = copy_bw.get(size, float("nan"))
    return {
        "path": path.name,
        "op": op,
        "size": size,
        "count": count,
        "type": "float",
        "redop": redop,
        "root": -1,
        "time_us": t * 1e6,
        "algbw": algbw,
        "busbw": busbw,
        "wrong": COMM.allreduce(wrong),
        "copy_gbps": cbw,
        "vs_copy": bc.ratio(busbw, cbw),
        "vs_raw": float("nan"),
        "host_gbps": float("nan"),
        "vs_host": float("nan"),
        "note": path.note,
    }


def compare(rows: list, host_bw: dict) -> None:
    """Fill vs_raw (raw NCCL's time / the row's) and host_gbps / vs_host (algbw / host bound)."""
    raw = {(r["op"], r["size"]): r["time_us"] for r in rows if r["path"] == "raw-nccl" and r["size"]}
    for r in rows:
        if not r["size"]:
            continue
        if (r["op"], r["size"]) in raw:
            r["vs_raw"] = bc.ratio(raw[(r["op"], r["size"])], r["time_us"])
        r["host_gbps"] = host_bw.get(r["size"], float("nan"))
        r["vs_host"] = bc.ratio(r["algbw"], r["host_gbps"])


def host_bandwidths(cupy: Any, sizes: list[int]) -> dict:
    """S / (t(device -> pinned host) + t(pinned host -> device)): the bound of host staging."""
    import cupyx  # noqa: PLC0415

    n = COMM.Get_size()
    wanted = sorted({max(1, s // 4) * 4 for s in sizes} | {max(1, s // (4 * n)) * n * 4 for s in sizes})
    sync = cupy.cuda.get_current_stream().synchronize
    out = {}
    for size in wanted:
        dev = cupy.ones(size // 4, cupy.float32)
        host = cupyx.empty_pinned(size // 4, cupy.float32)
        out[size] = size / measure(lambda dev=dev, host=host: (dev.get(out=host), dev.set(host)), sync) / 1e9
    return out


def copy_bandwidths(cupy: Any, sizes: list[int]) -> dict:
    """S / t of cupy.copyto for every byte size the ops use (the all_reduce and all_gather sizes)."""
    n = COMM.Get_size()
    wanted = sorted({max(1, s // 4) * 4 for s in sizes} | {max(1, s // (4 * n)) * n * 4 for s in sizes})
    sync = cupy.cuda.get_current_stream().synchronize
    out = {}
    for size in wanted:
        src, dst = cupy.ones(size // 4, cupy.float32), cupy.empty(size // 4, cupy.float32)
        out[size] = size / measure(lambda dst=dst, src=src: cupy.copyto(dst, src), sync) / 1e9
    return out


def write(rows: list, header: list[str], out_dir: Path) -> Path:
    n = COMM.Get_size()
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / f"gpu_np{n}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(rows)
    lines = [f"# GPU benchmark, {n} rank(s), float32", "", *header, "", *targets(rows), ""]
    cols = (
        "| size(B) | count | type | redop | root | time(us) | algbw(GB/s) | busbw(GB/s) | #wrong | "
        "copy bw(GB/s) | vs copy | vs raw | host bw(GB/s) | vs host |"
    )
    for op in ("all_reduce", "all_gather"):
        for path in dict.fromkeys(r["path"] for r in rows):
            sel = [r for r in rows if r["op"] == op and r["path"] == path]
            if not sel:
                continue
            lines += [f"## {op}: {path}", ""]
            if sel[0]["note"]:
                lines += [f"{sel[0]['note']}", ""]
            if sel[0]["size"] == 0:
                lines += ["(no measurements)", ""]
                continue
            lines += [cols, "|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
            lines += [
                f"| {r['size']} | {r['count']} | float | {r['redop']} | -1 | {bc.fmt(r['time_us'])} | "
                f"{bc.fmt(r['algbw'], 3)} | {bc.fmt(r['busbw'], 3)} | {r['wrong']} | "
                f"{bc.fmt(r['copy_gbps'], 1)} | {bc.fmt(r['vs_copy'], 3)} | {bc.fmt(r['vs_raw'], 3)} | "
                f"{bc.fmt(r['host_gbps'], 1)} | {bc.fmt(r['vs_host'], 3)} |"
                for r in sel
            ]
            lines.append("")
    path = out_dir / f"gpu_np{n}.md"
    path.write_text("\n".join(lines))
    return path


def targets(rows: list) -> list[str]:
    """The issue's targets from 16 MiB: nccl >= 0.9 of raw NCCL, host staging >= 0.5 of the host bound."""
    lines = []
    for op in ("all_reduce", "all_gather"):
        for name, col, label, bound in (
            ("nccl", "vs_raw", "time vs raw NCCL", 0.9),
            ("host-staging", "vs_host", "algbw vs host-copy bound", 0.5),
        ):
            sel = {r["size"]: r[col] for r in rows if r["path"] == name and r["op"] == op and r["size"]}
            big = [s for s in sel if s >= 16 << 20]
            lines.append(
                "- "
                + bc.verdict(
                    f"{op} {name} {label} >= {bound} from 16 MiB",
                    big,
                    lambda s, sel=sel: sel[s],
                    lambda v, bound=bound: v >= bound,
                    min,
                )
            )
        stg = {r["size"]: r for r in rows if r["path"] == "host-staging" and r["op"] == op and r["size"]}
        mpi = {r["size"]: r for r in rows if r["path"] == "host-mpi" and r["op"] == op and r["size"]}
        parts = [
            f"{bc.human_bytes(z)} {stg[z]['time_us'] / (mpi[z]['time_us'] + z / stg[z]['host_gbps'] / 1e3):.2f}"
            for z in sorted(stg)
            if z in mpi and z >= 1 << 20 and stg[z]["host_gbps"] > 0
        ]
        if parts:
            lines.append(f"- {op} host-staging time / (host-mpi time + device<->host copy time): " + ", ".join(parts))
        plain = {r["size"]: r for r in rows if r["path"] == "host-staging-unpipelined" and r["op"] == op and r["size"]}
        gain = [
            f"{bc.human_bytes(z)} {plain[z]['time_us'] / stg[z]['time_us']:.2f}x" for z in sorted(stg) if z in plain
        ]
        if gain:
            lines.append(f"- {op} host-staging, pipelined vs unpipelined (time ratio, same run): " + ", ".join(gain))
        sweep = {}
        for r in rows:
            if r["path"].startswith("host-staging@") and r["op"] == op and r["size"]:
                sweep.setdefault(r["path"].split("@")[1], []).append(
                    f"{bc.human_bytes(r['size'])} {bc.fmt(r['vs_host'], 3)}"
                )
        for chunk, cells in sweep.items():
            lines.append(f"- {op} host-staging with {chunk} chunks, vs host: " + ", ".join(cells))
    return lines


def unavailable(name: str, why: str) -> list[dict]:
    base = {f: "" for f in FIELDS}
    return [
        {**base, "path": name, "op": op, "size": 0, "note": f"not measured: {why}"}
        for op in ("all_reduce", "all_gather")
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--min-bytes", default="8")
    parser.add_argument("--max-bytes", default="256M")
    parser.add_argument("--factor", type=int, default=4)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument(
        "--staging-chunks",
        default="",
        help="also time pipelined host staging with these chunk sizes (e.g. 1M,4M,16M), from 16 MiB",
    )
    args = parser.parse_args()
    reason = skip_reason()
    if reason:
        if COMM.Get_rank() == 0:
            print(f"SKIPPED: GPU benchmark: {reason}")
        return 0
    import cupy  # noqa: PLC0415

    import mpidist  # noqa: PLC0415

    load = os.getloadavg()[0]
    local = COMM.Split_type(MPI.COMM_TYPE_SHARED)
    n_local, local_rank = local.Get_size(), local.Get_rank()
    device = local_rank % cupy.cuda.runtime.getDeviceCount()
    cupy.cuda.Device(device).use()
    sizes = bc.sweep(bc.parse_bytes(args.min_bytes), bc.parse_bytes(args.max_bytes), args.factor)
    copy_bw = copy_bandwidths(cupy, sizes)
    aware, how = cuda_aware_mpi()
    host_bw = host_bandwidths(cupy, sizes)
    paths = [
        ("raw-nccl", "", {}, nccl_ok(cupy, n_local)),
        ("nccl", "cpu:mpi,cuda:nccl", {}, nccl_ok(cupy, n_local)),
        ("cuda-aware-mpi", "mpi", {"MPIDIST_CUDA_AWARE": "1"}, "" if aware else f"not CUDA-aware ({how})"),
        ("host-staging", "mpi", {"MPIDIST_CUDA_AWARE": "0"}, ""),
        ("host-staging-unpipelined", "mpi", {"MPIDIST_CUDA_AWARE": "0", "MPIDIST_STAGING_CHUNK": "off"}, ""),
        ("host-mpi", "mpi", {}, ""),
    ]
    chunks = [c for c in args.staging_chunks.split(",") if c]
    paths += [(f"host-staging@{c}", "mpi", {"MPIDIST_CUDA_AWARE": "0", "MPIDIST_STAGING_CHUNK": c}, "") for c in chunks]
    rows: list = []
    for name, backend, env, why in paths:
        why = COMM.allreduce(why, op=MPI.MAX)
        if why:
            rows += unavailable(name, why)
            continue
        path = {"raw-nccl": RawNccl, "host-mpi": HostMpi}.get(name, DevicePath)(name, backend, env)
        try:
            why = path.start(mpidist, cupy)
            if why:
                rows += unavailable(name, why)
            else:
                big = [z for z in sizes if z >= 16 << 20] if "@" in name else sizes
                run_sizes(path, cupy, big, copy_bw, rows)
        finally:
            path.stop(mpidist)
    compare(rows, host_bw)
    props = cupy.cuda.runtime.getDeviceProperties(device)
    gpu = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    header = bc.machine_lines(COMM.Get_size(), load) + [
        f"- GPU: {gpu} (device {device} of rank 0; {n_local} rank(s) on this node)",
        f"- {bc.versions(cupy=cupy.__version__, mpidist=mpidist.__version__)}, CUDA-aware MPI: {aware} ({how})",
        f"- timing: median of {REPEATS} measurements of ~{TARGET_S * 1e3:.0f} ms, each the max over ranks of the "
        f"mean time per call (a barrier, back-to-back calls, then the stream synchronized)",
        "- busbw as nccl-tests: all_reduce 2(n-1)/n, all_gather (n-1)/n; copy bw: cupy.copyto of the same "
        "size on each rank's GPU, same run; vs copy = busbw / copy bw",
    ]
    if COMM.Get_rank() == 0:
        out = write(rows, header, Path(args.out))
        print(f"wrote {out} and {out.with_suffix('.csv')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
