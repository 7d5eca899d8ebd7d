"""The flight recorder: what each op records, sequence numbers that agree across members,
dumps, and ``python -m mpidist.tools.trace`` lining the ranks up."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile

import numpy as np
import pytest
from conftest import launcher_free_env
from mpi4py import MPI

from mpidist._core import recorder
from mpidist.tools import trace

pytestmark = pytest.mark.launches  # starts MPI jobs or processes of its own: make test-mpis runs it on every MPI


def recent(key: str, n: int) -> list[dict]:
    return [e for e in recorder.snapshot() if e["group_key"] == key][-n:]


@pytest.mark.mpi
def test_collectives_are_recorded_and_numbered_alike_on_every_member(dist, any_group):
    g, members = any_group
    rank = dist.get_rank()
    last = recorder._ring[-1] if recorder._ring else None
    x, out = np.arange(4.0), np.zeros(4 * len(members))
    if rank not in members:  # non-members: every op is a no-op, nothing is recorded
        assert dist.all_reduce(x, group=g) is None and dist.barrier(group=g) is None
        assert (recorder._ring[-1] if recorder._ring else None) is last
        MPI.COMM_WORLD.allgather(None)
        return
    pg = dist._runtime.world.resolve_group(g)
    key, first = recorder.group_key(pg), pg.engine.seq
    dist.all_reduce(x, group=g)
    dist.broadcast(x, src=members[-1], group=g)
    dist.barrier(group=g)
    dist.all_gather_into_tensor(out, x, group=g)
    work = dist.all_reduce(x.astype(np.float32), op=dist.ReduceOp.MAX, group=g, async_op=True)
    work.wait()
    got = recent(key, 5)
    assert [(e["op"], e["seq"], e["state"]) for e in got] == [
        ("all_reduce", first, "completed"),
        ("broadcast", first + 1, "completed"),
        ("barrier", first + 2, "completed"),
        ("all_gather_into_tensor", first + 3, "completed"),
        ("all_reduce", first + 4, "completed"),
    ]
    assert [(e["shapes"], e["dtype"], e["root"]) for e in got] == [
        ([4], "float64", -1),
        ([4], "float64", members[-1]),
        (None, None, -1),
        ([4], "float64", -1),
        ([4], "float32", -1),
    ]
    assert all(e["issued"] <= e["started"] <= e["ended"] and e["duration_s"] >= 0 for e in got)
    assert all(e["group_ranks"] == members and not e["p2p"] for e in got)
    # every member holds the same key and numbers for this group
    seen = MPI.COMM_WORLD.allgather((key, tuple(e["seq"] for e in got)))
    assert {seen[r] for r in members} == {(key, tuple(range(first, first + 5)))}


@pytest.mark.mpi(min_size=2)
def test_point_to_point_is_recorded_with_its_peer(dist, world):
    rank, _ = world
    g = dist._runtime.world.state().world
    if rank == 0:
        dist.send(np.ones(3), 1)
        dist.isend(np.ones(2, np.int32), 1, tag=5).wait()
        got = recent("world", 2)
        assert [(e["op"], e["peer"], e["shapes"], e["dtype"], e["p2p"], e["state"]) for e in got] == [
            ("send", 1, [3], "float64", True, "completed"),
            ("isend", 1, [2], "int32", True, "completed"),
        ]
    elif rank == 1:
        dist.recv(np.zeros(3), None)
        w = dist.irecv(np.zeros(2, np.int32), 0, tag=5)
        w.wait()
        got = recent("world", 2)
        assert [(e["op"], e["peer"], e["state"]) for e in got] == [("recv", -1, "completed"), ("irecv", 0, "completed")]
    assert g.engine.p2p_seq >= (2 if rank < 2 else 0)
    dist.barrier()


@pytest.mark.mpi
def test_dump_writes_every_rank_and_trace_lines_them_up(dist, world, monkeypatch):
    rank, size = world
    directory = MPI.COMM_WORLD.bcast(tempfile.mkdtemp(prefix="mpidist-rec-") if rank == 0 else None, 0)
    monkeypatch.setattr(recorder, "_dir", directory)
    g = dist.new_group()
    key = recorder.group_key(g)
    for i in range(3):
        dist.all_reduce(np.full(2, float(i)), group=g)
    dist.broadcast(np.zeros(5, np.int64), src=size - 1, group=g)
    path = recorder.dump("test")
    assert path == f"{directory}/rank{rank}.json"
    doc = json.loads(open(path).read())
    assert (doc["rank"], doc["world_size"], doc["reason"]) == (rank, size, "test")
    mine = next(x for x in doc["groups"] if x["key"] == key)
    assert mine["issued"] == 4 and mine["ranks"] == list(range(size))
    assert [e["op"] for e in doc["entries"] if e["group_key"] == key] == ["all_reduce"] * 3 + ["broadcast"]
    dist.barrier()
    if rank == 0:
        docs = trace.load(directory)
        assert sorted(docs) == list(range(size))
        only = {
            r: {
                **d,
                "entries": [e for e in d["entries"] if e["group_key"] == key],
                "groups": [x for x in d["groups"] if x["key"] == key],
            }
            for r, d in docs.items()
        }
        assert trace.analyse(only) == []
        report = trace.render(only, [])
        assert f"  3     broadcast(int64, root {size - 1}) (5,) completed" in report
        assert report.endswith("verdict: no divergence found: every rank issued the same collectives in the same order")
    dist.barrier()
    dist.destroy_process_group(g)


# -- the trace tool on hand-made dumps ---------------------------------------------------------


def entry(
    seq: int,
    op: str = "all_reduce",
    state: str = "completed",
    root: int = -1,
    dtype: str = "float32",
    key: str = "world",
    group: str = "default_pg",
    ranks=(0, 1, 2),
) -> dict:
    return {
        "seq": seq,
        "op": op,
        "p2p": False,
        "group": group,
        "group_key": key,
        "group_ranks": list(ranks),
        "shapes": [4],
        "dtype": dtype,
        "root": root,
        "issued": 1.0,
        "started": 1.0,
        "ended": None if state == "started" else 2.0,
        "duration_s": None,
        "state": state,
        "timeout_s": 1800.0,
        "info": None,
    }


def write_dumps(directory, per_rank: dict) -> None:
    for rank, entries in per_rank.items():
        issued = max([e["seq"] + 1 for e in entries if e["group_key"] == "world"], default=0)
        doc = {
            "rank": rank,
            "world_size": len(per_rank),
            "pid": 100 + rank,
            "host": "h",
            "reason": "timeout",
            "time": 0.0,
            "timeout_s": 1800.0,
            "buffer": 2048,
            "entries": entries,
            "groups": [{"key": "world", "name": "default_pg", "ranks": [0, 1, 2], "issued": issued, "current": None}],
        }
        (directory / f"rank{rank}.json").write_text(json.dumps(doc))


def run_trace(directory) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mpidist.tools.trace", str(directory)],
        capture_output=True,
        text=True,
        timeout=60,
        env=launcher_free_env(),
    )


def test_trace_finds_the_rank_that_never_arrived(tmp_path):
    done = [entry(0), entry(1, "broadcast", root=0)]
    write_dumps(tmp_path, {0: done + [entry(2, state="started")], 1: done, 2: done + [entry(2, state="started")]})
    out = run_trace(tmp_path)
    assert out.returncode == 1, out.stderr
    lines = out.stdout.splitlines()
    row = next(line for line in lines if line.endswith("<== diverges here"))
    assert row.split() == [
        "2",
        "all_reduce(float32)",
        "(4,)",
        "started",
        "-",
        "all_reduce(float32)",
        "(4,)",
        "started",
        "<==",
        "diverges",
        "here",
    ]
    assert lines[-2] == (
        "  group 'default_pg' (ranks [0, 1, 2]) sequence number 2: rank(s) [1] had not arrived "
        "(rank 1 issued 2 collectives on this group, latest op: broadcast #1 on group "
        "'default_pg' (completed)); the others called all_reduce(float32)"
    )
    assert lines[-1] == (
        "verdict: rank(s) [1] diverged first, on group 'default_pg' at sequence number 2 (not arrived)"
    )


def test_trace_finds_mismatched_ops_dtypes_and_roots(tmp_path):
    cases = [
        (entry(1), entry(1, "broadcast", root=0), "all_reduce(float32)", "broadcast(float32, root 0)"),
        (entry(1), entry(1, dtype="float64"), "all_reduce(float32)", "all_reduce(float64)"),
        (
            entry(1, "broadcast", root=0),
            entry(1, "broadcast", root=2),
            "broadcast(float32, root 0)",
            "broadcast(float32, root 2)",
        ),
    ]
    for right, wrong, right_text, wrong_text in cases:
        write_dumps(tmp_path, {0: [entry(0), right], 1: [entry(0), right], 2: [entry(0), wrong]})
        found = trace.analyse(trace.load(str(tmp_path)))
        assert [(f["kind"], f["ranks"], f["seq"]) for f in found] == [("mismatch", [2], 1)]
        assert found[0]["text"] == (
            f"group 'default_pg' (ranks [0, 1, 2]) sequence number 1: mismatched "
            f"collectives: rank(s) [0, 1] called {right_text}; rank(s) [2] called {wrong_text}"
        )


def test_trace_without_divergence_and_without_dumps(tmp_path):
    write_dumps(tmp_path, {r: [entry(0), entry(1)] for r in range(3)})
    out = run_trace(tmp_path)
    assert out.returncode == 0 and out.stdout.splitlines()[-1].startswith("verdict: no divergence found")
    out = run_trace(tmp_path / "empty")
    assert out.returncode == 2 and "no flight recorder dumps (rank<r>.json) in" in out.stderr


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm, count", [(None, 2), (None, 1 << 16), ("shm", 1 << 14), ("ring", 1 << 14)])
def test_the_all_reduce_latency_path_records_what_launch_records(dist, world, monkeypatch, algorithm, count):
    """A blocking all_reduce of a numpy array its members agreed on runs on the inline path at
    every size (MPI_Allreduce below the shared-memory sizes, the plan's body above: no
    launch) and builds its recorder entry there (no function call): it must hold what
    recorder.begin/end make for the same op through _dispatch.launch."""
    from mpidist._backends.mpi import collectives

    g = dist._runtime.world.resolve_group(None)
    x = np.ones(count, dtype=np.float32)
    dist.all_reduce(x, algorithm=algorithm)  # makes the plan and agrees on the call: the next is inline
    assert (collectives._PLANS[(x.dtype, dist.ReduceOp.SUM._value_, algorithm)][3] > x.nbytes) == (count == 2)
    before = g.engine.seq
    with monkeypatch.context() as m:
        m.setattr(collectives, "launch", None)  # (a call through launch raises TypeError)
        dist.all_reduce(x, algorithm=algorithm)  # the inline path
    inline = list(recorder._ring[-1])
    dist.all_reduce(x, async_op=True, algorithm=algorithm).wait()  # through launch: R.begin / R.end
    launched = list(recorder._ring[-1])
    assert g.engine.seq == before + 2 and (inline[recorder.SEQ], launched[recorder.SEQ]) == (before, before + 1)
    times = {recorder.T_ISSUE, recorder.T_START, recorder.T_END, recorder.SEQ}
    assert len(inline) == len(launched)
    assert [v for i, v in enumerate(inline) if i not in times] == [v for i, v in enumerate(launched) if i not in times]
    assert inline[recorder.STATE] == recorder.COMPLETED and inline[recorder.OP] == "all_reduce"
    assert inline[recorder.T_ISSUE] <= inline[recorder.T_END] <= launched[recorder.T_ISSUE]
    assert x.tolist() == [world[1] ** 3] * count


def test_zero_length_buffer_keeps_no_history():
    code = (
        "import numpy as np, mpidist\nmpidist.init_process_group()\nmpidist.all_reduce(np.ones(2))\n"
        "print(len(mpidist._core.recorder.snapshot()), mpidist._runtime.world.state().world.engine.seq)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env=launcher_free_env(MPIDIST_TRACE_BUFFER="0"),
    )
    assert out.stdout == "0 1\n", out.stderr
