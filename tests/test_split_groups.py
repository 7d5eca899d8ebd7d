"""split_group, new_subgroups_by_enumeration (one MPI_Comm_split each), new_group's
sort_ranks/device_id, and get_pg_count (torch 2.13's counting)."""

from __future__ import annotations

import numpy as np
import pytest

import mpidist

pytestmark = pytest.mark.mpi


def _sum_over(dist, g, rank):
    x = np.full(2, float(rank))
    dist.all_reduce(x, group=g)
    return x[0]


def test_new_subgroups_by_enumeration(dist, world):
    rank, size = world
    evens, odds = list(range(0, size, 2)), list(range(1, size, 2))
    lists = [odds[::-1], evens] if odds else [evens]
    before = dist.get_pg_count()
    mine, groups = dist.new_subgroups_by_enumeration(lists, group_desc="parity")
    assert dist.get_pg_count() == before + len(lists)  # torch: one new_group per list
    assert len(groups) == len(lists)
    want = odds if rank % 2 else evens
    assert mine is groups[lists.index(odds[::-1] if rank % 2 else evens)]
    assert [g is dist.GroupMember.NON_GROUP_MEMBER for g in groups] == [g is not mine for g in groups]
    assert dist.get_process_group_ranks(mine) == want  # sorted, as new_group sorts
    assert dist.get_rank(mine) == want.index(rank) and mine.group_name == "parity"
    assert _sum_over(dist, mine, rank) == sum(want)
    for g in groups:
        if g is not dist.GroupMember.NON_GROUP_MEMBER:
            dist.destroy_process_group(g)


def test_new_subgroups_by_enumeration_leaves_ranks_out(dist, world):
    rank, size = world
    mine, groups = dist.new_subgroups_by_enumeration([[0]])
    assert (mine is groups[0]) == (rank == 0)
    if rank == 0:
        assert dist.get_world_size(mine) == 1
        dist.destroy_process_group(mine)
    else:
        assert mine is None and groups == [dist.GroupMember.NON_GROUP_MEMBER]


def test_new_subgroups_by_enumeration_errors(dist, world):
    rank, size = world
    with pytest.raises(
        ValueError,
        match=r"new_subgroups_by_enumeration: ranks_per_subgroup_list must be a "
        r"non-empty list",
    ):
        dist.new_subgroups_by_enumeration([])
    with pytest.raises(
        ValueError,
        match=r"new_subgroups_by_enumeration: rank 0 appears in both "
        r"ranks_per_subgroup_list\[0\] \[0\] and ranks_per_subgroup_list\[1\] "
        r"\[0\]; the groups must not overlap",
    ):
        dist.new_subgroups_by_enumeration([[0], [0]])
    with pytest.raises(ValueError, match=rf"rank {size} in ranks_per_subgroup_list\[0\] is out of range"):
        dist.new_subgroups_by_enumeration([[size]])
    with pytest.raises(TypeError, match=r"ranks_per_subgroup_list\[0\] must hold ints"):
        dist.new_subgroups_by_enumeration([["0"]])


@pytest.mark.mpi(min_size=2)
def test_lists_that_differ_between_ranks_fail_on_every_rank(dist, world):
    """A program whose ranks pass different lists gets a ValueError everywhere, not wrong groups."""
    rank, size = world
    count = dist.get_pg_count()
    with pytest.raises(
        ValueError,
        match=r"new_subgroups_by_enumeration: the members of group 'default_pg' passed "
        r"different ranks; every member must pass the same",
    ):
        dist.new_subgroups_by_enumeration([[0]] if rank == 0 else [[1]])
    with pytest.raises(ValueError, match=r"split_group: the members of group 'default_pg' passed different ranks"):
        dist.split_group(split_ranks=[[0, 1]] if rank == 0 else [[0], [1]])
    assert dist.get_pg_count() == count
    dist.barrier()


