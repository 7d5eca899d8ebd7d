"""torch.distributed's backend queries: which backends exist here, which one a device
gets by default, and a group's backend per device type.

mpidist has one transport, MPI: host (numpy) arrays always travel over it; device
(cupy) arrays over NCCL on a group whose backend names nccl, else over CUDA-aware MPI
or host staging (docs/device.md). torch's ``"gloo"`` names are accepted by
init_process_group and run over MPI.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from mpidist._core.group import ProcessGroup
from mpidist._runtime import world as runtime
from mpidist.errors import prefix

__all__ = [
    "is_available",
    "is_backend_available",
    "is_gloo_available",
    "is_ucc_available",
    "is_xccl_available",
    "is_torchelastic_launched",
    "get_default_backend_for_device",
    "BackendConfig",
    "get_backend_config",
]

#: backend name -> available here. gloo: torch's name, run over MPI; ucc and xccl: not provided.
_KNOWN = {
    "mpi": lambda: True,
    "gloo": lambda: True,
    "nccl": lambda: runtime.is_nccl_available(),
    "ucc": lambda: False,
    "xccl": lambda: False,
}
#: device type -> the backend init_process_group gives it when none is named
_DEFAULT_FOR_DEVICE = {"cpu": "mpi", "cuda": "nccl"}


def is_available() -> bool:
    """True: the distributed package is usable (torch: built with distributed support)."""
    return True


def is_gloo_available() -> bool:
    """True: torch's ``"gloo"`` backend names are accepted; mpidist runs them over MPI."""
    return True


def is_ucc_available() -> bool:
    """False: mpidist has no UCC backend."""
    return False


def is_xccl_available() -> bool:
    """False: mpidist has no XCCL (Intel GPU) backend."""
    return False


def is_torchelastic_launched() -> bool:
    """Whether this process was started by torchelastic (``torchrun``), which sets
    ``TORCHELASTIC_RUN_ID`` (torch's test). mpiexec or srun launches give False."""
    return os.environ.get("TORCHELASTIC_RUN_ID") is not None


def _device_backends(backend: str) -> Optional[dict]:
    """``{device: backend}`` of a ``"cpu:mpi,cuda:nccl"`` string (lower case), None if malformed."""
    out: dict = {}
    for part in backend.replace(" ", "").split(","):
        device, sep, name = part.partition(":")
        if not sep or not device or not name or device in out:
            return None
        out[device] = name
    return out


def is_backend_available(backend: str) -> bool:
    """Whether ``backend`` can be used here (torch.distributed.is_backend_available).

    ``"mpi"`` and ``"gloo"`` (run over MPI): True; ``"nccl"``: when CuPy with NCCL is
    importable (:func:`mpidist.is_nccl_available`); a ``"device:backend,..."`` string: when
    every named backend is, for devices ``cpu`` and ``cuda``; anything else: False.

    Raises:
        TypeError: ``backend`` is not a string.
    """
    if not isinstance(backend, str):
        raise TypeError(f"{prefix('is_backend_available')} backend must be a string, got {type(backend).__name__}")
    name = backend.lower()
    if ":" not in name:
        check = _KNOWN.get(name.strip())
        return check is not None and check()
    parts = _device_backends(name)
    return (
        parts is not None
        and all(d in _DEFAULT_FOR_DEVICE for d in parts)
        and all(is_backend_available(b) for b in parts.values())
    )


def get_default_backend_for_device(device: Any) -> str:
    """The backend mpidist uses for ``device`` when none is named: ``"mpi"`` for
    ``"cpu"`` (torch says ``"gloo"``; mpidist's host transport is MPI) and ``"nccl"`` for
    ``"cuda"``. ``device``: a string (``"cuda:1"``: the type counts) or an object with a
    ``.type`` (``torch.device``).

    Raises:
        ValueError: a device type mpidist has no backend for (torch: "Default backend
            not registered for device").
    """
    kind = getattr(device, "type", device)
    if not isinstance(kind, str):
        raise TypeError(
            f"{prefix('get_default_backend_for_device')} device must be a string such as 'cpu' or "
            f"'cuda:0', or have a .type, got {type(device).__name__}"
        )
    found = _DEFAULT_FOR_DEVICE.get(kind.partition(":")[0].strip().lower())
    if found is None:
        raise ValueError(
            f"{prefix('get_default_backend_for_device')} Default backend not registered for device : "
            f"{device!r}; mpidist knows {sorted(_DEFAULT_FOR_DEVICE)}"
        )
    return found


class BackendConfig:
    """A backend string's backend per device type (torch.distributed.BackendConfig).

    ``BackendConfig("cpu:mpi,cuda:nccl").get_device_backend_map()`` is
    ``{"cpu": "mpi", "cuda": "nccl"}``. A single name stands for both device types; where
    a string names no ``cpu`` backend (``"nccl"``, ``"cuda:nccl"``) the cpu entry is
    ``"mpi"``, since mpidist sends host arrays over MPI on every group (torch's nccl
    config has no cpu entry). ``str()`` gives the ``"cpu:...,cuda:..."`` form.

    Raises:
        TypeError: ``backend`` is not a string.
        ValueError: a malformed device:backend string, or a device type other than cpu
            and cuda.
    """

    def __init__(self, backend: str) -> None:
        if not isinstance(backend, str):
            raise TypeError(f"{prefix('BackendConfig')} backend must be a string, got {type(backend).__name__}")
        name = backend.lower().strip()
        parts = _device_backends(name) if ":" in name else {d: name for d in _DEFAULT_FOR_DEVICE}
        if parts is None or not set(parts) <= set(_DEFAULT_FOR_DEVICE):
            raise ValueError(
                f"{prefix('BackendConfig')} backend {backend!r} is not a backend name or a "
                f"'cpu:<backend>,cuda:<backend>' string"
            )
        if parts.get("cpu", "nccl") == "nccl":  # NCCL does not move host arrays: MPI does
            parts["cpu"] = "mpi"
        self.device_backend_map = {d: parts[d] for d in sorted(parts)}

    def get_device_backend_map(self) -> dict:
        """``{device type: backend name}``."""
        return dict(self.device_backend_map)

    def __repr__(self) -> str:
        return ",".join(f"{d}:{b}" for d, b in self.device_backend_map.items())


def get_backend_config(group: Optional[ProcessGroup] = None) -> str:
    """``group``'s backend per device type as ``"cpu:mpi,cuda:nccl"`` (default: the
    default group), as torch.distributed.get_backend_config (see :class:`BackendConfig`).

    Raises:
        ValueError: before init_process_group, or a destroyed group.
    """
    return str(BackendConfig(runtime.get_backend(group)))
