"""torch.distributed through the "mpidist" backend against gloo, raw mpi4py and a do-nothing backend.

Run as ``mpiexec -n N python benchmarks/bench_torch.py [--min-bytes 8 --max-bytes 64M --factor 4
--quick --no-ddp --out benchmarks/results]``. Needs torch (the ``torch`` extra).

One job, four torch groups on the same ranks (mpidist, gloo, noop, floor) and raw mpi4py:

* ``mpidist``: the default group, ``init_process_group("mpidist", init_method="tcp://127.0.0.1:PORT")``
  (``import mpidist.torch``; ranks from MPI; the TCP store, port picked by rank 0 and
  broadcast over MPI, is only there so that a gloo group can be made beside it:
  mpidist's own ``mpi://`` store is process-local);
* ``gloo``: ``new_group(backend="gloo")`` on every rank (loopback, ``GLOO_SOCKET_IFNAME=lo``);
* ``raw``: ``Comm.Allreduce(MPI.IN_PLACE, [x, MPI.FLOAT], MPI.SUM)`` through mpi4py on a Dup of
  COMM_WORLD, on the numpy view of the same tensor: what MPI itself costs;
* ``noop``: ``new_group(backend="noop")``, a Python ``torch.distributed.ProcessGroup`` registered
  here whose ``allreduce`` returns None at once (a finished synchronous op): torch's own
  front end (``dist.all_reduce``'s checks, options object, the call into Python) and nothing
  else. ``mpidist - noop`` is what the backend adds to it, communication included;
* ``floor``: ``new_group(backend="floor")``, the same Python ProcessGroup whose ``allreduce`` is
  ``Allreduce(MPI.IN_PLACE, tensors[0].numpy(), MPI.SUM)`` on raw's Dup of COMM_WORLD and nothing
  else (no check, no other op, no error handling): the least any Python backend over MPI
  adds to torch's front end. ``floor - noop`` is that least, ``mpidist - floor`` what
  mpidist adds beyond it.

Part 1, ``dist.all_reduce(t, group=...)`` on a float32 CPU tensor (``torch.from_numpy`` of a
page-aligned buffer), SUM, sizes S = ``--min-bytes``, every power of ``--factor`` between,
``--max-bytes`` (8 B ... 64 MiB). Columns as nccl-tests (size count type redop root time algbw
busbw #wrong; busbw = algbw * 2(n-1)/n; doc/PERFORMANCE.md). #wrong: each implementation
first reduces rank-scaled small integers once and every element is checked (noop: not
checked, ``n/a``). Timing as ``bench_collectives.py`` (its code): per case up to
``--warmup`` calls, calls per measurement calibrated to ``--target-ms``, ``--reps``
measurements taken round-robin over the cases (the order rotated each pass), each the MAX
over ranks of the mean time per call; gloo at most ``--gloo-max-iters`` calls. Ratios
(``gloo/mpidist``, ``mpidist/raw``) are the median over passes of the per-pass ratio,
``mpidist - noop`` the median of the per-pass difference: a slow spell of the machine
hits both sides.

Part 2 (unless ``--no-ddp``): one ``DistributedDataParallel`` step (zero_grad, forward,
cross-entropy, backward with DDP's bucketed all-reduce, SGD step) of an MLP
``--ddp-width`` wide with ``--ddp-layers`` hidden layers (784 inputs, 10 classes; 3.2 M
parameters by default, 12.7 MB of gradients), a fixed batch of ``--ddp-batch`` samples per
rank, default DDP settings (25 MB buckets), one torch thread per rank: the same model
(same initial parameters) wrapped twice, once over mpidist's group, once over gloo's.
Before timing, both run 3 steps from the same start on the same data and their
parameters are compared (at 2 ranks every sum has two terms, so they must be bitwise
equal; else the largest difference is shown). Then measurements of ``--ddp-target-ms``
(calibrated step counts) alternate between the two, ``--ddp-reps`` each;
``gloo/mpidist`` is the median per-pair ratio. With ``--ddp-compile BACKEND`` (default
``aot_eager``; ``none``: not) two more DDPs of the same start run under
``torch.compile(ddp, backend=BACKEND)`` in the same rotation ("mpidist compiled", "gloo
compiled"; on the CPU torch compiles no graph of a DDP model: docs/torch.md, "torch.compile").

Output (rank 0): tables on stdout and in ``--out``/``torch_np{N}.md``, the all-reduce rows in
``torch_np{N}.csv`` (``bench_collectives.py``'s columns), the DDP rows in
``torch_np{N}_ddp.csv``. The last lines printed are the headline figures and whether each
target is met (issue 13): gloo/mpidist >= 10x up to 64 KiB, >= 4x at 1 MiB, >= 2x at 16-64
MiB; DDP step over mpidist no slower than over gloo; the backend's cost over torch's front end
<= 5 us at 8 B, read two ways: mpidist - noop (MPI's own time included) and mpidist - noop -
raw (without it). Exit
status 1 when an element is wrong or the two DDP models differ at 2 ranks.
"""

