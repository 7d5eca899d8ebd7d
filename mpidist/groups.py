"""Process groups as MPI sub-communicators: new_group, new_subgroups,
new_subgroups_by_enumeration, split_group, rank translation, get_pg_count.

Follows torch.distributed: every rank calls ``new_group`` with the same ranks in the
same order; ranks are sorted (unless ``sort_ranks=False``), so group rank i is the i-th
smallest member; a rank outside the group gets ``GroupMember.NON_GROUP_MEMBER``, for
which ``get_rank`` and ``get_world_size`` give -1 and every collective returns None.
Several disjoint groups at once (split_group, new_subgroups_by_enumeration, the
dimensions of a device mesh) are made by one ``MPI_Comm_split`` of their parent.
"""

from __future__ import annotations

import datetime
import hashlib
from collections.abc import Iterable, Sequence
from typing import Any, Optional, cast, overload

import numpy as np
from mpi4py import MPI

from mpidist._check import mismatch
from mpidist._core.group import ProcessGroup
from mpidist._core.tags import CREATE_GROUP_TAG
from mpidist._runtime import world as runtime
from mpidist._runtime.backend_queries import BackendConfig
from mpidist.errors import prefix

__all__ = [
    "GroupMember",
    "group",
    "new_group",
    "new_subgroups",
    "new_subgroups_by_enumeration",
    "split_group",
    "get_group_rank",
    "get_global_rank",
    "get_process_group_ranks",
    "get_pg_count",
]


class _WorldAttr(type):
    @property
    def WORLD(cls) -> Optional[ProcessGroup]:  # noqa: N802  (torch's name)
        """The default group, or None before init_process_group."""
        st = runtime.state_or_none()
        return st.world if st is not None else None


class GroupMember(metaclass=_WorldAttr):
    """``GroupMember.WORLD`` is the default group; ``NON_GROUP_MEMBER`` what non-members get."""

    NON_GROUP_MEMBER = ProcessGroup(None, (), "NON_GROUP_MEMBER", "mpi")


class group(metaclass=_WorldAttr):  # noqa: N801  (torch's name: ``group.WORLD``)
    """``group.WORLD`` is the default group, as in torch.distributed."""


def _check_ranks(
    ranks: Any, world_size: int, op: str, arg: str = "ranks", sort: bool = True, what: str = "world size"
) -> list[int]:
    """``ranks`` (argument ``arg``) as a list of distinct ints in ``[0, world_size)``,
    sorted unless ``sort`` is False; ``what`` names the bound in messages."""
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Iterable):
        raise TypeError(
            f"{prefix(op)} {arg} must be a list of {'global ' if what == 'world size' else ''}ranks, "
            f"got {type(ranks).__name__}"
        )
    out = []
    for r in ranks:
        if not isinstance(r, (int, np.integer)) or isinstance(r, bool):
            raise TypeError(f"{prefix(op)} {arg} must hold ints, got {r!r} ({type(r).__name__})")
        if not 0 <= r < world_size:
            raise ValueError(
                f"{prefix(op)} rank {r} in {arg} is out of range; expected 0 <= rank < {what} {world_size}"
            )
        out.append(int(r))
    dup = sorted({r for r in out if out.count(r) > 1})
    if dup:
        raise ValueError(f"{prefix(op)} {arg} must not repeat, got duplicates {dup} in {list(ranks)}")
    if not out:
        raise ValueError(f"{prefix(op)} {arg} must name at least one rank, got an empty list")
    return sorted(out) if sort else out


@overload
def _check_backend(backend: str, op: str) -> str: ...
@overload
def _check_backend(backend: Optional[str], op: str) -> Optional[str]: ...
def _check_backend(backend: Optional[str], op: str) -> Optional[str]:
    """The canonical form of a group's ``backend`` (None: inherit the default group's)."""
    return None if backend is None else runtime.canonical_backend(backend, prefix(op))


