"""One MPI rank of torch's ``DistributedTest._DistTestBase``: run on every rank by run.py.

``mpiexec -n 3 python tests/torch_suite/rank.py --backend mpidist|gloo|mpidist@mpi|gloo@mpi --tests FILE --out DIR``

torch runs this suite with ``MultiProcessTestCase``: a parent process per test sets up the
temporary directories and the file ``Barrier``, spawns one child per rank, and each child
(``TestDistBackend._run``) initializes the default group from a ``file://`` store, runs the
test and destroys the group; the parent turns the children's exit codes into the outcome.
Here the MPI ranks are those children, and only that process machinery is replaced
(``SuiteCase``): every rank runs the same tests in the same order, with ``self.rank`` = its
MPI rank; rank 0 does the parent's per-test setup and shares its paths over MPI; a
``sys.exit(code)`` with one of torch's skip codes is a skip, as the parent reads it. The
default group is initialized per test as ``_run`` does (same store, rank, world size and
timeout), with backend ``"mpidist"`` or ``"gloo"``; ``gloo@mpi``: torch's gloo with the
default group's store and ranks from ``init_method="mpi://"`` (mpidist.torch's MPIStore, no
file, no port) instead of the file store; ``mpidist@mpi``: mpidist so.

Each rank appends one JSON line per test to ``DIR/rank{R}.jsonl``: the outcome (pass, fail,
skip), its one-line cause, the traceback and the time. Bounds: ``--test-timeout`` seconds per
test (set-up, test and tear-down) on a watchdog thread, which writes ``timeout``, dumps every
thread's stack to stderr and aborts the whole job (MPI_Abort); an exception outside a test
aborts the job as well. run.py then restarts the job at the next test.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import re
import sys
import tempfile
import threading
import time
import traceback
import unittest
from datetime import timedelta
from typing import Any, Optional

from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import classify  # noqa: E402

COMM = MPI.COMM_WORLD
RANK = COMM.Get_rank()


def _abort_on_exception(kind, value, tb):  # a failing rank ends the job, never hangs it
    sys.stderr.write(
        f"[rank {RANK}] torch_suite harness error, aborting the job:\n"
        + "".join(traceback.format_exception(kind, value, tb))
    )
    sys.stderr.flush()
    COMM.Abort(2)


class Channel:
    """The harness's own communicator (a Dup of COMM_WORLD): waits sleep instead of spinning,
    so that MPICH's busy-polling does not steal the 2 cores from the ranks still in a test."""

    def __init__(self) -> None:
        self.comm = COMM.Dup()

    def _wait(self, req: Any) -> Any:
        while True:
            done, value = req.test()
            if done:
                return value
            time.sleep(0.002)

    def sync(self) -> None:
        self._wait(_Req(self.comm.Ibarrier()))

    def bcast(self, obj: Any) -> Any:
        return self.comm.bcast(obj, root=0)  # (right after a sync: no long spin)


class _Req:
    """mpi4py's Request.Test as (done, None), like the object requests' test()."""

    def __init__(self, req: Any) -> None:
        self.req = req

    def test(self) -> tuple:
        return self.req.Test(), None


class Watchdog(threading.Thread):
    """Aborts the job when a test runs past its time."""

    def __init__(self, out: Recorder) -> None:
        super().__init__(daemon=True, name="torch_suite watchdog")
        self.out = out
        self.cv = threading.Condition()
        self.test: Optional[str] = None
        self.deadline = 0.0
        self.limit = 0.0

    def arm(self, test: Optional[str], limit: float) -> None:
        with self.cv:
            self.test, self.limit, self.deadline = test, limit, time.monotonic() + limit
            self.cv.notify()

    def run(self) -> None:
        with self.cv:
            while True:
                if self.test is None:
                    self.cv.wait()
                    continue
                left = self.deadline - time.monotonic()
                if left > 0:
                    self.cv.wait(left)
                    continue
                test = self.test
                self.out.write(
                    test, "timeout", f"no result after {self.limit:.0f} s on rank {RANK} (job aborted)", "", self.limit
                )
                sys.stderr.write(
                    f"\n[rank {RANK}] torch_suite: {test} still running after {self.limit:.0f} s; "
                    f"stacks of every thread, then MPI_Abort:\n"
                )
                faulthandler.dump_traceback(all_threads=True)
                sys.stderr.flush()
                time.sleep(5)  # the other ranks' watchdogs (armed within ms of this one) dump theirs too
                COMM.Abort(124)


