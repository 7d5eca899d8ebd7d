"""mpidist._backends.device.nccl on a fake NCCL (tests/fake_nccl.py): every op through ``nccl.run``,
sync and async, every ReduceOp and dtype mapping, the stream protocol, Work semantics,
communicator lifetime, the flight recorder, and bad input with exact messages.

Every rank regenerates every rank's input from a seed and checks its own result
without trusting mpidist. FakeDeviceArray keeps its data in host memory, which the
fake NCCL reads through the pointers mpidist hands it.
"""

from __future__ import annotations

import os
import re
import sys
import time

import numpy as np
import pytest
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(__file__))
from fake_device import FakeDeviceArray  # noqa: E402
from fake_nccl import DLPackOnly, FakeShim, ReadOnlyFake, StridedFake  # noqa: E402

import mpidist  # noqa: E402
from mpidist import ReduceOp, make_premul_sum  # noqa: E402
from mpidist._backends.device import nccl, nccl_shim  # noqa: E402
from mpidist._backends.device.nccl_core import REAPER, reduction, state  # noqa: E402
from mpidist._core import recorder as R  # noqa: E402
from mpidist._runtime import world as runtime  # noqa: E402
from mpidist.errors import DistBackendError, DistError  # noqa: E402
from mpidist.p2p import P2POp  # noqa: E402
from mpidist.work import WorkResult  # noqa: E402

try:
    import ml_dtypes

    BF16 = ml_dtypes.bfloat16
except ImportError:  # pragma: no cover
    BF16 = None

pytestmark = pytest.mark.mpi
PREFIX = r"\[rank \d+/\d+\] "
DTYPES = [
    np.int8,
    np.uint8,
    np.int32,
    np.uint32,
    np.int64,
    np.uint64,
    np.float16,
    np.float32,
    np.float64,
    BF16,
    np.bool_,
    np.complex64,
    np.complex128,
]
OPS = {
    "SUM": ReduceOp.SUM,
    "AVG": ReduceOp.AVG,
    "PRODUCT": ReduceOp.PRODUCT,
    "MIN": ReduceOp.MIN,
    "MAX": ReduceOp.MAX,
    "PREMUL": None,
}
_UFUNC = {"SUM": np.add, "AVG": np.add, "PRODUCT": np.multiply, "MIN": np.minimum, "MAX": np.maximum, "PREMUL": np.add}
_BOOL = {"SUM": np.logical_or, "MAX": np.logical_or, "PRODUCT": np.logical_and, "MIN": np.logical_and}


def supported(name: str, dtype) -> bool:
    kind = "f" if dtype is BF16 else np.dtype(dtype).kind
    if kind == "b":
        return name in _BOOL
    if kind in "iu":
        return name != "AVG"
    if kind == "c":
        return name in ("SUM", "AVG", "PREMUL")
    return True


def premul_factor(dtype):
    kind = "f" if dtype is BF16 else np.dtype(dtype).kind
    return {"c": 1 + 1j, "f": 0.5}.get(kind, 2)


# -- fixtures and helpers ------------------------------------------------------------------------


def _drop_nccl(g) -> None:
    res = g._resources.pop("nccl", None)
    if res is not None:
        res.free()


@pytest.fixture
def shim(dist):
    """A fresh FakeShim installed for the test; the default group's NCCL state is dropped
    afterwards, so every test makes its own communicators with its own shim."""
    fake = FakeShim()
    previous = nccl_shim.use(fake)
    yield fake
    fake.release()
    assert REAPER.drain(), "ops still in flight after the test"
    _drop_nccl(runtime.state().world)
    nccl_shim.use(previous)


def resolved(dist, any_group):
    """(group, members, my group rank) for a member, or None for a non-member."""
    g, members = any_group
    if dist.get_rank() not in members:
        return None
    return runtime.resolve_group(g), members, members.index(dist.get_rank())


def world(dist):
    return runtime.state().world, list(range(dist.get_world_size())), dist.get_rank()


def data(dtype, shape, *key: int) -> np.ndarray:
    """Deterministic small values for ``key``, exact in every dtype (bool, complex too)."""
    rng = np.random.default_rng([53, *key])
    x = rng.integers(1, 4, size=shape)
    if np.dtype(dtype).kind == "c":
        x = x + 1j * rng.integers(1, 4, size=shape)
    if dtype is np.bool_:
        x = x > 2
    return np.asarray(x).astype(dtype)


def dev(host) -> FakeDeviceArray:
    return FakeDeviceArray.from_host(np.asarray(host))


def block(shapes, dtype) -> list:
    """FakeDeviceArrays of ``shapes`` laid back to back in one buffer (views of its memory)."""
    sizes = [int(np.prod(s)) for s in shapes]
    whole = FakeDeviceArray((sum(sizes),), dtype)
    parts, at = [], 0
    for s, n in zip(shapes, sizes):
        part = FakeDeviceArray.__new__(FakeDeviceArray)
        part._data, part.device, part.stream, part.syncs = whole.host[at : at + n].reshape(s), 0, 1, 0
        parts.append(part)
        at += n
    parts[0]._whole = whole  # keep the buffer alive
    return parts


def view_of(whole: FakeDeviceArray, start: int, stop: int, shape=None) -> FakeDeviceArray:
    """A FakeDeviceArray over elements ``start:stop`` of ``whole`` (shared memory)."""
    part = FakeDeviceArray.__new__(FakeDeviceArray)
    sub = whole.host.reshape(-1)[start:stop]
    part._data, part.device, part.stream, part.syncs = sub.reshape(shape or sub.shape), 0, 1, 0
    return part


def expected_reduction(name: str, dtype, shape, n: int, salt: int, factor=None) -> np.ndarray:
    """The reduction of group ranks 0..n-1's inputs ``data(dtype, shape, salt, rank)``, in rank
    order; AVG divides complex values part by part (NCCL averages them as pairs of reals)."""
    parts = [data(dtype, shape, salt, r) for r in range(n)]
    if factor is not None:
        f = np.asarray(factor).astype(dtype)
        parts = [p * f for p in parts]
    ufunc = _BOOL[name] if np.dtype(dtype).kind == "b" else _UFUNC[name]
    acc = parts[0].copy()
    for p in parts[1:]:
        ufunc(acc, p, out=acc)
    if name == "AVG" and np.dtype(dtype).kind == "c":
        real = acc.view(np.dtype(f"f{np.dtype(dtype).itemsize // 2}"))
        acc = (real / n).astype(real.dtype).view(dtype)
    elif name == "AVG":
        acc = (acc / n).astype(dtype)
    return acc


