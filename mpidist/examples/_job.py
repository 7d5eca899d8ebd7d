"""What both main jobs share (:mod:`mpidist.examples.train_digits`, :mod:`mpidist.examples.train_torch`):
their common options, the stop flag, and :class:`Job`, the training loop and outputs, which
each job subclasses with its collectives and model.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, NoReturn, Optional, Protocol

import numpy as np

from mpidist._launch.environment import launcher_rank
from mpidist._launch.mpi_init import early_signals
from mpidist.checkpoint import load_checkpoint, save_checkpoint
from mpidist.data import load_digits_split, load_mnist
from mpidist.run import JobExit

# Installed in this order. mpidist catches SIGUSR1 from its import on (it records one for
# StopFlag.install: MPICH's MPI_Init would swallow it), so a caught SIGTERM is what shows from
# outside (SigCgt in /proc/PID/status) that both handlers are this job's: tests/slurm/run.sh
# waits for it before it sends the time-limit warning.
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
_AUTO = ""  # --resume without a path: --out/checkpoint.npz if it exists


class Sampler(Protocol):
    """What :meth:`Job.run` uses of a job's sampler (mpidist's or torch's DistributedSampler)."""

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[int]: ...

    def set_epoch(self, epoch: int) -> None: ...


class JobParser(argparse.ArgumentParser):
    """argparse's, for the command line every rank parses alike: a usage error is printed by one
    rank (``shows``: rank 0, by the launcher's variables), and every rank exits 2 (:class:`JobExit`)."""

    shows = (launcher_rank() or (0, 1))[0] == 0

    def error(self, message: str) -> NoReturn:
        if self.shows:
            self.print_usage(sys.stderr)
            sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise JobExit(2)


class Refused(Exception):
    """A mistake in --data or --resume found once the job runs (:meth:`Job.refuse`)."""


def job_arguments(prog: str, doc: str, out: str, epochs: int, threads: str) -> JobParser:
    """The options both main jobs take (module ``prog``, its docstring ``doc``): output directory
    ``out``, data, epochs (default ``epochs``), batch size, learning rate, momentum, seed, threads
    per rank (``threads``: which library's), resume, progress bar."""
    p = JobParser(prog=f"python -m {prog}", description=doc.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path(out), help=f"output directory (default: {out})")
    p.add_argument("--data", type=Path, default=None, help="directory with MNIST IDX files (default: sklearn digits)")
    p.add_argument("--epochs", type=int, default=epochs)
    p.add_argument("--batch-size", type=int, default=16, help="samples per rank per step")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help=f"{threads} threads per rank (default: cores on the node / ranks on the node)",
    )
    p.add_argument(
        "--resume",
        nargs="?",
        const=_AUTO,
        default=None,
        metavar="CKPT",
        help="continue from checkpoint CKPT (without CKPT: OUT/checkpoint.npz, or start afresh "
        "if there is none, as a requeued job wants)",
    )
    bar = p.add_mutually_exclusive_group()
    bar.add_argument(
        "--progress",
        action="store_true",
        help="show a progress bar even when stdout is not a terminal (e.g. mpiexec in a terminal)",
    )
    bar.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar (the default when stdout is not a terminal, as in a batch job's log)",
    )
    return p


def checked_arguments(p: JobParser, argv: Optional[Sequence[str]], sizes: tuple) -> argparse.Namespace:
    """``p``'s parse of ``argv`` (``args.parser``: ``p``); exits with the usage error for a size in
    ``sizes`` (and epochs, batch size) below 1, a learning rate <= 0, or negative threads."""
    args = p.parse_args(argv)
    args.parser = p
    for name in ("epochs", "batch_size") + sizes:
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.lr <= 0:
        p.error(f"--lr must be > 0, got {args.lr}")
    if args.threads < 0:
        p.error(f"--threads must be >= 0, got {args.threads}")
    return args


