"""The Reducer behind DistributedDataParallel: buckets, grad-ready hooks, reductions.

After torch's C++ ``Reducer`` (torch/csrc/distributed/c10d/reducer.cpp; Li et al.,
"PyTorch Distributed: Experiences on Accelerating Data Parallel Training", VLDB 2020)
and Horovod's Tensor Fusion; how a step works: docs/ddp.md, "How a step works". Buckets
live on the parameters' device (numpy or cupy); bookkeeping stays on the host.
"""

from __future__ import annotations

import concurrent.futures
import math
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Optional

import numpy as np

from mpidist._arrays.buffers import mpi_reducible
from mpidist._arrays.namespace import array_module
from mpidist._arrays.reduce_op import ReduceOp
from mpidist._core.group import ProcessGroup
from mpidist.collectives import all_reduce
from mpidist.errors import prefix
from mpidist.nn._data import as_data_array
from mpidist.nn._util import copy_into, on_device
from mpidist.parallel.comm_hooks import GradBucket
from mpidist.parallel.timeline import Timeline

__all__ = ["Reducer", "assign_buckets", "DEFAULT_FIRST_BUCKET_BYTES"]

#: torch's ``dist._DEFAULT_FIRST_BUCKET_BYTES``: cap of the first bucket launched (the
#: last layers' gradients) when ``bucket_cap_mb`` is left at its default.
DEFAULT_FIRST_BUCKET_BYTES = 2**20


@dataclass(eq=False)
class Bucket:
    """Gradients of ``params`` packed end to end in ``flat`` (one dtype per bucket)."""

    index: int
    params: list[Any]
    indices: list[int]  # positions of params in Reducer.params
    offsets: list[int]
    flat: Any  # on the parameters' device
    views: list[Any]  # flat[offsets[k]:offsets[k+1]] shaped like params[k]
    xp: ModuleType  # flat's array module (numpy or cupy)
    n_ready: int = 0
    launched: bool = False
    pending: Any = None  # the Work (built-in reduction) or Future (comm hook)
    started_us: float = 0.0


def assign_buckets(params: list[Any], limits: list[int]) -> list[list[int]]:
    """Indices of ``params`` per bucket, torch's ``compute_bucket_assignment_by_size``.

    Parameters are taken in reverse order; each dtype fills its own open bucket; a
    bucket closes once its size reaches its limit (so it may exceed it by the last
    parameter). A dtype's k-th bucket gets ``limits[min(k, len(limits) - 1)]``. Buckets
    come in the order they close, then the still-open ones by first parameter.
    """
    open_: dict[np.dtype, tuple[list[int], int]] = {}  # dtype -> (indices, bytes)
    count: dict[np.dtype, int] = {}  # dtype -> buckets closed so far
    closed: list[list[int]] = []
    for i in reversed(range(len(params))):
        dt = params[i].dtype
        idx, size = open_.get(dt, ([], 0))
        idx.append(i)
        size += params[i].data.nbytes
        k = count.get(dt, 0)
        if size >= limits[min(k, len(limits) - 1)]:
            closed.append(idx)
            count[dt] = k + 1
            open_.pop(dt, None)
        else:
            open_[dt] = (idx, size)
    return closed + sorted((idx for idx, _ in open_.values()), key=lambda idx: -idx[0])


def _make_bucket(index: int, params: list[Any], indices: list[int]) -> Bucket:
    members = [params[i] for i in indices]
    offsets = np.cumsum([0] + [p.size for p in members]).tolist()
    data = members[0].data
    xp = array_module(data)
    with on_device(data):
        flat = xp.zeros(offsets[-1], dtype=members[0].dtype)
    # the parameters' grad type (DataArray on the host): assigning a view to p.grad keeps it
    typed = as_data_array(flat)
    views = [typed[offsets[k] : offsets[k + 1]].reshape(p.shape) for k, p in enumerate(members)]
    return Bucket(index, members, list(indices), offsets, flat, views, xp)