# global ranks -> how many groups this process has made with them (flight recorder keys)
_made: dict[tuple[int, ...], int] = {}
# [the runtime state counted in, get_pg_count's value for it]
_count: list[Any] = [None, 0]


def _key(members: Sequence[int]) -> str:
    """The flight recorder's key for a group of ``members`` (global ranks, group-rank
    order): the same on every member (each member makes each group of these members, in
    the same order) and never reused in this process, even after the group or the whole
    runtime is destroyed (the recorder keeps their entries)."""
    index = _made.get(tuple(members), 0)
    _made[tuple(members)] = index + 1
    return f"{list(members)}#{index}"


def _register(comm: MPI.Comm, members: Sequence[int], name: str, backend: str, key: str) -> ProcessGroup:
    """A new group on ``comm`` (the caller is a member), kept for destroy_process_group."""
    pg = ProcessGroup(comm, members, name, backend)
    pg.engine.key = key
    runtime.state().groups.append(pg)
    return pg


def _name(st: Any, group_desc: Optional[str], members: Sequence[int]) -> str:
    return group_desc or f"group{len(st.groups) + 1}:{list(members)}"


def _counted(n: int) -> None:
    """``n`` more groups for :func:`get_pg_count`."""
    get_pg_count()
    _count[1] += n


def get_pg_count() -> int:
    """How many process groups this process has made since init_process_group
    (torch.distributed.get_pg_count): the default group, plus one per group made by
    ``new_group`` on every rank that called it, member or not (also through
    new_subgroups, new_subgroups_by_enumeration and init_device_mesh, which torch builds
    from new_group). As in torch, groups made by ``split_group`` or by
    ``new_group(use_local_synchronization=True)`` are not counted (torch names those by
    a hash of their ranks instead of this count). 0 before init_process_group."""
    st = runtime.state_or_none()
    if st is None:
        return 0
    if _count[0] is not st:  # a new runtime: only its default group so far
        _count[:] = [st, 1]
    return cast(int, _count[1])


def new_group(
    ranks: Optional[Iterable[int]] = None,
    timeout: Optional[datetime.timedelta] = None,
    backend: Optional[str] = None,
    pg_options: Any = None,
    use_local_synchronization: bool = False,
    group_desc: Optional[str] = None,
    device_id: Any = None,
    sort_ranks: bool = True,
) -> ProcessGroup:
    """Create a group of the given global ranks on a new MPI communicator.

    Collective over ALL ranks of the default group (``MPI_Comm_create``), which must call
    it in the same order with the same ``ranks``. ``ranks=None`` means every rank.
    Members get a :class:`ProcessGroup` whose group rank i is the i-th smallest of
    ``ranks`` (with ``sort_ranks=False``, torch 2.6+: the i-th of ``ranks`` as given);
    others get ``GroupMember.NON_GROUP_MEMBER``.

    ``use_local_synchronization=True`` (torch's meaning): only the members need to call
    it, in the same order as each other; the communicator is made by a members-only
    ``MPI_Comm_create_group``. A non-member that calls it gets NON_GROUP_MEMBER at once,
    without communicating. (torch's process-group plugins are created this way: torch
    calls the creator on members only.)

    ``timeout`` (a positive ``datetime.timedelta``): the group's own timeout for its ops
    (as torch's; None: init_process_group's; ``MPIDIST_TIMEOUT``, when set, overrides
    both). ``pg_options``, ``group_desc`` and ``device_id`` are accepted for torch
    compatibility (``group_desc`` names the group; torch's ``device_id`` makes NCCL
    create its communicator at once, mpidist's NCCL path creates it at first use).
    ``backend``: as init_process_group's (``"mpi"``, ``"nccl"``, ``"cpu:mpi,cuda:nccl"``);
    None inherits the default group's.

    Raises:
        TypeError / ValueError: ranks not ints, out of range, repeated or empty; an
            unsupported backend; ``timeout`` not a timedelta, or not positive.
    """
    op = "new_group"
    st = runtime.state()
    backend = _check_backend(backend, op) or st.backend
    timeout_s = _timeout_seconds(timeout, op)
    members = (
        list(range(st.world_size)) if ranks is None else _check_ranks(ranks, st.world_size, op, sort=bool(sort_ranks))
    )
    world = st.world
    name = _name(st, group_desc, members)
    local = bool(use_local_synchronization)
    if local and st.rank not in members:
        return GroupMember.NON_GROUP_MEMBER  # the members make it among themselves
    if not local:
        _counted(1)

    def create() -> Optional[MPI.Comm]:
        wcomm = cast(MPI.Intracomm, world.comm)  # the default group's: every rank's (a Dup of COMM_WORLD)
        mpi_group = wcomm.Get_group().Incl(members)
        try:
            comm = wcomm.Create_group(mpi_group, CREATE_GROUP_TAG) if local else wcomm.Create(mpi_group)
        finally:
            mpi_group.Free()
        return None if comm == MPI.COMM_NULL else comm

    comm = world.engine.run_sync(create)
    key = _key(members)  # counted on every rank that makes the group, member or not
    if comm is None:
        return GroupMember.NON_GROUP_MEMBER
    pg = _register(comm, members, name, backend, key)
    pg.timeout_s = timeout_s
    world.engine.run_sync(mismatch.prepare, pg)  # (its members only: collective over pg)
    return pg


