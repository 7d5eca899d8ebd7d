"""``python -m mpidist``: run a script or module so that a failure on one rank ends the whole job.

Usage (as ``python -m mpi4py``)::

    mpiexec -n 4 python -m mpidist script.py [args...]
    mpiexec -n 4 python -m mpidist -m package.module [args...]
    mpiexec -n 4 python -m mpidist -c "code" [args...]

Beyond init_process_group's ``sys.excepthook`` (:mod:`mpidist._launch.abort`) it catches an
exception raised before ``init_process_group`` and a non-zero ``sys.exit(code)``: the
traceback prefixed ``[rank r]``, every rank's flight recorder written (if initialized), then
MPI_Abort (exit code 1, 130 for KeyboardInterrupt, or ``code``); a one-rank run just exits.
A :class:`JobExit`, which every rank raises together, ends the rank with its code unaborted.
It is also where mpidist owns the launch (:func:`mpidist._launch.environment.supervised`).
docs/reliability.md, sections 1 and 11. Source: mpi4py's ``mpi4py.run``.
"""

from __future__ import annotations

import builtins
import io
import os
import runpy
import sys
import traceback
import types
from collections.abc import Sequence
from typing import Any, NoReturn, Optional

from mpidist._launch import abort as A
from mpidist._launch.environment import launcher_rank

__all__ = ["main", "USAGE", "JobExit"]

USAGE = """\
usage: python -m mpidist [-h] [--version] (script.py | -m module | -c code) [args ...]

Run a Python program so that an unhandled exception (or a non-zero sys.exit) on any
rank prints its traceback prefixed with [rank r] and aborts the whole MPI job.

  script.py   run this file as __main__
  -m module   run this module as __main__ (like python -m)
  -c code     run this code as __main__ (like python -c)
  args        become sys.argv[1:] of the program
  -h, --help  this text
  --version   mpidist's version
"""

_RUNNER_FILES = (os.path.abspath(__file__), os.path.abspath(runpy.__file__), os.path.abspath("<frozen runpy>"))


def _rank_and_size() -> tuple[int, int]:
    """This process's rank and the job's size, from MPI (initializing it if the program did not)."""
    try:
        from mpi4py import MPI  # noqa: PLC0415  (imported late: the program may set mpi4py.rc first)

        if not MPI.Is_initialized() or MPI.Is_finalized():
            if MPI.Is_finalized():
                raise RuntimeError("MPI is finalized")
            MPI.Init_thread()
        return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    except Exception:  # noqa: BLE001  (fall back on the launcher's variables)
        return launcher_rank() or (0, 1)


def _user_traceback(exc: BaseException) -> Any:
    """The traceback of ``exc`` without the runner's own frames (its first frames)."""
    tb = exc.__traceback__
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) in _RUNNER_FILES:
        tb = tb.tb_next
    return tb


def _abort(code: int, reason: str) -> NoReturn:
    """Write every rank's flight recorder, then abort the job (or exit, in a one-rank run)."""
    rank, size = _rank_and_size()
    from mpidist._runtime import world as runtime  # noqa: PLC0415

    A.end_job(rank, size, code, reason, runtime.dump_all_report if runtime.is_initialized() else None)
    sys.exit(code)


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    return 1  # sys.exit("message"): Python prints the message and exits with 1


def _fresh_main(**attrs: object) -> dict[str, Any]:
    """A new ``__main__`` module, installed in sys.modules as ``python script.py`` has it (so
    the program's globals live, and are finalized, exactly as they would there); its dict."""
    main = types.ModuleType("__main__")
    main.__dict__.update(__builtins__=builtins, __spec__=None, __loader__=None, **attrs)
    sys.modules["__main__"] = main
    return main.__dict__


def _run(argv: list[str]) -> None:
    """Run the program named by ``argv`` (after mpidist's own options) as __main__."""
    first = argv[0]
    if first == "-m":
        if len(argv) < 2:
            raise _UsageError("-m needs a module name")
        sys.argv = [argv[1], *argv[2:]]
        _fresh_main()
        # what ``python -m`` runs (private, so not in typeshed's runpy)
        runpy._run_module_as_main(argv[1], alter_argv=True)  # type: ignore[attr-defined]
    elif first == "-c":
        if len(argv) < 2:
            raise _UsageError("-c needs the code to run")
        sys.argv = ["-c", *argv[2:]]
        exec(compile(argv[1], "<string>", "exec"), _fresh_main())  # noqa: S102  (what python -c does)
    elif first.startswith("-"):
        raise _UsageError(f"unknown option {first!r}")
    else:
        if not os.path.isfile(first):
            raise _UsageError(f"can't open file {first!r}: no such file")
        sys.argv = list(argv)
        sys.path.insert(0, os.path.dirname(os.path.abspath(first)))  # as python script.py does
        with io.open_code(first) as f:
            code = compile(f.read(), first, "exec")
        exec(code, _fresh_main(__file__=first, __cached__=None))  # noqa: S102


class _UsageError(Exception):
    pass


class JobExit(SystemExit):
    """``raise JobExit(code)`` on every rank at once (the ranks agreed on it, e.g. on a usage
    error: exit code 2): the runner lets each rank exit with ``code``, without MPI_Abort."""


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Entry point of ``python -m mpidist``; ``argv`` defaults to ``sys.argv[1:]``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        (sys.stdout if args else sys.stderr).write(USAGE)
        sys.exit(0 if args else 2)
    if args[0] == "--version":
        from mpidist import __version__  # noqa: PLC0415

        print(f"mpidist {__version__}")
        return
    try:
        _run(args)
    except _UsageError as exc:
        sys.stderr.write(f"python -m mpidist: error: {exc}\n{USAGE}")
        sys.exit(2)
    except SystemExit as exc:
        code = _exit_code(exc.code)
        if code == 0 or isinstance(exc, JobExit):
            raise
        if not isinstance(exc.code, (int, type(None))):
            sys.stderr.write(f"{exc.code}\n")
        _abort(code, f"sys.exit({exc.code!r})")
    except BaseException as exc:  # noqa: BLE001  (that is the point: any unhandled exception)
        rank, size = _rank_and_size()
        from mpidist._check import mismatch  # noqa: PLC0415
        from mpidist._runtime import world as runtime  # noqa: PLC0415

        tb = _user_traceback(exc)
        text = "".join(traceback.format_exception(type(exc), exc, tb))
        full = mismatch.get_debug_level() is not mismatch.DebugLevel.OFF
        dump = runtime.dump_all_report if runtime.is_initialized() else None
        sys.exit(A.report(rank, size, exc, tb, text, full, dump))
