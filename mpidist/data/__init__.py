"""Data utilities: a distributed sampler and small datasets for the examples."""

from __future__ import annotations

from mpidist.data.datasets import load_digits_split, load_mnist, read_idx, write_idx
from mpidist.data.sampler import DistributedSampler

__all__ = ["DistributedSampler", "load_digits_split", "load_mnist", "read_idx", "write_idx"]
