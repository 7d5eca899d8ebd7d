"""What torch's own test suite and the frameworks on top of torch expect of a backend,
found when they were run on backend "mpidist" (issue 23), each checked against what
torch's gloo or NCCL backend does:

* ``all_gather_coalesced`` in torch's layout (one output list per rank);
* a sub-group's own ``timeout=``, and the words torch's users match a timeout on;
* ``ProcessGroup.monitored_barrier(timedelta(0))`` failing at once on group rank 0;
* ``all_reduce`` of a sparse COO tensor (gloo's sum);
* ``ReduceOp.AVG`` of integer tensors (NCCL's: sum, then division toward zero), which
  Lightning's ``self.log(..., sync_dist=True)`` sends;
* the group's device types (``torch.distributed.checkpoint.async_save`` needs CPU);
* ``PREMUL_SUM`` with a one-element tensor factor (torch's NCCL tests' form);
* no FutureWarning from mpidist's own calls; profiler events ``"mpidist:<op>"``.

Runs serially (world size 1) and under mpiexec -n 2, 3, 4.
"""

from __future__ import annotations

import datetime
import os
import re
import subprocess
import sys
import time
import warnings

import pytest

torch = pytest.importorskip("torch")
tdist = pytest.importorskip("torch.distributed")

from torch_helpers import TORCH, all_gather_single, reduce_scatter_single, torch_world  # noqa: E402

import mpidist  # noqa: E402
from mpidist._core import recorder  # noqa: E402
from mpidist._runtime import world as runtime  # noqa: E402
from mpidist.torch import _profile  # noqa: E402

# torch warns when a sparse tensor is made without its invariant checks (the sparse tests)
pytestmark = [
    pytest.mark.launches,
    pytest.mark.mpi,
    pytest.mark.filterwarnings("ignore:Sparse invariant checks:UserWarning"),
]


@pytest.fixture(scope="module", autouse=True)
def world():
    with torch_world():
        yield tdist.get_rank(), tdist.get_world_size()


def _same_dir(tmp_path) -> str:
    """One directory for every rank: rank 0's ``tmp_path``."""
    box = [str(tmp_path)]
    tdist.broadcast_object_list(box, src=0)
    return box[0]


# -- all_gather_coalesced: torch's layout ---------------------------------------------------


@pytest.mark.parametrize("async_op", [False, True])
def test_all_gather_coalesced_fills_one_list_per_rank(world, async_op):
    r, n = world
    inputs = [torch.full((2,), 10.0 * r), torch.full((3,), 10.0 * r + 1), torch.full((1, 2), -1.0 - r)]
    outputs = [[torch.empty(2), torch.empty(3), torch.empty(1, 2)] for _ in range(n)]  # outputs[rank][i]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch: "will be deprecated"
        fut = tdist.all_gather_coalesced(outputs, inputs, async_op=async_op)
    if async_op:
        fut.wait()
    for k in range(n):
        assert torch.equal(outputs[k][0], torch.full((2,), 10.0 * k))
        assert torch.equal(outputs[k][1], torch.full((3,), 10.0 * k + 1))
        assert torch.equal(outputs[k][2], torch.full((1, 2), -1.0 - k))


