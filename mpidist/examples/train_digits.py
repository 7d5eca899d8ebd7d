"""The main job: data-parallel training of an MLP on handwritten digits.

Run under MPI, for example ``mpiexec -n 4 python -m mpidist.examples.train_digits --out out``.
By default it trains on scikit-learn's digits (1,797 8x8 images, shipped with
scikit-learn); ``--data DIR`` reads the four standard MNIST IDX files instead. Each
rank trains on its DistributedSampler shard with a per-rank batch; gradients are
averaged by DistributedDataParallel. Rank 0 prints a line per epoch and writes, under
``--out``: ``checkpoint.npz`` (atomic, no pickle; every rank loads it back and checks
it), ``metrics.json`` and ``training.png`` (loss and test accuracy per epoch). A progress
bar is shown when rank 0's stdout is a terminal (a plain ``python -m`` run), or with
``--progress``; never in a log (under ``mpiexec`` the ranks' output is a pipe), where it would
interleave with the epoch lines. When shown it writes to stdout, the epoch lines' stream,
and the epoch lines go through it (``tqdm.write``), so the two never mix.

The ranks check after each step, in the same all_reduce as the stop flag below, whether
any rank's loss is not finite (a diverging run, e.g. ``--lr 1e4``): then every rank stops
after that step, rank 0 reports "loss is not finite at epoch E step S", writes
``metrics.json`` and ``training.png`` of what ran (the last record marks the divergence),
leaves the checkpoint alone (a non-finite model is not worth resuming; an earlier
checkpoint stays as it was) and the job exits with code 1.

SIGTERM or SIGUSR1 (a Slurm time limit, preemption, ``scancel --signal=TERM``,
``kill`` on mpiexec) makes every rank stop at the same step boundary: the ranks agree
with a one-element all_reduce(MAX) after each step, rank 0 writes the checkpoint, and
the job exits with code 0. ``--resume`` continues from that checkpoint (model,
momentum buffers, epoch, step within the epoch, per-rank loss sums, history); the
sampler's shuffle is a function of (seed, epoch), so the resumed run ends with
parameters bitwise identical to an uninterrupted one on the same number of ranks.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np
from threadpoolctl import threadpool_limits

import mpidist
from mpidist import ReduceOp
from mpidist.checkpoint import load_checkpoint, save_checkpoint
from mpidist.data import DistributedSampler, load_digits_split, load_mnist
from mpidist.nn import CrossEntropyLoss, Linear, ReLU, Sequential
from mpidist.optim import SGD
from mpidist.parallel import DistributedDataParallel

# Installed in this order. MPICH catches SIGUSR1 from MPI_Init on (at import), so a caught
# SIGTERM is what shows from outside (SigCgt in /proc/PID/status) that both handlers are this
# job's: tests/slurm/run.sh waits for it before it sends the time-limit warning.
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
# A resumed run must use the same values as the checkpointed one (--epochs may grow).
RESUME_KEYS = ("dataset", "seed", "batch_size", "lr", "momentum", "hidden")
_AUTO = ""  # --resume without a path: --out/checkpoint.npz if it exists


def job_arguments(prog: str, doc: str, out: str, epochs: int, threads: str) -> argparse.ArgumentParser:
    """The options both main jobs take (module ``prog``, its docstring ``doc``: this one and
    mpidist.examples.train_torch): output
    directory ``out``, data, epochs (default ``epochs``), batch size, learning rate, momentum,
    seed, threads per rank (``threads``: which library's), resume, progress bar."""
    p = argparse.ArgumentParser(prog=f"python -m {prog}", description=doc.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path(out), help=f"output directory (default: {out})")
    p.add_argument("--data", type=Path, default=None, help="directory with MNIST IDX files (default: sklearn digits)")
    p.add_argument("--epochs", type=int, default=epochs)
    p.add_argument("--batch-size", type=int, default=16, help="samples per rank per step")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0,
                   help=f"{threads} threads per rank (default: cores on the node / ranks on the node)")
    p.add_argument("--resume", nargs="?", const=_AUTO, default=None, metavar="CKPT",
                   help="continue from checkpoint CKPT (without CKPT: OUT/checkpoint.npz, or start afresh "
                        "if there is none, as a requeued job wants)")
    bar = p.add_mutually_exclusive_group()
    bar.add_argument("--progress", action="store_true",
                     help="show a progress bar even when stdout is not a terminal (e.g. mpiexec in a terminal)")
    bar.add_argument("--no-progress", action="store_true",
                     help="no progress bar (the default when stdout is not a terminal, as in a batch job's log)")
    return p


