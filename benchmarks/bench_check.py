"""What the default mismatch check costs: all_reduce with the check on and off, paired.

    mpiexec -n N python benchmarks/bench_check.py [--sizes 64K,256K,1M,4M,16M,64M]
        [--algorithms auto,mpi,ring] [--rounds 7] [--target-ms 60] [--out benchmarks/results]

By default every member of a group compares a collective's signature the first time the
group uses it, then looks it up in a cache; the shared-memory all-reduce also compares a
header on every call (mpidist._check.mismatch, docs/reliability.md). This script measures that,
float32 SUM, for each size and ``algorithm`` (``auto`` = None: shared memory from the
measured crossover up on one node; ``mpi``: MPI_Allreduce), each a blocking call of a
numpy array, which takes all_reduce's inline path once its members agreed on it; the switch
below leaves that path's repeated-call test in place (``host work`` below times it).

* ``checked``: ``mpidist.all_reduce(x, algorithm=...)`` as users run it;
* ``unchecked``: the same with every check switched off (``mismatch._set_checks(False)`` and
  ``ShmAllReduce.verify = False``: a benchmark-only switch, not a user setting);
* ``control``: ``unchecked`` after Python lines of the check's shape that check nothing
  (:func:`lookalike`: a key built, a state looked up, a comparison, a store), run by this
  script before each call. It measures what any such lines cost on the host before the op,
  whatever they do: on the 2-core VM the ring and shared-memory paths, whose ranks meet
  several times per call, turned ~0.5 us of added Python into +2.5 to +5 us per call
  (``control - unchecked``), the MPI path did not. ``checked - control`` is then what the
  check costs beyond what the host charges any code in its place.

Per size, ``--rounds`` rounds, each one measurement of ``checked``, ``unchecked`` and
``control`` (the order rotating between rounds), each measurement a barrier then a
calibrated number of back-to-back calls lasting about ``--target-ms``, its value the max
over ranks of the mean time per call (``_bench_common.timed``). Reported: the medians, the
median of the per-round ratios checked / unchecked (target: <= 1.01 at >= 64 KiB, issue 27) and of
the per-round differences. The rounds pair measurements taken
seconds apart, so a loaded machine (other jobs) shows up as scatter in the ratios, not as
a bias: compare ratios, and rerun on a quiet machine for the figures that count.

A second measurement, ``host work``, takes the peers out: the call with an empty op in place
of the reduction, checks on and off, paired in rounds as above. No data moves and the ranks
meet only at the check's periodic comparison (every ``mpidist._check.mismatch.PERIOD`` calls,
amortized), so the difference is the check's own work per call, which runs on the calling
thread before the op and so adds to the call: what it costs on a machine where the peers'
timing does not amplify it (on the 2-core VM ``control - unchecked`` shows the host charging
any lines there ~1-5 us). It does not depend on the array's size (the signature holds the
count, not the data); reported as a share of the ``unchecked`` call at each size. Two calls:

* ``inline``: ``mpidist._backends.mpi.collectives.all_reduce``'s inline path, which a blocking
  all_reduce of a numpy array takes at every size once its members agreed on it (every call
  the paired table times). Its check is two identity tests and one store whatever the size
  and body, and the switch leaves them in place, so it is timed as ``bench_latency.py`` times
  it: its ``bare+check`` loop against ``bare`` (the path's lines with and without the check's,
  inline in one function each, around an 8-byte MPI_Allreduce), paired in rounds here;
* ``launch``: ``mpidist._dispatch.dispatch.launch`` as all_reduce calls it where the inline path does
  not run (``async_op=True``, an array that is not a contiguous writable numpy array, an op
  queued on the group), with an empty op in the reduction's place: a key tuple built and
  compared with the group's open run. Its share is also given of the unchecked async call
  (``async_op=True``, then ``wait()``), timed in the same rounds as ``async``.

The shared-memory path's header comparison is one integer compared in a barrier the call
makes anyway.

Writes ``check_np{N}.md`` to ``--out`` (rank 0 prints it too).
"""

from __future__ import annotations

import _bench_common as bc  # first: sets the BLAS thread variables

# isort: split

import argparse  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
from pathlib import Path  # noqa: E402

import bench_latency  # noqa: E402  (its loops: the inline path's check, see host_work)
import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import mpidist  # noqa: E402
from mpidist._check import mismatch  # noqa: E402
from mpidist._dispatch.dispatch import launch  # noqa: E402
from mpidist._runtime import world as runtime  # noqa: E402
from mpidist.algorithms import ShmAllReduce  # noqa: E402

