"""Which path a device call takes, decided without a GPU: the path table, CUDA-awareness
detection (for real on this MPICH, and with a stand-in library / info), device binding,
backend strings, and the routing of device calls to NCCL."""

from __future__ import annotations

import re
import sys
import threading
import types
import warnings

import numpy as np
import pytest
from fake_device import FakeDeviceArray, FakeRuntime
from mpi4py import MPI

import mpidist
from mpidist import ReduceOp, make_premul_sum
from mpidist._arrays.namespace import is_device_array
from mpidist._backends.device import paths
from mpidist._backends.device.paths import HOST, MPI_CUDA, NCCL, STAGING
from mpidist._runtime.world import canonical_backend
from mpidist.device import binding, detect, runtime

pytestmark = pytest.mark.mpi


# -- the path table ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "device, backend, aware, possible, expected",
    [
        (False, "mpi", False, False, HOST),
        (False, "mpi", True, True, HOST),
        (False, "nccl", True, True, HOST),
        (True, "nccl", False, False, NCCL),
        (True, "nccl", True, True, NCCL),
        (True, "mpi", True, True, MPI_CUDA),
        (True, "mpi", True, False, STAGING),
        (True, "mpi", False, True, STAGING),
        (True, "mpi", False, False, STAGING),
    ],
)
def test_path_table(device, backend, aware, possible, expected):
    assert paths.choose(device, backend, aware, possible) == expected


@pytest.mark.parametrize("backend, device_backend", [("mpi", "mpi"), ("nccl", "nccl"), ("cpu:mpi,cuda:nccl", "nccl")])
def test_device_backend(backend, device_backend):
    assert paths.device_backend(backend) == device_backend


F32, F16, I64 = np.dtype(np.float32), np.dtype(np.float16), np.dtype(np.int64)


@pytest.mark.parametrize(
    "op, dtype, redop, algorithm, overlap, ok",
    [
        ("all_reduce", F32, ReduceOp.SUM, None, False, True),
        ("all_reduce", I64, ReduceOp.BAND, "mpi", False, True),
        ("all_reduce", F32, ReduceOp.AVG, "ring", False, True),
        ("all_reduce", F32, ReduceOp.SUM, "shm", False, False),  # a host-memory algorithm
        ("all_reduce", F16, ReduceOp.SUM, None, False, False),  # reduced by a Python MPI op
        ("all_reduce", F32, make_premul_sum(2.0), None, False, False),  # host-array factor
        ("reduce", F32, ReduceOp.MAX, None, False, True),
        ("reduce_scatter_tensor", F16, ReduceOp.SUM, None, False, False),
        ("all_gather_into_tensor", F16, None, None, False, True),  # no reduction: any dtype
        ("all_gather_into_tensor", F32, None, None, True, False),  # in place: staged
        ("broadcast", F16, None, None, False, True),
        ("send", F32, None, None, False, True),
        ("batch_isend_irecv", F32, None, None, False, True),
        ("all_gather", F32, None, None, False, False),
        ("gather", F32, None, None, False, False),
        ("scatter", F32, None, None, False, False),
        ("all_to_all", F32, None, None, False, False),
        ("all_to_all_single", F32, None, None, False, False),
        ("reduce_scatter", F32, ReduceOp.SUM, None, False, False),
        ("all_reduce_multigpu", F32, ReduceOp.SUM, None, False, False),
    ],
)
def test_mpi_cuda_table(op, dtype, redop, algorithm, overlap, ok):
    assert paths.mpi_cuda_ok(op, dtype, redop, algorithm, overlap) is ok


# -- what counts as a device array ------------------------------------------------------------


class _DL:
    def __init__(self, kind):
        self.kind = kind

    def __dlpack_device__(self):
        if self.kind is None:
            raise RuntimeError("broken")
        return (self.kind, 0)


@pytest.mark.parametrize(
    "obj, device",
    [
        (np.zeros(2), False),
        (FakeDeviceArray((2,)), True),
        (_DL(2), True),
        (_DL(13), True),
        (_DL(3), False),
        (_DL(1), False),
        (_DL(None), False),
        ([1, 2], False),
        (None, False),
    ],
)
def test_is_device_array(obj, device):
    assert is_device_array(obj) is device


# -- detection --------------------------------------------------------------------------------


