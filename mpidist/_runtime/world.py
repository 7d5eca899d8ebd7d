"""The process-wide state: MPI bootstrap, the default group, local rank, env export,
and the timeout watchdog.

Rank and world size come from MPI_COMM_WORLD (no rendezvous, no listening socket); the local
rank from its ``MPI_COMM_TYPE_SHARED`` split. Design: docs/architecture.md, "Bootstrap"; the
``MPIDIST_*`` reliability settings init_process_group reads: docs/reliability.md, "Settings".
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import operator
import os
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional, cast

from mpi4py import MPI  # initialized, within its bound, by the package's first line (mpidist/__init__.py)

from mpidist import work
from mpidist._check import init_args, mismatch
from mpidist._core import current as _current, recorder as R
from mpidist._core.current import live_groups
from mpidist._core.group import ProcessGroup
from mpidist._core.private_files import fresh_name
from mpidist._launch import abort as _abort, environment, launcher_files, mpi_init
from mpidist._launch.abort import abort_job
from mpidist._runtime import watchdog as _watchdog
from mpidist.device import binding, detect
from mpidist.errors import DistError, prefix

__all__ = [
    "Backend",
    "RuntimeState",
    "init_process_group",
    "destroy_process_group",
    "is_initialized",
    "is_mpi_available",
    "is_nccl_available",
    "get_backend",
    "get_rank",
    "get_world_size",
    "get_node_local_rank",
    "get_local_world_size",
    "state",
    "state_or_none",
    "resolve_group",
    "DEFAULT_TIMEOUT",
    "live_groups",
    "dump_all",
    "dump_all_report",
    "abort_job",
    "canonical_backend",
]

DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)
_NOT_INIT = "Default process group has not been initialized, please make sure to call init_process_group."


class Backend(str):
    """Backend names, as ``torch.distributed.Backend``: ``Backend("MPI") == "mpi"``."""

    MPI = "mpi"
    NCCL = "nccl"
    GLOO = "gloo"
    _SUPPORTED = ("mpi", "gloo", "nccl")

    def __new__(cls, name: str) -> Backend:
        if not isinstance(name, str):
            raise TypeError(f"Backend name must be a string, got {name!r}")
        return super().__new__(cls, name.lower())


@dataclass
class RuntimeState:
    """What init_process_group established; one per process."""

    backend: str
    world: ProcessGroup
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    timeout: datetime.timedelta
    thread_multiple: bool
    groups: list[ProcessGroup] = field(default_factory=list)  # every group made by new_group, for destroy


if MPI.Is_initialized() and not MPI.Is_finalized():  # (not if the program set mpi4py.rc.initialize)
    environment.export_at_import(MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size())


def state_or_none() -> Optional[RuntimeState]:
    return _current.state


def state() -> RuntimeState:
    """The runtime state; ValueError (as torch) when init_process_group was not called."""
    st: Optional[RuntimeState] = _current.state
    if st is None:
        raise ValueError(_NOT_INIT)
    return st


def is_initialized() -> bool:
    """True between init_process_group and destroy_process_group."""
    return _current.state is not None


def is_mpi_available() -> bool:
    """Always True: mpidist's transport is MPI."""
    return True


def is_nccl_available() -> bool:
    """True when CuPy with NCCL support can be imported."""
    try:
        from cupy.cuda import nccl  # noqa: F401, PLC0415
    except Exception:  # noqa: BLE001  (any import failure means unavailable)
        return False
    return True


_DEVICE_BACKENDS = {"cpu": ("mpi", "gloo"), "cuda": ("mpi", "gloo", "nccl")}
_gloo_warned = False


