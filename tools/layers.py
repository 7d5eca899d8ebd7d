#!/usr/bin/env python3
"""Check that mpidist's modules form layers that only look down, and have no import cycle.

Usage: python tools/layers.py [PACKAGE_DIR]   (default: mpidist)

Every module belongs to one layer of :data:`LAYERS` (lowest first): the layer that names
it, else the one naming the package it is in. A module
may import modules of its own layer and of the layers below it, never of a layer above;
and no group of modules may import each other in a cycle (tools/import_cycles.py's graph:
imports at any depth of a function body count). docs/architecture.md describes the layers.
Prints each violation; exit status 0 when there is none, 1 otherwise, 2 on bad usage.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from import_cycles import package_graph, package_root, strongly_connected  # noqa: E402

#: (layer, modules), lowest first: a module's name, or a package's name ending in "." for
#: the modules under it that no layer names.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "core: errors, settings, process state, Work and engine, flight recorder, mismatch check",
        (
            "mpidist._current",
            "mpidist._tags",
            "mpidist._private",
            "mpidist._environ",
            "mpidist._abort",
            "mpidist._helper_process",
            "mpidist._init_watcher",
            "mpidist._finalize_watcher",
            "mpidist._launcher_files",
            "mpidist._mpi_init",
            "mpidist._array",
            "mpidist._signature",
            "mpidist._initcheck",
            "mpidist.errors",
            "mpidist._recorder",
            "mpidist.work",
            "mpidist._debug",
            "mpidist._group",
            "mpidist._watchdog",
        ),
    ),
    (
        "arrays: buffer and dtype adapters, reduce ops, device runtimes and detection",
        (
            "mpidist._buffers",
            "mpidist._reduce_op",
            "mpidist.device.runtime",
            "mpidist.device.arrays",
            "mpidist.device.detect",
            "mpidist.device.binding",
            "mpidist.device._nccl_shim",
            "mpidist.device._streams",
            "mpidist.device",
        ),
    ),
    ("runtime: init, groups, backends per group", ("mpidist._runtime", "mpidist._backends")),
    (
        "dispatch: group and rank resolution, recording, checking, launching; the backend interface",
        ("mpidist._dispatch", "mpidist._p2p_op", "mpidist._comm_backend"),
    ),
    (
        "MPI backend: the ops' bodies on host arrays, the collective algorithms",
        ("mpidist._mpi", "mpidist._mpi.", "mpidist.algorithms", "mpidist.algorithms."),
    ),
    ("device backends: MPI on device memory, host staging, NCCL, and the router that picks one", ("mpidist.device.",)),
    (
        "public API: the torch.distributed functions on arrays",
        (
            "mpidist._public_op",
            "mpidist.collectives",
            "mpidist.reductions",
            "mpidist.gather_scatter",
            "mpidist.p2p",
            "mpidist.objects",
            "mpidist.groups",
            "mpidist._coalesced",
            "mpidist._utilities",
            "mpidist._deprecated",
            "mpidist.device_mesh",
        ),
    ),
    ("package: the public namespace", ("mpidist",)),
    (
        "front ends and tools: torch backend, DDP, model toolkit, data, checkpoint, launcher, examples",
        (
            "mpidist.torch",
            "mpidist.torch.",
            "mpidist.parallel",
            "mpidist.parallel.",
            "mpidist.nn",
            "mpidist.nn.",
            "mpidist.optim",
            "mpidist.data",
            "mpidist.data.",
            "mpidist.checkpoint",
            "mpidist.run",
            "mpidist.__main__",
            "mpidist.tools",
            "mpidist.tools.",
            "mpidist.examples",
            "mpidist.examples.",
            "mpidist.info",
        ),
    ),
]


def layer_of(module: str) -> int:
    """Index in :data:`LAYERS` of ``module``'s layer: the layer that names it, else the one
    with the longest matching ``"package."`` prefix; ValueError for a module in none."""
    best: tuple[int, int] | None = None
    for i, (_, names) in enumerate(LAYERS):
        for p in names:
            if p == module:
                return i
            if p.endswith(".") and module.startswith(p) and (best is None or len(p) > best[0]):
                best = (len(p), i)
    if best is None:
        raise ValueError(f"{module}: in no layer of tools/layers.py's LAYERS; add it to one")
    return best[1]


def violations(root: Path) -> list[str]:
    """Every layer violation and import cycle of the package at ``root``, as text lines."""
    graph = package_graph(root)
    out = []
    for m in sorted(graph):
        try:
            mine = layer_of(m)
        except ValueError as exc:
            out.append(str(exc))
            continue
        for w in sorted(graph[m]):
            try:
                theirs = layer_of(w)
            except ValueError:  # reported as that module's own line
                continue
            if theirs > mine:
                out.append(
                    f"{m} (layer {mine}, {LAYERS[mine][0].split(':')[0]}) imports {w} "
                    f"(layer {theirs}, {LAYERS[theirs][0].split(':')[0]}): a layer may only import "
                    f"its own and lower ones"
                )
    for comp in strongly_connected(graph):
        if len(comp) > 1:
            members = set(comp)
            edges = "; ".join(
                f"{v} -> {', '.join(sorted(w for w in graph[v] if w in members))}" for v in comp if graph[v] & members
            )
            out.append(f"import cycle of {len(comp)} modules: {edges}")
    return out


def main(argv: list[str]) -> int:
    root = package_root(argv, __doc__)
    if root is None:
        return 2
    found = violations(root)
    for line in found:
        print(line)
    count = sum(1 for _ in root.rglob("*.py"))
    print(f"{len(found)} violation(s) in {count} modules of {len(LAYERS)} layers")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
