"""DDP communication hooks: GradBucket, allreduce/fp16/bf16 hooks, PowerSGD.

Tolerances, relative to the largest magnitude of the exact (float32, built-in) averaged
gradient of each parameter: fp16_compress_hook 5e-3 and bf16_compress_hook 5e-2
(measured: about 7e-4 and 7e-3 at world sizes 1-4: float16 keeps 11 significant bits,
bfloat16 8, and the ring rounds every partial sum).
"""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest
from mpi4py import MPI
from threadpoolctl import threadpool_limits

from mpidist.data import DistributedSampler, load_digits_split
from mpidist.nn import CrossEntropyLoss, Linear, ReLU, Sequential
from mpidist.optim import SGD
from mpidist.parallel import DistributedDataParallel, GradBucket
from mpidist.parallel.comm_hooks import (
    PowerSGDState,
    allreduce_hook,
    bf16_compress_hook,
    default_hooks,
    fp16_compress_hook,
    powerSGD_hook,
    then,
)

pytestmark = pytest.mark.mpi

FP16_TOL, BF16_TOL = 5e-3, 5e-2


def mlp(seed: int, dtype=np.float32, sizes=(6, 16, 16, 4)) -> Sequential:
    rng = np.random.default_rng(seed)
    layers = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers += [Linear(a, b, dtype=dtype, rng=rng)] + ([ReLU()] if i < len(sizes) - 2 else [])
    return Sequential(*layers)


def batch(step: int, rank: int, dtype=np.float32, n: int = 5, d_in: int = 6, classes: int = 4):
    rng = np.random.default_rng([9, step, rank])
    return rng.standard_normal((n, d_in)).astype(dtype), rng.integers(0, classes, size=n)


def grads_after_step(hook, state=None, seed=0, step=0, dtype=np.float32, **ddp_kw) -> list:
    rank = MPI.COMM_WORLD.Get_rank()
    model = mlp(seed, dtype)
    ddp = DistributedDataParallel(model, bucket_cap_mb=ddp_kw.pop("bucket_cap_mb", 0.001), **ddp_kw)
    if hook is not None:
        ddp.register_comm_hook(state, hook)
    crit = CrossEntropyLoss()
    x, y = batch(step, rank, dtype)
    crit(ddp(x), y)
    ddp.backward(crit.backward())
    return [p.grad.copy() for p in model.parameters()]


def same_on_every_rank(arrays: list) -> bool:
    return len(set(MPI.COMM_WORLD.allgather(b"".join(a.tobytes() for a in arrays)))) == 1


@pytest.mark.parametrize("view", [False, True])
def test_allreduce_hook_equals_builtin_reduction_bitwise(dist, view):
    exact = grads_after_step(None, gradient_as_bucket_view=view)
    got = grads_after_step(default_hooks.allreduce_hook, None, gradient_as_bucket_view=view)
    for a, b in zip(got, exact):
        np.testing.assert_array_equal(a, b)


def test_hook_gets_grad_buckets_with_local_undivided_gradients(dist, world):
    rank, size = world
    seen = []

    def spy(state, bucket: GradBucket):
        assert state == "my state"
        grads = bucket.gradients()
        assert all(np.shares_memory(g, bucket.buffer()) for g in grads)
        assert [g.shape for g in grads] == [p.shape for p in bucket.parameters()]
        seen.append(
            (bucket.index(), bucket.is_last(), [p.name for p in bucket.parameters()], [g.copy() for g in grads])
        )
        return allreduce_hook(None, bucket)

    model = mlp(1)
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.001)
    ddp.register_comm_hook("my state", spy)
    crit = CrossEntropyLoss()
    x, y = batch(0, rank)
    crit(ddp(x), y)
    ddp.backward(crit.backward())
    names = ddp.bucket_parameter_names
    assert [s[0] for s in seen] == list(range(len(names)))
    assert [s[1] for s in seen] == [False] * (len(names) - 1) + [True]
    assert [s[2] for s in seen] == names
    local = mlp(1)  # this rank's own gradient, computed without DDP
    crit(local(x), y)
    local.backward(crit.backward())
    by_name = dict(local.named_parameters())
    for _, _, bucket_names, grads in seen:
        for name, g in zip(bucket_names, grads):
            np.testing.assert_array_equal(g, by_name[name].grad)


@pytest.mark.parametrize("hook, tol", [(fp16_compress_hook, FP16_TOL), (bf16_compress_hook, BF16_TOL)])
def test_compression_hooks_are_close_to_the_exact_average(dist, hook, tol):
    exact = grads_after_step(None, step=1)
    got = grads_after_step(hook, None, step=1)
    assert same_on_every_rank(got)
    for a, b in zip(got, exact):
        assert a.dtype == np.float32
        np.testing.assert_allclose(a, b, rtol=0, atol=tol * np.max(np.abs(b)))


