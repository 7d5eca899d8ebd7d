"""The host cost of mpidist's device path, without a GPU: the routing and bookkeeping of one
small device collective, with the device work stubbed out.

A null CUDA stand-in replaces CuPy below mpidist's seams: :class:`NullShim` for the NCCL
path (``mpidist._backends.device.nccl_shim.use``: streams, events and NCCL calls that do nothing)
and :class:`NullRuntime` for host staging (``mpidist.device.runtime.register``: copies of
the 8-byte arrays between "device" and host memory). What is left is mpidist's own Python
per call: the public op, the router, argument checks, the flight recorder, stream and
event bookkeeping, completion tracking. The floor is the stand-in's NCCL call made
directly (``raw``), so ``over raw`` is mpidist's per-call cost in microseconds, the figure
the GPU target bounds (NCCL path <= 10 us over raw NCCL; docs/device.md, "Per-call cost").
On a GPU the CUDA calls themselves add ~0.5-1 us each (tools/profile_device_call.py).

Before/after in one run: ``--baseline REV`` also times the mpidist of git revision REV
(``git archive`` into a temporary directory, imported from there), in alternating rounds
with this tree's, and reports both.

Run: ``python benchmarks/bench_device_host.py [--baseline REV] [--calls 20000] [--rounds 7]
[--out benchmarks/results]`` (one process: a world of size 1); writes ``device_host.md``.
"""

from __future__ import annotations

import _bench_common as bc  # first: sets the BLAS thread variables

# isort: split

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable  # noqa: E402

import numpy as np  # noqa: E402

HERE = Path(__file__).resolve().parent
PATHS = ("raw", "nccl", "nccl-async", "staging")


class NullArray:
    """A "device" array: ``__cuda_array_interface__`` (v3, no stream) over host memory."""

    def __init__(self, n: int = 2, dtype: Any = np.float32) -> None:
        self.host = np.ones(n, dtype)
        self.dtype = self.host.dtype
        self.shape = self.host.shape
        self.size = self.host.size
        self.nbytes = self.host.nbytes
        self.device = 0
        self.__cuda_array_interface__ = {
            "shape": self.shape,
            "typestr": self.dtype.str,
            "data": (self.host.ctypes.data, False),
            "version": 3,
            "strides": None,
            "stream": None,
        }


class NullStream:
    ptr = 0

    def __init__(self, ptr: int = 0) -> None:
        self.ptr = ptr


class NullComm:
    """NCCL calls that do nothing (one rank: NCCL's all-reduce is a no-op there too)."""

    def allReduce(self, *args: Any) -> None:  # noqa: N802  (NCCL's names)
        pass

    broadcast = reduce = allGather = reduceScatter = send = recv = allReduce

    def destroy(self) -> None:
        pass


