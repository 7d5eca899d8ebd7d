"""The process's runtime state where the layers below :mod:`mpidist._runtime.world` read it.

:mod:`mpidist._runtime.world` is the only writer: ``state`` is its ``RuntimeState`` between
init_process_group and destroy_process_group (None otherwise), ``watchdog`` the timeout
watchdog's channel to the other ranks while one runs (None with one rank or without
``MPI_THREAD_MULTIPLE``). The modules below it (the rank prefix of every error message,
the flight recorder, the mismatch check) read them here, so they import nothing above
themselves. This module imports nothing of the package.
"""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["state", "watchdog", "live_groups"]

#: the RuntimeState (mpidist._runtime.world) while initialized, else None
state: Optional[Any] = None
#: the running watchdog (mpidist._runtime.watchdog._Watchdog): ``check_probe(g, seq)`` and
#: ``notify_mismatch(g, peers, seq, text)``; None when there is none
watchdog: Optional[Any] = None


def live_groups() -> list:
    """The default group and every group made by new_group that is not destroyed (in the
    order made); empty before init."""
    st = state
    if st is None:
        return []
    return [st.world] + [g for g in st.groups if not g.destroyed and g.comm is not None]
