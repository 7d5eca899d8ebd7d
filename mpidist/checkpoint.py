"""Atomic checkpoints of named arrays as numpy ``.npz`` files, without pickle.

The module knows nothing of ranks: in a data-parallel job the caller saves
from rank 0 only, and every rank may load.

Device (cupy) arrays are saved as host copies and loaded as numpy arrays; a model
on the GPU gets them back on its device through ``model.load_state_dict`` (and an
optimizer through ``SGD.load_state_dict``), which copy each array onto its target's
device: ``save_checkpoint(path, model.state_dict())`` then
``model.load_state_dict(load_checkpoint(path))`` round-trips on any device.
"""
from __future__ import annotations

import os
import tempfile
import zipfile
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Union

import numpy as np

from mpidist._array import is_device_array

__all__ = ["load_checkpoint", "save_checkpoint"]

PathLike = Union[str, os.PathLike]

# First bytes of a zip archive: a local file header, or the end record of an empty one.
_ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06")


def _to_host(name: str, value: Any) -> np.ndarray:
    """``value`` as a numpy array, copied from the GPU if needed; no object arrays."""
    if is_device_array(value):
        if not hasattr(value, "get"):
            raise TypeError(f"checkpoint array {name!r}: device array of type "
                            f"{type(value).__name__} has no .get() to copy it to the host")
        value = value.get()
    array = np.asarray(value)
    if array.dtype.hasobject:
        raise ValueError(f"checkpoint array {name!r} has dtype {array.dtype}, which would need "
                         f"pickle; only numeric, bool, string and plain structured dtypes are allowed")
    return array


def _write_npz(fh: Any, arrays: Mapping[str, Any]) -> None:
    """Write ``arrays`` to the open binary file ``fh`` in numpy's ``.npz`` layout."""
    with zipfile.ZipFile(fh, mode="w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        for name, value in arrays.items():
            array = _to_host(name, value)
            with zf.open(f"{name}.npy", mode="w", force_zip64=True) as member:
                np.lib.format.write_array(member, array, allow_pickle=False)


def _fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable (POSIX only; a no-op elsewhere)."""
    if os.name != "posix":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(path: PathLike, arrays: Mapping[str, Any]) -> None:
    """Save named arrays to ``path`` as a ``.npz`` file, atomically.

    Writes a temporary file in the same directory (``tempfile.mkstemp``,
    so created with mode 0o600), flushes and fsyncs it, ``os.replace``-s it
    onto ``path`` and fsyncs the directory. A crash or an error at any point
    leaves either the previous file at ``path`` or the complete new one,
    never a partial file; the temporary file is removed on error.
    :func:`load_checkpoint` reads the file back; so does ``numpy.load``.

    Args:
        path: destination file; ``.npz`` is not appended.
        arrays: name -> numpy array, cupy array (copied to the host with
            ``.get()``), or anything ``numpy.asarray`` accepts (0-d included).
            Device arrays are copied to the host one at a time, while writing.

    Raises:
        TypeError: a name that is not a str, or a device array without ``.get()``.
        ValueError: an array of object dtype (it would need pickle).
        OSError: the file cannot be written.
    """
    path = Path(path)
    bad = [k for k in arrays if not isinstance(k, str)]
    if bad:
        raise TypeError(f"checkpoint {path}: array names must be str, got {bad!r}")
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            _write_npz(fh, arrays)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def load_checkpoint(path: PathLike) -> dict[str, np.ndarray]:
    """Load every array of a checkpoint written by :func:`save_checkpoint`.

    Reads with ``numpy.load(..., allow_pickle=False)``, so a file holding
    pickled (object) arrays is refused, never unpickled. Everything is read
    into memory and the file is closed before returning.

    Returns:
        name -> numpy array, with the saved shapes and dtypes.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: the file is not a ``.npz`` archive, is corrupt or
            truncated, or holds pickled data.
    """
    path = Path(path)
    with open(path, "rb") as fh:
        magic = fh.read(4)
        if magic not in _ZIP_MAGICS:
            raise ValueError(f"checkpoint {path} is corrupt or truncated: "
                             f"expected a .npz (zip) archive, got first bytes {magic!r}")
        fh.seek(0)
        try:
            with np.load(fh, allow_pickle=False) as npz:
                return {name: npz[name] for name in npz.files}
        except ValueError as exc:
            if "allow_pickle" in str(exc):
                raise ValueError(f"checkpoint {path} holds pickled data, which "
                                 f"load_checkpoint refuses to load: {exc}") from exc
            raise ValueError(f"checkpoint {path} is corrupt or truncated: {exc}") from exc
        except (EOFError, zipfile.BadZipFile, zlib.error, KeyError) as exc:
            raise ValueError(f"checkpoint {path} is corrupt or truncated: {exc}") from exc
