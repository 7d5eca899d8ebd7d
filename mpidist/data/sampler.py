"""A sampler that gives each rank its own shard of a dataset's indices.

Port of ``torch.utils.data.distributed.DistributedSampler``
(https://pytorch.org/docs/stable/data.html#torch.utils.data.distributed.DistributedSampler)
with the same constructor, padding, ``drop_last`` and ``set_epoch`` semantics.
One difference: the shuffle uses ``numpy.random.default_rng(seed + epoch)``
instead of ``torch.randperm``, so the order of the indices differs from
torch's for the same seed, while every other property is the same.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized

import numpy as np

__all__ = ["DistributedSampler"]


def _from_process_group(what: str) -> int:
    """``mpidist.get_world_size()`` or ``mpidist.get_rank()``, imported lazily.

    Before ``init_process_group`` these raise ValueError, as torch's do; it
    propagates unchanged, as in torch's sampler.
    """
    import mpidist  # noqa: PLC0415  (avoid an import cycle)

    return int(getattr(mpidist, what)())


class DistributedSampler:
    """Restricts data loading to this rank's shard of ``range(len(dataset))``.

    Each of the ``num_replicas`` ranks gets ``len(self)`` indices; together
    they cover the whole dataset. Without ``drop_last``, indices from the
    start of the (shuffled) list are repeated so every rank gets the same
    number; with ``drop_last``, the tail is dropped instead.

    Call :meth:`set_epoch` at the start of every epoch, before iterating,
    or every epoch uses the same order.

    Args:
        dataset: any object with ``__len__`` (only its length is used).
        num_replicas: number of ranks; default ``mpidist.get_world_size()``.
        rank: this rank, in ``[0, num_replicas)``; default ``mpidist.get_rank()``.
        shuffle: shuffle the indices, with seed ``seed + epoch``.
        seed: shuffle seed; must be the same on every rank.
        drop_last: drop the tail so the shards divide evenly, instead of padding.

    Raises:
        ValueError: ``num_replicas < 1``, ``rank`` out of range, or (from
            ``mpidist.get_world_size``/``get_rank``, as in torch) ``num_replicas``
            or ``rank`` omitted before ``mpidist.init_process_group``.
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if num_replicas is None:
            num_replicas = _from_process_group("get_world_size")
        if rank is None:
            rank = _from_process_group("get_rank")
        if num_replicas < 1:
            raise ValueError(f"Invalid num_replicas {num_replicas}, it should be at least 1")
        if rank >= num_replicas or rank < 0:
            raise ValueError(f"Invalid rank {rank}, rank should be in the interval [0, {num_replicas - 1}]")
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.epoch = 0
        self.drop_last = drop_last
        self.shuffle = shuffle
        self.seed = seed
        n = len(dataset)
        if drop_last and n % num_replicas != 0:
            self.num_samples = math.ceil((n - num_replicas) / num_replicas)
        else:
            self.num_samples = math.ceil(n / num_replicas)
        self.total_size = self.num_samples * num_replicas

    def _indices(self) -> list[int]:
        """All ``total_size`` indices, shuffled and padded or truncated."""
        n = len(self.dataset)
        indices: list[int]
        if self.shuffle:
            indices = np.random.default_rng(self.seed + self.epoch).permutation(n).tolist()
        else:
            indices = list(range(n))
        if self.drop_last:
            return indices[: self.total_size]
        padding = self.total_size - n
        if padding <= n:
            return indices + indices[:padding]
        return indices + (indices * math.ceil(padding / n))[:padding]

    def __iter__(self) -> Iterator[int]:
        """This rank's indices: every ``num_replicas``-th, starting at ``rank``."""
        indices = self._indices()[self.rank : self.total_size : self.num_replicas]
        assert len(indices) == self.num_samples
        return iter(indices)

    def __len__(self) -> int:
        """Number of indices this rank yields per epoch (same on every rank)."""
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch, which is added to ``seed`` for the shuffle.

        Call it with the same value on every rank before each epoch, so each
        epoch has a new order and all ranks agree on it.
        """
        self.epoch = epoch
