"""The main job end to end, launched the way users launch it: mpiexec -n N python -m ..."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import STOP_SIGNAL, launcher_free_env

from mpidist.checkpoint import load_checkpoint, save_checkpoint
from mpidist.data import write_idx

pytestmark = pytest.mark.launches  # starts MPI jobs or processes of its own: make test-mpis runs it on every MPI

MPIEXEC = str(Path(sys.executable).with_name("mpiexec"))
JOB_DEFAULTS = [sys.executable, "-m", "mpidist", "-m", "mpidist.examples.train_digits"]
JOB = [*JOB_DEFAULTS, "--no-progress"]


def run_job(n: int, *args: str, timeout: float = 300, job: list = JOB) -> subprocess.CompletedProcess:
    return subprocess.run(
        [MPIEXEC, "-n", str(n), *job, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=launcher_free_env(OMP_NUM_THREADS="1"),
    )


def check_usage_error(job: subprocess.CompletedProcess, message: str, prog: str = "train_digits") -> None:
    """A mistake in the command line, also one found after init_process_group (--data, --resume):
    exit 2 on every rank, argparse's usage and one-line error once per job (so on one rank), and
    no traceback, abort or flight recorder."""
    assert job.returncode == 2, job.stdout + job.stderr
    errors = [line for line in job.stderr.splitlines() if ": error: " in line]
    assert len(errors) == 1 and errors[0].startswith(f"python -m mpidist.examples.{prog}: error: "), job.stderr
    assert message in errors[0] and job.stderr.count("usage: ") == 1, job.stderr
    for noise in ("Traceback", "MPI_Abort", "flight recorder"):
        assert noise not in job.stdout + job.stderr, job.stdout + job.stderr


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
            x[i, r : r + 7, c : c + 7] = 255
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


# --- output through pipes (a batch job's log): no progress bar mixed into the epoch lines ---


def test_piped_output_gets_epoch_lines_and_no_progress_bar(tmp_path):
    """mpiexec passes the ranks' output through pipes, as a batch job's log: by default the
    job shows no bar there (the bar used to go to stderr while the epoch lines went to stdout,
    so a merged log had "...step/s]epoch   1/2" lines)."""
    out = run_job(2, "--out", str(tmp_path), "--epochs", "2", job=JOB_DEFAULTS)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "\r" not in out.stdout + out.stderr and "step/s" not in out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert [line[:11] for line in lines if "samples/s" in line] == ["epoch   1/2", "epoch   2/2"]


def test_a_forced_progress_bar_shares_stdout_with_the_epoch_lines(tmp_path):
    """--progress shows the bar on stdout, the epoch lines' stream, and writes the epoch
    lines through it: each starts on a line of its own (after the bar is cleared with
    carriage returns), never after the bar's text."""
    out = run_job(2, "--out", str(tmp_path), "--epochs", "2", "--progress", job=JOB_DEFAULTS)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "step/s" in out.stdout and "step/s" not in out.stderr
    segments = [seg for seg in re.split(r"[\r\n]", out.stdout) if "samples/s" in seg]
    assert [seg[:11] for seg in segments] == ["epoch   1/2", "epoch   2/2"], segments
    out = subprocess.run([*JOB, "--progress"], capture_output=True, text=True, timeout=60, env=launcher_free_env())
    assert out.returncode == 2 and "--progress: not allowed with argument --no-progress" in out.stderr


# --- divergence: every rank stops at the first non-finite loss, with a clear message ---


