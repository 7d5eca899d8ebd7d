"""MPI_Init and MPI_Finalize, bounded in time: the two waits for every rank that no mpidist
timeout watches (docs/reliability.md, section 11; found by the chaos tests: a rank stopped
before either hung the job).

* :func:`import_mpi` imports ``mpi4py.MPI`` (``MPI_Init``) under
  ``faulthandler.dump_traceback_later(T, exit=True)``: past the bound the rank prints
  ``Timeout (h:mm:ss)!`` and a stack ending in
  ``_mpi_init_waits_for_every_rank_for_at_most_MPIDIST_TIMEOUT``, and exits with status 1.
* An ``atexit`` handler aborts the job when an unhandled exception ended a rank of several (one
  that raised before init_process_group left its peers waiting in it), and arms ``alarm()`` at
  the bound on what is left of the rank (mpi4py calls
  ``MPI_Finalize`` from ``Py_AtExit``, after faulthandler's thread has stopped), where SIGALRM
  has its default action; under supervision it also starts the exit watcher
  (:mod:`mpidist._launch.finalize_watcher`), whose line says why. After a final comparison that
  waited its whole timeout, the bound is the grace alone (:func:`peers_had_their_timeout`).
* Supervision (:func:`mpidist._launch.environment.supervised`: ``python -m mpidist`` or
  ``MPIDIST_SUPERVISE=1``; never in somebody else's program): the watcher of ``MPI_Init``
  (:mod:`mpidist._launch.init_watcher`), the removal of the launcher's files once it has
  returned (:mod:`mpidist._launch.launcher_files`), and SIGUSR1 recorded from import on where it
  has its default action (MPICH's ``MPI_Init`` would swallow a time-limit warning sent before the
  program installs its handler): :func:`early_signals`.

T is ``MPIDIST_TIMEOUT`` (s) where it is a positive number, else 30 minutes, plus the grace
``MPIDIST_INIT_FINALIZE_GRACE`` (s, >= 0; else :data:`GRACE`) for start-up and exit work that is
no wait for a peer. ``MPIDIST_BOUND_INIT_FINALIZE=0`` switches both bounds off.
"""

from __future__ import annotations

import atexit
import faulthandler
import math
import os
import signal
import sys
import threading
from types import ModuleType
from typing import Optional

from mpidist._launch import abort, environment, finalize_watcher, init_watcher, launcher_files

__all__ = [
    "import_mpi",
    "bound_seconds",
    "grace_seconds",
    "env_seconds",
    "peers_had_their_timeout",
    "early_signals",
    "ENV",
    "GRACE_ENV",
]

ENV = "MPIDIST_BOUND_INIT_FINALIZE"
GRACE_ENV = "MPIDIST_INIT_FINALIZE_GRACE"
GRACE = 10.0  # s, the default grace
_DEFAULT_S = 30 * 60.0


def env_seconds(name: str, default: float, zero: bool) -> float:
    """``name`` in seconds if a finite number > 0 (>= 0 with ``zero``), else ``default``."""
    try:
        value = float(os.environ.get(name, "").strip())
    except ValueError:
        return default
    return value if (value >= 0 if zero else value > 0) and value < math.inf else default


def bound_seconds() -> float:
    """T + grace: T is MPIDIST_TIMEOUT when it is a positive finite number of seconds, else 30
    minutes (a bad value is reported by init_process_group, not here); the grace is
    MPIDIST_INIT_FINALIZE_GRACE when it is a finite number >= 0, else GRACE."""
    return env_seconds("MPIDIST_TIMEOUT", _DEFAULT_S, False) + grace_seconds()


_RECORDED = (signal.SIGUSR1,)  # what MPICH's MPI_Init would swallow
_early: set[int] = set()


def _record(signum: int, frame: object) -> None:
    _early.add(signum)


