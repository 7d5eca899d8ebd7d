"""torch.distributed's own entry points on backend "mpidist", on CPU tensors, against
what torch's gloo backend computes (expected values worked out per rank here).

Runs serially (world size 1) and under mpiexec -n 2, 3, 4.
"""

from __future__ import annotations

import datetime
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tdist = pytest.importorskip("torch.distributed")

from torch._C._distributed_c10d import AllgatherOptions, AllreduceOptions  # noqa: E402
from torch_helpers import TORCH, torch_world  # noqa: E402

import mpidist  # noqa: E402
from mpidist._core import recorder  # noqa: E402
from mpidist.torch import ProcessGroupMpidist  # noqa: E402

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module", autouse=True)
def world():
    with torch_world():
        yield tdist.get_rank(), tdist.get_world_size()


def _vals(n: int, f) -> list:
    return [f(r) for r in range(n)]


# -- all-reduce: every op, PREMUL_SUM, AVG ---------------------------------------------------


@pytest.mark.parametrize(
    "op,dtype,expect",
    [
        (tdist.ReduceOp.SUM, torch.float32, lambda xs: sum(xs)),
        (tdist.ReduceOp.PRODUCT, torch.float64, lambda xs: float(np.prod(xs))),
        (tdist.ReduceOp.MIN, torch.int32, lambda xs: min(xs)),
        (tdist.ReduceOp.MAX, torch.int64, lambda xs: max(xs)),
        (tdist.ReduceOp.BAND, torch.int64, lambda xs: int(np.bitwise_and.reduce(xs))),
        (tdist.ReduceOp.BOR, torch.uint8, lambda xs: int(np.bitwise_or.reduce(xs))),
        (tdist.ReduceOp.BXOR, torch.int16, lambda xs: int(np.bitwise_xor.reduce(xs))),
        (tdist.ReduceOp.AVG, torch.float64, lambda xs: sum(xs) / len(xs)),
    ],
)
def test_all_reduce_ops(world, op, dtype, expect):
    r, n = world
    value = lambda k: k + 3  # noqa: E731
    t = torch.full((5,), value(r), dtype=dtype)
    tdist.all_reduce(t, op=op)
    assert torch.equal(t, torch.full((5,), expect(_vals(n, value)), dtype=dtype))


@pytest.mark.parametrize("factor", [2.5, "tensor"])
def test_all_reduce_premul_sum(world, factor):
    r, n = world
    f = torch.tensor(0.5, dtype=torch.float64) if factor == "tensor" else factor
    t = torch.full((3,), float(r + 1), dtype=torch.float64)
    if TORCH < (2, 13):  # torch keeps the factor in C++: a clear error on every rank, the tensor untouched
        with pytest.raises(ValueError, match="PREMUL_SUM needs torch >= 2.13"):
            tdist.all_reduce(t, op=tdist._make_nccl_premul_sum(f))
        assert torch.equal(t, torch.full((3,), float(r + 1), dtype=torch.float64))
        return
    tdist.all_reduce(t, op=tdist._make_nccl_premul_sum(f))
    assert torch.equal(t, torch.full((3,), float(f) * sum(range(1, n + 1)), dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.bool, torch.complex64, torch.uint8])
def test_all_reduce_dtypes(world, dtype):
    r, n = world
    if dtype is torch.bool:
        t = torch.tensor([r == 0, False, True])
        tdist.all_reduce(t)  # torch: SUM on bool is a logical or
        assert t.tolist() == [True, False, True]
        return
    base = torch.arange(4, dtype=torch.float32) + r
    t = (base + 1j * base).to(dtype) if dtype.is_complex else base.to(dtype)
    tdist.all_reduce(t)
    total = sum(torch.arange(4, dtype=torch.float32) + k for k in range(n))
    want = (total + 1j * total).to(dtype) if dtype.is_complex else total.to(dtype)
    assert torch.equal(t, want)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.complex32, torch.bfloat16])
def test_data_movement_dtypes(world, dtype):
    r, n = world
    base = torch.tensor([0.5, 1.0, -2.0, 4.0])
    value = lambda k: (base + k).to(dtype) if not dtype.is_complex else (base + k + 1j).to(dtype)  # noqa: E731
    t = value(r)
    tdist.broadcast(t, src=n - 1)
    assert torch.equal(t.view(torch.uint8), value(n - 1).view(torch.uint8))
    out = torch.empty(4 * n, dtype=dtype)
    tdist.all_gather_into_tensor(out, value(r))
    assert torch.equal(out.view(torch.uint8), torch.cat([value(k) for k in range(n)]).view(torch.uint8))


