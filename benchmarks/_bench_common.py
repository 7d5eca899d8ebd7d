"""Shared pieces of the MPI benchmark scripts: sizes, aligned buffers, timing, machine info,
and a torch.distributed gloo group started on the ranks of an MPI job.

Import it before numpy (it sets the BLAS/OpenMP thread variables to 1 when unset, so no
thread pool competes with the ranks for the cores). The scripts in ``benchmarks/`` run as
``python benchmarks/SCRIPT.py``, which puts this folder on ``sys.path``.

Timing method (:func:`timed`, :func:`calibrate`, :func:`warm_up`): a measurement is a
barrier, then ``iters`` back-to-back calls; its value is the MAX over ranks of each rank's
mean time per call. ``iters`` is calibrated so that a measurement lasts a target time.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # before numpy is imported: no BLAS thread pools

import contextlib  # noqa: E402
import datetime  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from functools import partial  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable, Optional  # noqa: E402

import mpi4py  # noqa: E402
import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

PAGE = 4096
CALIBRATION_ROUNDS = 40

# ---------------------------------------------------------------- sizes


def parse_bytes(text: str) -> int:
    """``"8"``, ``"4K"``, ``"64M"``, ``"1G"`` (optionally ending in ``B``) -> bytes, binary
    multiples as nccl-tests' ``-b``/``-e``. Raises ValueError on anything else."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("B")
    if text and text[-1] in units:
        return int(text[:-1]) * units[text[-1]]
    return int(text)


def human_bytes(n: int) -> str:
    """``4096`` -> ``"4 KiB"``; sizes that are not whole KiB/MiB/GiB stay in bytes."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"


def sweep(min_bytes: int, max_bytes: int, factor: int, itemsize: int = 1) -> list[int]:
    """``min_bytes``, every power of ``factor`` strictly between, and ``max_bytes``, sorted;
    each rounded down to whole elements of ``itemsize`` bytes (at least one)."""
    sizes, p = {min_bytes, max_bytes}, 1
    while p < max_bytes:
        if p > min_bytes:
            sizes.add(p)
        p *= factor
    return sorted({max(itemsize, s - s % itemsize) for s in sizes})


def aligned_empty(count: int, dtype: Any) -> np.ndarray:
    """An uninitialized ``count``-element array starting on a page boundary (so that
    timings do not depend on where the heap happened to put it)."""
    dtype = np.dtype(dtype)
    raw = np.empty(count * dtype.itemsize + PAGE, np.uint8)
    start = -raw.ctypes.data % PAGE
    return raw[start : start + count * dtype.itemsize].view(dtype)


def aligned_zeros(count: int, dtype: Any) -> np.ndarray:
    """:func:`aligned_empty`, zero-filled."""
    out = aligned_empty(count, dtype)
    out.fill(0)
    return out


# ---------------------------------------------------------------- timing


def idle_barrier(comm: MPI.Comm) -> None:
    """A barrier that sleeps instead of spinning, so ranks that wait leave the cores alone."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(1e-3)


def timed(comm: MPI.Comm, fn: Callable[[], object], iters: int, active: bool = True) -> float:
    """Barrier, ``iters`` calls of ``fn`` (where ``active``): max over ranks of the mean
    seconds per call. Collective over ``comm``."""
    comm.Barrier()
    elapsed = 0.0
    if active:
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        elapsed = time.perf_counter() - t0
    idle_barrier(comm)
    return comm.allreduce(elapsed / iters, op=MPI.MAX)


def warm_up(comm: MPI.Comm, fn: Callable[[], object], calls: int, budget_s: float, active: bool = True) -> float:
    """Up to ``calls`` untimed calls, fewer when one call is slow: the first alone, the
    rest only while they fit in ``budget_s``. Returns the time of the first call."""
    first = timed(comm, fn, 1, active)
    more = min(calls - 1, int(budget_s / first) if first > 0 else calls - 1)
    if more > 0:
        timed(comm, fn, more, active)
    return first


def calibrate(
    comm: MPI.Comm,
    fn: Callable[[], object],
    target_s: float,
    active: bool = True,
    guess_s: float = 0.0,
    max_iters: Optional[int] = None,
    min_iters: int = 1,
) -> int:
    """Calls per measurement so that one lasts ``target_s`` +- 1/3 (at least ``min_iters`` calls).

    Starts from ``target_s / guess_s`` calls when a per-call time is known (the warm-up's),
    doubles the batch until it is long enough to time (>= target / 8), then rescales it
    until a batch lands in the window; so one slow batch cannot shrink the count much.
    ``max_iters`` caps the result. Collective over ``comm`` (every rank gets the same count).
    """
    cap = max_iters or 1 << 40
    iters = max(min_iters, min(cap, int(target_s / guess_s) if guess_s > 0 else min_iters))
    for _ in range(CALIBRATION_ROUNDS):
        batch = timed(comm, fn, iters, active) * iters
        if batch >= target_s * 2 / 3 and (batch <= target_s * 4 / 3 or iters == min_iters):
            break
        if iters >= cap and batch < target_s:
            break
        nxt = 2 * iters if batch < target_s / 8 else math.ceil(iters * target_s / batch)
        iters = max(min_iters, min(cap, nxt))
    return iters


