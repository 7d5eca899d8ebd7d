"""Is the MPI library CUDA-aware (may MPI be handed a device pointer)?

Decided once per process, at init_process_group: ``MPIDIST_CUDA_AWARE=1``/``0`` if set, else
yes if ``MPIX_Query_cuda_support()`` of the loaded MPI library or the MPI-4.1 info key
``mpi_memory_alloc_kinds`` says so (docs/device.md, "CUDA-aware MPI: detection and override").
A wrong yes makes MPI dereference a device pointer and segfault, so without a positive answer
the answer is no. :func:`detection` keeps the answer and its source.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

__all__ = [
    "Detection",
    "detect",
    "detection",
    "cuda_aware_mpi",
    "env_override",
    "query_library",
    "info_key",
    "mpi_library_paths",
    "init",
]

ENV = "MPIDIST_CUDA_AWARE"


@dataclass(frozen=True)
class Detection:
    """The decision (``aware``) and its ``source``, a sentence for messages."""

    aware: bool
    source: str


def env_override(env: Mapping[str, str]) -> Optional[bool]:
    """``MPIDIST_CUDA_AWARE`` as a bool, None when unset or empty; ValueError otherwise."""
    text = env.get(ENV, "").strip()
    if not text:
        return None
    if text not in ("0", "1"):
        raise ValueError(f"{ENV} must be 0 or 1, got {text!r}")
    return text == "1"


def mpi_library_paths(maps: str = "/proc/self/maps") -> list[str]:
    """Shared libraries mapped into this process whose name starts with ``libmpi``
    (libmpi.so, libmpich.so, libmpi_cray.so, ...), in the order first mapped."""
    try:
        with open(maps, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    seen: list[str] = []
    for line in lines:
        parts = line.split(maxsplit=5)
        path = parts[5].strip() if len(parts) == 6 else ""
        if ".so" in path and os.path.basename(path).startswith("libmpi") and path not in seen:
            seen.append(path)
    return seen


def query_library(paths: Optional[list] = None) -> tuple[Optional[bool], str]:
    """Call ``MPIX_Query_cuda_support`` of the loaded MPI library.

    ``paths``: libraries to try (default: :func:`mpi_library_paths`, then the mpi4py
    extension module, whose symbol lookup searches the libraries it links). Returns
    (True/False, what was called) or (None, why not) when no library exports it.
    """
    if paths is None:
        paths = mpi_library_paths()
        try:
            from mpi4py import MPI  # noqa: PLC0415

            paths = paths + [MPI.__file__]
        except Exception:  # noqa: BLE001, S110  (no mpi4py extension: nothing more to try)
            pass
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
            fn = lib.MPIX_Query_cuda_support
        except (OSError, AttributeError):
            continue
        fn.restype, fn.argtypes = ctypes.c_int, []
        value = int(fn())
        return value == 1, f"MPIX_Query_cuda_support() in {path} returned {value}"
    return None, "no loaded MPI library exports MPIX_Query_cuda_support"


def info_key(comm: Any = None) -> tuple[Optional[bool], str]:
    """The MPI-4.1 ``mpi_memory_alloc_kinds`` info key of ``comm`` (default MPI_COMM_WORLD)."""
    try:
        if comm is None:
            from mpi4py import MPI  # noqa: PLC0415

            comm = MPI.COMM_WORLD
        info = comm.Get_info()
        try:
            kinds = info.Get("mpi_memory_alloc_kinds")
        finally:
            info.Free()
    except Exception as exc:  # noqa: BLE001  (an MPI before 4.1, or no info support)
        return None, f"mpi_memory_alloc_kinds unavailable ({exc})"
    if kinds is None:
        return None, "MPI_COMM_WORLD has no mpi_memory_alloc_kinds info key"
    # CUDA-aware: a kind "cuda" listed, unrestricted or restricted to "device" or "managed" memory
    cuda = any(
        name == "cuda" and (not rest or {"device", "managed"} & set(rest.split(":")))
        for name, _, rest in (kind.strip().partition(":") for kind in kinds.split(","))
    )
    return cuda, f"mpi_memory_alloc_kinds={kinds!r}"


def detect(env: Optional[Mapping[str, str]] = None, paths: Optional[list] = None, comm: Any = None) -> Detection:
    """Decide CUDA-awareness now (see the module docstring for the order)."""
    forced = env_override(os.environ if env is None else env)
    if forced is not None:
        return Detection(forced, f"{ENV}={int(forced)}")
    lib, lib_source = query_library(paths)
    kinds, kinds_source = info_key(comm)
    return Detection(bool(lib) or bool(kinds), f"{lib_source}; {kinds_source}")


_detected: Optional[Detection] = None


def init(comm: Any = None) -> Detection:
    """Detect and cache (called by init_process_group). Raises ValueError for a bad
    ``MPIDIST_CUDA_AWARE``."""
    global _detected
    _detected = detect(comm=comm)
    return _detected


def detection() -> Detection:
    """The cached decision (detected now if init_process_group has not run)."""
    return _detected if _detected is not None else init()


def cuda_aware_mpi() -> bool:
    """True if mpidist hands device arrays to MPI directly (CUDA-aware MPI).

    Decided at :func:`init_process_group`: ``MPIDIST_CUDA_AWARE=0|1`` if set, else the
    MPI library's ``MPIX_Query_cuda_support()`` or its MPI-4.1 ``mpi_memory_alloc_kinds``
    info key (docs/device.md); ``mpidist.device.detect.detection().source`` says which.
    mpidist extension (torch has no such query). Raises ValueError if
    ``MPIDIST_CUDA_AWARE`` is neither 0 nor 1.
    """
    return detection().aware
