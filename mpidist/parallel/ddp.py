"""DistributedDataParallel for mpidist's array models, with torch's arguments and features.

Bucketed gradient averaging overlapped with backward (:mod:`mpidist.parallel.reducer`),
``no_sync`` accumulation, ``find_unused_parameters``, ``gradient_as_bucket_view``,
communication hooks (:mod:`mpidist.parallel.comm_hooks`), ``join`` for uneven inputs
(torch's ``Join`` protocol) and a Chrome-trace timeline (:mod:`mpidist.parallel.timeline`).
docs/ddp.md lists every difference from torch.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import numbers
import warnings
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union, cast

import numpy as np

from mpidist._arrays.reduce_op import ReduceOp
from mpidist._core.group import ProcessGroup
from mpidist._runtime import world as runtime
from mpidist.collectives import ALGORITHMS, all_reduce, broadcast
from mpidist.errors import prefix
from mpidist.gather_scatter import all_gather_into_tensor
from mpidist.nn._util import check_bool, device_of
from mpidist.nn.modules import mismatched_keys
from mpidist.parallel.reducer import DEFAULT_FIRST_BUCKET_BYTES, Reducer
from mpidist.parallel.timeline import Timeline, timeline_from_env

__all__ = ["DistributedDataParallel"]

_OP = "DistributedDataParallel"
_PREFIX = "module."  # torch's DDP holds the model as its submodule "module"


@dataclass(frozen=True)
class _JoinConfig:
    enable: bool
    divide_by_initial_world_size: bool
    throw_on_early_termination: bool


@dataclass(frozen=True)
class _JoinInfo:
    """What one join all-reduce told every rank about the current step."""

    active: int  # ranks that still have inputs
    authority: int  # global rank of the highest active rank (-1: none)
    grads: bool  # some active rank reduces gradients this step
    buffers: bool  # some active rank broadcasts buffers this step


@dataclass(frozen=True)
class _BucketLimits:
    """The bucket sizes the constructor's arguments ask for (torch's ``_BucketCapacityConfig``)."""

    cap_mb: float  # bucket_cap_mb, or the largest of bucket_cap_mb_list
    default: bool  # bucket_cap_mb and bucket_cap_mb_list left unset
    per_bucket: list[int]  # bucket_cap_mb_list in bytes ([] when unset)

    def reducer_limits(self, cap_bytes: int) -> list[int]:
        """Limits for :func:`~mpidist.parallel.reducer.assign_buckets`, in launch order."""
        if self.per_bucket:
            return list(self.per_bucket)
        return [DEFAULT_FIRST_BUCKET_BYTES if self.default else cap_bytes, cap_bytes]


def _bucket_limits(bucket_cap_mb: Any, bucket_cap_mb_list: Any) -> _BucketLimits:
    """Validate ``bucket_cap_mb`` and ``bucket_cap_mb_list`` (each > 0) into bucket limits."""
    where = prefix(_OP)

    def positive(value: Any) -> bool:
        return isinstance(value, numbers.Real) and not isinstance(value, bool) and value > 0  # type: ignore[operator]  # numbers.Real's stub has no __gt__

    if bucket_cap_mb is not None and not positive(bucket_cap_mb):
        raise ValueError(f"{where} bucket_cap_mb must be > 0, got {bucket_cap_mb!r} (None: the default, 25 MiB)")
    if bucket_cap_mb_list is not None:
        if not isinstance(bucket_cap_mb_list, (list, tuple)) or not all(map(positive, bucket_cap_mb_list)):
            raise ValueError(
                f"{where} bucket_cap_mb_list must be a list of sizes in MiB, each > 0, got {bucket_cap_mb_list!r}"
            )
        if bucket_cap_mb_list:  # torch: an empty list means unset
            return _BucketLimits(max(bucket_cap_mb_list), False, [int(mb * 2**20) for mb in bucket_cap_mb_list])
    if bucket_cap_mb is None:
        return _BucketLimits(25, True, [])
    return _BucketLimits(bucket_cap_mb, False, [])


def _buffer_sync(broadcast_buffers: Optional[bool], forward_sync_buffers: Optional[bool]) -> tuple[bool, bool]:
    """``(forward_sync_buffers, init_sync_buffers)`` from torch 2.13's two buffer flags, with its warnings."""
    if broadcast_buffers is not None:
        if forward_sync_buffers is not None:
            warnings.warn(
                "Both `broadcast_buffers` and `forward_sync_buffers` were specified. `broadcast_buffers` "
                "is deprecated and its value is ignored when `forward_sync_buffers` is provided.",
                FutureWarning,
                stacklevel=3,
            )
        else:
            warnings.warn(
                "`broadcast_buffers` is deprecated. Use `forward_sync_buffers` instead. IMPORTANT: "
                "unlike `broadcast_buffers=False`, `forward_sync_buffers=False` still syncs buffers at "
                "init. If you rely on buffers NOT being synced at init (e.g. rank-local buffers), keep "
                "using `broadcast_buffers=False`.",
                FutureWarning,
                stacklevel=3,
            )
    if forward_sync_buffers is not None:
        return forward_sync_buffers, True
    effective = True if broadcast_buffers is None else broadcast_buffers
    return effective, effective