@pytest.mark.parametrize("hook, dtype", [(fp16_compress_hook, np.float16), (bf16_compress_hook, "bfloat16")])
def test_compression_hooks_cast_then_divide_as_torch(dist, world, monkeypatch, hook, dtype):
    """torch 2.13: ``buffer.to(dtype).div_(world_size)``, the division computed in float32 and
    rounded to the compressed dtype. Each rank must send exactly that (dividing while
    casting rounds once, and differs for tiny float16 values and for world sizes that are
    not powers of two). This formula matched torch 2.13 bitwise on 10^5 values of 12
    magnitudes at world sizes 2, 3, 4, 7 and 3001."""
    import ml_dtypes

    import mpidist.parallel.comm_hooks as hooks

    dtype = np.dtype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
    _, size = world
    rng = np.random.default_rng(12)
    x = (rng.standard_normal(4000) * 10.0 ** rng.integers(-9, 3, 4000)).astype(np.float32)
    x[:3] = [1.4 * 2**-24, 3e-8, 1.0 / 3]
    sent = []
    real = hooks.all_reduce

    def capture(tensor, *args, **kwargs):
        sent.append(tensor.copy())
        return real(tensor, *args, **kwargs)

    monkeypatch.setattr(hooks, "all_reduce", capture)
    buffer = x.copy()
    result = hook(None, GradBucket(0, buffer, [], [0, x.size], True)).result()
    (compressed,) = sent
    torch_order = (x.astype(dtype).astype(np.float32) / np.float32(size)).astype(dtype)
    assert compressed.dtype == dtype and compressed.tobytes() == torch_order.tobytes()
    assert result is buffer and buffer.dtype == np.float32


def test_hook_errors_are_clear(dist):
    model = mlp(0)
    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(None, lambda state, bucket: bucket.buffer())
    crit = CrossEntropyLoss()
    x, y = batch(0, MPI.COMM_WORLD.Get_rank())
    crit(ddp(x), y)
    with pytest.raises(TypeError, match=r"the comm hook must return a concurrent.futures.Future, got ndarray"):
        ddp.backward(crit.backward())

    def short(state, bucket):
        done = concurrent.futures.Future()
        done.set_result(np.zeros(3, np.float32))
        return done

    ddp2 = DistributedDataParallel(mlp(0))
    ddp2.register_comm_hook(None, short)
    crit(ddp2(x), y)
    with pytest.raises(
        ValueError,
        match=r"the comm hook's future must hold an array of \d+ elements for bucket 0, "
        r"got \(3,\)",
    ):
        ddp2.backward(crit.backward())


def test_then_chains_and_propagates_errors():
    start = concurrent.futures.Future()
    doubled = then(start, lambda f: f.result() * 2)
    start.set_result(21)
    assert doubled.result() == 42
    failed = concurrent.futures.Future()
    chained = then(failed, lambda f: f.result() + 1)
    failed.set_exception(KeyError("boom"))
    with pytest.raises(KeyError, match="boom"):
        chained.result()


# -- PowerSGD ------------------------------------------------------------------------------------
def test_powersgd_state_validates_arguments():
    with pytest.raises(
        ValueError,
        match=r"PowerSGDState: expect start_powerSGD_iter > 1 if use_error_feedback "
        r"or warm_start is enabled.*got 1",
    ):
        PowerSGDState(None, start_powerSGD_iter=1)
    PowerSGDState(None, start_powerSGD_iter=0, use_error_feedback=False, warm_start=False)
    with pytest.raises(ValueError, match=r"matrix_approximation_rank must be >= 1, got 0"):
        PowerSGDState(None, matrix_approximation_rank=0)
    with pytest.raises(TypeError, match=r"matrix_approximation_rank must be an int, got float"):
        PowerSGDState(None, matrix_approximation_rank=1.5)
    with pytest.raises(ValueError, match=r"min_compression_rate must be a real number >= 0, got -1"):
        PowerSGDState(None, min_compression_rate=-1)
    with pytest.raises(TypeError, match=r"warm_start must be a bool, got int"):
        PowerSGDState(None, warm_start=1)


def test_powersgd_warm_up_is_plain_allreduce(dist):
    state = PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=5)
    exact = grads_after_step(None)
    got = grads_after_step(powerSGD_hook, state)
    for a, b in zip(got, exact):
        np.testing.assert_array_equal(a, b)
    assert state.iter == 1 and not state.p_memory_dict