class StopFlag:
    """Set by SIGTERM/SIGUSR1 on any rank; :meth:`agreed` makes all ranks see it at the same step,
    together with whether any rank's loss was not finite."""

    def __init__(self) -> None:
        self.signum = 0
        self._buf = np.zeros(2, dtype=np.int32)  # [signal number, a loss was not finite]

    def install(self) -> None:
        """Handle the stop signals from now on, and act on one that arrived after ``import
        mpidist`` and before this call (kept by mpidist: MPICH's MPI_Init would swallow a
        SIGUSR1 sent then)."""
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handler)
        early = early_signals() & set(STOP_SIGNALS)
        if early and not self.signum:
            self.signum = min(early)

    def _handler(self, signum: int, frame: Any) -> None:
        self.signum = signum

    def ignore(self) -> None:
        """Ignore further stop signals once training is over, through shutdown (else Python's
        reset to SIG_DFL lets a late SIGUSR1 kill the rank: docs/hpc.md, "Stopping,
        checkpoints and requeue", item 4)."""
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)

    def agreed(self, all_reduce: Callable[[np.ndarray, str], Any], loss_finite: bool = True) -> bool:
        """Collective: True on every rank once any rank got a stop signal or a non-finite loss.

        One 2-element int32 all_reduce(MAX) per step (``all_reduce``: the job's, see :class:`Job`):
        the non-finite flag rides in the stop signal's collective, costing no extra message.
        """
        self._buf[0] = self.signum
        self._buf[1] = not loss_finite
        all_reduce(self._buf, "MAX")
        return bool(self._buf.any())

    @property
    def diverged(self) -> bool:
        """After :meth:`agreed`: some rank's loss was not finite in the step just agreed on."""
        return bool(self._buf[1])

    @property
    def name(self) -> str:
        return signal.Signals(int(self._buf[0])).name if self._buf[0] else "no signal"


def save_plot(path: Path, history: list[dict]) -> None:
    """Loss and test accuracy per completed epoch; a divergence record (see :meth:`Job.diverged`)
    is drawn as a red line where training stopped."""
    import matplotlib  # noqa: PLC0415  (rank 0 only)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    done = [h for h in history if "diverged" not in h]
    epochs = [h["epoch"] for h in done]
    fig, ax1 = plt.subplots(figsize=(7, 4))
    ax1.plot(epochs, [h["loss"] for h in done], "o-", color="tab:blue", label="train loss")
    ax1.set_xlabel("epoch")
    ax1.set_ylabel("train loss", color="tab:blue")
    ax2 = ax1.twinx()
    ax2.plot(epochs, [h["test_accuracy"] for h in done], "s-", color="tab:green", label="test accuracy")
    ax2.set_ylabel("test accuracy", color="tab:green")
    ax2.set_ylim(0, 1)
    for h in history:
        if "diverged" in h:
            where = h["epoch"] - 1 + h["step"] / h["steps_per_epoch"]
            finite = [
                (h["epoch"] - 1 + s / h["steps_per_epoch"], loss)
                for s, loss in h["rank0_step_losses"]
                if loss is not None
            ]
            if finite:
                ax1.plot(*zip(*finite), ".", color="tab:blue", label="rank 0's step losses")
                values = [loss for _, loss in finite] + [d["loss"] for d in done]
                if max(values) > 100 * max(min(values), 1e-12):
                    ax1.set_yscale("log")  # a blow-up spans many decades
            ax1.axvline(where, color="tab:red")
            ax1.text(
                where,
                0.5,
                f" {h['diverged']}",
                color="tab:red",
                rotation=90,
                va="center",
                transform=ax1.get_xaxis_transform(),
            )
            ax1.set_xlim(0, max(epochs + [where]) + 0.5)
    fig.suptitle(f"mpidist DDP on {history[0]['dataset']}, {history[0]['world_size']} ranks")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _json_bytes(obj: Any) -> np.ndarray:
    return np.frombuffer(json.dumps(obj).encode(), dtype=np.uint8)


