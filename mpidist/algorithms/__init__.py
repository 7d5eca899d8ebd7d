"""Collective algorithms built on MPI point-to-point messages or MPI-3 shared memory."""

from mpidist.algorithms.ring import ring_all_reduce, ring_chunk_bounds
from mpidist.algorithms.shm import ShmAllReduce, shm_all_reduce, shm_applicable, shm_release

__all__ = ["ring_all_reduce", "ring_chunk_bounds", "ShmAllReduce", "shm_all_reduce", "shm_applicable", "shm_release"]
