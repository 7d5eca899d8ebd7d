"""A venv with another torch over the project's venv: what ``make test-torch-versions`` runs in.

    python tools/torch_venv.py VERSION --base .venv --venv .venv-torchVERSION [--cache DIR] [-- PIP_ARGS...]

The venv (``--venv``) is layered: it sees, in this order, its own site-packages (empty), torch
VERSION and its dependencies (the *layer*), then every package of ``--base`` (mpidist installed
there in editable mode, mpi4py, MPICH, numpy, pytest and its plugins). So only torch is new in it,
and a test run in it is the project's run with another torch. Its ``lib/`` and ``bin/`` link to
the base venv's MPI (pip's MPICH: ``libmpi*``, ``mpich/``, ``mpiexec`` and hydra's programs),
where mpi4py and the tests look for them (next to ``sys.executable``).

The layer is installed once per machine, by ``pip install --target``, into
``--cache``/torch-VERSION-cpXY-PLATFORM (default ``$XDG_CACHE_HOME/mpidist``, else
``~/.cache/mpidist``), and reused by every venv and clone that asks for the same VERSION: PyPI's
Linux torch wheels are CUDA builds, 2-3 GB of wheels (torch and its nvidia-* dependencies), which
take 1-2 min to download and unpack on the 2-core CI machine (docs/torch.md, "Versions"). It is
built in a private temporary folder beside it and renamed into place whole, so an interrupted
build is never used; ``make clean-torch-cache`` removes the cache. Exits non-zero, saying why,
when pip fails or the venv's torch is not VERSION.
"""

from __future__ import annotations

import argparse
import os
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

PIP_TIMEOUT = 1800  # s: a release's wheels (2-3 GB) took 1.5 min here; a stalled download must not hang make test


def cache_root(given: str | None) -> Path:
    """The cache folder, made private (0700) if new; refused if it is a link or not ours."""
    root = Path(given) if given else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mpidist"
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(root)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        sys.exit(f"torch_venv: {root} must be a folder of this user's, not a link: refusing to use it")
    return root


def layer(version: str, root: Path, pip_args: list[str]) -> Path:
    """torch ``version`` and its dependencies in ``root``, installed by pip the first time."""
    tag = f"torch-{version}-cp{sys.version_info[0]}{sys.version_info[1]}-{sysconfig.get_platform()}"
    done = root / tag
    if (done / ".complete").is_file():
        print(f"torch_venv: torch {version} from {done}", flush=True)
        return done
    tmp = Path(tempfile.mkdtemp(prefix=f".{tag}.", dir=root))  # private (0700), beside the cache entry
    try:
        print(f"torch_venv: installing torch {version} into {done} (once per machine)", flush=True)
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--target", str(tmp), f"torch=={version}", *pip_args]
        # The release asked for, whatever cap a pip configuration puts on torch (this machine's
        # image caps it at the releases on its disk): the layer is the tool's own, nothing else uses it.
        env = {**os.environ, "PIP_CONSTRAINT": os.devnull}
        try:
            failed = subprocess.run(cmd, env=env, timeout=PIP_TIMEOUT).returncode != 0
        except subprocess.TimeoutExpired:
            failed = True
        if failed:
            sys.exit(f"torch_venv: pip could not install torch {version} within {PIP_TIMEOUT} s: {' '.join(cmd)}")
        (tmp / ".complete").write_text(f"{version}\n")
        if (done / ".complete").is_file():  # another build finished first: use its
            shutil.rmtree(tmp, ignore_errors=True)
            return done
        shutil.rmtree(done, ignore_errors=True)  # an entry without .complete (not renamed whole)
        os.rename(tmp, done)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return done


def link_mpi(base: Path, venv: Path) -> None:
    """The base venv's MPI programs and libraries, linked from the same places in ``venv``."""
    for sub, patterns in (("lib", ("libmpi*", "mpich")), ("bin", ("mpi*", "hydra_*"))):
        for pattern in patterns:
            for src in sorted((base / sub).glob(pattern)):
                (venv / sub / src.name).symlink_to(src.resolve())  # (the venv is new: nothing there)


def _ask(python: Path, code: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -c code``, its output captured; bounded (an import here runs MPI_Init)."""
    return subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=timeout)


def _purelib(python: Path) -> str:
    return _ask(python, "import sysconfig; print(sysconfig.get_path('purelib'))").stdout.strip()


def make_venv(version: str, base: Path, venv: Path, root: Path, pip_args: list[str]) -> None:
    base_site = _purelib(base / "bin" / "python")
    torch_dir = layer(version, root, pip_args)
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    # addsitedir appends, in this order, and reads the .pth files there (mpidist's editable install)
    (Path(_purelib(python)) / "_mpidist_layers.pth").write_text(
        f"import site; site.addsitedir({str(torch_dir)!r})\nimport site; site.addsitedir({base_site!r})\n"
    )
    link_mpi(base, venv)
    got = _ask(python, "import torch, mpidist.torch; print(torch.__version__)")
    if got.returncode != 0 or got.stdout.strip().split("+")[0] != version:
        sys.exit(f"torch_venv: {venv} imports torch {got.stdout.strip() or '(none)'}, not {version}:\n{got.stderr}")
    print(f"torch_venv: {venv}: torch {got.stdout.strip()} over {base}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("version", help="torch release, e.g. 2.7.1")
    p.add_argument("--base", type=Path, required=True, help="the project's venv (mpidist installed in it)")
    p.add_argument("--venv", type=Path, required=True, help="the venv to make (replaced if it exists)")
    p.add_argument("--cache", help="where torch layers are kept (default: $XDG_CACHE_HOME/mpidist)")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)  # after it: more arguments for pip (e.g. an index)
    args = p.parse_args(argv[:cut])
    if sys.prefix == sys.base_prefix:
        p.error("run it with a venv's Python (its pip installs the layer)")
    make_venv(args.version, args.base.resolve(), args.venv.absolute(), cache_root(args.cache), argv[cut + 1 :])


if __name__ == "__main__":
    main()
