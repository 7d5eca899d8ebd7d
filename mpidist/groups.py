"""Process groups as MPI sub-communicators: new_group, new_subgroups, rank translation.

Follows torch.distributed: every rank calls ``new_group`` with the same ranks in the
same order; ranks are sorted, so group rank i is the i-th smallest member; a rank
outside the group gets ``GroupMember.NON_GROUP_MEMBER``, for which ``get_rank`` and
``get_world_size`` give -1 and every collective returns None.
"""
from __future__ import annotations

import datetime
from typing import Any, Iterable, Optional

import numpy as np
from mpi4py import MPI

from mpidist import _runtime
from mpidist.errors import prefix
from mpidist._group import ProcessGroup
from mpidist._tags import CREATE_GROUP_TAG

__all__ = ["GroupMember", "group", "new_group", "new_subgroups", "get_group_rank", "get_global_rank",
           "get_process_group_ranks"]


class _WorldAttr(type):
    @property
    def WORLD(cls) -> Optional[ProcessGroup]:  # noqa: N802  (torch's name)
        """The default group, or None before init_process_group."""
        st = _runtime.state_or_none()
        return st.world if st is not None else None


class GroupMember(metaclass=_WorldAttr):
    """``GroupMember.WORLD`` is the default group; ``NON_GROUP_MEMBER`` what non-members get."""

    NON_GROUP_MEMBER = ProcessGroup(None, (), "NON_GROUP_MEMBER", "mpi")


class group(metaclass=_WorldAttr):  # noqa: N801  (torch's name: ``group.WORLD``)
    """``group.WORLD`` is the default group, as in torch.distributed."""


def _check_ranks(ranks: Any, world_size: int, op: str) -> list[int]:
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Iterable):
        raise TypeError(f"{prefix(op)} ranks must be a list of global ranks, got {type(ranks).__name__}")
    out = []
    for r in ranks:
        if not isinstance(r, (int, np.integer)) or isinstance(r, bool):
            raise TypeError(f"{prefix(op)} ranks must hold ints, got {r!r} ({type(r).__name__})")
        if not 0 <= r < world_size:
            raise ValueError(f"{prefix(op)} rank {r} in ranks is out of range; expected 0 <= rank < "
                             f"world size {world_size}")
        out.append(int(r))
    dup = sorted({r for r in out if out.count(r) > 1})
    if dup:
        raise ValueError(f"{prefix(op)} ranks must not repeat, got duplicates {dup} in {list(ranks)}")
    if not out:
        raise ValueError(f"{prefix(op)} ranks must name at least one rank, got an empty list")
    return sorted(out)


def _check_backend(backend: Optional[str], op: str) -> Optional[str]:
    """The canonical form of a group's ``backend`` (None: inherit the default group's)."""
    return None if backend is None else _runtime.canonical_backend(backend, prefix(op))


# global ranks -> how many groups this process has made with them (flight recorder keys)
_made: dict[tuple, int] = {}


