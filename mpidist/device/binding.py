"""Device binding: at init each rank makes one GPU its current device (torch's launch
convention: ``local_rank % device_count``), unless told otherwise.

The choice (:func:`choose_device`) is a pure function; :func:`bind` asks CuPy only
if it is installed (``importlib.util.find_spec``: a CPU-only install never imports it).
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Mapping
from typing import Any, Optional

from mpidist import work

__all__ = ["choose_device", "parse_device", "bind", "bound_device", "ENV"]

ENV = "MPIDIST_DEVICE"

_bound: Optional[int] = None


def parse_device(device_id: Any, where: str) -> Optional[int]:
    """A device index from ``device_id``: an int, ``"cuda:N"`` / ``"N"``, or an object with
    ``.index`` (``torch.device``). ``"cuda"`` or an index of None: None (no preference).

    Raises:
        TypeError / ValueError: anything else, or a negative index.
    """
    index: Any = device_id
    if hasattr(device_id, "index") and not isinstance(device_id, (str, int)):
        if getattr(device_id, "type", "cuda") not in ("cuda",):
            raise ValueError(f"{where} device_id must be a CUDA device, got {device_id!r}")
        index = device_id.index
    if index is None:
        return None
    if isinstance(index, str):
        m = re.fullmatch(r"cuda(?::(\d+))?|(\d+)", index.strip())
        if m is None:
            raise ValueError(f"{where} device_id must be an int, 'cuda:N' or a device with .index, got {device_id!r}")
        digits = m.group(1) or m.group(2)
        return int(digits) if digits else None
    if not isinstance(index, int) or isinstance(index, bool):
        raise TypeError(
            f"{where} device_id must be an int, 'cuda:N' or a device with .index, got {type(device_id).__name__}"
        )
    if index < 0:
        raise ValueError(f"{where} device_id must be >= 0, got {index}")
    return index


def choose_device(
    device_id: Any, env: Mapping[str, str], local_rank: int, device_count: int, where: str = "init_process_group:"
) -> int:
    """The device this rank binds to: ``device_id``, else ``MPIDIST_DEVICE``, else
    ``local_rank % device_count``.

    Raises:
        ValueError: the chosen index is not below ``device_count``, or MPIDIST_DEVICE is
            not an index; TypeError: a ``device_id`` of another type.
    """
    index = parse_device(device_id, where)
    name = "device_id"
    if index is None and env.get(ENV, "").strip():
        text = env[ENV].strip()
        if not text.isdigit():
            raise ValueError(f"{where} {ENV} must be a device index >= 0, got {text!r}")
        index, name = int(text), ENV
    if index is None:
        return local_rank % device_count
    if index >= device_count:
        raise ValueError(f"{where} {name}={index} but this node has {device_count} CUDA device(s)")
    return index


def _device_count() -> int:
    """CUDA devices visible through CuPy; 0 without CuPy (never imported then) or a driver."""
    if importlib.util.find_spec("cupy") is None:
        return 0
    try:
        import cupy  # noqa: PLC0415

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # noqa: BLE001  (no driver, no device: CPU only)
        return 0


def bind(device_id: Any, local_rank: int, where: str = "init_process_group:") -> Optional[int]:
    """Make the chosen device current on this thread (``cupy.cuda.Device(d).use()``) and
    on every group engine thread started from now on (:data:`mpidist.work.THREAD_START`);
    return it, or None where there is no CuPy or no GPU.

    Raises:
        ValueError: ``device_id`` given but there is no CuPy or no GPU; a bad index.
    """
    global _bound
    count = _checked_count(device_id, where)
    if count == 0:
        _bound, hooks = None, []
    else:
        index = choose_device(device_id, os.environ, local_rank, count, where)
        import cupy  # noqa: PLC0415

        device = cupy.cuda.Device(index)
        device.use()
        _bound, hooks = index, [device.use]
    work.THREAD_START[:] = hooks  # engine threads (async ops) make the same device current when they start
    return _bound


def _checked_count(device_id: Any, where: str) -> int:
    """The CUDA device count; ValueError if ``device_id`` is given and there is none."""
    count = _device_count()
    if count == 0 and device_id is not None:
        raise ValueError(
            f"{where} device_id={device_id!r} was given but there is no CUDA device "
            f"(or CuPy is not installed: pip install 'mpidist[gpu]')"
        )
    return count


def check(device_id: Any, where: str = "init_process_group:") -> None:
    """Raise what :func:`bind` would raise for ``device_id`` / ``MPIDIST_DEVICE``, binding nothing
    (none of its errors depend on the local rank): init_process_group checks this on every rank
    before its first collective, so that a bad index on one node fails every rank alike."""
    count = _checked_count(device_id, where)
    if count:
        choose_device(device_id, os.environ, 0, count, where)


def bound_device() -> Optional[int]:
    """The device bound at init, or None (no GPU, or not initialized)."""
    return _bound
