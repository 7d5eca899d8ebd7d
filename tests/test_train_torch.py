"""The torch main job end to end (torch DDP over the "mpidist" backend), launched as users do:
mpiexec -n N python -m mpidist -m mpidist.examples.train_torch ..."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch", reason="the torch job needs torch (pip install -e '.[torch]')")

from conftest import STOP_SIGNAL, launcher_free_env  # noqa: E402
from test_train_job import (  # noqa: E402  (the numpy job's helpers)
    check_usage_error,
    fake_mnist,
    same_run,
    stop_after_epoch,
)

from mpidist.checkpoint import load_checkpoint  # noqa: E402

pytestmark = pytest.mark.launches  # starts MPI jobs or processes of its own: make test-mpis runs it on every MPI

MPIEXEC = str(Path(sys.executable).with_name("mpiexec"))
JOB = [sys.executable, "-m", "mpidist", "-m", "mpidist.examples.train_torch", "--no-progress"]
# stop_after_epoch (test_train_job) looks for 3 rank processes.
RESUME_N = 3
STEPS = 30  # steps per epoch at RESUME_N ranks: ceil(ceil(1437 / 3) / 16)
EPOCHS = 12  # the stop comes after epoch 3: 9 epochs (about 4 s) of margin for mpiexec to pass the line on


def job_env() -> dict:
    """The environment of a job: no launcher's variables, and none of torch's launch variables
    (an earlier test's init_process_group in this process exported RANK=0, WORLD_SIZE=1...,
    which backend "mpidist" would refuse as contradicting MPI)."""
    env = launcher_free_env(OMP_NUM_THREADS="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def run_job(n: int, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [MPIEXEC, "-n", str(n), *JOB, *args], capture_output=True, text=True, timeout=timeout, env=job_env()
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The torch job at its defaults (backend "mpidist", 20 epochs) at 2 ranks: at 4 the two
    cores of the CI machine are oversubscribed and the run takes twice as long (36 s against
    20 s); the torch job runs at 3 and 4 ranks in the resume tests below, the chaos tests and
    the Slurm jobs. Shared by the accuracy test and the bitwise comparison with gloo."""
    out = tmp_path_factory.mktemp("trained")
    return out, run_job(2, "--out", str(out))