def test_a_diverging_run_stops_at_the_first_non_finite_loss_on_every_rank(tmp_path):
    """--lr 1e4 drives the loss to inf/NaN within a few steps. The ranks agree on it in the
    per-step stop all_reduce, stop after the same step, write metrics.json and training.png of
    what ran and no checkpoint, and the job fails with "loss is not finite at epoch E step S"
    (it used to train on in NaN and end with "checkpoint ... does not match this rank's state")."""
    out = run_job(2, "--out", str(tmp_path), "--lr", "1e4", "--epochs", "3", timeout=120)
    assert out.returncode != 0, out.stdout + out.stderr
    found = re.search(
        r"train_digits: loss is not finite at epoch (\d+) step (\d+) \(--lr 10000.0: try a smaller "
        r"one\); stopped every rank there",
        out.stderr,
    )
    assert found, out.stdout + out.stderr
    assert "does not match" not in out.stdout + out.stderr and "Traceback" not in out.stderr
    assert "RuntimeWarning" not in out.stderr
    epoch, step = int(found.group(1)), int(found.group(2))
    history = json.loads((tmp_path / "metrics.json").read_text())  # valid JSON: no NaN
    last = history[-1]
    assert (last["epoch"], last["step"], last["world_size"]) == (epoch, step, 2)
    assert last["diverged"] == f"loss is not finite at epoch {epoch} step {step}"
    assert last["rank0_step_losses"][-1][0] == step and len(history) == epoch
    assert (tmp_path / "training.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "checkpoint.npz").exists()


def test_bad_flags_fail_fast(tmp_path):
    check_usage_error(run_job(2, "--epochs", "0", timeout=60), "--epochs must be >= 1, got 0")
    missing = tmp_path / "missing"
    check_usage_error(run_job(2, "--data", str(missing), timeout=60), f"MNIST file not found in {missing}: looked for")


def test_a_mistake_only_one_rank_finds_fails_every_rank_with_its_line(tmp_path):
    """A --data that only rank 1 cannot read (a node without the files): the ranks agree on it in
    one all_reduce, rank 1 prints its error, prefixed [rank 1/3], and every rank exits 2."""
    code = (
        "import sys, mpidist.examples._job as J\n"
        "from mpidist.examples.train_digits import main\n"
        "def load(root):\n"
        "    if J.launcher_rank()[0] == 1:\n"
        "        raise FileNotFoundError(f'MNIST file not found in {root}: rank 1 only')\n"
        "    return J.load_digits_split()\n"
        "J.load_mnist = load\n"
        f"sys.exit(main(['--data', {str(tmp_path)!r}, '--out', {str(tmp_path)!r}, '--no-progress']))\n"
    )
    job = run_job(3, "-c", code, timeout=60, job=[sys.executable, "-m", "mpidist"])
    check_usage_error(job, f"error: [rank 1/3] MNIST file not found in {tmp_path}: rank 1 only")


# --- SIGTERM (SIGUSR1 on Open MPI) -> checkpoint at a step boundary on every rank; --resume -> bitwise the same run ---

RESUME_N = 3
STEPS = 30  # steps per epoch at RESUME_N ranks: ceil(ceil(1437 / 3) / 16)
# The stop is asked for after epoch 3, as soon as mpiexec passes the line on: 57 epochs (about
# 2 s here) of margin for that, since the job ignores the signal once training is over.
EPOCHS = 60


def start_job(n: int, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [MPIEXEC, "-n", str(n), *JOB, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=launcher_free_env(OMP_NUM_THREADS="1"),
    )


def stop_after_epoch(
    job: subprocess.Popen, epoch: int, kill, out_dir: Path, signum: int, timeout: float = 120
) -> tuple[str, str]:
    """Read the job's stdout until epoch ``epoch`` is reported, then send the stop signal
    with ``kill(job)`` while the ranks are paused, and wait for the end.

    The ranks (found by ``out_dir`` on their command line) get SIGSTOP first and SIGCONT
    once at least one of them has ``signum`` pending: so the signal reaches them
    mid-training however long mpiexec takes to pass it on, instead of racing the job's end
    (20 epochs can take 0.6 s). They must still be training when the epoch line has come
    through mpiexec (EPOCHS leaves the margin); if not, this fails saying so."""
    lines = []
    try:
        for line in job.stdout:
            lines.append(line)
            if line.startswith(f"epoch {epoch:3d}/"):
                pids = rank_pids(out_dir)
                assert len(pids) == RESUME_N, f"found ranks {pids}"
                for pid in pids:
                    os.kill(pid, signal.SIGSTOP)
                try:
                    # SIGSTOP takes effect asynchronously: a signal that lands before the stop
                    # does would be taken (no longer pending) by a thread still running
                    deadline = time.monotonic() + 30
                    while not all(stopped(pid) for pid in pids):
                        assert time.monotonic() < deadline, f"ranks {pids} did not stop in 30 s"
                        time.sleep(0.005)
                    assert all(signal_in(pid, signum, "SigCgt") for pid in pids), (
                        f"the ranks ended training before epoch {epoch} was read from mpiexec"
                    )
                    kill(job)
                    deadline = time.monotonic() + 30
                    # pending, or taken already: GNU timeout sends SIGCONT to its process group
                    # after the signal it passes on, and Intel MPI's ranks are in that group
                    while not any(signal_in(pid, signum, "SigPnd", "ShdPnd") or not stopped(pid) for pid in pids):
                        assert time.monotonic() < deadline, f"signal {signum} did not reach ranks {pids} in 30 s"
                        time.sleep(0.01)
                finally:
                    for pid in pids:
                        os.kill(pid, signal.SIGCONT)
                break
        out, err = job.communicate(timeout=timeout)
    except BaseException:
        job.kill()
        job.communicate()
        raise
    return "".join(lines) + out, err


def stopped(pid: int) -> bool:
    """True once every thread of process ``pid`` is stopped (state T in /proc/PID/task/*/status)."""
    try:
        states = [
            line.split()[1]
            for task in Path(f"/proc/{pid}/task").iterdir()
            for line in (task / "status").read_text().splitlines()
            if line.startswith("State:")
        ]
    except OSError:
        return False
    return bool(states) and all(state == "T" for state in states)


def signal_in(pid: int, signum: int, *masks: str) -> bool:
    """True if process ``pid`` has signal ``signum`` in one of ``masks`` of /proc/PID/status
    (SigCgt: caught; SigIgn: ignored; SigPnd, ShdPnd: pending)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    values = [line.split()[1] for line in status.splitlines() if line.split(":")[0] in masks]
    return any(int(m, 16) >> (signum - 1) & 1 for m in values)


def rank_pids(out_dir: Path) -> list[int]:
    """PIDs of the Python ranks whose command line names ``out_dir`` (not mpiexec itself)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if proc.name.isdigit() and argv[0] == sys.executable.encode() and str(out_dir).encode() in argv:
            pids.append(int(proc.name))
    return pids


def same_run(a: dict, b: dict) -> None:
    """Two checkpoints of the same run: every array bitwise equal; history equal but for timings."""
    assert set(a) == set(b)
    differ = [k for k in a if k != "history" and not (a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]))]
    assert not differ, differ
    untimed = [
        [{k: v for k, v in h.items() if k != "samples_per_s"} for h in json.loads(c["history"].tobytes())]
        for c in (a, b)
    ]
    assert untimed[0] == untimed[1]


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
    job = start_job(RESUME_N, "--out", str(out), "--epochs", str(EPOCHS))
    stdout, stderr = stop_after_epoch(job, 3, lambda j: j.send_signal(STOP_SIGNAL), out, STOP_SIGNAL)
    return out, job.returncode, stdout, stderr


