"""The router: a public op whose primary array argument is a device array hands the
call here with its resolved group (:mod:`mpidist._public_op`), and this resolves the root
once, picks the backend of the path of :mod:`mpidist._backends.device.paths` (NCCL, MPI on device
memory, or host staging: :class:`mpidist._dispatch.comm_backend.CommBackend`) and runs the call
there. Every backend lives below this module: the router never calls a public function back.

A public op's device test is ``type(x) is not np.ndarray and takes(x)``, so a host call
pays one type comparison. ``takes`` is False while a backend runs the MPI backend's body
on device arrays (the CUDA-aware path, :func:`passthrough`), where
:func:`mpidist._arrays.buffers.host_array` accepts them.
"""

from __future__ import annotations

import sys
from typing import Any, Optional

import numpy as np

from mpidist._arrays.namespace import is_device_array
from mpidist._backends.device import paths, pipeline
from mpidist._backends.device.cuda_aware import CUDA_AWARE
from mpidist._backends.device.staging import STAGING, warn_once
from mpidist._core.group import ProcessGroup
from mpidist._dispatch import dispatch
from mpidist._dispatch.p2p_op import P2POp
from mpidist._runtime import world as runtime
from mpidist.device import detect, op_args as A
from mpidist.device.op_args import passing_through, passthrough
from mpidist.errors import prefix

__all__ = ["takes", "first_takes", "device_call", "passthrough", "passing_through"]


def takes(x: Any) -> bool:
    """True if a call whose primary argument is ``x`` belongs to the router."""
    return is_device_array(x) and not passing_through()


def first_takes(xs: Any) -> bool:
    """:func:`takes` for the first entry of a list argument (False for anything else)."""
    return isinstance(xs, (list, tuple)) and len(xs) > 0 and type(xs[0]) is not np.ndarray and takes(xs[0])


#: op -> (its root argument, the global rank meant when neither it nor ``group_<arg>`` is
#: given: 0 as torch, None when one is required, -1 for any source)
_ROOTS = {
    "broadcast": ("src", None),
    "broadcast_multigpu": ("src", None),
    "scatter": ("src", 0),
    "recv": ("src", -1),
    "irecv": ("src", -1),
    "reduce": ("dst", None),
    "reduce_multigpu": ("dst", None),
    "gather": ("dst", 0),
    "send": ("dst", None),
    "isend": ("dst", None),
}


def _global_root(op: str, g: Any, args: dict) -> dict:
    """``args`` with the op's root (src/dst) as a global rank and no ``group_src``/
    ``group_dst`` (torch 2.4+): every path then sees one form (NCCL's ops take global
    ranks). Both or neither given: the MPI backend's checks raise (:func:`root_rank`)."""
    found = _ROOTS.get(op)
    if found is None:
        return args
    arg, default = found
    group_arg = "group_" + arg
    rank, group_rank = args.get(arg), args.pop(group_arg, None)
    if rank is None and group_rank is None and default == -1:
        return args  # a receive from any source
    root = dispatch.root_rank(g, rank, group_rank, op, arg, group_arg, None if default == -1 else default)
    args[arg] = g.ranks[root]
    return args