class Reducer:
    """Averages the gradients of ``params`` over ``group`` during backward.

    DDP drives it: :meth:`prepare` before the module's backward (``div``: what the
    built-in reduction divides by), :meth:`mark_ready` from each parameter's
    post-accumulate-grad hook, :meth:`finalize` after. Outside that window the hooks only
    record which parameters got gradients (``no_sync`` accumulation).

    ``limits``: bucket size limits in bytes, see :func:`assign_buckets`.
    ``skip_all_reduce_unused_params``: docs/ddp.md, "``skip_all_reduce_unused_params=True``".
    """

    def __init__(
        self,
        params: list[Any],
        group: ProcessGroup,
        *,
        limits: list[int],
        gradient_as_bucket_view: bool,
        algorithm: Optional[str],
        find_unused_parameters: bool,
        static_graph: bool,
        skip_all_reduce_unused_params: bool = False,
        timeline: Optional[Timeline],
    ) -> None:
        self.params = params
        self.group = group
        self.view_mode = gradient_as_bucket_view
        self.algorithm = algorithm
        self.find_unused = find_unused_parameters
        self.static_graph = static_graph
        self.skip_unused = skip_all_reduce_unused_params and (find_unused_parameters or static_graph)
        self.timeline = timeline
        self.hook: Optional[Callable[[Any, GradBucket], concurrent.futures.Future[Any]]] = None
        self.hook_state: Any = None
        self.buckets = [_make_bucket(k, params, idx) for k, idx in enumerate(assign_buckets(params, limits))]
        self._where = {id(p): (i, b, pos) for b in self.buckets for pos, (i, p) in enumerate(zip(b.indices, b.params))}
        self._ready = [False] * len(params)
        self.used = np.zeros(len(params), dtype=bool)  # got a gradient since the last reduction
        self.syncing = False
        self.div = group.size()
        self._next = 0
        self._late: list[str] = []
        self._static_local: Optional[np.ndarray] = None
        self._static_global: Optional[np.ndarray] = None
        # the used-parameter counts as last all-reduced (torch's local_used_map_dev_), which a
        # joined rank re-sends while it shadows the others
        self._used_counts: Optional[np.ndarray] = None
        self.skipped: frozenset[int] = frozenset()  # buckets not reduced (skip_all_reduce_unused_params)
        self._skip_decided = False
        if self.view_mode:  # grads that exist already become bucket views (torch)
            for p in params:
                if p.grad is not None:
                    self._copy_in(p, *self._where[id(p)][1:])
        self.handles = [p.register_post_accumulate_grad_hook(self.mark_ready) for p in params]

    # -- during backward -----------------------------------------------------------------
    def prepare(self, div: int) -> None:
        """Start a synchronized backward whose built-in reduction divides by ``div``."""
        self.div = div
        self.syncing = True

    def mark_ready(self, param: Any) -> None:
        """The post-accumulate-grad hook: copy the grad into its bucket, launch full buckets."""
        i, b, pos = self._where[id(param)]
        self.used[i] = True
        if not self.syncing:
            return
        if self._ready[i]:  # a second accumulation in one backward (a shared parameter)
            if b.launched:
                self._late.append(param.name or f"parameter {i}")
            else:
                self._copy_in(param, b, pos)
            return
        self._ready[i] = True
        self._copy_in(param, b, pos)
        b.n_ready += 1
        if b.n_ready == len(b.params):
            if self.timeline is not None:
                self.timeline.instant("bucket_ready", f"bucket {b.index}", {"bucket": b.index})
            if b.index == self._next:
                self._launch_ready()

    def _copy_in(self, param: Any, b: Bucket, pos: int) -> None:
        view, grad = b.views[pos], param.grad
        if self.view_mode:
            if grad is not view:
                view[...] = grad
                param.grad = view
        elif self.hook is None and self.div != 1:
            b.xp.divide(grad, self.div, out=view)  # torch divides while copying into the bucket
        else:
            view[...] = grad

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].n_ready == len(
            self.buckets[self._next].params
        ):
            self._launch(self.buckets[self._next])
            self._next += 1

    def _reduce(self, index: int, flat: Any, views: Optional[list[Any]], divided: bool) -> Any:
        """Start reducing one bucket's ``flat``: the built-in all-reduce or the comm hook."""
        if self.hook is None:
            if not divided and self.div != 1:
                flat /= self.div
            algorithm = self.algorithm if self.algorithm != "mpi" or mpi_reducible(flat.dtype) else None
            return all_reduce(flat, ReduceOp.SUM, self.group, async_op=True, algorithm=algorithm)
        b = self.buckets[index]
        bucket = GradBucket(index, flat, b.params, b.offsets, index == len(self.buckets) - 1, views)
        fut = self.hook(self.hook_state, bucket)
        if not isinstance(fut, concurrent.futures.Future):
            raise TypeError(
                f"{prefix('DistributedDataParallel')} the comm hook must return a "
                f"concurrent.futures.Future, got {type(fut).__name__}"
            )
        return fut

    def _launch(self, b: Bucket) -> None:
        b.launched = True
        if b.index in self.skipped:
            return  # skip_all_reduce_unused_params: no rank uses these parameters
        tl = self.timeline
        if tl is not None:
            b.started_us = tl.now()
        b.pending = self._reduce(b.index, b.flat, b.views, divided=not self.view_mode)
        if tl is not None:
            future = b.pending if self.hook is not None else b.pending.get_future()
            args = {
                "bucket": b.index,
                "bytes": int(b.flat.nbytes),
                "hook": getattr(self.hook, "__name__", "allreduce") if self.hook else "builtin",
            }
            start, row = b.started_us, f"bucket {b.index}"
            future.add_done_callback(lambda _f: tl.complete("allreduce", row, start, args=args))

    # -- after backward ----------------------------------------------------------------------
    def finalize(self) -> None:
        """Deal with parameters that got no gradient, wait for every bucket, write the grads.

        Raises (on this rank, after its collectives completed, so no peer hangs):
            RuntimeError: parameters without a gradient and neither find_unused_parameters
                nor static_graph; a parameter accumulated again after its bucket left; with
                static_graph, the set of parameters with gradients changed.
        """
        try:
            error = self._fill_missing()
            skipped = self.skipped
            global_used = self._global_used()
            self._wait_all()
            error = error or self._check_static() or self._check_skipped(skipped, global_used)
            if error is not None:
                raise RuntimeError(error)
            self._write_back(global_used)
            if self._late:
                raise RuntimeError(
                    f"{prefix('DistributedDataParallel.backward')} parameters {self._late} got "
                    f"gradient again after their bucket's reduction started (a parameter used "
                    f"twice in one forward); their .grad lacks the later contributions"
                )
        finally:
            self.reset()

    def _fill_missing(self) -> Optional[str]:
        missing = [i for i, ready in enumerate(self._ready) if not ready]
        if not missing:
            return None
        allowed = self.find_unused or self.static_graph
        for i in missing:
            _, b, pos = self._where[id(self.params[i])]
            p = self.params[i]
            if allowed and self.used[i] and p.grad is not None:
                self._copy_in(p, b, pos)  # accumulated under no_sync, not in this backward
            else:
                b.views[pos][...] = 0  # Horovod: zeros, so every rank reduces every bucket
            self._ready[i] = True
            b.n_ready += 1
        self._launch_ready()
        if allowed:
            return None
        names = [self.params[i].name or f"parameter {i}" for i in missing]
        return (
            f"{prefix('DistributedDataParallel.backward')} parameters got no gradient in this backward "
            f"pass: {names}; every parameter must take part in the loss, or construct "
            f"DistributedDataParallel with find_unused_parameters=True"
        )

    def _global_used(self, local: Optional[np.ndarray] = None) -> Optional[np.ndarray]:
        """Which parameters got a gradient on any rank (one small all-reduce), or None.

        ``local``: the counts to contribute instead of this backward's (a joined rank's)."""
        if not (self.find_unused or (self.static_graph and self._static_global is None)):
            return self._static_global
        counts = self.used.astype(np.int32) if local is None else local
        all_reduce(counts, ReduceOp.SUM, self.group)
        self._used_counts = counts
        used = counts > 0
        if self.static_graph and self._static_global is None:
            self._static_global = used
        if self.skip_unused and not self._skip_decided:
            self._skip_decided = True
            self.skipped = frozenset(b.index for b in self.buckets if not used[b.indices].any())
        return used

    def _check_skipped(self, skipped: frozenset[int], global_used: Optional[np.ndarray]) -> Optional[str]:
        """skip_all_reduce_unused_params: a skipped bucket's parameter got a gradient somewhere."""
        if not skipped or global_used is None:
            return None
        names = [
            self.params[i].name or f"parameter {i}"
            for i in sorted(i for b in self.buckets if b.index in skipped for i in b.indices)
            if global_used[i]
        ]
        if not names:
            return None
        return (
            f"{prefix('DistributedDataParallel.backward')} skip_all_reduce_unused_params=True, but parameters "
            f"{names} got a gradient on some rank, and their buckets are no longer reduced (no rank used them "
            f"in the first synchronized step); their .grad holds unreduced local gradients. Construct "
            f"DistributedDataParallel without skip_all_reduce_unused_params if the set of unused parameters "
            f"changes"
        )

    def _check_static(self) -> Optional[str]:
        if not self.static_graph:
            return None
        if self._static_local is None:
            self._static_local = self.used.copy()
            return None
        if np.array_equal(self._static_local, self.used):
            return None
        changed = [self.params[i].name or f"parameter {i}" for i in np.flatnonzero(self._static_local != self.used)]
        return (
            f"{prefix('DistributedDataParallel.backward')} static_graph=True, but parameters {changed} "
            f"changed between getting and not getting a gradient since the first iteration"
        )

    def _wait_all(self, pending: Optional[list[Any]] = None) -> None:
        """Wait for every bucket's reduction; copy hook results in; re-raise the first error."""
        first: Optional[BaseException] = None
        for b, job in zip(self.buckets, pending if pending is not None else [b.pending for b in self.buckets]):
            if job is None:
                continue  # a skipped bucket
            try:
                if self.hook is None:
                    job.wait()
                else:
                    self._take_hook_result(b, job.result(), copy=pending is None)
            except BaseException as exc:  # noqa: BLE001  (every bucket first, then raise)
                first = first or exc
        if first is not None:
            raise first

    def _take_hook_result(self, b: Bucket, result: Any, copy: bool) -> None:
        if not hasattr(result, "shape") or math.prod(result.shape) != b.flat.size:
            raise ValueError(
                f"{prefix('DistributedDataParallel')} the comm hook's future must hold an array of "
                f"{b.flat.size} elements for bucket {b.index}, got "
                f"{getattr(result, 'shape', type(result).__name__)}"
            )
        if copy and result is not b.flat:  # from any device (a host result for a GPU bucket), as torch
            copy_into(b.flat, result, "DistributedDataParallel")

    def _write_back(self, global_used: Optional[np.ndarray]) -> None:
        for b in self.buckets:
            if b.index in self.skipped:
                continue
            for i, p, view in zip(b.indices, b.params, b.views):
                if global_used is not None and not global_used[i]:
                    continue  # no rank produced a gradient: leave .grad as it is (torch)
                if self.view_mode:
                    p.grad = view
                elif p.grad is None:
                    p.grad = view.copy()
                else:
                    p.grad[...] = view

    def reset(self) -> None:
        """Forget this backward's progress (also after an error)."""
        self.syncing = False
        self._next = 0
        self._late = []
        self._ready = [False] * len(self.params)
        self.used[:] = False
        for b in self.buckets:
            b.n_ready, b.launched, b.pending = 0, False, None

    # -- join ------------------------------------------------------------------------------------
    def shadow(self) -> None:
        """A joined rank's backward: the same collectives as the others', on zeros (torch's
        ``_match_all_reduce_for_bwd_pass``); gradients and buckets are not touched. With
        find_unused_parameters it re-sends the used counts it last all-reduced (zeros before
        any step), as torch's ``_match_unused_params_allreduce``: docs/ddp.md, "``join()``"."""
        pending: list[Any] = []  # per bucket: its Work or hook Future, None when skipped
        for b in self.buckets:
            if b.index in self.skipped:
                pending.append(None)
                continue
            with on_device(b.flat):
                zeros = b.xp.zeros_like(b.flat)
            pending.append(self._reduce(b.index, zeros, None, divided=True))
        last = self._used_counts if self.find_unused and self._used_counts is not None else None
        self._global_used(np.zeros(len(self.params), dtype=np.int32) if last is None else last)
        self._wait_all(pending)
