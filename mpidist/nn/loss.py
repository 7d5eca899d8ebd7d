"""Losses with explicit backward: torch.nn.CrossEntropyLoss, NLLLoss and MSELoss.

``crit(input, target)`` returns the loss as a ``numpy.float64`` (a Python ``float``
subclass, so ``loss.item()`` works as on a torch scalar) and caches what
``crit.backward(grad_output=1.0)`` needs; backward returns dL/dinput, shaped and typed like
the input. There is no autograd: where torch calls ``loss.backward()``, mpidist calls
``model.backward(crit.backward())`` (or ``ddp.backward(crit.backward())``).
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from mpidist._arrays.namespace import array_module
from mpidist.nn._util import check_array, like, prefix
from mpidist.nn.modules import Module

__all__ = ["CrossEntropyLoss", "NLLLoss", "MSELoss"]

_REDUCTIONS = ("mean", "sum")


def _check_reduction(reduction: Any, op: str) -> str:
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{prefix(op)} reduction must be 'mean' or 'sum', got {reduction!r}")
    return reduction


def _check_scores(x: Any, what: str, op: str) -> None:
    """``x`` must be a floating (N, C) array with C >= 1."""
    check_array(x, what, op)
    if x.ndim != 2 or x.shape[1] < 1:
        raise ValueError(f"{prefix(op)} {what} must have shape (N, C) with C >= 1, got {tuple(x.shape)}")
    if x.dtype.kind != "f":
        raise TypeError(f"{prefix(op)} {what} must have a floating dtype, got {x.dtype}")


def _class_targets(targets: Any, scores: Any, what: str, op: str, ignore_index: Optional[int] = None) -> Any:
    """``targets`` on ``scores``' device, checked: integer, shape (N,), in [0, C) (or ``ignore_index``)."""
    n, c = scores.shape
    t = like(targets, scores, op)
    if t.dtype.kind not in "iu":
        raise TypeError(f"{prefix(op)} targets must be integer class indices, got dtype {t.dtype}")
    if tuple(t.shape) != (n,):
        raise ValueError(f"{prefix(op)} targets must have shape ({n},) to match {what}, got {tuple(t.shape)}")
    counted = t if ignore_index is None else t[t != ignore_index]
    if counted.size and (int(counted.min()) < 0 or int(counted.max()) >= c):
        raise ValueError(
            f"{prefix(op)} targets must be in [0, {c}), got min {int(counted.min())}, max {int(counted.max())}"
        )
    return t


class CrossEntropyLoss(Module):
    """``loss_i = logsumexp(logits_i) - logits_i[targets_i]``, reduced by mean or sum.

    Computed through ``log_softmax`` shifted by the row max, so huge logits stay finite.
    ``crit(logits, targets)``: logits (N, C) floating, targets (N,) integer in [0, C) (any
    device: copied to the logits' device if needed);
    returns the loss as a ``numpy.float64`` (mean of an empty batch is nan, as torch) and caches
    the softmax. ``crit.backward(grad_output=1.0)`` returns dL/dlogits, shape (N, C), dtype of
    logits: ``(softmax - onehot(targets)) * grad_output`` (divided by N for "mean").
    No class weights, ``ignore_index``, label smoothing or probability targets.

    Raises:
        ValueError: reduction not "mean"/"sum"; bad shapes; targets out of range.
        TypeError: non-array or non-floating logits; non-integer targets.
        RuntimeError: backward before forward.
    """

    def __init__(self, reduction: str = "mean") -> None:
        super().__init__()
        self.reduction = _check_reduction(reduction, "CrossEntropyLoss")
        self._cache: Optional[tuple[Any, Any, float]] = None

    def forward(self, logits: Any, targets: Any) -> np.float64:
        op = "CrossEntropyLoss"
        _check_scores(logits, "logits", op)
        xp = array_module(logits)
        n = logits.shape[0]
        t = _class_targets(targets, logits, "logits", op)
        z = logits - logits.max(axis=1, keepdims=True)
        logp = z - xp.log(xp.exp(z).sum(axis=1, keepdims=True))
        rows = xp.arange(n)
        total = -float(logp[rows, t].sum())
        scale = 1.0 if self.reduction == "sum" else 1.0 / max(n, 1)
        self._cache = (logp, t, scale)
        return np.float64(total if self.reduction == "sum" else (total / n if n else float("nan")))

    def backward(self, grad_output: float = 1.0) -> Any:
        if self._cache is None:
            raise RuntimeError(f"{prefix('CrossEntropyLoss.backward')} called before forward")
        logp, t, scale = self._cache
        xp = array_module(logp)
        grad = xp.exp(logp)
        grad[xp.arange(t.shape[0]), t] -= 1
        grad *= scale * float(grad_output)
        return grad


