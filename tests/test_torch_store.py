"""mpidist.torch.MPIStore, torch's Store served over MPI (mpidist/torch/store.py), across
ranks: blocking get, concurrent add, wait timeouts, compare_set races, bad input, keys of
different groups, and torch's own gloo over it (mpi://, a gloo group beside an mpidist
world, TORCH_DIST_INIT_BARRIER=1).

Runs serially (world size 1) and under mpiexec -n 2, 3, 4.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import timedelta

import pytest

torch = pytest.importorskip("torch")
tdist = pytest.importorskip("torch.distributed")

from mpi4py import MPI  # noqa: E402
from torch_helpers import torch_world  # noqa: E402

from mpidist.torch import MPIStore  # noqa: E402

pytestmark = [pytest.mark.launches, pytest.mark.mpi]

RANK, SIZE = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()


@pytest.fixture(scope="module")
def store():
    s = MPIStore(timedelta(seconds=30))
    yield s
    MPI.COMM_WORLD.Barrier()  # nobody asks rank 0's server any more
    s.close()


def _sync() -> None:
    MPI.COMM_WORLD.Barrier()


def test_set_then_blocking_get_across_ranks(store):
    store.set(f"k/{RANK}", f"v{RANK}")
    for r in range(SIZE):  # blocks until rank r has set it
        assert store.get(f"k/{r}") == f"v{r}".encode()
    late = "late/key"
    if RANK == SIZE - 1:
        time.sleep(0.4)
        store.set(late, b"\x00\xffbytes")
    t0 = time.monotonic()
    assert store.get(late) == b"\x00\xffbytes"
    if RANK == 0 and SIZE > 1:
        assert time.monotonic() - t0 >= 0.3  # it waited for the set
    _sync()


def test_concurrent_add_counts_every_increment(store):
    for _ in range(25):
        store.add("counter", 1)
    store.add("counter", 0)
    _sync()
    assert store.get("counter") == str(25 * SIZE).encode()
    _sync()


def test_compare_set_race_has_one_winner(store):
    held = store.compare_set("lock", "", f"rank{RANK}")
    _sync()
    winner = store.get("lock")
    assert held == winner and winner.startswith(b"rank")
    assert store.compare_set("lock", "not-it", "x") == winner  # unchanged when expected differs
    _sync()


def test_wait_times_out_naming_the_keys_and_the_store_survives(store):
    t0 = time.monotonic()
    with pytest.raises(
        tdist.DistStoreError,
        match=rf"\[rank {RANK}\] MPIStore.wait: no answer within the timeout "
        rf"of 0.3 s for keys \['never/a', 'never/b'\]",
    ):
        store.wait(["never/a", "never/b"], timedelta(seconds=0.3))
    assert 0.25 <= time.monotonic() - t0 < 5
    store.set(f"after/{RANK}", "ok")  # usable afterwards; a late answer to the wait is discarded
    store.wait([f"after/{r}" for r in range(SIZE)])
    assert store.check([f"after/{r}" for r in range(SIZE)]) and not store.check(["never/a"])
    _sync()


def test_get_of_a_key_never_set_raises_on_the_caller_only(store):
    if RANK == 0:
        store.set_timeout(timedelta(seconds=0.3))
        try:
            with pytest.raises(
                tdist.DistStoreError,
                match=r"MPIStore.get: .* for keys \['nobody/sets/this'\] "
                r"\(the keys were never set\)",
            ):
                store.get("nobody/sets/this")
        finally:
            store.set_timeout(timedelta(seconds=30))
    store.set(f"alive/{RANK}", "1")  # every other rank went on meanwhile
    store.wait([f"alive/{r}" for r in range(SIZE)])
    _sync()


def test_the_other_methods(store):
    if RANK == 0:
        store.set("d", "x")
        assert store.delete_key("d") is True and store.delete_key("d") is False
        store.append("ap", "ab")
        store.append("ap", b"cd")
        assert store.get("ap") == b"abcd"
        store.multi_set(["m1", "m2"], ["one", b"two"])
        assert store.multi_get(["m1", "m2"]) == [b"one", b"two"]
        assert store.num_keys() >= 4 and store.has_extended_api()
    _sync()
    assert store.multi_get(["m1", "m2"]) == [b"one", b"two"]
    _sync()


def test_keys_of_different_groups_never_collide(store):
    a, b = tdist.PrefixStore("group_a/", store), tdist.PrefixStore("group_b/", store)
    a.set(f"x{RANK}", "A")
    b.set(f"x{RANK}", "B")
    assert a.get(f"x{RANK}") == b"A" and b.get(f"x{RANK}") == b"B"
    assert a.add("n", 1) >= 1
    a.delete_key(f"x{RANK}")  # through torch's C++ side (deleteKey)
    assert not a.check([f"x{RANK}"]) and b.check([f"x{RANK}"])
    _sync()


def test_bad_input_is_a_clear_error(store):
    with pytest.raises(TypeError, match="MPIStore.set: key must be a str, got int"):
        store.set(1, "x")
    with pytest.raises(TypeError, match="MPIStore.set: value must be bytes or str, got float"):
        store.set("k", 1.5)
    with pytest.raises(TypeError, match="MPIStore.add: amount must be an int, got str"):
        store.add("k", "1")
    with pytest.raises(ValueError, match="MPIStore.multi_set: 2 keys but 1 values"):
        store.multi_set(["a", "b"], ["x"])
    store.set(f"text/{RANK}", "not a number")
    with pytest.raises(ValueError, match=rf"\[rank {RANK}\] MPIStore.add: ValueError: invalid literal for int"):
        store.add(f"text/{RANK}", 1)
    assert store.get(f"text/{RANK}") == b"not a number"  # the store survived its user's mistake
    _sync()


def test_gloo_group_beside_an_mpidist_world():
    with torch_world():
        gloo = tdist.new_group(backend="gloo")
        t = torch.full((2,), float(RANK))
        tdist.all_reduce(t, group=gloo)
        assert torch.equal(t, torch.full((2,), float(sum(range(SIZE)))))
        assert tdist.get_backend(gloo) == "gloo"
        b = torch.full((3,), float(RANK))
        tdist.broadcast(b, src=SIZE - 1, group=gloo)
        assert torch.equal(b, torch.full((3,), float(SIZE - 1)))
        parts = [torch.empty(1) for _ in range(SIZE)]
        tdist.all_gather(parts, torch.tensor([float(RANK)]), group=gloo)
        assert [p.item() for p in parts] == [float(r) for r in range(SIZE)]
        tdist.barrier(group=gloo)
        # a sub-group (every other rank) beside it, its keys under its own prefix of the store
        evens = list(range(0, SIZE, 2))
        sub = tdist.new_group(ranks=evens, backend="gloo")
        if RANK in evens:
            s = torch.ones(1)
            tdist.all_reduce(s, group=sub)
            assert s.item() == len(evens)
        tdist.destroy_process_group(sub)
        tdist.destroy_process_group(gloo)


def test_a_second_rendezvous_leaves_the_live_groups_store_open():
    """torch's stores from two rendezvous are independent: a second ``mpi://`` rendezvous
    while a default group exists leaves its store usable (a gloo group made afterwards meets
    in it); a store no group uses any more is closed by the next rendezvous."""
    from mpidist.torch import rendezvous  # noqa: PLC0415

    with torch_world():
        first = next(tdist.rendezvous("mpi://"))[0]  # a second rendezvous: a store of its own
        gloo = tdist.new_group(ranks=list(range(SIZE)), backend="gloo")
        t = torch.ones(1)
        tdist.all_reduce(t, group=gloo)
        assert t.item() == SIZE
        tdist.destroy_process_group(gloo)
        default = [s for s in rendezvous._stores if s is not first]
        assert default and not any(getattr(s, "_closed", False) for s in default)
    MPI.COMM_WORLD.Barrier()
    second = next(tdist.rendezvous("mpi://"))[0]  # the default group is gone: its store closes
    assert all(getattr(s, "_closed", True) for s in default) and getattr(first, "_closed", True)
    assert rendezvous._stores == [second]
    MPI.COMM_WORLD.Barrier()
    rendezvous.close_unused()
    assert rendezvous._stores == []


INIT_BARRIER = """
import torch, torch.distributed as dist
import mpidist.torch
dist.init_process_group(__BACKEND__)
t = torch.ones(1)
dist.all_reduce(t)
print(f"rank {dist.get_rank()} sum {t.item()} backend {dist.get_backend()}", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.parametrize("backend", ['"mpidist"', '"gloo", init_method="mpi://"'])
def test_torch_dist_init_barrier(tmp_path, backend):
    """TORCH_DIST_INIT_BARRIER=1: torch's store-based barrier after init, on the store over MPI."""
    if SIZE > 1:
        pytest.skip("starts its own job; runs in the serial pass")
    from conftest import launcher_free_env

    script = tmp_path / "job.py"
    script.write_text(INIT_BARRIER.replace("__BACKEND__", backend))
    env = launcher_free_env(OMP_NUM_THREADS="1", TORCH_DIST_INIT_BARRIER="1")
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    proc = subprocess.run(
        [mpiexec, "-n", "3", sys.executable, "-m", "mpidist", str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    name = "gloo" if "gloo" in backend else "mpidist"
    for r in range(3):
        assert f"rank {r} sum 3.0 backend {name}" in proc.stdout, proc.stdout + proc.stderr
