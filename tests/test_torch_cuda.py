"""CUDA tensors on backend "mpidist", without a GPU: the routing, tested with stand-ins.

* :class:`mpidist.torch._cuda.CudaTensor` over a tensor in host memory with a fake
  stream goes through mpidist's device router like any device array: here (an MPI that
  is not CUDA-aware) host staging with :class:`~mpidist.torch._cuda.TorchRuntime`, after
  synchronizing the tensor's stream, never the host path.
* A fake CUDA tensor (a tensor subclass that says ``is_cuda`` and refuses ``numpy()``,
  as a CUDA tensor does) through torch's own front end: the backend hands it to the
  router inside torch's stream context, copies non-contiguous results back, and waits
  for async ops in the stream context.

The same calls on a real GPU: tests/gpu/test_torch_gpu.py. Runs serially and under
mpiexec -n 2, 3, 4.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

torch = pytest.importorskip("torch")
tdist = pytest.importorskip("torch.distributed")
ml_dtypes = pytest.importorskip("ml_dtypes")

from torch_helpers import torch_world  # noqa: E402

import mpidist  # noqa: E402
from mpidist._arrays.namespace import is_device_array  # noqa: E402
from mpidist._backends.device import staging  # noqa: E402
from mpidist.device import detect  # noqa: E402
from mpidist.torch import _backend, _cuda  # noqa: E402

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module", autouse=True)
def world():
    with torch_world():
        if detect.detection().aware:
            pytest.skip("this MPI reports CUDA-awareness: these tests check the host-staging route")
        yield tdist.get_rank(), tdist.get_world_size()


class FakeStream:
    """A torch.cuda.Stream stand-in that counts synchronizations."""

    cuda_stream = 0x1234

    def __init__(self) -> None:
        self.syncs = 0

    def synchronize(self) -> None:
        self.syncs += 1


class FakeCudaTensor(torch.Tensor):
    """Host memory that presents itself as a CUDA tensor: ``is_cuda`` is True and
    ``numpy()`` fails as it does on a CUDA tensor, so only a device path can move it."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def is_cuda(self) -> bool:
        return True

    def numpy(self, *args, **kwargs):
        raise TypeError("can't convert cuda:0 device type tensor to numpy")


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch's current stream -> a FakeStream; the stream context records its uses."""
    stream, entered = FakeStream(), []

    class Context:  # reusable, as CuPy's stream objects are (an async op's Work enters it again)
        def __enter__(self):
            entered.append(True)

        def __exit__(self, *exc):
            return None

    monkeypatch.setattr(_cuda, "stream_of", lambda device=None: stream)
    monkeypatch.setattr(_cuda, "current_stream", lambda s: Context())
    return stream, entered


def _staged_buffers() -> int:
    pool = staging.pool_for(_cuda.RUNTIME)
    return pool.allocated + pool.reused


def test_cuda_tensor_is_a_device_array_staged_with_its_stream(world):
    r, n = world
    stream = FakeStream()
    for dtype in (torch.float32, torch.bfloat16):
        t = torch.full((5,), float(r + 1)).to(dtype)
        x = _cuda.CudaTensor(t, stream, _cuda._numpy_dtype(dtype, "test", "t"))
        assert is_device_array(x) and x.__cuda_array_interface__["stream"] == FakeStream.cuda_stream
        before = _staged_buffers()
        mpidist.all_reduce(x)
        assert _staged_buffers() > before  # host staging through TorchRuntime's pinned pool
        assert torch.equal(t, torch.full((5,), float(n * (n + 1) // 2)).to(dtype))
    assert stream.syncs >= 2  # its stream synchronized before MPI read it


def test_fake_cuda_tensor_through_torch_front_end(world, fake_cuda):
    r, n = world
    stream, entered = fake_cuda
    t = torch.full((3,), float(r)).as_subclass(FakeCudaTensor)
    tdist.all_reduce(t)
    assert torch.equal(t.as_subclass(torch.Tensor), torch.full((3,), float(sum(range(n)))))
    assert entered and stream.syncs >= 1
    # bfloat16, which CuPy lacks; a non-contiguous output (a temporary, copied back)
    big = torch.zeros(4, 4, dtype=torch.bfloat16)
    view = big[:, 1].as_subclass(FakeCudaTensor)
    view.fill_(1.0)
    tdist.all_reduce(view)
    assert torch.equal(big[:, 1], torch.full((4,), float(n), dtype=torch.bfloat16))
    assert torch.equal(big[:, 0], torch.zeros(4, dtype=torch.bfloat16))


def test_fake_cuda_async_work_waits_in_the_stream(world, fake_cuda):
    r, n = world
    _, entered = fake_cuda
    out = torch.empty(2 * n).as_subclass(FakeCudaTensor)
    work = tdist.all_gather_into_tensor(out, torch.full((2,), float(r)).as_subclass(FakeCudaTensor), async_op=True)
    calls = len(entered)
    work.wait()
    assert len(entered) == calls + 1
    assert torch.equal(out.as_subclass(torch.Tensor), torch.arange(float(n)).repeat_interleave(2))


def test_host_and_cuda_tensors_mixed_are_refused(world, fake_cuda):
    r, n = world
    with pytest.raises(TypeError, match="device"):
        tdist.all_gather_into_tensor(torch.empty(2 * n), torch.ones(2).as_subclass(FakeCudaTensor))


@pytest.mark.parametrize(
    "gpus,version,env,want",
    [
        ("enough", 22809, None, "cpu:mpi,cuda:nccl"),  # a GPU per rank: any NCCL
        ("fewer", 22809, "1", "mpi"),  # ranks share a GPU, NCCL 2.28: it would fail (H200 run)
        ("fewer", 23000, None, "mpi"),
        ("fewer", 23000, "1", "cpu:mpi,cuda:nccl"),
    ],
)
def test_runtime_backend_for_cuda_tensors(monkeypatch, gpus, version, env, want):
    from fake_nccl import FakeShim  # noqa: PLC0415

    from mpidist._backends.device import nccl_shim  # noqa: PLC0415

    monkeypatch.setattr(mpidist, "is_nccl_available", lambda: False)
    assert _backend._device_backend() == "mpi"
    monkeypatch.setattr(mpidist, "is_nccl_available", lambda: True)
    on_node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED).Get_size()
    monkeypatch.setattr(torch.cuda, "device_count", lambda: on_node if gpus == "enough" else on_node - 1)
    if env is None:
        monkeypatch.delenv("NCCL_MULTI_RANK_GPU_ENABLE", raising=False)
    else:
        monkeypatch.setenv("NCCL_MULTI_RANK_GPU_ENABLE", env)
    previous = nccl_shim.use(FakeShim(version=version))
    try:
        assert _backend._device_backend() == want
    finally:
        nccl_shim.use(previous)


def test_cuda_dtypes_map_to_numpy_and_ml_dtypes():
    assert _cuda._numpy_dtype(torch.bfloat16, "op", "t") == np.dtype(ml_dtypes.bfloat16)
    assert _cuda._numpy_dtype(torch.float8_e4m3fn, "op", "t") == np.dtype(ml_dtypes.float8_e4m3fn)
    assert _cuda._numpy_dtype(torch.complex64, "op", "t") == np.complex64
    with pytest.raises(TypeError, match="cannot communicate"):
        _cuda._numpy_dtype(torch.complex32, "op", "t")
