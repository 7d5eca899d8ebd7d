"""torch's backend-generic test suite (``DistributedTest._DistTestBase``), classified for a backend.

Imports ``torch.testing._internal.distributed.distributed_test`` from the installed torch
wheel (nothing of it is copied here) and applies the classification that decides which of
its tests a backend is meant to pass. README.md (next to this file) says the same in words.

The suite gates its tests on the module global ``BACKEND`` (``os.environ["BACKEND"]`` at
import): decorators such as ``skip_but_pass_in_sandcastle_if(BACKEND != "gloo", ...)`` are
evaluated when the module is imported, a few branches in test bodies compare it again at
run time (``if BACKEND == "mpi" or BACKEND == "gloo"``: the CPU model), and the same name is
what the suite passes as ``backend=`` and compares with ``dist.get_backend()``.

Classification of ``"mpidist"`` (only this; no assertion, helper or test body is touched):

1. The module is imported with ``BACKEND=gloo`` in the environment, so every gate evaluated
   at import is gloo's, and ``os.environ["BACKEND"]`` stays ``"gloo"`` for the run-time
   helpers that read it (``skip_if_small_worldsize``, ``_test_allgather_object``'s
   ``backend == "nccl"``, ...).
2. The all_to_all gates: the tests whose gate is ``BACKEND != "mpi"`` with reason
   ``"Only MPI supports all_to_all"`` or ``"Only MPI supports CPU all_to_all_single"``
   (:data:`ALL_TO_ALL_REASONS`) are un-skipped (gloo has no all_to_all on CPU, MPI has;
   mpidist claims it). :func:`load` checks that exactly the tests in
   :data:`ALL_TO_ALL_TESTS` carry those reasons, so a torch that gates them otherwise
   fails loudly here instead of silently changing the selection.
3. After the import, the module global ``BACKEND`` becomes :class:`Classified`: the str
   ``"mpidist"`` (what ``init_process_group(backend=BACKEND)``, ``BACKEND.lower()`` and
   ``dist.Backend(BACKEND)`` see: the real backend) that compares equal to ``"gloo"`` and
   unequal to every other built-in backend name (``nccl``, ``mpi``, ``ucc``, ...), and
   hashes as ``"gloo"`` so that ``BACKEND in {"nccl", "gloo", "ucc"}`` answers as for gloo.
   This only matters for the comparisons made at run time (the ones at import already saw
   ``"gloo"``).
4. Profiling: mpidist is added to ``PROFILING_SUPPORTED_BACKENDS`` and
   ``SEND_RECV_PROFILING_SUPPORTED_BACKENDS`` (the backend lists of the profiled variants,
   which then look for ``mpidist:all_reduce``-style events, as for gloo's
   ``gloo:all_reduce``). :data:`PROFILE_MPIDIST` = False leaves it out.

For the gloo control nothing is changed: ``BACKEND`` is the plain ``"gloo"``.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

#: The one-line switch: True puts "mpidist" in the suite's profiling lists.
PROFILE_MPIDIST = True

WORLD_SIZE = 3
#: torch's gate reasons for the CPU all_to_all tests (MPI only in torch's classification).
ALL_TO_ALL_REASONS = ("Only MPI supports all_to_all", "Only MPI supports CPU all_to_all_single")
#: The tests that carry those gates in torch 2.13.0 (checked by :func:`load`).
ALL_TO_ALL_TESTS = frozenset(
    {
        "test_all_to_all",
        "test_all_to_all_complex",
        "test_all_to_all_full_group",
        "test_all_to_all_group",
        "test_all_to_all_single_equal_split",
        "test_all_to_all_single_equal_split_complex",
        "test_all_to_all_single_equal_split_full_group",
        "test_all_to_all_single_equal_split_group",
        "test_all_to_all_single_unequal_split",
        "test_all_to_all_single_unequal_split_complex",
        "test_all_to_all_single_unequal_split_full_group",
        "test_all_to_all_single_unequal_split_group",
    }
)
_BUILTIN = frozenset({"gloo", "nccl", "mpi", "ucc", "xccl", "hccl", "fake", "threaded", "undefined"})
MODULE = "torch.testing._internal.distributed.distributed_test"


class Classified(str):
    """The backend name ``value`` that the suite's comparisons classify as ``like``.

    ``Classified("mpidist", "gloo") == "gloo"`` is True, ``== "nccl"``/``"mpi"``/... is
    False, ``== "mpidist"`` is True; ``hash`` is ``like``'s (set membership). Every str
    method (``lower``, ``upper``, formatting, ``str()``) gives plain strs of ``value``.
    """

    def __new__(cls, value: str, like: str) -> Classified:
        self = super().__new__(cls, value)
        self.like = like
        return self

    def __eq__(self, other: object) -> bool:
        if isinstance(other, str) and str.lower(other) in _BUILTIN:
            return str.lower(other) == self.like
        return str.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        return hash(self.like)


def prepare_env(init_method: str) -> None:
    """The environment the suite reads at import: BACKEND (classification), WORLD_SIZE,
    INIT_METHOD (a file:// URL: the suite's gates for re-initialization need one)."""
    os.environ["BACKEND"] = "gloo"
    os.environ["WORLD_SIZE"] = str(WORLD_SIZE)
    os.environ["INIT_METHOD"] = init_method
    os.environ.setdefault("TEMP_DIR", os.path.dirname(init_method[len("file://") :]))


def load(backend: str, profile: bool = PROFILE_MPIDIST) -> Any:
    """Import the suite (once per process) classified for ``backend``; the module."""
    if backend not in ("gloo", "mpidist"):
        raise ValueError(f"backend must be 'gloo' or 'mpidist', got {backend!r}")
    if os.environ.get("BACKEND") != "gloo" or not os.environ.get("INIT_METHOD", "").startswith("file://"):
        raise RuntimeError("call prepare_env() before load(): the suite's gates are evaluated at import")
    dt = importlib.import_module(MODULE)
    base = dt.DistributedTest._DistTestBase
    gated = {
        name
        for name, fn in vars(base).items()
        if name.startswith("test")
        and getattr(fn, "__unittest_skip__", False)
        and getattr(fn, "__unittest_skip_why__", None) in ALL_TO_ALL_REASONS
    }
    if gated != ALL_TO_ALL_TESTS:
        raise RuntimeError(
            f"torch gates other tests as all_to_all than this harness knows: "
            f"new {sorted(gated - ALL_TO_ALL_TESTS)}, gone {sorted(ALL_TO_ALL_TESTS - gated)}"
        )
    if backend == "mpidist":
        import mpidist.torch  # noqa: F401  (registers the backend)

        for name in gated:
            fn = vars(base)[name]
            del fn.__unittest_skip__, fn.__unittest_skip_why__
        dt.BACKEND = Classified("mpidist", "gloo")
        if profile:
            dt.PROFILING_SUPPORTED_BACKENDS.append("mpidist")
            dt.SEND_RECV_PROFILING_SUPPORTED_BACKENDS.append("mpidist")
    return dt


def test_names(dt: Any) -> list:
    """Every test of ``_DistTestBase``, in the order unittest runs them (sorted by name)."""
    return sorted(n for n in dir(dt.DistributedTest._DistTestBase) if n.startswith("test"))


def static_skip(dt: Any, name: str) -> Any:
    """The reason a test is skipped by a gate evaluated at import, or None."""
    fn = getattr(dt.DistributedTest._DistTestBase, name)
    return getattr(fn, "__unittest_skip_why__", "skipped") if getattr(fn, "__unittest_skip__", False) else None


if __name__ == "__main__":  # list the selection: python classify.py [gloo|mpidist]
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        prepare_env("file://" + os.path.join(d, "init"))
        mod = load(sys.argv[1] if len(sys.argv) > 1 else "mpidist")
        names = test_names(mod)
        run = [n for n in names if static_skip(mod, n) is None]
        print(f"{len(names)} tests, {len(run)} not skipped at import")
        for n in run:
            print(n)