def run(op: str, g, args: dict):
    """``nccl.run``, then, for a sync op, what a host that reads the results does first:
    synchronize the stream it called from (as ``cupy.asnumpy`` does; a sync op runs on it).
    The fake's sends and receives stay pending on their stream until then."""
    out = nccl.run(op, g, args)
    if not args.get("async_op") and op not in ("isend", "irecv", "batch_isend_irecv"):
        shim = nccl_shim.get()
        shim.synchronize(shim.current_stream())
    return out


def finish(work, async_op: bool):
    """None for sync calls, whose results the host reads after synchronizing the stream it
    called from (as ``cupy.asnumpy`` does; a sync op runs on it); for async ones check the
    Work and wait on it."""
    if not async_op:
        assert work is None
        shim = nccl_shim.get()
        shim.synchronize(shim.current_stream())
        return
    assert isinstance(work, nccl.NcclWork)
    assert work.wait() is True
    assert work.get_future().result(timeout=10) == work.result()


def p2p_op(op, tensor, peer, group=None, tag=0) -> P2POp:
    """A P2POp over a device array (built field by field: the host P2POp refuses device arrays)."""
    p = P2POp.__new__(P2POp)
    p.op, p.tensor, p.peer, p.group, p.tag = op, tensor, peer, group, tag
    return p


# -- reductions: every op x dtype ----------------------------------------------------------------


@pytest.mark.parametrize(
    "name,dtype",
    [(n, d) for n in OPS for d in DTYPES if d is not None and supported(n, d)],
    ids=lambda v: v if isinstance(v, str) else np.dtype(v).name,
)
def test_all_reduce_every_op_and_dtype(dist, shim, name, dtype):
    g, members, me = world(dist)
    factor = premul_factor(dtype) if name == "PREMUL" else None
    op = make_premul_sum(factor) if factor is not None else OPS[name]
    x = dev(data(dtype, (3, 4), 1, me))
    assert run("all_reduce", g, {"tensor": x, "op": op}) is None
    want = expected_reduction(name, dtype, (3, 4), len(members), 1, factor)
    assert x.host.tobytes() == want.tobytes()
    assert len(set(MPI.COMM_WORLD.allgather(x.host.tobytes()))) == 1


@pytest.mark.parametrize("async_op", [False, True])
def test_dlpack_only_device_arrays_take_the_nccl_path(dist, shim, async_op):
    """A device array with DLPack only (no __cuda_array_interface__, e.g. a JAX array) goes
    through a zero-copy view: the results land in its own memory."""
    g, members, me = world(dist)
    x = DLPackOnly(dev(data(np.float32, (2, 3), 8, me)))
    finish(run("all_reduce", g, {"tensor": x, "op": ReduceOp.SUM, "async_op": async_op}), async_op)
    assert ("from_dlpack", "DLPackOnly") in shim.log
    np.testing.assert_array_equal(x.inner.host, expected_reduction("SUM", np.float32, (2, 3), len(members), 8))
    out = DLPackOnly(dev(np.zeros((len(members), 2), np.int32)))
    finish(
        run(
            "all_gather_into_tensor",
            g,
            {"output_tensor": out, "input_tensor": dev(np.full(2, me, np.int32)), "async_op": async_op},
        ),
        async_op,
    )
    np.testing.assert_array_equal(out.inner.host, np.repeat(np.arange(len(members), dtype=np.int32), 2).reshape(-1, 2))


def test_a_host_object_is_not_taken_for_a_device_array_on_the_nccl_path(dist, shim):
    g, _, _ = world(dist)
    with pytest.raises(
        TypeError,
        match=PREFIX + r"all_reduce: tensor must be a device \(GPU\) array \(cupy, or any "
        r"object with __cuda_array_interface__ or a CUDA __dlpack_device__\) "
        r"on the NCCL path, got list",
    ):
        run("all_reduce", g, {"tensor": [1.0], "op": ReduceOp.SUM})


def test_reduction_plans_match_nccl_codes():
    f32, c64 = np.dtype(np.float32), np.dtype(np.complex64)
    assert reduction(ReduceOp.SUM, f32, "x", 22300)[:4] == (7, 1, 0, False)
    assert reduction(ReduceOp.AVG, f32, "x", 21000)[:4] == (7, 1, 4, False)
    assert reduction(ReduceOp.AVG, f32, "x", 20907)[:4] == (7, 1, 0, True)  # NCCL < 2.10: SUM, divide
    assert reduction(ReduceOp.SUM, np.dtype(np.bool_), "x", 22300)[:3] == (1, 1, 2)  # uint8 MAX
    assert reduction(ReduceOp.PRODUCT, np.dtype(np.bool_), "x", 22300)[:3] == (1, 1, 3)  # uint8 MIN
    assert reduction(ReduceOp.SUM, c64, "x", 22300)[:3] == (7, 2, 0)  # pairs of float32
    plan = reduction(make_premul_sum(3), np.dtype(np.int64), "x", 22300)
    assert plan[:4] == (4, 1, 0, False) and plan.premul.factor == 3
    if BF16 is not None:
        assert reduction(ReduceOp.MAX, np.dtype(BF16), "x", 22300)[:3] == (9, 1, 2)


def test_avg_without_nccl_avg_sums_then_divides(dist):
    fake = FakeShim(version=20907)  # NCCL 2.9.7: no ncclAvg
    previous = nccl_shim.use(fake)
    try:
        g = dist.new_group()
        pg, members, me = runtime.resolve_group(g), list(range(dist.get_world_size())), dist.get_rank()
        x = dev(data(np.float64, 7, 2, me))
        run("all_reduce", pg, {"tensor": x, "op": ReduceOp.AVG})
        np.testing.assert_array_equal(x.host, expected_reduction("AVG", np.float64, 7, len(members), 2))
        assert ("kernel", fake.current_stream().ptr) in fake.log  # the division, on a sync op's stream: the caller's
        dist.destroy_process_group(g)
    finally:
        nccl_shim.use(previous)


