"""Accelerate 1.15 over mpidist, the documented way: ``init_process_group("mpidist")`` first
(Accelerate cannot select the backend by name), then ``Accelerator(cpu=True)``, which finds
the group initialized and uses it. Without ``cpu=True`` on a node without GPUs, Accelerate
starts no distributed run and does not wrap the model: every rank would train alone.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from _fwcheck import Indexed, finish, regression_data
from mpi4py import MPI

import mpidist.torch  # noqa: F401  registers backend "mpidist"

N = 256


def main() -> None:
    if os.environ.get("FW_BACKEND", "mpidist") == "mpidist":
        dist.init_process_group("mpidist")
    # else (FW_BACKEND=mpi): the framework picks backend "mpi" on its own (import mpidist.torch
    # made torch.distributed.is_mpi_available() True) and initializes the group itself
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, set_seed

    accelerator = Accelerator(cpu=True)
    assert accelerator.distributed_type == DistributedType.MULTI_CPU, accelerator.distributed_type
    assert accelerator.num_processes == MPI.COMM_WORLD.Get_size() and accelerator.process_index == dist.get_rank()
    set_seed(0)
    data = Indexed(*regression_data(N))
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = torch.utils.data.DataLoader(data, batch_size=16, shuffle=False)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    assert isinstance(model, torch.nn.parallel.DistributedDataParallel), type(model)
    losses = []
    for _ in range(4):
        for x, y in loader:
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            opt.step()
            losses.append(loss.item())
    finish("accelerate", accelerator.unwrap_model(model).parameters(), losses, data.served, N)
    accelerator.end_training()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
