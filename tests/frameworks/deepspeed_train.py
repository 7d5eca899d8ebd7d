"""DeepSpeed ZeRO-1 / ZeRO-2 over mpidist on CPU, no compiled ops (``DS_BUILD_OPS=0``, the
default of a pip install): ``init_process_group("mpidist")`` first, then
``deepspeed.initialize(..., optimizer=<a torch optimizer>, dist_init_required=False)``.

DeepSpeed 0.19's torch comm backend JIT-compiles its shared-memory all-reduce op (C++, with
ninja and the host compiler; used only by its ``inference_all_reduce``) at
``deepspeed.initialize`` on a CPU accelerator, whatever the torch backend, unless the op is
marked incompatible: :func:`no_jit_ops` marks every op so (``deepspeed.ops.__compatible_ops__``,
the module-level dict DeepSpeed consults before a JIT build), so that nothing is compiled and an
op that were needed would fail loudly instead.

``--stage 1 2`` trains one model per ZeRO stage in the same job, one after the other.
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from mpi4py import MPI

import mpidist.torch  # noqa: F401  registers backend "mpidist"

from _fwcheck import Indexed, finish, regression_data

N, BATCH = 256, 16


def no_jit_ops() -> None:
    """Tell DeepSpeed that none of its C++ ops may be built here (the module's docstring)."""
    import deepspeed.ops
    from deepspeed.ops.op_builder.all_ops import ALL_OPS

    deepspeed.ops.__compatible_ops__ = dict.fromkeys(ALL_OPS, False)


def train(stage: int) -> None:
    import deepspeed

    torch.manual_seed(0)
    data = Indexed(*regression_data(N))
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 500, "allgather_bucket_size": 500},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**6,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config, dist_init_required=False)
    assert engine.zero_optimization_stage() == stage, engine.zero_optimization_stage()
    assert engine.dp_world_size == MPI.COMM_WORLD.Get_size(), engine.dp_world_size
    sampler = torch.utils.data.DistributedSampler(data, shuffle=False)
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, sampler=sampler)
    losses = []
    for epoch in range(4):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    finish(f"deepspeed-zero{stage}", engine.module.parameters(), losses, data.served, N)
    engine.destroy()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--stage", type=int, nargs="+", default=[1, 2], choices=[1, 2])
    args = p.parse_args()
    dist.init_process_group("mpidist")
    no_jit_ops()
    for stage in args.stage:
        train(stage)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