@dataclass
class Measurement:
    """The measurements of one case: seconds per call, each the max over ranks of the mean."""

    samples: list[float] = field(default_factory=list)
    iters: int = 0

    @property
    def time_s(self) -> float:
        return statistics.median(self.samples) if self.samples else math.nan


def ratio(a: float, b: float) -> float:
    """``a / b``; NaN when ``b`` is 0 or either is NaN."""
    return a / b if b and not (math.isnan(a) or math.isnan(b)) else math.nan


def fmt(x: float, digits: int = 2) -> str:
    """A table cell: ``x`` with ``digits`` decimals, ``-`` for NaN."""
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def verdict(
    label: str,
    sizes: list[int],
    value: Callable[[int], float],
    ok: Callable[[float], bool],
    worst: Callable,
    unit: str = "",
) -> str:
    """A target's line: ``value(s)`` for each of ``sizes`` (NaN: not measured), the ``worst``
    (min or max) of them, and MET when ``ok`` holds at every measured size."""
    vals = [(value(s), s) for s in sizes if not math.isnan(value(s))]
    if not vals:
        return f"target: {label}: not measured"
    v, s = worst(vals)
    met = all(ok(x) for x, _ in vals)
    return (
        f"target: {label}: worst {v:.3f}{unit} at {human_bytes(s)} over {len(vals)} sizes -> "
        f"{'MET' if met else 'NOT MET'}"
    )


# ---------------------------------------------------------------- all-reduce variants (bench_allreduce, bench_shm)

#: Calls per measurement at the least, in the all-reduce benchmarks.
MIN_ITERS = 3
#: The all-reduce validation values stay small integers (exact in float32).
PATTERN_PERIOD = 251


@dataclass
class Case:
    """One timed all-reduce variant: ``call(buf)`` on every rank, or only where ``active``."""

    name: str
    call: Callable[[np.ndarray], object]
    active: bool = True


@dataclass
class Result:
    """One variant at one size: the median time per call, and the spread of the measurements."""

    name: str
    nbytes: int
    samples: list[float]
    iters: int
    wrong: int

    @property
    def time_s(self) -> float:
        return statistics.median(self.samples)


def algbw(r: Result) -> float:
    """nccl-tests' algorithm bandwidth S / t, GB/s."""
    return r.nbytes / r.time_s / 1e9