@pytest.mark.parametrize(
    "op,dtype,kind,message",
    [
        (
            ReduceOp.BAND,
            np.int32,
            ValueError,
            "ReduceOp.BAND is not supported by NCCL (torch: 'Cannot use "
            "ReduceOp.BAND with NCCL'); bitwise reductions need host arrays",
        ),
        (ReduceOp.BXOR, np.bool_, ValueError, "ReduceOp.BXOR is not supported by NCCL"),
        (
            ReduceOp.PRODUCT,
            np.complex64,
            ValueError,
            "ReduceOp.PRODUCT on complex dtype complex64 is not supported "
            "by NCCL; complex arrays reduce with SUM, AVG or PREMUL_SUM only",
        ),
        (ReduceOp.MAX, np.complex128, ValueError, "ReduceOp.MAX is not defined for complex dtype complex128"),
        (ReduceOp.AVG, np.int64, ValueError, "ReduceOp.AVG needs a floating or complex dtype, got int64"),
        (ReduceOp.SUM, np.int16, TypeError, "dtype int16 cannot be reduced by NCCL; expected one of int8, uint8"),
        ("sum", np.float32, TypeError, "op must be a mpidist.ReduceOp, got 'sum'"),
    ],
)
def test_reduction_errors(dist, shim, op, dtype, kind, message):
    g, _, _ = world(dist)
    for call, args in (("all_reduce", {}), ("reduce", {"dst": 0}), ("reduce_scatter_tensor", {})):
        x = dev(np.zeros(dist.get_world_size(), dtype))
        if call == "reduce_scatter_tensor":
            args = {"output": dev(np.zeros(1, dtype)), "input": x}
        else:
            args = {"tensor": x, **args}
        with pytest.raises(kind, match=PREFIX + re.escape(f"{call}: {message}")):
            run(call, g, {**args, "op": op})


@pytest.mark.parametrize("async_op", [False, True])
def test_reduce_every_root(dist, shim, any_group, async_op):
    m = resolved(dist, any_group)
    if m is None:
        return
    g, members, me = m
    for root_index, root in enumerate(members):
        x = dev(data(np.float32, (2, 5), 3, me))
        finish(
            run("reduce", g, {"tensor": x, "dst": root, "op": make_premul_sum(0.5), "async_op": async_op}),
            async_op,
        )
        if me == root_index:
            np.testing.assert_array_equal(
                x.host, expected_reduction("PREMUL", np.float32, (2, 5), len(members), 3, 0.5)
            )
        else:  # a non-root's input is left as it was, premul included
            np.testing.assert_array_equal(x.host, data(np.float32, (2, 5), 3, me))


@pytest.mark.parametrize("async_op", [False, True])
def test_all_reduce_any_group(dist, shim, any_group, async_op):
    m = resolved(dist, any_group)
    if m is None:
        return
    g, members, me = m
    x = dev(data(np.int64, 11, 4, me))
    finish(run("all_reduce", g, {"tensor": x, "op": ReduceOp.MAX, "async_op": async_op}), async_op)
    np.testing.assert_array_equal(x.host, expected_reduction("MAX", np.int64, 11, len(members), 4))


@pytest.mark.parametrize("layout", ["separate", "block"])
@pytest.mark.parametrize("op", ["SUM", "PREMUL", "AVG"])
def test_reduce_scatter_list(dist, shim, any_group, layout, op):
    m = resolved(dist, any_group)
    if m is None:
        return
    g, members, me = m
    n = len(members)
    factor = 3.0 if op == "PREMUL" else None
    reduce_op = make_premul_sum(factor) if factor else OPS[op]
    hosts = [data(np.float64, (2, 3), 5, me, r) for r in range(n)]
    ins = [dev(h) for h in hosts] if layout == "separate" else block([(2, 3)] * n, np.float64)
    for a, h in zip(ins, hosts):
        a.host[...] = h
    out = dev(np.zeros((2, 3)))
    run("reduce_scatter", g, {"output": out, "input_list": ins, "op": reduce_op})
    parts = [data(np.float64, (2, 3), 5, r, me) * (factor or 1) for r in range(n)]
    want = sum(parts[1:], parts[0].copy())
    np.testing.assert_array_equal(out.host, want / n if op == "AVG" else want)
    for a, h in zip(ins, hosts):  # inputs unchanged, premul included
        np.testing.assert_array_equal(a.host, h)


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("async_op", [False, True])
def test_reduce_scatter_tensor(dist, shim, any_group, in_place, async_op):
    m = resolved(dist, any_group)
    if m is None:
        return
    g, members, me = m
    n = len(members)
    inp = dev(data(np.complex128, (n, 4), 6, me))
    out = view_of(inp, me * 4, (me + 1) * 4) if in_place else dev(np.zeros(4, np.complex128))
    finish(run("reduce_scatter_tensor", g, {"output": out, "input": inp, "async_op": async_op}), async_op)
    want = sum(data(np.complex128, (n, 4), 6, r)[me] for r in range(n))
    np.testing.assert_array_equal(out.host, want)


# -- data movement -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.int16, np.bool_, np.complex64])
@pytest.mark.parametrize("async_op", [False, True])
def test_broadcast_every_src(dist, shim, any_group, dtype, async_op):
    m = resolved(dist, any_group)
    if m is None:
        return
    g, members, me = m
    for src_index, src in enumerate(members):
        x = dev(data(dtype, (3, 2), 7, me))
        finish(run("broadcast", g, {"tensor": x, "src": src, "async_op": async_op}), async_op)
        np.testing.assert_array_equal(x.host, data(dtype, (3, 2), 7, src_index))


