"""DistributedDataParallel's torch features, each against a one-process computation.

Every rank regenerates every rank's batches from seeds, so the reference (one model
trained on what all ranks saw, gradients averaged by hand) is computed independently on
each rank. float64 models: DDP and the reference differ only by summation order, hence
rtol 1e-6.
"""

from __future__ import annotations

import inspect
import re
import warnings

import numpy as np
import pytest
from mpi4py import MPI

import mpidist.parallel.reducer
from mpidist.nn import CrossEntropyLoss, Linear, Module, ReLU, Sequential, consume_prefix_in_state_dict_if_present
from mpidist.optim import SGD
from mpidist.parallel import DistributedDataParallel

pytestmark = pytest.mark.mpi

D_IN, HIDDEN, CLASSES, BATCH = 6, 16, 4, 3
RTOL, ATOL = 1e-6, 1e-12


def mlp(seed: int) -> Sequential:
    rng = np.random.default_rng(seed)
    return Sequential(
        Linear(D_IN, HIDDEN, dtype=np.float64, rng=rng),
        ReLU(),
        Linear(HIDDEN, HIDDEN, dtype=np.float64, rng=rng),
        ReLU(),
        Linear(HIDDEN, CLASSES, dtype=np.float64, rng=rng),
    )


def batch(step: int, rank: int, tag: int = 0):
    """Rank ``rank``'s batch at ``step``: any rank can regenerate it."""
    rng = np.random.default_rng([tag, step, rank])
    return rng.standard_normal((BATCH, D_IN)), rng.integers(0, CLASSES, size=BATCH)


class TwoHeads(Module):
    """A trunk and two heads; ``forward(x, use_b)`` uses one head, so the other gets no gradient."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        rng = np.random.default_rng(seed)
        self.trunk = Linear(D_IN, HIDDEN, dtype=np.float64, rng=rng)
        self.relu = ReLU()
        self.head_a = Linear(HIDDEN, CLASSES, dtype=np.float64, rng=rng)
        self.head_b = Linear(HIDDEN, CLASSES, dtype=np.float64, rng=rng)
        self._head = self.head_a

    def forward(self, x, use_b: bool):
        object.__setattr__(self, "_head", self.head_b if use_b else self.head_a)
        return self._head(self.relu(self.trunk(x)))

    def backward(self, grad):
        return self.trunk.backward(self.relu.backward(self._head.backward(grad)))


class RunningMean(Module):
    """A linear layer plus a buffer tracking the inputs' running mean (updated in forward)."""

    def __init__(self, seed: int, start: float = 0.0) -> None:
        super().__init__()
        self.lin = Linear(D_IN, CLASSES, dtype=np.float64, rng=seed)
        self.register_buffer("running_mean", np.full(D_IN, start))

    def forward(self, x):
        self.running_mean[...] = 0.5 * self.running_mean + 0.5 * x.mean(axis=0)
        return self.lin(x)

    def backward(self, grad):
        return self.lin.backward(grad)


def reference_step(ref, opt, crit, batches, divisor, **forward_kw) -> None:
    """One SGD step of ``ref`` on the gradient sum over ``batches`` divided by ``divisor``.

    ``batches``: (x, y, forward kwargs) per contributing rank. Parameters no batch
    reaches keep ``grad None``, so SGD skips them (torch semantics).
    """
    opt.zero_grad()
    for x, y, kw in batches:
        crit(ref(x, **kw), y)
        ref.backward(crit.backward())
    for p in ref.parameters():
        if p.grad is not None:
            p.grad /= divisor
    opt.step()


def assert_same_model(model, ref) -> None:
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        np.testing.assert_allclose(p.data, q.data, rtol=RTOL, atol=ATOL, err_msg=name)
    flat = b"".join(p.data.tobytes() for p in model.parameters())
    assert len(set(MPI.COMM_WORLD.allgather(flat))) == 1, "ranks' parameters differ"


# -- constructor -----------------------------------------------------------------------------
#: torch 2.13's DistributedDataParallel.__init__ parameters, in order (torch/nn/parallel/distributed.py)
TORCH_2_13_ARGS = [
    "module",
    "device_ids",
    "output_device",
    "dim",
    "broadcast_buffers",
    "init_sync",
    "process_group",
    "bucket_cap_mb",
    "find_unused_parameters",
    "check_reduction",
    "gradient_as_bucket_view",
    "static_graph",
    "delay_all_reduce_named_params",
    "param_to_hook_all_reduce",
    "mixed_precision",
    "device_mesh",
    "skip_all_reduce_unused_params",
    "bucket_cap_mb_list",
    "batched_grad_copy",
    "forward_sync_buffers",
]
TORCH_2_13_DEFAULTS = {
    "device_ids": None,
    "output_device": None,
    "dim": 0,
    "broadcast_buffers": None,
    "init_sync": True,
    "process_group": None,
    "bucket_cap_mb": None,
    "find_unused_parameters": False,
    "check_reduction": False,
    "gradient_as_bucket_view": False,
    "static_graph": False,
    "delay_all_reduce_named_params": None,
    "param_to_hook_all_reduce": None,
    "mixed_precision": None,
    "device_mesh": None,
    "skip_all_reduce_unused_params": False,
    "bucket_cap_mb_list": None,
    "batched_grad_copy": False,
    "forward_sync_buffers": None,
}