def new_group(ranks: Optional[Iterable[int]] = None, timeout: Optional[datetime.timedelta] = None,
              backend: Optional[str] = None, pg_options: Any = None,
              use_local_synchronization: bool = False, group_desc: Optional[str] = None) -> ProcessGroup:
    """Create a group of the given global ranks on a new MPI communicator.

    Collective over ALL ranks of the default group (``MPI_Comm_create``), which must call
    it in the same order with the same ``ranks``. ``ranks=None`` means every rank.
    Members get a :class:`ProcessGroup` whose group rank i is the i-th smallest of
    ``ranks``; others get ``GroupMember.NON_GROUP_MEMBER``.

    ``use_local_synchronization=True`` (torch's meaning): only the members need to call
    it, in the same order as each other; the communicator is made by a members-only
    ``MPI_Comm_create_group``. A non-member that calls it gets NON_GROUP_MEMBER at once,
    without communicating. (torch's process-group plugins are created this way: torch
    calls the creator on members only.)

    ``timeout``, ``pg_options`` and ``group_desc`` are accepted for torch compatibility
    (``group_desc`` names the group). ``backend``: as init_process_group's (``"mpi"``,
    ``"nccl"``, ``"cpu:mpi,cuda:nccl"``); None inherits the default group's.

    Raises:
        TypeError / ValueError: ranks not ints, out of range, repeated or empty; an
            unsupported backend.
    """
    op = "new_group"
    st = _runtime.state()
    backend = _check_backend(backend, op) or st.backend
    members = list(range(st.world_size)) if ranks is None else _check_ranks(ranks, st.world_size, op)
    world = st.world
    name = group_desc or f"group{len(st.groups) + 1}:{members}"
    local = bool(use_local_synchronization)
    if local and st.rank not in members:
        return GroupMember.NON_GROUP_MEMBER  # the members make it among themselves

    def create() -> Optional[MPI.Comm]:
        mpi_group = world.comm.Get_group().Incl(members)
        try:
            comm = (world.comm.Create_group(mpi_group, CREATE_GROUP_TAG) if local
                    else world.comm.Create(mpi_group))
        finally:
            mpi_group.Free()
        return None if comm == MPI.COMM_NULL else comm

    comm = world.engine.run_sync(create)
    # the flight recorder's key for the group: the same on every member (every rank makes
    # every group, in the same order) and never reused in this process, even after the group
    # or the whole runtime is destroyed (the recorder keeps their entries)
    index = _made.get(tuple(members), 0)
    _made[tuple(members)] = index + 1
    if comm is None:
        return GroupMember.NON_GROUP_MEMBER
    pg = ProcessGroup(comm, members, name, backend)
    pg.engine.key = f"{members}#{index}"
    st.groups.append(pg)
    return pg


def new_subgroups(group_size: Optional[int] = None, group: Optional[ProcessGroup] = None,
                  timeout: Optional[datetime.timedelta] = None, backend: Optional[str] = None,
                  pg_options: Any = None, group_desc: Optional[str] = None
                  ) -> tuple[ProcessGroup, list[ProcessGroup]]:
    """Split the world into equal consecutive subgroups of ``group_size`` ranks.

    Returns ``(the caller's subgroup, all subgroups)`` as torch does; entries the
    caller is not in are ``NON_GROUP_MEMBER``. ``group_size`` defaults to the number
    of ranks on this node (torch: devices per node). Collective over all ranks.

    Raises:
        ValueError: ``group_size`` < 1, larger than the world, or not dividing it;
            ``group`` other than None (not supported).
    """
    op = "new_subgroups"
    st = _runtime.state()
    if group is not None:
        raise ValueError(f"{prefix(op)} group must be None (subgroups of the world only)")
    size = st.local_world_size if group_size is None else group_size
    if not isinstance(size, (int, np.integer)) or size < 1 or size > st.world_size or st.world_size % size:
        raise ValueError(f"{prefix(op)} group_size must divide the world size {st.world_size} and be "
                         f">= 1, got {group_size!r}")
    subgroups = [new_group(range(start, start + size), timeout, backend, pg_options,
                           group_desc=f"{group_desc or 'subgroup'}{start // size}")
                 for start in range(0, st.world_size, size)]
    return subgroups[st.rank // size], subgroups


def _known(g: Optional[ProcessGroup], op: str) -> ProcessGroup:
    pg = _runtime.resolve_group(g)
    if pg is GroupMember.NON_GROUP_MEMBER:
        raise ValueError(f"{prefix(op)} group is NON_GROUP_MEMBER: this rank does not know its members")
    return pg


def get_group_rank(group: Optional[ProcessGroup], global_rank: int) -> int:
    """Translate a global rank to its rank in ``group``; ValueError if it is not a member."""
    pg = _known(group, "get_group_rank")
    try:
        return pg.group_rank(global_rank)
    except ValueError as exc:
        raise ValueError(f"{prefix('get_group_rank')} {exc}") from None


def get_global_rank(group: Optional[ProcessGroup], group_rank: int) -> int:
    """Translate a rank in ``group`` to its global rank; ValueError if out of range."""
    pg = _known(group, "get_global_rank")
    try:
        return pg.global_rank(group_rank)
    except ValueError as exc:
        raise ValueError(f"{prefix('get_global_rank')} {exc}") from None


def get_process_group_ranks(group: Optional[ProcessGroup]) -> list[int]:
    """The global ranks of ``group``'s members, in group-rank order."""
    return list(_known(group, "get_process_group_ranks").ranks)