@pytest.mark.parametrize("layout", ["separate", "block", "uneven"])
@pytest.mark.parametrize("async_op", [False, True])
def test_all_gather(dist, shim, any_group, layout, async_op):
    m = resolved(dist, any_group)
    if m is None:
        return
    g, members, me = m
    n = len(members)
    shape = (lambda r: (r + 1, 2)) if layout == "uneven" else (lambda r: (2, 2))
    inp = dev(data(np.int32, shape(me), 8, me))
    outs = (
        [dev(np.zeros(shape(r), np.int32)) for r in range(n)]
        if layout != "block"
        else block([shape(r) for r in range(n)], np.int32)
    )
    finish(run("all_gather", g, {"tensor_list": outs, "tensor": inp, "async_op": async_op}), async_op)
    for r in range(n):
        np.testing.assert_array_equal(outs[r].host, data(np.int32, shape(r), 8, r))
    used = {e[1] for e in shim.log if e[0] == "nccl"}
    assert used == ({"allGather"} if layout == "block" or n == 1 else {"broadcast"})


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("async_op", [False, True])
def test_all_gather_into_tensor(dist, shim, any_group, in_place, async_op):
    m = resolved(dist, any_group)
    if m is None:
        return
    g, members, me = m
    n = len(members)
    out = dev(np.zeros((n, 3), np.float16))
    if in_place:
        inp = view_of(out, me * 3, (me + 1) * 3)
        inp.host[...] = data(np.float16, 3, 9, me)
    else:
        inp = dev(data(np.float16, 3, 9, me))
    finish(
        run("all_gather_into_tensor", g, {"output_tensor": out, "input_tensor": inp, "async_op": async_op}),
        async_op,
    )
    np.testing.assert_array_equal(out.host, np.stack([data(np.float16, 3, 9, r) for r in range(n)]))


@pytest.mark.parametrize("async_op", [False, True])
def test_gather_and_scatter_every_root(dist, shim, any_group, async_op):
    m = resolved(dist, any_group)
    if m is None:
        return
    g, members, me = m
    n = len(members)
    for root_index, root in enumerate(members):
        mine = dev(data(np.float32, (me + 1,), 10, me))
        gl = [dev(np.zeros(r + 1, np.float32)) for r in range(n)] if me == root_index else None
        finish(run("gather", g, {"tensor": mine, "gather_list": gl, "dst": root, "async_op": async_op}), async_op)
        if gl is not None:
            for r in range(n):
                np.testing.assert_array_equal(gl[r].host, data(np.float32, (r + 1,), 10, r))
        out = dev(np.zeros(me + 2, np.uint8))
        sl = [dev(data(np.uint8, (r + 2,), 11, root_index, r)) for r in range(n)] if me == root_index else None
        finish(run("scatter", g, {"tensor": out, "scatter_list": sl, "src": root, "async_op": async_op}), async_op)
        np.testing.assert_array_equal(out.host, data(np.uint8, (me + 2,), 11, root_index, me))


def rows(sender: int, receiver: int) -> int:
    return (sender + 2 * receiver) % 3 + 1


@pytest.mark.parametrize("async_op", [False, True])
def test_all_to_all_uneven(dist, shim, any_group, async_op):
    m = resolved(dist, any_group)
    if m is None:
        return
    g, members, me = m
    n = len(members)
    ins = [dev(data(np.float64, (rows(me, r), 2), 12, me, r)) for r in range(n)]
    outs = [dev(np.zeros((rows(r, me), 2))) for r in range(n)]
    finish(
        run("all_to_all", g, {"output_tensor_list": outs, "input_tensor_list": ins, "async_op": async_op}),
        async_op,
    )
    for r in range(n):
        np.testing.assert_array_equal(outs[r].host, data(np.float64, (rows(r, me), 2), 12, r, me))


@pytest.mark.parametrize("splits", [False, True])
@pytest.mark.parametrize("async_op", [False, True])
def test_all_to_all_single(dist, shim, any_group, splits, async_op):
    m = resolved(dist, any_group)
    if m is None:
        return
    g, members, me = m
    n = len(members)
    if splits:
        in_rows, out_rows = [rows(me, r) for r in range(n)], [rows(r, me) for r in range(n)]
        args = {"output_split_sizes": out_rows, "input_split_sizes": in_rows}
    else:
        in_rows = out_rows = [2] * n
        args = {}
    inp = dev(np.concatenate([data(np.int64, (k, 3), 13, me, r) for r, k in enumerate(in_rows)]))
    out = dev(np.zeros((sum(out_rows), 3), np.int64))
    finish(run("all_to_all_single", g, {"output": out, "input": inp, "async_op": async_op, **args}), async_op)
    want = np.concatenate([data(np.int64, (k, 3), 13, r, me) for r, k in enumerate(out_rows)])
    np.testing.assert_array_equal(out.host, want)


def test_overlapping_inputs_are_staged(dist, shim):
    """all_to_all_single with output == input and all_gather_into_tensor from a foreign slot."""
    g, members, me = world(dist)
    n = len(members)
    buf = dev(np.concatenate([data(np.int32, (1, 2), 14, me, r) for r in range(n)]))
    run("all_to_all_single", g, {"output": buf, "input": buf})
    np.testing.assert_array_equal(buf.host, np.concatenate([data(np.int32, (1, 2), 14, r, me) for r in range(n)]))
    out = dev(np.zeros(2 * n, np.int32))
    other = (me + 1) % n
    inp = view_of(out, other * 2, other * 2 + 2)
    inp.host[...] = data(np.int32, 2, 15, me)
    run("all_gather_into_tensor", g, {"output_tensor": out, "input_tensor": inp})
    np.testing.assert_array_equal(out.host, np.concatenate([data(np.int32, 2, 15, r) for r in range(n)]))


# -- point-to-point -----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["sync", "async", "batch"])
def test_ring_exchange(dist, shim, any_group, mode):
    m = resolved(dist, any_group)
    if m is None:
        return
    g, members, me = m
    n = len(members)
    if n < 2:
        return
    right, left = members[(me + 1) % n], members[(me - 1) % n]
    out, got = dev(data(np.float32, 100, 16, me)), dev(np.zeros(100, np.float32))
    group = None if g is runtime.state().world else g
    if mode == "batch":
        works = run(
            "batch_isend_irecv",
            g,
            {"p2p_op_list": [p2p_op(mpidist.irecv, got, left, group), p2p_op(mpidist.isend, out, right, group)]},
        )
        assert len(works) == 2 and works[0].source_rank() == left
        assert works[0].result() == [got] and works[1].result() == []
    elif mode == "async":  # each pair's first exchange makes its communicator: lower peer first, no cycle
        posts = sorted(
            [(left, "irecv", {"tensor": got, "src": left}), (right, "isend", {"tensor": out, "dst": right})],
            key=lambda p: (p[0], p[1]),
        )
        works = {op: run(op, g, args) for _, op, args in posts}
        assert all(w.wait() for w in works.values()) and works["irecv"].source_rank() == left
    elif me % 2 == 0:
        assert run("send", g, {"tensor": out, "dst": right}) is None
        assert run("recv", g, {"tensor": got, "src": left}) == left
    else:
        assert run("recv", g, {"tensor": got, "src": left}) == left
        assert run("send", g, {"tensor": out, "dst": right}) is None
    np.testing.assert_array_equal(got.host, data(np.float32, 100, 16, members.index(left)))
    st = state(g)
    if mode == "batch":
        assert st.main is not None and not st.pairs  # the batch uses the group's communicator
    else:
        assert st.main is None and set(st.pairs) <= {members.index(left), members.index(right)}