def test_all_reduce_non_contiguous_and_grad(world):
    r, n = world
    big = torch.zeros(4, 6)
    view = big[:, ::2]  # non-contiguous: through a temporary, written back
    view.fill_(r + 1.0)
    tdist.all_reduce(view)
    assert torch.equal(big[:, ::2], torch.full((4, 3), float(sum(range(1, n + 1)))))
    assert torch.equal(big[:, 1::2], torch.zeros(4, 3))  # the rest untouched
    p = torch.full((2,), float(r), requires_grad=True)
    with torch.no_grad():
        tdist.all_reduce(p)
    assert p.tolist() == [float(sum(range(n)))] * 2


@pytest.mark.skipif(TORCH < (2, 8), reason="torch < 2.8 makes every op async (no asyncOp in its options)")
def test_sync_all_reduce_of_a_viewable_tensor_skips_the_staging(world, monkeypatch):
    """The sync call on one C-contiguous CPU tensor takes ProcessGroupMpidist.allreduce's short
    path (no Staged); every call that needs staging still gets it, with the same results."""
    from mpidist.torch import _process_group

    r, n = world
    made = []

    class Counted(_process_group.Staged):
        def __init__(self) -> None:
            made.append(1)
            super().__init__()

    monkeypatch.setattr(_process_group, "Staged", Counted)
    t = torch.full((3,), float(r + 1))
    tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
    assert torch.equal(t, torch.full((3,), float(n))) and not made
    staged = {
        "integer AVG": (torch.full((3,), 2 * r + 1, dtype=torch.int64), tdist.ReduceOp.AVG),
        "non-contiguous": (torch.full((3, 2), float(r + 1))[:, 0], tdist.ReduceOp.SUM),
    }
    for name, (x, op) in staged.items():
        made.clear()
        tdist.all_reduce(x, op=op)
        want = sum(2 * k + 1 for k in range(n)) // n if name == "integer AVG" else float(sum(range(1, n + 1)))
        assert x.tolist() == [want] * 3 and made, name


def test_async_work_and_future(world):
    r, n = world
    t = torch.full((4,), float(r))
    work = tdist.all_reduce(t, async_op=True)
    assert isinstance(work, tdist.Work)
    fut = work.get_future()
    assert work.wait(timeout=datetime.timedelta(seconds=60)) is True
    assert work.is_completed() and work.is_success()
    value = fut.wait()
    assert isinstance(value, list) and value[0] is t
    assert torch.equal(t, torch.full((4,), float(sum(range(n)))))
    chained = tdist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0] * 2)
    assert torch.equal(chained.wait(), torch.full((4,), float(n * sum(range(n)) * 2)))


def test_sync_op_returns_what_this_torch_waits_on(world):
    """torch >= 2.8 says in the options whether an op is async and takes None back from a sync
    one; before 2.8 its front end calls ``work.wait()`` on whatever comes back (also for
    all_gather, whose options have had ``asyncOp`` since 2.2), so mpidist returns a Work there."""
    r, n = world
    pg = tdist.group.WORLD
    t = torch.full((2,), float(r))
    gathered = [torch.empty(2) for _ in range(n)]
    for opts, call in [
        (AllreduceOptions(), lambda o: pg.allreduce([t], o)),
        (AllgatherOptions(), lambda o: pg.allgather([gathered], [t], o)),
    ]:
        if hasattr(opts, "asyncOp"):
            opts.asyncOp = False  # a sync call, as torch's front end makes it
        got = call(opts)
        if TORCH >= (2, 8):
            assert got is None  # done already
        else:
            assert isinstance(got, tdist.Work) and got.wait() is True
    assert torch.equal(t, torch.full((2,), float(sum(range(n)))))
    assert all(torch.equal(g, t) for g in gathered)


def test_future_callback_issues_collective(world):
    """PowerSGD's pattern: a then-callback issues another all-reduce and waits on it."""
    r, n = world
    a, b = torch.ones(3), torch.ones(3)

    def second(fut):
        return tdist.all_reduce(b, async_op=True).get_future().wait()[0] + fut.value()[0]

    out = tdist.all_reduce(a, async_op=True).get_future().then(second).wait()
    assert torch.equal(out, torch.full((3,), 2.0 * n))