def count_wrong(comm: MPI.Comm, case: Case, count: int, dtype: Any = np.float32) -> int:
    """Sum rank-dependent small integers with ``case``; wrong elements over all ranks."""
    pattern = (np.arange(count) % PATTERN_PERIOD + 1).astype(dtype)
    n = comm.Get_size()
    buf = pattern * (comm.Get_rank() + 1)
    case.call(buf)
    return comm.allreduce(int(np.count_nonzero(buf != pattern * (n * (n + 1) // 2))), op=MPI.SUM)


def bench_size(
    comm: MPI.Comm, cases: list[Case], nbytes: int, args: Any, validated: tuple, dtype: Any = np.float32
) -> dict[str, Result]:
    """Validate (the cases named in ``validated``), warm up (``args.warmup`` calls), calibrate
    (``args.iters`` calls, or :func:`calibrate`'s to ``args.target_s``) and time every case
    at one size, ``args.reps`` measurements each, interleaved."""
    count = nbytes // np.dtype(dtype).itemsize
    wrong = {c.name: count_wrong(comm, c, count, dtype) for c in cases if c.name in validated}
    buf = aligned_zeros(count, dtype)
    calls = {c.name: partial(c.call, buf) for c in cases}
    iters = {}
    for c in cases:
        for _ in range(args.warmup if c.active else 0):
            calls[c.name]()
        iters[c.name] = args.iters or calibrate(comm, calls[c.name], args.target_s, c.active, min_iters=MIN_ITERS)
    samples: dict[str, list[float]] = {c.name: [] for c in cases}
    for _ in range(args.reps):
        for c in cases:
            samples[c.name].append(timed(comm, calls[c.name], iters[c.name], c.active))
    return {c.name: Result(c.name, nbytes, samples[c.name], iters[c.name], wrong.get(c.name, 0)) for c in cases}


# ---------------------------------------------------------------- models (the DDP benchmarks)


def build_mlp(sizes: tuple, rng: np.random.Generator) -> Any:
    """An ``mpidist.nn`` MLP: Linear layers ``sizes[i] -> sizes[i + 1]``, ReLU between them,
    initialized from ``rng``."""
    from mpidist.nn import Linear, ReLU, Sequential  # noqa: PLC0415  (only scripts that train import it)

    layers: list = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(Linear(a, b, rng=rng))
        if i < len(sizes) - 2:
            layers.append(ReLU())
    return Sequential(*layers)


# ---------------------------------------------------------------- environment


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, or what platform knows."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def mpi_library() -> str:
    """First line of MPI_Get_library_version, e.g. ``MPICH Version: 5.0.2``."""
    return " ".join(MPI.Get_library_version().splitlines()[0].split())


def machine_lines(n: int, load_at_start: float) -> list[str]:
    """Markdown bullet lines: date, machine, cores, load, MPI library and thread level."""
    cores = os.cpu_count()
    lines = [
        f"- date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
        f"- machine: {platform.platform()}, {cpu_model()}, os.cpu_count() = {cores}; "
        f"1-min load average {load_at_start:.2f} at start, {os.getloadavg()[0]:.2f} at the end",
        f"- MPI: {mpi_library()} (thread level {MPI.Query_thread()}, "
        f"MPI_THREAD_MULTIPLE = {MPI.THREAD_MULTIPLE}), {n} ranks on one node",
    ]
    if cores and n > cores:
        lines.append(f"- **oversubscribed**: {n} ranks on {cores} cores; timings are noisy")
    return lines


def versions(**extra: Optional[str]) -> str:
    """``python X, numpy Y, mpi4py Z`` plus ``extra`` (name -> version, None = not installed)."""
    items = {"python": platform.python_version(), "numpy": np.__version__, "mpi4py": mpi4py.__version__}
    items.update({k: v or "not installed" for k, v in extra.items()})
    return ", ".join(f"{k} {v}" for k, v in items.items())


def write_report(
    out: Path,
    name: str,
    title: str,
    n: int,
    load: float,
    notes: list[str],
    rows: list[str],
    **versions_extra: Optional[str],
) -> Path:
    """Write a Markdown report ``out/name`` (title, machine lines, versions with mpidist's and
    ``versions_extra``, ``notes`` as bullet lines, the table ``rows``), print it, and return
    its path (rank 0 only)."""
    import mpidist  # noqa: PLC0415  (the scripts import it after this module)

    versions_extra.setdefault("mpidist", mpidist.__version__)
    text = "\n".join(
        [
            f"# {title}",
            "",
            *machine_lines(n, load),
            f"- {versions(**versions_extra)}",
            *(f"- {note}" for note in notes),
            "",
            *rows,
            "",
        ]
    )
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    path.write_text(text)
    print(text, flush=True)
    print(f"# wrote {path}", flush=True)
    return path


def thread_limit() -> contextlib.AbstractContextManager:
    """threadpoolctl's limit of BLAS/OpenMP pools to 1 thread where it is installed (the
    environment variables set at import do the same for pools not yet started)."""
    try:
        from threadpoolctl import threadpool_limits  # noqa: PLC0415
    except ImportError:
        return contextlib.nullcontext()
    return threadpool_limits(1)


# ---------------------------------------------------------------- torch.distributed peer


@dataclass
class Gloo:
    """A torch.distributed gloo default group on the MPI job's ranks (or why there is none)."""

    dist: Any = None
    torch: Any = None
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.dist is not None

    @property
    def version(self) -> Optional[str]:
        return self.torch.__version__ if self.torch is not None else None

    def close(self) -> None:
        if self.ok and self.dist.is_initialized():
            self.dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_gloo(comm: MPI.Comm, wanted: bool = True) -> Gloo:
    """``torch.distributed.init_process_group("gloo")`` with world size and rank from ``comm``.

    Rank 0 picks a free TCP port on 127.0.0.1 and broadcasts it over MPI (the rendezvous
    is ``tcp://127.0.0.1:PORT``, so every rank must be on rank 0's node); gloo's sockets
    use the loopback interface unless ``GLOO_SOCKET_IFNAME`` says otherwise. Sets
    ``torch.set_num_threads(1)``. Collective over ``comm``. When torch is missing on any
    rank, or the ranks span nodes, returns a Gloo whose ``reason`` says why.
    """
    if not wanted:
        return Gloo(reason="disabled (--no-torch)")
    try:
        import torch  # noqa: PLC0415
        import torch.distributed as dist  # noqa: PLC0415

        reason = "" if dist.is_available() and dist.is_gloo_available() else "torch without gloo"
    except ImportError as exc:
        torch, dist, reason = None, None, f"torch not installed ({exc})"
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    one_node = node.Get_size() == comm.Get_size()
    node.Free()
    reasons = [r for r in comm.allgather(reason if one_node else "ranks span several nodes") if r]
    if reasons:
        return Gloo(reason=reasons[0])
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    port = comm.bcast(_free_port() if comm.Get_rank() == 0 else None, root=0)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=comm.Get_size(), rank=comm.Get_rank()
    )
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    return Gloo(dist=dist, torch=torch)
