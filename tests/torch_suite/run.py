"""Run torch's ``DistributedTest._DistTestBase`` on gloo (the control) and on mpidist, at world
size 3 under mpiexec, and compare: exit 1 when a test that gloo passes (or that mpidist's
classification adds: the all_to_all tests) does not pass on mpidist, unless listed below.

    python tests/torch_suite/run.py [--backends gloo,mpidist,mpidist@mpi,gloo@mpi] [--tests NAME ...] [--all]
                                    [--control all|failures] [--out out/torch_suite]
                                    [--results FILE.md] [--profile]

``--control failures`` (what ``make test`` runs): mpidist first, then gloo on the tests that
did not pass on mpidist only, less those mpidist skipped for a reason that does not depend on
the backend (:data:`SAME_ON_EVERY_BACKEND`: torch's decorators skip them on gloo alike); the
verdict is the same as with the whole control (a test mpidist passes needs no control), in
about half the time. ``all`` (the default) runs gloo on
every test, for the full table (results.md next to this file).

The tests run in one ``mpiexec -n 3`` job per backend (``rank.py`` on every rank), each
bounded by ``timeout -k 10``; a test past ``--test-timeout`` s aborts the job from the rank's
watchdog, and so does an exception outside a test; the job is then started again at the next
test (at most ``--restarts`` times per backend), and the test is reported as ``timeout`` or
``crash``. Every temporary file is in a private directory removed at the end. Writes
``OUT/{backend}.log`` (every rank's output), ``OUT/results.json`` and ``OUT/results.md``.
README.md next to this file: the classification, the selection, the exceptions.

``mpidist@mpi``: mpidist with each test's default group initialized over ``init_method="mpi://"``
(its own store, as ``init_process_group("mpidist")`` gives users) instead of torch's file
store; every test, judged as mpidist.
``gloo@mpi``: torch's own gloo with each test's
default group initialized over ``init_method="mpi://"`` (mpidist.torch's store over MPI and
MPI's ranks) instead of the file store, on the collectives tests only (:data:`OVER_MPI`).
Judged as mpidist is: exit 1 when a test that gloo passes over the file store does not pass
over mpi://.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import classify  # noqa: E402

TORCH_C10D = "torch/distributed/distributed_c10d.py"

#: Tests that a backend registered from Python cannot pass because of torch itself, with the
#: torch line that stops them (torch 2.13.0). Reported, never run on mpidist.
EXCEPTIONS = {
    "test_monitored_barrier_gloo": f"{TORCH_C10D}:5418-5419: dist.monitored_barrier raises "
    "'monitored_barrier is only implemented for "
    f"GLOO backend' for any other backend",
    "test_monitored_barrier_gloo_subgroup": f"{TORCH_C10D}:5418-5419: as test_monitored_barrier_gloo",
    "test_monitored_barrier_failure_order": f"{TORCH_C10D}:5418-5419: as test_monitored_barrier_gloo",
    "test_monitored_barrier_wait_all_ranks": f"{TORCH_C10D}:5418-5419: as test_monitored_barrier_gloo",
}

#: Failures being fixed (none today: the eight that issue 23 listed were fixed by a4b7fa5). Run and
#: reported; they do not fail the run, but one that passes does (remove it from this list then).
KNOWN_FAILURES: dict = {}  # test name -> the cause, e.g. "sparse COO all_reduce is refused (issue 23)"

#: Skip reasons of torch's suite that hold for every backend (the GPUs and the world size of the
#: machine): a test mpidist skips for one of them is skipped on gloo too, so ``--control failures``
#: does not run it there.
SAME_ON_EVERY_BACKEND = re.compile(
    r"Need at least \d+ CUDA devices|CUDA is not available\.|Skipped due to small world size\."
)

#: The tests ``gloo@mpi`` runs: the collectives (and the groups they run on), where the store is
#: what differs from the control: gloo's rendezvous, its sub-groups' (``new_group`` over the
#: default group's store, PrefixStore'd) and the barriers; not their profiled variants (the
#: profiler is not the store's business; they take a third of the time).
OVER_MPI = re.compile(
    r"test_(all_reduce|reduce|broadcast|all_gather|gather|scatter|reduce_scatter|barrier|new_subgroups|"
    r"batch_isend_irecv|isend|irecv|send_recv|get_future|all_gather_object|broadcast_object|gather_object|"
    r"scatter_object)(?!.*profiler)"
)
#: Judged against the control (gloo over the file store): mpidist (over the file store, as
#: torch's harness inits), mpidist@mpi (over its own store, what ``init_process_group("mpidist")``
#: gives users) and gloo@mpi.
SUBJECTS = ("mpidist", "mpidist@mpi", "gloo@mpi")


def _base(backend: str) -> str:
    """The backend proper: ``mpidist@mpi`` -> ``mpidist``."""
    return backend.partition("@")[0]


#: Left out of the default selection for time (seconds per backend on the 2-core CI machine).
SLOW: dict = {}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backends", default="gloo,mpidist", help="among gloo, mpidist, gloo@mpi")
    p.add_argument("--tests", nargs="*", help="only these tests (default: the selection, README.md)")
    p.add_argument("--all", action="store_true", help="include the SLOW tests")
    p.add_argument("--out", default=os.path.join(ROOT, "out", "torch_suite"))
    p.add_argument("--results", default=None, help="also write the results table to this file")
    p.add_argument("--test-timeout", type=float, default=120.0, help="seconds per test (default 120)")
    p.add_argument("--pg-timeout", type=float, default=None, help="the suite's default_pg_timeout (torch's: 60)")
    p.add_argument("--job-timeout", type=float, default=1800.0, help="seconds per backend in all (default 1800)")
    p.add_argument("--restarts", type=int, default=20, help="job restarts per backend after a hang or crash")
    p.add_argument("--profile", action="store_true", help="mpidist in the suite's profiling lists")
    p.add_argument(
        "--control",
        choices=("all", "failures"),
        default="all",
        help="gloo runs every test (all), or only those that did not pass on mpidist or gloo@mpi (failures)",
    )
    p.add_argument("--mpiexec", default=os.path.join(os.path.dirname(sys.executable), "mpiexec"))
    return p.parse_args()


def selection(args: argparse.Namespace, backend: str, dt) -> tuple:
    """(tests to run, {test: skip reason}) for ``backend``."""
    names = classify.test_names(dt)
    skipped = {}
    for n in names:
        why = classify.static_skip(dt, n)
        if why is not None and not (_base(backend) == "mpidist" and n in classify.ALL_TO_ALL_TESTS):
            skipped[n] = f"skipped at import: {why}"
    if args.tests:
        unknown = sorted(set(args.tests) - set(names))
        if unknown:
            raise SystemExit(f"no such tests in _DistTestBase: {unknown}")
        names = [n for n in names if n in args.tests]
    if backend == "gloo@mpi":  # the collectives only
        names = [n for n in names if OVER_MPI.match(n)]
    run = []
    for n in names:
        if n in skipped:
            continue
        if _base(backend) == "mpidist" and n in EXCEPTIONS:
            skipped[n] = f"exception (torch): {EXCEPTIONS[n]}"
        elif n in SLOW and not args.all and not args.tests:
            skipped[n] = f"left out for time ({SLOW[n]})"
        else:
            run.append(n)
    return run, {n: skipped[n] for n in names if n in skipped}


def merge(records: list) -> dict:
    """One outcome for a test from its per-rank records."""
    by = {r["rank"]: r for r in records}
    outs = {r["outcome"] for r in by.values()}
    secs = max(r["secs"] for r in by.values())
    for bad in ("timeout", "fail"):
        if bad in outs:
            first = min(r for r in by if by[r]["outcome"] == bad)
            ranks = sorted(r for r in by if by[r]["outcome"] == bad)
            return {
                "outcome": bad,
                "cause": f"rank {','.join(map(str, ranks))}: {by[first]['cause']}",
                "secs": secs,
                "traceback": by[first]["traceback"],
            }
    if "skip" in outs:
        first = min(r for r in by if by[r]["outcome"] == "skip")
        return {"outcome": "skip", "cause": by[first]["cause"], "secs": secs}
    return {"outcome": "pass", "cause": "", "secs": secs}


def read_records(job_dir: str) -> dict:
    recs: dict = {}
    for name in os.listdir(job_dir):
        if name.startswith("rank") and name.endswith(".jsonl"):
            with open(os.path.join(job_dir, name)) as f:
                for line in f:
                    if line.strip():
                        r = json.loads(line)
                        recs.setdefault(r["test"], {})[r["rank"]] = r
    return recs


def run_backend(args: argparse.Namespace, backend: str, tests: list, tmp: str, log) -> dict:
    results: dict = {}
    remaining = list(tests)
    deadline = time.monotonic() + args.job_timeout
    attempt = 0
    while remaining:
        left = deadline - time.monotonic()
        if attempt > args.restarts or left < 30:
            why = "not run: too many job restarts" if attempt > args.restarts else "not run: time for the backend spent"
            for n in remaining:
                results[n] = {"outcome": "not run", "cause": why, "secs": 0}
            break
        job_dir = tempfile.mkdtemp(prefix=f"{backend}{attempt}_", dir=tmp)
        list_file = os.path.join(job_dir, "tests.txt")
        with open(list_file, "w") as f:
            f.write("\n".join(remaining) + "\n")
        cmd = [
            "timeout",
            "-k",
            "10",
            str(int(left)),
            args.mpiexec,
            "-n",
            str(classify.WORLD_SIZE),
            sys.executable,
            os.path.join(HERE, "rank.py"),
            "--backend",
            backend,
            "--tests",
            list_file,
            "--out",
            job_dir,
            "--test-timeout",
            str(args.test_timeout),
        ]
        if args.pg_timeout is not None:
            cmd += ["--pg-timeout", str(args.pg_timeout)]
        if args.profile:
            cmd.append("--profile")
        env = dict(
            os.environ,
            TORCH_SUITE_TMP=job_dir,
            OMP_NUM_THREADS="1",
            KINETO_LOG_LEVEL="5",
            MPIDIST_ABORT_ON_TIMEOUT="0",
            TMPDIR=job_dir,
            PYTORCH_PRINT_REPRO_ON_FAILURE="0",
        )
        log.write(f"\n===== {backend}: job {attempt}: {len(remaining)} tests from {remaining[0]}\n")
        log.flush()
        proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace"
        )
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                log.write(line)
                if line.startswith(f"[{backend}] test"):
                    sys.stdout.write(line)
                    sys.stdout.flush()
            rc = proc.wait()
        finally:
            if proc.poll() is None:  # this runner was stopped (SIGTERM, Ctrl-C): end its job too
                proc.terminate()
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
        log.flush()
        recs = read_records(job_dir)
        done = 0
        for n in remaining:
            got = recs.get(n, {})
            if len(got) == classify.WORLD_SIZE and all(r["outcome"] != "timeout" for r in got.values()):
                results[n] = merge(list(got.values()))
                done += 1
                continue
            # the job ended during this test
            if any(r["outcome"] == "timeout" for r in got.values()):
                results[n] = merge(list(got.values()))
            else:
                results[n] = {
                    "outcome": "crash",
                    "secs": 0,
                    "cause": f"the job ended (exit code {rc}) during this test; ranks that finished it: "
                    f"{sorted(got)}; see {backend}.log",
                }
            done += 1
            sys.stdout.write(f"[{backend}] {n}: {results[n]['outcome']}: {results[n]['cause']}\n")
            break
        if rc != 0 and done == len(remaining) and results[remaining[-1]]["outcome"] not in ("timeout", "crash"):
            sys.stdout.write(f"[{backend}] note: the job exited with code {rc} after its last test ({backend}.log)\n")
        remaining = remaining[done:]
        attempt += 1
    return results


def _needs_control(result: Optional[dict]) -> bool:
    """Whether gloo's outcome can change the verdict on a test whose mpidist ``result`` this is."""
    if result is None or result["outcome"] == "pass":
        return False
    return not (result["outcome"] == "skip" and SAME_ON_EVERY_BACKEND.fullmatch(result.get("cause", "").strip()))