# -- data movement -------------------------------------------------------------------------


def test_broadcast_reduce_from_every_root(world):
    r, n = world
    for root in range(n):
        t = torch.arange(3.0) + r
        tdist.broadcast(t, src=root)
        assert torch.equal(t, torch.arange(3.0) + root)
        t = torch.full((2,), r + 1.0)
        tdist.reduce(t, dst=root, op=tdist.ReduceOp.MAX)
        assert t.tolist() == ([float(n)] * 2 if r == root else [r + 1.0] * 2)


def test_all_gather_forms(world):
    r, n = world
    inp = torch.full((2, 2), float(r))
    outs = [torch.empty(2, 2) for _ in range(n)]
    tdist.all_gather(outs, inp)
    assert all(torch.equal(o, torch.full((2, 2), float(k))) for k, o in enumerate(outs))
    out = torch.empty(2 * n, 2)
    tdist.all_gather_into_tensor(out, inp)
    assert torch.equal(out, torch.cat([torch.full((2, 2), float(k)) for k in range(n)]))
    stacked = torch.empty(n, 2, 2)
    tdist.all_gather_into_tensor(stacked, inp)
    assert torch.equal(stacked.reshape(2 * n, 2), out)


def test_all_gather_into_tensor_aliased_input(world):
    """FSDP2's all-gather: the input is this rank's slot of the output (MPI_IN_PLACE)."""
    r, n = world
    out = torch.zeros(3 * n, dtype=torch.float64)
    mine = out[3 * r : 3 * (r + 1)]
    mine.copy_(torch.tensor([r, r + 0.5, r + 0.25], dtype=torch.float64))
    tdist.all_gather_into_tensor(out, mine)
    want = torch.cat([torch.tensor([k, k + 0.5, k + 0.25], dtype=torch.float64) for k in range(n)])
    assert torch.equal(out, want)


def test_gather_scatter(world):
    r, n = world
    for root in range(n):
        gl = [torch.empty(3) for _ in range(n)] if r == root else None
        tdist.gather(torch.full((3,), float(r)), gl, dst=root)
        if r == root:
            assert all(torch.equal(g, torch.full((3,), float(k))) for k, g in enumerate(gl))
        out = torch.empty(2)
        sl = [torch.full((2,), 10.0 * k) for k in range(n)] if r == root else None
        tdist.scatter(out, sl, src=root)
        assert torch.equal(out, torch.full((2,), 10.0 * r))


def test_reduce_scatter_forms(world):
    r, n = world
    out = torch.empty(2)
    tdist.reduce_scatter(out, [torch.full((2,), float(r * 10 + k)) for k in range(n)])
    assert torch.equal(out, torch.full((2,), float(sum(q * 10 + r for q in range(n)))))
    inp = torch.arange(2.0 * n) + r
    out = torch.empty(2)
    tdist.reduce_scatter_tensor(out, inp, op=tdist.ReduceOp.AVG)
    assert torch.allclose(out, torch.arange(2.0 * r, 2.0 * r + 2) + (n - 1) / 2)


def test_all_to_all_forms(world):
    r, n = world
    outs = [torch.empty(2) for _ in range(n)]
    tdist.all_to_all(outs, [torch.full((2,), float(100 * r + k)) for k in range(n)])
    assert all(torch.equal(o, torch.full((2,), float(100 * k + r))) for k, o in enumerate(outs))
    out = torch.empty(n)
    tdist.all_to_all_single(out, torch.arange(float(n)) + 10 * r)
    assert torch.equal(out, torch.tensor([10.0 * k + r for k in range(n)]))
    # uneven splits: rank r sends k + 1 elements to rank k
    inp = torch.cat([torch.full((k + 1,), float(r)) for k in range(n)])
    out = torch.empty(n * (r + 1))
    tdist.all_to_all_single(out, inp, output_split_sizes=[r + 1] * n, input_split_sizes=[k + 1 for k in range(n)])
    assert torch.equal(out, torch.cat([torch.full((r + 1,), float(k)) for k in range(n)]))


