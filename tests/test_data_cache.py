"""The per-user cache of load_digits_split (mpidist.data._cache): the same arrays bit for bit,
no scikit-learn import once cached, private files, and every bad cache state computed around."""

from __future__ import annotations

import io
import os
import stat
import subprocess
import sys

import numpy as np
import pytest
from conftest import launcher_free_env

from mpidist.data import _cache, load_digits_split

KEY = "test key v1"


def arrays() -> dict:
    return {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.array([3, 1, 2], np.int64)}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    path = tmp_path / "cache"
    monkeypatch.setenv(_cache.ENV, str(path))
    return path


def counted() -> tuple[list, object]:
    calls: list = []

    def compute() -> dict:
        calls.append(1)
        return arrays()

    return calls, compute


def the_file(cache) -> os.PathLike:
    (found,) = list(cache.iterdir())
    return found


def test_computed_once_then_read_back_private(cache):
    calls, compute = counted()
    first = _cache.cached(KEY, compute)
    again = _cache.cached(KEY, compute)
    assert len(calls) == 1
    for k, v in arrays().items():
        assert first[k].dtype == again[k].dtype == v.dtype
        np.testing.assert_array_equal(again[k], v)
    assert set(again) == {"a", "b"}
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    f = the_file(cache)
    assert stat.S_IMODE(f.stat().st_mode) == 0o600 and f.name.endswith(".npz")


def test_another_key_is_computed(cache):
    calls, compute = counted()
    _cache.cached(KEY, compute)
    _cache.cached(KEY + " other", compute)
    assert len(calls) == 2 and len(list(cache.iterdir())) == 2


@pytest.mark.parametrize("bad", ["torn", "not npz", "foreign key", "no key"])
def test_a_bad_file_is_computed_around_and_replaced(cache, bad):
    calls, compute = counted()
    _cache.cached(KEY, compute)
    f = the_file(cache)
    if bad == "torn":
        f.write_bytes(f.read_bytes()[:100])
    elif bad == "not npz":
        f.write_bytes(b"hello")
    else:
        buf = io.BytesIO()
        extra = {} if bad == "no key" else {"__cache_key__": np.array("another key")}
        np.savez(buf, a=np.zeros(1), **extra)
        f.write_bytes(buf.getvalue())
    got = _cache.cached(KEY, compute)
    assert len(calls) == 2
    np.testing.assert_array_equal(got["a"], arrays()["a"])
    _cache.cached(KEY, compute)  # the file was replaced with a good one
    assert len(calls) == 2


def test_a_link_in_the_files_place_is_not_followed(cache, tmp_path):
    calls, compute = counted()
    _cache.cached(KEY, compute)
    f = the_file(cache)
    target = tmp_path / "elsewhere.npz"
    f.rename(target)  # a good file of the key, but reached through a link: not read
    f.symlink_to(target)
    before = target.read_bytes()
    _cache.cached(KEY, compute)
    assert len(calls) == 2
    assert not f.is_symlink() and target.read_bytes() == before  # replaced, the target untouched


@pytest.mark.parametrize("how", ["group-writable", "a link", "off"])
def test_no_private_directory_means_no_cache_and_no_error(tmp_path, monkeypatch, how):
    path = tmp_path / "cache"
    if how == "group-writable":
        path.mkdir()
        path.chmod(0o770)
    elif how == "a link":
        (tmp_path / "real").mkdir(mode=0o700)
        path.symlink_to(tmp_path / "real")
    monkeypatch.setenv(_cache.ENV, "off" if how == "off" else str(path))
    calls, compute = counted()
    _cache.cached(KEY, compute)
    got = _cache.cached(KEY, compute)
    assert len(calls) == 2
    np.testing.assert_array_equal(got["b"], arrays()["b"])
    if how == "group-writable":
        assert list(path.iterdir()) == []
    elif how == "a link":
        assert list((tmp_path / "real").iterdir()) == []
    else:
        assert not path.exists()


def test_default_directory_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv(_cache.ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert _cache.cache_dir() == str(tmp_path / "mpidist" / "data")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert _cache.cache_dir() == os.path.join(os.path.expanduser("~"), ".cache", "mpidist", "data")


SPLIT = """
import sys, numpy as np
from mpidist.data import load_digits_split
split = load_digits_split(test_size=0.25, seed=3, dtype=np.float64)
np.savez(sys.argv[1], *split)
print("sklearn imported:", "sklearn" in sys.modules)
"""


def test_the_digits_split_is_the_same_cached_and_needs_no_sklearn_import(cache, tmp_path, monkeypatch):
    """A fresh process fills the cache (importing scikit-learn), the next reads it back without
    that import, and both get what scikit-learn computes in this process, bit for bit."""
    outs = []
    for i, imported in enumerate(("True", "False")):
        out = tmp_path / f"split{i}.npz"
        run = subprocess.run(
            [sys.executable, "-c", SPLIT, str(out)],
            capture_output=True,
            text=True,
            timeout=120,
            env=launcher_free_env(**{_cache.ENV: str(cache)}),
        )
        assert run.returncode == 0, run.stderr
        assert f"sklearn imported: {imported}" in run.stdout
        with np.load(out) as npz:
            outs.append([npz[k] for k in sorted(npz.files)])
    monkeypatch.setenv(_cache.ENV, "off")
    want = load_digits_split(test_size=0.25, seed=3, dtype=np.float64)
    for got in outs:
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and g.shape == w.shape
            assert g.tobytes() == w.tobytes()


def test_a_seed_that_is_no_integer_is_not_cached(cache):
    a = load_digits_split(seed=np.random.RandomState(1))
    b = load_digits_split(seed=np.random.RandomState(1))
    np.testing.assert_array_equal(a[1], b[1])
    assert not cache.exists() or list(cache.iterdir()) == []