DEFAULT_SIZES = "64K,256K,1M,4M,16M,64M"


def set_checks(on: bool) -> None:
    """Every check on or off (on every rank at the same point: the caller's barrier)."""
    mismatch._set_checks(on)
    ShmAllReduce.verify = on


class _State:
    __slots__ = ("lkey", "decided")


def lookalike(x: np.ndarray, states: dict, g: object, seq: int) -> None:
    """Lines of the check's shape (``_dispatch._guarded``'s repeated call: a key built, the
    group's state looked up, the key compared with its run's, a store) that check nothing."""
    key = ("all_reduce", x.size, x.dtype, -1, "sum", None)
    st = states.get(g)
    if st is not None and seq & 4095 and key == st.lkey:
        st.decided = seq


def measure(comm: MPI.Comm, x: np.ndarray, algorithm, rounds: int, target_s: float) -> dict:
    """{"checked": [s per call], "unchecked": [...], "control": [...], "async": [...]} over
    ``rounds`` rounds; ``async``: the same all-reduce with ``async_op=True`` and its ``wait()``,
    unchecked (the call that the ``launch`` host work is a share of)."""

    def call() -> None:
        mpidist.all_reduce(x, algorithm=algorithm)

    def call_async() -> None:
        mpidist.all_reduce(x, algorithm=algorithm, async_op=True).wait()

    st = _State()
    st.lkey, st.decided = ("all_reduce", x.size, x.dtype, -1, "sum", None), 0
    g = object()
    states = {g: st}
    seq = [0]

    def control() -> None:
        seq[0] += 1
        lookalike(x, states, g, seq[0])
        mpidist.all_reduce(x, algorithm=algorithm)

    return paired(comm, {"checked": call, "unchecked": call, "control": control, "async": call_async}, rounds, target_s)


def paired(comm: MPI.Comm, loops: dict, rounds: int, target_s: float) -> dict:
    """{name: [s per call]} over ``rounds`` rounds, each one measurement of every loop of
    ``loops`` (name -> the call; checks on only for "checked"), the order rotating between
    rounds; the number of calls per measurement calibrated on the first loop."""
    names = tuple(loops)
    first = loops[names[0]]
    set_checks(True)
    bc.warm_up(comm, first, 20, 0.2)  # the first call agrees on the signature
    iters = bc.calibrate(comm, first, target_s)
    times: dict = {name: [] for name in names}
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            set_checks(name == "checked")
            times[name].append(bc.timed(comm, loops[name], iters))
    set_checks(True)
    return times


def _empty_op(g: object, arr: np.ndarray, op: object) -> None:
    """The reduction's place in ``host_work``, empty."""


#: Calls of a ``bench_latency.py`` loop per timed call in ``host_work`` (its loops take a count).
_BATCH = 100