class NLLLoss(Module):
    """Negative log-likelihood of class targets given log-probabilities (torch.nn.NLLLoss).

    ``crit(log_probs, targets)``: log_probs (N, C) floating (e.g. the output of
    :class:`mpidist.nn.LogSoftmax` ``(dim=1)``), targets (N,) integer in [0, C) or
    ``ignore_index``. ``loss_i = -weight[t_i] * log_probs[i, t_i]``; "mean" divides the sum by
    the total weight of the counted targets (nan when none counts, as torch), "sum" does not.
    ``crit.backward(grad_output=1.0)`` returns dL/dlog_probs, shape (N, C): ``-weight[t_i] *
    scale * grad_output`` at ``(i, t_i)``, zero elsewhere. Only (N, C) inputs (torch also
    takes (N, C, d1, ...)).

    Args:
        weight: optional per-class weights, shape (C,) (torch's ``weight``).
        ignore_index: targets equal to it contribute nothing (torch's default -100).
        reduction: "mean" (default) or "sum".

    Raises:
        ValueError: reduction not "mean"/"sum"; bad shapes; targets out of range.
        TypeError: non-array or non-floating log_probs; non-integer targets or ignore_index.
        RuntimeError: backward before forward.
    """

    def __init__(self, weight: Any = None, ignore_index: int = -100, reduction: str = "mean") -> None:
        super().__init__()
        op = "NLLLoss"
        self.reduction = _check_reduction(reduction, op)
        if not isinstance(ignore_index, (int, np.integer)) or isinstance(ignore_index, bool):
            raise TypeError(f"{prefix(op)} ignore_index must be an int, got {type(ignore_index).__name__}")
        if weight is not None:
            check_array(weight, "weight", op)
            if weight.ndim != 1:
                raise ValueError(
                    f"{prefix(op)} weight must be 1-D (one weight per class), got shape {tuple(weight.shape)}"
                )
        self.weight, self.ignore_index = weight, int(ignore_index)
        self._cache: Optional[tuple[Any, Any, Any, float]] = None

    def forward(self, log_probs: Any, targets: Any) -> np.float64:
        op = "NLLLoss"
        _check_scores(log_probs, "log_probs", op)
        xp = array_module(log_probs)
        n, c = log_probs.shape
        t = _class_targets(targets, log_probs, "log_probs", op, self.ignore_index)
        counted = t != self.ignore_index
        safe_t = xp.where(counted, t, 0)
        if self.weight is None:
            w = counted.astype(log_probs.dtype)
        else:
            if tuple(self.weight.shape) != (c,):
                raise ValueError(
                    f"{prefix(op)} weight must have shape ({c},) for {c} classes, got {tuple(self.weight.shape)}"
                )
            w = like(self.weight, log_probs, op).astype(log_probs.dtype)[safe_t] * counted
        rows = xp.arange(n)
        total = -float((w * log_probs[rows, safe_t]).sum())
        denom = 1.0 if self.reduction == "sum" else float(w.sum())
        scale, loss = (1.0 / denom, total / denom) if denom else (float("nan"), float("nan"))
        self._cache = (log_probs, safe_t, w, scale)
        return np.float64(loss)

    def backward(self, grad_output: float = 1.0) -> Any:
        if self._cache is None:
            raise RuntimeError(f"{prefix('NLLLoss.backward')} called before forward")
        log_probs, t, w, scale = self._cache
        xp = array_module(log_probs)
        grad = xp.zeros_like(log_probs)
        grad[xp.arange(t.shape[0]), t] = -w * (scale * float(grad_output))
        return grad


class MSELoss(Module):
    """Mean squared error, ``mean((input - target)**2)`` or the sum (torch.nn.MSELoss).

    ``crit(input, target)``: floating ``input`` of any shape; ``target`` of the same shape
    (any numeric dtype and device: converted to the input's dtype and device; torch refuses
    another dtype at backward). ``crit.backward(grad_output=1.0)`` returns
    ``2 * (input - target) * grad_output`` (divided by the element count for "mean"), shape
    and dtype of ``input``. Mean of an empty input is nan, as torch.

    Raises:
        ValueError: reduction not "mean"/"sum"; shapes differ (torch would broadcast, with a
            warning: here pass the target in the input's shape).
        TypeError: non-array or non-floating input; a non-array target.
        RuntimeError: backward before forward.
    """

    def __init__(self, reduction: str = "mean") -> None:
        super().__init__()
        self.reduction = _check_reduction(reduction, "MSELoss")
        self._cache: Optional[tuple[Any, float]] = None

    def forward(self, input: Any, target: Any) -> np.float64:  # noqa: A002  (torch's argument name)
        op = "MSELoss"
        check_array(input, "input", op, floating=True)
        check_array(target, "target", op)
        if tuple(target.shape) != tuple(input.shape):
            raise ValueError(
                f"{prefix(op)} target must have the input's shape {tuple(input.shape)}, got {tuple(target.shape)}"
            )
        t = like(target, input, op)
        diff = input - t.astype(input.dtype, copy=False)
        total = float((diff * diff).sum())
        n = diff.size
        scale = 1.0 if self.reduction == "sum" else (1.0 / n if n else float("nan"))
        self._cache = (diff, scale)
        return np.float64(total if self.reduction == "sum" else (total / n if n else float("nan")))

    def backward(self, grad_output: float = 1.0) -> Any:
        if self._cache is None:
            raise RuntimeError(f"{prefix('MSELoss.backward')} called before forward")
        diff, scale = self._cache
        return diff * diff.dtype.type(2.0 * scale * float(grad_output))
