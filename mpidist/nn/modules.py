"""Module tree and layers with explicit backward (no autograd).

Follows the ``torch.nn.Module`` / ``torch.nn.Linear`` / ``torch.nn.ReLU`` /
``torch.nn.Dropout`` / ``torch.nn.LogSoftmax`` / ``torch.nn.Sequential`` docs. ``forward`` caches what
``backward`` needs (one
forward per module instance at a time); ``backward(grad_output)`` accumulates
parameter gradients, fires each parameter's post-accumulate-grad hooks as its
gradient becomes ready, and returns the gradient w.r.t. the forward input.
Compute goes through ``array_module(x)``, so numpy and cupy arrays both work;
``Module.to("cuda")`` moves a model to the GPU (cupy), ``.to("cpu")`` back. Kernels run
on cupy's current device: keep it the model's (one GPU per process, as torch).
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Iterator, Mapping
from typing import Any, Callable, Optional, Union

import numpy as np

from mpidist._arrays.namespace import array_module
from mpidist.nn._random import generator
from mpidist.nn._util import (
    check_array,
    check_bool,
    check_device,
    check_int,
    copy_into,
    cupy_module,
    like,
    like_checked,
    move,
    parse_device,
    prefix,
)
from mpidist.nn.parameter import Parameter

__all__ = ["Module", "Linear", "ReLU", "Dropout", "LogSoftmax", "Sequential"]


def _join(a: str, b: str) -> str:
    return f"{a}.{b}" if a else b


def _check_grad_output(grad_output: Any, cached: Any, op: str) -> None:
    """An elementwise layer's backward: forward ran (``cached``, an array of the input's
    shape and device, is not None) and ``grad_output`` is an array of that shape and device.

    Raises RuntimeError (no forward), TypeError (not an array, another device), ValueError (shape)."""
    if cached is None:
        raise RuntimeError(f"{prefix(op)} called before forward")
    check_array(grad_output, "grad_output", op)
    if tuple(grad_output.shape) != tuple(cached.shape):
        raise ValueError(
            f"{prefix(op)} grad_output must have shape {tuple(cached.shape)}, got {tuple(grad_output.shape)}"
        )
    check_device(grad_output, cached, "grad_output", "the forward input", op)


def mismatched_keys(state: Any, own: Mapping, op: str) -> tuple[list[str], list[str]]:
    """``(missing, unexpected)`` keys of state dict ``state`` against ``own``'s.

    Raises TypeError if ``state`` is not a mapping."""
    if not isinstance(state, Mapping):
        raise TypeError(f"{prefix(op)} state must be a mapping of name -> array, got {type(state).__name__}")
    return [k for k in own if k not in state], [k for k in state if k not in own]


def _check_name(name: Any, op: str) -> None:
    if not isinstance(name, str) or not name or "." in name:
        raise ValueError(f"{prefix(op)} name must be a non-empty str without '.', got {name!r}")


class Module:
    """Base class: registers parameters, buffers and submodules by attribute assignment.

    Assigning a :class:`Parameter` or :class:`Module` to an attribute registers it (in
    assignment order); arrays become buffers through :meth:`register_buffer`. After each
    registration every parameter's ``name`` is set to its dotted name in this tree.
    Subclasses implement ``forward`` (caching what they need) and ``backward``.
    """

    training: bool
    # Set in ``__init__`` through ``object.__setattr__`` (bypassing registration).
    _parameters: dict[str, Parameter]
    _buffers: dict[str, Any]  # a buffer reassigned to None stays registered
    _modules: dict[str, Module]

    def __init__(self) -> None:
        object.__setattr__(self, "_parameters", {})
        object.__setattr__(self, "_buffers", {})
        object.__setattr__(self, "_modules", {})
        self.training = True

    # -- registration -------------------------------------------------------
    def __setattr__(self, name: str, value: Any) -> None:
        registered = isinstance(value, (Parameter, Module))
        if "_parameters" not in self.__dict__:
            if registered:
                raise AttributeError(f"cannot assign {type(value).__name__} {name!r} before Module.__init__()")
        else:
            target = (
                self._parameters
                if isinstance(value, Parameter)
                else self._modules
                if isinstance(value, Module)
                else self._buffers
                if name in self._buffers
                else None
            )
            for reg in (self._parameters, self._buffers, self._modules):
                if reg is not target:
                    reg.pop(name, None)
            if target is not None:
                target[name] = value
        object.__setattr__(self, name, value)
        if registered:
            self._set_parameter_names()

    def __delattr__(self, name: str) -> None:
        for reg in (self._parameters, self._buffers, self._modules):
            reg.pop(name, None)
        object.__delattr__(self, name)

    def _set_parameter_names(self) -> None:
        for name, p in self.named_parameters():
            p.name = name

    def register_parameter(self, name: str, param: Parameter) -> None:
        """Register ``param`` under ``name`` (same as ``setattr``). Raises TypeError/ValueError."""
        _check_name(name, "Module.register_parameter")
        if not isinstance(param, Parameter):
            raise TypeError(
                f"{prefix('Module.register_parameter')} param must be a Parameter, got {type(param).__name__}"
            )
        setattr(self, name, param)

    def add_module(self, name: str, module: Module) -> None:
        """Register child ``module`` under ``name`` (same as ``setattr``). Raises TypeError/ValueError."""
        _check_name(name, "Module.add_module")
        if not isinstance(module, Module):
            raise TypeError(f"{prefix('Module.add_module')} module must be a Module, got {type(module).__name__}")
        setattr(self, name, module)

    def register_buffer(self, name: str, tensor: Any) -> None:
        """Register a non-trainable array (e.g. running statistics) under ``name``.

        Buffers appear in :meth:`buffers` and :meth:`state_dict`; reassigning the attribute
        keeps it a buffer. Raises ValueError (bad or taken name), TypeError (not an array).
        """
        op = "Module.register_buffer"
        _check_name(name, op)
        check_array(tensor, "tensor", op)
        if name in self.__dict__ and name not in self._buffers:
            raise ValueError(f"{prefix(op)} attribute {name!r} already exists")
        self._buffers[name] = tensor
        object.__setattr__(self, name, tensor)

    # -- traversal ----------------------------------------------------------
    def named_modules(self) -> list[tuple[str, Module]]:
        """``(dotted name, module)`` pairs, self first (name ``""``), preorder, no duplicates."""
        out: list[tuple[str, Module]] = []
        seen = set()

        def visit(mod: Module, name: str) -> None:
            if id(mod) not in seen:
                seen.add(id(mod))
                out.append((name, mod))
                for child_name, child in mod._modules.items():
                    visit(child, _join(name, child_name))

        visit(self, "")
        return out

    def children(self) -> list[Module]:
        """Direct submodules in registration order."""
        return list(self._modules.values())

    def _named_members(self, get: Callable[[Module], Any]) -> list[tuple[str, Any]]:
        out, seen = [], set()
        for mod_name, mod in self.named_modules():
            for name, value in get(mod).items():
                if value is not None and id(value) not in seen:
                    seen.add(id(value))
                    out.append((_join(mod_name, name), value))
        return out

    def named_parameters(self) -> list[tuple[str, Parameter]]:
        """``(dotted name, Parameter)`` in torch order: each module's own, then its children's."""
        return self._named_members(lambda m: m._parameters)

    def parameters(self) -> list[Parameter]:
        """All parameters, recursive, registration order, each once."""
        return [p for _, p in self.named_parameters()]

    def named_buffers(self) -> list[tuple[str, Any]]:
        """``(dotted name, array)`` for all buffers, recursive, each once (references)."""
        return self._named_members(lambda m: m._buffers)

    def buffers(self) -> list[Any]:
        return [b for _, b in self.named_buffers()]

    # -- state --------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Parameter data and buffers by dotted name (per module: params, then buffers).

        Values are references to the live arrays (on the module's device), not copies: copy
        them (or save them: :func:`mpidist.save_checkpoint` copies device arrays to the host)
        before training on.
        """
        out: dict[str, Any] = {}
        for mod_name, mod in self.named_modules():
            for name, p in mod._parameters.items():
                out[_join(mod_name, name)] = p.data
            for name, b in mod._buffers.items():
                if b is not None:
                    out[_join(mod_name, name)] = b
        return out

    def load_state_dict(self, state: Mapping, strict: bool = True) -> None:
        """Copy ``state``'s arrays into this module's parameters and buffers in place (``xp.copyto``).

        Values may live on any device (e.g. host arrays from :func:`mpidist.load_checkpoint`):
        each is copied onto its target's device. All checks run before anything is copied,
        so a failed load changes nothing.

        Raises:
            TypeError: ``state`` is not a mapping, or a value's dtype differs from the target's.
            ValueError: ``strict`` and keys are missing or unexpected; or a shape differs.
        """
        op = f"{type(self).__name__}.load_state_dict"
        own = self.state_dict()
        missing, unexpected = mismatched_keys(state, own, op)
        if strict and (missing or unexpected):
            raise ValueError(f"{prefix(op)} keys do not match: missing {missing}, unexpected {unexpected}")
        copies = [(dst, like_checked(state[key], dst, key, op)) for key, dst in own.items() if key in state]
        for dst, src in copies:
            copy_into(dst, src, op)

    # -- devices --------------------------------------------------------------
    def to(self, device: Union[str, int]) -> Module:
        """Move every parameter (data and grad) and buffer to ``device``, in place; returns self.

        ``torch.nn.Module.to(device)``: ``"cpu"`` (numpy), ``"cuda"`` (cupy's current device),
        ``"cuda:N"`` or an int ``N``. Parameters stay the same objects (an optimizer built
        before keeps working; its state follows on the next step); arrays already on
        ``device`` are not copied. Move the model before wrapping it in
        DistributedDataParallel (its buckets live on the parameters' device). No dtype
        conversion (torch's ``.to(dtype)``).

        Raises:
            TypeError / ValueError: ``device`` is not one of the forms above.
            RuntimeError: a ``"cuda"`` device without cupy installed.
        """
        op = f"{type(self).__name__}.to"
        kind, index = parse_device(device, op)
        if kind == "cuda":
            cupy_module(op)
        for p in self.parameters():
            p.data = move(p.data, kind, index, op)
            if p.grad is not None:
                p.grad = move(p.grad, kind, index, op)
        for _, mod in self.named_modules():
            for name, buf in list(mod._buffers.items()):
                if buf is not None:
                    moved = move(buf, kind, index, op)
                    mod._buffers[name] = moved
                    object.__setattr__(mod, name, moved)
        return self

    def cuda(self, device: Optional[Union[int, str]] = None) -> Module:
        """``to("cuda")``, or ``to(device)`` for an int or ``"cuda:N"`` (torch's ``Module.cuda``).

        Raises ValueError for a non-CUDA ``device``; see :meth:`to`.
        """
        if device is None:
            return self.to("cuda")
        if isinstance(device, str) and not device.startswith("cuda"):
            raise ValueError(
                f"{prefix(f'{type(self).__name__}.cuda')} device must be a CUDA device "
                f"(an int or 'cuda:N'), got {device!r}"
            )
        return self.to(device)

    def cpu(self) -> Module:
        """``to("cpu")`` (torch's ``Module.cpu``)."""
        return self.to("cpu")

    # -- training -----------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset every parameter's grad: to ``None``, or zero it in place when ``set_to_none=False``."""
        for p in self.parameters():
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad[...] = 0

    def train(self, mode: bool = True) -> Module:
        """Set ``training`` on this module and all submodules; returns self. Raises TypeError."""
        check_bool(mode, "mode", "Module.train")
        for _, mod in self.named_modules():
            mod.training = mode
        return self

    def eval(self) -> Module:
        """``train(False)``."""
        return self.train(False)

    # -- compute ------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must implement forward")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def backward(self, grad_output: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must implement backward")

    def extra_repr(self) -> str:
        return ""

    def __repr__(self) -> str:
        lines = [f"({n}): " + repr(m).replace("\n", "\n  ") for n, m in self._modules.items()]
        body = "".join(f"\n  {line}" for line in lines)
        return f"{type(self).__name__}({self.extra_repr()}{body}{chr(10) if body else ''})"