def _refuse_unsupported(
    delay_all_reduce_named_params: Any, param_to_hook_all_reduce: Any, mixed_precision: Any
) -> None:
    """torch 2.13 constructor arguments mpidist does not implement: None only."""
    where = prefix(_OP)
    if (delay_all_reduce_named_params is None) != (param_to_hook_all_reduce is None):
        raise ValueError(
            f"{where} delay_all_reduce_named_params and param_to_hook_all_reduce need to be set at the same time."
        )
    if delay_all_reduce_named_params is not None:
        raise NotImplementedError(
            f"{where} delay_all_reduce_named_params / param_to_hook_all_reduce are not "
            f"supported: mpidist's Reducer has no delayed all-reduce; leave them None (every "
            f"parameter is then reduced in its bucket during backward)"
        )
    if mixed_precision is not None:
        raise NotImplementedError(
            f"{where} mixed_precision is not supported: leave it None and train in the "
            f"parameters' dtype, or reduce gradients in float16/bfloat16 with "
            f"register_comm_hook(None, comm_hooks.fp16_compress_hook / bf16_compress_hook)"
        )


def _mesh_group(process_group: Optional[ProcessGroup], device_mesh: Any) -> Optional[ProcessGroup]:
    """The group DDP averages over: ``process_group``, or a 1-D ``device_mesh``'s group (torch)."""
    if device_mesh is None:
        return process_group
    where = prefix(_OP)
    if process_group is not None:
        raise RuntimeError(f"{where} Cannot specify both process_group and device_mesh arguments.")
    if not (hasattr(device_mesh, "ndim") and callable(getattr(device_mesh, "get_group", None))):
        raise TypeError(
            f"{where} device_mesh must be a DeviceMesh (with ndim and get_group), got {type(device_mesh).__name__}"
        )
    if device_mesh.ndim != 1:
        raise RuntimeError(f"{where} Only 1D device mesh is supported, but got {device_mesh}.")
    return cast(ProcessGroup, device_mesh.get_group(mesh_dim=0))  # a DeviceMesh's group


