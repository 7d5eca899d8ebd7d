"""``python -m mpidist.info [--json]``: what mpidist finds on this machine; run it first on a new
cluster, serially and under the launcher (``mpiexec -n 2 python -m mpidist.info``, ``srun -n 2
python -m mpidist.info``).

Rank 0 prints the versions (mpidist, Python, mpi4py, the MPI library and its thread level),
CUDA-awareness (:mod:`mpidist.device.detect`), CuPy/NCCL and GPUs, torch and its backends,
the launcher and rank variables, and shared memory (an MPI-3 window, one node, ``/dev/shm``);
``--json``: one JSON document. Then every rank runs ``init_process_group``, an all_reduce
of 1.0 (must equal the world size: N singletons give 1) and an ``all_gather_object`` of its
host, local rank and pid. Exit status 0 when every check passed, else 1 (docs/hpc.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import sys
from collections.abc import Mapping, Sequence
from typing import Any, Optional, cast

import numpy as np
from mpi4py import MPI

import mpidist
from mpidist._backends.device.nccl_core import version_text
from mpidist.device import detect

__all__ = ["collect", "launcher", "main"]

_THREAD_LEVELS = {
    MPI.THREAD_SINGLE: "MPI_THREAD_SINGLE",
    MPI.THREAD_FUNNELED: "MPI_THREAD_FUNNELED",
    MPI.THREAD_SERIALIZED: "MPI_THREAD_SERIALIZED",
    MPI.THREAD_MULTIPLE: "MPI_THREAD_MULTIPLE",
}
# The variables a launcher or mpidist sets that say who a process is.
_RANK_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "PMI_RANK",
    "PMI_SIZE",
    "MPI_LOCALRANKID",
    "MPI_LOCALNRANKS",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "PMIX_RANK",
    "SLURM_JOB_ID",
    "SLURM_STEP_ID",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "SLURM_NODEID",
)


def launcher(env: Optional[Mapping[str, str]] = None) -> str:
    """The launcher that started this process, from its variables (and, for hydra, the parent)."""
    env = os.environ if env is None else env
    if "HYDI_CONTROL_FD" in env or "PMI_FD" in env and "SLURM_STEP_ID" not in env:
        return "hydra (Intel MPI's mpiexec)" if "I_MPI_HYDRA_UUID" in env else "hydra (MPICH's mpiexec)"
    if "OMPI_COMM_WORLD_SIZE" in env:
        return "Open MPI's mpirun"
    if "SLURM_STEP_ID" in env and "SLURM_PROCID" in env:
        return "Slurm's srun"
    if "PMIX_RANK" in env:
        return "a PMIx launcher"
    return "none (a singleton: python without a launcher)"


def _optional(name: str) -> Optional[Any]:
    try:
        return __import__(name)
    except Exception:  # noqa: BLE001  (not installed, or broken: reported as absent)
        return None


def _gpu() -> dict[str, Any]:
    cupy = _optional("cupy")
    if cupy is None:
        return {"cupy": None}
    out: dict[str, Any] = {"cupy": cupy.__version__}
    try:
        out["gpus"] = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:  # noqa: BLE001
        out["gpus"] = 0
        out["gpu_error"] = f"{type(exc).__name__}: {exc}"
    try:
        from cupy.cuda import nccl  # noqa: PLC0415

        out["nccl"] = version_text(nccl.get_version())
    except Exception:  # noqa: BLE001
        out["nccl"] = None
    return out


def _torch() -> dict[str, Any]:
    torch = _optional("torch")
    if torch is None:
        return {"torch": None}
    out: dict[str, Any] = {"torch": torch.__version__, "distributed": bool(torch.distributed.is_available())}
    if out["distributed"]:
        try:
            import mpidist.torch  # noqa: F401, PLC0415  (registers the backends)

            out["backends"] = list(torch.distributed.Backend.backend_list)
            out["is_mpi_available"] = bool(torch.distributed.is_mpi_available())
        except Exception as exc:  # noqa: BLE001
            out["error"] = f"import mpidist.torch: {type(exc).__name__}: {exc}"
    return out


def _shared_memory(node: MPI.Intracomm) -> dict[str, Any]:
    out: dict[str, Any] = {}
    try:
        win = MPI.Win.Allocate_shared(8, 1, comm=node)
        win.Free()
        out["window"] = True
    except Exception as exc:  # noqa: BLE001
        out["window"] = False
        out["window_error"] = f"{type(exc).__name__}: {exc}"
    try:
        out["dev_shm_free_mib"] = round(shutil.disk_usage("/dev/shm").free / 2**20)
    except OSError:
        out["dev_shm_free_mib"] = None
    return out


def collect() -> dict[str, Any]:
    """This process's facts (collective over MPI_COMM_WORLD: it splits off the node's ranks)."""
    import mpi4py  # noqa: PLC0415

    world = MPI.COMM_WORLD
    # an Intracomm (split from one), which mpi4py's stubs type as its base Comm
    node = cast(MPI.Intracomm, world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank()))
    try:
        shm = _shared_memory(node)
        local = (node.Get_rank(), node.Get_size())
    finally:
        node.Free()
    found = detect.detect(comm=world)
    vendor, vendor_version = MPI.get_vendor()
    return {
        "mpidist": mpidist.__version__,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "mpi4py": mpi4py.__version__,
        "mpi": {
            "library": " ".join(MPI.Get_library_version().strip().splitlines()[0].split()),
            "vendor": f"{vendor} {'.'.join(map(str, vendor_version))}",
            "standard": "{}.{}".format(*MPI.Get_version()),
            "thread_level": _THREAD_LEVELS.get(MPI.Query_thread(), str(MPI.Query_thread())),
        },
        "cuda_aware_mpi": {"aware": found.aware, "decided_by": found.source},
        "gpu": _gpu(),
        "torch": _torch(),
        "launcher": launcher(),
        "variables": {k: os.environ[k] for k in _RANK_VARIABLES if k in os.environ},
        "rank": world.Get_rank(),
        "world_size": world.Get_size(),
        "host": socket.gethostname(),
        "local_rank": local[0],
        "local_world_size": local[1],
        "pid": os.getpid(),
        "shared_memory": shm,
    }


def _check_world(facts: dict[str, Any]) -> dict[str, Any]:
    """Collective: init_process_group, one all_reduce and an all_gather_object; what they gave."""
    mpidist.init_process_group()
    try:
        one = np.ones(1)
        mpidist.all_reduce(one)
        rows: list[Any] = [None] * mpidist.get_world_size()
        mpidist.all_gather_object(rows, {k: facts[k] for k in ("rank", "host", "local_rank", "pid")})
        nodes = len({row["host"] for row in rows})
        return {
            "init_process_group": "ok",
            "all_reduce": float(one[0]),
            "all_reduce_ok": bool(one[0] == len(rows)),
            "ranks": rows,
            "nodes": nodes,
            "backend": mpidist.get_backend(),
        }
    finally:
        mpidist.destroy_process_group()


def _text(facts: dict[str, Any], world: dict[str, Any]) -> str:
    mpi, gpu, torch = facts["mpi"], facts["gpu"], facts["torch"]
    lines = [
        f"mpidist {facts['mpidist']}  (Python {facts['python']}, numpy {facts['numpy']}, mpi4py {facts['mpi4py']})",
        f"MPI: {mpi['library']}",
        f"  vendor {mpi['vendor']}, MPI standard {mpi['standard']}, thread level {mpi['thread_level']}",
        f"CUDA-aware MPI: {'yes' if facts['cuda_aware_mpi']['aware'] else 'no'} "
        f"(decided by: {facts['cuda_aware_mpi']['decided_by']})",
    ]
    if gpu["cupy"] is None:
        lines.append("CuPy: not installed (device arrays: none)")
    else:
        lines.append(
            f"CuPy {gpu['cupy']}: {gpu.get('gpus', 0)} GPU(s)"
            f"{' (' + gpu['gpu_error'] + ')' if 'gpu_error' in gpu else ''}; "
            f"NCCL {gpu['nccl'] or 'not available'}"
        )
    if torch["torch"] is None:
        lines.append("torch: not installed")
    else:
        lines.append(
            f"torch {torch['torch']}: torch.distributed {'available' if torch['distributed'] else 'missing'}"
            + (
                f"; backends {', '.join(torch['backends'])} (is_mpi_available: {torch['is_mpi_available']})"
                if "backends" in torch
                else ""
            )
            + (f"; {torch['error']}" if "error" in torch else "")
        )
    shm = facts["shared_memory"]
    lines += [
        f"launcher: {facts['launcher']}",
        "variables: " + (" ".join(f"{k}={v}" for k, v in facts["variables"].items()) or "(none)"),
        f"shared memory: MPI-3 window {'ok' if shm['window'] else 'FAILED: ' + shm.get('window_error', '')}, "
        f"/dev/shm {shm['dev_shm_free_mib']} MiB free",
        f"world: {facts['world_size']} rank(s) on {world['nodes']} node(s); init_process_group "
        f"{world['init_process_group']} (backend {world['backend']}); all_reduce of 1.0 gave "
        f"{world['all_reduce']:g} ({'ok' if world['all_reduce_ok'] else 'WRONG: expected the world size'})",
    ]
    lines += [
        f"  rank {row['rank']}: host {row['host']}, local rank {row['local_rank']}, pid {row['pid']}"
        for row in world["ranks"]
    ]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mpidist.info", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON document instead of text")
    args = p.parse_args(argv)
    facts = collect()
    world = _check_world(facts)
    if facts["rank"] == 0:
        print(json.dumps({**facts, "world": world}, indent=1) if args.json else _text(facts, world), flush=True)
    return 0 if world["all_reduce_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
