"""Data parallelism: DistributedDataParallel, its communication hooks and timeline."""

from mpidist.parallel import comm_hooks
from mpidist.parallel.comm_hooks import GradBucket, PowerSGDState
from mpidist.parallel.ddp import DistributedDataParallel

__all__ = ["DistributedDataParallel", "GradBucket", "PowerSGDState", "comm_hooks"]