def _timeout_seconds(timeout: Any, op: str) -> Optional[float]:
    """A new group's own timeout in seconds: None for ``timeout=None`` (the default
    group's applies) or when MPIDIST_TIMEOUT is set (it overrides every group's)."""
    if timeout is None:
        return None
    if not isinstance(timeout, datetime.timedelta):
        raise TypeError(f"{prefix(op)} timeout must be a datetime.timedelta, got {type(timeout).__name__}")
    if timeout.total_seconds() <= 0:
        raise ValueError(f"{prefix(op)} timeout must be positive, got {timeout}")
    return None if runtime.env_timeout(prefix(op)) is not None else timeout.total_seconds()


def agree(g: ProcessGroup, obj: Any, op: str, what: str) -> None:
    """Check that every member of ``g`` passed the same ``obj`` (by a hash of its repr, one
    small all-reduce, collective over ``g``'s members), so that a program whose ranks
    disagree gets a ValueError on every member instead of wrong groups.

    Not public (not in ``__all__``), as :func:`split`."""
    # a hash of repr(obj) that is the same in every process, in [0, 2**56)
    digest = int.from_bytes(hashlib.blake2b(repr(obj).encode(), digest_size=7).digest(), "little")

    def compare() -> bool:
        agreed = np.array([digest, -digest], np.int64)
        comm = cast(MPI.Comm, g.comm)  # a member's (the callers' contract)
        comm.Allreduce(MPI.IN_PLACE, agreed, MPI.MAX)  # the largest and the smallest digest
        return bool(agreed[0] == -agreed[1])

    if not g.engine.run_sync(compare):
        raise ValueError(
            f"{prefix(op)} the members of group {g.group_name!r} passed different {what}; every "
            f"member must pass the same (this rank passed {obj!r:.200})"
        )


