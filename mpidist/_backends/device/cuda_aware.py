"""MPI on device memory: a call's device arrays handed to a CUDA-aware MPI, through the MPI
backend's bodies (:mod:`mpidist._backends.mpi`), for the ops and dtypes of
:func:`mpidist._backends.device.paths.mpi_cuda_ok`."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from mpidist._arrays.namespace import is_device_array
from mpidist._backends.device.staging import DeviceWork
from mpidist._backends.mpi import MPI
from mpidist._core.group import ProcessGroup
from mpidist._dispatch.p2p_op import with_tensor
from mpidist.device import op_args as A
from mpidist.device.runtime import DeviceRuntime
from mpidist.work import Work

__all__ = ["CudaAwareMpi", "CUDA_AWARE"]


class CudaAwareMpi:
    """Each device array's stream synchronized, then the MPI backend's body on zero-copy
    compute views (cupy arrays) that MPI reads and writes directly; an async call's Work
    is a :class:`~mpidist._backends.device.staging.DeviceWork` whose ``result()`` gives the caller's arrays."""

    def run(self, op: str, g: ProcessGroup, args: dict, runtime: Optional[DeviceRuntime] = None) -> Any:
        """As :meth:`CommBackend.run`; ``runtime``: the arrays' device runtime when the caller
        (the router) found it already, else looked up here."""
        runtime = runtime or A.runtime_of(op, args)
        views: dict[int, tuple] = {}

        def convert(x: Any, role: int) -> Any:
            if isinstance(x, np.ndarray) or not is_device_array(x):
                return x
            entry = views.get(id(x))
            if entry is None:
                runtime.synchronize(x)
                entry = views[id(x)] = (x, runtime.compute_view(x))
            return entry[1]

        if op == "all_reduce" and args.get("algorithm") is None:
            args = dict(args, algorithm="mpi")  # host-only algorithms (shared memory) are not for device memory
        with A.passthrough():
            result = MPI.run(op, g, A.replace(op, args, convert, with_tensor))
        outmap = {id(view): x for x, view in views.values()}
        if isinstance(result, list):
            return [DeviceWork(w, None, outmap) for w in result]
        if isinstance(result, Work):
            return DeviceWork(result, None, outmap)
        return result


CUDA_AWARE = CudaAwareMpi()