def canonical_backend(backend: Optional[str], where: str = "init_process_group:") -> str:
    """The stored form of a backend string, as :func:`get_backend` returns it.

    Accepts torch's spellings, any case: ``"mpi"``/``"cpu:mpi"``/``"cuda:mpi"``/
    ``"cpu:mpi,cuda:mpi"`` (-> ``"mpi"``); ``"nccl"``/``"cuda:nccl"`` (-> ``"nccl"``);
    ``"gloo"``/``"cpu:gloo"``/``"cuda:gloo"`` (-> ``"gloo"``); ``"cpu:mpi,cuda:nccl"`` and
    ``"cpu:gloo,cuda:nccl"`` in either order (a mixed ``"cpu:gloo,cuda:mpi"`` is kept so).
    ``"gloo"`` is MPI under torch's name (one warning per process, :func:`_warn_gloo`).

    Raises:
        ValueError: any other backend (ucc, "cpu:nccl", a device other than cpu/cuda, a
            device named twice, ...).
    """
    if backend is None:
        return Backend.MPI
    name = Backend(backend).replace(" ", "")
    if name in ("mpi", "gloo"):
        chosen = {"cpu": name, "cuda": name}
    elif name == "nccl":
        chosen = {"cuda": "nccl"}
    else:
        chosen = {}
        for part in name.split(","):
            device, _, impl = part.partition(":")
            if impl not in _DEVICE_BACKENDS.get(device, ()) or device in chosen:
                chosen = {}
                break
            chosen[device] = impl
    if not chosen:
        raise ValueError(
            f"{where} backend {backend!r} is not supported; expected 'mpi', 'gloo', 'nccl' or "
            f"torch's device:backend form such as 'cpu:gloo,cuda:nccl' (cpu: mpi or gloo; "
            f"cuda: mpi, gloo or nccl)"
        )
    if chosen.get("cuda") == "nccl":
        stored = Backend.NCCL if "cpu" not in chosen else f"cpu:{chosen['cpu']},cuda:nccl"
    elif len(set(chosen.values())) == 1:
        stored = next(iter(chosen.values()))
    else:
        stored = f"cpu:{chosen['cpu']},cuda:{chosen['cuda']}"
    if "gloo" in stored:
        _warn_gloo(backend, where)
    return stored


def _warn_gloo(backend: str, where: str) -> None:
    """Once per process: mpidist runs a gloo backend name over MPI."""
    global _gloo_warned
    if not _gloo_warned:
        _gloo_warned = True
        warnings.warn(
            f"{where} mpidist runs the {backend!r} backend over MPI: 'gloo' is accepted for programs "
            f"written for torch (get_backend() says 'gloo'), host arrays travel over MPI as with "
            f"'mpi', and ranks come from the MPI launcher (mpiexec/srun)",
            stacklevel=5,
        )


def _check_init_method(init_method: Optional[str]) -> None:
    if init_method is None or init_method.startswith("env://"):
        return
    if init_method.startswith(("tcp://", "file://")):
        warnings.warn(
            f"init_process_group: init_method {init_method!r} ignored: mpidist takes ranks "
            f"from MPI and needs no rendezvous",
            stacklevel=4,
        )
        return
    raise ValueError(
        f"init_process_group: init_method must be None, 'env://', 'tcp://...' or 'file://...', got {init_method!r}"
    )


