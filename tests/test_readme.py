"""The README's "Use" commands work as written in a new shell once the venv is active, as the
README says to do: ``. .venv/bin/activate``, then ``python -m mpidist.info`` and the README's
bash lines with its first Python example as ``script.py`` (a new user's first steps)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import launcher_free_env

pytestmark = pytest.mark.launches  # starts MPI jobs: make test-mpis runs it on every MPI

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def _block(lang: str, contains: str) -> str:
    """The README's first ``lang`` code block that contains ``contains``."""
    for body in re.findall(rf"```{lang}\n(.*?)```", README, re.S):
        if contains in body:
            return body
    raise AssertionError(f"README.md has no {lang} block with {contains!r}")


def test_use_commands_run_as_written_in_a_new_shell(tmp_path):
    venv_bin = Path(sys.prefix) / "bin"
    if sys.prefix == sys.base_prefix or not (venv_bin / "activate").is_file():
        pytest.skip("the suite is not running from a virtual environment")
    (tmp_path / "script.py").write_text(_block("python", "import mpidist as dist"))
    lines = [line.split("#")[0].strip() for line in _block("bash", "script.py").splitlines()]
    assert "mpiexec -n 4 python -m mpidist script.py" in lines, lines
    assert "activate it first (`. .venv/bin/activate`" in README
    shell = "\n".join([f". {venv_bin / 'activate'}", "python -m mpidist.info", *filter(None, lines)])
    env = launcher_free_env(OMP_NUM_THREADS="1", MPIDIST_SUPERVISE="")
    env.pop("VIRTUAL_ENV", None)  # a new shell: the venv is neither active nor on PATH
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if Path(p) != venv_bin)
    run = subprocess.run(
        ["timeout", "-k", "5", "240", "bash", "-e", "-c", shell],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
    )
    assert run.returncode == 0, f"{shell}\n--- stdout\n{run.stdout}\n--- stderr\n{run.stderr}"
    assert "init_process_group ok" in run.stdout, run.stdout