def test_detection_env_override():
    assert detect.detect({"MPIDIST_CUDA_AWARE": "1"}) == detect.Detection(True, "MPIDIST_CUDA_AWARE=1")
    assert detect.detect({"MPIDIST_CUDA_AWARE": " 0 "}) == detect.Detection(False, "MPIDIST_CUDA_AWARE=0")
    with pytest.raises(ValueError, match=r"MPIDIST_CUDA_AWARE must be 0 or 1, got 'yes'"):
        detect.detect({"MPIDIST_CUDA_AWARE": "yes"})


def test_detection_for_real_on_this_mpi():
    """The pip MPIs (MPICH, Open MPI, Intel MPI) are not CUDA-aware: MPIX_Query_cuda_support,
    where the library exports it, says 0; the MPI-4.1 info key, where the MPI has it (MPICH;
    not Open MPI 5.0), lists no cuda."""
    libs = detect.mpi_library_paths()
    assert libs and all(re.search(r"libmpi[^/]*\.so", p) for p in libs)
    aware, source = detect.query_library()
    assert aware in (False, None)
    if aware is False:
        assert re.fullmatch(r"MPIX_Query_cuda_support\(\) in \S*libmpi\S* returned 0", source)
    aware, source = detect.info_key()
    if MPI.get_vendor()[0] == "MPICH":
        assert aware is False and "mpi_memory_alloc_kinds=" in source and "cuda" not in source
    else:
        assert aware in (False, None) and "cuda" not in source
    found = detect.detect({})
    assert found.aware is False
    assert mpidist.cuda_aware_mpi() in (False, True)  # False unless the run sets MPIDIST_CUDA_AWARE=1


def test_detection_reads_library_and_info(monkeypatch, tmp_path):
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f01 r-xp 00000000 08:01 1 /opt/x/lib/libmpi_cray.so.12\n"
        "7f01-7f02 r--p 00000000 08:01 2 /usr/lib/libc.so.6\n7f02-7f03 rw-p 00000000 00:00 0 \n"
        "7f03-7f04 r-xp 00000000 08:01 1 /opt/x/lib/libmpi_cray.so.12\n"
    )
    assert detect.mpi_library_paths(str(maps)) == ["/opt/x/lib/libmpi_cray.so.12"]
    assert detect.mpi_library_paths(str(tmp_path / "none")) == []

    class Lib:
        def __init__(self, path):
            if path == "missing":
                raise OSError(path)
            if path == "nosym":
                return
            self.MPIX_Query_cuda_support = lambda: 1

    monkeypatch.setattr(detect.ctypes, "CDLL", Lib)
    assert detect.query_library(["missing", "nosym", "good"]) == (True, "MPIX_Query_cuda_support() in good returned 1")
    assert detect.query_library(["missing"])[0] is None

    class Info:
        def __init__(self, value):
            self.value = value

        def Get(self, key):  # noqa: N802
            assert key == "mpi_memory_alloc_kinds"
            return self.value

        def Free(self):  # noqa: N802
            pass

    class Comm:
        def __init__(self, value):
            self.value = value

        def Get_info(self):  # noqa: N802
            if self.value is Exception:
                raise RuntimeError("no info")
            return Info(self.value)

    for kinds, aware in [
        ("mpi,system,cuda", True),
        ("mpi,cuda:device", True),
        ("cuda:host:managed", True),
        ("mpi,cuda:host", False),
        ("mpi,system", False),
        ("rocm:device", False),
        (None, None),
    ]:
        assert detect.info_key(Comm(kinds))[0] is aware, kinds
    assert detect.info_key(Comm(Exception))[0] is None
    found = detect.detect({}, paths=["missing"], comm=Comm("mpi,cuda:device"))
    assert found == detect.Detection(
        True, "no loaded MPI library exports MPIX_Query_cuda_support; mpi_memory_alloc_kinds='mpi,cuda:device'"
    )
    assert detect.detect({}, paths=["missing"], comm=Comm(None)).aware is False


def test_cuda_aware_mpi_cached_at_init(dist, monkeypatch):
    monkeypatch.setattr(detect, "_detected", detect.Detection(True, "test"))
    assert mpidist.cuda_aware_mpi() is True
    monkeypatch.setenv("MPIDIST_CUDA_AWARE", "0")
    detect.init()
    assert mpidist.cuda_aware_mpi() is False and detect.detection().source == "MPIDIST_CUDA_AWARE=0"


