"""RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE: exported for code written for torchrun,
and the values the user's launcher left, kept for init_process_group's check; also what the
launchers set (:func:`launcher_rank`, :func:`without_launcher`) and :func:`supervised`.

Exported at ``import mpidist`` (:func:`export_at_import`: LOCAL_* from the launcher's variables,
nothing when RANK/WORLD_SIZE say a larger world than MPI's) and again at init_process_group.
:data:`MARKER` records what mpidist exported, so a child process's inherited values are not
taken for a torchrun-style launch. When each is set and why: docs/hpc.md, "RANK, WORLD_SIZE,
LOCAL_RANK: when they are set". Imports nothing of mpidist.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Optional

__all__ = [
    "LAUNCHER_RANK_VARS",
    "launched",
    "VARS",
    "MARKER",
    "export_at_import",
    "export",
    "user_values",
    "launcher_local",
    "contradiction",
    "byte_count",
    "byte_setting",
    "SHM_MIN_BYTES_ENV",
    "STAGING_CHUNK_ENV",
    "launcher_rank",
    "without_launcher",
]

_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def byte_count(text: str) -> Optional[int]:
    """A size as the ``MPIDIST_*`` size settings take it: digits with an optional binary
    K/M/G (``65536``, ``64K``, ``4M``), or ``off`` (0); None if it is neither."""
    text = text.strip()
    if text.lower() == "off":
        return 0
    digits, unit = (text[:-1], _UNITS[text[-1].upper()]) if text and text[-1].upper() in _UNITS else (text, 1)
    return int(digits) * unit if digits.isdigit() else None


SHM_MIN_BYTES_ENV, STAGING_CHUNK_ENV = "MPIDIST_SHM_MIN_BYTES", "MPIDIST_STAGING_CHUNK"


def byte_setting(name: str, where: str) -> Optional[int]:
    """Variable ``name`` by :func:`byte_count`, None when unset; ValueError for a value it does not take."""
    text = os.environ.get(name, "").strip()
    value = byte_count(text) if text else None
    if text and value is None:
        raise ValueError(f"{where} {name} must be a byte count (65536, 64K, 1M), 0 or off, got {text!r}")
    return value


VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
MARKER = "MPIDIST_ENV_EXPORTED"

#: The user's (launcher's) values of VARS when mpidist was imported, before any export;
#: values inherited from an mpidist parent process are left out.
_at_import: dict = {}
#: What this process exported last (the values now in os.environ unless someone changed them).
_exported: dict = {}


def _recorded(env: Mapping[str, str]) -> dict:
    """The values MARKER says an mpidist process exported: ``{"RANK": "1", ...}``."""
    out = {}
    for item in env.get(MARKER, "").split():
        name, _, value = item.partition("=")
        if name in VARS:
            out[name] = value
    return out


def _int(text: Optional[str]) -> Optional[int]:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _tasks_on_node(spec: str, node: int) -> Optional[int]:
    """The task count of node ``node`` in Slurm's ``2(x3),1`` notation."""
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if m is None:
            return None
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts[node] if 0 <= node < len(counts) else None


