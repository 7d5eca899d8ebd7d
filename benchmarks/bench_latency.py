"""Where the 8-byte all_reduce's time goes: raw mpi4py, mpidist, and the bare latency path.

    mpiexec -n 2 python benchmarks/bench_latency.py [--calls 20000] [--passes 25] [--out DIR]

Six loops of ``--calls`` back-to-back calls on a float32[2] (8 B), interleaved, the order
rotating between passes (no loop always follows the same one), ``--passes`` times; each
value is the max over ranks of the mean time per call, and the table shows the median over
passes and the median per-pass ratio to raw:

* ``raw``: ``comm.Allreduce(MPI.IN_PLACE, [x, MPI.FLOAT], MPI.SUM)`` on a duplicate of
  the default group's communicator: the ceiling for any Python wrapper;
* ``mpidist``: ``mpidist.all_reduce(x)`` (its inline latency path: every check, the
  flight-recorder entry, the test that the members agreed on this call before), compiled
  where the install built mpidist/_backends/mpi/_ext/_inline_c.c (the report says whether);
* ``mpidist, Python path``: the same public op as an install without the compiled path
  makes it: the Python latency path, of which the ``bare`` loops below take the parts;
* ``bare``: what is left of that path without mpidist's argument and group checks: the
  flight-recorder entry (as :func:`mpidist._core.recorder.begin` / ``end`` make it) and the
  same MPI call, inline in one Python function. The gap between ``bare`` and ``mpidist``
  is the cost of the checks; between ``raw`` and ``bare``, of a Python function call plus
  the recorder;
* ``bare+check``: ``bare`` plus the lines the default mismatch check adds to the latency
  path (the test that the group's open run of calls is this call's: the note on its engine,
  tested by identity against the call's plan and by its byte count, read by the path anyway;
  the note of how far this rank has decided; every PERIOD calls the exchange that compares the
  running hashes, and the run's record in them, amortized; see mpidist._check.mismatch.check,
  "Runs"). ``bare+check`` - ``bare`` is the
  check's cost at 8 B (target <= 0.3 us, issue 27;
  benchmarks/bench_check.py measures the larger sizes). The three ``bare`` loops read
  ``t.nbytes`` and test all_reduce's size limit for this path, as all_reduce does whether or
  not it checks (until 2026-11-26 only the loops with the check's lines read it: the check was
  charged for it);
* ``bare+control``: ``bare`` plus lines of the check's shape that check nothing (the same
  tuple test, branch and store, on a stand-in object, and never a check): what any such
  lines cost here, between MPI calls. ``bare+check`` - ``bare+control`` is what the check
  costs beyond that;
* ``bare again``: ``bare`` once more, as a control: ``bare again`` - ``bare`` is what the
  measurement resolves (two identical loops differ by that much).

Writes ``latency_np{N}.md`` to ``--out`` (default benchmarks/results). The target it
explains (8 B within 1.5x raw; issue 44: 1.25x) is in benchmarks/results/targets.md.
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
from mpidist._arrays.reduce_op import ReduceOp  # noqa: E402
from mpidist._backends.mpi import collectives as C  # noqa: E402
from mpidist._check import mismatch  # noqa: E402
from mpidist._core import recorder as R  # noqa: E402
from mpidist._public_op import public_op  # noqa: E402


def loops(x: np.ndarray) -> dict[str, Callable[[int], None]]:
    g = mpidist._runtime.world.state().world
    comm = g.comm.Dup()
    F, S, IP = MPI.FLOAT, MPI.SUM, MPI.IN_PLACE
    now = time.monotonic

    # bare, bare_check and bare_control repeat the recorder's lines instead of sharing a helper:
    # each must be one inline function, as all_reduce's latency path is, or a call (~60 ns)
    # would hide in all three what they are here to compare.
    def bare(t: np.ndarray) -> None:
        eng = g.engine
        if t.nbytes >= limit:  # the path's test of MPI_Allreduce against the plan's body (read checked or not)
            return
        seq = eng.seq
        eng.seq = seq + 1
        t0 = now()
        rec = [seq, "all_reduce", g, t.shape, t.dtype, -1, t0, t0, 0.0, R.STARTED, R.timeout, None]
        R._append(rec)
        eng.current = rec
        g.comm.Allreduce(IP, [t, F], S)
        rec[R.T_END] = now()
        rec[R.STATE] = R.COMPLETED

    def run_raw(calls: int) -> None:
        for _ in range(calls):
            comm.Allreduce(IP, [x, F], S)

    def run_mpidist(calls: int) -> None:
        ar = mpidist.all_reduce
        for _ in range(calls):
            ar(x)

    # the public op as an install without the compiled path makes it (mpidist._public_op)
    python_path = public_op(C.all_reduce)(mpidist.all_reduce.__wrapped__)  # type: ignore[attr-defined]

    def run_python_path(calls: int) -> None:
        for _ in range(calls):
            python_path(x)

    def bare_check(t: np.ndarray) -> None:
        eng = g.engine
        if (nbytes := t.nbytes) >= limit:
            return
        ok = eng.lat
        if ok[0] is plan and ok[1] == nbytes:
            going = True
        else:
            going = False
            ok = mismatch.known
            if not (ok[0] is plan and ok[1] == nbytes and ok[4] is g):
                ok = mismatch.agree_all_reduce(g, plan, t, op)
        seq = eng.seq
        eng.seq = seq + 1
        t0 = now()
        rec = [seq, "all_reduce", g, t.shape, t.dtype, -1, t0, t0, 0.0, R.STARTED, R.timeout, None]
        R._append(rec)
        eng.current = rec
        if going and seq & pmask:  # the group's open run goes on
            eng.decided = seq
        else:  # every PERIOD calls: the exchange (and the run's record), as the latency path does it
            mismatch.check(g, rec, ok[3])
            if ok[2].lkey is ok[3]:
                mismatch.note_run(eng, ok)
        g.comm.Allreduce(IP, [t, F], S)
        rec[R.T_END] = now()
        rec[R.STATE] = R.COMPLETED

    class Lookalike:  # what bare_control's lines read and write instead of the group's engine
        lat: tuple = ()
        decided = -1

    dummy = Lookalike()

    def bare_control(t: np.ndarray) -> None:
        eng = g.engine
        if (nbytes := t.nbytes) >= limit:
            return
        ok = dummy.lat
        if ok[0] is plan and ok[1] == nbytes:
            going = True
        else:
            going = False
        seq = eng.seq
        eng.seq = seq + 1
        t0 = now()
        rec = [seq, "all_reduce", g, t.shape, t.dtype, -1, t0, t0, 0.0, R.STARTED, R.timeout, None]
        R._append(rec)
        eng.current = rec
        if going and seq & pmask:
            dummy.decided = seq
        else:
            dummy.decided = -seq
        g.comm.Allreduce(IP, [t, F], S)
        rec[R.T_END] = now()
        rec[R.STATE] = R.COMPLETED

    def repeat(body: Callable[[np.ndarray], None]) -> Callable[[int], None]:
        def run(calls: int) -> None:
            for _ in range(calls):
                body(x)

        return run

    pmask = mismatch.PERIOD_MASK
    op = ReduceOp.SUM
    mpidist.all_reduce(x)  # the members agree on this call (the check's first exchange); its plan
    plan = C._PLANS[(x.dtype, op._value_, None)]
    limit = plan[3]  # bytes: under it, all_reduce's inline path calls MPI_Allreduce itself
    dummy.lat = (plan, x.nbytes)
    return {
        "raw": run_raw,
        "mpidist": run_mpidist,
        "mpidist, Python path": run_python_path,
        "bare": repeat(bare),
        "bare+check": repeat(bare_check),
        "bare+control": repeat(bare_control),
        "bare again": repeat(bare),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=20000)
    p.add_argument("--passes", type=int, default=25)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args()
    if args.calls < 1 or args.passes < 1:
        p.error("--calls and --passes must be >= 1")
    load = os.getloadavg()[0]
    mpidist.init_process_group("mpi")
    comm = MPI.COMM_WORLD
    n = comm.Get_size()
    x = np.zeros(2, np.float32)  # sums of zeros: the values stay put however many calls
    cases = loops(x)
    for run in cases.values():  # warm-up: the plan cache, the engine, MPI's connections
        run(200)
    times: dict[str, list[float]] = {k: [] for k in cases}
    names = list(cases)
    for p_ in range(args.passes):
        for name in names[p_ % len(names) :] + names[: p_ % len(names)]:  # the order rotating
            run = cases[name]
            comm.Barrier()
            t0 = time.perf_counter()
            run(args.calls)
            times[name].append(comm.allreduce((time.perf_counter() - t0) / args.calls, op=MPI.MAX))
    x[:] = 1.0
    for run in cases.values():
        run(1)
    assert x.tolist() == [float(n) ** len(cases)] * 2, f"wrong all_reduce result {x}"
    if comm.Get_rank() == 0:
        rows = ["| loop | time per call (us) | / raw (median of per-pass ratios) |", "|---|---:|---:|"]
        for name, ts in times.items():
            ratio = statistics.median(t / r for t, r in zip(ts, times["raw"]))
            rows.append(f"| {name} | {statistics.median(ts) * 1e6:.2f} | {ratio:.3f} |")
        check = statistics.median((c - b) * 1e6 for c, b in zip(times["bare+check"], times["bare"]))
        floor = statistics.median((c - b) * 1e6 for c, b in zip(times["bare again"], times["bare"]))
        control = statistics.median((c - b) * 1e6 for c, b in zip(times["bare+control"], times["bare"]))
        beyond = statistics.median((c - b) * 1e6 for c, b in zip(times["bare+check"], times["bare+control"]))
        rows += [
            "",
            f"The default mismatch check on this path (bare+check - bare, median of per-pass "
            f"differences): {check:+.3f} us per call (target <= 0.3 us); the same between two "
            f"identical loops (bare again - bare, the measurement's floor): {floor:+.3f} us; the control's "
            f"lines, which check nothing (bare+control - bare): {control:+.3f} us; the check beyond "
            f"them (bare+check - bare+control): {beyond:+.3f} us",
        ]
        bc.write_report(
            args.out,
            f"latency_np{n}.md",
            f"8-byte all_reduce latency breakdown, {n} ranks",
            n,
            load,
            [
                f"{args.passes} passes of {args.calls} calls per loop, interleaved, the order rotating; "
                f"see the docstring of benchmarks/bench_latency.py for the loops",
                "the compiled latency path (mpidist/_backends/mpi/_ext/_inline_c.c): "
                + ("built, in the mpidist loop" if C.INLINE is not None else "not built: mpidist is the Python path"),
            ],
            rows,
        )
    mpidist.destroy_process_group()


if __name__ == "__main__":
    main()