def init_process_group(
    backend: Optional[str] = None,
    init_method: Optional[str] = None,
    timeout: Optional[datetime.timedelta] = None,
    world_size: int = -1,
    rank: int = -1,
    store: Any = None,
    group_name: str = "",
    pg_options: Any = None,
    device_id: Any = None,
) -> None:
    """Create the default process group from MPI_COMM_WORLD (collective over it).

    Same signature as ``torch.distributed.init_process_group``. Rank and world size come
    from MPI: launch with ``mpiexec -n N`` or ``srun -n N``; a plain ``python script.py`` is
    a world of size 1. ``store`` is not used; ``tcp://`` and ``file://`` init methods are
    accepted with a warning and ignored.

    ``backend``: ``"mpi"`` (default), ``"nccl"``, ``"cpu:mpi,cuda:nccl"``, or torch's gloo
    names, which run over MPI (:func:`canonical_backend`). NCCL is loaded only when a device
    array first meets it, so ``"nccl"`` initializes on a CPU-only machine too (torch
    refuses). Where CuPy and a GPU exist, ``device_id`` (an int, ``"cuda:N"`` or an object
    with ``.index``), else ``MPIDIST_DEVICE``, else ``local_rank % device_count`` becomes the
    current device; CUDA-awareness of MPI is detected here (docs/device.md).

    ``rank`` / ``world_size`` (-1: take MPI's):

    * with an MPI backend name (``"mpi"``, ``"cpu:mpi"``, ``"cpu:mpi,cuda:nccl"``), as torch's
      MPI backend: values that differ from MPI's are ignored with torch's warning ("For MPI
      backend, world_size (0) and rank (0) are ignored ..."), except ranks that are all
      different, each in 0..n-1, but not MPI's (a renumbering): ValueError.
    * with any other name (None, ``"gloo"``, ``"nccl"``, ...) they must match MPI, else
      ValueError saying how to launch (``mpiexec -n W`` / ``srun -n W``).

    RANK / WORLD_SIZE in the environment that say a larger world than MPI launched
    (torchrun's habit) raise ValueError saying how to launch. Exports RANK, WORLD_SIZE,
    LOCAL_RANK and LOCAL_WORLD_SIZE (docs/hpc.md).

    Every error is raised on every rank with the same message (the checks are exchanged in
    one MPI_Iallgather, :mod:`mpidist._check.init_args`); a rank that does not call it within
    the timeout ends the job (docs/reliability.md, section 1a). Installs a ``sys.excepthook``
    that aborts the job on an unhandled exception (unless ``MPIDIST_ABORT_ON_EXCEPTION=0``;
    docs/reliability.md, section 1); destroy_process_group removes it.

    Raises:
        ValueError: already initialized ("trying to initialize the default process
            group twice!", as torch), an unsupported backend, world_size/rank that
            contradict MPI (as above), an environment that says a larger world, different
            backends on different ranks, ``device_id`` given where there is no GPU (or no
            CuPy) or out of range, a bad MPIDIST_* setting; on every rank alike.
        TypeError: ``timeout`` not a timedelta, ``rank``/``world_size`` not ints.
        DistError: a rank did not call it within the timeout, with MPIDIST_ABORT_ON_TIMEOUT=0.
    """
    if _current.state is not None:
        st = _current.state
        raise ValueError(
            f"[rank {st.rank}/{st.world_size}] init_process_group: trying to "
            f"initialize the default process group twice!"
        )
    world = MPI.COMM_WORLD
    mpi_rank, mpi_size = world.Get_rank(), world.Get_size()
    tag = f"[rank {mpi_rank}/{mpi_size}]"
    mine, settings = _check_locally(backend, init_method, timeout, world_size, rank, device_id)
    try:
        error, warning = init_args.agree(world, mine, settings.timeout.total_seconds())
    except init_args.InitTimeout as exc:
        text = f"{tag} {exc}" + (f" (this rank's own error: {mine.error})" if mine.error is not None else "")
        if settings.abort:
            _abort.write(
                mpi_rank,
                f"mpidist.errors.DistError: {text}\naborting the job (set "
                f"MPIDIST_ABORT_ON_TIMEOUT=0 to raise the DistError in the caller instead)",
            )
            abort_job(1)
        raise DistError(text) from None
    if error is not None:
        raise error[0](f"{tag} {error[1]}")
    if warning is not None:
        warnings.warn(warning, stacklevel=2)
    launcher_files.remove_names()  # MPI may have been initialized after mpidist was imported
    name = mine.backend
    node = world.Split_type(MPI.COMM_TYPE_SHARED, key=mpi_rank)
    local_rank, local_size = node.Get_rank(), node.Get_size()
    node.Free()
    detect.init(world)  # CUDA-aware MPI? (MPIDIST_CUDA_AWARE, MPIX_Query_cuda_support, info key)
    binding.bind(device_id, local_rank, f"{tag} init_process_group:")  # checked above: cannot raise here
    group = ProcessGroup(world.Dup(), range(mpi_size), group_name or "default_pg", name)
    st = _current.state = RuntimeState(
        backend=name,
        world=group,
        rank=mpi_rank,
        world_size=mpi_size,
        local_rank=local_rank,
        local_world_size=local_size,
        timeout=settings.timeout,
        thread_multiple=MPI.Query_thread() >= MPI.THREAD_MULTIPLE,
    )
    environment.export(
        {"RANK": mpi_rank, "WORLD_SIZE": mpi_size, "LOCAL_RANK": local_rank, "LOCAL_WORLD_SIZE": local_size}
    )
    # (group.comm: the Dup made above, not None)
    R.configure(
        settings.timeout.total_seconds(), settings.buffer, _trace_name(cast(MPI.Comm, group.comm)), settings.keep
    )
    work.ABORT_ON_TIMEOUT = settings.abort
    mismatch.set_debug_level(settings.level or mismatch.get_debug_level())  # unset: keep the level set before init
    _watchdog.start(st)
    _register_exit_check()
    if settings.abort_on_exception:
        full = mismatch.get_debug_level() is not mismatch.DebugLevel.OFF  # (set just above)
        _abort.install_excepthook(mpi_rank, mpi_size, dump_all_report, full)


