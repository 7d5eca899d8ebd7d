"""The torch main job: torch's DistributedDataParallel over the ``mpidist`` backend, a small CNN on digits.

Run under MPI, for example ``mpiexec -n 4 python -m mpidist -m mpidist.examples.train_torch
--out out/torch``. ``import mpidist.torch`` registers the torch.distributed backend
"mpidist"; ``torch.distributed.init_process_group("mpidist")`` takes rank and world size
from MPI (no MASTER_ADDR, no port), and ``torch.nn.parallel.DistributedDataParallel``
averages the gradients through mpidist's collectives. ``--backend gloo`` runs the same job
over torch's gloo instead (one node only: rank 0 picks a free port on 127.0.0.1 and sends
it to the others over MPI), for comparison.

Data as the numpy job (:mod:`mpidist.examples.train_digits`): scikit-learn's digits
(1,797 8x8 images) by default, ``--data DIR`` for the four MNIST IDX files; each image is
fed as a 1-channel square. The model: two 3x3 convolutions (16 and 32 channels, ReLU), an
adaptive max pool to 4x4 and a linear head (9,930 parameters). Each rank trains on its
``torch.utils.data.distributed.DistributedSampler`` shard, ``--batch-size`` samples per
rank per step, SGD with momentum; ``torch.manual_seed(--seed)`` on every rank and DDP's
broadcast of rank 0's parameters make the start identical. One torch thread per rank
unless ``--threads`` (default: cores on the node / ranks on the node).

Rank 0 writes, under ``--out``: ``checkpoint.npz`` (:func:`mpidist.checkpoint.save_checkpoint`:
atomic, no pickle; ``model.<name>`` holds ``ddp.module.state_dict()``'s tensors as arrays,
``optimizer.<i>.momentum_buffer`` SGD's state; every rank reads it back and checks it),
``metrics.json`` and ``training.png`` (loss and test accuracy per epoch), as the numpy job.
Load the model back with ``model.load_state_dict({k[6:]: torch.from_numpy(v) for k, v in
load_checkpoint(path).items() if k.startswith("model.")})``.

SIGTERM or SIGUSR1 (a Slurm time limit, preemption, ``kill`` on mpiexec) stops every rank
at the same step, as in the numpy job: the ranks agree with a two-element
``all_reduce(MAX)`` after each step (the stop signal, and whether any rank's loss was not
finite), rank 0 writes the checkpoint (with every rank's partial loss sums) and the job
exits with code 0. ``--resume`` continues from it; the sampler's shuffle is a function of
(seed, epoch), so a resumed run ends with parameters bitwise identical to an uninterrupted
one on the same number of ranks. A diverging run (``--lr 1e3``) stops on every rank at the
first non-finite loss, "loss is not finite at epoch E step S", with metrics.json and the
plot of what ran, no checkpoint, exit code 1, as the numpy job. The progress bar, as the
numpy job's: only when stdout is a terminal, or with ``--progress``.
"""
from __future__ import annotations

import argparse
import math
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import torch
import torch.distributed as tdist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data.distributed import DistributedSampler

from mpidist.examples.train_digits import (
    StopFlag,
    _json_bytes,
    checked_arguments,
    diverged,
    divergence_record,
    job_arguments,
    load_data,
    progress_bar,
    resumed,
    resume_path,
    write_outputs,
)

# A resumed run must use the same values as the checkpointed one (--epochs may grow).
RESUME_KEYS = ("dataset", "seed", "batch_size", "lr", "momentum", "channels")
BACKENDS = ("mpidist", "gloo")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = job_arguments("mpidist.examples.train_torch", __doc__, "out/torch", 20, "torch")
    p.add_argument("--backend", choices=BACKENDS, default="mpidist",
                   help="torch.distributed backend (default: mpidist; gloo: one node only, for comparison)")
    p.add_argument("--channels", type=int, default=16,
                   help="channels of the first convolution (twice that in the second)")
    return checked_arguments(p, argv, ("channels",))