def _from_json_bytes(arr: np.ndarray) -> Any:
    return json.loads(arr.tobytes().decode())


def _same_bits(a: np.ndarray, b: Any) -> bool:
    """Bitwise equality (a NaN equals the same NaN, 0.0 differs from -0.0): the checkpoint must
    hold exactly this rank's state."""
    b = np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def check_checkpoint(path: Path, state: dict[str, np.ndarray], rank: int, world: int) -> None:
    """Read ``path`` back and check it bitwise against this rank's ``state`` (all but the
    history, whose timings are rank 0's)."""
    loaded = load_checkpoint(path)
    differ = sorted(set(loaded) ^ set(state)) or [
        k for k, v in state.items() if k != "history" and not _same_bits(loaded[k], v)
    ]
    if differ:
        raise RuntimeError(
            f"[rank {rank}/{world}] checkpoint {path} does not match this rank's state: {differ} "
            f"differ (the model differs between ranks, or the file was changed)"
        )


def resume_path(args: argparse.Namespace) -> Optional[Path]:
    """The checkpoint to resume from, or None to start afresh."""
    if args.resume is None:
        return None
    if args.resume == _AUTO:
        path = args.out / "checkpoint.npz"
        return path if path.exists() else None
    path = Path(args.resume)
    if not path.exists():
        raise Refused(f"--resume {path}: no such checkpoint")
    return path


def terminal_columns() -> int:
    """The width of the terminal stdout is, or 0 when it is none, or one of no width: Open MPI's
    mpirun gives each rank's stdout a pseudo-terminal of 0 columns, wherever its own output goes."""
    try:
        return os.get_terminal_size(sys.stdout.fileno()).columns if sys.stdout.isatty() else 0
    except (OSError, ValueError):  # no descriptor (a replaced sys.stdout), or no size
        return 0


def progress_bar(args: argparse.Namespace, total: int, initial: int) -> Any:
    """Rank 0's tqdm bar on stdout, or None: shown with --progress, or when stdout is a terminal
    and --no-progress is not given (a batch job's log, or mpiexec's pipes, get no bar)."""
    columns = terminal_columns()
    if args.no_progress or not (args.progress or columns):
        return None
    from tqdm import tqdm  # noqa: PLC0415

    # on no terminal, or one of no size (Open MPI's), tqdm sizes itself to 0 rows and shows nothing
    size: dict[str, Any] = {"dynamic_ncols": True} if columns else {"ncols": 80, "nrows": 24}
    return tqdm(total=total, initial=initial, unit="step", file=sys.stdout, **size)


