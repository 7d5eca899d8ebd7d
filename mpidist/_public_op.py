"""The entry of every public op, written once: resolve the group, send a call on device
arrays to the router, hand the rest to the MPI backend's body.

A public op is declared as a stub (signature and docstring) under ``@public_op(body)``. The
function that runs resolves ``group`` (a non-member gets None); sends a call whose primary
argument (:data:`mpidist.device.op_args.SIGNATURES`) is a device array to
:func:`mpidist._backends.device.route.device_call`; else calls ``body`` with the arguments by
position and the resolved group as ``g``. A point-to-point body takes ``group`` and resolves
it itself (:func:`mpidist._backends.mpi.p2p._prepare`). The function is compiled from the
stub's signature, as :mod:`dataclasses` compiles ``__init__``: a generic ``*args, **kwargs``
wrapper cost the 8-byte all_reduce ~60 ns (benchmarks/results/latency_layers.md).
docs/architecture.md, "The path of one all_reduce".
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional, TypeVar, cast

import numpy as np

from mpidist._backends.device.route import device_call, first_takes, takes
from mpidist._core import current
from mpidist._dispatch.dispatch import member
from mpidist.device.op_args import LIST, SIGNATURES

__all__ = ["public_op"]

#: A stub's type: the public op made from it keeps the stub's signature for type checkers.
F = TypeVar("F", bound=Callable[..., Any])


def public_op(body: Callable[..., Any], inline: Optional[Callable[..., bool]] = None) -> Callable[[F], F]:
    """Decorator: the stub it decorates becomes the public op running ``body`` (see the module).

    Args:
        body: the MPI backend's body; its parameters are the stub's, in the same order,
            with ``g`` (the resolved group) for ``group``, or ``group`` itself where the
            body resolves it (point-to-point).
        inline: tried first, with ``body``'s arguments: True when it ran the call (a
            compiled latency path: :mod:`mpidist._backends.mpi.inline`), False for ``body``.

    Raises:
        TypeError: at import, when ``body``'s parameters do not match the stub's, or the
            stub has code besides its docstring.
    """

    def make(stub: F) -> F:
        name, op = stub.__name__, body.__name__
        sig = inspect.signature(stub)
        names = list(sig.parameters)
        got = list(inspect.signature(body).parameters)
        resolve = "g" in got
        expected = [("g" if p == "group" and resolve else p) for p in names]
        if got != expected:
            raise TypeError(f"public_op {name}: body {body.__qualname__} must take {expected}, got {got}")
        if stub.__code__.co_names or len(stub.__code__.co_varnames) > len(names):  # code that would never run
            raise TypeError(f"public_op {name}: the stub must hold only its signature and docstring")
        primary = SIGNATURES.get(op, ((None, None, None),))[0]
        params, star = [], False
        for p in sig.parameters.values():
            if p.kind is p.KEYWORD_ONLY and not star:
                params.append("*")
                star = True
            params.append(p.name)
        by_name = ", ".join(f"{p!r}: {p}" for p in names if p != "group")
        lines = [f"def {name}({', '.join(params)}):"]
        if resolve:
            lines += [
                "    st = _current.state",
                "    if group is None and st is not None:",
                "        g = st.world  # the common case: member(None) without the call",
                "    else:",
                "        g = _member(group)",
                "        if g is None:",
                "            return None",
            ]
        if inline is not None:
            lines.append(f"    if _inline({', '.join(expected)}):\n        return None")
        if primary[0] is not None:
            lines += [
                f"    if type({primary[0]}) is not _ndarray and _takes({primary[0]}):",
                f"        return _device_call({op!r}, {'g' if resolve else '_member(group)'}, {{{by_name}}})",
            ]
        lines.append(f"    return _body({', '.join(expected)})")
        scope: dict[str, Any] = {
            "_current": current,
            "_member": member,
            "_ndarray": np.ndarray,
            "_takes": first_takes if primary[2] == LIST else takes,
            "_device_call": device_call,
            "_body": body,
            "_inline": inline,
        }
        exec(compile("\n".join(lines), f"<mpidist public op {name}>", "exec"), scope)  # noqa: S102
        fn = scope[name]
        fn.__defaults__, fn.__kwdefaults__ = stub.__defaults__, stub.__kwdefaults__
        for attr in ("__module__", "__qualname__", "__doc__", "__annotations__"):
            setattr(fn, attr, getattr(stub, attr))
        fn.__wrapped__ = stub  # where typing.get_type_hints finds the annotations' names
        return cast(F, fn)

    return make
