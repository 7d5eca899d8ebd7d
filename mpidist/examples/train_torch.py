"""The torch main job: torch's DistributedDataParallel over the ``mpidist`` backend, a small CNN on digits.

Run under MPI, for example ``mpiexec -n 4 python -m mpidist -m mpidist.examples.train_torch
--out out/torch``. ``import mpidist.torch`` registers the torch.distributed backend
"mpidist" (rank and world size from MPI: no MASTER_ADDR, no port). For comparison,
``--backend gloo`` runs the same job over torch's gloo (one node: rank 0 sends a free
127.0.0.1 port over MPI), and ``--backend nccl`` with ``--device cuda`` over torch's NCCL
(``"cpu:gloo,cuda:nccl"``, ``init_method="mpi://"``). ``--device cuda``: rank r uses GPU
``local rank % GPUs on the node``, cuDNN's deterministic algorithms (docs/torch.md, "CUDA
tensors").

Data, outputs, SIGTERM/SIGUSR1 stop and ``--resume``, divergence and the progress bar are
the numpy job's (:mod:`mpidist.examples.train_digits`). Model, checkpoint layout (load it
back into torch) and results: docs/torch.md, "The torch main job".
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from collections.abc import Sequence
from typing import Optional

import numpy as np
import torch
import torch.distributed as tdist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data.distributed import DistributedSampler

from mpidist.examples._job import Job, StopFlag, checked_arguments, job_arguments

BACKENDS = ("mpidist", "gloo", "nccl")
_CPU = torch.device("cpu")
DEVICES = ("cpu", "cuda")
#: torch's all_gather_single (2.13), under its older name all_gather_into_tensor on torch < 2.13
_all_gather_single = getattr(tdist, "all_gather_single", None) or tdist.all_gather_into_tensor


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = job_arguments("mpidist.examples.train_torch", __doc__, "out/torch", 20, "torch")
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default="mpidist",
        help="torch.distributed backend (default: mpidist; gloo: one node only, for comparison; "
        "nccl: torch's own, with --device cuda)",
    )
    p.add_argument(
        "--device",
        choices=DEVICES,
        default="cpu",
        help="where the model trains (cuda: GPU local rank %% GPUs on the node)",
    )
    p.add_argument(
        "--channels", type=int, default=16, help="channels of the first convolution (twice that in the second)"
    )
    args = checked_arguments(p, argv, ("channels",))
    if args.backend == "nccl" and args.device != "cuda":
        p.error("--backend nccl needs --device cuda (NCCL communicates CUDA tensors only)")
    if args.device == "cuda" and not torch.cuda.is_available():  # this node's answer: each rank's error (no JobExit)
        argparse.ArgumentParser.error(
            p, "--device cuda: this torch sees no CUDA device (torch.cuda.is_available() is False)"
        )
    return args


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_backend(backend: str) -> None:
    """``torch.distributed.init_process_group(backend)`` with rank and world size from MPI.

    "mpidist": ``import mpidist.torch`` registers the backend, which bootstraps from
    MPI_COMM_WORLD itself. "nccl": ``"cpu:gloo,cuda:nccl"`` over mpidist's ``mpi://``
    rendezvous (the store over MPI; no port): torch's NCCL for the gradients, torch's gloo
    for the job's CPU tensors (the stop flag, the metrics), which NCCL does not take. "gloo":
    rank 0 picks a free TCP port on 127.0.0.1 and broadcasts it over MPI
    (``tcp://127.0.0.1:PORT``: every rank must be on rank 0's node).
    """
    if backend in ("mpidist", "nccl"):
        import mpidist.torch  # noqa: F401, PLC0415  (registers "mpidist" and the mpi:// rendezvous)

        if backend == "nccl":  # the job's own host collectives (stop flag, metrics) need gloo
            tdist.init_process_group("cpu:gloo,cuda:nccl", init_method="mpi://")
        else:
            tdist.init_process_group("mpidist")
        return
    from mpi4py import MPI  # noqa: PLC0415

    comm = MPI.COMM_WORLD
    port = comm.bcast(_free_port() if comm.Get_rank() == 0 else None, root=0)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    tdist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.Get_rank(), world_size=comm.Get_size()
    )


def local_rank_and_size() -> tuple[int, int]:
    """(rank on this node, ranks on this node): MPI's shared-memory split of COMM_WORLD."""
    from mpi4py import MPI  # noqa: PLC0415

    node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return node.Get_rank(), node.Get_size()
    finally:
        node.Free()


def local_world_size() -> int:
    """Ranks on this node."""
    return local_rank_and_size()[1]


def pick_device(name: str) -> torch.device:
    """The job's device: the CPU, or GPU ``local rank % GPUs`` (made current) for "cuda"."""
    if name == "cpu":
        return torch.device("cpu")
    device = torch.device("cuda", local_rank_and_size()[0] % torch.cuda.device_count())
    torch.cuda.set_device(device)
    torch.backends.cudnn.deterministic = True  # the same steps give the same parameters
    torch.backends.cudnn.benchmark = False
    return device


class Net(nn.Module):
    """Two 3x3 convolutions (``channels``, ``2 * channels``; ReLU), max pool to 4x4, linear head.

    Input: float32 of shape (N, 1, side, side), side >= 4; output: logits of shape (N, classes).
    """

    def __init__(self, channels: int, classes: int) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveMaxPool2d(4),
            nn.Flatten(),
        )
        self.head = nn.Linear(2 * channels * 16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def as_images(x: np.ndarray) -> torch.Tensor:
    """(N, side * side) features -> float32 tensor (N, 1, side, side)."""
    side = int(round(x.shape[1] ** 0.5))
    if side * side != x.shape[1] or side < 4:
        raise ValueError(f"the images must be squares of side >= 4: got {x.shape[1]} features per sample")
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).reshape(len(x), 1, side, side)


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


