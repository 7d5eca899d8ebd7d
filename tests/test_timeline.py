"""MPIDIST_TIMELINE: a Chrome-trace JSON per rank of DDP's steps (Horovod's Timeline)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import launcher_free_env

from mpidist.nn import CrossEntropyLoss, Linear, ReLU, Sequential
from mpidist.parallel import DistributedDataParallel
from mpidist.parallel.comm_hooks import allreduce_hook
from mpidist.parallel.timeline import ENV_VAR, timeline_path

pytestmark = pytest.mark.launches  # starts MPI jobs or processes of its own: make test-mpis runs it on every MPI

D_IN, HIDDEN, CLASSES = 6, 8, 3


def mlp() -> Sequential:
    rng = np.random.default_rng(0)
    return Sequential(Linear(D_IN, HIDDEN, rng=rng), ReLU(), Linear(HIDDEN, CLASSES, rng=rng))


def step(ddp, rank: int, seed: int = 0) -> None:
    rng = np.random.default_rng([seed, rank])
    crit = CrossEntropyLoss()
    crit(ddp(rng.standard_normal((4, D_IN)).astype(np.float32)), rng.integers(0, CLASSES, size=4))
    ddp.backward(crit.backward())


def load(path) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def names(trace: dict, ph: str) -> list:
    return [e["name"] for e in trace["traceEvents"] if e["ph"] == ph]


@pytest.mark.mpi
def test_timeline_is_off_by_default(dist, monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    model = mlp()
    ddp = DistributedDataParallel(model)
    assert ddp._timeline is None and ddp.reducer.timeline is None
    assert "backward" not in model[0].__dict__  # layers are not wrapped


@pytest.mark.mpi
@pytest.mark.parametrize("hook", [None, allreduce_hook])
def test_timeline_is_valid_chrome_trace_after_every_step(dist, world, tmp_path, monkeypatch, hook):
    rank, _ = world
    template = str(tmp_path / "trace-{rank}.json")
    monkeypatch.setenv(ENV_VAR, template)
    ddp = DistributedDataParallel(mlp(), bucket_cap_mb=1e-9)
    if hook is not None:
        ddp.register_comm_hook(None, hook)
    path = tmp_path / f"trace-{rank}.json"
    assert timeline_path(template, rank) == str(path)
    n_buckets = len(ddp.bucket_sizes)
    try:
        for k in (1, 2):
            step(ddp, rank, seed=k)
            trace = load(path)  # valid JSON after each step's flush
            complete = names(trace, "X")
            assert complete.count("forward") == k and complete.count("backward") == k
            assert complete.count("synchronize") == k
            for layer in ("0", "1", "2"):
                assert complete.count(f"forward:{layer}") == k and complete.count(f"backward:{layer}") == k
            assert complete.count("allreduce") == k * n_buckets
            assert names(trace, "i").count("bucket_ready") == k * n_buckets
    finally:
        ddp._timeline.close()
    events = load(path)["traceEvents"]
    assert {e["pid"] for e in events} == {rank}
    assert all(e["dur"] >= 0 for e in events if e["ph"] == "X")
    reductions = [e for e in events if e["name"] == "allreduce"]
    assert sorted({e["args"]["bucket"] for e in reductions}) == list(range(n_buckets))
    assert {e["args"]["hook"] for e in reductions} == {"builtin" if hook is None else "allreduce_hook"}
    thread_names = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert {"step", "layers", "bucket 0"} <= thread_names
    # the last layer's bucket is launched before the first layer's backward starts
    first_layer = min(e["ts"] for e in events if e["name"] == "backward:0")
    last_bucket = min(e["ts"] for e in events if e["name"] == "allreduce" and e["args"]["bucket"] == 0)
    assert last_bucket <= first_layer


@pytest.mark.mpi(min_size=2)
def test_timeline_records_join_shadowing(dist, world, tmp_path, monkeypatch):
    rank, _ = world
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "join"))
    ddp = DistributedDataParallel(mlp())
    try:
        with ddp.join():
            for k in range(1 + rank):
                step(ddp, rank, seed=k)
    finally:
        ddp._timeline.close()
    shadows = names(load(tmp_path / f"join.rank{rank}.json"), "X").count("join_shadow")
    assert shadows == dist.get_world_size() - 1 - rank


def test_timeline_is_flushed_at_process_exit(tmp_path):
    """A forward without backward is only written by the exit flush."""
    script = textwrap.dedent("""
        import numpy as np, mpidist
        from mpidist.nn import Linear
        from mpidist.parallel import DistributedDataParallel
        mpidist.init_process_group("mpi")
        ddp = DistributedDataParallel(Linear(3, 2, rng=0))
        ddp(np.ones((1, 3), np.float32))
    """)
    env = launcher_free_env(**{ENV_VAR: str(tmp_path / "exit.{rank}.json")})
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120, env=env)
    assert names(load(tmp_path / "exit.0.json"), "X") == ["forward"]