def test_constructor_has_torch_2_13_signature(dist):
    params = list(inspect.signature(DistributedDataParallel.__init__).parameters.values())[1:]
    positional = [p for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert [p.name for p in positional] == TORCH_2_13_ARGS
    assert {p.name: p.default for p in positional[1:]} == TORCH_2_13_DEFAULTS
    assert [p.name for p in params if p.kind is p.KEYWORD_ONLY] == ["algorithm"]


def test_constructor_takes_torch_arguments_positionally(dist, world):
    with pytest.warns(FutureWarning, match=r"`broadcast_buffers` is deprecated. Use `forward_sync_buffers`"):
        ddp = DistributedDataParallel(mlp(1), None, None, 0, True, True, None, None, False, False, False, False)
    assert (ddp.device_ids, ddp.output_device, ddp.dim) == (None, None, 0)
    assert ddp.broadcast_buffers and ddp.forward_sync_buffers
    assert not ddp.find_unused_parameters and not ddp.static_graph
    assert ddp.bucket_bytes_cap == 25 * 2**20 and ddp.bucket_bytes_cap_default and ddp.bucket_bytes_cap_list == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ddp = DistributedDataParallel(mlp(1), device_ids=[], bucket_cap_mb=1, batched_grad_copy=True)
    assert ddp.forward_sync_buffers and ddp.batched_grad_copy


@pytest.mark.mpi(min_size=2)
def test_init_sync_false_does_not_communicate_at_construction(dist, world):
    rank, _ = world
    model = mlp(100 + rank)
    mine = [p.data.copy() for p in model.parameters()]
    DistributedDataParallel(model, init_sync=False)
    assert all(np.array_equal(p.data, m) for p, m in zip(model.parameters(), mine))  # not rank 0's
    # no shape check either: differing models are the caller's promise to keep (torch)
    other = Sequential(Linear(D_IN + rank, CLASSES, dtype=np.float64, rng=0))
    DistributedDataParallel(other, init_sync=False)
    DistributedDataParallel(model)  # init_sync=True: rank 0's weights everywhere
    assert_same_model(model, mlp(100))


@pytest.mark.parametrize(
    "kwargs, init_synced, forward_synced, warning",
    [
        ({}, True, True, None),
        ({"forward_sync_buffers": False}, True, False, None),
        ({"broadcast_buffers": False}, False, False, r"`broadcast_buffers` is deprecated"),
        (
            {"broadcast_buffers": False, "forward_sync_buffers": True},
            True,
            True,
            r"Both `broadcast_buffers` and `forward_sync_buffers` were specified",
        ),
    ],
)
def test_forward_sync_buffers_and_the_deprecated_broadcast_buffers(
    dist, world, kwargs, init_synced, forward_synced, warning
):
    """torch 2.13: forward_sync_buffers governs the per-forward broadcast only (buffers are
    synced at init whatever its value); the deprecated broadcast_buffers=False also skips the
    init sync; given both, broadcast_buffers is ignored."""
    rank, _ = world
    model = RunningMean(0, start=float(rank))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ddp = DistributedDataParallel(model, **kwargs)
    found = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    assert (warning is None and not found) or (len(found) == 1 and re.search(warning, found[0])), found
    assert ddp.forward_sync_buffers is forward_synced and ddp.broadcast_buffers is forward_synced
    np.testing.assert_array_equal(model.running_mean, 0.0 if init_synced else float(rank))
    model.running_mean[...] = rank + 1
    x, y = batch(0, rank)
    before = model.running_mean.copy() if not forward_synced else np.ones(D_IN)
    crit = CrossEntropyLoss()
    crit(ddp(x), y)
    ddp.backward(crit.backward())
    np.testing.assert_allclose(model.running_mean, 0.5 * before + 0.5 * x.mean(axis=0), rtol=1e-12)
    ddp.broadcast_buffers = not forward_synced  # the deprecated attribute writes forward_sync_buffers
    assert ddp.forward_sync_buffers is not forward_synced


class _Mesh:
    """A stand-in for a DeviceMesh: DDP only needs ndim and get_group(mesh_dim=0)."""

    def __init__(self, ndim, group=None):
        self.ndim, self.group = ndim, group

    def get_group(self, mesh_dim=0):
        assert mesh_dim == 0
        return self.group


def test_torch_arguments_mpidist_lacks_are_refused_clearly_and_device_mesh_is_taken(dist):
    with pytest.raises(
        NotImplementedError,
        match=r"delay_all_reduce_named_params / param_to_hook_all_reduce "
        r"are not supported: mpidist's Reducer has no delayed all-reduce",
    ):
        DistributedDataParallel(mlp(0), delay_all_reduce_named_params=[], param_to_hook_all_reduce=object())
    with pytest.raises(
        ValueError,
        match=r"delay_all_reduce_named_params and param_to_hook_all_reduce need to be "
        r"set at the same time",
    ):
        DistributedDataParallel(mlp(0), delay_all_reduce_named_params=[])
    with pytest.raises(NotImplementedError, match=r"mixed_precision is not supported: .*fp16_compress_hook"):
        DistributedDataParallel(mlp(0), mixed_precision=object())
    with pytest.raises(RuntimeError, match=r"Cannot specify both process_group and device_mesh arguments"):
        DistributedDataParallel(mlp(0), process_group=dist.group.WORLD, device_mesh=_Mesh(1, dist.group.WORLD))
    with pytest.raises(RuntimeError, match=r"Only 1D device mesh is supported"):
        DistributedDataParallel(mlp(0), device_mesh=_Mesh(2))
    with pytest.raises(TypeError, match=r"device_mesh must be a DeviceMesh \(with ndim and get_group\), got int"):
        DistributedDataParallel(mlp(0), device_mesh=3)
    ddp = DistributedDataParallel(mlp(0), device_mesh=_Mesh(1, dist.group.WORLD))
    assert ddp.process_group is dist.group.WORLD and ddp.device_mesh.ndim == 1
    for bad in ([0.5, 0], [-1], "25", [True]):
        with pytest.raises(ValueError, match=r"bucket_cap_mb_list must be a list of sizes in MiB, each > 0"):
            DistributedDataParallel(mlp(0), bucket_cap_mb_list=bad)
    with pytest.raises(TypeError, match=r"init_sync must be a bool, got NoneType"):
        DistributedDataParallel(mlp(0), init_sync=None)
    with pytest.raises(TypeError, match=r"skip_all_reduce_unused_params must be a bool, got int"):
        DistributedDataParallel(mlp(0), skip_all_reduce_unused_params=1)


def test_check_reduction_is_accepted_with_a_future_warning(dist):
    with pytest.warns(FutureWarning, match="check_reduction.*deprecated"):
        DistributedDataParallel(mlp(0), check_reduction=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DistributedDataParallel(mlp(0), check_reduction=False)


def test_bad_arguments_raise_clear_errors(dist):
    with pytest.raises(
        ValueError,
        match=r"device_ids must be None \(or \[\]\) for a module on host \(numpy\) "
        r"arrays, got \[0\]",
    ):
        DistributedDataParallel(mlp(0), device_ids=[0])
    with pytest.raises(ValueError, match=r"output_device must be None for a module on host \(numpy\) arrays, got 0"):
        DistributedDataParallel(mlp(0), output_device=0)
    with pytest.raises(ValueError, match=r"dim must be 0, got 1: torch scatters inputs along dim"):
        DistributedDataParallel(mlp(0), dim=1)
    with pytest.raises(TypeError, match=r"find_unused_parameters must be a bool, got str"):
        DistributedDataParallel(mlp(0), find_unused_parameters="yes")
    with pytest.raises(TypeError, match=r"gradient_as_bucket_view must be a bool, got int"):
        DistributedDataParallel(mlp(0), gradient_as_bucket_view=1)
    with pytest.raises(ValueError, match=r"bucket_cap_mb must be > 0, got -1 \(None: the default, 25 MiB\)"):
        DistributedDataParallel(mlp(0), bucket_cap_mb=-1)
    with pytest.raises(TypeError, match=r"module must be an mpidist.nn.Module .*got list"):
        DistributedDataParallel([1, 2])
    with pytest.raises(RuntimeError, match=r"not needed when a module has no parameters"):
        DistributedDataParallel(ReLU())


@pytest.mark.mpi(min_size=2)
def test_process_group_without_this_rank_is_rejected(dist, world):
    rank, _ = world
    g = dist.new_group([0])
    if rank == 0:
        assert DistributedDataParallel(mlp(0), process_group=g).process_group is g
    else:
        with pytest.raises(ValueError, match=r"this rank is not a member of process_group"):
            DistributedDataParallel(mlp(0), process_group=g)


def test_comm_hook_registration_errors(dist):
    ddp = DistributedDataParallel(mlp(0))
    with pytest.raises(TypeError, match=r"register_comm_hook: hook must be callable, got int"):
        ddp.register_comm_hook(None, 3)
    with pytest.raises(TypeError, match=r"hook must take two positional arguments \(state, bucket\), got one\(b\)"):

        def one(b):
            return b

        ddp.register_comm_hook(None, one)
    from mpidist.parallel.comm_hooks import allreduce_hook

    ddp.register_comm_hook(None, allreduce_hook)
    with pytest.raises(RuntimeError, match=r"register_comm_hook can only be called once"):
        ddp.register_comm_hook(None, allreduce_hook)


def test_first_bucket_is_one_mib_by_default(dist):
    """torch: with bucket_cap_mb left at None the first bucket (last layers) closes at 1 MiB."""
    rng = np.random.default_rng(0)
    model = Sequential(Linear(256, 512, rng=rng), Linear(512, 512, rng=rng), Linear(512, 256, rng=rng))
    names = [n for n, _ in model.named_parameters()][::-1]
    default = DistributedDataParallel(model)
    # reversed: 2.bias 1 KiB, 2.weight 512 KiB, 1.bias 2 KiB, 1.weight 1 MiB -> reaches 1 MiB, closes
    assert default.bucket_parameter_names == [names[:4], names[4:]]
    assert DistributedDataParallel(model, bucket_cap_mb=25).bucket_parameter_names == [names]
    # an explicit cap applies to the first bucket too (torch >= 2.3)
    assert DistributedDataParallel(model, bucket_cap_mb=0.5).bucket_parameter_names == [
        names[:2],
        names[2:4],
        names[4:],
    ]


def test_bucket_cap_mb_list_gives_each_bucket_its_limit(dist):
    """torch 2.13: bucket k (in launch order) closes at bucket_cap_mb_list[k], the last entry
    applies to every later bucket; bucket_bytes_cap is the largest; bucket_cap_mb is ignored."""
    rng = np.random.default_rng(0)
    model = Sequential(Linear(256, 512, rng=rng), Linear(512, 512, rng=rng), Linear(512, 256, rng=rng))
    names = [n for n, _ in model.named_parameters()][::-1]
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.001, bucket_cap_mb_list=[0.5, 25])
    assert ddp.bucket_parameter_names == [names[:2], names[2:]]
    assert ddp.bucket_bytes_cap == 25 * 2**20 and ddp.bucket_bytes_cap_list == [2**19, 25 * 2**20]
    assert not ddp.bucket_bytes_cap_default
    small_then_tiny = DistributedDataParallel(model, bucket_cap_mb_list=[0.5, 0.0001])
    assert small_then_tiny.bucket_parameter_names == [names[:2]] + [[n] for n in names[2:]]
    assert (
        DistributedDataParallel(model, bucket_cap_mb_list=[]).bucket_parameter_names
        == DistributedDataParallel(model).bucket_parameter_names
    )  # torch: empty means unset


# -- state_dict: torch's "module." prefix ------------------------------------------------------------
def test_state_dict_keys_carry_the_module_prefix_and_load_both_ways(dist, world):
    """torch's tutorial: rank 0 saves ddp_model.state_dict(), every rank loads it into
    ddp_model; a bare model loads it after consume_prefix_in_state_dict_if_present."""
    rank, _ = world
    model = RunningMean(5)
    ddp = DistributedDataParallel(model)
    state = ddp.state_dict()
    assert list(state) == ["module.running_mean", "module.lin.weight", "module.lin.bias"]
    assert state["module.lin.weight"] is model.lin.weight.data
    assert [n for n, _ in ddp.named_parameters()] == ["module.lin.weight", "module.lin.bias"]
    assert [n for n, _ in ddp.named_buffers()] == ["module.running_mean"]
    saved = {k: v + 1 for k, v in state.items()}
    ddp.load_state_dict(saved)
    np.testing.assert_array_equal(model.lin.bias.data, saved["module.lin.bias"])
    bare = RunningMean(6)
    copy = dict(saved)
    consume_prefix_in_state_dict_if_present(copy, "module.")
    bare.load_state_dict(copy)
    np.testing.assert_array_equal(bare.lin.weight.data, saved["module.lin.weight"])
    with pytest.raises(
        ValueError,
        match=r"DistributedDataParallel.load_state_dict: keys do not match: missing "
        r"\['module.running_mean', .*unexpected \['running_mean', .*these are the bare "
        r"model's keys, without torch DDP's 'module.' prefix: load them with "
        r"ddp.module.load_state_dict\(state\)",
    ):
        ddp.load_state_dict(bare.state_dict())
    ddp.module.load_state_dict(bare.state_dict())
    ddp.load_state_dict({"module.lin.bias": np.zeros(CLASSES), "extra": np.zeros(1)}, strict=False)
    np.testing.assert_array_equal(model.lin.bias.data, 0)


# -- no_sync -----------------------------------------------------------------------------------
@pytest.mark.parametrize("view", [False, True])
def test_no_sync_accumulation_equals_one_process_on_the_combined_batch(dist, world, view):
    rank, size = world
    model = mlp(10 + rank)
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.001, gradient_as_bucket_view=view)
    opt, crit = SGD(model.parameters(), lr=0.1, momentum=0.9), CrossEntropyLoss()
    ref = mlp(10)
    ref_opt, ref_crit = SGD(ref.parameters(), lr=0.1, momentum=0.9), CrossEntropyLoss()
    micro = 3
    for step in range(3):
        opt.zero_grad()
        for m in range(micro):
            x, y = batch(step * micro + m, rank)
            if m < micro - 1:
                with ddp.no_sync():
                    crit(ddp(x), y)
                    ddp.backward(crit.backward())
            else:
                crit(ddp(x), y)
                ddp.backward(crit.backward())
            if step == 0 and m == 0:  # no communication: the local gradient, exactly
                local = mlp(10)
                crit(local(x), y)
                local.backward(crit.backward())
                for p, q in zip(model.parameters(), local.parameters()):
                    np.testing.assert_array_equal(p.grad, q.grad)
        opt.step()
        # reference: sum over micro-steps of the gradient of the mean loss over all ranks' batches
        ref_opt.zero_grad()
        for m in range(micro):
            xs, ys = zip(*(batch(step * micro + m, r) for r in range(size)))
            ref_crit(ref(np.concatenate(xs)), np.concatenate(ys))
            ref.backward(ref_crit.backward())
        ref_opt.step()
    assert_same_model(model, ref)


