"""The tutorials' torch programs, ported line for line to mpidist, so a torch user's habits
are covered end to end (short runs, every world size).

Seed 001 (the distributed-SGD tutorial, pytorch.org/tutorials/intermediate/dist_tuto.html):
``torch.manual_seed(1234)``, a Net with Dropout and ``log_softmax``, ``F.nll_loss``, a seeded
DataPartitioner, ``loss.item()`` and the hand-written ``average_gradients`` that all-reduces
``param.grad.data`` and divides ``param.grad.data /= size``. MNIST becomes scikit-learn's
digits (no download) and the convolutions an MLP (mpidist.nn has no Conv2d).

Seed 003 (the DDP tutorial, pytorch.org/tutorials/intermediate/ddp_tutorial.html):
``demo_basic`` (ToyModel, MSELoss, one SGD step) and ``demo_checkpoint`` (rank 0 saves
``ddp_model.state_dict()``, a barrier, every rank loads it into ``ddp_model``; a bare model
loads it after ``consume_prefix_in_state_dict_if_present``). ``mp.spawn``/``MASTER_ADDR``
become ``mpiexec``; ``device_ids=[rank]`` goes (host arrays); ``torch.save``/``torch.load``
become ``save_checkpoint``/``load_checkpoint``; ``loss.backward()`` becomes
``model.backward(loss_fn.backward())``. Remaining differences: docs/ddp.md, "The model
toolkit, coming from torch".
"""

from __future__ import annotations

import os
import tempfile
from math import ceil
from random import Random

import numpy as np
import pytest
from mpi4py import MPI
from threadpoolctl import threadpool_limits

import mpidist as dist
from mpidist.checkpoint import load_checkpoint, save_checkpoint
from mpidist.data import load_digits_split
from mpidist.nn import (
    Dropout,
    Linear,
    LogSoftmax,
    Module,
    MSELoss,
    NLLLoss,
    ReLU,
    consume_prefix_in_state_dict_if_present,
    manual_seed,
)
from mpidist.optim import SGD
from mpidist.parallel import DistributedDataParallel as DDP

pytestmark = pytest.mark.mpi


def same_on_every_rank(model) -> bool:
    flat = b"".join(p.data.tobytes() for p in model.parameters())
    return len(set(MPI.COMM_WORLD.allgather(flat))) == 1


# -- seed 001: distributed synchronous SGD by hand ------------------------------------------------
class Partition:
    """Dataset partitioning helper"""

    def __init__(self, data, index):
        self.data = data
        self.index = index

    def __len__(self):
        return len(self.index)

    def __getitem__(self, index):
        data_idx = self.index[index]
        return self.data[data_idx]


class DataPartitioner:
    def __init__(self, data, sizes=(0.7, 0.2, 0.1), seed=1234):
        self.data = data
        self.partitions = []
        rng = Random()
        rng.seed(seed)
        data_len = len(data)
        indexes = [x for x in range(0, data_len)]
        rng.shuffle(indexes)

        for frac in sizes:
            part_len = int(frac * data_len)
            self.partitions.append(indexes[0:part_len])
            indexes = indexes[part_len:]

    def use(self, partition):
        return Partition(self.data, self.partitions[partition])


class Net(Module):
    """The tutorial's MNIST Net with the convolutions replaced by a linear layer:
    fc1 -> relu -> dropout -> fc2 -> log_softmax (backward in reverse: no autograd)."""

    def __init__(self):
        super().__init__()
        self.fc1 = Linear(64, 50)
        self.relu = ReLU()
        self.drop = Dropout()  # F.dropout(x, training=self.training)
        self.fc2 = Linear(50, 10)
        self.log_softmax = LogSoftmax(dim=1)

    def forward(self, x):
        return self.log_softmax(self.fc2(self.drop(self.relu(self.fc1(x)))))

    def backward(self, grad):
        grad = self.log_softmax.backward(grad)
        return self.fc1.backward(self.relu.backward(self.drop.backward(self.fc2.backward(grad))))


