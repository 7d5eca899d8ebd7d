#!/usr/bin/env python3
"""Check that mpidist's modules form layers that only look down, and have no import cycle.

Usage: python tools/layers.py [PACKAGE_DIR]   (default: mpidist)

The layers are the package's folders: every module belongs to the layer of :data:`LAYERS`
(lowest first) that names its folder (the deepest one named), or, at the top level, names the
module itself. A module
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

#: (layer, folders and modules), lowest first. A layer is a folder of the package (a name
#: ending in "."): every module under it, at any depth, is in that layer, the deepest named
#: folder deciding. The top-level modules are named one by one (``mpidist.errors`` and
#: ``mpidist.work`` are core's public face; the public API's modules; the front ends').
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "launch: MPI_Init/Finalize under a bound, watchers, launcher files, abort, rank environment",
        ("mpidist._launch.",),
    ),
    (
        "core: process state, tags, private files, flight recorder, Work and engine, process group, errors",
        ("mpidist._core.", "mpidist.errors", "mpidist.work"),
    ),
    ("check: call signatures, the mismatch check, init's argument check", ("mpidist._check.",)),
    (
        "arrays: numpy/cupy, buffer and dtype adapters, reduce ops, device runtime and detection",
        ("mpidist._arrays.", "mpidist.device."),
    ),
    ("runtime: init and destroy, world state, backend queries, the watchdog", ("mpidist._runtime.",)),
    (
        "dispatch: group and rank resolution, recording, checking, launching; the backend interface",
        ("mpidist._dispatch.",),
    ),
    (
        "MPI backend: the ops' bodies on host arrays, the collective algorithms",
        ("mpidist._backends.mpi.", "mpidist.algorithms."),
    ),
    ("device backends: NCCL, CUDA-aware MPI, host staging, and the router that picks one", ("mpidist._backends.",)),
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
            "mpidist.torch.",
            "mpidist.parallel.",
            "mpidist.nn.",
            "mpidist.data.",
            "mpidist.tools.",
            "mpidist.examples.",
            "mpidist.optim",
            "mpidist.checkpoint",
            "mpidist.run",
            "mpidist.__main__",
            "mpidist.info",
        ),
    ),
]


def layer_of(module: str) -> int:
    """Index in :data:`LAYERS` of ``module``'s layer: the layer that names it, else the one
    naming the deepest folder it is in (a package's ``__init__`` is in its own folder);
    ValueError for a module in none."""
    best: tuple[int, int] | None = None
    for i, (_, names) in enumerate(LAYERS):
        for p in names:
            if p == module:
                return i
            if p.endswith(".") and (module + ".").startswith(p) and (best is None or len(p) > best[0]):
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