def checked_arguments(p: argparse.ArgumentParser, argv: Optional[Sequence[str]], sizes: tuple) -> argparse.Namespace:
    """``p``'s parse of ``argv``; exits with the usage error for a size in ``sizes`` (and
    epochs, batch size) below 1, a learning rate <= 0, or negative threads."""
    args = p.parse_args(argv)
    for name in ("epochs", "batch_size") + sizes:
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.lr <= 0:
        p.error(f"--lr must be > 0, got {args.lr}")
    if args.threads < 0:
        p.error(f"--threads must be >= 0, got {args.threads}")
    return args


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = job_arguments("mpidist.examples.train_digits", __doc__, "out/digits", 30, "BLAS")
    p.add_argument("--algorithm", choices=["mpi", "ring"], default="mpi", help="gradient all-reduce algorithm")
    p.add_argument("--hidden", type=int, default=128, help="width of the two hidden layers")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    return checked_arguments(p, argv, ("hidden",))


class StopFlag:
    """Set by SIGTERM/SIGUSR1 on any rank; :meth:`agreed` makes all ranks see it at the same step,
    together with whether any rank's loss was not finite."""

    def __init__(self) -> None:
        self.signum = 0
        self._buf = np.zeros(2, dtype=np.int32)   # [signal number, a loss was not finite]

    def install(self) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handler)

    def _handler(self, signum: int, frame: Any) -> None:
        self.signum = signum

    def ignore(self) -> None:
        """Ignore further stop signals: once training is over there is nothing left to stop.

        A stop signal can still arrive then (a time-limit warning or ``scancel`` racing the
        job's end). Python resets handled signals to SIG_DFL when the interpreter shuts
        down, before MPI_Finalize; SIGUSR1's default action kills the process, which srun
        and mpiexec report as a failed job. SIG_IGN is left in place through shutdown.
        """
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)

    def agreed(self, loss_finite: bool = True) -> bool:
        """Collective: True on every rank once any rank got a stop signal or a non-finite loss.

        One 2-element int32 all_reduce(MAX) per step, the same single collective as for the
        stop signal alone: telling every rank about a local non-finite loss costs no extra
        message (a separate finite-flag all_reduce would add one small collective per step).
        """
        self._buf[0] = self.signum
        self._buf[1] = not loss_finite
        mpidist.all_reduce(self._buf, op=ReduceOp.MAX)
        return bool(self._buf.any())

    @property
    def diverged(self) -> bool:
        """After :meth:`agreed`: some rank's loss was not finite in the step just agreed on."""
        return bool(self._buf[1])

    @property
    def name(self) -> str:
        return signal.Signals(int(self._buf[0])).name if self._buf[0] else "no signal"


def build_model(n_in: int, hidden: int, n_out: int, seed: int) -> Sequential:
    rng = np.random.default_rng(seed)
    return Sequential(Linear(n_in, hidden, rng=rng), ReLU(), Linear(hidden, hidden, rng=rng), ReLU(),
                      Linear(hidden, n_out, rng=rng))


def evaluate(model: Sequential, x: np.ndarray, y: np.ndarray, rank: int, world: int) -> float:
    """Accuracy over the whole test set: each rank scores rank::world, then one all_reduce."""
    model.eval()
    xs, ys = x[rank::world], y[rank::world]
    counts = np.array([np.sum(model(xs).argmax(axis=1) == ys) if len(ys) else 0, len(ys)], dtype=np.int64)
    model.train()
    mpidist.all_reduce(counts)
    return float(counts[0] / counts[1])