@dataclass
class _Settings:
    """init_process_group's settings from its arguments and the environment."""

    timeout: datetime.timedelta = DEFAULT_TIMEOUT
    abort: bool = True
    level: Optional[mismatch.DebugLevel] = None  # None: neither debug variable is set
    buffer: int = R.DEFAULT_BUFFER
    keep: int = R.DEFAULT_KEEP
    abort_on_exception: bool = True


def _int_arg(value: Any, name: str, where: str) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{where} {name} must be an int, got {type(value).__name__}")
    return operator.index(value)


def _check_locally(
    backend: Optional[str], init_method: Optional[str], timeout: Any, world_size: Any, rank: Any, device_id: Any
) -> tuple[init_args.Mine, _Settings]:
    """Every check init_process_group makes of its arguments and the environment, without
    communicating: this rank's view for :func:`mpidist._check.init_args.agree`, with the first
    error (TypeError/ValueError, its message starting ``init_process_group:``) kept in it."""
    where = "init_process_group:"
    env = environment.user_values()
    mine = init_args.Mine(env_rank=env["RANK"], env_size=env["WORLD_SIZE"])
    settings = _Settings()
    try:
        mine.rank = _int_arg(rank, "rank", where)
        mine.world_size = _int_arg(world_size, "world_size", where)
        mine.backend = canonical_backend(backend, where)
        mine.mpi_name = backend is not None and mine.backend in (Backend.MPI, "cpu:mpi,cuda:nccl")
        _check_init_method(init_method)
        if timeout is not None and not isinstance(timeout, datetime.timedelta):
            raise TypeError(f"{where} timeout must be a datetime.timedelta, got {type(timeout).__name__}")
        if timeout is not None and timeout.total_seconds() <= 0:
            raise ValueError(f"{where} timeout must be positive, got {timeout}")
        settings.timeout = env_timeout(where) or timeout or DEFAULT_TIMEOUT
        settings.abort, settings.level, settings.buffer = _env_reliability(where)
        settings.keep = _env_count("MPIDIST_TRACE_KEEP", R.DEFAULT_KEEP, "job directories", where)
        settings.abort_on_exception = _env_flag("MPIDIST_ABORT_ON_EXCEPTION", where)
        try:
            detect.env_override(os.environ)
        except ValueError as exc:
            raise ValueError(f"{where} {exc}") from None
        binding.check(device_id, where)
    except (TypeError, ValueError) as exc:
        mine.error = exc
    return mine, settings


def dump_all_report(reason: str, traceback: str = "") -> str:
    """Every rank's flight recorder (:func:`dump_all`) and this rank's ``traceback``, and the
    line that says where."""
    line = R.report(dump_all(reason))
    if traceback and _current.state is not None:
        with contextlib.suppress(Exception):  # (the job is failing)
            name = f"rank{_current.state.rank}.traceback.txt"
            line += f"; this rank's full traceback: {R.write(name, traceback.encode())}"
    return line


_exit_check_registered = False


def _register_exit_check() -> None:
    """Register :func:`_compare_at_exit` (once; after the watchdog's exit handler, so it runs
    before it)."""
    global _exit_check_registered
    if not _exit_check_registered:
        atexit.register(_compare_at_exit)
        _exit_check_registered = True


