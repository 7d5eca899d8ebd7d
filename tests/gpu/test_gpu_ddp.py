"""The model toolkit, DDP and the ring all-reduce on cupy arrays (needs a GPU and cupy).

Run: ``python -m pytest --with-mpi -q tests/gpu/test_gpu_ddp.py`` and under
``mpiexec -n 2`` (two ranks may share one GPU). Skipped, with the reason, where cupy
is not installed or no CUDA device is visible; the ring tests also need a CUDA-aware
MPI (``mpidist.cuda_aware_mpi()`` where that exists, else ``MPIDIST_CUDA_AWARE=1``).
The CPU suite covers the same code with a stand-in array module (tests/test_ddp_xp.py);
this file checks what only real cupy shows: its kernels, streams, cuSOLVER's QR and
the device paths of the collectives underneath DDP.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from mpi4py import MPI

cupy = pytest.importorskip("cupy", reason="cupy is not installed")

import mpidist  # noqa: E402
from mpidist._arrays.reduce_op import ReduceOp  # noqa: E402
from mpidist.algorithms import ring_all_reduce  # noqa: E402
from mpidist.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from mpidist.nn import CrossEntropyLoss, Linear, ReLU, Sequential  # noqa: E402
from mpidist.optim import SGD  # noqa: E402
from mpidist.parallel import DistributedDataParallel  # noqa: E402
from mpidist.parallel.comm_hooks import PowerSGDState, fp16_compress_hook, powerSGD_hook  # noqa: E402


def _device_count() -> int:
    try:
        return cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError:
        return 0


if _device_count() == 0:
    pytest.skip("no CUDA device visible to cupy", allow_module_level=True)


def _cuda_aware() -> bool:
    """mpidist's CUDA-awareness verdict where it has one, else MPIDIST_CUDA_AWARE=1."""
    detect = getattr(mpidist, "cuda_aware_mpi", None)
    if callable(detect):
        return bool(detect())
    return os.environ.get("MPIDIST_CUDA_AWARE") == "1"


@pytest.fixture(autouse=True)
def _bind_device():
    """Each rank on GPU ``rank % device_count`` (torch's launch convention)."""
    with cupy.cuda.Device(MPI.COMM_WORLD.Get_rank() % _device_count()):
        yield


D_IN, HIDDEN, CLASSES, BATCH, STEPS = 16, 64, 5, 8, 5


def mlp(seed: int) -> Sequential:
    rng = np.random.default_rng(seed)
    return Sequential(
        Linear(D_IN, HIDDEN, rng=rng), ReLU(), Linear(HIDDEN, HIDDEN, rng=rng), ReLU(), Linear(HIDDEN, CLASSES, rng=rng)
    )


def batches(world_size: int, rank: int):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((STEPS, world_size * BATCH, D_IN)).astype(np.float32)
    y = rng.integers(0, CLASSES, size=(STEPS, world_size * BATCH))
    mine = slice(rank * BATCH, (rank + 1) * BATCH)
    return x[:, mine], y[:, mine]


def test_module_to_cuda_and_back_round_trip():
    model = mlp(0)
    before = [p.data.copy() for p in model.parameters()]
    params = model.parameters()
    model.to("cuda")
    assert model.parameters() == params
    for p, b in zip(params, before):
        assert isinstance(p.data, cupy.ndarray) and p.data.device.id == cupy.cuda.Device().id
        assert cupy.asnumpy(p.data).tobytes() == b.tobytes()
    x = np.random.default_rng(1).standard_normal((3, D_IN)).astype(np.float32)
    with pytest.raises(
        TypeError,
        match=r"Linear.forward: x must be on cuda:\d \(the device of parameter "
        r"'0.weight'\), got a cpu array",
    ):
        model(x)
    out = model(cupy.asarray(x))
    assert isinstance(out, cupy.ndarray)
    np.testing.assert_allclose(cupy.asnumpy(out), mlp(0)(x), rtol=1e-5, atol=1e-6)
    model.cpu()
    for p, b in zip(params, before):
        assert type(p.data) is np.ndarray and p.data.tobytes() == b.tobytes()


