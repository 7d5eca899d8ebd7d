"""Rendezvous without a port: ranks from MPI_COMM_WORLD, a store served over MPI.

Two ways in, both registered by ``import mpidist.torch``:

* ``init_method="mpi://"``: :func:`mpi_rendezvous_handler` (torch's public
  ``register_rendezvous_handler``).
* ``init_process_group("mpidist")`` with no ``init_method`` (torch then uses
  ``env://``): torch's env handler is wrapped (:func:`install_env_handler`; torch's
  private ``rendezvous._rendezvous_handlers["env"]``) so that, *for backend
  ``"mpidist"`` only*, ranks come from MPI as well. Other backends get torch's own env
  handler unchanged. Which backend is being initialized is read from the
  ``init_process_group`` frame on the stack (private: tested against each torch
  version mpidist supports); where it cannot be found, torch's handler runs.

Either way the rank and world size are MPI's: under ``mpiexec -n N`` or
``srun --mpi=pmi2`` no MASTER_ADDR, MASTER_PORT, RANK or WORLD_SIZE is needed, and a
plain ``python script.py`` is a world of size 1. The store is an
:class:`~mpidist.torch.store.MPIStore` (served by rank 0 over MPI; made collectively by
every rank in the rendezvous): nothing of mpidist's listens on a socket, and the store is
shared between the ranks, so torch's own backends work over it too:
``init_process_group("gloo", init_method="mpi://")`` (and ``"nccl"``) take MPI's ranks
with no MASTER_ADDR, and gloo groups beside an mpidist world (``new_group(backend="gloo")``)
and ``TORCH_DIST_INIT_BARRIER=1`` meet in it. Where MPI gives less than
``MPI_THREAD_MULTIPLE`` the store is a process-local ``HashStore``: backend ``"mpidist"``
works, torch's own backends across ranks do not. For backend ``"mpidist"``
the handler starts mpidist's runtime (``mpidist.init_process_group``, collective), whose
check of the settings applies, with the same error on every rank: ``rank=``/``world_size=``
as for torch's own MPI backend (values that differ from MPI's are ignored with torch's
warning; a renumbering of the processes is an error), RANK/WORLD_SIZE in the environment
that say a larger world than MPI launched are an error. MASTER_ADDR/MASTER_PORT are not
needed and, when set, unused (said once, on rank 0, at debug level INFO or DETAIL:
``MPIDIST_DEBUG``/``TORCH_DISTRIBUTED_DEBUG``; frameworks set them on their own).
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings
from collections.abc import Iterator
from datetime import timedelta
from types import FrameType
from typing import Any, Callable, Optional
from urllib.parse import urlparse

import torch.distributed as dist
from mpi4py import MPI

import mpidist
from mpidist.torch import _backend
from mpidist.torch.store import MPIStore

__all__ = ["mpi_rendezvous_handler", "install_env_handler", "close_unused", "SCHEME", "BACKEND"]

SCHEME = "mpi"
BACKEND = "mpidist"
_DEFAULT_TIMEOUT = timedelta(minutes=30)
#: torch's rendezvous module (``torch.distributed.rendezvous`` the attribute is its function)
_rdzv = importlib.import_module("torch.distributed.rendezvous")
_C10D = os.path.join("torch", "distributed", "distributed_c10d.py")
_HERE = os.path.dirname(os.path.abspath(__file__))


def _where() -> str:
    return f"[rank {MPI.COMM_WORLD.Get_rank()}/{MPI.COMM_WORLD.Get_size()}] init_process_group:"


def calling_backend() -> Optional[str]:
    """The ``backend`` of the ``torch.distributed.init_process_group`` call on this
    thread's stack, as torch normalized it (``"mpidist"``, ``"gloo"``, ...), or None when
    there is none (a direct call of torch's ``rendezvous``)."""
    frame: Optional[FrameType] = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "init_process_group" and code.co_filename.endswith(_C10D):
            backend = frame.f_locals.get("backend")
            return None if backend is None else str(backend)
        frame = frame.f_back
    return None


def _is_ours(backend: Optional[str]) -> bool:
    return backend is not None and BACKEND in backend.lower()


def _query(url: str) -> dict[str, str]:
    return dict(pair.split("=", 1) for pair in urlparse(url).query.split("&") if "=" in pair)


def _int(value: Optional[str], source: str) -> int:
    """A rank or world size from the URL's query (-1 when absent)."""
    if value is None or not value.strip():
        return -1
    try:
        return int(value.strip())
    except ValueError:
        raise ValueError(f"{_where()} {source} must be an integer, got {value!r}") from None


def _user_stacklevel() -> int:
    """The stacklevel of the first frame outside torch.distributed and this package."""
    frame: Optional[FrameType]
    level, frame = 1, sys._getframe(1)
    torch_dir = os.path.join("torch", "distributed")
    while frame is not None:
        name = frame.f_code.co_filename
        if torch_dir not in name and not name.startswith(_HERE) and "contextlib" not in name:
            return level
        frame = frame.f_back
        level += 1
    return 1


def mpi_rendezvous_handler(
    url: str, timeout: timedelta = _DEFAULT_TIMEOUT, **kwargs: Any
) -> Iterator[tuple[Any, int, int]]:
    """torch rendezvous handler for ``mpi://``: yields ``(store, MPI rank, MPI size)``.

    ``url`` may carry ``rank=`` / ``world_size=`` (torch adds init_process_group's
    arguments). For backend ``"mpidist"`` this starts mpidist's runtime unless it runs
    already (collective over MPI_COMM_WORLD: every rank must get here), which checks them
    and the RANK / WORLD_SIZE environment variables as for torch's MPI backend (see the
    module's docstring); on a runtime started before, values that differ from MPI's are
    ignored with torch's warning. The store: :func:`store` (a new MPIStore, collective).

    Raises:
        ValueError: (on every rank) a renumbering of the processes, or an environment
            that says a larger world than MPI launched; another backend than "mpidist" with
            a world of more than one rank where the store cannot be shared (no
            MPI_THREAD_MULTIPLE).
    """
    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    query = _query(url)
    given_rank, given_size = _int(query.get("rank"), "rank"), _int(query.get("world_size"), "world_size")
    backend = calling_backend()
    shared = MPI.Query_thread() >= MPI.THREAD_MULTIPLE
    if size > 1 and not shared and backend is not None and not _is_ours(backend):
        raise ValueError(
            f"{_where()} init_method 'mpi://' gives a process-local store here (MPI gives less "
            f"than MPI_THREAD_MULTIPLE, which the store over MPI needs), which backend {backend!r} "
            f"cannot use across {size} ranks; use backend 'mpidist' (import mpidist.torch)"
        )
    if _is_ours(backend):
        if not mpidist.is_initialized():
            _backend.start_runtime(timeout, given_rank, given_size)
        elif (given_rank, given_size) != (-1, -1) and (given_rank, given_size) != (rank, size):
            warnings.warn(
                f"For MPI backend, world_size ({given_size}) and rank ({given_rank}) are ignored since "
                f"they are assigned by the MPI runtime (backend 'mpidist': rank {rank} of {size})",
                UserWarning,
                stacklevel=_user_stacklevel(),
            )
    yield store(timeout, shared), rank, size
    raise RuntimeError("Unable to perform re-rendezvous using mpi:// method")


#: the stores the rendezvous made that may still be open (closed once no group uses them)
_stores: list[Any] = []


def _in_use() -> set[int]:
    """ids of the stores (under torch's PrefixStores) of the groups torch holds now."""
    import torch.distributed.distributed_c10d as c10d  # noqa: PLC0415

    used = set()
    for _, found in list(getattr(getattr(c10d, "_world", None), "pg_map", {}).values()):
        while isinstance(found, dist.PrefixStore):
            found = found.underlying_store
        used.add(id(found))
    return used


def close_unused() -> None:
    """Close the stores the rendezvous made that no group torch holds uses any more (local).
    Called by each new rendezvous (torch gives a backend no call when it destroys a group
    of another backend, so a store whose groups are gone is closed there); at exit every
    store closes (:class:`MPIStore` registers that itself)."""
    used = _in_use()
    for old in [s for s in _stores if id(s) not in used]:
        _stores.remove(old)
        if hasattr(old, "close"):
            old.close()


def store(timeout: timedelta = _DEFAULT_TIMEOUT, shared: bool = True) -> Any:
    """A new store for a rendezvous, made collectively by every rank: an MPIStore, or
    (``shared`` False) a process-local HashStore. Stores of earlier rendezvous stay open
    while a group uses them (torch's stores from two rendezvous are independent); those no
    group uses are closed first (:func:`close_unused`)."""
    close_unused()
    if shared:
        made: Any = MPIStore(timeout)
    else:
        made = dist.HashStore()
        made.set_timeout(timeout)
    _stores.append(made)
    return made


_torch_env: Optional[Callable[..., Iterator[tuple[Any, int, int]]]] = None


def _env_handler(url: str, timeout: timedelta = _DEFAULT_TIMEOUT, **kwargs: Any) -> Iterator[tuple[Any, int, int]]:
    """torch's ``env://`` for every backend but ``"mpidist"``; for it, :func:`mpi_rendezvous_handler`."""
    assert _torch_env is not None
    if not _is_ours(calling_backend()):
        return _torch_env(url, timeout=timeout, **kwargs)
    unused = [name for name in ("MASTER_ADDR", "MASTER_PORT") if os.environ.get(name)]
    # Lightning, Accelerate and DeepSpeed set them themselves: said only when asked for
    # (debug level INFO or DETAIL), where it may explain a setup, never as routine noise
    if unused and MPI.COMM_WORLD.Get_rank() == 0 and mpidist.get_debug_level() != mpidist.DebugLevel.OFF:
        warnings.warn(
            f"mpidist: {' and '.join(unused)} {'is' if len(unused) == 1 else 'are'} set but unused: "
            f"backend 'mpidist' takes ranks from MPI ({MPI.COMM_WORLD.Get_size()} processes) and "
            f"listens on no port",
            UserWarning,
            stacklevel=_user_stacklevel(),
        )
    return mpi_rendezvous_handler(url, timeout=timeout, **kwargs)


def install_env_handler() -> None:
    """Wrap torch's ``env://`` handler (once) so that backend ``"mpidist"`` takes its ranks from MPI."""
    global _torch_env
    handlers = _rdzv._rendezvous_handlers
    current = handlers.get("env")
    if current is None or current is _env_handler:
        return
    _torch_env = current
    handlers["env"] = _env_handler


def register() -> None:
    """Register ``mpi://`` and wrap ``env://`` (idempotent)."""
    if SCHEME not in _rdzv._rendezvous_handlers:
        dist.register_rendezvous_handler(SCHEME, mpi_rendezvous_handler)  # type: ignore[no-untyped-call]  # torch's is unannotated
    install_env_handler()