def test_coalesced_forms(world):
    r, n = world
    a, b = torch.full((2,), float(r)), torch.full((3,), 1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        tdist.all_reduce_coalesced([a, b])
    assert torch.equal(a, torch.full((2,), float(sum(range(n))))) and torch.equal(b, torch.full((3,), float(n)))
    outs, ins = [torch.empty(n * 2), torch.empty(n)], [torch.full((2,), float(r)), torch.full((1,), 5.0 + r)]
    with tdist._coalescing_manager(async_ops=True) as cm:
        for o, x in zip(outs, ins):
            tdist.all_gather_into_tensor(o, x)
    cm.wait()
    assert torch.equal(outs[1], torch.arange(5.0, 5.0 + n))
    outs = [torch.empty(1), torch.empty(2)]
    with tdist._coalescing_manager():
        for k, o in enumerate(outs):
            tdist.reduce_scatter_tensor(o, torch.ones(n * (k + 1)))
    assert torch.equal(outs[1], torch.full((2,), float(n)))
    # with a device: each op issued in the block, one Work for all (_start/_end_coalescing)
    c, d = torch.ones(2), torch.full((2,), 2.0)
    with tdist._coalescing_manager(device=torch.device("cpu"), async_ops=True) as cm:
        tdist.all_reduce(c)
        tdist.all_reduce(d)
    cm.wait()
    assert torch.equal(c + d, torch.full((2,), 3.0 * n))


def test_barrier_and_monitored_barrier_limit(world):
    tdist.barrier()
    tdist.barrier(async_op=True).wait()
    if TORCH < (2, 14):
        with pytest.raises(ValueError, match="GLOO"):  # torch's front end: gloo only
            tdist.monitored_barrier(timeout=datetime.timedelta(seconds=10))
    else:  # 2.14 asks for a CPU backend (the group's _device_types), then calls the group's own
        tdist.monitored_barrier(timeout=datetime.timedelta(seconds=10))
    tdist.group.WORLD.monitored_barrier(datetime.timedelta(seconds=30))  # the group's own: mpidist's


# -- point-to-point ------------------------------------------------------------------------


@pytest.mark.mpi(min_size=2)
def test_p2p_send_recv_anysource_batch(world):
    r, n = world
    if r == 0:
        for _ in range(n - 1):
            t = torch.empty(3)
            src = tdist.recv(t, tag=3)  # any source
            assert torch.equal(t, torch.full((3,), float(src)))
    else:
        tdist.send(torch.full((3,), float(r)), dst=0, tag=3)
    right, left = (r + 1) % n, (r - 1) % n
    send, recv = torch.full((2,), float(r)), torch.empty(2)
    works = tdist.batch_isend_irecv([tdist.P2POp(tdist.isend, send, right), tdist.P2POp(tdist.irecv, recv, left)])
    for w in works:
        w.wait()
    assert torch.equal(recv, torch.full((2,), float(left)))
    got = torch.empty(2)
    works = [tdist.irecv(got, src=left, tag=7), tdist.isend(send, dst=right, tag=7)]
    for w in works:
        w.wait()
    assert torch.equal(got, torch.full((2,), float(left)))


@pytest.mark.mpi(min_size=2)
def test_work_wait_timeout_then_success(world):
    r, n = world
    if r == 0:
        t = torch.empty(1)
        w = tdist.irecv(t, src=1)
        with pytest.raises(RuntimeError, match="timed out"):
            w.wait(timeout=datetime.timedelta(milliseconds=200))
        tdist.barrier()
        w.wait()
        assert t.item() == 42.0 and w._source_rank() == 1
    else:
        tdist.barrier()
        if r == 1:
            tdist.send(torch.tensor([42.0]), dst=0)


def test_object_collectives(world):
    r, n = world
    objs = [{"rank": r, "data": [r] * 3} if r == 0 else None]
    tdist.broadcast_object_list(objs, src=0)
    assert objs[0] == {"rank": 0, "data": [0, 0, 0]}
    got = [None] * n
    tdist.all_gather_object(got, ("r", r))
    assert got == [("r", k) for k in range(n)]
    gathered = [None] * n if r == n - 1 else None
    tdist.gather_object(r * 2, gathered, dst=n - 1)
    if r == n - 1:
        assert gathered == [2 * k for k in range(n)]
    out = [None]
    tdist.scatter_object_list(out, [f"to {k}" for k in range(n)] if r == 0 else None, src=0)
    assert out == [f"to {r}"]
    if n > 1 and r in (0, 1):
        box = [{"from": 0, "x": list(range(5))}] if r == 0 else [None]
        if r == 0:
            tdist.send_object_list(box, dst=1)
        else:
            tdist.recv_object_list(box, src=0)
        assert box == [{"from": 0, "x": [0, 1, 2, 3, 4]}]


# -- groups --------------------------------------------------------------------------------


def test_new_group_members_only_and_group_ranks(world):
    r, n = world
    odds = [k for k in range(n) if k % 2 == 1] or [0]
    g = tdist.new_group(odds)
    if r not in odds:
        assert g is tdist.GroupMember.NON_GROUP_MEMBER
        return
    assert isinstance(g, ProcessGroupMpidist) and g.size() == len(odds)
    assert tdist.get_process_group_ranks(g) == odds
    t = torch.full((2,), float(r))
    tdist.broadcast(t, group=g, group_src=len(odds) - 1)  # group rank, translated by torch
    assert torch.equal(t, torch.full((2,), float(odds[-1])))
    tdist.all_reduce(t, group=g)
    assert torch.equal(t, torch.full((2,), float(odds[-1] * len(odds))))
    tdist.destroy_process_group(g)
    assert g.mpidist_group.destroyed


def test_torch_attaches_no_flight_recorder_of_its_own(world):
    """mpidist records its ops itself; torch 2.15 attaches its own flight recorder to a group
    whose backend it does not know as self-recording, and that hook cannot read a Python
    ProcessGroup's backend: every init_process_group failed ("Could not find the default
    backend type 0"). mpidist.torch names "mpidist" (and "mpi" where it provides it) there."""
    import torch.distributed.distributed_c10d as c10d  # noqa: PLC0415

    from mpidist.torch import _mpi_name  # noqa: PLC0415

    names = getattr(c10d, "_FR_SELF_RECORDING_BACKENDS", None)
    if names is None:
        pytest.skip(f"torch {torch.__version__} attaches no flight recorder to a group (2.15 does)")
    assert "mpidist" in names
    assert ("mpi" in names) == _mpi_name.installed()
    g = tdist.new_group(list(range(tdist.get_world_size())))
    hooks = c10d._world.pg_flight_recorder_hooks
    assert tdist.group.WORLD not in hooks and g not in hooks
    tdist.destroy_process_group(g)


def test_new_subgroups(world):
    r, n = world
    size = 2 if n % 2 == 0 else 1
    mine, groups = tdist.new_subgroups(group_size=size)
    assert len(groups) == n // size and tdist.get_world_size(mine) == size
    t = torch.tensor([float(r)])
    tdist.all_reduce(t, group=mine)
    start = r - r % size
    assert t.item() == float(sum(range(start, start + size)))
    for g in groups:
        tdist.destroy_process_group(g)


# -- what mpidist adds ---------------------------------------------------------------------


def test_flight_recorder_sees_torch_calls(world):
    t = torch.ones(4, dtype=torch.float16)
    tdist.all_reduce(t)
    tdist.broadcast(t, src=0)
    last = recorder.snapshot()[-2:]
    assert [e["op"] for e in last] == ["all_reduce", "broadcast"]
    assert last[0]["dtype"] == "float16" and last[0]["state"] == "completed"


def test_errors_are_clear(world):
    r, n = world
    with pytest.raises(ValueError, match="rootRank"):
        tdist.group.WORLD.broadcast([torch.ones(1)], n + 3)
    with pytest.raises(TypeError, match="device meta"):
        tdist.group.WORLD.allreduce([torch.ones(2, device="meta")])


def test_backend_names(world):
    assert tdist.get_backend() == "mpidist"
    assert tdist.group.WORLD.name() == "mpidist"
    assert tdist.group.WORLD.group_desc == "default_pg"
    assert tdist.is_initialized() and mpidist.is_initialized()


def test_abort_makes_a_group_unusable_at_once(world):
    """torch's ProcessGroup.abort(): local, at once; every later op on the group raises."""
    r, n = world
    g = tdist.new_group(list(range(n)))
    t = torch.ones(2)
    tdist.all_reduce(t, group=g)
    assert torch.equal(t, torch.full((2,), float(n)))
    g.abort()
    with pytest.raises(RuntimeError, match=r"is unusable: aborted by ProcessGroup.abort\(\)"):
        tdist.all_reduce(t, group=g)
    tdist.destroy_process_group(g)  # collective destroy of an aborted group frees nothing, raises nothing
    tdist.all_reduce(t)  # the default group is unaffected
    assert torch.equal(t, torch.full((2,), float(n * n)))
