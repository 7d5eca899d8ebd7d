"""The main job: data-parallel training of an MLP on handwritten digits.

Run under MPI, for example ``mpiexec -n 4 python -m mpidist.examples.train_digits --out out``.
By default it trains on scikit-learn's digits (1,797 8x8 images, shipped with
scikit-learn); ``--data DIR`` reads the four standard MNIST IDX files instead. Each
rank trains on its DistributedSampler shard with a per-rank batch; gradients are
averaged by DistributedDataParallel. Rank 0 shows progress and writes, under
``--out``: ``checkpoint.npz`` (atomic, no pickle; every rank loads it back and checks
it), ``metrics.json`` and ``training.png`` (loss and test accuracy per epoch).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
from threadpoolctl import threadpool_limits

import mpidist
from mpidist import ReduceOp
from mpidist.checkpoint import load_checkpoint, save_checkpoint
from mpidist.data import DistributedSampler, load_digits_split, load_mnist
from mpidist.nn import CrossEntropyLoss, Linear, ReLU, Sequential
from mpidist.optim import SGD
from mpidist.parallel import DistributedDataParallel


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m mpidist.examples.train_digits", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("out/digits"), help="output directory (default: out/digits)")
    p.add_argument("--data", type=Path, default=None, help="directory with MNIST IDX files (default: sklearn digits)")
    p.add_argument("--algorithm", choices=["mpi", "ring"], default="mpi", help="gradient all-reduce algorithm")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=16, help="samples per rank per step")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--hidden", type=int, default=128, help="width of the two hidden layers")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0,
                   help="BLAS threads per rank (default: cores on the node / ranks on the node)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    for name in ("epochs", "batch_size", "hidden"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.lr <= 0:
        p.error(f"--lr must be > 0, got {args.lr}")
    return args


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
    import matplotlib  # noqa: PLC0415  (rank 0 only)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    epochs = [h["epoch"] for h in history]
    fig, ax1 = plt.subplots(figsize=(7, 4))
    ax1.plot(epochs, [h["loss"] for h in history], "o-", color="tab:blue", label="train loss")
    ax1.set_xlabel("epoch")
    ax1.set_ylabel("train loss", color="tab:blue")
    ax2 = ax1.twinx()
    ax2.plot(epochs, [h["test_accuracy"] for h in history], "s-", color="tab:green", label="test accuracy")
    ax2.set_ylabel("test accuracy", color="tab:green")
    ax2.set_ylim(0, 1)
    fig.suptitle(f"mpidist DDP on {history[0]['dataset']}, {history[0]['world_size']} ranks")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    mpidist.init_process_group("mpi")
    rank, world = mpidist.get_rank(), mpidist.get_world_size()
    # Ranks sharing a node must not each start a BLAS thread per core: oversubscribed,
    # spinning BLAS threads slow every rank down several times.
    threads = args.threads or max(1, (os.cpu_count() or 1) // mpidist.get_local_world_size())
    threadpool_limits(limits=threads)
    if args.data is None:
        dataset = "sklearn digits"
        x_train, y_train, x_test, y_test = load_digits_split(seed=args.seed)
    else:
        dataset = f"MNIST ({args.data})"
        x_train, y_train, x_test, y_test = load_mnist(args.data)
    n_classes = int(max(y_train.max(), y_test.max())) + 1

    model = build_model(x_train.shape[1], args.hidden, n_classes, args.seed + rank)  # rank 0's weights win
    ddp = DistributedDataParallel(model, bucket_cap_mb=args.bucket_cap_mb, algorithm=args.algorithm)
    optimizer = SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    criterion = CrossEntropyLoss()
    sampler = DistributedSampler(x_train, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    steps = -(-len(sampler) // args.batch_size)

    bar = None
    if rank == 0:
        print(f"mpidist: {world} ranks, {dataset}: {len(x_train)} train / {len(x_test)} test samples, "
              f"{steps} steps/epoch of {args.batch_size} per rank, algorithm={args.algorithm}", flush=True)
        if not args.no_progress:
            from tqdm import tqdm  # noqa: PLC0415

            bar = tqdm(total=steps * args.epochs, unit="step", file=sys.stderr, dynamic_ncols=True)

    history: list[dict] = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        order = np.fromiter(sampler, dtype=np.int64)
        totals = np.zeros(2)  # summed loss * samples, samples
        start = time.perf_counter()
        for step in range(steps):
            idx = order[step * args.batch_size:(step + 1) * args.batch_size]
            optimizer.zero_grad()
            loss = criterion(ddp(x_train[idx]), y_train[idx])
            ddp.backward(criterion.backward())
            optimizer.step()
            totals += (loss * len(idx), len(idx))
            if bar is not None:
                bar.update()
        mpidist.all_reduce(totals)
        elapsed = time.perf_counter() - start
        accuracy = evaluate(model, x_test, y_test, rank, world)
        record = {"epoch": epoch + 1, "loss": totals[0] / totals[1], "test_accuracy": accuracy,
                  "samples_per_s": totals[1] / elapsed, "dataset": dataset, "world_size": world}
        history.append(record)
        if rank == 0:
            line = (f"epoch {epoch + 1:3d}/{args.epochs}  loss {record['loss']:.4f}  "
                    f"test acc {accuracy:.4f}  {record['samples_per_s']:,.0f} samples/s")
            (bar.write(line) if bar is not None else print(line, flush=True))
    if bar is not None:
        bar.close()

    args.out.mkdir(parents=True, exist_ok=True)
    ckpt = args.out / "checkpoint.npz"
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    state.update({f"optimizer.{k}": v for k, v in optimizer.state_dict().items()})
    state["epoch"] = np.array(args.epochs)
    if rank == 0:
        save_checkpoint(ckpt, state)
        (args.out / "metrics.json").write_text(json.dumps(history, indent=1))
        save_plot(args.out / "training.png", history)
    mpidist.barrier()
    loaded = load_checkpoint(ckpt)
    if any(not np.array_equal(loaded[k], np.asarray(v)) for k, v in state.items()):
        raise RuntimeError(f"[rank {rank}/{world}] checkpoint {ckpt} does not match this rank's model")
    if rank == 0:
        print(f"final test accuracy {history[-1]['test_accuracy']:.4f}; wrote {ckpt}, "
              f"{args.out / 'metrics.json'}, {args.out / 'training.png'}", flush=True)
    mpidist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
