"""Small datasets for the examples: scikit-learn's digits and MNIST IDX files.

:func:`load_digits_split` needs scikit-learn (``pip install mpidist[examples]``);
the IDX reader and writer need only numpy. Nothing here downloads anything.
"""

from __future__ import annotations

import gzip
import importlib.metadata
import os
import struct
import zlib
from pathlib import Path
from typing import Union

import numpy as np
from numpy.typing import DTypeLike

from mpidist.data._cache import cached

__all__ = ["load_digits_split", "load_mnist", "read_idx", "write_idx"]

PathLike = Union[str, "os.PathLike[str]"]
_NEEDS_SKLEARN = "load_digits_split needs scikit-learn: pip install mpidist[examples]"
Split = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]

# IDX type code -> big-endian numpy dtype (http://yann.lecun.com/exdb/mnist/).
_IDX_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_IDX_CODE_LIST = ", ".join(f"0x{code:02x}" for code in _IDX_DTYPES)
_IDX_CODES = {dt.newbyteorder("="): code for code, dt in _IDX_DTYPES.items()}


def load_digits_split(test_size: float = 0.2, seed: int = 0, dtype: DTypeLike = np.float32) -> Split:
    """scikit-learn's 8x8 digits, scaled to [0, 1] and split with stratification.

    Source: ``sklearn.datasets.load_digits`` (1,797 images of 8x8 pixels with
    values 0..16, ten classes; ships with scikit-learn, no download), split by
    ``sklearn.model_selection.train_test_split(stratify=y, random_state=seed)``.

    Args:
        test_size: fraction of the samples in the test split, in (0, 1).
        seed: random state of the split; the same seed gives the same split.
        dtype: dtype of the features.

    Returns:
        ``(X_train, y_train, X_test, y_test)``: features of shape ``(N, 64)``
        and ``dtype``, pixel intensity divided by 16 so in [0, 1]; labels of
        shape ``(N,)``, int64 in 0..9.

    Raises:
        ImportError: scikit-learn is not installed.

    The split is cached per user (:mod:`mpidist.data._cache`: ``MPIDIST_DATA_CACHE``, default
    ``~/.cache/mpidist/data``, ``off`` to disable), keyed by scikit-learn's version and the
    arguments, so that a job's ranks read it back instead of importing scikit-learn (~2 s of
    CPU each). The arrays are the same bit for bit either way.
    """
    try:
        version = importlib.metadata.version("scikit-learn")
    except importlib.metadata.PackageNotFoundError as exc:
        raise ImportError(_NEEDS_SKLEARN) from exc
    dt = np.dtype(dtype)
    key = f"load_digits_split scikit-learn=={version} test_size={test_size!r} seed={seed!r} dtype={dt.str}"

    def split() -> dict[str, np.ndarray]:
        try:
            from sklearn.datasets import load_digits  # noqa: PLC0415  (optional)
            from sklearn.model_selection import train_test_split  # noqa: PLC0415
        except ImportError as exc:
            raise ImportError(_NEEDS_SKLEARN) from exc
        digits = load_digits()
        x = (digits.data / 16.0).astype(dt)
        y = digits.target.astype(np.int64)
        x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=test_size, stratify=y, random_state=seed)
        return {"x_train": x_train, "y_train": y_train, "x_test": x_test, "y_test": y_test}

    # (a seed that is no integer, None or a RandomState, draws another split each call: not cached)
    arrays = cached(key, split) if isinstance(seed, (int, np.integer)) else split()
    return arrays["x_train"], arrays["y_train"], arrays["x_test"], arrays["y_test"]


def _read_bytes(path: Path) -> bytes:
    """The file's bytes, decompressed if the name ends with ``.gz``."""
    raw = path.read_bytes()
    if not path.name.endswith(".gz"):
        return raw
    try:
        return gzip.decompress(raw)
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise ValueError(f"IDX file {path}: bad gzip data: expected a complete gzip stream, got {exc}") from exc