class TorchStopFlag(StopFlag):
    """:class:`~mpidist.examples.train_digits.StopFlag` agreed through torch.distributed (the job's group)."""

    def __init__(self) -> None:
        super().__init__()
        self._tensor = torch.from_numpy(self._buf)  # shares the buffer that ``name`` reads

    def agreed(self, loss_finite: bool = True) -> bool:
        """Collective: True on every rank once any rank got a stop signal or a non-finite loss
        (one 2-element all_reduce MAX, as the numpy job's)."""
        self._buf[0] = self.signum
        self._buf[1] = not loss_finite
        tdist.all_reduce(self._tensor, op=tdist.ReduceOp.MAX)
        return bool(self._buf.any())


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_backend(backend: str) -> None:
    """``torch.distributed.init_process_group(backend)`` with rank and world size from MPI.

    "mpidist": ``import mpidist.torch`` registers the backend, which bootstraps from
    MPI_COMM_WORLD itself. "gloo": rank 0 picks a free TCP port on 127.0.0.1 and
    broadcasts it over MPI (``tcp://127.0.0.1:PORT``: every rank must be on rank 0's node).
    """
    if backend == "mpidist":
        import mpidist.torch  # noqa: F401, PLC0415  (registers the "mpidist" backend)

        tdist.init_process_group("mpidist")
        return
    from mpi4py import MPI  # noqa: PLC0415

    comm = MPI.COMM_WORLD
    port = comm.bcast(_free_port() if comm.Get_rank() == 0 else None, root=0)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.Get_rank(),
                             world_size=comm.Get_size())


def local_world_size() -> int:
    """Ranks on this node (MPI's shared-memory split of COMM_WORLD)."""
    from mpi4py import MPI  # noqa: PLC0415

    node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return node.Get_size()
    finally:
        node.Free()


class Net(nn.Module):
    """Two 3x3 convolutions (``channels``, ``2 * channels``; ReLU), max pool to 4x4, linear head.

    Input: float32 of shape (N, 1, side, side), side >= 4; output: logits of shape (N, classes).
    """

    def __init__(self, channels: int, classes: int) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1), nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.ReLU(),
            nn.AdaptiveMaxPool2d(4), nn.Flatten())
        self.head = nn.Linear(2 * channels * 16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def as_images(x: np.ndarray) -> torch.Tensor:
    """(N, side * side) features -> float32 tensor (N, 1, side, side)."""
    side = int(round(x.shape[1] ** 0.5))
    if side * side != x.shape[1] or side < 4:
        raise ValueError(f"the images must be squares of side >= 4: got {x.shape[1]} features per sample")
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).reshape(len(x), 1, side, side)


def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, rank: int, world: int) -> float:
    """Accuracy over the whole test set: each rank scores rank::world, then one all_reduce."""
    model.eval()
    with torch.no_grad():
        xs, ys = x[rank::world], y[rank::world]
        right = int((model(xs).argmax(dim=1) == ys).sum()) if len(ys) else 0
    model.train()
    counts = torch.tensor([right, len(ys)], dtype=torch.int64)
    tdist.all_reduce(counts)
    right, total = counts.tolist()
    return right / total


def training_state(model: nn.Module, optimizer: torch.optim.SGD, epoch: int, step: int, totals: np.ndarray,
                   history: list[dict], config: dict) -> dict[str, np.ndarray]:
    """Everything a resumed run needs, as named arrays (layout of the numpy job's checkpoint).

    ``model.<name>``: the module's state_dict; ``optimizer.<i>.<key>``: SGD's per-parameter
    state (its momentum buffers), i in parameter order; ``epoch``: epochs completed; ``step``:
    steps completed in the next epoch; ``loss_totals``: every rank's (summed loss * samples,
    samples) of that epoch so far, shape (world, 2); history and config as JSON bytes.
    """
    state = {f"model.{k}": v.detach().numpy().copy() for k, v in model.state_dict().items()}
    for i, per_param in optimizer.state_dict()["state"].items():
        state.update({f"optimizer.{i}.{k}": v.detach().numpy().copy() for k, v in per_param.items()
                      if isinstance(v, torch.Tensor)})
    state.update({"epoch": np.array(epoch), "step": np.array(step), "loss_totals": totals,
                  "history": _json_bytes(history), "config": _json_bytes(config)})
    return state