def _compare_at_exit() -> None:
    """A process that leaves without destroy_process_group: its groups' final comparison; on
    a difference it prints the mismatch and aborts the job (exit status 1). Nothing after
    destroy, or on an unhandled exception (docs/reliability.md, section 4)."""
    st = _current.state
    if st is None or getattr(sys, "last_value", None) is not None or getattr(sys, "last_exc", None) is not None:
        return
    _watchdog.leaving()
    try:
        for g in (*st.groups, st.world):
            mismatch.compare_final(g, "exit")
    except Exception as exc:  # noqa: BLE001  (a mismatch, or a timeout of the comparison)
        _abort.report(
            st.rank, st.world_size, exc, None, f"{type(exc).__module__}.{type(exc).__name__}: {exc}", True, None
        )


def destroy_process_group(group: Optional[ProcessGroup] = None) -> None:
    """Free the default group (with every other group and the runtime state), or only ``group``.

    Collective over the group's members. After destroying the default group,
    init_process_group may be called again; using a destroyed group raises ValueError.
    Destroying the default group also removes init_process_group's ``sys.excepthook`` and
    the watchdog (and its SIGTERM handler).

    Raises:
        ValueError: the members made different calls on a group destroyed (its final
            comparison, docs/reliability.md, section 4): on every member, naming the first
            call that differs (a group already broken by a mismatch is not compared again).
    """
    st = state()
    if group is None or group is st.world:
        _watchdog.leaving()
        for g in (*st.groups, st.world):  # while the watchdog still answers the peers' questions
            mismatch.compare_final(g, "destroy_process_group")
        _abort.remove_excepthook()
        _watchdog.stop()
        for g in st.groups:
            g.free()
        st.world.free()
        _current.state = None
    else:
        pg = resolve_group(group)  # raises for a group destroyed already
        if pg.comm is not None:  # a non-member (NON_GROUP_MEMBER) has nothing to free
            mismatch.compare_final(pg, "destroy_process_group")
            pg.free()


def check_collectives(group: Optional[ProcessGroup] = None) -> None:
    """Compare the calls every member made on ``group`` (default: the default group) so far.

    An mpidist extension, collective over the group's members: the final comparison of
    destroy_process_group (docs/reliability.md, section 4). Call it before writing a
    checkpoint. Costs one MPI_Iallgather of 17 int64 per member.

    Raises:
        ValueError: the members made different calls; on every member, with the same text,
            naming the first call that differs (its sequence number, and each rank's
            arguments). The group is unusable afterwards (its ops raise DistError).
        ValueError: ``group`` was destroyed.
    """
    mismatch.compare_final(resolve_group(group), "check_collectives")


def resolve_group(group: Optional[ProcessGroup]) -> ProcessGroup:
    """``group`` itself, or the default group for None."""
    if group is None:
        return state().world
    if not isinstance(group, ProcessGroup):
        raise TypeError(f"{prefix('group')} group must be a ProcessGroup or None, got {type(group).__name__}")
    if group.destroyed:
        raise ValueError(
            f"{prefix('group')} group {group.group_name!r} was destroyed by "
            f"destroy_process_group and cannot be used any more"
        )
    return group


def get_backend(group: Optional[ProcessGroup] = None) -> str:
    """The backend of ``group`` (default: the default group), as torch spells it: ``"mpi"``,
    ``"nccl"`` or ``"cpu:mpi,cuda:nccl"`` (see :func:`canonical_backend`).

    Device arrays go to NCCL for ``"nccl"`` and ``"cpu:mpi,cuda:nccl"``; for ``"mpi"``, to
    CUDA-aware MPI if :func:`mpidist.cuda_aware_mpi`, else host staging (docs/device.md).
    Host arrays always use MPI.
    """
    return resolve_group(group).backend


def get_rank(group: Optional[ProcessGroup] = None) -> int:
    """The caller's rank in ``group`` (global rank by default); -1 if not a member."""
    if group is None:
        return state().rank
    return resolve_group(group).rank()


def get_world_size(group: Optional[ProcessGroup] = None) -> int:
    """Number of ranks in ``group`` (all ranks by default); -1 if the caller is not a member."""
    if group is None:
        return state().world_size
    g = resolve_group(group)
    return g.size() if g.is_member() else -1