def save_plot(path: Path, history: list[dict]) -> None:
    """Loss and test accuracy per completed epoch; a divergence record (see :func:`divergence_record`)
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
            finite = [(h["epoch"] - 1 + s / h["steps_per_epoch"], loss) for s, loss in h["rank0_step_losses"]
                      if loss is not None]
            if finite:
                ax1.plot(*zip(*finite), ".", color="tab:blue", label="rank 0's step losses")
                values = [loss for _, loss in finite] + [d["loss"] for d in done]
                if max(values) > 100 * max(min(values), 1e-12):
                    ax1.set_yscale("log")   # a blow-up spans many decades
            ax1.axvline(where, color="tab:red")
            ax1.text(where, 0.5, f" {h['diverged']}", color="tab:red", rotation=90, va="center",
                     transform=ax1.get_xaxis_transform())
            ax1.set_xlim(0, max(epochs + [where]) + 0.5)
    fig.suptitle(f"mpidist DDP on {history[0]['dataset']}, {history[0]['world_size']} ranks")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _json_bytes(obj: Any) -> np.ndarray:
    return np.frombuffer(json.dumps(obj).encode(), dtype=np.uint8)


def _from_json_bytes(arr: np.ndarray) -> Any:
    return json.loads(arr.tobytes().decode())


def training_state(model: Sequential, optimizer: SGD, epoch: int, step: int, totals: np.ndarray,
                   history: list[dict], config: dict) -> dict[str, np.ndarray]:
    """Everything a resumed run needs, as named arrays (history and config as JSON bytes).

    ``epoch``: epochs completed; ``step``: steps completed in the next epoch; ``loss_totals``:
    every rank's (summed loss * samples, samples) of that epoch so far, shape (world, 2).
    """
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    state.update({f"optimizer.{k}": v for k, v in optimizer.state_dict().items()})
    state.update({"epoch": np.array(epoch), "step": np.array(step), "loss_totals": totals,
                  "history": _json_bytes(history), "config": _json_bytes(config)})
    return state


def _same_bits(a: np.ndarray, b: Any) -> bool:
    """Bitwise equality (a NaN equals the same NaN, 0.0 differs from -0.0): the checkpoint must
    hold exactly this rank's state."""
    b = np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def save_training_state(path: Path, state: dict[str, np.ndarray], rank: int, world: int,
                        barrier: Callable[[], Any] = mpidist.barrier) -> None:
    """Collective: rank 0 writes ``path`` (atomically); every rank then reads it back and checks it
    bitwise against its own state (all but the history, whose timings are rank 0's). ``barrier``:
    the job's (the torch job passes torch.distributed's)."""
    if rank == 0:
        save_checkpoint(path, state)
    barrier()
    loaded = load_checkpoint(path)
    differ = sorted(set(loaded) ^ set(state)) or [k for k, v in state.items()
                                                  if k != "history" and not _same_bits(loaded[k], v)]
    if differ:
        raise RuntimeError(f"[rank {rank}/{world}] checkpoint {path} does not match this rank's state: {differ} "
                           f"differ (the model differs between ranks, or the file was changed)")


def resume_path(args: argparse.Namespace) -> Optional[Path]:
    """The checkpoint to resume from, or None to start afresh."""
    if args.resume is None:
        return None
    if args.resume == _AUTO:
        path = args.out / "checkpoint.npz"
        return path if path.exists() else None
    path = Path(args.resume)
    if not path.exists():
        raise FileNotFoundError(f"--resume {path}: no such checkpoint")
    return path


def resumed(path: Path, config: dict, keys: Sequence[str], world: int, rank: int) -> tuple[dict, int, int,
                                                                                           np.ndarray, list[dict]]:
    """The checkpoint at ``path`` with (epoch, step, this rank's loss totals, history), for
    either main job: its config must match ``config`` in ``keys`` (the job's RESUME_KEYS).

    Raises:
        ValueError: the checkpoint's config differs in one of ``keys``, or it stopped
            mid-epoch on a different number of ranks.
    """
    ckpt = load_checkpoint(path)
    saved = _from_json_bytes(ckpt["config"])
    differ = {k: (saved.get(k), config[k]) for k in keys if saved.get(k) != config[k]}
    if differ:
        raise ValueError(f"[rank {rank}/{world}] --resume {path}: the checkpoint was written with other "
                         f"settings (checkpoint, now): {differ}")
    epoch, step, totals = int(ckpt["epoch"]), int(ckpt["step"]), ckpt["loss_totals"]
    if step and len(totals) != world:
        raise ValueError(f"[rank {rank}/{world}] --resume {path}: the checkpoint stopped in the middle of "
                         f"epoch {epoch + 1} on {len(totals)} ranks; resume it on {len(totals)} ranks")
    mine = totals[rank].copy() if step else np.zeros(2)
    return ckpt, epoch, step, mine, _from_json_bytes(ckpt["history"])


def restore(path: Path, model: Sequential, optimizer: SGD, config: dict, world: int,
            rank: int) -> tuple[int, int, np.ndarray, list[dict]]:
    """Load ``path`` into model and optimizer; return (epoch, step, this rank's loss totals,
    history). ValueError as :func:`resumed`."""
    ckpt, epoch, step, mine, history = resumed(path, config, RESUME_KEYS, world, rank)
    model.load_state_dict({k[6:]: v for k, v in ckpt.items() if k.startswith("model.")})
    optimizer.load_state_dict({k[10:]: v for k, v in ckpt.items() if k.startswith("optimizer.")})
    return epoch, step, mine, history