def test_torch_job_reaches_accuracy_and_writes_outputs(trained):
    tmp_path, out = trained
    assert out.returncode == 0, out.stdout + out.stderr
    assert "mpidist: 2 ranks, torch 2." in out.stdout
    assert " DDP over mpidist, sklearn digits: 1437 train / 360 test samples" in out.stdout
    history = json.loads((tmp_path / "metrics.json").read_text())
    assert len(history) == 20 and all(h["world_size"] == 2 for h in history)
    assert history[-1]["test_accuracy"] >= 0.97, history[-1]
    assert history[-1]["loss"] < history[0]["loss"]
    assert (tmp_path / "training.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ckpt = load_checkpoint(tmp_path / "checkpoint.npz")
    assert ckpt["model.features.0.weight"].shape == (16, 1, 3, 3) and ckpt["model.head.weight"].shape == (10, 512)
    assert ckpt["optimizer.0.momentum_buffer"].shape == (16, 1, 3, 3)
    assert int(ckpt["epoch"]) == 20 and int(ckpt["step"]) == 0
    assert json.loads(ckpt["config"].tobytes())["backend"] == "mpidist"
    assert f"final test accuracy {history[-1]['test_accuracy']:.4f}" in out.stdout


def test_a_diverging_torch_run_stops_at_the_first_non_finite_loss(tmp_path):
    """As the numpy job: every rank stops after the step whose loss was not finite on some
    rank, metrics.json (valid JSON) and the plot of what ran, no checkpoint, exit code 1."""
    out = run_job(2, "--out", str(tmp_path), "--lr", "1e6", "--epochs", "3", timeout=180)
    assert out.returncode != 0, out.stdout + out.stderr
    found = re.search(
        r"train_torch: loss is not finite at epoch (\d+) step (\d+) \(--lr 1000000.0: try a "
        r"smaller one\); stopped every rank there",
        out.stderr,
    )
    assert found, out.stdout + out.stderr
    assert "does not match" not in out.stdout + out.stderr and "Traceback" not in out.stderr
    epoch, step = int(found.group(1)), int(found.group(2))
    last = json.loads((tmp_path / "metrics.json").read_text())[-1]
    assert (last["epoch"], last["step"], last["diverged"]) == (
        epoch,
        step,
        f"loss is not finite at epoch {epoch} step {step}",
    )
    assert (tmp_path / "training.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "checkpoint.npz").exists()


def untimed(ckpt: dict) -> list[dict]:
    return [{k: v for k, v in h.items() if k != "samples_per_s"} for h in json.loads(ckpt["history"].tobytes())]


def test_mpidist_and_gloo_train_bitwise_the_same_model(trained, tmp_path):
    """At 2 ranks every sum is of two numbers (the same either way round), so DDP over mpidist
    must end with exactly gloo's parameters, momentum buffers and history (20 epochs, 900
    steps); and the checkpoint loads into a plain torch model."""
    ours, run = trained
    assert run.returncode == 0, run.stdout + run.stderr
    out = run_job(2, "--out", str(tmp_path / "gloo"), "--backend", "gloo")
    assert out.returncode == 0, out.stdout + out.stderr
    for backend, text in (("mpidist", run.stdout), ("gloo", out.stdout)):
        assert "mpidist: 2 ranks, torch 2." in text and f" DDP over {backend}, " in text
    a, b = load_checkpoint(ours / "checkpoint.npz"), load_checkpoint(tmp_path / "gloo" / "checkpoint.npz")
    assert set(a) == set(b)
    differ = [k for k in a if k not in ("history", "config") and not np.array_equal(a[k], b[k])]
    assert not differ, differ
    assert untimed(a) == untimed(b)
    check_loads_into_a_torch_model(ours)


def check_loads_into_a_torch_model(out: Path) -> None:
    """The checkpoint is plain arrays: a torch model loads them with load_state_dict and scores the
    test set exactly as the job did."""
    code = (
        "import sys, json, torch\n"
        "from mpidist.checkpoint import load_checkpoint\n"
        "from mpidist.data import load_digits_split\n"
        "from mpidist.examples.train_torch import Net, as_images\n"
        "ckpt = load_checkpoint(sys.argv[1] + '/checkpoint.npz')\n"
        "net = Net(16, 10)\n"
        "net.load_state_dict({k[6:]: torch.from_numpy(v) for k, v in ckpt.items() if k.startswith('model.')})\n"
        "_, _, x, y = load_digits_split(seed=0)\n"
        "with torch.no_grad():\n"
        "    acc = float((net(as_images(x)).argmax(1) == torch.from_numpy(y)).double().mean())\n"
        "want = json.load(open(sys.argv[1] + '/metrics.json'))[-1]['test_accuracy']\n"
        "assert acc == want, (acc, want)\n"
    )
    check = subprocess.run(
        [sys.executable, "-c", code, str(out)], capture_output=True, text=True, timeout=120, env=job_env()
    )
    assert check.returncode == 0, check.stdout + check.stderr


def test_mnist_idx_job(tmp_path):
    data = tmp_path / "mnist"
    data.mkdir()
    fake_mnist(data, 400, 100)
    out = run_job(2, "--out", str(tmp_path / "out"), "--data", str(data), "--epochs", "4")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "MNIST" in out.stdout and "400 train / 100 test samples" in out.stdout
    history = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert history[-1]["test_accuracy"] >= 0.9, history[-1]
    assert load_checkpoint(tmp_path / "out" / "checkpoint.npz")["model.head.weight"].shape == (10, 512)


@pytest.mark.parametrize(
    "flag,value,message",
    [
        ("--epochs", "0", "--epochs must be >= 1, got 0"),
        ("--lr", "-1", "--lr must be > 0, got -1.0"),
        ("--backend", "ucc", "invalid choice: 'ucc'"),
        ("--backend", "nccl", "--backend nccl needs --device cuda (NCCL communicates CUDA tensors only)"),
        ("--device", "tpu", "invalid choice: 'tpu'"),
    ],
)
def test_bad_flags_fail_fast(flag, value, message, capsys):
    """The job's own parser (what main() runs first); the command line end to end below."""
    from mpidist.examples.train_torch import parse_args  # noqa: PLC0415

    with pytest.raises(SystemExit) as info:
        parse_args([flag, value])
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_a_bad_flag_on_the_command_line_exits_2_before_any_training():
    out = subprocess.run([*JOB, "--lr", "-1"], capture_output=True, text=True, timeout=60, env=launcher_free_env())
    assert out.returncode == 2 and "--lr must be > 0, got -1.0" in out.stderr, out.stderr
    assert "mpidist:" not in out.stdout, out.stdout


def test_device_cuda_without_cuda_fails_fast():
    """The GPU run itself is in tests/gpu/test_torch_gpu_job.py (runs where torch sees CUDA)."""
    import torch  # noqa: PLC0415

    if torch.cuda.is_available():
        pytest.skip("this torch sees a CUDA device")
    out = subprocess.run(
        [*JOB, "--device", "cuda"], capture_output=True, text=True, timeout=60, env=launcher_free_env()
    )
    assert out.returncode == 2, out.stderr
    assert "--device cuda: this torch sees no CUDA device (torch.cuda.is_available() is False)" in out.stderr


# --- SIGTERM (SIGUSR1 on Open MPI) -> checkpoint at a step boundary on every rank; --resume -> bitwise the same run ---


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    job = run_job(RESUME_N, "--out", str(out), "--epochs", str(EPOCHS))
    assert job.returncode == 0, job.stdout + job.stderr
    return load_checkpoint(out / "checkpoint.npz")


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """The same job, given the launcher's stop signal (STOP_SIGNAL: mpiexec passes it on to every
    rank) after epoch 3."""
    out = tmp_path_factory.mktemp("interrupted")
    job = subprocess.Popen(
        [MPIEXEC, "-n", str(RESUME_N), *JOB, "--out", str(out), "--epochs", str(EPOCHS)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=job_env(),
    )
    stdout, stderr = stop_after_epoch(job, 3, lambda j: j.send_signal(STOP_SIGNAL), out, STOP_SIGNAL)
    return out, job.returncode, stdout, stderr


def test_stop_signal_to_mpiexec_checkpoints_at_one_step_and_exits_cleanly(interrupted):
    out, rc, stdout, stderr = interrupted
    assert rc == 0, stdout + stderr
    assert "Traceback" not in stderr, stderr
    stopped = load_checkpoint(out / "checkpoint.npz")
    epoch, step = int(stopped["epoch"]), int(stopped["step"])
    assert 3 <= epoch < EPOCHS and 0 <= step < STEPS, (epoch, step)
    assert f"stopped by {STOP_SIGNAL.name} after {epoch} epochs and {step}/{STEPS} steps" in stdout, stdout
    assert stopped["loss_totals"].shape == (RESUME_N, 2)
    assert (stopped["loss_totals"][:, 1] == (16 * step if step else 0)).all(), stopped["loss_totals"]
    assert [h["epoch"] for h in json.loads((out / "metrics.json").read_text())] == list(range(1, epoch + 1))


def test_resume_ends_bitwise_equal_to_an_uninterrupted_run(interrupted, uninterrupted, tmp_path):
    resumed = tmp_path / "resumed"
    shutil.copytree(interrupted[0], resumed)
    stopped = load_checkpoint(resumed / "checkpoint.npz")
    job = run_job(RESUME_N, "--out", str(resumed), "--epochs", str(EPOCHS), "--resume")
    assert job.returncode == 0, job.stdout + job.stderr
    assert (
        f"resumed from {resumed / 'checkpoint.npz'}: {int(stopped['epoch'])} epochs and "
        f"{int(stopped['step'])}/{STEPS} steps done"
    ) in job.stdout
    a = load_checkpoint(resumed / "checkpoint.npz")
    assert int(a["epoch"]) == EPOCHS and int(a["step"]) == 0
    same_run(a, uninterrupted)


def test_resume_refuses_other_settings(interrupted):
    job = run_job(RESUME_N, "--out", str(interrupted[0]), "--resume", "--seed", "1", "--channels", "8")
    message = "the checkpoint was written with other settings (checkpoint, now): {'seed': (0, 1), 'channels': (16, 8)}"
    check_usage_error(job, message, "train_torch")