def read_idx(path: PathLike) -> np.ndarray:
    """Read an array from an IDX file, the format of the MNIST files.

    Format (http://yann.lecun.com/exdb/mnist/): two zero bytes, a type code
    byte (0x08 uint8, 0x09 int8, 0x0B int16, 0x0C int32, 0x0D float32,
    0x0E float64), a byte with the number of dimensions, one big-endian
    uint32 per dimension, then the data, big-endian, C order. A name ending
    with ``.gz`` is decompressed with gzip.

    Returns:
        An array of the file's shape and dtype, in native byte order.

    Raises:
        FileNotFoundError: no such file.
        ValueError: bad magic number, unknown type code, data shorter or
            longer than the dimensions say, or a bad gzip stream; the message
            names the file and what was expected.
    """
    path = Path(path)
    data = _read_bytes(path)
    if len(data) < 4 or data[:2] != b"\x00\x00" or data[2] not in _IDX_DTYPES:
        raise ValueError(
            f"IDX file {path}: bad magic number: expected 00 00 <type code in "
            f"{_IDX_CODE_LIST}> <ndim>, got {data[:4].hex(' ') or 'empty file'}"
        )
    dtype, ndim = _IDX_DTYPES[data[2]], data[3]
    header = 4 + 4 * ndim
    if len(data) < header:
        raise ValueError(f"IDX file {path}: truncated header: expected {header} bytes, got {len(data)}")
    shape = struct.unpack(f">{ndim}I", data[4:header])
    expected = header + dtype.itemsize * int(np.prod(shape, dtype=np.int64))
    if len(data) != expected:
        what = "truncated data" if len(data) < expected else "trailing data"
        raise ValueError(
            f"IDX file {path}: {what}: expected {expected} bytes for shape {shape} of {dtype.name}, got {len(data)}"
        )
    return np.frombuffer(data, dtype, offset=header).reshape(shape).astype(dtype.newbyteorder("="))


def write_idx(path: PathLike, array: np.ndarray) -> None:
    """Write ``array`` as an IDX file (gzip-compressed if the name ends with ``.gz``).

    The inverse of :func:`read_idx`; used to make small MNIST-like fixtures.

    Raises:
        ValueError: a dtype IDX cannot hold (only uint8, int8, int16, int32,
            float32, float64), more than 255 dimensions, or a dimension of
            2**32 or more.
    """
    path = Path(path)
    array = np.asarray(array)
    code = _IDX_CODES.get(array.dtype.newbyteorder("="))
    if code is None:
        raise ValueError(f"IDX file {path}: dtype {array.dtype} has no IDX type code")
    if array.ndim > 255 or any(d >= 2**32 for d in array.shape):
        raise ValueError(f"IDX file {path}: shape {array.shape} does not fit the IDX header")
    header = bytes([0, 0, code, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    payload = header + np.ascontiguousarray(array, dtype=_IDX_DTYPES[code]).tobytes()
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "wb") as fh:
        fh.write(payload)


def _find_mnist_file(root: Path, name: str) -> Path:
    """``root/name`` with the dotted variant (``.idx3-ubyte``) and ``.gz`` allowed."""
    stem, kind = name.rsplit("-idx", 1)
    candidates = [f"{base}{gz}" for base in (name, f"{stem}.idx{kind}") for gz in ("", ".gz")]
    for candidate in candidates:
        if (root / candidate).is_file():
            return root / candidate
    raise FileNotFoundError(f"MNIST file not found in {root}: looked for {', '.join(candidates)}")


def _mnist_pair(root: Path, images: str, labels: str, dtype: DTypeLike) -> tuple[np.ndarray, np.ndarray]:
    """Read one split: images flattened and scaled to [0, 1], labels as int64."""
    x_path, y_path = _find_mnist_file(root, images), _find_mnist_file(root, labels)
    x, y = read_idx(x_path), read_idx(y_path)
    if x.ndim != 3 or y.ndim != 1:
        raise ValueError(
            f"MNIST files {x_path}, {y_path}: expected images of 3 and labels of 1 "
            f"dimension, got shapes {x.shape} and {y.shape}"
        )
    if len(x) != len(y):
        raise ValueError(f"MNIST files {x_path}, {y_path}: {len(x)} images but {len(y)} labels")
    pixels = x.reshape(len(x), -1).astype(dtype)
    pixels /= 255
    return pixels, y.astype(np.int64)


def load_mnist(root: PathLike, dtype: DTypeLike = np.float32) -> Split:
    """Load MNIST from the four standard IDX files in ``root`` (no download).

    Looks for ``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``,
    ``t10k-images-idx3-ubyte`` and ``t10k-labels-idx1-ubyte``, each also as
    ``.gz`` and in the dotted spelling (``train-images.idx3-ubyte``).
    Format: http://yann.lecun.com/exdb/mnist/.

    Args:
        root: folder holding the four files.
        dtype: floating dtype of the images.

    Returns:
        ``(X_train, y_train, X_test, y_test)``: images of shape
        ``(N, rows * cols)`` (``(N, 784)`` for MNIST) and ``dtype``, pixel
        intensity divided by 255 so in [0, 1]; labels of shape ``(N,)``, int64.

    Raises:
        FileNotFoundError: a file is missing; the message lists the names tried.
        ValueError: a malformed file (see :func:`read_idx`), images not 3-D or
            labels not 1-D, or image and label counts that differ.
    """
    root = Path(root)
    x_train, y_train = _mnist_pair(root, "train-images-idx3-ubyte", "train-labels-idx1-ubyte", dtype)
    x_test, y_test = _mnist_pair(root, "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte", dtype)
    return x_train, y_train, x_test, y_test