def split(
    parent: ProcessGroup, subgroups: Sequence[Sequence[int]], op: str, backend: str, group_desc: Optional[str] = None
) -> Optional[ProcessGroup]:
    """The caller's group among ``subgroups`` (disjoint lists of global ranks, each in
    group-rank order, all members of ``parent``), made by one ``MPI_Comm_split`` of
    ``parent``'s communicator (MPI-4.1 §7.4.2): collective over ``parent``'s members, which
    must all pass the same ``subgroups`` (checked first by :func:`agree`, so a mismatch
    raises ValueError on every member). None for a caller in none of them. The caller
    must be a member of ``parent``.

    Not public (not in ``__all__``): split_group, new_subgroups_by_enumeration and
    DeviceMesh make their groups with it.
    """
    st = runtime.state()
    color, mine = MPI.UNDEFINED, None
    for i, members in enumerate(subgroups):
        if st.rank in members:
            color, mine = i, list(members)
            break
    key = 0 if mine is None else mine.index(st.rank)
    agree(parent, [list(m) for m in subgroups], op, "ranks")

    def create() -> Optional[MPI.Comm]:
        comm = cast(MPI.Comm, parent.comm).Split(color, key)  # (the caller is a member of parent)
        return None if comm == MPI.COMM_NULL else comm

    comm = parent.engine.run_sync(create)
    if comm is None:
        return None
    mine = cast("list[int]", mine)  # (set: a rank in none of the subgroups got no communicator)
    pg = _register(comm, mine, _name(st, group_desc, mine), backend, _key(mine))
    parent.engine.run_sync(mismatch.prepare, pg)  # (collective over pg: every member is here)
    return pg


def split_group(
    parent_pg: Optional[ProcessGroup] = None,
    split_ranks: Optional[list[list[int]]] = None,
    timeout: Optional[datetime.timedelta] = None,
    pg_options: Any = None,
    group_desc: Optional[str] = None,
    backend: Optional[str] = None,
) -> Optional[ProcessGroup]:
    """Split ``parent_pg`` into disjoint groups (torch.distributed.split_group), by one
    ``MPI_Comm_split`` of its communicator.

    Collective over every member of ``parent_pg`` (default: the default group), which
    must all pass the same ``split_ranks``: a list of lists of ranks IN ``parent_pg``
    (group ranks, as torch), disjoint; a member may be in none of them. Each list is
    sorted, as torch does, so group rank i of a new group is its i-th smallest member.

    Returns the caller's new group, or None for a member in no list. ``backend``: None
    (the parent's), or the parent's backend or part of it (``"nccl"`` from a
    ``"cpu:mpi,cuda:nccl"`` parent: see :class:`mpidist.BackendConfig`). ``timeout`` and
    ``pg_options`` are accepted and ignored; ``group_desc`` names the new groups.

    Differs from torch: torch splits only NCCL groups whose default group is bound to a
    device (``init_process_group(device_id=...)``); mpidist splits any group.

    Raises:
        ValueError: ``split_ranks`` None or empty, a list empty or with repeated or
            out-of-range ranks, two lists sharing a rank, lists that differ between the
            members; the caller not a member of ``parent_pg``; a backend the parent
            does not have.
        TypeError: ranks that are not ints.
    """
    op = "split_group"
    st = runtime.state()
    parent = runtime.resolve_group(parent_pg)
    if parent.comm is None:
        raise ValueError(
            f"{prefix(op)} global rank {st.rank} is not part of the parent group; only its members call split_group"
        )
    lists = _check_lists(split_ranks, parent.size(), op, "split_ranks", "parent group size")
    chosen = parent.backend if backend is None else _child_backend(parent, backend, op)
    return split(parent, [[parent.ranks[r] for r in lst] for lst in lists], op, chosen, group_desc)


def _check_lists(lists: Any, bound: int, op: str, arg: str, what: str) -> list[list[int]]:
    """``lists`` (argument ``arg``): a non-empty list of disjoint lists of ranks in
    ``[0, bound)`` (``what`` names the bound), each sorted."""
    ranks = "global ranks" if what == "world size" else "ranks in the parent group"
    if not lists:
        raise ValueError(f"{prefix(op)} {arg} must be a non-empty list of lists of {ranks}, got {lists!r}")
    if isinstance(lists, (str, bytes)) or not isinstance(lists, Sequence):
        raise TypeError(f"{prefix(op)} {arg} must be a list of lists of {ranks}, got {type(lists).__name__}")
    out = [_check_ranks(r, bound, op, f"{arg}[{i}]", what=what) for i, r in enumerate(lists)]
    _check_disjoint(out, op, arg)
    return out