def partition_dataset(generator):
    x_train, y_train, _, _ = load_digits_split(seed=0)
    dataset = list(zip(x_train, y_train))
    size = dist.get_world_size()
    bsz = int(128 / float(size))  # the tutorial passes the float to DataLoader
    partition_sizes = [1.0 / size for _ in range(size)]
    partition = DataPartitioner(dataset, partition_sizes)
    partition = partition.use(dist.get_rank())

    def train_set():  # DataLoader(partition, batch_size=bsz, shuffle=True)
        order = generator.permutation(len(partition))
        for b in range(0, len(order), bsz):
            xs, ys = zip(*(partition[i] for i in order[b : b + bsz]))
            yield np.stack(xs), np.array(ys)

    return train_set, len(partition), bsz


def average_gradients(model):
    """Gradient averaging."""
    size = float(dist.get_world_size())
    for param in model.parameters():
        dist.all_reduce(param.grad.data, op=dist.ReduceOp.SUM)
        param.grad.data /= size


def run_001(epochs):
    """Distributed Synchronous SGD Example"""
    generator = manual_seed(1234)  # torch.manual_seed(1234): init, dropout and shuffling
    train_set, n, bsz = partition_dataset(generator)
    model = Net()
    optimizer = SGD(model.parameters(), lr=0.01 * 50, momentum=0.5)  # 50x: a few epochs suffice
    loss_fn = NLLLoss()  # F.nll_loss
    num_batches = ceil(n / float(bsz))
    losses = []
    for _epoch in range(epochs):
        epoch_loss = 0.0
        for data, target in train_set():
            optimizer.zero_grad()
            output = model(data)
            loss = loss_fn(output, target)
            epoch_loss += loss.item()
            model.backward(loss_fn.backward())  # loss.backward()
            average_gradients(model)
            optimizer.step()
        losses.append(epoch_loss / num_batches)
    return model, losses


def test_seed_001_distributed_sgd_tutorial(dist, world):
    with threadpool_limits(limits=1):
        model, losses = run_001(epochs=8)
        assert same_on_every_rank(model)  # same seed, averaged gradients
        assert losses[-1] < 0.3 * losses[0], losses
        _, _, x_test, y_test = load_digits_split(seed=0)
        model.eval()  # dropout off
        accuracy = float((model(x_test).argmax(axis=1) == y_test).mean())
        assert accuracy > 0.85, accuracy
        again, again_losses = run_001(epochs=8)  # manual_seed: the same run again, bitwise
    assert again_losses == losses
    assert all(np.array_equal(p.data, q.data) for p, q in zip(model.parameters(), again.parameters()))


def test_all_reduce_of_param_grad_updates_it_in_place_on_every_rank(dist, world):
    rank, size = world
    lin = Linear(3, 2, rng=0, dtype=np.float64)
    lin(np.full((1, 3), rank + 1.0))
    lin.backward(np.ones((1, 2)))
    grad = lin.weight.grad
    dist.all_reduce(lin.weight.grad)
    dist.all_reduce(lin.bias.grad.data)
    assert lin.weight.grad is grad
    np.testing.assert_array_equal(lin.weight.grad, np.full((2, 3), size * (size + 1) / 2))
    np.testing.assert_array_equal(lin.bias.grad, np.full(2, float(size)))


# -- seed 003: the DDP tutorial ----------------------------------------------------------------------
class ToyModel(Module):
    def __init__(self):
        super().__init__()
        self.net1 = Linear(10, 10)
        self.relu = ReLU()
        self.net2 = Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))

    def backward(self, grad):
        return self.net1.backward(self.relu.backward(self.net2.backward(grad)))


