"""The faults the chaos harness (tests/chaos/run.py) injects from inside a main job.

Usage, on every rank::

    python -m mpidist tests/chaos/inject.py FAULT RANK STEP MARKER -m mpidist.examples.train_digits [args ...]

then runs the module as ``__main__`` (as ``python -m`` does) with these faults armed on rank
``RANK`` only (the other ranks run the job unchanged):

* ``raise``: an exception at the job's ``STEP``-th training step (counted from 1 in this run;
  the job's per-step stop agreement, ``StopFlag.agreed``, is where the step is seen);
* ``unwritable``: the checkpoint's directory refuses new files when the checkpoint is written:
  mode 0o555, or (root ignores modes) ``tempfile.mkstemp`` fails with EACCES as the kernel
  would have answered a non-root user;
* ``full``: the disk fills at the checkpoint: the file-size limit (RLIMIT_FSIZE) drops to
  4 KiB, so the checkpoint's write fails with the kernel's EFBIG part-way through the file.

Before it injects, the rank writes the wall-clock time to ``MARKER`` (the harness measures the
job's end from it). Only a test tool: the job's own code is unchanged.
"""

from __future__ import annotations

import errno
import os
import resource
import runpy
import signal
import sys
import tempfile
import time

FAULT, RANK, STEP, MARKER = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
if sys.argv[5] != "-m":
    sys.exit("inject.py: expected -m MODULE after the fault")
MODULE = sys.argv[6]
sys.argv = [MODULE, *sys.argv[7:]]


def _mark() -> None:
    with open(MARKER, "w") as fh:
        fh.write(repr(time.time()))


def _mine() -> bool:
    return int(os.environ.get("RANK", os.environ.get("PMI_RANK", "-1"))) == RANK


def arm() -> None:
    from mpidist.examples import _job  # noqa: PLC0415  (after the runner is set up)

    if FAULT == "raise":
        agreed, count = _job.StopFlag.agreed, [0]

        def agreed_then_raise(self, *args, **kwargs):
            count[0] += 1
            if count[0] == STEP and _mine():
                _mark()
                raise RuntimeError(f"chaos: fault injected at step {STEP} of this run")
            return agreed(self, *args, **kwargs)

        _job.StopFlag.agreed = agreed_then_raise
    elif FAULT in ("unwritable", "full"):
        save = _job.save_checkpoint

        def failing_save(path, arrays):
            if _mine():
                _mark()
                if FAULT == "full":
                    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a signal
                    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
                elif os.geteuid() != 0:
                    os.chmod(os.path.dirname(os.path.abspath(path)), 0o555)
                else:

                    def mkstemp(*args, **kwargs):
                        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), kwargs.get("dir"))

                    tempfile.mkstemp = mkstemp
            return save(path, arrays)

        _job.save_checkpoint = failing_save
    else:
        sys.exit(f"inject.py: unknown fault {FAULT!r}")


arm()
runpy.run_module(MODULE, run_name="__main__", alter_sys=True)
