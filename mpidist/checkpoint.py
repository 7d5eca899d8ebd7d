"""Atomic checkpoints of named arrays as numpy ``.npz`` files, without pickle, checked
whole on load.

The module knows nothing of ranks: in a data-parallel job the caller saves from rank 0
only, and every rank may load. Every file :func:`save_checkpoint` writes carries a SHA-256
digest of its bytes in the zip archive's comment (``mpidist-sha256:<64 hex digits>``, the
last 79 bytes of the file), which :func:`load_checkpoint` checks: why, and the guarantees,
in docs/reliability.md, section 6. Device (cupy) arrays are saved as host copies and load
as numpy arrays; ``model.load_state_dict`` copies them back onto the model's device.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import struct
import tempfile
import zipfile
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Union

import numpy as np

from mpidist._arrays.namespace import is_device_array

__all__ = ["load_checkpoint", "save_checkpoint"]

PathLike = Union[str, "os.PathLike[str]"]

# First bytes of a zip archive: a local file header, or the end record of an empty one.
_ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06")
_END = b"PK\x05\x06"  # the zip "end of central directory" record: 22 bytes, then the comment
_END_SIZE = 22
_DIGEST_TAG = b"mpidist-sha256:"
_DIGEST_SIZE = len(_DIGEST_TAG) + 64


def _to_host(name: str, value: Any) -> np.ndarray:
    """``value`` as a numpy array, copied from the GPU if needed; no object arrays."""
    if is_device_array(value):
        if not hasattr(value, "get"):
            raise TypeError(
                f"checkpoint array {name!r}: device array of type "
                f"{type(value).__name__} has no .get() to copy it to the host"
            )
        value = value.get()
    array = np.asarray(value)
    if array.dtype.hasobject:
        raise ValueError(
            f"checkpoint array {name!r} has dtype {array.dtype}, which would need "
            f"pickle; only numeric, bool, string and plain structured dtypes are allowed"
        )
    return array


def _write_npz(fh: Any, arrays: Mapping[str, Any]) -> None:
    """Write ``arrays`` to the open binary file ``fh`` in numpy's ``.npz`` layout."""
    with zipfile.ZipFile(fh, mode="w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        for name, value in arrays.items():
            array = _to_host(name, value)
            with zf.open(f"{name}.npy", mode="w", force_zip64=True) as member:
                np.lib.format.write_array(member, array, allow_pickle=False)


def _seal(fh: Any) -> None:
    """Give the complete archive open in ``fh`` (read/write, comment empty) its digest comment:
    SHA-256 of every byte before the end record's comment-length field."""
    fh.seek(0, os.SEEK_END)
    end = fh.tell() - _END_SIZE
    fh.seek(0)
    digest = hashlib.sha256()
    left = end + _END_SIZE - 2
    while left:
        chunk = fh.read(min(left, 1 << 22))
        if not chunk:
            raise OSError(f"the archive shrank while it was sealed ({left} bytes missing)")
        digest.update(chunk)
        left -= len(chunk)
    comment = _DIGEST_TAG + digest.hexdigest().encode()
    fh.write(struct.pack("<H", len(comment)) + comment)


def _check_digest(path: Path, data: bytes) -> None:
    """Raise ValueError unless ``data`` (the whole file) matches its digest comment; a file
    whose end record has no comment passes (numpy.savez's, or an older mpidist's)."""
    end = data.rfind(_END, max(0, len(data) - _END_SIZE - 0xFFFF))
    while end >= 0 and end + _END_SIZE + struct.unpack_from("<H", data, end + 20)[0] != len(data):
        end = data.rfind(_END, 0, end)
    if end < 0 or len(data) < end + _END_SIZE:
        raise ValueError(f"checkpoint {path} is corrupt or truncated: no zip end record at the end of the file")
    comment = data[end + _END_SIZE :]
    if not comment:
        return
    if len(comment) != _DIGEST_SIZE or not comment.startswith(_DIGEST_TAG):
        raise ValueError(
            f"checkpoint {path} is corrupt or truncated: its end record carries {comment[:40]!r}..., not "
            f"save_checkpoint's digest"
        )
    if hashlib.sha256(data[: end + _END_SIZE - 2]).hexdigest().encode() != comment[len(_DIGEST_TAG) :]:
        raise ValueError(
            f"checkpoint {path} is corrupt or truncated: its bytes do not match the SHA-256 digest written with it"
        )


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

    A temporary file in the same directory (mode 0o600), sealed with the SHA-256
    digest, fsynced, ``os.replace``-d onto ``path``, the directory fsynced: a crash
    leaves the previous file or the complete new one, never a partial one (after
    SIGKILL a ``.<name>.*.tmp`` file may be left beside ``path``). Readable by
    :func:`load_checkpoint` and ``numpy.load``.

    Args:
        path: destination file; ``.npz`` is not appended.
        arrays: name -> numpy array, cupy array (copied to the host with
            ``.get()``), or anything ``numpy.asarray`` accepts (0-d included).
            Device arrays are copied to the host one at a time, while writing.

    Raises:
        TypeError: a name that is not a str, or a device array without ``.get()``.
        ValueError: an array of object dtype (it would need pickle).
        OSError: the file cannot be written (the same subclass, e.g. PermissionError, with a
            message naming ``path``; the system's error is its ``__cause__``).
    """
    path = Path(path)
    bad = [k for k in arrays if not isinstance(k, str)]
    if bad:
        raise TypeError(f"checkpoint {path}: array names must be str, got {bad!r}")
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        raise OSError(
            exc.errno, f"cannot write checkpoint {path}: cannot create a file in {path.parent} ({exc.strerror})"
        ) from exc
    try:
        fh = os.fdopen(fd, "w+b")
        try:
            _write_npz(fh, arrays)
            _seal(fh)
            fh.flush()
            os.fsync(fh.fileno())
        finally:
            with contextlib.suppress(OSError):  # flushed and synced, or failing already
                fh.close()
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError) and exc.errno is not None:
            raise OSError(exc.errno, f"cannot write checkpoint {path} ({exc.strerror})") from exc
        raise
    _fsync_dir(path.parent)


def load_checkpoint(path: PathLike) -> dict[str, np.ndarray]:
    """Load every array of a checkpoint written by :func:`save_checkpoint`.

    Checks the whole file against its SHA-256 digest (a file without one, as
    ``numpy.savez`` writes, gets the zip CRC checks only), then parses it with
    ``numpy.load(..., allow_pickle=False)``: pickled arrays are refused, never unpickled.

    Returns:
        name -> numpy array, with the saved shapes and dtypes.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: the file is not a ``.npz`` archive, is corrupt or
            truncated (its digest does not match, or it does not parse), or
            holds pickled data; the message names ``path``.
    """
    path = Path(path)
    with open(path, "rb") as fh:
        data = fh.read()
    magic = data[:4]
    if magic not in _ZIP_MAGICS:
        raise ValueError(
            f"checkpoint {path} is corrupt or truncated: expected a .npz (zip) archive, got first bytes {magic!r}"
        )
    _check_digest(path, data)
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            return {name: npz[name] for name in npz.files}
    except ValueError as exc:
        if "allow_pickle" in str(exc):
            raise ValueError(
                f"checkpoint {path} holds pickled data, which load_checkpoint refuses to load: {exc}"
            ) from exc
        raise ValueError(f"checkpoint {path} is corrupt or truncated: {exc}") from exc
    except (
        EOFError,
        zipfile.BadZipFile,
        zlib.error,
        KeyError,
        SyntaxError,
        NotImplementedError,
        OSError,
        OverflowError,
        MemoryError,
        TypeError,
        UnicodeDecodeError,
        IndexError,
    ) as exc:
        # what numpy's .npy header parser and zipfile raise on damaged bytes (a file with no digest)
        raise ValueError(f"checkpoint {path} is corrupt or truncated: {type(exc).__name__}: {exc}") from exc
