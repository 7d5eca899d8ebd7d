"""Collective algorithms built on MPI point-to-point messages or MPI-3 shared memory."""

from mpidist.algorithms.hierarchical import HierAllReduce
from mpidist.algorithms.ring import ring_all_reduce, ring_chunk_bounds
from mpidist.algorithms.shm import ShmAllReduce, shm_all_reduce, shm_applicable, shm_release

__all__ = [
    "HierAllReduce",
    "ring_all_reduce",
    "ring_chunk_bounds",
    "ShmAllReduce",
    "shm_all_reduce",
    "shm_applicable",
    "shm_release",
]