def host_work(comm: MPI.Comm, x: np.ndarray, path: str, rounds: int, target_s: float) -> dict:
    """{"checked": [s per call], "unchecked": [...]}: the check's lines on ``path``
    (``"inline"`` or ``"launch"``, see the docstring) with and without them."""
    if path == "inline":
        cases = bench_latency.loops(np.zeros(2, np.float32))
        bare, with_check = cases["bare"], cases["bare+check"]
        times = paired(
            comm, {"checked": lambda: with_check(_BATCH), "unchecked": lambda: bare(_BATCH)}, rounds, target_s
        )
        return {name: [t / _BATCH for t in ts] for name, ts in times.items()}
    g, op = runtime.resolve_group(None), mpidist.ReduceOp.SUM

    def call() -> None:
        launch(
            g, "all_reduce", _empty_op, (g, x, op), False, (x,), shapes=x.shape, dtype=x.dtype, count=x.size, redop=op
        )

    return paired(comm, {"checked": call, "unchecked": call}, rounds, target_s)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default=DEFAULT_SIZES, help="comma-separated byte counts (8, 64K, 1M)")
    p.add_argument("--algorithms", default="auto,mpi,ring")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--target-ms", type=float, default=60.0)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args()
    sizes = [bc.parse_bytes(s) for s in args.sizes.split(",")]
    algorithms = [a.strip() for a in args.algorithms.split(",")]
    if args.rounds < 1 or any(s < 4 for s in sizes) or not set(algorithms) <= {"auto", "mpi", "ring", "shm"}:
        p.error("need --rounds >= 1, sizes >= 4 bytes, algorithms among auto, mpi, ring, shm")
    load = os.getloadavg()[0]
    mpidist.init_process_group("mpi")
    comm = MPI.COMM_WORLD
    n = comm.Get_size()
    rows = [
        "| algorithm | size | checked (us) | unchecked (us) | checked / unchecked (median of rounds) | "
        "difference (us, median of rounds) | min-max ratio | control - unchecked (us) | "
        "checked / control | checked - control (us) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    small = bc.aligned_zeros(min(sizes) // 4, np.float32)
    work = {path: host_work(comm, small, path, 2 * args.rounds, args.target_ms / 1e3) for path in ("inline", "launch")}
    work_us = {path: [(c - u) * 1e6 for c, u in zip(t["checked"], t["unchecked"])] for path, t in work.items()}
    check_us = {path: statistics.median(d) for path, d in work_us.items()}
    shares = [
        "| algorithm | size | unchecked call (us) | the check's host work / the call: inline path | launch | "
        "unchecked async call + wait (us) | launch / the async call |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for algorithm in algorithms:
        for nbytes in sizes:
            x = bc.aligned_zeros(nbytes // 4, np.float32)  # sums of zeros: the values stay put
            t = measure(comm, x, None if algorithm == "auto" else algorithm, args.rounds, args.target_ms / 1e3)
            unchecked, unchecked_async = (statistics.median(t[k]) * 1e6 for k in ("unchecked", "async"))
            shares.append(
                f"| {algorithm} | {bc.human_bytes(nbytes)} | {unchecked:.2f} | "
                f"{100 * check_us['inline'] / unchecked:.2f}% | {100 * check_us['launch'] / unchecked:.2f}% | "
                f"{unchecked_async:.2f} | {100 * check_us['launch'] / unchecked_async:.2f}% |"
            )
            ratios = [c / u for c, u in zip(t["checked"], t["unchecked"])]
            diffs = [(c - u) * 1e6 for c, u in zip(t["checked"], t["unchecked"])]
            host = [(c - u) * 1e6 for c, u in zip(t["control"], t["unchecked"])]
            beyond = [c / k for c, k in zip(t["checked"], t["control"])]
            beyond_us = [(c - k) * 1e6 for c, k in zip(t["checked"], t["control"])]
            rows.append(
                f"| {algorithm} | {bc.human_bytes(nbytes)} | {statistics.median(t['checked']) * 1e6:.2f} | "
                f"{statistics.median(t['unchecked']) * 1e6:.2f} | {statistics.median(ratios):.3f} | "
                f"{statistics.median(diffs):+.2f} | {min(ratios):.3f}-{max(ratios):.3f} | "
                f"{statistics.median(host):+.2f} | {statistics.median(beyond):.3f} | "
                f"{statistics.median(beyond_us):+.2f} |"
            )
            if comm.Get_rank() == 0:
                print(rows[-1], flush=True)
    if comm.Get_rank() == 0:
        bc.write_report(
            args.out,
            f"check_np{n}.md",
            f"Cost of the default mismatch check, all_reduce float32 SUM, {n} ranks",
            n,
            load,
            [
                f"{args.rounds} rounds (checked, unchecked, control, async) per size of ~{args.target_ms:g} ms per "
                f"measurement; see the docstring of benchmarks/bench_check.py"
            ],
            [
                "Target (issue 27): checked / unchecked <= 1.01 from 64 KiB up, on every path "
                "(8 B: bench_latency.py, <= 0.3 us).",
                "",
                "## Paired calls",
                "",
                *rows,
                "",
                "## The check's host work (an empty op in the call's place; see the docstring)",
                "",
                *(
                    f"- {what}, {2 * args.rounds} rounds: checked "
                    f"{statistics.median(work[path]['checked']) * 1e6:.3f} us, unchecked "
                    f"{statistics.median(work[path]['unchecked']) * 1e6:.3f} us per call; the check "
                    f"**{check_us[path]:+.3f} us** (median of the rounds' differences; "
                    f"{min(work_us[path]):+.3f} to {max(work_us[path]):+.3f})"
                    for path, what in (
                        (
                            "inline",
                            "all_reduce's inline path (every call timed above; bench_latency.py's bare+check - bare)",
                        ),
                        ("launch", "`launch` (async calls, other ops)"),
                    )
                ),
                "",
                "As a share of each unchecked call measured above (blocking calls of a contiguous numpy array take "
                "the inline path; an async call, `launch`: its share of the unchecked async call, `wait()` included):",
                "",
                *shares,
            ],
        )
    mpidist.destroy_process_group()


if __name__ == "__main__":
    main()
