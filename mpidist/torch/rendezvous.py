"""Rendezvous without a port: ranks from MPI_COMM_WORLD, a store served over MPI.

Two ways in, both registered by ``import mpidist.torch``: ``init_method="mpi://"``
(:func:`mpi_rendezvous_handler`, through torch's public ``register_rendezvous_handler``), and
``init_process_group("mpidist")`` with no ``init_method``: torch's private ``env://`` handler
(``rendezvous._rendezvous_handlers["env"]``) is wrapped (:func:`install_env_handler`) so that,
for backend ``"mpidist"`` only (read from the ``init_process_group`` frame on the stack; not
found: torch's handler runs), ranks come from MPI too; every other backend gets torch's handler
unchanged. The store is an :class:`~mpidist.torch.store.MPIStore` (a process-local
``HashStore`` below ``MPI_THREAD_MULTIPLE``). For ``"mpidist"`` the handler starts mpidist's
runtime, whose collective check of ``rank=``/``world_size=``/RANK/WORLD_SIZE applies. Why the
wrapper: docs/architecture.md, "Bootstrap"; behaviour: docs/torch.md, "Launching".
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

    ``url`` may carry ``rank=`` / ``world_size=``. For backend ``"mpidist"`` this starts
    mpidist's runtime unless it runs already (collective over MPI_COMM_WORLD), which checks
    them as for torch's MPI backend; on a runtime started before, values that differ from
    MPI's are ignored with torch's warning. The store: :func:`store` (collective).

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
    Called by each new rendezvous: torch tells no backend when it destroys a group of
    another backend. At exit every :class:`MPIStore` closes itself."""
    used = _in_use()
    for old in [s for s in _stores if id(s) not in used]:
        _stores.remove(old)
        if hasattr(old, "close"):
            old.close()


def store(timeout: timedelta = _DEFAULT_TIMEOUT, shared: bool = True) -> Any:
    """A new store for a rendezvous, made collectively by every rank: an MPIStore, or
    (``shared`` False) a process-local HashStore. Earlier stores no group uses are closed
    first (:func:`close_unused`)."""
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
    backend = calling_backend()
    if not _is_ours(backend):
        _known_or_raise(backend)
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


def _known_or_raise(backend: Optional[str]) -> None:
    """ValueError for a backend name torch does not know, not torch's "MASTER_ADDR expected"."""
    if backend is None or os.environ.get("MASTER_ADDR"):
        return
    known = [name for name in dist.Backend.backend_list if name != dist.Backend.UNDEFINED]
    if all(part.split(":")[-1].strip() in known for part in backend.lower().split(",")):
        return
    raise ValueError(
        f"{_where()} unknown backend {backend!r}; the registered backends are {', '.join(known)} "
        f"(backend {BACKEND!r} takes ranks from MPI and needs no MASTER_ADDR)"
    )


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
