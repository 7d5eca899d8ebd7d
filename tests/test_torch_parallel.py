"""torch's own higher layers on backend "mpidist": DDP (buckets, comm hooks, no_sync,
find_unused_parameters, Join), FSDP2 ``fully_shard``, ``init_device_mesh``, DTensor,
functional collectives, ``torch.distributed.checkpoint``.

Equivalence (DDP, FSDP2): W ranks with per-rank batch B end with parameters equal
(float64, rtol 1e-10) to one process trained on the W*B samples, and bitwise equal
across ranks. Runs serially and under mpiexec -n 2, 3, 4.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

torch = pytest.importorskip("torch")
tdist = pytest.importorskip("torch.distributed")

from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch_helpers import torch_world  # noqa: E402

pytestmark = pytest.mark.mpi

B, STEPS, LR = 4, 3, 0.1
RTOL = 1e-10


@pytest.fixture(scope="module", autouse=True)
def world():
    with torch_world():
        yield tdist.get_rank(), tdist.get_world_size()


def _model(seed: int = 0, unused: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    layers = [nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3)]
    model = nn.Sequential(*layers).double()
    if unused:
        model.add_module("unused", nn.Linear(3, 3).double())
        model.forward = lambda x: model[2](model[1](model[0](x)))  # "unused" never runs
    return model


def _batch(step: int, n: int) -> tuple:
    """The step's W*B samples (the same on every rank)."""
    g = torch.Generator().manual_seed(1000 + step)
    return (
        torch.randn(n * B, 6, generator=g, dtype=torch.float64),
        torch.randn(n * B, 3, generator=g, dtype=torch.float64),
    )


def _local(step: int, r: int, n: int) -> tuple:
    x, y = _batch(step, n)
    return x[r * B : (r + 1) * B], y[r * B : (r + 1) * B]


