"""Object collectives and object point-to-point, over every kind of group."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
from mpi4py import MPI
from mpi4py.util import pkl5

from mpidist._core.tags import OBJECT_TAG, USER_TAG_MAX

pytestmark = pytest.mark.mpi

SENTINEL = "unset"


def rank_object(r: int, salt: int = 0):
    """Rank ``r``'s object: nested containers, numpy arrays of several dtypes, None, text."""
    rng = np.random.default_rng([5, r, salt])
    return {
        "rank": r,
        "arr": rng.standard_normal((r + 1, 3)).astype(np.float32),
        "none": None,
        "nested": [r, (r, "x" * r), {"deep": [np.arange(r + salt, dtype=np.int64)], "b": b"\x00" * r}],
        "text": f"from {r} salt {salt}",
        "big": 2**70 + r,
        "empty": np.empty((0, 2), dtype=np.complex128),
    }


def assert_same(got, want):
    """Recursive equality that compares numpy arrays by dtype, shape and values."""
    assert type(got) is type(want), (type(got), type(want))
    if isinstance(want, np.ndarray):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)
    elif isinstance(want, dict):
        assert got.keys() == want.keys()
        for k in want:
            assert_same(got[k], want[k])
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        for a, b in zip(got, want):
            assert_same(a, b)
    else:
        assert got == want


def is_member(dist, members):
    return dist.get_rank() in members


# ---------------------------------------------------------------- broadcast_object_list


@pytest.mark.parametrize("n", [1, 3])
def test_broadcast_object_list_from_every_src(dist, any_group, n):
    g, members = any_group
    rank = dist.get_rank()
    for src in members:
        objs = [rank_object(rank, i) for i in range(n)] if rank == src else [SENTINEL] * n
        if not is_member(dist, members):
            assert dist.broadcast_object_list(objs, src=src, group=g) is None
            assert objs == [SENTINEL] * n
            continue
        assert dist.broadcast_object_list(objs, src=src, group=g) is None
        assert_same(objs, [rank_object(src, i) for i in range(n)])


def test_broadcast_object_list_of_plain_values(dist, any_group):
    g, members = any_group
    if not is_member(dist, members):
        return
    src = members[-1]
    want = [None, 0, 3.5, "s", b"b", (1, 2), [], {}, {"k": None}, np.float64(2.5), True]
    objs = list(want) if dist.get_rank() == src else [SENTINEL] * len(want)
    dist.broadcast_object_list(objs, src=src, group=g)
    assert_same(objs, want)


def test_broadcast_object_list_length_mismatch_raises_on_every_rank(dist, world):
    """The members compare their calls first (mpidist._check.mismatch): on a fresh group, where the
    call is new, every rank raises and nothing is sent."""
    rank, size = world
    g = dist.new_group()
    objs = [1, 2] if rank == 0 else [SENTINEL] * 3
    calls = "; ".join(
        f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: broadcast_object_list(seq=0, count={n}, root=0)"
        for r, n in [([0], 2), (list(range(1, size)), 3)]
        if r
    )
    if size > 1:
        with pytest.raises(ValueError) as info:
            dist.broadcast_object_list(objs, src=0, group=g)
        assert str(info.value) == (
            f"[rank {rank}/{size}] broadcast_object_list: the members of group "
            f"{g.group_name!r} called mismatched collectives (they differ in count): {calls}"
        )
        assert objs == ([1, 2] if rank == 0 else [SENTINEL] * 3)
    dist.destroy_process_group(g)


# ---------------------------------------------------------------- all_gather_object


def test_all_gather_object(dist, any_group):
    g, members = any_group
    rank = dist.get_rank()
    out = [SENTINEL] * len(members)
    assert dist.all_gather_object(out, rank_object(rank), group=g) is None
    if is_member(dist, members):
        assert_same(out, [rank_object(r) for r in members])
    else:
        assert out == [SENTINEL] * len(members)


def test_all_gather_object_of_none_and_varied_sizes(dist, any_group):
    g, members = any_group
    rank = dist.get_rank()
    if not is_member(dist, members):
        return
    # rank r contributes None or an array of r * 1000 bytes: sizes differ across ranks
    obj = None if rank % 2 else np.full(rank * 1000, rank, dtype=np.uint8)
    out = [SENTINEL] * len(members)
    dist.all_gather_object(out, obj, group=g)
    assert_same(out, [None if r % 2 else np.full(r * 1000, r, dtype=np.uint8) for r in members])


