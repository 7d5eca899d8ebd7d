"""The torch main job on a GPU (``--device cuda``), launched as users do, at 1 and 2 ranks: over
"mpidist" (CUDA tensors through NCCL where mpidist can use it, else host staging), and over
torch's own NCCL (``--backend nccl``, ``init_method="mpi://"``) where NCCL can run the ranks.
Both reach the CPU job's accuracy; at 1 rank the two backends train bitwise the same model.

Skipped with the reason where torch sees no CUDA device. Run serially (it starts its own jobs).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("torch sees no CUDA device (or is a CPU build)", allow_module_level=True)

from conftest import launcher_free_env  # noqa: E402
from mpi4py import MPI  # noqa: E402

from mpidist._backends.device import nccl_core  # noqa: E402
from mpidist.checkpoint import load_checkpoint  # noqa: E402

if MPI.COMM_WORLD.Get_size() > 1:
    pytest.skip("starts its own jobs: runs in the serial pass", allow_module_level=True)

MPIEXEC = str(Path(sys.executable).with_name("mpiexec"))
JOB = [
    sys.executable,
    "-m",
    "mpidist",
    "-m",
    "mpidist.examples.train_torch",
    "--no-progress",
    "--device",
    "cuda",
    "--epochs",
    "8",
]


def run(n: int, out: Path, *args: str) -> dict:
    env = launcher_free_env(OMP_NUM_THREADS="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    job = subprocess.run(
        [MPIEXEC, "-n", str(n), *JOB, "--out", str(out), *args], capture_output=True, text=True, timeout=300, env=env
    )
    assert job.returncode == 0, job.stdout + job.stderr
    assert " on cuda, " in job.stdout, job.stdout
    history = json.loads((out / "metrics.json").read_text())
    assert history[-1]["test_accuracy"] >= 0.95, history[-1]
    return load_checkpoint(out / "checkpoint.npz")


def nccl_refuses(n: int) -> str:
    """'' when torch's NCCL can run ``n`` ranks on this node's GPUs, else why not."""
    return "" if n <= torch.cuda.device_count() else nccl_core.shared_gpu_refused(torch.cuda.nccl.version())


@pytest.mark.parametrize("n", [1, 2])
def test_torch_job_on_cuda_over_mpidist(tmp_path, n):
    run(n, tmp_path)


@pytest.mark.parametrize("n", [1, 2])
def test_torch_job_on_cuda_mpidist_against_nccl(tmp_path, n):
    why = nccl_refuses(n)
    if why:
        pytest.skip(f"torch's NCCL cannot run {n} ranks on {torch.cuda.device_count()} GPU(s): {why}")
    mine, theirs = run(n, tmp_path / "mpidist"), run(n, tmp_path / "nccl", "--backend", "nccl")
    keys = [k for k in mine if k.startswith(("model.", "optimizer."))]
    diff = max(float(np.abs(mine[k] - theirs[k]).max()) for k in keys)
    if n == 1:  # one rank: both add nothing, so the same steps give the same bits
        assert diff == 0.0, f"1 rank: mpidist and NCCL differ by {diff}"