def _reference(n: int, steps: int = STEPS, micro: int = 1) -> list:
    """One process on all W*B samples of each step (``micro`` batches accumulated)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for s in range(steps):
        opt.zero_grad()
        for m in range(micro):
            x, y = _batch(s * micro + m, n)
            nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _assert_same_everywhere(params: list) -> None:
    """Bitwise equal on every rank."""
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    got = [torch.empty_like(flat) for _ in range(tdist.get_world_size())]
    tdist.all_gather(got, flat)
    for other in got:
        assert torch.equal(other, flat)


def _train_ddp(ddp: nn.Module, r: int, n: int, steps: int = STEPS) -> None:
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    for s in range(steps):
        opt.zero_grad()
        x, y = _local(s, r, n)
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()


@pytest.mark.parametrize("bucket_cap_mb", [25, 0.0005])
def test_ddp_equivalent_to_one_process(world, bucket_cap_mb):
    r, n = world
    model = _model(seed=r)  # different on each rank: DDP broadcasts rank 0's
    torch.manual_seed(0)
    model.load_state_dict(_model().state_dict()) if r == 0 else None
    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb)
    _train_ddp(ddp, r, n)
    for got, want in zip(model.parameters(), _reference(n)):
        torch.testing.assert_close(got.detach(), want, rtol=RTOL, atol=0)
    _assert_same_everywhere(list(model.parameters()))


def test_ddp_no_sync_accumulates(world):
    r, n = world
    model = _model()
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    for s in range(2):
        opt.zero_grad()
        with ddp.no_sync():
            x, y = _local(2 * s, r, n)
            nn.functional.mse_loss(ddp(x), y).backward()
        x, y = _local(2 * s + 1, r, n)
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    for got, want in zip(model.parameters(), _reference(n, steps=2, micro=2)):
        torch.testing.assert_close(got.detach(), want, rtol=RTOL, atol=0)
    _assert_same_everywhere(list(model.parameters()))


def test_ddp_find_unused_parameters(world):
    r, n = world
    model = _model(unused=True)
    ddp = DDP(model, find_unused_parameters=True)
    _train_ddp(ddp, r, n)
    used = [p for name, p in model.named_parameters() if not name.startswith("unused")]
    for got, want in zip(used, _reference(n)):
        torch.testing.assert_close(got.detach(), want, rtol=RTOL, atol=0)
    _assert_same_everywhere(list(model.parameters()))


@pytest.mark.parametrize("hook", ["fp16", "powersgd"])  # bf16_compress_hook: torch refuses it without CUDA+NCCL
def test_ddp_comm_hooks(world, hook):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook  # noqa: PLC0415

    r, n = world
    model = _model()
    ddp = DDP(model)
    if hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    else:  # compressed from step 2: its hook waits on all-reduces inside future callbacks
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2, min_compression_rate=0.1
        )
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    _train_ddp(ddp, r, n, steps=4)
    ref = _reference(n, steps=4)
    for got, want in zip(model.parameters(), ref):
        assert torch.isfinite(got).all()
        if hook != "powersgd":  # a lossy compression of the gradient: close, not equal
            torch.testing.assert_close(got.detach(), want, rtol=0.05, atol=0.02)
    _assert_same_everywhere(list(model.parameters()))


def test_ddp_join_uneven_inputs(world):
    from torch.distributed.algorithms.join import Join  # noqa: PLC0415

    r, n = world
    model = _model()
    ddp = DDP(model)
    with Join([ddp]):
        _train_ddp(ddp, r, n, steps=2 + r)  # rank r has 2 + r batches
    _assert_same_everywhere(list(model.parameters()))


# -- FSDP2, DeviceMesh, DTensor, functional collectives, DCP ---------------------------------


def _fsdp_model(seed: int = 0) -> nn.Module:
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

    model = _model(seed)
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    return model


def _full(params) -> list:
    return [p.full_tensor().detach() for p in params]


def test_fsdp2_equivalent_to_one_process(world):
    r, n = world
    model = _fsdp_model()
    _train_ddp(model, r, n)
    full = _full(model.parameters())
    for got, want in zip(full, _reference(n)):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=0)
    _assert_same_everywhere(full)


def test_device_mesh_and_dtensor(world):
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor  # noqa: PLC0415

    r, n = world
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("dp",))
    assert tdist.get_process_group_ranks(mesh.get_group("dp")) == list(range(n))
    full = torch.arange(4.0 * n * 3, dtype=torch.float64).reshape(4 * n, 3)
    d = distribute_tensor(full, mesh, [Shard(0)])
    assert torch.equal(d.to_local(), full[4 * r : 4 * (r + 1)])
    assert torch.equal(d.redistribute(mesh, [Replicate()]).to_local(), full)
    assert torch.equal((d * 2).sum().full_tensor(), full.sum() * 2)  # a reduction through the mesh


@pytest.mark.mpi(min_size=4)
def test_device_mesh_2d(world):
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor  # noqa: PLC0415

    r, n = world
    if n != 4:
        pytest.skip("the 2-D mesh test is written for 4 ranks")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    assert tdist.get_process_group_ranks(mesh.get_group("dp")) == [r % 2, r % 2 + 2]
    assert tdist.get_process_group_ranks(mesh.get_group("tp")) == [r - r % 2, r - r % 2 + 1]
    full = torch.arange(4.0 * 6, dtype=torch.float64).reshape(4, 6)
    d = distribute_tensor(full, mesh, [Shard(0), Shard(1)])
    assert torch.equal(d.to_local(), full[2 * (r // 2) : 2 * (r // 2) + 2, 3 * (r % 2) : 3 * (r % 2) + 3])
    assert torch.equal(d.redistribute(mesh, [Replicate(), Shard(0)]).to_local(), full[2 * (r % 2) : 2 * (r % 2) + 2])
    assert torch.equal(d.full_tensor(), full)


def test_functional_collectives(world):
    import torch.distributed._functional_collectives as funcol  # noqa: PLC0415

    r, n = world
    group = tdist.group.WORLD
    t = torch.full((2,), float(r + 1))
    assert torch.equal(funcol.wait_tensor(funcol.all_reduce(t, "sum", group)), torch.full((2,), float(n * (n + 1) / 2)))
    g = funcol.all_gather_tensor(torch.full((1, 2), float(r)), 0, group)
    assert torch.equal(funcol.wait_tensor(g), torch.arange(float(n)).repeat_interleave(2).reshape(n, 2))
    rs = funcol.reduce_scatter_tensor(torch.ones(2 * n), "sum", 0, group)
    assert torch.equal(funcol.wait_tensor(rs), torch.full((2,), float(n)))
    a2a = funcol.all_to_all_single(torch.arange(float(n)) + 10 * r, None, None, group)
    assert torch.equal(funcol.wait_tensor(a2a), torch.tensor([10.0 * k + r for k in range(n)]))


def test_distributed_checkpoint_save_load(world):
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415

    r, n = world
    path = [tempfile.mkdtemp(prefix="mpidist-dcp-") if r == 0 else None]
    tdist.broadcast_object_list(path, src=0)
    try:
        model = _fsdp_model(seed=0)
        _train_ddp(model, r, n, steps=1)
        dcp.save({"model": model.state_dict()}, checkpoint_id=path[0])
        other = _fsdp_model(seed=5)
        state = {"model": other.state_dict()}
        dcp.load(state, checkpoint_id=path[0])
        other.load_state_dict(state["model"])
        for got, want in zip(_full(other.parameters()), _full(model.parameters())):
            assert torch.equal(got, want)
    finally:
        tdist.barrier()
        if r == 0:
            shutil.rmtree(path[0], ignore_errors=True)
    assert not os.path.exists(path[0]) or r != 0
