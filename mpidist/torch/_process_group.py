"""The torch ``ProcessGroup`` that runs every op through mpidist.

:class:`ProcessGroupMpidist` is what the backend creator returns for each group. Each method
(torch's backend signature) turns the tensors into zero-copy arrays
(:mod:`mpidist.torch._views`), translates group ranks to global ranks, calls the mpidist op of
the same meaning (several tensors: its ``*_multigpu`` form; ``*_coalesced``: one op per tensor
or pair; ``_allgather_base``/``_reduce_scatter_base``: the ``*_tensor`` ops; send/recv:
isend/irecv) and returns None (a sync op, done) or a :class:`~mpidist.torch._work.TorchWork`.
"""

from __future__ import annotations

import datetime
import operator
import sys
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllreduceCoalescedOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    GatherOptions,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
)

import mpidist
from mpidist import _coalesced, gather_scatter, reductions
from mpidist._backends.device import paths
from mpidist._runtime import world as runtime
from mpidist.errors import DistError, prefix
from mpidist.torch._profile import profiled, record, recording
from mpidist.torch._views import SparseTensor, Staged, array, direct
from mpidist.torch._work import TorchWork

__all__ = ["ProcessGroupMpidist", "BACKEND_NAME"]

BACKEND_NAME = "mpidist"

#: (Any: torch's stub declares RedOpType an Enum with no members; it is a pybind enum that has them)
_RedOpType: Any = dist.ReduceOp.RedOpType
_OPS = {
    int(_RedOpType.SUM): mpidist.ReduceOp.SUM,
    int(_RedOpType.AVG): mpidist.ReduceOp.AVG,
    int(_RedOpType.PRODUCT): mpidist.ReduceOp.PRODUCT,
    int(_RedOpType.MIN): mpidist.ReduceOp.MIN,
    int(_RedOpType.MAX): mpidist.ReduceOp.MAX,
    int(_RedOpType.BAND): mpidist.ReduceOp.BAND,
    int(_RedOpType.BOR): mpidist.ReduceOp.BOR,
    int(_RedOpType.BXOR): mpidist.ReduceOp.BXOR,
}
_SUM, _PREMUL = dist.ReduceOp.SUM, int(_RedOpType.PREMUL_SUM)
_MSUM, _MAVG = mpidist.ReduceOp.SUM, mpidist.ReduceOp.AVG

#: Whether torch's options carry ``asyncOp`` and its front end takes None from a sync op
#: (torch >= 2.8); before, every op returns a Work (docs/torch.md, "Versions ...": torch < 2.8)
_ASYNC_IN_OPTS = hasattr(AllreduceOptions(), "asyncOp")
#: ``opts.asyncOp`` (torch >= 2.8), else True: the op returns a Work for torch to wait on
#: (allreduce, broadcast and reduce test ``_ASYNC_IN_OPTS`` inline: no call on their path)
_is_async: Callable[[Any], bool] = operator.attrgetter("asyncOp") if _ASYNC_IN_OPTS else lambda opts: True


def _cuda() -> Any:
    """:mod:`mpidist.torch._cuda` (CUDA tensors only; imported once, then found in ``sys.modules``)."""
    found = sys.modules.get("mpidist.torch._cuda")
    if found is None:
        from mpidist.torch import _cuda as found  # noqa: PLC0415
    return found


def _nccl() -> Any:
    """:mod:`mpidist._backends.device.nccl` (loads CuPy's NCCL: imported on the first CUDA tensor of an NCCL group)."""
    found = sys.modules.get("mpidist._backends.device.nccl")
    if found is None:
        from mpidist._backends.device import nccl as found  # noqa: PLC0415
    return found


def _reduce_op(red: Any, op: str) -> Any:
    """mpidist's op for torch's ``red`` (a ``ReduceOp``, a ``RedOpType``, or the PREMUL_SUM
    that ``_make_nccl_premul_sum(factor)`` made)."""
    if red == _SUM:
        return _MSUM
    kind = red.op if isinstance(red, dist.ReduceOp) else red  # type: ignore[attr-defined]  # ReduceOp.op: missing from torch's stub
    try:
        value = int(kind)
    except (TypeError, ValueError):
        raise TypeError(f"{prefix(op)} op must be a torch.distributed.ReduceOp, got {red!r}") from None
    if value == _PREMUL:
        try:
            factor = red.factor
        except AttributeError:  # torch < 2.13 keeps the factor in C++ (``ReduceOp.factor``: pytorch#185863)
            raise ValueError(
                f"{prefix(op)} PREMUL_SUM needs torch >= 2.13: torch {torch.__version__} does not "
                f"show its factor to a Python backend; multiply the tensor, then use SUM"
            ) from None
        if isinstance(factor, torch.Tensor):  # one element (torch checks): 0-d, or torch.tensor([f]) as its tests
            factor = factor.reshape(())
            factor = float(factor.item()) if factor.is_cuda else array(factor, op, "PREMUL_SUM factor")
        return mpidist.make_premul_sum(factor)
    found = _OPS.get(value)
    if found is None:
        raise ValueError(f"{prefix(op)} unsupported reduce op {red!r}")
    return found


