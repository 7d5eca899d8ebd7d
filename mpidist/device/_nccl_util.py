"""Small pieces shared by the NCCL ops: argument checks, temporaries, device copies,
scaling (PREMUL_SUM) and division (AVG without ncclAvg) on the communicator's stream,
NCCL groups, and the common path of a collective (communicator, record, launch)."""
from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from mpidist._buffers import holds, same_dtype
from mpidist.device import _nccl_shim
from mpidist.device._nccl_core import Dev, NcclComm, Plan, device_array, mover, overlaps, state
from mpidist.device._nccl_work import NcclWork, collective_rec, launch
from mpidist.errors import prefix
from mpidist._group import ProcessGroup
from mpidist._reduce_op import _premul_factor

__all__ = ["version", "pair", "holds", "arrays", "same_shape", "new_buffer", "copy_of", "scale", "divide",
           "scaled_input", "Group", "collective", "back_to_back", "copy", "send_recv", "p2p_group_body",
           "rows"]

_VERSIONS: dict = {}


def version(shim: Any) -> int:
    """NCCL's runtime version code through ``shim`` (asked once per shim)."""
    found = _VERSIONS.get(id(shim))
    if found is None or found[0] is not shim:
        found = _VERSIONS[id(shim)] = (shim, shim.version())
    return found[1]


# -- small pieces ---------------------------------------------------------------------------------

def pair(name: str, output: Any, input: Any, out_arg: str = "output",  # noqa: A002
         in_arg: str = "input") -> tuple[Any, Dev, Dev]:
    """The shim and an op's ``output`` (writable) and ``input`` device arrays, of one dtype."""
    shim = _nccl_shim.get()
    out = device_array(output, name, out_arg, True, shim)
    inp = device_array(input, name, in_arg, False, shim)
    same_dtype(out, inp, name, out_arg, in_arg)
    return shim, out, inp


def arrays(xs: Any, name: str, arg: str, n: int, writable: bool, shim: Any, ref: Optional[Dev] = None,
           ref_arg: str = "", per_rank: bool = False) -> list[Dev]:
    """Validate a list of ``n`` device arrays of ``ref``'s dtype (default: the first
    element's); ``per_rank`` words a wrong length as reduce_scatter does."""
    if not isinstance(xs, (list, tuple)):
        raise TypeError(f"{prefix(name)} {arg} must be a list of device arrays, got {type(xs).__name__}")
    if len(xs) != n:
        what = f"one array per group rank: expected {n}" if per_rank else f"the group size = {n} arrays"
        raise ValueError(f"{prefix(name)} {arg} must hold {what}, got {len(xs)}")
    if not xs:
        raise ValueError(f"{prefix(name)} {arg} must hold at least one array, got an empty list")
    devs = [device_array(x, name, f"{arg}[{i}]", writable, shim) for i, x in enumerate(xs)]
    ref, ref_arg = (ref, ref_arg) if ref is not None else (devs[0], f"{arg}[0]")
    for i, d in enumerate(devs):
        same_dtype(ref, d, name, ref_arg, f"{arg}[{i}]")
    return devs


def same_shape(a: Dev, ref: Dev, name: str, arg: str, ref_arg: str, why: str = "") -> None:
    if a.shape != ref.shape:
        raise ValueError(f"{prefix(name)} {arg} must have the shape of {ref_arg}, {ref.shape}{why}, got {a.shape}")


def new_buffer(comm: NcclComm, count: int, dtype: np.dtype) -> tuple[Any, int]:
    """A new device buffer, allocated on the communicator's stream; (array, pointer)."""
    shim = comm.shim
    with shim.on_stream(comm.stream):
        arr = shim.empty(count, dtype)
    return arr, shim.pointer(arr)


def copy_of(comm: NcclComm, d: Dev) -> tuple[Any, int]:
    """A device copy of ``d`` made on the communicator's stream; (array, pointer)."""
    arr, ptr = new_buffer(comm, d.size, d.dtype)
    comm.shim.copy(ptr, d.ptr, d.nbytes, comm.stream)
    return arr, ptr


def scale(comm: NcclComm, src: Dev, dst_ptr: int, plan: Plan) -> None:
    """``dst = factor * src`` on the stream (PREMUL_SUM; ``dst`` may be ``src``)."""
    shim = comm.shim
    factor = _premul_factor(plan.premul, src.dtype)[()]
    with shim.on_stream(comm.stream):
        out = shim.view(dst_ptr, src.size, src.dtype, comm.device)
        shim.xp.multiply(shim.view(src.ptr, src.size, src.dtype, comm.device, src.obj), factor, out=out)


