"""What every training script of the frameworks suite checks at its end (imported by the
scripts, which run under ``mpiexec -n N python -m mpidist SCRIPT``; not a test module).

A run passes when, on every rank:

* ``torch.distributed.get_backend()`` is ``"mpidist"`` and the world is MPI's;
* each rank trained on its own samples: the first N/world indices each rank's data set
  served (its first epoch; :class:`Indexed` records them in order) are disjoint across ranks
  and cover the data set of N samples, so identical
  parameters at the end can only come from gradients exchanged between the ranks, not from
  every rank training alone on the same data;
* the parameters are bitwise identical on every rank (a SHA-256 of the flattened float64
  parameters, compared over MPI directly rather than through the backend under test);
* the loss fell: the mean of the last quarter of the recorded losses is below 0.9 times the
  mean of the first quarter, and every loss is finite.

Rank 0 then prints ``FRAMEWORK OK <name> ...``, the line the tests look for. A failed check
raises AssertionError, which ``python -m mpidist`` turns into the end of the whole job.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from mpi4py import MPI


class Indexed(torch.utils.data.Dataset):
    """A map-style data set over tensors that records, in order, the indices this process served."""

    def __init__(self, *tensors: torch.Tensor, as_dict: Sequence[str] = ()) -> None:
        self.tensors, self.as_dict, self.served = tensors, tuple(as_dict), []

    def __len__(self) -> int:
        return len(self.tensors[0])

    def __getitem__(self, i: int):
        self.served.append(int(i))
        items = tuple(t[i] for t in self.tensors)
        return dict(zip(self.as_dict, items)) if self.as_dict else items


def regression_data(n: int = 256, features: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The same small regression problem on every rank (a fixed seed: no download)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    w = torch.randn(features, 1, generator=g)
    return x, x @ w + 0.01 * torch.randn(n, 1, generator=g)


def reference_step(
    reference: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, idx: torch.Tensor
) -> None:
    """One step of the one-process reference model on the global batch ``idx`` (MSE loss)."""
    opt.zero_grad()
    torch.nn.functional.mse_loss(reference(x[idx]), y[idx]).backward()
    opt.step()


def out_dir() -> str:
    """The run's private output directory (the test's temporary directory; cwd otherwise)."""
    return os.environ.get("FW_OUT", os.getcwd())


def param_digest(params: Iterable[torch.Tensor]) -> str:
    flat = [p.detach().to("cpu", torch.float64).reshape(-1) for p in params]
    assert flat, "no parameters to compare"
    return hashlib.sha256(torch.cat(flat).numpy().tobytes()).hexdigest()


def finish(
    name: str, params: Iterable[torch.Tensor], losses: Sequence[float], served: Sequence[int], n_samples: int
) -> None:
    """Check the end of a run (the module's docstring) and print rank 0's ``FRAMEWORK OK`` line."""
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    backend, want = dist.get_backend(), os.environ.get("FW_BACKEND", "mpidist")
    assert backend == want, f"[rank {rank}] {name}: torch.distributed.get_backend() is {backend!r}, not {want!r}"
    assert dist.get_world_size() == size and dist.get_rank() == rank, (
        f"[rank {rank}] {name}: torch's rank/world {dist.get_rank()}/{dist.get_world_size()} is not MPI's {rank}/{size}"
    )

    assert n_samples % size == 0 and len(served) >= n_samples // size, (
        f"[rank {rank}] {name}: served {len(served)} samples, fewer than one epoch's {n_samples // size}"
    )
    every = comm.allgather(sorted(served[: n_samples // size]))
    seen = [i for s in every for i in s]
    assert len(seen) == len(set(seen)), f"{name}: ranks served overlapping samples (the data was not sharded)"
    assert set(seen) == set(range(n_samples)), f"{name}: the ranks served {len(set(seen))} of {n_samples} samples"

    digest = param_digest(params)
    digests = comm.allgather(digest)
    assert len(set(digests)) == 1, f"{name}: parameters differ between ranks: {[d[:12] for d in digests]}"

    losses = [float(v) for v in losses]
    assert len(losses) >= 4, f"[rank {rank}] {name}: only {len(losses)} losses recorded"
    assert all(math.isfinite(v) for v in losses), f"[rank {rank}] {name}: a loss is not finite: {losses}"
    q = max(1, len(losses) // 4)
    first, last = sum(losses[:q]) / q, sum(losses[-q:]) / q
    assert last < 0.9 * first, f"[rank {rank}] {name}: the loss did not fall: {first:.4g} -> {last:.4g}"
    comm.Barrier()
    if rank == 0:
        print(
            f"FRAMEWORK OK {name} np={size} backend={backend} steps={len(losses)} "
            f"loss {first:.4g} -> {last:.4g} params sha256 {digest[:16]} on every rank",
            flush=True,
        )