# -- find_unused_parameters / static_graph -------------------------------------------------------
def uses_b(step: int, rank: int) -> bool:
    return (step + rank) % 3 == 0


@pytest.mark.parametrize("bucket_cap_mb", [None, 1e-9])
@pytest.mark.parametrize("view", [False, True])
def test_find_unused_parameters_equals_one_process(dist, world, bucket_cap_mb, view):
    """Each step some ranks use head_b and others head_a; at world size 2 some steps use
    head_b nowhere, and its grad must stay None (so momentum SGD leaves it alone)."""
    rank, size = world
    model = TwoHeads(20 + rank)
    ddp = DistributedDataParallel(
        model, bucket_cap_mb=bucket_cap_mb, find_unused_parameters=True, gradient_as_bucket_view=view
    )
    opt, crit = SGD(model.parameters(), lr=0.1, momentum=0.9), CrossEntropyLoss()
    ref = TwoHeads(20)
    ref_opt, ref_crit = SGD(ref.parameters(), lr=0.1, momentum=0.9), CrossEntropyLoss()
    for step in range(6):
        opt.zero_grad()
        x, y = batch(step, rank, tag=1)
        crit(ddp(x, uses_b(step, rank)), y)
        ddp.backward(crit.backward())
        nobody_b = not any(uses_b(step, r) for r in range(size))
        assert (model.head_b.weight.grad is None) == nobody_b
        opt.step()
        reference_step(
            ref, ref_opt, ref_crit, [(*batch(step, r, tag=1), {"use_b": uses_b(step, r)}) for r in range(size)], size
        )
    assert_same_model(model, ref)


