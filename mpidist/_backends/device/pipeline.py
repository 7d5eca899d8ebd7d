"""Pipelined host staging: large device arrays move through host memory in chunks, the
copies of one chunk overlapping MPI on another.

For :data:`OPS` of at least two chunks (:data:`CHUNK_VAR`), every chunk's copy down is enqueued
at once on a copy stream, each followed by an event; chunk by chunk the host waits for its
event, runs the MPI step on it and enqueues its copy up on a second stream. The call is one
collective for the check and the recorder, keyed as the unchunked call. all_gather's host output
and reduce_scatter's host input are chunk-major (the n pieces of chunk k side by side), so each
chunk's MPI call takes contiguous buffers. docs/device.md, "Pipelined staging".
"""

from __future__ import annotations

import math
import os
from functools import partial
from typing import Any, Optional

import numpy as np

from mpidist._arrays.buffers import group_blocks, mpi_datatype
from mpidist._arrays.reduce_op import check_op_dtype
from mpidist._backends.device.staging import pool_for
from mpidist._backends.mpi.collectives import reduce_body
from mpidist._backends.mpi.reductions import _reduce_scatter_tensor
from mpidist._core.group import ProcessGroup
from mpidist._dispatch.dispatch import launch, root_rank
from mpidist._launch.environment import STAGING_CHUNK_ENV, byte_setting
from mpidist.device import op_args as A
from mpidist.device.runtime import DeviceRuntime
from mpidist.errors import prefix
from mpidist.work import Work

__all__ = ["OPS", "CHUNK_VAR", "DEFAULT_CHUNK", "chunk_bytes", "run"]

#: The ops this module pipelines, and the argument whose size is chunked (what each rank contributes).
_SIZED = {
    "all_reduce": "tensor",
    "broadcast": "tensor",
    "all_gather_into_tensor": "input_tensor",
    "reduce_scatter_tensor": "output",
}
OPS = frozenset(_SIZED)
#: Bytes per chunk of the array each rank contributes; "0" or "off": no pipelining.
CHUNK_VAR = STAGING_CHUNK_ENV
#: The default chunk (bytes), chosen by measurement on an H200 (docs/device.md, "Host staging").
DEFAULT_CHUNK = 4 << 20


_parsed: tuple = ("", DEFAULT_CHUNK)  # (the variable's text, its value): parsed once per text


def chunk_bytes(op: str = "staging") -> int:
    """The chunk size in bytes from :data:`CHUNK_VAR` (0: pipelining off).

    Raises:
        ValueError: a value :func:`~mpidist._launch.environment.byte_count` does not take,
            naming ``op``.
    """
    global _parsed
    text = os.environ.get(CHUNK_VAR, "")
    if text == _parsed[0]:
        return _parsed[1]
    value = byte_setting(CHUNK_VAR, prefix(op))
    _parsed = (text, DEFAULT_CHUNK if value is None else value)
    return _parsed[1]


class _Copy:
    """One copy of a chunk piece: device array, byte offset into it, host bytes."""

    __slots__ = ("x", "offset", "host")

    def __init__(self, x: Any, offset: int, host: np.ndarray) -> None:
        self.x, self.offset, self.host = x, offset, host


def _ranges(total: int, chunk: int) -> list[tuple[int, int]]:
    """(start, length) in bytes of each chunk of ``total`` bytes."""
    return [(start, min(chunk, total - start)) for start in range(0, total, chunk)]


def _pipeline(rt: DeviceRuntime, device: int, chunks: list, buffers: list) -> None:
    """Run ``chunks`` ((copies down, host step, copies up) each), then give ``buffers`` back
    to the pool once the streams are drained, also on error."""
    with rt.on_device(device):
        down, up = rt.copy_streams(device)
        try:
            ready = []
            for copies, _, _ in chunks:
                for c in copies:
                    rt.copy_down(c.x, c.offset, c.host, down)
                ready.append(rt.record(down))
            for (_, step, ups), event in zip(chunks, ready):
                rt.wait(event)
                step()
                for c in ups:
                    rt.copy_up(c.host, c.x, c.offset, up)
        finally:
            rt.wait(rt.record(down))  # no copy may still use a buffer the pool hands out again
            rt.wait(rt.record(up))
            _release(rt, buffers)


def _release(rt: DeviceRuntime, buffers: list) -> None:
    """Give ``buffers`` back to the pool, once (the list is emptied)."""
    pool = pool_for(rt)
    while buffers:
        pool.release(buffers.pop())


def _host(rt: DeviceRuntime, x: Any) -> tuple[np.ndarray, np.ndarray]:
    """A pinned buffer for ``x``'s bytes and its view with ``x``'s shape and dtype."""
    shape, dtype = rt.shape_dtype(x)
    nbytes = math.prod(shape) * dtype.itemsize
    buf = pool_for(rt).acquire(nbytes)
    return buf, buf[:nbytes].view(dtype).reshape(shape)


def run(op: str, g: ProcessGroup, args: dict, rt: DeviceRuntime) -> Any:
    """Run ``op`` (a public op's arguments by name, its root a global rank) pipelined, or
    return :data:`NotImplemented` where it does not apply (too small, pipelining off,
    overlapping arrays, a form with lists): the caller then stages it plainly.

    Returns what the public op returns (None, or a Work when ``async_op``). Raises what the
    host op raises for the call (its checks run on the host views, before anything moves).
    """
    chunk = chunk_bytes(op)
    if op not in OPS or not chunk:
        return NotImplemented
    x = args[_SIZED[op]]
    if not A.is_device_array(x):
        return NotImplemented
    shape, dtype = rt.shape_dtype(x)
    if math.prod(shape) * dtype.itemsize < 2 * chunk:  # (the common small call leaves here)
        return NotImplemented
    found = [f for f in A.leaves(op, args) if A.is_device_array(f[1])]
    if A.overlapping(rt, found):
        return NotImplemented
    for _, y, _ in found:
        rt.synchronize(y)  # the work producing the arrays is done (as plain staging)
    device = rt.device_of(found[0][1])
    return _OPS[op](g, args, rt, device, max(chunk - chunk % dtype.itemsize, dtype.itemsize))


