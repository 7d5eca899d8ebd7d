"""The hierarchical all-reduce (mpidist.algorithms.hierarchical) on pretend nodes: the ranks of
this machine placed on several "nodes" (HierAllReduce's node_color; the group's choice through
collectives._node_color), evenly and unevenly, against values computed without mpidist. Across
real hosts: tests/slurm/two_hosts.sh runs this file on two network namespaces (make test-slurm)."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI
from test_collectives import expected, rank_input, same_bytes_everywhere

from mpidist import ReduceOp
from mpidist._backends.mpi import collectives
from mpidist.algorithms import HierAllReduce, shm_applicable

pytestmark = pytest.mark.mpi

#: node of each rank, by world size: every layout the world size allows, uneven ones included
LAYOUTS = {
    "mpi": None,  # the nodes MPI reports
    "each alone": lambda r, n: r,
    "pairs": lambda r, n: r // 2,  # -n 3: 2 + 1; -n 4: 2 + 2
    "first alone": lambda r, n: min(r, 1),  # -n 3: 1 + 2; -n 4: 1 + 3
}
OPS = [ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX]


def colors(layout: str) -> list:
    """Every rank's pretend node (collective): the layout's, within the real node, so that
    across hosts (make test-slurm) a pretend node never spans two real ones."""
    place = LAYOUTS[layout]
    world = MPI.COMM_WORLD
    n = world.Get_size()
    node = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
    first = world.allgather(node.bcast(world.Get_rank()))  # a real node's lowest world rank names it
    node.Free()
    return [None if place is None else place(r, n) * n + first[r] for r in range(n)]


def color(layout: str):
    return colors(layout)[MPI.COMM_WORLD.Get_rank()]


@pytest.mark.parametrize("inter", ["mpi", "ring"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.float16, np.int8])
@pytest.mark.parametrize("op", [op for op in OPS if op is not ReduceOp.AVG])  # (AVG: test_through_all_reduce)
def test_matches_numpy_on_every_layout(dist, world, op, dtype, layout, inter):
    """Every op and dtype (float16 and int8: reduced by mpidist, not MPI), across 1 to 4 nodes
    of uneven sizes; the result bitwise identical on every rank."""
    rank, size = world
    with HierAllReduce(MPI.COMM_WORLD, node_color=color(layout), inter=inter) as h:
        for shape in [(3, 5), (0,), (70001,)]:  # 70001 float64: chunks of the window and a tail
            x = rank_input(rank, shape, dtype)
            h(x, op)
            np.testing.assert_array_equal(x, expected(op, size, shape, dtype))
            assert same_bytes_everywhere(x)


def test_counts_nodes(dist, world):
    rank, size = world
    nodes = colors("pairs")
    with HierAllReduce(MPI.COMM_WORLD, node_color=nodes[rank]) as h:
        assert h.nodes == len(set(nodes))
        assert h.local_size == nodes.count(nodes[rank])
        assert (h.shm is None) == (h.local_size == 1)


def test_bool_and_bitwise(dist, world):
    rank, size = world
    with HierAllReduce(MPI.COMM_WORLD, node_color=color("pairs")) as h:
        b = np.array([rank == 0, True, rank % 2 == 1])
        h(b, ReduceOp.BOR)
        np.testing.assert_array_equal(b, [True, True, size > 1])
        v = np.array([0b1111 ^ (1 << (rank % 4))], np.int64)
        h(v, ReduceOp.BAND)
        assert int(v[0]) == 0b1111 & ~sum(1 << (r % 4) for r in range(size))


@pytest.mark.parametrize("layout", ["pairs", "first alone"])
def test_through_all_reduce(dist, world, monkeypatch, layout):
    """``algorithm="hierarchical"`` on a group, AVG and PREMUL_SUM included; and the automatic
    choice takes it on a group that spans nodes (some of several ranks) from HIER_OVER_MPI."""
    rank, size = world
    nodes = colors(layout)
    monkeypatch.setattr(collectives, "_node_color", nodes.__getitem__)
    g = dist.new_group(list(range(size)))  # its node split is made at its first all_reduce
    try:
        x = np.full((4, 3), rank + 1.0)
        dist.all_reduce(x, ReduceOp.AVG, group=g, algorithm="hierarchical")
        assert np.all(x == (size + 1) / 2)
        y = np.full(5, rank + 1.0, np.float32)
        dist.all_reduce(y, dist.make_premul_sum(2.0), group=g, algorithm="hierarchical")
        assert np.all(y == size * (size + 1))
        big = np.zeros(collectives.HIER_OVER_MPI // 4, np.float32)
        body = collectives._auto_choice(g, big)
        spread = len(set(nodes)) > 1 and max(map(nodes.count, nodes)) > 1  # several nodes, one of several ranks
        assert (body is collectives.ALL_REDUCE["hierarchical"].body) == spread
        if spread:  # below the threshold: MPI
            assert collectives._auto_choice(g, big[:-1]) is collectives.ALL_REDUCE["mpi"].body
        big[:] = rank + 1
        dist.all_reduce(big, group=g)
        assert np.all(big == size * (size + 1) // 2)
    finally:
        dist.destroy_process_group(g)


def test_one_node_is_the_shared_memory_algorithm(dist, world):
    """A group on one node: the hierarchical algorithm is the shared-memory step alone."""
    if not shm_applicable(MPI.COMM_WORLD):
        pytest.skip("the ranks are on several hosts")
    x = np.full(1000, world[0] + 1.0)
    with HierAllReduce(MPI.COMM_WORLD, node_color=0) as h:
        assert h.nodes == 1
        h(x, ReduceOp.SUM)
    assert np.all(x == world[1] * (world[1] + 1) / 2)


def test_bad_input(dist, world):
    rank, _ = world
    with pytest.raises(ValueError, match=r"hierarchical_all_reduce: inter must be 'mpi' or 'ring', got 'tree'"):
        HierAllReduce(MPI.COMM_WORLD, inter="tree")
    h = HierAllReduce(MPI.COMM_WORLD, node_color=color("pairs"))
    with pytest.raises(TypeError, match=r"hierarchical_all_reduce: op must be a ReduceOp"):
        h(np.ones(3), "sum")
    with pytest.raises(ValueError, match=r"ReduceOp.MAX is not defined for complex"):
        h(np.ones(3, np.complex64), ReduceOp.MAX)
    with pytest.raises(ValueError, match=r"C-contiguous|contiguous"):
        h(np.ones((4, 4))[:, 0], ReduceOp.SUM)
    h.free()
    h.free()  # idempotent
    with pytest.raises(ValueError, match=r"this HierAllReduce was freed"):
        h(np.ones(3), ReduceOp.SUM)


def test_mismatch_within_a_node_raises_there(dist, world):
    """Ranks of one node that call with different counts get a ValueError naming the calls (on
    every node, here, since each node's ranks disagree alike), before any data changes."""
    rank, size = world
    nodes = colors("pairs")
    if any(nodes.count(c) != 2 for c in nodes):
        pytest.skip("needs nodes of two ranks each")
    with HierAllReduce(MPI.COMM_WORLD, node_color=color("pairs")) as h:
        x = np.ones(4 + rank % 2)
        with pytest.raises(ValueError, match=r"mismatched all-reduces: rank 0: count=4, .*rank 1: count=5"):
            h(x, ReduceOp.SUM)
        assert np.all(x == 1)
        y = np.ones(6)
        h(y, ReduceOp.SUM)  # still usable
        assert np.all(y == size)
