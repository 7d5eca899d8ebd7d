"""DDP communication hooks: the ``GradBucket`` a hook sees, and torch's built-in hooks.

``hook(state, bucket) -> concurrent.futures.Future`` replaces how DistributedDataParallel
reduces one bucket (``DistributedDataParallel.register_comm_hook``; torch docs "DDP
Communication Hooks"); the future completes with a flat array of ``bucket.buffer()``'s
size. torch's ``torch.futures.Future`` is a ``concurrent.futures.Future`` here
(:func:`then` gives torch's chaining). Built-in hooks, as
``torch.distributed.algorithms.ddp_comm_hooks``: :func:`allreduce_hook`,
:func:`fp16_compress_hook`, :func:`bf16_compress_hook`, :func:`powerSGD_hook`. All compute
in the bucket's array module (numpy or cupy) and on its device, also in their completion
callbacks (which may run on another thread). Contract, callbacks and the engine thread,
accuracy: docs/ddp.md, "Communication hooks".
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import numbers
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any, Callable, Optional, cast

import numpy as np

from mpidist._arrays.namespace import array_module
from mpidist._arrays.reduce_op import ReduceOp
from mpidist._core.group import ProcessGroup
from mpidist._dispatch.dispatch import member
from mpidist.collectives import all_reduce
from mpidist.errors import prefix
from mpidist.nn._util import check_bool, check_int, copy_into, on_device
from mpidist.work import Work

__all__ = [
    "GradBucket",
    "then",
    "allreduce_hook",
    "fp16_compress_hook",
    "bf16_compress_hook",
    "PowerSGDState",
    "powerSGD_hook",
    "default_hooks",
    "powerSGD",
]

logger = logging.getLogger(__name__)

Future = concurrent.futures.Future


class GradBucket:
    """One bucket of gradients handed to a comm hook (``torch.distributed.GradBucket``).

    ``buffer()`` is the flat array (1-D, the parameters' dtype and device) that DDP reduces;
    ``gradients()`` are views into it, one per parameter, shaped like the parameters, in
    ``parameters()`` order. ``index()`` counts buckets in launch order: 0 holds the last
    layers' gradients (ready first); ``is_last()`` is true for the bucket launched last
    in a step (the first layers). Buckets are fixed at construction (torch rebuilds them
    once after the first step, so torch warns not to rely on early indices).
    """

    __slots__ = ("_index", "_buffer", "_params", "_offsets", "_is_last", "_grads")

    def __init__(
        self,
        index: int,
        buffer: Any,
        parameters: Sequence[Any],
        offsets: Sequence[int],
        is_last: bool,
        gradients: Optional[list[Any]] = None,
    ) -> None:
        self._index = index
        self._buffer = buffer
        self._params = list(parameters)
        self._offsets = offsets
        self._is_last = is_last
        self._grads = gradients

    def index(self) -> int:
        """Position of this bucket in launch order (0: launched first)."""
        return self._index

    def buffer(self) -> Any:
        """The flat gradient buffer, 1-D (numpy or cupy)."""
        return self._buffer

    def gradients(self) -> list[Any]:
        """Per-parameter views into :meth:`buffer`, shaped like :meth:`parameters`."""
        if self._grads is None:
            b, o = self._buffer, self._offsets
            self._grads = [b[o[i] : o[i + 1]].reshape(p.shape) for i, p in enumerate(self._params)]
        return self._grads

    def parameters(self) -> list[Any]:
        """The :class:`mpidist.nn.Parameter` objects whose gradients the bucket holds."""
        return self._params

    def is_last(self) -> bool:
        """True for the last bucket to be reduced in a step."""
        return self._is_last

    def set_buffer(self, buffer: Any) -> None:
        """Copy ``buffer`` (same size, any device) into the bucket's buffer (torch replaces the tensor)."""
        copy_into(self._buffer, buffer, "GradBucket.set_buffer")

    def __repr__(self) -> str:
        return (
            f"GradBucket(index={self._index}, numel={self._buffer.size}, dtype={self._buffer.dtype}, "
            f"parameters={len(self._params)}, is_last={self._is_last})"
        )


def then(future: Future[Any], fn: Callable[[Future[Any]], Any]) -> Future[Any]:
    """torch's ``Future.then``: a future completed with ``fn(future)`` once ``future`` is done.

    ``fn`` runs on the thread that completes ``future`` (or at once, here, if it is done);
    an exception raised by ``fn`` (or re-raised by ``future.result()``) completes the new
    future with that exception.
    """
    out: Future[Any] = Future()

    def run(done: Future[Any]) -> None:
        try:
            out.set_result(fn(done))
        except BaseException as exc:  # noqa: BLE001  (delivered through the future)
            out.set_exception(exc)

    future.add_done_callback(run)
    return out


def _group(process_group: Optional[ProcessGroup], op: str) -> ProcessGroup:
    g = member(process_group)
    if g is None:
        raise ValueError(f"{prefix(op)} this rank is not a member of the hook's process_group")
    return g


def _allreduce_fut(g: ProcessGroup, tensor: Any) -> Future[Any]:
    """Divide ``tensor`` by the group size, start a SUM all-reduce; future of ``tensor``."""
    if g.size() > 1:
        tensor /= g.size()
    work = cast(Work, all_reduce(tensor, ReduceOp.SUM, g, async_op=True))  # a member's async op: a Work
    return then(work.get_future(), lambda f: f.result()[0])


def allreduce_hook(process_group: Optional[ProcessGroup], bucket: GradBucket) -> Future[Any]:
    """Average the bucket: divide by the group size, then SUM all-reduce, in place.

    torch: ``default_hooks.allreduce_hook``. ``process_group`` (the hook state) None means
    the default group. DDP's built-in reduction (no hook) gives bitwise the same result.
    """
    return _allreduce_fut(_group(process_group, "allreduce_hook"), bucket.buffer())


def _compress_hook(process_group: Optional[ProcessGroup], bucket: GradBucket, dtype: Any, op: str) -> Future[Any]:
    g = _group(process_group, op)
    buffer = bucket.buffer()
    xp = array_module(buffer)
    with on_device(buffer), np.errstate(over="ignore"):  # beyond the dtype's range: inf, silently (torch)
        # torch: buffer.to(dtype).div_(world_size): cast (rounding once), then divide computing in
        # float32 (torch's opmath for half types) and round again; bitwise torch's result
        compressed = buffer.astype(dtype)
        xp.divide(compressed, g.size(), out=compressed, dtype=np.float32, casting="same_kind")
    work = cast(Work, all_reduce(compressed, ReduceOp.SUM, g, async_op=True))  # a member's async op: a Work

    def decompress(done: Future[Any]) -> Any:
        copy_into(buffer, done.result()[0], op)
        return buffer

    return then(work.get_future(), decompress)


def fp16_compress_hook(process_group: Optional[ProcessGroup], bucket: GradBucket) -> Future[Any]:
    """Reduce the bucket in float16: cast, divide by the group size, SUM, cast back in place.

    torch: ``default_hooks.fp16_compress_hook``, same order and rounding (the division in
    float32, rounded to float16, as torch's ``div_``): each rank sends bitwise what torch's
    would. The sum runs in float16 (mpidist's ring). Relative error about 1e-3 of the
    bucket's magnitude; values beyond 65504 become inf (docs/ddp.md, "Communication hooks").
    """
    return _compress_hook(process_group, bucket, np.float16, "fp16_compress_hook")


def bf16_compress_hook(process_group: Optional[ProcessGroup], bucket: GradBucket) -> Future[Any]:
    """Reduce the bucket in bfloat16 (``ml_dtypes.bfloat16``), like :func:`fp16_compress_hook`.

    torch: ``default_hooks.bf16_compress_hook``: cast to bfloat16, then divide (in float32,
    rounded to bfloat16), as torch. bfloat16 keeps float32's range with 8 significant bits:
    relative error about 1e-2 of the bucket's magnitude.

    Raises:
        ImportError: ml_dtypes is not installed.
    """
    import ml_dtypes  # noqa: PLC0415  (optional dependency)

    return _compress_hook(process_group, bucket, ml_dtypes.bfloat16, "bf16_compress_hook")


# -- PowerSGD ------------------------------------------------------------------------------
def _check_real(op: str, name: str, value: Any) -> None:
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not value >= 0:  # type: ignore[operator]  # numbers.Real's stub has no __ge__
        raise ValueError(f"{prefix(op)} {name} must be a real number >= 0, got {value!r}")


class PowerSGDState:
    """State of :func:`powerSGD_hook` (``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.PowerSGDState``).

    Same arguments and defaults as torch:

    Args:
        process_group: the group to reduce over (None: the default group); use DDP's.
        matrix_approximation_rank: r, the rank of the approximation of each gradient
            matrix (1 to 4 is typical; capped per matrix at min(rows, cols)).
        start_powerSGD_iter: steps of plain all-reduce before compression starts (a
            warm-up; the paper and torch recommend ~10% of training). Must be > 1 when
            error feedback or warm start is on (torch's rule).
        min_compression_rate: a matrix is compressed only when
            ``(rows + cols) * r * min_compression_rate < rows * cols``; others (and all
            1-D tensors, for r >= 1 and rate >= 1) are all-reduced uncompressed.
        use_error_feedback: add the previous step's local compression error to the
            gradient before compressing (the paper's error feedback).
        warm_start: reuse the previous step's Q (re-orthogonalized) instead of a fresh
            random one.
        orthogonalization_epsilon: added to column norms in Gram-Schmidt (0: none; a
            zero column then becomes zeros).
        random_seed: seed of the generator that seeds each fresh random Q; every rank
            uses the same, so the Q's agree across ranks without communication.
        compression_stats_logging_frequency: steps between compression-stats log lines
            (logger ``mpidist.parallel.comm_hooks``, INFO).
        batch_tensors_with_same_shape: accepted for torch compatibility; matrices are
            always compressed one by one here (same result up to float rounding).

    Attributes ``iter``, ``error_dict``, ``p_memory_dict``, ``q_memory_dict`` (by bucket
    index) and the compression counters mirror torch's. :meth:`compression_stats`
    returns ``(rate, numel_before, numel_after)``.

    Raises:
        TypeError / ValueError: an argument of the wrong type or out of range.
    """

    def __init__(
        self,
        process_group: Optional[ProcessGroup],
        matrix_approximation_rank: int = 1,
        start_powerSGD_iter: int = 1_000,
        min_compression_rate: float = 2,
        use_error_feedback: bool = True,
        warm_start: bool = True,
        orthogonalization_epsilon: float = 0,
        random_seed: int = 0,
        compression_stats_logging_frequency: int = 10_000,
        batch_tensors_with_same_shape: bool = False,
    ) -> None:
        op = "PowerSGDState"
        check_int(matrix_approximation_rank, "matrix_approximation_rank", op, 1)
        check_int(start_powerSGD_iter, "start_powerSGD_iter", op, 0)
        check_int(random_seed, "random_seed", op, 0)
        check_int(compression_stats_logging_frequency, "compression_stats_logging_frequency", op, 1)
        _check_real(op, "min_compression_rate", min_compression_rate)
        _check_real(op, "orthogonalization_epsilon", orthogonalization_epsilon)
        for name, flag in (
            ("use_error_feedback", use_error_feedback),
            ("warm_start", warm_start),
            ("batch_tensors_with_same_shape", batch_tensors_with_same_shape),
        ):
            check_bool(flag, name, op)
        if (use_error_feedback or warm_start) and start_powerSGD_iter <= 1:
            raise ValueError(
                f"{prefix(op)} expect start_powerSGD_iter > 1 if use_error_feedback or warm_start "
                f"is enabled, because PowerSGD can only be applied after the first two iterations "
                f"in DDP; got {start_powerSGD_iter}"
            )
        self.process_group = process_group
        self.matrix_approximation_rank = int(matrix_approximation_rank)
        self.start_powerSGD_iter = int(start_powerSGD_iter)
        self.min_compression_rate = min_compression_rate
        self.use_error_feedback = use_error_feedback
        self.warm_start = warm_start
        self.orthogonalization_epsilon = orthogonalization_epsilon
        self.rng = np.random.RandomState(random_seed)  # host: seeds only (same on every rank)
        self.error_dict: dict[int, Any] = {}  # arrays on the buckets' device
        self.p_memory_dict: dict[int, Any] = {}
        self.q_memory_dict: dict[int, Any] = {}
        self.iter = 0
        self.total_numel_before_compression = 0
        self.total_numel_after_compression = 0
        self.compression_stats_logging_frequency = max(1, int(compression_stats_logging_frequency))
        self.next_stats_report = 0
        self.batch_tensors_with_same_shape = batch_tensors_with_same_shape

    def maybe_increase_iter(self, bucket: GradBucket) -> None:
        """Count a step when the step's last bucket is processed (torch's rule)."""
        if bucket.is_last():
            self.iter += 1
        if self.iter == self.start_powerSGD_iter:
            logger.info("Start to apply PowerSGD after %s iterations.", self.iter)

    def compression_stats(self) -> tuple[float, int, int]:
        """``(numel_before / numel_after, numel_before, numel_after)`` over all compressed steps."""
        after = self.total_numel_after_compression
        rate = self.total_numel_before_compression / after if after > 0 else 0
        return rate, self.total_numel_before_compression, after


def _orthogonalize(matrix: Any, epsilon: float = 0) -> None:
    """Orthonormalize the columns of ``matrix`` (n x r, r <= n) in place.

    As torch: Gram-Schmidt for r <= 2 or half-precision dtypes, else a reduced QR
    (``xp.linalg.qr``: LAPACK's Householder for numpy, cuSOLVER's for cupy). Deterministic:
    identical inputs give identical outputs.
    """
    if matrix.shape[1] <= 2 or matrix.dtype.itemsize < 4:
        _gram_schmidt(matrix, epsilon)
    else:
        matrix[...] = array_module(matrix).linalg.qr(matrix)[0]


def _gram_schmidt(matrix: Any, epsilon: float) -> None:
    xp = array_module(matrix)
    cols = matrix.shape[1]
    for i in range(cols):
        col = matrix[:, i : i + 1]
        norm = xp.sqrt(xp.sum(col * col, dtype=np.float64))  # 0-d on the device for cupy
        if epsilon == 0 and norm == 0:
            col[...] = 0  # torch zero-fills a column it cannot normalize
        else:
            col /= (norm + epsilon).astype(col.dtype)
        if i + 1 < cols:
            rest = matrix[:, i + 1 :]
            rest -= xp.sum(col * rest, axis=0, keepdims=True) * col


def _report_compression_stats(bucket: GradBucket, state: PowerSGDState) -> None:
    if bucket.is_last() and state.iter >= state.next_stats_report:
        rate, before, after = state.compression_stats()
        logger.info(
            "Compression stats: iter %s, total before compression %s, total after compression %s, rate %s",
            state.iter,
            before,
            after,
            rate,
        )
        state.next_stats_report = state.iter + state.compression_stats_logging_frequency


def _split(state: PowerSGDState, tensors: list[Any]) -> tuple[list[Any], list[Any], int, int]:
    """(matrices to compress, tensors to all-reduce as they are, numel of P, numel of Q)."""
    compress, plain, p_size, q_size = [], [], 0, 0
    for t in tensors:
        matrix = t.reshape(t.shape[0] if t.ndim else 1, -1)
        n, m = matrix.shape
        rank = min(n, m, state.matrix_approximation_rank)
        before, after = n * m, (n + m) * rank  # torch's _should_compress: numel of M, and of P and Q
        ok = after * state.min_compression_rate < before
        state.total_numel_before_compression += before
        if ok:
            compress.append(matrix)
            p_size += n * rank
            q_size += m * rank
            state.total_numel_after_compression += after
        else:
            plain.append(t)
            state.total_numel_after_compression += before
    return compress, plain, p_size, q_size


def _views(flat: Any, shapes: list[tuple[int, ...]]) -> list[Any]:
    """Views into the 1-D ``flat``, end to end, one per shape."""
    ends = np.cumsum([0] + [math.prod(shape) for shape in shapes]).tolist()
    return [flat[a:b].reshape(shape) for a, b, shape in zip(ends, ends[1:], shapes)]


def powerSGD_hook(state: PowerSGDState, bucket: GradBucket) -> Future[Any]:
    """PowerSGD (Vogels et al., NeurIPS 2019), step for step as torch's ``powerSGD_hook``.

    Before ``state.start_powerSGD_iter`` steps: :func:`allreduce_hook`. Then, per bucket:

    1. error feedback: ``buffer += error`` (the previous step's local error); keep a copy;
    2. view each gradient as a matrix ``M`` (rows = first dim); those that pass
       ``min_compression_rate`` are compressed, the others (1-D biases for any useful
       rank) are packed together and all-reduced (async, divided by the world size);
    3. ``Q`` (m x r): warm start reuses last step's Q, else a fresh normal matrix drawn
       from a generator seeded by ``state.rng`` (same on every rank); orthogonalize Q;
    4. ``P = M Q``; all-reduce all P's of the bucket at once (sum); orthogonalize each P;
    5. ``Q = M^T P``; all-reduce all Q's (sum), divide by the world size;
    6. ``M <- P Q^T`` in the bucket (the rank-r approximation of the average gradient);
       error = (input copy) - buffer.

    Sends ``sum((n + m) r)`` elements per bucket for the compressed matrices, instead of
    ``sum(n m)``; the result is bitwise identical on every rank. Steps 4-6 run in the
    uncompressed all-reduce's completion callback, with synchronous all-reduces.
    """
    op = "powerSGD_hook"
    g = _group(state.process_group, op)
    buffer = bucket.buffer()
    if state.iter < state.start_powerSGD_iter:
        state.maybe_increase_iter(bucket)
        return _allreduce_fut(g, buffer)
    with on_device(buffer):
        return _powerSGD_compress(state, bucket, g)


def _powerSGD_compress(state: PowerSGDState, bucket: GradBucket, g: ProcessGroup) -> Future[Any]:
    """Steps 1-4 of :func:`powerSGD_hook` on the bucket's device; ``finish`` does 4-6."""
    buffer = bucket.buffer()
    xp = array_module(buffer)
    world, idx, dtype = g.size(), bucket.index(), buffer.dtype
    copy = None
    if state.use_error_feedback:
        if idx in state.error_dict:
            buffer += state.error_dict[idx]
        else:
            state.error_dict[idx] = xp.zeros_like(buffer)
        copy = buffer.copy()
    compress, plain, p_size, q_size = _split(state, bucket.gradients())
    _report_compression_stats(bucket, state)
    plain_memory = xp.concatenate([t.reshape(-1) for t in plain]) if plain else xp.empty(0, dtype)
    fresh = not state.warm_start or idx not in state.p_memory_dict
    if fresh:
        state.p_memory_dict[idx] = xp.empty(p_size, dtype)
        state.q_memory_dict[idx] = xp.empty(q_size, dtype)
    p_memory, q_memory = state.p_memory_dict[idx], state.q_memory_dict[idx]
    ranks = [min(*matrix.shape, state.matrix_approximation_rank) for matrix in compress]
    ps = _views(p_memory, [(matrix.shape[0], rank) for matrix, rank in zip(compress, ranks)])  # n x r
    qs = _views(q_memory, [(matrix.shape[1], rank) for matrix, rank in zip(compress, ranks)])  # m x r
    eps = state.orthogonalization_epsilon
    if fresh:  # drawn on the host from the shared seed: the same Q on every rank and device
        gen = np.random.default_rng(state.rng.randint(1_000_000_000))
        for q in qs:
            q[...] = xp.asarray(gen.standard_normal(q.shape))
    for q in qs:
        _orthogonalize(q, eps)
    for matrix, q, p in zip(compress, qs, ps):
        xp.matmul(matrix, q, out=p)
    work = cast(Work, all_reduce(plain_memory, ReduceOp.SUM, g, async_op=True))  # a member's async op: a Work

    def finish(done: Future[Any]) -> Any:
        done.result()
        with on_device(buffer):
            if world > 1:
                xp.divide(plain_memory, world, out=plain_memory)
            for t, reduced in zip(plain, _views(plain_memory, [t.shape for t in plain])):
                t[...] = reduced
            all_reduce(p_memory, ReduceOp.SUM, g)  # no division: P gets orthogonalized
            for p in ps:
                _orthogonalize(p, eps)
            for matrix, p, q in zip(compress, ps, qs):
                xp.matmul(matrix.T, p, out=q)
            all_reduce(q_memory, ReduceOp.SUM, g)
            if world > 1:
                xp.divide(q_memory, world, out=q_memory)
            for p, q, matrix in zip(ps, qs, compress):
                xp.matmul(p, q.T, out=matrix)
            if copy is not None:
                xp.subtract(copy, buffer, out=state.error_dict[idx])
        if not state.warm_start:  # torch clears both dicts; other buckets may still be in flight
            state.p_memory_dict.pop(idx, None)
            state.q_memory_dict.pop(idx, None)
        state.maybe_increase_iter(bucket)
        return buffer

    return then(work.get_future(), finish)


#: torch's ``ddp_comm_hooks.default_hooks`` module, as a namespace.
default_hooks = SimpleNamespace(
    allreduce_hook=allreduce_hook, fp16_compress_hook=fp16_compress_hook, bf16_compress_hook=bf16_compress_hook
)
#: torch's ``ddp_comm_hooks.powerSGD_hook`` module, as a namespace.
powerSGD = SimpleNamespace(PowerSGDState=PowerSGDState, powerSGD_hook=powerSGD_hook)