def randn(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def demo_basic(rank, world_size):
    model = ToyModel()  # .to(rank): host arrays
    ddp_model = DDP(model)  # device_ids=[rank]: host arrays have no device

    loss_fn = MSELoss()
    optimizer = SGD(ddp_model.parameters(), lr=0.001)

    rng = np.random.default_rng([3, rank])
    optimizer.zero_grad()
    outputs = ddp_model(randn(rng, 20, 10))
    labels = randn(rng, 20, 5)
    loss_fn(outputs, labels)
    ddp_model.backward(loss_fn.backward())  # loss_fn(outputs, labels).backward()
    optimizer.step()
    return model


def test_seed_003_demo_basic(dist, world):
    rank, size = world
    manual_seed(rank)  # different initial weights: DDP broadcasts rank 0's
    manual_seed(0)
    ref = ToyModel()  # rank 0's initial model, rebuilt on every rank
    manual_seed(rank)
    model = demo_basic(rank, size)
    assert same_on_every_rank(model)
    # the same step on one process: the gradient averaged over every rank's batch
    grads = []
    for r in range(size):
        rng = np.random.default_rng([3, r])
        x, y = randn(rng, 20, 10), randn(rng, 20, 5)
        crit = MSELoss()
        crit(ref(x), y)
        ref.zero_grad()
        ref.backward(crit.backward())
        grads.append([p.grad.copy() for p in ref.parameters()])
    for p, q, *per_rank in zip(model.parameters(), ref.parameters(), *grads):
        np.testing.assert_allclose(p.data, q.data - 0.001 * sum(per_rank) / size, rtol=1e-5, atol=1e-7)


def demo_checkpoint(rank, world_size, checkpoint_path):
    model = ToyModel()
    ddp_model = DDP(model)

    loss_fn = MSELoss()
    optimizer = SGD(ddp_model.parameters(), lr=0.001)

    if rank == 0:
        # All processes should see same parameters as they all start from same
        # random parameters and gradients are synchronized in backward passes.
        # Therefore, saving it in one process is sufficient.
        save_checkpoint(checkpoint_path, ddp_model.state_dict())

    # Use a barrier() to make sure that process 1 loads the model after process
    # 0 saves it.
    dist.barrier()
    # map_location: load_checkpoint gives host arrays, load_state_dict copies them onto
    # each parameter's device
    ddp_model.load_state_dict(load_checkpoint(checkpoint_path))

    rng = np.random.default_rng([4, rank])
    optimizer.zero_grad()
    outputs = ddp_model(randn(rng, 20, 10))
    labels = randn(rng, 20, 5)
    loss_fn = MSELoss()
    loss_fn(outputs, labels)
    ddp_model.backward(loss_fn.backward())
    optimizer.step()

    # Not necessary to use a dist.barrier() to guard the file deletion below
    # as the AllReduce ops in the backward pass of DDP already served as
    # a synchronization.
    saved = load_checkpoint(checkpoint_path)
    dist.barrier()  # (here it is: the other ranks read it once more above)
    if rank == 0:
        os.remove(checkpoint_path)
    return model, saved


def test_seed_003_demo_checkpoint(dist, world):
    rank, size = world
    root = [tempfile.mkdtemp(prefix="mpidist-seed003-") if rank == 0 else None]
    dist.broadcast_object_list(root, src=0)  # one directory for every rank (one node)
    checkpoint_path = os.path.join(root[0], "model.checkpoint")
    manual_seed(10 + rank)
    model, saved = demo_checkpoint(rank, size, checkpoint_path)
    assert same_on_every_rank(model)
    assert sorted(saved) == ["module.net1.bias", "module.net1.weight", "module.net2.bias", "module.net2.weight"]
    bare = ToyModel()  # torch: model.load_state_dict needs the prefix gone
    with pytest.raises(ValueError, match=r"unexpected \['module.net1.weight'"):
        bare.load_state_dict(saved)
    consume_prefix_in_state_dict_if_present(saved, "module.")
    bare.load_state_dict(saved)
    manual_seed(10)
    np.testing.assert_array_equal(bare.net1.weight.data, ToyModel().net1.weight.data)  # rank 0's initial model
    dist.barrier()
    if rank == 0:
        assert not os.path.exists(checkpoint_path)
        os.rmdir(root[0])