# -- device binding ---------------------------------------------------------------------------


class _TorchDevice:
    def __init__(self, index, type="cuda"):  # noqa: A002
        self.index, self.type = index, type


@pytest.mark.parametrize(
    "device_id, env, local_rank, count, expected",
    [
        (None, {}, 0, 4, 0),
        (None, {}, 5, 4, 1),
        (None, {}, 3, 1, 0),
        (2, {}, 0, 4, 2),
        ("cuda:3", {}, 0, 4, 3),
        ("1", {}, 0, 4, 1),
        ("cuda", {}, 6, 4, 2),
        (_TorchDevice(1), {}, 0, 4, 1),
        (_TorchDevice(None), {}, 3, 2, 1),
        (None, {"MPIDIST_DEVICE": "3"}, 0, 4, 3),
        (1, {"MPIDIST_DEVICE": "3"}, 0, 4, 1),
        (None, {"MPIDIST_DEVICE": ""}, 1, 4, 1),
    ],
)
def test_device_choice(device_id, env, local_rank, count, expected):
    assert binding.choose_device(device_id, env, local_rank, count) == expected


@pytest.mark.parametrize(
    "device_id, env, error, match",
    [
        (4, {}, ValueError, r"init_process_group: device_id=4 but this node has 4 CUDA device\(s\)"),
        (None, {"MPIDIST_DEVICE": "7"}, ValueError, r"MPIDIST_DEVICE=7 but this node has 4"),
        (None, {"MPIDIST_DEVICE": "gpu1"}, ValueError, r"MPIDIST_DEVICE must be a device index >= 0, got 'gpu1'"),
        ("gpu:1", {}, ValueError, r"device_id must be an int, 'cuda:N' or a device with .index, got 'gpu:1'"),
        (-1, {}, ValueError, r"device_id must be >= 0, got -1"),
        (1.5, {}, TypeError, r"device_id must be an int, 'cuda:N' or a device with .index, got float"),
        (_TorchDevice(0, "cpu"), {}, ValueError, r"device_id must be a CUDA device"),
    ],
)
def test_device_choice_errors(device_id, env, error, match):
    with pytest.raises(error, match=match):
        binding.choose_device(device_id, env, 0, 4)


def test_binding_without_gpu(dist, monkeypatch):
    monkeypatch.setattr(binding, "_device_count", lambda: 0)
    assert binding.bind(None, 0) is None and binding.bound_device() is None
    with pytest.raises(
        ValueError,
        match=r"init_process_group: device_id='cuda:0' was given but there is no CUDA "
        r"device \(or CuPy is not installed",
    ):
        binding.bind("cuda:0", 0)


def test_binding_makes_the_device_current_here_and_on_engine_threads(monkeypatch):
    """bind() makes the device current on this thread and registers it for every engine thread
    (CUDA's current device is per thread); a later bind without a GPU clears that again."""
    from mpidist import work

    used = []

    class Device:
        def __init__(self, index):
            self.index = index

        def use(self):
            used.append((self.index, threading.current_thread().name))

    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=types.SimpleNamespace(Device=Device)))
    monkeypatch.setattr(binding, "_device_count", lambda: 2)
    monkeypatch.setattr(binding, "_bound", None)
    monkeypatch.setattr(work, "THREAD_START", [])
    monkeypatch.delenv(binding.ENV, raising=False)
    assert binding.bind(None, 3) == 1 and binding.bound_device() == 1  # local rank 3 % 2 GPUs
    assert used == [(1, threading.current_thread().name)]
    t = threading.Thread(target=lambda: [hook() for hook in work.THREAD_START], name="engine-like")
    t.start()
    t.join()
    assert used[1:] == [(1, "engine-like")]
    monkeypatch.setattr(binding, "_device_count", lambda: 0)
    assert binding.bind(None, 0) is None and work.THREAD_START == []


def test_init_with_device_id_but_no_gpu(dist, monkeypatch):
    monkeypatch.setattr(binding, "_device_count", lambda: 0)
    dist.destroy_process_group()
    try:
        with pytest.raises(ValueError, match=r"device_id=0 was given but there is no CUDA device"):
            dist.init_process_group(device_id=0)
        assert not dist.is_initialized()
    finally:
        if not dist.is_initialized():
            dist.init_process_group()


