"""Sphinx configuration: the docs site (``make docs``), built from the repository root so that
the pages' links to the repository's files (jobs/, tests/) resolve; only docs/ and the committed
chaos results are pages, so the root page lands at out/docs/docs/index.html and out/docs/index.html
is a redirect to it (_extra/). The API reference (reference.md) is autodoc over the docstrings."""

from __future__ import annotations

import os
import sys
import warnings

from docutils import nodes

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
html_static_path = ["_static"]  # relative to this directory (docs/)
html_css_files = ["mpidist.css"]  # code blocks wrap long lines
html_extra_path = ["_extra"]  # index.html at the site's root: a redirect to docs/index.html


def _one_field_list(app, domain, objtype, contentnode):
    """Merge an entry's field lists into its first one, before autodoc adds the type hints.

    napoleon turns each docstring section (Args, Returns, Raises) into fields; prose between
    two sections splits them into separate field lists, and autodoc_typehints = "description"
    (target "all") adds every parameter, with its type, to each list: "Parameters" twice.
    """
    lists = [n for n in contentnode.children if isinstance(n, nodes.field_list)]
    for extra in lists[1:]:
        lists[0].extend(extra.children)
        contentnode.remove(extra)


def _no_builtin_doc(app, what, name, obj, options, lines):
    """A constant without a ``#:`` comment where it is documented (ALGORITHMS: imported) gets
    its type's docstring ("Built-in immutable sequence..."): drop that."""
    if what == "data" and type(obj).__module__ == "builtins" and obj.__doc__ == type(obj).__doc__:
        lines.clear()


def setup(app):
    app.connect("autodoc-process-docstring", _no_builtin_doc)
    # autodoc's merge_typehints runs at the default priority, 500
    app.connect("object-description-transform", _one_field_list, priority=400)