class Job:
    """A main job: :meth:`run` is the training both jobs share; a subclass gives its own parts.

    The subclass's ``__init__`` calls this one (the data, ``n_classes``, the config, its own
    settings ``own`` among the common ones, and the checks of --data and --resume: :meth:`refuse`),
    builds ``model`` and ``optimizer``, sets ``progress = self.resume()`` before its DDP takes
    rank 0's parameters, and a ``sampler``. It sets ``name`` (its module's, for the divergence
    message) and ``resume_keys`` (the config a resumed run must keep; --epochs may grow), and
    defines collectives on numpy arrays, in place: ``all_reduce(arr, op="SUM")`` (``op``: a
    ReduceOp name), ``all_gather(out, arr)``, ``barrier()``, ``destroy()`` (of the process
    group); ``train_step(idx)`` (one optimizer step on training samples ``idx``; this rank's
    loss), ``count_right(x, y)`` (samples of ``x`` the model classifies as ``y``),
    ``model_state()`` (the checkpoint's ``model.<name>`` and ``optimizer.<name>`` arrays),
    ``load_model_state(ckpt)``, ``banner(steps)`` (rank 0's first line).
    """

    name = ""
    resume_keys: tuple[str, ...] = ()
    # Loaded as numpy arrays; a subclass may replace them by its framework's (TorchJob: tensors).
    x_train: Any
    y_train: Any
    x_test: Any
    y_test: Any
    # Set by the subclass's ``__init__``.
    progress: tuple[Optional[Path], int, int, np.ndarray, list[dict]]
    sampler: Sampler

    if TYPE_CHECKING:  # defined by each subclass (see above); no defaults at run time

        def all_reduce(self, arr: np.ndarray, op: str = "SUM") -> object: ...

        def all_gather(self, out: np.ndarray, arr: np.ndarray, /) -> object: ...

        def barrier(self) -> object: ...

        def destroy(self) -> object: ...

        def train_step(self, idx: np.ndarray) -> Any: ...

        def count_right(self, x: Any, y: Any) -> int: ...

        def model_state(self) -> dict[str, np.ndarray]: ...

        def load_model_state(self, ckpt: dict[str, np.ndarray]) -> None: ...

        def banner(self, steps: int) -> str: ...

    def __init__(self, args: argparse.Namespace, rank: int, world: int, **own: Any) -> None:
        self.args, self.rank, self.world = args, rank, world
        self.dataset = "sklearn digits" if args.data is None else f"MNIST ({args.data})"
        self.config = {
            "dataset": self.dataset,
            "seed": args.seed,
            "batch_size": args.batch_size,
            "lr": args.lr,
            "momentum": args.momentum,
            **own,
            "world_size": world,
        }
        try:
            data = load_digits_split(seed=args.seed) if args.data is None else load_mnist(args.data)
            self.checkpoint = self.checked_checkpoint()
            self.refuse("")
        except (FileNotFoundError, Refused) as exc:  # FileNotFoundError: load_mnist's, naming --data
            self.refuse(str(exc))
        self.x_train, self.y_train, self.x_test, self.y_test = data
        self.n_classes = int(max(self.y_train.max(), self.y_test.max())) + 1

    def refuse(self, error: str) -> None:
        """Collective: exit 2 on every rank (:class:`JobParser`'s usage error, printed by the first
        rank with one) if this rank's ``error`` or another rank's is not empty."""
        first = np.array([self.rank if error else self.world, bool(error)])  # MIN: [first rank, all ranks]
        self.all_reduce(first, "MIN")
        if first[0] < self.world:
            self.destroy()
            self.args.parser.shows = first[0] == self.rank
            self.args.parser.error(error if first[1] else f"[rank {self.rank}/{self.world}] {error}")

    def checked_checkpoint(self) -> tuple[Optional[Path], dict[str, np.ndarray]]:
        """--resume's checkpoint and its arrays, or (None, {}).

        Raises:
            Refused: it does not exist, its config differs in one of ``resume_keys``, or it
                stopped mid-epoch on a different number of ranks.
        """
        path = resume_path(self.args)
        if path is None:
            return None, {}
        ckpt = load_checkpoint(path)
        saved = _from_json_bytes(ckpt["config"])
        differ = {k: (saved.get(k), self.config[k]) for k in self.resume_keys if saved.get(k) != self.config[k]}
        if differ:
            raise Refused(
                f"--resume {path}: the checkpoint was written with other settings (checkpoint, now): {differ}"
            )
        step, ranks = int(ckpt["step"]), len(ckpt["loss_totals"])
        if step and ranks != self.world:
            raise Refused(
                f"--resume {path}: the checkpoint stopped in the middle of epoch {int(ckpt['epoch']) + 1} on "
                f"{ranks} ranks; resume it on {ranks} ranks"
            )
        return path, ckpt

    def resume(self) -> tuple[Optional[Path], int, int, np.ndarray, list[dict]]:
        """(checkpoint, epoch, step, this rank's loss totals, history) to start from: --resume's
        checkpoint, loaded into the model and optimizer, or (None, 0, 0, zeros, [])."""
        path, ckpt = self.checkpoint
        if path is None:
            return None, 0, 0, np.zeros(2), []
        self.load_model_state(ckpt)
        epoch, step, totals = int(ckpt["epoch"]), int(ckpt["step"]), ckpt["loss_totals"]
        return path, epoch, step, totals[self.rank].copy() if step else np.zeros(2), _from_json_bytes(ckpt["history"])

    def evaluate(self) -> float:
        """Accuracy over the whole test set: each rank scores rank::world, then one all_reduce."""
        xs, ys = self.x_test[self.rank :: self.world], self.y_test[self.rank :: self.world]
        counts = np.array([self.count_right(xs, ys) if len(ys) else 0, len(ys)], dtype=np.int64)
        self.all_reduce(counts)
        return float(counts[0] / counts[1])

    def train_steps(
        self, order: np.ndarray, step: int, steps: int, totals: np.ndarray, stop: StopFlag, bar: Any, losses: list
    ) -> tuple[int, bool]:
        """Run steps ``step..steps-1`` of an epoch, adding (loss * samples, samples) to ``totals`` and
        (step number from 1, this rank's loss) to ``losses``.

        Returns (steps done, stopped): after each step every rank learns whether any rank got a
        stop signal or a non-finite loss (``stop.diverged``), so all of them stop after the same step.
        """
        batch = self.args.batch_size
        while step < steps:
            idx = order[step * batch : (step + 1) * batch]
            loss = self.train_step(idx)
            totals += (loss * len(idx), len(idx))
            step += 1
            losses.append((step, float(loss)))
            if bar is not None:
                bar.update()
            if stop.agreed(self.all_reduce, math.isfinite(loss)):
                return step, True
        return step, False

    def checkpoint_state(self, epoch: int, step: int, totals: np.ndarray, history: list[dict]) -> dict[str, np.ndarray]:
        """Everything a resumed run needs, as named arrays (history and config as JSON bytes).

        ``epoch``: epochs completed; ``step``: steps completed in the next epoch; ``loss_totals``:
        every rank's (summed loss * samples, samples) of that epoch so far, shape (world, 2).
        """
        return {
            **self.model_state(),
            "epoch": np.array(epoch),
            "step": np.array(step),
            "loss_totals": totals,
            "history": _json_bytes(history),
            "config": _json_bytes(self.config),
        }

    def check_calls(self) -> None:
        """Collective: compare the collectives every rank made so far (the job's group:
        :func:`mpidist.check_collectives`); raises the mismatch ValueError on every rank."""

    def write_outputs(self, state: Optional[dict[str, np.ndarray]], history: list[dict]) -> Path:
        """Collective: checkpoint (none if ``state`` is None: rank 0 writes it atomically, then every
        rank reads it back and checks it, :func:`check_checkpoint`); rank 0 also writes
        metrics.json and the plot."""
        out = self.args.out
        out.mkdir(parents=True, exist_ok=True)
        ckpt = out / "checkpoint.npz"
        if state is not None:
            self.check_calls()  # never save the state of a run whose ranks made different calls
            if self.rank == 0:
                save_checkpoint(ckpt, state)
            self.barrier()
            check_checkpoint(ckpt, state, self.rank, self.world)
        if self.rank == 0:
            (out / "metrics.json").write_text(json.dumps(history, indent=1))
            if history:
                save_plot(out / "training.png", history)
        self.barrier()  # the outputs are complete when any rank goes on (or exits)
        return ckpt

    def run(self, stop: StopFlag) -> int:
        """Collective: train from ``self.progress`` to --epochs, or until ``stop`` or a
        non-finite loss; write the outputs. The job's exit code (1: the loss went non-finite)."""
        args, rank, world = self.args, self.rank, self.world
        source, epoch, step, totals, history = self.progress
        steps = -(-len(self.sampler) // args.batch_size)
        bar = None
        if rank == 0:
            print(self.banner(steps), flush=True)
            if source is not None:
                print(f"resumed from {source}: {epoch} epochs and {step}/{steps} steps done", flush=True)
            bar = progress_bar(args, steps * args.epochs, min(steps * epoch + step, steps * args.epochs))

        stopped = False
        while epoch < args.epochs and not stopped:
            self.sampler.set_epoch(epoch)
            order = np.fromiter(self.sampler, dtype=np.int64)
            step_losses: list[tuple[int, float]]
            resumed_samples, start, step_losses = totals[1], time.perf_counter(), []
            with np.errstate(over="ignore", invalid="ignore", divide="ignore"):  # a diverging run: reported below
                step, stopped = self.train_steps(order, step, steps, totals, stop, bar, step_losses)
            if step < steps or stop.diverged:  # stopped mid-epoch: the checkpoint keeps every rank's partial sums
                break
            summed = np.array([totals[0], totals[1], totals[1] - resumed_samples])  # the last: samples run now
            self.all_reduce(summed)
            elapsed = time.perf_counter() - start
            accuracy = self.evaluate()
            history.append(
                {
                    "epoch": epoch + 1,
                    "loss": float(summed[0] / summed[1]),
                    "test_accuracy": accuracy,
                    "samples_per_s": float(summed[2] / elapsed),
                    "dataset": self.dataset,
                    "world_size": world,
                }
            )
            if rank == 0:
                line = (
                    f"epoch {epoch + 1:3d}/{args.epochs}  loss {history[-1]['loss']:.4f}  "
                    f"test acc {accuracy:.4f}  {history[-1]['samples_per_s']:,.0f} samples/s"
                )
                (bar.write(line) if bar is not None else print(line, flush=True))
            epoch, step, totals = epoch + 1, 0, np.zeros(2)
        if bar is not None:
            bar.close()
        stop.ignore()  # the ranks agreed for the last time: a late signal must not kill a rank at exit

        if stop.diverged:
            self.diverged(epoch, step, steps, step_losses, history)
            return 1
        every = np.zeros((world, 2))
        if step:
            self.all_gather(every, totals)
        ckpt = self.write_outputs(self.checkpoint_state(epoch, step, every, history), history)
        if rank == 0:
            if stopped:
                print(
                    f"stopped by {stop.name} after {epoch} epochs and {step}/{steps} steps; wrote {ckpt}; "
                    f"continue with --resume",
                    flush=True,
                )
            else:
                final = f"final test accuracy {history[-1]['test_accuracy']:.4f}; " if history else ""
                print(f"{final}wrote {ckpt}, {args.out / 'metrics.json'}, {args.out / 'training.png'}", flush=True)
        return 0

    def diverged(self, epoch: int, step: int, steps: int, step_losses: list, history: list[dict]) -> None:
        """Collective end of a run whose loss went non-finite on some rank in step ``step`` (1-based)
        of epoch ``epoch + 1``: metrics.json of what ran, whose last record marks it (valid JSON:
        non-finite losses are null; ``step_losses``: this rank's (step, loss) in that epoch), the
        plot, and no checkpoint (the caller then exits with code 1)."""
        record = {
            "epoch": epoch + 1,
            "step": step,
            "steps_per_epoch": steps,
            "loss": None,
            "test_accuracy": None,
            "diverged": f"loss is not finite at epoch {epoch + 1} step {step}",
            "rank0_step_losses": [[s, loss if math.isfinite(loss) else None] for s, loss in step_losses],
            "dataset": self.dataset,
            "world_size": self.world,
        }
        self.write_outputs(None, history + [record])
        if self.rank == 0:
            out = self.args.out
            print(
                f"{self.name}: {record['diverged']} (--lr {self.args.lr}: try a smaller one); stopped every rank "
                f"there. Wrote {out / 'metrics.json'} and {out / 'training.png'}; no checkpoint written "
                f"(a non-finite model is not worth resuming).",
                file=sys.stderr,
                flush=True,
            )
