"""torch.compile over backend "mpidist" (docs/torch.md, "torch.compile"): a compiled DDP
model trains to eager DDP's parameters with Dynamo's aot_eager and inductor backends, over
"mpidist" as over a gloo group of the same ranks (and to the same parameters on both), and
compiled code that calls a c10d collective runs it. torch's C++ calls mpidist's Python (DDP's
broadcasts, Work.wait, future callbacks) while a compiled frame is active; every mpidist
function is behind the Dynamo fence (mpidist/torch/_dynamo_fence.py), so Dynamo neither
compiles those frames nor inlines them. Runs serially and under mpiexec -n 2, 3, 4.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
tdist = pytest.importorskip("torch.distributed")

from torch_helpers import assert_compiled_broadcast, assert_compiled_ddp_matches_eager, torch_world  # noqa: E402

from mpidist.torch import _dynamo_fence  # noqa: E402

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module", autouse=True)
def world():
    with torch_world():
        yield tdist.get_rank()


@pytest.fixture(scope="module")
def gloo(world):
    """A gloo group of every rank (its store: mpidist's, over MPI)."""
    return tdist.new_group(backend="gloo")


@pytest.mark.parametrize("compile_backend", ["aot_eager", "inductor"])
def test_compiled_ddp_matches_eager(world, gloo, compile_backend):
    """On both backends compiled DDP trains to eager DDP's parameters, and mpidist's compiled
    run to gloo's (float64; the sums' order may differ beyond 2 ranks: rtol 1e-9)."""
    ours = assert_compiled_ddp_matches_eager(world, "cpu", compile_backend)
    theirs = assert_compiled_ddp_matches_eager(world, "cpu", compile_backend, group=gloo)
    for got, want in zip(ours, theirs):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


def test_compiled_broadcast(world):
    assert_compiled_broadcast(world, "cpu")


def test_every_entry_point_is_fenced():
    """What torch's C++ calls (the group's ops, the Work's methods, the store's) and what
    those call (the op, the check, the recorder) are behind the fence."""
    import mpidist._check.mismatch
    import mpidist.work

    for fn in (
        mpidist.torch.ProcessGroupMpidist.broadcast,
        mpidist.torch.ProcessGroupMpidist.allreduce,
        mpidist.torch.TorchWork.wait,
        mpidist.torch.TorchWork.get_future,
        mpidist.torch.MPIStore.get,
        mpidist.all_reduce,
        mpidist.work.Work.wait,
    ):
        assert _dynamo_fence.fenced(fn), fn
        assert getattr(fn, "_torchdynamo_disable", False), fn
    assert any(_dynamo_fence.fenced(f) for f in vars(mpidist._check.mismatch).values() if callable(f))