def count_reductions(monkeypatch) -> list:
    """Sizes of the arrays the Reducer all-reduces (buckets and the used map), in call order."""
    calls = []
    real = mpidist.parallel.reducer.all_reduce

    def counting(tensor, *args, **kwargs):
        calls.append(tensor.size)
        return real(tensor, *args, **kwargs)

    monkeypatch.setattr(mpidist.parallel.reducer, "all_reduce", counting)
    return calls


@pytest.mark.parametrize("flag", ["find_unused_parameters", "static_graph"])
def test_skip_all_reduce_unused_params_skips_buckets_no_rank_uses(dist, world, monkeypatch, flag):
    """head_b is never used: after the first step its two buckets (weight, bias) are no
    longer reduced, and training equals the one-process reference."""
    rank, size = world
    calls = count_reductions(monkeypatch)
    model = TwoHeads(80 + rank)
    ddp = DistributedDataParallel(model, bucket_cap_mb=1e-9, skip_all_reduce_unused_params=True, **{flag: True})
    opt, crit = SGD(model.parameters(), lr=0.1, momentum=0.9), CrossEntropyLoss()
    ref = TwoHeads(80)
    ref_opt, ref_crit = SGD(ref.parameters(), lr=0.1, momentum=0.9), CrossEntropyLoss()
    n_params = len(model.parameters())
    used_map = 1 if flag == "find_unused_parameters" else 0  # static_graph: first step only
    for step in range(3):
        del calls[:]
        opt.zero_grad()
        x, y = batch(step, rank, tag=9)
        crit(ddp(x, False), y)
        ddp.backward(crit.backward())
        assert model.head_b.weight.grad is None
        skipped = {i for i, names in enumerate(ddp.bucket_parameter_names) if names[0].startswith("head_b")}
        assert len(skipped) == 2 and ddp.reducer.skipped == skipped  # decided in the first step
        assert len(calls) == (n_params + 1 if step == 0 else n_params - 2 + used_map), (step, calls)
        opt.step()
        reference_step(ref, ref_opt, ref_crit, [(*batch(step, r, tag=9), {"use_b": False}) for r in range(size)], size)
    assert_same_model(model, ref)


