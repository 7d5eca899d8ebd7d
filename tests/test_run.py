"""``python -m mpidist``: runs a script, module or code string as __main__, and turns an
unhandled exception or a non-zero exit into a [rank r]-prefixed traceback and MPI_Abort."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import launcher_free_env

pytestmark = pytest.mark.launches  # starts MPI jobs or processes of its own: make test-mpis runs it on every MPI

MPIEXEC = str(Path(sys.executable).with_name("mpiexec"))
RUN = [sys.executable, "-m", "mpidist"]


def run(*args: str, cwd=None, n: int = 0, timeout: float = 60, **env: str) -> subprocess.CompletedProcess:
    cmd = ([MPIEXEC, "-n", str(n)] if n else []) + RUN + list(args)
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=launcher_free_env(OMP_NUM_THREADS="1", **env)
    )


def test_script_runs_as_main_with_its_arguments(tmp_path):
    script = tmp_path / "prog.py"
    script.write_text("import sys\nprint(__name__, sys.argv)\n")
    out = run(str(script), "a", "--b", "7")
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"__main__ {[str(script), 'a', '--b', '7']}\n"


def test_module_and_code_run_as_main(tmp_path):
    (tmp_path / "mymod.py").write_text("import sys\nprint(__name__, sys.argv[1:])\n")
    out = run("-m", "mymod", "x", "y", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "__main__ ['x', 'y']\n"
    out = run("-c", "import sys; print(__name__, sys.argv)", "z")
    assert out.returncode == 0 and out.stdout == "__main__ ['-c', 'z']\n", out.stderr


def test_exception_prints_rank_prefixed_traceback_and_exits_1(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("def f():\n    raise ValueError('bad value 42')\n\nf()\n")
    out = run(str(script))
    assert out.returncode == 1
    lines = out.stderr.splitlines()
    assert lines[0] == "[rank 0] Traceback (most recent call last):"
    assert f'[rank 0]   File "{script}", line 4, in <module>' in lines
    assert "[rank 0] ValueError: bad value 42" in lines
    assert "runpy" not in out.stderr and "mpidist/run.py" not in out.stderr  # the runner's own frames are cut


def test_exit_codes_pass_through(tmp_path):
    assert run("-c", "import sys; sys.exit(3)").returncode == 3
    out = run("-c", "import sys; sys.exit('no data')")
    assert out.returncode == 1 and out.stderr.startswith("no data\n")
    assert run("-c", "import sys; sys.exit(0)").returncode == 0
    assert run("-c", "raise SystemExit").returncode == 0


def test_usage_errors():
    out = run()
    assert out.returncode == 2 and out.stderr.startswith("usage: python -m mpidist")
    out = run("--bogus")
    assert out.returncode == 2 and "python -m mpidist: error: unknown option '--bogus'" in out.stderr
    out = run("/no/such/file.py")
    assert out.returncode == 2 and "can't open file '/no/such/file.py': no such file" in out.stderr
    out = run("-m")
    assert out.returncode == 2 and "-m needs a module name" in out.stderr
    assert run("--help").stdout.startswith("usage: python -m mpidist")
    import mpidist

    assert run("--version").stdout == f"mpidist {mpidist.__version__}\n"


def test_nonzero_exit_on_one_rank_aborts_the_job(tmp_path):
    """Rank 1 exits with 4 while rank 0 waits in a collective: the job ends, with code 4."""
    script = tmp_path / "exit.py"
    script.write_text(
        "import sys, numpy as np, mpidist\nmpidist.init_process_group()\n"
        "if mpidist.get_rank() == 1:\n    sys.exit(4)\nmpidist.all_reduce(np.ones(2))\n"
    )
    start = time.monotonic()
    out = run(str(script), n=2, timeout=60, TMPDIR=str(tmp_path))  # (its flight recorder goes there)
    assert out.returncode == 4, out.stderr
    assert time.monotonic() - start < 20
    assert "[rank 1] aborting the MPI job (MPI_Abort, exit code 4)" in out.stderr


@pytest.mark.parametrize("n", [2, 3])
def test_clean_job_exits_0(tmp_path, n):
    script = tmp_path / "ok.py"
    script.write_text(
        "import numpy as np, mpidist\nmpidist.init_process_group()\nx = np.ones(2)\n"
        "mpidist.all_reduce(x)\nassert x[0] == mpidist.get_world_size()\nprint('ok')\n"
    )
    out = run(str(script), n=n)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("ok") == n  # (the ranks' lines may interleave)