@pytest.mark.mpi(min_size=2)
def test_p2p_first_op_between_two_ranks_only(dist, shim):
    """send/recv may be a group's first NCCL op even when other members stay out of it."""
    g, _, me = world(dist)
    if me < 2:
        x = dev(data(np.int8, 5, 17, 0) if me == 0 else np.zeros(5, np.int8))
        run("send" if me == 0 else "recv", g, {"tensor": x, ("dst" if me == 0 else "src"): 1 - me})
        np.testing.assert_array_equal(x.host, data(np.int8, 5, 17, 0))
        assert state(g).made == 1
    dist.barrier()


# -- barrier, multigpu forms --------------------------------------------------------------------------


def test_barrier_sync_and_async(dist, shim, any_group):
    m = resolved(dist, any_group)
    if m is None:
        return
    g, _, _ = m
    assert run("barrier", g, {}) is None
    work = run("barrier", g, {"async_op": True, "device_ids": [0]})
    assert work.wait() is True and work.is_completed()
    assert state(g).made == 1


def test_multigpu_forms_take_one_array(dist, shim):
    g, members, me = world(dist)
    n = len(members)
    x = dev(data(np.float32, 4, 18, me))
    run("all_reduce_multigpu", g, {"tensor_list": [x]})
    np.testing.assert_array_equal(x.host, expected_reduction("SUM", np.float32, 4, len(members), 18))
    y = dev(data(np.float32, 4, 19, me))
    run("reduce_multigpu", g, {"tensor_list": [y], "dst": 0, "dst_tensor": 0})
    if me == 0:
        np.testing.assert_array_equal(y.host, expected_reduction("SUM", np.float32, 4, len(members), 19))
    z = dev(data(np.float32, 4, 20, me))
    run("broadcast_multigpu", g, {"tensor_list": [z], "src": n - 1})
    np.testing.assert_array_equal(z.host, data(np.float32, 4, 20, n - 1))
    outs = [dev(np.zeros(4, np.float32)) for _ in range(n)]
    w = run("all_gather_multigpu", g, {"output_tensor_lists": [outs], "input_tensor_list": [x], "async_op": True})
    w.wait()
    for o in outs:
        np.testing.assert_array_equal(o.host, x.host)
    msg = (
        "tensor_list must hold exactly one array on the NCCL path (one GPU per process; torch removed the "
        "multi-GPU forms), got 2"
    )
    with pytest.raises(ValueError, match=PREFIX + re.escape(f"all_reduce_multigpu: {msg}")):
        run("all_reduce_multigpu", g, {"tensor_list": [x, y]})
    with pytest.raises(ValueError, match=re.escape("dst_tensor=1 is out of range: the NCCL path takes one array")):
        run("reduce_multigpu", g, {"tensor_list": [y], "dst": 0, "dst_tensor": 1})


# -- streams, Work, lifetime, recorder ---------------------------------------------------------------


def test_stream_protocol_of_a_sync_op(dist, shim):
    """A sync op runs on the caller's stream (torch >= 2.8, pytorch#150398): no event between
    two streams, one done event recorded after it for the recorder, and the host goes on."""
    g, _, me = world(dist)
    x = FakeDeviceArray.from_host(np.ones(3), stream=None)  # its interface: no stream to wait for
    nccl.run("all_reduce", g, {"tensor": x})  # makes the communicator
    comm = state(g).main
    user, mark = shim.current_stream().ptr, len(shim.log)
    nccl.run("all_reduce", g, {"tensor": x})
    (_, _, nccl_stream), (_, done, on) = shim.log[mark : mark + 2]
    assert nccl_stream == user != comm.stream.ptr and on == user  # the op and its done event: the caller's stream
    assert len(shim.log) == mark + 2  # nothing else: no wait, and the host did not synchronize
    rec = R.snapshot()[-1]
    assert REAPER.drain() and R.snapshot()[-1]["state"] == "completed", rec


def test_stream_protocol_of_an_async_op(dist, shim):
    """An async op runs on the communicator's stream, after an event recorded on the caller's;
    ``wait()`` makes the caller's stream wait on its done event, and the host goes on."""
    g, _, me = world(dist)
    x = FakeDeviceArray.from_host(np.ones(3), stream=None)
    nccl.run("all_reduce", g, {"tensor": x})
    comm = state(g).main
    user, mark = shim.current_stream().ptr, len(shim.log)
    work = nccl.run("all_reduce", g, {"tensor": x, "async_op": True})
    (_, ready, on_user), (_, stream, waited), (_, _, nccl_stream), (_, done, on_nccl) = shim.log[mark : mark + 4]
    assert on_user == user and stream == comm.stream.ptr and waited == ready  # NCCL stream waits on the caller
    assert nccl_stream == comm.stream.ptr != user and on_nccl == comm.stream.ptr  # the op runs on the NCCL stream
    assert len(shim.log) == mark + 4
    work.wait()
    assert shim.log[mark + 4 :] == [("wait", user, done)]  # the caller waits on the done event


def test_sync_ops_end_without_a_thread_hand_off(dist, shim):
    """A sync op's entry ends when a later op on the communicator sees its done event, or the
    completion thread's backstop poll does; the arrays of a sync op are not kept."""
    g, _, me = world(dist)
    x = FakeDeviceArray.from_host(np.ones(3), stream=None)
    nccl.run("all_reduce", g, {"tensor": x})
    comm = state(g).main
    shim.hold = True
    nccl.run("all_reduce", g, {"tensor": x})
    rec = R.snapshot()[-1]
    assert rec["state"] == "started" and len(comm.inflight) == 1 and not REAPER._items
    shim.release()
    nccl.run("all_reduce", g, {"tensor": x})  # the next op ends the first
    assert [e["state"] for e in R.snapshot()[-2:]] in (["completed", "started"], ["completed", "completed"])
    deadline = time.monotonic() + 5
    while comm.inflight and time.monotonic() < deadline:  # the backstop, with no further op
        time.sleep(0.01)
    assert not comm.inflight and R.snapshot()[-1]["state"] == "completed"


