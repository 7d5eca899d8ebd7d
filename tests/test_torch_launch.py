"""Starting, ending and failing torch jobs on backend "mpidist", each a real job under
mpiexec (or a plain python), bounded in time: init with no MASTER_ADDR/RANK/WORLD_SIZE
in both forms, init/destroy/init, no listening socket of ours, MASTER_ADDR set (one
warning), rank/world_size as torch's MPI backend treats them and a torchrun environment
of a larger world (the same error on every rank), a world of size 1, a rank
that never joins (timeout naming the op and the missing rank), a rank that raises
(``python -m mpidist`` aborts the job).

Not MPI-marked: each test launches its own job, once, in the serial pass.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.launches  # starts MPI jobs or processes of its own: make test-mpis runs it on every MPI

pytest.importorskip("torch")

from conftest import launcher_free_env  # noqa: E402

MPIEXEC = str(Path(sys.executable).with_name("mpiexec"))

# The listening TCP sockets this process holds (inodes), from /proc.
LISTENING = """
import os
def listening():
    inodes = set()
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = open(name).read().splitlines()[1:]
        except OSError:
            continue
        inodes |= {row.split()[9] for row in rows if row.split()[3] == "0A"}
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:[") and target[8:-1] in inodes:
            mine.add(target[8:-1])
    return mine
"""

FORMS = (
    LISTENING
    + """
import sys
import torch
import torch.distributed as dist
import mpidist
import mpidist.torch

before = listening()
for form in sys.argv[1:]:
    if form == "env":
        dist.init_process_group("mpidist")
    else:
        dist.init_process_group(backend="mpidist", init_method="mpi://")
    t = torch.ones(2)
    dist.all_reduce(t)
    mpidist.all_reduce(t.numpy())  # the same runtime serves mpidist's own API
    store = dist.distributed_c10d._get_default_store()
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    line = (f"{form} rank {dist.get_rank()} size {dist.get_world_size()} sum {t[0].item()} "
            f"store {type(store).__name__} new-listening {len(listening() - before)}")
    lines = [None] * dist.get_world_size()
    dist.all_gather_object(lines, line)
    rank = dist.get_rank()
    dist.destroy_process_group()
    if rank == 0:
        print(chr(10).join(lines), flush=True)
    print(f"{form} destroyed torch={dist.is_initialized()} mpidist={mpidist.is_initialized()}", flush=True)
try:
    dist.init_process_group("gloo")  # other backends keep torch's own env:// rendezvous
except (ValueError, RuntimeError) as exc:
    print("gloo:", str(exc).splitlines()[0], flush=True)
"""
)

SEED_SETUP = """
import os
import torch
import torch.distributed as dist
import mpidist.torch

os.environ["MASTER_ADDR"] = "localhost"
os.environ["MASTER_PORT"] = "12355"
rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
dist.init_process_group("mpidist", rank=rank, world_size=world)
t = torch.tensor([float(rank)])
dist.all_reduce(t)
lines = [None] * dist.get_world_size()
dist.all_gather_object(lines, f"rank {dist.get_rank()} of {dist.get_world_size()} sum {t.item()}")
if rank == 0:
    print(chr(10).join(lines), flush=True)
dist.destroy_process_group()
"""

PLAIN = """
import sys
from datetime import timedelta
import torch
import torch.distributed as dist
import mpidist.torch

kw = {"world_size": int(sys.argv[1])} if len(sys.argv) > 1 else {}
dist.init_process_group("mpidist", timeout=timedelta(seconds=3), **kw)
print(f"rank {dist.get_rank()} of {dist.get_world_size()}", flush=True)
dist.destroy_process_group()
"""

FAULTS = """
import os
import sys
import time
from datetime import timedelta
import torch
import torch.distributed as dist
import mpidist.torch

dist.init_process_group("mpidist", timeout=timedelta(seconds=float(sys.argv[2])))
rank = dist.get_rank()
t = torch.ones(4)
dist.all_reduce(t)
print(f"rank {rank} ready", flush=True)
if rank == 1:
    if sys.argv[1] == "raise":
        raise RuntimeError("injected fault on rank 1")
    time.sleep(120)  # never joins the next all_reduce
dist.all_reduce(t)
"""


def _run(tmp_path: Path, source: str, *args: str, n: int = 2, limit: float = 120, **env: str):
    script = tmp_path / "job.py"
    script.write_text(source)
    cmd = ([MPIEXEC, "-n", str(n)] if n else []) + [sys.executable, "-m", "mpidist", str(script), *args]
    environ = launcher_free_env(OMP_NUM_THREADS="1", **env)
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        if name not in env:  # none of torch's launch variables unless the test sets it
            environ.pop(name, None)
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, env=environ)
    return proc.returncode, proc.stdout, proc.stderr, time.monotonic() - t0


def test_init_forms_without_env_and_no_listening_socket(tmp_path):
    rc, out, err, _ = _run(tmp_path, FORMS, "env", "mpi", "env")
    assert rc == 0, err
    for form in ("env", "mpi"):
        for rank in (0, 1):
            assert f"{form} rank {rank} size 2 sum 4.0 store MPIStore new-listening 0" in out, out + err
    assert out.count("destroyed torch=False mpidist=False") == 6  # 3 inits, 2 ranks: runtime freed each time
    assert out.count("gloo: ") == 2 and "MASTER_ADDR" in out  # gloo: torch's own env:// error, untouched


def test_master_addr_set_by_the_program_is_unused_and_said_only_when_asked(tmp_path):
    """Frameworks (Lightning, Accelerate, DeepSpeed) set MASTER_ADDR/MASTER_PORT on their
    own: no warning by default; one, on rank 0, at debug level INFO."""
    rc, out, err, _ = _run(tmp_path, SEED_SETUP)
    assert rc == 0, err
    assert "rank 0 of 2 sum 1.0" in out and "rank 1 of 2 sum 1.0" in out
    assert "set but unused" not in err, err
    rc, out, err, _ = _run(tmp_path, SEED_SETUP, MPIDIST_DEBUG="INFO")
    assert rc == 0, err
    assert err.count("MASTER_ADDR and MASTER_PORT are set but unused") == 1, err


def test_plain_python_is_a_world_of_one(tmp_path):
    rc, out, err, _ = _run(tmp_path, PLAIN, n=0)
    assert rc == 0, err
    assert out.strip() == "rank 0 of 1"


RANKS = """
import sys
from datetime import timedelta
import torch.distributed as dist
from mpi4py import MPI
import mpidist.torch

me = MPI.COMM_WORLD.Get_rank()
kw = {"rank": 1 - me, "world_size": 2} if sys.argv[1] == "renumber" else {"rank": 0, "world_size": 0}
try:
    dist.init_process_group("mpidist", timeout=timedelta(seconds=20), **kw)
except ValueError as exc:
    print(f"rank {me} ValueError: {exc}", flush=True)
else:
    print(f"rank {dist.get_rank()} of {dist.get_world_size()}", flush=True)
    dist.destroy_process_group()
"""


TYPO = """
import torch.distributed as dist
import mpidist.torch

try:
    dist.init_process_group("mpidst")
except ValueError as exc:
    print(f"ValueError: {exc}", flush=True)
"""


def test_a_misspelt_backend_is_named_with_the_known_ones_not_as_a_missing_master_addr(tmp_path):
    rc, out, err, _ = _run(tmp_path, TYPO, n=0, limit=60)
    assert rc == 0, err
    assert "ValueError: [rank 0/1] init_process_group: unknown backend 'mpidst'" in out, out + err
    assert "the registered backends are gloo," in out and "mpidist" in out.split("registered backends are")[1]


def test_environment_of_a_larger_world_is_refused_on_every_rank(tmp_path):
    """torchrun's RANK/WORLD_SIZE that say a larger world than MPI launched: the same error on
    every rank (mpidist's collective init check), saying how to launch."""
    rc, out, err, _ = _run(tmp_path, PLAIN, RANK="5")
    assert rc != 0
    assert err.count("the environment says RANK=5") >= 2, err  # both ranks, no hang
    assert "mpiexec -n 6" in err


def test_rank_and_world_size_follow_torchs_mpi_rule(tmp_path):
    """As torch's MPI backend: values that differ from MPI's are ignored with torch's warning
    (the tutorials' init_process(0, 0, ...)); a renumbering of the processes is an error on
    every rank."""
    rc, out, err, _ = _run(tmp_path, RANKS, "ignored")
    assert rc == 0, err
    assert "rank 0 of 2" in out and "rank 1 of 2" in out
    assert "For MPI backend, world_size (0) and rank (0) are ignored" in err
    rc, out, err, _ = _run(tmp_path, RANKS, "renumber")
    assert rc == 0, err
    for me in (0, 1):
        assert (
            f"rank {me} ValueError: [rank {me}/2] init_process_group: rank= contradicts MPI, which numbers "
            f"the processes itself"
        ) in out, out + err


def test_rank_that_never_joins_times_out_naming_op_and_rank(tmp_path):
    rc, out, err, secs = _run(tmp_path, FAULTS, "sleep", "3", limit=90)
    assert rc != 0 and secs < 60
    assert "all_reduce" in err and "timed out after 3 s" in err, err
    assert "ranks that had not arrived: [1]" in err, err


def test_python_m_mpidist_aborts_the_job_on_one_rank_exception(tmp_path):
    rc, out, err, secs = _run(tmp_path, FAULTS, "raise", "600", limit=90)
    assert rc != 0 and secs < 60
    assert "injected fault on rank 1" in err, err
