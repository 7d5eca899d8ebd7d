"""torch's default group and mpidist's runtime in one process, in either order.

* mpidist initialized first: torch's group runs on it and leaves it running when torch
  destroys its groups.
* torch first: its default group starts mpidist's runtime (torch's timeout becomes
  mpidist's), mpidist's own API works on it, and destroying torch's group stops it, so
  init/destroy/init works in one process.

Runs serially and under mpiexec -n 2, 3, 4.
"""

from __future__ import annotations

import datetime

import pytest

torch = pytest.importorskip("torch")
tdist = pytest.importorskip("torch.distributed")

import mpidist  # noqa: E402
import mpidist.torch  # noqa: E402, F401
from mpidist._core import recorder  # noqa: E402

pytestmark = pytest.mark.mpi


@pytest.fixture(autouse=True)
def no_torch_group():
    if tdist.is_initialized():
        tdist.destroy_process_group()
    yield
    if tdist.is_initialized():
        tdist.destroy_process_group()


def test_torch_on_an_initialized_mpidist_leaves_it_running():
    if not mpidist.is_initialized():
        mpidist.init_process_group()
    world = mpidist.group.WORLD
    tdist.init_process_group("mpidist")
    assert tdist.group.WORLD.mpidist_group is world
    t = torch.ones(3)
    tdist.all_reduce(t)
    assert t[0].item() == mpidist.get_world_size()
    sub = tdist.new_group(list(range(tdist.get_world_size())))
    tdist.destroy_process_group()
    assert mpidist.is_initialized() and mpidist.group.WORLD is world and world.comm is not None
    assert sub.mpidist_group.destroyed  # torch's sub-groups are freed with torch's world
    x = t.numpy().copy()
    mpidist.all_reduce(x)
    assert x[0] == mpidist.get_world_size() ** 2


def test_torch_starts_and_stops_mpidist_and_init_again():
    if mpidist.is_initialized():
        mpidist.destroy_process_group()
    for seconds in (123, 77):
        tdist.init_process_group("mpidist", timeout=datetime.timedelta(seconds=seconds))
        assert mpidist.is_initialized() and recorder.timeout == seconds
        assert mpidist.group.WORLD.group_name == "default_pg"
        x = torch.ones(2).numpy()
        mpidist.all_reduce(x)  # mpidist's API on the runtime torch started
        assert x[0] == tdist.get_world_size()
        keep = tdist.group.WORLD
        tdist.destroy_process_group()
        assert not mpidist.is_initialized()
        with pytest.raises(ValueError):
            keep.allreduce([torch.ones(1)])  # a destroyed group: a clear error, no hang


def test_sub_group_needs_mpidist_initialized():
    from mpidist.torch import _backend  # noqa: PLC0415

    if mpidist.is_initialized():
        mpidist.destroy_process_group()

    class Opts:
        global_ranks_in_group, group_rank, group_size, group_id, timeout = [0], 0, 1, "9", None

    with pytest.raises(RuntimeError, match="not initialized"):
        _backend.create(Opts())


def test_mpi_init_method_gives_torchs_gloo_mpis_ranks():
    """mpi:// with torch's own gloo: ranks from MPI, the store served over MPI (no
    MASTER_ADDR), gloo's own collectives across every rank."""
    from mpi4py import MPI  # noqa: PLC0415

    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    tdist.init_process_group("gloo", init_method="mpi://")
    try:
        assert (tdist.get_rank(), tdist.get_world_size(), tdist.get_backend()) == (rank, size, "gloo")
        t = torch.full((3,), float(rank + 1))
        tdist.all_reduce(t)
        assert torch.equal(t, torch.full((3,), size * (size + 1) / 2))
    finally:
        tdist.destroy_process_group()
    assert not tdist.is_initialized()
