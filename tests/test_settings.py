"""The settings table of docs/reliability.md ("Settings") against the code: every ``MPIDIST_*``
variable the package reads is a row and every row is read; each row that
``init_process_group`` checks, set to a bad value, makes it raise a ValueError naming the
variable, the value and what is accepted, also for the settings read leniently at import."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import launcher_free_env

pytestmark = pytest.mark.launches  # starts processes of its own: make test-mpis runs it on every MPI

ROOT = Path(__file__).resolve().parents[1]
SECTION = (ROOT / "docs" / "reliability.md").read_text().split("## Settings", 1)[1].split("\n## ", 1)[0]
TABLE = re.findall(r"^\| `(MPIDIST_[A-Z_]+)`", SECTION, re.M)
#: what the package's code reads, from its string literals (the marker of exported variables is no setting)
CODE = {
    name
    for path in (ROOT / "mpidist").rglob("*.py")
    for name in re.findall(r"[\"'](MPIDIST_[A-Z_]+)[\"']", path.read_text())
} - {"MPIDIST_ENV_EXPORTED"}
#: a bad value of each setting init_process_group checks, and what the error says is accepted
BAD = {
    "MPIDIST_TIMEOUT": ("soon", "a positive number of seconds"),
    "MPIDIST_ABORT_ON_TIMEOUT": ("maybe", "0 or 1"),
    "MPIDIST_STALL_WARNING": ("soon", "a number of seconds >= 0"),
    "MPIDIST_DEBUG": ("LOUD", "one of OFF, INFO, DETAIL"),
    "MPIDIST_TRACE_BUFFER": ("-1", "a number of entries >= 0"),
    "MPIDIST_TRACE_KEEP": ("all", "a number of job directories >= 0"),
    "MPIDIST_ABORT_ON_EXCEPTION": ("maybe", "0 or 1"),
    "MPIDIST_BOUND_INIT_FINALIZE": ("maybe", "0 or 1"),
    "MPIDIST_INIT_FINALIZE_GRACE": ("soon", "a number of seconds >= 0"),
    "MPIDIST_SUPERVISE": ("maybe", "0 or 1"),
    "MPIDIST_REMOVE_LAUNCHER_FILES": ("maybe", "0 or 1"),
    "MPIDIST_SHM_MIN_BYTES": ("1MB", "a byte count (65536, 64K, 1M), 0 or off"),
    "MPIDIST_CUDA_AWARE": ("maybe", "0 or 1"),
    "MPIDIST_STAGING_CHUNK": ("4MB", "a byte count (65536, 64K, 1M), 0 or off"),
}
#: the rows the table says are checked elsewhere (where they are used)
ELSEWHERE = {"MPIDIST_TRACE_DIR", "MPIDIST_DEVICE", "MPIDIST_TIMELINE", "MPIDIST_DATA_CACHE"}


def test_the_table_lists_what_the_code_reads():
    assert len(TABLE) == len(set(TABLE)), TABLE
    assert set(TABLE) == CODE, f"in the code only: {CODE - set(TABLE)}; in the table only: {set(TABLE) - CODE}"
    assert set(TABLE) == set(BAD) | ELSEWHERE and not set(BAD) & ELSEWHERE
    for name in ELSEWHERE:
        assert f"`{name}`" in SECTION.split("each checked where it is used:")[1].split("\n\n")[0], name


@pytest.mark.parametrize("name", [name for name in TABLE if name in BAD])
def test_a_bad_value_fails_init_naming_variable_value_and_what_is_accepted(name):
    value, accepted = BAD[name]
    run = subprocess.run(
        [sys.executable, "-c", "import mpidist; mpidist.init_process_group()"],
        capture_output=True,
        text=True,
        timeout=60,
        env=launcher_free_env(**{name: value}),
    )
    assert run.returncode == 1, run.stderr
    line = f"ValueError: [rank 0/1] init_process_group: {name} must be {accepted}, got {value!r}"
    assert line in run.stderr, run.stderr