def write_outputs(args: argparse.Namespace, state: Optional[dict[str, np.ndarray]], history: list[dict],
                  rank: int, world: int, barrier: Callable[[], Any] = mpidist.barrier) -> Path:
    """Collective: checkpoint (checked on every rank; none if ``state`` is None); rank 0 also
    writes metrics.json and the plot. ``barrier``: the job's."""
    args.out.mkdir(parents=True, exist_ok=True)
    ckpt = args.out / "checkpoint.npz"
    if state is not None:
        save_training_state(ckpt, state, rank, world, barrier)
    if rank == 0:
        (args.out / "metrics.json").write_text(json.dumps(history, indent=1))
        if history:
            save_plot(args.out / "training.png", history)
    barrier()   # the outputs are complete when any rank goes on (or exits)
    return ckpt


def divergence_record(epoch: int, step: int, steps: int, step_losses: list, dataset: str, world: int) -> dict:
    """The metrics.json record of a run stopped by a non-finite loss in step ``step`` (1-based)
    of epoch ``epoch + 1``: valid JSON (non-finite losses are null), recognisable by its
    "diverged" message; ``step_losses``: this rank's (step, loss) in that epoch."""
    return {"epoch": epoch + 1, "step": step, "steps_per_epoch": steps, "loss": None, "test_accuracy": None,
            "diverged": f"loss is not finite at epoch {epoch + 1} step {step}",
            "rank0_step_losses": [[s, loss if math.isfinite(loss) else None] for s, loss in step_losses],
            "dataset": dataset, "world_size": world}


