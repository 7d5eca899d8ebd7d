"""save_checkpoint / load_checkpoint: round trip, atomicity, no pickle."""

from __future__ import annotations

import importlib.util
import random
import subprocess
import sys
from pathlib import Path

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


# --- the digest: any damage is refused, wherever it lands ----------------------------------

STATE = {"model.w": np.arange(24, dtype=np.float32).reshape(4, 6), "epoch": np.array(3), "name": np.array("x")}


def test_the_file_ends_with_its_digest_and_numpy_still_reads_it(tmp_path):
    path = tmp_path / "c.npz"
    save_checkpoint(path, STATE)
    data = path.read_bytes()
    assert data[-79:].startswith(b"mpidist-sha256:")
    with np.load(path) as npz:
        assert npz["model.w"].tobytes() == STATE["model.w"].tobytes()


@pytest.mark.parametrize("where", ["every byte of the headers", "the end record and digest"])
def test_a_flipped_bit_anywhere_is_refused(tmp_path, where):
    """Without the digest, a flip in an array's .npy header loaded as another array (shape,
    dtype or order changed: no CRC is checked before it) or raised tokenize's TokenError."""
    path = tmp_path / "c.npz"
    save_checkpoint(path, STATE)
    data = path.read_bytes()
    positions = (
        range(len(data) - 101, len(data))
        if where.startswith("the end")
        else [i for i in range(len(data)) if i < 200 or data[max(0, i - 60) : i].find(b"PK") >= 0]
    )
    for i in positions:
        damaged = bytearray(data)
        damaged[i] ^= 0x04
        path.write_bytes(bytes(damaged))
        with pytest.raises(ValueError, match=f"checkpoint {path} is corrupt or truncated"):
            load_checkpoint(path)


def test_every_damage_of_the_chaos_harness_is_refused(tmp_path, monkeypatch):
    """tests/chaos/run.py's ``corrupt`` must change the file: its zeroed block once fell on
    bytes already zero (a checkpoint with zero arrays), the file stayed intact, loaded, and the
    chaos trial failed (CI, stop 51)."""
    spec = importlib.util.spec_from_file_location("chaos_run", Path(__file__).parent / "chaos" / "run.py")
    harness = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, harness)  # its dataclasses look it up
    spec.loader.exec_module(harness)
    path = tmp_path / "c.npz"
    state = {"zeros": np.zeros(4096, np.float32), "w": np.arange(64, dtype=np.float64)}
    for seed in range(300):
        save_checkpoint(path, state)
        harness.corrupt(path, random.Random(seed))
        with pytest.raises(ValueError, match=f"checkpoint {path} is corrupt or truncated"):
            load_checkpoint(path)


def test_a_numpy_savez_file_loads_and_its_damage_is_a_value_error(tmp_path):
    path = tmp_path / "plain.npz"
    np.savez(path, **STATE)
    assert load_checkpoint(path)["model.w"].tobytes() == STATE["model.w"].tobytes()
    data = path.read_bytes()
    at = data.index(b"'descr'") + 2  # the first array's .npy header, which no CRC guards
    for i in range(at, at + 60):
        damaged = bytearray(data)
        damaged[i] ^= 0x40
        path.write_bytes(bytes(damaged))
        try:
            loaded = load_checkpoint(path)
        except ValueError as exc:
            assert "is corrupt or truncated" in str(exc)
        else:  # the header still parsed: then it says the same (a flip in a padding space, say)
            assert set(loaded) == set(STATE)


def test_write_errors_name_the_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "c.npz"
    save_checkpoint(path, STATE)
    before = path.read_bytes()

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(tmp_path))

    monkeypatch.setattr(ckpt.tempfile, "mkstemp", refuse)
    with pytest.raises(
        PermissionError,
        match=f"cannot write checkpoint {path}: cannot create a file in {tmp_path} \\(Permission denied\\)",
    ):
        save_checkpoint(path, STATE)
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["c.npz"]


def test_a_full_disk_keeps_the_previous_checkpoint(tmp_path):
    """The kernel's own EFBIG part-way through the file (RLIMIT_FSIZE, in a child process)."""
    path = tmp_path / "c.npz"
    save_checkpoint(path, STATE)
    code = (
        f"import resource, signal, numpy as np\n"
        f"from mpidist.checkpoint import save_checkpoint\n"
        f"signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        f"resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))\n"
        f"try:\n    save_checkpoint({str(path)!r}, {{'big': np.zeros(10000)}})\n"
        f"except OSError as exc:\n    print(type(exc).__name__, exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == f"OSError [Errno 27] cannot write checkpoint {path} (File too large)", out
    assert load_checkpoint(path)["model.w"].tobytes() == STATE["model.w"].tobytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.npz"]
