"""Parameter: a weight array with a gradient slot and grad-ready hooks.

Mirrors ``torch.nn.Parameter`` plus ``torch.Tensor.register_post_accumulate_grad_hook``
(torch.nn / torch.Tensor docs) for a toolkit without autograd: modules compute
gradients explicitly in ``backward`` and hand them to :meth:`Parameter.accumulate_grad`,
which accumulates and then fires the hooks, the moment DDP needs to start reducing.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable

from mpidist._arrays.namespace import array_module
from mpidist.nn._data import as_data_array
from mpidist.nn._util import check_array, check_device, prefix

__all__ = ["Parameter", "RemovableHandle"]

Hook = Callable[["Parameter"], None]


class RemovableHandle:
    """Returned by hook registration; :meth:`remove` unregisters the hook (idempotent).

    Also a context manager that removes the hook on exit, as ``torch.utils.hooks.RemovableHandle``.
    """

    _ids = itertools.count()

    def __init__(self, hooks: dict[int, Any]) -> None:
        self._hooks = hooks
        self.id = next(RemovableHandle._ids)

    def remove(self) -> None:
        self._hooks.pop(self.id, None)

    def __enter__(self) -> RemovableHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


class Parameter:
    """A trainable array.

    Attributes:
        data: the weights, a C-contiguous floating-point numpy or cupy array. Assigning
            converts with ``xp.asarray`` (no copy when already a contiguous array, so the
            parameter shares memory with the array passed in, as ``torch.nn.Parameter``);
            assigning an array on another device moves the parameter there
            (what ``Module.to`` does).
        grad: the accumulated gradient (same shape, dtype and device as ``data``) or ``None``. May be
            replaced by any array of that shape (e.g. a view into a DDP bucket): accumulation
            after the first is in place (``grad += g``). Usable directly as a collective's
            argument: ``dist.all_reduce(p.grad)`` reduces it in place.
        name: dotted name set by the owning Module tree, e.g. ``"0.weight"``; ``""`` when free.

    A host (numpy) ``grad`` is a :class:`mpidist.nn._data.DataArray`: a numpy array whose
    ``.data`` is the array itself, as torch's ``Tensor.data``, so torch's
    ``dist.all_reduce(param.grad.data)`` and ``param.grad.data /= n`` work unchanged (on a
    plain numpy array ``.data`` is a memoryview). Assigning a plain numpy array views it as
    one, without a copy. ``data`` stays a plain array (``param.data`` is what torch code
    passes to collectives); cupy arrays are kept as they are (their ``.data`` is cupy's
    device pointer: pass ``param.grad`` itself).

    Raises:
        TypeError: ``data`` is not an array-like of floating-point dtype.
    """

    def __init__(self, data: Any, name: str = "") -> None:
        self._post_accumulate_grad_hooks: dict[int, Hook] = {}
        self.data = data
        self._grad: Any = None
        self.name = name

    @property
    def data(self) -> Any:
        return self._data

    @data.setter
    def data(self, value: Any) -> None:
        arr = array_module(value).asarray(value)
        if arr.dtype.kind not in "fc":
            raise TypeError(f"{prefix('Parameter')} data must be a floating-point array, got dtype {arr.dtype}")
        self._data = arr if arr.flags.c_contiguous else arr.copy(order="C")

    @property
    def grad(self) -> Any:
        return self._grad

    @grad.setter
    def grad(self, value: Any) -> None:
        self._grad = as_data_array(value)

    @property
    def shape(self) -> tuple:
        return tuple(self._data.shape)

    @property
    def dtype(self) -> Any:
        return self._data.dtype

    @property
    def size(self) -> int:
        return int(self._data.size)

    @property
    def ndim(self) -> int:
        return int(self._data.ndim)

    def register_post_accumulate_grad_hook(self, hook: Hook) -> RemovableHandle:
        """Call ``hook(param)`` right after this parameter's grad is accumulated in backward.

        Same name and semantics as ``torch.Tensor.register_post_accumulate_grad_hook``: the
        hook sees the final ``param.grad`` of that accumulation; its return value is ignored.
        Hooks run in registration order. Returns a handle whose ``remove()`` unregisters it.

        Raises:
            TypeError: ``hook`` is not callable.
        """
        if not callable(hook):
            raise TypeError(
                f"{prefix('register_post_accumulate_grad_hook')} hook must be callable, got {type(hook).__name__}"
            )
        handle = RemovableHandle(self._post_accumulate_grad_hooks)
        self._post_accumulate_grad_hooks[handle.id] = hook
        return handle

    def accumulate_grad(self, grad: Any) -> None:
        """Add ``grad`` into :attr:`grad`, then fire the post-accumulate hooks.

        ``self.grad`` becomes a C-contiguous copy of ``grad`` (cast to ``data.dtype``) when it is
        ``None``, else ``self.grad += grad`` in place. Called by modules' ``backward``.

        Raises:
            TypeError: ``grad`` is not an array, or is on another device than ``data``.
            ValueError: ``grad.shape != data.shape``.
        """
        op = "Parameter.accumulate_grad"
        check_array(grad, "grad", op)
        name = self.name or "parameter"
        if tuple(grad.shape) != self.shape:
            raise ValueError(f"{prefix(op)} grad for {name!r} must have shape {self.shape}, got {tuple(grad.shape)}")
        check_device(grad, self._data, f"grad for {name!r}", "the parameter", op)
        if self.grad is None:
            self.grad = grad.astype(self.dtype, order="C", copy=True)
        else:
            self.grad += grad
        for hook in tuple(self._post_accumulate_grad_hooks.values()):
            hook(self)

    def __repr__(self) -> str:
        return f"Parameter(name={self.name!r}, shape={self.shape}, dtype={self.dtype})"