def _record_early_signals() -> None:
    """Give each signal of _RECORDED that has its default action the recording handler."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in _RECORDED:
        if signal.getsignal(sig) is signal.SIG_DFL:
            signal.signal(sig, _record)


def early_signals() -> frozenset[int]:
    """The signals (SIGUSR1) that arrived while mpidist's recording handler was theirs: from
    ``import mpidist`` until the program installed its own handler. Call after installing it."""
    return frozenset(_early)


def _enabled() -> bool:
    return os.environ.get(ENV, "1").strip() != "0"


def _mpi_init_waits_for_every_rank_for_at_most_MPIDIST_TIMEOUT() -> ModuleType:  # noqa: N802  (read in a stack dump)
    from mpi4py import MPI  # noqa: PLC0415  (this import is MPI_Init)

    return MPI


#: A final comparison (mpidist._check.mismatch) waited its group's whole timeout for a peer that
#: neither came nor left: see :func:`peers_had_their_timeout`.
_waited = False


def grace_seconds() -> float:
    """MPIDIST_INIT_FINALIZE_GRACE when it is a finite number >= 0, else GRACE."""
    return env_seconds(GRACE_ENV, GRACE, True)


def peers_had_their_timeout() -> Optional[float]:
    """Note that this rank waited the whole timeout of a group of every rank for a peer at a
    final comparison (``destroy_process_group`` or exit; :mod:`mpidist._check.mismatch`) and gave it up:
    MPI_Finalize is then bounded by the grace alone, since the peers have had the timeout
    already. Without it a rank stopped just before ``destroy_process_group`` held the job for
    the timeout twice plus the grace (a chaos trial: 28 s against its bound of 23). Returns
    that bound (s), or None where the bounds are off (MPIDIST_BOUND_INIT_FINALIZE=0)."""
    global _waited
    if not _enabled():
        return None
    _waited = True
    return grace_seconds()


def _finalize_message(rank: int, size: int, seconds: float) -> str:
    if _waited:
        why = f"{GRACE_ENV}, the final comparison of the calls having waited the timeout already"
    else:
        why = f"MPIDIST_TIMEOUT + {GRACE_ENV}"
    return (
        f"[rank {rank}/{size}] MPI_Finalize timed out: this rank was still exiting {seconds:g} s after its exit "
        f"handlers began (bound: {why}), most likely waiting in MPI_Finalize for a rank that is stopped or "
        "dead; mpidist ends it (SIGALRM)"
    )


def _at_exit() -> None:
    """atexit: a rank of a multi-rank job that an unhandled exception ends (Python set
    ``sys.last_value`` and printed the traceback) aborts the job, since its peers may wait for it
    (before init_process_group installs its hook: they wait in init); then, where the bounds
    are on, it bounds what is left of this process, MPI_Finalize included: the exit watcher
    ends it at the bound, after a line that says why; the kernel's alarm one second later where
    no watcher could start."""
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is None or not MPI.Is_initialized() or MPI.Is_finalized():
        return
    world = MPI.COMM_WORLD
    if world.Get_size() == 1:  # no peer for MPI_Finalize to wait for: nothing to bound, no watcher
        return
    exc = getattr(sys, "last_value", None)
    on = os.environ.get("MPIDIST_ABORT_ON_EXCEPTION", "1").strip() != "0"
    interactive = sys.flags.interactive or hasattr(sys, "ps1") or "IPython" in sys.modules  # (they set it per error)
    if exc is not None and on and not interactive:
        why = "the unhandled exception above ended this rank, whose peers may wait for it"
        abort.report(world.Get_rank(), world.Get_size(), exc, None, why, True, None)
    if not _enabled():
        return
    seconds = grace_seconds() if _waited else bound_seconds()
    if environment.supervised():
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        # the watcher's pipe stays open until this process exits: its end-of-file tells the watcher
        finalize_watcher.start(seconds, _finalize_message(world.Get_rank(), world.Get_size(), seconds))
    elif signal.getsignal(signal.SIGALRM) is not signal.SIG_DFL:
        return  # somebody else's program keeps its own SIGALRM handler (and MPI_Finalize is unbounded)
    signal.alarm(math.ceil(seconds) + 1)


def import_mpi() -> ModuleType:
    """``mpi4py.MPI``, imported (MPI_Init) within the bound or this process exits with status 1; also
    arms the bound on MPI_Finalize (see the module docstring). Call from the main thread."""
    bounded = _enabled()
    if "mpi4py.MPI" in sys.modules:  # imported (initialized) before mpidist
        MPI = sys.modules["mpi4py.MPI"]
        if MPI.Is_initialized():
            launcher_files.remove_names()
    else:
        supervised = environment.supervised()
        if supervised and environment.launched():  # a job's rank (a plain Python keeps its handlers)
            _record_early_signals()
        watch = init_watcher.start() if supervised else None  # removes MPICH's segment if this rank dies in MPI_Init
        if bounded:
            faulthandler.dump_traceback_later(bound_seconds(), exit=True)
        try:
            MPI = _mpi_init_waits_for_every_rank_for_at_most_MPIDIST_TIMEOUT()
        finally:
            if bounded:
                faulthandler.cancel_dump_traceback_later()
            through = "mpi4py.MPI" in sys.modules and sys.modules["mpi4py.MPI"].Is_initialized()
            if through:
                launcher_files.remove_names()
            init_watcher.end(watch, through)
    atexit.register(_at_exit)  # runs before mpi4py's MPI_Finalize (registered earlier)
    return MPI
