"""docs/reference.md, the API reference (autodoc), covers every public module of mpidist: each
has an ``automodule`` there, or all of its ``__all__`` names are re-exported by ``mpidist``
(and documented in its section). Where an automodule lists its members, it lists every name
``mpidist`` does not re-export. Reads the sources only: no docs build, no MPI job.
"""

from __future__ import annotations

import ast
import importlib.util
import pkgutil
import re
from pathlib import Path

import mpidist

PACKAGE = Path(mpidist.__file__).parent
REFERENCE = (PACKAGE.parent / "docs" / "reference.md").read_text()

# ".. automodule:: mpidist.x" and the ":members:" line of its options, if any
AUTOMODULE = re.compile(r"^\.\. automodule:: (\S+)\n((?:   :.*\n)*)", re.M)


def _automodules() -> dict[str, set[str] | None]:
    """Module -> the members its automodule lists (None: all of them, or none listed)."""
    found: dict[str, set[str] | None] = {}
    for name, options in AUTOMODULE.findall(REFERENCE):
        listed = re.search(r":members:[ \t]*(.*)", options)
        found[name] = {m.strip() for m in listed.group(1).split(",")} if listed and listed.group(1) else None
    return found


def _static_all(path: Path) -> list[str] | None:
    """A module's literal ``__all__``, read without importing it (mpidist.torch needs torch)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    return None


def _public_modules() -> dict[str, Path]:
    modules = {}
    for info in pkgutil.iter_modules(mpidist.__path__):
        if not info.name.startswith("_"):
            modules[info.name] = PACKAGE / info.name / "__init__.py" if info.ispkg else PACKAGE / f"{info.name}.py"
    return modules


def test_every_public_module_is_in_the_reference():
    documented, exported = _automodules(), set(mpidist.__all__)
    modules = _public_modules()
    assert {"nn", "optim", "torch", "parallel"} <= set(modules)  # the scan sees the package
    missing = {}
    for name, path in modules.items():
        names = _static_all(path)
        not_exported = None if names is None else set(names) - exported
        qualified = f"mpidist.{name}"
        if qualified in documented:
            listed = documented[qualified]
            if listed is not None and not_exported and not not_exported <= listed:
                missing[qualified] = f"automodule's :members: lacks {sorted(not_exported - listed)}"
        elif names is None:
            missing[qualified] = "no automodule, and no __all__ for mpidist to re-export"
        elif not_exported:
            missing[qualified] = f"no automodule, and mpidist does not re-export {sorted(not_exported)}"
    assert not missing, f"docs/reference.md does not cover: {missing}"


def _spec(name: str):
    try:
        return importlib.util.find_spec(name)
    except ModuleNotFoundError:  # a name inside a module (its parent is no package)
        return None


def test_every_reference_entry_exists():
    targets = re.findall(r"^\.\. auto\w+:: (mpidist\S*)", REFERENCE, re.M)
    assert len(targets) > 10
    for target in targets:
        if _spec(target) is None:  # mpidist.collectives.ALGORITHMS: a public name of a module
            module, _, attribute = target.rpartition(".")
            spec = _spec(module)
            assert spec is not None and attribute in (_static_all(Path(spec.origin)) or []), target