class Linear(Module):
    """``y = x @ weight.T + bias`` (torch.nn.Linear).

    Args:
        in_features, out_features: positive ints.
        bias: learn an additive bias.
        dtype: floating dtype of the parameters (default float32); inputs must match it.
        rng: ``numpy.random.Generator`` or seed for the init; ``None`` (default): the default
            generator of :mod:`mpidist.nn` (:func:`mpidist.nn.manual_seed`, torch's habit).
        xp: array module (numpy or cupy) the parameters live in.
        device: torch's factory argument: ``"cpu"``, ``"cuda"``, ``"cuda:N"`` (see
            :meth:`Module.to`); overrides ``xp``. The initial values are drawn on the host
            either way, so a seed gives the same weights on every device.

    Parameters, in this order: ``weight`` (out_features, in_features) and ``bias``
    (out_features,), both drawn from U(-1/sqrt(in_features), 1/sqrt(in_features)) as torch's
    ``kaiming_uniform_(a=sqrt(5))`` default (weight first, then bias, from ``rng``).
    ``forward(x)``: x (*, in_features) -> (*, out_features); caches x (by reference).
    ``backward(g)``: accumulates weight's grad, fires its hooks, then bias's; returns dL/dx.

    Raises:
        TypeError: non-int features, non-floating dtype, input dtype != parameter dtype,
            input (or grad_output) on another device than the parameters; a bad ``rng``.
        ValueError: features < 1, input last dim != in_features, grad_output shape mismatch.
        RuntimeError: backward before forward.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        dtype: Any = np.float32,
        rng: Union[np.random.Generator, int, None] = None,
        xp: Any = np,
        device: Optional[Union[str, int]] = None,
    ) -> None:
        super().__init__()
        check_int(in_features, "in_features", "Linear", 1)
        check_int(out_features, "out_features", "Linear", 1)
        dt = np.dtype(dtype)
        if dt.kind != "f":
            raise TypeError(f"{prefix('Linear')} dtype must be a floating dtype, got {dt}")
        gen = generator(rng, "Linear")
        bound = 1.0 / math.sqrt(in_features)
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.weight = Parameter(xp.asarray(gen.uniform(-bound, bound, (out_features, in_features)).astype(dt)))
        self.bias = Parameter(xp.asarray(gen.uniform(-bound, bound, out_features).astype(dt))) if bias else None
        self._input: Optional[Any] = None
        if device is not None:
            self.to(device)

    def _owner(self) -> str:
        return f"parameter {self.weight.name or 'weight'!r}"

    def forward(self, x: Any) -> Any:
        op = "Linear.forward"
        check_array(x, "x", op)
        if x.ndim < 1 or x.shape[-1] != self.in_features:
            raise ValueError(
                f"{prefix(op)} x must have shape (N, {self.in_features}) (last dim = in_features), got {tuple(x.shape)}"
            )
        if x.dtype != self.weight.dtype:
            raise TypeError(f"{prefix(op)} x must have dtype {self.weight.dtype} (the parameters'), got {x.dtype}")
        check_device(x, self.weight.data, "x", self._owner, op)
        self._input = x
        y = x @ self.weight.data.T
        if self.bias is not None:
            y += self.bias.data
        return y

    def backward(self, grad_output: Any) -> Any:
        op = "Linear.backward"
        x = self._input
        if x is None:
            raise RuntimeError(f"{prefix(op)} called before forward")
        check_array(grad_output, "grad_output", op)
        expected = tuple(x.shape[:-1]) + (self.out_features,)
        if tuple(grad_output.shape) != expected:
            raise ValueError(f"{prefix(op)} grad_output must have shape {expected}, got {tuple(grad_output.shape)}")
        if grad_output.dtype != self.weight.dtype:
            raise TypeError(f"{prefix(op)} grad_output must have dtype {self.weight.dtype}, got {grad_output.dtype}")
        check_device(grad_output, self.weight.data, "grad_output", self._owner, op)
        g = grad_output.reshape(-1, self.out_features)
        self.weight.accumulate_grad(g.T @ x.reshape(-1, self.in_features))
        if self.bias is not None:
            self.bias.accumulate_grad(g.sum(axis=0))
        return (g @ self.weight.data).reshape(x.shape)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class ReLU(Module):
    """``max(x, 0)`` elementwise (torch.nn.ReLU); any shape and floating dtype.

    ``backward(g)`` returns ``g * (x > 0)`` (gradient 0 at x == 0, as torch).
    Raises RuntimeError (backward before forward), ValueError (shape mismatch), TypeError
    (grad_output on another device than the forward input).
    """

    def __init__(self) -> None:
        super().__init__()
        self._mask: Optional[Any] = None

    def forward(self, x: Any) -> Any:
        check_array(x, "x", "ReLU.forward")
        self._mask = x > 0
        return array_module(x).maximum(x, 0)

    def backward(self, grad_output: Any) -> Any:
        _check_grad_output(grad_output, self._mask, "ReLU.backward")
        return grad_output * self._mask


class Dropout(Module):
    """Zero each element with probability ``p`` in training, scale the rest by ``1/(1-p)``
    (torch.nn.Dropout); the identity in eval mode (``module.eval()``) or with ``p == 0``.

    Args:
        p: probability of an element being zeroed, in [0, 1] (``p == 1`` zeroes everything).
        inplace: write the result into the input array (torch's ``inplace``).
        rng: mpidist extension: a ``numpy.random.Generator`` or seed for the masks; ``None``
            (default): the default generator of :mod:`mpidist.nn` at each forward, so
            :func:`mpidist.nn.manual_seed` makes the masks reproducible, as ``torch.manual_seed``.

    ``forward(x)``: any shape, floating dtype; the mask is drawn on the host (so a seed gives
    the same mask on every device) as ``bernoulli(1 - p) / (1 - p)`` in ``x.dtype`` and
    multiplied in. ``backward(g)`` returns ``g`` times the same mask.

    Raises:
        ValueError: ``p`` outside [0, 1]; grad_output of another shape than the input.
        TypeError: ``p`` not a real number, ``inplace`` not a bool, a bad ``rng``; a
            non-floating input.
        RuntimeError: backward before forward.
    """

    p: float
    inplace: bool
    _rng: Optional[np.random.Generator]

    def __init__(
        self, p: float = 0.5, inplace: bool = False, *, rng: Union[np.random.Generator, int, None] = None
    ) -> None:
        super().__init__()
        if not isinstance(p, numbers.Real) or isinstance(p, bool):
            raise TypeError(f"{prefix('Dropout')} p must be a real number, got {type(p).__name__}")
        if not 0 <= p <= 1:
            raise ValueError(f"{prefix('Dropout')} dropout probability has to be between 0 and 1, but got {p}")
        check_bool(inplace, "inplace", "Dropout")
        self.p, self.inplace = float(p), inplace
        self._rng = None if rng is None else generator(rng, "Dropout")
        self._scale: Optional[Any] = None  # the mask times 1/(1-p); None: identity
        self._input: Optional[Any] = None  # the forward input (shape, device), by reference

    def forward(self, x: Any) -> Any:
        op = "Dropout.forward"
        check_array(x, "x", op, floating=True)
        self._input = x
        if not self.training or self.p == 0:
            self._scale = None
            return x
        gen = self._rng if self._rng is not None else generator(None, op)
        keep = gen.random(x.shape) >= self.p
        dt = x.dtype.type
        scale = keep.astype(x.dtype) / dt(1 - self.p) if self.p < 1 else keep.astype(x.dtype)
        self._scale = like(scale, x, op)
        if self.inplace:
            x *= self._scale
            return x
        return x * self._scale

    def backward(self, grad_output: Any) -> Any:
        _check_grad_output(grad_output, self._input, "Dropout.backward")
        return grad_output if self._scale is None else grad_output * self._scale

    def extra_repr(self) -> str:
        return f"p={self.p}, inplace={self.inplace}"


class LogSoftmax(Module):
    """``log(softmax(x))`` along ``dim`` (torch.nn.LogSoftmax), computed as ``z - log(sum(exp(z)))``
    with ``z = x - max(x)`` so large inputs stay finite.

    ``dim=None`` picks torch's implicit dimension (0 for 0-, 1- and 3-D inputs, else 1) with
    torch's deprecation UserWarning. ``backward(g)`` returns ``g - softmax(x) * sum(g, dim)``.

    Raises:
        TypeError: ``dim`` not an int or None; a non-floating input.
        ValueError: ``dim`` out of range for the input; grad_output of another shape.
        RuntimeError: backward before forward.
    """

    def __init__(self, dim: Optional[int] = None) -> None:
        super().__init__()
        if dim is not None and (not isinstance(dim, numbers.Integral) or isinstance(dim, bool)):
            raise TypeError(f"{prefix('LogSoftmax')} dim must be an int or None, got {type(dim).__name__}")
        self.dim = dim
        self._out: Optional[Any] = None
        self._axis: Optional[int] = 0

    def forward(self, x: Any) -> Any:
        op = "LogSoftmax.forward"
        check_array(x, "x", op, floating=True)
        dim = self.dim
        if dim is None:
            dim = 0 if x.ndim in (0, 1, 3) else 1  # torch.nn.functional._get_softmax_dim
            warnings.warn(
                f"Implicit dimension choice for log_softmax has been deprecated. Change the call to "
                f"include dim={dim} as an argument.",
                UserWarning,
                stacklevel=2,
            )
        ndim = max(x.ndim, 1)
        if not -ndim <= dim < ndim:
            raise ValueError(f"{prefix(op)} dim must be in [{-ndim}, {ndim - 1}] for a {x.ndim}-D input, got {dim}")
        self._axis = dim % ndim if x.ndim else None
        xp = array_module(x)
        z = x - x.max(axis=self._axis, keepdims=True)
        self._out = z - xp.log(xp.exp(z).sum(axis=self._axis, keepdims=True))
        return self._out

    def backward(self, grad_output: Any) -> Any:
        out = self._out
        _check_grad_output(grad_output, out, "LogSoftmax.backward")
        xp = array_module(out)
        return grad_output - xp.exp(out) * grad_output.sum(axis=self._axis, keepdims=True)

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


class Sequential(Module):
    """Chain of modules named ``"0"``, ``"1"``, ... (torch.nn.Sequential).

    ``forward`` runs the children in order, ``backward`` in reverse, so the last layer's
    parameters get their grads (and fire their hooks) first. Since each module caches a single
    forward, a module instance may appear only once.

    Raises:
        TypeError: an argument is not a Module.  ValueError: the same instance appears twice.
    """

    def __init__(self, *modules: Module) -> None:
        super().__init__()
        for i, m in enumerate(modules):
            if not isinstance(m, Module):
                raise TypeError(f"{prefix('Sequential')} argument {i} must be a Module, got {type(m).__name__}")
        if len({id(m) for m in modules}) != len(modules):
            raise ValueError(f"{prefix('Sequential')} a module instance appears more than once")
        for i, m in enumerate(modules):
            self.add_module(str(i), m)

    def forward(self, x: Any) -> Any:
        for m in self._modules.values():
            x = m(x)
        return x

    def backward(self, grad_output: Any) -> Any:
        for m in reversed(list(self._modules.values())):
            grad_output = m.backward(grad_output)
        return grad_output

    def __len__(self) -> int:
        return len(self._modules)

    def __getitem__(self, idx: int) -> Module:
        return list(self._modules.values())[idx]

    def __iter__(self) -> Iterator[Module]:
        return iter(list(self._modules.values()))