def test_skip_all_reduce_unused_params_is_an_error_on_every_rank_when_the_unused_set_changes(dist, world):
    """torch hangs when ranks skip different buckets; here the skipped set is the same on
    every rank, and a gradient in it (rank 0 uses head_b) raises on every rank, after the
    step's collectives."""
    rank, _ = world
    model = TwoHeads(0)
    ddp = DistributedDataParallel(
        model, bucket_cap_mb=1e-9, find_unused_parameters=True, skip_all_reduce_unused_params=True
    )
    crit = CrossEntropyLoss()
    x, y = batch(0, rank)
    crit(ddp(x, False), y)
    ddp.backward(crit.backward())
    crit(ddp(x, rank == 0), y)
    with pytest.raises(
        RuntimeError,
        match=r"skip_all_reduce_unused_params=True, but parameters \['head_b.weight', "
        r"'head_b.bias'\] got a gradient on some rank",
    ):
        ddp.backward(crit.backward())
    dist.barrier()


def test_skip_all_reduce_unused_params_under_join(dist, world):
    """A joined rank skips the same buckets as the active ones (no hang, same model)."""
    rank, size = world
    model = TwoHeads(90 + rank)
    ddp = DistributedDataParallel(
        model, bucket_cap_mb=1e-9, find_unused_parameters=True, skip_all_reduce_unused_params=True
    )
    opt, crit = SGD(model.parameters(), lr=0.1), CrossEntropyLoss()
    with ddp.join():
        for step in range(n_batches(rank)):
            opt.zero_grad()
            x, y = batch(step, rank, tag=10)
            crit(ddp(x, False), y)
            ddp.backward(crit.backward())
            opt.step()
    ref = TwoHeads(90)
    ref_opt, ref_crit = SGD(ref.parameters(), lr=0.1), CrossEntropyLoss()
    for step in range(n_batches(size - 1)):
        active = [r for r in range(size) if n_batches(r) > step]
        reference_step(ref, ref_opt, ref_crit, [(*batch(step, r, tag=10), {"use_b": False}) for r in active], size)
    assert_same_model(model, ref)