def _check_disjoint(lists: Sequence[Sequence[int]], op: str, arg: str) -> None:
    seen: dict[int, int] = {}
    for i, lst in enumerate(lists):
        for r in lst:
            if r in seen:
                raise ValueError(
                    f"{prefix(op)} rank {r} appears in both {arg}[{seen[r]}] {list(lists[seen[r]])} and "
                    f"{arg}[{i}] {list(lst)}; the groups must not overlap"
                )
            seen[r] = i


def _child_backend(parent: ProcessGroup, backend: str, op: str) -> str:
    """The canonical ``backend`` for a group split from ``parent``: one whose device
    backends are all the parent's."""
    name = _check_backend(backend, op)
    want, have = BackendConfig(name).get_device_backend_map(), BackendConfig(parent.backend).get_device_backend_map()
    if any(have.get(d) != b for d, b in want.items()):
        raise ValueError(
            f"{prefix(op)} backend {backend!r} is not part of the parent group's backend "
            f"{parent.backend!r}; pass None or the parent's own"
        )
    return name


def new_subgroups_by_enumeration(
    ranks_per_subgroup_list: Any,
    timeout: Optional[datetime.timedelta] = None,
    backend: Optional[str] = None,
    pg_options: Any = None,
    group_desc: Optional[str] = None,
) -> tuple[Optional[ProcessGroup], list[ProcessGroup]]:
    """Make one group per list of global ranks (torch.distributed.new_subgroups_by_enumeration).

    Collective over ALL ranks of the default group, which must pass the same lists; the
    lists must not overlap, and a rank may be in none. One ``MPI_Comm_split`` makes
    every group at once (torch calls ``new_group`` per list). Each list is sorted, as
    new_group sorts.

    Returns ``(the caller's group or None, all the groups)``; in the list, the groups the
    caller is not in are ``NON_GROUP_MEMBER``, as torch's new_group returns them.
    ``backend``: as new_group's; ``timeout`` and ``pg_options`` are accepted and ignored;
    ``group_desc`` names every subgroup.

    Raises:
        ValueError: an empty list of lists, a list empty or with repeated or
            out-of-range ranks, two lists sharing a rank ("Rank r has appeared in both
            subgroup ..." in torch), lists that differ between the ranks.
        TypeError: ranks that are not ints.
    """
    op = "new_subgroups_by_enumeration"
    st = runtime.state()
    lists = _check_lists(ranks_per_subgroup_list, st.world_size, op, "ranks_per_subgroup_list", "world size")
    mine = split(st.world, lists, op, _check_backend(backend, op) or st.backend, group_desc)
    _counted(len(lists))
    return mine, [mine if mine is not None and st.rank in lst else GroupMember.NON_GROUP_MEMBER for lst in lists]


def new_subgroups(
    group_size: Optional[int] = None,
    group: Optional[ProcessGroup] = None,
    timeout: Optional[datetime.timedelta] = None,
    backend: Optional[str] = None,
    pg_options: Any = None,
    group_desc: Optional[str] = None,
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
    st = runtime.state()
    if group is not None:
        raise ValueError(f"{prefix(op)} group must be None (subgroups of the world only)")
    size = st.local_world_size if group_size is None else group_size
    if not isinstance(size, (int, np.integer)) or size < 1 or size > st.world_size or st.world_size % size:
        raise ValueError(
            f"{prefix(op)} group_size must divide the world size {st.world_size} and be >= 1, got {group_size!r}"
        )
    subgroups = [
        new_group(
            range(start, start + size),
            timeout,
            backend,
            pg_options,
            group_desc=f"{group_desc or 'subgroup'}{start // size}",
        )
        for start in range(0, st.world_size, size)
    ]
    return subgroups[st.rank // size], subgroups


def _known(g: Optional[ProcessGroup], op: str) -> ProcessGroup:
    pg = runtime.resolve_group(g)
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
