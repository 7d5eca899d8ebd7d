"""Removing the names of the files MPICH and its launcher create for a job on each node, once
every rank has opened them, so that a job that ends badly leaves none behind.

Two files outlive a job that ends through ``MPI_Abort`` or a signal (issue 27: after every
failed job on a shared node):

* ``/dev/shm/mpich_shm_<hash>_<n>``: the shared-memory segment MPICH's ``MPI_Init`` creates for
  the ranks of a node; it is unlinked only in ``MPI_Finalize``, so a rank killed, or a job ended
  by ``MPI_Abort``, leaves it (1-4 MB of memory each, until reboot);
* ``/tmp/hydra_hwloc_xmlfile_XXXXXX``: the node's hardware topology, which hydra's
  ``hydra_pmi_proxy`` (the ranks' parent) writes for its ranks' ``MPI_Init``; it removes it at
  the end of a job, a signal or a non-zero exit, but not after ``MPI_Abort``.

Both are needed only while ranks start: a segment stays mapped, and an open file readable, after
its name is removed (POSIX ``unlink``). Both are done with once ``MPI_Init`` has returned on any
rank: MPICH's ``MPI_Init`` reads the topology, and allocates and attaches each such segment
followed by a barrier of the node's ranks (``MPIDU_Init_shm_alloc``, then
``MPIDU_Init_shm_barrier``, in MPICH's ``src/mpid/common/shm``), and only returns after PMI
barriers with every rank. :func:`remove_names` runs as soon as mpidist is imported with MPI
initialized (:func:`mpidist._launch.mpi_init.import_mpi`, right after its ``MPI_Init``), and again in
``init_process_group``; it removes:

* the segments this process has mapped (``/proc/self/maps``; MPICH's ``mpich_shm_*``, and
  UCX's, which UCX has unlinked already: :func:`mpidist._launch.init_watcher.is_segment`);
* the ``hydra_hwloc_xmlfile_*`` file its parent holds open (``/proc/<ppid>/fd``), only when that
  parent is ``hydra_pmi_proxy``;

each only when it is a regular file owned by this user (``os.lstat``: a symbolic link is never
followed or removed). MPICH's ``MPI_Finalize`` and hydra ignore a name that is already gone.
A job that ends while its ranks are still in ``MPI_Init`` is covered by a watcher process
(:mod:`mpidist._launch.init_watcher`). Linux only (``/proc``); elsewhere, and with
``MPIDIST_REMOVE_LAUNCHER_FILES=0``, nothing is done.

Open MPI's launcher (``prterun``) removes its jobs' files itself, after a signal or
``MPI_Abort`` too; not so an Open MPI **singleton** (a process started without a launcher:
``python script.py``), which leaves its shared-memory segment,
``/dev/shm/sm_segment.<host>.<uid>.<jobid>.<rank>`` (16 MiB apparent size), at every exit, a
clean one included (Open MPI 5.0.11). No other process can open a singleton's segment, so
:func:`remove_names` removes its name too, where no launcher set ``PMIX_RANK``. Its empty session
directory, ``$TMPDIR/ompi.<host>.<uid>/jf.0/<jobid>``, stays (docs/hpc.md, "MPIs").
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