def divide(comm: NcclComm, d: Dev, n: int) -> None:
    """``d /= n`` on the stream (AVG where NCCL has no ncclAvg); complex part by part, as
    ncclAvg treats them (pairs of reals)."""
    shim = comm.shim
    dtype, count = d.dtype, d.size
    if dtype.kind == "c":
        dtype, count = np.dtype(f"f{dtype.itemsize // 2}"), 2 * count
    with shim.on_stream(comm.stream):
        view = shim.view(d.ptr, count, dtype, comm.device, d.obj)
        shim.xp.divide(view, n, out=view)


def scaled_input(comm: NcclComm, d: Dev, plan: Plan) -> tuple[Any, int]:
    """A scaled copy of ``d`` for PREMUL_SUM, else (None, d's own pointer)."""
    if plan.premul is None:
        return None, d.ptr
    arr, ptr = new_buffer(comm, d.size, d.dtype)
    scale(comm, d, ptr, plan)
    return arr, ptr


class Group:
    """``with Group(shim):`` brackets NCCL calls in ncclGroupStart/ncclGroupEnd."""

    def __init__(self, shim: Any) -> None:
        self.shim = shim

    def __enter__(self) -> None:
        self.shim.group_start()

    def __exit__(self, *exc: Any) -> bool:
        self.shim.group_end()
        return False


def collective(g: ProcessGroup, name: str, devs: Sequence[Dev], args: Sequence[str], body: Any, bargs: tuple,
               refs: tuple, outputs: tuple, async_op: bool, shapes: Any, root: int = -1, device: Optional[int] = None,
               host_wait: bool = False) -> Optional[NcclWork]:
    """Get the group's communicator (device-checking ``devs``; ``device``: the one to make it
    on, barrier), record, and launch ``body`` (``host_wait``: see launch)."""
    comm = state(g).collective(name, devs, args, device)
    rec = collective_rec(g, name, shapes, devs[0].dtype if devs else None, root)
    works = launch(comm, g, name, body, bargs, refs, async_op, [(name, outputs, [rec], None)], host_wait, devs)
    return works[0] if works else None


def back_to_back(devs: Sequence[Dev]) -> bool:
    """True if the arrays lie one after the other in memory, in list order."""
    return all(b.ptr == a.ptr + a.nbytes for a, b in zip(devs, devs[1:]))


def copy(comm: NcclComm, dst: Dev, src: Dev) -> Any:
    """``dst = src`` on the stream (nothing if they are the same memory; through a temporary,
    returned, if they overlap otherwise)."""
    if dst.ptr == src.ptr:
        return None
    if overlaps(dst, src):
        temp, ptr = copy_of(comm, src)
        comm.shim.copy(dst.ptr, ptr, src.nbytes, comm.stream)
        return temp
    comm.shim.copy(dst.ptr, src.ptr, src.nbytes, comm.stream)
    return None


def send_recv(comm: NcclComm, d: Dev, peer: int, receive: bool = False) -> None:
    """ncclSend of ``d`` to ``peer`` (a rank of ``comm``), or ncclRecv into it, on the stream."""
    kind, mult = mover(d.dtype)
    (comm.nccl.recv if receive else comm.nccl.send)(d.ptr, d.size * mult, kind, peer, comm.stream.ptr)


def p2p_group_body(comm: NcclComm, sends: Sequence[tuple[int, Dev]], recvs: Sequence[tuple[int, Dev]],
                    before: Optional[tuple[Dev, Dev]] = None, after: Optional[tuple[Dev, Dev]] = None) -> Any:
    """Grouped ncclSend/ncclRecv ((group rank, array) pairs), with a device copy (dst, src)
    of this rank's own part ``before`` the group (gather: its input may be overwritten by a
    receive) or ``after`` it (scatter: its output may overlap a part being sent)."""
    temps = [copy(comm, *before)] if before is not None else []
    with Group(comm.shim):
        for peer, d in sends:
            send_recv(comm, d, peer)
        for peer, d in recvs:
            send_recv(comm, d, peer, True)
    if after is not None:
        temps.append(copy(comm, *after))
    return temps


def rows(base: Dev, rows: list[int]) -> list[Dev]:
    """``base`` cut along dim 0 into parts of ``rows`` rows each (flat Devs)."""
    per_row = base.size // base.shape[0] if base.shape and base.shape[0] else 0
    parts, at = [], base.ptr
    for r in rows:
        count = r * per_row
        parts.append(Dev(None, at, (count,), base.dtype, base.device))
        at += count * base.dtype.itemsize
    return parts