def test_unused_parameter_without_the_flag_raises_and_nobody_hangs(dist, world):
    """Rank 0 uses head_b, the others head_a: without find_unused_parameters each rank
    raises for its own unused head, after completing its collectives (zero-filled), so no
    rank waits forever; the reducer is reset, so the next step behaves the same."""
    rank, _ = world
    ddp = DistributedDataParallel(TwoHeads(0), bucket_cap_mb=1e-9)
    crit = CrossEntropyLoss()
    x, y = batch(0, rank)
    unused = "head_a" if rank == 0 else "head_b"
    for _ in range(2):
        crit(ddp(x, rank == 0), y)
        with pytest.raises(
            RuntimeError,
            match=rf"parameters got no gradient in this backward pass: "
            rf"\['{unused}.weight', '{unused}.bias'\]; .*find_unused_parameters=True",
        ):
            ddp.backward(crit.backward())
    dist.barrier()


def test_static_graph_allows_a_fixed_unused_branch(dist, world):
    rank, size = world
    model = TwoHeads(30 + rank)
    ddp = DistributedDataParallel(model, bucket_cap_mb=1e-9, static_graph=True)
    opt, crit = SGD(model.parameters(), lr=0.1, momentum=0.9), CrossEntropyLoss()
    ref = TwoHeads(30)
    ref_opt, ref_crit = SGD(ref.parameters(), lr=0.1, momentum=0.9), CrossEntropyLoss()
    for step in range(4):
        opt.zero_grad()
        x, y = batch(step, rank, tag=2)
        crit(ddp(x, False), y)
        ddp.backward(crit.backward())
        assert model.head_b.weight.grad is None
        opt.step()
        reference_step(ref, ref_opt, ref_crit, [(*batch(step, r, tag=2), {"use_b": False}) for r in range(size)], size)
    assert_same_model(model, ref)
    crit(ddp(x, True), y)
    with pytest.raises(
        RuntimeError,
        match=r"static_graph=True, but parameters \['head_a.weight', 'head_a.bias', "
        r"'head_b.weight', 'head_b.bias'\] changed",
    ):
        ddp.backward(crit.backward())


