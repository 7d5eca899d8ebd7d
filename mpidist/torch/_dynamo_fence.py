"""Keep torch.compile (TorchDynamo) out of mpidist's Python: the one fence.

:func:`fence_package` marks every function of every loaded ``mpidist`` module (methods,
properties, nested functions included) as ``torch.compiler.disable`` would, without a wrapper
(no per-call cost) and without importing ``torch._dynamo`` (1.7 s): its code object gets the
frame strategy "skip this frame and everything it calls"
(``torch._C._dynamo.eval_frame.set_code_exec_strategy``, torch >= 2.6), and the function gets
``_torchdynamo_disable = True``, which makes Dynamo's inliner graph-break at the call.
Why: docs/torch.md, "torch.compile".
"""

from __future__ import annotations

import sys
import types
from typing import Any, Callable, Optional

__all__ = ["fence_package", "fenced"]

_set_strategy: Optional[Callable[[types.CodeType], None]]
try:  # torch >= 2.6
    from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy

    _SKIP_ALL = _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP)

    def _set_strategy(code: types.CodeType) -> None:
        set_code_exec_strategy(code, _SKIP_ALL)

except ImportError:  # a torch without Dynamo's frame strategies: nothing to fence
    _set_strategy = None

#: code objects already marked (a code object is shared by every function made from it)
_marked: set = set()


def _mark_code(code: types.CodeType) -> None:
    if code in _marked or _set_strategy is None:
        return
    _marked.add(code)
    _set_strategy(code)
    for const in code.co_consts:  # nested functions, lambdas, comprehensions
        if isinstance(const, types.CodeType):
            _mark_code(const)


def _mark_function(fn: Any) -> None:
    if not isinstance(fn, types.FunctionType):
        return
    _mark_code(fn.__code__)
    _mark_function(getattr(fn, "__wrapped__", None))  # a decorator's inner function (functools.wraps)
    try:
        fn._torchdynamo_disable = True  # type: ignore[attr-defined]
        fn._torchdynamo_disable_msg = "mpidist's Python runs eagerly (docs/torch.md, torch.compile)"  # type: ignore[attr-defined]
    except AttributeError:  # pragma: no cover  (a function without __dict__)
        pass


def _mark_class(cls: type, module: str) -> None:
    for value in vars(cls).values():
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        if isinstance(value, property):
            for part in (value.fget, value.fset, value.fdel):
                if part is not None:
                    _mark_function(part)
        elif isinstance(value, type) and value.__module__ == module:
            _mark_class(value, module)
        else:
            _mark_function(value)


def fence_module(module: types.ModuleType) -> None:
    """Mark the functions and classes that ``module`` defines (see the module docstring)."""
    name = module.__name__
    for value in list(vars(module).values()):
        if isinstance(value, types.FunctionType) and value.__module__ == name:
            _mark_function(value)
        elif isinstance(value, type) and value.__module__ == name:
            _mark_class(value, name)


def fence_package(package: str = "mpidist") -> None:
    """Mark every loaded module of ``package`` (:func:`fence_module`). Modules imported
    later are reached only through fenced frames, whose strategy covers every frame they
    call. Idempotent; about 10 ms the first time."""
    for name, module in list(sys.modules.items()):
        if module is not None and (name == package or name.startswith(package + ".")):
            fence_module(module)


def fenced(fn: Any) -> bool:
    """Whether ``fn`` (a function or method) is behind the fence."""
    fn = getattr(fn, "__func__", fn)
    return isinstance(fn, types.FunctionType) and fn.__code__ in _marked
