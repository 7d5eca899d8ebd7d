"""DistributedDataParallel: equivalence with one process, bitwise agreement, overlap, errors."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from mpidist.nn import CrossEntropyLoss, Linear, ReLU, Sequential
from mpidist.optim import SGD
from mpidist.parallel import DistributedDataParallel

pytestmark = pytest.mark.mpi

D_IN, HIDDEN, CLASSES, BATCH, STEPS = 6, 16, 4, 3, 6


def mlp(seed: int, hidden: int = HIDDEN) -> Sequential:
    rng = np.random.default_rng(seed)
    return Sequential(
        Linear(D_IN, hidden, dtype=np.float64, rng=rng),
        ReLU(),
        Linear(hidden, hidden, dtype=np.float64, rng=rng),
        ReLU(),
        Linear(hidden, CLASSES, dtype=np.float64, rng=rng),
    )


def data(world_size: int):
    rng = np.random.default_rng(1234)
    x = rng.standard_normal((STEPS, world_size * BATCH, D_IN))
    y = rng.integers(0, CLASSES, size=(STEPS, world_size * BATCH))
    return x, y


def params_bytes(model) -> bytes:
    return b"".join(p.data.tobytes() for p in model.parameters())


@pytest.mark.parametrize("bucket_cap_mb", [25, 0.002])
@pytest.mark.parametrize("algorithm", ["mpi", "ring"])
def test_ddp_equals_one_process_on_the_global_batch(dist, world, algorithm, bucket_cap_mb):
    rank, size = world
    x, y = data(size)
    # every rank starts from different weights: DDP must broadcast rank 0's
    model = mlp(seed=100 + rank)
    ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb, algorithm=algorithm)
    opt = SGD(model.parameters(), lr=0.1, momentum=0.9)
    crit = CrossEntropyLoss()

    ref = mlp(seed=100)
    ref_opt = SGD(ref.parameters(), lr=0.1, momentum=0.9)
    ref_crit = CrossEntropyLoss()

    mine = slice(rank * BATCH, (rank + 1) * BATCH)
    for step in range(STEPS):
        opt.zero_grad()
        crit(ddp(x[step, mine]), y[step, mine])
        ddp.backward(crit.backward())
        opt.step()
        assert len(set(MPI.COMM_WORLD.allgather(params_bytes(model)))) == 1, f"ranks differ after step {step}"

        ref_opt.zero_grad()
        ref_crit(ref(x[step]), y[step])
        ref.backward(ref_crit.backward())
        ref_opt.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        np.testing.assert_allclose(p.data, q.data, rtol=1e-6, atol=1e-12, err_msg=name)


def test_construction_broadcasts_rank0_parameters(dist, world):
    rank, _ = world
    model = mlp(seed=rank)
    DistributedDataParallel(model)
    want = mlp(seed=0)
    for p, q in zip(model.parameters(), want.parameters()):
        np.testing.assert_array_equal(p.data, q.data)


def test_buckets_follow_reverse_parameter_order_and_cap(dist):
    model = mlp(seed=0)
    sizes = [p.data.size for p in model.parameters()]
    one = DistributedDataParallel(model, bucket_cap_mb=25)
    assert one.bucket_sizes == [sum(sizes)]
    per_param = DistributedDataParallel(model, bucket_cap_mb=1e-9)
    assert per_param.bucket_sizes == sizes[::-1]
    cap = (sizes[-1] + sizes[-2]) * 8 / 2**20  # the last layer's weight and bias fit exactly
    two = DistributedDataParallel(model, bucket_cap_mb=cap)
    assert two.bucket_sizes[0] == sizes[-1] + sizes[-2]


def test_allreduce_starts_before_backward_ends(dist, world):
    """With one bucket per layer, the last layer's bucket is launched while earlier layers still run backward."""
    model = mlp(seed=0)
    ddp = DistributedDataParallel(model, bucket_cap_mb=1e-9)
    first = model[0]
    launched_when_first_layer_ran = []
    original = first.backward

    def spy(grad):
        launched_when_first_layer_ran.append(ddp.reducer._next)
        return original(grad)

    first.backward = spy
    crit = CrossEntropyLoss()
    x, y = data(1)
    crit(ddp(x[0]), y[0])
    ddp.backward(crit.backward())
    assert launched_when_first_layer_ran and launched_when_first_layer_ran[0] >= 4


@pytest.mark.mpi(min_size=2)
def test_different_models_across_ranks_rejected(dist, world):
    rank, _ = world
    model = mlp(seed=0, hidden=HIDDEN + (rank == 1))
    with pytest.raises(
        ValueError, match=r"DistributedDataParallel: the model's parameter shapes/dtypes on ranks \[1\] differ"
    ):
        DistributedDataParallel(model)


def test_parameter_without_gradient_is_an_error(dist):
    model = mlp(seed=0)
    ddp = DistributedDataParallel(model, bucket_cap_mb=1e-9)
    # a module whose backward skips the first layer's parameters
    original = model[0].backward
    model[0].backward = lambda grad: grad @ model[0].weight.data
    crit = CrossEntropyLoss()
    x, y = data(1)
    crit(ddp(x[0]), y[0])
    with pytest.raises(
        RuntimeError, match=r"parameters got no gradient in this backward pass: \['0.weight', '0.bias'\]"
    ):
        ddp.backward(crit.backward())
    model[0].backward = original
    dist.barrier()


def test_bad_arguments_rejected(dist):
    with pytest.raises(
        ValueError, match=r"algorithm must be None or one of \('mpi', 'ring', 'shm', 'hierarchical'\), got 'tree'"
    ):
        DistributedDataParallel(mlp(0), algorithm="tree")
    with pytest.raises(ValueError, match=r"bucket_cap_mb must be > 0, got 0"):
        DistributedDataParallel(mlp(0), bucket_cap_mb=0)