# ---------------------------------------------------------------- gather_object


def test_gather_object_to_every_dst(dist, any_group):
    g, members = any_group
    rank = dist.get_rank()
    for dst in members:
        out = [SENTINEL] * len(members) if rank == dst else None
        assert dist.gather_object(rank_object(rank, dst), out, dst=dst, group=g) is None
        if rank == dst:
            assert_same(out, [rank_object(r, dst) for r in members])


def test_gather_object_accepts_empty_list_off_dst(dist, any_group):
    g, members = any_group
    rank = dist.get_rank()
    if not is_member(dist, members):
        return
    out = [SENTINEL] * len(members) if rank == members[0] else []
    dist.gather_object(rank, out, dst=members[0], group=g)
    assert out == (members if rank == members[0] else [])


# ---------------------------------------------------------------- scatter_object_list


def test_scatter_object_list_from_every_src(dist, any_group):
    g, members = any_group
    rank = dist.get_rank()
    for src in members:
        inputs = [rank_object(src, dst) for dst in members] if rank == src else None
        out = [SENTINEL, "kept"]
        assert dist.scatter_object_list(out, inputs, src=src, group=g) is None
        if is_member(dist, members):
            assert_same(out, [rank_object(src, rank), "kept"])
        else:
            assert out == [SENTINEL, "kept"]


def test_scatter_object_list_ignores_input_off_src(dist, any_group):
    g, members = any_group
    rank = dist.get_rank()
    if not is_member(dist, members):
        return
    src = members[0]
    inputs = [f"to {r}" for r in members] if rank == src else ["garbage"]
    out = [None]
    dist.scatter_object_list(out, inputs, src=src, group=g)
    assert out == [f"to {rank}"]


# ---------------------------------------------------------------- big objects


