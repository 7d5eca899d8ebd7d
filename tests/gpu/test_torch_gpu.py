"""CUDA tensors on backend "mpidist" on a real GPU (needs torch with CUDA, and CuPy for
the NCCL path; skipped with the reason elsewhere; the routing is tested without a GPU
in tests/test_torch_cuda.py).

Run: ``python -m pytest --with-mpi -q tests/gpu/test_torch_gpu.py`` and under
``mpiexec -n 2`` (two ranks may share one GPU). torch's default group starts mpidist's
runtime, whose CUDA tensors take NCCL where CuPy has it (else CUDA-aware MPI or staging).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("torch sees no CUDA device (or is a CPU build)", allow_module_level=True)

import torch.distributed as tdist  # noqa: E402
from torch_helpers import assert_ddp_step_matches_one_process  # noqa: E402

import mpidist.torch  # noqa: E402, F401

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module", autouse=True)
def world():
    started = not tdist.is_initialized()
    if started:
        tdist.init_process_group("mpidist")
    torch.cuda.set_device(tdist.get_rank() % torch.cuda.device_count())
    yield tdist.get_rank(), tdist.get_world_size()
    if started:
        tdist.destroy_process_group()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64])
def test_all_reduce_cuda(world, dtype):
    r, n = world
    t = torch.full((1000,), r + 1, dtype=dtype, device="cuda")
    tdist.all_reduce(t)
    assert torch.equal(t.cpu(), torch.full((1000,), n * (n + 1) // 2, dtype=dtype))


def test_stream_order_side_stream(world):
    """Data produced on a side stream, the op issued in it, results read in it."""
    r, n = world
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        big = torch.ones(1 << 22, device="cuda")
        t = (big * (r + 1)).sum().reshape(1) / (1 << 22)  # a kernel still running, maybe
        tdist.all_reduce(t)
        t.mul_(2)
    side.synchronize()
    assert t.item() == 2.0 * n * (n + 1) / 2


def test_async_and_gathers_cuda(world):
    r, n = world
    t = torch.full((4,), float(r), device="cuda")
    work = tdist.all_reduce(t, async_op=True)
    work.wait()
    assert t[0].item() == float(sum(range(n)))
    out = torch.empty(4 * n, device="cuda")
    mine = torch.full((4,), float(r), device="cuda")
    tdist.all_gather_into_tensor(out, mine)
    assert torch.equal(out.cpu(), torch.arange(float(n)).repeat_interleave(4))
    b = torch.arange(3.0, device="cuda") * (r + 1)
    tdist.broadcast(b, src=0)
    assert torch.equal(b.cpu(), torch.arange(3.0))


def test_ddp_cuda_matches_cpu_reference(world):
    r, n = world
    assert_ddp_step_matches_one_process(r, n)