def classify_result(backend_results: dict, skipped: dict) -> dict:
    out = dict(backend_results)
    for n, why in skipped.items():
        out[n] = {"outcome": "skip", "cause": why, "secs": 0}
    return out


def _judge(subject: str, res: dict, names: list) -> tuple:
    """(problems, known failures, fixed known failures) of ``subject`` against the control."""
    gloo, sub = res.get("gloo"), res[subject]
    problems, known, fixed = [], [], []
    for n in names:
        m = sub.get(n)
        own = _base(subject) == "mpidist"  # (the exceptions, known failures and all_to_all gates are mpidist's)
        if m is None or m["outcome"] == "pass" or (own and n in EXCEPTIONS):
            if own and m is not None and m["outcome"] == "pass" and n in KNOWN_FAILURES:
                fixed.append(n)
            continue
        g = gloo.get(n) if gloo is not None else None
        gloo_passed = g is not None and g["outcome"] == "pass"
        if m["outcome"] == "skip" and not gloo_passed:
            continue  # skipped at run time (e.g. world size), as on gloo
        if not gloo_passed and not (own and n in classify.ALL_TO_ALL_TESTS) and gloo is not None:
            continue  # fails on gloo too: reported, not counted against the subject
        (known if own and n in KNOWN_FAILURES else problems).append(n)
    return problems, known, fixed


