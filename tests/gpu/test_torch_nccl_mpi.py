"""torch's own NCCL backend with ranks and store from MPI (``init_method="mpi://"``, the store
over MPI: no MASTER_ADDR, no port), on a real GPU; and torch's gloo beside it for CPU tensors.

Skipped with the reason where torch has no CUDA, and where two ranks share one GPU unless
torch's NCCL is >= 2.30 and NCCL_MULTI_RANK_GPU_ENABLE=1 (NCCL refuses it otherwise).

Run: ``python -m pytest --with-mpi -q tests/gpu/test_torch_nccl_mpi.py`` and under
``mpiexec -n 2``.
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("torch sees no CUDA device (or is a CPU build)", allow_module_level=True)

import torch.distributed as tdist  # noqa: E402
from mpi4py import MPI  # noqa: E402
from torch_helpers import assert_ddp_step_matches_one_process  # noqa: E402

import mpidist.torch  # noqa: E402, F401  (registers mpi://)
from mpidist._backends.device.nccl_core import shared_gpu_refused  # noqa: E402

pytestmark = pytest.mark.mpi


def _skip_reason() -> str:
    if not tdist.is_nccl_available():
        return "this torch has no NCCL"
    local = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED).Get_size()
    if local > torch.cuda.device_count():
        return shared_gpu_refused(torch.cuda.nccl.version())
    return ""


_REASON = MPI.COMM_WORLD.allreduce(_skip_reason(), op=MPI.MAX)  # every rank skips alike
if _REASON:
    pytest.skip(_REASON, allow_module_level=True)


@pytest.fixture(scope="module")
def world():
    if tdist.is_initialized():  # an earlier module's world (mpidist): this one needs NCCL's
        tdist.destroy_process_group()
    for var in ("MASTER_ADDR", "MASTER_PORT"):  # else the test would not show that mpi:// needs none
        assert var not in os.environ, f"{var} is set"
    me, n = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    local = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
    torch.cuda.set_device(local % torch.cuda.device_count())
    tdist.init_process_group("nccl", init_method="mpi://")
    yield me, n
    tdist.destroy_process_group()


def test_nccl_world_from_mpi(world):
    me, n = world
    assert tdist.get_backend() == "nccl"
    assert (tdist.get_rank(), tdist.get_world_size()) == (me, n)
    t = torch.full((1 << 20,), float(me + 1), device="cuda")
    tdist.all_reduce(t)
    assert t[0].item() == t[-1].item() == n * (n + 1) / 2
    b = torch.arange(5, device="cuda") * (me + 1)
    tdist.broadcast(b, src=n - 1)
    assert torch.equal(b.cpu(), torch.arange(5) * n)


def test_gloo_group_beside_nccl(world):
    """A gloo group for CPU tensors made from the same store over MPI."""
    me, n = world
    gloo = tdist.new_group(backend="gloo")
    c = torch.full((3,), float(me))
    tdist.all_reduce(c, group=gloo)
    assert c.tolist() == [float(sum(range(n)))] * 3
    tdist.destroy_process_group(gloo)


def test_ddp_nccl_matches_cpu_reference(world):
    me, n = world
    assert_ddp_step_matches_one_process(me, n)
