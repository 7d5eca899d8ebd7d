"""CUDA tensors on backend "mpidist" over an NCCL group, without a GPU: a dense contiguous
CUDA tensor goes straight to mpidist's NCCL path (``ProcessGroupMpidist.allreduce`` ->
``mpidist.torch._cuda.nccl_dev`` -> ``mpidist._backends.device.nccl.all_reduce`` in torch's current
stream), skipping the generic array layers; what that path does not take (integer AVG, a
non-contiguous tensor) takes the general one. Stand-ins: tests/fake_nccl.py's FakeShim (NCCL
over MPI on host memory) and a CPU tensor that says it is a CUDA tensor. Runs serially and
under mpiexec -n 2, 3, 4.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tdist = pytest.importorskip("torch.distributed")

from fake_nccl import FakeShim  # noqa: E402

import mpidist  # noqa: E402
import mpidist.torch  # noqa: E402, F401
from mpidist._backends.device import nccl_shim  # noqa: E402
from mpidist.torch import _cuda  # noqa: E402
from mpidist.torch._process_group import _ASYNC_IN_OPTS  # noqa: E402

pytestmark = pytest.mark.mpi


class FakeCudaTensor(torch.Tensor):
    """Host memory that says it is a CUDA tensor on device 0."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def is_cuda(self) -> bool:
        return True

    def get_device(self) -> int:
        return 0

    def numpy(self, *args, **kwargs):
        raise TypeError("can't convert cuda:0 device type tensor to numpy")


class Stream:
    """torch's current stream as the stand-ins see it: the FakeShim's caller stream (its
    ``ptr``, its pending requests) as a context manager that counts its uses (CuPy's
    stream object for torch's stream)."""

    def __init__(self, inner) -> None:
        object.__setattr__(self, "inner", inner)
        object.__setattr__(self, "entered", 0)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __setattr__(self, name, value):
        setattr(self.inner, name, value)

    def __enter__(self):
        object.__setattr__(self, "entered", self.entered + 1)

    def __exit__(self, *exc):
        return None


@pytest.fixture(scope="module")
def world():
    """mpidist over "cpu:mpi,cuda:nccl" with a FakeShim, then torch's default group on it
    (the earlier tests' runtime, on backend "mpi", is destroyed first)."""
    if tdist.is_initialized():
        tdist.destroy_process_group()
    if mpidist.is_initialized():
        mpidist.destroy_process_group()
    fake = FakeShim()
    previous = nccl_shim.use(fake)
    mpidist.init_process_group(backend="cpu:mpi,cuda:nccl")
    tdist.init_process_group("mpidist")
    yield tdist.get_rank(), tdist.get_world_size(), fake
    tdist.destroy_process_group()
    mpidist.destroy_process_group()
    nccl_shim.use(previous)


@pytest.fixture
def stream(world, monkeypatch):
    s = Stream(world[2].current_stream())
    monkeypatch.setattr(_cuda, "_raw_stream", lambda index: 0)
    monkeypatch.setattr(_cuda, "_current_stream", lambda device=None: s)
    monkeypatch.setattr(_cuda, "stream_of", lambda device=None: s)
    monkeypatch.setattr(_cuda, "current_stream", lambda torch_stream: s)
    calls = []
    real = _cuda.nccl_dev
    monkeypatch.setattr(_cuda, "nccl_dev", lambda t: calls.append(t) or real(t))
    return s, calls


def fake_cuda(values) -> torch.Tensor:
    return torch.as_tensor(values).clone().as_subclass(FakeCudaTensor)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bfloat16])
def test_straight_to_nccl(world, stream, dtype):
    r, n, fake = world
    s, calls = stream
    t = fake_cuda(torch.full((5,), r + 1, dtype=dtype))
    mark = len(fake.log)
    tdist.all_reduce(t)
    nccl_shim.get().synchronize(nccl_shim.get().current_stream())  # the host reads after its stream
    ran = [e for e in fake.log[mark:] if e[:2] == ("nccl", "allReduce")]
    assert calls and len(ran) == 1
    if _ASYNC_IN_OPTS:  # torch >= 2.8 says the call is sync: it runs on torch's current stream
        assert ran[0][2] == fake.current_stream().ptr
    assert torch.equal(t.as_subclass(torch.Tensor), torch.full((5,), n * (n + 1) // 2, dtype=dtype))


def test_async_waits_in_torch_stream(world, stream):
    r, n, fake = world
    s, calls = stream
    t = fake_cuda(np.arange(4.0) * (r + 1))
    work = tdist.all_reduce(t, op=tdist.ReduceOp.MAX, async_op=True)
    before = s.entered
    work.wait()
    assert calls and s.entered == before + 1  # the Work waits in torch's current stream
    fake.synchronize(fake.current_stream())
    assert torch.equal(t.as_subclass(torch.Tensor), torch.arange(4.0) * n)


def test_what_the_straight_path_does_not_take(world, stream):
    """Integer AVG (a SUM, then a division) and a non-contiguous tensor take the general path."""
    r, n, fake = world
    s, calls = stream
    t = fake_cuda(torch.full((3,), 4 * n, dtype=torch.int64))
    tdist.all_reduce(t, op=tdist.ReduceOp.AVG)
    assert not calls
    assert torch.equal(t.as_subclass(torch.Tensor), torch.full((3,), 4 * n, dtype=torch.int64))
    base = torch.zeros(4, 2)
    view = base[:, 0].as_subclass(FakeCudaTensor)
    view.fill_(1.0)
    tdist.all_reduce(view)
    assert len(calls) == 1  # tried, refused: not contiguous
    assert torch.equal(base[:, 0], torch.full((4,), float(n))) and torch.equal(base[:, 1], torch.zeros(4))