def _all_reduce(g: ProcessGroup, args: dict, rt: DeviceRuntime, device: int, chunk: int) -> Optional[Work]:
    x, op = args["tensor"], args["op"]
    buf, host = _host(rt, x)
    try:
        body = reduce_body(host.dtype, op, args.get("algorithm"))
    except BaseException:
        _release(rt, [buf])
        raise
    flat = buf[: host.nbytes]
    chunks = []
    for start, n in _ranges(host.nbytes, chunk):
        piece = _Copy(x, start, flat[start : start + n])
        step = partial(body, g, piece.host.view(host.dtype), op)
        chunks.append(([piece], step, [piece]))
    return _launch(g, "all_reduce", rt, device, chunks, [buf], args, (x,), host, count=host.size, redop=op)


def _broadcast(g: ProcessGroup, args: dict, rt: DeviceRuntime, device: int, chunk: int) -> Optional[Work]:
    x = args["tensor"]
    root = root_rank(g, args.get("src"), None, "broadcast", "src", "group_src")
    buf, host = _host(rt, x)
    flat, dt, mine = buf[: host.nbytes], mpi_datatype(host.dtype), g.rank() == root
    chunks = []
    for start, n in _ranges(host.nbytes, chunk):
        piece = _Copy(x, start, flat[start : start + n])
        step = partial(g.comm.Bcast, [piece.host.view(host.dtype), dt], root)  # type: ignore[union-attr]  # a member's
        chunks.append(([piece] if mine else [], step, [] if mine else [piece]))
    return _launch(g, "broadcast", rt, device, chunks, [buf], args, (x,), host, count=host.size, root=g.ranks[root])


def _all_gather(g: ProcessGroup, args: dict, rt: DeviceRuntime, device: int, chunk: int) -> Optional[Work]:
    out, inp = args["output_tensor"], args["input_tensor"]
    n = g.size()
    in_buf, in_host = _host(rt, inp)
    out_buf, out_host = _host(rt, out)
    try:
        group_blocks(out_host, in_host, n, "all_gather_into_tensor", "output_tensor", "input_tensor", gather=True)
    except BaseException:
        _release(rt, [in_buf, out_buf])
        raise
    size, dt = in_host.nbytes, mpi_datatype(in_host.dtype)
    chunks = []
    for start, k in _ranges(size, chunk):
        send = in_buf[start : start + k]
        region = out_buf[n * start : n * (start + k)]  # chunk-major: the n pieces of this chunk
        ups = [_Copy(out, r * size + start, region[r * k : (r + 1) * k]) for r in range(n)]
        step = partial(g.comm.Allgather, [send.view(in_host.dtype), dt], [region.view(in_host.dtype), dt])  # type: ignore[union-attr]
        chunks.append(([_Copy(inp, start, send)], step, ups))
    return _launch(
        g, "all_gather_into_tensor", rt, device, chunks, [in_buf, out_buf], args, (out,), in_host, count=out_host.size
    )


def _reduce_scatter(g: ProcessGroup, args: dict, rt: DeviceRuntime, device: int, chunk: int) -> Optional[Work]:
    out, inp = args["output"], args["input"]
    n, name = g.size(), "reduce_scatter_tensor"
    out_buf, out_host = _host(rt, out)
    in_buf, in_host = _host(rt, inp)
    try:
        group_blocks(out_host, in_host, n, name, "output", "input", gather=False)
        op = check_op_dtype(args["op"], out_host.dtype, prefix(name))
    except BaseException:
        _release(rt, [in_buf, out_buf])
        raise
    size, dtype = out_host.nbytes, out_host.dtype
    chunks = []
    for start, k in _ranges(size, chunk):
        region = in_buf[n * start : n * (start + k)]  # chunk-major: the n pieces of this chunk
        downs = [_Copy(inp, r * size + start, region[r * k : (r + 1) * k]) for r in range(n)]
        piece = _Copy(out, start, out_buf[start : start + k])
        step = partial(_reduce_scatter_tensor, g, piece.host.view(dtype), region.view(dtype), op)
        chunks.append((downs, step, [piece]))
    return _launch(
        g, name, rt, device, chunks, [out_buf, in_buf], args, (out,), in_host, count=out_host.size, redop=op,
        dtype=dtype,
    )  # fmt: skip


def _launch(
    g: ProcessGroup,
    name: str,
    rt: DeviceRuntime,
    device: int,
    chunks: list,
    buffers: list,
    args: dict,
    outputs: tuple,
    keyed: np.ndarray,
    **key: Any,
) -> Optional[Work]:
    """One collective for the check and the recorder, keyed as the host op keys the call
    (``keyed``: the array whose shape and dtype it names), running the pipeline."""
    key.setdefault("dtype", keyed.dtype)
    try:
        return launch(
            g,
            name,
            _pipeline,
            (rt, device, chunks, buffers),
            bool(args.get("async_op")),
            outputs,
            shapes=keyed.shape,
            **key,
        )
    except BaseException:
        _release(rt, buffers)  # what is left: the pipeline never ran (a mismatch, a broken group)
        raise


_OPS: dict = {
    "all_reduce": _all_reduce,
    "broadcast": _broadcast,
    "all_gather_into_tensor": _all_gather,
    "reduce_scatter_tensor": _reduce_scatter,
}
