"""torch.compile of a DDP model on CUDA: over "mpidist" (CUDA tensors through NCCL where
mpidist can use it, else host staging) and over torch's own NCCL (``init_method="mpi://"``)
where NCCL can run the ranks, with Dynamo's aot_eager and inductor backends. Compiled DDP
trains to eager DDP's parameters on the same group (tests/torch_helpers.py), and compiled
code that calls ``dist.broadcast`` runs it (docs/torch.md, "torch.compile").

Skipped with the reason where torch sees no CUDA device. The same on the CPU:
tests/test_torch_compile.py.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("torch sees no CUDA device (or is a CPU build)", allow_module_level=True)

import torch.distributed as tdist  # noqa: E402
from mpi4py import MPI  # noqa: E402
from torch_helpers import assert_compiled_broadcast, assert_compiled_ddp_matches_eager  # noqa: E402

import mpidist.torch  # noqa: E402, F401
from mpidist._backends.device import nccl_core  # noqa: E402

pytestmark = pytest.mark.mpi


@pytest.fixture(params=["mpidist", "nccl"])
def world(request):
    """torch's default group on the backend (nccl: over ``mpi://``), each rank on GPU
    ``local rank % GPUs``; destroyed at the test's end."""
    node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    local, local_size = node.Get_rank(), node.Get_size()
    node.Free()
    if request.param == "nccl" and local_size > torch.cuda.device_count():
        why = nccl_core.shared_gpu_refused(torch.cuda.nccl.version())
        if why:
            pytest.skip(f"torch's NCCL cannot run {local_size} ranks on {torch.cuda.device_count()} GPU(s): {why}")
    if tdist.is_initialized():  # an earlier module's world
        tdist.destroy_process_group()
    torch.cuda.set_device(local % torch.cuda.device_count())
    if request.param == "nccl":
        tdist.init_process_group("nccl", init_method="mpi://")
    else:
        tdist.init_process_group("mpidist")
    yield tdist.get_rank()
    tdist.destroy_process_group()


@pytest.mark.parametrize("compile_backend", ["aot_eager", "inductor"])
def test_compiled_ddp_matches_eager_cuda(world, compile_backend):
    assert_compiled_ddp_matches_eager(world, "cuda", compile_backend)


def test_compiled_broadcast_cuda(world):
    assert_compiled_broadcast(world, "cuda")
