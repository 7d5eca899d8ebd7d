"""DistributedDataParallel for mpidist's array models: bucketed gradient averaging
overlapped with backward.

The scheme is torch's DDP Reducer (Li et al., "PyTorch Distributed: Experiences on
Accelerating Data Parallel Training", VLDB 2020) and Horovod's Tensor Fusion: gradients
are packed into buckets of about ``bucket_cap_mb`` in reverse parameter order (the
order backward produces them), and each bucket's all-reduce starts, asynchronously, as
soon as its last gradient is ready, while backward goes on computing earlier layers.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from mpidist import _runtime
from mpidist._array import array_module
from mpidist.collectives import ALGORITHMS, all_reduce, broadcast
from mpidist.gather_scatter import all_gather_into_tensor
from mpidist.errors import prefix
from mpidist.group import ProcessGroup
from mpidist.reduce_op import ReduceOp
from mpidist.work import Work

__all__ = ["DistributedDataParallel"]


@dataclass
class _Bucket:
    """Gradients of ``params`` packed end to end in ``flat`` (one dtype per bucket)."""

    params: list
    offsets: list
    flat: Any
    pending: int = 0
    work: Optional[Work] = None
    ready: set = field(default_factory=set)


class DistributedDataParallel:
    """Wrap ``module`` so that backward leaves the gradient averaged over the group.

    Args:
        module: an :class:`mpidist.nn.Module` (parameters numpy or cupy arrays). Its
            parameters are broadcast from the group's rank 0 at construction, so every
            rank starts from the same weights; the module is used in place.
        process_group: the group to average over (default: all ranks).
        bucket_cap_mb: bucket size in MiB (2**20 bytes), as torch's ``bucket_cap_mb``.
        broadcast_buffers: broadcast the module's buffers from rank 0 at every forward.
        algorithm: mpidist extension: ``"mpi"`` (MPI_Allreduce) or ``"ring"``
            (:func:`mpidist.algorithms.ring_all_reduce`).

    Differences from torch: there is no autograd, so call ``ddp.backward(grad_output)``
    (the gradient of the loss with respect to the module's output, e.g.
    ``criterion.backward()``) where torch calls ``loss.backward()``. It returns when
    every parameter's ``.grad`` holds the group average (sum / world size) of the
    ranks' gradients; results are bitwise identical on every rank.

    Raises:
        ValueError: the ranks' models differ in parameter shapes or dtypes (checked at
            construction, naming the ranks), bad ``bucket_cap_mb`` or ``algorithm``.
        RuntimeError: a parameter got no gradient in a backward pass.
    """

    def __init__(self, module: Any, process_group: Optional[ProcessGroup] = None,
                 bucket_cap_mb: float = 25, broadcast_buffers: bool = True, *,
                 algorithm: str = "mpi") -> None:
        where = prefix("DistributedDataParallel")
        if algorithm not in ALGORITHMS:
            raise ValueError(f"{where} algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
        if not bucket_cap_mb > 0:
            raise ValueError(f"{where} bucket_cap_mb must be > 0, got {bucket_cap_mb!r}")
        self.module = module
        self.process_group = _runtime.resolve_group(process_group)
        self.broadcast_buffers = broadcast_buffers
        self.algorithm = algorithm
        self.bucket_cap_mb = bucket_cap_mb
        self._params = list(module.parameters())
        self._src = self.process_group.global_rank(0)
        self._verify_same_model(where)
        for p in self._params:
            broadcast(p.data, self._src, self.process_group)
        self._sync_buffers()
        self._buckets = self._build_buckets(int(bucket_cap_mb * 2**20))
        self._bucket_of = {id(p): (b, i) for b in self._buckets for i, p in enumerate(b.params)}
        self._next_launch = 0
        self._handles = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in self._params]

    # -- construction -----------------------------------------------------------------
    def _verify_same_model(self, where: str) -> None:
        spec = ";".join(f"{tuple(p.shape)}:{np.dtype(p.dtype).str}" for p in self._params)
        digest = np.frombuffer(hashlib.sha256(spec.encode()).digest()[:8], dtype=np.int64).copy()
        g = self.process_group
        every = np.empty(g.size(), dtype=np.int64)
        all_gather_into_tensor(every, digest, g)
        differ = [g.ranks[i] for i in range(g.size()) if every[i] != every[0]]
        if differ:
            raise ValueError(f"{where} the model's parameter shapes/dtypes on ranks {differ} differ from "
                             f"rank {g.ranks[0]}'s; every rank must build the same model")

    def _build_buckets(self, cap_bytes: int) -> list:
        buckets: list = []
        current: list = []
        size = 0
        for p in reversed(self._params):
            if current and (size + p.data.nbytes > cap_bytes or p.dtype != current[0].dtype):
                buckets.append(current)
                current, size = [], 0
            current.append(p)
            size += p.data.nbytes
        if current:
            buckets.append(current)
        out = []
        for params in buckets:
            offsets = np.cumsum([0] + [p.data.size for p in params]).tolist()
            xp = array_module(params[0].data)
            out.append(_Bucket(params, offsets, xp.empty(offsets[-1], dtype=params[0].dtype)))
        return out

    def _sync_buffers(self) -> None:
        if self.broadcast_buffers and self.process_group.size() > 1:
            for _, buf in self.module.named_buffers():
                broadcast(buf, self._src, self.process_group)

    # -- the step ---------------------------------------------------------------------
    def forward(self, *inputs: Any) -> Any:
        """Run the module's forward (after broadcasting buffers from rank 0 if asked)."""
        self._sync_buffers()
        return self.module(*inputs)

    __call__ = forward

    def _grad_ready(self, param: Any) -> None:
        bucket, i = self._bucket_of[id(param)]
        if id(param) in bucket.ready:
            return
        bucket.ready.add(id(param))
        lo, hi = bucket.offsets[i], bucket.offsets[i + 1]
        bucket.flat[lo:hi] = param.grad.reshape(-1)
        if len(bucket.ready) == len(bucket.params):
            self._launch_ready()

    def _launch_ready(self) -> None:
        # Launch in bucket order only, so every rank issues the same collectives in the
        # same order even if buckets fill in a different order.
        while (self._next_launch < len(self._buckets)
               and len(self._buckets[self._next_launch].ready) == len(self._buckets[self._next_launch].params)):
            b = self._buckets[self._next_launch]
            b.work = all_reduce(b.flat, ReduceOp.AVG, self.process_group, async_op=True,
                                algorithm=self.algorithm)
            self._next_launch += 1

    def backward(self, grad_output: Any) -> Any:
        """Backward through the module, averaging gradients across the group on the way.

        Returns the module's gradient with respect to its input. When it returns, every
        parameter's ``.grad`` holds the average over the group's ranks.
        """
        self._next_launch = 0
        for b in self._buckets:
            b.ready.clear()
            b.work = None
        grad_input = self.module.backward(grad_output)
        if self._next_launch != len(self._buckets):
            missing = [p.name for p in self._params if id(p) not in self._bucket_of[id(p)][0].ready]
            raise RuntimeError(f"{prefix('DistributedDataParallel.backward')} parameters got no gradient "
                               f"in this backward pass: {missing}; every parameter must take part in "
                               f"the loss")
        for b in self._buckets:
            b.work.wait()
            for i, p in enumerate(b.params):
                p.grad[...] = b.flat[b.offsets[i]:b.offsets[i + 1]].reshape(p.grad.shape)
        return grad_input

    # -- conveniences forwarded to the module -------------------------------------------
    def parameters(self) -> list:
        return self._params

    def named_parameters(self) -> list:
        return list(self.module.named_parameters())

    def state_dict(self) -> dict:
        return self.module.state_dict()

    def load_state_dict(self, state: dict, strict: bool = True) -> None:
        self.module.load_state_dict(state, strict=strict)

    def train(self, mode: bool = True) -> "DistributedDataParallel":
        self.module.train(mode)
        return self

    def eval(self) -> "DistributedDataParallel":
        return self.train(False)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.module.zero_grad(set_to_none)

    @property
    def bucket_sizes(self) -> list:
        """Number of elements in each bucket, in launch order."""
        return [b.flat.size for b in self._buckets]