def report(args: argparse.Namespace, res: dict, names: list, elapsed: dict) -> int:
    verdicts = {b: _judge(b, res, names) for b in SUBJECTS if b in res}
    subjects = list(verdicts)
    known = sorted({(b, n) for b in subjects for n in verdicts[b][1]})
    fixed = sorted({(b, n) for b in subjects for n in verdicts[b][2]})
    counts = {}
    for b, r in res.items():
        c: dict = {}
        for n in names:
            o = r[n]["outcome"] if n in r else "not selected"
            c[o] = c.get(o, 0) + 1
        counts[b] = c
    lines = [
        "# torch's DistributedTest suite: gloo vs mpidist",
        "",
        f"torch {_torch_version()}, world size {classify.WORLD_SIZE}, `mpiexec -n {classify.WORLD_SIZE}`; "
        f"generated by `tests/torch_suite/run.py` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}).",
        "",
    ]
    for b, c in counts.items():
        lines.append(
            f"- **{b}**: " + ", ".join(f"{v} {k}" for k, v in sorted(c.items())) + f" ({elapsed.get(b, 0):.0f} s)"
        )
    if args.control == "failures" and subjects:
        lines.append(
            f"- gloo (the control) ran only the tests that did not pass on {', '.join(subjects)} (`--control failures`)"
        )
    if "mpidist@mpi" in res:
        lines.append("- **mpidist@mpi**: mpidist with the default group over `mpi://` (its own store)")
    if "gloo@mpi" in res:
        lines.append("- **gloo@mpi**: torch's gloo with the default group over `mpi://` (the collectives tests only)")
    lines += [
        "",
        "| test | gloo | " + " | ".join(subjects) + " | cause / skip reason |",
        "|---|---|" + "---|" * len(subjects) + "---|",
    ]
    for n in names:
        g = res["gloo"].get(n) if "gloo" in res else None
        cells, cause = [], ""
        for b in subjects:
            m = res[b].get(n) if b in res else None
            probs, kn, _ = verdicts.get(b, ([], [], []))
            mark = " **FAIL**" if n in probs else " (known)" if n in kn else ""
            cells.append(f"{m['outcome'] if m else '-'}{mark}")
            if m is not None and not cause and m["outcome"] != "pass":
                cause = m.get("cause", "")
        cause = (cause or (g or {}).get("cause", "")).replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {n} | {g['outcome'] if g else '-'} | " + " | ".join(cells) + f" | {cause} |")
    text = "\n".join(lines) + "\n"
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(res, f, indent=1, sort_keys=True)
    if args.results:
        with open(args.results, "w") as f:
            f.write(text)
    print()
    for b, c in counts.items():
        print(f"{b}: " + ", ".join(f"{v} {k}" for k, v in sorted(c.items())) + f" in {elapsed.get(b, 0):.0f} s")
    for b, n in known:
        print(f"known failure (issue 23) on {b}: {n}: {res[b][n]['cause']}")
    for b, n in fixed:
        print(f"KNOWN FAILURE NOW PASSES on {b}: {n}: remove it from KNOWN_FAILURES in tests/torch_suite/run.py")
    for b, (probs, _, _) in verdicts.items():
        for n in probs:
            print(f"FAILED on {b}: {n}: {res[b][n]['outcome']}: {res[b][n]['cause']}")
    print(f"results: {os.path.join(args.out, 'results.md')}")
    bad = sum(len(p) for p, _, _ in verdicts.values()) + len(fixed)
    if over := res.get("gloo@mpi"):
        print(
            f"torch suite, gloo over mpi://: {sum(1 for r in over.values() if r['outcome'] == 'pass')} passed, "
            f"{len(verdicts['gloo@mpi'][0])} failed where gloo over the file store passes"
        )
    for b in subjects:
        if _base(b) == "mpidist":
            print(
                f"torch suite: {sum(1 for n in names if res[b].get(n, {}).get('outcome') == 'pass')} passed, "
                f"{len(verdicts[b][0]) + len(verdicts[b][2])} failed on {b} ({len(verdicts[b][1])} known failures)"
            )
    return 1 if bad else 0


