"""Softmax cross-entropy over integer class targets (torch.nn.CrossEntropyLoss)."""
from __future__ import annotations

from typing import Any, Optional, Tuple

from mpidist._array import array_module
from mpidist.nn._util import check_array, like, prefix
from mpidist.nn.modules import Module

__all__ = ["CrossEntropyLoss"]


class CrossEntropyLoss(Module):
    """``loss_i = logsumexp(logits_i) - logits_i[targets_i]``, reduced by mean or sum.

    Computed through ``log_softmax`` shifted by the row max, so huge logits stay finite.
    ``crit(logits, targets)``: logits (N, C) floating, targets (N,) integer in [0, C) (any
    device: copied to the logits' device if needed);
    returns the loss as a Python float (mean of an empty batch is nan, as torch) and caches
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
        if reduction not in ("mean", "sum"):
            raise ValueError(f"{prefix('CrossEntropyLoss')} reduction must be 'mean' or 'sum', got {reduction!r}")
        self.reduction = reduction
        self._cache: Optional[Tuple[Any, Any, float]] = None

    def forward(self, logits: Any, targets: Any) -> float:
        op = "CrossEntropyLoss"
        check_array(logits, "logits", op)
        if logits.ndim != 2 or logits.shape[1] < 1:
            raise ValueError(f"{prefix(op)} logits must have shape (N, C) with C >= 1, got {tuple(logits.shape)}")
        if logits.dtype.kind != "f":
            raise TypeError(f"{prefix(op)} logits must have a floating dtype, got {logits.dtype}")
        xp = array_module(logits)
        n, c = logits.shape
        t = like(targets, logits, op)
        if t.dtype.kind not in "iu":
            raise TypeError(f"{prefix(op)} targets must be integer class indices, got dtype {t.dtype}")
        if tuple(t.shape) != (n,):
            raise ValueError(f"{prefix(op)} targets must have shape ({n},) to match logits, got {tuple(t.shape)}")
        if n and (int(t.min()) < 0 or int(t.max()) >= c):
            raise ValueError(f"{prefix(op)} targets must be in [0, {c}), got min {int(t.min())}, max {int(t.max())}")
        z = logits - logits.max(axis=1, keepdims=True)
        logp = z - xp.log(xp.exp(z).sum(axis=1, keepdims=True))
        rows = xp.arange(n)
        total = -float(logp[rows, t].sum())
        scale = 1.0 if self.reduction == "sum" else 1.0 / max(n, 1)
        self._cache = (logp, t, scale)
        return total if self.reduction == "sum" else (total / n if n else float("nan"))

    def backward(self, grad_output: float = 1.0) -> Any:
        if self._cache is None:
            raise RuntimeError(f"{prefix('CrossEntropyLoss.backward')} called before forward")
        logp, t, scale = self._cache
        xp = array_module(logp)
        grad = xp.exp(logp)
        grad[xp.arange(t.shape[0]), t] -= 1
        grad *= scale * float(grad_output)
        return grad
