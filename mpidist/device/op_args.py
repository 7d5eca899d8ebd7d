"""The array arguments of every op, in one table, and the checks on a call's arrays.

:data:`SIGNATURES` lists, per public op, its array arguments in the order the host op
validates them: the name, whether the op reads it (:data:`IN`), writes it
(:data:`OUT`) or both (:data:`INOUT`), and its structure (one array, a list, a list
of lists, a list of P2POp). The first one is the op's *primary* argument: the one
the op's entry line tests to route a call to :mod:`mpidist._backends.device.route`. Host
staging copies down what is read and copies back what is written from this table;
every other module asks it instead of knowing an op's arguments.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable, Optional

import numpy as np

from mpidist._arrays.namespace import is_device_array
from mpidist.device.runtime import DeviceRuntime, runtime_for
from mpidist.errors import prefix

__all__ = [
    "IN",
    "OUT",
    "INOUT",
    "ONE",
    "LIST",
    "LISTS",
    "P2P",
    "SIGNATURES",
    "primary_name",
    "leaves",
    "classify",
    "runtime_of",
    "replace",
    "device_label",
    "mixed_error",
    "passing_through",
    "passthrough",
    "is_receive",
]

IN, OUT, INOUT = 1, 2, 3  # bit 1: read by the op, bit 2: written by it
ONE, LIST, LISTS, P2P = "array", "list", "list of lists", "P2POp list"

#: op -> ((argument, role, structure), ...); the first entry is the primary argument.
SIGNATURES: dict[str, tuple] = {
    "all_reduce": (("tensor", INOUT, ONE),),
    "broadcast": (("tensor", INOUT, ONE),),
    "reduce": (("tensor", INOUT, ONE),),
    "all_gather": (("tensor", IN, ONE), ("tensor_list", OUT, LIST)),
    "all_gather_into_tensor": (("output_tensor", OUT, ONE), ("input_tensor", IN, ONE)),
    "gather": (("tensor", IN, ONE), ("gather_list", OUT, LIST)),
    "scatter": (("tensor", OUT, ONE), ("scatter_list", IN, LIST)),
    "reduce_scatter": (("output", OUT, ONE), ("input_list", IN, LIST)),
    "reduce_scatter_tensor": (("output", OUT, ONE), ("input", IN, ONE)),
    "all_to_all": (("input_tensor_list", IN, LIST), ("output_tensor_list", OUT, LIST)),
    "all_to_all_single": (("output", OUT, ONE), ("input", IN, ONE)),
    "all_reduce_multigpu": (("tensor_list", INOUT, LIST),),
    "reduce_multigpu": (("tensor_list", INOUT, LIST),),
    "broadcast_multigpu": (("tensor_list", INOUT, LIST),),
    "all_gather_multigpu": (("input_tensor_list", IN, LIST), ("output_tensor_lists", OUT, LISTS)),
    "send": (("tensor", IN, ONE),),
    "isend": (("tensor", IN, ONE),),
    "recv": (("tensor", OUT, ONE),),
    "irecv": (("tensor", OUT, ONE),),
    "batch_isend_irecv": (("p2p_op_list", None, P2P),),  # role per op: isend IN, irecv OUT
    "all_reduce_coalesced": (("tensors", INOUT, LIST),),
    "all_gather_coalesced": (("input_tensor_list", IN, LIST), ("output_tensor_lists", OUT, LISTS)),
}

_SUFFIX = {ONE: "", LIST: "[0]", LISTS: "[0][0]", P2P: "[0].tensor"}


_local = threading.local()


def passing_through() -> bool:
    """True while the CUDA-aware backend (:mod:`mpidist._backends.device.cuda_aware`) runs the MPI
    backend's body on device arrays: :func:`mpidist._arrays.buffers.host_array` then accepts them."""
    return getattr(_local, "through", False)


@contextmanager
def passthrough() -> Iterator[None]:
    """Mark this thread as running the MPI backend's body on device arrays (the CUDA-aware path)."""
    before = passing_through()
    _local.through = True
    try:
        yield
    finally:
        _local.through = before


def primary_name(op: str) -> Optional[str]:
    """How the primary argument of ``op`` is named in messages (``"tensor_list[0]"``)."""
    sig = SIGNATURES.get(op)
    return None if sig is None else sig[0][0] + _SUFFIX[sig[0][2]]


def _is_seq(xs: Any) -> bool:
    return isinstance(xs, (list, tuple))


def is_receive(p: Any) -> bool:
    """True if P2POp ``p`` receives: its op is irecv (P2POp takes only mpidist.isend or
    mpidist.irecv, so the name tells them apart)."""
    return getattr(p.op, "__name__", None) == "irecv"


