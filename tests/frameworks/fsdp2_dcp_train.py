"""FSDP2 (``torch.distributed.fsdp.fully_shard``) over mpidist, then ``torch.distributed.checkpoint``:
``dcp.save``, ``dcp.load`` and ``dcp.async_save`` on the sharded model and optimizer.

1. Train an MLP sharded with ``fully_shard`` on a CPU DeviceMesh; each step must match (to
   float32 rounding) the same model trained in one process on the global batch, computed on
   every rank beside it.
2. ``dcp.save`` the model and optimizer state dicts, change the model, ``dcp.load`` and
   ``set_model_state_dict``/``set_optimizer_state_dict``: the full parameters and optimizer
   state must be bitwise the saved ones. Rank 0 prints ``FRAMEWORK OK fsdp2-dcp``.
3. The same through ``dcp.async_save`` (its future's ``result()``), then ``dcp.load``:
   ``FRAMEWORK OK fsdp2-dcp-async``.
"""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _fwcheck import Indexed, finish, out_dir, reference_step, regression_data
from mpi4py import MPI
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import mpidist.torch  # noqa: F401  registers backend "mpidist"

N, BATCH = 256, 8


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def full_params(model) -> list[torch.Tensor]:
    return [full(p.detach()).clone() for p in model.parameters()]


def full_optim(osd: dict) -> list[torch.Tensor]:
    return [
        full(v).clone()
        for _, st in sorted(osd["state"].items())
        for _, v in sorted(st.items())
        if isinstance(v, torch.Tensor)
    ]


def roundtrip(model, opt, path: str, use_async: bool) -> None:
    """Save model and optimizer with DCP, change the model and optimizer, load back, compare bitwise."""
    before, osd = full_params(model), get_optimizer_state_dict(model, opt)
    opt_before = full_optim(osd)
    state = {"model": get_model_state_dict(model), "optim": osd}
    if use_async:
        dcp.async_save(state, checkpoint_id=path).result()
    else:
        dcp.save(state, checkpoint_id=path)
    with torch.no_grad():  # change everything the checkpoint must restore
        for p in model.parameters():
            p.add_(1.0)
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                v.add_(1.0)
    assert not all(torch.equal(a, b) for a, b in zip(before, full_params(model)))
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    after, opt_after = full_params(model), full_optim(get_optimizer_state_dict(model, opt))
    assert all(torch.equal(a, b) for a, b in zip(before, after)), f"{path}: the parameters did not load back"
    assert len(opt_before) == len(opt_after) > 0 and all(torch.equal(a, b) for a, b in zip(opt_before, opt_after)), (
        f"{path}: the optimizer state did not load back"
    )


def main() -> None:
    dist.init_process_group("mpidist")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    reference = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert isinstance(model[0].weight, DTensor) and model[0].weight.to_local().shape[0] == -(-64 // world)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)

    x, y = regression_data(N)
    data = Indexed(x, y)
    sampler = torch.utils.data.DistributedSampler(data, shuffle=False)
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, sampler=sampler)
    order = torch.arange(N).reshape(-1, world)  # position i of every rank's shard: indices i*world + r
    losses = []
    for _epoch in range(2):
        for step, (xb, yb) in enumerate(loader):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            reference_step(reference, ref_opt, x, y, order[step * BATCH : (step + 1) * BATCH].reshape(-1))
    for p, r in zip(full_params(model), reference.parameters()):
        torch.testing.assert_close(
            p,
            r.detach(),
            rtol=1e-4,
            atol=1e-5,
            msg=lambda m: f"[rank {rank}] FSDP2 and one-process training differ: {m}",
        )
    finish("fsdp2", full_params(model), losses, data.served, N)

    root = os.path.join(out_dir(), "dcp")
    roundtrip(model, opt, os.path.join(root, "sync"), use_async=False)
    MPI.COMM_WORLD.Barrier()
    if rank == 0:
        print(f"FRAMEWORK OK fsdp2-dcp np={world} dcp.save and dcp.load: model and optimizer bitwise", flush=True)
    roundtrip(model, opt, os.path.join(root, "async"), use_async=True)
    MPI.COMM_WORLD.Barrier()
    if rank == 0:
        print(
            f"FRAMEWORK OK fsdp2-dcp-async np={world} dcp.async_save and dcp.load: model and optimizer bitwise",
            flush=True,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