def restore(path: Path, model: nn.Module, optimizer: torch.optim.SGD, config: dict, world: int,
            rank: int) -> tuple[int, int, np.ndarray, list[dict]]:
    """Load ``path`` into model and optimizer; return (epoch, step, this rank's loss totals,
    history). ValueError as :func:`mpidist.examples.train_digits.resumed`."""
    ckpt, epoch, step, mine, history = resumed(path, config, RESUME_KEYS, world, rank)
    model.load_state_dict({k[6:]: torch.from_numpy(v) for k, v in ckpt.items() if k.startswith("model.")})
    per_param: dict[int, dict[str, torch.Tensor]] = {}
    for k, v in ckpt.items():
        if k.startswith("optimizer."):
            i, key = k[10:].split(".", 1)
            per_param.setdefault(int(i), {})[key] = torch.from_numpy(v)
    optimizer.load_state_dict({"state": per_param, "param_groups": optimizer.state_dict()["param_groups"]})
    return epoch, step, mine, history


def prime_buckets(ddp: DistributedDataParallel, x: torch.Tensor) -> None:
    """One forward and backward whose gradients are thrown away, so that DDP lays out its buckets.

    DDP's first backward reduces every gradient in one bucket in parameter order, and records
    the order in which they became ready; the next forward rebuilds the buckets in that order
    (torch/nn/parallel/distributed.py, "bucket rebuild"). Where an element sits in a bucket
    decides the order in which the ranks' values are summed (a ring, MPI's
    reduce-scatter), so without this a resumed run's first step would round differently from
    the uninterrupted run's step at the same point. Collective (one all_reduce).
    """
    ddp(x[:1]).sum().backward()
    ddp.module.zero_grad(set_to_none=True)


