"""DistributedSampler: torch.utils.data.distributed.DistributedSampler semantics."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

import mpidist
from mpidist.data import DistributedSampler


class Data:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


def shards(n: int, replicas: int, **kw) -> list[list[int]]:
    return [list(DistributedSampler(Data(n), replicas, r, **kw)) for r in range(replicas)]


def torch_reference(n, replicas, rank, shuffle=True, seed=0, epoch=0, drop_last=False):
    """torch's DistributedSampler.__iter__, transcribed, with numpy's permutation."""
    if drop_last and n % replicas != 0:
        num_samples = math.ceil((n - replicas) / replicas)
    else:
        num_samples = math.ceil(n / replicas)
    total_size = num_samples * replicas
    if shuffle:
        indices = np.random.default_rng(seed + epoch).permutation(n).tolist()
    else:
        indices = list(range(n))
    if not drop_last:
        padding_size = total_size - len(indices)
        if padding_size <= len(indices):
            indices += indices[:padding_size]
        else:
            indices += (indices * math.ceil(padding_size / len(indices)))[:padding_size]
    else:
        indices = indices[:total_size]
    return indices[rank:total_size:replicas]


@pytest.mark.parametrize("shuffle", [True, False])
def test_divisible_shards_are_disjoint_and_cover(shuffle):
    parts = shards(12, 4, shuffle=shuffle)
    assert all(len(p) == 3 for p in parts)
    flat = [i for p in parts for i in p]
    assert sorted(flat) == list(range(12))


def test_no_shuffle_is_strided():
    assert shards(10, 3, shuffle=False) == [[0, 3, 6, 9], [1, 4, 7, 0], [2, 5, 8, 1]]


@pytest.mark.parametrize("n,replicas", [(10, 3), (7, 4), (3, 8), (1, 5)])
def test_padding_repeats_from_the_start(n, replicas):
    parts = shards(n, replicas)
    assert {len(p) for p in parts} == {math.ceil(n / replicas)}
    counts = Counter(i for p in parts for i in p)
    assert set(counts) == set(range(n))
    assert sum(counts.values()) - n == math.ceil(n / replicas) * replicas - n
    assert max(counts.values()) <= math.ceil(replicas / n) + 1


@pytest.mark.parametrize("n,replicas", [(10, 3), (7, 4), (12, 4), (3, 8)])
def test_drop_last_truncates(n, replicas):
    parts = shards(n, replicas, drop_last=True)
    assert {len(p) for p in parts} == {n // replicas}
    flat = [i for p in parts for i in p]
    assert len(set(flat)) == len(flat) == (n // replicas) * replicas
    assert len(DistributedSampler(Data(n), replicas, 0, drop_last=True)) == n // replicas


def test_set_epoch_changes_order_and_ranks_agree():
    def epoch_shards(epoch):
        out = []
        for rank in range(3):
            s = DistributedSampler(Data(30), 3, rank, seed=5)
            s.set_epoch(epoch)
            out.append(list(s))
        return out

    e0, e0_again, e1 = epoch_shards(0), epoch_shards(0), epoch_shards(1)
    assert e0 == e0_again
    assert e0 != e1
    for parts in (e0, e1):
        assert sorted(i for p in parts for i in p) == list(range(30))


def test_iterating_twice_gives_the_same_order():
    s = DistributedSampler(Data(50), 2, 1)
    assert list(s) == list(s)


def test_seeds_differ():
    assert shards(40, 2, seed=0) != shards(40, 2, seed=1)


@pytest.mark.parametrize("rank", [-1, 4, 5])
def test_rank_out_of_range(rank):
    with pytest.raises(ValueError, match=r"Invalid rank .*interval \[0, 3\]"):
        DistributedSampler(Data(10), num_replicas=4, rank=rank)


def test_num_replicas_must_be_positive():
    with pytest.raises(ValueError, match="num_replicas"):
        DistributedSampler(Data(10), num_replicas=0, rank=0)


def test_int_dataset_rejected():
    with pytest.raises(TypeError):
        DistributedSampler(10, num_replicas=2, rank=0)


@pytest.mark.parametrize("n,replicas", [(0, 3), (1, 4), (3, 8), (10, 3), (16, 4), (17, 5), (100, 7)])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
def test_matches_torch_algorithm(n, replicas, drop_last, shuffle):
    for epoch in (0, 3):
        for rank in range(replicas):
            s = DistributedSampler(Data(n), replicas, rank, shuffle=shuffle, seed=7, drop_last=drop_last)
            s.set_epoch(epoch)
            want = torch_reference(n, replicas, rank, shuffle, 7, epoch, drop_last)
            assert list(s) == want
            assert len(s) == len(want)


def test_defaults_need_an_initialized_process_group():
    if mpidist.is_initialized():
        pytest.skip("process group already initialized in this process")
    with pytest.raises(ValueError, match="not been initialized"):
        DistributedSampler(Data(10))
    with pytest.raises(ValueError, match="not been initialized"):
        DistributedSampler(Data(10), num_replicas=2)
