"""docs/api.md lists every public name of torch.distributed 2.13 with its status here, and
the names it calls done or differs exist in mpidist (issue 15, item 6).

The names are written out below (torch is not needed to run the tests): they are
``sorted(n for n in dir(torch.distributed) if not n.startswith("_"))`` on torch 2.13.0.
When torch is installed, the test also checks that list against it.
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

import mpidist

TORCH_2_13 = """
AllToAllOptions AllreduceCoalescedOptions AllreduceOptions Backend BackendConfig BarrierOptions
BroadcastOptions BuiltinCommHookType DebugLevel DeviceMesh DistBackendError DistError DistNetworkError
DistStoreError FileStore GatherOptions GradBucket GroupMember GroupName HashStore Logger P2POp PrefixStore
ProcessGroup ProcessGroupGloo QueueEmptyError RankType ReduceOp ReduceOptions ReduceScatterOptions Reducer
ScatterOptions Store TCPStore Work algorithms all_gather all_gather_coalesced all_gather_into_tensor
all_gather_object all_gather_single all_reduce all_reduce_coalesced all_to_all all_to_all_single autograd
barrier batch_isend_irecv breakpoint broadcast broadcast_object_list c10d_logger config constants
default_pg_timeout destroy_process_group device_mesh distributed_c10d gather gather_object get_backend
get_backend_config get_debug_level get_default_backend_for_device get_global_rank get_group_rank
get_node_local_rank get_pg_count get_process_group_ranks get_rank get_world_size group init_device_mesh
init_process_group irecv is_available is_backend_available is_gloo_available is_initialized is_mpi_available
is_nccl_available is_torchelastic_launched is_ucc_available is_xccl_available isend log logging
logging_handlers monitored_barrier new_group new_subgroups new_subgroups_by_enumeration record_comm recv
recv_object_list reduce reduce_op reduce_scatter reduce_scatter_single reduce_scatter_tensor
register_rendezvous_handler remote_device rendezvous rpc scatter scatter_object_list send send_object_list
set_debug_level set_debug_level_from_env shrink_group split_group supports_complex sys timedelta torch
traceback typing utils
""".split()

#: names documented as done that are not there yet (a branch adds them); empty once merged
PENDING: set = set()

API_MD = Path(__file__).resolve().parents[1] / "docs" / "api.md"
ROW = re.compile(r"^\| `([A-Za-z_][A-Za-z0-9_]*)` \| (done|differs|n/a) \|(.*)\|$")


def _table() -> dict:
    text = API_MD.read_text()
    section = text.split("## Every torch 2.13 public name", 1)
    assert len(section) == 2, "docs/api.md has no 'Every torch 2.13 public name' section"
    rows: dict = {}
    for line in section[1].splitlines():
        if line.startswith("| `"):
            m = ROW.match(line)
            assert m, f"malformed row in docs/api.md: {line}"
            name, status, notes = m.groups()
            assert name not in rows, f"{name} has two rows in docs/api.md"
            rows[name] = (status, notes.strip())
    return rows


def test_the_list_has_119_names():
    assert len(TORCH_2_13) == len(set(TORCH_2_13)) == 119
    assert TORCH_2_13 == sorted(TORCH_2_13)


def test_matches_torch_when_installed():
    """torch.distributed's names as a fresh ``import torch.distributed`` has them (in a process of
    its own: the submodules other tests import, fsdp or pipelining, become attributes too)."""
    torch = pytest.importorskip("torch")
    if not torch.__version__.startswith("2.13"):
        pytest.skip(f"torch {torch.__version__}: the list is torch 2.13's")
    code = "import torch.distributed as d; print(*sorted(n for n in dir(d) if not n.startswith('_')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == TORCH_2_13


def test_every_torch_name_has_one_row():
    rows = _table()
    missing = [n for n in TORCH_2_13 if n not in rows]
    extra = [n for n in rows if n not in TORCH_2_13]
    assert not missing, f"torch 2.13 names without a row in docs/api.md: {missing}"
    assert not extra, f"rows for names torch 2.13 does not have: {extra}"
    assert list(rows) == TORCH_2_13, "rows out of alphabetical order"


def test_done_and_differs_names_exist_and_na_names_say_why():
    rows = _table()
    absent = [
        n
        for n, (status, _) in rows.items()
        if status != "n/a" and not hasattr(mpidist, n) and n not in PENDING and not _resolves_in(rows[n][1])
    ]
    assert not absent, f"docs/api.md calls these done or differs but mpidist lacks them: {absent}"
    unexplained = [n for n, (status, notes) in rows.items() if status == "n/a" and len(notes) < 10]
    assert not unexplained, f"n/a rows must say why: {unexplained}"
    present_but_na = [
        n
        for n, (status, _) in rows.items()
        if status == "n/a" and hasattr(mpidist, n) and not isinstance(getattr(mpidist, n), types.ModuleType)
    ]
    assert not present_but_na, f"mpidist has these but docs/api.md calls them n/a: {present_but_na}"


def _resolves_in(notes: str) -> bool:
    """A differs row for a name mpidist keeps elsewhere names that place, e.g.
    `mpidist.parallel.GradBucket`: it must import."""
    for path in re.findall(r"`(mpidist(?:\.[A-Za-z_]\w*)+)`", notes):
        module, _, attr = path.rpartition(".")
        try:
            if hasattr(importlib.import_module(module), attr):
                return True
            importlib.import_module(path)
            return True
        except ImportError:
            continue
    return False


def test_every_mpidist_public_name_from_torch_is_in_the_table():
    """The other direction: what mpidist exports under a torch name is listed."""
    rows = _table()
    torch_names = set(TORCH_2_13)
    assert [n for n in mpidist.__all__ if n in torch_names and n not in rows] == []