def load_data(args: argparse.Namespace) -> tuple[str, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(dataset name, x_train, y_train, x_test, y_test)."""
    if args.data is None:
        return ("sklearn digits", *load_digits_split(seed=args.seed))
    return (f"MNIST ({args.data})", *load_mnist(args.data))


def train_steps(ddp: DistributedDataParallel, optimizer: SGD, criterion: CrossEntropyLoss, x: np.ndarray,
                y: np.ndarray, order: np.ndarray, batch: int, step: int, steps: int, totals: np.ndarray,
                stop: StopFlag, bar: Any, losses: list) -> tuple[int, bool]:
    """Run steps ``step..steps-1`` of an epoch, adding (loss * samples, samples) to ``totals`` and
    (step number from 1, this rank's loss) to ``losses``.

    Returns (steps done, stopped): after each step every rank learns whether any rank got a
    stop signal or a non-finite loss (``stop.diverged``), so all of them stop after the same step.
    """
    while step < steps:
        idx = order[step * batch:(step + 1) * batch]
        optimizer.zero_grad()
        loss = criterion(ddp(x[idx]), y[idx])
        ddp.backward(criterion.backward())
        optimizer.step()
        totals += (loss * len(idx), len(idx))
        step += 1
        losses.append((step, float(loss)))
        if bar is not None:
            bar.update()
        if stop.agreed(math.isfinite(loss)):
            return step, True
    return step, False


def progress_bar(args: argparse.Namespace, total: int, initial: int) -> Any:
    """Rank 0's tqdm bar on stdout, or None: shown with --progress, or when stdout is a terminal
    and --no-progress is not given (a batch job's log, or mpiexec's pipes, get no bar)."""
    if args.no_progress or not (args.progress or sys.stdout.isatty()):
        return None
    from tqdm import tqdm  # noqa: PLC0415

    return tqdm(total=total, initial=initial, unit="step", file=sys.stdout, dynamic_ncols=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    stop = StopFlag()
    stop.install()  # before anything slow, so an early SIGTERM is not fatal
    mpidist.init_process_group("mpi")
    rank, world = mpidist.get_rank(), mpidist.get_world_size()
    # Ranks sharing a node must not each start a BLAS thread per core: oversubscribed,
    # spinning BLAS threads slow every rank down several times.
    threads = args.threads or max(1, (os.cpu_count() or 1) // mpidist.get_local_world_size())
    threadpool_limits(limits=threads)
    dataset, x_train, y_train, x_test, y_test = load_data(args)
    n_classes = int(max(y_train.max(), y_test.max())) + 1
    config = {"dataset": dataset, "seed": args.seed, "batch_size": args.batch_size, "lr": args.lr,
              "momentum": args.momentum, "hidden": args.hidden, "algorithm": args.algorithm,
              "world_size": world}

    model = build_model(x_train.shape[1], args.hidden, n_classes, args.seed + rank)  # rank 0's weights win
    optimizer = SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    epoch, step, totals, history = 0, 0, np.zeros(2), []
    source = resume_path(args)
    if source is not None:
        epoch, step, totals, history = restore(source, model, optimizer, config, world, rank)
    ddp = DistributedDataParallel(model, bucket_cap_mb=args.bucket_cap_mb, algorithm=args.algorithm)
    criterion = CrossEntropyLoss()
    sampler = DistributedSampler(x_train, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    steps = -(-len(sampler) // args.batch_size)

    bar = None
    if rank == 0:
        print(f"mpidist: {world} ranks, {dataset}: {len(x_train)} train / {len(x_test)} test samples, "
              f"{steps} steps/epoch of {args.batch_size} per rank, algorithm={args.algorithm}", flush=True)
        if source is not None:
            print(f"resumed from {source}: {epoch} epochs and {step}/{steps} steps done", flush=True)
        bar = progress_bar(args, steps * args.epochs, min(steps * epoch + step, steps * args.epochs))

    stopped = False
    while epoch < args.epochs and not stopped:
        sampler.set_epoch(epoch)
        order = np.fromiter(sampler, dtype=np.int64)
        resumed_samples, start, step_losses = totals[1], time.perf_counter(), []
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):  # a diverging run: reported below
            step, stopped = train_steps(ddp, optimizer, criterion, x_train, y_train, order, args.batch_size,
                                        step, steps, totals, stop, bar, step_losses)
        if step < steps or stop.diverged:  # stopped mid-epoch: the checkpoint keeps every rank's partial sums
            break
        summed = np.array([totals[0], totals[1], totals[1] - resumed_samples])  # the last: samples run now
        mpidist.all_reduce(summed)
        elapsed = time.perf_counter() - start
        accuracy = evaluate(model, x_test, y_test, rank, world)
        history.append({"epoch": epoch + 1, "loss": summed[0] / summed[1], "test_accuracy": accuracy,
                        "samples_per_s": summed[2] / elapsed, "dataset": dataset, "world_size": world})
        if rank == 0:
            line = (f"epoch {epoch + 1:3d}/{args.epochs}  loss {history[-1]['loss']:.4f}  "
                    f"test acc {accuracy:.4f}  {history[-1]['samples_per_s']:,.0f} samples/s")
            (bar.write(line) if bar is not None else print(line, flush=True))
        epoch, step, totals = epoch + 1, 0, np.zeros(2)
    if bar is not None:
        bar.close()
    stop.ignore()  # the ranks agreed for the last time: a late signal must not kill a rank at exit

    if stop.diverged:
        diverged(args, divergence_record(epoch, step, steps, step_losses, dataset, world), history, rank, world)
        mpidist.destroy_process_group()
        return 1
    every = np.zeros((world, 2))
    if step:
        mpidist.all_gather_single(every, totals)
    state = training_state(model, optimizer, epoch, step, every, history, config)
    ckpt = write_outputs(args, state, history, rank, world)
    if rank == 0:
        if stopped:
            print(f"stopped by {stop.name} after {epoch} epochs and {step}/{steps} steps; wrote {ckpt}; "
                  f"continue with --resume", flush=True)
        else:
            final = f"final test accuracy {history[-1]['test_accuracy']:.4f}; " if history else ""
            print(f"{final}wrote {ckpt}, {args.out / 'metrics.json'}, {args.out / 'training.png'}", flush=True)
    mpidist.destroy_process_group()
    return 0


def diverged(args: argparse.Namespace, record: dict, history: list[dict], rank: int, world: int,
             barrier: Callable[[], Any] = mpidist.barrier, job: str = "train_digits") -> None:
    """Collective end of a run whose loss went non-finite on some rank (``record``, see
    :func:`divergence_record`): metrics.json and the plot of what ran, no checkpoint (the
    caller then exits with code 1)."""
    history = history + [record]
    write_outputs(args, None, history, rank, world, barrier)
    if rank == 0:
        print(f"{job}: {record['diverged']} (--lr {args.lr}: try a smaller one); stopped every rank "
              f"there. Wrote {args.out / 'metrics.json'} and {args.out / 'training.png'}; no checkpoint written "
              f"(a non-finite model is not worth resuming).", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