class DistributedDataParallel:
    """Wrap ``module`` so that backward leaves every gradient averaged over the group.

    Same constructor as ``torch.nn.parallel.DistributedDataParallel`` in torch 2.13 (same
    names, positions and defaults; ``algorithm`` is mpidist's, keyword-only):

    Args:
        module: an :class:`mpidist.nn.Module` with at least one parameter, all on one
            device: host (numpy) or one GPU (cupy; move it first with ``module.to("cuda")``).
            With ``init_sync`` its parameters and buffers are broadcast from the group's
            rank 0 at construction; the module is used in place. Gradient buckets are
            allocated on the parameters' device and all-reduced there.
        device_ids, output_device: torch places a single-device module with them. Host
            module: only ``None`` (or ``[]`` for ``device_ids``). Module on GPU N: ``None``,
            ``[N]`` / ``N`` (or ``"cuda:N"``); the module already lives there.
        dim: torch scatters inputs along ``dim`` to ``device_ids``; only 0 (no scatter).
        broadcast_buffers: deprecated in torch 2.13 for ``forward_sync_buffers`` (a
            FutureWarning when given, as torch). ``False`` also keeps buffers out of the
            construction-time broadcast; ignored when ``forward_sync_buffers`` is given.
        init_sync: compare the ranks' parameter shapes and broadcast parameters and buffers
            from rank 0 at construction (default True). False: no communication at
            construction; every rank must then already hold the same weights (torch).
        process_group: the group to average over (default: all ranks); must contain
            this rank.
        bucket_cap_mb: bucket size in MiB. ``None`` (default): 25 MiB, and the first
            bucket launched (the last layers' gradients) is capped at 1 MiB
            (torch's ``_DEFAULT_FIRST_BUCKET_BYTES``) so it can start early; an explicit
            value caps every bucket, the first included (torch >= 2.3).
        find_unused_parameters: allow parameters that get no gradient in a step: their
            slots are zero-filled (Horovod's approach), so every rank reduces every
            bucket; one extra small all-reduce per step finds the parameters no rank
            used, whose ``.grad`` is then left untouched (torch).
        check_reduction: deprecated in torch and ignored (a FutureWarning when True).
        gradient_as_bucket_view: make each ``p.grad`` a view into its bucket's flat
            buffer: no grad-sized copies after the reduction and no separate grad arrays
            (saves the gradients' size in memory).
        static_graph: promise that the set of parameters that get gradients is the same
            every step. Unused parameters are then allowed (as with
            find_unused_parameters) but the used-parameter all-reduce runs only in the
            first step; a later change is a RuntimeError.
        delay_all_reduce_named_params, param_to_hook_all_reduce: not supported (mpidist's
            Reducer has no delayed all-reduce): anything but ``None`` is a
            NotImplementedError; setting only one of them is torch's ValueError.
        mixed_precision: not supported: anything but ``None`` is a NotImplementedError
            (train in the dtype you want, or reduce in float16/bfloat16 with
            :func:`~mpidist.parallel.comm_hooks.fp16_compress_hook` / ``bf16_compress_hook``).
        device_mesh: a 1-D device mesh (anything with ``ndim`` and ``get_group(mesh_dim=0)``,
            e.g. ``mpidist.DeviceMesh``) whose group to average over, as torch; RuntimeError
            together with ``process_group`` or for ``ndim != 1``.
        skip_all_reduce_unused_params: with ``find_unused_parameters`` or ``static_graph``,
            do not reduce buckets whose parameters are unused (torch: requires the unused
            set to be the same on every rank for the whole training). Here the buckets to
            skip are decided once, from the first synchronized step's all-reduced used map,
            so every rank skips the same ones (torch decides per rank and hangs if they
            differ); a gradient that later appears in a skipped bucket is a RuntimeError on
            every rank, raised after the step's collectives. No effect without either flag.
        bucket_cap_mb_list: per-bucket limits in MiB, in launch order; the last applies to
            every later bucket (torch 2.13). Overrides ``bucket_cap_mb``
            (``bucket_bytes_cap`` is then the largest).
        batched_grad_copy: accepted; a no-op (torch batches the grad-to-bucket copies into
            fewer kernel launches; the gradients are the same).
        forward_sync_buffers: broadcast the module's buffers from rank 0 (in join mode: the
            highest rank still active) at the start of each forward that follows a
            synchronized step (torch's ``require_forward_param_sync``), and after a join.
            ``None`` (default): True, or the deprecated ``broadcast_buffers`` if given.
        algorithm: mpidist extension: the built-in reduction's all-reduce algorithm.
            None (default): all_reduce's measured automatic choice (intra-node shared
            memory for mid-size and large buckets on a one-node group, else MPI);
            ``"mpi"`` (MPI_Allreduce), ``"ring"``
            (:func:`mpidist.algorithms.ring_all_reduce`), ``"shm"`` or ``"hierarchical"`` to force one.
            Buckets of a dtype MPI cannot sum (float16, bfloat16) never use ``"mpi"``.

    There is no autograd: call ``ddp.backward(grad_output)`` (the gradient of the loss
    with respect to the module's output, e.g. ``criterion.backward()``) where torch calls
    ``loss.backward()``. It returns when every parameter's ``.grad`` holds the group
    average (gradient / world size, summed) of the ranks' gradients, bitwise identical on
    every rank. Whether a step is synchronized is decided at its forward, as in torch
    (``no_sync`` must wrap the forward).

    ``state_dict()`` keys carry torch's ``"module."`` prefix; see :meth:`state_dict`.

    Raises:
        TypeError: an argument of the wrong type; ``module`` is not an mpidist Module.
        ValueError: parameters on more than one device; device_ids / output_device / dim
            that do not match the parameters' device; bad ``bucket_cap_mb``,
            ``bucket_cap_mb_list`` or ``algorithm``; this rank is not in
            ``process_group``; the ranks' models differ in parameter shapes or dtypes
            (naming the ranks); only one of the two delayed-all-reduce arguments.
        RuntimeError: the module has no parameters; ``device_mesh`` with
            ``process_group``, or not 1-D.
        NotImplementedError: ``delay_all_reduce_named_params``/``param_to_hook_all_reduce``
            or ``mixed_precision`` given.
    """

    def __init__(
        self,
        module: Any,
        device_ids: Optional[list[Union[int, str]]] = None,
        output_device: Any = None,
        dim: int = 0,
        broadcast_buffers: Optional[bool] = None,
        init_sync: bool = True,
        process_group: Optional[ProcessGroup] = None,
        bucket_cap_mb: Optional[float] = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        delay_all_reduce_named_params: Optional[list[tuple[str, Any]]] = None,
        param_to_hook_all_reduce: Any = None,
        mixed_precision: Any = None,
        device_mesh: Any = None,
        skip_all_reduce_unused_params: bool = False,
        bucket_cap_mb_list: Optional[list[float]] = None,
        batched_grad_copy: bool = False,
        forward_sync_buffers: Optional[bool] = None,
        *,
        algorithm: Optional[str] = None,
    ) -> None:
        where = prefix(_OP)
        flag: Optional[bool]
        for name, flag in (
            ("init_sync", init_sync),
            ("find_unused_parameters", find_unused_parameters),
            ("check_reduction", check_reduction),
            ("gradient_as_bucket_view", gradient_as_bucket_view),
            ("static_graph", static_graph),
            ("skip_all_reduce_unused_params", skip_all_reduce_unused_params),
            ("batched_grad_copy", batched_grad_copy),
        ):
            check_bool(flag, name, _OP)
        for name, flag in (("broadcast_buffers", broadcast_buffers), ("forward_sync_buffers", forward_sync_buffers)):
            if flag is not None:
                check_bool(flag, name, _OP)
        _refuse_unsupported(delay_all_reduce_named_params, param_to_hook_all_reduce, mixed_precision)
        if check_reduction:
            warnings.warn(
                "The `check_reduction` argument in `DistributedDataParallel` module is deprecated and ignored.",
                FutureWarning,
                stacklevel=2,
            )
        self.forward_sync_buffers, init_sync_buffers = _buffer_sync(broadcast_buffers, forward_sync_buffers)
        if algorithm is not None and algorithm not in ALGORITHMS:
            raise ValueError(f"{where} algorithm must be None or one of {ALGORITHMS}, got {algorithm!r}")
        limits = _bucket_limits(bucket_cap_mb, bucket_cap_mb_list)
        if not (callable(getattr(module, "parameters", None)) and callable(getattr(module, "backward", None))):
            raise TypeError(
                f"{where} module must be an mpidist.nn.Module (with parameters() and backward()), "
                f"got {type(module).__name__}"
            )
        self.module = module
        self._params = list(module.parameters())
        if not self._params:
            raise RuntimeError(f"{where} DistributedDataParallel is not needed when a module has no parameters")
        self.device = self._parameters_device(where)
        self.device_ids, self.output_device = self._check_placement(device_ids, output_device, dim)
        self.dim = 0
        self.device_mesh = device_mesh
        self.process_group = runtime.resolve_group(_mesh_group(process_group, device_mesh))
        if not self.process_group.is_member():
            raise ValueError(f"{where} this rank is not a member of process_group")
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.skip_all_reduce_unused_params = skip_all_reduce_unused_params
        self.batched_grad_copy = batched_grad_copy
        self.mixed_precision = None
        self.algorithm = algorithm
        self.bucket_bytes_cap_list = limits.per_bucket
        self.bucket_bytes_cap_default = limits.default
        self.bucket_cap_mb = limits.cap_mb
        self.bucket_bytes_cap = int(self.bucket_cap_mb * 2**20)
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self._sync_this_step = True
        self._div = self.process_group.size()  # what the built-in reduction divides by (set at forward)
        self._join_config: Optional[_JoinConfig] = None
        self._src = self.process_group.global_rank(0)
        if init_sync:
            self._verify_same_model(where)
            self._sync_module_states(self._src, init_sync_buffers)
        self._timeline: Optional[Timeline] = timeline_from_env(runtime.state().rank)
        self.reducer = Reducer(
            self._params,
            self.process_group,
            limits=limits.reducer_limits(self.bucket_bytes_cap),
            gradient_as_bucket_view=gradient_as_bucket_view,
            algorithm=algorithm,
            find_unused_parameters=find_unused_parameters,
            static_graph=static_graph,
            skip_all_reduce_unused_params=skip_all_reduce_unused_params,
            timeline=self._timeline,
        )
        if self._timeline is not None:
            self._instrument_layers(self._timeline)

    @property
    def broadcast_buffers(self) -> bool:
        """torch 2.13's deprecated alias of :attr:`forward_sync_buffers` (read and write)."""
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.forward_sync_buffers = value

    # -- construction -----------------------------------------------------------------
    def _parameters_device(self, where: str) -> str:
        """The one device ("cpu" or "cuda:N") of all parameters; ValueError naming them otherwise."""
        by_device: dict[str, list[str]] = {}
        for i, p in enumerate(self._params):
            by_device.setdefault(device_of(p.data), []).append(p.name or f"parameter {i}")
        if len(by_device) > 1:
            found = "; ".join(
                f"{dev}: {names[:3] + ['...'] if len(names) > 3 else names}" for dev, names in by_device.items()
            )
            raise ValueError(
                f"{where} all parameters of the module must be on one device, got {found}; "
                f"move the module with module.to(device) first"
            )
        return next(iter(by_device))

    def _check_placement(
        self, device_ids: Any, output_device: Any, dim: Any
    ) -> tuple[Optional[list[int]], Optional[int]]:
        """Validate torch's placement arguments against the parameters' device; return
        ``(device_ids, output_device)`` as torch stores them."""
        where = prefix(_OP)
        if not isinstance(dim, numbers.Integral) or isinstance(dim, bool) or dim != 0:
            raise ValueError(
                f"{where} dim must be 0, got {dim!r}: torch scatters inputs along dim over "
                f"device_ids; here each process uses its input as given"
            )
        no_ids = device_ids is None or (isinstance(device_ids, (list, tuple)) and len(device_ids) == 0)
        if self.device != "cpu":
            return self._check_gpu_placement(where, device_ids, output_device, no_ids)
        if not no_ids:
            raise ValueError(
                f"{where} device_ids must be None (or []) for a module on host (numpy) arrays, "
                f"got {device_ids!r}: each process trains its own host copy, there is no device "
                f"to place the module on"
            )
        if output_device is not None:
            raise ValueError(
                f"{where} output_device must be None for a module on host (numpy) arrays, got "
                f"{output_device!r}: outputs stay where the module computes them"
            )
        return None, None

    def _check_gpu_placement(
        self, where: str, device_ids: Any, output_device: Any, no_ids: bool
    ) -> tuple[Optional[list[int]], Optional[int]]:
        """A module on GPU N: device_ids None/[]/[N], output_device None/N (N or "cuda:N")."""
        index = int(self.device.split(":")[1])
        allowed = (index, self.device)
        if not (
            no_ids
            or (isinstance(device_ids, (list, tuple)) and len(device_ids) == 1 and _same_device(device_ids[0], allowed))
        ):
            raise ValueError(
                f"{where} device_ids must be None or [{index}] for a module on {self.device} (one "
                f"device per process), got {device_ids!r}"
            )
        if output_device is not None and not _same_device(output_device, allowed):
            raise ValueError(
                f"{where} output_device must be None or {index} for a module on {self.device}, got {output_device!r}"
            )
        return (None, None) if no_ids else ([index], index)

    def _verify_same_model(self, where: str) -> None:
        spec = ";".join(f"{tuple(p.shape)}:{np.dtype(p.dtype).str}" for p in self._params)
        digest = np.frombuffer(hashlib.sha256(spec.encode()).digest()[:8], dtype=np.int64).copy()
        g = self.process_group
        every = np.empty(g.size(), dtype=np.int64)
        all_gather_into_tensor(every, digest, g)
        differ = [g.ranks[i] for i in range(g.size()) if every[i] != every[0]]
        if differ:
            raise ValueError(
                f"{where} the model's parameter shapes/dtypes on ranks {differ} differ from "
                f"rank {g.ranks[0]}'s; every rank must build the same model"
            )

    def _sync_module_states(self, src: int, with_buffers: bool) -> None:
        """Broadcast parameters (and buffers) from global rank ``src`` (torch's _sync_module_states)."""
        if self.process_group.size() == 1:
            return
        for p in self._params:
            broadcast(p.data, src, self.process_group)
        if with_buffers:
            self._broadcast_buffers(src)

    def _broadcast_buffers(self, src: int) -> None:
        for buf in self.module.buffers():
            broadcast(buf, src, self.process_group)

    def _instrument_layers(self, tl: Timeline) -> None:
        """Record each leaf module's forward and backward on the timeline (instance wrappers)."""
        for name, mod in self.module.named_modules():
            if name and not mod.children():
                for phase in ("forward", "backward"):
                    setattr(mod, phase, _timed(tl, f"{phase}:{name}", getattr(mod, phase)))

    # -- the step ---------------------------------------------------------------------
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the module's forward, after the step's join and buffer synchronization.

        Raises RuntimeError in join mode with ``throw_on_early_termination`` once a rank has
        run out of inputs (on every rank).
        """
        tl = self._timeline
        start = tl.now() if tl is not None else 0.0
        self._sync_this_step = self.require_backward_grad_sync
        self._div = self.process_group.size()
        buffers = (
            self.require_forward_param_sync
            and self.forward_sync_buffers
            and self.process_group.size() > 1
            and bool(self.module.buffers())
        )
        src = self._src
        if self._join_config is not None:
            info = self._join_all_reduce(active=True, buffers=buffers)
            if self._join_config.throw_on_early_termination and info.active < self.process_group.size():
                raise RuntimeError(
                    f"{prefix(_OP)} detected at least one rank that exhausted inputs; throwing "
                    f"across all ranks (throw_on_early_termination=True)"
                )
            if not self._join_config.divide_by_initial_world_size:
                self._div = info.active
            buffers, src = info.buffers, info.authority
        if buffers:
            sync = tl.now() if tl is not None else 0.0
            self._broadcast_buffers(src)
            if tl is not None:
                tl.complete("broadcast_buffers", "step", sync, args={"src": src})
        out = self.module(*inputs, **kwargs)
        self.require_forward_param_sync = self._sync_this_step
        if tl is not None:
            tl.complete("forward", "step", start)
        return out

    __call__ = forward

    def backward(self, grad_output: Any) -> Any:
        """Backward through the module, averaging gradients across the group on the way.

        Returns the module's gradient with respect to its input. In a synchronized step,
        when it returns every parameter's ``.grad`` holds the group average; under
        :meth:`no_sync` gradients just accumulate locally.

        Raises:
            RuntimeError: a parameter got no gradient (without find_unused_parameters or
                static_graph), or see :meth:`Reducer.finalize`; raised after this rank's
                collectives completed, so the other ranks do not hang.
        """
        if not self._sync_this_step:
            return self.module.backward(grad_output)
        tl = self._timeline
        start = tl.now() if tl is not None else 0.0
        reducer = self.reducer
        reducer.prepare(self._div)
        try:
            grad_input = self.module.backward(grad_output)
        except BaseException:
            reducer.reset()
            raise
        if tl is None:
            reducer.finalize()
            return grad_input
        sync = tl.now()
        try:
            reducer.finalize()
        finally:
            tl.complete("synchronize", "step", sync)
            tl.complete("backward", "step", start)
            tl.flush()
        return grad_input

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Steps whose forward runs inside accumulate gradients locally, without communication.

        The first synchronized backward afterwards reduces the accumulated gradients
        (torch: ``DistributedDataParallel.no_sync``).
        """
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    # -- communication hooks -------------------------------------------------------------
    def register_comm_hook(self, state: Any, hook: Callable[[Any, Any], Any]) -> None:
        """Reduce each bucket with ``hook(state, bucket) -> concurrent.futures.Future`` (torch's API).

        ``bucket`` is a :class:`mpidist.parallel.comm_hooks.GradBucket` whose ``buffer()``
        holds this rank's gradients (not divided by the world size); the future must
        complete with the reduced flat array (DDP copies it into the bucket unless it is
        the bucket's own buffer). Built-in hooks: :mod:`mpidist.parallel.comm_hooks`.

        Raises:
            TypeError: ``hook`` is not callable with two positional arguments.
            RuntimeError: a hook is registered already (torch allows one).
        """
        where = prefix("DistributedDataParallel.register_comm_hook")
        if not callable(hook):
            raise TypeError(f"{where} hook must be callable, got {type(hook).__name__}")
        try:
            inspect.signature(hook).bind(state, None)
        except TypeError:
            raise TypeError(
                f"{where} hook must take two positional arguments (state, bucket), got "
                f"{getattr(hook, '__name__', hook)}{inspect.signature(hook)}"
            ) from None
        except ValueError:
            pass  # no signature to inspect (a builtin): trust it
        if self.reducer.hook is not None:
            raise RuntimeError(f"{where} register_comm_hook can only be called once")
        self.reducer.hook, self.reducer.hook_state = hook, state

    # -- join (uneven inputs) -------------------------------------------------------------
    def join(
        self, divide_by_initial_world_size: bool = True, enable: bool = True, throw_on_early_termination: bool = False
    ) -> AbstractContextManager[None]:
        """Context manager for ranks with different numbers of inputs (torch's DDP ``join``).

        Inside it every forward first joins one small all-reduce of "still active" flags.
        A rank that leaves the block (out of inputs) then shadows the others: for each of
        their steps it joins that all-reduce, their buffer broadcast and their gradient
        reductions (with zero gradients, through the comm hook if any), until every rank
        has left; finally the parameters (and buffers) are broadcast from the last rank to
        leave, so all ranks end with the same model.

        Args:
            divide_by_initial_world_size: divide the gradient sum by the group size (True)
                or by the number of ranks still active in the step (False; built-in
                reduction only: hooks divide as they do).
            enable: False makes the context manager do nothing.
            throw_on_early_termination: raise RuntimeError on every rank as soon as one
                rank runs out of inputs, instead of shadowing.

        Every forward inside must be followed by ``ddp.backward`` (or be under
        :meth:`no_sync`); run evaluation through ``ddp.module``.
        """
        for name, flag in (
            ("divide_by_initial_world_size", divide_by_initial_world_size),
            ("enable", enable),
            ("throw_on_early_termination", throw_on_early_termination),
        ):
            check_bool(flag, name, _OP)
        return self._join(_JoinConfig(enable, divide_by_initial_world_size, throw_on_early_termination))

    @contextlib.contextmanager
    def _join(self, config: _JoinConfig) -> Iterator[None]:
        if not config.enable:
            yield
            return
        if self._join_config is not None:
            raise RuntimeError(f"{prefix('DistributedDataParallel.join')} join() contexts cannot be nested")
        self._join_config = config
        try:
            yield
            self._shadow_until_all_joined(config)
        finally:
            self._join_config = None

    def _join_all_reduce(self, active: bool, buffers: bool = False) -> _JoinInfo:
        """The per-step join all-reduce: [active flag per group rank..., grads, buffers] summed."""
        g = self.process_group
        n = g.size()
        flags = np.zeros(n + 2, dtype=np.int64)
        if active:
            flags[g.rank()] = 1
            flags[n] = int(self._sync_this_step)
            flags[n + 1] = int(buffers)
        all_reduce(flags, ReduceOp.SUM, g)
        alive = np.flatnonzero(flags[:n])
        authority = g.ranks[int(alive[-1])] if alive.size else -1
        return _JoinInfo(int(alive.size), authority, bool(flags[n]), bool(flags[n + 1]))

    def _shadow_until_all_joined(self, config: _JoinConfig) -> None:
        """A rank out of inputs: mirror the others' collectives until every rank is out."""
        tl = self._timeline
        is_last = True
        while True:
            start = tl.now() if tl is not None else 0.0
            info = self._join_all_reduce(active=False)
            if info.active == 0:
                break
            if config.throw_on_early_termination:
                raise RuntimeError(
                    f"{prefix(_OP)} rank {runtime.state().rank} exhausted all inputs (throw_on_early_termination=True)"
                )
            is_last = False
            if info.buffers:
                self._broadcast_buffers(info.authority)
            if info.grads:
                self.reducer.shadow()
            if tl is not None:
                tl.complete("join_shadow", "step", start, args={"active": info.active})
        self._sync_final_model(is_last)
        if tl is not None:
            tl.flush()

    def _sync_final_model(self, is_last_joiner: bool) -> None:
        """Broadcast the model from the highest rank among the last to join (torch)."""
        g = self.process_group
        rank = np.array([g.rank() if is_last_joiner else -1], dtype=np.int64)
        all_reduce(rank, ReduceOp.MAX, g)
        self._sync_module_states(g.ranks[int(rank[0])], self.forward_sync_buffers)

    # -- conveniences forwarded to the module -------------------------------------------
    def parameters(self) -> list[Any]:
        return self._params

    def named_parameters(self) -> list[tuple[str, Any]]:
        """``("module.<name>", Parameter)`` pairs: torch's DDP is a Module holding ``module``."""
        return [(_PREFIX + name, p) for name, p in self.module.named_parameters()]

    def buffers(self) -> list[Any]:
        return cast("list[Any]", self.module.buffers())  # an mpidist.nn.Module's buffers

    def named_buffers(self) -> list[tuple[str, Any]]:
        """``("module.<name>", array)`` pairs, as :meth:`named_parameters`."""
        return [(_PREFIX + name, b) for name, b in self.module.named_buffers()]

    def state_dict(self) -> dict[str, Any]:
        """The module's state dict with torch DDP's ``"module."`` key prefix (live arrays, not copies).

        As torch: ``ddp.load_state_dict(ddp.state_dict())`` round-trips; a bare model loads it
        after ``mpidist.nn.consume_prefix_in_state_dict_if_present(state, "module.")``, and a
        bare model's state dict loads into the wrapped one with ``ddp.module.load_state_dict``.
        """
        return {_PREFIX + key: value for key, value in self.module.state_dict().items()}

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True) -> None:
        """Load a state dict whose keys carry the ``"module."`` prefix (torch's DDP), in place.

        Raises:
            TypeError: ``state`` is not a mapping, or a dtype differs (see
                :meth:`mpidist.nn.Module.load_state_dict`).
            ValueError: ``strict`` and the keys differ from :meth:`state_dict`'s (naming the
                missing and unexpected keys, and saying what to do when they are a bare
                model's keys); a shape differs.
        """
        op = "DistributedDataParallel.load_state_dict"
        own = self.state_dict()
        missing, unexpected = mismatched_keys(state, own, op)
        if strict and (missing or unexpected):
            bare = unexpected and all(_PREFIX + k in own for k in unexpected)
            hint = (
                (
                    f"; these are the bare model's keys, without torch DDP's {_PREFIX!r} prefix: load them with "
                    f"ddp.module.load_state_dict(state)"
                )
                if bare
                else ""
            )
            raise ValueError(f"{prefix(op)} keys do not match: missing {missing}, unexpected {unexpected}{hint}")
        self.module.load_state_dict({k[len(_PREFIX) :]: v for k, v in state.items() if k in own}, strict=strict)

    def train(self, mode: bool = True) -> DistributedDataParallel:
        self.module.train(mode)
        return self

    def eval(self) -> DistributedDataParallel:
        return self.train(False)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.module.zero_grad(set_to_none)

    @property
    def bucket_sizes(self) -> list[int]:
        """Number of elements in each bucket, in launch order."""
        return [b.flat.size for b in self.reducer.buckets]

    @property
    def bucket_parameter_names(self) -> list[list[str]]:
        """Names of the parameters in each bucket, in launch order."""
        return [[p.name for p in b.params] for b in self.reducer.buckets]


def _same_device(value: Any, allowed: tuple[int, str]) -> bool:
    """True if ``value`` (an int index or a "cuda:N" string) names the device in ``allowed``."""
    return not isinstance(value, bool) and value in allowed


def _timed(tl: Timeline, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        start = tl.now()
        try:
            return fn(*args, **kwargs)
        finally:
            tl.complete(name, "layers", start)

    return run
