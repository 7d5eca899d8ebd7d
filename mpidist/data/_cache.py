"""A per-user on-disk cache of the small arrays the examples derive from a library's data.

:func:`mpidist.data.load_digits_split` needs scikit-learn, whose import takes ~2 s of CPU
(scipy.stats and friends) on every rank of every job: on a 2-core node, 3 ranks of the main
job spent ~3 s of their start there, for a 0.5 MB result (float32) that never changes for a given
scikit-learn version, seed and split. So the result is written once to
``$MPIDIST_DATA_CACHE`` (default ``$XDG_CACHE_HOME/mpidist/data``, else
``~/.cache/mpidist/data``) and read back in milliseconds; ``MPIDIST_DATA_CACHE=off`` (or
``0``) turns the cache off.

Files are written as :mod:`mpidist._core.private_files` writes them: in a directory that is a real
directory owned by this user and writable by nobody else (created 0700), each file created
``O_EXCL|O_NOFOLLOW`` with mode 0600 and renamed into place, so ranks that fill the cache at
the same moment each replace the file whole. A file is read through the directory's
descriptor with ``O_NOFOLLOW``, with ``allow_pickle=False``, and used only if it holds the
key it was asked for; a missing, unreadable or foreign file, or a directory that is not
private, means the arrays are computed as if there were no cache (and written when the
directory allows).
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
