"""save_checkpoint / load_checkpoint: round trip, atomicity, no pickle."""
from __future__ import annotations

import numpy as np
import pytest

import mpidist.checkpoint as ckpt
from mpidist.checkpoint import load_checkpoint, save_checkpoint


def sample_arrays():
    rng = np.random.default_rng(0)
    return {
        "w": rng.standard_normal((3, 4)).astype(np.float32),
        "b": rng.standard_normal(4),
        "step": np.array(17, dtype=np.int64),
        "lr": np.float64(0.1),
        "mask": np.array([True, False]),
        "h": np.arange(6, dtype=np.float16).reshape(2, 3),
        "u8": np.arange(5, dtype=np.uint8),
        "empty": np.zeros((0, 3), dtype=np.int32),
        "layer.0/weight": np.ones(2, dtype=np.complex64),
        "names": np.array(["a", "bc"]),
    }


def assert_same(got, want):
    assert set(got) == set(want)
    for key, value in want.items():
        value = np.asarray(value)
        assert got[key].dtype == value.dtype, key
        assert got[key].shape == value.shape, key
        np.testing.assert_array_equal(got[key], value)


def test_round_trip(tmp_path):
    path = tmp_path / "model.npz"
    arrays = sample_arrays()
    save_checkpoint(path, arrays)
    got = load_checkpoint(path)
    assert_same(got, arrays)
    assert all(isinstance(v, np.ndarray) for v in got.values())
    assert got["step"].shape == ()


def test_lists_and_numpy_load_compatible(tmp_path):
    path = tmp_path / "c.npz"
    save_checkpoint(str(path), {"a": [1, 2, 3]})
    with np.load(path) as npz:
        np.testing.assert_array_equal(npz["a"], [1, 2, 3])


def test_empty_mapping(tmp_path):
    save_checkpoint(tmp_path / "e.npz", {})
    assert load_checkpoint(tmp_path / "e.npz") == {}


class FakeDeviceArray:
    """Looks like a cupy array: __cuda_array_interface__ and .get()."""

    __cuda_array_interface__ = {}

    def __init__(self, host):
        self.host = host

    def get(self):
        return self.host


def test_device_arrays_are_copied_to_host(tmp_path):
    save_checkpoint(tmp_path / "d.npz", {"x": FakeDeviceArray(np.arange(3.0))})
    np.testing.assert_array_equal(load_checkpoint(tmp_path / "d.npz")["x"], np.arange(3.0))


def test_overwrite_and_no_temp_files(tmp_path):
    path = tmp_path / "c.npz"
    save_checkpoint(path, {"a": np.zeros(3)})
    save_checkpoint(path, {"a": np.ones(3), "b": np.arange(2)})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.npz"]
    assert_same(load_checkpoint(path), {"a": np.ones(3), "b": np.arange(2)})


class Exploding:
    def __array__(self, dtype=None, copy=None):
        raise RuntimeError("boom")


def test_failed_write_keeps_previous_checkpoint(tmp_path):
    path = tmp_path / "c.npz"
    save_checkpoint(path, {"a": np.arange(4)})
    with pytest.raises(RuntimeError, match="boom"):
        save_checkpoint(path, {"a": np.arange(1000.0), "b": Exploding()})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.npz"]
    assert_same(load_checkpoint(path), {"a": np.arange(4)})


def test_failed_replace_keeps_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "c.npz"
    save_checkpoint(path, {"a": np.arange(4)})

    def fail(src, dst):
        raise OSError("disk on fire")

    monkeypatch.setattr(ckpt.os, "replace", fail)
    with pytest.raises(OSError, match="disk on fire"):
        save_checkpoint(path, {"a": np.zeros(9)})
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.npz"]
    assert_same(load_checkpoint(path), {"a": np.arange(4)})


def test_object_arrays_rejected(tmp_path):
    path = tmp_path / "c.npz"
    with pytest.raises(ValueError, match="object"):
        save_checkpoint(path, {"o": np.array([{"x": 1}, None], dtype=object)})
    assert list(tmp_path.iterdir()) == []


def test_non_str_keys_rejected(tmp_path):
    with pytest.raises(TypeError, match="must be str"):
        save_checkpoint(tmp_path / "c.npz", {1: np.zeros(1)})


@pytest.mark.parametrize("keep", [0, 3, 10, 100, -30])
def test_truncated_file_is_reported(tmp_path, keep):
    path = tmp_path / "c.npz"
    save_checkpoint(path, {"a": np.arange(100.0), "b": np.ones((4, 4))})
    data = path.read_bytes()
    path.write_bytes(data[:keep])
    with pytest.raises(ValueError, match="is corrupt or truncated") as info:
        load_checkpoint(path)
    assert str(path) in str(info.value)


def test_corrupt_payload_is_reported(tmp_path):
    path = tmp_path / "c.npz"
    save_checkpoint(path, {"a": np.arange(100.0)})
    data = bytearray(path.read_bytes())
    data[200] ^= 0xFF  # inside the array data: CRC mismatch
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="is corrupt or truncated"):
        load_checkpoint(path)


def test_pickled_object_array_is_refused(tmp_path):
    path = tmp_path / "evil.npz"
    np.savez(path, o=np.array([{"x": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match="pickle"):
        load_checkpoint(path)


def test_plain_pickle_file_is_refused(tmp_path):
    import pickle

    path = tmp_path / "evil.npz"
    path.write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(ValueError, match="is corrupt or truncated"):
        load_checkpoint(path)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_checkpoint(tmp_path / "nope.npz")
