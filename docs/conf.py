"""Sphinx configuration: the docs site (``make docs``), built from the repository root so that
the pages' links to the repository's files (jobs/, tests/) resolve; only docs/ and the committed
chaos results are pages. The API reference (reference.md) is autodoc over the docstrings."""

from __future__ import annotations

import os
import sys
import warnings

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

import mpidist  # noqa: E402  (after the path: the checkout's package)

# autodoc reads every public name, the deprecated alias too: its warning says nothing here
warnings.filterwarnings("ignore", message="`mpidist.reduce_op` is deprecated", category=FutureWarning)

project = "mpidist"
author = "the mpidist authors"
release = version = mpidist.__version__
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown"}
root_doc = "docs/index"
include_patterns = ["docs/**", "tests/chaos/results.md"]
exclude_patterns = ["docs/conf.py"]
myst_heading_anchors = 3
autodoc_member_order = "bysource"
autodoc_typehints = "description"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
html_theme = "alabaster"
html_title = f"mpidist {version}"
