"""The package's layers only look down and it has no import cycle (tools/layers.py), and
the checker finds both kinds of violation."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _layers():
    spec = importlib.util.spec_from_file_location("mpidist_tools_layers", ROOT / "tools" / "layers.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def layers():
    saved = list(sys.path)
    try:
        yield _layers()
    finally:
        sys.path[:] = saved


def test_mpidist_has_no_upward_import_and_no_cycle(layers):
    assert layers.violations(ROOT / "mpidist") == []


def test_every_module_has_a_layer(layers):
    for path in (ROOT / "mpidist").rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        layers.layer_of(name)  # raises for a module in no layer


def test_checker_reports_an_upward_import_and_a_cycle(layers, tmp_path):
    pkg = tmp_path / "mpidist"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "errors.py").write_text("def prefix():\n    from mpidist import collectives  # a lazy import counts\n")
    (pkg / "collectives.py").write_text("from mpidist.errors import prefix\n")
    for folder in ("_arrays", "_runtime"):
        (pkg / folder).mkdir()
        (pkg / folder / "__init__.py").write_text("")
    (pkg / "_arrays" / "buffers.py").write_text("import mpidist._runtime.world\n")
    (pkg / "_runtime" / "world.py").write_text("")
    found = layers.violations(pkg)
    assert any(line.startswith("mpidist.errors (layer 1, core) imports mpidist.collectives") for line in found), found
    assert any(
        line.startswith("mpidist._arrays.buffers (layer 3, arrays) imports mpidist._runtime.world") for line in found
    ), found
    assert any(line.startswith("import cycle of 2 modules") for line in found), found
    assert len(found) == 3, found


def test_a_folder_decides_the_layer(layers):
    """A module is in its folder's layer, at any depth; a package's __init__ in its own folder's."""
    assert layers.layer_of("mpidist._launch.mpi_init") == 0
    assert layers.layer_of("mpidist._backends.device.route") == layers.layer_of("mpidist._backends")
    assert layers.layer_of("mpidist._backends.mpi.collectives") == layers.layer_of("mpidist._backends.mpi")
    assert layers.layer_of("mpidist._backends.mpi") < layers.layer_of("mpidist._backends.device")


def test_checker_refuses_a_module_in_no_layer(layers, tmp_path):
    pkg = tmp_path / "mpidist"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "newthing.py").write_text("")
    assert layers.violations(pkg) == ["mpidist.newthing: in no layer of tools/layers.py's LAYERS; add it to one"]
