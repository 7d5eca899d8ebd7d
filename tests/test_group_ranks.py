"""torch 2.4+'s group_src / group_dst / group_peer: the root or peer named by its rank in
the group instead of its global rank, on every op that takes src/dst/peer (one rule,
mpidist._dispatch.dispatch.root_rank, as torch's _canonicalize_group_rank)."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
from conftest import make_group

import mpidist

pytestmark = pytest.mark.mpi

#: op -> its global-rank argument and group-rank argument (torch 2.13's signatures; the
#: *_multigpu forms, gone from torch, take them too)
KEYWORDS = {
    "broadcast": ("src", "group_src"),
    "reduce": ("dst", "group_dst"),
    "gather": ("dst", "group_dst"),
    "scatter": ("src", "group_src"),
    "send": ("dst", "group_dst"),
    "recv": ("src", "group_src"),
    "isend": ("dst", "group_dst"),
    "irecv": ("src", "group_src"),
    "P2POp": ("peer", "group_peer"),
    "broadcast_object_list": ("src", "group_src"),
    "gather_object": ("dst", "group_dst"),
    "scatter_object_list": ("src", "group_src"),
    "send_object_list": ("dst", "group_dst"),
    "recv_object_list": ("src", "group_src"),
    "broadcast_multigpu": ("src", "group_src"),
    "reduce_multigpu": ("dst", "group_dst"),
}


@pytest.mark.parametrize("name", sorted(KEYWORDS))
def test_every_root_or_peer_argument_has_its_group_form(name):
    params = inspect.signature(getattr(mpidist, name)).parameters
    arg, group_arg = KEYWORDS[name]
    assert params[arg].default is None and params[group_arg].default is None


def _last(members: list) -> int:
    return len(members) - 1


@pytest.mark.parametrize("kind", ["world", "parity", "single"])
def test_collectives_by_group_rank_equal_by_global_rank(dist, world, kind):
    """Each rooted collective with the root as group rank gives what it gives with the
    same root as global rank (the last member: group rank != global rank on odd ranks)."""
    rank, _ = world
    g, members = make_group(dist, kind)
    if rank not in members:
        x = np.full(3, -1.0)
        assert dist.broadcast(x, group=g, group_src=0) is None and dist.reduce(x, group=g, group_dst=0) is None
        assert dist.gather(x, group=g, group_dst=0) is None and dist.scatter(x, group=g, group_src=0) is None
        assert (x == -1).all()
        return
    root_g = _last(members)
    root = members[root_g]
    results = []
    for by_group in (False, True):
        kw = (lambda a: {f"group_{a}": root_g}) if by_group else (lambda a: {a: root})
        b = np.full(3, float(rank))
        dist.broadcast(b, group=g, **kw("src"))
        r = np.full(3, rank + 1.0)
        dist.reduce(r, group=g, **kw("dst"))
        gl = [np.zeros(2) for _ in members] if rank == root else None
        dist.gather(np.full(2, float(rank)), gl, group=g, **kw("dst"))
        s = np.zeros(2)
        sl = [np.full(2, 10.0 * m) for m in members] if rank == root else None
        dist.scatter(s, sl, group=g, **kw("src"))
        objs = [rank, "x"]
        dist.broadcast_object_list(objs, group=g, **kw("src"))
        og = [None] * len(members) if rank == root else None
        dist.gather_object({"r": rank}, og, group=g, **kw("dst"))
        so = [None]
        dist.scatter_object_list(so, [m * 3 for m in members] if rank == root else None, group=g, **kw("src"))
        bm = [np.full(2, float(rank)), np.zeros(2)]
        dist.broadcast_multigpu(bm, group=g, **kw("src"))
        rm = [np.full(2, 1.0), np.full(2, 2.0)]
        dist.reduce_multigpu(rm, group=g, **kw("dst"))
        results.append((b, r, gl, s, objs, og, so, bm, rm))
    by_global, by_group = results
    for a, b in zip(by_global, by_group):
        if isinstance(a, np.ndarray):
            np.testing.assert_array_equal(a, b)
        elif isinstance(a, list) and a and isinstance(a[0], np.ndarray):
            for x, y in zip(a, b):
                np.testing.assert_array_equal(x, y)
        else:
            assert a == b
    b, r, gl, s, objs, og, so, bm, rm = by_group  # and they are right
    np.testing.assert_array_equal(b, np.full(3, float(root)))
    np.testing.assert_array_equal(s, np.full(2, 10.0 * rank))
    assert objs == [root, "x"] and so == [rank * 3]
    np.testing.assert_array_equal(bm[1], np.full(2, float(root)))
    if rank == root:
        np.testing.assert_array_equal(r, np.full(3, float(sum(m + 1 for m in members))))
        assert [int(x[0]) for x in gl] == members and og == [{"r": m} for m in members]
        np.testing.assert_array_equal(rm[0], np.full(2, 3.0 * len(members)))
    else:
        np.testing.assert_array_equal(r, np.full(3, rank + 1.0))  # a non-root's input is left alone
    if g is not None:
        dist.destroy_process_group(g)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", ["world", "parity"])
def test_point_to_point_by_group_rank(dist, world, kind):
    """A ring in the group with group_dst/group_src: recv returns the sender's GLOBAL rank."""
    rank, size = world
    g, members = make_group(dist, kind)
    if rank not in members or len(members) < 2:
        if g is not None and g is not dist.GroupMember.NON_GROUP_MEMBER:
            dist.destroy_process_group(g)
        return
    n, me = len(members), members.index(rank)
    right, left = (me + 1) % n, (me - 1) % n
    x, y = np.full(4, float(rank)), np.zeros(4)
    if me % 2 == 0:
        dist.send(x, group=g, group_dst=right, tag=3)
        got = dist.recv(y, group=g, group_src=left, tag=3)
    else:
        got = dist.recv(y, group=g, group_src=left, tag=3)
        dist.send(x, group=g, group_dst=right, tag=3)
    assert got == members[left]
    np.testing.assert_array_equal(y, np.full(4, float(members[left])))
    y[:] = 0
    works = [dist.irecv(y, group=g, group_src=left, tag=4), dist.isend(x, group=g, group_dst=right, tag=4)]
    for w in works:
        w.wait()
    assert works[0].source_rank() == members[left]
    np.testing.assert_array_equal(y, np.full(4, float(members[left])))
    y[:] = 0
    ops = [
        dist.P2POp(dist.irecv, y, group=g, tag=5, group_peer=left),
        dist.P2POp(dist.isend, x, group=g, tag=5, group_peer=right),
    ]
    assert "group_peer=" in repr(ops[0])
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    np.testing.assert_array_equal(y, np.full(4, float(members[left])))
    objs = [None, None]
    if me % 2 == 0:
        dist.send_object_list([rank, "o"], group=g, group_dst=right, use_batch=True)
        got = dist.recv_object_list(objs, group=g, group_src=left, use_batch=True)
    else:
        got = dist.recv_object_list(objs, group=g, group_src=left)
        dist.send_object_list([rank, "o"], group=g, group_dst=right)
    assert got == members[left] and objs == [members[left], "o"]
    if g is not None:
        dist.destroy_process_group(g)


