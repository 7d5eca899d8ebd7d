"""The tag layout on a group's communicator, in one place.

User messages take tags ``0 .. USER_TAG_MAX``; above them mpidist reserves, from the top:
``OBJECT_TAG = MPI_TAG_UB`` (send/recv_object_list), ``MONITORED_BARRIER_TAGS`` tags for
monitored_barrier (:func:`monitored_barrier_tag`), then ``CREATE_GROUP_TAG`` for the
members-only ``MPI_Comm_create_group`` of a group's communicator (whose tag Open MPI sends
point-to-point). MPI guarantees MPI_TAG_UB >= 32767, so users keep at least 28,671 tags.
"""

from __future__ import annotations

from typing import cast

from mpi4py import MPI

__all__ = [
    "TAG_UB",
    "OBJECT_TAG",
    "MONITORED_BARRIER_TAGS",
    "CREATE_GROUP_TAG",
    "USER_TAG_MAX",
    "monitored_barrier_tag",
]

TAG_UB: int = int(cast(int, MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)))  # (MPI always sets MPI_TAG_UB on COMM_WORLD)
OBJECT_TAG: int = TAG_UB
MONITORED_BARRIER_TAGS: int = 4095
CREATE_GROUP_TAG: int = TAG_UB - 1 - MONITORED_BARRIER_TAGS
USER_TAG_MAX: int = CREATE_GROUP_TAG - 1


def monitored_barrier_tag(call_index: int) -> int:
    """The tag of a group's ``call_index``-th monitored_barrier."""
    return TAG_UB - 1 - call_index % MONITORED_BARRIER_TAGS