def test_all_gather_coalesced_wrong_list_count_is_a_clear_error(world):
    r, n = world
    outputs = [[torch.empty(2)] for _ in range(n + 1)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        with pytest.raises(ValueError, match=rf"\[rank {r}/{n}\] all_gather_coalesced: output_tensor_lists"):
            tdist.all_gather_coalesced(outputs, [torch.ones(2)])


# -- a group's own timeout --------------------------------------------------------------------


def test_new_group_timeout_is_the_groups_own(world):
    r, n = world
    group = tdist.new_group(list(range(n)), timeout=datetime.timedelta(seconds=7))
    other = tdist.new_group(list(range(n)))  # torch's default for a new group: 30 min
    t = torch.ones(2)
    tdist.all_reduce(t, group=group)
    tdist.all_reduce(t, group=other)
    mine = group.mpidist_group
    assert mine.timeout_s == 7.0 and other.mpidist_group.timeout_s == 1800.0
    if n > 1:
        entries = {e["group"]: e for e in recorder.snapshot() if e["op"] == "all_reduce"}
        assert entries[mine.group_name]["timeout_s"] == 7.0
        assert entries[other.mpidist_group.group_name]["timeout_s"] == 1800.0
    tdist.destroy_process_group(group)
    tdist.destroy_process_group(other)


def test_new_group_timeout_bad_values(world):
    with pytest.raises(TypeError, match=r"new_group: timeout must be a datetime.timedelta, got int"):
        mpidist.new_group(timeout=5)
    with pytest.raises(ValueError, match=r"new_group: timeout must be positive"):
        mpidist.new_group(timeout=datetime.timedelta(0))


SUBGROUP_TIMEOUT = r"""
import re, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
import mpidist.torch
dist.init_process_group("mpidist")
rank = dist.get_rank()
group = dist.new_group([0, 1], timeout=timedelta(seconds=1))
if rank == 0:  # alone in the group's barrier: it must end at the group's 1 s, not the default 30 min
    t0 = time.monotonic()
    try:
        dist.barrier(group)
    except RuntimeError as exc:
        took = time.monotonic() - t0
        matched = re.search(" (Timed out|closed|timeout) ", str(exc)) is not None
        print(f"raised after {took:.1f} s, torch's pattern matched: {matched}: {exc}", flush=True)
dist.barrier()
if rank == 1:  # joins the barrier rank 0 gave up on, which is still in MPI (MPIDIST_ABORT_ON_TIMEOUT=0)
    dist.barrier(group)
dist.barrier()
dist.destroy_process_group()
print(f"rank {rank} done", flush=True)
"""


def test_a_subgroup_barrier_times_out_at_the_groups_timeout(tmp_path):
    if runtime.state().world_size > 1:
        pytest.skip("starts its own 2-rank job; runs in the serial pass")
    script = tmp_path / "job.py"
    script.write_text(SUBGROUP_TIMEOUT)
    env = dict(os.environ, MPIDIST_ABORT_ON_TIMEOUT="0", OMP_NUM_THREADS="1")
    for name in (
        "MASTER_ADDR",
        "MASTER_PORT",
        "RANK",
        "WORLD_SIZE",
        "PMI_RANK",
        "PMI_SIZE",
        "PMI_FD",
        "PMI_PORT",
        "PMIX_RANK",
        "HYDRA_CONTROL_FD",
    ):
        env.pop(name, None)
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    t0 = time.monotonic()
    proc = subprocess.run(
        [mpiexec, "-n", "2", sys.executable, "-m", "mpidist", str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert time.monotonic() - t0 < 60
    found = re.search(
        r"raised after ([\d.]+) s, torch's pattern matched: True: \[rank 0/2\] barrier: timed out "
        r"after 1 s, the timeout of group",
        proc.stdout,
    )
    assert found, proc.stdout + proc.stderr
    assert 0.9 <= float(found.group(1)) < 10
    assert "rank 0 done" in proc.stdout and "rank 1 done" in proc.stdout


# -- monitored_barrier with a zero timeout ----------------------------------------------------


def test_monitored_barrier_zero_timeout_fails_at_once_on_rank_0(world):
    r, n = world
    group = tdist.new_group(list(range(n)))
    if r == 0:  # the other ranks never call it: rank 0 must not wait for them
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"Rank 0 timed out in monitoredBarrier"):
            group.monitored_barrier(datetime.timedelta(seconds=0))
        assert time.monotonic() - t0 < 1.0
    tdist.barrier()
    tdist.destroy_process_group(group)


# -- sparse all_reduce ------------------------------------------------------------------------


@pytest.mark.parametrize("async_op", [False, True])
def test_all_reduce_sparse_coo_sums_as_gloo(world, async_op):
    r, n = world
    # every rank: its own entry in row r, and a shared entry at (0, 1)
    t = torch.sparse_coo_tensor(torch.tensor([[r, 0], [0, 1]]), torch.tensor([r + 1.0, 1.0]), (n, 2))
    work = tdist.all_reduce(t, async_op=async_op)
    if async_op:
        work.wait()
    assert t.is_sparse
    want = torch.zeros(n, 2)
    want[:, 0] = torch.arange(1.0, n + 1)
    want[0, 1] = float(n)
    assert torch.equal(t.to_dense(), want)


def test_all_reduce_sparse_other_op_is_refused(world):
    r, n = world
    t = torch.sparse_coo_tensor(torch.tensor([[0], [0]]), torch.tensor([1.0]), (1, 1))
    with pytest.raises(ValueError, match=rf"\[rank {r}/{n}\] all_reduce: sparse tensors are summed only"):
        tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
    ints = torch.sparse_coo_tensor(torch.tensor([[0], [0]]), torch.tensor([3]), (1, 1))
    with pytest.raises(ValueError, match=rf"\[rank {r}/{n}\] all_reduce: sparse tensors are summed only"):
        tdist.all_reduce(ints, op=tdist.ReduceOp.AVG)  # not summed silently
    assert ints.to_dense().item() == 3


# -- AVG of integer tensors ---------------------------------------------------------------------


def _int_avg(values: list, n: int) -> torch.Tensor:
    return torch.tensor(sum(values)).div(n, rounding_mode="trunc")


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8])
def test_all_reduce_avg_of_integers_is_ncclS(world, dtype):
    r, n = world
    a = (lambda k: 7 * k + 1) if dtype is torch.uint8 else (lambda k: -(5 * k + 2))  # noqa: E731
    t = torch.tensor([a(r), 3 * r + 1], dtype=dtype)
    tdist.all_reduce(t, op=tdist.ReduceOp.AVG)
    want = torch.stack([_int_avg([a(k) for k in range(n)], n), _int_avg([3 * k + 1 for k in range(n)], n)])
    assert torch.equal(t, want.to(dtype))
    w = tdist.all_reduce(t2 := torch.tensor([2 * r + 1], dtype=dtype), op=tdist.ReduceOp.AVG, async_op=True)
    w.wait()
    assert torch.equal(t2, _int_avg([2 * k + 1 for k in range(n)], n).reshape(1).to(dtype))


