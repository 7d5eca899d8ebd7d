"""Process groups: an MPI communicator of their own plus the rank maps.

Every group, the default one included, runs on a communicator duplicated for it,
so mpidist's traffic never matches a user's own messages on MPI_COMM_WORLD, and
the ring algorithm gets a second private duplicate so its point-to-point tags
never meet the group's own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable, Optional

from mpi4py import MPI

from mpidist.work import Engine

__all__ = ["ProcessGroup"]


class ProcessGroup:
    """A set of global ranks and the communicator that connects them.

    ``rank()`` is the caller's rank in the group (-1 for a non-member), ``size()`` the
    number of members, ``ranks`` the members' global ranks in group-rank order.
    A non-member holds no communicator (``comm`` is None).

    Ending it (torch's ``ProcessGroup`` methods): :meth:`shutdown` (graceful, collective)
    and :meth:`abort` (local, at once); ``destroy_process_group(group)`` calls :meth:`free`.
    """

    def __init__(self, comm: Optional[MPI.Comm], ranks: Sequence[int], name: str, backend: str) -> None:
        self.comm = comm
        self.ranks = tuple(ranks)
        self.group_name = name
        self.backend = backend
        self._index = {g: i for i, g in enumerate(self.ranks)}
        self._rank = comm.Get_rank() if comm is not None else -1
        self._ring_comm: Optional[MPI.Comm] = None
        self.engine = Engine(name)
        self.destroyed = False
        self._resources: dict[str, Any] = {}
        #: this group's own timeout in seconds (``new_group(timeout=...)``); None: the
        #: default group's (init_process_group's), read at each op
        self.timeout_s: Optional[float] = None

    def resource(self, key: str, make: Callable[[ProcessGroup], Any]) -> Any:
        """The group's resource ``key`` (an intra-node shared-memory window, an NCCL
        communicator, ...), made by ``make(self)`` on first use and kept until :meth:`free`,
        which calls its ``free()``. ``make`` may be collective: every member must ask for
        ``key`` in the same order, as for any collective."""
        found = self._resources.get(key)
        if found is None:
            found = self._resources[key] = make(self)
        return found

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return len(self.ranks)

    def is_member(self) -> bool:
        return self.comm is not None

    def group_rank(self, global_rank: int) -> int:
        """Group rank of ``global_rank``; ValueError if it is not a member."""
        try:
            return self._index[global_rank]
        except (KeyError, TypeError):
            raise ValueError(
                f"global rank {global_rank!r} is not part of group {self.group_name!r} (members: {list(self.ranks)})"
            ) from None

    def global_rank(self, group_rank: int) -> int:
        """Global rank of the member with ``group_rank``; ValueError if out of range."""
        if not isinstance(group_rank, int) or not 0 <= group_rank < len(self.ranks):
            raise ValueError(
                f"group rank {group_rank!r} is out of range for group {self.group_name!r} of size {len(self.ranks)}"
            )
        return self.ranks[group_rank]

    @property
    def ring_comm(self) -> MPI.Comm:
        """A private duplicate of ``comm`` for the ring algorithm (made on first use, collectively)."""
        if self._ring_comm is None:
            assert self.comm is not None
            self._ring_comm = self.comm.Dup()
        return self._ring_comm

    def free(self) -> None:
        """Finish queued ops, then free the communicators and resources (collective over the
        members, as MPI_Comm_free and MPI_Win_free are). Idempotent. After :meth:`abort` it
        frees nothing (a call may still be in progress on them, and the peers may never
        join a collective free): the group is only marked destroyed (using it raises), and
        its communicators, shared-memory window and NCCL communicators, which the op in
        progress may still use, are left to the end of the process."""
        self.engine.shutdown()
        if self.engine.aborted:  # the op in progress may still use all of it: only mark destroyed
            self.destroyed = True
            return
        resources, self._resources = self._resources, {}
        for res in reversed(list(resources.values())):
            res.free()
        for comm in (self._ring_comm, self.comm):
            if comm is not None and comm != MPI.COMM_NULL:
                comm.Free()
        self._ring_comm = None
        self.comm = None
        self._rank = -1
        self.destroyed = True

    def shutdown(self) -> None:
        """End the group gracefully (torch's ``ProcessGroup.shutdown``, which
        ``torch.distributed.destroy_process_group`` calls): the ops queued on it run to the
        end, then its communicators and resources are freed, as :meth:`free`. Collective
        over the members, like ``destroy_process_group(group)``, which it is for a group
        made by ``new_group`` (without removing it from the runtime's list: later calls on
        it raise ValueError as on a destroyed group). Idempotent; after :meth:`abort`,
        frees nothing (see :meth:`free`)."""
        self.free()

    def abort(self) -> None:
        """Abort the group (torch's ``ProcessGroup.abort``): local, returns at once.

        * Ops queued on the group's engine and not started end with
          :class:`~mpidist.DistError` (their ``wait()`` and future; a sync op waiting
          behind them raises it) and never run.
        * An op already inside MPI cannot be interrupted (MPI has no cancel for
          collectives): its Work ends with DistError at once, the call goes on in the
          background (its output arrays may still be written) and the timeout watchdog
          stops watching it. A sync op running on the caller's own thread, or an
          isend/irecv already posted, is not affected.
        * Every later op on the group, collective or point-to-point, raises DistError
          at once ("group ... is unusable: aborted by ProcessGroup.abort()"), on this
          rank: peers learn nothing (abort on every rank that should stop).
        * Nothing is freed (see :meth:`free`): the usual sequel is leaving the process,
          or ``destroy_process_group(group)`` to forget the group and go on with others.

        Idempotent. Source: torch.distributed's ``ProcessGroup.abort`` ("abort all
        operations and connections if supported by the backend").
        """
        self.engine.abort("aborted by ProcessGroup.abort()")

    def __repr__(self) -> str:
        return f"ProcessGroup(name={self.group_name!r}, ranks={list(self.ranks)}, rank={self._rank})"