# -- gradient_as_bucket_view ---------------------------------------------------------------------
@pytest.mark.parametrize("set_to_none", [True, False])
def test_gradient_as_bucket_view_equals_one_process_and_shares_memory(dist, world, set_to_none):
    rank, size = world
    model = mlp(40 + rank)
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.002, gradient_as_bucket_view=True)
    opt, crit = SGD(model.parameters(), lr=0.1, momentum=0.9), CrossEntropyLoss()
    ref = mlp(40)
    ref_opt, ref_crit = SGD(ref.parameters(), lr=0.1, momentum=0.9), CrossEntropyLoss()
    flats = [b.flat for b in ddp.reducer.buckets]
    assert len(flats) > 1
    for step in range(4):
        opt.zero_grad(set_to_none=set_to_none)
        x, y = batch(step, rank, tag=3)
        crit(ddp(x), y)
        ddp.backward(crit.backward())
        saved = 0
        for p in model.parameters():
            owner = [f for f in flats if np.shares_memory(p.grad, f)]
            assert len(owner) == 1 and np.shares_memory(p.grad, owner[0]), p.name
            saved += p.grad.nbytes
        assert saved == sum(f.nbytes for f in flats)  # no gradient memory besides the buckets
        opt.step()
        reference_step(ref, ref_opt, ref_crit, [(*batch(step, r, tag=3), {}) for r in range(size)], size)
    assert_same_model(model, ref)


def test_gradient_as_bucket_view_adopts_existing_grads(dist):
    model = mlp(0)
    for p in model.parameters():
        p.grad = np.full(p.shape, 2.0)
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=True)
    (flat,) = [b.flat for b in ddp.reducer.buckets]
    for p in model.parameters():
        assert np.shares_memory(p.grad, flat)
        np.testing.assert_array_equal(p.grad, 2.0)


# -- broadcast_buffers ------------------------------------------------------------------------------
@pytest.mark.parametrize("broadcast_buffers", [True, False])
def test_buffers_are_broadcast_at_each_synchronized_forward(dist, world, broadcast_buffers):
    """Step 1 runs under no_sync, so step 2's forward does not broadcast (torch's
    require_forward_param_sync); steps 0, 1 and 3 do. (The deprecated broadcast_buffers=False
    also keeps buffers out of the construction-time broadcast.)"""
    rank, _ = world
    model = RunningMean(0, start=float(rank))
    with pytest.warns(FutureWarning, match="broadcast_buffers"):
        ddp = DistributedDataParallel(model, broadcast_buffers=broadcast_buffers)
    crit = CrossEntropyLoss()
    mine = np.full(D_IN, 0.0 if broadcast_buffers else float(rank))  # after construction
    rank0 = np.zeros(D_IN)
    broadcasts = [True, True, False, True]
    for step, bcast in enumerate(broadcasts):
        np.testing.assert_array_equal(model.running_mean, mine)
        x, y = batch(step, rank, tag=4)
        x0, _ = batch(step, 0, tag=4)
        base = rank0 if (bcast and broadcast_buffers) else mine
        mine = 0.5 * base + 0.5 * x.mean(axis=0)
        rank0 = 0.5 * rank0 + 0.5 * x0.mean(axis=0)
        context = ddp.no_sync() if step == 1 else _nothing()
        with context:
            crit(ddp(x), y)
            ddp.backward(crit.backward())
        np.testing.assert_allclose(model.running_mean, mine, rtol=1e-12)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# -- join -----------------------------------------------------------------------------------------------
def n_batches(rank: int) -> int:
    return 2 + rank


@pytest.mark.parametrize("hook", [None, "allreduce"])
@pytest.mark.parametrize("initial", [True, False])
def test_join_with_uneven_inputs_equals_independent_computation(dist, world, initial, hook):
    """Rank r has 2 + r batches. Step t averages the gradients of the ranks that still
    have a batch, divided by the world size (or by their number); at the end every rank
    holds the last rank's model, the buffers too."""
    rank, size = world
    model = RunningMean(50 + rank, start=float(rank))
    ddp = DistributedDataParallel(model, bucket_cap_mb=1e-9)
    if hook:
        from mpidist.parallel.comm_hooks import allreduce_hook

        ddp.register_comm_hook(None, allreduce_hook)
    opt, crit = SGD(model.parameters(), lr=0.1, momentum=0.9), CrossEntropyLoss()
    with ddp.join(divide_by_initial_world_size=initial):
        for step in range(n_batches(rank)):
            opt.zero_grad()
            x, y = batch(step, rank, tag=5)
            crit(ddp(x), y)
            ddp.backward(crit.backward())
            opt.step()
    ref = RunningMean(50)
    ref_opt, ref_crit = SGD(ref.parameters(), lr=0.1, momentum=0.9), CrossEntropyLoss()
    divide_by_world = initial or hook is not None  # hooks divide by the group size themselves
    for step in range(n_batches(size - 1)):
        active = [r for r in range(size) if n_batches(r) > step]
        reference_step(
            ref,
            ref_opt,
            ref_crit,
            [(*batch(step, r, tag=5), {}) for r in active],
            size if divide_by_world else len(active),
        )
    assert_same_model(model, ref)
    last = np.zeros(D_IN)  # the last rank is always the authority: its own running mean
    for step in range(n_batches(size - 1)):
        last = 0.5 * last + 0.5 * batch(step, size - 1, tag=5)[0].mean(axis=0)
    np.testing.assert_allclose(model.running_mean, last, rtol=1e-12)