# -- backend strings --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "given, canonical",
    [
        (None, "mpi"),
        ("mpi", "mpi"),
        ("MPI", "mpi"),
        ("cpu:mpi", "mpi"),
        ("cuda:mpi", "mpi"),
        ("cpu:mpi,cuda:mpi", "mpi"),
        ("nccl", "nccl"),
        ("cuda:nccl", "nccl"),
        ("cpu:mpi,cuda:nccl", "cpu:mpi,cuda:nccl"),
        ("cuda:nccl,cpu:mpi", "cpu:mpi,cuda:nccl"),
        ("CPU:MPI, CUDA:NCCL", "cpu:mpi,cuda:nccl"),
        ("gloo", "gloo"),
        ("GLOO", "gloo"),
        ("cpu:gloo", "gloo"),
        ("cuda:gloo", "gloo"),
        ("cpu:gloo,cuda:nccl", "cpu:gloo,cuda:nccl"),
        ("cuda:nccl,cpu:gloo", "cpu:gloo,cuda:nccl"),
        ("cpu:gloo,cuda:mpi", "cpu:gloo,cuda:mpi"),
    ],
)
def test_backend_strings(given, canonical):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the gloo names' warning: tests/test_init_check.py
        assert canonical_backend(given) == canonical


@pytest.mark.parametrize("bad", ["ucc", "cpu:nccl", "cuda:nccl,cuda:mpi", "xpu:mpi", "cpu:ucc,cuda:nccl", ""])
def test_backend_strings_refused(bad):
    with pytest.raises(
        ValueError,
        match=rf"init_process_group: backend {re.escape(repr(bad))} is not supported; "
        r"expected 'mpi', 'gloo', 'nccl' or torch's device:backend form",
    ):
        canonical_backend(bad)


def test_backend_of_groups(dist, world):
    rank, size = world
    assert dist.get_backend() == "mpi"
    g = dist.new_group(backend="cuda:nccl,cpu:mpi")
    h = dist.new_group(backend="nccl")
    k = dist.new_group()
    assert (dist.get_backend(g), dist.get_backend(h), dist.get_backend(k)) == ("cpu:mpi,cuda:nccl", "nccl", "mpi")
    with pytest.raises(ValueError, match=rf"\[rank {rank}/{size}\] new_group: backend 'ucc' is not supported"):
        dist.new_group(backend="ucc")
    for grp in (g, h, k):
        dist.destroy_process_group(grp)


def test_init_with_nccl_backend_string(dist, world):
    _, size = world
    dist.destroy_process_group()
    try:
        dist.init_process_group("cpu:mpi,cuda:nccl")
        assert dist.get_backend() == "cpu:mpi,cuda:nccl"
        x = np.ones(3)
        dist.all_reduce(x)  # host arrays over MPI on an NCCL backend
        np.testing.assert_array_equal(x, np.full(3, float(size)))
    finally:
        dist.destroy_process_group()
        dist.init_process_group()


# -- routing to NCCL --------------------------------------------------------------------------


@pytest.fixture
def nccl_calls(dist, monkeypatch):
    """A stand-in mpidist._backends.device.nccl that records its calls."""
    calls = []
    fake = types.ModuleType("mpidist._backends.device.nccl")

    def run(op, g, args):
        calls.append((op, g, args))
        return ("nccl", op)

    fake.run = run
    monkeypatch.setitem(sys.modules, "mpidist._backends.device.nccl", fake)
    import mpidist.device as pkg

    monkeypatch.setattr(pkg, "nccl", fake, raising=False)
    rt = FakeRuntime()
    runtime.register(rt)
    yield calls
    runtime.unregister(rt)


