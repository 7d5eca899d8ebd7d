"""A per-user on-disk cache of the small arrays the examples derive from a library's data.

:func:`mpidist.data.load_digits_split` would import scikit-learn (~2 s of CPU) on every rank
for a 0.5 MB result that depends only on scikit-learn's version, seed and split; it is
cached in ``$MPIDIST_DATA_CACHE`` (default ``$XDG_CACHE_HOME/mpidist/data``, else
``~/.cache/mpidist/data``; ``off`` or ``0``: no cache; docs/api.md, "Training").

Files are written by :mod:`mpidist._core.private_files` (a private 0700 directory, files
0600 renamed into place, so concurrent ranks each replace a file whole) and read with
``O_NOFOLLOW`` and ``allow_pickle=False``, used only if they hold the asked key. Any
failure (missing, foreign or unreadable file, a directory not private) means computing the
arrays as if there were no cache.
"""

from __future__ import annotations

import hashlib
import io
import os
from typing import Any, Callable, Optional

import numpy as np

from mpidist._core import private_files

__all__ = ["ENV", "cache_dir", "cached"]

ENV = "MPIDIST_DATA_CACHE"
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_KEY = "__cache_key__"


def cache_dir() -> Optional[str]:
    """The cache directory (see the module docstring), or None when the cache is off."""
    chosen = os.environ.get(ENV, "").strip()
    if chosen.lower() in ("off", "0"):
        return None
    if chosen:
        return chosen
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "mpidist", "data")


def cached(key: str, compute: Callable[[], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The arrays ``compute()`` returns for ``key`` (a text naming every input they depend
    on, versions included): read from the cache when a file there holds ``key``, else
    computed and written there (when the cache is on and its directory is private)."""
    directory = cache_dir()
    name = f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.npz"
    if directory is not None:
        found = _read(directory, name, key)
        if found is not None:
            return found
    arrays = compute()
    if directory is not None:
        buf = io.BytesIO()
        named: dict[str, Any] = {**arrays, _KEY: np.array(key)}
        np.savez(buf, **named)
        try:
            private_files.write_private_file(directory, name, buf.getvalue())
        except OSError:  # (UnsafeDirectory included) read-only, full, or not private: go on uncached
            pass
    return arrays


def _read(directory: str, name: str, key: str) -> Optional[dict[str, np.ndarray]]:
    """The arrays of ``<directory>/<name>`` if it is there, readable and holds ``key``."""
    try:
        dir_fd = private_files.open_private_dir(directory)
    except OSError:
        return None
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | _CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None
    finally:
        os.close(dir_fd)
    try:
        with os.fdopen(fd, "rb") as f:
            with np.load(io.BytesIO(f.read()), allow_pickle=False) as npz:
                arrays = {k: npz[k] for k in npz.files}
    except Exception:  # torn, or not an npz of ours (zipfile.BadZipFile, ValueError, OSError, ...)
        return None
    stored = arrays.pop(_KEY, None)
    if stored is None or stored.shape != () or str(stored) != key:
        return None
    return arrays
