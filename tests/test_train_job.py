"""The main job end to end, launched the way users launch it: mpiexec -n N python -m ..."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import launcher_free_env
from mpidist.checkpoint import load_checkpoint
from mpidist.data import write_idx

MPIEXEC = str(Path(sys.executable).with_name("mpiexec"))
JOB = [sys.executable, "-m", "mpidist.examples.train_digits", "--no-progress"]


def run_job(n: int, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([MPIEXEC, "-n", str(n), *JOB, *args], capture_output=True, text=True,
                          timeout=timeout, env=launcher_free_env(OMP_NUM_THREADS="1"))


@pytest.mark.parametrize("n, algorithm", [(4, "mpi"), (3, "ring")])
def test_digits_job_reaches_accuracy_and_writes_outputs(tmp_path, n, algorithm):
    out = run_job(n, "--out", str(tmp_path), "--algorithm", algorithm)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"mpidist: {n} ranks, sklearn digits: 1437 train / 360 test samples" in out.stdout
    history = json.loads((tmp_path / "metrics.json").read_text())
    assert len(history) == 30 and all(h["world_size"] == n for h in history)
    assert history[-1]["test_accuracy"] >= 0.95, history[-1]
    assert history[-1]["loss"] < history[0]["loss"]
    assert (tmp_path / "training.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ckpt = load_checkpoint(tmp_path / "checkpoint.npz")
    assert ckpt["model.0.weight"].shape == (128, 64) and ckpt["model.4.weight"].shape == (10, 128)
    assert int(ckpt["epoch"]) == 30
    assert "final test accuracy" in out.stdout


def fake_mnist(root: Path, n_train: int, n_test: int) -> None:
    """Tiny IDX files in MNIST's layout: class k is a bright 7x7 square at a k-dependent place."""
    rng = np.random.default_rng(0)

    def images(labels):
        x = rng.integers(0, 60, size=(len(labels), 28, 28), dtype=np.uint8)
        for i, k in enumerate(labels):
            r, c = 7 * (k // 4), 7 * (k % 4)
            x[i, r:r + 7, c:c + 7] = 255
        return x

    for prefix, n in (("train", n_train), ("t10k", n_test)):
        labels = rng.integers(0, 10, size=n).astype(np.uint8)
        write_idx(root / f"{prefix}-images-idx3-ubyte.gz", images(labels))
        write_idx(root / f"{prefix}-labels-idx1-ubyte", labels)


def test_mnist_idx_job(tmp_path):
    data = tmp_path / "mnist"
    data.mkdir()
    fake_mnist(data, 400, 100)
    out = run_job(2, "--out", str(tmp_path / "out"), "--data", str(data), "--epochs", "8", "--lr", "0.02")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "MNIST" in out.stdout and "400 train / 100 test samples" in out.stdout
    history = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert history[-1]["test_accuracy"] >= 0.9, history[-1]
    assert load_checkpoint(tmp_path / "out" / "checkpoint.npz")["model.0.weight"].shape == (128, 784)


def test_bad_flags_fail_fast(tmp_path):
    out = subprocess.run([*JOB, "--epochs", "0"], capture_output=True, text=True, timeout=60,
                         env=launcher_free_env())
    assert out.returncode == 2 and "--epochs must be >= 1, got 0" in out.stderr
    out = subprocess.run([*JOB, "--data", str(tmp_path / "missing"), "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=60, env=launcher_free_env())
    assert out.returncode != 0 and "FileNotFoundError" in out.stderr