def check_stopped(out: Path, rc: int, stdout: str, stderr: str, n: int, signame: str) -> dict:
    assert rc == 0, stdout + stderr
    assert f"stopped by {signame} after" in stdout and "continue with --resume" in stdout, stdout + stderr
    assert "Traceback" not in stderr, stderr
    assert "flight recorder" not in stderr, stderr  # a clean stop writes none
    ckpt = load_checkpoint(out / "checkpoint.npz")
    epoch, step = int(ckpt["epoch"]), int(ckpt["step"])
    assert 3 <= epoch < EPOCHS and 0 <= step < STEPS, (epoch, step)
    assert f"after {epoch} epochs and {step}/{STEPS} steps" in stdout
    assert ckpt["loss_totals"].shape == (n, 2) and ckpt["loss_totals"].dtype == np.float64
    assert (ckpt["loss_totals"][:, 1] == (16 * step if step else 0)).all(), ckpt["loss_totals"]
    history = json.loads((out / "metrics.json").read_text())
    assert [h["epoch"] for h in history] == list(range(1, epoch + 1))
    assert json.loads(ckpt["history"].tobytes()) == history
    assert json.loads(ckpt["config"].tobytes())["world_size"] == n
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint.npz", "metrics.json", "training.png"]
    return ckpt


def test_stop_signal_to_mpiexec_checkpoints_and_exits_cleanly(interrupted):
    check_stopped(*interrupted, n=RESUME_N, signame=STOP_SIGNAL.name)


def test_stop_signal_to_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    """Only one rank gets the signal (SIGUSR1, the other stop signal): the per-step
    all_reduce(MAX) makes every rank stop after the same step, and the job exits cleanly."""

    def kill_one(job):
        pids = rank_pids(tmp_path)
        assert len(pids) == RESUME_N, pids
        os.kill(max(pids), signal.SIGUSR1)

    job = start_job(RESUME_N, "--out", str(tmp_path), "--epochs", str(EPOCHS))
    stdout, stderr = stop_after_epoch(job, 3, kill_one, tmp_path, signal.SIGUSR1)
    check_stopped(tmp_path, job.returncode, stdout, stderr, n=RESUME_N, signame="SIGUSR1")