class NullShim:
    """The shim interface of ``mpidist._backends.device.nccl_shim.CupyShim``, doing no device work.
    ``calls`` counts the calls that are CUDA runtime calls on a GPU (device queries and
    switches, stream queries, event creation, records, waits and queries)."""

    xp = np
    error = RuntimeError

    def __init__(self) -> None:
        self._stream = NullStream(7)
        self.calls = 0

    def version(self) -> int:
        return 22809

    def unique_id(self) -> bytes:
        return os.urandom(128)

    def communicator(self, size: int, uid: Any, rank: int, mpi_comm: Any) -> NullComm:
        return NullComm()

    def group_start(self) -> None:
        pass

    group_end = group_start

    def current_device(self) -> int:
        self.calls += 1
        return 0

    def device(self, device: int) -> Any:
        self.calls += 1
        return contextlib.nullcontext()

    def device_key(self, device: int) -> str:
        return f"null:{device}"

    def device_of(self, x: Any, ptr: int) -> int:
        return 0

    def from_dlpack(self, x: Any) -> Any:
        return x

    def current_stream(self) -> NullStream:
        self.calls += 1
        return self._stream

    def external_stream(self, ptr: int) -> NullStream:
        return NullStream(ptr)

    def new_stream(self) -> NullStream:
        return NullStream(9)

    def new_event(self) -> object:
        self.calls += 1
        return object()

    def record(self, event: Any, stream: Any) -> None:
        self.calls += 1
        pass

    def wait_event(self, stream: Any, event: Any) -> None:
        self.calls += 1
        pass

    def done(self, event: Any) -> bool:
        self.calls += 1
        return True

    def synchronize(self, stream: Any) -> None:
        pass

    def on_stream(self, stream: Any) -> Any:
        return contextlib.nullcontext()

    def view(self, ptr: int, count: int, dtype: Any, device: int, owner: Any = None) -> np.ndarray:
        return np.empty(count, dtype)

    def empty(self, count: int, dtype: Any) -> np.ndarray:
        return np.empty(count, dtype)

    def pointer(self, arr: np.ndarray) -> int:
        return int(arr.ctypes.data)

    def copy(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        pass


class NullRuntime:
    """mpidist's device runtime for :class:`NullArray`: numpy copies, no synchronization."""

    name = "null"

    def owns(self, x: Any) -> bool:
        return isinstance(x, NullArray)

    def device_of(self, x: Any) -> int:
        return 0

    def shape_dtype(self, x: Any) -> tuple:
        return x.shape, x.dtype

    def c_contiguous(self, x: Any) -> bool:
        return True

    def strides(self, x: Any) -> None:
        return None

    def span(self, x: Any) -> tuple:
        return x.host.ctypes.data, x.nbytes

    def synchronize(self, x: Any) -> None:
        pass

    def compute_view(self, x: Any) -> np.ndarray:
        return x.host

    def pinned(self, nbytes: int) -> np.ndarray:
        return np.empty(nbytes, np.uint8)

    def to_host(self, x: Any, out: np.ndarray) -> None:
        np.copyto(out, x.host)

    def to_device(self, src: np.ndarray, x: Any) -> None:
        np.copyto(x.host, src)

    def device_count(self) -> int:
        return 1


def per_call_us(fn: Callable[[], Any], calls: int, shim: NullShim, counts: dict, path: str) -> float:
    for _ in range(min(calls, 2000)):
        fn()
    before = shim.calls
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    took = (time.perf_counter() - t) / calls * 1e6
    counts[path] = (shim.calls - before) / calls
    return took


def measure(calls: int) -> dict:
    """One round: the mean host time per call of each path, in microseconds."""
    import mpidist as dist
    from mpidist.device import runtime

    try:
        from mpidist._backends.device import nccl_shim
    except ImportError:  # a baseline from before the folders (40aa2fd): mpidist/device/_nccl_shim.py
        from mpidist.device import _nccl_shim as nccl_shim  # type: ignore[no-redef]

    shim = NullShim()
    nccl_shim.use(shim)
    runtime.register(NullRuntime())
    x = NullArray()
    comm = NullComm()
    ptr = x.host.ctypes.data
    counts: dict = {}
    out = {
        "raw": per_call_us(
            lambda: comm.allReduce(ptr, ptr, 2, 7, 0, shim.current_stream().ptr), calls, shim, counts, "raw"
        )
    }
    dist.init_process_group(backend="cpu:mpi,cuda:nccl")
    out["nccl"] = per_call_us(lambda: dist.all_reduce(x), calls, shim, counts, "nccl")
    out["nccl-async"] = per_call_us(lambda: dist.all_reduce(x, async_op=True).wait(), calls, shim, counts, "nccl-async")
    dist.destroy_process_group()
    os.environ["MPIDIST_CUDA_AWARE"] = "0"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dist.init_process_group(backend="mpi")
        out["staging"] = per_call_us(lambda: dist.all_reduce(x), calls, shim, counts, "staging")
        dist.destroy_process_group()
    return {"us": out, "cuda_calls": counts}


def child(tree: str, calls: int) -> dict:
    """:func:`measure` in a fresh interpreter importing mpidist from ``tree``."""
    env = dict(os.environ, PYTHONPATH=tree + os.pathsep + str(HERE))
    for var in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK"):
        env.pop(var, None)
    run = subprocess.run(
        [sys.executable, __file__, "--measure", "--calls", str(calls)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        cwd=tempfile.gettempdir(),
    )
    if run.returncode != 0:
        raise SystemExit(f"bench_device_host: the run over {tree} failed:\n{run.stdout}\n{run.stderr}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def report(trees: dict, rounds: list, out: Path, calls: int, load: float) -> None:
    names = list(trees)
    med = {name: {p: statistics.median(r[name]["us"][p] for r in rounds) for p in PATHS} for name in names}
    cuda = {name: rounds[-1][name]["cuda_calls"] for name in names}
    lines = [
        "# Host cost of a small device collective, device work stubbed out (CPU)",
        "",
        *bc.machine_lines(1, load),
        f"- {bc.versions()}",
        f"- method: {len(rounds)} alternating rounds of {calls} back-to-back all_reduce calls of an 8-byte "
        'float32 "device" array per tree and path (one process, world of size 1); the median of the rounds\' '
        "means. Null CUDA stand-ins (benchmarks/bench_device_host.py): what is left is mpidist's own Python. "
        "CUDA calls/op: the stand-in's calls that are CUDA runtime calls on a GPU (each ~0.5-2 us there)",
        f"- trees: {', '.join(f'{k} = {v}' for k, v in trees.items())}",
        "",
        "| path | " + " | ".join(f"{n}: us/call | over raw (us) | CUDA calls/op" for n in names) + " |",
        "|---|" + "---:|---:|---:|" * len(names),
    ]
    for p in PATHS:
        cells = []
        for n in names:
            cells += [
                bc.fmt(med[n][p]),
                bc.fmt(med[n][p] - med[n]["raw"]) if p != "raw" else "",
                bc.fmt(cuda[n][p], 1),
            ]
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    if len(names) == 2:
        a, b = names
        lines.append("")
        for p in PATHS[1:]:
            over_a, over_b = med[a][p] - med[a]["raw"], med[b][p] - med[b]["raw"]
            lines.append(
                f"- {p}: {b} {bc.fmt(over_b)} us over raw, {a} {bc.fmt(over_a)} us ({bc.fmt(over_b / over_a)}x)"
            )
    out.mkdir(parents=True, exist_ok=True)
    (out / "device_host.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {out / 'device_host.md'}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", help="also time the mpidist of this git revision")
    p.add_argument("--calls", type=int, default=20000)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.measure:
        print(json.dumps(measure(args.calls)))
        return
    root = HERE.parent
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="mpidist-baseline-") as tmp:
        trees = {}
        if args.baseline:
            rev = subprocess.run(
                ["git", "-C", str(root), "rev-parse", "--short", args.baseline],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip()
            archive = subprocess.run(
                ["git", "-C", str(root), "archive", rev, "mpidist"], capture_output=True, check=True
            )
            subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
            trees[f"baseline {rev}"] = tmp
        trees["this tree"] = str(root)
        rounds = []
        for i in range(args.rounds):
            rounds.append({name: child(tree, args.calls) for name, tree in trees.items()})
            print(f"round {i + 1}/{args.rounds}: {rounds[-1]}", flush=True)
        head = subprocess.run(
            ["git", "-C", str(root), "describe", "--always", "--dirty"], capture_output=True, text=True, check=False
        ).stdout.strip()
        labels = {k: (head or "?") if k == "this tree" else k.split()[-1] for k in trees}
        report(labels, rounds, args.out, args.calls, load)


if __name__ == "__main__":
    main()