from __future__ import annotations

import _bench_common as bc  # noqa: I001  (first: sets the thread variables before numpy)

# isort: split
import argparse
import copy
import csv
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional

import bench_collectives as bcoll
from mpi4py import MPI

import mpidist

IMPLS = ("mpidist", "gloo", "raw", "noop", "floor")
NOOP, FLOOR = "noop", "floor"
HEADLINE_SIZES = (8, 4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20)
FRONT_END_BUDGET_US = 5.0
TIGHT_BUDGET_US = 3.0  # issue 44's target for mpidist - noop at 8 B


# ---------------------------------------------------------------- setup


def python_backend(dist: Any, name: str, allreduce: Callable[[Any], None]) -> None:
    """Register backend ``name``: a Python ProcessGroup whose ``allreduce`` calls
    ``allreduce(tensors)`` and returns None (torch's sign of a finished synchronous op)."""

    class Group(dist.ProcessGroup):
        def __init__(self, rank: int, size: int) -> None:
            super().__init__(rank, size)
            self._name = self._desc = ""

        def getBackendName(self) -> str:  # noqa: N802  (torch's names)
            return name

        def setGroupName(self, name: str) -> None:  # noqa: N802
            self._name = name

        def getGroupName(self) -> str:  # noqa: N802
            return self._name

        def setGroupDesc(self, desc: str) -> None:  # noqa: N802
            self._desc = desc

        def getGroupDesc(self) -> str:  # noqa: N802
            return self._desc

        def allreduce(self, tensors: Any, opts: Any = None, timeout: Any = None) -> None:
            allreduce(tensors)

    def create(options: Any, backend_options: Any = None) -> Group:
        return Group(int(options.group_rank), int(options.group_size))

    dist.Backend.register_backend(name, create, extended_api=True, devices=["cpu"])


@dataclass
class TorchEnv(bcoll.Env):
    """bench_collectives' Env plus the torch groups."""

    groups: dict = field(default_factory=dict)  # impl -> torch ProcessGroup (None: the default group)


def start(comm: MPI.Comm) -> TorchEnv:
    """The default group over mpidist, a gloo, a noop and a floor group on every rank. Collective."""
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    import mpidist.torch  # noqa: F401, PLC0415  (registers "mpidist")

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    port = comm.bcast(bc._free_port() if comm.Get_rank() == 0 else None, root=0)
    dist.init_process_group(
        "mpidist", init_method=f"tcp://127.0.0.1:{port}", rank=comm.Get_rank(), world_size=comm.Get_size()
    )
    dup = comm.Dup()  # raw's and floor's communicator, and the timing's (freed at the end)
    python_backend(dist, NOOP, lambda tensors: None)
    python_backend(dist, FLOOR, lambda tensors: dup.Allreduce(MPI.IN_PLACE, tensors[0].numpy(), MPI.SUM))
    groups = {"mpidist": None, "gloo": dist.new_group(backend="gloo")}
    groups.update({name: dist.new_group(backend=name) for name in (NOOP, FLOOR)})
    return TorchEnv(dup, comm.Get_rank(), comm.Get_size(), bc.Gloo(dist=dist, torch=torch), groups)