def test_resume_ends_bitwise_equal_to_an_uninterrupted_run(interrupted, uninterrupted, tmp_path):
    out = tmp_path / "resumed"
    shutil.copytree(interrupted[0], out)
    stopped = load_checkpoint(out / "checkpoint.npz")
    job = run_job(RESUME_N, "--out", str(out), "--epochs", str(EPOCHS), "--resume")
    assert job.returncode == 0, job.stdout + job.stderr
    assert (
        f"resumed from {out / 'checkpoint.npz'}: {int(stopped['epoch'])} epochs and "
        f"{int(stopped['step'])}/{STEPS} steps done"
    ) in job.stdout
    assert "final test accuracy" in job.stdout
    resumed = load_checkpoint(out / "checkpoint.npz")
    assert int(resumed["epoch"]) == EPOCHS and int(resumed["step"]) == 0
    same_run(resumed, uninterrupted)
    assert json.loads((out / "metrics.json").read_text()) == json.loads(resumed["history"].tobytes())


def test_resume_refuses_other_settings_or_world_size(interrupted, tmp_path):
    out = tmp_path / "resumed"
    shutil.copytree(interrupted[0], out)
    check_usage_error(
        run_job(RESUME_N, "--out", str(out), "--resume", "--lr", "0.1", timeout=60),
        f"--resume {out / 'checkpoint.npz'}: the checkpoint was written with other settings (checkpoint, now): "
        "{'lr': (0.05, 0.1)}",
    )
    job = run_job(RESUME_N, "--out", str(out), "--resume", "--seed", "1", "--lr", "0.1", timeout=60)
    check_usage_error(job, "(checkpoint, now): {'seed': (0, 1), 'lr': (0.05, 0.1)}")
    ckpt = load_checkpoint(out / "checkpoint.npz")
    ckpt["step"] = np.array(max(1, int(ckpt["step"])))  # mid-epoch, even if the stop fell on a boundary
    save_checkpoint(out / "checkpoint.npz", ckpt)
    check_usage_error(
        run_job(2, "--out", str(out), "--resume", timeout=60),
        f"the checkpoint stopped in the middle of epoch {int(ckpt['epoch']) + 1} on {RESUME_N} ranks; "
        f"resume it on {RESUME_N} ranks",
    )


def test_resume_without_checkpoint_starts_afresh_but_a_named_one_must_exist(tmp_path):
    job = run_job(2, "--out", str(tmp_path / "fresh"), "--epochs", "1", "--resume")
    assert job.returncode == 0, job.stdout + job.stderr
    assert "resumed from" not in job.stdout
    assert int(load_checkpoint(tmp_path / "fresh" / "checkpoint.npz")["epoch"]) == 1
    job = run_job(2, "--out", str(tmp_path), "--resume", str(tmp_path / "nope.npz"), timeout=60)
    check_usage_error(job, f"--resume {tmp_path / 'nope.npz'}: no such checkpoint")


def test_a_stop_signal_after_training_does_not_kill_a_rank(tmp_path):
    """A stop signal racing the job's end (a time-limit warning, ``scancel``) must not turn a
    finished job into a failed one: Python resets handled signals to SIG_DFL at shutdown, before
    MPI_Finalize, and SIGUSR1's default action kills. Once training is over the job ignores them."""
    code = (
        "import os, signal, sys\n"
        "from mpidist.examples.train_digits import STOP_SIGNALS, main\n"
        f"rc = main(['--out', {str(tmp_path)!r}, '--epochs', '1', '--no-progress'])\n"
        "assert all(signal.getsignal(s) is signal.SIG_IGN for s in STOP_SIGNALS), "
        "[signal.getsignal(s) for s in STOP_SIGNALS]\n"
        "for s in STOP_SIGNALS:\n"
        "    os.kill(os.getpid(), s)\n"
        "print('survived', flush=True)\n"
        "sys.exit(rc)\n"
    )
    job = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env=launcher_free_env(OMP_NUM_THREADS="1"),
    )
    assert job.returncode == 0, job.stdout + job.stderr
    assert "final test accuracy" in job.stdout and "survived" in job.stdout, job.stdout + job.stderr
