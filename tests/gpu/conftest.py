"""tests/gpu: run only where CuPy imports and sees a CUDA device; skipped with the reason
otherwise (so `make test` on a CPU machine collects and skips them)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Optional

import pytest

_HERE = Path(__file__).parent


def _no_gpu_reason() -> Optional[str]:
    if importlib.util.find_spec("cupy") is None:
        return (
            "CuPy is not importable by this Python: the GPU tests need it (pip install 'mpidist[gpu]', "
            "or a venv made with --system-site-packages where CuPy is installed system-wide)"
        )
    try:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001  (no driver, no runtime)
        return f"CuPy imports but finds no CUDA device ({type(exc).__name__}: {exc})"
    return None if count > 0 else "CuPy imports but finds no CUDA device"


NO_GPU = _no_gpu_reason()


def pytest_collection_modifyitems(config, items):
    if NO_GPU is None:
        return
    skip = pytest.mark.skip(reason=NO_GPU)
    for item in items:
        if _HERE in Path(str(item.path)).parents:
            item.add_marker(skip)