def _rebuild(op: str, args: dict, conv: Callable[[str, Any, int], Any], make_p2p: Callable[..., Any]) -> dict:
    """``args`` with every array argument ``x`` replaced by ``conv(name in messages, x, role)``
    and each P2POp by ``make_p2p(p, new_tensor)``. None entries (an absent gather_list) and
    non-sequences where a list belongs are kept as given: the MPI backend's own validation
    reports those."""
    out = dict(args)
    for name, role, kind in SIGNATURES[op]:
        value = args.get(name)
        if value is None or (kind != ONE and not _is_seq(value)):
            continue
        if kind == ONE:
            out[name] = conv(name, value, role)
        elif kind == LIST:
            out[name] = [conv(f"{name}[{i}]", x, role) for i, x in enumerate(value)]
        elif kind == LISTS:
            out[name] = [
                [conv(f"{name}[{i}][{j}]", y, role) for j, y in enumerate(x)] if _is_seq(x) else x
                for i, x in enumerate(value)
            ]
        else:
            out[name] = [
                make_p2p(p, conv(f"{name}[{i}].tensor", p.tensor, OUT if is_receive(p) else IN))
                if hasattr(p, "tensor") and hasattr(p, "op")
                else p
                for i, p in enumerate(value)
            ]
    return out


def leaves(op: str, args: dict) -> list[tuple[str, Any, int]]:
    """Every array-like argument of a call: (name in messages, object, role), in the order of
    :data:`SIGNATURES`; what :func:`replace` keeps as given is skipped."""
    found: list = []
    _rebuild(op, args, lambda name, x, role: found.append((name, x, role)), lambda p, _: p)  # (args dropped)
    return found


def device_label(x: Any, runtime: Optional[DeviceRuntime] = None) -> str:
    """``"cuda:D"`` for a device array (``"GPU"`` when its device cannot be told)."""
    dl = getattr(x, "__dlpack_device__", None)
    try:
        if dl is not None:
            return f"cuda:{int(dl()[1])}"
        if runtime is not None:
            return f"cuda:{runtime.device_of(x)}"
    except Exception:  # noqa: BLE001, S110  (only for a message)
        pass
    return "GPU"


def mixed_error(op: str, dev_name: str, dev: Any, host_name: str) -> TypeError:
    """The error for a call that mixes a device and a host array."""
    return TypeError(
        f"{prefix(op)} {dev_name} is a device ({device_label(dev)}) array but {host_name} is a "
        f"host numpy array; every array of one call must be on the same side: move them with "
        f"cupy.asarray(...) or cupy.asnumpy(...) first"
    )


def runtime_of(op: str, args: dict) -> DeviceRuntime:
    """The runtime of the first device array of a call that :func:`classify` accepted."""
    name, x, _ = next(f for f in leaves(op, args) if is_device_array(f[1]))
    return runtime_for(x, op, name)


def classify(op: str, found: list) -> tuple[DeviceRuntime, int]:
    """Check the arrays of a call whose primary argument is a device array.

    ``found``: the call's :func:`leaves`. Returns (runtime, device index).

    Raises:
        TypeError: a host numpy array among them (mixed call); no runtime (no CuPy).
        ValueError: device arrays on different devices; a non-contiguous device array.
    """
    first = host = None
    for name, x, _ in found:
        if isinstance(x, np.ndarray):
            host = host or name
        elif first is None and is_device_array(x):
            first = (name, x)
    assert first is not None, "classify() is for calls with a device array"
    if host is not None:
        raise mixed_error(op, first[0], first[1], host)
    rt = runtime_for(first[1], op, first[0])
    device = rt.device_of(first[1])
    for name, x, _ in found:
        if not is_device_array(x):
            continue
        d = rt.device_of(x)
        if d != device:
            raise ValueError(
                f"{prefix(op)} {name} is on cuda:{d} but {first[0]} is on cuda:{device}; all "
                f"device arrays of one call must be on one device"
            )
        if not rt.c_contiguous(x):
            shape, _ = rt.shape_dtype(x)
            raise ValueError(
                f"{prefix(op)} {name} must be C-contiguous, got a non-contiguous array of shape "
                f"{shape} and strides {rt.strides(x)}"
            )
    return rt, device


def overlapping(rt: DeviceRuntime, found: list) -> bool:
    """True if two distinct device arrays of the call share memory (in-place forms)."""
    spans = sorted({id(x): rt.span(x) for _, x, _ in found if is_device_array(x)}.values())
    return any(a[0] + a[1] > b[0] for a, b in zip(spans, spans[1:]) if a[1] and b[1])


def replace(op: str, args: dict, conv: Callable[[Any, int], Any], make_p2p: Callable[..., Any]) -> dict:
    """``args`` with every array argument ``x`` replaced by ``conv(x, role)``; P2POp
    lists get new P2POp made by ``make_p2p(p, new_tensor)``. Other arguments as given."""
    return _rebuild(op, args, lambda _, x, role: conv(x, role), make_p2p)