@pytest.mark.parametrize("warm_start", [True, False])
def test_powersgd_full_rank_reproduces_the_exact_average(dist, world, warm_start):
    """Rank >= min(rows, cols) with min_compression_rate=0 compresses every matrix yet
    loses nothing: P spans the summed gradient's columns, so P P^T M = M. Trained with
    momentum SGD, the model stays on the one-process trajectory (float64, rtol 1e-6)."""
    rank, size = world
    model = mlp(100 + rank, np.float64)
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.001)
    state = PowerSGDState(
        None, matrix_approximation_rank=64, start_powerSGD_iter=2, min_compression_rate=0, warm_start=warm_start
    )
    ddp.register_comm_hook(state, powerSGD_hook)
    ref = mlp(100, np.float64)
    opt, ref_opt = SGD(model.parameters(), lr=0.1, momentum=0.9), SGD(ref.parameters(), lr=0.1, momentum=0.9)
    crit = CrossEntropyLoss()
    for step in range(6):
        opt.zero_grad()
        x, y = batch(step, rank, np.float64)
        crit(ddp(x), y)
        ddp.backward(crit.backward())
        opt.step()
        ref_opt.zero_grad()
        xs, ys = zip(*(batch(step, r, np.float64) for r in range(size)))
        crit(ref(np.concatenate(xs)), np.concatenate(ys))
        ref.backward(crit.backward())
        ref_opt.step()
    assert state.iter == 6 and state.total_numel_after_compression > 0
    assert len(state.p_memory_dict) == (len(ddp.bucket_sizes) if warm_start else 0)
    assert same_on_every_rank([p.data for p in model.parameters()])
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        np.testing.assert_allclose(p.data, q.data, rtol=1e-6, atol=1e-12, err_msg=name)


def test_powersgd_rank1_is_lossy_identical_on_ranks_and_reports_stats(dist, world):
    state = PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2)
    model = mlp(7)
    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(state, powerSGD_hook)
    crit = CrossEntropyLoss()
    rank, _ = world
    for step in range(3):
        ddp.zero_grad()
        x, y = batch(step, rank)
        crit(ddp(x), y)
        ddp.backward(crit.backward())
    assert same_on_every_rank([p.grad for p in model.parameters()])
    # one compressed step (steps 0 and 1 are the warm-up): 16x6 -> 16+6, 16x16 -> 32, 4x16 -> 20
    weights = [p for p in model.parameters() if p.ndim == 2]
    compressed = [(p.shape[0] + p.shape[1]) if (p.shape[0] + p.shape[1]) * 2 < p.size else p.size for p in weights]
    before = sum(p.size for p in model.parameters())
    after = sum(compressed) + sum(p.size for p in model.parameters() if p.ndim == 1)
    rate, total_before, total_after = state.compression_stats()
    assert (total_before, total_after) == (before, after)
    assert rate == pytest.approx(before / after)
    # the low-rank result is the rank-1 approximation of something: each weight grad has rank 1
    for p in weights:
        if (p.shape[0] + p.shape[1]) * 2 < p.size:
            assert np.linalg.matrix_rank(p.grad.astype(np.float64), tol=1e-5 * np.abs(p.grad).max()) == 1


def test_powersgd_trains_the_digits_mlp(dist, world):
    """train_digits.py's model and settings (30 epochs, batch 16 per rank, lr 0.05,
    momentum 0.9) with rank-1 PowerSGD after 10 plain steps reach >= 0.93 test accuracy."""
    rank, size = world
    x_train, y_train, x_test, y_test = load_digits_split(seed=0)
    rng = np.random.default_rng(rank)
    model = Sequential(Linear(64, 128, rng=rng), ReLU(), Linear(128, 128, rng=rng), ReLU(), Linear(128, 10, rng=rng))
    ddp = DistributedDataParallel(model)
    state = PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=10)
    ddp.register_comm_hook(state, powerSGD_hook)
    opt, crit = SGD(model.parameters(), lr=0.05, momentum=0.9), CrossEntropyLoss()
    sampler = DistributedSampler(x_train, num_replicas=size, rank=rank, shuffle=True, seed=0)
    steps = -(-len(sampler) // 16)
    with threadpool_limits(limits=1):
        for epoch in range(30):
            sampler.set_epoch(epoch)
            order = np.fromiter(sampler, dtype=np.int64)
            for step in range(steps):
                idx = order[step * 16 : (step + 1) * 16]
                opt.zero_grad()
                crit(ddp(x_train[idx]), y_train[idx])
                ddp.backward(crit.backward())
                opt.step()
    assert state.iter == 30 * steps and state.compression_stats()[0] > 10
    correct = np.sum(model(x_test).argmax(axis=1) == y_test)
    assert correct / len(y_test) >= 0.93
    assert same_on_every_rank([p.data for p in model.parameters()])


def test_powersgd_under_join_with_uneven_inputs(dist, world):
    """Joined ranks run the hook on zeros, so every rank's PowerSGD state advances alike
    and nobody hangs; every rank ends with the last rank's model."""
    rank, size = world
    model = mlp(3)
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.001)
    state = PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2)
    ddp.register_comm_hook(state, powerSGD_hook)
    opt, crit = SGD(model.parameters(), lr=0.1), CrossEntropyLoss()
    with ddp.join():
        for step in range(3 + rank):
            opt.zero_grad()
            x, y = batch(step, rank)
            crit(ddp(x), y)
            ddp.backward(crit.backward())
            opt.step()
    assert state.iter == 3 + size - 1
    assert same_on_every_rank([p.data for p in model.parameters()])