def device_call(op: str, g: Optional[ProcessGroup], args: dict) -> Any:
    """Run public op ``op`` on the backend the group and the MPI allow.

    Args:
        op: the public op's name.
        g: the resolved group (:mod:`mpidist._public_op`); None for a point-to-point op on
            a rank that is not a member (returns the op's non-member result: -1 for recv,
            else None) and for batch_isend_irecv (each P2POp names its group).
        args: the op's other arguments by name (not ``group``), the primary one a device array.

    Returns what the public op returns (None, a Work, recv's source rank, a list of
    Works); a Work of the staging or CUDA-aware path is a :class:`~staging.DeviceWork`.

    Raises:
        TypeError: host and device arrays mixed (also in lists); no CuPy.
        ValueError: device arrays on different devices or non-contiguous; whatever the
            MPI backend's body or NCCL raise for the call.
    """
    if op == "batch_isend_irecv":
        g, args = _batch_group(args)
        if g is None:
            return []
    elif g is None:
        return -1 if op == "recv" else None
    else:
        args = _global_root(op, g, args)
    backend = paths.device_backend(g.backend)
    if backend == "nccl" and op in _ONE_ARRAY:  # nothing to mix up: NCCL validates its one array
        return _nccl().run(op, g, args)
    found = list(A.leaves(op, args))
    rt, _ = A.classify(op, found)
    if backend == "nccl":
        return _nccl().run(op, g, args)
    found_dev = [f for f in found if is_device_array(f[1])]
    redop = args.get("op") if op in paths.REDUCING_OPS else None
    dtype = rt.shape_dtype(found_dev[0][1])[1] if found_dev and is_device_array(found_dev[0][1]) else None
    found_ok = paths.mpi_cuda_ok(op, dtype, redop, args.get("algorithm"), A.overlapping(rt, found_dev))
    path = paths.choose(True, backend, detect.detection().aware, found_ok)
    if path == paths.MPI_CUDA:
        return CUDA_AWARE.run(op, g, args, rt)
    if op in pipeline.OPS:
        done = pipeline.run(op, g, args, rt)
        if done is not NotImplemented:
            warn_once(detect.detection(), op)
            return done
    return STAGING.run(op, g, args, rt)


#: ops whose only array argument is one array (no list: nothing for :func:`A.classify` to compare)
_ONE_ARRAY = frozenset(op for op, sig in A.SIGNATURES.items() if len(sig) == 1 and sig[0][2] == A.ONE)


def _nccl() -> Any:
    """:mod:`mpidist._backends.device.nccl` (imported on first use: it loads cupy's NCCL; then found in
    ``sys.modules`` without the import statement's machinery, ~1 us a call)."""
    found = sys.modules.get("mpidist._backends.device.nccl")
    if found is None:
        from mpidist._backends.device import nccl as found  # noqa: PLC0415
    return found


def _batch_group(args: dict) -> tuple[Any, dict]:
    """The group of a batch's ops that the caller is in, and the args with only those ops
    (torch skips ops on other groups). Mixed device backends in one batch: ValueError."""
    ops = args["p2p_op_list"]
    mine, groups = [], []
    for i, p in enumerate(ops):
        g = runtime.resolve_group(getattr(p, "group", None))
        if g.comm is not None:
            mine.append(_global_peer(p, g, i))
            groups.append(g)
    if not mine:
        return None, args
    if len({paths.device_backend(g.backend) for g in groups}) > 1:
        raise ValueError(
            f"{prefix('batch_isend_irecv')} p2p_op_list mixes groups with NCCL and MPI "
            f"device backends; one batch must use one"
        )
    return groups[0], dict(args, p2p_op_list=mine)


def _global_peer(p: Any, g: Any, i: int) -> Any:
    """P2POp ``p`` (``p2p_op_list[i]``) with its peer as a global rank (torch 2.4+'s
    ``group_peer`` translated), as NCCL's batch expects; ``p`` itself when it has one."""
    group_peer = getattr(p, "group_peer", None)
    if group_peer is None:
        return p
    where = f"p2p_op_list[{i}]."
    rank = dispatch.root_rank(g, p.peer, group_peer, "batch_isend_irecv", f"{where}peer", f"{where}group_peer")
    return P2POp(p.op, p.tensor, g.ranks[rank], p.group, p.tag)


def batch_takes(p2p_op_list: Any) -> bool:
    """:func:`takes` for batch_isend_irecv: the first op's tensor is a device array."""
    return (
        isinstance(p2p_op_list, (list, tuple))
        and len(p2p_op_list) > 0
        and type(getattr(p2p_op_list[0], "tensor", None)) is not np.ndarray
        and takes(getattr(p2p_op_list[0], "tensor", None))
    )