def _is_integer(t: Any) -> bool:
    """An integer tensor (not bool, floating point or complex)."""
    return not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype is torch.bool)


def _tensors(x: Any) -> list:
    """A tensor-list argument; a bare tensor stands for a list of one (torch's old overloads)."""
    return [x] if isinstance(x, torch.Tensor) else list(x)


def _options(opts: Any, cls: Any, **legacy: Any) -> Any:
    """``opts`` if it is a ``cls`` options object, else one built from torch's older
    positional forms (``legacy``: attribute -> value, None for "leave the default")."""
    if isinstance(opts, cls):
        return opts
    if opts is not None and not isinstance(opts, datetime.timedelta):  # (a legacy form's timeout)
        raise TypeError(f"opts must be a torch {cls.__name__}, got {type(opts).__name__}")
    made = cls()
    for name, value in legacy.items():
        if value is not None:
            setattr(made, name, value)
    return made


class ProcessGroupMpidist(dist.ProcessGroup):
    """A torch process group over the mpidist group ``group``.

    ``rank`` and ``size``: the caller's rank in the group and the group's size;
    ``owns_runtime``: this group started mpidist's runtime and stops it on ``shutdown()``;
    ``backend_name``: ``"mpidist"``, or ``"mpi"`` (:mod:`mpidist.torch._mpi_name`).

    Root and peer ranks in the options are group ranks; sync calls return None once the op
    is done, async ones (every one on torch < 2.8) a Work. Errors: TypeError/ValueError for
    bad arguments, DistError (a RuntimeError) for communication failures and timeouts
    (docs/torch.md, "Semantics").
    """

    def __init__(
        self, group: mpidist.ProcessGroup, rank: int, size: int, owns_runtime: bool, backend_name: str = BACKEND_NAME
    ) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # torch's (rank, size) overload: missing from its stub
        self._backend_name = backend_name
        self._mg = group
        st = runtime.state_or_none()
        #: what mpidist's ops get as ``group``: None for the world (their fastest path)
        self._arg = None if st is not None and group is st.world else group
        self._ranks = tuple(group.ranks)
        self._owns = owns_runtime
        self._state = st  # the runtime the group was made in (release() frees only within it)
        self._released = False
        self._name = ""
        self._desc = ""
        self._coalesced: Optional[list] = None  # Works issued between _start/_end_coalescing
        #: CUDA tensors go through NCCL on this group (its mpidist group's backend names it)
        self._nccl = paths.device_backend(group.backend) == "nccl"

    # -- housekeeping -----------------------------------------------------------------------
    def getBackendName(self) -> str:  # noqa: N802  (torch's names)
        return self._backend_name

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._name = name

    def getGroupName(self) -> str:  # noqa: N802
        return self._name

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._desc = desc
        if desc and desc != "undefined" and self._may_rename():
            self._mg.group_name = desc  # mpidist's errors and flight recorder name the group so

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._desc

    def _may_rename(self) -> bool:
        """False for mpidist's default group when mpidist was initialized before torch (its name is the user's)."""
        st = runtime.state_or_none()
        return self._owns or st is None or self._mg is not st.world

    @property
    def mpidist_group(self) -> mpidist.ProcessGroup:
        """The mpidist group under this torch group (its communicator, engine, recorder key)."""
        return self._mg

    #: what torch asks of a device backend (``_get_backend(device).supports_*``)
    supports_coalescing = False
    supports_splitting = False
    supports_time_estimate = False

    def _get_backend(self, device: Any = None) -> ProcessGroupMpidist:  # type: ignore[override]  # its own backend
        """The group itself: it is its own backend for every device (torch 2.15's
        ``batch_isend_irecv`` asks it whether it coalesces: no)."""
        return self

    @property
    def _device_types(self) -> list:
        """The devices whose tensors the group takes (torch's ``ProcessGroup._device_types``):
        CPU, and CUDA where torch has it; read by torch's object collectives and ``async_save``."""
        cpu = torch.device("cpu")
        return [cpu, torch.device("cuda")] if torch.cuda.is_available() else [cpu]

    def _get_sequence_number_for_group(self) -> int:
        """Collectives issued on the group so far (mpidist's sequence number)."""
        return self._mg.engine.seq

    def shutdown(self) -> None:
        """Free what the group holds (torch's ``destroy_process_group``); idempotent.

        A sub-group's communicators are freed; the default group that started mpidist's
        runtime destroys it, one that found mpidist initialized leaves it running. Nothing
        happens if the runtime the group was made in is gone already.
        """
        if self._released:
            return
        self._released = True
        st = runtime.state_or_none()
        if st is None or st is not self._state:
            return
        # A group whose op timed out or mismatched may still be inside MPI: freeing it would
        # wait for ever, where torch's destroy returns; abort it first (local, frees nothing).
        for g in [st.world, *st.groups] if self._owns else [self._mg]:
            if g.engine.broken is not None and g.engine.pending and not g.destroyed:
                g.abort()
        if self._owns:
            mpidist.destroy_process_group()
        elif self._mg is not st.world and not self._mg.destroyed:
            mpidist.destroy_process_group(self._mg)

    def abort(self) -> None:
        """torch's abort: :meth:`mpidist.ProcessGroup.abort` (local, at once; queued and later
        ops raise DistError; nothing is freed)."""
        if self._released:
            return
        self._released = True
        st = runtime.state_or_none()
        if st is not None and st is self._state and not self._mg.destroyed:
            self._mg.abort()

    def __repr__(self) -> str:
        return f"ProcessGroupMpidist(name={self._name!r}, desc={self._desc!r}, ranks={list(self._ranks)})"

    # -- the common tail of every op -------------------------------------------------------
    def _global(self, group_rank: Any, op: str, arg: str) -> int:
        try:
            return self._ranks[group_rank]
        except (IndexError, TypeError):
            raise ValueError(
                f"{prefix(op)} {arg}={group_rank!r} is not a rank of this group of size {len(self._ranks)}"
            ) from None

    def _done(self, works: Any, outputs: list, staged: Staged, source: Optional[Callable] = None) -> Any:
        """None for a sync op (after its copies back), else a TorchWork over ``works``."""
        if works is None:
            staged.finish()
            return None
        if not isinstance(works, list):
            works = [works]
        work = TorchWork(works, outputs, staged.finish if staged.backs or staged.after else None, source, staged.stream)
        if self._coalesced is not None:
            self._coalesced.append(work)
        return work

    def _call(self, staged: Staged, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, in torch's current CUDA stream if a CUDA tensor is involved."""
        if staged.stream is None:
            return fn(*args, **kwargs)
        with staged.stream:
            return fn(*args, **kwargs)

    def _each(self, staged: Staged, async_op: bool, calls: list) -> Any:
        """Run ``calls`` ((fn, args) of mpidist ops) in order; their Works, or None if sync."""
        works = [self._call(staged, fn, *args, async_op=async_op) for fn, args in calls]
        return [w for w in works if w is not None] if async_op else None

    def _pairs(self, fn: Callable[..., Any], op: str, outputs: Any, inputs: Any, async_op: bool, *extra: Any) -> Any:
        """The _coalesced forms: ``fn(outputs[i], inputs[i], *extra)`` for each pair, in order."""
        outs = list(outputs)
        staged = Staged()
        calls = [
            (fn, (staged.out(o, op, f"outputs[{i}]"), staged.inp(x, op, f"inputs[{i}]"), *extra, self._arg))
            for i, (o, x) in enumerate(zip(outs, inputs))
        ]
        return self._done(self._each(staged, async_op, calls), outs, staged)

    def _avg(self, red: Any, staged: Staged, outputs: list, written: bool = True) -> Any:
        """``red``, except AVG of integer tensors: SUM, then ``outputs`` divided by the group
        size rounding toward zero once the op completed (NCCL's integer AVG; mpidist's own
        takes floating point only). ``written``: False where this rank gets no result."""
        if red is not _MAVG or not outputs or not _is_integer(outputs[0]):
            return red
        if written:
            n = len(self._ranks)
            staged.after.append(lambda: [t.div_(n, rounding_mode="trunc") for t in outputs])
        return _MSUM

    # -- all-reduce ------------------------------------------------------------------------
    def allreduce(self, tensors: Any, opts: Any = None, timeout: Any = None, _traced: bool = False) -> Any:
        """torch ``allreduce``: ``tensors`` (one tensor, or a list reduced together as
        ``all_reduce_multigpu``) reduced in place on every rank. A sparse COO tensor is
        summed as gloo sums one (:meth:`_sparse_allreduce`); AVG of integer tensors is
        NCCL's (:meth:`_avg`). While a torch profiler records: event ``mpidist:all_reduce``."""
        if recording() and not _traced:
            return record(
                "all_reduce", 0, ProcessGroupMpidist.allreduce, self, (tensors, opts, timeout), {"_traced": True}
            )
        op = "all_reduce"
        if type(opts) is AllreduceOptions:
            red, async_op = _reduce_op(opts.reduceOp, op), opts.asyncOp if _ASYNC_IN_OPTS else True
            if not async_op and type(tensors) is list and len(tensors) == 1:
                # torch's sync call on one tensor that needs no staging (integer AVG does): the
                # general path below without Staged, _call and _done (-1.6 to -2 us a call at 8 B:
                # benchmarks/results/repeats/issue44_2026-11-28/torch_fastpath_ab.md)
                a = direct(tensors[0])
                if a is not None and (red is not _MAVG or a.dtype.kind not in "iu"):
                    mpidist.all_reduce(a, red, self._arg, False)
                    return None
        else:
            red, async_op = _reduce_op(_SUM if opts is None else opts, op), True
        ts = _tensors(tensors)  # allreduce, broadcast, reduce written out: a shared helper cost 0.2-0.6 us
        staged = Staged()
        if red is _MAVG:
            red = self._avg(red, staged, ts)
        try:
            if len(ts) == 1:
                if self._nccl and not staged.after and getattr(ts[0], "is_cuda", False) and not self._mg.destroyed:
                    found = _cuda().nccl_dev(ts[0])
                    if found is not None:  # straight to the NCCL path, in torch's current stream
                        staged.stream = found[1]
                        w = _nccl().all_reduce(self._mg, found[0], red, async_op, stream=found[1])
                        return self._done(w, ts, staged)
                w = self._call(staged, mpidist.all_reduce, staged.out(ts[0], op, "tensor"), red, self._arg, async_op)
            else:
                arrays = [staged.out(t, op, f"tensors[{i}]") for i, t in enumerate(ts)]
                w = self._call(staged, mpidist.all_reduce_multigpu, arrays, red, self._arg, async_op)
        except SparseTensor:  # (an integer AVG became SUM + a division above: still AVG here)
            return self._sparse_allreduce(ts, _MAVG if staged.after else red, async_op)
        return self._done(w, ts, staged)

    def _sparse_allreduce(self, ts: list, red: Any, async_op: bool) -> Any:
        """all_reduce of one sparse COO tensor, as gloo does it: the coalesced sum of every
        member's tensor (gathered and summed in group-rank order, so every member gets the
        same tensor) replaces it on every member (``nnz`` may change). SUM only.

        Raises:
            ValueError: an op other than SUM, several tensors, a tensor that is not sparse
                COO, or members whose tensors' sizes differ (on every member).
        """
        op = "all_reduce"
        if red is not _MSUM:
            raise ValueError(f"{prefix(op)} sparse tensors are summed only (ReduceOp.SUM), got {red!r}")
        if len(ts) != 1 or ts[0].layout is not torch.sparse_coo:
            raise ValueError(
                f"{prefix(op)} expects one sparse COO tensor, or dense tensors only; got {[str(t.layout) for t in ts]}"
            )
        t = ts[0]
        local = t.detach().coalesce()
        parts: list = [None] * len(self._ranks)
        mpidist.all_gather_object(parts, (tuple(t.shape), local.indices(), local.values()), self._arg)
        sizes = [p[0] for p in parts]
        if any(size != sizes[0] for size in sizes):
            raise ValueError(
                f"{prefix(op)} the members' sparse tensors differ in size (group rank: size): {dict(enumerate(sizes))}"
            )
        total = torch.sparse_coo_tensor(
            torch.cat([p[1] for p in parts], 1), torch.cat([p[2] for p in parts]), t.shape, dtype=t.dtype
        ).coalesce()
        with torch.no_grad():
            t.copy_(total)
        return TorchWork([], [t]) if async_op else None

    @profiled("all_reduce_coalesced", 0)
    def allreduce_coalesced(self, tensors: Any, opts: Any = None) -> Any:
        """torch ``allreduce_coalesced``: each tensor reduced on its own, in list order."""
        op = "all_reduce"
        opts = _options(opts, AllreduceCoalescedOptions)
        ts = _tensors(tensors)
        staged = Staged()
        red = self._avg(_reduce_op(opts.reduceOp, op), staged, ts)
        calls = [(mpidist.all_reduce, (staged.out(t, op, f"tensors[{i}]"), red, self._arg)) for i, t in enumerate(ts)]
        return self._done(self._each(staged, _is_async(opts), calls), ts, staged)

    # -- broadcast / reduce ----------------------------------------------------------------
    def broadcast(self, tensors: Any, opts: Any = None, timeout: Any = None, _traced: bool = False) -> Any:
        """torch ``broadcast`` from group rank ``opts.rootRank`` (tensor ``opts.rootTensor``).
        While a torch profiler records: event ``mpidist:broadcast``."""
        if recording() and not _traced:
            return record(
                "broadcast", 0, ProcessGroupMpidist.broadcast, self, (tensors, opts, timeout), {"_traced": True}
            )
        op = "broadcast"
        if isinstance(opts, int):  # (tensor, root)
            opts = _options(None, BroadcastOptions, rootRank=opts)
        opts = _options(opts, BroadcastOptions)
        src = self._global(opts.rootRank, op, "rootRank")
        async_op = opts.asyncOp if _ASYNC_IN_OPTS else True
        ts = _tensors(tensors)
        staged = Staged()
        if len(ts) == 1:
            w = self._call(staged, mpidist.broadcast, staged.out(ts[0], op, "tensor"), src, self._arg, async_op)
        else:
            arrays = [staged.out(t, op, f"tensors[{i}]") for i, t in enumerate(ts)]
            w = self._call(
                staged, mpidist.broadcast_multigpu, arrays, src, self._arg, async_op, src_tensor=opts.rootTensor
            )
        return self._done(w, ts, staged)

    def reduce(self, tensors: Any, opts: Any = None, op: Any = None, timeout: Any = None, _traced: bool = False) -> Any:
        """torch ``reduce`` to group rank ``opts.rootRank`` (tensor ``opts.rootTensor``).
        While a torch profiler records: event ``mpidist:reduce``."""
        if recording() and not _traced:
            return record(
                "reduce", 0, ProcessGroupMpidist.reduce, self, (tensors, opts, op, timeout), {"_traced": True}
            )
        name = "reduce"
        if isinstance(opts, int):  # (tensor, root, op)
            opts = _options(None, ReduceOptions, rootRank=opts, reduceOp=op)
        opts = _options(opts, ReduceOptions)
        red = _reduce_op(opts.reduceOp, name)
        dst = self._global(opts.rootRank, name, "rootRank")
        async_op = opts.asyncOp if _ASYNC_IN_OPTS else True
        ts = _tensors(tensors)
        staged = Staged()
        if red is _MAVG:
            red = self._avg(red, staged, ts, self.rank() == opts.rootRank)
        if len(ts) == 1:
            w = self._call(staged, mpidist.reduce, staged.out(ts[0], name, "tensor"), dst, red, self._arg, async_op)
        else:
            arrays = [staged.out(t, name, f"tensors[{i}]") for i, t in enumerate(ts)]
            w = self._call(
                staged, mpidist.reduce_multigpu, arrays, dst, red, self._arg, async_op, dst_tensor=opts.rootTensor
            )
        return self._done(w, ts, staged)

    # -- gathers ---------------------------------------------------------------------------
    @profiled("all_gather", 1)
    def allgather(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> Any:
        """torch ``allgather``: ``output_tensors[0][r]`` receives group rank r's input."""
        op = "all_gather"
        if isinstance(input_tensors, torch.Tensor):  # (output list, input tensor)
            output_tensors, input_tensors = [output_tensors], [input_tensors]
        opts = _options(opts, AllgatherOptions)
        outs = [list(lst) for lst in output_tensors]
        staged = Staged()
        if len(input_tensors) == 1:
            out = [staged.out(t, op, f"output_tensors[0][{i}]") for i, t in enumerate(outs[0])]
            w = self._call(
                staged,
                mpidist.all_gather,
                out,
                staged.inp(input_tensors[0], op, "input_tensors[0]"),
                self._arg,
                _is_async(opts),
            )
        else:
            out = [
                [staged.out(t, op, f"output_tensors[{j}][{i}]") for i, t in enumerate(lst)]
                for j, lst in enumerate(outs)
            ]
            inp = [staged.inp(t, op, f"input_tensors[{i}]") for i, t in enumerate(input_tensors)]
            w = self._call(staged, mpidist.all_gather_multigpu, out, inp, self._arg, _is_async(opts))
        return self._done(w, outs, staged)

    @profiled("all_gather_coalesced", 1)
    def allgather_coalesced(self, output_lists: Any, input_list: Any, opts: Any = None) -> Any:
        """torch ``allgather_coalesced``: ``output_lists[r][i]`` receives group rank r's
        ``input_list[i]`` (torch's layout: one list per rank), in one collective
        (``mpidist.all_gather_coalesced``)."""
        op = "all_gather_coalesced"
        opts = _options(opts, AllgatherOptions)
        outs = [list(lst) for lst in output_lists]
        staged = Staged()
        w = self._call(
            staged,
            _coalesced.all_gather_coalesced,
            [[staged.out(t, op, f"output_lists[{r}][{i}]") for i, t in enumerate(lst)] for r, lst in enumerate(outs)],
            [staged.inp(t, op, f"input_list[{i}]") for i, t in enumerate(_tensors(input_list))],
            self._arg,
            _is_async(opts),
        )
        return self._done(w, outs, staged)

    @profiled("all_gather_into_tensor", 1)
    def _allgather_base(self, output: Any, input: Any, opts: Any = None) -> Any:  # noqa: A002
        """torch ``_allgather_base`` / ``all_gather_single``: ``output`` holds every rank's
        ``input`` in group-rank order; ``input`` may be this rank's slot of ``output``
        (FSDP2: then MPI runs in place)."""
        op = "all_gather_into_tensor"
        opts = _options(opts, AllgatherOptions)
        staged = Staged()
        w = self._call(
            staged,
            gather_scatter.all_gather_into_tensor,
            staged.out(output, op, "output"),
            staged.inp(input, op, "input"),
            self._arg,
            _is_async(opts),
        )
        return self._done(w, [output], staged)

    all_gather_single = _allgather_base

    @profiled("all_gather_into_tensor_coalesced", 1)
    def allgather_into_tensor_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        """torch ``allgather_into_tensor_coalesced`` / ``all_gather_single_coalesced``: one
        ``_allgather_base`` per (output, input) pair, in order."""
        opts = _options(opts, AllgatherOptions)
        return self._pairs(
            gather_scatter.all_gather_into_tensor, "all_gather_into_tensor", outputs, inputs, _is_async(opts)
        )

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    @profiled("gather", 1)
    def gather(self, output_tensors: Any, input_tensors: Any, opts: Any = None, timeout: Any = None) -> Any:
        """torch ``gather`` to group rank ``opts.rootRank``: on the root ``output_tensors[0]``
        receives every rank's input; elsewhere ``output_tensors`` is empty."""
        op = "gather"
        if isinstance(input_tensors, torch.Tensor):  # (output list, input tensor, root)
            opts = _options(None, GatherOptions, rootRank=opts)
            output_tensors, input_tensors = [output_tensors] if output_tensors else [], [input_tensors]
        opts = _options(opts, GatherOptions)
        dst = self._global(opts.rootRank, op, "rootRank")
        outs = [list(lst) for lst in output_tensors]
        staged = Staged()
        gather_list = (
            [staged.out(t, op, f"output_tensors[0][{i}]") for i, t in enumerate(outs[0])] if outs and outs[0] else None
        )
        w = self._call(
            staged,
            mpidist.gather,
            staged.inp(input_tensors[0], op, "input_tensors[0]"),
            gather_list,
            dst,
            self._arg,
            _is_async(opts),
        )
        return self._done(w, outs, staged)

    @profiled("scatter", 1)
    def scatter(self, output_tensors: Any, input_tensors: Any, opts: Any = None, timeout: Any = None) -> Any:
        """torch ``scatter`` from group rank ``opts.rootRank``: ``output_tensors[0]`` receives
        the root's ``input_tensors[0][my rank]``."""
        op = "scatter"
        if isinstance(output_tensors, torch.Tensor):  # (output tensor, input list, root)
            opts = _options(None, ScatterOptions, rootRank=opts)
            output_tensors, input_tensors = [output_tensors], [input_tensors] if input_tensors else []
        opts = _options(opts, ScatterOptions)
        src = self._global(opts.rootRank, op, "rootRank")
        outs = list(output_tensors)
        staged = Staged()
        scatter_list = (
            [staged.inp(t, op, f"input_tensors[0][{i}]") for i, t in enumerate(input_tensors[0])]
            if input_tensors and input_tensors[0]
            else None
        )
        w = self._call(
            staged,
            mpidist.scatter,
            staged.out(outs[0], op, "output_tensors[0]"),
            scatter_list,
            src,
            self._arg,
            _is_async(opts),
        )
        return self._done(w, outs, staged)

    # -- reduce-scatter --------------------------------------------------------------------
    @profiled("reduce_scatter", 1)
    def reduce_scatter(self, output_tensors: Any, input_tensors: Any, opts: Any = None, timeout: Any = None) -> Any:
        """torch ``reduce_scatter``: ``output_tensors[0]`` receives the reduction of every
        rank's ``input_tensors[0][my rank]``."""
        op = "reduce_scatter"
        if isinstance(output_tensors, torch.Tensor):  # (output, input list, op)
            opts = _options(None, ReduceScatterOptions, reduceOp=opts)
            output_tensors, input_tensors = [output_tensors], [input_tensors]
        opts = _options(opts, ReduceScatterOptions)
        red = _reduce_op(opts.reduceOp, op)
        outs = list(output_tensors)
        if len(outs) != 1 or len(input_tensors) != 1:
            raise ValueError(
                f"{prefix(op)} expects one output tensor and one input list (one device per "
                f"process), got {len(outs)} and {len(input_tensors)}"
            )
        staged = Staged()
        red = self._avg(red, staged, outs)
        inputs = [staged.inp(t, op, f"input_tensors[0][{i}]") for i, t in enumerate(input_tensors[0])]
        w = self._call(
            staged,
            mpidist.reduce_scatter,
            staged.out(outs[0], op, "output_tensors[0]"),
            inputs,
            red,
            self._arg,
            _is_async(opts),
        )
        return self._done(w, outs, staged)

    @profiled("reduce_scatter_tensor", 1)
    def _reduce_scatter_base(self, output: Any, input: Any, opts: Any = None) -> Any:  # noqa: A002
        """torch ``_reduce_scatter_base`` / ``reduce_scatter_single``: ``output`` receives
        block ``my rank`` of the reduction of every rank's ``input``."""
        op = "reduce_scatter_tensor"
        opts = _options(opts, ReduceScatterOptions)
        staged = Staged()
        red = self._avg(_reduce_op(opts.reduceOp, op), staged, [output])
        w = self._call(
            staged,
            reductions.reduce_scatter_tensor,
            staged.out(output, op, "output"),
            staged.inp(input, op, "input"),
            red,
            self._arg,
            _is_async(opts),
        )
        return self._done(w, [output], staged)

    reduce_scatter_single = _reduce_scatter_base

    @profiled("reduce_scatter_tensor_coalesced", 1)
    def reduce_scatter_tensor_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        """torch ``reduce_scatter_tensor_coalesced`` / ``reduce_scatter_single_coalesced``:
        one ``_reduce_scatter_base`` per (output, input) pair, in order."""
        op = "reduce_scatter_tensor"
        opts = _options(opts, ReduceScatterOptions)
        return self._pairs(
            reductions.reduce_scatter_tensor, op, outputs, inputs, _is_async(opts), _reduce_op(opts.reduceOp, op)
        )

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    # -- all-to-all ------------------------------------------------------------------------
    @profiled("all_to_all", 1)
    def alltoall_base(
        self,
        output: Any,
        input: Any,
        output_split_sizes: Any,
        input_split_sizes: Any,  # noqa: A002
        opts: Any = None,
    ) -> Any:
        """torch ``alltoall_base`` / ``all_to_all_single`` (empty split lists: equal splits)."""
        op = "all_to_all_single"
        opts = _options(opts, AllToAllOptions)
        staged = Staged()
        w = self._call(
            staged,
            mpidist.all_to_all_single,
            staged.out(output, op, "output"),
            staged.inp(input, op, "input"),
            list(output_split_sizes) or None,
            list(input_split_sizes) or None,
            self._arg,
            _is_async(opts),
        )
        return self._done(w, [output], staged)

    all_to_all_single = alltoall_base

    @profiled("all_to_all", 1)
    def alltoall(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> Any:
        """torch ``alltoall``: ``output_tensors[r]`` receives group rank r's ``input_tensors[my rank]``."""
        op = "all_to_all"
        opts = _options(opts, AllToAllOptions)
        outs = list(output_tensors)
        staged = Staged()
        w = self._call(
            staged,
            mpidist.all_to_all,
            [staged.out(t, op, f"output_tensors[{i}]") for i, t in enumerate(outs)],
            [staged.inp(t, op, f"input_tensors[{i}]") for i, t in enumerate(input_tensors)],
            self._arg,
            _is_async(opts),
        )
        return self._done(w, outs, staged)

    # -- synchronization -------------------------------------------------------------------
    @profiled("barrier", None)
    def barrier(self, opts: Any = None) -> Any:
        """torch ``barrier`` (MPI_Barrier; ``device_ids`` do not matter)."""
        if isinstance(opts, datetime.timedelta):  # (timeout)
            opts = None
        opts = _options(opts, BarrierOptions)
        w = mpidist.barrier(self._arg, _is_async(opts))
        return None if w is None else TorchWork([w], [])

    def monitored_barrier(self, timeout: Any = None, wait_all_ranks: bool = False) -> None:
        """mpidist's ``monitored_barrier`` on this group (torch's front end only calls gloo's).

        ``timeout``: a ``timedelta`` or seconds; None: the group's timeout. A timeout <= 0
        makes group rank 0 raise DistError at once, as gloo's; the others wait for rank 0 up
        to the group's timeout."""
        limit = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
        if limit is not None and limit <= 0:
            if self.rank() == 0:
                raise DistError(
                    f"{prefix('monitored_barrier')} Rank 0 timed out in monitoredBarrier after 0 ms: "
                    f"a timeout of {timeout} leaves no time to wait for the other ranks"
                )
            limit = None
        mpidist.monitored_barrier(self._arg, limit, wait_all_ranks)

    # -- point-to-point --------------------------------------------------------------------
    @profiled("send", 0)
    def send(self, tensors: Any, dstRank: int, tag: int = 0) -> Any:  # noqa: N803  (torch's names)
        """torch ``send``: start sending ``tensors[0]`` to group rank ``dstRank`` (MPI_Isend)."""
        op = "isend"
        ts = _tensors(tensors)
        staged = Staged()
        w = self._call(
            staged, mpidist.isend, staged.inp(ts[0], op, "tensor"), self._global(dstRank, op, "dstRank"), self._arg, tag
        )
        return self._done(w, ts, staged)

    @profiled("recv", 0)
    def recv(self, tensors: Any, srcRank: int, tag: int = 0) -> Any:  # noqa: N803
        """torch ``recv``: start receiving into ``tensors[0]`` from group rank ``srcRank``."""
        op = "irecv"
        ts = _tensors(tensors)
        staged = Staged()
        w = self._call(
            staged, mpidist.irecv, staged.out(ts[0], op, "tensor"), self._global(srcRank, op, "srcRank"), self._arg, tag
        )
        return self._done(w, ts, staged, self._group_rank)

    @profiled("recvAnySource", 0)
    def recv_anysource(self, tensors: Any, tag: int = 0) -> Any:
        """torch ``recv_anysource``: receive from any member; the Work's ``_source_rank()``
        (group rank) says from whom."""
        op = "irecv"
        ts = _tensors(tensors)
        staged = Staged()
        w = self._call(staged, mpidist.irecv, staged.out(ts[0], op, "tensor"), None, self._arg, tag)
        return self._done(w, ts, staged, self._group_rank)

    def _group_rank(self, global_rank: int) -> int:
        return self._ranks.index(global_rank)

    # -- coalescing (torch's _coalescing_manager with a device) -------------------------------
    def _start_coalescing(self, device: Any = None) -> None:
        """Collect the Works of the ops issued until :meth:`_end_coalescing`."""
        self._coalesced = []

    def _end_coalescing(self, device: Any = None) -> Any:
        """One Work over every op issued since :meth:`_start_coalescing`."""
        works, self._coalesced = self._coalesced or [], None
        return _Joined(works)

    start_coalescing = _start_coalescing
    end_coalescing = _end_coalescing


class _Joined(TorchWork):
    """A Work over other TorchWorks (a coalescing block)."""

    def __init__(self, works: list) -> None:
        super().__init__(works, [t for w in works for t in w._outputs])