def test_root_argument_errors(dist, world):
    rank, size = world
    x = np.ones(2)
    both = r"src=0 and group_src=0 both given; specify one of them: src is a global rank, group_src a rank in the group"
    with pytest.raises(ValueError, match=rf"\[rank {rank}/{size}\] broadcast: {both}"):
        dist.broadcast(x, 0, group_src=0)
    with pytest.raises(ValueError, match=rf"scatter: {both}"):
        dist.scatter(x, [x] * size if rank == 0 else None, 0, group_src=0)
    with pytest.raises(
        ValueError,
        match=r"reduce: neither dst \(a global rank\) nor group_dst \(a rank in the "
        r"group\) given; specify one of them",
    ):
        dist.reduce(x)
    with pytest.raises(ValueError, match=r"broadcast: neither src"):
        dist.broadcast(x)
    with pytest.raises(ValueError, match=r"send: neither dst"):
        dist.send(x)
    with pytest.raises(
        ValueError,
        match=rf"gather: group_dst={size} is out of range for group 'default_pg' of "
        rf"size {size}; expected 0 <= group_dst < {size}",
    ):
        dist.gather(x, group_dst=size)
    with pytest.raises(TypeError, match=r"isend: group_dst must be an int \(a rank in the group\), got str"):
        dist.isend(x, group_dst="1")
    with pytest.raises(ValueError, match=r"recv_object_list: src=0 and group_src=0 both given"):
        dist.recv_object_list([None], 0, group_src=0)
    with pytest.raises(ValueError, match=rf"send: group_dst={rank} is the calling rank itself"):
        dist.send(x, group_dst=rank)
    with pytest.raises(ValueError, match=r"P2POp: peer=1 and group_peer=1 both given"):
        dist.P2POp(dist.irecv, x, 1, group_peer=1)
    with pytest.raises(
        ValueError,
        match=r"P2POp: an isend needs its destination: peer \(a global rank\) or "
        r"group_peer",
    ):
        dist.P2POp(dist.isend, x)
    with pytest.raises(
        ValueError,
        match=rf"batch_isend_irecv: p2p_op_list\[0\].group_peer={size} is out of "
        rf"range",
    ):
        dist.batch_isend_irecv([dist.P2POp(dist.irecv, x, group_peer=size)])


def test_gather_scatter_and_objects_default_to_rank_0(dist, world):
    """Neither dst nor group_dst: global rank 0, as torch (gather, scatter, the object forms)."""
    rank, size = world
    gl = [np.zeros(1) for _ in range(size)] if rank == 0 else None
    dist.gather(np.full(1, float(rank)), gl)
    s = np.zeros(1)
    dist.scatter(s, [np.full(1, 7.0 + r) for r in range(size)] if rank == 0 else None)
    objs = [rank]
    dist.broadcast_object_list(objs)
    assert objs == [0] and s[0] == 7.0 + rank
    if rank == 0:
        assert [int(a[0]) for a in gl] == list(range(size))
