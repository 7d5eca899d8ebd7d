"""new_group / new_subgroups as MPI sub-communicators, rank translation, non-member semantics."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

pytestmark = pytest.mark.mpi


def test_group_ranks_and_translation(dist, any_group):
    g, members = any_group
    rank = dist.get_rank()
    if rank in members:
        assert dist.get_rank(g) == members.index(rank)
        assert dist.get_world_size(g) == len(members)
        assert dist.get_process_group_ranks(g if g is not None else dist.group.WORLD) == members
        for i, r in enumerate(members):
            assert dist.get_group_rank(g or dist.GroupMember.WORLD, r) == i
            assert dist.get_global_rank(g or dist.GroupMember.WORLD, i) == r
    else:
        assert g is dist.GroupMember.NON_GROUP_MEMBER
        assert dist.get_rank(g) == -1 and dist.get_world_size(g) == -1


def test_group_has_its_own_communicator(dist, any_group):
    g, members = any_group
    if dist.get_rank() not in members or g is None:
        return
    assert g.comm != MPI.COMM_WORLD and g.comm != dist.group.WORLD.comm
    assert MPI.Comm.Compare(g.comm, dist.group.WORLD.comm) != MPI.IDENT


def test_collectives_on_groups_and_non_members_untouched(dist, any_group):
    g, members = any_group
    rank = dist.get_rank()
    x = np.full(5, float(rank + 1))
    before = x.copy()
    result = dist.all_reduce(x, group=g)
    assert result is None
    if rank in members:
        np.testing.assert_array_equal(x, np.full(5, float(sum(r + 1 for r in members))))
        src = members[-1]
        y = np.full(3, rank, dtype=np.int32)
        dist.broadcast(y, src=src, group=g)
        np.testing.assert_array_equal(y, np.full(3, src))
    else:
        np.testing.assert_array_equal(x, before)
        assert dist.all_reduce(x, group=g, async_op=True) is None
        assert dist.broadcast(x, 0, group=g) is None
        np.testing.assert_array_equal(x, before)


def test_src_outside_group_rejected(dist):
    size = dist.get_world_size()
    g = dist.new_group([r for r in range(size) if r != size - 1] or [0])
    if dist.get_rank(g) >= 0 and size > 1:
        with pytest.raises(ValueError, match=rf"broadcast: src={size - 1}: global rank {size - 1} is not part"):
            dist.broadcast(np.ones(2), src=size - 1, group=g)
    if g is not dist.GroupMember.NON_GROUP_MEMBER:
        dist.destroy_process_group(g)


def test_new_group_bad_ranks(dist):
    size = dist.get_world_size()
    with pytest.raises(ValueError, match=r"new_group: ranks must not repeat, got duplicates \[0\]"):
        dist.new_group([0, 0])
    with pytest.raises(ValueError, match=rf"new_group: rank {size} in ranks is out of range"):
        dist.new_group([0, size])
    with pytest.raises(ValueError, match=r"new_group: rank -1 in ranks is out of range"):
        dist.new_group([-1])
    with pytest.raises(TypeError, match=r"new_group: ranks must hold ints, got '0'"):
        dist.new_group(["0"])
    with pytest.raises(ValueError, match=r"new_group: backend 'nccl2' is not supported"):
        dist.new_group([0], backend="nccl2")


def test_new_group_sorts_ranks_like_torch(dist):
    size = dist.get_world_size()
    g = dist.new_group(list(range(size))[::-1])
    assert dist.get_process_group_ranks(g) == list(range(size))
    assert dist.get_rank(g) == dist.get_rank()
    dist.destroy_process_group(g)


def test_new_subgroups(dist):
    rank, size = dist.get_rank(), dist.get_world_size()
    mine, subgroups = dist.new_subgroups(1)
    assert len(subgroups) == size and dist.get_world_size(mine) == 1 and dist.get_rank(mine) == 0
    assert dist.get_process_group_ranks(mine) == [rank]
    for i, sg in enumerate(subgroups):
        assert (sg is dist.GroupMember.NON_GROUP_MEMBER) == (i != rank)
    dist.destroy_process_group(mine)
    with pytest.raises(ValueError, match=rf"new_subgroups: group_size must divide the world size {size}"):
        dist.new_subgroups(size + 1)
    if size % 2 == 0:
        mine, subgroups = dist.new_subgroups(2)
        assert len(subgroups) == size // 2
        assert dist.get_process_group_ranks(mine) == [rank - rank % 2, rank - rank % 2 + 1]
        dist.destroy_process_group(mine)


def test_destroyed_group_cannot_be_used(dist):
    g = dist.new_group()
    dist.destroy_process_group(g)
    with pytest.raises(ValueError, match=r"was destroyed by destroy_process_group"):
        dist.all_reduce(np.ones(2), group=g)
    with pytest.raises(ValueError, match=r"was destroyed"):
        dist.get_rank(g)


def test_translation_errors(dist):
    size = dist.get_world_size()
    with pytest.raises(ValueError, match=rf"get_group_rank: global rank {size} is not part"):
        dist.get_group_rank(dist.group.WORLD, size)
    with pytest.raises(ValueError, match=rf"get_global_rank: group rank {size} is out of range"):
        dist.get_global_rank(dist.group.WORLD, size)
    with pytest.raises(ValueError, match=r"NON_GROUP_MEMBER"):
        dist.get_process_group_ranks(dist.GroupMember.NON_GROUP_MEMBER)


def test_members_only_creation_with_use_local_synchronization(dist, world):
    """torch's use_local_synchronization=True: only the members call new_group (here the
    non-members do something else meanwhile), and the group works as any other."""
    rank, size = world
    evens, odds = list(range(0, size, 2)), list(range(1, size, 2))
    mine = evens if rank % 2 == 0 else odds
    # members of each parity make their group among themselves, in their own order
    g = dist.new_group(mine, use_local_synchronization=True, group_desc=f"local{rank % 2}")
    assert g is not dist.GroupMember.NON_GROUP_MEMBER
    assert dist.get_rank(g) == mine.index(rank) and dist.get_world_size(g) == len(mine)
    assert dist.get_process_group_ranks(g) == mine and g.group_name == f"local{rank % 2}"
    x = np.full(3, float(rank))
    dist.all_reduce(x, group=g)
    np.testing.assert_array_equal(x, np.full(3, float(sum(mine))))
    other = odds if rank % 2 == 0 else evens
    if other:  # a non-member that calls it gets NON_GROUP_MEMBER without communicating
        assert dist.new_group(other, use_local_synchronization=True) is dist.GroupMember.NON_GROUP_MEMBER
    dist.destroy_process_group(g)
    dist.barrier()