def test_ops_wait_for_the_streams_their_arrays_are_ready_on(dist, shim):
    """__cuda_array_interface__ v3's ``stream`` (a torch tensor reports its current stream):
    the op's stream (a sync op's: the caller's) waits on an event recorded there, once per
    distinct stream other than the caller's, before the op."""
    g, members, me = world(dist)
    nccl.run("all_reduce", g, {"tensor": FakeDeviceArray.from_host(np.ones(2), stream=None)})
    user = shim.current_stream().ptr

    def waits_before_the_op(mark: int) -> list:
        log = shim.log[mark:]
        first = next(i for i, e in enumerate(log) if e[0] == "nccl")
        recorded = {e[1]: e[2] for e in log[:first] if e[0] == "record"}
        return sorted(recorded[e[2]] for e in log[:first] if e[0] == "wait" and e[1] == user)

    mark = len(shim.log)
    x = FakeDeviceArray.from_host(data(np.float32, 4, 2, me), stream=0x7000)
    nccl.run("all_reduce", g, {"tensor": x})
    assert waits_before_the_op(mark) == [0x7000]
    np.testing.assert_array_equal(x.host, expected_reduction("SUM", np.float32, 4, len(members), 2))
    mark = len(shim.log)
    outs = [FakeDeviceArray.from_host(np.zeros(2), stream=s) for s in (0x8000, 0x9000) * len(members)][: len(members)]
    nccl.run(
        "all_gather", g, {"tensor_list": outs, "tensor": FakeDeviceArray.from_host(np.full(2, me * 1.0), stream=0x8000)}
    )
    assert waits_before_the_op(mark) == sorted([0x8000] + ([0x9000] if len(members) > 1 else []))
    assert [o.host.tolist() for o in outs] == [[float(r)] * 2 for r in range(len(members))]


def test_the_legacy_default_stream_is_the_null_stream_of_the_caller(dist, shim):
    """The interface names the legacy default stream 1; cupy's null stream has handle 0: an
    array ready on it, used from the null stream, adds no wait (cupy arrays report 1 there)."""
    g, members, me = world(dist)
    nccl.run("all_reduce", g, {"tensor": FakeDeviceArray.from_host(np.ones(2), stream=None)})
    null = shim.current_stream()
    del shim.by_ptr[null.ptr]
    null.ptr = 0
    shim.by_ptr[0] = null
    mark = len(shim.log)
    x = FakeDeviceArray.from_host(np.ones(2), stream=1)
    nccl.run("all_reduce", g, {"tensor": x})
    first = next(i for i, e in enumerate(shim.log[mark:]) if e[0] == "nccl")
    assert first == 0 and shim.log[mark][2] == 0  # no record, no wait: the op itself first, on the null stream
    assert x.host.tolist() == [float(len(members))] * 2


def rec_event(work) -> int:
    """The id of the done event of an NcclWork (what its stream waits are on)."""
    return work._event.id


def test_async_work_completes_with_its_event(dist, shim):
    g, members, me = world(dist)
    x = dev(data(np.float32, 6, 21, me))
    shim.hold = True
    work = nccl.run("all_reduce", g, {"tensor": x, "async_op": True})
    future = work.get_future()
    seen = []
    future.add_done_callback(lambda f: seen.append(f.result()))
    rec = work._recs[0]
    assert not work.is_completed() and not future.done() and rec[R.STATE] == R.STARTED
    assert id(rec) in R.watched  # the timeout watchdog watches it while it is in flight
    result = work.get_future_result()
    mark = len(shim.log)
    assert work.wait() is True  # no timeout: only the caller's stream waits, the host goes on
    assert shim.log[mark][0] == "wait" and not work.is_completed()
    mark = len(shim.log)
    assert work.synchronize() is None  # torch's WorkNCCL::synchronize: the same stream wait
    assert shim.log[mark:] == [("wait", shim.log[mark][1], rec_event(work))] and not work.is_completed()
    assert not result.done()
    with pytest.raises(DistError, match=PREFIX + re.escape("all_reduce: Work.wait timed out after 0.05 s")):
        work.wait(timeout=0.05)
    shim.release()
    assert future.result(timeout=10) == [x] and work.is_completed() and work.is_success()
    assert REAPER.drain() and seen == [[x]] and rec[R.STATE] == R.COMPLETED and id(rec) not in R.watched
    assert work.wait(timeout=1) is True and work.exception() is None
    assert result.result(timeout=10) == WorkResult.SUCCESS


def test_barrier_blocks_the_host_until_done(dist, shim):
    g, _, _ = world(dist)
    shim.hold = True
    work = run("barrier", g, {"async_op": True})
    with pytest.raises(DistError, match=re.escape("barrier: Work.wait timed out")):
        work.wait(timeout=0.02)
    shim.release()
    assert work.wait() is True


def test_flight_recorder_names_the_ops(dist, shim):
    g, _, me = world(dist)
    x = dev(np.ones(4, np.float32))
    run("broadcast", g, {"tensor": x, "src": 0})
    assert REAPER.drain()
    last = R.snapshot()[-1]
    assert (last["op"], last["shapes"], last["dtype"], last["root"], last["state"]) == (
        "broadcast",
        [4],
        "float32",
        0,
        "completed",
    )
    shim.fail_next = True
    with pytest.raises(
        DistBackendError,
        match=PREFIX + re.escape("all_reduce: the op failed: NCCL error: NCCL_ERROR_SYSTEM_ERROR: injected failure"),
    ):
        run("all_reduce", g, {"tensor": x})
    assert R.snapshot()[-1]["state"] == "failed"  # (every rank failed the same way: nothing unmatched)


def test_communicators_made_once_and_destroyed_with_the_group(dist, shim):
    members = list(range(dist.get_world_size()))
    group = dist.new_group()
    g = runtime.resolve_group(group)
    for _ in range(3):
        run("all_reduce", g, {"tensor": dev(np.ones(2))})
        run(
            "all_gather_into_tensor", g, {"output_tensor": dev(np.zeros(len(members))), "input_tensor": dev(np.ones(1))}
        )
    assert state(g).made == 1 and len(shim.comms) == 1
    dist.destroy_process_group(group)
    assert shim.destroyed == 1 and shim.comms[0].destroyed
    assert shim.log[-1][0] == "synchronize"  # the stream drained before the communicator went