def test_64mib_object_round_trips_through_pkl5(dist, world, monkeypatch):
    rank, size = world
    calls = []
    real_bcast = pkl5.Intracomm.bcast

    def spy(self, obj, root=0):
        calls.append(root)
        return real_bcast(self, obj, root)

    monkeypatch.setattr(pkl5.Intracomm, "bcast", spy)
    want = bytes(range(256)) * (64 * 2**20 // 256)
    objs = [want if rank == 0 else None, np.arange(2**20, dtype=np.float64)]
    dist.broadcast_object_list(objs, src=0)
    assert calls == [0], "broadcast_object_list did not go through mpi4py.util.pkl5"
    assert objs[0] == want
    np.testing.assert_array_equal(objs[1], np.arange(2**20, dtype=np.float64))
    if size > 1:
        if rank == 0:
            dist.send_object_list([want], dst=1)
        elif rank == 1:
            got = [None]
            assert dist.recv_object_list(got, src=0) == 0
            assert got[0] == want


@pytest.mark.skipif(
    os.environ.get("MPIDIST_BIG_TESTS") != "1", reason="needs ~2.2 GiB per rank; set MPIDIST_BIG_TESTS=1"
)
def test_object_over_2gib(dist, world):
    """A numpy array of 2**31 + 8 bytes: over MPI's int count, so pkl5's large-count path."""
    rank, size = world
    n = 2**31 + 8
    big = np.arange(n // 8, dtype=np.uint64).view(np.uint8) if rank == 0 else None
    objs = [big]
    dist.broadcast_object_list(objs, src=0)
    got = objs[0]
    assert got.shape == (n,) and got.dtype == np.uint8
    assert got[-8:].tobytes() == big_tail(n)
    del objs, got
    if size > 1:
        if rank == 0:
            dist.send_object_list([big], dst=size - 1)
        elif rank == size - 1:
            out = [None]
            assert dist.recv_object_list(out, src=0) == 0
            assert out[0].shape == (n,) and out[0][-8:].tobytes() == big_tail(n)


def big_tail(n: int) -> bytes:
    """The last 8 bytes of ``np.arange(n // 8, dtype=uint64).view(uint8)``."""
    return np.array([n // 8 - 1], dtype=np.uint64).tobytes()


# ---------------------------------------------------------------- send/recv_object_list


def test_send_recv_object_list_ring(dist, any_group):
    g, members = any_group
    rank = dist.get_rank()
    if not is_member(dist, members):
        assert dist.send_object_list([1], members[0], group=g) is None
        assert dist.recv_object_list([None], members[0], group=g) == -1
        return
    if len(members) < 2:
        return
    me = members.index(rank)
    right, left = members[(me + 1) % len(members)], members[(me - 1) % len(members)]
    got = [SENTINEL, SENTINEL]
    if me % 2 == 0:
        assert dist.send_object_list([rank_object(rank), None], right, group=g) is None
        assert dist.recv_object_list(got, left, group=g) == left
    else:
        assert dist.recv_object_list(got, left, group=g) == left
        dist.send_object_list([rank_object(rank), None], right, group=g)
    assert_same(got, [rank_object(left), None])


def test_recv_object_list_from_any_source(dist, any_group):
    g, members = any_group
    rank = dist.get_rank()
    if not is_member(dist, members) or len(members) < 2:
        return
    root = members[0]
    if rank == root:
        senders = set()
        for _ in range(len(members) - 1):
            got = [None]
            src = dist.recv_object_list(got, group=g)
            assert_same(got[0], rank_object(src))
            senders.add(src)
        assert senders == set(members[1:])
    else:
        dist.send_object_list([rank_object(rank)], root, group=g)


@pytest.mark.mpi(min_size=2)
def test_object_and_array_messages_never_match(dist, world):
    """An array send and an object send to the same rank, received in the other order."""
    rank, _ = world
    if rank == 0:
        work = dist.isend(np.arange(4.0), 1, tag=0)
        dist.send_object_list(["obj"], 1)
        work.wait()
    elif rank == 1:
        got = [None]
        assert dist.recv_object_list(got, src=0) == 0 and got == ["obj"]
        arr = np.empty(4)
        assert dist.recv(arr, src=0, tag=0) == 0
        np.testing.assert_array_equal(arr, np.arange(4.0))
    with pytest.raises(ValueError, match=rf"send: tag must be in \[0, {USER_TAG_MAX}\]"):
        dist.send(np.ones(1), (rank + 1) % world[1], tag=OBJECT_TAG)
    dist.barrier()


@pytest.mark.mpi(min_size=2)
def test_recv_object_list_length_mismatch(dist, world):
    rank, size = world
    if rank == 0:
        dist.send_object_list([1, 2], 1)
        dist.send_object_list(["next"], 1)
    elif rank == 1:
        out = [SENTINEL] * 3
        with pytest.raises(
            ValueError,
            match=rf"\[rank 1/{size}\] recv_object_list: received 2 objects from "
            rf"rank 0, expected len\(object_list\) = 3",
        ):
            dist.recv_object_list(out, 0)
        assert out == [SENTINEL] * 3
        # the bad message was consumed: the next one arrives intact
        out = [None]
        dist.recv_object_list(out, 0)
        assert out == ["next"]
    dist.barrier()


# ---------------------------------------------------------------- failures agree (issue 14, item 5)


class Unpicklable:
    """An object whose pickling raises (as a lock, a socket or a generator would)."""

    def __reduce__(self):
        raise RuntimeError("no pickling for you")


class Picky:
    """Pickles anywhere; unpickling it raises on global rank ``bad`` only (a class missing there)."""

    def __init__(self, bad: int) -> None:
        self.bad = bad

    def __reduce__(self):
        return (rebuild_picky, (self.bad,))

    def __eq__(self, other):
        return type(other) is Picky and other.bad == self.bad


def rebuild_picky(bad: int) -> Picky:
    if MPI.COMM_WORLD.Get_rank() == bad:
        raise ModuleNotFoundError(f"no module named 'only_elsewhere' on rank {bad}")
    return Picky(bad)


def p(dist) -> str:
    return rf"\[rank {dist.get_rank()}/{dist.get_world_size()}\]"


def cannot_pickle(dist, op: str, who: str) -> str:
    return rf"^{p(dist)} {op}: {who}$"


PICKLE_ERR = "RuntimeError: no pickling for you"


def test_unpicklable_broadcast_raises_on_every_rank_and_the_retry_is_correct(dist, any_group):
    """Before: the source raised PicklingError alone, its peers waited, and took the source's
    retry for this broadcast (then hung in their own retry)."""
    g, members = any_group
    if not is_member(dist, members):
        return
    rank = dist.get_rank()
    for src in members:
        objs = ["ok", Unpicklable()] if rank == src else [SENTINEL, SENTINEL]
        with pytest.raises(
            TypeError,
            match=cannot_pickle(
                dist, "broadcast_object_list", rf"rank {src} could not pickle its object_list: {PICKLE_ERR}"
            ),
        ) as err:
            dist.broadcast_object_list(objs, src=src, group=g)
        if rank == src:
            assert isinstance(err.value.__cause__, RuntimeError)
        else:
            assert objs == [SENTINEL, SENTINEL] and err.value.__cause__ is None
        objs = [f"retry from {src}", rank_object(src)] if rank == src else [SENTINEL, SENTINEL]
        dist.broadcast_object_list(objs, src=src, group=g)
        assert_same(objs, [f"retry from {src}", rank_object(src)])


def test_unpicklable_obj_in_all_gather_object_raises_on_every_rank(dist, any_group):
    g, members = any_group
    if not is_member(dist, members):
        return
    rank = dist.get_rank()
    bad = members[1::2] or members[:1]  # every other member (the only one of a one-rank group)
    out = [SENTINEL] * len(members)
    whos = "; ".join(f"rank {r} could not pickle its obj: {PICKLE_ERR}" for r in bad)
    with pytest.raises(TypeError, match=cannot_pickle(dist, "all_gather_object", whos)) as err:
        dist.all_gather_object(out, Unpicklable() if rank in bad else rank, group=g)
    assert out == [SENTINEL] * len(members)
    assert isinstance(err.value.__cause__, RuntimeError) == (rank in bad)
    dist.all_gather_object(out, rank_object(rank), group=g)
    assert_same(out, [rank_object(r) for r in members])


def test_unpicklable_obj_in_gather_object_raises_on_every_rank(dist, any_group):
    """Before: dst and the ranks that pickled their object went on; only the failing rank raised."""
    g, members = any_group
    if not is_member(dist, members):
        return
    rank = dist.get_rank()
    for dst in members:
        bad = members[-1]
        out = [SENTINEL] * len(members) if rank == dst else None
        with pytest.raises(
            TypeError, match=cannot_pickle(dist, "gather_object", rf"rank {bad} could not pickle its obj: {PICKLE_ERR}")
        ):
            dist.gather_object(Unpicklable() if rank == bad else rank, out, dst=dst, group=g)
        if rank == dst:
            assert out == [SENTINEL] * len(members)
        dist.gather_object(rank_object(rank, dst), out, dst=dst, group=g)
        if rank == dst:
            assert_same(out, [rank_object(r, dst) for r in members])


def test_gather_object_that_dst_cannot_unpickle_raises_on_every_rank(dist, any_group):
    g, members = any_group
    if not is_member(dist, members):
        return
    rank, dst, sender = dist.get_rank(), members[0], members[-1]
    out = [SENTINEL] * len(members) if rank == dst else None
    with pytest.raises(
        TypeError,
        match=cannot_pickle(
            dist,
            "gather_object",
            rf"rank {dst} could not unpickle the obj of rank {sender}: ModuleNotFoundError: "
            rf"no module named 'only_elsewhere' on rank {dst}",
        ),
    ) as err:
        dist.gather_object(Picky(dst) if rank == sender else rank, out, dst=dst, group=g)
    assert isinstance(err.value.__cause__, ModuleNotFoundError) == (rank == dst)
    if rank == dst:
        assert out == [SENTINEL] * len(members)
    dist.gather_object(rank, out, dst=dst, group=g)
    if rank == dst:
        assert out == members


def test_unpicklable_item_in_scatter_object_list_raises_on_every_rank(dist, any_group):
    """Before: src raised after sending the items before the bad one; the later ranks waited."""
    g, members = any_group
    if not is_member(dist, members):
        return
    rank = dist.get_rank()
    for src in members:
        k = len(members) - 1
        inputs = [f"to {r}" for r in members[:k]] + [Unpicklable()] if rank == src else None
        out = [SENTINEL]
        with pytest.raises(
            TypeError,
            match=cannot_pickle(
                dist,
                "scatter_object_list",
                rf"rank {src} could not pickle its scatter_object_input_list\[{k}\]: "
                rf"{PICKLE_ERR}",
            ),
        ):
            dist.scatter_object_list(out, inputs, src=src, group=g)
        assert out == [SENTINEL]
        dist.scatter_object_list(out, [rank_object(src, r) for r in members] if rank == src else None, src=src, group=g)
        assert_same(out, [rank_object(src, rank)])


def test_object_a_receiver_cannot_unpickle_raises_there_and_leaves_nothing_behind(dist, any_group):
    """broadcast_object_list, all_gather_object, scatter_object_list: the rank that cannot
    unpickle raises (the others finish the step), and the next op of the group is intact."""
    g, members = any_group
    if not is_member(dist, members):
        return
    rank, src, bad = dist.get_rank(), members[0], members[-1]
    want = (
        rf"rank {bad} could not unpickle the %s of rank {src}: ModuleNotFoundError: "
        rf"no module named 'only_elsewhere' on rank {bad}"
    )
    objs = [Picky(bad)] if rank == src else [SENTINEL]
    if rank == bad and bad != src:
        with pytest.raises(TypeError, match=cannot_pickle(dist, "broadcast_object_list", want % "object_list")):
            dist.broadcast_object_list(objs, src=src, group=g)
        assert objs == [SENTINEL]
    else:
        dist.broadcast_object_list(objs, src=src, group=g)
        assert objs == [Picky(bad)]
    out = [SENTINEL] * len(members)
    if rank == bad:
        with pytest.raises(TypeError, match=cannot_pickle(dist, "all_gather_object", want % "obj")):
            dist.all_gather_object(out, Picky(bad) if rank == src else rank, group=g)
        assert out == [SENTINEL] * len(members)
    else:
        dist.all_gather_object(out, Picky(bad) if rank == src else rank, group=g)
        assert out == [Picky(bad)] + members[1:]
    out = [SENTINEL]
    inputs = [Picky(bad)] * len(members) if rank == src else None
    if rank == bad:
        with pytest.raises(
            TypeError, match=cannot_pickle(dist, "scatter_object_list", want % "scatter_object_input_list item")
        ):
            dist.scatter_object_list(out, inputs, src=src, group=g)
        assert out == [SENTINEL]
    else:
        dist.scatter_object_list(out, inputs, src=src, group=g)
        assert out == [Picky(bad)]
    out = [SENTINEL] * len(members)
    dist.all_gather_object(out, rank_object(rank), group=g)
    assert_same(out, [rank_object(r) for r in members])


@pytest.mark.mpi(min_size=2)
def test_unpicklable_send_object_list_raises_on_both_sides(dist, world):
    """Before: the sender raised, the receiver waited for the timeout."""
    rank, size = world
    if rank == 0:
        with pytest.raises(
            TypeError,
            match=cannot_pickle(dist, "send_object_list", rf"rank 0 could not pickle its object_list: {PICKLE_ERR}"),
        ) as err:
            dist.send_object_list(["fine", Unpicklable()], 1)
        assert isinstance(err.value.__cause__, RuntimeError)
        dist.send_object_list(["next", Picky(1)], 1)
        dist.send_object_list(["last"], 1)
    elif rank == 1:
        out = [SENTINEL, SENTINEL]
        with pytest.raises(
            TypeError,
            match=cannot_pickle(dist, "recv_object_list", rf"rank 0 could not pickle its object_list: {PICKLE_ERR}"),
        ):
            dist.recv_object_list(out, 0)
        assert out == [SENTINEL, SENTINEL]
        with pytest.raises(
            TypeError,
            match=cannot_pickle(
                dist,
                "recv_object_list",
                r"rank 1 could not unpickle the object_list of rank 0: ModuleNotFoundError: "
                r"no module named 'only_elsewhere' on rank 1",
            ),
        ) as err:
            dist.recv_object_list(out)
        assert isinstance(err.value.__cause__, ModuleNotFoundError) and out == [SENTINEL, SENTINEL]
        out = [None]
        assert dist.recv_object_list(out, 0) == 0 and out == ["last"]
    dist.barrier()


def test_lock_in_broadcast_names_pythons_own_error(dist, world):
    """A real unpicklable object: Python's TypeError, named and chained on src."""
    rank, size = world
    objs = [threading.Lock()] if rank == 0 else [None]
    with pytest.raises(
        TypeError,
        match=cannot_pickle(
            dist,
            "broadcast_object_list",
            r"rank 0 could not pickle its object_list: TypeError: cannot pickle '_thread.lock' object",
        ),
    ) as err:
        dist.broadcast_object_list(objs, src=0)
    assert isinstance(err.value.__cause__, TypeError) == (rank == 0)


# ---------------------------------------------------------------- bad input


def test_bad_lists_rejected_before_communicating(dist, world):
    rank, size = world
    p = rf"\[rank {rank}/{size}\]"
    with pytest.raises(TypeError, match=rf"{p} broadcast_object_list: object_list must be a list, got tuple"):
        dist.broadcast_object_list((1,), src=0)
    with pytest.raises(
        ValueError,
        match=rf"{p} all_gather_object: object_list must have one item per "
        rf"group member \({size}\), got {size + 1}",
    ):
        dist.all_gather_object([None] * (size + 1), 1)
    with pytest.raises(TypeError, match=rf"{p} all_gather_object: object_list must be a list, got NoneType"):
        dist.all_gather_object(None, 1)
    if rank == 0:
        with pytest.raises(
            ValueError,
            match=rf"{p} gather_object: object_gather_list must have one item "
            rf"per group member \({size}\), got {size + 2}",
        ):
            dist.gather_object(1, [None] * (size + 2), dst=0)
        with pytest.raises(TypeError, match=rf"{p} gather_object: object_gather_list must be a list, got NoneType"):
            dist.gather_object(1, None, dst=0)
        with pytest.raises(
            ValueError,
            match=rf"{p} scatter_object_list: scatter_object_input_list must have "
            rf"one item per group member \({size}\), got {size + 1}",
        ):
            dist.scatter_object_list([None], [0] * (size + 1), src=0)
    else:
        with pytest.raises(
            ValueError,
            match=rf"{p} gather_object: object_gather_list must be None on ranks "
            rf"other than dst=0, got a list of {size} items",
        ):
            dist.gather_object(1, [None] * size, dst=0)
        with pytest.raises(
            ValueError,
            match=rf"{p} scatter_object_list: scatter_object_output_list must hold "
            rf"at least 1 item, got an empty list",
        ):
            dist.scatter_object_list([], None, src=0)
    with pytest.raises(
        TypeError,
        match=rf"{p} scatter_object_list: scatter_object_output_list must be a "
        rf"list, got dict",
    ):
        dist.scatter_object_list({}, None, src=0)
    dist.barrier()


def test_bad_ranks_rejected(dist, world):
    rank, size = world
    with pytest.raises(ValueError, match=rf"broadcast_object_list: src={size}: global rank {size} is not part"):
        dist.broadcast_object_list([1], src=size)
    with pytest.raises(ValueError, match=r"gather_object: dst=-1: global rank -1 is not part"):
        dist.gather_object(1, None, dst=-1)
    with pytest.raises(TypeError, match=r"scatter_object_list: src must be an int \(a global rank\), got str"):
        dist.scatter_object_list([None], None, src="0")
    with pytest.raises(ValueError, match=rf"send_object_list: dst={rank} is the calling rank itself"):
        dist.send_object_list([1], rank)
    with pytest.raises(ValueError, match=rf"recv_object_list: src={size + 3}: global rank {size + 3} is not part"):
        dist.recv_object_list([1], size + 3)
    with pytest.raises(TypeError, match=r"send_object_list: object_list must be a list, got str"):
        dist.send_object_list("abc", (rank + 1) % size)
    dist.barrier()


def test_object_collectives_are_ordered_with_async_ops(dist, world):
    """A sync object collective issued behind pending async ops runs after them."""
    rank, size = world
    xs = [np.full(100_000, float(rank + i)) for i in range(3)]
    works = [dist.all_reduce(x, async_op=True) for x in xs]
    out = [None] * size
    dist.all_gather_object(out, {"r": rank})
    assert out == [{"r": r} for r in range(size)]
    for i, (w, x) in enumerate(zip(works, xs)):
        w.wait()
        np.testing.assert_array_equal(x, np.full(100_000, size * (size - 1) / 2 + size * i))
    assert MPI.COMM_WORLD.allreduce(1) == size