def _torch_version() -> str:
    import torch

    return torch.__version__


def _stop(signum, frame):  # SIGTERM (make's timeout): unwind, so that the job and the files go too
    raise SystemExit(128 + signum)


def main() -> int:
    signal.signal(signal.SIGTERM, _stop)
    args = parse()
    backends = [b for b in args.backends.split(",") if b]
    tmp = tempfile.mkdtemp(prefix="torch_suite_")
    try:
        classify.prepare_env("file://" + os.path.join(tmp, "init_method_file"))
        dt = classify.load("gloo")  # the gates as imported; mpidist's differ by ALL_TO_ALL_TESTS only
        names = classify.test_names(dt)
        if args.tests:
            names = [n for n in names if n in args.tests]
        os.makedirs(args.out, exist_ok=True)
        res, elapsed = {}, {}
        unknown = set(backends) - {"gloo", *SUBJECTS}
        if unknown:
            raise SystemExit(f"--backends: unknown {sorted(unknown)}; among gloo, {', '.join(SUBJECTS)}")
        failures_only = args.control == "failures" and any(b in backends for b in SUBJECTS)
        if failures_only:  # the subjects first: gloo is asked about what they did not pass only
            backends = sorted(backends, key=lambda b: b == "gloo")
        for b in backends:
            run, skipped = selection(args, b, dt)
            if failures_only and b == "gloo":
                subs = [res[s] for s in SUBJECTS if s in res]
                run = [n for n in run if any(_needs_control(r.get(n)) for r in subs)]
                skipped = {
                    n: why for n, why in skipped.items() if any(r.get(n, {}).get("outcome") != "pass" for r in subs)
                }
                print(f"== control: {b} on the {len(run)} tests that did not pass on mpidist or gloo@mpi", flush=True)
                if not run:
                    res[b], elapsed[b] = classify_result({}, skipped), 0.0
                    continue
            print(f"== torch suite on {b}: {len(run)} tests to run, {len(skipped)} skipped", flush=True)
            t0 = time.monotonic()
            with open(os.path.join(args.out, f"{b}.log"), "w") as log:
                res[b] = classify_result(run_backend(args, b, run, tmp, log), skipped)
            elapsed[b] = time.monotonic() - t0
        return report(args, res, names, elapsed)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
