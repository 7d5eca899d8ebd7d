"""IDX reader/writer, load_mnist on a fake MNIST, and load_digits_split."""

from __future__ import annotations

import gzip

import numpy as np
import pytest

from mpidist.data import load_digits_split, load_mnist, read_idx, write_idx

DTYPES = [np.uint8, np.int8, np.int16, np.int32, np.float32, np.float64]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_idx_round_trip(tmp_path, dtype, suffix):
    rng = np.random.default_rng(0)
    array = (rng.standard_normal((3, 4, 5)) * 50).astype(dtype)
    path = tmp_path / f"a-idx3-ubyte{suffix}"
    write_idx(path, array)
    got = read_idx(path)
    assert got.dtype == np.dtype(dtype) and got.dtype.isnative
    np.testing.assert_array_equal(got, array)


def test_idx_header_is_big_endian(tmp_path):
    path = tmp_path / "x"
    write_idx(path, np.arange(6, dtype=np.int16).reshape(2, 3))
    data = path.read_bytes()
    assert data[:4] == bytes([0, 0, 0x0B, 2])
    assert data[4:12] == bytes([0, 0, 0, 2, 0, 0, 0, 3])
    assert data[12:16] == bytes([0, 0, 0, 1])


def test_idx_gz_is_really_gzip(tmp_path):
    path = tmp_path / "x.gz"
    write_idx(path, np.arange(4, dtype=np.uint8))
    assert gzip.decompress(path.read_bytes())[:4] == bytes([0, 0, 8, 1])


@pytest.mark.parametrize("shape", [(), (0,), (2, 0, 3), (7,)])
def test_idx_odd_shapes(tmp_path, shape):
    array = np.ones(shape, dtype=np.float32)
    write_idx(tmp_path / "x", array)
    got = read_idx(tmp_path / "x")
    assert got.shape == shape
    np.testing.assert_array_equal(got, array)


def test_write_idx_rejects_unsupported_dtype(tmp_path):
    with pytest.raises(ValueError, match="no IDX type code"):
        write_idx(tmp_path / "x", np.zeros(3, dtype=np.int64))


@pytest.fixture
def idx_file(tmp_path):
    path = tmp_path / "data-idx2-ubyte"
    write_idx(path, np.arange(12, dtype=np.int32).reshape(3, 4))
    return path


@pytest.mark.parametrize("head", [b"\x01\x00\x0c\x02", b"\x00\x00\x07\x02", b"\x00\x00", b""])
def test_bad_magic(idx_file, head):
    idx_file.write_bytes(head + idx_file.read_bytes()[4:] if len(head) == 4 else head)
    with pytest.raises(ValueError, match="bad magic number") as info:
        read_idx(idx_file)
    assert str(idx_file) in str(info.value)


def test_truncated_data(idx_file):
    idx_file.write_bytes(idx_file.read_bytes()[:-3])
    with pytest.raises(ValueError, match=r"truncated data: expected 60 bytes .* got 57") as info:
        read_idx(idx_file)
    assert str(idx_file) in str(info.value)


def test_truncated_header(idx_file):
    idx_file.write_bytes(idx_file.read_bytes()[:7])
    with pytest.raises(ValueError, match="truncated header"):
        read_idx(idx_file)


def test_trailing_data(idx_file):
    idx_file.write_bytes(idx_file.read_bytes() + b"\x00")
    with pytest.raises(ValueError, match=r"trailing data: expected 60 bytes .* got 61"):
        read_idx(idx_file)


def test_truncated_gzip(tmp_path):
    path = tmp_path / "x.gz"
    write_idx(path, np.arange(1000, dtype=np.float64))
    path.write_bytes(path.read_bytes()[:-20])
    with pytest.raises(ValueError, match="gzip") as info:
        read_idx(path)
    assert str(path) in str(info.value)


def test_missing_idx_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_idx(tmp_path / "nope")


def write_fake_mnist(root, n_train=20, n_test=10, dotted=False, gz=False):
    rng = np.random.default_rng(1)
    parts = {}
    for split, n in (("train", n_train), ("t10k", n_test)):
        images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        images[0, 0, 0], images[0, 0, 1] = 0, 255
        labels = rng.integers(0, 10, n, dtype=np.uint8)
        sep = "." if dotted else "-"
        write_idx(root / f"{split}-images{sep}idx3-ubyte{'.gz' if gz else ''}", images)
        write_idx(root / f"{split}-labels{sep}idx1-ubyte{'.gz' if gz else ''}", labels)
        parts[split] = images, labels
    return parts


@pytest.mark.parametrize("dotted", [False, True])
@pytest.mark.parametrize("gz", [False, True])
def test_load_mnist(tmp_path, dotted, gz):
    parts = write_fake_mnist(tmp_path, dotted=dotted, gz=gz)
    x_train, y_train, x_test, y_test = load_mnist(str(tmp_path))
    assert x_train.shape == (20, 784) and x_test.shape == (10, 784)
    assert x_train.dtype == np.float32 and y_train.dtype == np.int64
    assert x_train.min() == 0.0 and x_train.max() == 1.0
    np.testing.assert_allclose(x_train, parts["train"][0].reshape(20, -1) / 255, rtol=1e-6)
    np.testing.assert_array_equal(y_train, parts["train"][1])
    np.testing.assert_array_equal(y_test, parts["t10k"][1])


def test_load_mnist_dtype(tmp_path):
    write_fake_mnist(tmp_path)
    assert load_mnist(tmp_path, dtype=np.float64)[0].dtype == np.float64


def test_load_mnist_missing_file_lists_names(tmp_path):
    write_fake_mnist(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(FileNotFoundError) as info:
        load_mnist(tmp_path)
    msg = str(info.value)
    for name in ("t10k-labels-idx1-ubyte", "t10k-labels-idx1-ubyte.gz", "t10k-labels.idx1-ubyte.gz"):
        assert name in msg


def test_load_mnist_count_mismatch(tmp_path):
    write_fake_mnist(tmp_path)
    write_idx(tmp_path / "train-labels-idx1-ubyte", np.zeros(19, dtype=np.uint8))
    with pytest.raises(ValueError, match="20 images but 19 labels"):
        load_mnist(tmp_path)


def test_digits_split_shapes_and_range():
    x_train, y_train, x_test, y_test = load_digits_split()
    assert len(x_train) + len(x_test) == 1797
    assert len(x_test) == 360
    assert x_train.shape[1] == x_test.shape[1] == 64
    assert x_train.dtype == np.float32 and y_train.dtype == np.int64
    both = np.concatenate([x_train, x_test])
    assert both.min() == 0.0 and both.max() == 1.0
    assert set(np.unique(y_train)) == set(range(10))


def test_digits_split_is_stratified():
    _, y_train, _, y_test = load_digits_split(test_size=0.25)
    train_frac = np.bincount(y_train, minlength=10) / len(y_train)
    test_frac = np.bincount(y_test, minlength=10) / len(y_test)
    np.testing.assert_allclose(train_frac, test_frac, atol=0.01)


def test_digits_split_deterministic_by_seed():
    a, b, c = load_digits_split(seed=0), load_digits_split(seed=0), load_digits_split(seed=1)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(a[1], c[1])


def test_digits_split_dtype():
    assert load_digits_split(dtype=np.float64)[0].dtype == np.float64
