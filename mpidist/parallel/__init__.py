"""Data parallelism: DistributedDataParallel."""
from mpidist.parallel.ddp import DistributedDataParallel

__all__ = ["DistributedDataParallel"]