def train_steps(ddp: DistributedDataParallel, optimizer: torch.optim.SGD, x: torch.Tensor, y: torch.Tensor,
                order: torch.Tensor, batch: int, step: int, steps: int, totals: np.ndarray, stop: TorchStopFlag,
                bar: Any, losses: list) -> tuple[int, bool]:
    """Run steps ``step..steps-1`` of an epoch, adding (loss * samples, samples) to ``totals``
    and (step, loss) to ``losses``.

    Returns (steps done, stopped): after each step every rank learns whether any rank got a
    stop signal or a non-finite loss (``stop.diverged``), so all of them stop after the same step.
    """
    criterion = nn.CrossEntropyLoss()
    while step < steps:
        idx = order[step * batch:(step + 1) * batch]
        optimizer.zero_grad(set_to_none=False)
        loss = criterion(ddp(x[idx]), y[idx])
        loss.backward()  # DDP all-reduces the gradients, bucket by bucket, during backward
        optimizer.step()
        value = loss.item()
        totals += (value * len(idx), len(idx))
        step += 1
        losses.append((step, value))
        if bar is not None:
            bar.update()
        if stop.agreed(math.isfinite(value)):
            return step, True
    return step, False


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    stop = TorchStopFlag()
    stop.install()  # before anything slow, so an early SIGTERM is not fatal
    init_backend(args.backend)
    rank, world = tdist.get_rank(), tdist.get_world_size()
    # Ranks sharing a node must not each start a thread per core (oversubscribed threads
    # slow every rank down several times).
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // local_world_size()))
    torch.manual_seed(args.seed)
    dataset, x_train, y_train, x_test, y_test = load_data(args)
    n_classes = int(max(y_train.max(), y_test.max())) + 1
    x_train, x_test = as_images(x_train), as_images(x_test)
    y_train, y_test = torch.from_numpy(y_train), torch.from_numpy(y_test)
    config = {"dataset": dataset, "seed": args.seed, "batch_size": args.batch_size, "lr": args.lr,
              "momentum": args.momentum, "channels": args.channels, "backend": args.backend,
              "world_size": world}

    model = Net(args.channels, n_classes)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    epoch, step, totals, history = 0, 0, np.zeros(2), []
    source = resume_path(args)
    if source is not None:
        epoch, step, totals, history = restore(source, model, optimizer, config, world, rank)
    ddp = DistributedDataParallel(model)  # broadcasts rank 0's parameters
    prime_buckets(ddp, x_train)  # every run, so that a resumed one reduces exactly as an uninterrupted one
    sampler = DistributedSampler(range(len(x_train)), num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    steps = -(-len(sampler) // args.batch_size)

    bar = None
    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        print(f"mpidist: {world} ranks, torch {torch.__version__} DDP over {args.backend}, {dataset}: "
              f"{len(x_train)} train / {len(x_test)} test samples, CNN of {n_params:,} parameters, {steps} "
              f"steps/epoch of {args.batch_size} per rank", flush=True)
        if source is not None:
            print(f"resumed from {source}: {epoch} epochs and {step}/{steps} steps done", flush=True)
        bar = progress_bar(args, steps * args.epochs, min(steps * epoch + step, steps * args.epochs))

    stopped = False
    while epoch < args.epochs and not stopped:
        sampler.set_epoch(epoch)
        order = torch.tensor(list(sampler), dtype=torch.int64)
        resumed_samples, start, step_losses = totals[1], time.perf_counter(), []
        step, stopped = train_steps(ddp, optimizer, x_train, y_train, order, args.batch_size, step, steps,
                                    totals, stop, bar, step_losses)
        if step < steps or stop.diverged:  # stopped mid-epoch: the checkpoint keeps every rank's partial sums
            break
        summed = torch.tensor([totals[0], totals[1], totals[1] - resumed_samples], dtype=torch.float64)
        tdist.all_reduce(summed)
        elapsed = time.perf_counter() - start
        accuracy = evaluate(model, x_test, y_test, rank, world)
        history.append({"epoch": epoch + 1, "loss": float(summed[0] / summed[1]), "test_accuracy": accuracy,
                        "samples_per_s": float(summed[2]) / elapsed, "dataset": dataset, "world_size": world})
        if rank == 0:
            line = (f"epoch {epoch + 1:3d}/{args.epochs}  loss {history[-1]['loss']:.4f}  "
                    f"test acc {accuracy:.4f}  {history[-1]['samples_per_s']:,.0f} samples/s")
            (bar.write(line) if bar is not None else print(line, flush=True))
        epoch, step, totals = epoch + 1, 0, np.zeros(2)
    if bar is not None:
        bar.close()
    stop.ignore()  # the ranks agreed for the last time: a late signal must not kill a rank at exit

    if stop.diverged:
        diverged(args, divergence_record(epoch, step, steps, step_losses, dataset, world), history, rank, world,
                 tdist.barrier, "train_torch")
        tdist.destroy_process_group()
        return 1
    every = torch.zeros(world * 2, dtype=torch.float64)
    if step:
        tdist.all_gather_single(every, torch.from_numpy(totals))  # torch 2.13's all_gather_into_tensor
    state = training_state(model, optimizer, epoch, step, every.numpy().reshape(world, 2), history, config)
    ckpt = write_outputs(args, state, history, rank, world, tdist.barrier)
    if rank == 0:
        if stopped:
            print(f"stopped by {stop.name} after {epoch} epochs and {step}/{steps} steps; wrote {ckpt}; "
                  f"continue with --resume", flush=True)
        else:
            final = f"final test accuracy {history[-1]['test_accuracy']:.4f}; " if history else ""
            print(f"{final}wrote {ckpt}, {args.out / 'metrics.json'}, {args.out / 'training.png'}", flush=True)
    tdist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