def test_cupy13_tuple_unique_ids(dist):
    fake = FakeShim(tuple_ids=True)
    previous = nccl_shim.use(fake)
    try:
        g = dist.new_group()
        x = dev(np.full(2, dist.get_rank() + 1.0))
        run("all_reduce", runtime.resolve_group(g), {"tensor": x})
        n = dist.get_world_size()
        np.testing.assert_array_equal(x.host, np.full(2, n * (n + 1) / 2))
        assert isinstance(fake.comms[0].uid, tuple)
        dist.destroy_process_group(g)
    finally:
        nccl_shim.use(previous)


@pytest.mark.parametrize("version,env,refused", [(22809, "1", True), (23000, None, True), (23000, "1", False)])
def test_ranks_sharing_a_gpu(dist, monkeypatch, version, env, refused):
    """Two ranks of one communicator on one GPU: refused up front on every member, naming the
    ranks, the GPU and NCCL's version (NCCL 2.28 says only "invalid usage"), unless NCCL >= 2.30
    with NCCL_MULTI_RANK_GPU_ENABLE=1 (found on an H200 with NCCL 2.28.9)."""
    if env is None:
        monkeypatch.delenv("NCCL_MULTI_RANK_GPU_ENABLE", raising=False)
    else:
        monkeypatch.setenv("NCCL_MULTI_RANK_GPU_ENABLE", env)
    fake = FakeShim(version=version)
    fake.shared_gpu = True
    previous = nccl_shim.use(fake)
    try:
        g = dist.new_group()
        pg, n = runtime.resolve_group(g), dist.get_world_size()
        x = dev(np.full(2, dist.get_rank() + 1.0))
        if refused and n > 1:
            with pytest.raises(
                DistBackendError,
                match=PREFIX
                + re.escape("all_reduce: could not make the NCCL communicator of group ")
                + r".*"
                + re.escape(
                    f": its ranks {list(range(n))} use the same GPU (fake-gpu-0); NCCL refuses ranks of one "
                    f"communicator on one GPU unless NCCL >= 2.30 (found {version // 10000}.{version // 100 % 100}."
                    f"{version % 100}) and NCCL_MULTI_RANK_GPU_ENABLE=1"
                ),
            ):
                run("all_reduce", pg, {"tensor": x})
            assert not fake.comms  # refused before NCCL was asked
        else:
            run("all_reduce", pg, {"tensor": x})
            np.testing.assert_array_equal(x.host, np.full(2, n * (n + 1) / 2))
        dist.destroy_process_group(g)
    finally:
        nccl_shim.use(previous)


# -- bad input ----------------------------------------------------------------------------------------


def test_bad_arrays(dist, shim):
    g, members, me = world(dist)
    n = len(members)
    cases = [
        (
            "all_reduce",
            {"tensor": np.ones(3)},
            TypeError,
            "tensor must be a device (GPU) array (cupy, or any object with __cuda_array_interface__ or a CUDA "
            "__dlpack_device__) on the NCCL "
            "path, got ndarray",
        ),
        (
            "all_reduce",
            {"tensor": StridedFake((2, 3))},
            ValueError,
            "tensor must be C-contiguous, got a non-contiguous array of shape (2, 3) and strides (4, 12)",
        ),
        (
            "broadcast",
            {"tensor": ReadOnlyFake(3), "src": 0},
            ValueError,
            "tensor must be writable, got a read-only array",
        ),
        (
            "all_reduce",
            {"tensor": dev(np.ones(2)), "algorithm": "ring"},
            ValueError,
            "algorithm='ring' selects a host algorithm; the NCCL path takes algorithm=None",
        ),
        ("broadcast", {"tensor": dev(np.ones(2)), "src": n}, ValueError, f"src={n}: global rank {n} is not part"),
        (
            "all_gather_into_tensor",
            {"output_tensor": dev(np.zeros(n + 1)), "input_tensor": dev(np.ones(1))},
            ValueError,
            f"output_tensor must hold world_size * input_tensor.size = {n} * 1 = {n} elements, got {n + 1}",
        ),
        (
            "all_gather_into_tensor",
            {"output_tensor": dev(np.zeros(n)), "input_tensor": dev(np.ones(1, np.int32))},
            TypeError,
            "input_tensor dtype int32 does not match output_tensor dtype float64",
        ),
        (
            "all_gather",
            {"tensor_list": [dev(np.zeros(2))] * (n + 1), "tensor": dev(np.ones(2))},
            ValueError,
            f"tensor_list must hold the group size = {n} arrays, got {n + 1}",
        ),
        (
            "reduce_scatter",
            {"output": dev(np.zeros(2)), "input_list": [dev(np.zeros(3))] * n},
            ValueError,
            "input_list[0] has shape (3,), expected the shape of output (2,)",
        ),
        (
            "all_to_all_single",
            {"output": dev(np.zeros(n)), "input": dev(np.zeros(n)), "output_split_sizes": [1] * (n + 1)},
            ValueError,
            f"output_split_sizes must hold one size per group member = {n} sizes, got {n + 1}",
        ),
        ("recv", {"tensor": dev(np.zeros(2))}, ValueError, "src=None (any source) is not supported by NCCL"),
        ("send", {"tensor": dev(np.zeros(2)), "dst": 0, "tag": -1}, ValueError, "tag must be in [0, "),
        (
            "gather",
            {"tensor": dev(np.zeros(2)), "gather_list": [dev(np.zeros(2))] * n, "dst": n - 1},
            ValueError,
            f"gather_list must not be given on a rank other than dst={n - 1}",
        ),
        (
            "barrier",
            {"device_ids": [0, 1]},
            ValueError,
            "device_ids must be None or a list of one int (this process's GPU) on the NCCL path, got [0, 1]",
        ),
        ("all_gatherz", {}, ValueError, "has no NCCL implementation; expected one of"),
    ]
    for op, args, kind, message in cases:
        if op == "gather" and me == n - 1:
            continue
        with pytest.raises(kind, match=PREFIX + re.escape(f"{op}: {message}")):
            run(op, g, args)