class TorchJob(Job):
    """The CNN, trained with torch's DistributedDataParallel; every collective through
    torch.distributed (the job's group), on tensors that share the numpy arrays' memory."""

    name = "train_torch"
    # A resumed run must use the same values as the checkpointed one (--epochs may grow).
    resume_keys = ("dataset", "seed", "batch_size", "lr", "momentum", "channels")

    def __init__(self, args: argparse.Namespace, device: torch.device = _CPU) -> None:
        rank, world = tdist.get_rank(), tdist.get_world_size()
        super().__init__(args, rank, world, channels=args.channels, backend=args.backend)
        self.device = device
        self.x_train, self.x_test = as_images(self.x_train).to(device), as_images(self.x_test).to(device)
        self.y_train, self.y_test = torch.from_numpy(self.y_train).to(device), torch.from_numpy(self.y_test).to(device)
        self.model = Net(args.channels, self.n_classes).to(device)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=args.lr, momentum=args.momentum)
        self.progress = self.resume()
        self.ddp = DistributedDataParallel(self.model)  # broadcasts rank 0's parameters
        prime_buckets(self.ddp, self.x_train)  # every run: a resumed one then reduces exactly as an uninterrupted one
        self.criterion = nn.CrossEntropyLoss()
        self.sampler = DistributedSampler(
            range(len(self.x_train)),  # type: ignore[arg-type]  # torch annotates a Dataset; it only takes len()
            num_replicas=world,
            rank=rank,
            shuffle=True,
            seed=args.seed,
        )

    def all_reduce(self, arr: np.ndarray, op: str = "SUM") -> None:
        tdist.all_reduce(torch.from_numpy(arr), op=getattr(tdist.ReduceOp, op))

    def all_gather(self, out: np.ndarray, arr: np.ndarray) -> None:
        # torch 2.13's all_gather_into_tensor, into a flat view of ``out``
        _all_gather_single(torch.from_numpy(out).view(-1), torch.from_numpy(arr))

    barrier = staticmethod(tdist.barrier)
    destroy = staticmethod(tdist.destroy_process_group)

    def check_calls(self) -> None:
        """Over backend "mpidist", torch's collectives are mpidist's: compare them
        (:func:`mpidist.check_collectives`); torch's gloo and NCCL have no such check."""
        if self.args.backend == "mpidist":
            import mpidist  # noqa: PLC0415

            mpidist.check_collectives()

    def train_step(self, idx: np.ndarray) -> float:
        index = torch.from_numpy(idx).to(self.device)
        self.optimizer.zero_grad(set_to_none=False)
        loss = self.criterion(self.ddp(self.x_train[index]), self.y_train[index])
        loss.backward()  # DDP all-reduces the gradients, bucket by bucket, during backward
        self.optimizer.step()
        return loss.item()

    def count_right(self, x: torch.Tensor, y: torch.Tensor) -> int:
        self.model.eval()
        with torch.no_grad():
            right = int((self.model(x).argmax(dim=1) == y).sum())
        self.model.train()
        return right

    def model_state(self) -> dict[str, np.ndarray]:
        """``model.<name>``: the module's state_dict; ``optimizer.<i>.<key>``: SGD's per-parameter
        state (its momentum buffers), i in parameter order (the numpy job's checkpoint layout)."""
        state = {f"model.{k}": v.detach().cpu().numpy().copy() for k, v in self.model.state_dict().items()}
        for i, per_param in self.optimizer.state_dict()["state"].items():
            state.update(
                {
                    f"optimizer.{i}.{k}": v.detach().cpu().numpy().copy()
                    for k, v in per_param.items()
                    if isinstance(v, torch.Tensor)
                }
            )
        return state

    def load_model_state(self, ckpt: dict[str, np.ndarray]) -> None:
        self.model.load_state_dict({k[6:]: torch.from_numpy(v) for k, v in ckpt.items() if k.startswith("model.")})
        per_param: dict[int, dict[str, torch.Tensor]] = {}
        for k, v in ckpt.items():
            if k.startswith("optimizer."):
                i, key = k[10:].split(".", 1)
                per_param.setdefault(int(i), {})[key] = torch.from_numpy(v)
        groups = self.optimizer.state_dict()["param_groups"]
        self.optimizer.load_state_dict({"state": per_param, "param_groups": groups})

    def banner(self, steps: int) -> str:
        n_params = sum(p.numel() for p in self.model.parameters())
        where = "" if self.device.type == "cpu" else f" on {self.device.type}"
        return (
            f"mpidist: {self.world} ranks, torch {torch.__version__} DDP over {self.args.backend}{where}, "
            f"{self.dataset}: "
            f"{len(self.x_train)} train / {len(self.x_test)} test samples, CNN of {n_params:,} parameters, {steps} "
            f"steps/epoch of {self.args.batch_size} per rank"
        )


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    stop = StopFlag()
    stop.install()  # before anything slow, so an early SIGTERM is not fatal
    init_backend(args.backend)
    # Ranks sharing a node must not each start a thread per core (oversubscribed threads
    # slow every rank down several times).
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // local_world_size()))
    torch.manual_seed(args.seed)
    rc = TorchJob(args, pick_device(args.device)).run(stop)
    tdist.destroy_process_group()
    return rc


if __name__ == "__main__":
    sys.exit(main())
