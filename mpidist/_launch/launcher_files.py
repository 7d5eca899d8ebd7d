"""Removing the names of the files MPICH and its launcher create for a job on each node, once
every rank is through ``MPI_Init``, so that a job that ends badly leaves none behind
(docs/reliability.md, section 12).

MPICH's segment ``/dev/shm/mpich_shm_*`` is unlinked only in ``MPI_Finalize``, and hydra's
``/tmp/hydra_hwloc_xmlfile_*`` survives ``MPI_Abort``; both are needed only while ranks start
(MPICH's ``MPI_Init`` attaches every local rank to the segment and reads the topology before its
PMI barriers), and an unlinked file stays mapped and readable. :func:`remove_names` removes the
segments this process maps (``/proc/self/maps``) and the topology file its parent holds open when
that is ``hydra_pmi_proxy``: regular files of this user only, never through a symbolic link. It
also removes an Open MPI singleton's own segment (``/dev/shm/sm_segment.*``, 16 MiB, left at every
exit; docs/hpc.md, "MPIs"). A job that dies inside ``MPI_Init`` is covered by
:mod:`mpidist._launch.init_watcher`. Linux only; ``MPIDIST_REMOVE_LAUNCHER_FILES=0`` switches it
off.
"""

from __future__ import annotations

import os
import re

from mpidist._launch import environment
from mpidist._launch.init_watcher import ENV, comm_of, enabled, is_segment, open_files, remove, segments_of

__all__ = ["remove_names", "ENV"]

_HYDRA_TOPOLOGY = re.compile(r"hydra_hwloc_xmlfile_\w+")
_OPEN_MPI_SEGMENT = re.compile(r"/dev/shm/sm_segment\.[^/]+\.\d+\.[0-9a-f]+\.\d+")


def _parent_topology_files() -> set[str]:
    """The hydra topology files this process's parent holds open, if it is hydra's proxy."""
    ppid = os.getppid()
    if comm_of(ppid) != "hydra_pmi_proxy":
        return set()
    return {t for t in open_files(ppid) if os.path.isabs(t) and _HYDRA_TOPOLOGY.fullmatch(os.path.basename(t))}


def remove_names() -> list[str]:
    """Remove the names of this node's MPICH segments and hydra topology file, and of an Open
    MPI singleton's segment (see the module docstring); the paths this call removed. Only where
    mpidist owns the launch (``python -m mpidist``: :func:`mpidist._launch.environment.supervised`)
    or there is no launcher (a singleton's files are its own). Call only after every rank has
    finished ``MPI_Init``. Never raises."""
    if not enabled() or environment.launched() and not environment.supervised():
        return []  # somebody else's launch: its files are its launcher's business
    singleton = "PMIX_RANK" not in os.environ  # no Open MPI launcher: a singleton's own segment too
    mapped = segments_of("self", lambda p: is_segment(p) or singleton and _OPEN_MPI_SEGMENT.fullmatch(p))
    return [p for p in sorted(mapped | _parent_topology_files()) if remove(p)]