class TorchAllReduce(bcoll.AllReduce):
    """``dist.all_reduce(t, group=g)`` for each group, and raw mpi4py on the tensor's numpy view."""

    api = (
        "`dist.all_reduce(t, group=g)` (in place) for g = mpidist (the default group), gloo, noop and floor; "
        "raw `Allreduce(IN_PLACE, t.numpy(), SUM)`"
    )

    def calls(self, b: dict, variant: str) -> dict:
        e, x = self.env, b["x"]
        t = e.t(x)
        out: dict[str, Callable[[], object]] = {
            impl: partial(e.gloo.dist.all_reduce, t, group=e.groups[impl]) for impl in ("mpidist", "gloo")
        }
        out["raw"] = partial(e.comm.Allreduce, MPI.IN_PLACE, [x, bcoll.FT], MPI.SUM)
        for impl in (NOOP, FLOOR):
            out[impl] = partial(e.gloo.dist.all_reduce, t, group=e.groups[impl])
        return out

    def wrong(self, b: dict, impl: str) -> int:
        return 0 if impl == NOOP else super().wrong(b, impl)


def run_sweep(env: TorchEnv, args: argparse.Namespace) -> tuple[list[bcoll.Row], bcoll.CopyRef]:
    copy_ref, rows, t0 = bcoll.CopyRef(env.rank), [], time.perf_counter()
    for nominal in bc.sweep(args.min_bytes, args.max_bytes, args.factor, bcoll.ITEM):
        rows += bcoll.run_collective(env, TorchAllReduce(env, nominal // bcoll.ITEM), nominal, copy_ref, args)
        if env.rank == 0:
            print(f"# {bc.human_bytes(nominal):>8}: done at {time.perf_counter() - t0:6.1f} s", flush=True)
    return rows, copy_ref


# ---------------------------------------------------------------- DDP step


@dataclass
class DdpResult:
    impl: str
    m: bc.Measurement
    params: int
    max_diff: float  # largest |parameter difference| from the other DDP after the check steps

    @property
    def time_s(self) -> float:
        return self.m.time_s


def build_mlp(torch: Any, width: int, layers: int) -> Any:
    nn = torch.nn
    mods: list = [nn.Linear(784, width), nn.ReLU()]
    for _ in range(layers - 1):
        mods += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*mods, nn.Linear(width, 10))


def bench_ddp(env: TorchEnv, args: argparse.Namespace) -> list[DdpResult]:
    """Two DDPs of one model (mpidist's group, gloo's): checked equal, then timed alternately."""
    torch = env.gloo.torch
    torch.manual_seed(0)
    base = build_mlp(torch, args.ddp_width, args.ddp_layers)
    gen = torch.Generator().manual_seed(1 + env.rank)
    x = torch.randn(args.ddp_batch, 784, generator=gen)
    y = torch.randint(0, 10, (args.ddp_batch,), generator=gen)
    nn = torch.nn
    ddps, opts = {}, {}
    kinds = ("", " compiled") if args.ddp_compile != "none" else ("",)  # compiled: the same DDPs under torch.compile
    for kind in kinds:
        for impl in ("mpidist", "gloo"):  # each from the same start
            model = copy.deepcopy(base)
            ddp = nn.parallel.DistributedDataParallel(model, process_group=env.groups[impl])
            ddps[impl + kind] = torch.compile(ddp, backend=args.ddp_compile) if kind else ddp
            opts[impl + kind] = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step(impl: str) -> None:
        opts[impl].zero_grad(set_to_none=False)
        nn.functional.cross_entropy(ddps[impl](x), y).backward()
        opts[impl].step()

    for impl in ddps:  # the check: same start, same data, same steps
        for _ in range(3):
            step(impl)
    pm, pg = (list(ddps[i].module.parameters()) for i in ("mpidist", "gloo"))
    diff = max(float((a - b).abs().max()) for a, b in zip(pm, pg))
    diff = env.comm.allreduce(diff, op=MPI.MAX)
    n_params = sum(p.numel() for p in pm)
    ms = {}
    for impl in ddps:
        call = partial(step, impl)
        first = bc.warm_up(env.comm, call, 3, args.ddp_target_s)
        ms[impl] = bc.Measurement(iters=bc.calibrate(env.comm, call, args.ddp_target_s, guess_s=first))
    order = list(ddps)
    for k in range(args.ddp_reps):
        for impl in order[k % len(order) :] + order[: k % len(order)]:
            ms[impl].samples.append(bc.timed(env.comm, partial(step, impl), ms[impl].iters))
    return [DdpResult(impl, ms[impl], n_params, diff) for impl in ddps]


def ddp_ratio(res: list[DdpResult], mpidist: str = "mpidist") -> float:
    """gloo's step time over mpidist's (``mpidist``: "mpidist" or "mpidist compiled", against
    the gloo DDP of the same kind), the median of the alternated measurements' ratios."""
    by = {r.impl: r for r in res}
    gloo = by[mpidist.replace("mpidist", "gloo")]
    return statistics.median(g / m for g, m in zip(gloo.m.samples, by[mpidist].m.samples))


# ---------------------------------------------------------------- reporting


def diff_us(a: Optional[bcoll.Row], b: Optional[bcoll.Row]) -> float:
    """time(a) - time(b) in us, the median over passes of the per-pass difference."""
    if a is None or b is None:
        return math.nan
    return statistics.median(x - y for x, y in zip(a.m.samples, b.m.samples)) * 1e6


def nccl_table(ix: dict, impl: str, nominals: list[int], n: int) -> list[str]:
    """nccl-tests' in-place columns for one implementation (all_reduce is in place in torch)."""
    lines = [
        "| size(B) | count | type | redop | root | time(us) | algbw(GB/s) | busbw(GB/s) | #wrong |",
        "|---:|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    for s in nominals:
        r = ix.get(("all_reduce", impl, bcoll.IP, s))
        if r is not None:
            wrong = "n/a" if impl == NOOP else str(r.wrong)
            lines.append(
                f"| {r.nbytes} | {r.count} | float | sum | -1 | {r.time_s * 1e6:.2f} | {r.algbw:.3f} | "
                f"{r.busbw(n):.3f} | {wrong} |"
            )
    return lines


def compare_table(ix: dict, nominals: list[int], n: int, copy_ref: bcoll.CopyRef) -> list[str]:
    cols = [
        "size(B)",
        "mpidist time(us)",
        "gloo/mpidist time",
        "mpidist/raw time",
        "noop time(us)",
        "mpidist - noop (us)",
        "mpidist - noop - raw (us)",
        "floor - noop (us)",
        "mpidist - floor (us)",
        "copy bw(GB/s)",
        "mpidist busbw/copy bw",
    ]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---:|" * len(cols)]
    for s in nominals:
        row = {i: ix.get(("all_reduce", i, bcoll.IP, s)) for i in IMPLS}
        md = row["mpidist"]
        if md is None:
            continue
        added = diff_us(md, row[NOOP])
        lines.append(
            "| "
            + " | ".join(
                [
                    str(md.nbytes),
                    f"{md.time_s * 1e6:.2f}",
                    bc.fmt(bcoll.paired(row["gloo"], md), 2),
                    bc.fmt(bcoll.paired(md, row["raw"]), 3),
                    bc.fmt(row[NOOP].time_s * 1e6 if row[NOOP] else math.nan),
                    bc.fmt(added),
                    bc.fmt(added - row["raw"].time_s * 1e6 if row["raw"] else math.nan),
                    bc.fmt(diff_us(row[FLOOR], row[NOOP])),
                    bc.fmt(diff_us(md, row[FLOOR])),
                    bc.fmt(copy_ref.bw(md.nbytes)),
                    bc.fmt(bc.ratio(md.busbw(n), copy_ref.bw(md.nbytes)), 3),
                ]
            )
            + " |"
        )
    return lines


def ddp_table(res: list[DdpResult], args: argparse.Namespace, n: int) -> list[str]:
    lines = [
        "| backend | step time(ms) | min-max of the measurements (ms) | steps/measurement | gloo/mpidist |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in res:
        ratio = bc.fmt(ddp_ratio(res, r.impl), 3) if r.impl.startswith("mpidist") else ""
        lines.append(
            f"| {r.impl} | {r.time_s * 1e3:.2f} | {min(r.m.samples) * 1e3:.2f}-{max(r.m.samples) * 1e3:.2f} "
            f"| {r.m.iters} | {ratio} |"
        )
    equal = "bitwise equal" if res[0].max_diff == 0 else f"largest difference {res[0].max_diff:.3g}"
    lines += [
        "",
        f"Parameters of the two DDPs after the same 3 steps from the same start: {equal}"
        f"{' (expected at 2 ranks)' if n == 2 else ''}.",
    ]
    return lines


def report(
    rows: list[bcoll.Row], copy_ref: bcoll.CopyRef, ddp: list[DdpResult], n: int, args: argparse.Namespace
) -> list[str]:
    ix = bcoll.index(rows)
    nominals = sorted({r.nominal for r in rows})
    torch = args.torch
    timing = (
        f"median of {args.reps} measurements of {args.target_s * 2e3 / 3:.0f}-{args.target_s * 4e3 / 3:.0f} ms "
        f"(>= 1 call; gloo <= {args.gloo_max_iters} calls), each the max over "
        f"ranks of the mean time per call; up to {args.warmup} warm-up calls; the cases of one size "
        f"interleaved, the order rotated each pass"
    )
    lines = [
        f"# torch.distributed over mpidist, gloo, raw mpi4py and a do-nothing backend, {n} ranks",
        "",
        *([f"**{args.note}**", ""] if args.note else []),
        *bc.machine_lines(n, args.load_at_start),
        f"- {bc.versions(torch=torch.__version__, mpidist=mpidist.__version__)}; torch.set_num_threads(1)",
        '- groups: mpidist = the default group (`init_process_group("mpidist", init_method="tcp://127.0.0.1:PORT")`), '
        'gloo = `new_group(backend="gloo")`, noop = `new_group(backend="noop")` (a Python ProcessGroup whose '
        'allreduce returns None: torch\'s front end alone), floor = `new_group(backend="floor")` (the same '
        "ProcessGroup whose allreduce is mpi4py's `Allreduce(IN_PLACE, tensors[0].numpy(), SUM)` and nothing "
        "else: the least a Python backend over MPI does); raw = mpi4py `Allreduce` on the tensor's numpy view",
        f"- timing: {timing}; wall time {args.elapsed:.0f} s",
        "- columns as nccl-tests (doc/PERFORMANCE.md): size(B), count, algbw = size / time, busbw = algbw * 2(n-1)/n, "
        "#wrong = wrong elements over all ranks (noop: n/a, it does nothing)",
        "- ratios: the median over the round-robin passes of the per-pass ratio (> 1 in gloo/mpidist = mpidist "
        "faster); mpidist - noop: the median per-pass difference, the time the backend adds to torch's front "
        "end (communication included); minus raw: what is left beyond MPI's own time; floor - noop: the least "
        "a Python backend over MPI adds; mpidist - floor: what mpidist adds beyond that; copy bw: single-core "
        "`np.copyto` bandwidth S / t on rank 0 alone (bench_collectives' reference)",
        "",
        "## dist.all_reduce, float32, SUM: ratios",
        "",
        *compare_table(ix, nominals, n, copy_ref),
    ]
    for impl in IMPLS:
        lines += ["", f"### {impl}", "", *nccl_table(ix, impl, nominals, n)]
    if ddp:
        lines += [
            "",
            "## DDP step",
            "",
            f"MLP 784-{args.ddp_width}x{args.ddp_layers}-10 ({ddp[0].params:,} parameters, "
            f"{ddp[0].params * 4 / 1e6:.1f} MB of gradients), {args.ddp_batch} samples per rank, default "
            f"DDP (25 MB buckets), SGD; median of {args.ddp_reps} alternating measurements of about "
            f"{args.ddp_target_s * 1e3:.0f} ms, each the max over ranks of the mean step time.",
            "",
            *ddp_table(ddp, args, n),
        ]
    wrong = sum(r.wrong for r in rows if r.impl != NOOP)
    lines += ["", f"Out of bounds values: {wrong} {'OK' if wrong == 0 else 'FAILED'}"]
    return lines


def headlines(rows: list[bcoll.Row], ddp: list[DdpResult]) -> list[str]:
    ix = bcoll.index(rows)
    got = sorted({r.nominal for r in rows})

    def row(impl: str, s: int) -> Optional[bcoll.Row]:
        return ix.get(("all_reduce", impl, bcoll.IP, s))

    def q(s: int) -> float:
        return bcoll.paired(row("gloo", s), row("mpidist", s))

    lines = []
    for s in HEADLINE_SIZES:
        md = row("mpidist", s)
        if md is None:
            lines.append(f"headline: all_reduce {bc.human_bytes(s)}: not measured")
            continue
        lines.append(
            f"headline: all_reduce {bc.human_bytes(s):>7}: gloo/mpidist = {bc.fmt(q(s))}x "
            f"({md.time_s * 1e6:.2f} us vs {row('gloo', s).time_s * 1e6:.2f} us); mpidist/raw = "
            f"{bc.fmt(bcoll.paired(md, row('raw', s)), 3)}; mpidist - noop = "
            f"{bc.fmt(diff_us(md, row(NOOP, s)))} us (noop {row(NOOP, s).time_s * 1e6:.2f} us); "
            f"floor - noop = {bc.fmt(diff_us(row(FLOOR, s), row(NOOP, s)))} us"
        )

    verdict = bc.verdict
    lines += [
        verdict(
            "all_reduce <= 64 KiB: mpidist >= 10x faster than gloo",
            [s for s in got if s <= 64 << 10],
            q,
            lambda x: x >= 10,
            min,
            "x",
        ),
        verdict(
            "all_reduce 1 MiB: mpidist >= 4x faster than gloo",
            [s for s in got if s == 1 << 20],
            q,
            lambda x: x >= 4,
            min,
            "x",
        ),
        verdict(
            "all_reduce 16-64 MiB: mpidist >= 2x faster than gloo",
            [s for s in got if 16 << 20 <= s <= 64 << 20],
            q,
            lambda x: x >= 2,
            min,
            "x",
        ),
        verdict(
            "8 B: mpidist - noop (what the backend adds to torch's front end, MPI's own time included) <= 5 us",
            [s for s in got if s == 8],
            lambda s: diff_us(row("mpidist", s), row(NOOP, s)),
            lambda x: x <= FRONT_END_BUDGET_US,
            max,
            " us",
        ),
        verdict(
            "8 B: mpidist - noop <= 3 us (issue 44; floor - noop, the least a Python backend over MPI adds, "
            f"is {bc.fmt(diff_us(row(FLOOR, 8), row(NOOP, 8)))} us)",
            [s for s in got if s == 8],
            lambda s: diff_us(row("mpidist", s), row(NOOP, s)),
            lambda x: x <= TIGHT_BUDGET_US,
            max,
            " us",
        ),
        verdict(
            "8 B: mpidist - noop - raw (the same without MPI's own time) <= 5 us",
            [s for s in got if s == 8],
            lambda s: diff_us(row("mpidist", s), row(NOOP, s)) - row("raw", s).time_s * 1e6,
            lambda x: x <= FRONT_END_BUDGET_US,
            max,
            " us",
        ),
    ]
    if ddp:
        r = ddp_ratio(ddp)
        lines.append(
            f"target: DDP step over mpidist no slower than over gloo: gloo/mpidist = {r:.3f} -> "
            f"{'MET' if r >= 1 else 'NOT MET'}"
        )
        if any(d.impl == "mpidist compiled" for d in ddp):
            r = ddp_ratio(ddp, "mpidist compiled")
            lines.append(f"compiled DDP step (torch.compile, --ddp-compile): gloo/mpidist = {r:.3f}")
    else:
        lines.append("target: DDP step: not measured (--no-ddp)")
    return lines


def write_ddp_csv(path: Path, res: list[DdpResult], args: argparse.Namespace, n: int) -> None:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(
            [
                "ranks",
                "backend",
                "params",
                "batch_per_rank",
                "step_ms",
                "step_min_ms",
                "step_max_ms",
                "steps_per_measurement",
                "gloo_over_mpidist",
                "max_param_diff",
            ]
        )
        ratio = ddp_ratio(res)
        for r in res:
            w.writerow(
                [
                    n,
                    r.impl,
                    r.params,
                    args.ddp_batch,
                    f"{r.time_s * 1e3:.6g}",
                    f"{min(r.m.samples) * 1e3:.6g}",
                    f"{max(r.m.samples) * 1e3:.6g}",
                    r.m.iters,
                    f"{ratio:.6g}",
                    f"{r.max_diff:.6g}",
                ]
            )


# ---------------------------------------------------------------- main


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--min-bytes", type=bc.parse_bytes, default=8)
    p.add_argument("--max-bytes", type=bc.parse_bytes, default=bc.parse_bytes("64M"))
    p.add_argument("--factor", type=int, default=4, help="sizes are the powers of FACTOR in range")
    p.add_argument("--quick", action="store_true", help="shorter measurements, fewer of them")
    p.add_argument("--target-ms", type=float, default=None, help="length of one measurement (default 40; 10 quick)")
    p.add_argument("--reps", type=int, default=None, help="measurements per case (default 5; 3 quick)")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls per case and size (fewer if slow)")
    p.add_argument("--gloo-max-iters", type=int, default=200, help="cap on gloo's calls per measurement")
    p.add_argument("--no-ddp", action="store_true", help="skip the DDP step comparison")
    p.add_argument("--ddp-width", type=int, default=1024)
    p.add_argument("--ddp-layers", type=int, default=3, help="hidden layers of the DDP MLP")
    p.add_argument("--ddp-batch", type=int, default=64, help="samples per rank per step")
    p.add_argument("--ddp-target-ms", type=float, default=None, help="one DDP measurement (default 500; 200 quick)")
    p.add_argument("--ddp-reps", type=int, default=None, help="DDP measurements per backend (default 7; 3 quick)")
    p.add_argument(
        "--ddp-compile",
        default="aot_eager",
        help="also time both DDPs under torch.compile with this Dynamo backend ('none': not)",
    )
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--note", default="", help="a line for the report's header (e.g. the machine's state)")
    args = p.parse_args(argv)
    if args.factor < 2 or args.min_bytes < 4 or args.max_bytes < args.min_bytes:
        p.error("need --factor >= 2 and 4 <= --min-bytes <= --max-bytes")
    args.reps = args.reps or (3 if args.quick else 5)
    args.target_s = (args.target_ms or (10.0 if args.quick else 40.0)) / 1e3
    args.ddp_reps = args.ddp_reps or (3 if args.quick else 7)
    args.ddp_target_s = (args.ddp_target_ms or (200.0 if args.quick else 500.0)) / 1e3
    if (
        min(args.reps, args.warmup, args.gloo_max_iters, args.ddp_reps, args.ddp_width, args.ddp_layers, args.ddp_batch)
        < 1
        or args.target_s <= 0
        or args.ddp_target_s <= 0
    ):
        p.error("counts, sizes and times must be positive")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    args.load_at_start = os.getloadavg()[0]
    world = MPI.COMM_WORLD
    env = start(world)
    args.torch = env.gloo.torch
    t0 = time.perf_counter()
    with bc.thread_limit():
        rows, copy_ref = run_sweep(env, args)
        ddp = [] if args.no_ddp else bench_ddp(env, args)
    args.elapsed = time.perf_counter() - t0
    env.gloo.close()
    env.comm.Free()
    if env.rank != 0:
        return 0
    n = env.n
    lines = report(rows, copy_ref, ddp, n, args)
    print("\n".join(lines))
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"torch_np{n}"
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    bcoll.write_csv(stem.with_suffix(".csv"), rows, copy_ref, n)
    paths = [stem.with_suffix(".md"), stem.with_suffix(".csv")]
    if ddp:
        write_ddp_csv(args.out / f"torch_np{n}_ddp.csv", ddp, args, n)
        paths.append(args.out / f"torch_np{n}_ddp.csv")
    for path in paths:
        print(f"# wrote {path}")
    print("\n".join(headlines(rows, ddp)), flush=True)
    bad = any(r.wrong for r in rows if r.impl != NOOP) or (n == 2 and ddp and ddp[0].max_diff != 0)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
