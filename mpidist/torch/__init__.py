"""mpidist as a torch.distributed backend: stock PyTorch over MPI from a pip install.

``import mpidist.torch`` registers the backend ``"mpidist"`` (devices cpu and cuda)
and the rendezvous scheme ``mpi://`` (whose store, :class:`MPIStore`, is served over
MPI), and makes backend ``"mpi"`` mpidist on a torch built without MPI; then, under
``mpiexec -n N`` or ``srun --mpi=pmi2`` (or as a plain ``python script.py``, a world of
size 1)::

    import torch.distributed as dist
    import mpidist.torch  # noqa: F401

    dist.init_process_group("mpidist")          # or init_method="mpi://"
    ...                                         # dist.*, DDP, FSDP2, DeviceMesh, DTensor, DCP
    dist.destroy_process_group()

Rank and world size come from MPI; no MASTER_ADDR, RANK or WORLD_SIZE is needed and
nothing listens on a socket (:mod:`mpidist.torch.rendezvous`). Every op runs through
mpidist's own (:mod:`mpidist.torch._process_group`): its algorithm choice, timeouts,
flight recorder and device paths serve torch's calls. See docs/torch.md.

Needs torch (the ``torch`` extra: ``pip install 'mpidist[torch]'``); nothing else in
mpidist imports torch.
"""

from __future__ import annotations

import torch.distributed as _dist

from mpidist.torch import _dynamo_fence, _mpi_name, rendezvous
from mpidist.torch._backend import create, declare_self_recording
from mpidist.torch._process_group import BACKEND_NAME, ProcessGroupMpidist
from mpidist.torch._work import TorchWork
from mpidist.torch.store import MPIStore

__all__ = ["BACKEND_NAME", "MPIStore", "ProcessGroupMpidist", "TorchWork", "create", "register", "rendezvous"]


def register() -> None:
    """Register backend ``"mpidist"`` (cpu and cuda) and rendezvous ``mpi://`` with torch,
    and make backend ``"mpi"`` mpidist on a torch built without MPI. Runs on import;
    calling it again does nothing."""
    _dist.Backend.register_backend(BACKEND_NAME, create, extended_api=True, devices=["cpu", "cuda"])
    declare_self_recording(BACKEND_NAME)
    rendezvous.register()
    _mpi_name.install()
    _dynamo_fence.fence_package()


register()
