"""Collective algorithms built on MPI point-to-point messages."""
from mpidist.algorithms.ring import ring_all_reduce, ring_chunk_bounds

__all__ = ["ring_all_reduce", "ring_chunk_bounds"]