@pytest.mark.parametrize("kind", ["all", "first"])
def test_device_calls_on_nccl_groups_go_to_nccl(dist, world, nccl_calls, kind):
    rank, size = world
    members = list(range(size)) if kind == "all" else [0]
    g = dist.new_group(members, backend="nccl" if kind == "all" else "cpu:mpi,cuda:nccl")
    x = FakeDeviceArray((3,))
    lst = [FakeDeviceArray((3,)) for _ in members]
    out = dist.all_reduce(x, ReduceOp.MAX, group=g, async_op=True)
    if rank not in members:
        assert out is None and dist.recv(x, members[0], group=g) == -1 and not nccl_calls
        assert dist.batch_isend_irecv([dist.P2POp(dist.isend, x, members[0], g)]) == []
        return
    assert out == ("nccl", "all_reduce")
    op, grp, args = nccl_calls[-1]
    assert grp is g and args == {"tensor": x, "op": ReduceOp.MAX, "async_op": True, "algorithm": None}
    dist.all_gather(lst, x, group=g)
    assert nccl_calls[-1][2] == {"tensor_list": lst, "tensor": x, "async_op": False}
    assert nccl_calls[-1][2]["tensor_list"][0] is lst[0]
    dist.reduce_scatter_tensor(x, FakeDeviceArray((3 * len(members),)), group=g)
    assert nccl_calls[-1][0] == "reduce_scatter_tensor" and set(nccl_calls[-1][2]) == {
        "output",
        "input",
        "op",
        "async_op",
    }
    assert dist.recv(x, members[0], group=g, tag=4) == ("nccl", "recv")
    assert nccl_calls[-1][2] == {"tensor": x, "src": members[0], "tag": 4}  # a global rank
    p2p = [dist.P2POp(dist.isend, x, members[0], g)]
    assert dist.batch_isend_irecv(p2p) == ("nccl", "batch_isend_irecv")
    assert nccl_calls[-1][2]["p2p_op_list"] == p2p
    calls = len(nccl_calls)
    h = np.ones(3)
    dist.all_reduce(h, group=g)  # host arrays: MPI, never NCCL
    np.testing.assert_array_equal(h, np.full(3, float(len(members))))
    assert len(nccl_calls) == calls
    with pytest.raises(
        TypeError,
        match=r"all_gather: tensor is a device \(cuda:0\) array but tensor_list\[0\] is "
        r"a host numpy array",
    ):
        dist.all_gather([np.zeros(3) for _ in members], x, group=g)
    assert len(nccl_calls) == calls
    dist.destroy_process_group(g)


def test_group_ranks_reach_nccl_as_global_ranks(dist, world, nccl_calls):
    """torch 2.4+'s group_src/group_dst/group_peer on device arrays: the router translates
    them once, so NCCL's ops see global ranks only (and the defaults: scatter's 0)."""
    rank, size = world
    members = list(range(size - 1, -1, -2))[::-1]  # the ranks of the last rank's parity
    g = dist.new_group(members, backend="nccl")
    x = FakeDeviceArray((3,))
    if rank not in members:
        assert dist.broadcast(x, group=g, group_src=0) is None and not nccl_calls
        return
    last = len(members) - 1
    dist.broadcast(x, group=g, group_src=last)
    assert nccl_calls[-1][2] == {"tensor": x, "src": members[last], "async_op": False}
    dist.reduce(x, group=g, group_dst=0, async_op=True)
    assert nccl_calls[-1][2]["dst"] == members[0] and "group_dst" not in nccl_calls[-1][2]
    if 0 in members:
        dist.scatter(x, group=g)
        assert nccl_calls[-1][2]["src"] == 0 and "group_src" not in nccl_calls[-1][2]
    else:  # torch's default source, global rank 0, is not in this group
        with pytest.raises(ValueError, match=r"scatter: src=0: global rank 0 is not part of group"):
            dist.scatter(x, group=g)
    dist.recv(x, group=g)  # any source stays any source
    assert nccl_calls[-1][2]["src"] is None and "group_src" not in nccl_calls[-1][2]
    p2p = [dist.P2POp(dist.irecv, x, group=g, group_peer=last)]
    dist.batch_isend_irecv(p2p)
    sent = nccl_calls[-1][2]["p2p_op_list"][0]
    assert (sent.peer, sent.group_peer, sent.tensor, sent.group) == (members[last], None, x, g)
    with pytest.raises(ValueError, match=r"broadcast: src=0 and group_src=0 both given"):
        dist.broadcast(x, 0, group=g, group_src=0)
    with pytest.raises(ValueError, match=rf"gather: group_dst={len(members)} is out of range"):
        dist.gather(x, group=g, group_dst=len(members))
    dist.destroy_process_group(g)