class Recorder:
    def __init__(self, out_dir: str) -> None:
        self.path = os.path.join(out_dir, f"rank{RANK}.jsonl")
        self.lock = threading.Lock()

    def write(self, test: str, outcome: str, cause: str, tb: str, secs: float) -> None:
        line = json.dumps(
            {"test": test, "rank": RANK, "outcome": outcome, "cause": cause, "traceback": tb, "secs": round(secs, 2)}
        )
        with self.lock, open(self.path, "a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())


def one_line(tb: str) -> str:
    """What was raised, from a traceback: the first line of its last exception (the line at
    column 0 that names it, e.g. ``AssertionError: ...``), shortened."""
    pick = ""
    for ln in tb.splitlines():
        if re.match(r"[A-Za-z_][\w.]*(: |$)", ln) and not ln.startswith(
            ("Traceback", "During handling", "The above exception")
        ):
            pick = ln.strip()
    pick = pick or (tb.strip().splitlines() or [""])[-1].strip()
    return pick if len(pick) <= 300 else pick[:297] + "..."


def make_case(dt: Any, backend: str, chan: Channel) -> type:
    """torch's TestDistBackend + _DistTestBase, with the process machinery replaced by MPI ranks."""
    import torch.distributed as dist
    from torch.testing._internal import common_distributed, common_utils

    skip_codes = {s.exit_code: s.message for s in common_distributed.TEST_SKIPS.values()}
    over_mpi = backend.endswith("@mpi")

    class SuiteCase(dt.TestDistBackend, dt.DistributedTest._DistTestBase):
        passed = False

        def join_or_run(self, fn):
            """torch's wrapper runs the test in the children and joins them in the parent; here the
            rank runs it, and a sys.exit with a skip code is a skip (the parent's reading of it)."""

            def run(*args, **kwargs):
                try:
                    fn(*args, **kwargs)
                except SystemExit as e:
                    code = e.code if isinstance(e.code, int) else 1
                    if code in skip_codes:
                        raise unittest.SkipTest(skip_codes[code]) from None
                    raise AssertionError(f"the test exited the process with code {e.code!r}") from e
                self.passed = True

            return run

        def setUp(self):
            # The parent's part (TestDistBackend.setUp: temp dirs, Barrier.init, the store file) runs
            # on every rank, then every rank takes rank 0's paths: one shared set, as the children's.
            chan.sync()
            super().setUp()
            shared = chan.bcast(
                (self.file_name, os.environ["TEMP_DIR"], os.environ["INIT_METHOD"]) if RANK == 0 else None
            )
            if RANK != 0:
                os.unlink(self.file_name)
            self.file_name, os.environ["TEMP_DIR"], os.environ["INIT_METHOD"] = shared
            dt.INIT_METHOD = shared[2]  # (read at import by the children, which import after the parent set it)
            chan.sync()
            # The child's part (TestDistBackend._run): init, barrier; run_test seeds the RNGs.
            self.rank = RANK
            name = self._testMethodName
            timeout = timedelta(seconds=dt.CUSTOM_PG_TIMEOUT.get(name, dt.default_pg_timeout))
            if over_mpi:  # ranks and world size from MPI (the same as the suite's here)
                dist.init_process_group(init_method="mpi://", backend=dt.BACKEND, timeout=timeout)
            else:
                dist.init_process_group(
                    init_method=self.init_method,
                    backend=dt.BACKEND,
                    world_size=int(self.world_size),
                    rank=self.rank,
                    timeout=timeout,
                )
            self._barrier()
            common_utils.set_rng_seed()

        def tearDown(self):
            try:
                if self.passed:
                    self._barrier()  # as _run after run_test
            finally:
                try:
                    if dist.is_initialized():
                        dist.destroy_process_group()
                finally:
                    chan.sync()
                    super().tearDown()

    SuiteCase.__name__ = SuiteCase.__qualname__ = f"TorchSuite_{backend.replace('@', '_')}"
    return SuiteCase


def run_one(case_cls: type, name: str) -> tuple:
    result = unittest.TestResult()
    case_cls(name).run(result)
    if result.errors or result.failures:
        tb = "\n".join(t for _, t in result.errors + result.failures)
        return "fail", one_line(tb), tb
    if result.skipped:
        return "skip", str(result.skipped[0][1]), ""
    if result.expectedFailures:
        return "pass", "expected failure", ""
    if result.unexpectedSuccesses:
        return "fail", "unexpected success", ""
    return "pass", "", ""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=("mpidist", "gloo", "gloo@mpi", "mpidist@mpi"), required=True)
    p.add_argument("--tests", required=True, help="file with one test name per line, run in that order")
    p.add_argument("--out", required=True, help="directory for rank{R}.jsonl")
    p.add_argument("--test-timeout", type=float, default=120.0)
    p.add_argument("--pg-timeout", type=float, default=None, help="the suite's default_pg_timeout (torch: 60 s)")
    p.add_argument("--profile", action="store_true", help="mpidist in the suite's profiling lists")
    args = p.parse_args()
    sys.excepthook = _abort_on_exception
    tmp = os.environ.get("TORCH_SUITE_TMP") or args.out
    tempfile.tempdir = tmp  # every temporary file of the suite in the runner's private directory
    if COMM.Get_size() != classify.WORLD_SIZE:
        raise SystemExit(f"run under mpiexec -n {classify.WORLD_SIZE}, not {COMM.Get_size()}")
    chan = Channel()
    classify.prepare_env("file://" + os.path.join(tmp, "init_method_file"))
    dt = classify.load(args.backend.partition("@")[0], profile=args.profile or classify.PROFILE_MPIDIST)
    if args.backend.endswith("@mpi"):
        import mpidist.torch  # noqa: F401  (registers mpi://)
    if args.pg_timeout is not None:
        dt.default_pg_timeout = args.pg_timeout
    case_cls = make_case(dt, args.backend, chan)
    case_cls.setUpClass()
    with open(args.tests) as f:
        names = [ln.strip() for ln in f if ln.strip()]
    rec = Recorder(args.out)
    dog = Watchdog(rec)
    dog.start()
    for name in names:
        limit = (
            max(args.test_timeout, dt.CUSTOM_PG_TIMEOUT[name] + 60)
            if name in dt.CUSTOM_PG_TIMEOUT
            else args.test_timeout
        )
        dog.arm(name, limit)
        t0 = time.monotonic()
        outcome, cause, tb = run_one(case_cls, name)
        secs = time.monotonic() - t0
        dog.arm(None, 0)
        rec.write(name, outcome, cause, tb, secs)
        if RANK == 0:
            print(
                f"[{args.backend}] {name}: {outcome} ({secs:.1f} s){' ' + cause if outcome == 'fail' else ''}",
                flush=True,
            )
        chan.sync()
    case_cls.tearDownClass()


if __name__ == "__main__":
    main()