def test_shared_checks_keep_each_ops_wording(dist, shim):
    """The checks the NCCL ops share (the (output, input) pair, the world-size block check,
    array lists, the root-only list of gather/scatter, the *_multigpu index) word each op's
    error as before."""
    g, members, me = world(dist)
    n, root = len(members), members[0]
    cases = [
        (
            "reduce_scatter_tensor",
            {"output": dev(np.zeros(1)), "input": dev(np.zeros(n + 1))},
            ValueError,
            f"input must hold world_size * output.size = {n} * 1 = {n} elements, got {n + 1} (shape ({n + 1},))",
        ),
        (
            "reduce_scatter_tensor",
            {"output": dev(np.zeros(1)), "input": dev(np.zeros(n, np.float32))},
            TypeError,
            "input dtype float32 does not match output dtype float64",
        ),
        (
            "all_to_all_single",
            {"output": dev(np.zeros(n)), "input": dev(np.zeros(n, np.int32))},
            TypeError,
            "input dtype int32 does not match output dtype float64",
        ),
        (
            "reduce_scatter",
            {"output": dev(np.zeros(2)), "input_list": dev(np.zeros(2))},
            TypeError,
            "input_list must be a list of device arrays, got FakeDeviceArray",
        ),
        (
            "reduce_scatter",
            {"output": dev(np.zeros(2)), "input_list": [dev(np.zeros(2))] * (n + 1)},
            ValueError,
            f"input_list must hold one array per group rank: expected {n}, got {n + 1}",
        ),
        (
            "all_to_all",
            {"output_tensor_list": [dev(np.zeros(1))] * n, "input_tensor_list": [dev(np.zeros(1))] * (n + 1)},
            ValueError,
            f"input_tensor_list must hold the group size = {n} arrays, got {n + 1}",
        ),
        (
            "broadcast_multigpu",
            {"tensor_list": [dev(np.zeros(2))], "src": 0, "src_tensor": True},
            TypeError,
            "src_tensor must be an int, got bool",
        ),
        (
            "broadcast_multigpu",
            {"tensor_list": [dev(np.zeros(2))] * 2, "src": 0, "src_tensor": 1},
            ValueError,
            "tensor_list must hold exactly one array on the NCCL path (one GPU per process; torch removed the "
            "multi-GPU forms), got 2",
        ),
    ]
    if me == root:
        cases += [
            (
                "gather",
                {"tensor": dev(np.zeros(2)), "gather_list": [], "dst": root},
                ValueError,
                f"gather_list must be given on the destination rank dst={root}: a list of {n} arrays, got []",
            ),
            (
                "scatter",
                {"tensor": dev(np.zeros(2)), "scatter_list": None, "src": root},
                ValueError,
                f"scatter_list must be given on the source rank src={root}: a list of {n} arrays, got None",
            ),
            (
                "scatter",
                {"tensor": dev(np.zeros(2)), "scatter_list": [dev(np.zeros(3))] * n, "src": root},
                ValueError,
                f"scatter_list[{me}] must have the shape of tensor, (2,) (it is src's own part), got (3,)",
            ),
        ]
    else:
        cases.append(
            (
                "scatter",
                {"tensor": dev(np.zeros(2)), "scatter_list": [dev(np.zeros(2))] * n, "src": root},
                ValueError,
                f"scatter_list must not be given on a rank other than src={root} (torch: 'must "
                f"NOT be specified on non-source ranks'); pass None",
            )
        )
    for op, args, kind, message in cases:
        with pytest.raises(kind, match=PREFIX + re.escape(f"{op}: {message}") + "$"):
            run(op, g, args)


def test_arrays_must_sit_on_the_communicators_device(dist, shim):
    g, _, _ = world(dist)
    run("all_reduce", g, {"tensor": dev(np.ones(2))})
    other = FakeDeviceArray.from_host(np.ones(2), device=1)
    with pytest.raises(
        ValueError,
        match=PREFIX
        + re.escape(
            "all_reduce: tensor is on device 1, expected device 0 (where group 'default_pg' communicates through NCCL)"
        ),
    ):
        run("all_reduce", g, {"tensor": other})
    with pytest.raises(ValueError, match=re.escape("output_tensor is on device 1, expected device 0")):
        run(
            "all_gather_into_tensor",
            g,
            {
                "output_tensor": FakeDeviceArray((dist.get_world_size(),), np.float64, device=1),
                "input_tensor": dev(np.ones(1)),
            },
        )


def test_batch_ops_must_share_one_group(dist, shim):
    g, _, _ = world(dist)
    other = dist.new_group()
    x = dev(np.zeros(2))
    with pytest.raises(
        ValueError,
        match=PREFIX + re.escape("batch_isend_irecv: p2p_op_list[1] is on another group than the batch's first op"),
    ):
        run("batch_isend_irecv", g, {"p2p_op_list": [p2p_op(mpidist.isend, x, 0), p2p_op(mpidist.isend, x, 0, other)]})
    with pytest.raises(ValueError, match=re.escape("p2p_op_list[0] must be a P2POp, got int")):
        run("batch_isend_irecv", g, {"p2p_op_list": [3]})
    dist.destroy_process_group(other)


@pytest.mark.parametrize("accepts", [bytes, tuple], ids=["cupy14-bytes", "cupy13-tuple"])
def test_cupy_shim_hands_the_unique_id_over_in_the_form_the_constructor_takes(accepts):
    """CuPy 13's get_unique_id() gives (and NcclCommunicator takes) a tuple of 128 signed
    chars, CuPy 14's bytes: an id made in either form reaches the other's constructor intact."""
    raw = bytes(range(256))[::2]  # 128 bytes, half of them > 127
    signed = tuple(b - 256 if b > 127 else b for b in raw)
    made = []

    class Communicator:
        def __init__(self, size, uid, rank):
            if not isinstance(uid, accepts):
                raise TypeError(f"commId must be {accepts.__name__}")
            made.append((size, uid, rank))

    shim = nccl_shim.CupyShim.__new__(nccl_shim.CupyShim)  # no cupy here: only the nccl module is used
    shim.nccl = type("StubNccl", (), {"NcclCommunicator": Communicator})
    for uid in (raw, signed):
        shim.communicator(2, uid, 1, None)
    want = raw if accepts is bytes else signed
    assert made == [(2, want, 1), (2, want, 1)]
