"""The main job: data-parallel training of an MLP on handwritten digits.

Run under MPI, for example ``mpiexec -n 4 python -m mpidist.examples.train_digits --out out``.
Data: scikit-learn's digits (1,797 8x8 images) by default, ``--data DIR`` for the four
MNIST IDX files. Each rank trains on its DistributedSampler shard; DistributedDataParallel
averages the gradients. Rank 0 prints a line per epoch and writes, under ``--out``:
``checkpoint.npz`` (atomic, no pickle; every rank reads it back and checks it),
``metrics.json`` and ``training.png``. A progress bar (stdout, the epoch lines through
``tqdm.write``) is shown only when rank 0's stdout is a terminal, or with ``--progress``.

After each step one all_reduce(MAX) tells every rank whether any rank got SIGTERM or
SIGUSR1 or a non-finite loss. A stop signal: every rank stops at that step, rank 0 writes
the checkpoint, exit code 0; ``--resume`` continues from it, ending bitwise identical to an
uninterrupted run on as many ranks. A non-finite loss ("loss is not finite at epoch E step
S"): metrics.json and training.png of what ran, no checkpoint, exit code 1. A bad flag, a
``--data`` without MNIST or a refused ``--resume``: argparse's one-line error, exit code 2 on
every rank. Details: docs/hpc.md, "Stopping, checkpoints and requeue".
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any, Optional

import numpy as np
from threadpoolctl import threadpool_limits

import mpidist
from mpidist import ReduceOp
from mpidist.data import DistributedSampler
from mpidist.examples._job import (
    STOP_SIGNALS,  # noqa: F401  (the stop signals; tests import them from here)
    Job,
    StopFlag,
    checked_arguments,
    job_arguments,
)
from mpidist.nn import CrossEntropyLoss, Linear, ReLU, Sequential
from mpidist.optim import SGD
from mpidist.parallel import DistributedDataParallel


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = job_arguments("mpidist.examples.train_digits", __doc__, "out/digits", 30, "BLAS")
    p.add_argument("--algorithm", choices=["mpi", "ring"], default="mpi", help="gradient all-reduce algorithm")
    p.add_argument("--hidden", type=int, default=128, help="width of the two hidden layers")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    return checked_arguments(p, argv, ("hidden",))


class DigitsJob(Job):
    """The MLP, trained with mpidist's DistributedDataParallel and collectives."""

    name = "train_digits"
    # A resumed run must use the same values as the checkpointed one (--epochs may grow).
    resume_keys = ("dataset", "seed", "batch_size", "lr", "momentum", "hidden")

    def __init__(self, args: argparse.Namespace) -> None:
        rank, world = mpidist.get_rank(), mpidist.get_world_size()
        super().__init__(args, rank, world, hidden=args.hidden, algorithm=args.algorithm)
        rng = np.random.default_rng(args.seed + rank)  # each rank its own: DDP starts from rank 0's weights
        self.model = Sequential(
            Linear(self.x_train.shape[1], args.hidden, rng=rng),
            ReLU(),
            Linear(args.hidden, args.hidden, rng=rng),
            ReLU(),
            Linear(args.hidden, self.n_classes, rng=rng),
        )
        self.optimizer = SGD(self.model.parameters(), lr=args.lr, momentum=args.momentum)
        self.progress = self.resume()
        self.ddp = DistributedDataParallel(self.model, bucket_cap_mb=args.bucket_cap_mb, algorithm=args.algorithm)
        self.criterion = CrossEntropyLoss()
        self.sampler = DistributedSampler(self.x_train, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)

    def all_reduce(self, arr: np.ndarray, op: str = "SUM") -> None:
        mpidist.all_reduce(arr, op=getattr(ReduceOp, op))

    all_gather = staticmethod(mpidist.all_gather_single)
    barrier = staticmethod(mpidist.barrier)
    destroy = staticmethod(mpidist.destroy_process_group)
    check_calls = staticmethod(mpidist.check_collectives)

    def train_step(self, idx: np.ndarray) -> Any:
        self.optimizer.zero_grad()
        loss = self.criterion(self.ddp(self.x_train[idx]), self.y_train[idx])
        self.ddp.backward(self.criterion.backward())
        self.optimizer.step()
        return loss

    def count_right(self, x: np.ndarray, y: np.ndarray) -> int:
        self.model.eval()
        right = int(np.sum(self.model(x).argmax(axis=1) == y))
        self.model.train()
        return right

    def model_state(self) -> dict[str, np.ndarray]:
        return {
            **{f"model.{k}": v for k, v in self.model.state_dict().items()},
            **{f"optimizer.{k}": v for k, v in self.optimizer.state_dict().items()},
        }

    def load_model_state(self, ckpt: dict[str, np.ndarray]) -> None:
        self.model.load_state_dict({k[6:]: v for k, v in ckpt.items() if k.startswith("model.")})
        self.optimizer.load_state_dict({k[10:]: v for k, v in ckpt.items() if k.startswith("optimizer.")})

    def banner(self, steps: int) -> str:
        return (
            f"mpidist: {self.world} ranks, {self.dataset}: {len(self.x_train)} train / {len(self.x_test)} test "
            f"samples, {steps} steps/epoch of {self.args.batch_size} per rank, algorithm={self.args.algorithm}"
        )


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    stop = StopFlag()
    stop.install()  # before anything slow, so an early SIGTERM is not fatal
    mpidist.init_process_group("mpi")
    # Ranks sharing a node must not each start a BLAS thread per core: oversubscribed,
    # spinning BLAS threads slow every rank down several times.
    threads = args.threads or max(1, (os.cpu_count() or 1) // mpidist.get_local_world_size())
    threadpool_limits(limits=threads)
    rc = DigitsJob(args).run(stop)
    mpidist.destroy_process_group()
    return rc


if __name__ == "__main__":
    sys.exit(main())
