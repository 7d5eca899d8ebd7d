#!/usr/bin/env python3
"""Print the import cycles among a package's modules, and each module's layer.

Usage: python tools/import_cycles.py [PACKAGE_DIR]   (default: mpidist)

(Copied from the team's shared tools; tools/layers.py builds on it.)

Reads every .py file under PACKAGE_DIR with `ast`, at any depth of the function bodies (a
local import is still a dependency), and builds the module graph of imports that stay inside
the package. It prints:
  - each cycle (strongly connected component of more than one module), with the edges that
    close it, so you can see which import runs "back up";
  - a layer number for every module: 0 for modules that import nothing of the package,
    otherwise 1 + the highest layer they import (modules in one cycle share a layer).
Exit status: 0 when there is no cycle, 1 when there is one (usable in CI), 2 on bad usage.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, name: str, package: str, known: set[str]) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_pkg = path.name == "__init__.py"
    here = name if is_pkg else name.rpartition(".")[0]
    found: set[str] = set()

    def resolve(mod: str) -> str | None:
        while mod and mod not in known:
            mod = mod.rpartition(".")[0]
        return mod or None

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == package:
                    target = resolve(alias.name)
                    if target:
                        found.add(target)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] != package:
                continue
            for alias in node.names:  # `from pkg import sub` imports the submodule
                sub = f"{mod}.{alias.name}"
                target = sub if sub in known else resolve(mod)
                if target:
                    found.add(target)
    found.discard(name)
    return found


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # Tarjan; the package graphs are small enough for recursion
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def package_graph(root: Path) -> dict[str, set[str]]:
    """Module name -> the package's modules it imports, for the package directory ``root``."""
    files = {module_name(root, p): p for p in sorted(root.rglob("*.py"))}
    known = set(files)
    return {m: imports_of(p, m, root.name, known) for m, p in files.items()}


def package_root(argv: list[str], usage: str) -> Path | None:
    """The package directory named on the command line (default: mpidist), or None after
    printing why it cannot be used (``usage`` for bad arguments)."""
    if len(argv) > 2:
        print(usage)
        return None
    root = Path(argv[1] if len(argv) == 2 else "mpidist").resolve()
    if not (root / "__init__.py").is_file():
        print(f"{root}: not a package directory (no __init__.py)")
        return None
    return root


def main(argv: list[str]) -> int:
    root = package_root(argv, __doc__)
    if root is None:
        return 2
    graph = package_graph(root)
    comps = strongly_connected(graph)
    comp_of = {m: i for i, c in enumerate(comps) for m in c}
    layer: dict[int, int] = {}
    for i, comp in enumerate(comps):  # Tarjan emits components in reverse topological order
        deps = {comp_of[w] for v in comp for w in graph[v]} - {i}
        layer[i] = 1 + max((layer[d] for d in deps), default=-1)

    cycles = [c for c in comps if len(c) > 1]
    for n, comp in enumerate(sorted(cycles, key=len, reverse=True), 1):
        members = set(comp)
        print(f"cycle {n}: {len(comp)} modules")
        for v in comp:
            inside = sorted(w for w in graph[v] if w in members)
            if inside:
                print(f"  {v} -> {', '.join(inside)}")
    print(f"{len(cycles)} cycle(s); {sum(map(len, cycles))} of {len(graph)} modules are in one")
    print("layers (0 = imports nothing of the package):")
    for m in sorted(graph, key=lambda m: (layer[comp_of[m]], m)):
        mark = "  (in a cycle)" if len(comps[comp_of[m]]) > 1 else ""
        print(f"  {layer[comp_of[m]]:2d}  {m}{mark}")
    return 1 if cycles else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