def get_node_local_rank(fallback_rank: Optional[int] = None) -> int:
    """The rank among the processes on this node (from MPI's shared-memory split).

    Before init it reads the LOCAL_RANK environment variable, then ``fallback_rank``,
    as torch does; raises RuntimeError if none is available.
    """
    st: Optional[RuntimeState] = _current.state
    if st is not None:
        return st.local_rank
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    if fallback_rank is not None:
        return int(fallback_rank)
    raise RuntimeError(
        "get_node_local_rank: LOCAL_RANK is not set and no fallback_rank was given; call init_process_group first"
    )


def get_local_world_size() -> int:
    """Number of ranks on this node (mpidist addition; torch reads LOCAL_WORLD_SIZE)."""
    return state().local_world_size


# -- reliability settings ------------------------------------------------------------------


def env_timeout(where: str) -> Optional[datetime.timedelta]:
    """MPIDIST_TIMEOUT in seconds (it overrides init_process_group's timeout), or None."""
    text = os.environ.get("MPIDIST_TIMEOUT", "").strip()
    if not text:
        return None
    try:
        secs = float(text)
    except ValueError:
        secs = -1.0
    if not secs > 0 or secs != secs or secs == float("inf"):
        raise ValueError(f"{where} MPIDIST_TIMEOUT must be a positive number of seconds, got {text!r}")
    return datetime.timedelta(seconds=secs)


def _env_reliability(where: str) -> tuple[bool, Optional[mismatch.DebugLevel], int]:
    """(abort on timeout, debug level or None when unset, flight recorder length) from the
    environment; the other settings init checks (docs/reliability.md, "Settings") checked."""
    abort = _env_flag("MPIDIST_ABORT_ON_TIMEOUT", where)
    level = mismatch.env_level(where)  # MPIDIST_DEBUG, else TORCH_DISTRIBUTED_DEBUG
    buffer = _env_count("MPIDIST_TRACE_BUFFER", R.DEFAULT_BUFFER, "entries", where)
    for name in (mpi_init.ENV, launcher_files.ENV, environment.SUPERVISE_ENV):  # read leniently at import
        _env_flag(name, where)
    for name in (mpi_init.GRACE_ENV, _watchdog.STALL_ENV):
        text = os.environ.get(name, "").strip()
        if text and mpi_init.env_seconds(name, -1.0, True) < 0:
            raise ValueError(f"{where} {name} must be a number of seconds >= 0, got {text!r}")
    for name in (environment.SHM_MIN_BYTES_ENV, environment.STAGING_CHUNK_ENV):
        environment.byte_setting(name, where)
    return abort, level, buffer


def _env_count(name: str, default: int, what: str, where: str) -> int:
    """A setting that is a number >= 0 (``what``: of what)."""
    text = os.environ.get(name, str(default)).strip()
    if not text.isdecimal():
        raise ValueError(f"{where} {name} must be a number of {what} >= 0, got {text!r}")
    return int(text)


def _env_flag(name: str, where: str) -> bool:
    """A 0/1 setting that defaults to 1 (unset or empty)."""
    text = os.environ.get(name, "1").strip()
    if text not in ("0", "1", ""):
        raise ValueError(f"{where} {name} must be 0 or 1, got {text!r}")
    return text != "0"


def _trace_name(comm: MPI.Comm) -> str:
    """The job's trace directory's name, ``mpidist-trace-<time>-<16 random hex digits>``, chosen
    by rank 0 (collective). Nothing is created here (docs/reliability.md, section 3)."""
    return str(comm.bcast(fresh_name(R.TRACE_PREFIX) if comm.Get_rank() == 0 else None, 0))


def dump_all(reason: str, wait: float = 2.0) -> Optional[str]:
    """Write this rank's flight recorder and ask every other rank to write theirs (waiting
    at most ``wait`` s for them); the path of this rank's file. Used before an abort."""
    path = R.dump(reason)
    wd = _current.watchdog
    if wd is not None:
        with contextlib.suppress(Exception):  # the job is failing: never mask that
            wd.dump_all(reason, wait)
    return path