def test_checkpoint_of_a_gpu_model_loads_back_onto_the_gpu(tmp_path):
    model = mlp(0).to("cuda")
    save_checkpoint(tmp_path / "m.npz", model.state_dict())
    loaded = load_checkpoint(tmp_path / "m.npz")
    assert all(type(a) is np.ndarray for a in loaded.values())
    other = mlp(1).to("cuda")
    other.load_state_dict(loaded)
    for p, q in zip(other.parameters(), model.parameters()):
        assert isinstance(p.data, cupy.ndarray) and bool((p.data == q.data).all())


CONFIGS = {
    "builtin": ({}, None, 1e-5),
    "bucket-view": ({"gradient_as_bucket_view": True, "bucket_cap_mb": 0.01}, None, 1e-5),
    "ring": ({"algorithm": "ring"}, None, 1e-5),
    "fp16": ({}, "fp16", 2e-2),
    "powersgd-rank1": ({}, dict(matrix_approximation_rank=1), 1e-3),
    "powersgd-rank4": ({}, dict(matrix_approximation_rank=4), 1e-3),
}


@pytest.mark.mpi
@pytest.mark.parametrize("config", list(CONFIGS))
def test_mlp_on_cupy_under_ddp_matches_numpy_and_agrees_across_ranks(dist, world, config):
    rank, size = world
    opts, hook, tol = CONFIGS[config]
    x, y = batches(size, rank)
    models = []
    for on_gpu in (False, True):
        model = mlp(100 + rank)
        if on_gpu:
            model.to("cuda")
        ddp = DistributedDataParallel(model, **opts)
        if hook == "fp16":
            ddp.register_comm_hook(None, fp16_compress_hook)
        elif hook is not None:
            ddp.register_comm_hook(PowerSGDState(None, start_powerSGD_iter=2, **hook), powerSGD_hook)
        models.append(
            (
                model,
                ddp,
                SGD(model.parameters(), lr=0.05, momentum=0.9),
                CrossEntropyLoss(),
                cupy.asarray if on_gpu else np.asarray,
            )
        )
    for _model, ddp, opt, crit, to_device in models:
        for step in range(STEPS):
            opt.zero_grad()
            crit(ddp(to_device(x[step])), to_device(y[step]))
            ddp.backward(crit.backward())
            opt.step()
    (ref, *_), (gpu, ddp, *_) = models
    assert all(isinstance(b.flat, cupy.ndarray) for b in ddp.reducer.buckets)
    mine = b"".join(cupy.asnumpy(p.data).tobytes() for p in gpu.parameters())
    assert len(set(MPI.COMM_WORLD.allgather(mine))) == 1, "ranks' GPU models differ"
    for (name, p), q in zip(gpu.named_parameters(), ref.parameters()):
        np.testing.assert_allclose(cupy.asnumpy(p.data), q.data, rtol=tol, atol=tol, err_msg=name)


@pytest.mark.mpi
@pytest.mark.parametrize(
    "dtype, op",
    [
        ("float32", ReduceOp.SUM),
        ("float32", ReduceOp.MAX),
        ("float16", ReduceOp.SUM),
        ("int32", ReduceOp.SUM),
        ("bool", ReduceOp.BOR),
    ],
)
def test_ring_all_reduce_on_cupy_arrays(dist, dtype, op):
    if not _cuda_aware():
        pytest.skip("the ring on device arrays needs a CUDA-aware MPI (MPIDIST_CUDA_AWARE=1 or detected)")
    comm = MPI.COMM_WORLD.Dup()
    try:
        n, rank = comm.Get_size(), comm.Get_rank()
        data = (np.random.default_rng(rank).standard_normal(1_000_003) * 4).astype(dtype)
        on_host = data.copy()
        ring_all_reduce(comm, on_host, op)
        on_gpu = cupy.asarray(data).copy()  # queued device work the ring must wait for
        ring_all_reduce(comm, on_gpu, op)
        got = cupy.asnumpy(on_gpu)
        if dtype == "float16":
            np.testing.assert_allclose(got.astype(np.float32), on_host.astype(np.float32), rtol=2e-3, atol=2e-3)
        else:
            assert got.tobytes() == on_host.tobytes()
        everyone = comm.allgather(got.tobytes())
        assert len(set(everyone)) == 1 and n == len(everyone)
    finally:
        comm.Free()