@pytest.mark.parametrize("sub", ["world", "dup"])
def test_split_group_by_parent_group_ranks(dist, world, sub):
    """split_ranks are ranks IN the parent group; here the parent orders ranks in reverse
    (sort_ranks=False), so parent rank i is global rank size-1-i."""
    rank, size = world
    parent = None if sub == "world" else dist.new_group(list(range(size))[::-1], sort_ranks=False)
    to_global = (lambda r: r) if parent is None else (lambda r: size - 1 - r)
    halves = [list(range(0, size, 2)), list(range(1, size, 2))] if size > 1 else [[0]]
    count = dist.get_pg_count()
    g = dist.split_group(parent, [h[::-1] for h in halves], group_desc="half")
    assert dist.get_pg_count() == count  # torch does not count split groups
    mine = next(h for h in halves if rank in [to_global(r) for r in h])
    members = [to_global(r) for r in sorted(mine)]  # each list sorted by parent rank, as torch
    assert dist.get_process_group_ranks(g) == members and g.group_name == "half"
    assert _sum_over(dist, g, rank) == sum(members)
    dist.destroy_process_group(g)
    if parent is not None:
        dist.destroy_process_group(parent)


def test_split_group_leaves_ranks_out_and_inherits_backend(dist, world):
    rank, size = world
    g = dist.split_group(split_ranks=[[size - 1]])
    if rank == size - 1:
        assert dist.get_process_group_ranks(g) == [rank] and g.backend == dist.get_backend()
        dist.destroy_process_group(g)
    else:
        assert g is None


def test_split_group_errors(dist, world):
    rank, size = world
    with pytest.raises(
        ValueError,
        match=r"split_group: split_ranks must be a non-empty list of lists of ranks in "
        r"the parent group, got None",
    ):
        dist.split_group()
    with pytest.raises(
        ValueError,
        match=rf"split_group: rank {size} in split_ranks\[0\] is out of range; expected "
        rf"0 <= rank < parent group size {size}",
    ):
        dist.split_group(split_ranks=[[size]])
    with pytest.raises(ValueError, match=r"split_group: split_ranks\[1\] must name at least one rank"):
        dist.split_group(split_ranks=[[0], []])
    with pytest.raises(ValueError, match=r"split_group: split_ranks\[0\] must not repeat, got duplicates \[0\]"):
        dist.split_group(split_ranks=[[0, 0]])
    with pytest.raises(ValueError, match=r"split_group: rank 0 appears in both split_ranks\[0\]"):
        dist.split_group(split_ranks=[[0], [0]])
    with pytest.raises(
        ValueError,
        match=r"split_group: backend 'nccl' is not part of the parent group's backend "
        r"'mpi'",
    ):
        dist.split_group(split_ranks=[[0]], backend="nccl")
    single = dist.new_group([size - 1])
    if rank != size - 1:
        with pytest.raises(ValueError, match=rf"split_group: global rank {rank} is not part of the parent group"):
            dist.split_group(single, [[0]])
    else:
        dist.destroy_process_group(single)


def test_new_group_sort_ranks_false_and_device_id(dist, world):
    rank, size = world
    given = list(range(size))[::-1]
    g = dist.new_group(given, sort_ranks=False, device_id=None)
    assert dist.get_process_group_ranks(g) == given and dist.get_rank(g) == size - 1 - rank
    x = np.zeros(size)
    x[dist.get_rank(g)] = rank
    dist.all_reduce(x, group=g)
    assert x.tolist() == [float(r) for r in given]  # slot i: group rank i's global rank
    dist.destroy_process_group(g)


def test_get_pg_count(dist, world):
    rank, size = world
    start = dist.get_pg_count()
    assert start >= 1  # the default group counts
    g = dist.new_group([0])  # counted on every rank that calls it, member or not
    assert dist.get_pg_count() == start + 1
    local = dist.new_group([rank], use_local_synchronization=True)  # not counted, as torch
    assert dist.get_pg_count() == start + 1
    dist.destroy_process_group(local)
    if rank == 0:
        dist.destroy_process_group(g)


def test_get_pg_count_restarts_with_the_runtime(dist):
    dist.destroy_process_group()
    try:
        assert mpidist.get_pg_count() == 0
        dist.init_process_group()
        assert mpidist.get_pg_count() == 1
    finally:
        if not dist.is_initialized():
            dist.init_process_group()
