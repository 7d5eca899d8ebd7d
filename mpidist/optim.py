"""Optimizers over :class:`mpidist.nn.Parameter` (torch.optim semantics), on numpy or cupy arrays.

The update runs in each parameter's array module; the optimizer's state (momentum buffers)
lives on its parameter's device and follows it there (``Module.to``) at the next step.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping
from typing import Any, Optional

import numpy as np

from mpidist.nn._data import DataArray
from mpidist.nn._util import check_bool, check_device, like, like_checked, prefix, to_host
from mpidist.nn.parameter import Parameter

__all__ = ["SGD"]

_HYPER = ("lr", "momentum", "dampening", "weight_decay", "nesterov")
_BUF = "momentum_buffer."


def _check_hyper(op: str, lr: Any, momentum: Any, dampening: Any, weight_decay: Any, nesterov: Any) -> None:
    for name, v in (("lr", lr), ("momentum", momentum), ("dampening", dampening), ("weight_decay", weight_decay)):
        if not isinstance(v, numbers.Real) or isinstance(v, bool):
            raise TypeError(f"{prefix(op)} {name} must be a real number, got {type(v).__name__}")
        if not math.isfinite(v):
            raise ValueError(f"{prefix(op)} {name} must be finite, got {v}")
    for name, v in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay)):
        if v < 0:
            raise ValueError(f"{prefix(op)} {name} must be >= 0, got {v}")
    check_bool(nesterov, "nesterov", op)
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError(
            f"{prefix(op)} nesterov requires momentum > 0 and dampening == 0, "
            f"got momentum={momentum}, dampening={dampening}"
        )


class SGD:
    """Stochastic gradient descent, exactly the algorithm of the ``torch.optim.SGD`` docs.

    Per parameter with a grad, on each :meth:`step`::

        g = grad + weight_decay * p                      (if weight_decay != 0)
        buf = g  (first step: a copy, no dampening)      (if momentum != 0)
        buf = momentum * buf + (1 - dampening) * g       (later steps, in place)
        g = g + momentum * buf if nesterov else buf
        p -= lr * g                                      (in place on p.data)

    One parameter group only (no ``param_groups``, no ``maximize``); the hyper-parameters are
    plain attributes (``opt.lr = ...`` takes effect on the next step).

    Raises:
        TypeError: ``params`` is not an iterable of Parameter; a hyper-parameter has the wrong type;
            (at :meth:`step`) a grad on another device than its parameter.
        ValueError: empty or duplicated params; lr, momentum or weight_decay < 0 or not finite;
            nesterov without momentum > 0 and dampening == 0.
    """

    def __init__(
        self,
        params: Iterable[Parameter],
        lr: float,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
    ) -> None:
        if isinstance(params, Parameter) or not isinstance(params, Iterable):
            raise TypeError(f"{prefix('SGD')} params must be an iterable of Parameters, got {type(params).__name__}")
        self.params: list[Parameter] = list(params)
        for i, p in enumerate(self.params):
            if not isinstance(p, Parameter):
                raise TypeError(f"{prefix('SGD')} params[{i}] must be a Parameter, got {type(p).__name__}")
        if not self.params:
            raise ValueError(f"{prefix('SGD')} params is empty")
        if len({id(p) for p in self.params}) != len(self.params):
            raise ValueError(f"{prefix('SGD')} params contains the same Parameter more than once")
        _check_hyper("SGD", lr, momentum, dampening, weight_decay, nesterov)
        self.lr, self.momentum, self.dampening = lr, momentum, dampening
        self.weight_decay, self.nesterov = weight_decay, nesterov
        self._momentum_buffers: list[Optional[Any]] = [None] * len(self.params)

    def step(self) -> None:
        """Update every parameter whose grad is not None, in place.

        Raises ValueError (grad shape mismatch) or TypeError (grad on another device).
        """
        lr, m, d, wd = self.lr, self.momentum, self.dampening, self.weight_decay
        for i, p in enumerate(self.params):
            g = p.grad
            if g is None:
                continue
            if type(g) is DataArray:
                g = g.view(np.ndarray)  # plain arithmetic below (each DataArray op costs ~1 us more)
            if tuple(g.shape) != p.shape:
                raise ValueError(
                    f"{prefix('SGD.step')} grad of {p.name or f'params[{i}]'!r} has shape "
                    f"{tuple(g.shape)}, expected {p.shape}"
                )
            data = p.data
            if type(g) is not np.ndarray or type(data) is not np.ndarray:
                check_device(g, data, f"grad of {p.name or f'params[{i}]'!r}", "its parameter", "SGD.step")
            if wd != 0:
                g = g + wd * data
            if m != 0:
                buf = self._momentum_buffers[i]
                if buf is None:
                    buf = self._momentum_buffers[i] = g.copy()
                else:
                    if type(buf) is not np.ndarray or type(data) is not np.ndarray:
                        # a copy on the parameter's device if it moved since (Module.to); else buf itself
                        buf = self._momentum_buffers[i] = like(buf, data, "SGD.step")
                    buf *= m
                    buf += (1 - d) * g
                g = g + m * buf if self.nesterov else buf
            p.data -= lr * g

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset each parameter's grad: to ``None``, or zero it in place when ``set_to_none=False``."""
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad[...] = 0

    def state_dict(self) -> dict[str, Any]:
        """Flat ``{name: array}``, saveable with ``numpy.savez`` (no pickle).

        Keys: ``"lr"``, ``"momentum"``, ``"dampening"``, ``"weight_decay"`` (0-d float64) and
        ``"nesterov"`` (0-d bool) as numpy arrays; ``"momentum_buffer.<i>"`` for the i-th
        parameter that has a buffer (on the parameter's device; a reference, not a copy).
        """
        out: dict[str, Any] = {
            k: np.asarray(getattr(self, k), dtype=bool if k == "nesterov" else np.float64) for k in _HYPER
        }
        for i, buf in enumerate(self._momentum_buffers):
            if buf is not None:
                out[f"{_BUF}{i}"] = buf
        return out

    def load_state_dict(self, state: Mapping) -> None:
        """Restore hyper-parameters and momentum buffers (copied) from :meth:`state_dict` output.

        Buffers may come from any device (e.g. host arrays from :func:`mpidist.load_checkpoint`):
        each is copied onto its parameter's device. Parameters without a ``momentum_buffer.<i>`` entry get none
        (fresh start). Nothing
        changes if a check fails.

        Raises:
            TypeError: ``state`` is not a mapping; a buffer's dtype differs from its parameter's.
            ValueError: missing or unknown keys, non-scalar hyper-parameters, invalid values,
                buffer index out of range or shape mismatch.
        """
        op = "SGD.load_state_dict"
        if not isinstance(state, Mapping):
            raise TypeError(f"{prefix(op)} state must be a mapping of name -> array, got {type(state).__name__}")
        missing = [k for k in _HYPER if k not in state]
        unknown = [
            k
            for k in state
            if k not in _HYPER and not (isinstance(k, str) and k.startswith(_BUF) and k[len(_BUF) :].isdigit())
        ]
        if missing or unknown:
            raise ValueError(f"{prefix(op)} keys do not match: missing {missing}, unexpected {unknown}")
        hyper: dict[str, Any] = {}
        for k in _HYPER:
            v = to_host(state[k])
            if v.ndim != 0:
                raise ValueError(f"{prefix(op)} {k!r} must be a 0-d array, got shape {tuple(v.shape)}")
            hyper[k] = bool(v) if k == "nesterov" else float(v)
        _check_hyper(op, **hyper)
        buffers: list[Optional[Any]] = [None] * len(self.params)
        for k, v in state.items():
            if k in _HYPER:
                continue
            i = int(k[len(_BUF) :])
            if i >= len(self.params):
                raise ValueError(f"{prefix(op)} {k!r}: index out of range for {len(self.params)} params")
            buffers[i] = like_checked(v, self.params[i].data, k, op).copy()
        for k, v in hyper.items():
            setattr(self, k, v)
        self._momentum_buffers = buffers

    def __repr__(self) -> str:
        hp = ", ".join(f"{k}={getattr(self, k)}" for k in _HYPER)
        return f"SGD({len(self.params)} params, {hp})"
