"""DeepSpeed ZeRO-1 / ZeRO-2 over mpidist on CPU, no compiled ops (``DS_BUILD_OPS=0``, the
default of a pip install): ``init_process_group("mpidist")`` first, then
``deepspeed.initialize(..., optimizer=<a torch optimizer>, dist_init_required=False)``.

DeepSpeed 0.19's torch comm backend JIT-compiles its shared-memory all-reduce op (C++, with
ninja and the host compiler; used only by its ``inference_all_reduce``) at
``deepspeed.initialize`` on a CPU accelerator, whatever the torch backend, unless the op is
marked incompatible: :func:`no_jit_ops` marks every op so (``deepspeed.ops.__compatible_ops__``,
the module-level dict DeepSpeed consults before a JIT build), so that nothing is compiled and an
op that were needed would fail loudly instead.

``--stage 1 2`` (the default) trains one model per ZeRO stage in the same job, one after the
other, from the same start: both must end with bitwise the same parameters, and each must
match (to float32 rounding) the same model trained in one process on the global batches,
computed on every rank beside it. DeepSpeed clips gradients to norm 1.0 unless told otherwise
(``gradient_clipping``); the config sets 0 so that the two compare.
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.distributed as dist
from _fwcheck import Indexed, finish, param_digest, reference_step, regression_data
from mpi4py import MPI

import mpidist.torch  # noqa: F401  registers backend "mpidist"

N, BATCH = 256, 16


def no_jit_ops() -> None:
    """Tell DeepSpeed that none of its C++ ops may be built here (the module's docstring)."""
    import deepspeed.ops
    from deepspeed.ops.op_builder.all_ops import ALL_OPS

    deepspeed.ops.__compatible_ops__ = dict.fromkeys(ALL_OPS, False)


def train(stage: int) -> str:
    """Train with ZeRO ``stage``; returns the parameters' digest."""
    import deepspeed

    torch.manual_seed(0)
    x, y = regression_data(N)
    data = Indexed(x, y)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 500, "allgather_bucket_size": 500},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,
        "steps_per_print": 10**6,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config, dist_init_required=False)
    assert engine.zero_optimization_stage() == stage, engine.zero_optimization_stage()
    assert engine.dp_world_size == MPI.COMM_WORLD.Get_size(), engine.dp_world_size
    sampler = torch.utils.data.DistributedSampler(data, shuffle=False)
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, sampler=sampler)
    world = MPI.COMM_WORLD.Get_size()
    order = torch.arange(N).reshape(-1, world)  # position i of every rank's shard: indices i*world + r
    losses = []
    for epoch in range(4):
        sampler.set_epoch(epoch)
        for step, (xb, yb) in enumerate(loader):
            loss = torch.nn.functional.mse_loss(engine(xb), yb)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            reference_step(reference, ref_opt, x, y, order[step * BATCH : (step + 1) * BATCH].reshape(-1))
    for p, r in zip(engine.module.parameters(), reference.parameters()):
        torch.testing.assert_close(
            p.detach(),
            r.detach(),
            rtol=1e-4,
            atol=1e-5,
            msg=lambda m: f"ZeRO-{stage}: DeepSpeed and one-process training differ: {m}",
        )
    finish(f"deepspeed-zero{stage}", engine.module.parameters(), losses, data.served, N)
    digest = param_digest(engine.module.parameters())
    engine.destroy()
    return digest


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--stage", type=int, nargs="+", default=[1, 2], choices=[1, 2])
    args = p.parse_args()
    dist.init_process_group("mpidist")
    no_jit_ops()
    digests = {stage: train(stage) for stage in args.stage}
    # fp32, same data and order: ZeRO-1 and ZeRO-2 differ only in how gradients are partitioned
    assert len(set(digests.values())) == 1, f"ZeRO stages ended with different parameters: {digests}"
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