def test_join_is_a_no_op_when_disabled_or_everyone_has_the_same_inputs(dist, world):
    rank, size = world
    model = mlp(60 + rank)
    ddp = DistributedDataParallel(model)
    crit = CrossEntropyLoss()
    for enable in (False, True):
        with ddp.join(enable=enable):
            x, y = batch(0, rank)
            crit(ddp(x), y)
            ddp.backward(crit.backward())
    with pytest.raises(RuntimeError, match=r"join\(\) contexts cannot be nested"):
        with ddp.join():
            with ddp.join():
                pass


def test_join_with_find_unused_parameters_follows_torchs_used_map_rule(dist, world):
    """torch's joined rank re-sends the used map of its last step (_match_unused_params_allreduce
    all-reduces its reducer's local_used_map_dev_). Rank 0 has 3 batches and uses head_b only
    in the first; every other rank has one batch using head_b. In rank 0's join-phase steps no
    active rank uses head_b, but the joined ranks' stale maps say it is used, so its grad is
    written as zeros (torch 2.13 gives zeros too) instead of being left None; alone (world size
    1) it stays None."""
    rank, size = world
    model = TwoHeads(95)
    ddp = DistributedDataParallel(model, find_unused_parameters=True)
    crit = CrossEntropyLoss()
    plan = [True, False, False] if rank == 0 else [True]
    with ddp.join():
        for step, use_b in enumerate(plan):
            model.zero_grad()
            x, y = batch(step, rank, tag=11)
            crit(ddp(x, use_b), y)
            ddp.backward(crit.backward())
            grad = model.head_b.weight.grad
            if step == 0:
                assert grad is not None and grad.any()
            elif size == 1:
                assert grad is None
            else:
                assert grad is not None and not grad.any(), grad


@pytest.mark.mpi(min_size=2)
def test_join_throw_on_early_termination_raises_on_every_rank(dist, world):
    rank, _ = world
    model = mlp(70)
    ddp = DistributedDataParallel(model)
    crit = CrossEntropyLoss()
    steps = 1 if rank == 0 else 3
    message = (
        r"rank 0 exhausted all inputs"
        if rank == 0
        else r"detected at least one rank that exhausted inputs; throwing across all ranks"
    )
    with pytest.raises(RuntimeError, match=message):
        with ddp.join(throw_on_early_termination=True):
            for step in range(steps):
                x, y = batch(step, rank)
                crit(ddp(x), y)
                ddp.backward(crit.backward())
    dist.barrier()


# -- a parameter accumulated twice in one backward ------------------------------------------------
class SharedUse(Module):
    """``y = x * (a + b)``; backward accumulates b's gradient in two halves, then a's."""

    def __init__(self) -> None:
        super().__init__()
        from mpidist.nn import Parameter

        self.a = Parameter(np.linspace(0.5, 1.5, D_IN))
        self.b = Parameter(np.linspace(-1.0, 1.0, D_IN))

    def forward(self, x):
        self._x = x
        return x * (self.a.data + self.b.data)

    def backward(self, grad):
        part = grad * self._x
        self.b.accumulate_grad(part[:1].sum(axis=0))
        self.b.accumulate_grad(part[1:].sum(axis=0))
        self.a.accumulate_grad(part.sum(axis=0))
        return grad * (self.a.data + self.b.data)


@pytest.mark.parametrize("bucket_cap_mb", [None, 1e-9])
def test_second_accumulation_is_taken_before_launch_and_reported_after(dist, world, bucket_cap_mb):
    """One bucket: b's second half arrives before the bucket launches and is included.
    One bucket per parameter: b's bucket has left; RuntimeError after the step."""
    rank, size = world
    model = SharedUse()
    ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    inputs = [np.random.default_rng([8, r]).standard_normal((2, BATCH, D_IN)) for r in range(size)]
    x, g = inputs[rank]
    ddp(x)
    if bucket_cap_mb is None:
        ddp.backward(g)
        want = sum((xr * gr).sum(axis=0) for xr, gr in inputs) / size
        np.testing.assert_allclose(model.b.grad, want, rtol=1e-12)
        np.testing.assert_allclose(model.a.grad, want, rtol=1e-12)
    else:
        with pytest.raises(
            RuntimeError,
            match=r"parameters \['b'\] got gradient again after their bucket's "
            r"reduction started",
        ):
            ddp.backward(g)