def test_reduce_and_reduce_scatter_avg_of_integers(world):
    r, n = world
    t = torch.tensor([4 * r + 3])
    tdist.reduce(t, dst=n - 1, op=tdist.ReduceOp.AVG)
    if r == n - 1:
        assert t.item() == _int_avg([4 * k + 3 for k in range(n)], n).item()
    out = torch.empty(1, dtype=torch.int64)
    reduce_scatter_single(out, torch.arange(n, dtype=torch.int64) * (r + 2), op=tdist.ReduceOp.AVG)
    assert out.item() == _int_avg([r * (k + 2) for k in range(n)], n).item()


def test_lightning_style_sync_dist_mean_of_an_int64_metric(world):
    """Lightning's ``_sync_ddp``: ``all_reduce(int64 tensor, op=ReduceOp.AVG)``."""
    r, n = world
    t = torch.tensor(10 * (r + 1), dtype=torch.int64)
    tdist.all_reduce(t, op=tdist.ReduceOp.AVG)
    assert t.item() == (10 * n * (n + 1) // 2) // n


# -- device types, async_save -------------------------------------------------------------------


def test_group_reports_cpu_and_async_save_takes_it(world, tmp_path):
    import torch.distributed.checkpoint as dcp

    r, n = world
    assert torch.device("cpu") in tdist.group.WORLD._device_types
    path = _same_dir(tmp_path)
    state = {"w": torch.arange(6.0) + 100 * r, "step": torch.tensor(r + 5)}
    fut = dcp.async_save({"model": {"w": state["w"]}}, checkpoint_id=os.path.join(path, "ckpt"))
    fut.result()
    loaded = {"model": {"w": torch.zeros(6)}}
    dcp.load(loaded, checkpoint_id=os.path.join(path, "ckpt"))
    assert torch.equal(loaded["model"]["w"], torch.arange(6.0))  # rank 0's (a replicated tensor is saved once)


# -- PREMUL_SUM with a one-element tensor ----------------------------------------------------------


def test_premul_sum_one_element_tensor_factor(world):
    r, n = world
    t = torch.full((3,), float(r + 1), dtype=torch.float64)
    op = tdist._make_nccl_premul_sum(torch.tensor([0.5], dtype=torch.float64))
    if TORCH < (2, 13):  # the factor is C++-only there (docs/torch.md, "Versions")
        with pytest.raises(ValueError, match="PREMUL_SUM needs torch >= 2.13"):
            tdist.all_reduce(t, op=op)
        return
    tdist.all_reduce(t, op=op)
    assert torch.equal(t, torch.full((3,), 0.5 * n * (n + 1) / 2, dtype=torch.float64))


# -- no FutureWarning from mpidist's own calls --------------------------------------------------------


def test_backend_calls_no_deprecated_mpidist_name(world):
    r, n = world
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        out = torch.empty(2 * n)
        all_gather_single(out, torch.full((2,), float(r)))  # torch's undeprecated names
        assert torch.equal(out, torch.arange(float(n)).repeat_interleave(2))
        small = torch.empty(2)
        reduce_scatter_single(small, torch.ones(2 * n))
        assert torch.equal(small, torch.full((2,), float(n)))


# -- profiler events -----------------------------------------------------------------------------


def _events(prof, name: str) -> list:
    return [e for e in prof.function_events if e.name == name]


@pytest.mark.parametrize("async_op", [False, True])
def test_profiler_records_each_collective(world, async_op):
    r, n = world
    t, out = torch.ones(10), torch.empty(4 * n)
    with torch.autograd.profiler.profile(record_shapes=True) as prof:
        works = [
            tdist.all_reduce(t, async_op=async_op),
            tdist.broadcast(t, src=0, async_op=async_op),
            tdist.all_gather_into_tensor(out, torch.ones(4), async_op=async_op),
        ]
        if async_op:
            for w in works:
                w.wait()
    assert torch.equal(t, torch.full((10,), float(n)))
    for name, shapes in [
        ("mpidist:all_reduce", [[10]]),
        ("mpidist:broadcast", [[10]]),
        ("mpidist:all_gather_into_tensor", [[4]]),
    ]:
        events = _events(prof, name)
        assert len(events) == 1, [e.name for e in prof.function_events]
        assert events[0].count == 1 and events[0].input_shapes == shapes and events[0].cpu_time >= 0
        if n > 1 and runtime.state().thread_multiple and _profile.OFF_THREAD:  # ended off the caller's thread
            assert events[0].is_async


def test_no_profiler_no_event_and_same_results(world):
    r, n = world
    t = torch.ones(3)
    tdist.all_reduce(t)
    assert torch.equal(t, torch.full((3,), float(n)))
    with torch.autograd.profiler.profile() as prof:
        pass
    assert not [e for e in prof.function_events if e.name.startswith("mpidist:")]


@pytest.mark.mpi(min_size=2)
def test_profiler_records_send_and_recv(world):
    r, n = world
    with torch.autograd.profiler.profile(record_shapes=True) as prof:
        if r == 0:
            for k in range(1, n):
                tdist.send(torch.full((3,), float(k)), dst=k)
        else:
            got = torch.empty(3)
            tdist.recv(got, src=0)
            assert torch.equal(got, torch.full((3,), float(r)))
    name = "mpidist:send" if r == 0 else "mpidist:recv"
    assert sum(e.count for e in _events(prof, name)) == (n - 1 if r == 0 else 1)
    assert all(e.input_shapes == [[3]] for e in _events(prof, name))
    assert re.match("mpidist:", name)
