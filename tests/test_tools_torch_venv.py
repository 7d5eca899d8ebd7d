"""tools/torch_venv.py's cache of torch releases (the venvs of `make test-torch-versions`): a
release is installed once, an interrupted install is never used, and the cache folder must be
the user's own. pip is stood in for (the real install is what `make test` runs)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parent.parent / "tools" / "torch_venv.py"


@pytest.fixture
def tool():
    spec = importlib.util.spec_from_file_location("torch_venv", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def pip_calls(tool, monkeypatch):
    """Each pip call's target folder; the stand-in "installs" a torch/ there, or fails when told."""
    calls: list[Path] = []

    def fake_run(cmd, env=None, **kw):
        target = Path(cmd[cmd.index("--target") + 1])
        calls.append(target)
        assert env["PIP_CONSTRAINT"] == os.devnull and cmd[-1].startswith("torch==")
        if os.environ.get("FAKE_PIP_FAILS"):
            (target / "torch").mkdir()  # half an install
            return subprocess.CompletedProcess(cmd, 1)
        (target / "torch").mkdir()
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(tool.subprocess, "run", fake_run)
    return calls


def test_a_release_is_installed_once_and_reused(tool, pip_calls, tmp_path):
    root = tool.cache_root(str(tmp_path / "cache"))
    assert (root.stat().st_mode & 0o777) == 0o700
    first = tool.layer("9.9.9", root, [])
    assert (first / "torch").is_dir() and (first / ".complete").read_text() == "9.9.9\n"
    assert tool.layer("9.9.9", root, []) == first
    assert len(pip_calls) == 1
    assert sorted(p.name for p in root.iterdir()) == [first.name]  # no temporary folder left


def test_an_interrupted_install_is_never_used(tool, pip_calls, tmp_path, monkeypatch):
    root = tool.cache_root(str(tmp_path / "cache"))
    monkeypatch.setenv("FAKE_PIP_FAILS", "1")
    with pytest.raises(SystemExit, match="pip could not install torch 9.9.9"):
        tool.layer("9.9.9", root, [])
    assert list(root.iterdir()) == []  # the half install went with its temporary folder
    # an entry without .complete (say, from a build killed between its steps) is rebuilt
    stale = root / f"torch-9.9.9-cp{sys.version_info[0]}{sys.version_info[1]}-{tool.sysconfig.get_platform()}"
    stale.mkdir()
    monkeypatch.delenv("FAKE_PIP_FAILS")
    assert tool.layer("9.9.9", root, []) == stale
    assert (stale / ".complete").is_file() and len(pip_calls) == 2


def test_a_cache_folder_that_is_a_link_is_refused(tool, tmp_path):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "cache").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(SystemExit, match="must be a folder of this user's, not a link"):
        tool.cache_root(str(tmp_path / "cache"))
