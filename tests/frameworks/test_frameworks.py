"""Training frameworks over backend "mpidist", launched as users do: each script under
``timeout -k 10 T mpiexec -n N python -m mpidist SCRIPT`` at N = 2 and 4 (docs/torch.md,
"Frameworks"). The scripts check the run themselves (_fwcheck.py: backend "mpidist", sharded
data, bitwise-identical parameters on every rank, a falling loss) and rank 0 prints one
``FRAMEWORK OK <name> np=N`` line per part that passed; a rank that fails ends the job.

One job may serve several tests (Lightning without and with ``sync_dist=True``; DeepSpeed
ZeRO-1 and ZeRO-2; FSDP2 with ``dcp.save`` and with ``dcp.async_save``): each job runs once per
world size and its tests read its output. Outputs (logs, checkpoints, flight-recorder dumps) go to a private
temporary directory.

The suite runs only under ``make test-frameworks`` (``MPIDIST_TEST_FRAMEWORKS=1``), which
installs the ``frameworks`` extra first; elsewhere (the other passes of ``make test``, a plain
``pytest``) it is skipped, so that it neither runs twice nor fails for want of the packages.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import launcher_free_env

if os.environ.get("MPIDIST_TEST_FRAMEWORKS") != "1":
    pytest.skip(
        "the frameworks suite runs under `make test-frameworks` (MPIDIST_TEST_FRAMEWORKS=1)", allow_module_level=True
    )

HERE = Path(__file__).resolve().parent
MPIEXEC = str(Path(sys.executable).with_name("mpiexec"))
#: Bound on one job (s), under `timeout -k 10`: the jobs took 7-42 s each on the 2-core machine under load.
JOB_TIMEOUT = int(os.environ.get("MPIDIST_FRAMEWORKS_JOB_TIMEOUT", "150"))
SIZES = [2, 4]
#: At -n 2 only: the frameworks whose -n 4 run adds no sharding of its own (DDP replicates the
#: model at every world size; DeepSpeed ZeRO and FSDP2 shard it, so they run at 2 and 4). The
#: -n 4 runs are the dearest on the 2-core CI machine (four ranks import torch and the framework).
DDP_SIZES = [2]


def job_env(out: Path) -> dict:
    env = launcher_free_env(
        OMP_NUM_THREADS="1",
        FW_OUT=str(out),
        TMPDIR=str(out),
        HF_HOME=str(out / "hf-home"),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        MPLCONFIGDIR=str(out / "mpl"),
        TOKENIZERS_PARALLELISM="false",
    )
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PYTHONPATH"):
        env.pop(name, None)
    return env


@pytest.fixture(scope="module")
def run_job():
    """``run_job(script, n)``: the job's CompletedProcess (stdout and stderr merged), run once
    per module in a private temporary directory, removed at the module's end."""
    jobs: dict = {}
    root = tempfile.TemporaryDirectory(prefix="mpidist-frameworks-")

    def run(script: str, n: int, backend: str = "mpidist") -> subprocess.CompletedProcess:
        key = (script, n, backend)
        if key not in jobs:
            out = Path(tempfile.mkdtemp(prefix=f"{Path(script).stem}-np{n}-", dir=root.name))
            cmd = [
                "timeout",
                "-k",
                "10",
                str(JOB_TIMEOUT),
                MPIEXEC,
                "-n",
                str(n),
                sys.executable,
                "-m",
                "mpidist",
                str(HERE / script),
            ]
            jobs[key] = subprocess.run(
                cmd,
                cwd=out,
                env=dict(job_env(out), FW_BACKEND=backend),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                timeout=JOB_TIMEOUT + 30,
            )
        return jobs[key]

    with root:
        yield run


def passed(job: subprocess.CompletedProcess, name: str, n: int) -> str:
    """The ``FRAMEWORK OK name np=n`` line of the job (AssertionError with the output's end
    when it is missing)."""
    # (not anchored at a line's start: another rank's unfinished line may stand before it)
    found = re.search(rf"FRAMEWORK OK {re.escape(name)} np={n} [^\n]*", job.stdout)
    if found:
        return found.group(0)
    tail = "\n".join(job.stdout.splitlines()[-60:])
    why = "timed out" if job.returncode in (124, 137) else f"exit code {job.returncode}"
    raise AssertionError(f"{name} at np={n}: no 'FRAMEWORK OK' line ({why}); output's end:\n{tail}")


def completed(job: subprocess.CompletedProcess, name: str, n: int) -> None:
    """As :func:`passed`, for the job's last part: the job must also exit 0."""
    line = passed(job, name, n)
    assert job.returncode == 0, f"{name} at np={n}: exit code {job.returncode} after {line!r}:\n{job.stdout[-4000:]}"


pytestmark = pytest.mark.timeout(JOB_TIMEOUT + 60)


@pytest.mark.parametrize("n", DDP_SIZES)
def test_lightning_ddp_strategy_with_mpi_environment(run_job, n):
    passed(run_job("lightning_train.py", n), "lightning", n)


@pytest.mark.parametrize("n", DDP_SIZES)
def test_lightning_log_sync_dist(run_job, n):
    """Lightning's sync_dist=True all-reduces an int64 tensor with ReduceOp.AVG (issue 23, finding 2)."""
    completed(run_job("lightning_train.py", n), "lightning-sync-dist", n)


@pytest.mark.parametrize("n", DDP_SIZES)
def test_accelerate_cpu_after_init_process_group(run_job, n):
    completed(run_job("accelerate_train.py", n), "accelerate", n)


@pytest.mark.parametrize("n", DDP_SIZES)
def test_transformers_trainer_use_cpu_after_init_process_group(run_job, n):
    completed(run_job("hf_trainer_train.py", n), "hf-trainer", n)


@pytest.mark.parametrize("n", DDP_SIZES)
def test_accelerate_picks_mpi_on_its_own(run_job, n):
    """No init_process_group of ours: under mpiexec, ``Accelerator(cpu=True)`` picks backend
    "mpi" itself because ``import mpidist.torch`` made ``is_mpi_available()`` True (issue 24)."""
    completed(run_job("accelerate_train.py", n, "mpi"), "accelerate", n)


@pytest.mark.parametrize("n", DDP_SIZES)
def test_transformers_trainer_picks_mpi_on_its_own(run_job, n):
    """``TrainingArguments(use_cpu=True)`` with no ``ddp_backend``: the Trainer's Accelerate picks "mpi"."""
    completed(run_job("hf_trainer_train.py", n, "mpi"), "hf-trainer", n)


@pytest.mark.parametrize("n", SIZES)
def test_deepspeed_zero1(run_job, n):
    passed(run_job("deepspeed_train.py", n), "deepspeed-zero1", n)


@pytest.mark.parametrize("n", SIZES)
def test_deepspeed_zero2(run_job, n):
    completed(run_job("deepspeed_train.py", n), "deepspeed-zero2", n)


@pytest.mark.parametrize("n", SIZES)
def test_fsdp2_dcp_save_and_load(run_job, n):
    passed(run_job("fsdp2_dcp_train.py", n), "fsdp2", n)
    passed(run_job("fsdp2_dcp_train.py", n), "fsdp2-dcp", n)


@pytest.mark.parametrize("n", SIZES)
def test_fsdp2_dcp_async_save_and_load(run_job, n):
    """dcp.async_save needs a CPU backend in the group's _device_types (issue 23, finding 3)."""
    completed(run_job("fsdp2_dcp_train.py", n), "fsdp2-dcp-async", n)