def launcher_local(env: Mapping[str, str], size: int) -> Optional[tuple[int, int]]:
    """(local rank, ranks on this node) from the launcher's variables, or None if it sets none
    (or they are inconsistent with a world of ``size``)."""
    if size == 1:
        return 0, 1
    pairs = [("MPI_LOCALRANKID", "MPI_LOCALNRANKS"), ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE")]
    for rank_var, size_var in pairs:
        local, count = _int(env.get(rank_var)), _int(env.get(size_var))
        if local is not None and count is not None:
            return (local, count) if 0 <= local < count <= size else None
    # srun starts the ranks itself only if its step has as many tasks as MPI has ranks (under
    # mpiexec in an allocation, srun started hydra's proxies, and SLURM_LOCALID is theirs)
    if _int(env.get("SLURM_STEP_NUM_TASKS")) == size:
        local, node = _int(env.get("SLURM_LOCALID")), _int(env.get("SLURM_NODEID"))
        count = _tasks_on_node(env.get("SLURM_STEP_TASKS_PER_NODE", ""), node) if node is not None else None
        if local is not None and count is not None and 0 <= local < count <= size:
            return local, count
    return None


#: (rank, world size) variable pairs the launchers set for each process they start: MPICH's and
#: Intel MPI's hydra, Open MPI's prterun (which also sets ``PMIX_RANK``), Slurm's srun, torchrun
_RANK_PAIRS = (
    ("PMI_RANK", "PMI_SIZE"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("SLURM_PROCID", "SLURM_NTASKS"),
    ("RANK", "WORLD_SIZE"),
)


#: What only a launcher sets for its processes (hydra, Open MPI's prterun, srun): not RANK and
#: WORLD_SIZE, which mpidist exports and a child process inherits.
LAUNCHER_RANK_VARS = ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID")


def launched(env: Mapping[str, str] = os.environ) -> bool:
    """Whether a launcher started this process as a job's rank (one of :data:`LAUNCHER_RANK_VARS`)."""
    return any(k in env for k in LAUNCHER_RANK_VARS)


#: "1": mpidist supervises this process, "0": it does not; unset: only under ``python -m mpidist``
SUPERVISE_ENV = "MPIDIST_SUPERVISE"


def supervised(argv: Optional[Sequence[str]] = None, env: Mapping[str, str] = os.environ) -> bool:
    """Whether mpidist owns this process's launch: :data:`SUPERVISE_ENV` is "1", or it is unset
    and the interpreter was started as ``python [options] -m mpidist ...`` (``argv``:
    ``sys.orig_argv``). Only then does ``import mpidist`` supervise the process
    (docs/reliability.md, section 11, "Supervision")."""
    setting = env.get(SUPERVISE_ENV, "").strip()
    if setting in ("0", "1"):
        return setting == "1"
    args = iter((sys.orig_argv if argv is None else argv)[1:])
    for arg in args:
        if not arg.startswith("-") or arg == "-":  # a script, or the program on standard input
            return False
        if arg.startswith("--"):  # a long option (--help, --version ...) takes no value here
            continue
        for i, flag in enumerate(arg[1:], 2):
            if flag in "cmWX":  # options with a value: the rest of the word, or the next word
                value = arg[i:] or next(args, "")
                if flag in "cm":
                    return flag == "m" and value == "mpidist"
                break
    return False


def launcher_rank(env: Mapping[str, str] = os.environ) -> Optional[tuple[int, int]]:
    """(rank, world size) as the launcher set them for this process, before or without MPI
    (the first consistent pair of :data:`_RANK_PAIRS`), or None."""
    for rank_var, size_var in _RANK_PAIRS:
        rank, size = _int(env.get(rank_var)), _int(env.get(size_var))
        if rank is not None and size is not None and 0 <= rank < size:
            return rank, size
    return None


#: What the launchers set for each process they start (hydra: ``PMI_*``, ``HYDRA_*``,
#: ``MPI_LOCAL*``, Intel MPI's ``I_MPI_HYDRA_UUID``; Open MPI's prterun: ``PMIX_*``, ``PRTE_*``
#: and ``OMPI_*``, of which the user's settings are kept: ``OMPI_ALLOW_RUN_AS_ROOT*`` and the
#: ``*_MCA_*`` parameters).
_LAUNCHER_PREFIXES = ("PMI_", "PMIX_", "HYDRA_", "MPIR_", "MPI_LOCAL", "OMPI_", "PRTE_", "I_MPI_HYDRA_UUID")
_USER_SETTINGS = ("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_MCA_", "PRTE_MCA_", "PMIX_MCA_")
_LAUNCHER_MCA = ("OMPI_MCA_num_procs", "OMPI_MCA_initial_wdir", "OMPI_MCA_cpu_type", "OMPI_MCA_PREFIXES")


def without_launcher(env: Mapping[str, str] = os.environ) -> dict:
    """``env`` without the variables an MPI launcher sets for each rank: the environment for a
    child process that must not join this rank's job (docs/hpc.md: child processes)."""
    return {
        k: v
        for k, v in env.items()
        if not k.startswith(_LAUNCHER_PREFIXES) or (k.startswith(_USER_SETTINGS) and k not in _LAUNCHER_MCA)
    }


def contradiction(env_rank: Optional[int], env_size: Optional[int], size: int) -> bool:
    """True if RANK/WORLD_SIZE from the launcher say a larger world than MPI's ``size``."""
    return (env_size is not None and env_size > size) or (env_rank is not None and env_rank >= size)


def export(values: Mapping[str, int], env: MutableMapping[str, str] = os.environ) -> None:
    """Set ``values`` (some of VARS) in ``env`` and record them in MARKER."""
    global _exported
    text = {k: str(int(v)) for k, v in values.items()}
    env.update(text)
    _exported = {**_exported, **text}
    env[MARKER] = " ".join(f"{k}={v}" for k, v in _exported.items())


def user_values(env: Mapping[str, str] = os.environ) -> dict:
    """RANK and WORLD_SIZE as the user's launcher (or the user's code) set them, as ints
    (None: unset, not an int, or mpidist's own export, in this process or a parent)."""
    out = {}
    for name in ("RANK", "WORLD_SIZE"):
        now = env.get(name)
        if now is not None and now == _exported.get(name):
            now = _at_import.get(name)  # ours: what was there before we exported
        elif now is not None and now == _recorded(env).get(name) and name not in _exported:
            now = None  # inherited from an mpidist parent
        out[name] = _int(now)
    return out


def export_at_import(rank: int, size: int, env: MutableMapping[str, str] = os.environ) -> None:
    """Remember the user's values, then export RANK/WORLD_SIZE (and LOCAL_* where the
    launcher tells) unless the environment contradicts MPI's world."""
    global _at_import
    inherited = _recorded(env)
    _at_import = {k: env[k] for k in VARS if k in env and env[k] != inherited.get(k)}
    if contradiction(_int(_at_import.get("RANK")), _int(_at_import.get("WORLD_SIZE")), size):
        return
    values = {"RANK": rank, "WORLD_SIZE": size}
    local = launcher_local(env, size)
    if local is not None:
        values.update(LOCAL_RANK=local[0], LOCAL_WORLD_SIZE=local[1])
    export(values, env)
